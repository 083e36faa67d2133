"""Asset checks: the data before anything trains on it, the room to work, and the models.

    source/<name>    schema_matches_config  (blocking)  the extracted columns are the configured ones
                     keys_present           (blocking)  null or duplicate keys (in the run's partitions);
                                                        ERROR above 5% of the rows
                     timestamps_plausible   (events)    none in the future or before 1970 in the warehouse
                     volume_guidelines      (events)    10,000 entities, 100,000 events a month, 3 months (WARN)
    source/<name>    categorical_cardinality            categorical columns above quality.max_categories values (WARN)
    cache            join_coverage          (blocking)  share of event keys that find their attribute row (WARN
                                                        below 90%; ERROR below 5%, naming both key types: the
                                                        silent no-match join of `123` against `'P-123'`)
                     rows_quarantined       (blocking)  events dropped / repaired by the quarantine
                                                        (models.quarantine), ERROR above quality.max_*_share
                     free_space_for_training (blocking) free >= (sources + checkpoints) * 1.2
    scenario/<name>  beats_baselines        (blocking)  the hold-out metric beats every baseline's

A blocking check that fails with ERROR stops the assets after it in the same run (no training on
broken data, no predictions from a worse model); across runs, predictions use the newest checkpoint
that passed (assets.serving). The checks read the extracted Parquet with DuckDB and the manifests
and checkpoints' config.json: they are fast and never load a table into memory.
"""

import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
from dagster._core.storage.tags import (ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG,
                                       PARTITION_NAME_TAG)

from assets.cache import CACHE_KEY, guideline_warnings
from assets.scenarios import scenario_key
from assets.serving import serving_note
from assets.sources import connection_key, source_key
from models.evaluate import LOWER_IS_BETTER
from models.storage import folder_bytes, read_json
from resources.workspace import HEADROOM, WorkspaceError

SEVERE_SHARE = 0.05  # above this share of rows with null or duplicate keys a source is broken, not noisy
MIN_JOIN_COVERAGE = 0.9
MISMATCH_COVERAGE = 0.05  # below this almost no key matches: the key's type or format differs, not its data
CHECKPOINT_ALLOWANCE = 100 * 2**20  # room kept for checkpoints before the first one exists
EPOCH = datetime(1970, 1, 1)

_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal, pa.types.is_boolean)
_TIME = (pa.types.is_timestamp, pa.types.is_date)


# a scenario that fails it is not promoted; the run that trained it did not fail (the CLI exits 0)
PROMOTION_GATE = "beats_baselines"


def extracted_files(workspace, source) -> list[str]:
    folder = workspace.sources(source.name)
    return sorted(str(p) for p in folder.glob("*.parquet")) if folder.exists() else []


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _scan(files: list[str]) -> str:
    return "read_parquet([" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "], union_by_name=true)"


def _query(sql: str) -> tuple:
    return _query_all(sql)[0]


def _query_all(sql: str) -> list[tuple]:
    import duckdb

    con = duckdb.connect()
    try:
        return con.sql(sql).fetchall()
    finally:
        con.close()


def files_of_run(context, files: list[str]) -> tuple[list[str], str]:
    """The partitions this run extracted (a check after a daily extraction reads a day, not the history),
    or every file when the run names no partition. Returns (files, what they are)."""
    tags = context.run.tags
    start, end = tags.get(ASSET_PARTITION_RANGE_START_TAG), tags.get(ASSET_PARTITION_RANGE_END_TAG)
    if tags.get(PARTITION_NAME_TAG):
        start = end = tags[PARTITION_NAME_TAG]
    if start and end:
        picked = [f for f in files if start <= Path(f).stem <= end]
        if picked:
            return picked, f"partitions {start} .. {end}" if start != end else f"partition {start}"
    return files, f"all {len(files)} file(s)"


def _not_extracted(source) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                               description=f"source/{source.name} has no extracted Parquet; materialize it first")


# --------------------------------------------------------------------------- the checks' logic (plain functions)


