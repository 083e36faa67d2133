"""`habitus init`: look at a connection's tables and print a suggested project config.

For each table it reads the schema, the time range and a bounded sample of rows through the
connection's own resource (the same streamed `read` the source assets use, so it works on every
connector), profiles each column (type, nulls, distinct values, value formats) and suggests:

- the events table (a timestamp and many rows per entity) and its timestamp column,
- the entity column (repeated in the events, unique in a table of its own),
- per column: categorical, numeric, high-cardinality categorical, or left out (constant, all null,
  unique per row, or one-to-one with another kept column), with the reason,
- entity attribute tables (keyed by the entity) and attribute tables with their join keys,

and warns where the join keys of events and attributes differ in type or in format (a join that
would silently find nothing). Nothing is written unless --out is given.
"""

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
import yaml

ENTITY_HINTS = ("customer", "user", "client", "member", "account", "visitor", "household", "person", "player",
                "subscriber", "patient", "device", "card")
TIME_HINTS = ("ts", "timestamp", "event_time", "time", "created_at", "occurred_at", "date", "datetime")
HIGH_CARDINALITY = 10_000  # distinct values above which a categorical column is hashed into buckets


@dataclass
class ColumnProfile:
    name: str
    type: pa.DataType
    rows: int
    nulls: int
    distinct: int
    examples: list = field(default_factory=list)

    @property
    def kind(self) -> str:
        t = self.type
        if pa.types.is_timestamp(t) or pa.types.is_date(t):
            return "time"
        if pa.types.is_boolean(t):
            return "bool"
        if pa.types.is_integer(t):
            return "int"
        if pa.types.is_floating(t) or pa.types.is_decimal(t):
            return "float"
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
            return "string"
        return "other"

    @property
    def non_null(self) -> int:
        return self.rows - self.nulls

    @property
    def unique(self) -> bool:
        return self.non_null > 1 and self.distinct == self.non_null

    @property
    def id_like(self) -> bool:
        n = self.name.lower()
        return bool(re.search(r"(^|_)(id|key|code|uuid|sku|number|no)$", n)) or n.endswith("id")


@dataclass
class TableProfile:
    table: str
    rows: int  # rows sampled
    capped: bool  # the sample stopped at --sample rows
    columns: dict[str, ColumnProfile]
    time_range: dict[str, tuple] = field(default_factory=dict)
    one_to_one: list[tuple[str, str]] = field(default_factory=list)

    def times(self) -> list[ColumnProfile]:
        return [c for c in self.columns.values() if c.kind == "time" and c.non_null]


# --------------------------------------------------------------------------- profiling

# the columns of habitus's own outputs (predictions written back to the warehouse, embeddings)
OUTPUT_COLUMNS = {"model_fingerprint", "as_of"}


def _scalar(t: pa.DataType) -> bool:
    return not (pa.types.is_nested(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)
                or pa.types.is_fixed_size_binary(t) or pa.types.is_null(t))


def habitus_output(warehouse, table: str) -> bool:
    """A table habitus wrote itself (predictions.sink): its scores are outputs, never inputs."""
    return OUTPUT_COLUMNS <= set(warehouse.schema(table).names)


def _sample(warehouse, table: str, limit: int) -> tuple[pa.Table, bool]:
    batches, n = [], 0
    reader = warehouse.read(table, batch_rows=min(limit, 65_536))
    try:
        for b in reader:
            batches.append(b)
            n += len(b)
            if n >= limit:
                return pa.Table.from_batches(batches).slice(0, limit), True
    finally:
        if hasattr(reader, "close"):
            reader.close()
    return (pa.Table.from_batches(batches) if batches else warehouse.schema(table).empty_table()), False


