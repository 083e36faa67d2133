"""bench/coldstart.py: its new-item metrics and how it hides items (their events before the split
dropped, nothing else)."""

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from coldstart import K, choose_hidden, metrics_at, split_events  # noqa: E402

from habitus.models.cache import CacheSpec, TableInput  # noqa: E402


def test_hit_rate_and_ndcg_among_the_new_items():
    scores = np.array([np.arange(12, 0, -1), np.arange(12)], np.float64)  # row 0 ranks 0..11, row 1 11..0
    relevant = np.zeros((2, 12), bool)
    relevant[0, [0, 11]] = True  # first and last (outside the top K = 10)
    relevant[1, 0] = True  # ranked last: a miss
    hr, ndcg = metrics_at(scores, relevant)
    assert K == 10
    np.testing.assert_array_equal(hr, [1.0, 0.0])
    np.testing.assert_allclose(ndcg, [1.0 / (1.0 + 1.0 / np.log2(3)), 0.0])


def test_hidden_items_lose_their_events_before_the_split_only(tmp_path):
    ts = pa.array([0, 10, 20, 30, 40, 50], pa.timestamp("s"))
    pq.write_table(pa.table({"customer_id": ["a", "a", "b", "b", "c", "c"], "ts": ts,
                             "product_id": ["p", "q", "p", "r", "q", "p"]}), tmp_path / "events.parquet")
    spec = CacheSpec("customer_id", [TableInput("events", [str(tmp_path / "events.parquet")],
                                                {"product_id": "categorical"}, timestamp="ts")])
    assert choose_hidden(spec, 25, "product_id", 1.0, seed=0) == {"p", "q"}  # r first sells after the split
    before, after = split_events(spec, tmp_path, 25, {"p"}, "product_id")
    assert pq.read_table(before).column("product_id").to_pylist() == ["q"]
    assert pq.read_table(after).column("product_id").to_pylist() == ["r", "q", "p"]
