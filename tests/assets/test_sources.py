"""Tests for the source/<name> assets: materialized with Dagster against a small generated DuckDB."""

from datetime import datetime

import dagster as dg
import duckdb
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from habitus.assets.sources import build_source_asset, source_key
from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.build import build_resources
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.pipelines.orchestration.partitions import events_partitions

MARCH, APRIL = datetime(2026, 3, 1), datetime(2026, 4, 1)

# backfill_policy on the asset is marked beta by Dagster; not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    path = tmp_path_factory.mktemp("warehouse") / "demo.duckdb"
    generate_demo_warehouse(path, customers=200, products=100)
    return path


def _project(tmp_path, warehouse, **purchases):
    source = {"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
              "timestamp": "ts", "columns": ["product_id", "price"], "partition": "monthly", "start": "2026-03-01"}
    source.update(purchases)
    cfg = {
        "workspace": "ws",  # relative: resolves into tmp_path
        "connections": {"warehouse": {"type": "duckdb", "path": str(warehouse)}},
        "entity": "customer_id",
        "sources": [source,
                    {"name": "products", "role": "attributes", "connection": "warehouse", "table": "products",
                     "key": "product_id", "columns": ["brand", "category"]},
                    {"name": "customers", "role": "entity_attributes", "connection": "warehouse",
                     "table": "customers", "columns": ["age", "segment"]}],
    }
    path = tmp_path / "project.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return load_project(path)


def _materialize(project, name="purchases", partition_key="2026-03-01", raise_on_error=True):
    source = project.source(name)
    partitions = events_partitions(source) if source.role == "events" else None
    asset = build_source_asset(project, source, partitions)
    result = dg.materialize([asset], resources=build_resources(project),
                            partition_key=partition_key if partitions else None, raise_on_error=raise_on_error)
    return asset, result


def _failure_text(result) -> str:
    parts = []
    for event in result.get_step_failure_events():
        error = event.step_failure_data.error
        while error is not None:
            parts.append(error.message)
            error = error.cause
    return "\n".join(parts)


def _warehouse_count(warehouse, start, end) -> int:
    con = duckdb.connect(str(warehouse), read_only=True)
    try:
        return con.execute("SELECT count(*) FROM purchases WHERE ts >= ? AND ts < ?", [start, end]).fetchall()[0][0]
    finally:
        con.close()


def test_partition_file_has_only_the_month_and_the_columns(tmp_path, warehouse):
    project = _project(tmp_path, warehouse)
    asset, result = _materialize(project)
    assert result.success
    path = tmp_path / "ws" / "sources" / "purchases" / "2026-03-01.parquet"
    assert path.is_file()
    table = pq.read_table(path)
    assert table.column_names == ["customer_id", "ts", "product_id", "price"]
    assert table.num_rows == _warehouse_count(warehouse, MARCH, APRIL) > 0
    assert pc.min(table.column("ts")).as_py() >= MARCH
    assert pc.max(table.column("ts")).as_py() < APRIL
    # only this partition was written, and no temporary file is left behind
    assert sorted(p.name for p in path.parent.iterdir()) == ["2026-03-01.parquet", "extractions.json"]

    [materialization] = result.asset_materializations_for_node(asset.op.name)
    assert materialization.asset_key == source_key("purchases")
    assert materialization.partition == "2026-03-01"
    meta = materialization.metadata
    assert meta["rows"].value == table.num_rows
    assert meta["columns"].data == ["customer_id", "ts", "product_id", "price"]
    assert meta["bytes"].value == path.stat().st_size
    assert meta["path"].value == str(path.parent)