def profile_table(warehouse, table: str, sample_rows: int = 100_000) -> TableProfile:
    data, capped = _sample(warehouse, table, sample_rows)
    cols = {}
    for name in data.column_names:
        col = data.column(name)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        if _scalar(col.type):
            distinct = pc.count_distinct(col, mode="only_valid").as_py() if len(col) else 0
            examples = pc.unique(col.drop_null().slice(0, 1000)).to_pylist()[:3] if len(col) else []
        else:  # lists, structs, maps: no distinct count (Arrow has no kernel); the model does not use them
            distinct, examples = -1, col.drop_null().slice(0, 3).to_pylist()
        cols[name] = ColumnProfile(name, data.schema.field(name).type, len(col), col.null_count, distinct, examples)
    prof = TableProfile(table, data.num_rows, capped, cols)
    for c in prof.times():
        try:
            prof.time_range[c.name] = warehouse.time_range(table, c.name)
        except Exception:  # a sample's min/max is the fallback
            prof.time_range[c.name] = (pc.min(data.column(c.name)).as_py(), pc.max(data.column(c.name)).as_py())
    # columns that carry the same information: equal distinct counts and as many distinct pairs
    candidates = [c for c in cols.values() if c.kind in ("string", "int") and 1 < c.distinct < c.non_null]
    for i, a in enumerate(candidates):
        for b in candidates[i + 1:]:
            if a.distinct == b.distinct:
                pairs = data.select([a.name, b.name]).drop_null().group_by([a.name, b.name]).aggregate([]).num_rows
                if pairs == a.distinct:
                    prof.one_to_one.append((a.name, b.name))
    return prof


# --------------------------------------------------------------------------- suggesting


def _time_column(p: TableProfile) -> ColumnProfile | None:
    times = p.times()
    if not times:
        return None

    def score(c):
        n = c.name.lower()
        hint = 2 if n in TIME_HINTS else 1 if any(n.endswith(h) or n.startswith(h) for h in TIME_HINTS) else 0
        return (pa.types.is_timestamp(c.type), hint, c.distinct)
    return max(times, key=score)


def _entity_candidates(events: TableProfile, others: list[TableProfile]) -> list[tuple[int, str]]:
    out = []
    for c in events.columns.values():
        if c.kind not in ("string", "int") or c.unique or c.distinct < 2:
            continue
        keyed = [o for o in others if c.name in o.columns and o.columns[c.name].unique]
        n = c.name.lower()
        score = 3 * any(h in n for h in ENTITY_HINTS) + 2 * bool(keyed) + c.id_like
        if score:
            out.append((score, c.name))
    return sorted(out, reverse=True)


def _key_format(values: list) -> str:
    """A value's shape: letters as A, digits as 9 (runs collapsed), e.g. 'C000123' -> 'A9'."""
    shapes = {re.sub(r"9+", "9", re.sub(r"[A-Za-z]+", "A", re.sub(r"\d", "9", str(v)))) for v in values[:50]}
    return "/".join(sorted(shapes)) if len(shapes) <= 3 else "mixed"


def join_warnings(events: TableProfile, key: str, attrs: TableProfile, attr_key: str,
                  event_values: list, attr_values: set) -> list[str]:
    """Type or format mismatches of a join key; a join that would find (almost) nothing."""
    e, a = events.columns[key], attrs.columns[attr_key]
    where = f"{events.table}.{key} ({e.type}) -> {attrs.table}.{attr_key} ({a.type})"
    warnings = []
    if e.kind != a.kind:
        warnings.append(f"{where}: the key types differ; cast one side in a view (the join compares them as text)")
    sample = [v for v in event_values if v is not None][:5000]
    if not sample:
        return warnings
    found = sum(str(v) in attr_values for v in sample) / len(sample)
    if found < 0.5:
        fe, fa = _key_format(sample), _key_format(list(attr_values))
        shape = f"; formats {fe} vs {fa}, e.g. {sample[0]!r} vs {next(iter(attr_values), None)!r}" if fe != fa else ""
        warnings.append(f"{where}: only {found:.0%} of sampled event keys are found in the attribute table{shape}")
    return warnings


@dataclass
class Suggestion:
    config: dict
    notes: list[str]
    warnings: list[str]


def _classify(c: ColumnProfile, rows_capped: bool) -> tuple[str | None, str]:
    """(type or None to leave out, reason)."""
    if c.non_null == 0:
        return None, "always null"
    if c.distinct == 1:
        return None, f"constant ({c.examples[0]!r})"
    if c.unique and c.kind in ("string", "int") and c.non_null > 20:
        return None, f"unique per row{' in the sample' if rows_capped else ''}: a row id, not a behaviour"
    if c.kind == "time":
        return "timestamp", "a time"
    if c.kind == "float" or (c.kind == "int" and not c.id_like):
        return "numeric", "a number"
    if c.kind in ("string", "bool", "int"):
        if c.distinct > HIGH_CARDINALITY:
            return "categorical", f"high-cardinality categorical ({c.distinct:,} values: hashed into buckets)"
        return "categorical", f"categorical ({c.distinct:,} values)"
    return None, f"type {c.type} is not used by the model"


