"""BigQueryWarehouse through the real google-cloud-bigquery client (REST) and Storage Read API
(gRPC) against bqemulator, a local BigQuery emulator run from its own virtualenv."""

import uuid
from datetime import datetime

import pyarrow as pa
import pytest

from resources.errors import WarehouseError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _driver():
    """Skips (at run time, not at collection: the default test run deselects this module) without the driver."""
    pytest.importorskip("google.cloud.bigquery", reason="install the bigquery extra: pip install -e '.[bigquery]'")


@pytest.fixture(scope="module", params=["storage", "query"])
def wh(request, bq_emulator, contract):
    from resources.bigquery import BigQueryWarehouse

    rest, grpc = bq_emulator
    dataset = f"habitus_{uuid.uuid4().hex[:8]}"
    wh = BigQueryWarehouse(name="bq", project="habitus", dataset=dataset, api_endpoint=rest, grpc_endpoint=grpc,
                           storage_api=request.param == "storage")
    client = wh._client()
    client.create_dataset(dataset)
    client.close()
    events = contract.events_table()
    assert wh.write("events", iter(events.to_batches(max_chunksize=50)), events.schema) == contract.N
    return wh


def _rows(wh, table):
    client = wh._client()
    try:
        return [tuple(r.values()) for r in client.query(f"SELECT customer_id, score, as_of FROM `{wh.dataset}.{table}`").result()]
    finally:
        client.close()


def test_schema(wh):
    s = wh.schema("events")
    assert s.names == ["id", "customer_id", "ts", "price", "amount", "note", "flag", "product_id"]
    assert s.field("id").type == pa.int64() and s.field("ts").type == pa.timestamp("us")  # DATETIME
    assert pa.types.is_decimal(s.field("amount").type) and s.field("flag").type == pa.bool_()


def test_time_range(wh, contract):
    contract.time_range(wh)


def test_sensor_queries(wh, contract):
    contract.sensor_queries(wh)


def test_types_survive_extraction(wh, contract, tmp_path):
    contract.types_survive_extraction(wh, tmp_path)


def test_read_projection_and_window(wh, contract):
    contract.read_window(wh)


def test_every_value_survives(wh, contract):
    contract.read_all_values(wh)


def test_small_batches(wh, contract):
    contract.small_batches(wh)


def test_missing_table(wh, contract):
    contract.missing_table(wh)


def test_write_replaces_partition(wh, contract):
    contract.write_replaces_partition(wh, lambda t: _rows(wh, t), table=f"scores_{uuid.uuid4().hex[:6]}")


def test_failed_write_keeps_previous_rows(wh, contract):
    table = f"failed_{uuid.uuid4().hex[:6]}"
    contract.failed_write_keeps_previous_rows(wh, lambda t: _rows(wh, t), table=table)
    client = wh._client()
    try:  # the staging table is gone
        assert [t.table_id for t in client.list_tables(wh.dataset) if t.table_id.startswith("_habitus_stage")] == []
    finally:
        client.close()


def test_timestamp_and_date_windows(wh):
    """TIMESTAMP (UTC instant) and DATE columns get bounds of their own type."""
    client = wh._client()
    client.query(f"CREATE TABLE `{wh.dataset}.typed` (happened TIMESTAMP, day DATE, id INT64)").result()
    client.query(f"INSERT INTO `{wh.dataset}.typed` VALUES (TIMESTAMP '2026-03-01 10:00:00+02:00', DATE '2026-03-01', 1), "
                 f"(TIMESTAMP '2026-03-02 00:30:00+00:00', DATE '2026-03-02', 2)").result()
    client.close()
    assert wh.schema("typed").field("happened").type == pa.timestamp("us", "UTC")
    assert wh.time_range("typed", "happened") == (datetime(2026, 3, 1, 8), datetime(2026, 3, 2, 0, 30))
    assert wh.time_range("typed", "day") == (datetime(2026, 3, 1), datetime(2026, 3, 2))
    ids = lambda col, a, b: sorted(pa.Table.from_batches(list(wh.read("typed", ["id"], col, a, b))).column("id").to_pylist())
    assert ids("happened", datetime(2026, 3, 1, 8), datetime(2026, 3, 2)) == [1]
    assert ids("day", datetime(2026, 3, 2), datetime(2026, 3, 3)) == [2]
    assert ids("day", datetime(2026, 3, 1, 12), datetime(2026, 3, 3)) == [2]  # a partial day starts the next


def test_bad_connection_names_it_and_hides_the_secret():
    from resources.bigquery import BigQueryWarehouse

    secret = '{"type": "service_account", "private_key": "hunter2-secret"}'
    wh = BigQueryWarehouse(name="prod_bq", project="p", dataset="d", api_endpoint="http://127.0.0.1:1", timeout=3,
                           credentials_json=secret)
    with pytest.raises(WarehouseError) as err:
        wh.schema("events")
    text = str(err.value)
    assert "prod_bq" in text and "127.0.0.1:1" in text and "cannot connect" in text and "hunter2" not in text
