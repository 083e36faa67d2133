"""Tests for habitus.resources.warehouses.sql: quoting, qualified names, the [start, end) filter, dialect output."""

from datetime import datetime

import duckdb
import pytest
import sqlglot
from sqlglot import exp

from habitus.resources.warehouses.sql import delete_sql, range_sql, select_sql, table_expr

HOSTILE = 'x"; DROP TABLE y; --'
HOSTILE_BQ = "a`b; DROP TABLE y; --"
MARCH, APRIL = datetime(2026, 3, 1), datetime(2026, 4, 1)


def _hostile_db(tmp_path):
    con = duckdb.connect(str(tmp_path / "h.duckdb"))
    q = '"' + HOSTILE.replace('"', '""') + '"'
    con.execute(f"CREATE TABLE {q} ({q} INTEGER, ts TIMESTAMP)")
    con.execute(f"INSERT INTO {q} VALUES (1, '2026-02-28 23:59:59'), (2, '2026-03-01 00:00:00'), "
                f"(3, '2026-03-31 23:59:59'), (4, '2026-04-01 00:00:00')")
    con.execute("CREATE TABLE y (v INTEGER)")
    con.execute("INSERT INTO y VALUES (42)")
    return con


def test_hostile_names_are_one_quoted_identifier():
    sql = select_sql("duckdb", HOSTILE, [HOSTILE], HOSTILE, MARCH, APRIL)
    statements = sqlglot.parse(sql, read="duckdb")
    assert len(statements) == 1
    q = statements[0]
    assert isinstance(q, exp.Select)
    assert q.find(exp.Table).name == HOSTILE
    assert [c.name for c in q.expressions] == [HOSTILE]
    assert all(i.quoted for i in q.find_all(exp.Identifier))
    assert q.find(exp.Drop) is None


def test_hostile_names_executed_on_duckdb(tmp_path):
    con = _hostile_db(tmp_path)
    rows = con.execute(select_sql("duckdb", HOSTILE, [HOSTILE], "ts", MARCH, APRIL)).fetchall()
    assert rows == [(2,), (3,)]
    lo, hi = con.execute(range_sql("duckdb", HOSTILE, "ts")).fetchall()[0]
    assert (lo, hi) == (datetime(2026, 2, 28, 23, 59, 59), datetime(2026, 4, 1))
    con.execute(delete_sql("duckdb", HOSTILE, HOSTILE, 1))
    con.execute(delete_sql("duckdb", HOSTILE, "ts", datetime(2026, 4, 1)))
    assert con.execute(select_sql("duckdb", HOSTILE, [HOSTILE])).fetchall() == [(2,), (3,)]
    assert con.execute("SELECT v FROM y").fetchall() == [(42,)]  # y survived every statement
    con.close()


def test_hostile_string_value_is_a_literal(tmp_path):
    con = _hostile_db(tmp_path)
    con.execute("CREATE TABLE t (tag VARCHAR)")
    con.execute("INSERT INTO t VALUES ('keep'), ('x''; DROP TABLE y; --')")
    con.execute(delete_sql("duckdb", "t", "tag", "x'; DROP TABLE y; --"))
    assert con.execute("SELECT tag FROM t").fetchall() == [("keep",)]
    assert con.execute("SELECT v FROM y").fetchall() == [(42,)]
    con.close()


def test_time_filter_is_half_open():
    q = sqlglot.parse_one(select_sql("duckdb", "t", ["a"], "ts", MARCH, APRIL), read="duckdb")
    where = q.args["where"].this
    assert isinstance(where, exp.And)
    ge, lt = where.this, where.expression
    assert isinstance(ge, exp.GTE) and ge.this.name == "ts" and "2026-03-01 00:00:00" in ge.expression.sql()
    assert isinstance(lt, exp.LT) and lt.this.name == "ts" and "2026-04-01 00:00:00" in lt.expression.sql()


def test_open_ended_filters_and_star():
    assert "WHERE" not in select_sql("duckdb", "t")
    assert select_sql("duckdb", "t").startswith("SELECT *")
    only_start = sqlglot.parse_one(select_sql("duckdb", "t", None, "ts", start=MARCH), read="duckdb")
    assert isinstance(only_start.args["where"].this, exp.GTE)
    only_end = sqlglot.parse_one(select_sql("duckdb", "t", None, "ts", end=APRIL), read="duckdb")
    assert isinstance(only_end.args["where"].this, exp.LT)
    # a window without a time column filters nothing
    assert "WHERE" not in select_sql("duckdb", "t", ["a"], None, MARCH, APRIL)


@pytest.mark.parametrize("name, parts", [
    ("t", ("", "", "t")),
    ("s.t", ("", "s", "t")),
    ("db.s.t", ("db", "s", "t")),
])
def test_qualified_names(name, parts):
    t = table_expr(name)
    assert (t.catalog, t.db, t.name) == parts
    assert all(i.quoted for i in t.find_all(exp.Identifier))


@pytest.mark.parametrize("bad", ["a.b.c.d", "a..b", ".t", "t.", ""])
def test_bad_qualified_names_refused(bad):
    with pytest.raises(ValueError, match="table name"):
        table_expr(bad)


