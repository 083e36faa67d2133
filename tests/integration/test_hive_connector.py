"""HiveWarehouse through PyHive against a real HiveServer2 endpoint (Spark's Thrift server)."""

import uuid
from datetime import datetime

import pyarrow as pa
import pytest

from resources.errors import WarehouseError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _driver():
    """Skips (at run time, not at collection: the default test run deselects this module) without the driver."""
    pytest.importorskip("pyhive", reason="install the hive extra: pip install -e '.[hive]'")


@pytest.fixture(scope="module")
def wh(hive_server, contract):
    from resources.hive import HiveWarehouse

    database = f"habitus_{uuid.uuid4().hex[:8]}"
    boot = HiveWarehouse(name="lake", host="127.0.0.1", port=hive_server.port, username="habitus", auth="NONE")
    con = boot._connect()
    con.cursor().execute(f"CREATE DATABASE `{database}`")
    con.close()
    wh = boot.model_copy(update={"database": database})
    events = contract.events_table()
    assert wh.write("events", iter(events.to_batches(max_chunksize=50)), events.schema) == contract.N
    return wh


def _rows(wh, table):
    con = wh._connect()
    try:
        cur = con.cursor()
        cur.execute(f"SELECT customer_id, score, as_of FROM `{table}`")
        return cur.fetchall()
    finally:
        con.close()


def test_schema(wh, contract):
    contract.schema(wh)


def test_time_range(wh, contract):
    contract.time_range(wh)


def test_sensor_queries(wh, contract):
    contract.sensor_queries(wh)


def test_types_survive_extraction(wh, contract, tmp_path):
    contract.types_survive_extraction(wh, tmp_path, aware=False)


def test_read_projection_and_window(wh, contract):
    contract.read_window(wh)


def test_every_value_survives(wh, contract):
    contract.read_all_values(wh)


def test_small_batches(wh, contract):
    contract.small_batches(wh)


def test_missing_table(wh, contract):
    contract.missing_table(wh)


def test_write_replaces_partition(wh, contract):
    contract.write_replaces_partition(wh, lambda t: _rows(wh, t))


def test_failed_write_keeps_previous_rows(wh, contract):
    contract.failed_write_keeps_previous_rows(wh, lambda t: _rows(wh, t))


def test_a_day_larger_than_one_statement_is_staged_and_replaced_in_one(wh, contract):
    """More rows than one INSERT holds: staged, then one INSERT OVERWRITE ... SELECT; a load that dies
    after some statements went through still leaves the day as it was."""
    from functools import partial

    day = datetime(2026, 3, 1)
    write = partial(wh.write, "habitus_staged", schema=contract.SCORES, replace=("as_of", day), insert_rows=3)
    assert write(iter(contract.scores(day, 10))) == 10
    assert write(iter(contract.scores(day, 7, offset=1.0))) == 7  # a re-run of the day
    assert sorted((c, s) for c, s, _ in _rows(wh, "habitus_staged")) == [(f"C{i}", i / 7 + 1.0) for i in range(7)]

    def broken():
        yield from contract.scores(day, 9, offset=2.0)[:2]  # 6 rows: two statements into the staging table
        raise RuntimeError("the scoring run died half way")

    with pytest.raises(WarehouseError, match="half way"):
        write(broken())
    assert sorted((c, s) for c, s, _ in _rows(wh, "habitus_staged")) == [(f"C{i}", i / 7 + 1.0) for i in range(7)]
    con = wh._connect()
    cur = con.cursor()
    cur.execute("SHOW TABLES")
    assert not [r for r in cur.fetchall() if any("_habitus_stage" in str(v) for v in r)]  # dropped either way
    con.close()


def test_hostile_column_names(wh):
    table = "hostile_columns"  # Hive table names are letters, digits and _ only; column names are free
    schema = pa.schema([("Event Time", pa.timestamp("us")), ("it's", pa.string())])
    batch = pa.record_batch([pa.array([datetime(2026, 3, 1, 12)], pa.timestamp("us")), pa.array(["o'k"])], schema=schema)
    assert wh.write(table, iter([batch]), schema) == 1
    assert wh.schema(table).names == ["Event Time", "it's"]
    t = pa.Table.from_batches(list(wh.read(table, ["it's"], "Event Time", datetime(2026, 3, 1), datetime(2026, 3, 2))))
    assert t.to_pydict() == {"it's": ["o'k"]}


def test_source_asset_from_project_config(wh, hive_server, contract, tmp_path):
    conn = {"type": "hive", "host": "127.0.0.1", "port": hive_server.port, "username": "habitus", "auth": "NONE",
            "database": wh.database}
    contract.source_asset(tmp_path, conn)


def test_bad_connection_names_it_and_hides_the_password():
    from resources.hive import HiveWarehouse

    secret = "hunter2-secret"
    wh = HiveWarehouse(name="prod_lake", host="127.0.0.1", port=1, username="u", password=secret)
    with pytest.raises(WarehouseError) as err:
        wh.schema("events")
    text = str(err.value)
    assert "prod_lake" in text and "127.0.0.1:1" in text and "cannot connect" in text and secret not in text
