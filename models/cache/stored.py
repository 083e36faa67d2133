"""The stored format of shard files: ids in the narrowest unsigned type that holds them, `ts` as
uint32 seconds after a base kept in the schema's metadata, zstd-compressed IPC buffers; and reading
them back as readers get them (int32 ids, int64 seconds)."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from habitus.models.cache.spec import TS

IPC_OPTIONS = ipc.IpcWriteOptions(compression=pa.Codec("zstd", 3))  # level 3: 8% smaller than 1, as fast
BATCH_ROWS = 1 << 16  # rows per record batch in shard files (whatever DuckDB's chunking: same bytes)


_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64, pa.uint8(): np.uint8,
          pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64, pa.float32(): np.float32,
          pa.float64(): np.float64}


def _values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numeric Arrow column without nulls as numpy, zero-copy from one chunk. Not `to_numpy`: in
    pyarrow 26 its first call imports pandas, 0.6 s and 50 MB a process that does not need it."""
    if isinstance(column, pa.ChunkedArray):  # (combine_chunks copies even one chunk: a mapped file's would load)
        arr = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    else:
        arr = column
    dtype = _NUMPY.get(arr.type)
    if dtype is None or arr.null_count:
        return arr.to_numpy(zero_copy_only=False)
    if not len(arr):
        return np.empty(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)


def _narrowest(largest: int) -> pa.DataType:
    return pa.uint8() if largest < 1 << 8 else pa.uint16() if largest < 1 << 16 else pa.int32()


def _stored_schema(schema: pa.Schema, maxima: dict[str, int], t_min: int, t_max: int) -> pa.Schema:
    """The schema a shard file is written with: each id column of `maxima` in the narrowest unsigned type
    that holds its largest id, `ts` as uint32 seconds after t_min (int64 for a span over 136 years), the
    base in the schema's metadata. Compressed, this halves the ids and times (the cache stays no bigger
    than its source Parquet)."""
    fields = [pa.field(f.name, _narrowest(maxima[f.name])) if f.name in maxima
              else pa.field(TS, pa.uint32() if t_max - t_min < 1 << 32 else pa.int64()) if f.name == TS else f
              for f in schema]
    return pa.schema(fields, metadata={b"habitus.ts_base": str(int(t_min)).encode()})


def _to_stored(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    base = int(schema.metadata[b"habitus.ts_base"])
    arrays = [(pc.subtract(batch.column(TS), base) if f.name == TS else batch.column(f.name)).cast(f.type)
              for f in schema]  # a safe cast: a value that does not fit raises, it is never wrapped
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _widen(table: pa.Table) -> pa.Table:
    """A shard file's columns as readers get them (see _stored_schema)."""
    base = int(table.schema.metadata[b"habitus.ts_base"])
    columns = [pc.add(table.column(TS).cast(pa.int64()), base) if f.name == TS
               else table.column(f.name).cast(pa.int32()) if pa.types.is_unsigned_integer(f.type)
               else table.column(f.name) for f in table.schema]
    return pa.table(columns, names=table.column_names)


def _read_sorted(paths: list[Path]) -> pa.Table:
    tables = [_widen(ipc.open_file(pa.memory_map(str(p))).read_all()) for p in paths]
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    if len(tables) > 1:
        order = np.lexsort((table.column("ts").to_numpy(), table.column("entity").to_numpy()))
        table = table.take(pa.array(order))
    return table


def _merge_shard_files(paths: list[Path], out: Path) -> None:
    """Merge sorted pieces of one shard into one (entity, ts)-sorted file (a stable sort: earlier
    pieces first among equal timestamps)."""
    table = _read_sorted(paths)
    ts = table.column(TS)
    maxima = {f.name: pc.max(table.column(f.name)).as_py() or 0 for f in table.schema if f.type == pa.int32()}
    schema = _stored_schema(table.schema, maxima, pc.min(ts).as_py() or 0, pc.max(ts).as_py() or 0)
    with ipc.new_file(str(out), schema, options=IPC_OPTIONS) as w:
        for batch in table.to_batches(BATCH_ROWS):
            w.write_batch(_to_stored(batch, schema))
