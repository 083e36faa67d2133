"""The cache against its source: bytes on disk and the time to read every shard, next to the same
shards stored the way format 2 stored them (uncompressed Arrow, int32 ids, int64 times, attributes
with every event), in the same run.

    .venv/bin/python bench/cache_size.py                       # the demo (20,000 customers) and Ta-Feng
    .venv/bin/python bench/cache_size.py --datasets demo --customers 2000 --json out.json

Each dataset's sources are extracted and its cache built in a fresh temporary workspace, through the
project's own assets. Reads are timed as training reads a shard (Cache.shard: the whole shard into
numpy), best of --repeats, alternating the two layouts.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.ipc as ipc  # noqa: E402
from tables import text_table  # noqa: E402

CONFIGS = {"demo": ROOT / "examples" / "demo.yaml", "tafeng": ROOT / "examples" / "tafeng.yaml"}


def build(name: str, work: Path, customers: int) -> tuple[Path, int]:
    """Extract the sources and build the cache of dataset `name` under `work`: (cache folder, source bytes)."""
    import dagster as dg
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    os.environ["HABITUS_WORKSPACE"] = str(work / "ws")
    if name == "demo":
        from habitus.pipelines.demo.data import generate_demo_warehouse

        os.environ["HABITUS_DEMO_WAREHOUSE"] = str(work / "warehouse.duckdb")
        generate_demo_warehouse(work / "warehouse.duckdb", customers=customers, products=max(100, customers // 10))
    from habitus.assets.cache import current_cache
    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.build import build_assets, build_resources

    project = load_project(CONFIGS[name])
    assets, resources = build_assets(project), build_resources(project)
    instance = dg.DagsterInstance.ephemeral()
    for s in project.events_sources:
        key = dg.AssetKey(["source", s.name])
        keys = next(a for a in assets if a.key == key).partitions_def.get_partition_keys()
        dg.materialize(assets, selection=[key], resources=resources, instance=instance,
                       tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
    others = [dg.AssetKey(["source", s.name]) for s in project.sources if s.role != "events"]
    dg.materialize(assets, selection=others + [dg.AssetKey("cache")], resources=resources, instance=instance)
    sources = sum(f.stat().st_size for f in (work / "ws" / "sources").rglob("*.parquet"))
    return current_cache(resources["workspace"]).path, sources


def read_all_shards(cache) -> float:
    started = time.perf_counter()
    for i in range(cache.shard_count):
        shard = cache._read_shard(i)
        sum(int(c[:1].sum()) for c in shard.columns.values())  # touch every column
    return time.perf_counter() - started


def read_format2(paths: list[Path]) -> float:
    started = time.perf_counter()
    for p in paths:
        table = ipc.open_file(pa.memory_map(str(p))).read_all()
        cols = {c: table.column(c).to_numpy() for c in table.column_names}
        np.diff(cols["entity"])
        sum(int(c[:1].sum()) for c in cols.values())
    return time.perf_counter() - started


def measure(name: str, customers: int, repeats: int) -> dict:
    from habitus.models.cache import Cache
    from habitus.models.storage.files import folder_bytes

    with tempfile.TemporaryDirectory(prefix=f"habitus-cache-{name}-") as tmp:
        work = Path(tmp)
        folder, source_bytes = build(name, work, customers)
        cache = Cache(folder)
        old = []  # the same shards as format 2 wrote them
        for i in range(cache.shard_count):  # every column, looked-up attributes too, as format 2 stored them
            shard = cache._read_shard(i)
            table = pa.table({"entity": shard.entity, "ts": shard.ts, **shard.columns})
            old.append(work / f"format2-{i:05d}.arrow")
            with ipc.new_file(str(old[-1]), table.schema) as w:
                for batch in table.to_batches(1 << 16):
                    w.write_batch(batch)
        new_s, old_s = [], []
        for _ in range(repeats):
            new_s.append(read_all_shards(cache))
            old_s.append(read_format2(old))
        shard_bytes = sum((folder / f).stat().st_size for m in cache.manifest["shards"] for f in m["files"])
        return {"dataset": name, "events": cache.manifest["n_events"], "source_bytes": source_bytes,
                "cache_bytes": folder_bytes(folder), "cache_to_source_ratio": round(folder_bytes(folder) / source_bytes, 3),
                "format2_shard_bytes": sum(p.stat().st_size for p in old), "shard_bytes": shard_bytes,
                "read_s": round(min(new_s), 4), "format2_read_s": round(min(old_s), 4),
                "read_time_ratio": round(min(new_s) / min(old_s), 3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="demo,tafeng")
    parser.add_argument("--customers", type=int, default=20_000, help="demo customers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    rows = [measure(d, args.customers, args.repeats) for d in args.datasets.split(",")]
    shown = [{**r, "source_mb": r["source_bytes"] / 1e6, "cache_mb": r["cache_bytes"] / 1e6,
             "format2_mb": r["format2_shard_bytes"] / 1e6} for r in rows]
    print("\n" + text_table(shown, [("dataset", "dataset", ""), ("events", "events", ","), ("source MB", "source_mb", ".2f"),
                                   ("cache MB", "cache_mb", ".2f"), ("ratio", "cache_to_source_ratio", ".2f"),
                                   ("format 2 shards MB", "format2_mb", ".2f"), ("read s", "read_s", ".3f"),
                                   ("format 2 read s", "format2_read_s", ".3f"), ("read ratio", "read_time_ratio", ".2f")]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
