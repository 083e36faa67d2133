"""Multilabel scenarios keep label histories and targets as sparse rows (habitus.models.data.items.SparseRows)
and densify a mini-batch at a time: checked against the dense [n, labels, channels] computation
they replace (same outputs, losses and training), and that a wide label set never builds a
dense per-chunk array."""

import math
from dataclasses import asdict
import tracemalloc

import numpy as np
import pyarrow as pa
import pytest
import torch

import habitus.models.train.finetune as finetuning
import habitus.models.data.labels as label_inputs
import habitus.models.data.targets as target_defs
import habitus.models.tasks.multilabel as multilabel
from habitus.models.train import spill
from habitus.models.evaluate.holdout import evaluate, protocol
from habitus.models.data.features import DAY, HALF_LIVES, FeatureSpec, chunk_at, featurize, value_history
from habitus.models.data.items import SparseRows, batch_history
from habitus.models.tasks.metrics import top_k
from habitus.models.nn.network import Head, Model, NetConfig
from habitus.models.serve.predict import predict
from habitus.models.tasks.multilabel import top_labels
from habitus.models.data.targets import TargetSpec, compute_target, label_positions
from habitus.models.train.finetune import batch_loss, finetune
from habitus.models.data.labels import label_history
from habitus.models.train.loop import batches
from habitus.models.tasks.scoring import build_model, scores
from habitus.models.train.config import FinetuneConfig
from habitus.models.tasks.spec import TaskSpec

N_CUSTOMERS, HORIZON = 240, 14  # (tests/models/conftest.py: segment_foundation)
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64, seed=0)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(segment_labels):
    """Customers of three segments, each buying mostly its own products of 12."""
    return segment_labels("multilabel")


def _dense_history(chunk, target, vocab_size, half_lives) -> np.ndarray:
    """The dense [n, labels, channels] label history multilabel used before (value_history + log1p)."""
    pos = label_positions(target.labels, chunk.shard.columns[target.column][chunk.rows])
    keep = pos >= 0
    hist = value_history(chunk, np.where(keep, pos, 0), len(target.labels), half_lives, keep)
    hist[:, :, :-1] = np.log1p(hist[:, :, :-1])
    return hist


def _chunk(cache, cutoff):
    shard = cache.shard(0)
    return chunk_at(shard, 0, len(shard.entities), cutoff)


def _dense_target(*args, **kwargs):
    y = compute_target(*args, **kwargs)
    return y.dense() if isinstance(y, SparseRows) else y


def _stack(hist: SparseRows, channels: int) -> np.ndarray:
    return np.stack([hist.dense(c) for c in range(channels)], axis=2)


def test_sparse_label_history_and_targets_equal_the_dense_ones(world):
    cache, test_cutoff, foundation, task = world
    chunk = _chunk(cache, test_cutoff)
    vocab = cache.columns["product_id"]["vocab_size"]
    hist = label_history(chunk, task.target, vocab, HALF_LIVES)
    assert isinstance(hist, SparseRows) and hist.shape == (chunk.n, vocab) and hist.values.shape[1] == 3
    np.testing.assert_allclose(_stack(hist, 3), _dense_history(chunk, task.target, vocab, HALF_LIVES),
                               rtol=1e-6, atol=1e-7)
    y = compute_target(chunk, task.target, vocab)
    assert isinstance(y, SparseRows) and y.shape == (chunk.n, vocab)
    assert set(np.unique(y.dense())) <= {0.0, 1.0} and y.dense().sum() == len(y.cols) > 0


