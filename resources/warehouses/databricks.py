"""Databricks SQL warehouses through databricks-sql-connector: reads stream Arrow tables
(`fetchmany_arrow`, the connector's Arrow/CloudFetch path), column types come from the cursor's
description of a LIMIT 0 query.

Writes: with `staging_volume` (a Unity Catalog volume path such as /Volumes/main/habitus/staging)
the batches go up as Parquet files (PUT) and one `INSERT INTO ... REPLACE WHERE col = value SELECT
... FROM parquet.<files>` swaps the partition atomically (Delta), then the files are removed.
Without a volume, rows go as multi-row VALUES statements after a DELETE of the partition.

Install with `pip install 'habitus[databricks]'`. Config (secrets as ${ENV} references):

    connections:
      dbx: {type: databricks, server_hostname: adb-123.azuredatabricks.net,
            http_path: /sql/1.0/warehouses/abc, access_token: ${DATABRICKS_TOKEN},
            catalog: main, schema: shop, staging_volume: /Volumes/main/shop/habitus}
"""

import contextlib
import os
import re
import tempfile
import uuid
from typing import ClassVar, Any, Iterable, Iterator

import dagster as dg
import pyarrow as pa
import sqlglot
from sqlglot import exp

from habitus.resources.warehouses.errors import WarehouseError, tables_there
from habitus.resources.warehouses.remote import CursorQueries, connect_error, first_lines, value_literal
from habitus.resources.warehouses.masking import secret_values, value
from habitus.resources.warehouses.sql import create_table_sql, delete_sql, limit0_sql, table_expr

DIALECT = "databricks"

_SIMPLE = {"tinyint": pa.int8(), "byte": pa.int8(), "smallint": pa.int16(), "short": pa.int16(),
           "int": pa.int32(), "integer": pa.int32(), "bigint": pa.int64(), "long": pa.int64(),
           "float": pa.float32(), "double": pa.float64(), "boolean": pa.bool_(), "string": pa.string(),
           "char": pa.string(), "varchar": pa.string(), "date": pa.date32(), "binary": pa.binary(),
           "timestamp": pa.timestamp("us", "UTC"), "timestamp_ntz": pa.timestamp("us"), "void": pa.string()}


def arrow_type(name: str, type_code: str, precision: int | None = None, scale: int | None = None) -> pa.DataType:
    """The Arrow type of a result column as the connector's cursor.description names it.
    TIMESTAMP is an instant (shown in the session time zone): UTC-aware; TIMESTAMP_NTZ is naive."""
    t = str(type_code).lower()
    base = t.split("(", 1)[0]
    if base in ("decimal", "numeric", "dec"):
        return pa.decimal128(precision or 10, scale or 0)
    if base in _SIMPLE:
        return _SIMPLE[base]
    raise WarehouseError(f"column {name!r}: Databricks type {type_code} has no Arrow mapping; leave it out of "
                         f"`columns` or convert it in a view")


# Databricks' error class (and SQLSTATE) of a table or view that does not exist
MISSING_TABLE = re.compile(r"TABLE_OR_VIEW_NOT_FOUND|\b42P01\b|Table or view not found")


def tables_sql(catalog: str | None, schema: str | None) -> str:
    """SHOW TABLES of `catalog.schema` (tables and views), of the session's schema when none is configured."""
    if not schema:
        return "SHOW TABLES"
    parts = [p for p in (catalog, schema) if p]
    return "SHOW TABLES IN " + ".".join(exp.to_identifier(p, quoted=True).sql(DIALECT) for p in parts)


def _literal(v) -> exp.Expression:
    return value_literal(v, "TIMESTAMP_NTZ", "TIMESTAMP", dialect=DIALECT)


def values_sql(table: str, names: list[str], rows: list[tuple]) -> str:
    """INSERT INTO table (cols) VALUES (...), (...): every value a typed literal, names quoted."""
    cols = exp.Schema(this=table_expr(table), expressions=[exp.to_identifier(n, quoted=True) for n in names])
    values = exp.values([exp.tuple_(*[_literal(v) for v in r]) for r in rows])
    return exp.insert(values, cols).sql(dialect=DIALECT)


