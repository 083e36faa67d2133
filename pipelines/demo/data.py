"""Generate the demo retail warehouse: customers, products, stores and purchases in one DuckDB file.

The tables are simulated from a small behavioural model (pipelines/demo/simulation.py), so that the
demo scenarios have something to learn. Same seed, same tables.

Command line (wired as `habitus demo-data`):  python -m habitus.pipelines.demo.data --out demo.duckdb
"""

from __future__ import annotations

import argparse
import os
from datetime import date, datetime, timedelta

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from habitus.pipelines.demo.simulation import simulate_blocks, simulate_tables

DEFAULT_OUT = ".habitus/demo_warehouse.duckdb"  # where examples/demo.yaml looks by default


def _remove(path: str) -> None:
    for p in (path, path + ".wal"):
        if os.path.exists(p):
            os.remove(p)


def generate_demo_warehouse(path: str | os.PathLike, *, customers: int = 20_000, products: int = 2_000,
                            stores: int = 30, start: str = "2026-03-01", end: str = "2026-10-31",
                            seed: int = 0) -> dict[str, int]:
    """Write a realistic retail warehouse into the DuckDB file `path` (replacing tables customers, products, stores, purchases atomically: write to `path + '.tmp'` then os.replace). Returns row counts per table.

    `start` and `end` are inclusive dates; purchases fall within shop hours of those days. The
    file is rebuilt whole, so it should hold the demo data only.
    """
    start_date, end_date = date.fromisoformat(str(start)), date.fromisoformat(str(end))
    n_days = (end_date - start_date).days + 1
    if n_days < 1:
        raise ValueError(f"end ({end}) is before start ({start})")
    if min(customers, products, stores) < 1:
        raise ValueError("customers, products and stores must each be at least 1")

    path = os.fspath(path)
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    _remove(tmp)  # a leftover from an interrupted run
    counts: dict[str, int] = {}
    con = duckdb.connect(tmp, config={"memory_limit": "1GB", "threads": 1})
    try:
        # a block of customers at a time (simulate_blocks): 100M purchases never sit in memory whole
        for tables in simulate_blocks(start_date, n_days, customers, products, stores, seed):
            for name, table in tables.items():
                con.register(f"{name}_arrow", table)
                # a block's purchases arrive sorted by ts; DuckDB preserves insertion order.
                con.execute(f'INSERT INTO "{name}" SELECT * FROM "{name}_arrow"' if name in counts else
                            f'CREATE TABLE "{name}" AS SELECT * FROM "{name}_arrow"')
                con.unregister(f"{name}_arrow")
                counts[name] = counts.get(name, 0) + table.num_rows
            del tables
        con.execute("CHECKPOINT")  # everything in the main file, no WAL to carry along
    finally:
        con.close()
    if os.path.exists(path + ".wal"):  # the old file's WAL must not be replayed onto the new one
        os.remove(path + ".wal")
    os.replace(tmp, path)
    return {name: counts[name] for name in ("customers", "products", "stores", "purchases")}


SHIFTS = ("volume_drop", "outage", "new_store", "brand_stops")
NEW_STORE = "S_NEW"
VOLUME_KEPT = {"volume_drop": 0.25, "outage": 0.02}  # the share of the day's purchases that still arrive
NEW_STORE_SHARE = 0.4  # the share of a new_store day's purchases made in the new store


