"""The multilabel hold-out scores a block of labels at a time (habitus.models.tasks.metrics.blockwise_macro_auroc,
habitus.models.evaluate.holdout): checked against the dense [entities, labels] computation it replaced, by hand, on
random data and on a tiny cache; and LightGBM's label cap for wide heads (habitus.models.evaluate.baselines)."""

import math
import tracemalloc

import numpy as np
import pytest
import torch

import habitus.models.tasks.metrics as metrics
from habitus.models.evaluate.baselines import lightgbm_scores
from habitus.models.tasks.base import LabelScores
from habitus.models.evaluate.holdout import evaluate, protocol
from habitus.models.data.features import FeatureSpec, chunk_at
from habitus.models.data.items import SparseRows
from habitus.models.tasks.metrics import blockwise_macro_auroc, column_aurocs, macro_auroc
from habitus.models.nn.network import NetConfig
from habitus.models.data.targets import TargetSpec, compute_target, eligible
from habitus.models.data.labels import recent_popularity, task_inputs
from habitus.models.data.chunks import chunk_plan
from habitus.models.tasks.scoring import build_model, scores
from habitus.models.tasks.spec import TaskSpec
from habitus.models.tasks import task as task_of

pytestmark = pytest.mark.usefixtures("one_thread")

N_CUSTOMERS = 180
SPAN_DAYS = 112
HORIZON = 14


def _sparse(y: np.ndarray) -> SparseRows:
    rows, cols = np.nonzero(y)
    return SparseRows.from_pairs(rows, cols, np.ones(len(rows)), *y.shape)


def test_column_aurocs_by_hand_with_ties():
    # column 0 is test_metrics' hand case: positives {0.8, 0.6, 0.9}, negatives {0.8, 0.2} -> 4.5 / 6;
    # column 1 ranks its two positives on top (1.0), column 2 is all tied (0.5)
    score = np.array([[0.8, 5, 1], [0.8, 4, 1], [0.6, 3, 1], [0.2, 2, 1], [0.9, 1, 1]], np.float32)
    rows, cols = np.array([0, 2, 4, 0, 1, 3, 4]), np.array([0, 0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose(column_aurocs(score, rows, cols), [0.75, 1.0, 0.5])


def test_blockwise_macro_auroc_by_hand():
    """test_metrics' macro_auroc case, one label per block: labels 1 and 2 are measured (1.0 and 0.0)."""
    n = 8
    y = np.zeros((n, 4))
    y[7, 0] = 1
    y[5:, 1] = 1
    y[:3, 2] = 1
    y[1:, 3] = 1
    score = np.tile(np.arange(n, dtype=np.float32)[:, None], (1, 4))
    asked = []

    def scorer(cols):
        asked.append(list(cols))
        return score[:, cols]

    aucs, measured = blockwise_macro_auroc(_sparse(y), {"s": scorer}, min_positives=2, block_values=n)
    assert aucs["s"] == pytest.approx(0.5) and measured == 2 and asked == [[1], [2]]
    aucs, measured = blockwise_macro_auroc(_sparse(y), {"s": lambda c: score[:, c]}, min_positives=1)
    assert aucs["s"] == pytest.approx(0.75) and measured == 4
    aucs, measured = blockwise_macro_auroc(_sparse(y), {"s": lambda c: score[:, c]}, labels=np.array([2, 1]),
                                           min_positives=2)
    assert aucs["s"] == pytest.approx(0.5) and measured == 2
    assert math.isnan(blockwise_macro_auroc(_sparse(y), {"s": scorer}, min_positives=4)[0]["s"])


@pytest.mark.parametrize("block_values", [1, 7 * 60, None])
def test_blockwise_macro_auroc_equals_the_dense_one(block_values):
    """Random labels of every density (some unmeasured) and scores with many ties, any block size."""
    rng = np.random.default_rng(0)
    n, labels = 60, 40
    y = (rng.random((n, labels)) < rng.uniform(0, 0.5, labels)).astype(np.float32)
    score = np.round(rng.random((n, labels)) + 0.5 * y, 1).astype(np.float32)  # rounded: ties
    aucs, measured = blockwise_macro_auroc(_sparse(y), {"s": lambda c: score[:, c]}, block_values=block_values)
    assert 0 < measured < labels
    assert aucs["s"] == pytest.approx(macro_auroc(y, score), abs=1e-12)
    subset = np.array([3, 7, 11, 20, 39])
    aucs, _ = blockwise_macro_auroc(_sparse(y), {"s": lambda c: score[:, c]}, labels=subset, block_values=block_values)
    assert aucs["s"] == pytest.approx(macro_auroc(y[:, subset], score[:, subset]), abs=1e-12)


# --------------------------------------------------------------------------- evaluate() on a tiny cache


@pytest.fixture(scope="module")
def world(module_sources):
    """Customers of three segments, each buying mostly its own products of 12; an untrained scenario
    model with random head weights and a positive weight on each label's own history."""
    cache = module_sources.segment_purchases(N_CUSTOMERS, SPAN_DAYS, seed=1)
    test_cutoff = module_sources.at(SPAN_DAYS - HORIZON)
    vocab = cache.columns["product_id"]["vocab_size"]
    task = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "product_id", tuple(range(1, vocab + 1))))
    spec = FeatureSpec.from_cache(cache, 32)
    torch.manual_seed(0)
    model = build_model(NetConfig(spec.width, 16, 1, 0.0), task, spec)
    with torch.no_grad():
        model.head.linear.weight.normal_()
        model.head.skip.weight.uniform_(0.5, 1.5)  # buys what it bought before: better than chance, not perfect
        model.head.label_skip.normal_(std=0.3)
    model.eval()
    return cache, test_cutoff, spec, task, model


