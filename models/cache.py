"""The training cache: source Parquet encoded for the model, sharded, memory-mapped.

Layout of one cache version, `<root>/<fingerprint[:16]>/`:

    manifest.json          written last; a folder without it is not a cache
    entities.arrow         one row per entity id (0..N-1): encoded entity attributes
    vocab/<column>.parquet value -> id (1..n, most frequent first; 0 = null / unseen)
    shard-00000.arrow ...  events sorted by (entity, ts), split by a stable hash of the entity id

Event columns: `entity` int32, `ts` int64 seconds, one int32 per categorical column (item
attributes joined in through their key), one float32 per numeric column. Arrow IPC files are
uncompressed so that reading them is a memory map, not a copy.

The fingerprint covers the inputs' content and the encoding settings: same inputs, same cache.
"""

import functools
import math
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

CACHE_FORMAT = 1
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


def build_cache(spec: CacheSpec, root: str | Path, *, log: Callable[[str], None] = print, keep: int = 2) -> Path:
    """Build (or reuse) the cache for `spec` under `root`; returns its folder."""
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
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        spill = tmp / "_spill"
        con = duckdb.connect(config={"temp_directory": str(spill)})
        try:
            manifest = _build(con, spec, tmp, log)
        finally:
            con.close()
            shutil.rmtree(spill, ignore_errors=True)
        manifest.update(fingerprint=fp, format=CACHE_FORMAT, build_seconds=round(time.time() - started, 3))
        write_json(tmp / "manifest.json", manifest)
    _prune(root, keep=keep, current=out)
    log(f"cache built in {time.time() - started:.1f}s: {manifest['n_events']:,} events, "
        f"{manifest['n_entities']:,} entities, {len(manifest['shards'])} shard(s) at {out}")
    return out