def schema_problems(project, source, schemas: dict[str, pa.Schema]) -> list[str]:
    """What differs between the extracted files and the config: missing columns, a time column that is
    not a time, a `types:` override the column cannot take, files whose columns differ."""
    problems = []
    first_file, schema = next(iter(schemas.items()))
    for f, s in schemas.items():
        if s.names != schema.names or s.types != schema.types:
            problems.append(f"{Path(f).name} has columns {dict(zip(s.names, map(str, s.types)))}, "
                            f"{Path(first_file).name} has {dict(zip(schema.names, map(str, schema.types)))}")
            break
    required = [c for c in (project.entity if source.role != "attributes" else None, source.timestamp, source.key) if c]
    missing = [c for c in dict.fromkeys(required + list(source.columns)) if c not in schema.names]
    if missing:
        problems.append(f"column(s) {missing} are configured but not extracted (extracted: {schema.names})")
    if source.timestamp and source.timestamp in schema.names:
        t = schema.field(source.timestamp).type
        if not any(ok(t) for ok in _TIME):
            problems.append(f"timestamp column {source.timestamp!r} is {t}, not a timestamp or date")
    for col, kind in source.types.items():
        if col not in schema.names:
            problems.append(f"types.{col}: no such column (extracted: {schema.names})")
            continue
        t = schema.field(col).type
        if kind == "numeric" and not any(ok(t) for ok in _NUMERIC):
            problems.append(f"types.{col}: numeric, but the column is {t}")
        if kind == "timestamp" and not any(ok(t) for ok in _TIME):
            problems.append(f"types.{col}: timestamp, but the column is {t}")
    return problems


def key_counts(project, source, files: list[str]) -> dict[str, int]:
    """rows, null keys and duplicate rows (events: whole duplicate rows; attribute tables: repeated keys)."""
    scan = _scan(files)
    if source.role == "events":
        rows, nulls = _query(f"SELECT count(*), count(*) - count({_q(project.entity)}) FROM {scan}")
        distinct = _query(f"SELECT count(*) FROM (SELECT DISTINCT * FROM {scan})")[0]
        return {"rows": rows, "null_keys": nulls, "duplicates": rows - distinct}
    key = project.entity if source.role == "entity_attributes" else source.key
    rows, nulls, distinct = _query(f"SELECT count(*), count(*) - count({_q(key)}), count(DISTINCT {_q(key)}) FROM {scan}")
    return {"rows": rows, "null_keys": nulls, "duplicates": rows - nulls - distinct}


def keys_message(n: dict, key_name: str, role: str, scope: str) -> str:
    """keys_present's description: the cause first (null keys, repeated rows or keys), then the rest."""
    rows = f"{n['rows']:,} rows"
    causes = []
    if n["null_keys"]:
        causes.append(f"{n['null_keys']:,} of {rows} without {key_name!r} (dropped)")
    if n["duplicates"]:
        causes.append(f"{n['duplicates']:,} duplicate rows (whole rows repeated; kept, as two identical items in one "
                      f"basket can be real)" if role == "events" else
                      f"{n['duplicates']:,} repeated {key_name!r} values (one row per key is used)")
    if not causes:
        return f"{scope}: every one of {rows} has {key_name!r}; no " \
               f"{'duplicate rows' if role == 'events' else f'repeated {key_name!r} values'}"
    return f"{scope}: " + "; ".join(causes) + ("" if n["null_keys"] else f"; no row without {key_name!r}")


def volume(project, source, files: list[str]) -> dict:
    """The numbers the data guidelines are about, from the extracted events."""
    ts = _q(source.timestamp)
    rows, entities, t0, t1 = _query(f"SELECT count(*), count(DISTINCT {_q(project.entity)}), "
                                    f"epoch(min({ts})), epoch(max({ts})) FROM {_scan(files)}")
    return {"n_events": rows, "n_entities": entities,
            "time_range": [int(t0 or 0), int(t1 or 0)]}


