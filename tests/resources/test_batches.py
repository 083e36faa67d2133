"""Tests for habitus.resources.warehouses.batches: the one cast of every batch read from a warehouse, and `Batches`,
which casts each driver chunk once, to the described schema or straight to what extraction asks for."""

from datetime import datetime
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.resources.warehouses.batches import Batches, cast_batch, conform
from habitus.resources.warehouses.canonical import canonical_schema, write_canonical_parquet
from habitus.resources.warehouses.errors import WarehouseError

SCHEMA = pa.schema([("id", pa.int64()), ("amount", pa.decimal128(10, 2)), ("ts", pa.timestamp("us"))])


def _batch(ids, amounts, ts, types=(pa.int8(), pa.decimal128(10, 2), pa.timestamp("ns"))):
    return pa.record_batch([pa.array(ids, types[0]), pa.array(amounts, types[1]), pa.array(ts, types[2])],
                           names=["ID", "amount", "ts"])


def test_conform_casts_narrow_chunks_and_slices():
    t = datetime(2026, 3, 1)
    batches = [_batch([1, 2, 3], [Decimal("1.50"), None, Decimal("2.25")], [t, t, None]),
               pa.record_batch([pa.array([], pa.int64()), pa.array([], pa.decimal128(10, 2)),
                                pa.array([], pa.timestamp("us"))], schema=SCHEMA),
               _batch(list(range(5)), [None] * 5, [t] * 5, (pa.int64(), pa.decimal128(10, 2), pa.timestamp("us")))]
    out = list(conform(iter(batches), SCHEMA, "t", batch_rows=2))
    assert [len(b) for b in out] == [2, 1, 2, 2, 1]  # empty batches dropped, big ones sliced
    assert all(b.schema.equals(SCHEMA, check_metadata=True) for b in out)
    assert pa.Table.from_batches(out).column("amount").to_pylist()[:3] == [Decimal("1.50"), None, Decimal("2.25")]


def test_conform_refuses_lossy_values_naming_the_column():
    big = pa.record_batch([pa.array([2**70], pa.decimal128(38, 0))], names=["product_id"])
    with pytest.raises(WarehouseError, match=r"table 'shop.events', column 'product_id'.*int64"):
        list(conform([big], pa.schema([("product_id", pa.int64())]), "shop.events"))
    sub_us = pa.record_batch([pa.array([1_000_000_001], pa.timestamp("ns"))], names=["ts"])
    with pytest.raises(WarehouseError, match="'ts'"):
        list(conform([sub_us], pa.schema([("ts", pa.timestamp("us"))]), "t"))


def test_conform_refuses_a_wrong_column_count():
    with pytest.raises(WarehouseError, match="2 columns"):
        list(conform([pa.record_batch([[1], [2]], names=["a", "b"])], pa.schema([("a", pa.int64())]), "t"))


def test_cast_batch_decodes_dictionaries_and_labels_other_zones_utc():
    berlin = pa.array([datetime(2026, 3, 1, 9)], pa.timestamp("ms", "UTC")).cast(pa.timestamp("ms", "Europe/Berlin"))
    cats = pa.array(["a", "b", "a"]).dictionary_encode()
    out = cast_batch(pa.record_batch([berlin], names=["t"]), pa.schema([("t", pa.timestamp("us", "UTC"))]))
    assert out.column(0).to_pylist()[0].replace(tzinfo=None) == datetime(2026, 3, 1, 9)  # the same instant
    out = cast_batch(pa.record_batch([cats], names=["c"]), pa.schema([("c", pa.string())]))
    assert out.column(0).to_pylist() == ["a", "b", "a"]
    same = pa.record_batch([pa.array([1], pa.int64())], schema=pa.schema([("a", pa.int64())]))
    assert cast_batch(same, same.schema) is same  # nothing to do: no copy


class _Source:
    """A connector's source: the described schema, then chunks; records whether it was closed."""

    def __init__(self, described, chunks):
        self.closed = False
        self.gen = self._gen(described, chunks)

    def _gen(self, described, chunks):
        try:
            yield described
            yield from chunks
        finally:
            self.closed = True


def _chunks():
    t = datetime(2026, 3, 1)
    return [_batch([1, 2, 3], [Decimal("1.50"), None, Decimal("2.25")], [t, t, None]),
            _batch([4], [None], [t])]


def test_batches_have_the_described_schema_and_close_the_source():
    src = _Source(SCHEMA, _chunks())
    out = list(Batches(src.gen, "t", batch_rows=2))
    assert [len(b) for b in out] == [2, 1, 1] and all(b.schema == SCHEMA for b in out)
    assert src.closed


def test_batches_cast_each_chunk_once_straight_to_the_canonical_types(tmp_path, monkeypatch):
    """Extraction asks a connector's batches for the canonical types: each chunk goes through one
    cast (driver types -> canonical), never through the described types first."""
    import habitus.resources.warehouses.batches as batches_module

    casts = []
    real = batches_module.cast_batch
    monkeypatch.setattr(batches_module, "cast_batch", lambda b, s, t="?": casts.append(s) or real(b, s, t))
    canon = canonical_schema(SCHEMA)
    path = tmp_path / "part.parquet"
    assert write_canonical_parquet(Batches(_Source(SCHEMA, _chunks()).gen, "t"), path, SCHEMA) == 4
    assert casts == [canon, canon]  # one per chunk, to the canonical schema
    assert pq.read_table(path).schema == canon
    assert pq.read_table(path).column("amount").to_pylist() == [Decimal("1.50"), None, Decimal("2.25"), None]


def test_batches_dropped_half_way_close_the_source():
    src = _Source(SCHEMA, _chunks())
    b = Batches(src.gen, "t")
    next(b)
    b.close()
    assert src.closed
    with pytest.raises(RuntimeError, match="first batch"):
        b.cast(SCHEMA)


def test_batches_a_lossy_chunk_is_an_error_naming_the_column_and_closes_the_source():
    src = _Source(pa.schema([("ts", pa.timestamp("us"))]),
                  [pa.record_batch([pa.array([1_000_000_001], pa.timestamp("ns"))], names=["ts"])])
    with pytest.raises(WarehouseError, match=r"table 'shop.events', column 'ts'.*view"):
        list(Batches(src.gen, "shop.events"))
    assert src.closed
