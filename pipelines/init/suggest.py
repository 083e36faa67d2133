"""`habitus init`, what it suggests from the profiles (pipelines/init/profile.py): the events table
and its timestamp, the entity, each column's type or why it is left out, the attribute tables and
their join keys, the partition grain, `end:` and a churn window; and the warnings where the data is
below the guidelines or a join would find (almost) nothing."""

import math
import re
from dataclasses import dataclass
from datetime import date, datetime, timedelta

import pyarrow as pa
import yaml

from habitus.pipelines.init.profile import ColumnProfile, EventsVolume, TableProfile, read_sample

ENTITY_HINTS = ("customer", "user", "client", "member", "account", "visitor", "household", "person", "player",
                "subscriber", "patient", "device", "card")
TIME_HINTS = ("ts", "timestamp", "event_time", "time", "created_at", "occurred_at", "date", "datetime")
HIGH_CARDINALITY = 10_000  # distinct values above which a categorical column is hashed into buckets


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


def text_time_warnings(profiles: list[TableProfile], events: TableProfile | None = None) -> list[str]:
    """Text columns whose values look like times: a source's `timestamp:` must be a TIMESTAMP or DATE column."""
    out = []
    for p in profiles:
        for c in p.columns.values():
            if c.text_time:
                larger = events is not None and p is not events and p.rows > events.rows
                out.append(f"{p.table}.{c.name} holds times stored as text (e.g. {c.examples[0]!r}), which habitus "
                           f"does not read as times" + (f"; with {p.rows:,} sampled rows against {events.rows:,} of "
                                                       f"{events.table}, {p.table} may be the events table" if larger
                                                       else "") +
                           f": store it as a TIMESTAMP, or run init on a view that selects "
                           f"CAST({c.name} AS TIMESTAMP) AS {c.name} with the other columns")
    return out


def _events_and_entity(profiles: list[TableProfile], entity: str | None, notes: list[str]):
    timed = [p for p in profiles if _time_column(p) is not None]
    hint = "".join(f"; {w}" for w in text_time_warnings(profiles))
    if not timed:
        raise ValueError("no table has a timestamp or date column: an events table needs one (name it with --tables)"
                         + hint)
    # events: a timed table whose entity repeats; the one with the most rows first
    events = max(timed, key=lambda p: p.rows)
    others = [p for p in profiles if p is not events]
    candidates = _entity_candidates(events, others)
    if entity is None:
        if not candidates:
            raise ValueError(f"no entity column found in {events.table}: name it with --entity" + hint)
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


# the guidelines of the data (habitus.assets.cache.guideline_warnings checks the same on the extracted events)
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


def volume_warnings(v: EventsVolume, table: str, entity: str | None = None) -> list[str]:
    """The data guidelines, with the numbers (10,000 entities, 100,000 events a month, 3 months)."""
    out = []
    ents = f"{'at least ' if v.capped else ''}{v.entities:,}"
    if v.entities < MIN_ENTITIES:
        out.append(f"volume: {ents} entities in {table} (guideline: at least {MIN_ENTITIES:,}; below it the "
                   f"models are unreliable" + (f"; the entity is {entity}: if that is not what you score, name it "
                                                f"with --entity" if entity else "") + ")")
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
        warnings += volume_warnings(volume, events.table, entity)
    warnings += text_time_warnings(profiles, events)
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
    ev_data, _ = read_sample(warehouse, ev["table"], sample_rows)
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