class DatabricksWarehouse(CursorQueries, dg.ConfigurableResource):
    warehouse_kind: ClassVar[str] = "databricks"
    sql_dialect: ClassVar[str] = DIALECT

    name: str = ""
    server_hostname: str
    http_path: str
    access_token: str | None = None
    catalog: str | None = None
    schema_name: str | None = None
    staging_volume: str | None = None
    options: dict[str, Any] = {}

    def _secrets(self) -> list:
        return secret_values(self)

    def connect_kwargs(self) -> dict:
        kw = {"server_hostname": self.server_hostname, "http_path": self.http_path,
              "access_token": self.access_token, "catalog": self.catalog, "schema": self.schema_name}
        kw = {k: value(v) for k, v in kw.items() if v is not None}
        kw.update({k: value(v) for k, v in self.options.items()})
        kw.setdefault("session_configuration", {}).setdefault("TIMEZONE", "UTC")
        return kw

    def _connect(self, staging_dir: str | None = None):
        from databricks import sql

        kw = self.connect_kwargs()
        if staging_dir:
            kw["staging_allowed_local_path"] = staging_dir
        try:
            return sql.connect(**kw)
        except Exception as e:
            raise connect_error("databricks", self.name, self.server_hostname, e, self._secrets()) from None

    def _where(self) -> str:
        return str(value(self.server_hostname))

    def _error_cause(self, exc: BaseException) -> BaseException:
        """A missing table ([TABLE_OR_VIEW_NOT_FOUND]) with the tables there."""
        if not MISSING_TABLE.search(str(exc)):
            return exc
        return RuntimeError(first_lines(exc) + tables_there(self.tables))

    def tables(self) -> list[str]:
        """The tables and views of the connection's `catalog`.`schema` (SHOW TABLES: namespace, tableName,
        isTemporary)."""
        with self._cursor("SHOW TABLES") as cur:
            cur.execute(tables_sql(value(self.catalog), value(self.schema_name)))
            return sorted(row[1] for row in cur.fetchall())

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _describe(cur, table: str, columns: list[str] | None) -> pa.Schema:
        cur.execute(limit0_sql(DIALECT, table, columns))
        return pa.schema([pa.field(d[0], arrow_type(d[0], d[1], d[4], d[5])) for d in cur.description])

    @staticmethod
    def _fetch(cur, schema: pa.Schema, batch_rows: int) -> Iterator[pa.RecordBatch]:
        while True:
            t = cur.fetchmany_arrow(batch_rows)
            if t is None or t.num_rows == 0:
                return
            yield from t.to_batches()

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None, insert_rows: int = 5_000,
              file_rows: int = 1_000_000) -> int:
        if self.staging_volume:
            return self._write_staged(table, batches, schema, replace, file_rows)
        with self._cursor(table) as cur:
            cur.execute(create_table_sql(DIALECT, table, schema))
            if replace is not None:
                cur.execute(delete_sql(DIALECT, table, *replace))
            written, pending = 0, []
            for b in batches:
                pending.extend(zip(*[c.to_pylist() for c in b.columns]))
                while len(pending) >= insert_rows:
                    cur.execute(values_sql(table, schema.names, pending[:insert_rows]))
                    written, pending = written + insert_rows, pending[insert_rows:]
            if pending:
                cur.execute(values_sql(table, schema.names, pending))
                written += len(pending)
            return written

    def _write_staged(self, table, batches, schema, replace, file_rows) -> int:
        import pyarrow.parquet as pq

        folder = f"{self.staging_volume.rstrip('/')}/habitus-{uuid.uuid4().hex}"
        with tempfile.TemporaryDirectory(prefix="habitus-dbx-") as tmp, self._cursor(table, staging_dir=tmp) as cur:
            cur.execute(create_table_sql(DIALECT, table, schema))
            remote, rows, writer, path, in_file = [], 0, None, None, 0

            def put(local):
                target = f"{folder}/{os.path.basename(local)}"
                cur.execute(f"PUT {exp.Literal.string(local).sql(DIALECT)} INTO "
                            f"{exp.Literal.string(target).sql(DIALECT)} OVERWRITE")
                remote.append(target)
                os.unlink(local)

            for b in batches:
                if not len(b):
                    continue
                if writer is None:
                    path = os.path.join(tmp, f"part-{len(remote):05d}.parquet")
                    writer, in_file = pq.ParquetWriter(path, schema), 0
                writer.write_batch(b)
                rows, in_file = rows + len(b), in_file + len(b)
                if in_file >= file_rows:
                    writer.close()
                    put(path)
                    writer = None
            if writer is not None:
                writer.close()
                put(path)
            try:
                target = table_expr(table).sql(dialect=DIALECT)
                cond = ""
                if replace is not None:
                    where = sqlglot.parse_one(delete_sql(DIALECT, table, *replace), read=DIALECT).args["where"]
                    cond = " REPLACE WHERE " + where.this.sql(dialect=DIALECT)
                cols = ", ".join(exp.to_identifier(n, quoted=True).sql(DIALECT) for n in schema.names)
                if remote:
                    source = exp.to_identifier(folder, quoted=True).sql(DIALECT)
                    cur.execute(f"INSERT INTO {target}{cond} SELECT {cols} FROM parquet.{source}")
                elif replace is not None:
                    cur.execute(delete_sql(DIALECT, table, *replace))
            finally:
                for r in remote:
                    with contextlib.suppress(Exception):
                        cur.execute(f"REMOVE {exp.Literal.string(r).sql(DIALECT)}")
            return rows
