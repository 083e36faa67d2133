"""source/<name>: each configured table extracted to Parquet in the workspace.

Event tables are time-partitioned; a run writes each of its partitions to
`sources/<name>/<partition key>.parquet`, replacing that file whole (idempotent re-runs).
Attribute tables are small and extracted whole to `sources/<name>/all.parquet`.
"""

import time

import dagster as dg
import pyarrow as pa

from habitus.resources.canonical import write_canonical_parquet
from habitus.resources.retries import extraction_retry_policy, retry_transient_only
from habitus.resources.workspace import Workspace, locked


def events_partitions(source) -> dg.TimeWindowPartitionsDefinition:
    """An events source's partitions, by month (or day with `partition: daily`); each key names the
    file its partition is written to, so the cache reads exactly the partitions of this setting."""
    start = source.start.isoformat()
    end = source.end.isoformat() if source.end else None
    if source.partition == "daily":
        return dg.DailyPartitionsDefinition(start_date=start, end_date=end)
    return dg.MonthlyPartitionsDefinition(start_date=start, end_date=end)


def source_key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["source", name])


def connection_key(name: str) -> str:
    return f"connection_{name}"


def wanted_columns(source, entity: str, schema: pa.Schema) -> list[str]:
    """The columns to extract, checked against the table's schema with a message that names them."""
    cols = list(source.columns) or [c for c in schema.names]
    required = [c for c in (entity if source.role != "attributes" else None, source.timestamp, source.key) if c]
    cols = list(dict.fromkeys(required + cols))
    missing = [c for c in cols if c not in schema.names]
    if missing:
        raise dg.Failure(
            f"source {source.name!r} (table {source.table!r}): column(s) {missing} not found; the table has "
            f"{schema.names}. Fix `columns`, `timestamp`, `key` or `entity` in the project config")
    check_time_column(source, schema)
    return cols


def check_time_column(source, schema: pa.Schema) -> None:
    """A `timestamp:` column stored as text fails here, naming it and the cast, before a warehouse compares
    it with the partition's bounds (DuckDB's 'Cannot compare values of type VARCHAR and type TIMESTAMP')."""
    if not source.timestamp or source.timestamp not in schema.names:
        return
    kind = schema.field(source.timestamp).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        raise dg.Failure(
            f"source {source.name!r} (table {source.table!r}): its `timestamp:` column {source.timestamp!r} is stored "
            f"as text ({kind}), not as a timestamp. Store it as a TIMESTAMP, or point the source's `table:` at a "
            f"view that selects CAST({source.timestamp} AS TIMESTAMP) AS {source.timestamp} with the other columns")


def _write_partition(batches, path, schema: pa.Schema, source, entity: str) -> int:
    """Canonical Parquet (resources/canonical.py): the same data gives the same bytes from any
    connector, so the cache built from it keeps its fingerprint."""
    first = [c for c in (entity if source.role != "attributes" else source.key, source.timestamp) if c]
    return write_canonical_parquet(batches, path, schema, first=first, table=source.table)


def build_source_asset(project, source, partitions_def) -> dg.AssetsDefinition:
    conn_key = connection_key(source.connection)
    is_events = source.role == "events"

    @dg.asset(
        key=source_key(source.name),
        partitions_def=partitions_def if is_events else None,
        # a backfill of a year is one run of monthly partitions, or 12 runs of a month of days each
        backfill_policy=(dg.BackfillPolicy.multi_run(max_partitions_per_run=31 if source.partition == "daily" else 12)
                         if is_events else None),
        required_resource_keys={conn_key, "workspace"},
        group_name="sources",
        kinds={project.connections[source.connection].type, "parquet"},
        description=f"{source.role} table {source.table!r} from connection {source.connection!r}",
        # transient warehouse errors only (resources/retries.py), as the config's `retries:` says
        retry_policy=extraction_retry_policy(**project.extraction_retries(source).model_dump()),
    )
    @retry_transient_only
    @locked(f"source/{source.name}")
    def _source(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        started = time.time()
        workspace: Workspace = context.resources.workspace
        warehouse = getattr(context.resources, conn_key)
        schema = warehouse.schema(source.table)
        columns = wanted_columns(source, project.entity, schema)
        out_schema = pa.schema([schema.field(c) for c in columns])
        folder = workspace.sources(source.name)
        rows, files = 0, []
        if is_events:
            for key in context.partition_keys:
                window = partitions_def.time_window_for_partition_key(key)
                batches = warehouse.read(source.table, columns, source.timestamp,
                                         window.start.replace(tzinfo=None), window.end.replace(tzinfo=None))
                n = _write_partition(batches, folder / f"{key}.parquet", out_schema, source, project.entity)
                context.log.info(f"{source.name} partition {key}: {n:,} rows")
                rows += n
                files.append(folder / f"{key}.parquet")
        else:
            rows = _write_partition(warehouse.read(source.table, columns), folder / "all.parquet", out_schema,
                                    source, project.entity)
            files.append(folder / "all.parquet")
        seconds = time.time() - started
        return dg.MaterializeResult(metadata={
            "rows": dg.MetadataValue.int(rows),
            "bytes": dg.MetadataValue.int(sum(f.stat().st_size for f in files)),
            "columns": dg.MetadataValue.json(columns),
            "path": dg.MetadataValue.path(str(folder)),
            "seconds": dg.MetadataValue.float(round(seconds, 3)),
            "rows_per_second": dg.MetadataValue.float(round(rows / max(seconds, 1e-9), 1)),
        })

    return _source
