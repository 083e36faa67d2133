"""What the asset checks (assets/checks.py) measure, as plain functions: DuckDB queries over the
extracted Parquet (never a table in memory), the cache's manifest and a scenario's config.json.
Each returns numbers or problems; the checks turn them into results, severities and messages."""

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.models.evaluate.holdout import LOWER_IS_BETTER
from habitus.models.storage.files import folder_bytes

SEVERE_SHARE = 0.05  # above this share of rows with null or duplicate keys a source is broken, not noisy
MIN_JOIN_COVERAGE = 0.9
MISMATCH_COVERAGE = 0.05  # below this almost no key matches: the key's type or format differs, not its data
CHECKPOINT_ALLOWANCE = 100 * 2**20  # room kept for checkpoints before the first one exists

_NUMERIC = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal, pa.types.is_boolean)
_TIME = (pa.types.is_timestamp, pa.types.is_date)


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
    from habitus.models.cache import infer_column_type

    schema = pq.read_schema(files[0])
    skip = {project.entity, source.timestamp}
    cols = [c for c in (source.columns or schema.names) if c not in skip and c in schema.names]
    cats = [c for c in cols if (source.types.get(c) or infer_column_type(schema.field(c).type, c)) == "categorical"]
    if not cats:
        return {}
    row = _query(f"SELECT {', '.join(f'approx_count_distinct({_q(c)})' for c in cats)} FROM {_scan(files)}")
    return dict(zip(cats, map(int, row)))


def quarantine_counts(manifest: dict) -> dict:
    """The cache's quarantine counts (habitus.models.cache.quarantine); for a cache built before the quarantine
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
