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

from pydantic import TypeAdapter, ValidationError

from habitus.pipelines.config.file import ConfigError, env_template, format_errors, parse_yaml, substitute_env
from habitus.pipelines.config.project import Connection, load_project

from habitus.pipelines.init.profile import OUTPUT_COLUMNS, habitus_output, profile_table, scan_events
from habitus.pipelines.init.suggest import check_joins, pick_events, render, suggest
from habitus.pipelines.orchestration.build import connection_resource
from habitus.resources.warehouses.errors import WarehouseError
from habitus.resources.store.redaction import redact_text
from habitus.resources.warehouses.masking import template_secrets
from habitus.resources.warehouses.remote import SECRET_KEYS


def _hide_secrets(name: str, conn: dict) -> dict:
    """The connection as printed: a value that holds ${VAR} is shown as written (`pw-${VAR}`, whatever its key
    and however deep), a secret-named key's value not already a ${VAR} reference becomes one; `options`
    and nested dicts and lists likewise."""
    def shown(k, v):
        if env_template(v) is not None:
            return env_template(v)
        if isinstance(v, dict):
            return {ik: shown(ik, iv) for ik, iv in v.items()}
        if isinstance(v, list):
            return [shown(k, iv) for iv in v]
        if k not in SECRET_KEYS or (isinstance(v, str) and v.startswith("${")):
            return v
        return "${" + re.sub(r"[^A-Z0-9]", "_", f"{name}_{k}".upper()) + "}"

    return {k: shown(k, v) for k, v in conn.items()}


def _list_tables(kind: str, conn: dict, warehouse=None) -> list[str]:
    """The tables of a DuckDB file, a Parquet folder or an s3:// prefix, through the connector's `tables()`."""
    if kind not in ("duckdb", "parquet") or warehouse is None:
        raise ValueError(f"a {kind} connection: name the tables with --tables")
    try:
        return warehouse.tables()
    except WarehouseError as e:
        raise ConfigError(f"--{kind} {e}") from None


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

    secrets: list[str] = []  # what the connection's ${VAR}s became: never printed, in an error either
    try:
        if args.config:
            project = load_project(args.config)
            name = args.use or next(iter(project.connections))
            if name not in project.connections:
                raise ConfigError(f"--use {name}: not among the connections {sorted(project.connections)}")
            conn = project.connections[name]
            secrets = template_secrets(conn.model_dump())
            shown = {k: v for k, v in conn.model_dump().items()}
            args.name = name
        else:
            raw = ({"type": "duckdb", "path": args.duckdb} if args.duckdb else
                   {"type": "parquet", "path": args.parquet} if args.parquet else parse_yaml(args.connection, "--connection"))
            if not isinstance(raw, dict):
                raise ConfigError("--connection: expected a YAML mapping such as '{type: clickhouse, host: ...}'")
            shown = raw
            substituted = substitute_env(raw, "--connection", args.connection or "", "connections")
            secrets = template_secrets(substituted)
            conn = TypeAdapter(Connection).validate_python(substituted)
        shown = _hide_secrets(args.name, shown)
        warehouse = connection_resource(args.name, conn)
        tables = args.tables or _list_tables(conn.type, conn.model_dump(), warehouse)
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
        # pydantic's own text quotes (a cut of) the input: its problems are listed without it
        text = format_errors("--connection", e) if isinstance(e, ValidationError) else str(e)
        print(f"error: {redact_text(text, secrets)}", file=sys.stderr)
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
