"""The training cache: source Parquet encoded for the model, sharded, memory-mapped.

Layout of one cache version, `<root>/<fingerprint[:16]>/`:

    manifest.json          written last; a folder without it is not a cache
    entities.arrow         one row per entity id (0..N-1): encoded entity attributes
    vocab/<column>.parquet value -> id (1..n, most frequent first at the first build; 0 = null / unseen)
    shard-00000.arrow ...  events sorted by (entity, ts), split by a stable hash of the entity id;
                           appended events add pieces (shard-00000-0001.arrow ...) that readers merge

Versions of one lineage (same settings, built from one another) give every value and entity the
same id forever: new data appends ids, it never renumbers, so a trained model keeps working.

Event columns: `entity` int32, `ts` int64 seconds, one int32 per categorical column (item
attributes joined in through their key), one float32 per numeric column. Arrow IPC files are
uncompressed so that reading them is a memory map, not a copy.

The fingerprint covers the inputs' content and the encoding settings: same inputs, same cache
(within a lineage; a fresh build numbers values by frequency).
"""

import fcntl
import functools
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from models.storage import atomic_path, combine, file_fingerprint, read_json, write_json

CACHE_FORMAT = 2
ENTITY, TS = "entity", "ts"


@dataclass(frozen=True)
class TableInput:
    """One extracted source: its Parquet files and the columns to use with their types."""

    name: str
    files: list[str]
    columns: dict[str, str]  # column -> "categorical" | "numeric" | "timestamp"
    timestamp: str | None = None  # events only
    key: str | None = None  # attribute tables only: the event column they join on


@dataclass(frozen=True)
class CacheSpec:
    entity: str
    events: list[TableInput]
    entity_attributes: list[TableInput] = field(default_factory=list)
    attributes: list[TableInput] = field(default_factory=list)
    shard_events: int = 4_000_000

    def fingerprint(self) -> str:
        settings = asdict(self)
        for group in ("events", "entity_attributes", "attributes"):
            for t in settings[group]:
                t["files"] = [file_fingerprint(f) for f in sorted(t["files"])]
        return combine(CACHE_FORMAT, settings)

    def settings_fingerprint(self) -> str:
        """The encoding settings without the data: versions with equal settings can share ids."""
        settings = asdict(self)
        for group in ("events", "entity_attributes", "attributes"):
            for t in settings[group]:
                del t["files"]
        settings.pop("shard_events")
        return combine(CACHE_FORMAT, settings)

    def file_prints(self) -> dict[str, dict[str, str]]:
        """source -> {file: content fingerprint}: what a later build compares to find new files.
        Files without rows are left out: a partition extracted before its data landed (a day in the
        future) becomes a new file, not a changed one, when it gets rows."""
        return {t.name: {f: file_fingerprint(f) for f in sorted(t.files) if pq.read_metadata(f).num_rows}
                for t in self.events + self.entity_attributes + self.attributes}


def infer_column_type(arrow_type: pa.DataType, name: str) -> str:
    """Strings, booleans and integer ids are categories; other numbers are numeric; times are timestamps."""
    if pa.types.is_timestamp(arrow_type) or pa.types.is_date(arrow_type):
        return "timestamp"
    if pa.types.is_floating(arrow_type) or pa.types.is_decimal(arrow_type):
        return "numeric"
    if pa.types.is_integer(arrow_type):
        lowered = name.lower()
        return "categorical" if lowered.endswith(("id", "_key", "code")) else "numeric"
    return "categorical"


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _files_sql(files: list[str]) -> str:
    return "read_parquet([" + ", ".join("'" + f.replace("'", "''") + "'" for f in files) + "], union_by_name=true)"


def _epoch_s(expr: str) -> str:
    """Seconds since 1970 of a plain (UTC) TIMESTAMP expression."""
    return f"epoch_us({expr}) // 1000000"


def _utc(expr: str, arrow_type: pa.DataType) -> str:
    """A time column as a plain UTC TIMESTAMP. A zone-aware one keeps its instant: a plain CAST would
    shift it to this machine's local zone."""
    if pa.types.is_timestamp(arrow_type) and arrow_type.tz is not None:
        return f"make_timestamp(epoch_us({expr}))"
    return f"CAST({expr} AS TIMESTAMP)"


def _field_type(t: TableInput, column: str) -> pa.DataType:
    schema = pq.read_schema(t.files[0])
    if column not in schema.names:
        raise CacheError(f"column {column!r} is not in source {t.name!r} (columns: {schema.names}); "
                         f"fix the project config")
    return schema.field(column).type


