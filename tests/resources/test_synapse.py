"""Tests for habitus.resources.warehouses.synapse up to the wire: a stand-in `mssql_python` module records every
statement, serves INFORMATION_SCHEMA rows and Arrow batches and takes bulk copies, so the T-SQL,
the batching and the type mapping are checked without a server. tests/integration/
test_connector_contract.py runs the same resource against a real server when SYNAPSE_* is set."""

import sys
import types
from datetime import datetime

import pyarrow as pa
import pytest
import sqlglot

from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.synapse import TABLES_SQL, SynapseWarehouse, arrow_type, columns_sql

try:  # the real driver's own mapping of a SQLSTATE to its exception, where the synapse extra is installed
    from mssql_python.exceptions import sqlstate_to_exception
except ImportError:
    sqlstate_to_exception = None

COLUMNS = [("id", "bigint", 19, 0, None), ("Event Time", "datetime2", None, None, 7),
           ("amount", "decimal", 12, 2, None), ("note", "nvarchar", None, None, None)]
DATA = pa.table({"id": pa.array(range(10), pa.int64()),
                 "Event Time": pa.array([datetime(2026, 3, 1, i) for i in range(10)], pa.timestamp("ns")),
                 "amount": pa.array([None] + [1] * 9, pa.decimal128(12, 2)), "note": ["x"] * 10})


class FakeCursor:
    def __init__(self, state):
        self.state, self.rows = state, []

    def execute(self, sql, *a):
        self.state["log"].append(sql)
        if "[nope]" in sql and self.state.get("fail"):
            raise self.state["fail"]
        if "INFORMATION_SCHEMA.TABLES" in sql:
            if isinstance(self.state.get("tables"), Exception):
                raise self.state["tables"]
            self.rows = self.state.get("tables", [])
        elif "INFORMATION_SCHEMA" in sql:
            self.rows = [] if "'nope'" in sql else COLUMNS
        elif sql.startswith("SELECT MIN"):
            self.rows = [(datetime(2026, 3, 1), datetime(2026, 3, 1, 9))]

    def fetchall(self):
        return self.rows

    def fetchone(self):
        return self.rows[0]

    def arrow_reader(self, batch_size):
        self.state["batch_size"] = batch_size
        reader = pa.RecordBatchReader.from_batches(DATA.schema, DATA.to_batches(max_chunksize=batch_size))
        return reader

    def bulkcopy_arrow(self, table_name, source, timeout=30, **kw):
        rows = sum(len(b) for b in source)
        self.state["bulk"].append((table_name, rows))
        return {"rows_copied": rows}

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    state = {"log": [], "bulk": [], "conn": [], "commits": 0, "connect_error": None}

    def connect(conn_str, timeout=0, **kw):
        if state["connect_error"]:
            raise state["connect_error"]
        state["conn"].append((conn_str, timeout))

        def commit():
            state["log"].append("COMMIT")

        def rollback():
            state["log"].append("ROLLBACK")

        return types.SimpleNamespace(cursor=lambda: FakeCursor(state), commit=commit, rollback=rollback,
                                     close=lambda: None)

    mod = types.ModuleType("mssql_python")
    mod.connect = connect
    monkeypatch.setitem(sys.modules, "mssql_python", mod)
    return state


def _wh(**kw):
    return SynapseWarehouse(name="syn", server="ws.sql.azuresynapse.net", database="shop", username="habitus",
                            password="p;w}d=secret", authentication="SqlPassword", **kw)


@pytest.mark.parametrize("t, p, s, dtp, expected", [
    ("bigint", 19, 0, None, pa.int64()), ("int", 10, 0, None, pa.int32()), ("tinyint", 3, 0, None, pa.uint8()),
    ("bit", None, None, None, pa.bool_()), ("decimal", 38, 10, None, pa.decimal128(38, 10)),
    ("money", 19, 4, None, pa.decimal128(19, 4)), ("float", 53, None, None, pa.float64()),
    ("nvarchar", None, None, None, pa.string()), ("uniqueidentifier", None, None, None, pa.string()),
    ("date", None, None, 0, pa.date32()), ("datetime2", None, None, 7, pa.timestamp("us")),
    ("datetime", None, None, 3, pa.timestamp("ms")), ("datetimeoffset", None, None, 7, pa.timestamp("us", "UTC")),
    ("varbinary", None, None, None, pa.binary()),
])
def test_arrow_type(t, p, s, dtp, expected):
    assert arrow_type("c", t, p, s, dtp) == expected