def test_head_gives_the_same_outputs_from_sparse_and_dense_histories():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    n, labels, channels = 9, 23, 3
    rows, cols = np.nonzero(rng.random((n, labels)) < 0.2)
    hist = SparseRows.from_pairs(rows, cols, rng.random((len(rows), channels)), n, labels)
    head = Head(8, labels, channels)
    h = torch.randn(n, 8)
    dense = torch.from_numpy(_stack(hist, channels))
    torch.testing.assert_close(head(h, batch_history(hist, "cpu")), head(h, dense), rtol=1e-6, atol=1e-6)
    # the fine-tuning start ("what they bought, habitually"): exactly the same numbers
    with torch.no_grad():
        head.skip.weight.zero_()
        head.skip.weight[0, 1] = 5.0
    assert torch.equal(head(h, batch_history(hist, "cpu")), head(h, dense))
    # and the same gradients
    y = torch.from_numpy((rng.random((n, labels)) < 0.3).astype(np.float32))
    grads = []
    for history in (batch_history(hist, "cpu"), dense):
        head.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(head(h, history), y).backward()
        grads.append([p.grad.clone() for p in head.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # a batch without any history entry: the skip still takes part (a zero gradient, as dense zeros)
    empty = hist[np.array([], np.int64)]
    head.zero_grad()
    head(h[:0], batch_history(empty, "cpu")).sum().backward()
    assert head.skip.weight.grad is not None and not head.skip.weight.grad.any()


def baseline_scores(hist, popularity: np.ndarray, channel: int) -> dict[str, np.ndarray]:
    """The multilabel baselines' [n, labels] scores, dense: what the entity bought, habitually (the label
    history's `channel`), and what sells now (the same for everyone)."""
    past = hist.dense(channel) if isinstance(hist, SparseRows) else hist[:, :, channel]
    return {"past frequency": past, "popularity": np.broadcast_to(popularity, past.shape)}


def test_batch_loss_and_scores_match_the_dense_path(world):
    cache, test_cutoff, foundation, task = world
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    model = build_model(NetConfig.from_dict(foundation.info["net"]), task, spec)
    with torch.no_grad():
        model.head.skip.weight.normal_()
        model.head.linear.weight.normal_(std=0.1)
    model.eval()
    chunk = _chunk(cache, test_cutoff - HORIZON * DAY)
    vocab_sizes = {"product_id": cache.columns["product_id"]["vocab_size"]}
    x, h = label_inputs.task_inputs(chunk, spec, task, cache.entity_table(), vocab_sizes)
    y = compute_target(chunk, task.target, vocab_sizes["product_id"])
    dense = (x, _stack(h, spec.channels), y.dense())
    rng = np.random.default_rng(0)
    b = rng.permutation(len(x))[:20]
    sparse_loss = batch_loss(model, task, (x, h, y), b, "cpu", rng)
    dense_loss = batch_loss(model, task, dense, b, "cpu", rng)
    assert sparse_loss.item() == pytest.approx(dense_loss.item(), rel=1e-6)
    np.testing.assert_allclose(scores(model, "multilabel", x, h, batch=7),
                               scores(model, "multilabel", x, dense[1]), rtol=1e-5, atol=1e-7)
    # inference's top labels, a block of rows at a time: the top_k of the whole chunk's scores (up to
    # float noise: the matrix products of 5 rows and of a whole chunk may round differently)
    full = scores(model, "multilabel", x, h)
    best, best_scores = top_labels(model, x, h, 3, block=5)
    assert best.shape == (len(x), 3) and (np.diff(best_scores, axis=1) <= 0).all()
    np.testing.assert_allclose(best_scores, np.take_along_axis(full, best, 1), rtol=1e-6)
    np.testing.assert_allclose(best_scores, np.take_along_axis(full, top_k(full, 3), 1), rtol=1e-6)
    # the evaluation's baselines read the same habitual channel
    dense_b = baseline_scores(dense[1], np.ones(vocab_sizes["product_id"]), spec.habitual_channel)
    sparse_b = baseline_scores(h, np.ones(vocab_sizes["product_id"]), spec.habitual_channel)
    for k in dense_b:
        np.testing.assert_allclose(sparse_b[k], dense_b[k], rtol=1e-6)


def test_finetune_on_sparse_rows_trains_as_the_dense_arrays_did(world, monkeypatch):
    """The whole fine-tuning (base-rate start, habitual skip, epochs, soup) on sparse rows against the
    same run fed the dense [n, labels, channels] histories and [n, labels] targets."""
    cache, test_cutoff, foundation, task = world
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    state = foundation.model.state_dict()

    def run():
        return finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff, FINETUNE,
                        device="cpu", log=lambda _: None)

    sparse = run()
    with monkeypatch.context() as m:
        m.setattr(label_inputs, "label_history", _dense_history)
        m.setattr(target_defs, "compute_target", _dense_target)
        dense = run()
    for key in ("train_loss", "val_loss"):
        np.testing.assert_allclose(sparse.curves[key], dense.curves[key], rtol=1e-5)
    assert sparse.info["soup_epochs"] == dense.info["soup_epochs"]
    assert sparse.info["val_target_mean"] == pytest.approx(dense.info["val_target_mean"], rel=1e-12)
    for k, v in dense.model.state_dict().items():
        torch.testing.assert_close(sparse.model.state_dict()[k], v, rtol=1e-4, atol=1e-5, msg=k)
    # the hold-out report and the predictions go through the sparse rows too
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    report = evaluate(sparse.model, cache, spec, task, plan.test_cutoff, chunk_entities=64)
    with monkeypatch.context() as m:
        import habitus.models.evaluate.holdout as ev
        m.setattr(ev, "task_inputs", lambda chunk, spec, task, et, vs: (
            featurize(chunk, spec, et), _dense_history(chunk, task.target, vs[task.target.column],
                                                             spec.half_lives)))
        m.setattr(target_defs, "compute_target", _dense_target)
        dense_report = evaluate(sparse.model, cache, spec, task, plan.test_cutoff, chunk_entities=64)
    assert report["entities"] == dense_report["entities"] > 0
    assert report["model"]["macro_auroc"] == pytest.approx(dense_report["model"]["macro_auroc"], abs=1e-6)
    for name, metrics in dense_report["baselines"].items():
        assert report["baselines"][name]["macro_auroc"] == pytest.approx(metrics["macro_auroc"], abs=1e-6)
    table = pa.Table.from_batches(list(predict(sparse.model, cache, spec, task, test_cutoff, k=3,
                                               label_names=[f"l{i}" for i in task.target.labels], chunk_entities=64)))
    assert table.column_names == ["entity_index", "labels", "scores"]
    assert all(len(v) == 3 and s[0] >= s[1] >= s[2] for v, s in zip(table.column("labels").to_pylist(),
                                                                     table.column("scores").to_pylist()))


def test_a_wide_label_set_never_builds_a_dense_chunk_array(world):
    """200,000 labels (most never bought): the history and targets of a chunk, and a fine-tuning
    epoch, stay far below one dense [chunk, labels, channels] array (~60 x 200,000 x 3 float32 =
    ~140 MB; NumPy allocations are what tracemalloc sees)."""
    cache, test_cutoff, foundation, _ = world
    vocab = cache.columns["product_id"]["vocab_size"]
    wide = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "product_id", tuple(range(1, 200_001))))
    chunk = _chunk(cache, test_cutoff - HORIZON * DAY)
    dense_bytes = chunk.n * 200_000 * 3 * 4
    tracemalloc.start()
    try:
        hist = label_history(chunk, wide.target, vocab, HALF_LIVES)
        y = compute_target(chunk, wide.target, vocab)
        assert hist.shape == y.shape == (chunk.n, 200_000)
        # what remains grows with the labels, not with rows x labels: the id -> label position index
        assert tracemalloc.get_traced_memory()[1] < dense_bytes / 20
        tracemalloc.reset_peak()
        plan = protocol(test_cutoff, HORIZON, 1, cache.time_range[0])
        result = finetune(cache, foundation.model.state_dict(), foundation.info, wide, list(plan.train_cutoffs),
                          plan.val_cutoff, FinetuneConfig(epochs=1, batch_size=32, chunk_entities=64, soup=False),
                          device="cpu", log=lambda _: None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.isfinite(result.curves["val_loss"]).all()
    assert peak < dense_bytes / 10, f"{peak / 2**20:.0f} MB of NumPy arrays"


# --------------------------------------------------------------------------- sampled negatives (wide heads)


def test_a_narrow_head_keeps_the_full_loss_bit_for_bit(world):
    """Heads up to FinetuneConfig.sampled_above_labels labels (Ta-Feng's 50 brands, this world's 12
    products) train on the full loss: batch_loss draws nothing and gives multilabel_loss's value, and a
    whole fine-tuning is bit-identical to one with sampling switched off."""
    cache, test_cutoff, foundation, task = world
    assert task.outputs <= FinetuneConfig().sampled_above_labels
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    model = build_model(NetConfig.from_dict(foundation.info["net"]), task, spec)
    with torch.no_grad():
        model.head.skip.weight.normal_()
        model.head.linear.weight.normal_(std=0.1)
    model.eval()  # (dropout)
    chunk = _chunk(cache, test_cutoff - HORIZON * DAY)
    vocab_sizes = {"product_id": cache.columns["product_id"]["vocab_size"]}
    x, h = label_inputs.task_inputs(chunk, spec, task, cache.entity_table(), vocab_sizes)
    y = compute_target(chunk, task.target, vocab_sizes["product_id"])
    b = np.random.default_rng(1).permutation(len(x))[:20]
    rng = np.random.default_rng(0)
    loss = batch_loss(model, task, (x, h, y), b, "cpu", rng)
    assert torch.equal(loss, multilabel.multilabel_loss(model(torch.from_numpy(x[b]), label_inputs.history_rows(h, b, "cpu")),
                                                   y[b], "cpu"))
    assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state  # nothing drawn
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    state = foundation.model.state_dict()
    runs = [finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff,
                     FinetuneConfig(**{**asdict(FINETUNE), "sampled_negatives": n}), device="cpu",
                     log=lambda _: None) for n in (FINETUNE.sampled_negatives, 0)]
    assert "sampled_negatives" not in runs[0].info
    assert runs[0].curves == runs[1].curves
    for k, v in runs[1].model.state_dict().items():
        assert torch.equal(runs[0].model.state_dict()[k], v), k


