"""Tests for habitus.resources.warehouses.databricks up to the wire: a stand-in `databricks.sql` module records every
statement and serves Arrow results, so the SQL per dialect, the batching and the type mapping are
checked without a workspace. tests/integration/test_connector_contract.py runs the same resource
against a real SQL warehouse when DATABRICKS_* variables are set."""

import sys
import types
from datetime import datetime

import dagster as dg
import pyarrow as pa
import pytest
import sqlglot

from habitus.resources.warehouses.databricks import DatabricksWarehouse, arrow_type, tables_sql, values_sql
from habitus.resources.warehouses.errors import WarehouseError

DATA = pa.table({"id": pa.array(range(10), pa.int32()), "ts": pa.array([datetime(2026, 3, 1, i) for i in range(10)],
                                                                      pa.timestamp("us")),
                 "amount": pa.array([None] + [1] * 9, pa.decimal128(12, 2))})
DESCRIPTION = [("id", "bigint", None, None, None, None, True), ("ts", "timestamp_ntz", None, None, None, None, True),
               ("amount", "decimal", None, None, 12, 2, True)]


try:  # the real driver's error of a failed statement, where the databricks extra is installed
    from databricks.sql.exc import ServerOperationError
except ImportError:
    ServerOperationError = None


def _not_found(name: str) -> Exception:
    """A missing table as Databricks reports it: the real driver's ServerOperationError when installed."""
    text = (f"[TABLE_OR_VIEW_NOT_FOUND] The table or view `{name}` cannot be found. Verify the spelling and "
            f"correctness of the schema and catalog.\nSQLSTATE: 42P01; line 1 pos 14")
    if ServerOperationError is None:
        return RuntimeError(text)
    return ServerOperationError(text, {"diagnostic-info": "org.apache.spark.sql.AnalysisException ..."})


class FakeCursor:
    def __init__(self, log, fail=None, tables=()):
        self.log, self.description, self._rest, self.fail, self.tables = log, None, None, fail, tables
        self.fetch_sizes = []

    def execute(self, sql, *a):
        self.log.append(sql)
        if sql.startswith("SHOW TABLES"):
            if isinstance(self.tables, Exception):
                raise self.tables
            self._all = list(self.tables)
            return
        if self.fail and self.fail in sql:
            raise _not_found(self.fail)
        if sql.endswith("LIMIT 0") or sql.startswith("SELECT"):
            self.description = DESCRIPTION
            self._rest = DATA
        if sql.startswith("SELECT MIN"):
            self._row = (datetime(2026, 3, 1), datetime(2026, 3, 1, 9))

    def fetchone(self):
        return self._row

    def fetchall(self):
        return self._all

    def fetchmany_arrow(self, n):
        self.fetch_sizes.append(n)
        out, self._rest = self._rest.slice(0, n), self._rest.slice(n)
        return out

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    state = {"log": [], "kwargs": [], "fail": None, "connect_error": None, "tables": ()}

    def connect(**kw):
        if state["connect_error"]:
            raise state["connect_error"]
        state["kwargs"].append(kw)
        con = types.SimpleNamespace(close=lambda: None)
        con.cursor = lambda: FakeCursor(state["log"], state["fail"], state["tables"])
        return con

    sql_mod = types.ModuleType("databricks.sql")
    sql_mod.connect = connect
    pkg = types.ModuleType("databricks")
    pkg.sql = sql_mod
    monkeypatch.setitem(sys.modules, "databricks", pkg)
    monkeypatch.setitem(sys.modules, "databricks.sql", sql_mod)
    return state


def _wh(**kw):
    return DatabricksWarehouse(name="dbx", server_hostname="adb-1.azuredatabricks.net",
                               http_path="/sql/1.0/warehouses/abc", access_token="dapi-secret-token",
                               catalog="main", schema_name="shop", **kw)


@pytest.mark.parametrize("code, p, s, expected", [
    ("bigint", None, None, pa.int64()), ("int", None, None, pa.int32()), ("string", None, None, pa.string()),
    ("decimal", 12, 2, pa.decimal128(12, 2)), ("timestamp", None, None, pa.timestamp("us", "UTC")),
    ("timestamp_ntz", None, None, pa.timestamp("us")), ("boolean", None, None, pa.bool_()),
    ("date", None, None, pa.date32()), ("double", None, None, pa.float64()), ("binary", None, None, pa.binary()),
])
def test_arrow_type(code, p, s, expected):
    assert arrow_type("c", code, p, s) == expected


def test_unmapped_type():
    with pytest.raises(WarehouseError, match="'m'.*map"):
        arrow_type("m", "map")


def test_read_sends_pushed_down_sql_and_streams_batches(fake, monkeypatch):
    monkeypatch.setenv("HABITUS_TEST_DBX_TOKEN", "dapi-from-env")
    wh = _wh().model_copy(update={"access_token": dg.EnvVar("HABITUS_TEST_DBX_TOKEN")})
    batches = list(wh.read("main.shop.events", ["id", "ts", "amount"], "ts", datetime(2026, 3, 1),
                           datetime(2026, 4, 1), batch_rows=4))
    assert fake["kwargs"][0]["access_token"] == "dapi-from-env"
    assert fake["kwargs"][0]["session_configuration"] == {"TIMEZONE": "UTC"}
    assert fake["kwargs"][0]["schema"] == "shop" and fake["kwargs"][0]["catalog"] == "main"
    assert fake["log"] == [
        "SELECT `id`, `ts`, `amount` FROM `main`.`shop`.`events` LIMIT 0",
        "SELECT `id`, `ts`, `amount` FROM `main`.`shop`.`events` WHERE `ts` >= CAST('2026-03-01 00:00:00' AS "
        "TIMESTAMP) AND `ts` < CAST('2026-04-01 00:00:00' AS TIMESTAMP)"]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert all(b.schema.field("id").type == pa.int64() for b in batches)  # int32 chunk cast to the described type
    assert pa.Table.from_batches(batches).column("amount").null_count == 1


