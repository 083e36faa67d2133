"""The training cache: source Parquet encoded for the model, sharded, memory-mapped.

Layout of one cache version, `<root>/<fingerprint[:16]>/`:

    manifest.json          written last; a folder without it is not a cache
    entities.arrow         one row per entity id (0..N-1): encoded entity attributes
    vocab/<column>.parquet value -> id (1..n, most frequent first at the first build; 0 = null / unseen)
    shard-00000.arrow ...  events sorted by (entity, ts) (within one second by a hash of the row, so
                           that the same inputs give the same bytes), split by a stable hash of the
                           entity id, in record batches of 65,536 rows; appended events add pieces
                           (shard-00000-0001.arrow ...) that readers merge

Versions of one lineage (same settings, built from one another) give every value and entity the
same id forever: new data appends ids, it never renumbers, so a trained model keeps working.

Event columns, as readers get them: `entity` int32, `ts` int64 seconds, one int32 per categorical
column (item attributes joined in through their key), one float32 per numeric column. On disk the
ids are in the narrowest unsigned type that holds them and `ts` is uint32 seconds after a base kept
in the file's schema metadata (_stored_schema; _widen reads them back). Arrow IPC buffers are
zstd-compressed, so that the cache is no bigger than its source Parquet (the cache promise is 1:1;
uncompressed it was 3-4x): a shard is read whole into memory anyway (one at a time), and
decompressing it measured as fast as copying it out of a memory map (bench/cache_size.py).

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
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from models.storage import atomic_path, combine, file_fingerprint, read_json, write_json

CACHE_FORMAT = 3  # 3: zstd-compressed IPC buffers, narrow ids, times as offsets
IPC_OPTIONS = ipc.IpcWriteOptions(compression=pa.Codec("zstd", 3))  # level 3: 8% smaller than 1, as fast
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
    # the cache is no bigger than its sources (format 3); the estimate names what a full disk lacked
    needed = sum(os.path.getsize(f) for t in spec.events + spec.entity_attributes + spec.attributes for f in t.files)
    with atomic_path(out, needed_bytes=needed) as tmp:
        tmp.mkdir(parents=True)
        spill = tmp / "_spill"
        # bounded memory: DuckDB spills to the workspace beyond this (a build needs far less: the sort
        # runs over PART_EVENTS events at a time); threads: DuckDB's default is one per core, 1 is
        # faster on a machine whose cores other work keeps busy
        config = {"temp_directory": str(spill), "memory_limit": os.environ.get("HABITUS_DUCKDB_MEMORY", "2GB")}
        if os.environ.get("HABITUS_DUCKDB_THREADS"):
            config["threads"] = int(os.environ["HABITUS_DUCKDB_THREADS"])
        con = duckdb.connect(config=config)
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


# --------------------------------------------------------------------------- building
#
# A build reads the events with a few DuckDB statements, each streaming the Parquet files (nothing the
# size of the events is materialized, in DuckDB or in Python):
#
#   screen    the quarantine's counts by reason (models.quarantine.screen: one grouped pass); the view
#             of the valid rows repeats only the rules that dropped or repaired something, so on clean
#             data the passes below read the Parquet as plainly as a scan
#   count     kept events per entity and per value of every categorical and join-key column (one
#             GROUP BY each, one statement): the vocabularies, entity ids, join coverage and the
#             attribute columns' counts and statistics come from these counts and the small
#             attribute tables, never from joining the events
#   describe  the numeric columns' statistics, the time range, the number of events
#   encode    ids through small lookup tables (one join per categorical or key column, the attributes
#             riding on their key's), sorted by (shard, entity, ts, row hash) and streamed into the
#             shard files, in ranges of entities of about PART_EVENTS events: DuckDB's sort, the
#             largest cost in time and memory, stays the same size whatever the data's, and on
#             entity-sorted Parquet (as extracted) each range reads only the row groups it needs
#
# Exact copies of a row (the quarantine's duplicate_event) sort next to each other in `encode` (same
# entity, time and row hash). Without any (the usual case) nothing more is needed. With some, or with a
# 64-bit hash collision within one entity and second, `count`, `describe` and `encode` run again over
# the DISTINCT rows, ordered by every column: always exact, only slower for data that has duplicates.

PART_EVENTS = int(os.environ.get("HABITUS_CACHE_PART_EVENTS", 2_000_000))  # ~150 MB of DuckDB sort
BATCH_ROWS = 1 << 16  # rows per record batch in shard files (whatever DuckDB's chunking: same bytes)


@dataclass
class _Staged:
    stats: dict  # quarantine counts of models.quarantine.screen (duplicates not counted yet)
    event_cols: dict[str, str]  # column -> categorical | numeric: the events' own, then the attributes'
    source_cols: list[str]  # the events' own columns
    attrs: list[tuple[str, TableInput, list[str]]]  # (temp table with one row per key, source, its columns)
    valid: str  # view of the rows that pass the quarantine (exact copies not dropped yet)


class _Tie(Exception):
    """Two rows sort equal on (entity, ts, row hash): exact copies, or a hash collision."""


def _stage_events(con, spec: CacheSpec, files: dict[str, list[str]]) -> _Staged:
    """Views `raw_events` (every event source as one stream, the entity id as text) and the quarantine's
    `raw_events_valid`; one temp table per attributes source (one row per key: duplicate keys would
    copy events)."""
    from models.quarantine import screen

    ent = _q(spec.entity)
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
    source_cols = list(event_cols)
    valid, stats = screen(con, "raw_events", event_cols, now_s=int(time.time()))

    attrs = []
    for j, t in enumerate(spec.attributes):
        if t.key not in source_cols:
            raise CacheError(f"attributes source {t.name!r} joins on {t.key!r}, which is not a column of the events "
                             f"sources (they have {sorted(source_cols)}); add it to the events' columns")
        cols = [c for c in t.columns if c != t.key]
        for c in cols:
            if c in event_cols:
                raise CacheError(f"column {c!r} of attributes source {t.name!r} clashes with an events column of the "
                                 f"same name; leave one of them out of `columns`")
            kind = t.columns[c]
            event_cols[c] = "numeric" if kind == "timestamp" else kind
        picks = "".join(f", any_value({_epoch_s(_utc(_q(c), _field_type(t, c))) if t.columns[c] == 'timestamp' else _q(c)}) "
                        f"AS {_q(c)}" for c in cols)
        con.sql(f"CREATE OR REPLACE TEMP TABLE __a{j} AS SELECT CAST({_q(t.key)} AS VARCHAR) AS __key{picks} "
                f"FROM {_files_sql(t.files)} GROUP BY 1")
        attrs.append((f"__a{j}", t, cols))
    return _Staged(stats=stats, event_cols=event_cols, source_cols=source_cols, attrs=attrs, valid=valid)


def _column_sql(t: TableInput, column: str) -> str:
    """An events column as read: a time becomes seconds since 1970 (the model reads it as a number)."""
    if t.columns[column] == "timestamp" or pa.types.is_timestamp(_field_type(t, column)) \
            or pa.types.is_date(_field_type(t, column)):
        return _epoch_s(_utc(_q(column), _field_type(t, column)))
    return _q(column)


def _encode(con, spec: CacheSpec, st: _Staged, out: Path, *, seed: "Cache | None", append: bool, n_shards=None,
            name=lambda s: f"shard-{s:05d}.arrow") -> dict:
    """Passes 2 and 3 over the valid rows; again over the DISTINCT rows when some are exact copies."""
    try:
        return _encode_kept(con, spec, st, st.valid, out, seed=seed, append=append, n_shards=n_shards, name=name,
                            exact=False)
    except _Tie:
        # exact copies (or a hash collision): drop them the quarantine's way and order by every column
        con.sql(f"CREATE OR REPLACE TEMP TABLE __distinct AS SELECT DISTINCT * FROM {_q(st.valid)}")
        return _encode_kept(con, spec, st, "__distinct", out, seed=seed, append=append, n_shards=n_shards,
                            name=name, exact=True)


def _encode_kept(con, spec: CacheSpec, st: _Staged, kept: str, out: Path, *, seed, append: bool, n_shards, name,
                 exact: bool) -> dict:
    """Vocabularies, entity ids and the shard files of the events of view `kept`."""
    sets = _count(con, kept, st)
    numeric, time_range, n_events = _describe(con, kept, [c for c in st.source_cols if st.event_cols[c] == "numeric"])
    (out / "vocab").mkdir(exist_ok=True)
    columns: dict[str, dict] = {}
    vocab_table: dict[str, str] = {}
    for k, (c, kind) in enumerate(st.event_cols.items()):
        if kind == "categorical":
            vocab_table[c] = f"v_{k}"
            n = _write_vocab(con, _counted(st, sets, c), out / "vocab" / f"{c}.parquet", f"v_{k}",
                             seed=seed and seed.path / "vocab" / f"{c}.parquet", add_counts=append)
            columns[c] = {"type": "categorical", "vocab_size": n}
        elif c in numeric:
            mean, std, lo, hi, nulls = numeric[c]
            # rounded: a parallel sum differs in the last bits from run to run
            columns[c] = {"type": "numeric", "mean": _round(mean), "std": _round(std), "min": lo, "max": hi,
                          "nulls": int(nulls)}
        else:
            mean, std, lo, hi, nulls = _attribute_stats(con, st, sets, c, n_events)
            columns[c] = {"type": "numeric", "mean": _round(mean), "std": _round(std), "min": lo, "max": hi,
                          "nulls": int(nulls)}
    if append:  # numeric statistics stay those of the first build: the models standardize with them
        columns = {c: (info if info["type"] == "categorical" else dict(seed.manifest["columns"][c]))
                   for c, info in columns.items()}

    # entity ids: every entity seen in events or in an entity attribute table, new ones ordered by id text
    _stage_entity_ids(con, spec, seed, add_events=append)
    n_entities = int(_one(con, "SELECT count(*) FROM entity_ids")[0])
    _write_entity_vocab(con, out)
    n_shards = n_shards or max(1, math.ceil(n_events / spec.shard_events))
    con.sql(f"CREATE OR REPLACE TEMP TABLE __ents AS SELECT v, id, before = 0 AS new, CAST(CAST(('0x' || "
            f"substr(md5(v), 1, 12)) AS UBIGINT) % {n_shards} AS INTEGER) AS shard FROM entity_ids WHERE events > before")
    entities = {int(s): (int(a), int(b)) for s, a, b in
                con.sql("SELECT shard, count(*), count(*) FILTER (WHERE new) FROM __ents GROUP BY 1").fetchall()}

    # events, encoded, sorted and streamed into one Arrow file per shard (entity ranges: see above)
    select, joins, codes, looked_up = _lookups(con, st, sets, vocab_table)
    lookups = _write_lookups(con, looked_up, columns, out)
    parts = _entity_parts(con, PART_EVENTS) if n_events > PART_EVENTS else [None]
    maxima = {ENTITY: n_entities - 1, **{c: info["vocab_size"] for c, info in columns.items()
                                          if info["type"] == "categorical"}}
    files = _ShardFiles(out, name, check=not exact,
                        stored=lambda schema: _stored_schema(schema, maxima, *time_range))
    try:
        for part in parts:
            where = "" if part is None else (f"e.id >= {part[0]} AND e.id < {part[1]} AND k.__entity >= {_lit(part[2])} "
                                             f"AND k.__entity <= {_lit(part[3])}")
            reader = con.sql(_encode_sql(kept, st, select, joins, codes, where, exact)).to_arrow_reader(BATCH_ROWS)
            try:
                files.write(reader)
            finally:
                reader.close()  # the connection runs nothing else while a result is open
        written = files.close()
    except BaseException:
        files.abandon()
        raise
    coverage = {}
    if st.attrs:  # events whose key finds an attributes row, events with a key
        row = _one(con, "SELECT " + ", ".join(
            f"(SELECT sum(c.n) FILTER (WHERE a.__key IS NOT NULL) FROM __counts c LEFT JOIN {a} a ON c.v = a.__key "
            f"WHERE c.__set = {sets[t.key]} AND c.v IS NOT NULL), "
            f"(SELECT sum(n) FROM __counts WHERE __set = {sets[t.key]} AND v IS NOT NULL)" for a, t, _ in st.attrs))
        coverage = {t.name: [int(row[2 * j] or 0), int(row[2 * j + 1] or 0)] for j, (_, t, _) in enumerate(st.attrs)}
    return {"columns": columns, "lookups": lookups, "coverage": coverage, "n_events": n_events, "n_entities": n_entities,
            "time_range": time_range,
            "n_shards": n_shards, "written": written, "entities": entities, "schema": files.schema}


def _count(con, kept: str, st: _Staged) -> dict[str, int]:
    """Temp table __counts (__set, v, n): the kept events per entity (set 0) and per value, as text, of every
    categorical and join-key column (set i, NULL values included). Returns column -> set. One GROUP BY
    per column in one statement (not GROUPING SETS, which materializes its input first)."""
    grouped = [c for c in st.source_cols if st.event_cols[c] == "categorical"] + [t.key for _, t, _ in st.attrs]
    sets = {c: i + 1 for i, c in enumerate(dict.fromkeys(grouped))}
    parts = [f"SELECT 0 AS __set, __entity AS v, count(*) AS n FROM {_q(kept)} GROUP BY 2"]
    parts += [f"SELECT {i}, CAST({_q(c)} AS VARCHAR), count(*) FROM {_q(kept)} GROUP BY 2" for c, i in sets.items()]
    con.sql(f"CREATE OR REPLACE TEMP TABLE __counts AS {' UNION ALL '.join(parts)}")
    return sets


def _counted(st: _Staged, sets: dict[str, int], column: str) -> str:
    """SQL of (v, n): the kept events per value (as text) of a categorical column; an attribute column's
    through the counts of its key."""
    if column in st.source_cols:
        return f"SELECT v, n FROM __counts WHERE __set = {sets[column]} AND v IS NOT NULL"
    a, t = next((a, t) for a, t, cols in st.attrs if column in cols)
    return (f"SELECT CAST(a.{_q(column)} AS VARCHAR) AS v, CAST(sum(c.n) AS BIGINT) AS n FROM __counts c "
            f"JOIN {a} a ON c.v = a.__key WHERE c.__set = {sets[t.key]} AND a.{_q(column)} IS NOT NULL GROUP BY 1")


def _describe(con, kept: str, numeric: list[str]) -> tuple[dict[str, tuple], tuple, int]:
    """(mean, std, min, max, nulls) of each numeric events column, the (first, last) event time and the
    number of events, over `kept`."""
    aggs = [f"min({_epoch_s('__ts')})", f"max({_epoch_s('__ts')})", "count(*)"]
    aggs += [f"{f}({_q(c)})" for c in numeric for f in ("avg", "stddev_pop", "min", "max", "count")]
    row = _one(con, f"SELECT {', '.join(aggs)} FROM {_q(kept)}")
    return {c: (*row[3 + 5 * i: 7 + 5 * i], row[2] - row[7 + 5 * i]) for i, c in enumerate(numeric)}, row[:2], int(row[2])


def _attribute_stats(con, st: _Staged, sets: dict[str, int], column: str, n_events: int) -> tuple:
    """(mean, std, min, max, nulls) of a numeric attribute column over the kept events, from the events per key."""
    a, t = next((a, t) for a, t, cols in st.attrs if column in cols)
    joined = (f"SELECT CAST(a.{_q(column)} AS DOUBLE) AS x, c.n FROM __counts c JOIN {a} a ON c.v = a.__key "
              f"WHERE c.__set = {sets[t.key]} AND a.{_q(column)} IS NOT NULL")
    mean, std, lo, hi, n = _one(con, f"WITH j AS ({joined}), m AS (SELECT sum(n * x) / sum(n) AS mean, sum(n) AS n, "
                                     f"min(x) AS lo, max(x) AS hi FROM j) "
                                     f"SELECT mean, (SELECT sqrt(sum(j.n * (j.x - m.mean) * (j.x - m.mean)) / m.n) FROM j), "
                                     f"lo, hi, n FROM m")
    return mean, std, lo, hi, n_events - int(n or 0)


def _lookups(con, st: _Staged, sets: dict[str, int], vocab_table: dict[str, str]
             ) -> tuple[list[str], str, list[str], dict[str, tuple[str, dict[str, str]]]]:
    """One small lookup table per categorical or join-key column: value -> its id and the encoded columns
    of the attributes joined on it. Returns the encoded columns' SELECT expressions (in st.event_cols
    order), the joins they need, per events column what tells its values apart (the id of a
    categorical value, a number itself) for the row hash, and the attributes that readers look up
    through the id of a categorical key instead of reading them per event: key -> (lookup table,
    {attribute column: its SELECT expression there}). Only attributes of a numeric key are stored with
    each event."""
    joins, expr, code, alias = "", {}, {}, {x: f"__x{n}" for n, x in enumerate(st.event_cols)}
    looked_up: dict[str, tuple[str, dict[str, str]]] = {}
    for c, i in sets.items():
        keyed = [(a, t, cols) for a, t, cols in st.attrs if t.key == c]
        categorical = st.event_cols[c] == "categorical"
        if categorical and not keyed:
            table = vocab_table[c]
        else:
            table = f"__l{i}"
            sel, lj = ["b.v"] + ["b.id AS __id"] * categorical, ""
            for a, t, cols in keyed:
                lj += f" LEFT JOIN {a} ON b.v = {a}.__key"
                for x in cols:
                    if st.event_cols[x] == "categorical":
                        lj += f" LEFT JOIN {vocab_table[x]} ON CAST({a}.{_q(x)} AS VARCHAR) = {vocab_table[x]}.v"
                        sel.append(f"{vocab_table[x]}.id AS {alias[x]}")
                    else:
                        sel.append(f"CAST({a}.{_q(x)} AS DOUBLE) AS {alias[x]}")
            base = vocab_table[c] if categorical else f"(SELECT v FROM __counts WHERE __set = {i} AND v IS NOT NULL)"
            con.sql(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT {', '.join(sel)} FROM {base} b{lj}")
        joins += f" LEFT JOIN {table} l{i} ON CAST(k.{_q(c)} AS VARCHAR) = l{i}.v"
        if categorical:
            code[c] = f"l{i}.{'id' if table == vocab_table[c] else '__id'}"
            expr[c] = f"CAST(coalesce({code[c]}, 0) AS INTEGER) AS {_q(c)}"
        for a, t, cols in keyed:
            for x in cols:
                expr[x] = (f"CAST(coalesce(l{i}.{alias[x]}, 0) AS INTEGER) AS {_q(x)}" if st.event_cols[x] == "categorical"
                           else f"CAST(coalesce(l{i}.{alias[x]}, 'NaN') AS FLOAT) AS {_q(x)}")
                if categorical:  # read through the key's id (_write_lookups), not stored per event
                    looked_up.setdefault(c, (table, {}))[1][x] = expr[x].replace(f"l{i}.", "")
    for c in st.source_cols:
        if st.event_cols[c] == "numeric":
            code[c] = f"k.{_q(c)}"
            expr[c] = f"CAST(coalesce(CAST(k.{_q(c)} AS DOUBLE), 'NaN') AS FLOAT) AS {_q(c)}"
    per_event = [expr[c] for c in st.event_cols if not any(c in xs for _, xs in looked_up.values())]
    return per_event, joins, [code[c] for c in st.source_cols], looked_up


def _write_lookups(con, looked_up: dict[str, tuple[str, dict[str, str]]], columns: dict, out: Path) -> list[dict]:
    """lookups/<n>.arrow: row i holds the encoded attributes of the key value with id i (row 0: a null or
    unseen key). An attribute is a function of its key, so storing it once per key value instead of
    once per event is what keeps the cache no bigger than its source."""
    (out / "lookups").mkdir(exist_ok=True)
    found = []
    for n, (key, (table, xs)) in enumerate(sorted(looked_up.items())):
        rows = con.sql(f"SELECT __id, {', '.join(xs.values())} FROM {table}").to_arrow_table()
        ids = _values(rows.column("__id")).astype(np.int64)
        size = columns[key]["vocab_size"] + 1
        arrays = {}
        for x in xs:
            fill = (0, np.int32) if columns[x]["type"] == "categorical" else (np.nan, np.float32)
            a = np.full(size, fill[0], dtype=fill[1])
            a[ids] = _values(rows.column(x))
            arrays[x] = a
        path = out / "lookups" / f"{n}.arrow"
        with ipc.new_file(str(path), pa.schema([(x, pa.from_numpy_dtype(a.dtype)) for x, a in arrays.items()]),
                          options=IPC_OPTIONS) as w:
            w.write_table(pa.table(arrays))
        found.append({"key": key, "file": f"lookups/{n}.arrow", "columns": list(xs)})
    return found


def _encode_sql(kept: str, st: _Staged, select: list[str], joins: str, codes: list[str], where: str, exact: bool) -> str:
    """The kept events encoded, ordered by (shard, entity, ts, row hash). The shard is a stable hash of the
    entity id, so an entity's events always go to the same shard, whatever the build. The row hash (of
    the time to the microsecond, the source and each column's id or number: equal for exact copies,
    which are all DISTINCT drops) orders the events of one entity in one second (a basket) the same way
    on every run, so the same inputs give the same bytes. `exact`: ties broken by every raw column."""
    raw = ["k.__ts", "k.__source"] + [f"k.{_q(c)}" for c in st.source_cols]
    order = ["__shard", "entity", "ts", "__h"] + raw * exact
    return (f"SELECT e.shard AS __shard, e.id AS entity, {_epoch_s('k.__ts')} AS ts, {''.join(c + ', ' for c in select)}"
            f"hash(epoch_us(k.__ts), k.__source{''.join(', ' + c for c in codes)}) AS __h "
            f"FROM {_q(kept)} k JOIN __ents e ON k.__entity = e.v{joins}"
            f"{' WHERE ' + where if where else ''} ORDER BY {', '.join(order)}")


def _entity_parts(con, max_events: int) -> list[tuple[int, int, str, str]]:
    """Ranges of entity ids [lo, hi) holding about `max_events` of this build's events each, with the first
    and last of their ids as text: a range is selected by its ids, and the text bounds (the same
    range on a fresh build, whose ids follow the text order) let the Parquet reader skip row groups."""
    table = con.sql("SELECT id, events - before AS n FROM entity_ids WHERE events > before ORDER BY id").to_arrow_table()
    ids, n = _values(table.column("id")), _values(table.column("n"))
    parts = math.ceil(int(n.sum()) / max_events)
    at = np.searchsorted(np.cumsum(n), int(n.sum()) * np.arange(1, parts) / parts, side="right")
    cuts = [int(ids[i]) for i in sorted(set(at.tolist())) if 0 < i < len(ids)]
    bounds = [int(ids[0]), *cuts, int(ids[-1]) + 1]
    which = "CASE " + " ".join(f"WHEN id < {b} THEN {j}" for j, b in enumerate(bounds[1:])) + " END"
    text = dict((j, (lo, hi)) for j, lo, hi in con.sql(f"SELECT {which} AS j, min(v), max(v) FROM __ents GROUP BY 1").fetchall())
    return [(lo, hi, *text[j]) for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if j in text]


_NUMPY = {pa.int8(): np.int8, pa.int16(): np.int16, pa.int32(): np.int32, pa.int64(): np.int64, pa.uint8(): np.uint8,
          pa.uint16(): np.uint16, pa.uint32(): np.uint32, pa.uint64(): np.uint64, pa.float32(): np.float32,
          pa.float64(): np.float64}


def _values(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numeric Arrow column without nulls as numpy, zero-copy from one chunk. Not `to_numpy`: in
    pyarrow 26 its first call imports pandas, 0.6 s and 50 MB a process that does not need it."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dtype = _NUMPY.get(arr.type)
    if dtype is None or arr.null_count:
        return arr.to_numpy(zero_copy_only=False)
    if not len(arr):
        return np.empty(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class _ShardFiles:
    """Streams (shard, entity, ts)-ordered batches into one Arrow file per shard, named name(shard), in
    record batches of exactly BATCH_ROWS rows (the last one shorter), so that the bytes do not depend on
    how the result was chunked. With `check`, raises _Tie at two rows equal on (entity, ts, row hash)."""

    def __init__(self, out: Path, name, check: bool, stored: Callable[[pa.Schema], pa.Schema]):
        self.out, self.name, self.check, self.stored = out, name, check, stored
        self.schema: pa.Schema | None = None
        self.open: dict[int, list] = {}  # shard -> [writer, pending batches, pending rows, rows written]
        self.last = None

    def write(self, reader: pa.RecordBatchReader) -> None:
        if self.schema is None:
            self.schema = self.stored(pa.schema([f for f in reader.schema if f.name not in ("__shard", "__h")]))
        for batch in reader:
            if not len(batch):
                continue
            if self.check:
                e, t, h = (_values(batch.column(c)) for c in ("entity", "ts", "__h"))
                if (np.any((e[1:] == e[:-1]) & (t[1:] == t[:-1]) & (h[1:] == h[:-1]))
                        or self.last == (e[0], t[0], h[0])):
                    raise _Tie()
                self.last = (e[-1], t[-1], h[-1])
            sid = _values(batch.column("__shard"))
            body = _to_stored(batch.drop_columns(["__shard", "__h"]), self.schema)
            cuts = np.flatnonzero(np.diff(sid)) + 1
            for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(sid)]):
                self._add(int(sid[lo]), body.slice(lo, hi - lo))

    def _add(self, shard: int, part: pa.RecordBatch) -> None:
        if shard not in self.open:
            writer = ipc.new_file(str(self.out / self.name(shard)), self.schema, options=IPC_OPTIONS)
            self.open[shard] = [writer, [], 0, 0]
        state = self.open[shard]
        state[1].append(part)
        state[2] += len(part)
        if state[2] >= BATCH_ROWS:
            self._flush(state, final=False)

    @staticmethod
    def _flush(state: list, final: bool) -> None:
        """Write the pending rows as batches of BATCH_ROWS (and the rest, when `final`). Each batch is
        copied into buffers of its own (pa.concat_batches): the IPC bytes of a slice depend on the
        buffer it was cut from, so slices of DuckDB's chunks would not give the same bytes twice."""
        writer, pending, rows, written = state
        while rows >= BATCH_ROWS or (final and rows):
            want, take = min(BATCH_ROWS, rows), []
            while want:
                head = pending[0]
                take.append(head.slice(0, want))
                if len(head) <= want:
                    pending.pop(0)
                else:
                    pending[0] = head.slice(want)
                want -= len(take[-1])
            batch = pa.concat_batches(take)
            writer.write_batch(batch)
            rows, written = rows - len(batch), written + len(batch)
        state[2], state[3] = rows, written

    def close(self) -> dict[int, tuple[str, int]]:
        """shard -> (file, rows) of every shard written."""
        for state in self.open.values():
            self._flush(state, final=True)
            state[0].close()
        return {s: (self.name(s), state[3]) for s, state in sorted(self.open.items())}

    def abandon(self) -> None:
        for s, state in self.open.items():
            try:
                state[0].close()
            except Exception:  # noqa: BLE001 - the file is removed anyway
                pass
            (self.out / self.name(s)).unlink(missing_ok=True)
        self.open = {}