@dataclass
class EventsVolume:
    """The events table's size and rhythm: counts pushed down to the warehouse (rows per month, time
    range) and, from the entity and time columns of up to `scan` rows, the entities and their gaps."""
    rows: int
    first: datetime | None
    last: datetime | None
    per_month: dict  # first day of each month -> rows
    entities: int
    scanned: int
    capped: bool  # the entity scan stopped at its limit: `entities` is a lower bound
    entity_ids: set = field(default_factory=set, repr=False)
    typical_gap_days: float | None = None  # median over repeat entities of their mean gap between active days
    repeat_entities: int = 0  # entities active on two days or more

    @property
    def days(self) -> float:
        if self.first is None or self.last is None:
            return 0.0
        return (self.last - self.first).total_seconds() / 86_400

    @property
    def per_month_mean(self) -> float:
        return self.rows / max(self.days / 30.44, 1e-9) if self.days else float(self.rows)


def scan_events(warehouse, table: str, entity: str, ts: str, scan_rows: int = 5_000_000) -> EventsVolume:
    """Counts per month and the time range from the warehouse; entities and their typical gap from a
    stream of the two columns (at most `scan_rows` rows: memory stays bounded)."""
    import numpy as np

    from resources.duckdb import utc_naive

    counts = warehouse.partition_counts(table, ts, "month")
    per_month = {utc_naive(m).date() if isinstance(m, datetime) else m: n for m, (n, _) in sorted(counts.items())}
    first, last = (utc_naive(t) if isinstance(t, datetime) else
                   datetime(t.year, t.month, t.day) if isinstance(t, date) else t
                   for t in warehouse.time_range(table, ts))
    ents, times, n, capped = [], [], 0, False
    reader = warehouse.read(table, [entity, ts], batch_rows=65_536)
    try:
        for b in reader:
            b = b.slice(0, scan_rows - n)
            ents.append(pc.cast(b.column(0), pa.string()))
            t = b.column(1)
            unit = pa.timestamp("s", tz=getattr(t.type, "tz", None))  # a zone-aware time keeps its UTC instant
            times.append(pc.cast(pc.cast(t, unit, safe=False), pa.int64()))
            n += len(b)
            if n >= scan_rows:
                capped = True
                break
    finally:
        if hasattr(reader, "close"):
            reader.close()
    if not n:
        return EventsVolume(sum(per_month.values()), first, last, per_month, 0, 0, False)
    t = pa.table({"e": pa.chunked_array(ents), "t": pa.chunked_array(times)}).drop_null()
    ent = t.column("e").combine_chunks().dictionary_encode()
    codes = ent.indices.to_numpy().astype(np.int64)
    day = t.column("t").to_numpy() // 86_400
    day = day - day.min() if len(day) else day
    k = len(ent.dictionary)
    pairs = np.unique(codes * (1 << 24) + day)  # (entity, active day)
    pc_code, pc_day = pairs >> 24, pairs & ((1 << 24) - 1)
    active = np.bincount(pc_code, minlength=k)
    lo = np.full(k, np.iinfo(np.int64).max)
    hi = np.full(k, np.iinfo(np.int64).min)
    np.minimum.at(lo, pc_code, pc_day)
    np.maximum.at(hi, pc_code, pc_day)
    repeat = active >= 2
    gap = float(np.median((hi[repeat] - lo[repeat]) / (active[repeat] - 1))) if repeat.any() else None
    ids = set(ent.dictionary.to_pylist()) if k <= 5_000_000 else set()
    return EventsVolume(sum(per_month.values()), first, last, per_month, k, n, capped, ids, gap, int(repeat.sum()))


def _events_and_entity(profiles: list[TableProfile], entity: str | None, notes: list[str]):
    timed = [p for p in profiles if _time_column(p) is not None]
    if not timed:
        raise ValueError("no table has a timestamp or date column: an events table needs one (name it with --tables)")
    # events: a timed table whose entity repeats; the one with the most rows first
    events = max(timed, key=lambda p: p.rows)
    others = [p for p in profiles if p is not events]
    candidates = _entity_candidates(events, others)
    if entity is None:
        if not candidates:
            raise ValueError(f"no entity column found in {events.table}: name it with --entity")
        entity = candidates[0][1]
        if len(candidates) > 1:
            notes.append(f"entity: {entity} (other candidates: {', '.join(n for _, n in candidates[1:4])}; "
                         f"choose with --entity)")
    elif entity not in events.columns:
        raise ValueError(f"--entity {entity}: {events.table} has no such column; it has {list(events.columns)}")
    return events, others, entity, _time_column(events)


