"""Explanations (models/explain.py): Integrated Gradients sum to score - baseline score, the groups
sum back to the inputs' attributions, and the reasons' numbers are the entity's own."""

import numpy as np
import pytest
import torch

from habitus.models.explain import Explainer, chosen, column_totals, explain_cutoff, input_groups, rendered, value_stats
from habitus.models.explain.integrated import integrated_gradients
from habitus.models.data.features import FeatureSpec, bucketize, chunk_at
from habitus.models.nn.network import NetConfig
from habitus.models.data.targets import TargetSpec, eligible
from habitus.models.data.labels import item_popularity, task_inputs, top_values
from habitus.models.tasks.scoring import build_model
from habitus.models.tasks.spec import TaskSpec

pytestmark = pytest.mark.usefixtures("one_thread")

# Completeness tolerance at 64 Gauss-Legendre steps: |score - baseline - sum of attributions| per
# entity, in the score's own units (probabilities, amounts, raw item scores), at most 1% of
# |score - baseline| plus 1e-4 (float32 rounding). Measured on these random networks (weights
# N(0, 0.2), sharper than trained ones), the largest relative gap at 16 / 32 / 64 steps: binary
# 0.064 / 1.1e-4 / 6.3e-5, regression 0.061 / 2.5e-4 / 6.4e-5, multilabel 0.010 / 2.4e-3 / 3.1e-3,
# recommendation 0.040 / 4.5e-5 / 1.3e-5.
TOLERANCE = 0.01
STEPS = 64


def _purchases(rng, i):
    k = int(rng.integers(1, 40))
    return np.sort(rng.uniform(0, 150, k)), [f"p{j}" for j in rng.integers(0, 12, k)], np.round(rng.gamma(2.0, 5.0, k), 2)


@pytest.fixture(scope="module")
def world(module_sources):
    s = module_sources
    events = s.customer_events(80, _purchases, seed=7, ids="c{:03d}")
    customers = s.write("customers", customer_id=[f"c{i:03d}" for i in range(80)],
                        segment=[["budget", "family", "premium"][i % 3] for i in range(80)],
                        age=[float(20 + i % 50) if i % 7 else None for i in range(80)])
    from habitus.models.cache import TableInput

    cache = s.build(events, [TableInput("customers", [customers], {"segment": "categorical", "age": "numeric"})])
    return cache, s.at(150)


def _model(cache, cutoff, task: TaskSpec, buckets: int = 256, ple_bins: int = 4, seed: int = 0, sequence: int = 0):
    """A random network with every weight drawn (heads that start at zero included), its input
    scale fitted on the world's features: completeness must hold for any weights. `sequence`: the
    trunk also reads the last events through the sequence encoder."""
    spec = FeatureSpec.from_cache(cache, buckets=buckets, sequence=sequence)
    torch.manual_seed(seed)
    net = NetConfig(spec.width, 16, 1, 0.0, spec.scalar_width if ple_bins else 0, ple_bins,
                    spec.entity_scalar_width if ple_bins else 0, sequence, spec.token_vocab, len(spec.numeric), 8)
    model = build_model(net, task, spec)
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), cutoff - 30 * 86_400)
    x, _ = task_inputs(chunk, spec, task, cache.entity_table(), _vocab_sizes(cache))
    model.trunk.fit_input_scale(torch.from_numpy(x), 1.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2 if "norm" not in name else 1.0)
    return model.eval(), spec


def _vocab_sizes(cache):
    return {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}


def _tasks(cache, cutoff):
    items = tuple(range(1, cache.columns["product_id"]["vocab_size"] + 1))
    return {
        "binary": TaskSpec("binary", TargetSpec("no_event", 28, active_days=90)),
        "regression": TaskSpec("regression", TargetSpec("sum", 28, "price")),
        "multilabel": TaskSpec("multilabel", TargetSpec("any_event", 28, "product_id",
                                                        top_values(cache, "product_id", cutoff, 6))),
        "recommendation": TaskSpec("recommendation", TargetSpec("items", 14, "product_id", items), k=3),
        "multiclass": TaskSpec("multiclass", TargetSpec("any_event", 14, "product_id",
                                                        top_values(cache, "product_id", cutoff, 5))),
    }