def _build(con, spec: CacheSpec, out: Path, log, seed: "Cache | None" = None) -> dict:
    from models.quarantine import finish, summary

    st = _stage_events(con, spec, {t.name: t.files for t in spec.events})
    if st.stats["rows_in"] == 0:
        raise CacheError("the events sources hold no rows: nothing to train on; extract source partitions with data")
    if st.stats["rows_valid"] == 0:
        raise CacheError(f"every event row was quarantined ({summary(finish(st.stats, 0))}); fix the source data or "
                         f"the config")
    enc = _encode(con, spec, st, out, seed=seed, append=False)
    stats = finish(st.stats, enc["n_events"])
    n_shards = enc["n_shards"]
    shards = []
    for s in range(n_shards):  # every shard gets a file, so shard i is always manifest["shards"][i]
        if s not in enc["written"]:
            with ipc.new_file(str(out / f"shard-{s:05d}.arrow"), enc["schema"], options=IPC_OPTIONS):
                pass
        f, rows = enc["written"].get(s, (f"shard-{s:05d}.arrow", 0))
        shards.append({"files": [f], "rows": rows, "entities": enc["entities"].get(s, (0, 0))[0]})
    log(f"encoded {enc['n_events']:,} events into {n_shards} shard(s)")

    entity_columns = _write_entity_table(con, spec, out, seed)
    t_min, t_max = enc["time_range"]
    return {
        "entity": spec.entity,
        "entity_type": str(_entity_arrow_type(spec)),
        "n_entities": enc["n_entities"],
        "n_events": enc["n_events"],
        "time_range": [int(t_min), int(t_max)],
        "columns": enc["columns"],
        "lookups": enc["lookups"],
        "entity_columns": entity_columns,
        "shards": shards,
        "appends": 0,
        "dropped": {"null_entity": stats["null_entity"], "null_timestamp": stats["null_timestamp"]},
        "quarantine": stats,
        "join_counts": enc["coverage"],
        "join_coverage": _coverage(enc["coverage"]),
        "sources": {t.name: sorted(t.files) for t in spec.events + spec.entity_attributes + spec.attributes},
    }


