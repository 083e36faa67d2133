"""cache: the extracted sources encoded for the model (see habitus.models.cache). Reused while its inputs are
unchanged; new source partitions are appended to the cache in use (ids never change), so models
trained on it keep scoring new data until their scheduled retraining."""

import time
from datetime import datetime, timezone
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from habitus.assets.sources import events_partitions, source_key, stale_partitions
from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache, infer_column_type
from habitus.models.storage.files import folder_bytes, read_json, write_json
from habitus.resources.store.workspace import Workspace, locked

CACHE_KEY = dg.AssetKey("cache")
# the volume below which models are unreliable (the product's data guidelines; `habitus init` warns by the
# same rule, habitus.pipelines.init.suggest)
MIN_ENTITIES, MIN_EVENTS_PER_MONTH, MIN_HISTORY_DAYS, MIN_HISTORY_DAYS_INFREQUENT = 10_000, 100_000, 90, 365
INFREQUENT_GAP_DAYS = 14  # a typical gap between two active days longer than two weeks: an infrequent domain


def source_files(source, workspace: Workspace) -> tuple[list[str], list[str]]:
    """(files to read, files left out): an events source's partitions of the current partitioning
    only, so files left by another `partition:` or `start:` setting are never read twice."""
    files = sorted(str(p) for p in workspace.sources(source.name).glob("*.parquet"))
    if source.role != "events":
        return [f for f in files if Path(f).stem == "all"], [f for f in files if Path(f).stem != "all"]
    keys = set(events_partitions(source).get_partition_keys())
    return [f for f in files if Path(f).stem in keys], [f for f in files if Path(f).stem not in keys]


def table_input(project, source, workspace: Workspace) -> TableInput:
    files, _ = source_files(source, workspace)
    if not files:
        raise dg.Failure(f"source/{source.name} has no extracted partitions in {workspace.sources(source.name)}; "
                         f"materialize it first")
    stale = sorted(set(stale_partitions(source, workspace.sources(source.name))) & {Path(f).stem for f in files})
    if stale:
        raise dg.Failure(f"source/{source.name}: partition(s) {stale[:6]}{' ...' if len(stale) > 6 else ''} were "
                         f"extracted with another table, `columns:` or `where:` than the config's now; extract them "
                         f"again (`habitus train` does, or a backfill of source/{source.name})")
    schema = pq.read_schema(files[0])
    skip = {project.entity, source.timestamp, source.key}
    cols = [c for c in (source.columns or schema.names) if c not in skip]
    types = {c: source.types.get(c) or infer_column_type(schema.field(c).type, c) for c in cols}
    if source.role == "events":  # a time column inside events is a number of seconds, not a category
        types = {c: ("numeric" if t == "timestamp" else t) for c, t in types.items()}
    return TableInput(source.name, files, types, timestamp=source.timestamp, key=source.key)


def cache_spec(project, workspace: Workspace) -> CacheSpec:
    by_role = {role: [table_input(project, s, workspace) for s in project.sources if s.role == role]
               for role in ("events", "entity_attributes", "attributes")}
    return CacheSpec(project.entity, by_role["events"], by_role["entity_attributes"], by_role["attributes"])


def cache_folder(workspace: Workspace) -> Path | None:
    """The cache folder that cache/current.json names (None without that file), checked before it becomes a
    path: a cache fingerprint (16 hex digits, never `..`, a slash or an absolute path) naming a folder that is
    not a link (models/storage/versions.py checked_fingerprint); dg.Failure naming the file otherwise."""
    from habitus.models.storage.versions import VersionError, checked_fingerprint

    pointer = workspace.cache_root / "current.json"
    if not pointer.exists():
        return None
    fix = f"delete {pointer} and build the cache again (`habitus train`, or materialize the `cache` asset)"
    try:
        record = read_json(pointer)
    except ValueError as e:  # not JSON (a torn or corrupted file)
        raise dg.Failure(f"{pointer}: not a cache pointer ({e}); {fix}") from None
    try:
        name = record.get("folder") if isinstance(record, dict) else None
        folder = workspace.cache_root / checked_fingerprint(name, f"{pointer}: folder", "cache", fix)
    except VersionError as e:
        raise dg.Failure(str(e)) from None
    if folder.is_symlink():
        raise dg.Failure(f"{pointer}: folder {folder.name!r} is a link ({folder} -> {folder.readlink()}), not a cache "
                         f"habitus built; check who can write to the workspace, then {fix}")
    return folder


def current_cache(workspace: Workspace) -> Cache:
    folder = cache_folder(workspace)
    if folder is None:
        raise dg.Failure(f"no cache in {workspace.cache_root}; materialize `cache` first")
    return Cache(folder)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def typical_gap_days(spec: CacheSpec) -> float | None:
    """The median over entities with two or more active days (distinct UTC days with an event, over every
    events source) of their mean gap between active days, as `habitus init` measures it; None without
    such an entity."""
    import duckdb

    tables = [t for t in spec.events if t.files]
    if not tables:
        return None
    parts = " UNION ALL ".join(
        f"SELECT CAST({_quoted(spec.entity)} AS VARCHAR) AS e, "
        f"CAST(floor(epoch({_quoted(t.timestamp)}) / 86400) AS BIGINT) AS d FROM read_parquet(?)" for t in tables)
    sql = (f"SELECT median((hi - lo) / (n - 1)) FROM (SELECT e, count(DISTINCT d) AS n, min(d) AS lo, max(d) AS hi "
           f"FROM ({parts}) WHERE e IS NOT NULL AND d IS NOT NULL GROUP BY e) WHERE n >= 2")
    with duckdb.connect() as con:
        (gap,) = con.execute(sql, [list(t.files) for t in tables]).fetchone()
    return None if gap is None else float(gap)


