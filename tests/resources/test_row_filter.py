"""A source's `where:` row filter (resources/warehouses/row_filter.py): pushed into DuckDB's query and the Parquet
scan with the same rows back, written for every dialect, and refused where it is not a plain condition."""

from datetime import datetime, timedelta
from decimal import Decimal

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sqlglot

from habitus.resources.warehouses import row_filter
from habitus.resources.warehouses.duckdb import DuckDBWarehouse
from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.parquet import ParquetWarehouse
from habitus.resources.warehouses.sql import select_sql

T0 = datetime(2026, 3, 1)
N = 40


def _rows() -> list[dict]:
    return [{"id": i, "country": [None, "PL", "DE", "pl"][i % 4], "is_test": i % 5 == 0,
             "price": i / 4, "amount": None if i % 7 == 3 else Decimal(i * 3) / 2, "name": f"{'Ab' if i % 3 else 'xy'}-{i}",
             "ts": T0 + timedelta(hours=13 * i), "unit price": float(i % 6)} for i in range(N)]


TABLE = pa.Table.from_pylist(_rows(), schema=pa.schema([
    ("id", pa.int64()), ("country", pa.string()), ("is_test", pa.bool_()), ("price", pa.float64()),
    ("amount", pa.decimal128(12, 2)), ("name", pa.string()), ("ts", pa.timestamp("us")), ("unit price", pa.float64())]))

# filter -> the ids it keeps, said in Python
CASES = {
    "country = 'PL' AND NOT is_test": lambda r: r["country"] == "PL" and not r["is_test"],
    "country IN ('PL', 'DE') OR country IS NULL": lambda r: r["country"] in ("PL", "DE", None),
    "country IS NOT NULL AND country <> 'PL'": lambda r: r["country"] not in (None, "PL"),
    "LOWER(country) = 'pl'": lambda r: r["country"] in ("PL", "pl"),
    "name LIKE 'Ab-1%'": lambda r: r["name"].startswith("Ab-1"),
    "price BETWEEN 2 AND 5.5 AND id != 12": lambda r: 2 <= r["price"] <= 5.5 and r["id"] != 12,
    "3 < price": lambda r: r["price"] > 3,
    "amount > 20.5": lambda r: r["amount"] is not None and r["amount"] > Decimal("20.5"),
    "ts >= '2026-03-05 12:00:00' AND ts < DATE '2026-03-10'":
        lambda r: datetime(2026, 3, 5, 12) <= r["ts"] < datetime(2026, 3, 10),
    "ts < TIMESTAMP '2026-03-03 01:00:00' OR id IN (-1, 39)": lambda r: r["ts"] < datetime(2026, 3, 3, 1) or r["id"] == 39,
    '"unit price" >= 4 AND NOT (is_test OR price > 8)': lambda r: r["unit price"] >= 4 and not (r["is_test"] or r["price"] > 8),
}


@pytest.fixture(scope="module")
def warehouses(tmp_path_factory):
    folder = tmp_path_factory.mktemp("filters")
    pq.write_table(TABLE, folder / "events.parquet", row_group_size=8)  # several row groups to skip
    con = duckdb.connect(str(folder / "wh.duckdb"))
    con.register("incoming", TABLE)
    con.sql("CREATE TABLE events AS SELECT * FROM incoming")
    con.close()
    return DuckDBWarehouse(path=str(folder / "wh.duckdb")), ParquetWarehouse(path=str(folder))


def _ids(wh, where, **kw) -> list[int]:
    return sorted(pa.Table.from_batches(list(wh.read("events", ["id"], where=where, **kw)), schema=pa.schema(
        [("id", pa.int64())])).column("id").to_pylist())


@pytest.mark.parametrize("where", list(CASES))
def test_duckdb_and_parquet_read_the_rows_the_filter_keeps(warehouses, where):
    want = [r["id"] for r in _rows() if CASES[where](r)]
    assert want and len(want) < N  # each case keeps some rows and drops others
    for wh in warehouses:
        assert _ids(wh, where) == want, type(wh).__name__


def test_the_filter_and_the_time_window_apply_together(warehouses):
    start, end = T0 + timedelta(days=3), T0 + timedelta(days=12)
    want = [r["id"] for r in _rows() if start <= r["ts"] < end and r["country"] == "PL"]
    assert want
    for wh in warehouses:
        assert _ids(wh, "country = 'PL'", time_column="ts", start=start, end=end) == want


def test_parquet_skips_row_groups_the_filter_excludes(warehouses, monkeypatch):
    _, parquet = warehouses
    batches = list(parquet.read("events", ["id"], where="id >= 32"))
    assert sum(len(b) for b in batches) == 8 and len(batches) == 1  # one row group of 8 read, four skipped