def test_unmapped_type():
    with pytest.raises(WarehouseError, match="'g'.*geography"):
        arrow_type("g", "geography")


def test_columns_sql_escapes_names_as_literals():
    sql = columns_sql("dbo.o'hara")
    assert "TABLE_NAME = 'o''hara'" in sql and "TABLE_SCHEMA = 'dbo'" in sql
    assert "TABLE_SCHEMA = SCHEMA_NAME()" in columns_sql("events")
    assert len(sqlglot.parse(sql, read="tsql")) == 1


def test_connection_string_braces_values_with_separators(fake):
    cs = _wh(options={"TrustServerCertificate": "no"}).connection_string()
    assert cs == ("Server=tcp:ws.sql.azuresynapse.net,1433;Database=shop;Encrypt=yes;Uid=habitus;"
                  "Pwd={p;w}}d=secret};Authentication=SqlPassword;TrustServerCertificate=no")


def test_read_sends_tsql_and_streams_batches(fake):
    batches = list(_wh().read("dbo.events", ["id", "Event Time", "amount", "note"], "Event Time", datetime(2026, 3, 1),
                              datetime(2026, 4, 1), batch_rows=4))
    assert fake["log"][1] == ("SELECT [id], [Event Time], [amount], [note] FROM [dbo].[events] WHERE [Event Time] >= "
                              "CAST('2026-03-01 00:00:00' AS DATETIME2) AND [Event Time] < "
                              "CAST('2026-04-01 00:00:00' AS DATETIME2)")
    assert fake["batch_size"] == 4 and [len(b) for b in batches] == [4, 4, 2]
    # the stand-in sends ns timestamps; the described schema (datetime2 -> us) wins
    assert batches[0].schema.names == ["id", "Event Time", "amount", "note"]
    assert batches[0].schema.field("Event Time").type == pa.timestamp("us")


def test_time_range_and_missing_table(fake):
    assert _wh().time_range("events", "Event Time") == (datetime(2026, 3, 1), datetime(2026, 3, 1, 9))
    assert fake["log"][-1] == "SELECT MIN([Event Time]), MAX([Event Time]) FROM [events]"
    with pytest.raises(WarehouseError,
                       match="table 'nope' in synapse connection 'syn' at ws.sql.azuresynapse.net:1433: not found"):
        _wh().schema("nope")


# (schema, table, SCHEMA_NAME()) as INFORMATION_SCHEMA.TABLES answers TABLES_SQL
TABLES = [("dbo", "customers", "dbo"), ("dbo", "events", "dbo"), ("dbo", "v_events", "dbo"), ("stage", "raw", "dbo")]


def test_tables_lists_tables_and_views_of_the_database(fake):
    fake["tables"] = TABLES
    assert _wh().tables() == ["customers", "events", "v_events", "stage.raw"]
    assert fake["log"] == [TABLES_SQL]
    assert TABLES_SQL == ("SELECT TABLE_SCHEMA, TABLE_NAME, SCHEMA_NAME() FROM INFORMATION_SCHEMA.TABLES "
                          "ORDER BY TABLE_SCHEMA, TABLE_NAME")
    assert sqlglot.parse_one(TABLES_SQL, read="tsql").sql("tsql") == TABLES_SQL  # valid T-SQL as written


def test_a_missing_table_lists_the_tables_there_on_the_same_cursor(fake):
    fake["tables"] = TABLES
    with pytest.raises(WarehouseError) as err:
        _wh().schema("nope")
    assert str(err.value) == ("table 'nope' in synapse connection 'syn' at ws.sql.azuresynapse.net:1433: "
                              "not found (INFORMATION_SCHEMA.COLUMNS has no columns for it); "
                              "the tables there: customers, events, v_events, stage.raw")
    assert fake["log"][-1] == TABLES_SQL and len(fake["conn"]) == 1


