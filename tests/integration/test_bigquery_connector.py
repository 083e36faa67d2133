"""BigQueryWarehouse through the real google-cloud-bigquery client (REST) and Storage Read API
(gRPC) against bqemulator, a local BigQuery emulator run from its own virtualenv: what only BigQuery
has. The checks every connector passes are in test_connector_contract.py."""

from datetime import datetime

import pyarrow as pa
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["storage", "query"])
def wh(request):
    return request.getfixturevalue(f"bigquery_{request.param}_events").wh


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


def test_a_misspelled_source_table_lists_the_tables_there(wh, bq_emulator, contract, tmp_path):
    """The source's table is not in the dataset: the step fails naming it, with list_tables' tables."""
    rest, grpc = bq_emulator
    conn = {"type": "bigquery", "project": "habitus", "dataset": wh.dataset, "api_endpoint": rest,
            "grpc_endpoint": grpc}
    message = contract.misspelled_source(tmp_path, conn)
    assert "in bigquery connection 'wh'" in message
