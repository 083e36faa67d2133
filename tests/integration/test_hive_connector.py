"""HiveWarehouse through PyHive against a real HiveServer2 endpoint (Spark's Thrift server): what only
Hive has. The checks every connector passes are in test_connector_contract.py."""

from datetime import datetime

import pyarrow as pa
import pytest

from habitus.resources.warehouses.errors import WarehouseError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wh(hive_events):
    return hive_events.wh


@pytest.fixture(scope="module")
def rows(hive_events):
    return hive_events.rows


def test_a_day_larger_than_one_statement_is_staged_and_replaced_in_one(wh, rows, contract):
    """More rows than one INSERT holds: staged, then one INSERT OVERWRITE ... SELECT; a load that dies
    after some statements went through still leaves the day as it was."""
    from functools import partial

    day = datetime(2026, 3, 1)
    write = partial(wh.write, "habitus_staged", schema=contract.SCORES, replace=("as_of", day), insert_rows=3)
    assert write(iter(contract.scores(day, 10))) == 10
    assert write(iter(contract.scores(day, 7, offset=1.0))) == 7  # a re-run of the day
    assert sorted((c, s) for c, s, _ in rows("habitus_staged")) == [(f"C{i}", i / 7 + 1.0) for i in range(7)]

    def broken():
        yield from contract.scores(day, 9, offset=2.0)[:2]  # 6 rows: two statements into the staging table
        raise RuntimeError("the scoring run died half way")

    with pytest.raises(WarehouseError, match="half way"):
        write(broken())
    assert sorted((c, s) for c, s, _ in rows("habitus_staged")) == [(f"C{i}", i / 7 + 1.0) for i in range(7)]
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


def test_a_misspelled_source_table_lists_the_tables_there(wh, hive_server, contract, tmp_path):
    """The source's table is not in the database: the step fails naming it, with SHOW TABLES' tables."""
    conn = {"type": "hive", "host": "127.0.0.1", "port": hive_server.port, "username": "habitus", "auth": "NONE",
            "database": wh.database}
    message = contract.misspelled_source(tmp_path, conn)
    assert f"in hive connection 'wh' at 127.0.0.1:{hive_server.port}" in message