def _invalid_object(name: str) -> Exception:
    """SQL Server's error 208 as the real driver raises it (mssql_python maps SQLSTATE 42S02 to its
    ProgrammingError) when it is installed, else as its text."""
    text = f"[Microsoft][ODBC Driver 18 for SQL Server][SQL Server]Invalid object name '{name}'. (208)"
    if sqlstate_to_exception is None:
        return RuntimeError(f"Driver Error: Base table or view not found; DDBC Error: {text}")
    error = sqlstate_to_exception("42S02", text)
    assert type(error).__name__ == "ProgrammingError"
    return error


def test_a_missing_table_in_a_query_lists_the_tables_there(fake):
    fake["tables"], fake["fail"] = TABLES, _invalid_object("nope")
    with pytest.raises(WarehouseError) as err:
        _wh().time_range("nope", "ts")
    text = str(err.value)
    assert text.startswith("table 'nope' in synapse connection 'syn' at ws.sql.azuresynapse.net:1433: ")
    assert "Invalid object name 'nope'" in text
    assert text.endswith("; the tables there: customers, events, v_events, stage.raw"), text
    assert fake["log"][-1] == TABLES_SQL and len(fake["conn"]) == 2  # listed on a connection of its own


def test_a_failed_listing_leaves_the_missing_table_error_as_it_was(fake):
    fake["tables"], fake["fail"] = RuntimeError("permission denied on INFORMATION_SCHEMA"), _invalid_object("nope")
    with pytest.raises(WarehouseError) as err:
        _wh().time_range("nope", "ts")
    text = str(err.value)
    assert "Invalid object name 'nope'" in text and "tables there" not in text and "permission" not in text
    with pytest.raises(WarehouseError) as err:
        _wh().schema("nope")
    assert str(err.value).endswith("(INFORMATION_SCHEMA.COLUMNS has no columns for it)")


SCORES = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.timestamp("s"))])


def _scores():
    return pa.table({"customer_id": ["a", "b", "c"], "score": [0.1, 0.2, 0.3],
                     "as_of": pa.array([datetime(2026, 3, 1)] * 3, pa.timestamp("s"))}, schema=SCORES)


def test_write_stages_then_replaces_in_one_transaction(fake):
    assert _wh().write("dbo.scores", iter(_scores().to_batches(max_chunksize=2)), SCORES,
                       replace=("as_of", datetime(2026, 3, 1))) == 3
    create, create_stage, commit, commit_load, delete, insert, commit2, drop, commit3 = fake["log"]
    assert create.startswith("IF NOT EXISTS (SELECT * FROM INFORMATION_SCHEMA.TABLES WHERE TABLE_NAME = 'scores' AND "
                             "TABLE_SCHEMA = 'dbo') EXEC('CREATE TABLE [dbo].[scores] ([customer_id] NVARCHAR(MAX), "
                             "[score] FLOAT, [as_of] DATETIME2)')")
    [(staged_into, rows)] = fake["bulk"]
    assert rows == 3 and staged_into.startswith("[dbo].[_habitus_stage_") and staged_into in create_stage
    assert delete == "DELETE FROM [dbo].[scores] WHERE [as_of] = CAST('2026-03-01 00:00:00' AS DATETIME2)"
    assert insert == (f"INSERT INTO [dbo].[scores] ([customer_id], [score], [as_of]) "
                      f"SELECT [customer_id], [score], [as_of] FROM {staged_into}")
    assert (commit, commit_load, commit2, commit3) == ("COMMIT",) * 4 and drop == f"DROP TABLE {staged_into}"


def test_a_failed_load_never_deletes_the_previous_rows(fake):
    def broken():
        yield from _scores().to_batches(max_chunksize=2)[:1]
        raise RuntimeError("the scoring run died half way")

    with pytest.raises(WarehouseError, match="half way"):
        _wh().write("dbo.scores", broken(), SCORES, replace=("as_of", datetime(2026, 3, 1)))
    assert not any(sql.startswith(("DELETE", "INSERT")) for sql in fake["log"])
    assert fake["log"][-2].startswith("DROP TABLE [dbo].[_habitus_stage_")  # the staging table is dropped


def test_bad_connection_hides_the_password(fake):
    fake["connect_error"] = RuntimeError("Login failed for user 'habitus' (Pwd=p;w}d=secret)")
    with pytest.raises(WarehouseError) as err:
        _wh().schema("events")
    text = str(err.value)
    assert "'syn'" in text and "ws.sql.azuresynapse.net:1433" in text and "p;w}d=secret" not in text
