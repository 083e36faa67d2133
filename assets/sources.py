"""source/<name>: each configured table extracted to Parquet in the workspace.

Event tables are time-partitioned; a run writes each of its partitions to
`sources/<name>/<partition key>.parquet`, replacing that file whole (idempotent re-runs).
Attribute tables are small and extracted whole to `sources/<name>/all.parquet`.

What a partition was extracted with (the table, the columns and the `where:` row filter) is its
extraction fingerprint, kept per file in `sources/<name>/extractions.json` and the asset's code version:
a partition extracted with other settings is stale, and `habitus train`, the new-data sensor and the
cache extract it again or refuse it.
"""

import time

import dagster as dg
import pyarrow as pa

from habitus.models.storage.files import combine, read_json, write_json
from habitus.resources.warehouses.canonical import write_canonical_parquet
from habitus.resources.warehouses.retries import extraction_retry_policy, retry_transient_only
from habitus.resources.store.workspace import Workspace, locked


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


EXTRACTIONS = "extractions.json"


def extraction_fingerprint(source, where: str | None = ...) -> str:
    """What a partition of `source` is extracted with: its table, columns and row filter (normalized
    SQL, so reformatting the filter changes nothing). `where` overrides the source's."""
    from habitus.resources.warehouses import row_filter

    where = source.where if where is ... else where
    return combine("extraction", source.table, list(source.columns), row_filter.sql(where, "duckdb") if where else None)


def stale_partitions(source, folder) -> list[str]:
    """The partition files (stems) in `folder` extracted with other settings than the source's now. A file
    without a record predates the records: it was extracted unfiltered, with the same table and columns."""
    from pathlib import Path

    folder = Path(folder)
    done = read_json(folder / EXTRACTIONS) if (folder / EXTRACTIONS).exists() else {}
    now, unfiltered = extraction_fingerprint(source), extraction_fingerprint(source, None)
    return sorted(p.stem for p in folder.glob("*.parquet") if done.get(p.stem, unfiltered) != now)


def _record(folder, stems: list[str], fingerprint: str) -> None:
    """Note that the partitions `stems` in `folder` were extracted with `fingerprint` (under the source's lock)."""
    path = folder / EXTRACTIONS
    done = read_json(path) if path.exists() else {}
    done.update(dict.fromkeys(stems, fingerprint))
    write_json(path, dict(sorted(done.items())))


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
    check_row_filter(source, schema)
    return cols


def check_row_filter(source, schema: pa.Schema) -> None:
    """A `where:` naming a column the table does not have fails before any query, naming it."""
    if not source.where:
        return
    from habitus.resources.warehouses import row_filter

    missing = [c for c in row_filter.columns(source.where) if c not in schema.names]
    if missing:
        raise dg.Failure(
            f"source {source.name!r} (table {source.table!r}): its `where:` filter names column(s) {missing} the "
            f"table does not have; it has {schema.names}. Fix the source's `where:` in the project config")


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
    """Canonical Parquet (resources/warehouses/canonical.py): the same data gives the same bytes from any
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
        code_version=extraction_fingerprint(source)[:16],
        description=f"{source.role} table {source.table!r} from connection {source.connection!r}",
        # transient warehouse errors only (resources/warehouses/retries.py), as the config's `retries:` says
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
                batches = warehouse.read(source.table, columns, source.timestamp, window.start.replace(tzinfo=None),
                                         window.end.replace(tzinfo=None), where=source.where)
                n = _write_partition(batches, folder / f"{key}.parquet", out_schema, source, project.entity)
                _record(folder, [key], extraction_fingerprint(source))
                context.log.info(f"{source.name} partition {key}: {n:,} rows")
                rows += n
                files.append(folder / f"{key}.parquet")
        else:
            rows = _write_partition(warehouse.read(source.table, columns, where=source.where), folder / "all.parquet",
                                    out_schema, source, project.entity)
            _record(folder, ["all"], extraction_fingerprint(source))
            files.append(folder / "all.parquet")
        seconds = time.time() - started
        return dg.MaterializeResult(metadata={
            "rows": dg.MetadataValue.int(rows),
            "bytes": dg.MetadataValue.int(sum(f.stat().st_size for f in files)),
            "columns": dg.MetadataValue.json(columns),
            **({"where": source.where} if source.where else {}),
            "path": dg.MetadataValue.path(str(folder)),
            "seconds": dg.MetadataValue.float(round(seconds, 3)),
            "rows_per_second": dg.MetadataValue.float(round(rows / max(seconds, 1e-9), 1)),
        })

    return _source