def test_a_filter_parquet_cannot_type_names_the_table(warehouses):
    _, parquet = warehouses
    with pytest.raises(WarehouseError, match=r"table 'events'.*`where: price = 'cheap'`.*'cheap' cannot be compared with a column of type double"):
        list(parquet.read("events", ["id"], where="price = 'cheap'"))
    with pytest.raises(WarehouseError, match=r"column 'nope' not found"):
        list(parquet.read("events", ["id"], where="nope = 1"))


@pytest.mark.parametrize("where, says", [
    ("id = 1; DROP TABLE events", "one expression"),
    ("id IN (SELECT id FROM events)", "not a subquery"),
    ("id = (SELECT max(id) FROM events)", "a subquery is not allowed"),
    ("DROP TABLE events", "DROP"),
    ("id = 1 UNION SELECT 1", "UNION"),
    ("EXISTS (SELECT 1)", "EXISTS"),
    ("current_user() = 'x'", "CURRENT_USER"),
    ("SUBSTR(name, 1, 2) = 'Ab'", "SUBSTRING"),
    ("events.id = 1", "without a table"),
    ("CAST(id AS TEXT) = '1'", "only DATE"),
    ("name LIKE country", "LIKE takes a string pattern"),
    ("id IN (1, price)", "literal values"),
    ("country IS TRUE", "IS takes NULL"),
    ("country = NULL", "comparison with NULL"),
    ("-price < 3", "only a number is negated"),
    ("name LIKE 5", "LIKE takes a string pattern"),
    ("price", None),  # a bare column is a condition (price = TRUE): refused only by the warehouse's types
    ("42", "a value, not a condition"),
    ("id = ", "does not parse"),
    ("   ", "is empty"),
])
def test_what_is_not_a_plain_condition_is_refused_naming_the_construct(where, says):
    if says is None:
        row_filter.parse(where)
        return
    with pytest.raises(row_filter.FilterError, match=says):
        row_filter.parse(where)


def test_the_config_refuses_a_bad_filter_naming_the_source_and_the_construct():
    from pydantic import ValidationError

    from habitus.pipelines.config.sources import Source

    good = Source(name="purchases", role="entity_attributes", connection="wh", table="t", where="a = 1")
    assert good.where == "a = 1"
    with pytest.raises(ValidationError, match=r"source 'purchases': `where: a = 1; DELETE FROM t`.*one expression"):
        Source(name="purchases", role="entity_attributes", connection="wh", table="t", where="a = 1; DELETE FROM t")


def test_column_names_are_quoted_never_pasted():
    sql = select_sql("duckdb", "events", ["id"], where='"x"" OR 1=1 --" = 2 AND y = \'a\'\'b\'')
    assert sql == 'SELECT "id" FROM "events" WHERE ("x"" OR 1=1 --" = 2 AND "y" = \'a\'\'b\')'
    assert row_filter.columns('"x"" OR 1=1 --" = 2 AND y = 1 AND y > 0') == ['x" OR 1=1 --', "y"]


WHERE = "country = 'PL' AND NOT is_test AND name LIKE 'A%' AND amount IS NOT NULL AND ts >= DATE '2026-03-02'"
# the generated WHERE of each dialect, as the warehouse receives it
DIALECTS = {
    "tsql": "([country] = 'PL' AND NOT ([is_test] = 1) AND [name] LIKE 'A%' AND NOT [amount] IS NULL "
            "AND [ts] >= CAST('2026-03-02' AS DATE))",
    "databricks": "(`country` = 'PL' AND NOT (`is_test` = TRUE) AND `name` LIKE 'A%' AND NOT `amount` IS NULL "
                  "AND `ts` >= CAST('2026-03-02' AS DATE))",
    "hive": "(`country` = 'PL' AND NOT (`is_test` = TRUE) AND `name` LIKE 'A%' AND NOT `amount` IS NULL "
            "AND `ts` >= CAST('2026-03-02' AS DATE))",
    "clickhouse": "(\"country\" = 'PL' AND NOT (\"is_test\" = TRUE) AND \"name\" LIKE 'A%' AND NOT (\"amount\" IS NULL) "
                  "AND \"ts\" >= CAST('2026-03-02' AS Nullable(DATE)))",
    "snowflake": "(\"country\" = 'PL' AND NOT (\"is_test\" = TRUE) AND \"name\" LIKE 'A%' AND NOT \"amount\" IS NULL "
                 "AND \"ts\" >= CAST('2026-03-02' AS DATE))",
    "bigquery": "(`country` = 'PL' AND NOT (`is_test` = TRUE) AND `name` LIKE 'A%' AND NOT `amount` IS NULL "
                "AND `ts` >= CAST('2026-03-02' AS DATE))",
}


@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_each_dialect_gets_the_filter_in_its_own_sql(dialect):
    sql = select_sql(dialect, "db.events", ["id"], "ts", datetime(2026, 3, 1), None, WHERE)
    head, _, rest = sql.partition(" WHERE ")
    assert rest.startswith(DIALECTS[dialect] + " AND ")
    assert sqlglot.parse_one(sql, read=dialect).find(sqlglot.exp.Where) is not None  # it parses back
