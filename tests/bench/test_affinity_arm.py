"""The panel's reference arm "lightgbm + affinity" (bench/affinity.py's affinity_lightgbm_scores): the
test entities' scores in evaluate's order, of the most frequent labels, and its affinity columns
change what the trees learn."""

import calendar
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytest.importorskip("lightgbm")


def _world(tmp_path):
    """300 customers, each loyal to one of 8 categories of 4 products (75% of what they buy) over 150 days;
    a products table gives every product its category."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
    from habitus.models.data.features import DAY

    rng, n, t0 = np.random.default_rng(0), 12000, calendar.timegm((2026, 1, 1, 0, 0, 0))
    customer = rng.integers(0, 300, n)
    own = rng.random(n) < 0.75
    group = np.where(own, customer % 8, rng.integers(0, 8, n))
    products = [f"p{g}_{j}" for g, j in zip(group, rng.integers(0, 4, n))]
    ts = t0 + (rng.uniform(0, 150, n) * DAY).astype(np.int64)
    pq.write_table(pa.table({"customer_id": pa.array([f"c{i:03d}" for i in customer]),
                             "ts": pa.array(ts, pa.int64()).cast(pa.timestamp("s")),
                             "product_id": pa.array(products)}), tmp_path / "purchases.parquet")
    names = sorted({p for p in products})
    pq.write_table(pa.table({"product_id": names, "category": [p.split("_")[0] for p in names]}),
                   tmp_path / "products.parquet")
    spec = CacheSpec("customer_id", [TableInput("purchases", [str(tmp_path / "purchases.parquet")],
                                                {"product_id": "categorical"}, timestamp="ts")],
                     [], [TableInput("products", [str(tmp_path / "products.parquet")], {"category": "categorical"},
                                     key="product_id")])
    return Cache(build_cache(spec, tmp_path / "cache", log=lambda _: None)), t0 + 136 * DAY


def test_the_affinity_arm_scores_the_test_entities_in_evaluates_order(tmp_path):
    from affinity import affinity_lightgbm_scores

    from habitus.models.data.affinity import attribute_columns
    from habitus.models.data.features import FeatureSpec
    from habitus.models.data.targets import TargetSpec
    from habitus.models.evaluate.holdout import holdout_chunks, protocol
    from habitus.models.tasks.metrics import macro_auroc
    from habitus.models.tasks.spec import TaskSpec

    cache, test_cutoff = _world(tmp_path)
    assert attribute_columns(cache) == ("category",)
    every = tuple(range(1, cache.columns["product_id"]["vocab_size"] + 1))
    task = TaskSpec("multilabel", TargetSpec("any_event", 14, "product_id", every))
    plan = protocol(test_cutoff, 14, 3, cache.time_range[0])
    spec = FeatureSpec.from_cache(cache, buckets=16)
    found = affinity_lightgbm_scores(cache, spec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                                     max_labels=10)
    assert len(found.labels) == 10 and (np.diff(found.labels) > 0).all()
    y = np.concatenate([y.dense(0, found.labels) for _, _, _, _, y in holdout_chunks(cache, spec, task, test_cutoff, 64)])
    assert found.scores.shape == y.shape
    assert macro_auroc(y, found.scores) > 0.65  # (scores out of evaluate's order would be near 0.5)
    plain = affinity_lightgbm_scores(cache, spec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                                     max_labels=10, levels=())
    assert not np.allclose(plain.scores, found.scores)  # the affinity columns are read
