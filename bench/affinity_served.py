"""The served head (models/heads/stacked_head.py) with and without its label trees' co-occurrence
affinity (StackConfig.affinity; models/data/affinity.py's served_affinity), on a temporal hold-out.

    OMP_NUM_THREADS=1 python bench/affinity_served.py --dataset tafeng --tafeng shared/data/tafeng
    OMP_NUM_THREADS=1 python bench/affinity_served.py --dataset demo --customers 20000

bench/quality.py's protocol and propensity task (imported): the foundation, then the scenario's network
fine-tuned once (seed 0), then the head chosen on validation fitted twice on the same network, with and
without the affinity columns (the affinity fitted at every training cut-off and the validation
cut-off, each on its own past). Both heads score the test cut-off as serving does (the affinity the
head saved, fitted at the validation cut-off, over each entity's events up to the test cut-off).
Macro AUROC over the labels with trees (the 50 most frequent) of the chosen candidate and of the trees
alone, with bench/intervals.py's paired entity bootstrap (1,000 stratified resamples).
"""

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import quality  # noqa: E402
from intervals import paired_many  # noqa: E402
from quality import dataset_parser, dataset_spec, tasks  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec  # noqa: E402
from habitus.models.evaluate.holdout import protocol  # noqa: E402
from habitus.models.heads.stacked_head import fit_head  # noqa: E402
from habitus.models.heads.stacked_rows import collect  # noqa: E402
from habitus.models.heads.stacking import StackConfig  # noqa: E402
from habitus.models.nn.network import load_trunk  # noqa: E402
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402
from habitus.models.train.scenario import train_scenario  # noqa: E402


def run(dataset: str, customers: int, workdir: Path, log=print, scores_path: Path | None = None) -> dict:
    spec, test_cutoff, params = dataset_spec(dataset, customers, workdir)
    cache = Cache(build_cache(spec, workdir / "cache", log=lambda _: None))
    fcfg = FoundationConfig()
    foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=lambda _: None)
    state, info = foundation.model.state_dict(), foundation.info
    fspec = FeatureSpec.from_dict(info["feature_spec"])
    task = tasks(cache, test_cutoff, params)["propensity"]
    plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
    cfg = ScenarioConfig("propensity", task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                         dataclasses.replace(FinetuneConfig(), seed=0), refit=False, head="network")
    t0 = time.time()
    model = train_scenario(cache, state, info, cfg, log=lambda _: None, baselines=False).trained.model
    log(f"foundation and network fine-tuned; network {time.time() - t0:.0f}s")
    scores, out = {}, {"dataset": dataset, "heads": {}}
    y = None
    for with_affinity in (True, False):
        name = "with" if with_affinity else "without"
        t0 = time.time()
        head = fit_head(cache, fspec, task, load_trunk(state, info["net"]), model, plan.train_cutoffs, plan.val_cutoff,
                        cfg=StackConfig(affinity=with_affinity), log=log)
        fit_s = time.time() - t0
        t0 = time.time()
        rows = collect(cache, fspec, task, head.trunk, plan.test_cutoff, labels=head.labels, model=model,
                       affinity=head.affinity)
        trees = head.stack.gbt_scores(rows)
        scores[name], scores[f"trees {name}"], scores["network"] = head.choose(rows.network, trees), trees, rows.network
        y = rows.y if y is None else y
        out["heads"][name] = {"chosen": head.chosen, "weight": head.weight, "fit_head_s": round(fit_s, 1),
                              "test_rows_s": round(time.time() - t0, 1),
                              "affinity_levels": None if head.affinity is None else list(head.affinity.levels),
                              "validation": head.stack.validation.get("chosen")}
        log(f"head {name}: {head.chosen} (w {head.weight}), fit {fit_s:.0f}s")
    if scores_path is not None:  # the test scores, before the bootstrap
        np.savez_compressed(scores_path, y=y, **{k.replace(" ", "_"): v for k, v in scores.items()})
    pairs = [("with", "without"), ("trees with", "trees without"), ("with", "network")]
    for (a, b), p in paired_many(y, scores, pairs).items():
        half = 1.96 * np.sqrt(p.var)
        out[f"{a} - {b}"] = {"a": p.a, "b": p.b, "diff": p.diff, "low": p.diff - half, "high": p.diff + half}
        log(f"{a} - {b}: {p.a:.4f} - {p.b:.4f} = {p.diff:+.4f} [{p.diff - half:+.4f}, {p.diff + half:+.4f}]")
    out["test_entities"], out["labels"] = int(len(y)), int(y.shape[1])
    return out


def main() -> None:
    parser = dataset_parser(__doc__)
    parser.add_argument("--tafeng", default=str(quality.TAFENG), help="the Ta-Feng folder (shared/data/tafeng)")
    parser.add_argument("--scores", help="also save the test scores (.npz) here, before the bootstrap")
    args = parser.parse_args()
    quality.TAFENG = Path(args.tafeng)
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.dataset, args.customers, Path(tmp), log=lambda m: print(m, file=sys.stderr, flush=True),
                     scores_path=None if args.scores is None else Path(args.scores))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
