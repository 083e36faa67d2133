"""ClickHouseWarehouse through the real clickhouse-connect client. Here on chDB (ClickHouse 26.x
in-process, through clickhouse-connect's chdb interface), so every statement the connector sends
runs on a current ClickHouse engine; against a ClickHouse server over HTTP when CLICKHOUSE_HOST is
set (CLICKHOUSE_PORT, CLICKHOUSE_USER, CLICKHOUSE_PASSWORD, CLICKHOUSE_SECURE optional): what only
ClickHouse has. The checks every connector passes are in test_connector_contract.py."""

from datetime import datetime

import pyarrow as pa
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["chdb", "server"])
def loaded(request):
    return request.getfixturevalue(f"clickhouse_{request.param}_events")


@pytest.fixture(scope="module")
def wh(loaded):
    return loaded.wh


def test_write_into_a_table_not_partitioned_by_the_day_swaps_it_whole(wh, loaded, contract):
    """A predictions table made by someone else (no PARTITION BY as_of): rebuilt in a staging table
    and swapped in with EXCHANGE TABLES; a failed load leaves it as it was."""
    with wh._session("-") as client:
        client.command('CREATE TABLE "scores_unpartitioned" ("customer_id" String, "score" Float64, '
                       '"as_of" DateTime64(6)) ENGINE = MergeTree ORDER BY "customer_id"')
    contract.write_replaces_partition(wh, loaded.rows, table="scores_unpartitioned")
    contract.failed_write_keeps_previous_rows(wh, loaded.rows, table="scores_unpartitioned")


def test_an_unsigned_id_beyond_int64_is_an_error_not_a_wrap(wh, contract, tmp_path):
    with wh._session("huge") as client:
        client.command('CREATE TABLE "huge" ("id" UInt64) ENGINE = MergeTree ORDER BY tuple()')
        client.command('INSERT INTO "huge" VALUES (7), (18446744073709551615)')
    contract.lossy_value_is_an_error(wh, tmp_path, "huge", "id")


def test_native_types_and_hostile_names(wh):
    """Columns as a ClickHouse user declares them, behind a name that needs quoting."""
    with wh._session("x") as client:
        client.command('CREATE TABLE `odd "name"` (`Event Time` DateTime64(3, \'Europe/Berlin\'), id UInt64, '
                       'cat LowCardinality(String), price Nullable(Decimal(10, 2)), day Date, ok Bool, '
                       'e Enum8(\'a\' = 1, \'b\' = 2), plain DateTime) ENGINE = MergeTree ORDER BY id')
        client.command("INSERT INTO `odd \"name\"` VALUES ('2026-03-01 10:00:00.250', 18446744073709551615, 'x', "
                       "12.34, '2026-03-01', true, 'b', '2026-03-01 09:00:00'), "
                       "('2026-03-02 01:30:00', 7, 'y', NULL, '2026-03-02', false, 'a', '2026-03-02 00:00:00')")
    table = 'odd "name"'
    s = wh.schema(table)
    assert s.names == ["Event Time", "id", "cat", "price", "day", "ok", "e", "plain"]
    assert s.field("Event Time").type == pa.timestamp("ms", "UTC") and s.field("id").type == pa.uint64()
    assert s.field("cat").type == pa.string() and s.field("price").type == pa.decimal128(10, 2)
    # the Berlin wall-clock 10:00:00.250 is 09:00:00.250 UTC
    assert wh.time_range(table, "Event Time") == (datetime(2026, 3, 1, 9, 0, 0, 250_000), datetime(2026, 3, 2, 0, 30))
    assert wh.time_range(table, "plain") == (datetime(2026, 3, 1, 9), datetime(2026, 3, 2))  # session_timezone UTC
    t = pa.Table.from_batches(list(wh.read(table, ["id", "cat", "e", "price"], "Event Time",
                                           datetime(2026, 3, 1, 9), datetime(2026, 3, 2))))
    assert t.to_pydict()["id"] == [18446744073709551615] and t.to_pydict()["e"] == ["b"]
    assert str(t.to_pydict()["price"][0]) == "12.34"
    empty = pa.Table.from_batches(list(wh.read(table, ["id"], "plain", datetime(2030, 1, 1))), schema=pa.schema([("id", pa.uint64())]))
    assert empty.num_rows == 0


def test_empty_table_has_no_time_range(wh):
    with wh._session("x") as client:
        client.command("CREATE TABLE empty_events (ts DateTime64(6), id Int64) ENGINE = MergeTree ORDER BY id")
    assert wh.time_range("empty_events", "ts") == (None, None)


def test_a_misspelled_source_table_lists_the_tables_there(clickhouse_chdb_events, chdb_path, contract, tmp_path):
    """The project config's source names a table the database does not have: the step fails naming it, with
    the tables of system.tables (on chDB, through the config path)."""
    wh = clickhouse_chdb_events.wh
    conn = {"type": "clickhouse", "interface": "chdb", "path": chdb_path, "database": wh.database}
    message = contract.misspelled_source(tmp_path, conn)
    assert "in clickhouse connection 'wh'" in message and "UNKNOWN_TABLE" in message
