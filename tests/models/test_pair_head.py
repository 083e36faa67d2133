"""The shared pairwise label scorer (network.PairScorer): one function of (entity, label, the entity's
own history of that label) for every label, scored only at the touched pairs. Checked: it starts
where the linear head starts, its sampled and dense forms agree with the full one, labels a row never
touched are scored without it, it learns what a per-label linear skip cannot, and checkpoints name
the head they were trained with."""

import numpy as np
import pytest
import torch

from habitus.models.data.items import SparseRows, batch_history
from habitus.models.tasks.metrics import auroc
from habitus.models.nn.network import Model, NetConfig, PairScorer
from habitus.models.serve.predict import load_model
from habitus.models.data.targets import TargetSpec
from habitus.models.tasks.multilabel import multilabel_loss
from habitus.models.tasks.scoring import build_model
from habitus.models.tasks.spec import PAIR_MAX_LABELS, PAIR_WIDTH, TaskSpec

pytestmark = pytest.mark.usefixtures("one_thread")


def _problem(n: int, labels: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    rows = np.repeat(np.arange(n), 4)
    cols = np.concatenate([rng.choice(labels, 4, replace=False) for _ in range(n)])
    h = SparseRows.from_pairs(rows, cols, rng.random((len(rows), 3)), n, labels)
    return x, h


def _randomized(model: Model) -> Model:
    with torch.no_grad():
        for p in model.head.parameters():
            p.normal_(std=0.3)
    return model.eval()


def test_the_pairwise_head_starts_as_the_linear_head():
    x, h = _problem(30, 20)
    torch.manual_seed(0)
    linear = Model(NetConfig(6, 8, 1, 0.0), 20, 3)
    torch.manual_seed(0)
    paired = Model(NetConfig(6, 8, 1, 0.0), 20, 3, pair_width=16)
    paired.load_state_dict(linear.state_dict(), strict=False)  # the same trunk, linear part and skip
    linear.eval(), paired.eval()
    xb, hist = torch.from_numpy(x), batch_history(h, "cpu")
    assert isinstance(paired.head.pair, PairScorer) and linear.head.pair is None
    torch.testing.assert_close(paired(xb, hist), linear(xb, hist))


def test_sampled_and_dense_forms_agree_with_the_full_head():
    x, h = _problem(40, 50)
    torch.manual_seed(0)
    model = _randomized(Model(NetConfig(6, 8, 1, 0.0), 50, 3, pair_width=16))
    xb, hist = torch.from_numpy(x), batch_history(h, "cpu")
    full = model(xb, hist)
    # the dense [rows, labels, channels] history gives the same logits as its sparse rows
    dense = torch.zeros(40, 50, 3)
    dense[torch.from_numpy(h.rows), torch.from_numpy(h.cols)] = torch.from_numpy(h.values)
    torch.testing.assert_close(model(xb, dense), full, rtol=1e-5, atol=1e-5)
    # a few label columns (training's sampled loss, evaluation's label blocks) and the positives' logits
    cols = torch.from_numpy(np.sort(np.random.default_rng(1).choice(50, 12, replace=False)))
    out, _ = model(xb, hist, labels=(cols, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)))
    torch.testing.assert_close(out, full[:, cols], rtol=1e-5, atol=1e-5)
    er, ec = torch.from_numpy(h.rows[::3]), torch.from_numpy(h.cols[::3])
    out, z = model(xb, hist, labels=(cols, er, ec))
    torch.testing.assert_close(out, full[:, cols], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z, full[er, ec], rtol=1e-5, atol=1e-5)


def test_untouched_labels_are_scored_without_the_pairwise_term():
    x, h = _problem(20, 30)
    torch.manual_seed(0)
    model = _randomized(Model(NetConfig(6, 8, 1, 0.0), 30, 3, pair_width=16))
    xb = torch.from_numpy(x)
    full = model(xb, batch_history(h, "cpu"))
    untouched = torch.ones(20, 30, dtype=torch.bool)
    untouched[torch.from_numpy(h.rows), torch.from_numpy(h.cols)] = False
    plain = model.head.linear(model.trunk(xb))
    torch.testing.assert_close(full[untouched], plain[untouched])
    assert not torch.allclose(full[~untouched], plain[~untouched])


