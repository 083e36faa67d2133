"""DatabricksWarehouse against a real SQL warehouse; runs only when DATABRICKS_SERVER_HOSTNAME,
DATABRICKS_HTTP_PATH and DATABRICKS_TOKEN are set (DATABRICKS_CATALOG, DATABRICKS_SCHEMA and
DATABRICKS_STAGING_VOLUME optional). Everything short of a workspace is in tests/resources/test_databricks.py."""

import os
import uuid

import pytest

pytestmark = pytest.mark.integration
_MISSING = not all(os.environ.get(v) for v in ("DATABRICKS_SERVER_HOSTNAME", "DATABRICKS_HTTP_PATH", "DATABRICKS_TOKEN"))


@pytest.fixture(scope="module", autouse=True)
def _driver():
    """Skips (at run time, not at collection: the default test run deselects this module) without the driver."""
    pytest.importorskip("databricks.sql", reason="install the databricks extra: pip install -e '.[databricks]'")


@pytest.fixture(scope="module", autouse=True)
def _server_configured():
    if _MISSING:
        pytest.skip("no Databricks workspace: set DATABRICKS_SERVER_HOSTNAME, DATABRICKS_HTTP_PATH, DATABRICKS_TOKEN")


@pytest.fixture(scope="module", params=["values", "volume"])
def wh(request, contract):
    from resources.databricks import DatabricksWarehouse

    volume = os.environ.get("DATABRICKS_STAGING_VOLUME")
    if request.param == "volume" and not volume:
        pytest.skip("set DATABRICKS_STAGING_VOLUME to test the PUT + REPLACE WHERE path")
    wh = DatabricksWarehouse(name="dbx", server_hostname=os.environ["DATABRICKS_SERVER_HOSTNAME"],
                             http_path=os.environ["DATABRICKS_HTTP_PATH"], access_token=os.environ["DATABRICKS_TOKEN"],
                             catalog=os.environ.get("DATABRICKS_CATALOG"), schema_name=os.environ.get("DATABRICKS_SCHEMA"),
                             staging_volume=volume if request.param == "volume" else None)
    table = f"habitus_events_{uuid.uuid4().hex[:8]}"
    events = contract.events_table()
    assert wh.write(table, iter(events.to_batches(max_chunksize=50)), events.schema) == contract.N
    yield wh, table
    with wh._cursor(table) as cur:
        cur.execute(f"DROP TABLE IF EXISTS `{table}`")


def test_contract(wh, contract):
    w, table = wh
    contract.time_range(w, table)
    contract.read_window(w, table)
    contract.read_all_values(w, table)
    contract.small_batches(w, table)
    contract.missing_table(w)


def test_write_replaces_partition(wh, contract):
    w, _ = wh
    table = f"habitus_scores_{uuid.uuid4().hex[:8]}"

    def rows(t):
        with w._cursor(t) as cur:
            cur.execute(f"SELECT customer_id, score, as_of FROM `{t}`")
            return cur.fetchall()

    try:
        contract.write_replaces_partition(w, rows, table)
    finally:
        with w._cursor(table) as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{table}`")
