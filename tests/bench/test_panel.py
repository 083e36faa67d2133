"""The panel's bootstrap and verdict rule (bench/intervals.py) on synthetic scores with a known
difference, and the practitioner baseline's features (bench/practitioner.py) on a hand-made history."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import norm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from intervals import combine, metric, paired_bootstrap, panel_mean, resample_counts, verdict, weighted_auroc  # noqa: E402
from practitioner import label_figures, parent_of  # noqa: E402

from habitus.models.cache.reader import Shard  # noqa: E402
from habitus.models.data.features import DAY, chunk_at  # noqa: E402
from habitus.models.data.targets import TargetSpec  # noqa: E402
from habitus.models.tasks.metrics import auroc, macro_auroc  # noqa: E402
from habitus.models.tasks.spec import TaskSpec  # noqa: E402


def binormal(n: int, aurocs: tuple[float, ...], rng: np.random.Generator, rate: float = 0.3):
    """0/1 labels and one score per AUROC: y * d + noise, d chosen so that the population AUROC is
    exactly that one (Phi(d / sqrt 2)); the arms share half their noise (paired, as two models are)."""
    y = rng.random(n) < rate
    shared = rng.normal(size=n)
    scores = [np.sqrt(2) * norm.ppf(a) * y + np.sqrt(0.5) * shared + np.sqrt(0.5) * rng.normal(size=n) for a in aurocs]
    return y, scores


def test_weighted_auroc_is_the_auroc_of_the_repeated_sample():
    rng = np.random.default_rng(1)
    y, s = rng.random(300) < 0.4, np.round(rng.normal(size=300), 1)  # rounded: many ties
    w = rng.integers(0, 4, (3, 300)).astype(np.int32)
    got = weighted_auroc(y, s, w)
    for row, value in zip(w, got):
        idx = np.repeat(np.arange(300), row)
        assert value == pytest.approx(auroc(y[idx], s[idx]), abs=1e-12)


def test_resamples_keep_each_stratum_size():
    strata = np.r_[np.zeros(70, bool), np.ones(30, bool)]
    w = resample_counts(strata, 50, np.random.default_rng(0))
    assert (w[:, ~strata].sum(1) == 70).all() and (w[:, strata].sum(1) == 30).all()
    assert w.std(0).mean() > 0.5  # entities are drawn with replacement, not kept once each


def test_a_true_difference_of_001_is_inside_the_interval():
    rng = np.random.default_rng(7)
    diffs, variances = [], []
    for seed in range(3):  # three "seeds": three fresh draws of the same two models' scores
        y, (a, b) = binormal(6000, (0.76, 0.75), rng)
        p = paired_bootstrap(y, a, b, draws=400, seed=seed)
        assert p.diff == pytest.approx(auroc(y, a) - auroc(y, b), abs=1e-12)
        diffs.append(p.diff)
        variances.append(p.var)
    iv = combine(diffs, variances)
    assert iv.lo < 0.01 < iv.hi
    # the bootstrap's standard error is the spread of the difference over fresh samples
    spread = np.std(_fresh_differences(rng), ddof=1)
    assert 0.7 < np.sqrt(np.mean(variances)) / spread < 1.4


def _fresh_differences(rng, reps: int = 40) -> list[float]:
    out = []
    for _ in range(reps):
        y, (a, b) = binormal(6000, (0.76, 0.75), rng)
        out.append(auroc(y, a) - auroc(y, b))
    return out


def test_a_true_zero_is_not_a_pass():
    rng = np.random.default_rng(3)
    for trial in range(5):
        diffs, variances = [], []
        for seed in range(3):
            y, (a, b) = binormal(4000, (0.75, 0.75), rng)
            p = paired_bootstrap(y, a, b, draws=300, seed=seed)
            diffs.append(p.diff)
            variances.append(p.var)
        iv = combine(diffs, variances)
        assert verdict(iv.mean, iv.lo, iv.hi, 0.01, 0.0) != "pass"
        assert iv.lo < 0 < iv.hi or abs(iv.mean) < 2.5 * np.sqrt(iv.var)


def test_macro_auroc_recomputes_every_label():
    rng = np.random.default_rng(5)
    n, labels = 5000, 4
    y = np.zeros((n, labels), np.int8)
    a, b = np.zeros((n, labels)), np.zeros((n, labels))
    for j in range(labels):
        yj, (aj, bj) = binormal(n, (0.80, 0.78), rng, rate=0.1 + 0.05 * j)
        y[:, j], a[:, j], b[:, j] = yj, aj, bj
    y[:, 3] = 0
    y[:3, 3] = 1  # three positives: not measured, as macro_auroc leaves it out
    ones = np.ones((1, n), np.int32)
    assert metric(y, a, ones)[0] == pytest.approx(macro_auroc(y, a), abs=1e-12)
    p = paired_bootstrap(y, a, b, draws=300)
    assert p.diff == pytest.approx(macro_auroc(y, a) - macro_auroc(y, b), abs=1e-12)
    iv = combine([p.diff], [p.var])
    assert iv.lo < 0.02 < iv.hi


def test_verdict_rule_and_variance():
    assert verdict(0.021, 0.011, 0.031, 0.02, 0.01) == "pass"
    assert verdict(0.021, 0.009, 0.033, 0.02, 0.01) == "undecided"  # lower bound not above the floor
    assert verdict(0.015, 0.011, 0.025, 0.02, 0.01) == "undecided"  # the mean short of the bar
    assert verdict(0.005, -0.005, 0.0199, 0.02, 0.01) == "fail"
    assert verdict(0.5, 0.4, 0.6, None, None) is None
    iv = combine([0.01, 0.03], [1e-4, 3e-4])
    assert iv.var == pytest.approx(0.0002 / 2 + 2e-4)
    assert iv.mean == pytest.approx(0.02) and iv.hi - iv.mean == pytest.approx(1.959964 * np.sqrt(3e-4), rel=1e-5)
    assert combine([0.01], [1e-4]).var == pytest.approx(1e-4)  # one seed: the bootstrap's alone
    both = panel_mean([combine([0.01], [1e-4]), combine([0.03], [3e-4])])
    assert both.mean == pytest.approx(0.02) and both.var == pytest.approx(1e-4)


CUTOFF = 100 * DAY


def hand_made_chunk():
    """Two entities; columns brand (the label column: labels are brand ids 3 and 5) and category."""
    ages = [7, 14, 0, 30, 3, -2]  # days before the cut-off (-2: after it, not history)
    order = [3, 2, 1, 0]  # entity 0's events oldest first: ages 30, 14, 7, 0
    ts = np.array([CUTOFF - ages[i] * DAY for i in order] + [CUTOFF - 3 * DAY, CUTOFF + 2 * DAY], np.int64)
    brand = np.array([[3, 3, 4, 5][i] for i in order] + [4, 3], np.int32)
    category = np.array([[2, 2, 2, 1][i] for i in order] + [1, 2], np.int32)
    shard = Shard(entity=np.array([0, 0, 0, 0, 1, 1], np.int32), ts=ts, columns={"brand": brand, "category": category},
                  entities=np.array([0, 1], np.int32), starts=np.array([0, 4, 6], np.int64))
    return chunk_at(shard, 0, 2, CUTOFF), shard


def test_practitioner_label_figures():
    chunk, _ = hand_made_chunk()
    task = TaskSpec("multilabel", TargetSpec("any_event", 28, "brand", (3, 5)))
    f = label_figures(chunk, task, np.array([0, 1]), ("category", np.array([2, 1]), 3)).astype(np.float64)
    assert f.shape == (2, 2, 10)
    d = lambda age, h: 2.0 ** (-age / h)  # noqa: E731
    # entity 0, brand 3 (ages 7 and 14): counts at 7 / 30 / 120 days, recency (30 days), days since the last
    expect = [np.log1p(d(7, h) + d(14, h)) for h in (7, 30, 120)] + [d(7, 30), 7]
    # its parent, category 2 (ages 0, 7, 14)
    expect += [np.log1p(1 + d(7, h) + d(14, h)) for h in (7, 30, 120)] + [1.0, 0]
    np.testing.assert_allclose(f[0, 0], expect, rtol=2e-3)
    # entity 0, brand 5 (age 30), parent category 1 (age 30)
    one = [np.log1p(d(30, h)) for h in (7, 30, 120)] + [d(30, 30), 30]
    np.testing.assert_allclose(f[0, 1], one + one, rtol=2e-3)
    # entity 1 bought neither brand before the cut-off (brand 3 after it): zeros and no last day;
    # its category 1 at age 3 is brand 5's parent
    np.testing.assert_array_equal(f[1, 0, :4], 0)
    assert np.isnan(f[1, 0, 4]) and np.isnan(f[1, 0, 9]) and np.isnan(f[1, 1, 4])
    np.testing.assert_allclose(f[1, 1, 5:], [np.log1p(d(3, h)) for h in (7, 30, 120)] + [d(3, 30), 3], rtol=2e-3)


def test_parent_is_the_category_a_labels_events_carry_most():
    _, shard = hand_made_chunk()
    cache = SimpleNamespace(shard_count=1, shard=lambda i: shard, columns={"category": {"vocab_size": 2}})
    task = TaskSpec("multilabel", TargetSpec("any_event", 28, "brand", (3, 5)))
    np.testing.assert_array_equal(parent_of(cache, task, "category", CUTOFF), [2, 1])
    # 20 days earlier brand 3 had no event yet: the missing value 0
    np.testing.assert_array_equal(parent_of(cache, task, "category", CUTOFF - 20 * DAY), [0, 1])


def test_every_arm_is_captured_on_the_same_entities_as_its_report(tmp_path):
    """bench/quality.py's train_arms with bench/arm_scores.py: the scores recorded for each arm give back
    the metrics each hold-out reported, on one list of entities, for one-score and label tasks."""
    import calendar

    import pyarrow as pa
    import pyarrow.parquet as pq

    from quality import train_arms

    from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
    from habitus.models.data.labels import top_values
    from habitus.models.evaluate.holdout import protocol
    from habitus.models.tasks.metrics import macro_auroc
    from habitus.models.train.config import FoundationConfig
    from habitus.models.train.foundation import train_foundation

    rng, n, t0 = np.random.default_rng(0), 6000, calendar.timegm((2026, 1, 1, 0, 0, 0))
    customer = rng.integers(0, 300, n)
    stop = t0 + rng.uniform(40, 160, 300) * DAY  # each customer buys until its own day
    ts = t0 + rng.uniform(0, 1, n) * (stop[customer] - t0)
    pq.write_table(pa.table({
        "customer_id": pa.array([f"c{i:03d}" for i in customer]),
        "ts": pa.array(ts.astype(np.int64), pa.int64()).cast(pa.timestamp("s")),
        "product_id": pa.array([f"p{(c % 6) * 3 + j}" for c, j in zip(customer, rng.integers(0, 5, n))])}),
        tmp_path / "purchases.parquet")
    spec = CacheSpec("customer_id", [TableInput("purchases", [str(tmp_path / "purchases.parquet")],
                                                {"product_id": "categorical"}, timestamp="ts")])
    cache = Cache(build_cache(spec, tmp_path / "cache", log=lambda _: None))
    test_cutoff = t0 + 126 * DAY
    foundation = train_foundation(cache, FoundationConfig(horizon_days=14, hidden=16, layers=1, epochs=1, batch_size=32,
                                                          buckets=16, chunk_entities=64),
                                  test_cutoff - 14 * DAY, device="cpu", log=lambda _: None)
    info = {**foundation.info, "weights_sha256": "f" * 64}
    for task, score in ((TaskSpec("binary", TargetSpec("no_event", 14, active_days=30)), auroc),
                        (TaskSpec("multilabel", TargetSpec("any_event", 14, "product_id",
                                                           top_values(cache, "product_id", test_cutoff, 8))),
                         macro_auroc)):
        plan = protocol(test_cutoff, 14, 3, cache.time_range[0])
        arms = train_arms(cache, foundation.model.state_dict(), info, task, plan, "row", seed=1)
        first = arms.records["run"][0]
        key = "auroc" if score is auroc else "macro_auroc"
        assert score(first["y"], first["scores"]["model"]) == pytest.approx(arms.run.report["model"][key], abs=1e-6)
        assert score(first["y"], first["scores"]["lightgbm"]) == pytest.approx(
            arms.run.report["baselines"]["lightgbm"][key], abs=1e-6)
        if "network" in arms.run.report:
            assert score(first["y"], first["scores"]["network"]) == pytest.approx(arms.run.report["network"][key], abs=1e-6)
        for name in ("scratch", "bare"):
            rec = arms.records[name][0]
            np.testing.assert_array_equal(rec["entities"], first["entities"])
            assert score(rec["y"], rec["scores"]["model"]) == pytest.approx(
                getattr(arms, name).report["model"][key], abs=1e-6)
        assert len(first["entities"]) == arms.run.report["entities"] > 50