def _wide_problem(n: int, labels: int, seed: int = 0):
    """Rows of 20 clusters (features: the cluster's one-hot plus noise); each label belongs to one
    cluster and is bought by 3% of its rows (half of those bought it before: the history), plus a
    few strays. Sparse targets and histories."""
    rng = np.random.default_rng(seed)
    cluster = rng.integers(0, 20, n)
    owner = rng.integers(0, 20, labels)
    x = np.eye(20, dtype=np.float32)[cluster] + 0.3 * rng.standard_normal((n, 20)).astype(np.float32)
    rows, cols = [], []
    hist_rows, hist_cols = [], []
    for r in range(n):
        own = np.flatnonzero(owner == cluster[r])
        bought = own[rng.random(len(own)) < 0.03]
        stray = rng.integers(0, labels, rng.poisson(labels * 0.0002))
        pos = np.unique(np.r_[bought, stray])
        rows += [r] * len(pos)
        cols += list(pos)
        past = np.unique(np.r_[bought[rng.random(len(bought)) < 0.5], own[rng.random(len(own)) < 0.01]])
        hist_rows += [r] * len(past)
        hist_cols += list(past)
    rows, cols = np.asarray(rows, np.int64), np.asarray(cols, np.int64)
    y = SparseRows.from_pairs(rows, cols, np.ones(len(rows)), n, labels)
    hr, hc = np.asarray(hist_rows, np.int64), np.asarray(hist_cols, np.int64)
    h = SparseRows.from_pairs(hr, hc, rng.random((len(hr), 3)), n, labels)
    return x, h, y