def _prune(root: Path, keep: int, current: Path) -> None:
    versions = sorted((p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").exists()),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in versions[keep:]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


def _build(con, spec: CacheSpec, out: Path, log) -> dict:
    ent = _q(spec.entity)
    # 1. all event sources as one stream with the entity id as text (ids keep one type across sources)
    parts = []
    for i, t in enumerate(spec.events):
        cols = "".join(f", {_q(c)}" for c in t.columns)
        parts.append(f"SELECT CAST({ent} AS VARCHAR) AS __entity, {_utc(_q(t.timestamp), _field_type(t, t.timestamp))} AS __ts, "
                     f"{i} AS __source{cols} FROM {_files_sql(t.files)}")
    con.sql("CREATE TEMP VIEW raw_events AS " + " UNION ALL BY NAME ".join(parts))
    row = _one(con, "SELECT count(*), count(*) FILTER (WHERE __entity IS NULL), "
                      "count(*) FILTER (WHERE __ts IS NULL) FROM raw_events")
    stats = dict(zip(("rows", "null_entity", "null_ts"), map(int, row)))
    if stats["rows"] == 0:
        raise CacheError("the events sources hold no rows: nothing to train on")

    # 2. item attributes joined through their key (one row per key: duplicates would copy events)
    event_cols: dict[str, str] = {}
    for t in spec.events:
        for c, kind in t.columns.items():
            event_cols.setdefault(c, kind)
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
    select_cols = [f"e.{_q(c)}" for t in spec.events for c in t.columns]
    select_cols = list(dict.fromkeys(select_cols))
    from_sql = "raw_events e"
    for alias, t, cols, sub in joins:
        from_sql += f" LEFT JOIN ({sub}) {alias} ON CAST(e.{_q(t.key)} AS VARCHAR) = {alias}.__key"
        select_cols += [f"{alias}.{_q(c)}" for c in cols]
        hit = _one(con, f"SELECT count(*) FILTER (WHERE {alias}.__key IS NOT NULL), count(e.{_q(t.key)}) "
                          f"FROM raw_events e LEFT JOIN ({sub}) {alias} ON CAST(e.{_q(t.key)} AS VARCHAR) = {alias}.__key"
                          )
        coverage[t.name] = round(hit[0] / hit[1], 6) if hit[1] else 0.0
    con.sql(f"CREATE TEMP TABLE events AS SELECT e.__entity, e.__ts, e.__source, {', '.join(select_cols)} "
                f"FROM {from_sql} WHERE e.__entity IS NOT NULL AND e.__ts IS NOT NULL")

    # 3. vocabularies: most frequent value first, ties by value, so ids are deterministic
    (out / "vocab").mkdir()
    columns: dict[str, dict] = {}
    for c, kind in event_cols.items():
        if kind == "categorical":
            n = _write_vocab(con, f"SELECT CAST({_q(c)} AS VARCHAR) AS v FROM events", out / "vocab" / f"{c}.parquet", f"v_{len(columns)}")
            columns[c] = {"type": "categorical", "vocab_size": n}
        else:
            mean, std, lo, hi, nulls = _one(
                con, f"SELECT avg(x), stddev_pop(x), min(x), max(x), count(*) - count(x) FROM "
                     f"(SELECT CAST({_q(c)} AS DOUBLE) AS x FROM events)")
            columns[c] = {"type": "numeric", "mean": mean, "std": std, "min": lo, "max": hi, "nulls": int(nulls)}

    # 4. entity ids: every entity seen in events or in an entity attribute table, ordered by id text
    ent_sources = ["SELECT DISTINCT __entity AS v FROM events"] + [
        f"SELECT DISTINCT CAST({ent} AS VARCHAR) AS v FROM {_files_sql(t.files)}" for t in spec.entity_attributes]
    con.sql(f"CREATE TEMP TABLE entity_ids AS SELECT v, CAST(row_number() OVER (ORDER BY v) - 1 AS INTEGER) AS id "
                f"FROM ({' UNION '.join(ent_sources)}) WHERE v IS NOT NULL")
    n_entities = _one(con, "SELECT count(*) FROM entity_ids")[0]
    entity_type = _entity_arrow_type(spec)
    pq.write_table(con.sql("SELECT v AS value, id FROM entity_ids ORDER BY id").to_arrow_table(), out / "vocab" / "__entity.parquet")

    # 5. events, encoded, sorted by (shard, entity, ts) and streamed into one Arrow file per shard
    n_events = _one(con, "SELECT count(*) FROM events")[0]
    n_shards = max(1, math.ceil(n_events / spec.shard_events))
    enc = ["CAST(ids.id AS INTEGER) AS entity", f"{_epoch_s('e.__ts')} AS ts"]
    vjoins = ""
    for k, (c, info) in enumerate(columns.items()):
        if info["type"] == "categorical":
            vjoins += f" LEFT JOIN v_{k} ON CAST(e.{_q(c)} AS VARCHAR) = v_{k}.v"
            enc.append(f"CAST(coalesce(v_{k}.id, 0) AS INTEGER) AS {_q(c)}")
        else:
            enc.append(f"CAST(coalesce(CAST(e.{_q(c)} AS DOUBLE), 'NaN') AS FLOAT) AS {_q(c)}")
    shard_expr = f"CAST(('0x' || substr(md5(e.__entity), 1, 12)) AS UBIGINT) % {n_shards}"
    sql = (f"SELECT {shard_expr} AS __shard, {', '.join(enc)} FROM events e JOIN entity_ids ids ON e.__entity = ids.v"
           f"{vjoins} ORDER BY __shard, entity, ts")
    shards = _write_shards(con.sql(sql).to_arrow_reader(1 << 16), out, n_shards)
    log(f"encoded {n_events:,} events into {n_shards} shard(s)")

    # 6. entity attributes, one row per entity id
    entity_columns = _write_entity_table(con, spec, out / "entities.arrow")
    t_min, t_max = _one(con, f"SELECT min({_epoch_s('__ts')}), max({_epoch_s('__ts')}) FROM events")
    return {
        "entity": spec.entity,
        "entity_type": str(entity_type),
        "n_entities": int(n_entities),
        "n_events": int(n_events),
        "time_range": [int(t_min), int(t_max)],
        "columns": columns,
        "entity_columns": entity_columns,
        "shards": shards,
        "dropped": {"null_entity": stats["null_entity"], "null_timestamp": stats["null_ts"]},
        "join_coverage": coverage,
        "sources": {t.name: sorted(t.files) for t in spec.events + spec.entity_attributes + spec.attributes},
    }


def _one(con, sql: str) -> tuple:
    """The single row of a query (DuckDB 2 relations keep no cursor, so fetch all of one row)."""
    return con.sql(sql).fetchall()[0]


def _write_vocab(con, values_sql: str, path: Path, table: str) -> int:
    con.sql(f"CREATE TEMP TABLE {table} AS SELECT v, CAST(row_number() OVER (ORDER BY count(*) DESC, v) AS INTEGER) AS id, "
                f"count(*) AS count FROM ({values_sql}) WHERE v IS NOT NULL GROUP BY v")
    pq.write_table(con.sql(f"SELECT v AS value, id, count FROM {table} ORDER BY id").to_arrow_table(), path)
    return int(_one(con, f"SELECT count(*) FROM {table}")[0])


def _entity_arrow_type(spec: CacheSpec) -> pa.DataType:
    schema = pq.read_schema(spec.events[0].files[0])
    if spec.entity not in schema.names:
        raise CacheError(f"entity column {spec.entity!r} is not in source {spec.events[0].name!r} "
                         f"(columns: {schema.names}); set `entity:` in the project config")
    return schema.field(spec.entity).type


def _write_shards(reader: pa.RecordBatchReader, out: Path, n_shards: int) -> list[dict]:
    shards, writer, current, rows, ents = [], None, None, 0, 0
    last_entity = None

    def close():
        nonlocal writer
        if writer is not None:
            writer.close()
            shards.append({"file": f"shard-{current:05d}.arrow", "rows": rows, "entities": ents})
            writer = None

    for batch in reader:
        sid = batch.column("__shard").to_numpy()
        cuts = np.flatnonzero(np.diff(sid)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(sid)]):
            part = batch.slice(lo, hi - lo).drop_columns(["__shard"])
            if writer is None or sid[lo] != current:
                close()
                current, rows, ents, last_entity = int(sid[lo]), 0, 0, None
                writer = ipc.new_file(str(out / f"shard-{current:05d}.arrow"), part.schema)
            e = part.column("entity").to_numpy()
            ents += int(np.count_nonzero(np.diff(e))) + 1 - (1 if last_entity == e[0] else 0)
            last_entity = e[-1]
            writer.write_batch(part)
            rows += len(part)
    close()
    return shards


def _write_entity_table(con, spec: CacheSpec, path: Path) -> dict:
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
                                 path.parent / "vocab" / f"entity.{c}.parquet", vt)
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
    if isinstance(table, pa.RecordBatchReader):
        table = table.read_all()
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
        self.manifest = read_json(mf)
        self.fingerprint: str = self.manifest["fingerprint"]
        self.columns: dict[str, dict] = self.manifest["columns"]
        self.entity_columns: dict[str, dict] = self.manifest["entity_columns"]
        self.n_entities: int = self.manifest["n_entities"]
        self.time_range: tuple[int, int] = tuple(self.manifest["time_range"])

    @property
    def shard_count(self) -> int:
        return len(self.manifest["shards"])

    def shard(self, i: int) -> Shard:
        table = ipc.open_file(pa.memory_map(str(self.path / self.manifest["shards"][i]["file"]))).read_all()
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
