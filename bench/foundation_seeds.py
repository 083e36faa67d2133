"""How far the foundation model's embeddings move with its seed, under foundation settings to compare.

    OMP_NUM_THREADS=1 python bench/foundation_seeds.py --dataset demo --seeds 0,1,2,3 \
        --variants default,learning_rate=0.001,cutoffs_per_chunk=4

Per variant and seed: the foundation model alone, read by the panel's probe (bench/panel.py
probe_arms: a C = 1 logistic regression on the embeddings without the appended scalars, fitted at
the validation cut-off, scored at the test cut-off on churn) against the RFM / visit scalars, paired
entity bootstrap; per variant, the seeds' spread and their combined interval. The demo's caches
leave `segment` out as the panel's do. A seed whose embeddings lose to the scalars is what the panel
found at the demo's seed 1 (docs/journal/quality.md, "The panel at more seeds").
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import withheld  # noqa: E402
from intervals import combine, paired_many  # noqa: E402
from foundation_settings import settings  # noqa: E402
from panel import probe_arms  # noqa: E402
from quality import dataset_spec, tasks  # noqa: E402


def run(dataset: str, customers: int, seeds: list[int], variants: list[str], draws: int, log=print):
    from habitus.models.cache import Cache, build_cache
    from habitus.models.data.features import DAY, FeatureSpec
    from habitus.models.evaluate.holdout import protocol
    from habitus.models.train.config import TRAIN_CUTOFFS, FoundationConfig
    from habitus.models.train.foundation import train_foundation

    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, params = dataset_spec(dataset, customers, Path(tmp))
        spec = withheld.without(spec, dataset)
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=lambda _: None))
        churn = tasks(cache, test_cutoff, params)["churn"]
        plan = protocol(test_cutoff, churn.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
        for variant in variants:
            found = []
            for seed in seeds:
                cfg = FoundationConfig(**{**settings(variant), "seed": seed})
                t0 = time.time()
                foundation = train_foundation(cache, cfg, test_cutoff - cfg.horizon_days * DAY, log=lambda _: None)
                fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
                y, arms = probe_arms(foundation, cache, fspec, churn.target, plan)
                p = paired_many(y, {k: s for k, (_, s) in arms.items()}, [("embeddings", "rfm scalars")], draws,
                                seed=seed)[("embeddings", "rfm scalars")]
                found.append(p)
                log(f"{dataset} {variant} seed {seed}: embeddings {p.a:.4f}, rfm scalars {p.b:.4f}, {p.diff:+.4f} "
                    f"[{p.diff - 1.96 * p.var ** 0.5:+.4f}, {p.diff + 1.96 * p.var ** 0.5:+.4f}]; val loss "
                    f"{[round(v, 4) for v in foundation.curves['val_loss']]} ({time.time() - t0:.0f}s)")
            c = combine([p.diff for p in found], [p.var for p in found])
            log(f"VARIANT {dataset} {variant}: embeddings {np.mean([p.a for p in found]):.4f}, worst seed "
                f"{min(p.diff for p in found):+.4f}, over seeds {c.mean:+.4f} [{c.lo:+.4f}, {c.hi:+.4f}]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="demo")
    ap.add_argument("--customers", type=int, default=50_000)
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--draws", type=int, default=200)
    a = ap.parse_args()
    run(a.dataset, a.customers, [int(s) for s in a.seeds.split(",")], a.variants.split(","), a.draws,
        log=lambda m: print(m, flush=True))


if __name__ == "__main__":
    main()
