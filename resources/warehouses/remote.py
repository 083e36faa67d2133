"""What the networked warehouse connectors share: errors that name the connection and never a
secret, the values that travel in and out of their SQL, and `CursorQueries`, the part of a
connector with a DB-API driver that does not depend on the driver. Their batches are cast once
(resources/warehouses/batches.py).

Each connector (`snowflake`, `clickhouse`, `databricks`, `synapse`, `hive`, `bigquery`) is a
`ConfigurableResource` with the interface of `habitus.resources.warehouses.duckdb.DuckDBWarehouse`:
`schema(table)`, `time_range(table, time_column)`, `read(...) -> Iterator[pa.RecordBatch]` and
`write(table, batches, schema, replace=(column, value)) -> rows`.
"""

import contextlib
import re
from datetime import datetime
from typing import ClassVar, Iterable, Iterator

import dagster as dg
import pyarrow as pa

from habitus.resources.store.redaction import redact_text
from habitus.resources.warehouses.batches import Batches
from habitus.resources.warehouses.errors import WarehouseError, network_error
from habitus.resources.warehouses.sql import freshness_sql, partition_counts_sql, range_sql, select_sql, utc_naive

class _SecretNames:
    """Key names that hold a secret, matched case-insensitively by pattern (`password`, `Password`,
    `private_key_file_pwd`, `oauth_client_secret`, `accountKey`, ...): `key in SECRET_KEYS`. A value
    from `${VAR}` is a secret whatever its key (pipelines/config/file.py EnvValue); this catches those
    written in the file, and what errors must leave out."""

    PATTERN = re.compile(r"pass(word|wd|phrase|code)?|pwd|secret|token|credential|private|"
                         r"(account|access|api|auth|client|master|shared|signing|sas)_?key|signature", re.I)

    def __contains__(self, key) -> bool:
        return isinstance(key, str) and bool(self.PATTERN.search(key))


SECRET_KEYS = _SecretNames()


def secret_values(resource) -> list:
    """What errors of `resource` must never show: every field and option whose key names a secret, and
    every value given as an environment variable (EnvVar, or {"env": NAME} inside `options`)."""
    found = []
    for name in type(resource).model_fields:
        v = getattr(resource, name, None)
        if name != "options" and (name in SECRET_KEYS or isinstance(v, dg.EnvVar)):
            found.append(v)
    for k, v in (getattr(resource, "options", None) or {}).items():
        if k in SECRET_KEYS or isinstance(v, dg.EnvVar) or (isinstance(v, dict) and set(v) == {"env"}):
            found.append(v)
    return [v for v in found if v is not None]


def value(v):
    """A resource field's value with `EnvVar`s read from the environment: as the object itself
    (a resource used outside a run) or, inside a dict field such as `options`, as {"env": NAME}."""
    if isinstance(v, dg.EnvVar):
        return v.get_value()
    if isinstance(v, dict) and set(v) == {"env"} and isinstance(v["env"], str):
        import os

        if v["env"] not in os.environ:
            raise WarehouseError(f"environment variable {v['env']} is not set (a connection parameter reads it)")
        return os.environ[v["env"]]
    return v


def first_lines(exc: BaseException, n: int = 3) -> str:
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:n] if line.strip())
    return re.sub(r"\s+", " ", text) or type(exc).__name__


def connect_error(kind: str, name: str, where: str, exc: BaseException, secrets: Iterable,
                  transient: bool | None = None) -> WarehouseError:
    """A failed connection: which connection, which host, the driver's cause; never a secret (`secrets`, and
    any URL's credentials: resources/store/redaction.py `redact_text`).
    `transient` (default: the chain holds a refused, reset or timed-out connection, resources/warehouses/errors.py):
    the server may answer later (retried); a refused login or an unknown host is permanent."""
    transient = network_error(exc) if transient is None else transient
    cause = redact_text(f"{type(exc).__name__}: {first_lines(exc)}", secrets)
    return WarehouseError(f"connection {name or '?'!r} ({kind} at {where}): cannot connect: {cause}. "
                          f"Check the host, credentials and network access in the project config's `connections`",
                          transient=transient)


def query_error(kind: str, name: str, table: str, exc: BaseException, secrets: Iterable, where: str | None = None,
                transient: bool = False) -> WarehouseError:
    """A failed statement on `table`; `where` (the host) is named when given, and always for a transient
    error (the connection dropped or the server was unavailable during the statement)."""
    at = f" at {where}" if where else ""
    lost = "the connection failed during the query (transient): " if transient else ""
    return WarehouseError(f"table {table!r} in {kind} connection {name or '?'!r}{at}: {lost}"
                          f"{redact_text(first_lines(exc), secrets)}", transient=transient)