def test_qualified_name_executes_on_duckdb(tmp_path):
    con = duckdb.connect(str(tmp_path / "cat.duckdb"))
    con.execute("CREATE SCHEMA sales")
    con.execute("CREATE TABLE sales.orders (id INTEGER)")
    con.execute("INSERT INTO sales.orders VALUES (7)")
    assert con.execute(select_sql("duckdb", "cat.sales.orders", ["id"])).fetchall() == [(7,)]
    assert con.execute(select_sql("duckdb", "sales.orders", ["id"])).fetchall() == [(7,)]
    con.close()


@pytest.mark.parametrize("dialect", ["snowflake", "bigquery", "duckdb"])
@pytest.mark.parametrize("table", ["db.sch.events", "db.sch." + HOSTILE, "db.sch." + HOSTILE_BQ, "o'hara"])
def test_dialect_output_parses_back(dialect, table):
    column = table.split(".")[-1]
    sql = select_sql(dialect, table, [column, "price"], "event time", MARCH, APRIL)
    statements = sqlglot.parse(sql, read=dialect)
    assert len(statements) == 1
    q = statements[0]
    t = q.find(exp.Table)
    expected = table.split(".")
    assert [p for p in (t.catalog, t.db, t.name) if p] == expected
    assert [c.name for c in q.expressions] == [column, "price"]
    cols = {c.name for c in q.args["where"].find_all(exp.Column)}
    assert cols == {"event time"}
    for other in (range_sql(dialect, table, "event time"), delete_sql(dialect, table, "as_of", "2026-03-01")):
        assert len(sqlglot.parse(other, read=dialect)) == 1
        assert sqlglot.parse_one(other, read=dialect).find(exp.Table).name == expected[-1]


def test_dialect_specific_quoting():
    assert select_sql("snowflake", "DB.SCH.T", ["A"]) == 'SELECT "A" FROM "DB"."SCH"."T"'
    assert select_sql("bigquery", "proj.ds.t", ["a"]) == "SELECT `a` FROM `proj`.`ds`.`t`"


def test_literals():
    assert delete_sql("duckdb", "t", "n", 3).endswith('"n" = 3')
    assert "CAST('2026-03-01 12:30:00' AS TIMESTAMP)" in delete_sql("duckdb", "t", "ts", datetime(2026, 3, 1, 12, 30))
    assert delete_sql("duckdb", "t", "d", "2026-03-01").endswith("'2026-03-01'")


def test_time_filter_keeps_sub_second_bounds(tmp_path):
    con = duckdb.connect(str(tmp_path / "us.duckdb"))
    con.execute("CREATE TABLE t (id INTEGER, ts TIMESTAMP)")
    con.execute("INSERT INTO t VALUES (1, '2026-03-01 00:00:00.2'), (2, '2026-03-01 00:00:00.7')")
    start = datetime(2026, 3, 1, 0, 0, 0, 500_000)
    rows = con.execute(select_sql("duckdb", "t", ["id"], "ts", start, APRIL)).fetchall()
    con.close()
    assert rows == [(2,)]


# --------------------------------------------------------------------------- what the new-data sensors ask


@pytest.mark.parametrize("dialect, month, day", [
    ("snowflake", "DATE_TRUNC('MONTH', \"ts\")", "DATE_TRUNC('DAY', \"ts\")"),
    ("bigquery", "DATE_TRUNC(DATE(`ts`), MONTH)", "DATE(`ts`)"),  # DATE() takes TIMESTAMP, DATETIME and DATE
    ("clickhouse", 'toStartOfMonth("ts")', 'toDate("ts")'),
    ("hive", "TRUNC(`ts`, 'MM')", "TO_DATE(`ts`)"),  # Hive has no DATE_TRUNC
    ("databricks", "DATE_TRUNC('MONTH', `ts`)", "DATE_TRUNC('DAY', `ts`)"),
    ("tsql", "DATEFROMPARTS(YEAR([ts]), MONTH([ts]), 1)", "CAST([ts] AS DATE)"),  # no DATETRUNC on Synapse
])
def test_partition_counts_sql_per_dialect(dialect, month, day):
    from habitus.resources.warehouses.sql import freshness_sql, partition_counts_sql

    for grain, period in (("month", month), ("day", day)):
        sql = partition_counts_sql(dialect, "shop.events", "ts", grain)
        assert sql.startswith(f"SELECT {period} AS period, COUNT(*), MAX(")
        assert sql.endswith(f"GROUP BY {period}")  # by the expression: T-SQL has no GROUP BY 1
        assert len(sqlglot.parse(sql, read=dialect)) == 1
    assert freshness_sql(dialect, "shop.events", "ts").startswith("SELECT COUNT(*), MAX(")
    with pytest.raises(ValueError, match="grain"):
        partition_counts_sql(dialect, "shop.events", "ts", "week")


def test_period_counts_parse_what_drivers_send():
    from datetime import date, timezone

    from habitus.resources.warehouses.remote import period_counts

    rows = [("2026-03-01", 5, "2026-03-31 23:00:00.5"), (date(2026, 4, 1), 2, datetime(2026, 4, 2, 1, tzinfo=timezone.utc))]
    assert period_counts(rows) == {datetime(2026, 3, 1): (5, datetime(2026, 3, 31, 23, 0, 0, 500000)),
                                   datetime(2026, 4, 1): (2, datetime(2026, 4, 2, 1))}
