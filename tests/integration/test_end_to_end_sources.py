"""One example project (events + customer attributes + product attributes, a slice of the demo
data) end to end from every server that runs here: sources -> cache -> foundation -> scenario ->
predictions written back into that server. The extracted files, and so the cache fingerprint, are
identical whatever server the same data came from."""

import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytestmark = pytest.mark.integration

TABLES = {"purchases": ["customer_id", "ts", "product_id", "store_id", "quantity", "price"],
          "customers": ["customer_id", "age", "region", "segment", "signup_date"],
          "products": ["product_id", "category", "brand", "price_tier"]}
SINK = "habitus_scores"


def project_config(connection: dict) -> dict:
    """A tiny model config: each run takes seconds."""
    return {
        "workspace": "ws", "connections": {"wh": connection}, "entity": "customer_id",
        "sources": [
            {"name": "purchases", "role": "events", "connection": "wh", "table": "purchases", "timestamp": "ts",
             "columns": ["product_id", "store_id", "quantity", "price"], "start": "2026-01-01", "end": "2026-06-01"},
            {"name": "customers", "role": "entity_attributes", "connection": "wh", "table": "customers",
             "columns": ["age", "region", "segment", "signup_date"]},
            {"name": "products", "role": "attributes", "connection": "wh", "table": "products", "key": "product_id",
             "columns": ["category", "brand", "price_tier"]},
        ],
        "foundation": {"horizon": "14d", "hidden": 16, "layers": 1, "epochs": 1, "batch_size": 256},
        "scenarios": {"churn": {"task": "binary", "epochs": 1, "target": {"no_event": "purchases", "within": "28d"}}},
        "predictions": {"top_k": 5, "start": "2026-05-01", "sink": {"connection": "wh", "table": SINK}},
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict[str, pa.Table]:
    """A few hundred customers over five months of the demo data, as Arrow tables."""
    from habitus.pipelines.demo.data import generate_demo_warehouse

    path = tmp_path_factory.mktemp("demo") / "demo.duckdb"
    generate_demo_warehouse(path, customers=300, products=60, stores=6, start="2026-01-01", end="2026-05-31", seed=7)
    con = duckdb.connect(str(path), read_only=True)
    try:
        return {name: con.sql(f'SELECT {", ".join(cols)} FROM "{name}"').to_arrow_table()
                for name, cols in TABLES.items()}
    finally:
        con.close()


# --------------------------------------------------------------------------- each server, loaded with the demo slice


def _load(wh, demo: dict[str, pa.Table]) -> None:
    for name, table in demo.items():
        assert wh.write(name, iter(table.to_batches(max_chunksize=2000)), table.schema) == table.num_rows


def load_duckdb(request, demo, root: Path) -> dict:
    path = root / "warehouse.duckdb"
    con = duckdb.connect(str(path))
    for name, table in demo.items():
        con.register("t", table)
        con.sql(f'CREATE TABLE "{name}" AS SELECT * FROM t')
        con.unregister("t")
    con.close()
    return {"type": "duckdb", "path": str(path)}


def load_parquet(request, demo, root: Path) -> dict:
    for name, table in demo.items():
        pq.write_table(table, root / f"{name}.parquet", row_group_size=1000)
    return {"type": "parquet", "path": str(root)}


def load_s3(request, demo, root: Path) -> dict:
    from pyarrow.fs import S3FileSystem

    endpoint = request.getfixturevalue("moto_s3")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    fs = S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1", allow_bucket_creation=True)
    bucket = f"e2e-{uuid.uuid4().hex[:8]}"
    fs.create_dir(bucket)
    for name, table in demo.items():  # the events as a hive-partitioned folder, like a data lake holds them
        if name == "purchases":
            import pyarrow.dataset as ds

            month = pa.array([t.strftime("%Y-%m") for t in table.column("ts").to_pylist()])
            ds.write_dataset(table.append_column("month", month), f"{bucket}/shop/{name}", filesystem=fs,
                             format="parquet", partitioning=["month"], partitioning_flavor="hive")
        else:
            pq.write_table(table, f"{bucket}/shop/{name}.parquet", filesystem=fs)
    return {"type": "parquet", "path": f"s3://{bucket}/shop", "endpoint": f"http://{endpoint}", "region": "us-east-1"}


def load_snowflake(request, demo, root: Path) -> dict:
    pytest.importorskip("snowflake.connector")
    from habitus.resources.warehouses.snowflake import SnowflakeWarehouse

    server = request.getfixturevalue("fakesnow_server")
    database = f"E2E_{uuid.uuid4().hex[:8].upper()}"
    options = {"host": "127.0.0.1", "port": server.port, "protocol": "http"}
    con = SnowflakeWarehouse(name="wh", account="fakesnow", user="fake", password="snow", options=options)._connect()
    con.cursor().execute(f"CREATE DATABASE {database}")
    con.cursor().execute(f"CREATE SCHEMA {database}.PUBLIC")
    con.close()
    _load(SnowflakeWarehouse(name="wh", account="fakesnow", user="fake", password="snow", database=database,
                             schema_name="PUBLIC", options=options), demo)
    return {"type": "snowflake", "account": "fakesnow", "user": "fake", "password": "${HABITUS_E2E_SF_PASSWORD}",
            "database": database, "schema": "PUBLIC", **options}


def load_bigquery(request, demo, root: Path) -> dict:
    pytest.importorskip("google.cloud.bigquery")
    from habitus.resources.warehouses.bigquery import BigQueryWarehouse

    rest, grpc = request.getfixturevalue("bq_emulator")
    dataset = f"e2e_{uuid.uuid4().hex[:8]}"
    wh = BigQueryWarehouse(name="wh", project="habitus", dataset=dataset, api_endpoint=rest, grpc_endpoint=grpc)
    client = wh._client()
    client.create_dataset(dataset)
    client.close()
    _load(wh, demo)
    return {"type": "bigquery", "project": "habitus", "dataset": dataset, "api_endpoint": rest, "grpc_endpoint": grpc}


def load_hive(request, demo, root: Path) -> dict:
    pytest.importorskip("pyhive")
    from habitus.resources.warehouses.hive import HiveWarehouse

    server = request.getfixturevalue("hive_server")
    database = f"e2e_{uuid.uuid4().hex[:8]}"
    boot = HiveWarehouse(name="wh", host="127.0.0.1", port=server.port, username="habitus", auth="NONE")
    con = boot._connect()
    cur = con.cursor()
    cur.execute(f"CREATE DATABASE `{database}`")
    # the server runs here: it loads Parquet files itself (the connector's own write, multi-row
    # INSERTs, is checked in test_hive_connector.py and by the predictions written back below)
    for name, table in demo.items():
        pq.write_table(table, root / f"{name}.parquet")
        cur.execute(f"CREATE TABLE `{database}`.`{name}` USING parquet LOCATION '{root / (name + '.parquet')}'")
    con.close()
    return {"type": "hive", "host": "127.0.0.1", "port": server.port, "username": "habitus", "auth": "NONE",
            "database": database}


def load_clickhouse(request, demo, root: Path) -> dict:
    pytest.importorskip("clickhouse_connect")
    from habitus.resources.warehouses.clickhouse import ClickHouseWarehouse

    path = request.getfixturevalue("chdb_path")
    database = f"e2e_{uuid.uuid4().hex[:8]}"
    boot = ClickHouseWarehouse(name="wh", interface="chdb", options={"path": path})
    with boot._session("-") as client:
        client.command(f"CREATE DATABASE {database}")
    _load(boot.model_copy(update={"database": database}), demo)
    return {"type": "clickhouse", "interface": "chdb", "path": path, "database": database}


SERVERS = {"duckdb": load_duckdb, "parquet": load_parquet, "s3": load_s3, "snowflake": load_snowflake,
           "bigquery": load_bigquery, "hive": load_hive, "clickhouse": load_clickhouse}


def materialize_project(project) -> str:
    """Every asset in order: the source partitions, the cache, the foundation model, the scenario,
    the predictions of the newest day (returned). The asset checks are left out: whether a model this
    tiny beats its baselines is no question for the data path (tests/pipelines/test_end_to_end.py)."""
    import dagster as dg
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from habitus.assets.cache import current_cache
    from habitus.assets.predictions import predictions_key
    from habitus.assets.sources import source_key
    from habitus.pipelines.orchestration.build import build_assets, build_resources

    assets, resources = build_assets(project), build_resources(project)
    instance = dg.DagsterInstance.ephemeral()

    def run(selection, **kw):
        assert dg.materialize(assets, selection=selection, resources=resources, instance=instance, **kw).success

    keys = next(a for a in assets if a.key == source_key("purchases")).partitions_def.get_partition_keys()
    run([source_key("purchases")], tags={ASSET_PARTITION_RANGE_START_TAG: keys[0],
                                         ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
    run([source_key("customers"), source_key("products"), dg.AssetKey("cache"), dg.AssetKey("foundation_model"),
         dg.AssetKey(["scenario", "churn"])])
    day = datetime.fromtimestamp(current_cache(resources["workspace"]).time_range[1], timezone.utc).date()
    run([predictions_key("churn")], partition_key=day.isoformat())
    return day.isoformat()


def run_project(request, demo, root: Path, server: str) -> dict:
    from habitus.assets.cache import current_cache
    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.build import build_resources

    root.mkdir(parents=True, exist_ok=True)
    connection = SERVERS[server](request, demo, root)
    (root / "project.yaml").write_text(yaml.safe_dump(project_config(connection), sort_keys=False))
    os.environ["HABITUS_E2E_SF_PASSWORD"] = "snow"  # a secret reaches the connector only through ${ENV}
    project = load_project(root / "project.yaml")
    day = materialize_project(project)
    resources = build_resources(project)
    cache = current_cache(resources["workspace"])
    sources = root / "ws" / "sources"
    return {"project": project, "day": day, "cache": cache.fingerprint,
            "files": {str(p.relative_to(sources)): p.read_bytes() for p in sorted(sources.rglob("*.parquet"))},
            "warehouse": resources["connection_wh"], "root": root}


@pytest.fixture(scope="module")
def reference(request, demo, tmp_path_factory):
    """The project run from the embedded default (DuckDB): what every other server must reproduce."""
    return run_project(request, demo, tmp_path_factory.mktemp("e2e") / "duckdb", "duckdb")


@pytest.mark.parametrize("server", list(SERVERS))
def test_project_end_to_end_with_identical_cache(request, demo, reference, tmp_path, server):
    run = reference if server == "duckdb" else run_project(request, demo, tmp_path / server, server)
    assert sorted(run["files"]) == ["customers/all.parquet", "products/all.parquet"] + [
        f"purchases/2026-{m:02d}-01.parquet" for m in range(1, 6)]
    for name, data in run["files"].items():
        assert data == reference["files"][name], f"{server}: sources/{name} differs from DuckDB's extraction"
    assert run["cache"] == reference["cache"]
    events = pq.read_table(run["root"] / "ws" / "sources" / "purchases" / "2026-04-01.parquet")
    assert events.num_rows == sum(1 for t in reference_ts(demo) if t.month == 4)
    # predictions of the day, in the workspace and written back into the same server
    predictions = pq.read_table(run["root"] / "ws" / "predictions" / "churn" / f"{run['day']}.parquet")
    assert predictions.num_rows > 100
    back = pa.Table.from_batches(list(run["warehouse"].read(f"{SINK}_churn")))
    assert back.num_rows == predictions.num_rows
    assert sorted(back.column("customer_id").to_pylist()) == sorted(predictions.column("customer_id").to_pylist())
    got = dict(zip(back.column("customer_id").to_pylist(), back.column("score").to_pylist()))
    want = dict(zip(predictions.column("customer_id").to_pylist(), predictions.column("score").to_pylist()))
    assert all(abs(got[k] - want[k]) < 1e-6 for k in want)
    # the new-data sensor asks this server: every month with data in one run, then nothing new
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    first, second = sensor_ticks(run["project"])
    assert not first.skip_message, first.skip_message
    [request] = first.run_requests
    assert (request.tags[ASSET_PARTITION_RANGE_START_TAG], request.tags[ASSET_PARTITION_RANGE_END_TAG]) == (
        "2026-01-01", "2026-05-01")
    assert not second.run_requests and "no new data" in second.skip_message


def sensor_ticks(project) -> tuple:
    """Two ticks of the new-data sensor on a fresh instance: (first, second)."""
    import dagster as dg

    from habitus.pipelines.definitions import build_definitions

    from habitus.pipelines.orchestration.build import build_resources

    defs = build_definitions(project)
    sensor = defs.resolve_sensor_def("purchases_new_data")
    instance = dg.DagsterInstance.ephemeral()
    first = sensor.evaluate_tick(dg.build_sensor_context(instance=instance, resources=build_resources(project),
                                                         definitions=defs))
    second = sensor.evaluate_tick(dg.build_sensor_context(cursor=first.cursor, instance=instance,
                                                          resources=build_resources(project), definitions=defs))
    return first, second


def reference_ts(demo):
    return demo["purchases"].column("ts").to_pylist()
