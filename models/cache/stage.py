"""The first passes of a build over the events: `screen` (the views of every event source and of the
rows the quarantine keeps, one temp table per attributes source), `count` and `describe` (see
habitus.models.cache.encode for the whole sequence)."""

import time
from dataclasses import dataclass

import pyarrow as pa

from habitus.models.cache.quarantine import screen
from habitus.models.cache.spec import CacheError, CacheSpec, TableInput
from habitus.models.cache.sql import _column_sql, _epoch_s, _field_type, _files_sql, _one, _q, _utc


# how a column type is encoded: a time as a number of seconds, a text as a value of a vocabulary (its
# vectors: habitus.models.cache.text)
STORED_AS = {"timestamp": "numeric", "text": "categorical"}


@dataclass
class _Staged:
    stats: dict  # quarantine counts of habitus.models.cache.quarantine.screen (duplicates not counted yet)
    event_cols: dict[str, str]  # column -> categorical | numeric: the events' own, then the attributes'
    source_cols: list[str]  # the events' own columns
    attrs: list[tuple[str, TableInput, list[str]]]  # (temp table with one row per key, source, its columns)
    valid: str  # view of the rows that pass the quarantine (exact copies not dropped yet)


def _stage_events(con, spec: CacheSpec, files: dict[str, list[str]]) -> _Staged:
    """Views `raw_events` (every event source as one stream, the entity id as text) and the quarantine's
    `raw_events_valid`; one temp table per attributes source (one row per key: duplicate keys would
    copy events)."""
    ent = _q(spec.entity)
    for t in spec.events + spec.attributes:
        for c, kind in t.columns.items():
            if kind == "text" and not (pa.types.is_string(_field_type(t, c)) or pa.types.is_large_string(_field_type(t, c))):
                raise CacheError(f"column {c!r} of source {t.name!r} has `type: text` but holds {_field_type(t, c)}, "
                                 f"not strings; give it another type under `types:` (categorical, numeric)")
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
            event_cols.setdefault(c, STORED_AS.get(kind, kind))
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
            event_cols[c] = STORED_AS.get(kind, kind)
        picks = "".join(f", any_value({_epoch_s(_utc(_q(c), _field_type(t, c))) if t.columns[c] == 'timestamp' else _q(c)}) "
                        f"AS {_q(c)}" for c in cols)
        con.sql(f"CREATE OR REPLACE TEMP TABLE __a{j} AS SELECT CAST({_q(t.key)} AS VARCHAR) AS __key{picks} "
                f"FROM {_files_sql(t.files)} GROUP BY 1")
        attrs.append((f"__a{j}", t, cols))
    return _Staged(stats=stats, event_cols=event_cols, source_cols=source_cols, attrs=attrs, valid=valid)


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
