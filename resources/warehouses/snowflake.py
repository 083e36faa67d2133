"""Snowflake through snowflake-connector-python: reads stream the result's Arrow chunks
(`fetch_arrow_batches`), writes go through a temporary stage (PUT of Parquet files, then
COPY INTO ... MATCH_BY_COLUMN_NAME) after deleting the partition's rows, in one transaction.

Install with `pip install 'habitus[snowflake]'`. Config (secrets as ${ENV} references):

    connections:
      wh: {type: snowflake, account: ${SF_ACCOUNT}, user: ${SF_USER}, password: ${SF_PASSWORD},
           warehouse: COMPUTE_WH, database: SHOP, schema: PUBLIC, role: ANALYST}

Other keys (authenticator, private_key_file, host, port, protocol, ...) are passed to
`snowflake.connector.connect` as given.
"""

import contextlib
import os
import tempfile
import uuid
from typing import ClassVar, Any, Iterable, Iterator

import dagster as dg
import pyarrow as pa

from habitus.resources.warehouses.errors import AUTH, WarehouseError, network_error, qualified_names, tables_there
from habitus.resources.warehouses.remote import CursorQueries, connect_error, first_lines
from habitus.resources.warehouses.masking import secret_values, value
from habitus.resources.warehouses.sql import create_table_sql, delete_sql, limit0_sql, table_expr

DIALECT = "snowflake"


def arrow_type(name: str, type_code_name: str, precision: int | None, scale: int | None) -> pa.DataType:
    """The Arrow type of a Snowflake result column (from the cursor's description)."""
    t = type_code_name.upper()
    if t == "FIXED":
        if scale:
            return pa.decimal128(precision or 38, scale)
        # NUMBER(p, 0), including the default NUMBER(38, 0) of INTEGER columns: ids fit int64;
        # a value that does not is reported by the cast (resources/warehouses/batches.py), never truncated.
        return pa.int64()
    if t in ("REAL", "FLOAT", "DOUBLE"):
        return pa.float64()
    if t in ("TEXT", "VARIANT", "OBJECT", "ARRAY", "GEOGRAPHY", "GEOMETRY"):
        return pa.string()
    if t == "BOOLEAN":
        return pa.bool_()
    if t == "DATE":
        return pa.date32()
    if t == "BINARY":
        return pa.binary()
    if t.startswith("TIMESTAMP") or t == "TIME":
        s = 9 if scale is None else scale
        unit = "s" if s == 0 else "ms" if s <= 3 else "us" if s <= 6 else "ns"
        if t == "TIME":
            return pa.time64("us" if unit in ("s", "ms", "us") else "ns")
        return pa.timestamp(unit, tz=None if t == "TIMESTAMP_NTZ" else "UTC")
    raise WarehouseError(f"column {name!r}: Snowflake type {type_code_name} has no Arrow mapping; "
                         f"leave it out of `columns` or cast it in a view")


# Snowflake's error numbers of a refused login (wrong user or password, key pair, MFA, locked user):
# permanent, however the driver wraps them.
AUTH_ERRNOS = frozenset({390100, 390101, 390102, 390103, 390104, 390105, 390144, 390156, 390186, 390191})
# The session was dropped under the client (a server restart, an idle session expired): a new connection helps.
SESSION_ERRNOS = frozenset({390111, 390112, 390114})
# "SQL compilation error: Object '...' does not exist or not authorized" (a table, a view, a schema)
MISSING_OBJECT_ERRNO = 2003
# the tables and views of the session's database, with the session's schema to name the others schema.table
TABLES_SQL = ("SELECT table_schema, table_name, CURRENT_SCHEMA() FROM information_schema.tables "
              "WHERE table_schema <> 'INFORMATION_SCHEMA' ORDER BY table_schema, table_name")
_RETRYABLE = ("OperationalError", "ServiceUnavailableError", "GatewayTimeoutError", "BadGatewayError",
              "OtherHTTPRetryableError", "RequestTimeoutError", "InternalServerError", "TooManyRequests",
              "RequestExceedMaxRetryError", "InterfaceError")


def transient(exc: BaseException) -> bool:
    """Whether an error of snowflake-connector-python may pass when retried: the transport failed
    (OperationalError 2500xx: cannot reach the backend, connection closed, request failed), the service
    answered 5xx or 429, or the session vanished (3901xx session errors, or HTTP 401 on a query of a session
    that had logged in: the server restarted and forgot its token). Permanent: a refused login,
    ProgrammingError (SQL compilation: bad SQL, missing table or column), and every other answer."""
    errno = getattr(exc, "errno", None)
    text = str(getattr(exc, "msg", "") or exc)
    if errno in SESSION_ERRNOS or (errno == 290401 and "login-request" not in text and "/queries/" in text):
        # a session token the server no longer knows (it restarted, the session expired): HTTP 401 on a
        # query of a session that had logged in; a new connection logs in again
        return True
    if errno in AUTH_ERRNOS or AUTH.search(text):
        return False
    if type(exc).__name__ in ("ProgrammingError", "NonRetryableTlsError"):
        return False
    if any(type(e).__module__.startswith("snowflake.connector") and type(e).__name__ in _RETRYABLE
           for e in (exc, exc.__cause__, exc.__context__) if e is not None):
        return True
    return network_error(exc)


