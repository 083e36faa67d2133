"""Embeddings and explanations written back to the warehouse as their assets write them
(assets/predictions.py `write_back`, assets/embeddings.py `warehouse_rows`): a day's rows replaced on a
re-run and read back whole from DuckDB and Parquet, in each connector's layout."""

from datetime import datetime
from functools import partial

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.assets.embeddings import ARRAY_CONNECTORS, warehouse_rows
from habitus.assets.predictions import write_back
from habitus.resources.warehouses.duckdb import DuckDBWarehouse
from habitus.resources.warehouses.parquet import ParquetWarehouse

D1, D2, WIDTH = datetime(2026, 3, 1), datetime(2026, 3, 2), 7


def _embeddings(day: datetime, n: int, offset: float) -> pa.Table:
    values = (np.arange(n * WIDTH) / 16 + offset).astype(np.float16)
    return pa.table({"customer_id": [f"C{i}" for i in range(n)],
                     "embedding": pa.FixedSizeListArray.from_arrays(pa.array(values, pa.float16()), WIDTH),
                     "model_fingerprint": ["0123456789abcdef"] * n, "as_of": pa.array([day] * n, pa.timestamp("s"))})


def _file(tmp_path, table: pa.Table, name: str):
    path = tmp_path / f"{name}.parquet"
    pq.write_table(table, path)
    return path


def test_the_columns_layout_puts_each_position_in_its_own_column_in_place():
    t = pa.concat_tables([_embeddings(D1, 3, 0.0), _embeddings(D1, 2, 1.0)])  # two chunks
    out = warehouse_rows(t, "columns")
    assert out.column_names == (["customer_id"] + [f"embedding_{i}" for i in range(WIDTH)]
                                + ["model_fingerprint", "as_of"])
    assert all(out.schema.field(f"embedding_{i}").type == pa.float32() for i in range(WIDTH))
    vectors = np.asarray(t.column("embedding").to_pylist(), np.float32)
    assert np.array_equal(np.stack([out.column(f"embedding_{i}").to_numpy() for i in range(WIDTH)], 1), vectors)
    arrays = warehouse_rows(t, "array")
    assert arrays.schema.field("embedding").type == pa.list_(pa.float32(), WIDTH)
    assert np.array_equal(np.asarray(arrays.column("embedding").to_pylist(), np.float32), vectors)


@pytest.mark.parametrize("layout", ["array", "columns"])
def test_embeddings_land_in_duckdb_a_rerun_replacing_the_day(tmp_path, layout):
    wh = DuckDBWarehouse(path=str(tmp_path / "wh.duckdb"))
    shape = partial(warehouse_rows, layout=layout)
    assert write_back(wh, "scores_embeddings", _file(tmp_path, _embeddings(D1, 9, 3.0), "a"), D1, shape) == 9
    assert write_back(wh, "scores_embeddings", _file(tmp_path, _embeddings(D2, 4, 1.0), "b"), D2, shape) == 4
    assert write_back(wh, "scores_embeddings", _file(tmp_path, _embeddings(D1, 5, 0.0), "c"), D1, shape) == 5
    con = duckdb.connect(str(tmp_path / "wh.duckdb"), read_only=True)
    try:
        kinds = dict(con.sql("SELECT column_name, data_type FROM information_schema.columns "
                             "WHERE table_name = 'scores_embeddings'").fetchall())
        got = con.sql("SELECT * FROM scores_embeddings ORDER BY as_of, customer_id").to_arrow_table()
    finally:
        con.close()
    if layout == "array":
        assert kinds["embedding"] == f"FLOAT[{WIDTH}]"
    else:
        assert kinds["embedding_0"] == "FLOAT" and f"embedding_{WIDTH - 1}" in kinds and "embedding" not in kinds
    want = pa.concat_tables([shape(_embeddings(D1, 5, 0.0)), shape(_embeddings(D2, 4, 1.0))])
    assert got.num_rows == 9
    assert got.to_pylist() == want.to_pylist()


def test_embeddings_land_in_parquet_as_arrays(tmp_path):
    wh = ParquetWarehouse(path=str(tmp_path / "lake"))
    shape = partial(warehouse_rows, layout="array" if "parquet" in ARRAY_CONNECTORS else "columns")
    for day, n in ((D1, 6), (D2, 3), (D1, 2)):
        assert write_back(wh, "scores_embeddings", _file(tmp_path, _embeddings(day, n, n), f"{day.day}{n}"), day, shape) == n
    got = pa.Table.from_batches(list(wh.read("scores_embeddings"))).sort_by([("as_of", "ascending"),
                                                                              ("customer_id", "ascending")])
    want = pa.concat_tables([shape(_embeddings(D1, 2, 2)), shape(_embeddings(D2, 3, 3))])
    assert got.to_pylist() == want.to_pylist()


def test_explanations_land_in_duckdb_with_their_types(tmp_path):
    n = 8
    day = pa.table({"customer_id": [f"C{i // 2}" for i in range(n)], "label": pa.array([None, "b"] * (n // 2)),
                    "score": pa.array([0.25] * n, pa.float32()), "rank": pa.array([1, 2] * (n // 2), pa.int16()),
                    "contribution": pa.array([i / 8 - 0.5 for i in range(n)], pa.float32()),
                    "count": pa.array([None if i % 3 else i for i in range(n)], pa.int32()),
                    "reason": [f"r{i}" for i in range(n)], "model_fingerprint": ["f"] * n,
                    "as_of": pa.array([D1] * n, pa.timestamp("s"))})
    wh = DuckDBWarehouse(path=str(tmp_path / "wh.duckdb"))
    assert write_back(wh, "scores_churn_explanations", _file(tmp_path, day, "x"), D1) == n
    assert write_back(wh, "scores_churn_explanations", _file(tmp_path, day.slice(0, 3), "y"), D1) == 3  # a re-run
    got = pa.Table.from_batches(list(wh.read("scores_churn_explanations"))).sort_by("reason")
    assert got.schema.remove(8) == day.schema.remove(8)  # every type kept; DuckDB's as_of reads back in ms
    assert pa.types.is_timestamp(got.schema.field("as_of").type)
    assert got.to_pylist() == day.slice(0, 3).to_pylist()


@pytest.mark.parametrize("layout, width, says", [
    ("array", 5, "Cannot cast array of size 5 to array of size 7"),
    ("columns", 9, 'does not have a column with name "embedding_7"')])
def test_embeddings_of_another_width_fail_naming_the_table_and_keep_its_rows(tmp_path, layout, width, says):
    from habitus.resources.warehouses.errors import WarehouseError

    wh = DuckDBWarehouse(path=str(tmp_path / "wh.duckdb"))
    shape = partial(warehouse_rows, layout=layout)
    assert write_back(wh, "scores_embeddings", _file(tmp_path, _embeddings(D1, 4, 0.0), "a"), D1, shape) == 4
    other = _embeddings(D1, 3, 0.0).set_column(1, "embedding", pa.FixedSizeListArray.from_arrays(
        pa.array(np.zeros(3 * width, np.float16)), width))  # a foundation model of another width
    with pytest.raises(WarehouseError, match=rf"writing table 'scores_embeddings' of DuckDB database .*{says}"):
        write_back(wh, "scores_embeddings", _file(tmp_path, other, "b"), D1, shape)
    assert len(pa.Table.from_batches(list(wh.read("scores_embeddings")))) == 4  # the day as it was
