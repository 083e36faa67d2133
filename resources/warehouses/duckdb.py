"""DuckDB: the embedded default warehouse (a local database file)."""

import contextlib
from datetime import datetime
from typing import Iterable, Iterator

import dagster as dg
import pyarrow as pa

from habitus.resources.warehouses.errors import WarehouseError, tables_there
from habitus.resources.warehouses.sql import (delete_sql, freshness_sql, partition_counts_sql, range_sql, select_sql, table_expr,
                           utc_naive)


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
            names: list[str] = []
            listed = tables_there(lambda: names.extend(self.tables()) or names)  # "" when the listing fails
            if table in names:  # the table is there: the catalog error is about something else
                listed = ""
            raise WarehouseError(f"table {table!r} in DuckDB database {self.path}: {str(e).splitlines()[0]}"
                                 f"{listed}") from None
        except duckdb.BinderException as e:
            raise WarehouseError(f"table {table!r} in DuckDB database {self.path}: {str(e).splitlines()[0]}") from None
        finally:
            con.close()

    def tables(self) -> list[str]:
        """The database's tables and views, `schema.table` outside the main schema."""
        import os

        if not os.path.exists(self.path):
            raise WarehouseError(f"{self.path}: no such file")
        import duckdb

        try:
            con = duckdb.connect(self.path, read_only=True)
        except duckdb.Error as e:
            raise WarehouseError(f"{self.path}: {str(e).splitlines()[0]}") from None
        try:
            rows = con.execute("SELECT table_schema, table_name FROM information_schema.tables "
                               "WHERE table_catalog = current_database() ORDER BY 1, 2").fetchall()
        finally:
            con.close()
        return [t if s == "main" else f"{s}.{t}" for s, t in rows]

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
             batch_rows: int = 1 << 17, where: str | None = None) -> Iterator[pa.RecordBatch]:
        """`columns` of the rows of `table` in [start, end) of `time_column` that pass the row filter
        `where` (resources/warehouses/row_filter.py), all pushed into DuckDB's query."""
        with self._session(table) as con:
            sql = select_sql("duckdb", table, columns, time_column, start, end, where)
            yield from con.sql(sql).to_arrow_reader(batch_rows)

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None) -> int:
        """Append `batches` to `table` (created if missing), first deleting rows where
        replace[0] == replace[1], all in one transaction: a re-run replaces, never duplicates. DuckDB's
        refusal (rows of another shape than the table's) names the table; nothing is written then."""
        import duckdb

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
        except duckdb.Error as e:
            con.sql("ROLLBACK")
            raise WarehouseError(f"writing table {table!r} of DuckDB database {self.path}: "
                                 f"{str(e).splitlines()[0]}") from None
        except Exception:
            con.sql("ROLLBACK")
            raise
        finally:
            con.close()
