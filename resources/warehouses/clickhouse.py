"""ClickHouse through clickhouse-connect: reads stream the result as Arrow record batches
(`query_arrow_stream`, format ArrowStream), writes are Arrow inserts (`insert_arrow`) into a
staging table that is swapped in with one statement.

Install with `pip install 'habitus[clickhouse]'`. Config (secrets as ${ENV} references):

    connections:
      ch: {type: clickhouse, host: ch.internal, port: 8443, secure: true, username: habitus,
           password: ${CH_PASSWORD}, database: shop}

`interface: chdb` (with `path:`) runs the same client on the in-process chDB engine. Other keys go
to `clickhouse_connect.get_client` as given. Every session runs with `session_timezone = 'UTC'`, so
time windows (naive UTC) mean the same on any server. ClickHouse has no multi-statement
transactions: a write loads a staging table and then replaces the day's partition from it
(REPLACE PARTITION) or swaps the tables (EXCHANGE TABLES), each one atomic statement, so a failed
load keeps the previous rows and a re-run never duplicates them.
"""

import contextlib
import re
import uuid
from datetime import datetime
from typing import Any, Iterable, Iterator

import dagster as dg
import pyarrow as pa
from sqlglot import exp

from habitus.resources.warehouses.errors import WarehouseError, tables_there
from habitus.resources.warehouses.remote import (ChunkReads, as_time, connect_error, first_lines, naive_utc, period_counts,
                                      query_error)
from habitus.resources.warehouses.masking import secret_values, value
from habitus.resources.warehouses.sql import (_literal, count_sql, create_table_sql, freshness_sql, partition_counts_sql, range_sql,
                           select_expr, table_expr)

DIALECT = "clickhouse"
SESSION = {"session_timezone": "UTC", "output_format_arrow_string_as_string": 1,
           "output_format_arrow_low_cardinality_as_dictionary": 0}

# ClickHouse's error code of a table that does not exist (UNKNOWN_TABLE)
MISSING_TABLE = re.compile(r"\bCode: 60\b|UNKNOWN_TABLE")

_INT = {"Int8": pa.int8(), "Int16": pa.int16(), "Int32": pa.int32(), "Int64": pa.int64(),
        "UInt8": pa.uint8(), "UInt16": pa.uint16(), "UInt32": pa.uint32(), "UInt64": pa.uint64()}
_STRINGY = ("String", "FixedString", "UUID", "Enum8", "Enum16", "Enum", "IPv4", "IPv6")


def _unwrap(t: str) -> str:
    t = t.strip()
    for wrapper in ("Nullable", "LowCardinality", "SimpleAggregateFunction"):
        if t.startswith(wrapper + "(") and t.endswith(")"):
            inner = t[len(wrapper) + 1:-1]
            if wrapper == "SimpleAggregateFunction":
                inner = inner.split(",", 1)[1]
            return _unwrap(inner)
    return t


def arrow_type(name: str, ch_type: str) -> pa.DataType:
    """The Arrow type of a ClickHouse column type as DESCRIBE prints it."""
    t = _unwrap(ch_type)
    base = t.split("(", 1)[0]
    args = [a.strip().strip("'") for a in t[len(base) + 1:-1].split(",")] if "(" in t else []
    if base in _INT:
        return _INT[base]
    if base in ("Int128", "UInt128"):
        return pa.decimal128(38, 0)
    if base in ("Float32",):
        return pa.float32()
    if base in ("Float64",):
        return pa.float64()
    if base == "Bool":
        return pa.bool_()
    if base.startswith("Decimal"):
        if base == "Decimal":
            p, s = int(args[0]), int(args[1]) if len(args) > 1 else 0
        else:  # Decimal32(S), Decimal64(S), Decimal128(S), Decimal256(S)
            p, s = {"Decimal32": 9, "Decimal64": 18, "Decimal128": 38, "Decimal256": 76}[base], int(args[0])
        return pa.decimal128(p, s) if p <= 38 else pa.decimal256(p, s)
    if base in _STRINGY:
        return pa.string()
    if base in ("Date", "Date32"):
        return pa.date32()
    if base == "DateTime":
        return pa.timestamp("s", tz="UTC" if args and args[0] else None)
    if base == "DateTime64":
        digits = int(args[0]) if args else 3
        unit = "s" if digits == 0 else "ms" if digits <= 3 else "us" if digits <= 6 else "ns"
        return pa.timestamp(unit, tz="UTC" if len(args) > 1 else None)
    raise WarehouseError(f"column {name!r}: ClickHouse type {ch_type} has no Arrow mapping; leave it out of "
                         f"`columns` or convert it in a view")