def _explain(cache, cutoff, kind, buckets=256, ple_bins=4, steps=STEPS, labels=(0, 1), max_steps=None, sequence=0):
    task = _tasks(cache, cutoff)[kind]
    model, spec = _model(cache, cutoff, task, buckets, ple_bins, sequence=sequence)
    vocab = lambda c: cache.vocab(c).column("value").to_pylist()  # noqa: E731
    groups = input_groups(spec, vocab, model.trunk, {"product_id": "purchases", "segment": "customers",
                                                       "age": "customers", "__events__": "purchases"})
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), cutoff)
    x, h = task_inputs(chunk, spec, task, cache.entity_table(), _vocab_sizes(cache))
    rows = np.flatnonzero(eligible(chunk, task.target))
    pop = item_popularity(cache, task.target, cutoff) if kind == "recommendation" else None
    target = None
    if task.uses_label_history:  # every entity: two labels (or items)
        rows, target = np.repeat(rows, len(labels)), np.tile(labels, len(rows))
    explainer = Explainer(model, spec, task, groups, steps=steps, max_steps=max_steps or steps, item_features=pop)
    return explainer, explainer.explain(x, h, rows, target), (spec, groups, x, h, chunk, task, vocab)


@pytest.mark.parametrize("kind", ["binary", "regression", "multilabel", "recommendation", "multiclass"])
def test_attributions_sum_to_score_minus_baseline(world, kind):
    cache, cutoff = world
    _, ex, _ = _explain(cache, cutoff, kind)
    moved = np.abs(ex.score - ex.baseline)
    assert len(ex.rows) > 50 and moved.mean() > 1e-3  # the scores do move away from the baseline
    assert np.all(np.abs(ex.gap) <= TOLERANCE * moved + 1e-4), np.abs(ex.gap).max()
    # one baseline for everyone (no history, average attributes), per label for label heads
    for t in np.unique(ex.target):
        assert np.ptp(ex.baseline[ex.target == t]) < 1e-5


@pytest.mark.parametrize("kind", ["binary", "multilabel"])
def test_the_last_events_are_one_reason_and_the_sum_still_holds(world, kind):
    """With the sequence encoder, the tokens are in place from the path's start: what they add to the
    empty history is the `sequence` group's, and the attributions still sum to score - baseline."""
    cache, cutoff = world
    _, ex, (spec, groups, *_) = _explain(cache, cutoff, kind, sequence=6)
    moved = np.abs(ex.score - ex.baseline)
    assert np.all(np.abs(ex.gap) <= TOLERANCE * moved + 1e-4), np.abs(ex.gap).max()
    g = groups.kind.index("sequence")
    assert (groups.of_input == g).sum() == spec.input_width - spec.width == 6 * spec.event_width
    assert np.abs(ex.dense[:, g]).mean() > 1e-3  # the last events do count
    for t in np.unique(ex.target):  # one baseline for everyone: no events at all
        assert np.ptp(ex.baseline[ex.target == t]) < 1e-5


def test_the_steps_of_the_piecewise_inputs_are_integrated(world):
    """With the piecewise-linear bins (steps where quantile edges coincide) integrated through the
    trunk's `ple` layer, few steps already hold completeness; integrating them as functions of the raw
    inputs would miss every step (the gap a plain IG over x leaves is far larger)."""
    from captum.attr import IntegratedGradients

    cache, cutoff = world
    explainer, ex, (spec, groups, x, h, chunk, task, vocab) = _explain(cache, cutoff, "binary", steps=16)
    xb = torch.from_numpy(x[ex.rows])
    base = torch.from_numpy(groups.baseline).expand_as(xb)
    f = lambda z: torch.sigmoid(explainer.model(z))  # noqa: E731
    plain = IntegratedGradients(f).attribute(xb, baselines=base, n_steps=16).sum(1).detach().numpy()
    plain_gap = np.abs(ex.score - ex.baseline - plain).mean()
    assert np.abs(ex.gap).mean() < plain_gap / 10, (np.abs(ex.gap).mean(), plain_gap)


def test_groups_sum_back_to_the_inputs_attributions(world):
    """Without piecewise inputs, Captum's own attributions of x, summed over each group's inputs, are
    the groups' attributions; and every input is in exactly one group."""
    from captum.attr import IntegratedGradients

    cache, cutoff = world
    explainer, ex, (spec, groups, x, h, chunk, task, vocab) = _explain(cache, cutoff, "binary", ple_bins=0)
    assert len(groups.of_input) == spec.width and set(groups.of_input) == set(range(len(groups)))
    xb = torch.from_numpy(x[ex.rows])
    base = torch.from_numpy(groups.baseline).expand_as(xb)
    raw = IntegratedGradients(lambda z: torch.sigmoid(explainer.model(z))).attribute(
        xb, baselines=base, n_steps=STEPS, method="gausslegendre").detach().numpy()
    by_group = np.zeros_like(ex.dense)
    np.add.at(by_group.T, groups.of_input, raw.T)
    np.testing.assert_allclose(ex.dense, by_group, atol=1e-6)
    keys, per_column = column_totals(groups, ex)
    np.testing.assert_allclose(per_column.sum(1), ex.total, atol=1e-5)
    assert ("customers", "segment") in keys and ("purchases", "recency") in keys