def entity_coverage(project, events_files: list[str], attribute_files: list[str]) -> float:
    """Share of event rows whose entity has a row in an entity attributes table."""
    ent = _q(project.entity)
    hit, total = _query(
        f"SELECT count(a.k), count(*) FROM (SELECT CAST({ent} AS VARCHAR) AS k FROM {_scan(events_files)} "
        f"WHERE {ent} IS NOT NULL) e LEFT JOIN (SELECT DISTINCT CAST({ent} AS VARCHAR) AS k FROM "
        f"{_scan(attribute_files)}) a ON e.k = a.k")
    return round(hit / total, 6) if total else 0.0


def key_samples(files: list[str], column: str, n: int = 3) -> tuple[str, list]:
    """The Arrow type of `column` in the first file and a few of its values (for a mismatch message)."""
    t = str(pq.read_schema(files[0]).field(column).type) if column in pq.read_schema(files[0]).names else "missing"
    rows = _query_all(f"SELECT DISTINCT CAST({_q(column)} AS VARCHAR) FROM {_scan(files)} "
                      f"WHERE {_q(column)} IS NOT NULL ORDER BY 1 LIMIT {int(n)}") if t != "missing" else []
    return t, [r[0] for r in rows]


def key_mismatch(events_files: list[str], event_key: str, attr_name: str, attr_files: list[str], attr_key: str) -> str:
    """'events product_id is int64 like ['1', '2'], products.product_id is string like ['P-1', ...]'."""
    et, ev = key_samples(events_files, event_key)
    at, av = key_samples(attr_files, attr_key)
    if not av:
        return f"{attr_name} has no rows with a {attr_key}: check that table (or its extraction) is not empty"
    return (f"events {event_key} is {et} like {ev}, {attr_name}.{attr_key} is {at} like {av}: make the key the "
            f"same type and format on both sides (e.g. a view that casts or strips a prefix)")


def categorical_cardinality(project, source, files: list[str]) -> dict[str, int]:
    """Approximate distinct values of each categorical column (HyperLogLog: one pass, little memory)."""
    from models.cache import infer_column_type

    schema = pq.read_schema(files[0])
    skip = {project.entity, source.timestamp}
    cols = [c for c in (source.columns or schema.names) if c not in skip and c in schema.names]
    cats = [c for c in cols if (source.types.get(c) or infer_column_type(schema.field(c).type, c)) == "categorical"]
    if not cats:
        return {}
    row = _query(f"SELECT {', '.join(f'approx_count_distinct({_q(c)})' for c in cats)} FROM {_scan(files)}")
    return dict(zip(cats, map(int, row)))


def quarantine_counts(manifest: dict) -> dict:
    """The cache's quarantine counts (models.quarantine); for a cache built before the quarantine
    existed, the null ids and timestamps it dropped."""
    if "quarantine" in manifest:
        return dict(manifest["quarantine"])
    dropped = manifest.get("dropped", {})
    rows_in = manifest["n_events"] + sum(dropped.values())
    return {"rows_in": rows_in, "rows_kept": manifest["n_events"], **dropped, "rows_repaired": 0,
            "dropped_share": round(sum(dropped.values()) / rows_in, 6) if rows_in else 0.0, "repaired_share": 0.0}


def space_needed(workspace, project) -> dict:
    """Bytes of the extracted sources and of the checkpoints (or an allowance before the first)."""
    source_bytes = sum(Path(f).stat().st_size for s in project.sources for f in extracted_files(workspace, s))
    checkpoints = workspace.foundation.parent
    ckpt_bytes = folder_bytes(checkpoints) if checkpoints.exists() else 0
    return {"source_bytes": source_bytes, "checkpoint_bytes": max(ckpt_bytes, CHECKPOINT_ALLOWANCE)}


def baseline_margin(cfg: dict) -> dict:
    """The headline metric of the model next to the closest baseline's, from a scenario's config.json.
    A baseline scored on some labels only (LightGBM on a wide head) is compared with the model's value
    on those labels (`model_<metric>`), so the two numbers shown are always like for like."""
    key, metrics = cfg["headline"], cfg["metrics"]
    lower = key in LOWER_IS_BETTER
    model = metrics["model"].get(key, math.nan)
    pairs = {b: (m.get(f"model_{key}", model), m.get(key, math.nan)) for b, m in metrics["baselines"].items()}
    pairs = {b: p for b, p in pairs.items() if not math.isnan(p[1])}
    best = min(pairs, key=lambda b: (pairs[b][1] - pairs[b][0]) * (1 if lower else -1)) if pairs else None
    mine, theirs = pairs[best] if best else (model, math.nan)
    return {"metric": key, "model": mine, "best_baseline": best, "baseline": theirs, "lower_is_better": lower}


