"""Tests for habitus.resources.warehouses.parquet.ParquetWarehouse: single files, hive-partitioned folders, writes."""

from datetime import date, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.parquet import ParquetWarehouse

T0 = datetime(2026, 2, 20)
N = 120  # one row every 12 hours: 2026-02-20 .. 2026-04-19


def _events(ids) -> pa.Table:
    ids = list(ids)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "customer_id": [f"C{i % 7}" for i in ids],
        "ts": pa.array([T0 + timedelta(hours=12 * i) for i in ids], pa.timestamp("us")),
        "price": [i / 2 for i in ids],
    })


@pytest.fixture
def lake(tmp_path):
    """`events.parquet` (one file) and `parted/month=YYYY-MM/x.parquet` (hive folders), same rows."""
    pq.write_table(_events(range(N)), tmp_path / "events.parquet", row_group_size=25)
    by_month: dict[str, list[int]] = {}
    for i in range(N):
        by_month.setdefault((T0 + timedelta(hours=12 * i)).strftime("%Y-%m"), []).append(i)
    for month, ids in by_month.items():
        folder = tmp_path / "parted" / f"month={month}"
        folder.mkdir(parents=True)
        pq.write_table(_events(ids), folder / "x.parquet")
    return tmp_path


def _expected_ids(start, end):
    return [i for i in range(N) if start <= T0 + timedelta(hours=12 * i) < end]


def test_schema_single_file(lake):
    schema = ParquetWarehouse(path=str(lake)).schema("events")
    assert schema.names == ["id", "customer_id", "ts", "price"]
    assert schema.field("ts").type == pa.timestamp("us")


def test_schema_hive_folder(lake):
    schema = ParquetWarehouse(path=str(lake)).schema("parted")
    assert schema.names[:4] == ["id", "customer_id", "ts", "price"]
    assert "month" in schema.names  # the partition key becomes a column


@pytest.mark.parametrize("table", ["events", "parted"])
def test_time_range(lake, table):
    assert ParquetWarehouse(path=str(lake)).time_range(table, "ts") == (T0, T0 + timedelta(hours=12 * (N - 1)))


@pytest.mark.parametrize("table", ["events", "parted"])
def test_read_projection_and_time_window(lake, table):
    start, end = datetime(2026, 3, 1), datetime(2026, 4, 1)
    batches = list(ParquetWarehouse(path=str(lake)).read(table, ["id", "price"], "ts", start, end))
    assert batches and all(isinstance(b, pa.RecordBatch) for b in batches)
    result = pa.Table.from_batches(batches)
    assert result.column_names == ["id", "price"]
    ids = sorted(result.column("id").to_pylist())
    assert ids == _expected_ids(start, end) and len(ids) == 62
    assert sorted(result.column("price").to_pylist()) == [i / 2 for i in ids]


@pytest.mark.parametrize("table", ["events", "parted"])
def test_read_window_is_half_open(lake, table):
    start, end = T0 + timedelta(hours=12 * 10), T0 + timedelta(hours=12 * 13)
    result = pa.Table.from_batches(list(ParquetWarehouse(path=str(lake)).read(table, ["id"], "ts", start, end)))
    assert sorted(result.column("id").to_pylist()) == [10, 11, 12]


def test_read_open_ended_windows(lake):
    wh = ParquetWarehouse(path=str(lake))
    after = pa.Table.from_batches(list(wh.read("events", ["id"], "ts", start=datetime(2026, 4, 1))))
    before = pa.Table.from_batches(list(wh.read("events", ["id"], "ts", end=datetime(2026, 4, 1))))
    assert after.num_rows + before.num_rows == N
    assert min(after.column("id").to_pylist()) == _expected_ids(datetime(2026, 4, 1), datetime(2027, 1, 1))[0]


def test_read_partition_column(lake):
    result = pa.Table.from_batches(list(ParquetWarehouse(path=str(lake)).read("parted", ["id", "month"])))
    assert result.num_rows == N
    assert set(result.column("month").to_pylist()) == {"2026-02", "2026-03", "2026-04"}


