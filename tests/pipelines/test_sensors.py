"""The new-data sensors: a Dagster test instance, a small DuckDB (and Parquet) warehouse, and cursors
carried from tick to tick, as the sensor daemon would."""

import json
import time
from datetime import datetime, timedelta, timezone

import dagster as dg
import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.pipelines.config.project import load_project
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.build import build_resources
from habitus.pipelines.orchestration.sensors import plan_runs

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")




def _rows(month: int, n: int, day: int = 3, first_customer: int = 0) -> list[tuple]:
    """n purchases on 2026-<month>-<day>, one an hour, by customers c0, c1, ..."""
    start = datetime(2026, month, day, 8)
    return [(f"c{first_customer + i % 5}", start + timedelta(hours=i), f"p{i % 3}", 1.0 + i) for i in range(n)]


def _insert(path, rows: list[tuple]) -> None:
    con = duckdb.connect(str(path))
    try:
        con.executemany("INSERT INTO purchases VALUES (?, ?, ?, ?)", rows)
    finally:
        con.close()


def _project(tmp_path, partition="monthly", connection=None, start="2026-03-01", where=None):
    cfg = {
        "workspace": "ws",
        "connections": {"warehouse": connection or {"type": "duckdb", "path": "warehouse.duckdb"}},
        "entity": "customer_id",
        "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                     "timestamp": "ts", "columns": ["product_id", "price"], "partition": partition, "start": start,
                     **({"where": where} if where else {})}],
    }
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    return load_project(tmp_path / "project.yaml")


@pytest.fixture
def warehouse(tmp_path):
    path = tmp_path / "warehouse.duckdb"
    con = duckdb.connect(str(path))
    con.sql("CREATE TABLE purchases (customer_id VARCHAR, ts TIMESTAMP, product_id VARCHAR, price DOUBLE)")
    con.close()
    _insert(path, _rows(3, 10) + _rows(4, 8) + _rows(5, 6))
    return path


class Ticker:
    """Evaluates the sensor like the daemon does: each tick starts from the cursor the last one left."""

    def __init__(self, project, instance):
        self.defs = build_definitions(project)
        self.sensor = self.defs.resolve_sensor_def("purchases_new_data")
        self.resources = build_resources(project)
        self.instance = instance
        self.cursor = None

    def tick(self):
        context = dg.build_sensor_context(cursor=self.cursor, instance=self.instance, resources=self.resources,
                                           definitions=self.defs)
        data = self.sensor.evaluate_tick(context)
        self.cursor = data.cursor
        return data

    def run(self, request) -> dg.ExecuteInProcessResult:
        """Execute a requested run of the sensor's job in this instance, with the request's tags."""
        job = self.defs.resolve_job_def("extract_purchases")
        return job.execute_in_process(instance=self.instance, partition_key=request.partition_key,
                                      tags=request.tags, raise_on_error=False)


def _ranges(requests) -> list[tuple[str, str]]:
    out = []
    for r in requests:
        if r.partition_key:
            out.append((r.partition_key, r.partition_key))
        else:
            out.append((r.tags[ASSET_PARTITION_RANGE_START_TAG], r.tags[ASSET_PARTITION_RANGE_END_TAG]))
    return out


