"""SynapseWarehouse against a real Synapse SQL pool or SQL Server; runs only when SYNAPSE_SERVER,
SYNAPSE_DATABASE, SYNAPSE_USER and SYNAPSE_PASSWORD are set (SYNAPSE_AUTHENTICATION optional).
Everything short of a server is in tests/resources/test_synapse.py."""

import os
import uuid

import pytest

pytestmark = pytest.mark.integration
_MISSING = not all(os.environ.get(v) for v in ("SYNAPSE_SERVER", "SYNAPSE_DATABASE", "SYNAPSE_USER", "SYNAPSE_PASSWORD"))


@pytest.fixture(scope="module", autouse=True)
def _driver():
    """Skips (at run time, not at collection: the default test run deselects this module) without the driver."""
    pytest.importorskip("mssql_python", reason="install the synapse extra: pip install -e '.[synapse]'")


@pytest.fixture(scope="module", autouse=True)
def _server_configured():
    if _MISSING:
        pytest.skip("no Synapse / SQL Server: set SYNAPSE_SERVER, SYNAPSE_DATABASE, SYNAPSE_USER, SYNAPSE_PASSWORD")


@pytest.fixture(scope="module")
def wh(contract):
    from resources.synapse import SynapseWarehouse

    wh = SynapseWarehouse(name="syn", server=os.environ["SYNAPSE_SERVER"], database=os.environ["SYNAPSE_DATABASE"],
                          username=os.environ["SYNAPSE_USER"], password=os.environ["SYNAPSE_PASSWORD"],
                          authentication=os.environ.get("SYNAPSE_AUTHENTICATION"))
    table = f"habitus_events_{uuid.uuid4().hex[:8]}"
    events = contract.events_table()
    assert wh.write(table, iter(events.to_batches(max_chunksize=50)), events.schema) == contract.N
    yield wh, table
    with wh._cursor(table) as (con, cur):
        cur.execute(f"DROP TABLE [{table}]")
        con.commit()


def test_contract(wh, contract):
    w, table = wh
    contract.schema(w, table)
    contract.time_range(w, table)
    contract.sensor_queries(w, table)
    contract.read_window(w, table)
    contract.read_all_values(w, table)
    contract.small_batches(w, table)
    contract.missing_table(w)


def test_write_replaces_partition(wh, contract):
    w, _ = wh
    table = f"habitus_scores_{uuid.uuid4().hex[:8]}"

    def rows(t):
        with w._cursor(t) as (_, cur):
            cur.execute(f"SELECT customer_id, score, as_of FROM [{t}]")
            return cur.fetchall()

    contract.write_replaces_partition(w, rows, table)
    contract.failed_write_keeps_previous_rows(w, rows, f"habitus_failed_{uuid.uuid4().hex[:8]}")