def _precise_times(query: exp.Expression) -> exp.Expression:
    """Timestamp literals as DateTime64(6): ClickHouse's DateTime (what TIMESTAMP becomes) would drop
    the microseconds of a bound."""
    def fix(node):
        if isinstance(node, exp.Cast) and node.to.is_type(exp.DataType.Type.TIMESTAMP, exp.DataType.Type.DATETIME):
            return exp.cast(node.this, exp.DataType.build("DateTime64(6)", dialect=DIALECT))
        return node
    return query.transform(fix)


def _projection(ch_type: str, name: str) -> exp.Expression:
    """The column as selected: types whose Arrow output is not their value (an Enum's code, a UUID's
    bytes, an IPv4's integer, a 128-bit integer's bytes) are converted in the query."""
    col = exp.column(name, quoted=True)
    base = _unwrap(ch_type).split("(", 1)[0]
    if base in _STRINGY and base not in ("String", "FixedString"):
        return exp.alias_(exp.func("toString", col), name, quoted=True)
    if base in ("Int128", "UInt128"):
        return exp.alias_(exp.cast(col, exp.DataType.build("Decimal(38, 0)", dialect=DIALECT)), name, quoted=True)
    return col


class ClickHouseWarehouse(ChunkReads, dg.ConfigurableResource):
    name: str = ""
    host: str = "localhost"
    port: int | None = None
    username: str = "default"
    password: str | None = None
    database: str | None = None
    secure: bool = False
    interface: str | None = None  # http / https, or chdb (in-process engine; `path` in options)
    connect_timeout: int = 10
    options: dict[str, Any] = {}

    def _secrets(self) -> list:
        return secret_values(self)

    def _where(self) -> str:
        if self.interface == "chdb":
            return f"chdb:{self.options.get('path') or 'memory'}"
        return f"{self.host}:{self.port or (8443 if self.secure else 8123)}"

    def client_kwargs(self) -> dict:
        kw = {"host": self.host, "port": self.port, "username": self.username, "password": self.password,
              "database": self.database, "secure": self.secure, "interface": self.interface,
              "connect_timeout": self.connect_timeout}
        kw = {k: value(v) for k, v in kw.items() if v is not None}
        kw.update({k: value(v) for k, v in self.options.items()})
        kw["settings"] = {**SESSION, **(kw.get("settings") or {})}
        if kw.get("interface") == "chdb":
            for k in ("host", "port", "username", "password", "secure", "connect_timeout"):
                kw.pop(k, None)
        return kw

    def _client(self):
        import clickhouse_connect

        try:
            return clickhouse_connect.get_client(**self.client_kwargs())
        except Exception as e:
            raise connect_error("clickhouse", self.name, self._where(), e, self._secrets()) from None

    @contextlib.contextmanager
    def _session(self, table: str):
        from clickhouse_connect.driver.exceptions import ClickHouseError

        client = self._client()
        try:
            yield client
        except ClickHouseError as e:
            cause = _short(e)
            if MISSING_TABLE.search(str(e)):  # Code: 60, UNKNOWN_TABLE: with the tables there
                cause = RuntimeError(f"{cause}{tables_there(lambda: _tables(client, table_expr(table).db or None))}")
            raise query_error("clickhouse", self.name, table, cause, self._secrets()) from None
        finally:
            client.close()

    def tables(self) -> list[str]:
        """The tables and views of the connection's `database` (system.tables)."""
        with self._session("system.tables") as client:
            return _tables(client, None)

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _describe(client, table: str, columns: list[str] | None, with_types: bool = False):
        rows = client.query(exp.Describe(this=table_expr(table)).sql(dialect=DIALECT)).result_rows
        types = {r[0]: r[1] for r in rows}
        names = columns or [r[0] for r in rows]
        missing = [c for c in names if c not in types]
        if missing:
            raise WarehouseError(f"table {table!r}: column(s) {missing} not found; it has {list(types)}")
        schema = pa.schema([pa.field(c, arrow_type(c, types[c])) for c in names])
        return (schema, types) if with_types else schema

    def schema(self, table: str) -> pa.Schema:
        with self._session(table) as client:
            return self._describe(client, table, None)

    def time_range(self, table: str, time_column: str) -> tuple[datetime | None, datetime | None]:
        """(min, max) of the time column as naive UTC; (None, None) for an empty table."""
        with self._session(table) as client:
            sql = range_sql(DIALECT, table, time_column)
            n = client.query(count_sql(DIALECT, table)).result_rows
            if not n or not n[0][0]:  # min() of no rows is the type's zero in ClickHouse, not NULL
                return None, None
            lo, hi = client.query(sql).result_rows[0]
            return naive_utc(lo), naive_utc(hi)

    def freshness(self, table: str, time_column: str) -> tuple[int, datetime | None]:
        """Rows and the newest time (naive UTC); None for an empty table (whose max() in ClickHouse
        is the type's zero, not NULL)."""
        with self._session(table) as client:
            rows, newest = client.query(freshness_sql(DIALECT, table, time_column)).result_rows[0]
            return int(rows), as_time(newest) if rows else None

    def partition_counts(self, table: str, time_column: str, grain: str) -> dict[datetime, tuple[int, datetime]]:
        """{start of each month or day (UTC): (rows, newest time)}: one GROUP BY in ClickHouse."""
        with self._session(table) as client:
            return period_counts(client.query(partition_counts_sql(DIALECT, table, time_column, grain)).result_rows)

    def _chunks(self, table, columns, time_column, start, end, batch_rows, where=None) -> Iterator:
        """The source of `Batches`: the described schema, then the ArrowStream result block by block
        (`max_block_size` = batch_rows)."""
        with self._session(table) as client:
            schema, client_types = self._describe(client, table, columns, with_types=True)
            yield schema
            sql = _precise_times(select_expr(table, [_projection(client_types[f.name], f.name) for f in schema],
                                             time_column, start, end, where)).sql(dialect=DIALECT, comments=False)
            settings = {"max_block_size": batch_rows, "preferred_block_size_bytes": 64 << 20}
            with client.query_arrow_stream(sql, settings=settings, use_strings=True) as stream:
                yield from (b for part in stream for b in (part.to_batches() if isinstance(part, pa.Table) else [part]))

    # ------------------------------------------------------------------ writing

    def write(self, table: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
              replace: tuple[str, object] | None = None, insert_rows: int = 500_000) -> int:
        """Write `batches` to `table` (a MergeTree, created if missing), replacing the rows where
        replace[0] == replace[1]. The rows are loaded into a staging table first and swapped in with
        one statement, so a failed load leaves the previous rows in place, never a half-written day:
        a table partitioned by the replaced column (as created here) takes the new partition with
        ALTER TABLE ... REPLACE PARTITION; any other table is rebuilt in the staging table (its other
        rows copied on the server) and swapped with EXCHANGE TABLES. Returns the rows written."""
        target = table_expr(table).sql(dialect=DIALECT)
        with self._session(table) as client:
            client.command(create_table_sql(DIALECT, table, schema, partition_by=replace[0] if replace else None))
            if replace is None:
                return self._insert_all(client, target, batches, schema, insert_rows)
            column = replace[0]
            cond = _precise_times(exp.EQ(this=exp.column(column, quoted=True), expression=_literal(replace[1])))
            t = table_expr(table)
            stage = exp.table_(f"_habitus_stage_{uuid.uuid4().hex[:12]}", db=t.args.get("db"), quoted=True)
            stage = stage.sql(dialect=DIALECT)
            client.command(f"CREATE TABLE {stage} AS {target}")
            try:
                partitioned = _partition_key(client, t) == column
                if not partitioned:
                    client.command(f"INSERT INTO {stage} SELECT * FROM {target} WHERE NOT ({cond.sql(DIALECT)})")
                written = self._insert_all(client, stage, batches, schema, insert_rows)
                if not partitioned:
                    client.command(f"EXCHANGE TABLES {target} AND {stage}")
                    return written
                ids = [r[0] for r in client.query(f"SELECT DISTINCT _partition_id FROM {stage}").result_rows]
                if len(ids) > 1:
                    raise WarehouseError(f"table {table!r}: rows to write hold {len(ids)} values of {column!r}, "
                                         f"expected only {replace[1]!r}")
                if ids:
                    client.command(f"ALTER TABLE {target} REPLACE PARTITION ID '{ids[0]}' FROM {stage}")
                else:  # an empty day empties its partition
                    for (old,) in client.query(f"SELECT DISTINCT _partition_id FROM {target} "
                                               f"WHERE {cond.sql(DIALECT)}").result_rows:
                        client.command(f"ALTER TABLE {target} DROP PARTITION ID '{old}'")
                return written
            finally:
                client.command(f"DROP TABLE IF EXISTS {stage}")

    def _insert_all(self, client, target: str, batches: Iterable[pa.RecordBatch], schema: pa.Schema,
                    insert_rows: int) -> int:
        """`batches` inserted as Arrow blocks of up to `insert_rows` rows; the rows inserted."""
        written, pending, n = 0, [], 0
        for b in batches:
            if len(b):
                pending.append(b)
                n += len(b)
            if n >= insert_rows:
                written += self._insert(client, target, pending, schema)
                pending, n = [], 0
        if pending:
            written += self._insert(client, target, pending, schema)
        return written

    @staticmethod
    def _insert(client, target: str, batches: list[pa.RecordBatch], schema: pa.Schema) -> int:
        table = pa.Table.from_batches(batches, schema=schema)
        # `target` is quoted by sqlglot; clickhouse-connect keeps a quoted or dotted name as given.
        client.insert_arrow(target, table)
        return table.num_rows


