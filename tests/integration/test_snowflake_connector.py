"""SnowflakeWarehouse through the real snowflake-connector-python against a local fakesnow server."""

import uuid
from datetime import datetime

import pyarrow as pa
import pytest

from resources.errors import WarehouseError

pytestmark = pytest.mark.integration


def _warehouse(server, database, **kw):
    from resources.snowflake import SnowflakeWarehouse

    return SnowflakeWarehouse(name="wh", account="fakesnow", user="fake", password="snow", database=database,
                              schema_name="PUBLIC", options={"host": "127.0.0.1", "port": server.port,
                                                             "protocol": "http"}, **kw)


@pytest.fixture(scope="module", autouse=True)
def _driver():
    """Skips (at run time, not at collection: the default test run deselects this module) without the driver."""
    pytest.importorskip("snowflake.connector", reason="install the snowflake extra: pip install -e '.[snowflake]'")


@pytest.fixture(scope="module")
def wh(fakesnow_server, contract):
    database = f"HABITUS_{uuid.uuid4().hex[:8].upper()}"
    boot = _warehouse(fakesnow_server, None)
    con = boot._connect()
    con.cursor().execute(f"CREATE DATABASE {database}")
    con.cursor().execute(f"CREATE SCHEMA {database}.PUBLIC")
    con.close()
    wh = _warehouse(fakesnow_server, database)
    events = contract.events_table()
    assert wh.write("events", iter(events.to_batches(max_chunksize=50)), events.schema) == contract.N
    return wh


def _rows(wh, table):
    con = wh._connect()
    try:
        cur = con.cursor()
        cur.execute(f'SELECT "customer_id", "score", "as_of" FROM "{table}"')
        return cur.fetchall()
    finally:
        con.close()


def test_schema(wh, contract):
    contract.schema(wh)


def test_time_range(wh, contract):
    contract.time_range(wh)


def test_sensor_queries(wh, contract):
    contract.sensor_queries(wh)


def test_types_survive_extraction(wh, contract, tmp_path):
    contract.types_survive_extraction(wh, tmp_path, null_times=False)


def test_read_projection_and_window(wh, contract):
    contract.read_window(wh)


def test_every_value_survives(wh, contract):
    contract.read_all_values(wh)


def test_small_batches(wh, contract):
    contract.small_batches(wh)


def test_missing_table(wh, contract):
    contract.missing_table(wh)


def test_write_replaces_partition(wh, contract):
    contract.write_replaces_partition(wh, lambda t: _rows(wh, t))


def test_failed_write_keeps_previous_rows(wh, contract):
    contract.failed_write_keeps_previous_rows(wh, lambda t: _rows(wh, t))


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
    """The config path: ${ENV} password -> dagster EnvVar -> the connector; events extracted to Parquet."""
    conn = {"type": "snowflake", "account": "fakesnow", "user": "fake", "password": "${HABITUS_TEST_SF_PASSWORD}",
            "database": wh.database, "schema": "PUBLIC", "host": "127.0.0.1", "port": fakesnow_server.port,
            "protocol": "http"}
    resource, out = contract.source_asset(tmp_path, conn, env={"HABITUS_TEST_SF_PASSWORD": "snow-from-env"})
    import dagster as dg

    assert isinstance(resource.password, dg.EnvVar) and resource.password.env_var_name == "HABITUS_TEST_SF_PASSWORD"
    assert out.schema.field("amount").type == pa.decimal128(38, 9)  # NUMBER(12,2) in the canonical decimal


def test_bad_connection_names_it_and_hides_the_password(fakesnow_server):
    from resources.snowflake import SnowflakeWarehouse

    secret = "hunter2-secret"
    wh = SnowflakeWarehouse(name="prod_wh", account="fakesnow", user="fake", password=secret, login_timeout=5,
                            options={"host": "127.0.0.1", "port": 1, "protocol": "http"})
    with pytest.raises(WarehouseError) as err:
        wh.schema("events")
    text = str(err.value)
    assert "prod_wh" in text and "127.0.0.1:1" in text and "cannot connect" in text
    assert secret not in text