def test_rematerializing_replaces_the_partition(tmp_path, warehouse):
    project = _project(tmp_path, warehouse)
    path = tmp_path / "ws" / "sources" / "purchases" / "2026-03-01.parquet"
    _, first = _materialize(project)
    rows = pq.read_metadata(path).num_rows
    before = pq.read_table(path)
    path.write_bytes(b"garbage from an interrupted run")
    asset, second = _materialize(project)
    assert second.success
    after = pq.read_table(path)
    assert after.num_rows == rows == _warehouse_count(warehouse, MARCH, APRIL)
    assert after.equals(before)  # same rows, no duplicates
    keys = after.select(["customer_id", "ts", "product_id"]).group_by(["customer_id", "ts", "product_id"]).aggregate([])
    assert keys.num_rows == after.num_rows
    assert second.asset_materializations_for_node(asset.op.name)[0].metadata["rows"].value == rows


def test_other_partitions_are_left_alone(tmp_path, warehouse):
    project = _project(tmp_path, warehouse)
    folder = tmp_path / "ws" / "sources" / "purchases"
    _materialize(project, partition_key="2026-03-01")
    march = pq.read_table(folder / "2026-03-01.parquet")
    _, result = _materialize(project, partition_key="2026-04-01")
    assert result.success
    april = pq.read_table(folder / "2026-04-01.parquet")
    assert april.num_rows == _warehouse_count(warehouse, APRIL, datetime(2026, 5, 1))
    assert pc.min(april.column("ts")).as_py() >= APRIL
    assert pq.read_table(folder / "2026-03-01.parquet").equals(march)


def test_attribute_sources_are_extracted_whole(tmp_path, warehouse):
    project = _project(tmp_path, warehouse)
    _, result = _materialize(project, "products")
    assert result.success
    products = pq.read_table(tmp_path / "ws" / "sources" / "products" / "all.parquet")
    assert products.column_names == ["product_id", "brand", "category"]  # key first, no entity
    assert products.num_rows == 100
    _, result = _materialize(project, "customers")
    customers = pq.read_table(tmp_path / "ws" / "sources" / "customers" / "all.parquet")
    assert customers.column_names == ["customer_id", "age", "segment"]
    assert customers.num_rows == 200


def test_unknown_column_fails_naming_column_and_table(tmp_path, warehouse):
    project = _project(tmp_path, warehouse, columns=["product_id", "colour"])
    _, result = _materialize(project, raise_on_error=False)
    assert not result.success
    message = _failure_text(result)
    assert "'colour'" in message and "'purchases'" in message
    assert not (tmp_path / "ws" / "sources" / "purchases" / "2026-03-01.parquet").exists()


def test_missing_table_fails_naming_it(tmp_path, warehouse):
    project = _project(tmp_path, warehouse, table="purchases_2019")
    _, result = _materialize(project, raise_on_error=False)
    assert not result.success
    assert "purchases_2019" in _failure_text(result)
    assert not (tmp_path / "ws" / "sources" / "purchases" / "2026-03-01.parquet").exists()


# --------------------------------------------------------------------------- `where:` row filters


def _filtered_count(warehouse, start, end, condition: str) -> int:
    con = duckdb.connect(str(warehouse), read_only=True)
    try:
        return con.execute(f"SELECT count(*) FROM purchases WHERE ts >= ? AND ts < ? AND ({condition})",
                           [start, end]).fetchall()[0][0]
    finally:
        con.close()


def test_where_is_pushed_down_and_only_matching_rows_are_extracted(tmp_path, warehouse):
    where = "price >= 2 AND store_id IN ('S001', 'S002', 'S026', 'S027') AND NOT quantity > 3"
    project = _project(tmp_path, warehouse, where=where)
    asset, result = _materialize(project)
    assert result.success
    table = pq.read_table(tmp_path / "ws" / "sources" / "purchases" / "2026-03-01.parquet")
    want = _filtered_count(warehouse, MARCH, APRIL, where)
    assert 0 < table.num_rows == want < _warehouse_count(warehouse, MARCH, APRIL)
    assert pc.min(table.column("price")).as_py() >= 2
    assert table.column_names == ["customer_id", "ts", "product_id", "price"]  # filter columns are not extracted
    [materialization] = result.asset_materializations_for_node(asset.op.name)
    assert materialization.metadata["where"].value == where