class CacheError(ValueError):
    pass


MAX_SHARD_FILES = 4  # an appended shard is merged back into one file when it has more pieces than this


def build_cache(spec: CacheSpec, root: str | Path, *, previous: str | Path | None = None,
                log: Callable[[str], None] = print, keep: int = 2) -> Path:
    """Build (or reuse) the cache for `spec` under `root`; returns its folder.

    With `previous` (the cache in use) built with the same settings, ids stay stable: when the only
    change is new events files, their events are encoded and appended to the previous version's
    shards ("append"); any other change re-encodes everything with the previous vocabularies and
    entity ids as a seed ("rebuild"). Either way a value or entity keeps the id it had, and new
    ones get the next ids, so models trained on an earlier version keep working on the new one."""
    import duckdb  # heavy import kept out of module import time

    root = Path(root)
    fp = spec.fingerprint()
    out = root / fp[:16]
    if (out / "manifest.json").exists() and read_json(out / "manifest.json").get("fingerprint") == fp:
        log(f"cache {out} is up to date (fingerprint {fp[:16]}); reusing it")
        return out
    started = time.time()
    for t in spec.events + spec.entity_attributes + spec.attributes:
        if not t.files:
            raise CacheError(f"source {t.name!r} has no extracted Parquet files; materialize source/{t.name} first")
    prev = _same_lineage(previous, spec, log)
    inputs = spec.file_prints()
    new_files = _new_events_files(prev, spec, inputs) if prev is not None else None
    mode = "fresh" if prev is None else ("append" if new_files else "rebuild")
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        spill = tmp / "_spill"
        # bounded memory: DuckDB spills sorts and joins to the workspace beyond this
        con = duckdb.connect(config={"temp_directory": str(spill),
                                     "memory_limit": os.environ.get("HABITUS_DUCKDB_MEMORY", "2GB")})
        try:
            if mode == "append":
                manifest = _append(con, spec, prev, new_files, tmp, log)
            else:
                manifest = _build(con, spec, tmp, log, seed=prev)
        finally:
            con.close()
            shutil.rmtree(spill, ignore_errors=True)
        manifest.update(fingerprint=fp, format=CACHE_FORMAT, settings=spec.settings_fingerprint(), inputs=inputs,
                        mode=mode, lineage=prev.lineage if prev else fp, parent=prev.fingerprint if prev else None,
                        build_seconds=round(time.time() - started, 3))
        write_json(tmp / "manifest.json", manifest)
    _prune(root, keep=keep, current=out)
    log(f"cache {mode} in {time.time() - started:.1f}s: {manifest['n_events']:,} events, "
        f"{manifest['n_entities']:,} entities, {len(manifest['shards'])} shard(s) at {out}")
    return out


def _same_lineage(previous, spec: CacheSpec, log) -> "Cache | None":
    if previous is None or not (Path(previous) / "manifest.json").exists():
        return None
    prev = Cache(previous)
    if prev.manifest.get("format") != CACHE_FORMAT or prev.manifest.get("settings") != spec.settings_fingerprint():
        log(f"the cache settings or format changed since {prev.path.name}: encoding from scratch (new ids; models "
            f"trained on the old cache must be retrained)")
        return None
    return prev


def _new_events_files(prev: "Cache", spec: CacheSpec, inputs: dict) -> dict[str, list[str]] | None:
    """The events files added since `prev`, per source, when nothing `prev` read changed; else None."""
    before = prev.manifest["inputs"]
    added: dict[str, list[str]] = {}
    for t in spec.events:
        old, now = before.get(t.name, {}), inputs[t.name]
        if any(now.get(f) != h for f, h in old.items()):
            return None  # a file was re-extracted (late rows) or removed: re-encode
        added[t.name] = sorted(set(now) - set(old))
    return added if any(added.values()) else None


