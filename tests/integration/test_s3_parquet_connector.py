"""ParquetWarehouse on object storage: s3:// paths on a local S3 server (moto), read in streaming
mode through pyarrow's S3 filesystem."""

import os
from datetime import datetime

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from resources.errors import WarehouseError
from resources.parquet import ParquetWarehouse

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lake(moto_s3, contract):
    """Bucket 'lake': events as one file and as a hive-partitioned folder (many row groups)."""
    from pyarrow.fs import S3FileSystem

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    fs = S3FileSystem(endpoint_override=moto_s3, scheme="http", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir("lake")
    events = contract.events_table()
    pq.write_table(events, "lake/shop/events.parquet", filesystem=fs, row_group_size=25)
    by_month = events.append_column("month", pa.array([t.strftime("%Y-%m") for t in events.column("ts").to_pylist()]))
    ds.write_dataset(by_month, "lake/shop/events_by_month", filesystem=fs, format="parquet",
                     partitioning=["month"], partitioning_flavor="hive")
    return moto_s3


@pytest.fixture(params=["events", "events_by_month"])
def table(request):
    return request.param


def _wh(lake):
    return ParquetWarehouse(path="s3://lake/shop", endpoint=f"http://{lake}", region="us-east-1")


def test_time_range(lake, contract, table):
    contract.time_range(_wh(lake), table)


def test_sensor_queries(lake, contract, table):
    contract.sensor_queries(_wh(lake), table)


def test_read_projection_and_window(lake, contract, table):
    contract.read_window(_wh(lake), table)


def test_small_batches_stream(lake, contract):
    contract.small_batches(_wh(lake), "events")


def test_every_value_survives(lake, contract):
    contract.schema(_wh(lake), "events")
    contract.read_all_values(_wh(lake), "events")


def test_missing_table(lake):
    with pytest.raises(WarehouseError, match="no_such_table.*s3://lake/shop"):
        _wh(lake).schema("no_such_table")


def test_endpoint_from_aws_endpoint_url(lake, monkeypatch):
    """No endpoint in the config: pyarrow reads AWS_ENDPOINT_URL, as the AWS tools do."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{lake}")
    wh = ParquetWarehouse(path="s3://lake/shop", region="us-east-1")
    assert wh.time_range("events", "ts")[0] == datetime(2026, 2, 20)


def test_write_replaces_partition(lake, contract):
    wh = _wh(lake)

    def rows(table):
        t = pa.Table.from_batches(list(wh.read(table)))
        return list(zip(t.column("customer_id").to_pylist(), t.column("score").to_pylist(),
                        t.column("as_of").to_pylist()))

    contract.write_replaces_partition(wh, rows)


def test_source_asset_from_project_config(lake, contract, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{lake}")
    contract.source_asset(tmp_path, {"type": "parquet", "path": "s3://lake/shop"}, table="events_by_month")


def test_types_survive_extraction(lake, contract, tmp_path):
    contract.types_survive_extraction(_wh(lake), tmp_path)