def test_rare_items_are_reasons_of_their_own_and_still_sum_up(world):
    """With 8 buckets for 12 products, the rarer products share buckets: their own history (the
    item head's skip) becomes a reason of its own (`extra`), counted in the total and the column."""
    cache, cutoff = world
    _, ex, (spec, groups, x, h, chunk, task, vocab) = _explain(cache, cutoff, "recommendation", buckets=8,
                                                           labels=(0, 10, 11))
    assert len(ex.extra[0]) > 0 and set(ex.extra[1]) <= {10, 11}  # products 11 and 12: the rarest
    moved = np.abs(ex.score - ex.baseline)
    assert np.all(np.abs(ex.gap) <= TOLERANCE * moved + 1e-4)
    keys, per_column = column_totals(groups, ex, label_column="product_id")
    np.testing.assert_allclose(per_column.sum(1), ex.total, atol=1e-4)


def test_reasons_are_the_largest_and_sum_with_the_rest(world):
    cache, cutoff = world
    _, ex, (spec, groups, x, h, chunk, task, vocab) = _explain(cache, cutoff, "multilabel")
    names = [str(v) for v in task.target.labels]
    out = rendered(spec, groups, ex, x, chunk, cache.entity_table(), vocab, task, names, top=3)
    for p in np.unique(out["pair"]):
        mine = out["pair"] == p
        c = out["contribution"][mine]
        assert list(out["rank"][mine]) == list(range(1, mine.sum() + 1)) and mine.sum() <= 3
        assert np.all(np.diff(np.abs(c)) <= 1e-7)
        np.testing.assert_allclose(c.sum() + out["others"][mine][0], ex.total[p], atol=1e-5)
        # nothing left out is larger than the smallest reason kept
        assert np.abs(ex.dense[p]).max() <= np.abs(c).max() + 1e-7
    assert {"value", "recency", "frequency", "money", "attribute"} >= set(out["kind"])
    seg = out["kind"] == "attribute"
    if seg.any():  # an attribute reason names the entity's own value
        assert set(out["value"][seg & (out["column"] == "segment")]) <= {"budget", "family", "premium"}


def test_value_counts_and_recency_are_the_entitys_own(world, frame):
    cache, cutoff = world
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), cutoff)
    ids = chunk.shard.columns["product_id"][chunk.rows]
    rows = np.repeat(np.arange(chunk.n), 3)
    keys = np.tile([1, 2, 3], chunk.n)
    count, last = value_stats(chunk, ids.astype(np.int64), rows, keys)
    for r, k, c, d in zip(rows, keys, count, last):
        mine = (chunk.local == r) & (ids == k)
        assert c == mine.sum()
        if c:
            assert d == pytest.approx(chunk.age_days[mine].min())
        else:
            assert np.isnan(d)
    b = bucketize(ids, 12, 8)  # buckets work the same way
    count_b, _ = value_stats(chunk, b, rows, keys)
    assert np.all(count_b == count)  # ids 1-3 keep a bucket each


def test_masking_every_group_gives_the_baseline(world):
    cache, cutoff = world
    explainer, ex, (spec, groups, x, h, chunk, task, vocab) = _explain(cache, cutoff, "multilabel")
    m = len(ex.rows)
    xm, hm = explainer.masked(x, h, ex.rows, np.ones((m, len(groups)), bool))
    assert len(hm.cols) == 0  # every label of this head has a value group: all history is gone
    np.testing.assert_allclose(explainer.score(xm, hm, np.arange(m), ex.target), ex.baseline, atol=1e-6)
    xm, hm = explainer.masked(x, h, ex.rows, np.zeros((m, len(groups)), bool))
    np.testing.assert_allclose(explainer.score(xm, hm, np.arange(m), ex.target), ex.score, atol=1e-6)


def test_integrated_gradients_are_captums(world):
    """habitus.models.explain's own quadrature is Captum's Gauss-Legendre Integrated Gradients, several inputs
    at once (x and the trunk's piecewise encoding) and at few steps."""
    from captum.attr import IntegratedGradients

    cache, cutoff = world
    explainer, ex, (spec, groups, x, h, chunk, task, vocab) = _explain(cache, cutoff, "binary", steps=4)
    xb = torch.from_numpy(x[ex.rows[:40]])
    base = torch.from_numpy(groups.baseline).expand_as(xb).contiguous()
    extra = torch.randn(len(xb), 3)
    f = lambda z, e: torch.sigmoid(explainer.model(z)) * (1 + torch.tanh(e).sum(1))  # noqa: E731
    for steps in (3, 8):
        ours = integrated_gradients(f, [xb, extra], [base, torch.zeros_like(extra)], steps)
        theirs = IntegratedGradients(f).attribute((xb, extra), baselines=(base, torch.zeros_like(extra)),
                                                  n_steps=steps, method="gausslegendre")
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), atol=1e-6)