def _prune(root: Path, keep: int, current: Path) -> None:
    """Delete all but the `keep` newest versions, except those a reader has open (a training run
    started on an older version keeps reading it while new data is appended)."""
    versions = sorted((p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").exists()),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in versions[keep:]:
        if old == current:
            continue
        with open(old / "manifest.json", "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use: the next build prunes it
            (old / "manifest.json").unlink()  # first: a folder without a manifest is never read again
            shutil.rmtree(old, ignore_errors=True)


def _stage_events(con, spec: CacheSpec, files: dict[str, list[str]]) -> tuple[dict, dict, dict]:
    """Create temp table `events`: the events of `files` (per source) that pass the quarantine
    (models.quarantine), with item attributes joined. Returns (quarantine counts, event column ->
    type, join coverage counts per attributes source)."""
    from models.quarantine import quarantine

    ent = _q(spec.entity)
    # all event sources as one stream with the entity id as text (ids keep one type across sources)
    parts = []
    for i, t in enumerate(spec.events):
        if not files.get(t.name):
            continue
        cols = "".join(f", {_column_sql(t, c)} AS {_q(c)}" for c in t.columns)
        parts.append(f"SELECT CAST({ent} AS VARCHAR) AS __entity, {_utc(_q(t.timestamp), _field_type(t, t.timestamp))} AS __ts, "
                     f"{i} AS __source{cols} FROM {_files_sql(files[t.name])}")
    con.sql("CREATE OR REPLACE TEMP VIEW raw_events AS " + " UNION ALL BY NAME ".join(parts))
    event_cols: dict[str, str] = {}
    for t in spec.events:
        for c, kind in t.columns.items():
            event_cols.setdefault(c, "numeric" if kind == "timestamp" else kind)
    kept, stats = quarantine(con, "raw_events", event_cols, now_s=int(time.time()))

    # item attributes joined through their key (one row per key: duplicates would copy events)
    joins, coverage = [], {}
    for j, t in enumerate(spec.attributes):
        if t.key not in event_cols:
            raise CacheError(f"attributes source {t.name!r} joins on {t.key!r}, which is not a column of the events "
                             f"sources (they have {sorted(event_cols)}); add it to the events' columns")
        alias = f"a{j}"
        cols = [c for c in t.columns if c != t.key]
        for c in cols:
            if c in event_cols:
                raise CacheError(f"column {c!r} of attributes source {t.name!r} clashes with an events column of the "
                                 f"same name; leave one of them out of `columns`")
            kind = t.columns[c]
            event_cols[c] = "numeric" if kind == "timestamp" else kind
        picks = ", ".join(f"any_value({_epoch_s(_utc(_q(c), _field_type(t, c))) if t.columns[c] == 'timestamp' else _q(c)}) AS {_q(c)}"
                          for c in cols)
        joins.append((alias, t, cols, f"SELECT CAST({_q(t.key)} AS VARCHAR) AS __key, {picks} FROM "
                                      f"{_files_sql(t.files)} GROUP BY 1"))
    select_cols = list(dict.fromkeys(f"e.{_q(c)}" for t in spec.events for c in t.columns))
    from_sql = f"{_q(kept)} e"
    for alias, t, cols, sub in joins:
        from_sql += f" LEFT JOIN ({sub}) {alias} ON CAST(e.{_q(t.key)} AS VARCHAR) = {alias}.__key"
        select_cols += [f"{alias}.{_q(c)}" for c in cols] + [f"{alias}.__key AS __hit{len(coverage)}"]
        coverage[t.name] = (len(coverage), t.key)
    con.sql(f"CREATE OR REPLACE TEMP TABLE events AS SELECT e.__entity, e.__ts, e.__source, {', '.join(select_cols)} "
            f"FROM {from_sql}")
    if coverage:  # counted on the built table: joining each attributes table a second time costs as much again
        row = _one(con, "SELECT " + ", ".join(f"count(__hit{i}), count({_q(key)})" for i, key in coverage.values())
                        + " FROM events")
        coverage = {name: [int(row[2 * i]), int(row[2 * i + 1])] for name, (i, _) in coverage.items()}
    return stats, event_cols, coverage


def _column_sql(t: TableInput, column: str) -> str:
    """An events column as read: a time becomes seconds since 1970 (the model reads it as a number)."""
    if t.columns[column] == "timestamp" or pa.types.is_timestamp(_field_type(t, column)) \
            or pa.types.is_date(_field_type(t, column)):
        return _epoch_s(_utc(_q(column), _field_type(t, column)))
    return _q(column)


def _build(con, spec: CacheSpec, out: Path, log, seed: "Cache | None" = None) -> dict:
    stats, event_cols, coverage = _stage_events(con, spec, {t.name: t.files for t in spec.events})
    if stats["rows_in"] == 0:
        raise CacheError("the events sources hold no rows: nothing to train on; extract source partitions with data")
    if stats["rows_kept"] == 0:
        from models.quarantine import summary
        raise CacheError(f"every event row was quarantined ({summary(stats)}); fix the source data or the config")

    # vocabularies: most frequent value first, ties by value, so ids are deterministic; a seed's ids kept
    (out / "vocab").mkdir()
    columns: dict[str, dict] = {}
    for c, kind in event_cols.items():
        if kind == "categorical":
            n = _write_vocab(con, f"SELECT CAST({_q(c)} AS VARCHAR) AS v FROM events", out / "vocab" / f"{c}.parquet",
                             f"v_{len(columns)}", seed=seed and seed.path / "vocab" / f"{c}.parquet")
            columns[c] = {"type": "categorical", "vocab_size": n}
        else:
            mean, std, lo, hi, nulls = _one(
                con, f"SELECT avg(x), stddev_pop(x), min(x), max(x), count(*) - count(x) FROM "
                     f"(SELECT CAST({_q(c)} AS DOUBLE) AS x FROM events)")
            # rounded: a parallel sum differs in the last bits from run to run
            columns[c] = {"type": "numeric", "mean": _round(mean), "std": _round(std), "min": lo, "max": hi,
                          "nulls": int(nulls)}

    # entity ids: every entity seen in events or in an entity attribute table, new ones ordered by id text
    _stage_entity_ids(con, spec, seed)
    n_entities = _one(con, "SELECT count(*) FROM entity_ids")[0]
    _write_entity_vocab(con, out)

    # events, encoded, sorted by (shard, entity, ts) and streamed into one Arrow file per shard
    n_events = _one(con, "SELECT count(*) FROM events")[0]
    n_shards = max(1, math.ceil(n_events / spec.shard_events))
    shards = [{"files": [f], "rows": r, "entities": e} for _, f, r, e in
              _write_shards(_encoded(con, columns, n_shards), out, n_shards, lambda s: f"shard-{s:05d}.arrow",
                            all_shards=True)]
    log(f"encoded {n_events:,} events into {n_shards} shard(s)")

    entity_columns = _write_entity_table(con, spec, out, seed)
    t_min, t_max = _one(con, f"SELECT min({_epoch_s('__ts')}), max({_epoch_s('__ts')}) FROM events")
    return {
        "entity": spec.entity,
        "entity_type": str(_entity_arrow_type(spec)),
        "n_entities": int(n_entities),
        "n_events": int(n_events),
        "time_range": [int(t_min), int(t_max)],
        "columns": columns,
        "entity_columns": entity_columns,
        "shards": shards,
        "appends": 0,
        "dropped": {"null_entity": stats["null_entity"], "null_timestamp": stats["null_timestamp"]},
        "quarantine": stats,
        "join_counts": coverage,
        "join_coverage": _coverage(coverage),
        "sources": {t.name: sorted(t.files) for t in spec.events + spec.entity_attributes + spec.attributes},
    }


def _append(con, spec: CacheSpec, prev: "Cache", files: dict[str, list[str]], out: Path, log) -> dict:
    """Encode only the events of new files and add them to `prev`'s shards, which are hard-linked
    (never copied, never modified): past events are not read, let alone re-encoded."""
    stats, event_cols, coverage = _stage_events(con, spec, files)
    pm = prev.manifest
    (out / "vocab").mkdir()
    columns: dict[str, dict] = {}
    for k, (c, kind) in enumerate(event_cols.items()):
        info = dict(pm["columns"][c])
        if kind == "categorical":
            info["vocab_size"] = _write_vocab(con, f"SELECT CAST({_q(c)} AS VARCHAR) AS v FROM events",
                                              out / "vocab" / f"{c}.parquet", f"v_{k}",
                                              seed=prev.path / "vocab" / f"{c}.parquet", add_counts=True)
        columns[c] = info  # numeric statistics stay those of the first build: the models standardize with them
    _stage_entity_ids(con, spec, prev, add_events=True)
    n_entities = _one(con, "SELECT count(*) FROM entity_ids")[0]
    _write_entity_vocab(con, out)

    seq = pm.get("appends", 0) + 1
    n_shards = len(pm["shards"])
    delta = {s: (f, r, e) for s, f, r, e in _write_shards(
        _encoded(con, columns, n_shards, new_to_shard=True), out, n_shards,
        lambda s: f"shard-{s:05d}-{seq:04d}.arrow")}
    shards = []
    for s, meta in enumerate(pm["shards"]):
        for f in meta["files"]:
            _link(prev.path / f, out / f)
        meta = {"files": list(meta["files"]), "rows": meta["rows"], "entities": meta["entities"]}
        if s in delta:
            f, rows, new_entities = delta[s]
            meta.update(files=meta["files"] + [f], rows=meta["rows"] + rows, entities=meta["entities"] + new_entities)
        if len(meta["files"]) > MAX_SHARD_FILES:
            merged = f"shard-{s:05d}-{seq:04d}-merged.arrow"
            _merge_shard_files([out / f for f in meta["files"]], out / merged)
            for f in meta["files"]:
                (out / f).unlink()
            meta["files"] = [merged]
        shards.append(meta)
    n_new = sum(r for _, r, _ in delta.values())
    log(f"appended {n_new:,} events from {sum(map(len, files.values()))} new file(s) to {n_shards} shard(s)")

    entity_columns = _write_entity_table(con, spec, out, prev)
    t_min, t_max = pm["time_range"]
    if n_new:
        lo, hi = _one(con, f"SELECT min({_epoch_s('__ts')}), max({_epoch_s('__ts')}) FROM events")
        t_min, t_max = min(t_min, int(lo)), max(t_max, int(hi))
    counts = {name: [a + b for a, b in zip(pm["join_counts"].get(name, [0, 0]), coverage.get(name, [0, 0]))]
              for name in set(pm["join_counts"]) | set(coverage)}
    return {
        **{k: pm[k] for k in ("entity", "entity_type")},
        "n_entities": int(n_entities),
        "n_events": pm["n_events"] + n_new,
        "time_range": [t_min, t_max],
        "columns": columns,
        "entity_columns": entity_columns,
        "shards": shards,
        "appends": seq,
        "dropped": {"null_entity": pm["dropped"]["null_entity"] + stats["null_entity"],
                    "null_timestamp": pm["dropped"]["null_timestamp"] + stats["null_timestamp"]},
        "quarantine": _add_counts(pm.get("quarantine", {}), stats),
        "join_counts": counts,
        "join_coverage": _coverage(counts),
        "sources": {t.name: sorted(t.files) for t in spec.events + spec.entity_attributes + spec.attributes},
    }


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.12g}")


def _add_counts(before: dict, now: dict) -> dict:
    """Quarantine counts of a version and its appended rows (duplicates are found within each)."""
    out = {k: before.get(k, 0) + v for k, v in now.items() if not k.endswith("_share")}
    rows = out.get("rows_in", 0)
    out["dropped_share"] = round((rows - out.get("rows_kept", 0)) / rows, 6) if rows else 0.0
    out["repaired_share"] = round(out.get("rows_repaired", 0) / rows, 6) if rows else 0.0
    return out


def _coverage(counts: dict) -> dict:
    return {name: round(hits / keys, 6) if keys else 0.0 for name, (hits, keys) in counts.items()}


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: copy (still never modifies the previous version)
        shutil.copyfile(src, dst)


def _one(con, sql: str) -> tuple:
    """The single row of a query (DuckDB 2 relations keep no cursor, so fetch all of one row)."""
    return con.sql(sql).fetchall()[0]


def _write_vocab(con, values_sql: str, path: Path, table: str, seed: Path | None = None, add_counts: bool = False) -> int:
    """Write value -> id (1..n) and the value's count; create temp table `table` (v, id) for encoding.
    Without a seed, ids go by count (descending), then value. With one, the seed's values keep their
    ids and new values follow them; counts are recounted, or added to the seed's with `add_counts`."""
    counted = f"SELECT v, count(*) AS n FROM ({values_sql}) WHERE v IS NOT NULL GROUP BY v"
    if seed is None or not Path(seed).exists():
        con.sql(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT v, CAST(row_number() OVER (ORDER BY n DESC, v) AS INTEGER) "
                f"AS id, n AS count FROM ({counted})")
    else:
        old = f"read_parquet('{str(seed).replace(chr(39), chr(39) * 2)}')"
        base = "coalesce(s.count, 0) + " if add_counts else ""
        con.sql(f"CREATE OR REPLACE TEMP TABLE {table} AS "
                f"SELECT s.value AS v, s.id, {base}coalesce(c.n, 0) AS count FROM {old} s LEFT JOIN ({counted}) c ON s.value = c.v "
                f"UNION ALL "
                f"SELECT c.v, CAST((SELECT coalesce(max(id), 0) FROM {old}) + row_number() OVER (ORDER BY c.n DESC, c.v) AS INTEGER), c.n "
                f"FROM ({counted}) c ANTI JOIN {old} s ON c.v = s.value")
    pq.write_table(con.sql(f"SELECT v AS value, id, count FROM {table} ORDER BY id").to_arrow_table(), path)
    return int(_one(con, f"SELECT count(*) FROM {table}")[0])


def _stage_entity_ids(con, spec: CacheSpec, seed: "Cache | None", add_events: bool = False) -> None:
    """Temp table entity_ids (v, id, events, before): every entity of the events and entity attribute
    tables; a seed's entities keep their ids; `before` = events the entity had before this build."""
    ent = _q(spec.entity)
    ent_sources = ["SELECT DISTINCT __entity AS v FROM events"] + [
        f"SELECT DISTINCT CAST({ent} AS VARCHAR) AS v FROM {_files_sql(t.files)}" for t in spec.entity_attributes]
    con.sql(f"CREATE OR REPLACE TEMP TABLE __seen AS SELECT s.v, coalesce(c.n, 0) AS n FROM "
            f"(SELECT v FROM ({' UNION '.join(ent_sources)}) WHERE v IS NOT NULL) s "
            f"LEFT JOIN (SELECT __entity AS v, count(*) AS n FROM events GROUP BY 1) c ON s.v = c.v")
    if seed is None:
        con.sql("CREATE OR REPLACE TEMP TABLE entity_ids AS SELECT v, CAST(row_number() OVER (ORDER BY v) - 1 AS INTEGER) "
                "AS id, n AS events, CAST(0 AS BIGINT) AS before FROM __seen")
        return
    old = f"read_parquet('{str(seed.path / 'vocab' / '__entity.parquet').replace(chr(39), chr(39) * 2)}')"
    before = "coalesce(o.events, 0)" if add_events else "0"
    con.sql(f"CREATE OR REPLACE TEMP TABLE entity_ids AS "
            f"SELECT o.value AS v, o.id, {before} + coalesce(s.n, 0) AS events, CAST({before} AS BIGINT) AS before "
            f"FROM {old} o LEFT JOIN __seen s ON o.value = s.v "
            f"UNION ALL "
            f"SELECT s.v, CAST((SELECT coalesce(max(id), -1) FROM {old}) + row_number() OVER (ORDER BY s.v) AS INTEGER), "
            f"s.n, CAST(0 AS BIGINT) FROM __seen s ANTI JOIN {old} o ON s.v = o.value")


def _write_entity_vocab(con, out: Path) -> None:
    pq.write_table(con.sql("SELECT v AS value, id, events FROM entity_ids ORDER BY id").to_arrow_table(),
                   out / "vocab" / "__entity.parquet")


def _encoded(con, columns: dict[str, dict], n_shards: int, new_to_shard: bool = False) -> pa.RecordBatchReader:
    """The staged events encoded, ordered by (shard, entity, ts). The shard is a stable hash of the
    entity id, so an entity's events always go to the same shard, whatever the build.
    With `new_to_shard`, a column `__new` marks the first row of entities that had no events before."""
    enc = ["CAST(ids.id AS INTEGER) AS entity", f"{_epoch_s('e.__ts')} AS ts"]
    vjoins = ""
    for k, (c, info) in enumerate(columns.items()):
        if info["type"] == "categorical":
            vjoins += f" LEFT JOIN v_{k} ON CAST(e.{_q(c)} AS VARCHAR) = v_{k}.v"
            enc.append(f"CAST(coalesce(v_{k}.id, 0) AS INTEGER) AS {_q(c)}")
        else:
            enc.append(f"CAST(coalesce(CAST(e.{_q(c)} AS DOUBLE), 'NaN') AS FLOAT) AS {_q(c)}")
    if new_to_shard:
        enc.append("ids.before = 0 AND row_number() OVER (PARTITION BY ids.id ORDER BY e.__ts) = 1 AS __new")
    shard_expr = f"CAST(('0x' || substr(md5(e.__entity), 1, 12)) AS UBIGINT) % {n_shards}"
    # every column in the order: events of one entity in the same second (a basket) come out in one
    # order on every run, so the same inputs give the same bytes
    order = ", ".join(["__shard", "entity", "ts"] + [_q(c) for c in columns])
    return con.sql(f"SELECT {shard_expr} AS __shard, {', '.join(enc)} FROM events e JOIN entity_ids ids ON e.__entity = ids.v"
                   f"{vjoins} ORDER BY {order}").to_arrow_reader(1 << 16)


def _entity_arrow_type(spec: CacheSpec) -> pa.DataType:
    schema = pq.read_schema(spec.events[0].files[0])
    if spec.entity not in schema.names:
        raise CacheError(f"entity column {spec.entity!r} is not in source {spec.events[0].name!r} "
                         f"(columns: {schema.names}); set `entity:` in the project config")
    return schema.field(spec.entity).type


def _write_shards(reader: pa.RecordBatchReader, out: Path, n_shards: int, name, all_shards: bool = False) -> list[tuple]:
    """Stream (shard, entity, ts)-ordered batches into one Arrow file per shard, named name(shard).
    Returns (shard, file, rows, entities) per shard written; entities are those marked `__new` if present."""
    shards, writer, current, rows, ents = [], None, None, 0, 0
    last_entity = None

    def close():
        nonlocal writer
        if writer is not None:
            writer.close()
            shards.append((current, name(current), rows, ents))
            writer = None

    for batch in reader:
        sid = batch.column("__shard").to_numpy()
        cuts = np.flatnonzero(np.diff(sid)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(sid)]):
            part = batch.slice(lo, hi - lo).drop_columns(["__shard"])
            if writer is None or sid[lo] != current:
                close()
                current, rows, ents, last_entity = int(sid[lo]), 0, 0, None
                writer = ipc.new_file(str(out / name(current)), _stored_schema(part.schema))
            if "__new" in part.schema.names:
                ents += int(np.count_nonzero(part.column("__new").to_numpy(zero_copy_only=False)))
                part = part.drop_columns(["__new"])
            else:
                e = part.column("entity").to_numpy()
                ents += int(np.count_nonzero(np.diff(e))) + 1 - (1 if last_entity == e[0] else 0)
                last_entity = e[-1]
            writer.write_batch(part)
            rows += len(part)
    close()
    if all_shards:  # every shard gets a file, so shard i is always manifest["shards"][i]
        written = {s for s, *_ in shards}
        for s in range(n_shards):
            if s not in written:
                with ipc.new_file(str(out / name(s)), _stored_schema(reader.schema).remove(0)):
                    pass
                shards.append((s, name(s), 0, 0))
        shards.sort()
    return shards


def _stored_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f for f in schema if f.name != "__new"])