def baseline_scores(hist, popularity: np.ndarray, channel: int) -> dict[str, np.ndarray]:
    """The multilabel baselines' [n, labels] scores, dense: what the entity bought, habitually (the label
    history's `channel`), and what sells now (the same for everyone)."""
    past = hist.dense(channel) if isinstance(hist, SparseRows) else hist[:, :, channel]
    return {"past frequency": past, "popularity": np.broadcast_to(popularity, past.shape)}


def _dense_evaluate(model, cache, spec, task, cutoff, extra, chunk_entities=64):
    """evaluate()'s multilabel path before it went blockwise: dense scores and 0/1 targets concatenated."""
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    popularity = recent_popularity(cache, task.target, cutoff)
    ys, preds, base = [], [], {}
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n == 0:
            continue
        keep = eligible(chunk, task.target)
        x, h = task_inputs(chunk, spec, task, cache.entity_table(), vocab_sizes)
        ys.append(compute_target(chunk, task.target, vocab_sizes["product_id"])[keep].dense())
        preds.append(scores(model, task.task, x[keep], h[keep]))
        for k, v in baseline_scores(h, popularity, spec.habitual_channel).items():
            base.setdefault(k, []).append(np.asarray(v)[keep])
    y = np.concatenate(ys)
    baselines = {**{k: np.concatenate(v) for k, v in base.items()}, **extra}
    task_metrics = task_of("multilabel").metrics
    return y, np.concatenate(preds), {"model": task_metrics(y, np.concatenate(preds)),
                                      "baselines": {k: task_metrics(y, v) for k, v in baselines.items()},
                                      "entities": len(y), "positive_rate": float(np.mean(y))}


def test_evaluate_multilabel_equals_the_dense_computation(world, monkeypatch):
    """Model, past frequency, popularity and a dense extra baseline: the same macro AUROC as the
    dense path, with the labels scored one block of entities x 2 labels at a time; a baseline on a
    subset of the labels (LabelScores) is reported next to the model's macro AUROC on that subset."""
    cache, test_cutoff, spec, task, model = world
    n = _dense_evaluate(model, cache, spec, task, test_cutoff, {})[2]["entities"]
    noise = np.random.default_rng(2).random((n, task.outputs)).astype(np.float32)
    y, p, dense = _dense_evaluate(model, cache, spec, task, test_cutoff, {"lightgbm": noise})
    assert 0.5 < dense["model"]["macro_auroc"] < 1.0  # informative and not perfect: a real comparison
    monkeypatch.setattr(metrics, "LABEL_BLOCK_VALUES", 2 * n)
    subset = LabelScores(np.array([1, 4, 6, 9]), noise[:, [1, 4, 6, 9]] + y[:, [1, 4, 6, 9]])
    report = evaluate(model, cache, spec, task, test_cutoff, chunk_entities=64,
                      extra={"lightgbm": noise, "lgbm": subset, "missing": None})
    assert report["entities"] == n  # (positive_rate: a float32 mean before)
    assert report["positive_rate"] == pytest.approx(dense["positive_rate"], rel=1e-6)
    assert report["model"]["macro_auroc"] == pytest.approx(dense["model"]["macro_auroc"], abs=1e-9)
    assert list(report["baselines"])[:3] == ["past frequency", "popularity", "lightgbm"]
    for name, m in dense["baselines"].items():
        assert report["baselines"][name]["macro_auroc"] == pytest.approx(m["macro_auroc"], abs=1e-9), name
    assert report["baselines"]["popularity"]["macro_auroc"] == 0.5  # one score for everyone: every pair tied
    sub = report["baselines"]["lgbm (top 4 labels)"]
    assert sub["labels_measured"] == 4
    assert sub["macro_auroc"] == pytest.approx(macro_auroc(y[:, subset.labels], subset.scores), abs=1e-9)
    assert sub["model_macro_auroc"] == pytest.approx(macro_auroc(y[:, subset.labels], p[:, subset.labels]), abs=1e-9)