def test_pairs_over_the_tolerance_are_integrated_again(world):
    """At 4 steps these sharp random networks leave gaps of several percent; the second passes (8, 16,
    ... up to max_steps) bring every pair within the tolerance, and only the pairs that needed it."""
    cache, cutoff = world
    _, once, _ = _explain(cache, cutoff, "binary", steps=4, max_steps=4)
    _, refined, _ = _explain(cache, cutoff, "binary", steps=4, max_steps=64)
    moved = np.abs(once.score - once.baseline)
    over = np.abs(once.gap) > TOLERANCE * moved + 1e-4 * (1 + np.abs(once.baseline))
    assert 0 < over.sum() < len(over) and set(once.steps) == {4}
    assert np.all(refined.steps[~over] == 4) and np.all(refined.steps[over] > 4)
    np.testing.assert_allclose(refined.dense[~over], once.dense[~over])
    assert np.all(np.abs(refined.gap) <= TOLERANCE * moved + 1e-4 * (1 + np.abs(refined.baseline)))


def test_chosen_picks_the_top_share_a_sample_or_all():
    score = np.array([0.5, 0.9, 0.1, 0.7, 0.3, 0.8, 0.2, 0.6, 0.4, 0.0, 0.95])
    assert list(chosen(score, "top", 0.2)) == [1, 5, 10]  # ceil(0.2 * 11) = 3: 0.95, 0.9, 0.8, in row order
    assert list(chosen(score, "top", 0.01)) == [10]  # at least one
    assert list(chosen(score, "all", 0.2)) == list(range(11)) == list(chosen(score, "top", 1.0))
    a, b = chosen(score, "sample", 0.5, np.random.default_rng(3)), chosen(score, "sample", 0.5, np.random.default_rng(3))
    assert len(a) == 6 and len(set(a)) == 6 and list(a) == list(b) == sorted(a)
    with pytest.raises(ValueError):
        chosen(score, "best", 0.2)


@pytest.mark.parametrize("kind", ["binary", "multiclass"])
def test_explain_cutoff_explains_the_top_scored_share(world, kind):
    """select: top explains the highest-scored share of the entities; a multiclass scenario explains the
    predicted class (its highest probability) of each."""
    cache, cutoff = world
    task = _tasks(cache, cutoff)[kind]
    model, spec = _model(cache, cutoff, task)
    vocab = lambda c: cache.vocab(c).column("value").to_pylist()  # noqa: E731
    groups = input_groups(spec, vocab, model.trunk, {"product_id": "purchases", "__events__": "purchases"})
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), cutoff)
    x, h = task_inputs(chunk, spec, task, cache.entity_table(), _vocab_sizes(cache))
    keep = np.flatnonzero(eligible(chunk, task.target))
    explainer = Explainer(model, spec, task, groups, steps=16)
    if kind == "multiclass":  # every class's probability; the best one is the prediction
        classes = len(task.target.labels)
        p = explainer.score(x, h, np.repeat(keep, classes), np.tile(np.arange(classes), len(keep))).reshape(-1, classes)
        best, top = p.argmax(1), p.max(1)
    else:
        top = explainer.score(x, h, keep, None)
    want = set(chunk.entities[keep[np.argsort(-top)[:int(np.ceil(0.25 * len(keep)))]]])
    names = [str(v) for v in task.target.labels] if task.target.labels else None
    batches = list(explain_cutoff(model, cache, spec, task, cutoff, groups, select="top", share=0.25, steps=16,
                                  label_names=names))
    got = np.concatenate([b.column("entity_index").to_numpy() for b in batches])
    assert set(got) == want
    if kind == "multiclass":
        label = np.concatenate([b.column("label").to_numpy(zero_copy_only=False) for b in batches])
        predicted = dict(zip(chunk.entities[keep], np.asarray(names)[best]))
        assert all(label[got == e][0] == predicted[e] and len(set(label[got == e])) == 1 for e in want)
        score = np.concatenate([b.column("score").to_numpy() for b in batches])
        assert np.all(score[np.isin(got, list(want))] > 1.0 / classes)  # the winning class beats a uniform share