def test_a_changed_where_makes_the_partitions_stale_and_the_cache_refuses_them(tmp_path, warehouse):
    from habitus.assets.cache import table_input
    from habitus.assets.sources import extraction_fingerprint, stale_partitions
    from habitus.resources.store.workspace import Workspace

    project = _project(tmp_path, warehouse)
    assert _materialize(project)[1].success
    folder = tmp_path / "ws" / "sources" / "purchases"
    assert stale_partitions(project.source("purchases"), folder) == []
    filtered = _project(tmp_path, warehouse, where="price > 3")
    source = filtered.source("purchases")
    assert extraction_fingerprint(source) != extraction_fingerprint(project.source("purchases"))
    # spacing and case of keywords are the same extraction
    assert extraction_fingerprint(source) == extraction_fingerprint(
        _project(tmp_path, warehouse, where="price>3 -- cheap ones out").source("purchases"))
    assert stale_partitions(source, folder) == ["2026-03-01"]
    ws = Workspace(root=str(tmp_path / "ws"))
    with pytest.raises(dg.Failure, match=r"source/purchases: partition\(s\) \['2026-03-01'\].*`where:`"):
        table_input(filtered, source, ws)
    assert _materialize(filtered)[1].success  # extracted again with the filter: current
    assert stale_partitions(source, folder) == []
    assert table_input(filtered, source, ws).files == [str(folder / "2026-03-01.parquet")]
    assert stale_partitions(project.source("purchases"), folder) == ["2026-03-01"]  # and back


def test_a_file_extracted_before_the_records_counts_as_unfiltered(tmp_path, warehouse):
    from habitus.assets.sources import stale_partitions

    project = _project(tmp_path, warehouse)
    assert _materialize(project)[1].success
    folder = tmp_path / "ws" / "sources" / "purchases"
    (folder / "extractions.json").unlink()
    assert stale_partitions(project.source("purchases"), folder) == []
    assert stale_partitions(_project(tmp_path, warehouse, where="price > 3").source("purchases"), folder) == ["2026-03-01"]


def test_where_naming_a_missing_column_fails_naming_it_and_the_source(tmp_path, warehouse):
    project = _project(tmp_path, warehouse, where="price > 2 AND countryy = 'PL'")
    _, result = _materialize(project, raise_on_error=False)
    assert not result.success
    message = _failure_text(result)
    assert "source 'purchases'" in message and "['countryy']" in message and "`where:`" in message
    assert not (tmp_path / "ws" / "sources" / "purchases" / "2026-03-01.parquet").exists()


def test_habitus_train_extracts_again_what_another_where_extracted(tmp_path, warehouse, monkeypatch):
    from habitus.assets.sources import stale_partitions
    from habitus.pipelines.run.runner import Runner

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    folder = tmp_path / "ws" / "sources" / "purchases"
    first = Runner(_project(tmp_path, warehouse, end="2026-05-01"), log=lambda _: None)
    first.extract()
    months = ["2026-03-01", "2026-04-01"]
    unfiltered = {m: pq.read_metadata(folder / f"{m}.parquet").num_rows for m in months}
    where = "price > 3 AND product_id <> 'P000001'"
    project = _project(tmp_path, warehouse, end="2026-05-01", where=where)
    assert stale_partitions(project.source("purchases"), folder) == months
    Runner(project, log=lambda _: None).extract()  # every month again, not only the last
    assert stale_partitions(project.source("purchases"), folder) == []
    for m, start in zip(months, (MARCH, APRIL)):
        table = pq.read_table(folder / f"{m}.parquet")
        end = datetime(start.year, start.month + 1, 1)
        assert table.num_rows == _filtered_count(warehouse, start, end, where) < unfiltered[m]
