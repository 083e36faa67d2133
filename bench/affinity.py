"""Per-label co-occurrence affinity (models/data/affinity.py) in the served head and in LightGBM, with and
without, on a temporal hold-out: paired entity bootstrap intervals of the difference.

    python bench/affinity.py --dataset tafeng [--seeds 0,1,2] [--json out.json]
    python bench/affinity.py --dataset demo --customers 20000

The protocol is bench/quality.py's (its dataset specs and propensity task, imported): the foundation
model (seed 0) and the fine-tuned network (the scenario's recipe, the network alone) are trained
once; at every cut-off (training, validation, test) an Affinity is fitted on that cut-off's past
only. Per tree seed:

- "habitus": the served head as models/heads/stacked_head.py chooses it on validation (the network, the
  trees over [hand features + 16 principal components of the foundation] or their blend), the trees
  with and without each label's affinity columns;
- "lightgbm": the baseline's per-label LightGBM (models/tasks/multilabel.py's parameters, the same
  training rows, early stopped on the validation cut-off) over the hand features, with and without.

Macro AUROC at the test cut-off over the labels with both classes; the interval is a paired bootstrap
over test entities (this script's own, 200 resamples, the seeds' mean difference in each resample).
`--lightgbm-only` runs the LightGBM rows alone (no network, no served head).
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
from quality import dataset_parser, dataset_spec, tasks  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.data.affinity import Affinity  # noqa: E402
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec, chunk_at  # noqa: E402
from habitus.models.evaluate.baselines import MULTILABEL_ROWS, most_frequent_labels  # noqa: E402
from habitus.models.evaluate.holdout import protocol  # noqa: E402
from habitus.models.heads.stacked_rows import Rows, collect  # noqa: E402
from habitus.models.heads.stacking import StackConfig, fit_stack  # noqa: E402
from habitus.models.nn.network import load_trunk  # noqa: E402
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402
from habitus.models.train.scenario import train_scenario  # noqa: E402


def weighted_macro_auroc(y: np.ndarray, s: np.ndarray, w: np.ndarray) -> np.ndarray:
    """[resamples] macro AUROC of scores `s` [n, labels] for 0/1 `y` [n, labels] under entity weights
    `w` [resamples, n] (a bootstrap's multiplicities; ones: the plain figure). Ties count a half."""
    out = np.zeros((len(w), y.shape[1]))
    for j in range(y.shape[1]):
        order = np.argsort(s[:, j], kind="stable")
        sj, yj = s[order, j], y[order, j]
        starts = np.r_[0, np.flatnonzero(np.diff(sj)) + 1]
        wp = np.add.reduceat(w[:, order] * yj, starts, axis=1)
        wn = np.add.reduceat(w[:, order] * (1 - yj), starts, axis=1)
        below = np.cumsum(wn, axis=1) - wn
        pos, neg = wp.sum(1), wn.sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            out[:, j] = (wp * (below + 0.5 * wn)).sum(1) / (pos * neg)
    return np.nanmean(out, axis=1)


def paired(y, arms_a: list, arms_b: list, resamples: int = 200, seed: int = 0) -> dict:
    """mean over seeds of macro AUROC (a) - (b), with a paired entity bootstrap 95% interval."""
    keep = (y.min(0) < y.max(0))
    y = y[:, keep]
    rng = np.random.default_rng(seed)
    ones = np.ones((1, len(y)))
    w = rng.multinomial(len(y), np.full(len(y), 1 / len(y)), size=resamples).astype(np.float64)
    a = [weighted_macro_auroc(y, s[:, keep], np.r_[ones, w]) for s in arms_a]
    b = [weighted_macro_auroc(y, s[:, keep], np.r_[ones, w]) for s in arms_b]
    diff = np.mean(a, 0) - np.mean(b, 0)
    lo, hi = np.quantile(diff[1:], [0.025, 0.975])
    return {"a": float(np.mean([x[0] for x in a])), "b": float(np.mean([x[0] for x in b])),
            "a_seeds": [round(float(x[0]), 4) for x in a], "b_seeds": [round(float(x[0]), 4) for x in b],
            "diff": float(diff[0]), "low": float(lo), "high": float(hi)}


def lightgbm_per_label(train: Rows, val: Rows, test: Rows, seed: int, with_affinity: bool) -> np.ndarray:
    """The baseline's per-label LightGBM (models/tasks/multilabel.py's parameters) over the hand features
    (+ each label's own affinity columns)."""
    import warnings

    import lightgbm as lgb

    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # (as baselines.lightgbm_scores)
    params = dict(n_estimators=100, learning_rate=0.1, num_leaves=15, min_child_samples=50, subsample=0.8,
                  subsample_freq=1, colsample_bytree=0.8, max_bin=63, random_state=seed, verbose=-1, n_jobs=1)
    rows = np.random.default_rng(seed).permutation(len(train))[:MULTILABEL_ROWS]
    sub = train.take(rows)
    out = np.zeros(test.y.shape, np.float32)

    def x(r: Rows, j: int) -> np.ndarray:
        return np.concatenate([r.hand, r.affinity[:, j, :]], 1) if with_affinity else r.hand

    for j in range(sub.y.shape[1]):
        if sub.y[:, j].min() == sub.y[:, j].max():
            out[:, j] = sub.y[0, j]
            continue
        model = lgb.LGBMClassifier(**params)
        model.fit(x(sub, j), np.ascontiguousarray(sub.y[:, j]),
                  eval_set=[(x(val, j), np.ascontiguousarray(val.y[:, j]))], callbacks=[lgb.early_stopping(15, verbose=False)])
        out[:, j] = model.predict_proba(x(test, j))[:, 1]
    return out


def run(dataset: str, customers: int, seeds: list[int], workdir: Path, log=print, lightgbm_only: bool = False,
        scores: Path | None = None) -> dict:
    spec, test_cutoff, params = dataset_spec(dataset, customers, workdir)
    cache = Cache(build_cache(spec, workdir / "cache", log=lambda _: None))
    fcfg = FoundationConfig()
    t0 = time.time()
    foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=lambda _: None)
    log(f"foundation {time.time() - t0:.0f}s")
    fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    state = foundation.model.state_dict()
    task = tasks(cache, test_cutoff, params)["propensity"]
    plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
    t0 = time.time()
    cfg = ScenarioConfig("propensity", task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, FinetuneConfig(),
                         refit=False, head="network")
    net = None if lightgbm_only else \
        train_scenario(cache, state, foundation.info, cfg, log=lambda _: None, baselines=False).trained.model
    log(f"network {time.time() - t0:.0f}s")
    trunk = load_trunk(state, foundation.info["net"]).float().eval()
    labels = most_frequent_labels(cache, task, plan.train_cutoffs, StackConfig().max_labels)
    fit_s, rows = [], {}
    for name, cutoffs in (("train", plan.train_cutoffs), ("val", [plan.val_cutoff]), ("test", [plan.test_cutoff])):
        parts = []
        for c in cutoffs:
            t0 = time.time()
            aff = Affinity.fit(cache, c, task.target.column, task.target.labels)
            fit_s.append(time.time() - t0)
            parts.append(collect(cache, fspec, task, trunk, c, labels=labels, affinity=aff,
                                 model=None if name == "train" else net))
        rows[name] = Rows.concat(parts)
    # the added featurization alone, at the test cut-off
    t0 = time.time()
    n = 0
    for s, lo, hi in chunk_plan(cache, SCORING_CHUNK_ENTITIES):
        chunk = chunk_at(cache.shard(s), lo, hi, plan.test_cutoff)
        aff.features(chunk, labels)
        n += chunk.n
    feat_s = time.time() - t0
    log(f"affinity: levels {list(aff.levels)}, fit {np.mean(fit_s):.1f}s per cut-off, features {feat_s:.1f}s for {n} "
        f"entities; rows train {len(rows['train'])}, val {len(rows['val'])}, test {len(rows['test'])}")
    bare = {k: dataclasses.replace(r, affinity=None) for k, r in rows.items()}
    served = {True: [], False: []}
    lgbm = {True: [], False: []}
    chosen = {True: [], False: []}
    for seed in seeds:
        for with_aff, r in ((True, rows), (False, bare)):
            if not lightgbm_only:
                stack = fit_stack(task.task, r["train"], r["val"], StackConfig(seed=seed, threads=1), labels=labels)
                served[with_aff].append(stack.predict(r["test"]))
                chosen[with_aff].append(f"{stack.chosen} {stack.weight}")
            lgbm[with_aff].append(lightgbm_per_label(rows["train"], rows["val"], rows["test"], seed, with_aff))
        log(f"seed {seed}: heads with {chosen[True][-1:]}, without {chosen[False][-1:]}")
    y = rows["test"].y
    if scores is not None:  # the test scores, before the (slow) bootstrap
        np.savez_compressed(scores, y=y, entities=rows["test"].entities, **{f"lightgbm_{k}": np.stack(v) for k, v in
                            (("with", lgbm[True]), ("without", lgbm[False]))},
                            **({} if lightgbm_only else {"served_with": np.stack(served[True]),
                                                         "served_without": np.stack(served[False]),
                                                         "network": rows["test"].network}))
    if lightgbm_only:
        result = {"dataset": dataset, "seeds": seeds, "labels": int(y.shape[1]), "test_entities": int(len(y)),
                  "levels": list(aff.levels), "fit_s_per_cutoff": round(float(np.mean(fit_s)), 2),
                  "features_s": round(feat_s, 2), "features_entities": n,
                  "lightgbm_with_minus_without": paired(y, lgbm[True], lgbm[False])}
        v = result["lightgbm_with_minus_without"]
        log(f"lightgbm_with_minus_without: {v['a']:.4f} - {v['b']:.4f} = {v['diff']:+.4f} [{v['low']:+.4f}, "
            f"{v['high']:+.4f}]")
        return result
    network = paired(y, [rows["test"].network], [rows["test"].network], resamples=1)["a"]
    result = {"dataset": dataset, "seeds": seeds, "labels": int(y.shape[1]), "test_entities": int(len(y)),
              "levels": list(aff.levels), "fit_s_per_cutoff": round(float(np.mean(fit_s)), 2),
              "features_s": round(feat_s, 2), "features_entities": n, "network_alone": network,
              "heads_with": chosen[True], "heads_without": chosen[False],
              "habitus_with_minus_without": paired(y, served[True], served[False]),
              "lightgbm_with_minus_without": paired(y, lgbm[True], lgbm[False]),
              "habitus_with_minus_lightgbm_with": paired(y, served[True], lgbm[True]),
              "habitus_without_minus_lightgbm_without": paired(y, served[False], lgbm[False])}
    for k, v in result.items():
        if isinstance(v, dict):
            log(f"{k}: {v['a']:.4f} - {v['b']:.4f} = {v['diff']:+.4f} [{v['low']:+.4f}, {v['high']:+.4f}]")
    return result


def main() -> None:
    parser = dataset_parser(__doc__)
    parser.add_argument("--seeds", default="0,1,2", help="the trees' seeds (comma-separated)")
    parser.add_argument("--tafeng", default=str(quality.TAFENG), help="the Ta-Feng folder (shared/data/tafeng)")
    parser.add_argument("--lightgbm-only", action="store_true", help="the LightGBM rows alone")
    parser.add_argument("--scores", help="also save the test scores (.npz) here, before the bootstrap")
    args = parser.parse_args()
    quality.TAFENG = Path(args.tafeng)
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.dataset, args.customers, seeds, Path(tmp),
                     log=lambda m: print(m, file=sys.stderr, flush=True), lightgbm_only=args.lightgbm_only,
                     scores=None if args.scores is None else Path(args.scores))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
