"""Appending a day of events to the cache vs encoding everything again.

    python bench/cache_append.py [--customers 20000] [--json PATH]

Generates the demo warehouse, writes its purchases as one Parquet file per day (as the daily
source partitions are), builds the cache from every day but the last, then (a) appends the last day
to it and (b) builds a fresh cache from every day. Prints the seconds of each, the ratio, and checks
that the appended cache holds the same events and keeps every id it had.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import duckdb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache  # noqa: E402
from habitus.pipelines.demo.data import generate_demo_warehouse  # noqa: E402
from tables import text_table  # noqa: E402


def _daily_files(warehouse: Path, out: Path) -> list[str]:
    out.mkdir()
    con = duckdb.connect(str(warehouse), read_only=True)
    days = [d for (d,) in con.sql("SELECT DISTINCT ts::DATE FROM purchases ORDER BY 1").fetchall()]
    for d in days:
        con.sql(f"COPY (SELECT * FROM purchases WHERE ts::DATE = DATE '{d}' ORDER BY customer_id, ts) "
                f"TO '{out / f'{d}.parquet'}' (FORMAT parquet, COMPRESSION zstd)")
    for t in ("customers", "products", "stores"):
        con.sql(f"COPY {t} TO '{out / f'{t}.parquet'}' (FORMAT parquet)")
    con.close()
    return [str(out / f"{d}.parquet") for d in days]


def _spec(files: list[str], folder: Path) -> CacheSpec:
    events = TableInput("purchases", files, {"product_id": "categorical", "store_id": "categorical",
                                             "quantity": "numeric", "price": "numeric"}, timestamp="ts")
    customers = TableInput("customers", [str(folder / "customers.parquet")],
                           {"age": "numeric", "region": "categorical", "segment": "categorical"})
    products = TableInput("products", [str(folder / "products.parquet")],
                          {"product_id": "categorical", "category": "categorical", "brand": "categorical"},
                          key="product_id")
    return CacheSpec("customer_id", [events], [customers], [products])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--customers", type=int, default=20_000)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    quiet = lambda _: None  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        generate_demo_warehouse(tmp / "w.duckdb", customers=args.customers)
        files = _daily_files(tmp / "w.duckdb", tmp / "parquet")
        base = Cache(build_cache(_spec(files[:-1], tmp / "parquet"), tmp / "cache", log=quiet))
        t = time.perf_counter()
        grown = Cache(build_cache(_spec(files, tmp / "parquet"), tmp / "cache", previous=base.path, log=quiet))
        append_s = time.perf_counter() - t
        t = time.perf_counter()
        fresh = Cache(build_cache(_spec(files, tmp / "parquet"), tmp / "fresh", log=quiet))
        fresh_s = time.perf_counter() - t
        assert grown.manifest["mode"] == "append" and grown.manifest["n_events"] == fresh.manifest["n_events"]
        old = base.vocab("product_id").column("value").to_pylist()
        assert grown.vocab("product_id").column("value").to_pylist()[:len(old)] == old
        added = grown.manifest["n_events"] - base.manifest["n_events"]
        figures = {"days": len(files), "events": fresh.manifest["n_events"], "appended_events": added,
                   "append_seconds": round(append_s, 3), "fresh_build_seconds": round(fresh_s, 3),
                   "fresh_build_events_per_s": round(fresh.manifest["n_events"] / fresh_s),
                   "speedup": round(fresh_s / append_s, 1)}
    print(text_table([figures], [("days", "days", ""), ("events", "events", ","), ("appended", "appended_events", ","),
                                 ("append s", "append_seconds", ".2f"), ("rebuild s", "fresh_build_seconds", ".2f"),
                                 ("rebuild ev/s", "fresh_build_events_per_s", ","), ("ratio", "speedup", ".1fx")]))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