def _merge_shard_files(paths: list[Path], out: Path) -> None:
    """Merge sorted pieces of one shard into one (entity, ts)-sorted file (a stable sort: earlier
    pieces first among equal timestamps)."""
    table = _read_sorted(paths)
    with ipc.new_file(str(out), table.schema) as w:
        w.write_table(table)


def _read_sorted(paths: list[Path]) -> pa.Table:
    tables = [ipc.open_file(pa.memory_map(str(p))).read_all() for p in paths]
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
    if len(tables) > 1:
        order = np.lexsort((table.column("ts").to_numpy(), table.column("entity").to_numpy()))
        table = table.take(pa.array(order))
    return table


def _write_entity_table(con, spec: CacheSpec, out: Path, seed: "Cache | None" = None) -> dict:
    """entities.arrow: one row per entity id with its encoded attributes (always rewritten whole:
    it is one row per entity, and attribute tables are replaced, not appended)."""
    path = out / "entities.arrow"
    ent = _q(spec.entity)
    info: dict[str, dict] = {}
    sel = ["ids.id AS entity"]
    joins = ""
    for j, t in enumerate(spec.entity_attributes):
        alias = f"ea{j}"
        cols = [c for c in t.columns if c != spec.entity]
        picks = ", ".join(f"any_value({_q(c)}) AS {_q(c)}" for c in cols)
        joins += (f" LEFT JOIN (SELECT CAST({ent} AS VARCHAR) AS __k, {picks} FROM {_files_sql(t.files)} GROUP BY 1) "
                  f"{alias} ON ids.v = {alias}.__k")
        for c in cols:
            kind = t.columns[c]
            if c in info:
                raise CacheError(f"entity attribute {c!r} appears in two entity_attributes sources; keep one")
            if kind == "categorical":
                vt = f"ev_{len(info)}"
                n = _write_vocab(con, f"SELECT CAST({_q(c)} AS VARCHAR) AS v FROM {_files_sql(t.files)}",
                                 out / "vocab" / f"entity.{c}.parquet", vt,
                                 seed=seed and seed.path / "vocab" / f"entity.{c}.parquet")
                joins += f" LEFT JOIN {vt} ON CAST({alias}.{_q(c)} AS VARCHAR) = {vt}.v"
                sel.append(f"CAST(coalesce({vt}.id, 0) AS INTEGER) AS {_q(c)}")
                info[c] = {"type": "categorical", "vocab_size": n}
            elif kind == "timestamp":
                sel.append(f"{_epoch_s(_utc(f'{alias}.{_q(c)}', _field_type(t, c)))} AS {_q(c)}")
                info[c] = {"type": "timestamp"}
            else:
                sel.append(f"CAST({alias}.{_q(c)} AS DOUBLE) AS {_q(c)}")
                info[c] = {"type": "numeric"}
    table = con.sql(f"SELECT {', '.join(sel)} FROM entity_ids ids{joins} ORDER BY ids.id").to_arrow_table()
    for c, meta in info.items():  # nulls -> NaN, so columns map to numpy without copies or masks
        if meta["type"] != "categorical":
            col = table.column(c).to_numpy(zero_copy_only=False).astype("float64")
            meta.update(mean=float(np.nanmean(col)) if np.isfinite(col).any() else 0.0,
                        std=float(np.nanstd(col)) if np.isfinite(col).any() else 1.0)
            table = table.set_column(table.schema.get_field_index(c), c, pa.array(col, pa.float64()))
    with ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return info


