"""The project's assets and resources, built from its config: a source asset per source (partitioned
by time for events), the cache, the foundation model, a scenario asset each, the daily predictions,
explanations, embeddings and realized outcomes; the workspace, the training executor and a warehouse
resource per connection. The code location (pipelines/definitions.py) puts them together with the
jobs, sensors and schedules; the runner (pipelines/run/runner.py) materializes them.
"""

import importlib
import typing
import warnings

import dagster as dg

from habitus.assets.cache import build_cache_asset
from habitus.assets.embeddings import build_embeddings_asset
from habitus.assets.explanations import build_explanations_asset
from habitus.assets.foundation import build_foundation_asset
from habitus.assets.predictions import build_predictions_asset
from habitus.assets.realized import build_realized_asset, realized_scenarios
from habitus.assets.scenarios import build_scenario_asset
from habitus.assets.sources import build_source_asset, connection_key
from habitus.pipelines.config.file import env_template, env_var
from habitus.pipelines.config.operations import executor_settings
from habitus.pipelines.config.project import ProjectConfig
from habitus.pipelines.orchestration.kubernetes import pod_tags
from habitus.pipelines.orchestration.kubernetes_nodes import group_of
from habitus.pipelines.orchestration.partitions import events_partitions, predictions_partitions
from habitus.resources.store.workspace import Workspace
from habitus.resources.training.executor import TrainingExecutor
from habitus.resources.warehouses.duckdb import DuckDBWarehouse
from habitus.resources.warehouses.parquet import ParquetWarehouse
from habitus.resources.warehouses.remote import SECRET_KEYS

warnings.filterwarnings("ignore", category=dg.BetaWarning)  # backfill_policy is marked beta

WAREHOUSES = {"duckdb": DuckDBWarehouse, "parquet": ParquetWarehouse}
# The networked connectors, imported when a connection uses them (their drivers load lazily too).
REMOTE_WAREHOUSES = {
    "snowflake": ("habitus.resources.warehouses.snowflake", "SnowflakeWarehouse"),
    "clickhouse": ("habitus.resources.warehouses.clickhouse", "ClickHouseWarehouse"),
    "databricks": ("habitus.resources.warehouses.databricks", "DatabricksWarehouse"),
    "synapse": ("habitus.resources.warehouses.synapse", "SynapseWarehouse"),
    "hive": ("habitus.resources.warehouses.hive", "HiveWarehouse"),
    "bigquery": ("habitus.resources.warehouses.bigquery", "BigQueryWarehouse"),
}


def _warehouse_class(kind: str):
    if kind in WAREHOUSES:
        return WAREHOUSES[kind]
    module, cls = REMOTE_WAREHOUSES[kind]
    return getattr(importlib.import_module(module), cls)


def _as_env_var(key: str, value, annotation=str):
    """A connection value that holds `${VAR}` (alone, mixed with text or nested in a dict or list) is kept as
    the text written in the file, which the connector expands where its driver takes it
    (resources/warehouses/masking.py `value`): the Dagster UI and the run records show `pw-${VAR}`, never the secret,
    whatever its key is called. An integer field of exactly `${VAR}` becomes EnvVar.int(VAR); a flag is its
    value. A value whose key names a secret (resources/warehouses/remote.py SECRET_KEYS) written literally in the
    file is kept, with a warning."""
    template = env_template(value)
    if template is not None:
        if annotation is int:
            return dg.EnvVar.int(env_var(value)) if env_var(value) else value
        return value if annotation is bool else template
    if isinstance(value, dict):
        return {k: _as_env_var(k, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_env_var(key, v) for v in value]
    if key in SECRET_KEYS and isinstance(value, str) and value:
        warnings.warn(f"a connection's {key!r} is written in the project config; write ${{VAR}} and export VAR")
    return value


def _plain_type(annotation):
    """int for `int` and `int | None`, bool likewise, else str (what EnvVar can stand for)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return args[0] if len(args) == 1 and args[0] in (int, bool) else str


def connection_resource(name: str, conn) -> dg.ConfigurableResource:
    """A connection of the project config as its warehouse resource. Keys the resource declares
    become fields (`schema` is `schema_name`); every other key goes to the driver as `options`."""
    if conn.type not in WAREHOUSES and conn.type not in REMOTE_WAREHOUSES:
        raise NotImplementedError(f"connections.{name}: the {conn.type!r} connector is not available; "
                                  f"available: {sorted(WAREHOUSES) + sorted(REMOTE_WAREHOUSES)}")
    if conn.type in WAREHOUSES:  # parquet on S3: endpoint/region when the config has them, else AWS_* variables
        extra = {k: getattr(conn, k) for k in ("endpoint", "region") if getattr(conn, k, None)}
        return WAREHOUSES[conn.type](path=conn.path, **extra)
    cls = _warehouse_class(conn.type)
    params = {k: v for k, v in conn.model_dump().items() if k != "type"}
    fields, options = {"name": name}, dict(params.pop("options", None) or {})
    options = {k: _as_env_var(k, v) for k, v in options.items()}
    for key, value in params.items():
        field = "schema_name" if key == "schema" and "schema_name" in cls.model_fields else key
        if field in cls.model_fields and field not in ("name", "options"):
            fields[field] = _as_env_var(key, value, _plain_type(cls.model_fields[field].annotation))
        else:
            options[key] = _as_env_var(key, value)
    if options:
        fields["options"] = options
    return cls(**fields)


def build_assets(project: ProjectConfig) -> list[dg.AssetsDefinition]:
    assets = [build_source_asset(project, s, events_partitions(s) if s.role == "events" else None)
              for s in project.sources]
    assets += [build_cache_asset(project), build_foundation_asset(
        project, pod_tags(project, "foundation"), node_group=lambda what: group_of(project, "foundation", what))]
    assets += [build_scenario_asset(project, name, sc, pod_tags(project, "scenarios"),
                                    node_group=lambda what: group_of(project, "scenarios", what))
               for name, sc in project.scenarios.items()]
    daily = predictions_partitions(project)
    assets += [build_predictions_asset(project, name, daily) for name in project.prediction_scenarios]
    assets += [build_explanations_asset(project, name, sc, daily) for name, sc in project.scenarios.items() if sc.explain]
    assets.append(build_embeddings_asset(project, daily))
    assets += [build_realized_asset(project, name, daily) for name in realized_scenarios(project)]
    return assets


def build_resources(project: ProjectConfig) -> dict:
    executor = TrainingExecutor(**executor_settings(project))  # `executor:` (the CLI may override it)
    resources = {"workspace": Workspace(root=project.workspace, output=project.output,
                                        output_pins=project.output_pins), "executor": executor}
    resources.update({connection_key(n): connection_resource(n, c) for n, c in project.connections.items()})
    return resources
