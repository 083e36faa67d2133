"""Canonical extraction: the same data, however a driver types and chunks it, gives the same bytes."""

import random
from datetime import datetime, timezone
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.resources.warehouses.canonical import ROW_GROUP_ROWS, canonical_schema, canonical_type, write_canonical_parquet
from habitus.resources.warehouses.errors import WarehouseError

ROWS = [(f"C{i % 13}", datetime(2026, 3, 1 + i % 28, i % 24, 0, 7), 10**15 + i, Decimal(f"{i}.25") if i % 4 else None,
         None if i % 5 == 0 else f"n{i % 3}", i % 2 == 0) for i in range(300)]
NAMES = ["customer_id", "ts", "product_id", "amount", "note", "flag"]


def _as(types: list[pa.DataType], rows=ROWS, chunk=50) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    cols = list(zip(*rows))
    arrays = []
    for values, t in zip(cols, types):
        if pa.types.is_dictionary(t):
            arrays.append(pa.array(values, pa.string()).dictionary_encode())
        else:
            arrays.append(pa.array(values, t))
    table = pa.Table.from_arrays(arrays, names=NAMES)
    return table.schema, table.to_batches(max_chunksize=chunk)


DUCKDB_LIKE = [pa.string(), pa.timestamp("us"), pa.int64(), pa.decimal128(12, 2), pa.string(), pa.bool_()]
SNOWFLAKE_LIKE = [pa.large_string(), pa.timestamp("ns"), pa.int64(), pa.decimal128(12, 2),
                  pa.dictionary(pa.int32(), pa.string()), pa.bool_()]
CLICKHOUSE_LIKE = [pa.string(), pa.timestamp("us"), pa.uint64(), pa.decimal128(18, 2), pa.large_string(), pa.bool_()]


def test_canonical_types():
    assert canonical_type(pa.timestamp("ns")) == pa.timestamp("us")
    assert canonical_type(pa.timestamp("ms", "Europe/Berlin")) == pa.timestamp("us", "UTC")
    assert canonical_type(pa.int32()) == canonical_type(pa.uint64()) == pa.int64()
    assert canonical_type(pa.decimal128(10, 2)) == canonical_type(pa.decimal256(50, 2)) == pa.decimal128(38, 9)
    assert canonical_type(pa.decimal128(38, 12)) == pa.decimal128(38, 12)
    assert canonical_type(pa.large_string()) == canonical_type(pa.dictionary(pa.int8(), pa.string())) == pa.string()
    assert canonical_type(pa.float32()) == pa.float64() and canonical_type(pa.date64()) == pa.date32()
    s = canonical_schema(pa.schema([pa.field("x", pa.int32(), nullable=False)], metadata={b"k": b"v"}))
    assert s.metadata is None and s.field("x").nullable
    with pytest.raises(WarehouseError, match="'tags'"):
        canonical_type(pa.list_(pa.string()), "tags")


def test_same_data_same_bytes_whatever_the_driver_types_chunking_and_order(tmp_path):
    files = []
    for i, (types, chunk) in enumerate([(DUCKDB_LIKE, 300), (SNOWFLAKE_LIKE, 7), (CLICKHOUSE_LIKE, 64)]):
        rows = list(ROWS)
        random.Random(i).shuffle(rows)  # a warehouse returns rows in no particular order
        schema, batches = _as(types, rows, chunk)
        path = tmp_path / f"{i}.parquet"
        assert write_canonical_parquet(iter(batches), path, schema, first=["customer_id", "ts"]) == len(ROWS)
        files.append(path.read_bytes())
    assert files[0] == files[1] == files[2]
    t = pq.read_table(tmp_path / "0.parquet")
    assert t.schema == pa.schema([("customer_id", pa.string()), ("ts", pa.timestamp("us")), ("product_id", pa.int64()),
                                  ("amount", pa.decimal128(38, 9)), ("note", pa.string()), ("flag", pa.bool_())])
    keys = list(zip(t.column("customer_id").to_pylist(), t.column("ts").to_pylist()))
    assert keys == sorted(keys)  # entity, then time
    assert sorted(t.column("product_id").to_pylist()) == [10**15 + i for i in range(300)]
    assert t.column("amount").null_count == 75 and t.column("note").null_count == 60
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.parquet", "1.parquet", "2.parquet"]  # no leftovers


