"""DuckDB: the embedded default warehouse (a local database file)."""

import contextlib
from datetime import datetime, timezone
from typing import Iterable, Iterator

import dagster as dg
import pyarrow as pa
from sqlglot import exp

from resources.sql import delete_sql, range_sql, select_sql, table_expr


class WarehouseError(ValueError):
    pass


class DuckDBWarehouse(dg.ConfigurableResource):
    """Reads tables with projection and time filter pushed down; writes predictions back."""

    path: str

    def _connect(self, read_only: bool = True):
        import duckdb
        import os

        if read_only and not os.path.exists(self.path):
            raise WarehouseError(f"DuckDB database {self.path} does not exist; check the connection's `path` "
                                 f"(for the demo run `habitus demo-data`)")
        return duckdb.connect(self.path, read_only=read_only)

    @contextlib.contextmanager
    def _session(self, table: str):
        """A read-only connection; a missing table or column becomes an error that names it."""
        import duckdb

        con = self._connect()
        try:
            yield con
        except duckdb.CatalogException as e:
            raise WarehouseError(f"table {table!r} in DuckDB database {self.path}: {str(e).splitlines()[0]}") from None
        except duckdb.BinderException as e:
            raise WarehouseError(f"table {table!r} in DuckDB database {self.path}: {str(e).splitlines()[0]}") from None
        finally:
            con.close()

    def schema(self, table: str) -> pa.Schema:
        with self._session(table) as con:
            return con.sql(select_sql("duckdb", table) + " LIMIT 0").to_arrow_table().schema

    def time_range(self, table: str, time_column: str) -> tuple[datetime | None, datetime | None]:
        with self._session(table) as con:
            return tuple(con.sql(range_sql("duckdb", table, time_column)).fetchall()[0])

    def freshness(self, table: str, time_column: str) -> tuple[int, datetime | None]:
        """Rows and the newest timestamp: the one aggregate a new-data sensor asks on every tick."""
        with self._session(table) as con:
            rows, newest = con.sql(freshness_sql("duckdb", table, time_column)).fetchall()[0]
        return int(rows), utc_naive(newest)

    def partition_counts(self, table: str, time_column: str, grain: str) -> dict[datetime, tuple[int, datetime]]:
        """{start of each month (grain 'month') or day ('day'): (rows, newest timestamp)}, UTC."""
        with self._session(table) as con:
            con.sql("SET TimeZone = 'UTC'")  # periods of a zone-aware column start at UTC midnight
            rows = con.sql(partition_counts_sql("duckdb", table, time_column, grain)).fetchall()
        return {utc_naive(start): (int(n), utc_naive(newest)) for start, n, newest in rows}

    def read(self, table: str, columns: list[str] | None = None, time_column: str | None = None,
             start: datetime | None = None, end: datetime | None = None,
             batch_rows: int = 1 << 17) -> Iterator[pa.RecordBatch]:
        with self._session(table) as con:
            yield from con.sql(select_sql("duckdb", table, columns, time_column, start, end)).to_arrow_reader(batch_rows)

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None) -> int:
        """Append `batches` to `table` (created if missing), first deleting rows where
        replace[0] == replace[1], all in one transaction: a re-run replaces, never duplicates."""
        con = self._connect(read_only=False)
        reader = pa.RecordBatchReader.from_batches(schema, batches)
        try:
            con.sql("BEGIN TRANSACTION")
            con.register("__incoming", reader)
            target = table_expr(table).sql(dialect="duckdb")
            con.sql(f"CREATE TABLE IF NOT EXISTS {target} AS SELECT * FROM __incoming LIMIT 0")
            if replace is not None:
                con.sql(delete_sql("duckdb", table, *replace))
            before = con.sql(f"SELECT count(*) FROM {target}").fetchall()[0][0]
            con.sql(f"INSERT INTO {target} BY NAME SELECT * FROM __incoming")
            after = con.sql(f"SELECT count(*) FROM {target}").fetchall()[0][0]
            con.sql("COMMIT")
            return int(after - before)
        except Exception:
            con.sql("ROLLBACK")
            raise
        finally:
            con.close()


# --------------------------------------------------------------------------- what new-data sensors ask


def freshness_sql(dialect: str, table: str, time_column: str) -> str:
    col = exp.column(time_column, quoted=True)
    return exp.select(exp.Count(this=exp.Star()), exp.Max(this=col)).from_(table_expr(table)).sql(dialect=dialect)


def partition_counts_sql(dialect: str, table: str, time_column: str, grain: str) -> str:
    """Rows and newest time per month or day of `time_column`: one GROUP BY in the warehouse."""
    col = exp.column(time_column, quoted=True)
    period = period_expr(dialect, col, grain)
    return (exp.select(period.as_("period"), exp.Count(this=exp.Star()), exp.Max(this=col.copy()))
            .from_(table_expr(table)).where(exp.Not(this=exp.Is(this=col.copy(), expression=exp.Null())))
            .group_by(period.copy()).sql(dialect=dialect))  # by the expression: T-SQL has no GROUP BY 1


def period_expr(dialect: str, col: exp.Expression, grain: str) -> exp.Expression:
    """The first instant of the month or day holding `col`, written so that each warehouse accepts it
    for timestamp, zone-aware and date columns alike (a date or a timestamp comes back)."""
    if grain not in ("month", "day"):
        raise ValueError(f"grain must be 'month' or 'day', got {grain!r}")
    month = grain == "month"

    def fn(name, *args):  # as written: sqlglot would reorder or rename a function it knows
        return exp.Anonymous(this=name, expressions=list(args))

    if dialect == "bigquery":  # TIMESTAMP_TRUNC refuses DATETIME and DATE columns; DATE() takes all three
        day = fn("DATE", col)
        return fn("DATE_TRUNC", day, exp.var("MONTH")) if month else day
    if dialect == "clickhouse":
        return fn("toStartOfMonth" if month else "toDate", col)
    if dialect == "hive":  # Hive has no DATE_TRUNC; TRUNC(.., 'MM') and TO_DATE run on Hive and Spark
        return fn("TRUNC", col, exp.Literal.string("MM")) if month else fn("TO_DATE", col)
    if dialect == "tsql":  # DATETRUNC is SQL Server 2022 only; Synapse has DATEFROMPARTS
        if month:
            return fn("DATEFROMPARTS", fn("YEAR", col), fn("MONTH", col.copy()), exp.Literal.number(1))
        return exp.cast(col, exp.DataType.build("DATE"))
    return exp.TimestampTrunc(this=col, unit=exp.var(grain.upper()))


def utc_naive(value):
    """A warehouse time as a naive UTC datetime (dates become midnight); None stays None."""
    if value is None:
        return None
    if not isinstance(value, datetime):  # a date
        return datetime(value.year, value.month, value.day)
    if value.tzinfo is not None:
        value = value.astimezone(timezone.utc).replace(tzinfo=None)
    return value