def test_read_small_batches(lake):
    batches = list(ParquetWarehouse(path=str(lake)).read("events", ["id"], batch_rows=16))
    assert len(batches) > 1
    assert all(len(b) <= 16 for b in batches)
    assert sum(len(b) for b in batches) == N


def test_time_window_on_nanosecond_and_tz_columns(tmp_path):
    ts = [datetime(2026, 2, 28, 23), datetime(2026, 3, 1), datetime(2026, 3, 15), datetime(2026, 4, 1)]
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "ts": pa.array(ts, pa.timestamp("ns"))}), tmp_path / "ns.parquet")
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "ts": pa.array(ts, pa.timestamp("us", tz="UTC"))}),
                   tmp_path / "tz.parquet")
    wh = ParquetWarehouse(path=str(tmp_path))
    for table in ("ns", "tz"):
        got = pa.Table.from_batches(list(wh.read(table, ["id"], "ts", datetime(2026, 3, 1), datetime(2026, 4, 1))))
        assert sorted(got.column("id").to_pylist()) == [1, 2], table


def test_missing_table(tmp_path):
    with pytest.raises(WarehouseError, match="nope"):
        list(ParquetWarehouse(path=str(tmp_path)).read("nope", ["id"]))
    with pytest.raises(WarehouseError, match="nope"):
        ParquetWarehouse(path=str(tmp_path)).schema("nope")
    with pytest.raises(WarehouseError, match="nope"):
        ParquetWarehouse(path=str(tmp_path / "missing_folder")).time_range("nope", "ts")


SCORES = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.date32())])


def _scores(as_of: date, n: int, offset: float = 0.0) -> list[pa.RecordBatch]:
    half = n // 2
    ids = [f"C{i}" for i in range(n)]
    return [pa.record_batch([pa.array(ids[a:b]), pa.array([i / n + offset for i in range(a, b)]),
                             pa.array([as_of] * (b - a), pa.date32())], schema=SCORES)
            for a, b in ((0, half), (half, n))]


def _all(wh, table) -> pa.Table:
    return pa.Table.from_batches(list(wh.read(table)), schema=wh.schema(table))


def test_write_creates_table(tmp_path):
    wh = ParquetWarehouse(path=str(tmp_path / "lake"))
    assert wh.write("scores", iter(_scores(date(2026, 3, 1), 10)), SCORES) == 10
    result = _all(wh, "scores")
    assert result.num_rows == 10
    assert result.column_names == SCORES.names
    assert wh.schema("scores").field("as_of").type == pa.date32()


def test_write_replace_is_idempotent(tmp_path):
    wh = ParquetWarehouse(path=str(tmp_path))
    march1, march2 = date(2026, 3, 1), date(2026, 3, 2)
    wh.write("scores", _scores(march1, 30), SCORES, replace=("as_of", march1))
    wh.write("scores", _scores(march2, 20), SCORES, replace=("as_of", march2))
    assert wh.write("scores", _scores(march1, 30, offset=1.0), SCORES, replace=("as_of", march1)) == 30
    result = _all(wh, "scores").to_pylist()
    by_day = {}
    for row in result:
        by_day.setdefault(row["as_of"], []).append(row)
    assert sorted(by_day) == [march1, march2]
    assert len(by_day[march1]) == 30 and len({r["customer_id"] for r in by_day[march1]}) == 30
    assert min(r["score"] for r in by_day[march1]) >= 1.0  # the second write replaced the first
    assert len(by_day[march2]) == 20
    # nothing left over from the atomic write
    assert not [p for p in (tmp_path / "scores").iterdir() if p.name.startswith(".")]


def test_write_replace_with_datetime_value(tmp_path):
    wh = ParquetWarehouse(path=str(tmp_path))
    schema = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us"))])
    at = datetime(2026, 3, 1, 6, 30)
    for _ in range(2):
        batch = pa.record_batch([pa.array([1, 2, 3]), pa.array([at] * 3, pa.timestamp("us"))], schema=schema)
        wh.write("snap", [batch], schema, replace=("at", at))
    assert _all(wh, "snap").num_rows == 3