def min_history_days(gap_days: float | None) -> int:
    """The history the guidelines ask for: 3 months, or a year for an infrequent domain (a typical gap
    between an entity's active days over two weeks)."""
    return MIN_HISTORY_DAYS_INFREQUENT if gap_days is not None and gap_days > INFREQUENT_GAP_DAYS else MIN_HISTORY_DAYS


def guideline_warnings(manifest: dict, gap_days: float | None = None) -> list[str]:
    """The data guidelines broken by a cache (or a source's) manifest; `gap_days` (typical_gap_days) decides
    whether 3 months or a year of history is asked for."""
    days = (manifest["time_range"][1] - manifest["time_range"][0]) / 86_400
    per_month = manifest["n_events"] / max(days / 30.44, 1e-9)
    notes = []
    if manifest["n_entities"] < MIN_ENTITIES:
        notes.append(f"{manifest['n_entities']:,} entities (guideline: at least {MIN_ENTITIES:,})")
    if per_month < MIN_EVENTS_PER_MONTH:
        notes.append(f"{per_month:,.0f} events a month (guideline: at least {MIN_EVENTS_PER_MONTH:,})")
    if days < min_history_days(gap_days):
        if gap_days is not None and gap_days > INFREQUENT_GAP_DAYS:
            notes.append(f"{days:.0f} days of history (guideline: at least a year for an infrequent domain: the "
                         f"typical gap between an entity's active days is {gap_days:.0f} days, over "
                         f"{INFREQUENT_GAP_DAYS})")
        else:
            notes.append(f"{days:.0f} days of history (guideline: at least 3 months; a year for infrequent domains, "
                         f"where the typical gap between an entity's active days is over {INFREQUENT_GAP_DAYS} days)")
    return notes


def build_cache_asset(project) -> dg.AssetsDefinition:
    @dg.asset(key=CACHE_KEY, deps=[source_key(s.name) for s in project.sources], group_name="training",
              kinds={"duckdb", "arrow"}, description="Encoded, entity-sorted, sharded events + vocabularies")
    @locked("cache")
    def cache(context: dg.AssetExecutionContext, workspace: Workspace) -> dg.MaterializeResult:
        started = time.time()
        for source in project.sources:
            left_out = source_files(source, workspace)[1]
            if left_out:
                context.log.warning(f"source/{source.name}: {len(left_out)} file(s) are not partitions of the current "
                                    f"config and are not read (e.g. {left_out[0]}); delete them if they are stale")
        spec = cache_spec(project, workspace)
        source_bytes = sum(Path(f).stat().st_size for t in spec.events + spec.entity_attributes + spec.attributes
                           for f in t.files)
        space = workspace.ensure_space(source_bytes, "the cache")  # compressed, the cache is no bigger than its source
        reused = (workspace.cache_root / spec.fingerprint()[:16] / "manifest.json").exists()
        previous = cache_folder(workspace)
        folder = build_cache(spec, workspace.cache_root, previous=previous, log=context.log.info,
                             **project.cache.build_options())
        write_json(workspace.cache_root / "current.json",
                   {"folder": folder.name, "at": datetime.now(timezone.utc).isoformat()})
        manifest = read_json(folder / "manifest.json")
        gap = typical_gap_days(spec)
        notes = guideline_warnings(manifest, gap)
        for note in notes:
            context.log.warning(f"below the data guidelines: {note}; models trained on this may be unreliable")
        t0, t1 = (datetime.fromtimestamp(t, timezone.utc).isoformat() for t in manifest["time_range"])
        return dg.MaterializeResult(metadata={
            "fingerprint": manifest["fingerprint"][:16],
            "lineage": manifest["lineage"][:16],
            "mode": "reused" if reused else manifest["mode"],  # fresh | append | rebuild
            "events": dg.MetadataValue.int(manifest["n_events"]),
            "entities": dg.MetadataValue.int(manifest["n_entities"]),
            "shards": dg.MetadataValue.int(len(manifest["shards"])),
            "bytes": dg.MetadataValue.int(folder_bytes(folder)),
            "source_bytes": dg.MetadataValue.int(source_bytes),
            "cache_to_source_ratio": dg.MetadataValue.float(round(folder_bytes(folder) / max(source_bytes, 1), 3)),
            "time_range": f"{t0} .. {t1}",
            "columns": dg.MetadataValue.json(manifest["columns"]),
            "join_coverage": dg.MetadataValue.json(manifest["join_coverage"]),
            "dropped_rows": dg.MetadataValue.json(manifest["dropped"]),
            "below_guidelines": dg.MetadataValue.json(notes),
            "typical_gap_days": dg.MetadataValue.null() if gap is None else dg.MetadataValue.float(round(gap, 2)),
            "reused": dg.MetadataValue.bool(reused),
            "free_space": dg.MetadataValue.json(space),
            "path": dg.MetadataValue.path(str(folder)),
            "seconds": dg.MetadataValue.float(round(time.time() - started, 3)),
        })

    return cache
