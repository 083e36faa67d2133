"""What the foundation's sequence encoder costs: features, a scoring pass and a training step of the
trunk with the last N events against the aggregate trunk alone, on the same entities in the same run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/sequence_cost.py [--customers 5000] [--lengths 32,64]

The demo generator's warehouse (pipelines/demo/data.py), one cut-off, every entity; each figure is
the median of `--repeats` passes, reported as entities/s and as the ratio to the aggregate trunk."""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quality import demo_spec  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.data.chunks import chunk_plan  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec, chunk_at, featurize  # noqa: E402
from habitus.models.nn.network import Model, NetConfig  # noqa: E402
from habitus.models.train.config import FoundationConfig  # noqa: E402


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(cache: Cache, cutoff: int, length: int, repeats: int) -> dict:
    cfg = FoundationConfig()
    spec = FeatureSpec.from_cache(cache, cfg.buckets, cfg.half_lives, length)
    table = cache.entity_table()
    chunks = [chunk_at(cache.shard(s), lo, hi, cutoff) for s, lo, hi in chunk_plan(cache, cfg.chunk_entities)]
    x = np.concatenate([featurize(c, spec, table) for c in chunks])
    n = len(x)
    features_s = median_time(lambda: [featurize(c, spec, table) for c in chunks], repeats)
    net = NetConfig(spec.width, cfg.hidden, cfg.layers, cfg.dropout, spec.scalar_width, cfg.ple_bins,
                    spec.entity_scalar_width, length, spec.token_vocab, len(spec.numeric), cfg.sequence_dim,
                    cfg.sequence_layers)
    torch.manual_seed(0)
    model = Model(net, 8)
    xt = torch.from_numpy(x)
    model.trunk.fit_input_scale(xt, cfg.std_floor)
    batches = torch.split(xt, cfg.batch_size)

    def score():
        with torch.no_grad():
            for b in batches:
                model.eval()(b)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train():
        model.train()
        for b in batches:
            loss = model(b).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    return {"length": length, "entities": n, "features": n / features_s, "scoring": n / median_time(score, repeats),
            "training": n / median_time(train, repeats),
            "parameters": sum(p.numel() for p in model.trunk.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--customers", type=int, default=5000)
    ap.add_argument("--lengths", default="32,64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, _ = demo_spec(args.customers, Path(tmp))
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=lambda _: None))
        cutoff = test_cutoff - 28 * DAY
        rows = [measure(cache, cutoff, n, args.repeats) for n in [0] + [int(v) for v in args.lengths.split(",")]]
    base = rows[0]
    print(f"demo, {args.customers} customers, {base['entities']} entities at one cut-off; "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"{'trunk':<22} {'parameters':>10} {'features/s':>11} {'ratio':>6} {'scoring/s':>10} {'ratio':>6} "
          f"{'training/s':>11} {'ratio':>6}")
    for r in rows:
        name = "aggregate" if not r["length"] else f"+ last {r['length']} events"
        print(f"{name:<22} {r['parameters']:>10,} {r['features']:>11,.0f} {r['features'] / base['features']:>6.2f} "
              f"{r['scoring']:>10,.0f} {r['scoring'] / base['scoring']:>6.2f} {r['training']:>11,.0f} "
              f"{r['training'] / base['training']:>6.2f}")


if __name__ == "__main__":
    main()