def _append(con, spec: CacheSpec, prev: "Cache", files: dict[str, list[str]], out: Path, log) -> dict:
    """Encode only the events of new files and add them to `prev`'s shards, which are hard-linked
    (never copied, never modified): past events are not read, let alone re-encoded."""
    from models.quarantine import finish

    st = _stage_events(con, spec, files)
    pm = prev.manifest
    seq = pm.get("appends", 0) + 1
    n_shards = len(pm["shards"])
    # (no valid rows: nothing to write; the vocabularies and entity ids are those of `prev`)
    enc = _encode(con, spec, st, out, seed=prev, append=True, n_shards=n_shards,
                  name=lambda s: f"shard-{s:05d}-{seq:04d}.arrow")
    stats = finish(st.stats, enc["n_events"])
    delta = {s: (f, rows, enc["entities"].get(s, (0, 0))[1]) for s, (f, rows) in enc["written"].items()}
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
        lo, hi = enc["time_range"]
        t_min, t_max = min(t_min, int(lo)), max(t_max, int(hi))
    coverage = enc["coverage"]
    counts = {name: [a + b for a, b in zip(pm["join_counts"].get(name, [0, 0]), coverage.get(name, [0, 0]))]
              for name in set(pm["join_counts"]) | set(coverage)}
    return {
        **{k: pm[k] for k in ("entity", "entity_type")},
        "n_entities": enc["n_entities"],
        "n_events": pm["n_events"] + n_new,
        "time_range": [t_min, t_max],
        "columns": enc["columns"],
        "lookups": enc["lookups"],
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


def _write_vocab(con, counted_sql: str, path: Path, table: str, seed: Path | None = None, add_counts: bool = False) -> int:
    """Write value -> id (1..n) and the value's count; create temp table `table` (v, id) for encoding.
    `counted_sql` gives (v, n): each non-null value and its count. Without a seed, ids go by count
    (descending), then value. With one, the seed's values keep their ids and new values follow them;
    counts are recounted, or added to the seed's with `add_counts`."""
    counted = f"SELECT v, CAST(n AS BIGINT) AS n FROM ({counted_sql})"
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
    vocab = con.sql(f"SELECT v AS value, id, count FROM {table} ORDER BY id").to_arrow_table()
    pq.write_table(vocab, path, compression="zstd")
    return len(vocab)


def _stage_entity_ids(con, spec: CacheSpec, seed: "Cache | None", add_events: bool = False) -> None:
    """Temp table entity_ids (v, id, events, before): every entity of the events (from __counts) and the
    entity attribute tables; a seed's entities keep their ids; `before` = events the entity had before
    this build."""
    ent = _q(spec.entity)
    counted = "SELECT v, n FROM __counts WHERE __set = 0"
    others = [f"SELECT DISTINCT CAST({ent} AS VARCHAR) AS v FROM {_files_sql(t.files)}" for t in spec.entity_attributes]
    if others:
        counted = (f"SELECT s.v, coalesce(c.n, 0) AS n FROM (SELECT v FROM ({' UNION '.join([f'SELECT v FROM ({counted})'] + others)}) "
                   f"WHERE v IS NOT NULL) s LEFT JOIN ({counted}) c ON s.v = c.v")
    con.sql(f"CREATE OR REPLACE TEMP TABLE __seen AS {counted}")
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
                   out / "vocab" / "__entity.parquet", compression="zstd")