# --------------------------------------------------------------------------- reading


@dataclass
class Shard:
    """One shard's events as numpy views over the memory-mapped file."""

    entity: np.ndarray  # int32, sorted
    ts: np.ndarray  # int64 seconds, sorted within an entity
    columns: dict[str, np.ndarray]
    entities: np.ndarray  # distinct entity ids in this shard
    starts: np.ndarray  # row where each of `entities` begins; starts[-1] == len(ts)


class Cache:
    """A built cache, opened read-only through its manifest."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.exists():
            raise CacheError(f"{self.path} has no manifest.json: it is not a finished cache; materialize `cache`")
        # a shared lock on the manifest while this object lives: the version is not pruned under it
        self._reader = open(mf, "rb")
        fcntl.flock(self._reader, fcntl.LOCK_SH)
        self.manifest = read_json(mf)
        self.fingerprint: str = self.manifest["fingerprint"]
        self.columns: dict[str, dict] = self.manifest["columns"]
        self.entity_columns: dict[str, dict] = self.manifest["entity_columns"]
        self.n_entities: int = self.manifest["n_entities"]
        self.time_range: tuple[int, int] = tuple(self.manifest["time_range"])
        # versions of one lineage share ids (see build_cache); a model trained on any of them fits all
        self.lineage: str = self.manifest.get("lineage", self.fingerprint)
        self._last: tuple[int, Shard] | None = None

    def fits(self, checkpoint_config: dict) -> bool:
        """Whether a model trained on the cache recorded in `checkpoint_config` can read this one."""
        return (checkpoint_config.get("cache_fingerprint") == self.fingerprint
                or checkpoint_config.get("cache_lineage") == self.lineage)

    def __del__(self):
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()  # releases the shared lock: the version may be pruned from now on

    @property
    def shard_count(self) -> int:
        return len(self.manifest["shards"])

    def shard(self, i: int) -> Shard:
        """Shard `i`; the last one asked for is kept, since training and scoring read one shard chunk
        by chunk (an appended shard is merged and sorted once, not once per chunk)."""
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        shard = self._read_shard(i)
        self._last = (i, shard)
        return shard

    def _read_shard(self, i: int) -> Shard:
        table = _read_sorted([self.path / f for f in self.manifest["shards"][i]["files"]])
        cols = {c: table.column(c).to_numpy() for c in self.columns}
        entity = table.column("entity").to_numpy()
        cut = np.flatnonzero(np.diff(entity)) + 1
        starts = np.r_[0, cut, len(entity)].astype(np.int64)
        return Shard(entity=entity, ts=table.column("ts").to_numpy(), columns=cols,
                     entities=entity[starts[:-1]] if len(entity) else entity[:0], starts=starts)

    def entity_table(self) -> dict[str, np.ndarray]:
        table = ipc.open_file(pa.memory_map(str(self.path / "entities.arrow"))).read_all()
        return {c: table.column(c).to_numpy() for c in table.column_names}

    def vocab(self, column: str) -> pa.Table:
        return pq.read_table(self.path / "vocab" / f"{column}.parquet")

    @functools.cached_property
    def _entity_values(self) -> pa.Array:
        return pq.read_table(self.path / "vocab" / "__entity.parquet").column("value").combine_chunks()

    def entity_ids(self, ids: np.ndarray) -> pa.Array:
        """Entity index -> the entity id as the warehouse wrote it."""
        out = self._entity_values.take(pa.array(ids))
        target = _parse_type(self.manifest["entity_type"])
        return out.cast(target) if target is not None else out


def _parse_type(name: str) -> pa.DataType | None:
    try:
        return pa.type_for_alias(name.split("[")[0])
    except ValueError:  # an id type Arrow cannot name back: keep the text form
        return None
