"""Azure Synapse (dedicated or serverless SQL pools) and SQL Server, T-SQL through mssql-python
(Microsoft's driver with its TDS client bundled: no system ODBC driver to install).

Reads stream Arrow record batches (`cursor.arrow_reader`), column types come from
INFORMATION_SCHEMA.COLUMNS; writes bulk-load the Arrow batches (`cursor.bulkcopy_arrow`, the TDS
bulk-load path) into a staging table, then delete the partition's rows and insert the staged ones in
one transaction: a failed load keeps the previous rows, re-runs replace, never duplicate.

Install with `pip install 'habitus[synapse]'`. Config (secrets as ${ENV} references):

    connections:
      syn: {type: synapse, server: myws.sql.azuresynapse.net, database: shop, username: habitus,
            password: ${SYNAPSE_PASSWORD}, authentication: SqlPassword}

`authentication` is any of the driver's (SqlPassword, ActiveDirectoryPassword,
ActiveDirectoryServicePrincipal, ActiveDirectoryMsi, ActiveDirectoryDefault, ...). Other keys are
added to the connection string as given.
"""

import re
import uuid
from typing import Any, ClassVar, Iterable, Iterator

import dagster as dg
import pyarrow as pa
from sqlglot import exp

from habitus.resources.warehouses.errors import WarehouseError, qualified_names, tables_there
from habitus.resources.warehouses.remote import CursorQueries, connect_error, first_lines
from habitus.resources.warehouses.masking import secret_values, value
from habitus.resources.warehouses.sql import create_table_sql, delete_sql, table_expr

DIALECT = "tsql"

_SIMPLE = {"bigint": pa.int64(), "int": pa.int32(), "smallint": pa.int16(), "tinyint": pa.uint8(),
           "bit": pa.bool_(), "float": pa.float64(), "real": pa.float32(), "money": pa.decimal128(19, 4),
           "smallmoney": pa.decimal128(10, 4), "date": pa.date32(), "datetime": pa.timestamp("ms"),
           "smalldatetime": pa.timestamp("s"), "datetimeoffset": pa.timestamp("us", "UTC"),
           "uniqueidentifier": pa.string(), "binary": pa.binary(), "varbinary": pa.binary(), "image": pa.binary()}
_TEXT = ("char", "varchar", "nchar", "nvarchar", "text", "ntext", "xml", "sysname")


def arrow_type(name: str, data_type: str, precision: int | None = None, scale: int | None = None,
               datetime_precision: int | None = None) -> pa.DataType:
    """The Arrow type of a column as INFORMATION_SCHEMA.COLUMNS describes it."""
    t = data_type.lower()
    if t in ("decimal", "numeric"):
        return pa.decimal128(precision or 18, scale or 0)
    if t == "datetime2":
        return pa.timestamp("us")  # datetime2(7)'s 100 ns digit is beyond what the driver returns
    if t in _SIMPLE:
        return _SIMPLE[t]
    if t in _TEXT:
        return pa.string()
    raise WarehouseError(f"column {name!r}: T-SQL type {data_type} has no Arrow mapping; leave it out of "
                         f"`columns` or convert it in a view")


def columns_sql(table: str) -> str:
    """INFORMATION_SCHEMA query for a table's columns; the names are string literals, escaped."""
    t = table_expr(table)
    cols = ["COLUMN_NAME", "DATA_TYPE", "NUMERIC_PRECISION", "NUMERIC_SCALE", "DATETIME_PRECISION"]
    q = (exp.select(*[exp.column(c) for c in cols])
         .from_(exp.table_("COLUMNS", db="INFORMATION_SCHEMA"))
         .where(exp.EQ(this=exp.column("TABLE_NAME"), expression=exp.Literal.string(t.name))))
    q = q.where(exp.EQ(this=exp.column("TABLE_SCHEMA"),
                       expression=exp.Literal.string(t.db) if t.db else exp.func("SCHEMA_NAME")))
    return q.order_by(exp.column("ORDINAL_POSITION")).sql(dialect=DIALECT)


# SQL Server's error 208 (SQLSTATE 42S02): a table or view named in a statement does not exist
MISSING_TABLE = re.compile(r"Invalid object name|\b42S02\b")
# the tables and views of the database, with the session's default schema to name the others schema.table
TABLES_SQL = ("SELECT TABLE_SCHEMA, TABLE_NAME, SCHEMA_NAME() FROM INFORMATION_SCHEMA.TABLES "
              "ORDER BY TABLE_SCHEMA, TABLE_NAME")


def _cs_value(v) -> str:
    """A connection-string value, braced when it holds a separator (} doubled inside)."""
    v = str(v)
    return "{" + v.replace("}", "}}") + "}" if any(ch in v for ch in ";{}= ") or v != v.strip() else v


