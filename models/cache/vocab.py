"""Vocabularies (value -> id), entity ids and the entity table of a build, seeded by the previous
version's so that a value or entity keeps its id."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from habitus.models.cache.reader import Cache
from habitus.models.cache.spec import CacheError, CacheSpec
from habitus.models.cache.sql import _epoch_s, _field_type, _files_sql, _q, _utc
from habitus.models.cache.stored import _values


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
            if kind in ("categorical", "text"):  # (an entity's text: a category, no vector)
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
    # uncompressed and one record batch: readers memory-map it and view its columns without a copy
    # (Cache.entity_table), so 18M entities' attributes are pages of a file, not the process's memory
    with ipc.new_file(str(path), table.schema, options=ipc.IpcWriteOptions(compression=None)) as w:
        w.write_table(table.combine_chunks())
    return info
