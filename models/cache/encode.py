"""Encoding the events of a build: vocabularies and entity ids from the counts, lookup tables, and the
events encoded, sorted and streamed into the shard files.

A build reads the events with a few DuckDB statements, each streaming the Parquet files (nothing the
size of the events is materialized, in DuckDB or in Python):

  screen    the quarantine's counts by reason (habitus.models.cache.quarantine.screen: one grouped pass); the view
            of the valid rows repeats only the rules that dropped or repaired something, so on clean
            data the passes below read the Parquet as plainly as a scan
  count     kept events per entity and per value of every categorical and join-key column (one
            GROUP BY each, one statement): the vocabularies, entity ids, join coverage and the
            attribute columns' counts and statistics come from these counts and the small
            attribute tables, never from joining the events
  describe  the numeric columns' statistics, the time range, the number of events
  encode    ids through small lookup tables (one join per categorical or key column, the attributes
            riding on their key's), sorted by (shard, entity, ts, row hash) and streamed into the
            shard files, in ranges of entities of about `part_events` events: DuckDB's sort, the
            largest cost in time and memory, stays the same size whatever the data's, and on
            entity-sorted Parquet (as extracted) each range reads only the row groups it needs

Exact copies of a row (the quarantine's duplicate_event) sort next to each other in `encode` (same
entity, time and row hash). Without any (the usual case) nothing more is needed. With some, or with a
64-bit hash collision within one entity and second, `count`, `describe` and `encode` run again over
the DISTINCT rows, ordered by every column: always exact, only slower for data that has duplicates.
"""

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from habitus.models.cache.reader import Cache
from habitus.models.cache.shards import _ShardFiles, _Tie
from habitus.models.cache.spec import ENTITY, CacheSpec
from habitus.models.cache.sql import _epoch_s, _lit, _one, _q
from habitus.models.cache.stage import _attribute_stats, _count, _counted, _describe, _Staged
from habitus.models.cache.stored import BATCH_ROWS, IPC_OPTIONS, _stored_schema, _values
from habitus.models.cache.vocab import _stage_entity_ids, _write_entity_vocab, _write_vocab
from habitus.models.cache.text import write_encoder

PART_EVENTS = 2_000_000  # events sorted at a time (~150 MB of DuckDB sort); build_cache(part_events=...)


def _encode(con, spec: CacheSpec, st: _Staged, out: Path, *, seed: "Cache | None", append: bool, n_shards=None,
            name=lambda s: f"shard-{s:05d}.arrow", part_events: int) -> dict:
    """Passes 2 and 3 over the valid rows; again over the DISTINCT rows when some are exact copies."""
    try:
        return _encode_kept(con, spec, st, st.valid, out, seed=seed, append=append, n_shards=n_shards, name=name,
                            exact=False, part_events=part_events)
    except _Tie:
        # exact copies (or a hash collision): drop them the quarantine's way and order by every column
        con.sql(f"CREATE OR REPLACE TEMP TABLE __distinct AS SELECT DISTINCT * FROM {_q(st.valid)}")
        return _encode_kept(con, spec, st, "__distinct", out, seed=seed, append=append, n_shards=n_shards,
                            name=name, exact=True, part_events=part_events)


def _encode_kept(con, spec: CacheSpec, st: _Staged, kept: str, out: Path, *, seed, append: bool, n_shards, name,
                 exact: bool, part_events: int) -> dict:
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
    for c in text_columns(spec):  # a text column's vectors: its encoder, fitted once (habitus.models.cache.text)
        texts = pq.read_table(out / "vocab" / f"{c}.parquet", columns=["value"]).column("value").to_pylist()
        columns[c]["text"] = write_encoder(out, c, texts, seed and seed.path)
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
    parts = _entity_parts(con, part_events) if n_events > part_events else [None]
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


def text_columns(spec: CacheSpec) -> list[str]:
    """The events' and attribute tables' columns of type text."""
    return sorted({c for t in spec.events + spec.attributes for c, kind in t.columns.items() if kind == "text"})


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


def _round(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.12g}")


def _coverage(counts: dict) -> dict:
    return {name: round(hits / keys, 6) if keys else 0.0 for name, (hits, keys) in counts.items()}
