"""Tests for habitus.resources.warehouses.duckdb.DuckDBWarehouse against a real DuckDB file."""

from datetime import date, datetime, timedelta

import duckdb
import pyarrow as pa
import pytest

from habitus.resources.warehouses.duckdb import DuckDBWarehouse
from habitus.resources.warehouses.errors import WarehouseError

T0 = datetime(2026, 2, 20)
N = 120  # one row every 12 hours: 2026-02-20 .. 2026-04-19


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "wh.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE events (id INTEGER, customer_id VARCHAR, ts TIMESTAMP, price DOUBLE, note VARCHAR)")
    con.execute("INSERT INTO events SELECT i, 'C' || (i % 7), TIMESTAMP '2026-02-20' + i * INTERVAL 12 HOUR, "
                "i / 2, 'n' FROM range(?) t(i) ORDER BY i", [N])
    con.execute("CREATE SCHEMA sales")
    con.execute("CREATE TABLE sales.orders (id INTEGER, ts TIMESTAMP)")
    con.execute("INSERT INTO sales.orders VALUES (1, '2026-05-01 10:00:00')")
    con.execute("CREATE TABLE empty (id INTEGER, ts TIMESTAMP)")
    con.close()
    return path


def _expected_ids(start, end):
    return [i for i in range(N) if start <= T0 + timedelta(hours=12 * i) < end]


def test_schema(db):
    schema = DuckDBWarehouse(path=str(db)).schema("events")
    assert isinstance(schema, pa.Schema)
    assert schema.names == ["id", "customer_id", "ts", "price", "note"]
    assert schema.field("id").type == pa.int32()
    assert pa.types.is_timestamp(schema.field("ts").type)
    assert schema.field("price").type == pa.float64()
    assert DuckDBWarehouse(path=str(db)).schema("sales.orders").names == ["id", "ts"]


def test_time_range(db):
    wh = DuckDBWarehouse(path=str(db))
    assert wh.time_range("events", "ts") == (T0, T0 + timedelta(hours=12 * (N - 1)))
    assert wh.time_range("sales.orders", "ts") == (datetime(2026, 5, 1, 10), datetime(2026, 5, 1, 10))
    assert wh.time_range("empty", "ts") == (None, None)


def test_read_projection_and_time_window(db):
    start, end = datetime(2026, 3, 1), datetime(2026, 4, 1)
    batches = list(DuckDBWarehouse(path=str(db)).read("events", ["id", "price"], "ts", start, end))
    assert batches and all(isinstance(b, pa.RecordBatch) for b in batches)
    table = pa.Table.from_batches(batches)
    assert table.column_names == ["id", "price"]
    ids = table.column("id").to_pylist()
    assert ids == _expected_ids(start, end)
    assert len(ids) == 62  # 31 days, two rows a day
    assert table.column("price").to_pylist() == [i / 2 for i in ids]


def test_read_window_is_half_open(db):
    # the row at exactly `end` is excluded, the row at exactly `start` included
    start, end = T0 + timedelta(hours=12 * 10), T0 + timedelta(hours=12 * 13)
    table = pa.Table.from_batches(list(DuckDBWarehouse(path=str(db)).read("events", ["id"], "ts", start, end)))
    assert table.column("id").to_pylist() == [10, 11, 12]


def test_read_small_batches(db):
    batches = list(DuckDBWarehouse(path=str(db)).read("events", ["id", "ts"], batch_rows=16))
    assert len(batches) > 1
    assert all(len(b) <= 16 for b in batches)
    assert sum(len(b) for b in batches) == N
    assert all(b.schema.names == ["id", "ts"] for b in batches)


def test_read_all_columns(db):
    table = pa.Table.from_batches(list(DuckDBWarehouse(path=str(db)).read("events")))
    assert table.num_rows == N and table.column_names == ["id", "customer_id", "ts", "price", "note"]


def test_read_qualified_table(db):
    batches = list(DuckDBWarehouse(path=str(db)).read("sales.orders", ["id"]))
    assert pa.Table.from_batches(batches).to_pydict() == {"id": [1]}


def test_missing_table_schema_names_table(db):
    with pytest.raises(WarehouseError, match="no_such_table"):
        DuckDBWarehouse(path=str(db)).schema("no_such_table")


def test_missing_table_read_raises_warehouse_error(db):
    with pytest.raises(WarehouseError, match="no_such_table"):
        list(DuckDBWarehouse(path=str(db)).read("no_such_table", ["id"]))


def test_missing_table_time_range_raises_warehouse_error(db):
    with pytest.raises(WarehouseError, match="no_such_table"):
        DuckDBWarehouse(path=str(db)).time_range("no_such_table", "ts")


