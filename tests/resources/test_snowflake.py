"""Tests for habitus.resources.warehouses.snowflake up to the wire: type mapping and the SQL it sends. The real
connector against a server is tested in tests/integration/test_connector_contract.py and
test_snowflake_connector.py."""

import pyarrow as pa
import pytest
import sqlglot
from sqlglot import exp

from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.snowflake import SnowflakeWarehouse, arrow_type
from habitus.resources.warehouses.sql import create_table_sql, limit0_sql, select_sql


@pytest.mark.parametrize("code, precision, scale, expected", [
    ("FIXED", 38, 0, pa.int64()),
    ("FIXED", 10, 2, pa.decimal128(10, 2)),
    ("FIXED", 38, 12, pa.decimal128(38, 12)),
    ("REAL", None, None, pa.float64()),
    ("TEXT", None, None, pa.string()),
    ("VARIANT", None, None, pa.string()),
    ("BOOLEAN", None, None, pa.bool_()),
    ("DATE", None, None, pa.date32()),
    ("BINARY", None, None, pa.binary()),
    ("TIMESTAMP_NTZ", 0, 9, pa.timestamp("ns")),
    ("TIMESTAMP_NTZ", 0, 6, pa.timestamp("us")),
    ("TIMESTAMP_NTZ", 0, 3, pa.timestamp("ms")),
    ("TIMESTAMP_NTZ", 0, 0, pa.timestamp("s")),
    ("TIMESTAMP_TZ", 0, 9, pa.timestamp("ns", "UTC")),
    ("TIMESTAMP_LTZ", 0, 6, pa.timestamp("us", "UTC")),
])
def test_arrow_type(code, precision, scale, expected):
    assert arrow_type("c", code, precision, scale) == expected


def test_unmapped_type_names_the_column():
    with pytest.raises(WarehouseError, match="'shape'.*VECTOR"):
        arrow_type("shape", "VECTOR", None, None)


def test_sql_is_quoted_and_pushed_down():
    from datetime import datetime

    sql = select_sql("snowflake", "SHOP.PUBLIC.events", ["customer_id", "Event Time"], "Event Time",
                     datetime(2026, 3, 1), datetime(2026, 4, 1))
    assert sql == ('SELECT "customer_id", "Event Time" FROM "SHOP"."PUBLIC"."events" WHERE "Event Time" >= '
                   "CAST('2026-03-01 00:00:00' AS TIMESTAMP) AND \"Event Time\" < CAST('2026-04-01 00:00:00' AS TIMESTAMP)")
    assert limit0_sql("snowflake", 'x"y', ["a"]) == 'SELECT "a" FROM "x""y" LIMIT 0'


def test_create_table_types_round_trip():
    schema = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.timestamp("s")),
                        ("at", pa.timestamp("us", "UTC")), ("n", pa.int64()), ("amount", pa.decimal128(12, 2)),
                        ("ok", pa.bool_()), ("day", pa.date32())])
    sql = create_table_sql("snowflake", "S.scores", schema)
    create = sqlglot.parse_one(sql, read="snowflake")
    types = {c.name: c.args["kind"].sql("snowflake") for c in create.find_all(exp.ColumnDef)}
    assert types == {"customer_id": "VARCHAR", "score": "DOUBLE", "as_of": "TIMESTAMPNTZ", "at": "TIMESTAMPTZ",
                     "n": "BIGINT", "amount": "DECIMAL(12, 2)", "ok": "BOOLEAN", "day": "DATE"}
    assert sql.startswith('CREATE TABLE IF NOT EXISTS "S"."scores"')


def test_connect_kwargs_keep_user_session_parameters():
    r = SnowflakeWarehouse(account="a", options={"session_parameters": {"QUERY_TAG": "habitus"}, "login_timeout": 5})
    kw = r.connect_kwargs()
    assert kw["session_parameters"] == {"QUERY_TAG": "habitus", "TIMEZONE": "UTC"}
    assert kw["login_timeout"] == 5 and "password" not in kw
