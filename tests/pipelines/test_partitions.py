"""Partitions follow the clock for live sources and stop at `end:` for data that stopped. The clock is
pinned in-process (Dagster's partition loading context), so nothing here depends on today's date."""

from datetime import datetime, timezone

from dagster._core.definitions.partitions.context import partition_loading_context

from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.partitions import events_partitions, predictions_partitions

CONFIG = """
workspace: ws
connections: {{w: {{type: duckdb, path: w.duckdb}}}}
entity: customer_id
sources:
  - {{name: purchases, role: events, connection: w, table: purchases, timestamp: ts, columns: [product_id],
     partition: {grain}, start: 2026-03-01{end}}}
scenarios:
  churn: {{task: binary, target: {{no_event: purchases, within: 28d}}}}
predictions: {{start: 2026-10-01}}
"""


def _project(tmp_path, grain="monthly", end=""):
    (tmp_path / "p.yaml").write_text(CONFIG.format(grain=grain, end=f", end: {end}" if end else ""))
    return load_project(tmp_path / "p.yaml")


def _keys(partitions_def, now: datetime) -> list[str]:
    with partition_loading_context(effective_dt=now):
        return partitions_def.get_partition_keys()


def test_a_live_monthly_source_gets_every_complete_month_up_to_now(tmp_path):
    source = _project(tmp_path).source("purchases")
    assert _keys(events_partitions(source), datetime(2026, 11, 30, 23, tzinfo=timezone.utc))[-1] == "2026-10-01"
    assert _keys(events_partitions(source), datetime(2026, 12, 1, 1, tzinfo=timezone.utc))[-1] == "2026-11-01"
    assert len(_keys(events_partitions(source), datetime(2027, 6, 15, tzinfo=timezone.utc))) == 15


def test_end_stops_the_partitions_whatever_the_date(tmp_path):
    source = _project(tmp_path, end="2026-11-01").source("purchases")
    expected = [f"2026-{m:02d}-01" for m in range(3, 11)]
    for now in (datetime(2026, 11, 2, tzinfo=timezone.utc), datetime(2027, 6, 15, tzinfo=timezone.utc),
                datetime(2031, 1, 1, tzinfo=timezone.utc)):
        assert _keys(events_partitions(source), now) == expected


def test_a_live_daily_source_gets_every_complete_day(tmp_path):
    source = _project(tmp_path, grain="daily").source("purchases")
    keys = _keys(events_partitions(source), datetime(2026, 12, 31, 12, tzinfo=timezone.utc))
    assert keys[0] == "2026-03-01" and keys[-1] == "2026-12-30"


def test_predictions_stop_where_the_data_stopped_and_follow_the_clock_otherwise(tmp_path):
    stopped = predictions_partitions(_project(tmp_path, end="2026-11-01"))
    assert _keys(stopped, datetime(2027, 6, 15, tzinfo=timezone.utc))[-1] == "2026-10-31"
    live = predictions_partitions(_project(tmp_path))
    keys = _keys(live, datetime(2027, 6, 15, 8, tzinfo=timezone.utc))
    assert keys[0] == "2026-10-01" and keys[-1] == "2027-06-14"