# --------------------------------------------------------------------------- the check definitions


def source_checks(project, source) -> list[dg.AssetChecksDefinition]:
    key = source_key(source.name)
    conn_key = connection_key(source.connection)
    checks = []

    @dg.asset_check(asset=key, name="schema_matches_config", blocking=True, required_resource_keys={"workspace"},
                    description="The extracted columns are the configured ones, with types the config can use")
    def schema_matches_config(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        schemas = {f: pq.read_schema(f) for f in files}
        problems = schema_problems(project, source, schemas)
        schema = next(iter(schemas.values()))
        return dg.AssetCheckResult(
            passed=not problems, severity=dg.AssetCheckSeverity.ERROR,
            description="; ".join(problems) or f"{len(files)} file(s) with the configured columns",
            metadata={"columns": dg.MetadataValue.json(dict(zip(schema.names, map(str, schema.types)))),
                      "files": dg.MetadataValue.int(len(files))})

    checks.append(schema_matches_config)

    key_name = {"events": project.entity, "entity_attributes": project.entity}.get(source.role, source.key)

    @dg.asset_check(asset=key, name="keys_present", blocking=True, required_resource_keys={"workspace"},
                    description=f"Rows without {key_name!r} or repeated "
                                f"{'rows' if source.role == 'events' else repr(key_name) + ' values'}; "
                                f"ERROR (blocking) above {SEVERE_SHARE:.0%} of the rows")
    def keys_present(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        files, scope = files_of_run(context, files)
        n = key_counts(project, source, files)
        # repeated events can be real (two identical items in one basket): they only warn
        bad = n["null_keys"] + (0 if source.role == "events" else n["duplicates"])
        share = bad / n["rows"] if n["rows"] else 0.0
        return dg.AssetCheckResult(
            passed=n["null_keys"] == 0 and n["duplicates"] == 0,
            severity=dg.AssetCheckSeverity.ERROR if share > SEVERE_SHARE else dg.AssetCheckSeverity.WARN,
            description=keys_message(n, key_name, source.role, scope),
            metadata={**{k: dg.MetadataValue.int(v) for k, v in n.items()},
                      "bad_share": dg.MetadataValue.float(round(share, 6)), "scope": scope})

    checks.append(keys_present)
    limit = project.quality.max_categories

    @dg.asset_check(asset=key, name="categorical_cardinality", required_resource_keys={"workspace"},
                    description=f"No categorical column has more than {limit:,} distinct values (quality.max_categories): "
                                f"an id or free text used as a category makes a vocabulary the model cannot learn")
    def categorical_cardinality_check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        counts = categorical_cardinality(project, source, files)
        wide = {c: n for c, n in counts.items() if n > limit}
        return dg.AssetCheckResult(
            passed=not wide, severity=dg.AssetCheckSeverity.WARN,
            description=("; ".join(f"{c}: about {n:,} distinct values (limit {limit:,}); leave it out of `columns`, "
                                   f"declare it `types: {{{c}: numeric}}` if it is a number, or raise "
                                   f"quality.max_categories" for c, n in wide.items())
                         or f"{len(counts)} categorical column(s), at most {max(counts.values(), default=0):,} values"),
            metadata={"distinct_values": dg.MetadataValue.json(counts)})

    checks.append(categorical_cardinality_check)
    if source.role != "events":
        return checks

    @dg.asset_check(asset=key, name="timestamps_plausible", required_resource_keys={conn_key},
                    description=f"No row of table {source.table!r} is dated in the future or before 1970 (such rows "
                                f"fall outside every partition and are never extracted)")
    def timestamps_plausible(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from resources.sql import utc_naive

        first, last = (utc_naive(t) for t in getattr(context.resources, conn_key).time_range(source.table,
                                                                                              source.timestamp))
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        problems = []
        if last is not None and last > now + timedelta(hours=1):
            problems.append(f"newest {source.timestamp} {last.isoformat()} is in the future (now {now:%Y-%m-%dT%H:%M})")
        if first is not None and first < EPOCH:
            problems.append(f"oldest {source.timestamp} {first.isoformat()} is before 1970 (a default or a unit error?)")
        return dg.AssetCheckResult(
            passed=not problems, severity=dg.AssetCheckSeverity.ERROR,
            description="; ".join(problems) or f"{first} .. {last}",
            metadata={"oldest": str(first), "newest": str(last)})

    @dg.asset_check(asset=key, name="volume_guidelines", required_resource_keys={"workspace"},
                    description="At least 10,000 entities, 100,000 events a month and 3 months of history "
                                "(below that models are unreliable; a warning)")
    def volume_guidelines(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        v = volume(project, source, files)
        notes = guideline_warnings(v) if v["n_events"] else ["no events extracted"]
        days = (v["time_range"][1] - v["time_range"][0]) / 86_400
        return dg.AssetCheckResult(
            passed=not notes, severity=dg.AssetCheckSeverity.WARN,
            description="; ".join(notes) or "within the data guidelines",
            metadata={"entities": dg.MetadataValue.int(v["n_entities"]),
                      "events": dg.MetadataValue.int(v["n_events"]),
                      "events_per_month": dg.MetadataValue.float(round(v["n_events"] / max(days / 30.44, 1e-9), 1)),
                      "days_of_history": dg.MetadataValue.float(round(days, 1))})

    return checks + [timestamps_plausible, volume_guidelines]


def cache_checks(project) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(asset=CACHE_KEY, name="join_coverage", required_resource_keys={"workspace"}, blocking=True,
                    description=f"Share of event keys that find their attribute row (warns below "
                                f"{MIN_JOIN_COVERAGE:.0%}): unmatched events get no attributes; below "
                                f"{MISMATCH_COVERAGE:.0%} the key's type or format differs (ERROR, blocking)")
    def join_coverage(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from assets.cache import current_cache

        workspace = context.resources.workspace
        cache = current_cache(workspace)
        coverage = dict(cache.manifest.get("join_coverage", {}))
        events = [f for s in project.events_sources for f in extracted_files(workspace, s)]
        for s in project.sources:
            if s.role == "entity_attributes" and events and extracted_files(workspace, s):
                coverage[s.name] = entity_coverage(project, events, extracted_files(workspace, s))
        low = {k: v for k, v in coverage.items() if v < MIN_JOIN_COVERAGE}
        mismatched = [_mismatch_note(project, workspace, k, v) for k, v in coverage.items() if v < MISMATCH_COVERAGE]
        if mismatched:
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                                       description="; ".join(mismatched),
                                       metadata={"coverage": dg.MetadataValue.json(coverage)})
        return dg.AssetCheckResult(
            passed=not low, severity=dg.AssetCheckSeverity.WARN,
            description=(", ".join(f"{k}: {v:.1%} of event keys found" for k, v in low.items()) + " (check `key` "
                         "and that the attribute table is complete)") if low else
                        ("every attribute table covers at least " f"{MIN_JOIN_COVERAGE:.0%}" if coverage
                         else "no attribute tables"),
            metadata={"coverage": dg.MetadataValue.json(coverage)})

    @dg.asset_check(asset=CACHE_KEY, name="rows_quarantined", required_resource_keys={"workspace"}, blocking=True,
                    description=f"Events dropped (null or blank ids, impossible times, duplicates) at most "
                                f"{project.quality.max_dropped_share:.1%} and repaired (inf, NaN, not a number) at most "
                                f"{project.quality.max_repaired_share:.1%} of all events (quality.max_*_share)")
    def rows_quarantined(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from assets.cache import current_cache
        from models.quarantine import summary

        counts = quarantine_counts(current_cache(context.resources.workspace).manifest)
        q = project.quality
        over = []
        if counts.get("dropped_share", 0.0) > q.max_dropped_share:
            over.append(f"{counts['dropped_share']:.2%} of the events dropped (quality.max_dropped_share "
                        f"{q.max_dropped_share:.2%})")
        if counts.get("repaired_share", 0.0) > q.max_repaired_share:
            over.append(f"{counts['repaired_share']:.2%} of the events repaired (quality.max_repaired_share "
                        f"{q.max_repaired_share:.2%})")
        return dg.AssetCheckResult(
            passed=not over, severity=dg.AssetCheckSeverity.ERROR,
            description=("; ".join(over) + f". {summary(counts)}. Fix the source data, or raise the limit in the "
                         f"project config if these rows are expected") if over else summary(counts),
            metadata={k: (dg.MetadataValue.float(float(v)) if isinstance(v, float) else dg.MetadataValue.int(int(v)))
                      for k, v in counts.items() if isinstance(v, (int, float))})

    @dg.asset_check(asset=CACHE_KEY, name="free_space_for_training", blocking=True,
                    required_resource_keys={"workspace"},
                    description="Free space in the workspace >= (extracted sources + checkpoints) + 20% before "
                                "training starts")
    def free_space_for_training(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        workspace = context.resources.workspace
        need = space_needed(workspace, project)
        total = need["source_bytes"] + need["checkpoint_bytes"]
        meta = {k: dg.MetadataValue.int(v) for k, v in need.items()}
        try:
            space = workspace.ensure_space(total, "training")
        except WorkspaceError as e:
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR, description=str(e),
                                       metadata=meta)
        return dg.AssetCheckResult(
            passed=True, description=f"{space['free_gb']} GB free, {space['needed_gb']} GB needed "
                                     f"(sources + checkpoints + {HEADROOM - 1:.0%})",
            metadata={**meta, "free_gb": dg.MetadataValue.float(space["free_gb"])})

    return [join_coverage, rows_quarantined, free_space_for_training]


def _mismatch_note(project, workspace, name: str, coverage: float) -> str:
    source = project.source(name)
    key = project.entity if source.role == "entity_attributes" else source.key
    events = next((files for s in project.events_sources if (files := extracted_files(workspace, s))
                   and key in pq.read_schema(files[0]).names), [])
    attr = extracted_files(workspace, source)
    head = f"{name}: {coverage:.1%} of event keys found"
    if not events or not attr:
        return head
    return f"{head}; {key_mismatch(events, key, name, attr, key)}"


def scenario_check(project, name: str) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=scenario_key(name), name=PROMOTION_GATE, blocking=True,
                    required_resource_keys={"workspace"},
                    description="The model beats every baseline on the hold-out; a worse model fails (blocking) and "
                                "the previous passing checkpoint keeps serving predictions")
    def beats_baselines(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        workspace = context.resources.workspace
        cfg_file = workspace.scenario(name) / "config.json"
        if not cfg_file.exists():
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                                       description=f"scenario {name!r} has no checkpoint; materialize it first")
        cfg = read_json(cfg_file)
        m = baseline_margin(cfg)
        word = "below" if m["lower_is_better"] else "above"
        verdict = "beats" if cfg["beats_baselines"] else "does not beat"
        return dg.AssetCheckResult(
            passed=bool(cfg["beats_baselines"]), severity=dg.AssetCheckSeverity.ERROR,
            description=f"{m['metric']} {m['model']:.4f} {verdict} the best baseline ({m['best_baseline']}: "
                        f"{m['baseline']:.4f}; better is {word}); predictions use the {serving_note(workspace, name)}",
            metadata={m["metric"]: dg.MetadataValue.float(float(m["model"])),
                      "best_baseline": str(m["best_baseline"]),
                      "baseline_value": dg.MetadataValue.float(float(m["baseline"])),
                      "checkpoint": cfg["weights_sha256"][:16],
                      "holdout_entities": dg.MetadataValue.int(cfg["metrics"].get("entities", 0))})

    return beats_baselines


def build_checks(project) -> list[dg.AssetChecksDefinition]:
    checks = [c for s in project.sources for c in source_checks(project, s)]
    checks += cache_checks(project)
    checks += [scenario_check(project, name) for name in project.scenarios]
    return checks
