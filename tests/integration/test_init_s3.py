"""`habitus init --parquet s3://bucket/prefix` lists the prefix's tables (`<name>.parquet` objects and
`<name>/` folders directly under it) on a local S3 server (moto), as it lists a local folder's."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pyarrow.fs import S3FileSystem

from habitus.pipelines.init import command as init
from habitus.resources.warehouses.parquet import ParquetWarehouse

from .conftest import events_table

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def init_prefix(s3_lake):
    """s3://lake/init_listing: purchases as one object, customers as a folder of parts, and objects that
    are not tables (a text file, a nested folder's own file)."""
    fs = S3FileSystem(endpoint_override=s3_lake, scheme="http", region="us-east-1")
    events = events_table()
    pq.write_table(events, "lake/init_listing/purchases.parquet", filesystem=fs)
    ids = sorted(set(events.column("customer_id").to_pylist()))
    customers = pa.table({"customer_id": ids, "segment": [f"s{i % 2}" for i in range(len(ids))]})
    pq.write_table(customers, "lake/init_listing/customers/part-0.parquet", filesystem=fs)
    with fs.open_output_stream("lake/init_listing/README.txt") as f:
        f.write(b"not a table")
    return s3_lake


def test_the_prefix_lists_its_tables(init_prefix):
    wh = ParquetWarehouse(path="s3://lake/init_listing/", endpoint=f"http://{init_prefix}", region="us-east-1")
    assert init._list_tables("parquet", {"path": "s3://lake/init_listing/"}, wh) == ["customers", "purchases"]


def test_init_parquet_s3_suggests_a_config_without_tables(init_prefix, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{init_prefix}")
    out = tmp_path / "suggested.yaml"
    assert init.main(["--parquet", "s3://lake/init_listing", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "profiling customers ..." in err and "profiling purchases ..." in err and "README" not in err
    config = yaml.safe_load(out.read_text())
    assert {s["table"] for s in config["sources"]} == {"purchases", "customers"}
    assert config["connections"]["warehouse"]["path"] == "s3://lake/init_listing"


def test_an_unreachable_prefix_is_a_config_error(monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert init.main(["--parquet", "s3://lake/init_listing"]) == 2
    assert "--parquet s3://lake/init_listing: cannot list the prefix" in capsys.readouterr().err
