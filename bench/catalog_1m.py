"""Top-10 recommendation from a catalog of 1,000,000 items: fine-tuning, the hold-out (HR@10 and
NDCG@10 next to past frequency and popularity) and scoring speed and memory, on generated data.

    .venv/bin/python bench/catalog_1m.py                     # 20,000 entities, 1M items (~15 min on 2 cores)
    .venv/bin/python bench/catalog_1m.py --items 100000 --json out.json

Data (seeded): a long-tail catalog (item popularity Zipf, exponent 1.1, so a few thousand items hold
half the purchases and most items sell once or never), and entities that each keep a personal set of
8 favourites drawn from that tail and buy from it with probability 0.5, otherwise from the whole
catalog, at their own pace, over 180 days; a third of them stop at a random day. Every item is also
sold once in the first 60 days to a random entity, so that the whole catalog is in the cache's
vocabulary (the items the head ranks). The project's own
code runs every stage, as the assets do: build_cache, train_foundation (1 epoch, hidden 64), finetune
of a recommendation scenario over every item (`items: item_id`, k 10; 2 epochs; the re-ranking trees
of models/tasks/rerank.py included), evaluate at the test cut-off (14-day window), predict (the asset's
top-10 lists). Each stage runs in a fresh process; "peak GB" is its maximum RSS (ru_maxrss), and
entities/s is the entities scored over the wall time of the predict stage.
Never part of the tests.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DAY = 86_400
T0 = 1_767_225_600  # 2026-01-01 00:00 UTC
SPAN_DAYS, WINDOW = 180, 14


def generate(folder: Path, entities: int, items: int, seed: int = 0) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, items + 1) ** 1.1
    weights /= weights.sum()
    cdf = np.cumsum(weights)
    draw = lambda n: np.minimum(np.searchsorted(cdf, rng.random(n)), items - 1)  # noqa: E731
    customer, ts, item = [], [], []
    for e in range(entities):
        favourites = draw(8)
        stop = rng.uniform(30, SPAN_DAYS) if rng.random() < 1 / 3 else SPAN_DAYS
        n = rng.poisson(rng.uniform(0.05, 0.4) * stop)
        own = rng.random(n) < 0.5
        picks = np.where(own, favourites[rng.integers(0, 8, n)], draw(n))
        customer.append(np.full(n, e))
        ts.append(T0 + (rng.uniform(0, stop, n) * DAY).astype(np.int64))
        item.append(picks)
    # every item of the catalog sold once in the first 60 days, to a random entity: the cache's vocabulary
    # (what the head ranks) is the items that ever sold, so the whole catalog is in it
    customer.append(rng.integers(0, entities, items))
    ts.append(T0 + (rng.uniform(0, 60, items) * DAY).astype(np.int64))
    item.append(np.arange(items))
    customer, ts, item = np.concatenate(customer), np.concatenate(ts), np.concatenate(item)
    table = pa.table({"customer_id": pa.array([f"c{c:06d}" for c in customer]),
                      "ts": pa.array(ts, pa.timestamp("s")),
                      "item_id": pa.array([f"i{i:07d}" for i in item])})
    path = folder / "events.parquet"
    pq.write_table(table, path)
    return {"events": len(ts), "entities": entities, "items": items, "items_sold": int(len(np.unique(item))),
            "path": str(path)}


def stage(name: str, folder: Path, items: int) -> dict:
    """One stage in this (child) process."""
    import torch

    from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
    from habitus.models.evaluate.holdout import evaluate, protocol
    from habitus.models.data.features import FeatureSpec
    from habitus.models.train.finetune import finetune
    from habitus.models.train.foundation import train_foundation
    from habitus.models.train.config import FinetuneConfig, FoundationConfig
    from habitus.models.tasks.spec import TaskSpec
    from habitus.models.data.targets import TargetSpec

    test_cutoff = T0 + (SPAN_DAYS - WINDOW) * DAY
    started = time.perf_counter()
    if name == "cache":
        spec = CacheSpec("customer_id", [TableInput("events", [str(folder / "events.parquet")],
                                                    {"item_id": "categorical"}, timestamp="ts")])
        (folder / "cache_path").write_text(str(build_cache(spec, folder / "cache", log=lambda _: None)))
        return {"seconds": time.perf_counter() - started}
    cache = Cache((folder / "cache_path").read_text())
    if name == "foundation":
        cfg = FoundationConfig(hidden=64, layers=1, epochs=1)
        result = train_foundation(cache, cfg, test_cutoff - WINDOW * DAY, device="cpu", log=lambda _: None)
        torch.save({"state": result.model.state_dict(), "info": result.info}, folder / "foundation.pt")
        return {"seconds": time.perf_counter() - started}
    vocab = cache.columns["item_id"]["vocab_size"]
    task = TaskSpec("recommendation", TargetSpec("items", WINDOW, "item_id", tuple(range(1, vocab + 1))), k=10,
                    item_dim=32)
    saved = torch.load(folder / "foundation.pt", weights_only=True)  # tensors and plain values only
    spec = FeatureSpec.from_dict(saved["info"]["feature_spec"])
    plan = protocol(test_cutoff, WINDOW, 4, cache.time_range[0])
    if name == "finetune":
        result = finetune(cache, saved["state"], saved["info"], task, list(plan.train_cutoffs), plan.val_cutoff,
                          FinetuneConfig(epochs=2), device="cpu", log=lambda _: None)
        torch.save(result.model.state_dict(), folder / "scenario.pt")
        return {"seconds": time.perf_counter() - started, "catalog": vocab,
                "second_stage": result.info.get("second_stage")}
    from habitus.models.tasks.scoring import build_model
    from habitus.models.nn.network import NetConfig

    model = build_model(NetConfig.from_dict(saved["info"]["net"]), task, spec)
    model.load_state_dict(torch.load(folder / "scenario.pt", weights_only=True))
    model.eval()
    if name == "evaluate":
        report = evaluate(model, cache, spec, task, plan.test_cutoff)
        return {"seconds": time.perf_counter() - started, "entities": report["entities"], "model": report["model"],
                "baselines": report["baselines"]}
    if name == "predict":
        from habitus.models.serve.predict import predict

        rows = sum(b.num_rows for b in predict(model, cache, spec, task, plan.test_cutoff + WINDOW * DAY, k=10))
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "rows": rows, "entities_per_s": rows / seconds, "catalog": vocab}
    raise ValueError(name)


def run(name: str, folder: Path, items: int) -> dict:
    """A stage in a fresh process (its own peak memory: ru_maxrss, read by the child at its end)."""
    proc = subprocess.run([sys.executable, __file__, "--child", name, str(folder), str(items)],
                          stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"stage {name} failed (exit {proc.returncode})")
    return json.loads(lines[-1][7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--entities", type=int, default=20_000)
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.child:
        import resource

        name, folder, items = args.child
        r = stage(name, Path(folder), int(items))
        r["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print("RESULT " + json.dumps(r), flush=True)
        return
    folder = args.work or Path(tempfile.mkdtemp(prefix="habitus-catalog-"))
    folder.mkdir(parents=True, exist_ok=True)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    result = {"data": generate(folder, args.entities, args.items)}
    say(f"generated {result['data']}")
    for name in ("cache", "foundation", "finetune", "evaluate", "predict"):
        result[name] = run(name, folder, args.items)
        say(f"{name}: {result[name]}")
    ev, pr = result["evaluate"], result["predict"]
    lines = [f"catalog {pr['catalog']:,} items ({result['data']['items_sold']:,} ever sold), "
             f"{result['data']['events']:,} events, {args.entities:,} entities",
             f"{'stage':<12} {'seconds':>8} {'peak GB':>8}  notes"]
    for name in ("cache", "foundation", "finetune", "evaluate", "predict"):
        r = result[name]
        note = ""
        if name == "finetune" and r.get("second_stage"):
            note = f"re-ranking: {r['second_stage'].get('chosen')}"
        if name == "predict":
            note = f"{r['entities_per_s']:,.0f} entities/s (top-10 of the whole catalog, {r['rows']:,} entities)"
        if name == "evaluate":
            note = (f"HR@10 {ev['model']['hr@10']:.4f} (past frequency {ev['baselines']['past frequency']['hr@10']:.4f}, "
                    f"popularity {ev['baselines']['popularity']['hr@10']:.4f}); NDCG@10 {ev['model']['ndcg@10']:.4f} "
                    f"({ev['baselines']['past frequency']['ndcg@10']:.4f}, {ev['baselines']['popularity']['ndcg@10']:.4f}); "
                    f"{ev['entities']:,} entities bought in the window")
        lines.append(f"{name:<12} {r['seconds']:>8.1f} {r['peak_rss_gb']:>8.2f}  {note}")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
