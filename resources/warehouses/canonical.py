"""One Arrow schema, one row order and one Parquet layout for what every connector extracts.

Drivers disagree about types for the same data: Snowflake sends nanosecond timestamps where DuckDB
sends microseconds, NUMBER(38,0) where DuckDB has INTEGER, large_string where others send string.
The cache fingerprint hashes the extracted files' bytes, so identical data must give identical
files whatever the source. Every batch is therefore cast to the canonical type of its column
(`canonical_type`), the rows of a file are sorted by every column (entity and time first), and one
Parquet writer with fixed settings and fixed row groups writes them.

A value that the canonical type cannot hold (a nanosecond that is not a whole microsecond, an
unsigned 64-bit id above 2**63 - 1, a decimal wider than 38 digits) is an error naming the table and
column: never a silent truncation.
"""

import os
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.models.storage.files import durable_replace
from habitus.resources.warehouses.batches import Batches, cast_batch
from habitus.resources.warehouses.errors import WarehouseError

ROW_GROUP_ROWS = 1 << 17
DECIMAL_SCALE = 9  # decimals are decimal128(38, 9) (BigQuery's NUMERIC) unless declared with more digits
# The one writer configuration of extracted sources: a different setting would change the bytes.
PARQUET_OPTIONS = dict(compression="zstd", compression_level=3, use_dictionary=True, write_statistics=True,
                       version="2.6", data_page_version="1.0", store_schema=True)
# DuckDB sorts a partition out of core within this much memory (and spills the rest to disk), with up to
# SORT_THREADS threads: one thread made a 13M-row partition (a month of the 100M-event benchmark) cost
# 1.12x per row what a 1.3M-row one did; two cost 0.75x (2.23 -> 1.55 us a row, peak 0.47 -> 0.50 GB;
# more memory did not help: 1 GB, 2.31 us). The rows' order, so the file, is the same whatever the threads.
SORT_MEMORY = "256MB"
SORT_THREADS = min(4, os.cpu_count() or 1)


def canonical_type(t: pa.DataType, column: str = "?") -> pa.DataType:
    """The one Arrow type extracted files use for a column of type `t`.

    timestamps -> microseconds (UTC kept as UTC, naive stays naive; any other zone -> UTC);
    integers -> int64; decimals -> decimal128(38, max(scale, 9)); floats -> float64; strings -> string;
    binaries -> binary; dates -> date32; times -> time64(us); dictionaries -> their values' type."""
    if pa.types.is_dictionary(t):
        return canonical_type(t.value_type, column)
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz else None)
    if pa.types.is_boolean(t):
        return pa.bool_()
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    if pa.types.is_decimal(t):
        # One type whatever the declared precision: NUMBER(12,2) in one warehouse and BigQuery's
        # NUMERIC (38, 9) in another hold the same values. Scales above 9 are kept as declared.
        if t.scale > 38 or t.scale < 0:
            raise WarehouseError(f"column {column!r}: decimal scale {t.scale} does not fit decimal128(38, s); "
                                 f"cast the column in a view")
        return pa.decimal128(38, max(t.scale, DECIMAL_SCALE))
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_binary_view(t) \
            or pa.types.is_fixed_size_binary(t):
        return pa.binary()
    if pa.types.is_date(t):
        return pa.date32()
    if pa.types.is_time(t):
        return pa.time64("us")
    if pa.types.is_null(t):
        return pa.string()  # a column of only NULLs (no type known): text, the widest
    raise WarehouseError(f"column {column!r}: Arrow type {t} has no canonical type for extraction; leave it out "
                         f"of `columns` or convert it in a view")