def _entity_arrow_type(spec: CacheSpec) -> pa.DataType:
    schema = pq.read_schema(spec.events[0].files[0])
    if spec.entity not in schema.names:
        raise CacheError(f"entity column {spec.entity!r} is not in source {spec.events[0].name!r} "
                         f"(columns: {schema.names}); set `entity:` in the project config")
    return schema.field(spec.entity).type


def _merge_shard_files(paths: list[Path], out: Path) -> None:
    """Merge sorted pieces of one shard into one (entity, ts)-sorted file (a stable sort: earlier
    pieces first among equal timestamps)."""
    table = _read_sorted(paths)
    ts = table.column(TS)
    maxima = {f.name: pc.max(table.column(f.name)).as_py() or 0 for f in table.schema if f.type == pa.int32()}
    schema = _stored_schema(table.schema, maxima, pc.min(ts).as_py() or 0, pc.max(ts).as_py() or 0)
    with ipc.new_file(str(out), schema, options=IPC_OPTIONS) as w:
        for batch in table.to_batches(BATCH_ROWS):
            w.write_batch(_to_stored(batch, schema))


def _narrowest(largest: int) -> pa.DataType:
    return pa.uint8() if largest < 1 << 8 else pa.uint16() if largest < 1 << 16 else pa.int32()


