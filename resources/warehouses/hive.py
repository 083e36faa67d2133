"""Hive (and Spark Thrift Server, Impala-compatible HiveServer2 endpoints) through PyHive.

Reads fetch `batch_rows` rows at a time (`fetchmany`) and turn them into Arrow batches of the
table's described schema. HiveServer2 has no DELETE on ordinary tables, so a predictions table is
created PARTITIONED BY the replaced column and a write overwrites that one partition
(`INSERT OVERWRITE ... PARTITION (col = value)`) in one statement: re-runs replace, never
duplicate, and a failed load keeps the old rows. Rows travel as multi-row VALUES statements of
`insert_rows` rows (HiveServer2 has no bulk-load endpoint a client can stream to); more than one
statement's worth goes to a staging table first.

Install with `pip install 'habitus[hive]'`. Config (secrets as ${ENV} references):

    connections:
      lake: {type: hive, host: hive.internal, port: 10000, username: habitus, database: shop,
             auth: LDAP, password: ${HIVE_PASSWORD}}
"""

import contextlib
import getpass
import itertools
import re
import uuid
from datetime import date, datetime
from typing import ClassVar, Any, Iterable, Iterator

import dagster as dg
import pyarrow as pa
from sqlglot import exp

from habitus.resources.warehouses.errors import AUTH, WarehouseError, chain, network_error, tables_there
from habitus.resources.warehouses.remote import (CursorQueries, column_array, connect_error, fetch_rows, first_lines, naive_utc,
                                      rows_to_batches, value_literal)
from habitus.resources.store.redaction import redact_text
from habitus.resources.warehouses.masking import secret_values, value
from habitus.resources.warehouses.sql import arrow_sql_type, range_sql, table_expr

DIALECT = "hive"
SUBSTITUTION_OFF = ("hive.variable.substitute", "spark.sql.variable.substitute")  # SET to false on connect

# a table or view that does not exist: Spark's error class, Hive's SemanticException 10001
MISSING_TABLE = re.compile(r"TABLE_OR_VIEW_NOT_FOUND|Table or view not found|Table not found|\[Error 10001\]")

_SIMPLE = {"tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(), "integer": pa.int32(),
           "bigint": pa.int64(), "float": pa.float32(), "double": pa.float64(), "boolean": pa.bool_(),
           "string": pa.string(), "date": pa.date32(), "timestamp": pa.timestamp("us"),
           "timestamp_ntz": pa.timestamp("us"), "timestamp_ltz": pa.timestamp("us"), "binary": pa.binary(),
           "void": pa.string()}


def arrow_type(name: str, hive_type: str) -> pa.DataType:
    """The Arrow type of a Hive column type as DESCRIBE prints it."""
    t = hive_type.strip().lower()
    base = t.split("(", 1)[0]
    if base in _SIMPLE:
        return _SIMPLE[base]
    if base in ("varchar", "char"):
        return pa.string()
    if base in ("decimal", "numeric"):
        args = [int(a) for a in t[len(base) + 1:-1].split(",")] if "(" in t else [10, 0]
        return pa.decimal128(args[0], args[1] if len(args) > 1 else 0)
    raise WarehouseError(f"column {name!r}: Hive type {hive_type} has no Arrow mapping; leave it out of "
                         f"`columns` or convert it in a view")


def transient(exc: BaseException) -> bool:
    """Whether a PyHive / Thrift error may pass when retried: the transport failed (Thrift's
    TTransportException: not open, timed out, end of file; a reset or refused socket), not an answer of
    the server. Permanent: a refused login (SASL: "Error validating the login"), and every error the
    server reported in a TStatus (a missing table, a parse or analysis error): the server answered."""
    if any(AUTH.search(str(e)) for e in chain(exc)):
        return False
    return network_error(exc)


def _literal(v) -> exp.Expression:
    return value_literal(v)


def _partition_literal(v) -> exp.Expression:
    """A partition spec takes constants only: times and dates as their text."""
    if isinstance(v, datetime):
        return exp.Literal.string(naive_utc(v).isoformat(sep=" "))
    if isinstance(v, date):
        return exp.Literal.string(v.isoformat())
    return _literal(v)


