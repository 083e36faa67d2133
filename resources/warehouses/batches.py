"""The one cast every batch read from a warehouse goes through.

Drivers hand over Arrow chunks whose types vary from chunk to chunk and from what the table was
described as: a narrower integer where a chunk's values are small, a decimal where one outgrew
int64, nanoseconds, a dictionary for a low-cardinality column, a zone other than UTC. `cast_batch`
casts a batch to a schema column by column and safely: a value that would change is an error naming
the table and the column, never a silent truncation.

A networked connector's `read` returns `Batches`: its driver's chunks cast to the table's described
schema. A consumer that wants other types (extraction wants the canonical ones, resources/warehouses/canonical.py)
asks for them with `Batches.cast` before iterating, and each chunk is then cast once, straight to
them, instead of once to the described types and again to the canonical ones.
"""

from typing import Iterable, Iterator

import pyarrow as pa

from habitus.resources.warehouses.errors import WarehouseError


def cast_column(col: pa.Array, to: pa.DataType, table: str, column: str) -> pa.Array:
    """`col` as type `to`: dictionaries decoded, a zone other than UTC relabelled as the same instants
    in UTC, then a safe cast. A value that does not fit is an error naming the table and column."""
    if col.type == to:
        return col
    try:
        if pa.types.is_dictionary(col.type):
            col = col.dictionary_decode()
        if pa.types.is_timestamp(col.type) and col.type.tz and col.type.tz != "UTC":
            col = col.cast(pa.timestamp(col.type.unit, "UTC"))  # the same instants, labelled UTC
        return col.cast(to, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as e:
        raise WarehouseError(
            f"table {table!r}, column {column!r}: a value of type {col.type} does not fit {to} "
            f"without loss ({str(e).splitlines()[0]}); cast the column in a view (e.g. round "
            f"timestamps to microseconds) or leave it out of `columns`") from None


def cast_batch(batch: pa.RecordBatch, schema: pa.Schema, table: str = "?") -> pa.RecordBatch:
    """`batch` with exactly `schema`: its names, and its types by position (see `cast_column`)."""
    if batch.schema.equals(schema, check_metadata=True):
        return batch
    if batch.num_columns != len(schema):
        raise WarehouseError(f"table {table!r}: {batch.num_columns} columns {batch.schema.names} arrived, "
                             f"expected {schema.names}")
    return pa.RecordBatch.from_arrays([cast_column(batch.column(i), f.type, table, f.name)
                                       for i, f in enumerate(schema)], schema=schema)


def conform(batches: Iterable[pa.RecordBatch], schema: pa.Schema, table: str = "?",
            batch_rows: int | None = None) -> Iterator[pa.RecordBatch]:
    """Each non-empty batch cast to `schema` (`cast_batch`) and sliced to at most `batch_rows` rows."""
    for b in batches:
        if len(b) == 0:
            continue
        b = cast_batch(b, schema, table)
        if batch_rows and len(b) > batch_rows:
            for start in range(0, len(b), batch_rows):
                yield b.slice(start, batch_rows)
        else:
            yield b


class Batches:
    """The batches of one read: never empty, at most `batch_rows` rows, with the table's described
    schema, or with the types asked for by `cast`. Iterating runs the query.

    `source` is a generator that holds the connection while it runs: it yields the described schema
    first, then the driver's chunks, and closes the connection when it ends or is closed (as
    happens here when the batches end, fail, or are dropped half way)."""

    def __init__(self, source: Iterator, table: str = "?", batch_rows: int | None = None):
        self._source, self._table, self._batch_rows = source, table, batch_rows
        self._target: pa.Schema | None = None
        self._batches: Iterator[pa.RecordBatch] | None = None

    def cast(self, schema: pa.Schema) -> "Batches":
        """These batches with `schema` (names, and types by position) instead of the described one:
        each chunk is cast once, straight to it (as pyarrow's RecordBatchReader.cast). Only before
        the first batch is taken."""
        if self._batches is not None:
            raise RuntimeError("Batches.cast after the first batch was taken")
        self._target = schema
        return self

    def __iter__(self) -> "Batches":
        return self

    def __next__(self) -> pa.RecordBatch:
        if self._batches is None:
            self._batches = self._run()
        return next(self._batches)

    def _run(self) -> Iterator[pa.RecordBatch]:
        try:
            described = next(self._source)
            yield from conform(self._source, self._target or described, self._table, self._batch_rows)
        finally:
            self._source.close()

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
        self._source.close()