def _stored_schema(schema: pa.Schema, maxima: dict[str, int], t_min: int, t_max: int) -> pa.Schema:
    """The schema a shard file is written with: each id column of `maxima` in the narrowest unsigned type
    that holds its largest id, `ts` as uint32 seconds after t_min (int64 for a span over 136 years), the
    base in the schema's metadata. Compressed, this halves the ids and times (the cache stays no bigger
    than its source Parquet)."""
    fields = [pa.field(f.name, _narrowest(maxima[f.name])) if f.name in maxima
              else pa.field(TS, pa.uint32() if t_max - t_min < 1 << 32 else pa.int64()) if f.name == TS else f
              for f in schema]
    return pa.schema(fields, metadata={b"habitus.ts_base": str(int(t_min)).encode()})


def _to_stored(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    base = int(schema.metadata[b"habitus.ts_base"])
    arrays = [(pc.subtract(batch.column(TS), base) if f.name == TS else batch.column(f.name)).cast(f.type)
              for f in schema]  # a safe cast: a value that does not fit raises, it is never wrapped
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _widen(table: pa.Table) -> pa.Table:
    """A shard file's columns as readers get them (see _stored_schema)."""
    base = int(table.schema.metadata[b"habitus.ts_base"])
    columns = [pc.add(table.column(TS).cast(pa.int64()), base) if f.name == TS
               else table.column(f.name).cast(pa.int32()) if pa.types.is_unsigned_integer(f.type)
               else table.column(f.name) for f in table.schema]
    return pa.table(columns, names=table.column_names)


def _read_sorted(paths: list[Path]) -> pa.Table:
    tables = [_widen(ipc.open_file(pa.memory_map(str(p))).read_all()) for p in paths]
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
                n = _write_vocab(con, f"SELECT v, count(*) AS n FROM (SELECT CAST({_q(c)} AS VARCHAR) AS v FROM "
                                      f"{_files_sql(t.files)}) WHERE v IS NOT NULL GROUP BY v",
                                 out / "vocab" / f"entity.{c}.parquet", vt,
                                 seed=seed and seed.path / "vocab" / f"entity.{c}.parquet")
                joins += f" LEFT JOIN {vt} ON CAST({alias}.{_q(c)} AS VARCHAR) = {vt}.v"
                sel.append(f"CAST(coalesce({vt}.id, 0) AS INTEGER) AS {_q(c)}")
                info[c] = {"type": "categorical", "vocab_size": n}
            else:  # nulls -> NaN, so columns map to numpy without copies or masks
                x = _epoch_s(_utc(f"{alias}.{_q(c)}", _field_type(t, c))) if kind == "timestamp" else f"{alias}.{_q(c)}"
                sel.append(f"coalesce(CAST({x} AS DOUBLE), 'NaN') AS {_q(c)}")
                info[c] = {"type": "timestamp" if kind == "timestamp" else "numeric"}
    table = con.sql(f"SELECT {', '.join(sel)} FROM entity_ids ids{joins} ORDER BY ids.id").to_arrow_table()
    for c, meta in info.items():
        if meta["type"] != "categorical":
            col = _values(table.column(c))
            meta.update(mean=float(np.nanmean(col)) if np.isfinite(col).any() else 0.0,
                        std=float(np.nanstd(col)) if np.isfinite(col).any() else 1.0)
    with ipc.new_file(str(path), table.schema, options=IPC_OPTIONS) as w:
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
        self._lookups: dict[str, dict[str, np.ndarray]] = {}

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
        self._last = None  # (let the previous shard go before the next is read: one in memory at a time)
        shard = self._read_shard(i)
        self._last = (i, shard)
        return shard

    def _read_shard(self, i: int) -> Shard:
        table = _read_sorted([self.path / f for f in self.manifest["shards"][i]["files"]])
        cols = {c: table.column(c).to_numpy() for c in table.column_names if c in self.columns}
        for lookup in self.manifest["lookups"]:  # attributes through their key's id
            for c, values in self._lookup(lookup["file"]).items():
                cols[c] = values[cols[lookup["key"]]]
        cols = {c: cols[c] for c in self.columns}
        entity = table.column("entity").to_numpy()
        cut = np.flatnonzero(np.diff(entity)) + 1
        starts = np.r_[0, cut, len(entity)].astype(np.int64)
        return Shard(entity=entity, ts=table.column("ts").to_numpy(), columns=cols,
                     entities=entity[starts[:-1]] if len(entity) else entity[:0], starts=starts)

    def _lookup(self, file: str) -> dict[str, np.ndarray]:
        """One key's attribute table (small: a row per key value), read once while the cache is open."""
        if file not in self._lookups:
            table = ipc.open_file(pa.memory_map(str(self.path / file))).read_all()
            self._lookups[file] = {c: table.column(c).to_numpy() for c in table.column_names}
        return self._lookups[file]

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
