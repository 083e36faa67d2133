"""Tests for habitus.resources.warehouses.clickhouse up to the wire: type mapping, the SQL it sends, client settings.
The real client on a ClickHouse engine is tested in tests/integration/test_connector_contract.py and
test_clickhouse_connector.py."""

from datetime import datetime

import pyarrow as pa
import pytest
import sqlglot

from habitus.resources.warehouses.clickhouse import ClickHouseWarehouse, _precise_times, _projection, arrow_type
from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.sql import create_table_sql, delete_sql, select_expr


@pytest.mark.parametrize("ch, expected", [
    ("Int64", pa.int64()), ("UInt64", pa.uint64()), ("Nullable(Int32)", pa.int32()), ("UInt8", pa.uint8()),
    ("Int128", pa.decimal128(38, 0)), ("Float32", pa.float32()), ("Float64", pa.float64()), ("Bool", pa.bool_()),
    ("Decimal(10, 2)", pa.decimal128(10, 2)), ("Nullable(Decimal(10, 2))", pa.decimal128(10, 2)),
    ("Decimal64(4)", pa.decimal128(18, 4)), ("Decimal256(10)", pa.decimal256(76, 10)),
    ("String", pa.string()), ("LowCardinality(Nullable(String))", pa.string()), ("FixedString(3)", pa.string()),
    ("UUID", pa.string()), ("Enum8('a' = 1, 'b' = 2)", pa.string()), ("IPv4", pa.string()),
    ("Date", pa.date32()), ("Date32", pa.date32()),
    ("DateTime", pa.timestamp("s")), ("DateTime('Europe/Berlin')", pa.timestamp("s", "UTC")),
    ("DateTime64(3)", pa.timestamp("ms")), ("DateTime64(6, 'UTC')", pa.timestamp("us", "UTC")),
    ("DateTime64(9)", pa.timestamp("ns")),
    ("SimpleAggregateFunction(max, Nullable(Int64))", pa.int64()),
])
def test_arrow_type(ch, expected):
    assert arrow_type("c", ch) == expected


def test_unmapped_type_names_the_column():
    with pytest.raises(WarehouseError, match="'tags'.*Array"):
        arrow_type("tags", "Array(String)")


def test_projection_converts_codes_to_values():
    q = _precise_times(select_expr('db.odd"t', [_projection("Enum8('a' = 1)", "kind"), _projection("UInt128", "id"),
                                 _projection("Nullable(String)", "note")], "Event Time",
                    datetime(2026, 3, 1), datetime(2026, 4, 1, 0, 0, 0, 500))).sql(dialect="clickhouse")
    assert q == ('SELECT toString("kind") AS "kind", CAST("id" AS Decimal(38, 0)) AS "id", "note" '
                 'FROM "db"."odd""t" WHERE "Event Time" >= CAST(\'2026-03-01 00:00:00\' AS DateTime64(6)) '
                 'AND "Event Time" < CAST(\'2026-04-01 00:00:00.000500\' AS DateTime64(6))')
    assert len(sqlglot.parse(q, read="clickhouse")) == 1


def test_write_sql():
    schema = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.timestamp("s")),
                        ("at", pa.timestamp("us", "UTC"))])
    # timestamps Nullable like the rest (a NULL must not become 1970-01-01), but never a partition key
    assert create_table_sql("clickhouse", "p.scores", schema) == (
        'CREATE TABLE IF NOT EXISTS "p"."scores" ("customer_id" Nullable(String), "score" Nullable(Float64), '
        "\"as_of\" Nullable(DateTime64(0)), \"at\" Nullable(DateTime64(6, 'UTC'))) ENGINE=MergeTree ORDER BY ()")
    assert create_table_sql("clickhouse", "p.scores", schema, partition_by="as_of") == (
        'CREATE TABLE IF NOT EXISTS "p"."scores" ("customer_id" Nullable(String), "score" Nullable(Float64), '
        "\"as_of\" DateTime64(0), \"at\" Nullable(DateTime64(6, 'UTC'))) ENGINE=MergeTree PARTITION BY \"as_of\" "
        "ORDER BY ()")
    delete = _precise_times(sqlglot.parse_one(delete_sql("clickhouse", "p.scores", "as_of", datetime(2026, 3, 1)),
                                              read="clickhouse"))
    assert delete.sql(dialect="clickhouse") == (
        'DELETE FROM "p"."scores" WHERE "as_of" = CAST(\'2026-03-01 00:00:00\' AS DateTime64(6))')


def test_client_kwargs():
    r = ClickHouseWarehouse(host="ch", port=8443, secure=True, password="pw", database="shop",
                            options={"settings": {"max_threads": 2}, "compress": "zstd"})
    kw = r.client_kwargs()
    assert kw["host"] == "ch" and kw["port"] == 8443 and kw["secure"] and kw["compress"] == "zstd"
    assert kw["settings"]["session_timezone"] == "UTC" and kw["settings"]["max_threads"] == 2
    chdb = ClickHouseWarehouse(interface="chdb", options={"path": "/tmp/x"}).client_kwargs()
    assert "host" not in chdb and "username" not in chdb and chdb["path"] == "/tmp/x"