def append_demo_day(path: str | os.PathLike, *, seed: int = 0, shift: str | None = None) -> tuple[str, int]:
    """Add the next day of purchases to a demo warehouse (what a nightly load would do), so the
    new-data sensor has something to find. The day is simulated with the warehouse's own sizes and
    first day, one day longer than the data it holds; `shift` changes it on purpose (what the drift
    checks are there to notice):

        volume_drop   only a quarter of the day's purchases arrive (a broken feed, a closed chain)
        outage        only 2% arrive (at least one: the day exists); days of it make customers look gone
        new_store     a store opens (NEW_STORE, added to `stores`) and takes NEW_STORE_SHARE of the purchases
        brand_stops   the brand with the most purchases so far sells nothing that day

    Returns (the day, rows added)."""
    if shift is not None and shift not in SHIFTS:
        raise ValueError(f"shift {shift!r}: one of {', '.join(SHIFTS)}")
    con = duckdb.connect(os.fspath(path))
    try:
        first, last = con.sql("SELECT min(ts)::DATE, max(ts)::DATE FROM purchases").fetchall()[0]
        sizes = [con.sql(f"SELECT count(*) FROM {t} WHERE {k} <> '{NEW_STORE}'").fetchall()[0][0]
                 for t, k in (("customers", "customer_id"), ("products", "product_id"), ("stores", "store_id"))]
        day = last + timedelta(days=1)
        tables = simulate_tables(first, (day - first).days + 1, *sizes, seed)
        purchases = tables["purchases"]
        start = pa.scalar(datetime(day.year, day.month, day.day), pa.timestamp("us"))
        new = purchases.filter(pc.greater_equal(purchases.column("ts"), start.cast(purchases.schema.field("ts").type)))
        if shift is not None:
            new = _shifted(con, new, shift, np.random.default_rng([seed, day.toordinal()]))
        con.register("new_day", new)
        con.sql("INSERT INTO purchases SELECT * FROM new_day")  # one statement: all of the day or none
        con.unregister("new_day")
        con.sql("CHECKPOINT")
    finally:
        con.close()
    return day.isoformat(), new.num_rows


def _shifted(con, day: pa.Table, shift: str, rng) -> pa.Table:
    """The day's purchases changed by `shift` (append_demo_day's list)."""
    if shift in VOLUME_KEPT:
        kept = rng.random(day.num_rows) < VOLUME_KEPT[shift]
        kept[:1] = True  # a day with no row would not be there: the next append would make it again
        return day.filter(pa.array(kept))
    if shift == "new_store":
        if not con.sql(f"SELECT count(*) FROM stores WHERE store_id = '{NEW_STORE}'").fetchall()[0][0]:
            con.sql(f"INSERT INTO stores SELECT '{NEW_STORE}', region, format FROM stores ORDER BY store_id LIMIT 1")
        moved = pa.array(rng.random(day.num_rows) < NEW_STORE_SHARE)
        stores = pc.if_else(moved, pa.scalar(NEW_STORE), day.column("store_id"))
        return day.set_column(day.schema.get_field_index("store_id"), "store_id", stores)
    brand = con.sql("SELECT p.brand FROM purchases u JOIN products p USING (product_id) "
                    "GROUP BY p.brand ORDER BY count(*) DESC, p.brand LIMIT 1").fetchall()[0][0]
    gone = pa.array([r[0] for r in con.sql("SELECT product_id FROM products WHERE brand = $1", params=[brand]).fetchall()])
    return day.filter(pc.invert(pc.is_in(day.column("product_id"), gone)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="habitus demo-data", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"DuckDB file to (re)write (default {DEFAULT_OUT})")
    parser.add_argument("--customers", type=int, default=20_000)
    parser.add_argument("--products", type=int, default=2_000)
    parser.add_argument("--stores", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", default="2026-03-01", help="first day (inclusive)")
    parser.add_argument("--end", default="2026-10-31", help="last day (inclusive)")
    parser.add_argument("--append-day", action="store_true",
                        help="add the next day of purchases to the existing warehouse instead of rewriting it")
    parser.add_argument("--shift", choices=SHIFTS, help="with --append-day: change that day on purpose (a volume "
                        "drop, an outage, a new store, a brand that stops selling), for the drift checks to notice")
    args = parser.parse_args(argv)
    if args.append_day:
        day, rows = append_demo_day(args.out, seed=args.seed, shift=args.shift)
        print(f"{args.out}: added {rows:,} purchases on {day}")
        return
    counts = generate_demo_warehouse(args.out, customers=args.customers, products=args.products,
                                     stores=args.stores, start=args.start, end=args.end, seed=args.seed)
    print(f"wrote {args.out}")
    for name, rows in counts.items():
        print(f"  {name:<10} {rows:>10,} rows")


if __name__ == "__main__":
    main()