def test_time_range(fake):
    assert _wh().time_range("events", "ts") == (datetime(2026, 3, 1), datetime(2026, 3, 1, 9))
    assert fake["log"][-1] == "SELECT MIN(`ts`), MAX(`ts`) FROM `events`"


def test_values_sql_is_one_statement_with_typed_literals():
    sql = values_sql("s.scores", ["customer_id", "as_of", "n"],
                     [("x'); DROP TABLE y; --", datetime(2026, 3, 1), 2**62), (None, None, None)])
    assert len(sqlglot.parse(sql, read="databricks")) == 1
    assert sql.startswith("INSERT INTO `s`.`scores` (`customer_id`, `as_of`, `n`) VALUES")
    assert "CAST('2026-03-01 00:00:00' AS TIMESTAMP_NTZ)" in sql and "4611686018427387904" in sql


def test_write_without_volume_deletes_then_inserts_in_chunks(fake):
    schema = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.timestamp("s"))])
    t = pa.table({"customer_id": [f"C{i}" for i in range(5)], "score": [0.5] * 5,
                  "as_of": pa.array([datetime(2026, 3, 1)] * 5, pa.timestamp("s"))}, schema=schema)
    assert _wh().write("scores", iter(t.to_batches(max_chunksize=3)), schema, replace=("as_of", datetime(2026, 3, 1)),
                       insert_rows=2) == 5
    log = fake["log"]
    assert log[0] == "CREATE TABLE IF NOT EXISTS `scores` (`customer_id` STRING, `score` DOUBLE, `as_of` TIMESTAMP_NTZ)"
    assert log[1] == "DELETE FROM `scores` WHERE `as_of` = CAST('2026-03-01 00:00:00' AS TIMESTAMP)"
    assert [s.count("CAST(") for s in log[2:]] == [2, 2, 1]  # 5 rows in chunks of 2


def test_write_with_volume_is_put_then_one_replace_where(fake):
    schema = pa.schema([("customer_id", pa.string()), ("as_of", pa.timestamp("s"))])
    t = pa.table({"customer_id": ["a", "b"], "as_of": pa.array([datetime(2026, 3, 1)] * 2, pa.timestamp("s"))},
                 schema=schema)
    wh = _wh(staging_volume="/Volumes/main/shop/stage")
    assert wh.write("scores", iter(t.to_batches()), schema, replace=("as_of", datetime(2026, 3, 1))) == 2
    assert fake["kwargs"][0]["staging_allowed_local_path"]
    put, insert, remove = fake["log"][1], fake["log"][2], fake["log"][3]
    assert put.startswith("PUT '/") and "INTO '/Volumes/main/shop/stage/habitus-" in put and put.endswith("OVERWRITE")
    assert insert.startswith("INSERT INTO `scores` REPLACE WHERE `as_of` = CAST('2026-03-01 00:00:00' AS TIMESTAMP) "
                             "SELECT `customer_id`, `as_of` FROM parquet.`/Volumes/main/shop/stage/habitus-")
    assert remove.startswith("REMOVE '/Volumes/main/shop/stage/habitus-")


def test_missing_table_and_bad_connection(fake):
    fake["fail"] = "nope"
    with pytest.raises(WarehouseError, match="table 'nope' in databricks connection 'dbx'.*cannot be found"):
        _wh().schema("nope")
    fake["connect_error"] = RuntimeError("401 Unauthorized for token dapi-secret-token")
    with pytest.raises(WarehouseError) as err:
        _wh().schema("events")
    text = str(err.value)
    assert "'dbx'" in text and "adb-1.azuredatabricks.net" in text and "dapi-secret-token" not in text


# SHOW TABLES IN main.shop: (namespace, tableName, isTemporary)
TABLES = [("shop", "events", False), ("shop", "customers", False), ("shop", "v_daily", False)]


def test_tables_is_show_tables_of_the_configured_schema(fake):
    fake["tables"] = TABLES
    assert _wh().tables() == ["customers", "events", "v_daily"]
    assert fake["log"] == ["SHOW TABLES IN `main`.`shop`"]
    assert tables_sql(None, "shop") == "SHOW TABLES IN `shop`" and tables_sql("main", None) == "SHOW TABLES"


def test_a_missing_table_lists_the_tables_there(fake):
    fake["fail"], fake["tables"] = "evnts", TABLES
    with pytest.raises(WarehouseError) as err:
        list(_wh().read("evnts", ["id"]))
    text = str(err.value)
    assert text.startswith("table 'evnts' in databricks connection 'dbx' at adb-1.azuredatabricks.net: "
                           "[TABLE_OR_VIEW_NOT_FOUND] The table or view `evnts` cannot be found"), text
    assert text.endswith("; the tables there: customers, events, v_daily"), text
    assert fake["log"][-1] == "SHOW TABLES IN `main`.`shop`" and len(fake["kwargs"]) == 2


def test_a_failed_listing_leaves_the_missing_table_error_as_it_was(fake):
    fake["fail"], fake["tables"] = "evnts", RuntimeError("[INSUFFICIENT_PERMISSIONS] no USE SCHEMA")
    with pytest.raises(WarehouseError) as err:
        _wh().time_range("evnts", "ts")
    text = str(err.value)
    assert "TABLE_OR_VIEW_NOT_FOUND" in text and "tables there" not in text and "PERMISSIONS" not in text