def _partition_key(client, table: exp.Table) -> str:
    """The PARTITION BY expression of a table as ClickHouse prints it ('' when it has none)."""
    db = exp.Literal.string(table.db) if table.db else exp.func("currentDatabase")
    sql = (exp.select("partition_key").from_("system.tables")
           .where(exp.and_(exp.EQ(this=exp.column("database"), expression=db),
                           exp.EQ(this=exp.column("name"), expression=exp.Literal.string(table.name)))))
    rows = client.query(sql.sql(dialect=DIALECT)).result_rows
    return rows[0][0].strip().strip("`\"") if rows else ""


def _tables(client, database: str | None) -> list[str]:
    """The tables and views of `database` (the session's when None), from system.tables."""
    db = exp.Literal.string(database) if database else exp.func("currentDatabase")
    sql = (exp.select("name").from_("system.tables").where(exp.EQ(this=exp.column("database"), expression=db))
           .order_by("name"))
    return [r[0] for r in client.query(sql.sql(dialect=DIALECT)).result_rows]


def _short(e: BaseException) -> BaseException:
    """ClickHouse errors carry the whole statement and a stack trace; keep the message."""
    text = first_lines(e, 2)
    text = re.sub(r"\s*\(version [^)]*\)", "", text)
    return RuntimeError(text[:600])
