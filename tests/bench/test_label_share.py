"""bench/label_share.py: the few-labels rows of bench/quality.py train on a seeded share of the
entities, through the same habitus functions, and are scored on every entity."""

import calendar
import importlib.util
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from habitus.models.evaluate import baselines
from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
from habitus.models.data.features import FeatureSpec, chunk_at, featurize
from habitus.models.data.targets import TargetSpec
from habitus.models.train.loop import chunk_plan
from habitus.models.tasks.spec import TaskSpec

BENCH = Path(__file__).resolve().parents[2] / "bench"
T0 = calendar.timegm((2026, 1, 1, 0, 0, 0))
DAY = 86_400


def _module():
    spec = importlib.util.spec_from_file_location("label_share", BENCH / "label_share.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache(tmp_path: Path) -> Cache:
    rng = np.random.default_rng(0)
    n = 4000
    path = tmp_path / "purchases.parquet"
    pq.write_table(pa.table({
        "customer_id": pa.array([f"c{i:03d}" for i in rng.integers(0, 300, n)]),
        "ts": pa.array((T0 + rng.uniform(0, 120 * DAY, n)).astype(np.int64), pa.int64()).cast(pa.timestamp("s")),
        "product_id": pa.array([f"p{j}" for j in rng.integers(0, 25, n)]),
        "price": pa.array(rng.gamma(2.0, 5.0, n))}), path)
    spec = CacheSpec("customer_id", [TableInput("purchases", [str(path)], {"product_id": "categorical",
                                                                          "price": "numeric"}, timestamp="ts")],
                     shard_events=1500)
    return Cache(build_cache(spec, tmp_path / "cache", log=lambda _: None))


def test_the_subset_holds_the_drawn_entities_whole(tmp_path):
    ls = _module()
    cache = _cache(tmp_path)
    assert cache.shard_count > 1
    keep = ls.labeled_entities(cache, 0.1)
    assert keep.sum() == math.ceil(0.1 * cache.n_entities)
    assert np.array_equal(keep, ls.labeled_entities(cache, 0.1))  # the same entities on every run
    assert not np.array_equal(keep, ls.labeled_entities(cache, 0.1, seed=1))
    subset = ls.EntitySubset(cache, keep)
    assert subset.n_entities == keep.sum() == sum(hi - lo for _, lo, hi in chunk_plan(subset, 7))
    spec = FeatureSpec.from_cache(cache, buckets=16)
    cutoff = T0 + 90 * DAY
    seen = []
    for s in range(cache.shard_count):
        full, part = cache.shard(s), subset.shard(s)
        assert np.array_equal(part.entities, full.entities[keep[full.entities]])
        a = chunk_at(full, 0, len(full.entities), cutoff)
        b = chunk_at(part, 0, len(part.entities), cutoff)
        # an entity kept keeps all of its events, so its features are the ones of the full cache
        rows = np.isin(a.entities, b.entities)
        assert np.array_equal(a.entities[rows], b.entities)
        np.testing.assert_array_equal(featurize(a, spec, cache.entity_table())[rows],
                                      featurize(b, spec, cache.entity_table()))
        seen += b.entities.tolist()
    assert len(seen) > 0 and keep[seen].all()


def test_lightgbm_trains_on_the_subset_and_scores_every_entity(tmp_path):
    ls = _module()
    cache = _cache(tmp_path)
    subset = ls.EntitySubset(cache, ls.labeled_entities(cache, 0.2))
    spec = FeatureSpec.from_cache(cache, buckets=16)
    task = TaskSpec("binary", TargetSpec("no_event", 14, active_days=60))
    train, test = T0 + 70 * DAY, T0 + 98 * DAY
    full_train, _ = baselines._dataset(cache, spec, task, [train])
    full_test, _ = baselines._dataset(cache, spec, task, [test])
    part_train, _ = baselines._dataset(subset, spec, task, [train])
    assert 0 < len(part_train) < len(full_train) / 2
    with ls.lightgbm_trained_on(subset, test):
        assert len(baselines._dataset(cache, spec, task, [train])[0]) == len(part_train)
        assert len(baselines._dataset(cache, spec, task, [train, test])[0]) < len(full_train) + len(full_test)
        assert len(baselines._dataset(cache, spec, task, [test])[0]) == len(full_test)
    assert len(baselines._dataset(cache, spec, task, [train])[0]) == len(full_train)  # restored after the block
