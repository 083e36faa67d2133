"""The Dagster code location: every asset, resource and job of the project config.

The config is chosen by $HABITUS_CONFIG (default examples/demo.yaml).
"""

import warnings

import dagster as dg

from assets.cache import build_cache_asset
from assets.foundation import build_foundation_asset
from assets.predictions import build_predictions_asset
from assets.scenarios import build_scenario_asset
from assets.sources import build_source_asset, connection_key
from pipelines.config import Project, load_project
from pipelines.partitions import events_partitions, predictions_partitions
from resources.duckdb import DuckDBWarehouse
from resources.executor import TrainingExecutor
from resources.parquet import ParquetWarehouse
from resources.workspace import Workspace

warnings.filterwarnings("ignore", category=dg.BetaWarning)  # backfill_policy is marked beta

WAREHOUSES = {"duckdb": DuckDBWarehouse, "parquet": ParquetWarehouse}


def connection_resource(name: str, conn) -> dg.ConfigurableResource:
    if conn.type not in WAREHOUSES:
        raise NotImplementedError(f"connections.{name}: the {conn.type!r} connector is not available yet; "
                                  f"available: {sorted(WAREHOUSES)}")
    return WAREHOUSES[conn.type](path=conn.path)


def build_assets(project: Project) -> list[dg.AssetsDefinition]:
    assets = [build_source_asset(project, s, events_partitions(s) if s.role == "events" else None)
              for s in project.sources]
    assets += [build_cache_asset(project), build_foundation_asset(project)]
    assets += [build_scenario_asset(project, name, sc) for name, sc in project.scenarios.items()]
    daily = predictions_partitions(project)
    assets += [build_predictions_asset(project, name, daily) for name in project.prediction_scenarios]
    return assets


def build_resources(project: Project) -> dict:
    resources = {"workspace": Workspace(root=project.workspace), "executor": TrainingExecutor()}
    resources.update({connection_key(n): connection_resource(n, c) for n, c in project.connections.items()})
    return resources


def build_definitions(project: Project) -> dg.Definitions:
    assets = build_assets(project)
    training = dg.define_asset_job(
        "train", selection=dg.AssetSelection.groups("training", "scenarios"),
        description="Cache, foundation model and every scenario (sources must be extracted)")
    return dg.Definitions(assets=assets, resources=build_resources(project), jobs=[training])


defs = build_definitions(load_project())
