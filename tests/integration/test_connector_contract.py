"""The checks every warehouse connector passes (`Contract` in conftest.py), run against every server
on a table loaded with `events_table()`. Each server's fixture (conftest.py) starts or finds the
server, loads the events, and skips with the reason where the server or its driver is missing.
What only one connector has is tested in its own module (test_<name>_connector.py)."""

import contextlib
import uuid

import pytest

pytestmark = pytest.mark.integration

# test id -> the fixture (conftest.py) giving that server's `Loaded` warehouse
SERVERS = {
    "snowflake": "snowflake_events",
    "bigquery-storage": "bigquery_storage_events",
    "bigquery-query": "bigquery_query_events",
    "clickhouse-chdb": "clickhouse_chdb_events",
    "clickhouse-server": "clickhouse_server_events",
    "hive": "hive_events",
    "databricks-values": "databricks_values_events",
    "databricks-volume": "databricks_volume_events",
    "synapse": "synapse_events",
    "s3": "s3_events",
    "s3-by-month": "s3_by_month_events",
    "duckdb": "duckdb_events",
    "parquet": "parquet_events",
}

_NOT_YET = "not yet run against a real {}: add it here once it passes there"
# The checks a server does not take, and why. Everything else runs everywhere.
NOT_RUN = {
    **{s: dict.fromkeys(["schema", "sensor_queries", "types_survive_extraction", "failed_write_keeps_previous_rows"],
                        _NOT_YET.format("Databricks workspace")) for s in ("databricks-values", "databricks-volume")},
    "synapse": {"types_survive_extraction": _NOT_YET.format("Synapse pool")},
    # a hive-partitioned folder: a `month` column besides the events' own, so only the time questions
    "s3-by-month": dict.fromkeys(["schema", "types_survive_extraction", "read_all_values", "small_batches",
                                  "missing_table", "write_replaces_partition", "failed_write_keeps_previous_rows",
                                  "read_where", "outputs_written_back"],
                                 "the same files as `s3`, partitioned by month"),
}


def pytest_generate_tests(metafunc):
    """Each check against each server that takes it: test_<check>[<server>]."""
    if "server" in metafunc.fixturenames:
        check = metafunc.function.__name__.removeprefix("test_")
        metafunc.parametrize("server", [s for s in SERVERS if check not in NOT_RUN.get(s, {})])


@pytest.fixture
def loaded(server, request):
    return request.getfixturevalue(SERVERS[server])


@contextlib.contextmanager
def _scratch(loaded, name: str):
    """A new table's name for a write check, and its removal afterwards where the server is shared."""
    table = f"{name}_{uuid.uuid4().hex[:8]}"
    try:
        yield table
    finally:
        if loaded.drop is not None:
            loaded.drop(table)


def test_schema(loaded, contract):
    s = contract.schema(loaded.wh, loaded.table, loaded.decimal_scale)
    for name, typ in loaded.schema_types.items():
        assert s.field(name).type == typ, name


def test_time_range(loaded, contract):
    contract.time_range(loaded.wh, loaded.table)


def test_sensor_queries(loaded, contract):
    contract.sensor_queries(loaded.wh, loaded.table)


def test_types_survive_extraction(loaded, contract, tmp_path):
    contract.types_survive_extraction(loaded.wh, tmp_path, **loaded.types)


def test_read_window(loaded, contract):
    contract.read_window(loaded.wh, loaded.table)


def test_read_all_values(loaded, contract):
    contract.read_all_values(loaded.wh, loaded.table)


def test_small_batches(loaded, contract):
    contract.small_batches(loaded.wh, loaded.table)


def test_read_where(loaded, contract):
    contract.read_where(loaded.wh, loaded.table)


def test_outputs_written_back(server, loaded, contract, tmp_path):
    from habitus.assets.embeddings import ARRAY_CONNECTORS

    kind = {"s3": "parquet", "s3-by-month": "parquet"}.get(server, server.split("-")[0])
    with _scratch(loaded, "habitus_out") as table:
        try:
            contract.outputs_written_back(loaded.wh, tmp_path, "array" if kind in ARRAY_CONNECTORS else "columns", table)
        finally:
            if loaded.drop is not None:
                for suffix in ("_embeddings", "_churn_explanations"):
                    loaded.drop(table + suffix)


def test_missing_table(loaded, contract):
    contract.missing_table(loaded.wh, loaded.table)


def test_write_replaces_partition(loaded, contract):
    with _scratch(loaded, "habitus_scores") as table:
        contract.write_replaces_partition(loaded.wh, loaded.rows, table)


def test_failed_write_keeps_previous_rows(loaded, contract):
    with _scratch(loaded, "habitus_failed") as table:
        contract.failed_write_keeps_previous_rows(loaded.wh, loaded.rows, table)
    if loaded.stages is not None:
        assert loaded.stages() == []  # the staging table is gone