def canonical_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` with canonical types, every field nullable, and no metadata."""
    return pa.schema([pa.field(f.name, canonical_type(f.type, f.name)) for f in schema])


def canonical_batch(batch: pa.RecordBatch, schema: pa.Schema, table: str = "?") -> pa.RecordBatch:
    """`batch` (columns by position) cast to the canonical `schema` (resources/warehouses/batches.py: a value that
    would change is an error naming the table and column), its text checked to be UTF-8."""
    batch = cast_batch(batch, schema, table)
    for i, f in enumerate(schema):
        if pa.types.is_string(f.type):
            _check_utf8(batch.column(i), table, f.name)
    return batch


def _check_utf8(col: pa.Array, table: str, column: str) -> None:
    """Text that is not UTF-8 (a Latin-1 export read as text) is an error naming the table, the column
    and the first bad value, before it reaches a file that nothing can read back."""
    try:
        col.validate(full=True)
    except pa.ArrowInvalid:
        raw = col.view(pa.binary()).to_pylist()
        bad = next((i, v) for i, v in enumerate(raw) if v is not None and not _is_utf8(v))
        raise WarehouseError(f"table {table!r}, column {column!r}: value {bad[1][:40]!r} (row {bad[0]} of a batch) is "
                             f"not valid UTF-8 text; convert the column to UTF-8 in the warehouse or a view "
                             f"(e.g. from Latin-1), or leave it out of `columns`") from None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def canonical_batches(batches: Iterable[pa.RecordBatch], schema: pa.Schema,
                      table: str = "?") -> Iterator[pa.RecordBatch]:
    """The non-empty `batches` as canonical batches. A connector's `Batches` are asked for the canonical
    types before they start, so each driver chunk is cast once, straight to them."""
    if isinstance(batches, Batches):
        batches = batches.cast(schema)
    for b in batches:
        if len(b):
            yield canonical_batch(b, schema, table)


def write_canonical_parquet(batches: Iterable[pa.RecordBatch], path: str | os.PathLike, schema: pa.Schema,
                            first: list[str] = (), table: str = "?") -> int:
    """Write `batches` to `path` as canonical Parquet: canonical types, rows sorted by the columns
    `first` (entity, time) and then by every other column, fixed row groups. Streams: the rows go
    to a temporary file, DuckDB sorts it out of core, the sorted rows are written row group by row
    group. The file appears whole (renamed into place). Returns the rows written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    canon = canonical_schema(schema)
    unsorted = path.with_name(f".{path.name}.unsorted-{os.getpid()}")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        rows = 0
        with pq.ParquetWriter(unsorted, canon, compression="lz4") as w:
            for b in canonical_batches(batches, canon, table):
                w.write_batch(b)
                rows += len(b)
        with pq.ParquetWriter(tmp, canon, **PARQUET_OPTIONS) as w:
            # an empty partition (a quiet day) skips the sort (a DuckDB session, ~10 ms): the file is the same
            for group in _row_groups(_sorted(unsorted, canon, first), canon) if rows else ():
                w.write_table(group, row_group_size=ROW_GROUP_ROWS)
        durable_replace(tmp, path)
        return rows
    finally:
        for p in (unsorted, tmp):
            if p.exists():
                p.unlink()


def _sorted(file: Path, schema: pa.Schema, first: Iterable[str]) -> Iterator[pa.RecordBatch]:
    """The rows of `file` ordered by `first`, then every other column (a total order: identical
    rows are indistinguishable), NULLs last, strings by their bytes."""
    import duckdb

    names = list(dict.fromkeys([*first, *schema.names]))
    order = ", ".join(f'{_q(n)} ASC NULLS LAST' for n in names)
    cols = ", ".join(_q(n) for n in schema.names)
    con = duckdb.connect(config={"memory_limit": SORT_MEMORY, "threads": SORT_THREADS,
                                 "temp_directory": str(file.parent / f".{file.name}.spill")})
    try:
        reader = con.sql(f"SELECT {cols} FROM read_parquet('{_s(file)}') ORDER BY {order}") \
                    .to_arrow_reader(ROW_GROUP_ROWS)
        for b in reader:
            yield b
    finally:
        con.close()
        spill = file.parent / f".{file.name}.spill"
        if spill.exists():
            import shutil

            shutil.rmtree(spill, ignore_errors=True)


def _row_groups(batches: Iterable[pa.RecordBatch], schema: pa.Schema) -> Iterator[pa.Table]:
    """Tables of exactly ROW_GROUP_ROWS rows (the last one shorter), cast back to `schema`
    (DuckDB may hand strings back as another string type): the row groups do not depend on how
    the sorted rows happened to be chunked."""
    pending, n = [], 0
    for b in batches:
        b = pa.RecordBatch.from_arrays([b.column(i).cast(f.type) if b.column(i).type != f.type else b.column(i)
                                        for i, f in enumerate(schema)], schema=schema)
        pending.append(b)
        n += len(b)
        while n >= ROW_GROUP_ROWS:
            t = pa.Table.from_batches(pending, schema=schema)
            yield t.slice(0, ROW_GROUP_ROWS).combine_chunks()
            rest = t.slice(ROW_GROUP_ROWS)
            pending, n = rest.to_batches(), rest.num_rows
    if n:
        yield pa.Table.from_batches(pending, schema=schema).combine_chunks()


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _s(path: Path) -> str:
    return str(path).replace("'", "''")