class SnowflakeWarehouse(CursorQueries, dg.ConfigurableResource):
    """Snowflake; `schema_name` is the config's `schema`, `options` any other connector parameter."""

    warehouse_kind: ClassVar[str] = "snowflake"
    sql_dialect: ClassVar[str] = DIALECT

    name: str = ""
    account: str
    user: str | None = None
    password: str | None = None
    warehouse: str | None = None
    database: str | None = None
    schema_name: str | None = None
    role: str | None = None
    login_timeout: int = 30
    options: dict[str, Any] = {}

    # ------------------------------------------------------------------ connection

    def _secrets(self) -> list:
        return secret_values(self)

    def _where(self) -> str:
        host = value(self.options.get("host")) or f"{value(self.account)}.snowflakecomputing.com"
        port = value(self.options.get("port"))
        return f"{host}:{port}" if port else str(host)

    def connect_kwargs(self) -> dict:
        kw = {"account": self.account, "user": self.user, "password": self.password, "warehouse": self.warehouse,
              "database": self.database, "schema": self.schema_name, "role": self.role}
        kw = {k: value(v) for k, v in kw.items() if v is not None}
        kw.update({k: value(v) for k, v in self.options.items()})
        kw.setdefault("login_timeout", self.login_timeout)
        kw.setdefault("network_timeout", max(self.login_timeout, 60))
        params = dict(kw.pop("session_parameters", None) or {})
        params.setdefault("TIMEZONE", "UTC")  # TIMESTAMP_LTZ values and CURRENT_TIMESTAMP in UTC
        kw["session_parameters"] = params
        return kw

    def _connect(self):
        import snowflake.connector

        try:
            return snowflake.connector.connect(**self.connect_kwargs())
        except Exception as e:  # the connector raises several classes; all mean "no connection"
            raise connect_error("snowflake", self.name, self._where(), e, self._secrets(), transient(e)) from None

    def _query_errors(self) -> tuple[type[BaseException], ...]:
        import snowflake.connector.errors as sf_errors

        return (sf_errors.Error,)

    def _transient(self, exc: BaseException) -> bool:
        return transient(exc)

    def _error_cause(self, exc: BaseException) -> BaseException:
        """A missing table (error 2003) with the tables there."""
        if getattr(exc, "errno", None) != MISSING_OBJECT_ERRNO:
            return exc
        return RuntimeError(first_lines(exc) + tables_there(self.tables))

    def tables(self) -> list[str]:
        """The tables and views of the connection's `database` (INFORMATION_SCHEMA.TABLES), `schema.table`
        outside its `schema`."""
        with self._cursor("information_schema.tables") as cur:
            cur.execute(TABLES_SQL)
            return qualified_names(cur.fetchall())

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _describe(cur, table: str, columns: list[str] | None) -> pa.Schema:
        from snowflake.connector.constants import FIELD_ID_TO_NAME

        cur.execute(limit0_sql(DIALECT, table, columns))
        return pa.schema([pa.field(d.name, arrow_type(d.name, FIELD_ID_TO_NAME[d.type_code], d.precision, d.scale))
                          for d in cur.description])

    @staticmethod
    def _fetch(cur, schema: pa.Schema, batch_rows: int) -> Iterator[pa.RecordBatch]:
        """The result's Arrow chunks as they arrive (Snowflake serves a large result as many chunks)."""
        return (b for t in cur.fetch_arrow_batches() for b in t.to_batches())

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None, file_rows: int = 1_000_000) -> int:
        """Create `table` if missing, stage `batches` as Parquet files (PUT to a temporary stage), then
        in one transaction delete the rows where replace[0] == replace[1] and COPY the files in: a
        re-run replaces its partition, never duplicates it. Returns the rows loaded."""
        import pyarrow.parquet as pq

        stage = f"HABITUS_{uuid.uuid4().hex.upper()}"  # generated: [A-Z0-9_] only, needs no quoting
        target = table_expr(table).sql(dialect=DIALECT)
        with self._cursor(table) as cur, tempfile.TemporaryDirectory(prefix="habitus-sf-") as tmp:
            cur.execute(create_table_sql(DIALECT, table, schema))
            cur.execute(f"CREATE TEMPORARY STAGE {stage}")
            try:
                staged = 0
                writer, path, in_file = None, None, 0

                def put(path):
                    uri = "file://" + path.replace("\\", "/").replace("'", "\\'")
                    cur.execute(f"PUT '{uri}' @{stage} AUTO_COMPRESS = FALSE")
                    os.unlink(path)

                for b in batches:
                    if len(b) == 0:
                        continue
                    if writer is None:
                        path = os.path.join(tmp, f"part-{staged:05d}.parquet")
                        writer, in_file = pq.ParquetWriter(path, schema, compression="zstd"), 0
                    writer.write_batch(b)
                    in_file += len(b)
                    if in_file >= file_rows:
                        writer.close()
                        put(path)
                        writer, staged = None, staged + 1
                if writer is not None:
                    writer.close()
                    put(path)
                    staged += 1
                cur.execute("BEGIN")
                try:
                    if replace is not None:
                        cur.execute(delete_sql(DIALECT, table, *replace))
                    loaded = 0
                    if staged:
                        cur.execute(f"COPY INTO {target} FROM @{stage} FILE_FORMAT = (TYPE = PARQUET) "
                                    f"MATCH_BY_COLUMN_NAME = CASE_INSENSITIVE PURGE = TRUE")
                        names = [d.name.lower() for d in cur.description]
                        col = names.index("rows_loaded") if "rows_loaded" in names else 3
                        loaded = sum(int(r[col] or 0) for r in cur.fetchall())
                    cur.execute("COMMIT")
                except Exception:
                    cur.execute("ROLLBACK")
                    raise
                return loaded
            finally:  # a temporary stage also goes with the session; dropping it early is a courtesy
                with contextlib.suppress(Exception):
                    cur.execute(f"DROP STAGE IF EXISTS {stage}")