def test_evaluate_never_builds_a_dense_entities_by_labels_matrix(world):
    """200,000 labels (all but 12 never bought): evaluate() stays far below one dense float32
    [entities, labels] matrix (what each of the old path's scores, targets and baselines was)."""
    cache, test_cutoff, spec, _, _ = world
    wide = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "product_id", tuple(range(1, 200_001))))
    torch.manual_seed(0)
    model = build_model(NetConfig(spec.width, 16, 1, 0.0), wide, spec).eval()
    tracemalloc.start()
    try:
        report = evaluate(model, cache, spec, wide, test_cutoff, chunk_entities=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    dense_bytes = report["entities"] * 200_000 * 4
    assert 0 < report["labels_measured"] <= 12 and 0 < report["model"]["macro_auroc"] < 1
    assert peak < dense_bytes / 10, f"{peak / 2**20:.0f} MB of NumPy arrays"


# --------------------------------------------------------------------------- LightGBM's label cap


def test_lightgbm_caps_a_wide_head_at_its_most_frequent_labels(world):
    pytest.importorskip("lightgbm")
    cache, test_cutoff, spec, task, model = world
    plan = protocol(test_cutoff, HORIZON, 2, cache.time_range[0])
    capped = lightgbm_scores(cache, spec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, max_labels=3)
    full = lightgbm_scores(cache, spec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff)
    assert isinstance(capped, LabelScores) and isinstance(full, np.ndarray) and full.shape[1] == task.outputs
    # the three labels with the most positives at the training cut-offs
    vocab = cache.columns["product_id"]["vocab_size"]
    positives = np.zeros(task.outputs, np.int64)
    for cutoff in plan.train_cutoffs:
        for s, lo, hi in chunk_plan(cache, 8192):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            positives += compute_target(chunk, task.target, vocab).col_counts()
    assert set(capped.labels) == set(np.argsort(-positives, kind="stable")[:3])
    assert capped.scores.shape == (len(full), 3) and (np.diff(capped.labels) > 0).all()
    report = evaluate(model, cache, spec, task, plan.test_cutoff, extra={"lightgbm": capped})
    sub = report["baselines"]["lightgbm (top 3 labels)"]
    assert 0.5 < sub["macro_auroc"] <= 1 and 0 < sub["model_macro_auroc"] <= 1
    assert "lightgbm" not in report["baselines"]


def test_a_narrow_head_keeps_every_label_in_lightgbm(world, monkeypatch):
    """At or below the cap nothing changes: the label-count features and targets of every label."""
    import habitus.models.evaluate.baselines as baselines

    cache, test_cutoff, spec, task, _ = world
    assert task.outputs <= baselines.MULTILABEL_MAX_LABELS
    plan = protocol(test_cutoff, HORIZON, 1, cache.time_range[0])
    x, y = baselines._dataset(cache, spec, task, plan.train_cutoffs)
    x_all, y_all = baselines._dataset(cache, spec, task, plan.train_cutoffs, labels=np.arange(task.outputs))
    np.testing.assert_array_equal(x, x_all)
    np.testing.assert_array_equal(y, y_all)
    assert baselines.most_frequent_labels(cache, task, plan.train_cutoffs, task.outputs) is None


def test_the_gate_compares_a_label_subset_baseline_with_the_model_on_that_subset():
    """habitus.models.train.scenario.beats_baselines: LightGBM on the top labels of a wide head is beaten when the
    model's macro AUROC on the same labels is higher, whatever the model's value over every label."""
    from habitus.models.train.scenario import beats_baselines

    task = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "product_id", tuple(range(1, 301))))
    report = {"model": {"macro_auroc": 0.80}, "baselines": {
        "past frequency": {"macro_auroc": 0.70},
        "lightgbm (top 200 labels)": {"macro_auroc": 0.85, "model_macro_auroc": 0.86, "labels_measured": 200}}}
    assert beats_baselines(task, report)
    report["baselines"]["lightgbm (top 200 labels)"]["model_macro_auroc"] = 0.84
    assert not beats_baselines(task, report)
    report["baselines"]["lightgbm (top 200 labels)"]["model_macro_auroc"] = 0.86
    report["baselines"]["past frequency"]["macro_auroc"] = 0.81
    assert not beats_baselines(task, report)