class SynapseWarehouse(CursorQueries, dg.ConfigurableResource):
    warehouse_kind: ClassVar[str] = "synapse"
    sql_dialect: ClassVar[str] = DIALECT
    default_batch_rows: ClassVar[int] = 1 << 16

    name: str = ""
    server: str
    port: int = 1433
    database: str
    username: str | None = None
    password: str | None = None
    authentication: str | None = None
    encrypt: bool = True
    login_timeout: int = 30
    options: dict[str, Any] = {}

    def _secrets(self) -> list:
        return secret_values(self)

    def connection_string(self) -> str:
        parts = {"Server": f"tcp:{value(self.server)},{self.port}", "Database": value(self.database),
                 "Encrypt": "yes" if self.encrypt else "no"}
        if self.username:
            parts["Uid"] = value(self.username)
        if self.password:
            parts["Pwd"] = value(self.password)
        if self.authentication:
            parts["Authentication"] = value(self.authentication)
        parts.update({k: value(v) for k, v in self.options.items()})
        return ";".join(f"{k}={_cs_value(v)}" for k, v in parts.items())

    def _connect(self):
        import mssql_python

        try:
            return mssql_python.connect(self.connection_string(), timeout=self.login_timeout)
        except Exception as e:
            raise connect_error("synapse", self.name, f"{self.server}:{self.port}", e, self._secrets()) from None

    def _where(self) -> str:
        return f"{value(self.server)}:{self.port}"

    def _error_cause(self, exc: BaseException) -> BaseException:
        """A missing table ("Invalid object name", error 208) with the tables there."""
        if not MISSING_TABLE.search(str(exc)):
            return exc
        return RuntimeError(first_lines(exc) + tables_there(self.tables))

    def tables(self) -> list[str]:
        """The tables and views of the connection's `database` (INFORMATION_SCHEMA.TABLES), `schema.table`
        outside the login's default schema."""
        with self._cursor("INFORMATION_SCHEMA.TABLES") as cur:
            return self._tables(cur)

    @staticmethod
    def _tables(cur) -> list[str]:
        cur.execute(TABLES_SQL)
        return qualified_names(cur.fetchall())

    # ------------------------------------------------------------------ reading

    def _describe(self, cur, table: str, columns: list[str] | None) -> pa.Schema:
        cur.execute(columns_sql(table))
        rows = cur.fetchall()
        if not rows:
            raise WarehouseError(f"table {table!r} in synapse connection {self.name or '?'!r} at {self._where()}: not "
                                 f"found (INFORMATION_SCHEMA.COLUMNS has no columns for it)"
                                 f"{tables_there(lambda: self._tables(cur))}")
        types = {r[0]: arrow_type(r[0], r[1], r[2], r[3], r[4]) for r in rows}
        names = columns or list(types)
        missing = [c for c in names if c not in types]
        if missing:
            raise WarehouseError(f"table {table!r}: column(s) {missing} not found; it has {list(types)}")
        return pa.schema([pa.field(c, types[c]) for c in names])

    @staticmethod
    def _fetch(cur, schema: pa.Schema, batch_rows: int) -> Iterator[pa.RecordBatch]:
        with cur.arrow_reader(batch_size=batch_rows) as reader:
            yield from reader

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None) -> int:
        """Create `table` if missing, bulk-load `batches` (TDS bulk copy) into a staging table, then in
        one transaction delete the rows where replace[0] == replace[1] and insert the staged rows: a
        failed load keeps the previous rows, a re-run never duplicates them. Returns the rows loaded."""
        t = table_expr(table)
        stage = ".".join(p for p in (t.catalog, t.db, f"_habitus_stage_{uuid.uuid4().hex[:12]}") if p)
        stage_sql, target_sql = table_expr(stage).sql(dialect=DIALECT), t.sql(dialect=DIALECT)
        with self._session(table) as (con, cur):
            cur.execute(create_table_sql(DIALECT, table, schema))
            cur.execute(create_table_sql(DIALECT, stage, schema, if_not_exists=False))
            con.commit()
            try:
                reader = pa.RecordBatchReader.from_batches(schema, (b for b in batches if len(b)))
                result = cur.bulkcopy_arrow(stage_sql, reader, timeout=0)
                con.commit()
                loaded = int((result or {}).get("rows_copied", 0)) if isinstance(result, dict) else int(result or 0)
                cols = ", ".join(exp.to_identifier(f.name, quoted=True).sql(DIALECT) for f in schema)
                try:
                    if replace is not None:
                        cur.execute(delete_sql(DIALECT, table, *replace))
                    cur.execute(f"INSERT INTO {target_sql} ({cols}) SELECT {cols} FROM {stage_sql}")
                    con.commit()
                except Exception:
                    con.rollback()
                    raise
                return loaded
            finally:
                cur.execute(f"DROP TABLE {stage_sql}")
                con.commit()
