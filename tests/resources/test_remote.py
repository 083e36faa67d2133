"""Tests for habitus.resources.warehouses.remote (shared by the networked connectors) and the connection -> resource
mapping in habitus.pipelines.orchestration.build."""

import subprocess
import sys
from datetime import datetime, timezone
from decimal import Decimal

import dagster as dg
import pyarrow as pa
import pytest

from habitus.pipelines.config.project import WarehouseConnection
from habitus.pipelines.orchestration.build import connection_resource
from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.warehouses.masking import value
from habitus.resources.store.redaction import redact_text
from habitus.resources.warehouses.remote import connect_error, naive_utc, rows_to_batches

SCHEMA = pa.schema([("id", pa.int64()), ("amount", pa.decimal128(10, 2)), ("ts", pa.timestamp("us"))])


def test_rows_to_batches():
    rows = iter([(i, Decimal(i) / 4, datetime(2026, 3, 1, i)) for i in range(5)])
    out = list(rows_to_batches(rows, SCHEMA, 2))
    assert [len(b) for b in out] == [2, 2, 1]
    assert pa.Table.from_batches(out).column("amount").to_pylist()[1] == Decimal("0.25")
    with pytest.raises(WarehouseError, match="'id'"):
        list(rows_to_batches(iter([("x", None, None)]), SCHEMA, 2))


def test_redact_and_connect_error_hide_secrets():
    secret = "p@ss/word 1"
    err = connect_error("snowflake", "prod", "acme.snowflakecomputing.com", RuntimeError(
        f"login failed for user bob with password {secret} (url https://x/?password=p%40ss%2Fword%201)"), [secret, None])
    text = str(err)
    assert "prod" in text and "acme.snowflakecomputing.com" in text and "cannot connect" in text
    assert secret not in text and "p%40ss%2Fword%201" not in text and "***" in text
    assert redact_text("ab is short", ["ab"]) == "ab is short"  # too short to be a secret worth hiding


def test_value_reads_env_vars(monkeypatch):
    monkeypatch.setenv("HABITUS_TEST_TOKEN", "tok-123")
    assert value(dg.EnvVar("HABITUS_TEST_TOKEN")) == "tok-123"
    assert value({"env": "HABITUS_TEST_TOKEN"}) == "tok-123"  # an EnvVar inside a dict field, in a run
    assert value({"a": 1}) == {"a": 1} and value("x") == "x"
    with pytest.raises(WarehouseError, match="HABITUS_TEST_MISSING"):
        value({"env": "HABITUS_TEST_MISSING"})


def test_naive_utc():
    assert naive_utc(datetime(2026, 3, 1, 10, tzinfo=timezone.utc)) == datetime(2026, 3, 1, 10)
    assert naive_utc(datetime(2026, 3, 1, 10)) == datetime(2026, 3, 1, 10)
    assert naive_utc(None) is None


def test_connection_resource_maps_fields_options_and_secrets(monkeypatch):
    from habitus.pipelines.config.file import EnvValue

    monkeypatch.setenv("HABITUS_TEST_SF_PW", "s3cret-pw")
    conn = WarehouseConnection.model_validate({
        "type": "snowflake", "account": "acme", "user": "bob", "schema": "PUBLIC",
        "password": EnvValue("s3cret-pw", "HABITUS_TEST_SF_PW"),  # as the config loader reads ${HABITUS_TEST_SF_PW}
        "database": "SHOP", "authenticator": "snowflake", "host": "127.0.0.1", "port": 8765})
    r = connection_resource("wh", conn)
    assert type(r).__name__ == "SnowflakeWarehouse"
    assert r.name == "wh" and r.schema_name == "PUBLIC" and r.database == "SHOP"
    assert r.password == "${HABITUS_TEST_SF_PW}"  # as written: expanded where the driver takes it
    assert r.options == {"authenticator": "snowflake", "host": "127.0.0.1", "port": 8765}
    kw = r.connect_kwargs()
    assert kw["password"] == "s3cret-pw" and kw["schema"] == "PUBLIC" and kw["port"] == 8765
    assert kw["session_parameters"] == {"TIMEZONE": "UTC"} and kw["login_timeout"] == 30


def test_literal_secret_warns():
    conn = WarehouseConnection.model_validate({"type": "snowflake", "account": "a", "password": "literal-pw-not-in-env"})
    with pytest.warns(UserWarning, match="password"):
        r = connection_resource("wh", conn)
    assert r.password == "literal-pw-not-in-env"


def test_unknown_connector_type_is_refused():
    class Fake:
        type = "oracle"

    with pytest.raises(NotImplementedError, match="oracle"):
        connection_resource("wh", Fake())


def test_drivers_import_lazily():
    """Loading the code location (and every connector module) must not import a connector's driver."""
    modules = "habitus.resources.warehouses.snowflake, habitus.resources.warehouses.clickhouse, habitus.resources.warehouses.databricks, habitus.resources.warehouses.synapse, habitus.resources.warehouses.hive, " \
              "habitus.resources.warehouses.bigquery, habitus.pipelines.definitions"
    code = (f"import sys, {modules}; heavy = [m for m in sys.modules if m.startswith(("
            "'snowflake', 'clickhouse_connect', 'databricks', 'pyodbc', 'mssql_python', 'arrow_odbc', "
            "'pyhive', 'google.cloud', 'thrift', 'chdb', 'pyspark'))]; print(heavy); assert not heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name, cls", [("snowflake", "SnowflakeWarehouse"), ("clickhouse", "ClickHouseWarehouse"),
                                       ("bigquery", "BigQueryWarehouse"), ("hive", "HiveWarehouse"),
                                       ("databricks", "DatabricksWarehouse"), ("synapse", "SynapseWarehouse"),
                                       ("s3", "ParquetWarehouse")])
def test_example_configs_build_their_connector(name, cls, monkeypatch):
    """examples/<warehouse>.yaml loads and its connection becomes the right resource, secrets as EnvVars."""
    from pathlib import Path

    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.build import build_resources

    for var in ("SF_ACCOUNT", "SF_USER", "SF_PASSWORD", "CH_HOST", "CH_PASSWORD", "BQ_PROJECT", "HIVE_HOST",
                "HIVE_USER", "HIVE_PASSWORD", "DATABRICKS_SERVER_HOSTNAME", "DATABRICKS_HTTP_PATH", "DATABRICKS_TOKEN",
                "SYNAPSE_SERVER", "SYNAPSE_USER", "SYNAPSE_PASSWORD"):
        monkeypatch.setenv(var, f"value-of-{var.lower()}")
    project = load_project(Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml")
    resources = build_resources(project)
    (wh,) = [v for k, v in resources.items() if k.startswith("connection_")]
    assert type(wh).__name__ == cls
    for secret in ("password", "access_token"):
        if getattr(wh, secret, None) is not None:  # kept as written; the value only where the driver takes it
            assert getattr(wh, secret).startswith("${") and "value-of-" not in getattr(wh, secret)
            assert value(getattr(wh, secret)).startswith("value-of-")