def test_sampled_head_logits_are_the_full_heads_columns():
    x, h, y = _wide_problem(40, 300)
    torch.manual_seed(0)
    model = Model(NetConfig(20, 16, 1, 0.0), 300, 3)
    with torch.no_grad():
        model.head.skip.weight.normal_()
        model.head.label_skip.normal_()
    model.eval()
    xb, hist = torch.from_numpy(x), batch_history(h, "cpu")
    full = model(xb, hist)
    cols = torch.from_numpy(np.sort(np.random.default_rng(0).choice(300, 50, replace=False)))
    out, z = model(xb, hist, labels=(cols, torch.from_numpy(y.rows), torch.from_numpy(y.cols)))
    torch.testing.assert_close(out, full[:, cols], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(z, full[torch.from_numpy(y.rows), torch.from_numpy(y.cols)], rtol=1e-5, atol=1e-6)
    # every label sampled: the full loss; fewer: an unbiased estimate of it
    rng = np.random.default_rng(0)
    exact = multilabel.multilabel_loss(full, y, "cpu")
    every = multilabel.sampled_multilabel_loss(model, xb, hist, y, 300, rng, "cpu")
    assert every.item() == pytest.approx(exact.item(), rel=1e-5)
    draws = [multilabel.sampled_multilabel_loss(model, xb, hist, y, 30, rng, "cpu").item() for _ in range(400)]
    assert np.mean(draws) == pytest.approx(exact.item(), rel=0.03)
    # a batch without any history entry: the skip still takes part (a zero gradient), as in forward
    empty = h[np.array([], np.int64)]
    model.zero_grad()
    out, z = model(xb[:0], batch_history(empty, "cpu"), labels=(cols, torch.zeros(0, dtype=torch.int64),
                                                                torch.zeros(0, dtype=torch.int64)))
    (out.sum() + z.sum()).backward()
    assert model.head.skip.weight.grad is not None and not model.head.skip.weight.grad.any()


def test_a_wide_head_trains_on_sampled_labels_without_rows_x_labels_logits():
    """20,000 labels, 256 rows a batch: no tensor of the training step (forward, loss or backward)
    comes near [rows, labels], and the sampled loss learns: the full loss falls, positives rank above
    negatives on rows it never saw, and the mean probability stays near the positive rate."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from habitus.models.tasks.metrics import auroc

    labels, batch, hidden = 20_000, 256, 16
    x, h, y = _wide_problem(batch * 12, labels)
    train_rows, test_rows = np.arange(batch * 8), np.arange(batch * 8, batch * 12)
    torch.manual_seed(0)
    model = Model(NetConfig(20, hidden, 1, 0.0), labels, 3)
    rate = len(y.cols) / (len(y) * labels)
    with torch.no_grad():
        model.head.linear.weight.zero_()
        model.head.linear.bias.fill_(float(np.log(rate / (1 - rate))))
    task = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "product_id", tuple(range(1, labels + 1))))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)

    def full_loss(rows):
        with torch.no_grad():
            return multilabel.multilabel_loss(model(torch.from_numpy(x[rows]), batch_history(h[rows], "cpu")),
                                         y[rows], "cpu").item()

    class Shapes(TorchDispatchMode):  # the shape of every tensor an operation makes
        seen: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Shapes.seen.add(tuple(t.shape))
            return out

    def ranking(rows):  # AUROC of positive over negative (row, label) pairs, a sample of them
        with torch.no_grad():
            p = torch.sigmoid(model(torch.from_numpy(x[rows]), batch_history(h[rows], "cpu"))).numpy()
        yt = y[rows].dense()
        sample = np.random.default_rng(1).choice(p.size, 200_000, replace=False)
        return auroc(yt.ravel()[sample], p.ravel()[sample]), p[yt == 1].mean() / p[yt == 0].mean(), p.mean()

    model.eval()
    before, auc_before = full_loss(test_rows), ranking(test_rows)[0]
    model.train()
    for epoch in range(6):
        for b in batches(len(train_rows), batch, rng):
            with Shapes():
                loss = batch_loss(model, task, (x, h, y), train_rows[b], "cpu", rng, negatives=512)
                opt.zero_grad()
                loss.backward()
            opt.step()
    model.eval()
    after, (auc, lift, mean_p) = full_loss(test_rows), ranking(test_rows)
    # nothing [rows, labels]: only the head's own parameters and their gradients span the labels; the
    # logits are [rows, columns], columns = the batch's positive labels + 512 drawn
    assert {s for s in Shapes.seen if labels in s} <= {(labels, hidden), (labels,), (labels, 3)}
    assert max(math.prod(s) for s in Shapes.seen) < batch * labels / 2
    # (the full loss, 6 epochs of it, reaches about the same on this problem: 0.0105, AUROC 0.854)
    assert after < 0.93 * before
    assert auc > max(0.8, auc_before + 0.05) and lift > 5
    assert 0.5 * rate < mean_p < 2.5 * rate  # the inverse-probability weights keep the base rate



def test_sampled_heads_train_in_bf16_where_the_hardware_has_it_and_land_where_fp32_does(world, monkeypatch):
    """This world's 12 products as a sampled head (above 6 labels): with bf16 matrix products (forced
    on, whatever this CPU has) fine-tuning reaches the validation losses of float32 closely, and the
    weights stay float32."""
    cache, test_cutoff, foundation, task = world
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    state = foundation.model.state_dict()
    monkeypatch.setattr(finetuning, "fast_bf16", lambda dev: True)
    runs = {}
    for bf16 in (True, False):
        cfg = FinetuneConfig(**{**asdict(FINETUNE), "sampled_above_labels": 6, "sampled_negatives": 3,
                                "val_sampled_negatives": 6, "sampled_bf16": bf16})
        runs[bf16] = finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                              device="cpu", log=lambda _: None)
        assert runs[bf16].info["sampled_negatives"] == 3
    assert runs[True].curves != runs[False].curves  # bf16 did run
    np.testing.assert_allclose(runs[True].curves["val_loss"], runs[False].curves["val_loss"], rtol=0.02)
    assert all(v.dtype == torch.float32 for v in runs[True].model.state_dict().values() if v.is_floating_point())


def test_spilled_features_read_back_equal(tmp_path):
    """spill.Kept's files (no pickle): arrays, sparse rows and Nones come back as they were."""
    x, h, y = _wide_problem(30, 50)
    path = str(tmp_path / "a.npz")
    spill.save_arrays(path, (x, h, y, None))
    x2, h2, y2, none = spill.load_arrays(path)
    assert none is None and np.array_equal(x2, x) and x2.dtype == x.dtype
    for a, b in ((h, h2), (y, y2)):
        assert isinstance(b, SparseRows) and b.n_cols == a.n_cols
        assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("indptr", "cols", "values"))