def test_missing_database_file(tmp_path):
    missing = tmp_path / "nope.duckdb"
    wh = DuckDBWarehouse(path=str(missing))
    with pytest.raises(WarehouseError, match="nope.duckdb"):
        wh.schema("events")
    with pytest.raises(WarehouseError, match="does not exist"):
        list(wh.read("events"))
    with pytest.raises(WarehouseError):
        wh.time_range("events", "ts")
    assert not missing.exists()  # reading never creates the file


SCORES = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.date32())])


def _scores(as_of: date, n: int, offset: float = 0.0, batches: int = 3) -> list[pa.RecordBatch]:
    ids = [f"C{i}" for i in range(n)]
    scores = [i / n + offset for i in range(n)]
    step = -(-n // batches)
    return [pa.record_batch([pa.array(ids[a:a + step]), pa.array(scores[a:a + step]),
                             pa.array([as_of] * len(ids[a:a + step]), pa.date32())], schema=SCORES)
            for a in range(0, n, step)]


def _rows(path, sql):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_write_creates_table(tmp_path):
    path = tmp_path / "out.duckdb"
    wh = DuckDBWarehouse(path=str(path))
    assert wh.write("scores", iter(_scores(date(2026, 3, 1), 10)), SCORES) == 10
    assert _rows(path, "SELECT count(*), count(DISTINCT customer_id) FROM scores") == [(10, 10)]
    assert wh.schema("scores").names == SCORES.names
    assert wh.write("scores", iter(_scores(date(2026, 3, 2), 4)), SCORES) == 4  # appends
    assert _rows(path, "SELECT count(*) FROM scores") == [(14,)]


def test_write_qualified_and_hostile_names(tmp_path):
    path = tmp_path / "out.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE SCHEMA preds")
    con.execute("CREATE TABLE y (v INTEGER)")
    con.close()
    wh = DuckDBWarehouse(path=str(path))
    assert wh.write("preds.scores", _scores(date(2026, 3, 1), 5), SCORES) == 5
    hostile = 'x"; DROP TABLE y; --'
    assert wh.write(hostile, _scores(date(2026, 3, 1), 2), SCORES) == 2
    assert wh.write(hostile, _scores(date(2026, 3, 1), 2), SCORES, replace=("as_of", date(2026, 3, 1))) == 2
    assert _rows(path, "SELECT count(*) FROM preds.scores") == [(5,)]
    assert _rows(path, 'SELECT count(*) FROM "x""; DROP TABLE y; --"') == [(2,)]
    assert _rows(path, "SELECT count(*) FROM y") == [(0,)]


def test_write_replace_is_idempotent(tmp_path):
    path = tmp_path / "out.duckdb"
    wh = DuckDBWarehouse(path=str(path))
    march1, march2 = date(2026, 3, 1), date(2026, 3, 2)
    wh.write("scores", _scores(march1, 30), SCORES, replace=("as_of", march1))
    wh.write("scores", _scores(march2, 20), SCORES, replace=("as_of", march2))
    assert wh.write("scores", _scores(march1, 30, offset=1.0), SCORES, replace=("as_of", march1)) == 30
    assert _rows(path, "SELECT as_of, count(*), count(DISTINCT customer_id), min(score) >= 1.0 "
                       "FROM scores GROUP BY as_of ORDER BY as_of") == [(march1, 30, 30, True), (march2, 20, 20, False)]
    # string and datetime replace values select the same rows
    wh.write("scores", _scores(march2, 20), SCORES, replace=("as_of", "2026-03-02"))
    assert _rows(path, "SELECT count(*) FROM scores WHERE as_of = DATE '2026-03-02'") == [(20,)]


def test_write_replace_with_timestamp_value(tmp_path):
    path = tmp_path / "out.duckdb"
    schema = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us"))])
    wh = DuckDBWarehouse(path=str(path))
    at, other = datetime(2026, 3, 1, 6), datetime(2026, 3, 2, 6)
    for value in (at, other, at):
        batch = pa.record_batch([pa.array([1, 2, 3]), pa.array([value] * 3, pa.timestamp("us"))], schema=schema)
        wh.write("snap", [batch], schema, replace=("at", value))
    assert _rows(path, 'SELECT "at", count(*) FROM snap GROUP BY "at" ORDER BY "at"') == [(at, 3), (other, 3)]


def test_failed_write_rolls_back(tmp_path):
    path = tmp_path / "out.duckdb"
    wh = DuckDBWarehouse(path=str(path))
    march1 = date(2026, 3, 1)
    wh.write("scores", _scores(march1, 10), SCORES, replace=("as_of", march1))

    def broken():
        yield from _scores(march1, 10)[:1]
        raise RuntimeError("source died")

    with pytest.raises(Exception):
        wh.write("scores", broken(), SCORES, replace=("as_of", march1))
    assert _rows(path, "SELECT count(*) FROM scores") == [(10,)]  # the old rows are still there