def pick_events(profiles: list[TableProfile], entity: str | None = None) -> tuple[str, str, str]:
    """(events table, entity column, time column) as suggest() will choose them."""
    events, _, entity, ts = _events_and_entity(profiles, entity, [])
    return events.table, entity, ts.name


# the guidelines of the data (assets.cache.guideline_warnings checks the same on the extracted events)
MIN_ENTITIES, MIN_EVENTS_PER_MONTH, MIN_HISTORY_DAYS, MIN_HISTORY_DAYS_INFREQUENT = 10_000, 100_000, 90, 365
INFREQUENT_GAP_DAYS = 14  # a typical gap between two active days longer than two weeks: an infrequent domain
DAILY_ABOVE_PER_MONTH = 3_000_000  # events a month above which partitions are days, not months
STOPPED_AFTER_DAYS = 7  # the newest event older than this (as of `now`): the data has stopped, propose `end:`
MIN_COVERAGE = 0.9  # share of event entities with an entity attributes row (the cache's join_coverage check)
THIN_COLUMN = 0.5  # attribute columns null in more than this share of their rows


def _weeks(days: float) -> int:
    return 7 * math.ceil(days / 7)


def _churn_target(volume: EventsVolume | None, events_name: str, notes: list, warnings: list) -> dict:
    """No event within a window of about three typical gaps (at least 28 days, whole weeks), so that a
    customer who keeps their rhythm is rarely counted as churned."""
    target = {"no_event": events_name, "within": "28d"}
    gap = volume.typical_gap_days if volume else None
    if gap is None:
        return target
    within = max(28, _weeks(3 * gap))
    target["within"] = f"{within}d"
    if within > 45:  # eligible: active within two windows (the default 90 days would miss regular customers)
        target["active_within"] = f"{max(90, 2 * within)}d"
    infrequent = gap > INFREQUENT_GAP_DAYS
    notes.append(f"churn within {within}d: about three typical gaps ({gap:.1f} days between an entity's active days, "
                 f"median over {volume.repeat_entities:,} entities with two or more)"
                 + ("" if within > 28 else "; at least 28d"))
    if infrequent:
        warnings.append(f"infrequent domain: the typical gap between an entity's active days is {gap:.0f} days "
                        f"(over {INFREQUENT_GAP_DAYS}); churn is suggested within {within}d, not 28d"
                        + (f", and {volume.days:.0f} days of history is under the guideline of a year for "
                           f"infrequent domains" if volume.days < MIN_HISTORY_DAYS_INFREQUENT else ""))
    if volume.days and volume.days < 3 * within:
        warnings.append(f"{volume.days:.0f} days of history for a {within}-day churn window: the hold-out and the "
                        f"training cut-offs need about three windows ({3 * within} days)")
    return target


def volume_warnings(v: EventsVolume, table: str) -> list[str]:
    """The data guidelines, with the numbers (10,000 entities, 100,000 events a month, 3 months)."""
    out = []
    ents = f"{'at least ' if v.capped else ''}{v.entities:,}"
    if v.entities < MIN_ENTITIES:
        out.append(f"volume: {ents} entities in {table} (guideline: at least {MIN_ENTITIES:,}; below it the "
                   f"models are unreliable)")
    if v.per_month_mean < MIN_EVENTS_PER_MONTH:
        out.append(f"volume: {v.per_month_mean:,.0f} events a month in {table} on average ({v.rows:,} over "
                   f"{v.days:.0f} days; guideline: at least {MIN_EVENTS_PER_MONTH:,})")
    if v.days < MIN_HISTORY_DAYS:
        out.append(f"volume: {v.days:.0f} days of history in {table} (guideline: at least 3 months; 1 year for "
                   f"infrequent domains)")
    return out


