"""SnowflakeWarehouse through the real snowflake-connector-python against a local fakesnow server: what
only Snowflake has. The checks every connector passes are in test_connector_contract.py."""

from datetime import datetime

import pyarrow as pa
import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wh(snowflake_events):
    return snowflake_events.wh


def test_native_types(wh):
    """Columns as a Snowflake user declares them: NUMBER(38,0) ids, TIMESTAMP_TZ / LTZ, quoted names."""
    con = wh._connect()
    cur = con.cursor()
    quoted = '"odd ""name"""'
    cur.execute(f'CREATE OR REPLACE TABLE {quoted} ("Event Time" TIMESTAMP_TZ, ID NUMBER(38, 0), '
                '"price" NUMBER(10, 2), "seen" TIMESTAMP_LTZ, "ok" BOOLEAN, "d" DATE, "f" FLOAT)')
    cur.execute(f"INSERT INTO {quoted} VALUES ('2026-03-01 10:00:00+02:00', 4611686018427387904, 12.34, "
                "'2026-03-01 08:00:00+00:00', TRUE, '2026-03-01', 1.5), "
                "('2026-03-02 00:30:00+00:00', 7, NULL, NULL, NULL, NULL, NULL)")
    con.close()
    table = 'odd "name"'
    s = wh.schema(table)
    assert s.names == ["Event Time", "ID", "price", "seen", "ok", "d", "f"]
    assert s.field("Event Time").type.tz == "UTC" and s.field("ID").type == pa.int64()
    assert s.field("price").type == pa.decimal128(10, 2) and s.field("d").type == pa.date32()
    assert wh.time_range(table, "Event Time") == (datetime(2026, 3, 1, 8), datetime(2026, 3, 2, 0, 30))
    t = pa.Table.from_batches(list(wh.read(table, ["ID", "price", "Event Time"], "Event Time",
                                           datetime(2026, 3, 1, 8), datetime(2026, 3, 2))))
    assert t.to_pydict()["ID"] == [4611686018427387904]
    assert str(t.to_pydict()["price"][0]) == "12.34"


def test_source_asset_from_project_config(wh, fakesnow_server, contract, tmp_path):
    """The config path: ${ENV} password -> kept as written in the resource -> expanded by the connector; events
    extracted to Parquet."""
    conn = {"type": "snowflake", "account": "fakesnow", "user": "fake", "password": "${HABITUS_TEST_SF_PASSWORD}",
            "database": wh.database, "schema": "PUBLIC", "host": "127.0.0.1", "port": fakesnow_server.port,
            "protocol": "http"}
    resource, out = contract.source_asset(tmp_path, conn, env={"HABITUS_TEST_SF_PASSWORD": "snow-from-env"})
    assert resource.password == "${HABITUS_TEST_SF_PASSWORD}"  # the extraction above logged in with its value
    assert out.schema.field("amount").type == pa.decimal128(38, 9)  # NUMBER(12,2) in the canonical decimal


def test_a_misspelled_source_table_lists_the_tables_there(wh, fakesnow_server, contract, tmp_path):
    """The source's table is not in the schema: the step fails naming it (Snowflake's error 2003), with the
    tables of INFORMATION_SCHEMA.TABLES."""
    conn = {"type": "snowflake", "account": "fakesnow", "user": "fake", "password": "snow", "database": wh.database,
            "schema": "PUBLIC", "host": "127.0.0.1", "port": fakesnow_server.port, "protocol": "http"}
    message = contract.misspelled_source(tmp_path, conn)
    assert "in snowflake connection 'wh'" in message and "does not exist" in message
