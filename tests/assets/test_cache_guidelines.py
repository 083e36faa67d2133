"""The cache's history guideline follows `habitus init`'s rule: 3 months of history, or a year when the
typical gap between an entity's active days is over two weeks (an infrequent domain)."""

from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.assets.cache import guideline_warnings, min_history_days, typical_gap_days
from habitus.models.cache import CacheSpec, TableInput

DAY = 86_400


def _manifest(days: float) -> dict:
    return {"time_range": [0, days * DAY], "n_events": 10**9, "n_entities": 10**6}


def _events(path, every_days: int, entities: int = 5, visits: int = 6):
    """Each entity active on `visits` days, `every_days` apart (several events on some of them)."""
    start = datetime(2026, 1, 1, 9, tzinfo=timezone.utc)
    ids, ts = [], []
    for e in range(entities):
        for v in range(visits):
            for _ in range(1 + v % 2):  # a second event the same day counts once
                ids.append(f"C{e:03d}")
                ts.append(start + timedelta(days=v * every_days + e, hours=e))
    ids.append("LONE")  # one active day: left out of the median
    ts.append(start)
    pq.write_table(pa.table({"customer_id": ids, "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))}), path)
    return str(path)


def _spec(*files) -> CacheSpec:
    return CacheSpec("customer_id", [TableInput("purchases", list(files), {}, timestamp="ts")], [], [])


def test_typical_gap_is_the_median_gap_between_active_days(tmp_path):
    assert typical_gap_days(_spec(_events(tmp_path / "weekly.parquet", 7))) == 7.0
    assert typical_gap_days(_spec(_events(tmp_path / "monthly.parquet", 33))) == 33.0
    lone = tmp_path / "lone.parquet"
    pq.write_table(pa.table({"customer_id": ["A", "A"], "ts": pa.array(
        [datetime(2026, 1, 1, 8), datetime(2026, 1, 1, 20)], pa.timestamp("us"))}), lone)
    assert typical_gap_days(_spec(str(lone))) is None  # nobody active on two days


def test_history_guideline_is_three_months_or_a_year_for_infrequent_domains():
    assert min_history_days(None) == min_history_days(3.5) == min_history_days(14) == 90
    assert min_history_days(14.5) == min_history_days(33) == 365
    assert guideline_warnings(_manifest(200), gap_days=5) == []
    assert guideline_warnings(_manifest(200)) == []
    (note,) = guideline_warnings(_manifest(200), gap_days=33)
    assert note.startswith("200 days of history (guideline: at least a year for an infrequent domain")
    assert "typical gap between an entity's active days is 33 days" in note
    (note,) = guideline_warnings(_manifest(60), gap_days=5)
    assert note.startswith("60 days of history (guideline: at least 3 months")
    assert guideline_warnings(_manifest(400), gap_days=33) == []