def test_row_groups_are_fixed_whatever_the_batches(tmp_path):
    n = ROW_GROUP_ROWS + 10
    t = pa.table({"k": pa.array(range(n), pa.int32())})
    write_canonical_parquet(iter(t.to_batches(max_chunksize=1000)), tmp_path / "a.parquet", t.schema)
    write_canonical_parquet(iter(t.to_batches(max_chunksize=77_777)), tmp_path / "b.parquet", t.schema)
    md = pq.read_metadata(tmp_path / "a.parquet")
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [ROW_GROUP_ROWS, 10]
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()


def test_time_zones_keep_their_instant_and_naive_stays_naive(tmp_path):
    berlin = pa.array([datetime(2026, 3, 1, 9, tzinfo=timezone.utc)], pa.timestamp("ns", "Europe/Berlin"))
    naive = pa.array([datetime(2026, 3, 1, 9)], pa.timestamp("ms"))
    t = pa.table({"aware": berlin, "naive": naive})
    write_canonical_parquet(iter(t.to_batches()), tmp_path / "t.parquet", t.schema)
    out = pq.read_table(tmp_path / "t.parquet")
    assert out.schema.field("aware").type == pa.timestamp("us", "UTC")
    assert out.column("aware")[0].as_py() == datetime(2026, 3, 1, 9, tzinfo=timezone.utc)
    assert out.schema.field("naive").type == pa.timestamp("us")
    assert out.column("naive")[0].as_py() == datetime(2026, 3, 1, 9)


@pytest.mark.parametrize("column, error", [
    (pa.array([1_000_000_000_000_000_001], pa.timestamp("ns")), "nanosecond|truncat|lose"),
    (pa.array([2**64 - 1], pa.uint64()), "overflow|out of bounds|fit"),
    (pa.array([Decimal("1" * 45)], pa.decimal256(50, 0)), "precision|fit|overflow"),
])
def test_a_value_that_would_lose_precision_is_an_error_naming_table_and_column(tmp_path, column, error):
    t = pa.table({"c": column})
    with pytest.raises(WarehouseError, match=r"table 'shop\.events', column 'c'") as e:
        write_canonical_parquet(iter(t.to_batches()), tmp_path / "x.parquet", t.schema, table="shop.events")
    assert "view" in str(e.value)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_an_empty_partition_is_a_file_with_the_schema(tmp_path):
    schema = pa.schema([("customer_id", pa.large_string()), ("ts", pa.timestamp("ns"))])
    assert write_canonical_parquet(iter([]), tmp_path / "e.parquet", schema, first=["customer_id"]) == 0
    out = pq.read_table(tmp_path / "e.parquet")
    assert out.num_rows == 0 and out.schema == canonical_schema(schema)


def test_an_empty_partition_skips_the_sort_and_writes_the_file_the_sort_would(tmp_path, monkeypatch):
    import habitus.resources.warehouses.canonical as canonical

    schema, _ = _as(DUCKDB_LIKE)
    canon = canonical_schema(schema)
    pq.write_table(canon.empty_table(), tmp_path / "unsorted.parquet")
    with pq.ParquetWriter(tmp_path / "sorted.parquet", canon, **canonical.PARQUET_OPTIONS) as w:  # through the sort
        for group in canonical._row_groups(canonical._sorted(tmp_path / "unsorted.parquet", canon, ["customer_id"]), canon):
            w.write_table(group)
    empty = [pa.RecordBatch.from_pylist([], schema=schema)]  # a quiet day: the driver's one batch has no row
    monkeypatch.setattr(canonical, "_sorted", lambda *a: pytest.fail("an empty partition was sorted"))
    assert write_canonical_parquet(iter(empty), tmp_path / "empty.parquet", schema, first=["customer_id"]) == 0
    assert (tmp_path / "empty.parquet").read_bytes() == (tmp_path / "sorted.parquet").read_bytes()
