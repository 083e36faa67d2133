"""ParquetWarehouse on object storage: s3:// paths on a local S3 server (moto), read in streaming
mode through pyarrow's S3 filesystem: what only object storage has. The checks every connector
passes are in test_connector_contract.py."""

from datetime import datetime

import pytest

from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.parquet import ParquetWarehouse

pytestmark = pytest.mark.integration


def test_missing_table_names_the_bucket(s3_events):
    with pytest.raises(WarehouseError, match="no_such_table.*s3://lake/shop"):
        s3_events.wh.schema("no_such_table")


def test_endpoint_from_aws_endpoint_url(s3_lake, monkeypatch):
    """No endpoint in the config: pyarrow reads AWS_ENDPOINT_URL, as the AWS tools do."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_lake}")
    wh = ParquetWarehouse(path="s3://lake/shop", region="us-east-1")
    assert wh.time_range("events", "ts")[0] == datetime(2026, 2, 20)


def test_source_asset_from_project_config(s3_lake, contract, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{s3_lake}")
    contract.source_asset(tmp_path, {"type": "parquet", "path": "s3://lake/shop"}, table="events_by_month")