def suggest(profiles: list[TableProfile], connection_name: str, connection: dict,
            entity: str | None = None, volume: EventsVolume | None = None,
            now: datetime | None = None) -> Suggestion:
    """The suggested config. `volume` (scan_events) adds `end:`, the partition grain, the churn window
    and the volume warnings; `now` (default: the clock) decides whether the data has stopped."""
    notes, warnings = [], []
    events, others, entity, ts = _events_and_entity(profiles, entity, notes)
    lo, hi = (volume.first, volume.last) if volume else events.time_range.get(ts.name, (None, None))
    lo = lo.date() if isinstance(lo, datetime) else lo
    hi = hi.date() if isinstance(hi, datetime) else hi
    if lo is None:
        start = date.today().replace(day=1)
        warnings.append(f"{events.table}.{ts.name} holds no time yet: `start` is this month; set it to the "
                        f"first month of the data")
    else:
        start = lo.replace(day=1)
    per_month = volume.per_month_mean if volume else 0.0
    partition = "daily" if per_month > DAILY_ABOVE_PER_MONTH else "monthly"
    if volume:
        notes.append(f"{events.table}: {volume.rows:,} events, {'at least ' if volume.capped else ''}"
                     f"{volume.entities:,} entities, {lo} .. {hi} ({volume.days:.0f} days, {per_month:,.0f} a month): "
                     f"{partition} partitions" + (f" (over {DAILY_ABOVE_PER_MONTH:,} events a month)"
                                                   if partition == "daily" else ""))
    end = None
    if hi is not None:
        clock = now or datetime.now()
        if (clock.date() - hi).days > STOPPED_AFTER_DAYS:
            end = (hi + timedelta(days=1) if partition == "daily" else
                   date(hi.year + hi.month // 12, hi.month % 12 + 1, 1))
            notes.append(f"end {end}: the newest event is from {hi}, {(clock.date() - hi).days} days ago (the data has "
                         f"stopped; remove `end` if new data still arrives)")

    taken_events = {entity, ts.name}  # names in the events' namespace: events columns and attributes columns
    taken_entity = {entity}  # names of entity attributes

    def columns_of(p: TableProfile, skip: set[str], taken: set[str] | None = None,
                   owner: str = "") -> tuple[list[str], dict]:
        keep, types, kept = [], {}, set()
        pair_of = {}
        for a, b in p.one_to_one:
            pair_of.setdefault(a, []).append(b)
            pair_of.setdefault(b, []).append(a)
        for c in p.columns.values():
            if c.name in skip:
                continue
            kind, why = _classify(c, p.capped)
            twin = next((t for t in pair_of.get(c.name, []) if t in kept or t in skip), None)
            if kind is not None and twin is not None:
                kind, why = None, f"one-to-one with {twin}: carries nothing more"
            if kind is not None and taken is not None and c.name in taken:
                kind, why = None, (f"a column named {c.name!r} is already taken by {owner}; each name is used once "
                                   f"(rename it in a view to keep both)")
            if kind is None:
                notes.append(f"{p.table}.{c.name}: left out ({why})")
                continue
            keep.append(c.name)
            kept.add(c.name)
            if taken is not None:
                taken.add(c.name)
            notes.append(f"{p.table}.{c.name}: {why}")
            inferred = ("timestamp" if c.kind == "time" else "numeric" if c.kind == "float"
                        else "categorical" if c.kind in ("string", "bool") or c.id_like else "numeric")
            if kind != inferred:
                types[c.name] = kind
        return keep, types

    def source(name, role, p, **extra):
        d = {"name": _source_name(name), "role": role, "connection": connection_name, "table": p.table}
        d.update(extra)
        return d

    ev_cols, ev_types = columns_of(events, {entity, ts.name}, taken_events, f"the events ({events.table})")
    ev = source(events.table, "events", events, timestamp=ts.name, columns=ev_cols,
                **({"types": ev_types} if ev_types else {}), partition=partition, start=start,
                **({"end": end} if end else {}))
    # attribute tables: keyed by the entity, or by another event column
    attr_sources = []
    for p in others:
        if entity in p.columns and p.columns[entity].unique:
            cols, types = columns_of(p, {entity}, taken_entity, "another entity attributes table")
            attr_sources.append(source(p.table, "entity_attributes", p, columns=cols, **({"types": types} if types else {})))
            continue
        keys = [c.name for c in p.columns.values() if c.unique and c.name in ev_cols]
        if not keys:
            # same key under another name or type? the caller sees the table left out with why
            notes.append(f"{p.table}: not used (no column of it is unique and also a kept column of {events.table})")
            continue
        key = sorted(keys, key=lambda k: (not p.columns[k].id_like, k))[0]
        cols, types = columns_of(p, {key}, taken_events, "the events or an earlier attributes table")
        attr_sources.append(source(p.table, "attributes", p, key=key, columns=cols, **({"types": types} if types else {})))
    names = [ev["name"]]
    for d in attr_sources:  # source names are unique (two tables may share a name across schemas)
        base, i = d["name"], 2
        while d["name"] in names:
            d["name"], i = f"{base}_{i}", i + 1
        names.append(d["name"])
    if volume:
        warnings += volume_warnings(volume, events.table)
    churn = _churn_target(volume, ev["name"], notes, warnings)
    config = {"workspace": ".habitus/project", "connections": {connection_name: connection}, "entity": entity,
              "sources": [ev] + attr_sources,
              "scenarios": {"churn": {"task": "binary", "target": churn}}}
    return Suggestion(config, notes, warnings)


def _source_name(table: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", table.split(".")[-1]).lower()
    return name if re.match(r"^[A-Za-z_]", name) else f"t_{name}"


def check_joins(warehouse, suggestion: Suggestion, profiles: dict[str, TableProfile], sample_rows: int,
                volume: EventsVolume | None = None) -> None:
    """Warn where event keys do not find their attribute rows (type or format mismatch), where entity
    attributes cover few of the events' entities, and where a kept attribute column is mostly null."""
    cfg = suggestion.config
    ev = cfg["sources"][0]
    events = profiles[ev["table"]]
    ev_data, _ = _sample(warehouse, ev["table"], sample_rows)
    for s in cfg["sources"][1:]:
        key = s.get("key") or cfg["entity"]
        attrs = profiles[s["table"]]
        keys = set()
        for b in warehouse.read(s["table"], [key]):
            keys.update(str(v) for v in b.column(0).to_pylist() if v is not None)
            if len(keys) > 5_000_000:
                break
        found = join_warnings(events, key, attrs, key, ev_data.column(key).to_pylist(), keys)
        suggestion.warnings += found
        if s["role"] == "entity_attributes" and volume and volume.entity_ids and not found:
            hit = len(volume.entity_ids & keys)
            share = hit / len(volume.entity_ids)
            if share < MIN_COVERAGE:
                suggestion.warnings.append(
                    f"coverage: {s['table']} has a row for {share:.0%} of the entities of {ev['table']} ({hit:,} of "
                    f"{len(volume.entity_ids):,}{' scanned' if volume.capped else ''}); the others get no attributes "
                    f"(the cache's join_coverage check warns below {MIN_COVERAGE:.0%})")
        for c in s.get("columns", []):
            col = attrs.columns[c]
            if col.rows and col.nulls / col.rows > THIN_COLUMN:
                suggestion.warnings.append(f"coverage: {s['table']}.{c} is null in {col.nulls / col.rows:.0%} of "
                                           f"{'sampled ' if attrs.capped else ''}rows ({col.nulls:,} of {col.rows:,})")


def render(s: Suggestion) -> str:
    lines = ["# Suggested by `habitus init`; review before use.",
             "# Column decisions (from a sample of each table):"]
    lines += [f"#   {n}" for n in s.notes]
    if s.warnings:
        lines.append("#")
        lines += [f"# WARNING: {w}" for w in s.warnings]
    return "\n".join(lines) + "\n" + yaml.safe_dump(s.config, sort_keys=False, default_flow_style=None, width=110)


# --------------------------------------------------------------------------- the command


def _hide_secrets(name: str, conn: dict) -> dict:
    """The connection as printed: a secret not already a ${VAR} reference becomes one."""
    from resources.remote import SECRET_KEYS

    return {k: (v if k not in SECRET_KEYS or (isinstance(v, str) and v.startswith("${"))
                else "${" + re.sub(r"[^A-Z0-9]", "_", f"{name}_{k}".upper()) + "}")
            for k, v in conn.items()}


def _list_tables(kind: str, conn: dict) -> list[str]:
    from pipelines.config import ConfigError

    if kind == "duckdb":
        import duckdb

        from pathlib import Path

        if not Path(conn["path"]).exists():
            raise ConfigError(f"--duckdb {conn['path']}: no such file")
        try:
            con = duckdb.connect(conn["path"], read_only=True)
        except duckdb.Error as e:
            raise ConfigError(f"--duckdb {conn['path']}: {str(e).splitlines()[0]}") from None
        try:
            rows = con.execute("SELECT table_schema, table_name FROM information_schema.tables "
                               "WHERE table_catalog = current_database() ORDER BY 1, 2").fetchall()
        finally:
            con.close()
        return [t if s == "main" else f"{s}.{t}" for s, t in rows]
    if kind == "parquet" and "://" not in conn["path"]:
        from pathlib import Path

        base = Path(conn["path"])
        if not base.is_dir():
            raise ConfigError(f"--parquet {base}: no such folder")
        return sorted(p.stem if p.suffix == ".parquet" else p.name for p in base.iterdir()
                      if p.suffix == ".parquet" or p.is_dir())
    raise ValueError(f"a {kind} connection: name the tables with --tables")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="habitus init", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--duckdb", metavar="FILE", help="a DuckDB database file")
    where.add_argument("--parquet", metavar="PATH", help="a folder (or s3:// prefix) of Parquet tables")
    where.add_argument("--connection", metavar="YAML", help="a connection as in the config, e.g. "
                       "'{type: snowflake, account: ${SF_ACCOUNT}, user: ${SF_USER}, password: ${SF_PASSWORD}}'")
    where.add_argument("--config", metavar="FILE", help="an existing project config; with --use NAME")
    ap.add_argument("--use", metavar="NAME", help="which connection of --config")
    ap.add_argument("--name", default="warehouse", help="the connection's name in the suggested config")
    ap.add_argument("--tables", nargs="+", help="tables to look at (default: all, for DuckDB and Parquet)")
    ap.add_argument("--entity", help="the entity column, when the guess is wrong")
    ap.add_argument("--sample", type=int, default=100_000, help="rows read per table (default 100,000)")
    ap.add_argument("--scan", type=int, default=5_000_000, help="rows of the events' entity and time columns read "
                    "to count entities and their gaps (default 5,000,000)")
    ap.add_argument("--out", help="write the suggestion to this file too")
    args = ap.parse_args(argv)

    from pydantic import TypeAdapter, ValidationError

    from pipelines.config import Connection, ConfigError, load_project
    from pipelines.config_file import substitute_env
    from pipelines.definitions import connection_resource
    from resources.duckdb import WarehouseError

    try:
        if args.config:
            project = load_project(args.config)
            name = args.use or next(iter(project.connections))
            if name not in project.connections:
                raise ConfigError(f"--use {name}: not among the connections {sorted(project.connections)}")
            conn = project.connections[name]
            shown = {k: v for k, v in conn.model_dump().items()}
            args.name = name
        else:
            raw = ({"type": "duckdb", "path": args.duckdb} if args.duckdb else
                   {"type": "parquet", "path": args.parquet} if args.parquet else yaml.safe_load(args.connection))
            if not isinstance(raw, dict):
                raise ConfigError("--connection: expected a YAML mapping such as '{type: clickhouse, host: ...}'")
            shown = raw
            conn = TypeAdapter(Connection).validate_python(substitute_env(raw, "--connection", args.connection or ""))
        shown = _hide_secrets(args.name, shown)
        warehouse = connection_resource(args.name, conn)
        tables = args.tables or _list_tables(conn.type, conn.model_dump())
        if not tables:
            raise ConfigError("no tables found; name them with --tables")
        profiles, skipped = {}, []
        for t in tables:
            if habitus_output(warehouse, t):
                if args.tables:
                    raise ConfigError(f"--tables {t}: a table habitus wrote (its columns {sorted(OUTPUT_COLUMNS)} are "
                                      f"predictions.sink's), not an input")
                print(f"skipping {t}: written by habitus (predictions)", file=sys.stderr)
                skipped.append(t)
                continue
            print(f"profiling {t} ...", file=sys.stderr)
            profiles[t] = profile_table(warehouse, t, args.sample)
        if not profiles:
            raise ConfigError(f"every table is one habitus wrote ({', '.join(skipped)}); name the inputs with --tables")
        table, entity, ts = pick_events(list(profiles.values()), args.entity)
        print(f"counting {table} by month and scanning {entity}, {ts} ...", file=sys.stderr)
        volume = scan_events(warehouse, table, entity, ts, args.scan)
        suggestion = suggest(list(profiles.values()), args.name, shown, args.entity, volume)
        suggestion.notes += [f"{t}: not used (written by habitus: predictions, not an input)" for t in skipped]
        check_joins(warehouse, suggestion, profiles, args.sample, volume)
    except (ConfigError, WarehouseError, ValueError, ValidationError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = render(suggestion)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    for w in suggestion.warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
