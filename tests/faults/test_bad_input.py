"""Bad input through the real assets (DuckDB / Parquet warehouses, Dagster): each case ends in an error
that names the table, column or key and what to do, or in a counted, checked quarantine; never in a
model trained silently on the wrong thing."""

import shutil

import dagster as dg
import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.assets.checks import build_checks
from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.build import build_assets, build_resources

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")
SOURCE, CACHE = dg.AssetKey(["source", "purchases"]), dg.AssetKey("cache")
RANGE = {ASSET_PARTITION_RANGE_START_TAG: "2026-03-01", ASSET_PARTITION_RANGE_END_TAG: "2026-05-01"}


@pytest.fixture(scope="module")
def demo_warehouse(tmp_path_factory):
    from habitus.pipelines.demo.data import generate_demo_warehouse

    path = tmp_path_factory.mktemp("bad-input") / "warehouse.duckdb"
    generate_demo_warehouse(path, customers=150, products=40, stores=3, end="2026-05-31", seed=4)
    return path


@pytest.fixture
def warehouse(demo_warehouse, tmp_path):
    path = tmp_path / "warehouse.duckdb"
    shutil.copy(demo_warehouse, path)
    return path


def _project(root, connection: dict, **purchases):
    source = {"name": "purchases", "role": "events", "connection": "w", "table": "purchases", "timestamp": "ts",
              "columns": ["product_id", "price"], "start": "2026-03-01", "end": "2026-06-01", **purchases}
    cfg = {"workspace": str(root / "ws"), "connections": {"w": connection}, "entity": "customer_id",
           "sources": [source,
                       {"name": "customers", "role": "entity_attributes", "connection": "w", "table": "customers",
                        "columns": ["segment"]},
                       {"name": "products", "role": "attributes", "connection": "w", "table": "products",
                        "key": "product_id", "columns": ["brand"]}]}
    (root / "project.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return load_project(root / "project.yaml")


def _run(project, selection, **kw) -> dg.ExecuteInProcessResult:
    return dg.materialize([*build_assets(project), *build_checks(project)], selection=selection,
                          resources=build_resources(project), raise_on_error=False, **kw)


def _extract(project):
    attrs = [dg.AssetKey(["source", "customers"]), dg.AssetKey(["source", "products"])]
    return _run(project, [SOURCE], tags=RANGE), _run(project, attrs)


def _error(result) -> str:
    """The failed steps' error messages, causes included (Dagster wraps the asset's exception)."""
    parts = []
    for e in result.all_events:
        error = e.event_specific_data.error if e.is_step_failure else None
        while error is not None:
            parts.append(error.message)
            error = error.cause
    return "\n".join(parts)


def test_text_that_is_not_utf8_stops_extraction_naming_table_column_and_value(tmp_path):
    folder = tmp_path / "parquet"
    folder.mkdir()
    n = 30
    raw = [f"c{i % 5}".encode() if i != 7 else b"caf\xe9" for i in range(n)]  # Latin-1, read as text
    pq.write_table(pa.table({"customer_id": pa.array(raw, pa.binary()).view(pa.string()),
                             "ts": pa.array([1772323200 + i * 3600 for i in range(n)], pa.timestamp("s")),
                             "product_id": pa.array(["p1"] * n), "price": pa.array([1.0] * n)}),
                   folder / "purchases.parquet")
    project = _project(tmp_path, {"type": "parquet", "path": str(folder)})
    result = _run(project, [SOURCE], partition_key="2026-03-01")
    assert not result.success
    message = _error(result)
    assert "table 'purchases', column 'customer_id': value b'caf\\xe9'" in message
    assert "not valid UTF-8" in message and "convert the column to UTF-8" in message
    assert not list((tmp_path / "ws" / "sources" / "purchases").glob("*.parquet"))  # nothing half-written


def test_an_empty_partition_is_an_empty_file_and_loses_no_row(warehouse, tmp_path, duckdb_sql):
    duckdb_sql(warehouse, "DELETE FROM purchases WHERE ts >= TIMESTAMP '2026-04-01' AND ts < TIMESTAMP '2026-05-01'")
    project = _project(tmp_path, {"type": "duckdb", "path": str(warehouse)})
    assert all(r.success for r in _extract(project))
    april = tmp_path / "ws" / "sources" / "purchases" / "2026-04-01.parquet"
    assert pq.read_metadata(april).num_rows == 0
    assert _run(project, [CACHE]).success
    con = duckdb.connect(str(warehouse), read_only=True)
    want = con.sql("SELECT count(*) FROM purchases WHERE ts < TIMESTAMP '2026-06-01'").fetchall()[0][0]
    con.close()
    from habitus.assets.cache import current_cache

    assert current_cache(build_resources(project)["workspace"]).manifest["n_events"] == want


def test_an_empty_events_table_stops_the_cache_with_a_clear_message(warehouse, tmp_path, duckdb_sql):
    duckdb_sql(warehouse, "DELETE FROM purchases")
    project = _project(tmp_path, {"type": "duckdb", "path": str(warehouse)})
    assert all(r.success for r in _extract(project))
    result = _run(project, [CACHE])
    assert not result.success and "hold no rows" in _error(result)


def _blocking_join_coverage(warehouse, tmp_path) -> dg.AssetCheckEvaluation:
    """Extract, then run the cache and the foundation model: the join_coverage check, which must fail
    with ERROR and keep the foundation model from training."""
    project = _project(tmp_path, {"type": "duckdb", "path": str(warehouse)})
    _extract(project)
    result = _run(project, [CACHE, dg.AssetKey("foundation_model")])
    check = next(e for e in result.get_asset_check_evaluations() if e.check_name == "join_coverage")
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert result.asset_materializations_for_node("foundation_model") == []
    return check


def test_an_empty_attribute_table_is_a_blocking_error(warehouse, tmp_path, duckdb_sql):
    duckdb_sql(warehouse, "DELETE FROM products")
    assert "products has no rows with a product_id" in _blocking_join_coverage(warehouse, tmp_path).description


def test_entity_ids_of_another_type_and_format_are_a_blocking_error(warehouse, tmp_path, duckdb_sql):
    """Events carry customer ids as text 'c…'; the customers table as integers: no row would match."""
    duckdb_sql(warehouse, "CREATE TABLE c2 AS SELECT row_number() OVER () AS customer_id, segment FROM customers",
               "DROP TABLE customers", "ALTER TABLE c2 RENAME TO customers")
    check = _blocking_join_coverage(warehouse, tmp_path)
    assert "customers: 0.0% of event keys found; events customer_id is string like [" in check.description
    assert "customers.customer_id is int64 like ['1', '10', '100']" in check.description