class HiveWarehouse(CursorQueries, dg.ConfigurableResource):
    warehouse_kind: ClassVar[str] = "hive"
    sql_dialect: ClassVar[str] = DIALECT
    default_batch_rows: ClassVar[int] = 1 << 16

    name: str = ""
    host: str = "localhost"
    port: int = 10000
    username: str | None = None
    password: str | None = None
    database: str = "default"
    auth: str | None = None  # NONE, NOSASL, LDAP, CUSTOM, KERBEROS
    connect_timeout: int = 10  # seconds to connect and open the session
    options: dict[str, Any] = {}

    def _secrets(self) -> list:
        return secret_values(self)

    def connect_kwargs(self) -> dict:
        kw = {"host": self.host, "port": self.port, "username": self.username, "password": self.password,
              "database": self.database, "auth": self.auth}
        kw = {k: value(v) for k, v in kw.items() if v is not None}
        kw.update({k: value(v) for k, v in self.options.items()})
        if kw.get("password") and not kw.get("auth"):
            kw["auth"] = "LDAP"
        return kw

    def _connect(self):
        from pyhive import hive

        kw = self.connect_kwargs()
        try:
            sock, transport = self._transport(kw)
            if transport is None:  # Kerberos or HTTP transport: PyHive builds it (no connect timeout then)
                con = hive.Connection(**kw)
            else:
                con = hive.Connection(username=kw.get("username") or getpass.getuser(),
                                      database=kw.get("database", "default"),
                                      configuration=kw.get("configuration"), thrift_transport=transport)
                sock.setTimeout(None)  # connected: a long query may take its time
        except Exception as e:
            raise connect_error("hive", self.name, self._where(), e, self._secrets(), transient(e)) from None
        with contextlib.suppress(Exception):  # Spark: render and parse timestamps in UTC
            con.cursor().execute("SET spark.sql.session.timeZone=UTC")
        # no ${env:...} / ${hiveconf:...} expansion in this session's statements (Hive, Spark; each server
        # takes the other's key as a plain setting); the written literals never hold `${` either
        # (resources/warehouses/remote.py text_literal). A server that refuses to switch it off (a restricted setting)
        # is an error: its statements would expand variables
        for setting in SUBSTITUTION_OFF:
            try:
                con.cursor().execute(f"SET {setting}=false")
            except Exception as e:  # noqa: BLE001 - whatever the driver raised, the session is not safe
                with contextlib.suppress(Exception):
                    con.close()
                cause = redact_text(first_lines(self._error_cause(e)), self._secrets())
                raise WarehouseError(f"connection {self.name or '?'!r} (hive at {self._where()}): the server refused "
                                     f"`SET {setting}=false` ({cause}), so this session would expand ${{...}} "
                                     f"variables in statements; allow the setting for this user (remove it from "
                                     f"hive.conf.restricted.list) or set it to false on the server") from None
        return con

    def _transport(self, kw: dict):
        """(socket, transport) of PyHive's binary transport with a connect timeout: a host that does
        not answer fails after `connect_timeout` seconds, not after the system's TCP timeout (minutes).
        (None, None) where PyHive must build it (Kerberos, HTTP)."""
        auth = (kw.get("auth") or "NONE").upper()
        if auth not in ("NONE", "NOSASL", "LDAP", "CUSTOM") or kw.get("scheme"):
            return None, None
        from thrift.transport import TSocket, TTransport

        sock = TSocket.TSocket(kw["host"], kw.get("port", 10000))
        sock.setTimeout(self.connect_timeout * 1000)
        if auth == "NOSASL":
            return sock, TTransport.TBufferedTransport(sock)
        import thrift_sasl
        from pyhive.hive import get_installed_sasl

        user, password = kw.get("username") or getpass.getuser(), kw.get("password") or "x"  # NONE: any non-empty
        return sock, thrift_sasl.TSaslClientTransport(
            lambda: get_installed_sasl(host=kw["host"], sasl_auth="PLAIN", service=None, username=user,
                                       password=password), "PLAIN", sock)

    def _where(self) -> str:
        return f"{self.host}:{self.port}"

    def _transient(self, exc: BaseException) -> bool:
        return transient(exc)

    def _error_cause(self, exc: BaseException) -> BaseException:
        """The server's message (pyhive's thrift/DB-API errors hold it); a missing table's with the tables there."""
        message = _server_message(exc)
        return RuntimeError(message + tables_there(self.tables) if MISSING_TABLE.search(message) else message)

    def tables(self) -> list[str]:
        """The tables and views of the connection's `database` (SHOW TABLES: Hive gives tab_name, Spark
        namespace, tableName, isTemporary)."""
        database = value(self.database)
        with self._cursor("SHOW TABLES") as cur:
            cur.execute(f"SHOW TABLES IN {exp.to_identifier(database, quoted=True).sql(DIALECT)}")
            return sorted(row[1] if len(row) > 1 else row[0] for row in cur.fetchall())

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _describe(cur, table: str, columns: list[str] | None) -> pa.Schema:
        cur.execute(exp.Describe(this=table_expr(table)).sql(dialect=DIALECT))
        types = {}
        for row in cur.fetchall():
            col = (row[0] or "").strip()
            if not col or col.startswith("#"):
                break  # partition information follows; its columns were listed above
            types[col] = row[1]
        names = columns or list(types)
        missing = [c for c in names if c not in types]
        if missing:
            raise WarehouseError(f"table {table!r}: column(s) {missing} not found; it has {list(types)}")
        return pa.schema([pa.field(c, arrow_type(c, types[c])) for c in names])

    def time_range(self, table: str, time_column: str) -> tuple[datetime | None, datetime | None]:
        with self._cursor(table) as cur:
            schema = self._describe(cur, table, [time_column])
            cur.execute(range_sql(DIALECT, table, time_column))
            lo, hi = cur.fetchone()
            typ = schema.field(0).type
            lo, hi = (column_array([v], typ, time_column)[0].as_py() for v in (lo, hi))
            return naive_utc(lo), naive_utc(hi)

    @staticmethod
    def _fetch(cur, schema: pa.Schema, batch_rows: int) -> Iterator[pa.RecordBatch]:
        """`batch_rows` rows at a time (`fetchmany`), as Arrow batches of the described schema."""
        return rows_to_batches(fetch_rows(cur, batch_rows), schema, batch_rows)

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None, insert_rows: int = 5_000) -> int:
        """Overwrite the partition replace[0] = replace[1] with `batches` (the table is created
        PARTITIONED BY that column when missing) in one statement: up to `insert_rows` rows as one
        INSERT OVERWRITE ... VALUES, more through a staging table and one INSERT OVERWRITE ...
        SELECT. Without `replace`, append."""
        target = table_expr(table)
        part_col = replace[0] if replace else None
        data_fields = [f for f in schema if f.name != part_col]
        with self._cursor(table) as cur:
            cols = [exp.ColumnDef(this=exp.to_identifier(f.name, quoted=True), kind=arrow_sql_type(f.type, DIALECT))
                    for f in data_fields]
            create = exp.Create(this=exp.Schema(this=target.copy(), expressions=cols), kind="TABLE", exists=True)
            sql = create.sql(dialect=DIALECT)
            if part_col:
                f = schema.field(part_col)
                sql += (f" PARTITIONED BY ({exp.to_identifier(part_col, quoted=True).sql(DIALECT)} "
                        f"{arrow_sql_type(f.type, DIALECT).sql(DIALECT)})")
            cur.execute(sql + " STORED AS PARQUET")
            spec = ""
            if part_col:
                spec = (f" PARTITION ({exp.to_identifier(part_col, quoted=True).sql(DIALECT)} = "
                        f"{_partition_literal(replace[1]).sql(DIALECT)})")
            names = [f.name for f in data_fields]
            if not part_col:
                written = 0
                for rows in _row_chunks(batches, names, insert_rows):
                    cur.execute(f"INSERT INTO TABLE {target.sql(DIALECT)} {_values(rows).sql(DIALECT)}")
                    written += len(rows)
                return written
            chunks = _row_chunks(batches, names, insert_rows)
            first = next(chunks, None)
            second = next(chunks, None) if first is not None else None
            if first is None:  # nothing to write: the partition is emptied
                cur.execute(f"ALTER TABLE {target.sql(DIALECT)} DROP IF EXISTS{spec}")
                return 0
            if second is None:  # one statement: the partition is replaced whole or not at all
                cur.execute(f"INSERT OVERWRITE TABLE {target.sql(DIALECT)}{spec} {_values(first).sql(DIALECT)}")
                return len(first)
            # More rows than one statement holds: they go to a staging table first, then one
            # INSERT OVERWRITE ... SELECT replaces the partition, so a failed load keeps the old rows.
            stage = ".".join(p for p in (target.db, f"_habitus_stage_{uuid.uuid4().hex[:12]}") if p)
            stage_sql = table_expr(stage).sql(DIALECT)
            stage_cols = [c.copy() for c in cols]
            cur.execute(exp.Create(this=exp.Schema(this=table_expr(stage), expressions=stage_cols), kind="TABLE")
                        .sql(dialect=DIALECT) + " STORED AS PARQUET")
            try:
                written = 0
                for rows in itertools.chain([first, second], chunks):
                    cur.execute(f"INSERT INTO TABLE {stage_sql} {_values(rows).sql(DIALECT)}")
                    written += len(rows)
                quoted = ", ".join(exp.to_identifier(n, quoted=True).sql(DIALECT) for n in names)
                cur.execute(f"INSERT OVERWRITE TABLE {target.sql(DIALECT)}{spec} SELECT {quoted} FROM {stage_sql}")
                return written
            finally:
                cur.execute(f"DROP TABLE IF EXISTS {stage_sql}")


def _values(rows: list[tuple]) -> exp.Expression:
    return exp.values([exp.tuple_(*[_literal(v) for v in r]) for r in rows])


def _row_chunks(batches: Iterable[pa.RecordBatch], names: list[str], n: int) -> Iterator[list[tuple]]:
    pending: list[tuple] = []
    for b in batches:
        cols = [b.column(b.schema.get_field_index(c)).to_pylist() for c in names]
        pending.extend(zip(*cols))
        while len(pending) >= n:
            yield pending[:n]
            pending = pending[n:]
    if pending:
        yield pending


def _server_message(e: BaseException) -> str:
    """The server's error text from a PyHive/Thrift exception (it nests a TStatus)."""
    status = getattr(getattr(e, "args", [None])[0], "status", None) if getattr(e, "args", None) else None
    msg = getattr(status, "errorMessage", None) or first_lines(e, 3)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    return " ".join(lines[:2])[:600]