def test_sampled_heads_pick_epochs_on_a_spread_subset_of_validation(world):
    """A wide head's sampled validation loss (after every epoch, for every soup candidate) reads every
    k-th validation chunk, about val_sampled_rows rows; base rates still count every row, and a head
    trained on the full loss reads all of validation."""
    cache, test_cutoff, foundation, task = world
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    state = foundation.model.state_dict()
    infos = {}
    for above, rows in ((6, 40), (6, 1 << 20), (1000, 40)):
        cfg = FinetuneConfig(**{**asdict(FINETUNE), "sampled_above_labels": above, "sampled_negatives": 3,
                                "val_sampled_negatives": 6, "chunk_entities": 32, "val_sampled_rows": rows,
                                "epochs": 2})
        run = finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                       device="cpu", log=lambda _: None)
        assert np.isfinite(run.curves["val_loss"]).all()
        infos[(above, rows)] = run.info
    small = infos[(6, 40)]
    assert small["val_chunk_stride"] == -(-small["val_rows"] // 40) > 1
    assert infos[(6, 1 << 20)]["val_chunk_stride"] == 1
    assert infos[(1000, 40)]["val_chunk_stride"] == 1 and "sampled_negatives" not in infos[(1000, 40)]


def test_sparse_row_gradients_train_the_same_wide_head_as_dense_ones():
    """A wide head's sampled rows with sparse gradients, added into the weight's kept dense gradient
    (loop.step's `kept`, Head.sparse_rows), give the same AdamW steps, bit for bit, as the dense
    gradient made anew at every step; and no sparse gradient is ever left for the optimizer."""
    from habitus.models.train.loop import step
    x, h, y = _wide_problem(64, 300)
    runs = []
    for sparse in (False, True):
        torch.manual_seed(0)
        model = Model(NetConfig(20, 16, 1, 0.0), 300, 3)
        model.head.sparse_rows = sparse
        kept = (model.head.linear.weight,) if sparse else ()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        rng = np.random.default_rng(0)
        for b in batches(len(x), 16, np.random.default_rng(1)):
            loss = multilabel.sampled_multilabel_loss(model, torch.from_numpy(x[b]), batch_history(h[b], "cpu"),
                                                      y[b], 30, rng, "cpu")
            step(model, opt, loss, kept)
            assert not model.head.linear.weight.grad.is_sparse
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
    assert runs[0].keys() == runs[1].keys()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampled_loss_gives_autograds_value_and_gradient_bit_for_bit(dtype):
    """multilabel._ColumnLoss (the sampled loss over a batch's label columns, its backward written out)
    against autograd on the same expression, from float32 logits and from bfloat16 ones (autocast's)."""
    rng = np.random.default_rng(0)
    rows_n, cols_n = 64, 300
    key = np.unique(rng.integers(0, rows_n, 400) * cols_n + rng.integers(0, cols_n, 400))
    rows, cols = torch.from_numpy(key // cols_n), torch.from_numpy(key % cols_n)
    values = torch.from_numpy(rng.uniform(0.5, 1.0, len(key)).astype(np.float32))
    weight = torch.from_numpy(np.where(rng.random(cols_n) < 0.5, 1.0, 12.5).astype(np.float32))
    logits = torch.from_numpy(rng.normal(-4, 6, (rows_n, cols_n)).astype(np.float32)).to(dtype)  # some above 20
    n = rows_n * 5_000
    grads = []
    for fused in (False, True):
        out = logits.clone().requires_grad_()
        if fused:
            loss = multilabel._ColumnLoss.apply(out, weight, rows, cols, values, n)
        else:
            z = out.float()
            loss = ((torch.nn.functional.softplus(z).sum(0) * weight).sum() - (z[rows, cols] * values).sum()) / n
        loss.backward()
        grads.append((loss.detach(), out.grad))
    assert grads[1][1].dtype == dtype
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("scale", [1e-3, 10.0, float("inf")], ids=["within the bound", "beyond", "not finite"])
def test_clip_gives_clip_grad_norms_gradients_bit_for_bit(scale):
    """loop.clip skips clip_grad_norm_'s multiply by exactly 1 (a norm within the bound), and only that:
    beyond the bound, and with a gradient that is not finite, it scales as clip_grad_norm_ does."""
    from habitus.models.train.loop import clip
    torch.manual_seed(0)
    x = torch.randn(8, 50)
    models = [torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Linear(40, 3)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for m in models:
        (m(x).square().sum() * scale).backward()
    torch.nn.utils.clip_grad_norm_(models[0].parameters(), 1.0)
    clip(models[1], 1.0)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num()) and torch.equal(p.grad.isnan(), q.grad.isnan())
    norm = torch.nn.utils.get_total_norm([p.grad for p in models[1].parameters()])
    assert norm <= 1.0 + 1e-5 if math.isfinite(scale) else not torch.isfinite(norm)
