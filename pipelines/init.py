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
import re
import sys
from dataclasses import dataclass, field
from datetime import date, datetime

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
        distinct = pc.count_distinct(col, mode="only_valid").as_py() if len(col) else 0
        examples = pc.unique(col.drop_null().slice(0, 1000)).to_pylist()[:3] if len(col) else []
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


def suggest(profiles: list[TableProfile], connection_name: str, connection: dict,
            entity: str | None = None) -> Suggestion:
    notes, warnings = [], []
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
    ts = _time_column(events)
    lo = events.time_range.get(ts.name, (None, None))[0]
    start = (lo.date() if isinstance(lo, datetime) else lo) if lo else date.today()
    start = start.replace(day=1)

    def columns_of(p: TableProfile, skip: set[str]) -> tuple[list[str], dict]:
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
            if kind is None:
                notes.append(f"{p.table}.{c.name}: left out ({why})")
                continue
            keep.append(c.name)
            kept.add(c.name)
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

    # attribute tables: keyed by the entity, or by another event column
    attr_sources, join_keys = [], []
    for p in others:
        if entity in p.columns and p.columns[entity].unique:
            cols, types = columns_of(p, {entity})
            attr_sources.append(source(p.table, "entity_attributes", p, columns=cols, **({"types": types} if types else {})))
            join_keys.append((entity, p, entity))
            continue
        keys = [c.name for c in p.columns.values() if c.unique and c.name in events.columns and c.name != ts.name]
        if not keys:
            # same key under another name or type? the caller sees the table left out with why
            notes.append(f"{p.table}: not used (no column of it is unique and also in {events.table})")
            continue
        key = sorted(keys, key=lambda k: (not p.columns[k].id_like, k))[0]
        cols, types = columns_of(p, {key})
        attr_sources.append(source(p.table, "attributes", p, key=key, columns=cols, **({"types": types} if types else {})))
        join_keys.append((key, p, key))
    ev_cols, ev_types = columns_of(events, {entity, ts.name})
    ev = source(events.table, "events", events, timestamp=ts.name, columns=ev_cols,
                **({"types": ev_types} if ev_types else {}), partition="monthly", start=start)
    config = {"workspace": ".habitus/project", "connections": {connection_name: connection}, "entity": entity,
              "sources": [ev] + attr_sources,
              "scenarios": {"churn": {"task": "binary", "target": {"no_event": ev["name"], "within": "28d"}}}}
    return Suggestion(config, notes, warnings)


def _source_name(table: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", table.split(".")[-1]).lower()
    return name if re.match(r"^[A-Za-z_]", name) else f"t_{name}"


def check_joins(warehouse, suggestion: Suggestion, profiles: dict[str, TableProfile], sample_rows: int) -> None:
    """Warn where event keys do not find their attribute rows (type or format mismatch)."""
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
        suggestion.warnings += join_warnings(events, key, attrs, key, ev_data.column(key).to_pylist(), keys)


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
    if kind == "duckdb":
        import duckdb

        con = duckdb.connect(conn["path"], read_only=True)
        try:
            rows = con.execute("SELECT table_schema, table_name FROM information_schema.tables "
                               "WHERE table_catalog = current_database() ORDER BY 1, 2").fetchall()
        finally:
            con.close()
        return [t if s == "main" else f"{s}.{t}" for s, t in rows]
    if kind == "parquet" and "://" not in conn["path"]:
        from pathlib import Path

        base = Path(conn["path"])
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
    ap.add_argument("--out", help="write the suggestion to this file too")
    args = ap.parse_args(argv)

    from pydantic import TypeAdapter, ValidationError

    from pipelines.config import Connection, ConfigError, _substitute_env, load_project
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
            conn = TypeAdapter(Connection).validate_python(_substitute_env(raw, "--connection", args.connection or ""))
        shown = _hide_secrets(args.name, shown)
        warehouse = connection_resource(args.name, conn)
        tables = args.tables or _list_tables(conn.type, conn.model_dump())
        if not tables:
            raise ConfigError("no tables found; name them with --tables")
        profiles = {}
        for t in tables:
            print(f"profiling {t} ...", file=sys.stderr)
            profiles[t] = profile_table(warehouse, t, args.sample)
        suggestion = suggest(list(profiles.values()), args.name, shown, args.entity)
        check_joins(warehouse, suggestion, profiles, args.sample)
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