def rows_to_batches(rows: Iterable[tuple], schema: pa.Schema, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """DB-API rows (fetched `batch_rows` at a time by the caller) as Arrow batches of `schema`."""
    chunk: list[tuple] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= batch_rows:
            yield _rows_batch(chunk, schema)
            chunk = []
    if chunk:
        yield _rows_batch(chunk, schema)


def column_array(values: list, typ: pa.DataType, name: str = "?") -> pa.Array:
    """Python values as an Arrow array of `typ`; values a driver sends as text (HiveServer2's
    timestamps, dates and decimals) are parsed. A value that does not fit is an error naming the column."""
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
        if any(isinstance(v, str) for v in values) and not pa.types.is_string(typ):
            try:
                return pa.array([None if v is None else str(v) for v in values], pa.string()).cast(typ)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                pass
        raise WarehouseError(f"column {name!r}: values do not fit {typ}: {first_lines(e, 1)}") from None


def _rows_batch(rows: list[tuple], schema: pa.Schema) -> pa.RecordBatch:
    columns = list(zip(*rows))
    return pa.RecordBatch.from_arrays([column_array(list(columns[i]), f.type, f.name) for i, f in enumerate(schema)],
                                      schema=schema)


def fetch_rows(cursor, batch_rows: int) -> Iterator[tuple]:
    """A DB-API cursor's rows, `fetchmany(batch_rows)` at a time: never the whole result in memory."""
    while True:
        rows = cursor.fetchmany(batch_rows)
        if not rows:
            return
        yield from rows


def naive_utc(v):
    """A timestamp from the warehouse as the pipeline's naive-UTC datetime."""
    from datetime import datetime, timezone

    if isinstance(v, datetime) and v.tzinfo is not None:
        return v.astimezone(timezone.utc).replace(tzinfo=None)
    return v


def as_time(v):
    """A time from a driver as a naive UTC datetime: text (HiveServer2 sends times as text) is
    parsed, dates become midnight, None stays None."""
    if isinstance(v, str):
        v = datetime.fromisoformat(v.strip())
    return utc_naive(v)


def period_counts(rows: Iterable[tuple]) -> dict:
    """(period start, rows, newest) rows of `partition_counts_sql` as {period: (rows, newest)}."""
    return {as_time(p): (int(n), as_time(m)) for p, n, m in rows}


def value_literal(v, timestamp_type: str = "TIMESTAMP", aware_timestamp_type: str | None = None,
                  dialect: str | None = None):
    """A Python value as a typed SQL literal for INSERT ... VALUES (Hive, Databricks): timestamps as
    UTC text cast to `timestamp_type` (`aware_timestamp_type` for zone-aware values)."""
    from datetime import date, datetime
    from decimal import Decimal

    from sqlglot import exp

    if v is None:
        return exp.null()
    if isinstance(v, bool):
        return exp.true() if v else exp.false()
    if isinstance(v, (int, float, Decimal)):
        return exp.Literal.number(str(v))
    if isinstance(v, datetime):
        kind = (aware_timestamp_type or timestamp_type) if v.tzinfo else timestamp_type
        return exp.cast(exp.Literal.string(naive_utc(v).isoformat(sep=" ")), exp.DataType.build(kind, dialect=dialect))
    if isinstance(v, date):
        return exp.cast(exp.Literal.string(v.isoformat()), exp.DataType.build("DATE"))
    if isinstance(v, bytes):
        return exp.func("unhex", exp.Literal.string(v.hex()))
    return text_literal(str(v))


def text_literal(text: str):
    """A string literal whose SQL text never holds `${`: HiveServer2 and Spark expand `${env:...}` and
    `${hiveconf:...}` inside string literals before parsing, so an entity id or a label such as
    `${env:DATABRICKS_TOKEN}` would copy a server secret into the table. Such a value is written as
    CONCAT('...$', '{...') (the same text, read back unchanged)."""
    from sqlglot import exp

    if "${" not in text:
        return exp.Literal.string(text)
    head, *rest = text.split("${")
    pieces = [head + "$"] + ["{" + r + "$" for r in rest[:-1]] + ["{" + rest[-1]]
    return exp.func("concat", *(exp.Literal.string(p) for p in pieces))


def _close(handle) -> None:
    """Close a cursor or connection. Closing one whose server went away fails (a broken pipe), and that
    failure must not replace the error that says what happened; nothing is undone by a failed close."""
    with contextlib.suppress(Exception):
        handle.close()


class ChunkReads:
    """`read` for a connector whose `_chunks(table, columns, time_column, start, end, batch_rows, where)` is a
    generator holding the connection: it yields the described schema, then the driver's Arrow batches."""

    default_batch_rows: ClassVar[int] = 1 << 17

    def read(self, table: str, columns: list[str] | None = None, time_column: str | None = None,
             start: datetime | None = None, end: datetime | None = None,
             batch_rows: int | None = None, where: str | None = None) -> Batches:
        """The columns of `table` whose `time_column` is in [start, end) and that pass the row filter
        `where` (resources/warehouses/row_filter.py), projection and filters in the warehouse's SQL, as Arrow batches
        of the table's described schema (`default_batch_rows` rows at most unless `batch_rows` says otherwise)."""
        batch_rows = batch_rows or self.default_batch_rows
        return Batches(self._chunks(table, columns, time_column, start, end, batch_rows, where), table, batch_rows)


class CursorQueries(ChunkReads):
    """What the connectors with a DB-API driver (Databricks, Hive, Snowflake, Synapse) share: a
    connection and a cursor for each call, both closed after it, and the driver's errors translated
    into a `WarehouseError` naming the connection and the table, never a secret; `schema`,
    `time_range`, `read` and the new-data sensor's two questions, each one query run in the warehouse.

    A connector gives what differs: `warehouse_kind` (its name in messages), `sql_dialect`,
    `default_batch_rows` (see `ChunkReads`), `_connect(**options)`, `_secrets()`,
    `_describe(cursor, table, columns)` (the table's schema), `_fetch(cursor, schema, batch_rows)` (the
    result's Arrow batches) and, where the defaults do not fit, `_query_errors()` (the driver's errors that are translated: all by
    default), `_error_cause(exc)` (the part of such an error worth showing), `_where()` (the host named in
    errors) and `_transient(exc)` (whether the driver's error may pass when retried: by default a failure of
    the transport, resources/warehouses/errors.py `network_error`)."""

    warehouse_kind: ClassVar[str]
    sql_dialect: ClassVar[str]

    def _query_errors(self) -> tuple[type[BaseException], ...]:
        return (Exception,)

    def _error_cause(self, exc: BaseException) -> BaseException:
        return exc

    def _where(self) -> str | None:
        host, port = getattr(self, "host", None), getattr(self, "port", None)
        return f"{value(host)}:{port}" if host and port else (value(host) if host else None)

    def _transient(self, exc: BaseException) -> bool:
        return network_error(exc)

    @contextlib.contextmanager
    def _session(self, table: str, **options):
        """(connection, cursor), closed afterwards; the driver's errors name the connection and `table`.
        `options` go to `_connect`."""
        try:
            con = self._connect(**options)
        except ModuleNotFoundError as e:  # the connector's extra is not installed: say which, not a traceback
            raise WarehouseError(f"connection {self.name or '?'!r} ({self.warehouse_kind}): cannot connect: its driver "
                                 f"{e.name!r} is not installed; pip install 'habitus[{self.warehouse_kind}]'") from None
        try:
            cur = con.cursor()
            try:
                yield con, cur
            except WarehouseError:
                raise
            except Exception as e:
                if not isinstance(e, self._query_errors()):
                    raise
                raise query_error(self.warehouse_kind, self.name, table, self._error_cause(e), self._secrets(),
                                  where=self._where(), transient=self._transient(e)) from None
            finally:
                _close(cur)
        finally:
            _close(con)

    @contextlib.contextmanager
    def _cursor(self, table: str, **options):
        """The cursor of `_session`."""
        with self._session(table, **options) as (_, cur):
            yield cur

    def schema(self, table: str) -> pa.Schema:
        with self._cursor(table) as cur:
            return self._describe(cur, table, None)

    def time_range(self, table: str, time_column: str) -> tuple[datetime | None, datetime | None]:
        """(min, max) of the time column; time-zone-aware values as naive UTC."""
        with self._cursor(table) as cur:
            cur.execute(range_sql(self.sql_dialect, table, time_column))
            lo, hi = cur.fetchone()
            return naive_utc(lo), naive_utc(hi)

    def freshness(self, table: str, time_column: str) -> tuple[int, datetime | None]:
        """Rows and the newest time (naive UTC): what a new-data sensor asks on every tick."""
        with self._cursor(table) as cur:
            cur.execute(freshness_sql(self.sql_dialect, table, time_column))
            rows, newest = cur.fetchone()
            return int(rows), as_time(newest)

    def partition_counts(self, table: str, time_column: str, grain: str) -> dict[datetime, tuple[int, datetime]]:
        """{start of each month or day (UTC): (rows, newest time)}: one GROUP BY in the warehouse."""
        with self._cursor(table) as cur:
            cur.execute(partition_counts_sql(self.sql_dialect, table, time_column, grain))
            return period_counts(cur.fetchall())

    def _chunks(self, table, columns, time_column, start, end, batch_rows, where=None) -> Iterator:
        """The source of `Batches`: the described schema, then the driver's batches."""
        with self._cursor(table) as cur:
            schema = self._describe(cur, table, columns)
            yield schema
            cur.execute(select_sql(self.sql_dialect, table, columns, time_column, start, end, where))
            yield from self._fetch(cur, schema, batch_rows)