def test_it_learns_a_repeat_that_depends_on_the_entity():
    """Entities of one kind rebuy what they bought, the others switch to what they did not buy: the
    history of a label predicts it with opposite signs depending on the entity, for every label (an
    exclusive-or of the entity's kind and the label's history). The linear skip weighs history the
    same for every entity and cannot rank this; the pairwise scorer, which sees the entity, can."""
    n, labels = 1200, 8
    rng = np.random.default_rng(0)
    kind = rng.random(n) < 0.5
    x = np.c_[kind.astype(np.float32), rng.normal(size=(n, 3)).astype(np.float32)]
    touched = rng.random((n, labels)) < 0.5
    bought = touched == kind[:, None]  # rebuyers buy what they touched, switchers what they did not
    rows, cols = np.nonzero(touched)
    hist = SparseRows.from_pairs(rows, cols, rng.uniform(0.5, 1.0, (len(rows), 3)), n, labels)
    yr, yc = np.nonzero(bought)
    y = SparseRows.from_pairs(yr, yc, np.ones(len(yr)), n, labels)
    train, test = np.arange(900), np.arange(900, n)
    result = {}
    for width in (0, 32):
        torch.manual_seed(0)
        model = Model(NetConfig(4, 16, 1, 0.0), labels, 3, pair_width=width)
        with torch.no_grad():  # as fine-tuning starts it: zero outputs at the base rate
            model.head.linear.weight.zero_()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        batches = np.random.default_rng(1)
        for _ in range(300):
            b = batches.choice(train, 128, replace=False)
            loss = multilabel_loss(model(torch.from_numpy(x[b]), batch_history(hist[b], "cpu")), y[b], "cpu")
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            p = model(torch.from_numpy(x[test]), batch_history(hist[test], "cpu")).numpy()
        result[width] = auroc(bought[test].ravel().astype(np.float32), p.ravel())
    assert result[32] > 0.95
    assert result[0] < 0.8


def test_checkpoints_name_their_head():
    target = TargetSpec("any_event", 14, "brand", tuple(range(1, 11)))
    task = TaskSpec("multilabel", target)
    assert task.pair_width == PAIR_WIDTH > 0
    saved = task.to_dict()
    assert TaskSpec.from_dict(saved) == task
    old = {k: v for k, v in saved.items() if k not in ("pair_width", "pair_layers")}  # before the scorer
    assert TaskSpec.from_dict(old).pair_width == 0
    from habitus.models.data.features import FeatureSpec

    spec = FeatureSpec({"brand": 10}, [], {}, {}, [], buckets=16, visits=False)
    net = NetConfig(spec.width, 8, 1, 0.0)
    for t, has in ((task, True), (TaskSpec.from_dict(old), False)):
        model = build_model(net, t, spec)
        assert (model.head.pair is not None) == has
        config = {"feature_spec": spec.to_dict(), "task": t.to_dict(), "net": net.to_dict()}
        again, _, loaded = load_model(model.state_dict(), config)
        assert (again.head.pair is not None) == has and loaded == t
    # heads wider than PAIR_MAX_LABELS (sampled negatives) leave it out, and say so in what they save
    wide = TaskSpec("multilabel", TargetSpec("any_event", 14, "brand", tuple(range(1, PAIR_MAX_LABELS + 2))))
    assert wide.pair_width == 0 and TaskSpec.from_dict(wide.to_dict()).pair_width == 0
    assert TaskSpec("multilabel", wide.target, pair_width=16).pair_width == 16  # asked for: kept
    # binary and recommendation tasks never get one
    assert build_model(net, TaskSpec("binary", TargetSpec("no_event", 14)), spec).head.pair is None


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_inference_precisions_keep_the_pairwise_ranking(precision):
    from habitus.models.tasks.multilabel import top_labels
    from habitus.models.nn.quantize import for_inference

    x, h = _problem(64, 40)
    torch.manual_seed(0)
    model = _randomized(Model(NetConfig(6, 16, 1, 0.0), 40, 3, pair_width=16))
    fast = for_inference(model, precision)
    assert fast.head.pair is not None
    want, _ = top_labels(model, x, h, 5)
    got, probs = top_labels(fast, x, h, 5)
    assert probs.dtype == np.float32 and np.isfinite(probs).all()
    # the same best label for nearly every row (rounding may swap near ties)
    assert (got[:, 0] == want[:, 0]).mean() > 0.9