def test_first_tick_requests_the_history_in_one_run(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    data = t.tick()
    assert _ranges(data.run_requests) == [("2026-03-01", "2026-05-01")]
    assert json.loads(t.cursor)["partitions"] == {
        "2026-03-01": [10, "2026-03-03T17:00:00"], "2026-04-01": [8, "2026-04-03T15:00:00"],
        "2026-05-01": [6, "2026-05-03T13:00:00"]}


def test_no_new_data_skips_and_keeps_the_cursor(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    t.tick()
    cursor = t.cursor
    data = t.tick()
    assert data.run_requests == []
    assert "no new data" in data.skip_message and "24 rows" in data.skip_message
    assert t.cursor == cursor


def test_one_new_partition(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    t.tick()
    _insert(warehouse, _rows(6, 4))
    data = t.tick()
    assert [r.partition_key for r in data.run_requests] == ["2026-06-01"]
    assert data.run_requests[0].run_key.startswith("purchases:2026-06-01..2026-06-01:")
    assert t.tick().run_requests == []  # and not again


def test_two_new_partitions_at_once(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    t.tick()
    _insert(warehouse, _rows(6, 4) + _rows(7, 2))
    data = t.tick()
    assert _ranges(data.run_requests) == [("2026-06-01", "2026-07-01")]  # consecutive: one run
    _insert(warehouse, _rows(4, 1, day=20) + _rows(9, 3))
    data = t.tick()  # a late row in April and new September: two runs, not one over April..September
    assert _ranges(data.run_requests) == [("2026-04-01", "2026-04-01"), ("2026-09-01", "2026-09-01")]
    assert len({r.run_key for r in data.run_requests}) == 2


def test_late_rows_request_a_processed_partition_again(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    first = t.tick().run_requests[0]
    _insert(warehouse, _rows(4, 2, day=28))  # arrives after April was extracted
    data = t.tick()
    assert [r.partition_key for r in data.run_requests] == ["2026-04-01"]
    assert data.run_requests[0].run_key != first.run_key
    assert json.loads(t.cursor)["partitions"]["2026-04-01"] == [10, "2026-04-28T09:00:00"]


def test_run_keys_are_stable_for_the_same_data(tmp_path, warehouse, instance):
    """A tick evaluated twice from the same cursor (a daemon restart) asks for the same run_keys, which
    Dagster launches once."""
    t = Ticker(_project(tmp_path), instance)
    t.tick()
    _insert(warehouse, _rows(6, 4))
    before = t.cursor
    keys = [r.run_key for r in t.tick().run_requests]
    t.cursor = before
    assert [r.run_key for r in t.tick().run_requests] == keys


def test_a_changed_where_requests_every_partition_again(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    first = t.tick().run_requests
    assert t.tick().run_requests == []
    filtered = Ticker(_project(tmp_path, where="price > 3"), instance)
    filtered.cursor = t.cursor  # the same sensor, after the config changed
    data = filtered.tick()
    assert _ranges(data.run_requests) == [("2026-03-01", "2026-05-01")]
    assert data.run_requests[0].run_key != first[0].run_key  # not taken for the run already launched
    assert filtered.tick().run_requests == []  # and once only
    old = json.loads(t.cursor)
    old.pop("extraction")  # a cursor written before the fingerprint was kept: unfiltered
    t.cursor = json.dumps(old)
    assert t.tick().run_requests == []
    filtered.cursor = json.dumps(old)
    assert _ranges(filtered.tick().run_requests) == [("2026-03-01", "2026-05-01")]


def test_first_tick_skips_partitions_this_instance_already_extracted(tmp_path, warehouse, instance):
    project = _project(tmp_path)
    t = Ticker(project, instance)
    t.run(dg.RunRequest(partition_key="2026-03-01"))
    assert t.tick().run_requests[0].tags[ASSET_PARTITION_RANGE_START_TAG] == "2026-04-01"


def test_rows_of_the_period_in_progress_wait_until_it_ends(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    t.tick()
    now = datetime.now(timezone.utc).replace(tzinfo=None, microsecond=0)
    _insert(warehouse, [("c1", now - timedelta(minutes=5), "p1", 2.0)])
    data = t.tick()
    assert data.run_requests == []
    assert "1 rows of the month in progress wait until it ends" in data.skip_message


def test_daily_source_requests_new_days(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path, partition="daily", start="2026-05-01"), instance)
    assert _ranges(t.tick().run_requests) == [("2026-05-03", "2026-05-03")]
    _insert(warehouse, _rows(5, 30, day=10))  # 30 hours: the 10th and the 11th
    assert _ranges(t.tick().run_requests) == [("2026-05-10", "2026-05-11")]


def test_a_requested_run_extracts_exactly_those_partitions(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    request = t.tick().run_requests[0]
    result = t.run(request)
    assert result.success
    files = sorted((tmp_path / "ws" / "sources" / "purchases").glob("*.parquet"))
    assert [f.stem for f in files] == ["2026-03-01", "2026-04-01", "2026-05-01"]
    assert [pq.read_metadata(f).num_rows for f in files] == [10, 8, 6]
    assert instance.get_materialized_partitions(dg.AssetKey(["source", "purchases"])) == {
        "2026-03-01", "2026-04-01", "2026-05-01"}
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["schema_matches_config"] and checks["keys_present"] and checks["timestamps_plausible"]
    assert checks["volume_guidelines"] is False  # 5 customers: below the guidelines, a warning only


def test_cache_automation_follows_new_source_partitions(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    before = dg.evaluate_automation_conditions(defs=t.defs, instance=instance)  # the automation sensor ticking
    assert before.total_requested == 0
    t.run(t.tick().run_requests[0])
    after = dg.evaluate_automation_conditions(defs=t.defs, instance=instance, cursor=before.cursor)
    assert after.get_requested_partitions(dg.AssetKey("cache")) == {None}
    again = dg.evaluate_automation_conditions(defs=t.defs, instance=instance, cursor=after.cursor)
    assert again.total_requested == 0  # requested once per update, not on every tick


def test_cache_automation_waits_when_a_blocking_check_failed(tmp_path, warehouse, instance):
    t = Ticker(_project(tmp_path), instance)
    t.run(t.tick().run_requests[0])
    cursor = dg.evaluate_automation_conditions(defs=t.defs, instance=instance).cursor
    _insert(warehouse, [(None, datetime(2026, 6, 2, 9), "p1", 1.0)] * 3 + _rows(6, 2))  # 60% without a customer
    (request,) = t.tick().run_requests
    assert not t.run(request).success  # keys_present fails with ERROR, blocking
    assert dg.evaluate_automation_conditions(defs=t.defs, instance=instance, cursor=cursor).total_requested == 0


def test_parquet_warehouse_new_file(tmp_path, instance):
    folder = tmp_path / "exports" / "purchases"
    folder.mkdir(parents=True)
    schema = pa.schema([("customer_id", pa.string()), ("ts", pa.timestamp("us")), ("product_id", pa.string()),
                        ("price", pa.float64())])

    def write(name, rows):
        pq.write_table(pa.Table.from_pylist([dict(zip(schema.names, r)) for r in rows], schema), folder / name)

    write("a.parquet", _rows(3, 5))
    project = _project(tmp_path, connection={"type": "parquet", "path": "exports"})
    t = Ticker(project, instance)
    assert _ranges(t.tick().run_requests) == [("2026-03-01", "2026-03-01")]
    assert t.tick().run_requests == []
    write("b.parquet", _rows(3, 2, day=30) + _rows(4, 3))
    assert _ranges(t.tick().run_requests) == [("2026-03-01", "2026-04-01")]


def test_a_tick_is_cheap(tmp_path, warehouse, instance):
    con = duckdb.connect(str(warehouse))  # 200,000 more rows over eight months
    con.sql("INSERT INTO purchases SELECT 'c' || (i % 1000), TIMESTAMP '2026-03-01' + to_seconds(i * 100), "
            "'p' || (i % 50), 1.0 FROM range(200000) t(i)")
    con.close()
    t = Ticker(_project(tmp_path), instance)
    started = time.time()
    t.tick()
    t.tick()
    assert time.time() - started < 2.0


def test_plan_runs_groups_consecutive_partitions_up_to_the_policy():
    order = [f"k{i:02d}" for i in range(30)]
    changed = order[:14] + [order[20], order[22], order[23]]
    assert [len(r) for r in plan_runs(changed, order, 12)] == [12, 2, 1, 2]
    assert plan_runs([], order, 12) == []
