"""Heads chosen on validation, measured: per dataset and task, at the test cut-off, the fine-tuned
network, LightGBM on hand features (the baseline, habitus.models.evaluate.baselines.lightgbm_scores),
LightGBM on [the foundation's embedding + hand features], their blend, and what the validation
cut-off chose (habitus.models.heads.stacking), with every candidate's validation score.

    python bench/stacking.py --dataset tafeng [--tasks churn,propensity,spend] [--json out.json]
    python bench/stacking.py --dataset demo [--customers 20000]
    python bench/stacking.py --dataset movielens
    python bench/stacking.py --dataset tafeng --variants default,components=8,choice_rule=best/se_blocks=5
                                                     # variants: StackConfig changes, "/" between fields

The columns: "gbt" is the trees alone (w = 1), "blend" the best blend strictly between 0 and 1 on
validation, "chosen" what StackConfig's rule picked (its weight in the "val" line); "val" is the
validation cut-off (every row scored by the trees of the other fold), "test" the test cut-off.
Run it with OMP_NUM_THREADS=1 on a loaded machine: LightGBM's threads spin-wait on each other.

Same datasets, cut-offs and scenarios as bench/quality.py (imported from it), one foundation per
dataset, one fine-tuning per task (seed 0). `--keep DIR` saves each task's rows (hand features,
embeddings, targets, network scores) there and `--reuse` reads them back instead of training again,
for trying the stack's options on the same network.
"""

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from quality import dataset_parser, dataset_spec, machine, tasks  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec  # noqa: E402
from habitus.models.evaluate.baselines import lightgbm_scores, most_frequent_labels  # noqa: E402
from habitus.models.evaluate.holdout import LOWER_IS_BETTER, evaluate, headline, protocol  # noqa: E402
from habitus.models.heads.stacked_rows import Rows, collect  # noqa: E402
from habitus.models.heads.stacking import StackConfig, blend, fit_stack, score  # noqa: E402
from habitus.models.tasks import task as task_of  # noqa: E402
from habitus.models.train.finetune import finetune  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402
from habitus.models.train.config import FinetuneConfig, FoundationConfig  # noqa: E402

TASKS = ("churn", "propensity", "spend")


def _save(path: Path, rows: dict[str, Rows], extra: dict) -> None:
    arrays = {}
    for name, r in rows.items():
        for k in ("entities", "hand", "embedding", "y", "network"):
            v = getattr(r, k)
            if v is not None:
                arrays[f"{name}.{k}"] = v
    arrays.update({k: np.asarray(v) for k, v in extra.items() if v is not None})
    np.savez(path, **arrays)


def _load(path: Path) -> tuple[dict[str, Rows], dict]:
    z = np.load(path, allow_pickle=False)
    rows = {}
    for name in ("train", "val", "test"):
        rows[name] = Rows(z[f"{name}.entities"], z[f"{name}.hand"], z[f"{name}.embedding"], z[f"{name}.y"],
                          z[f"{name}.network"] if f"{name}.network" in z else None)
    extra = {k: z[k] for k in z.files if "." not in k}
    return rows, extra


def run(dataset: str, customers: int, only: tuple[str, ...], variants: tuple[str, ...], keep: Path | None,
        reuse: bool, log=print) -> dict:
    quiet = lambda _: None  # noqa: E731
    t_run = time.time()
    out = {"dataset": dataset, "machine": machine(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec, test_cutoff, params = dataset_spec(dataset, customers, tmp)
        cache = Cache(build_cache(spec, tmp / "cache", log=quiet))
        foundation = None
        for name, task in tasks(cache, test_cutoff, params).items():
            if name not in only:
                continue
            plan = protocol(test_cutoff, task.target.window_days, 4, cache.time_range[0])
            saved = keep / f"{dataset}_{name}.npz" if keep else None
            row = {"task": name, "metric": headline(task)}
            if reuse and saved and saved.exists():
                data, extra = _load(saved)
                lgbm, row["finetune_s"], row["collect_s"] = extra.get("lightgbm"), float(extra["finetune_s"]), \
                    float(extra["collect_s"])
                row["lightgbm_s"] = float(extra.get("lightgbm_s", np.nan))
                labels = extra.get("labels")
                log(f"{dataset} {name}: rows read back from {saved}")
            else:
                if foundation is None:
                    t0 = time.time()
                    fcfg = FoundationConfig()
                    foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=quiet)
                    fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
                    state = foundation.model.state_dict()
                    out["foundation_s"] = round(time.time() - t0, 1)
                    log(f"{dataset}: foundation {out['foundation_s']}s")
                t0 = time.time()
                tuned = finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff,
                                 FinetuneConfig(), log=quiet)
                row["finetune_s"] = round(time.time() - t0, 1)
                log(f"{dataset} {name}: fine-tuned in {row['finetune_s']}s (epochs {tuned.info['soup_epochs']})")
                t0 = time.time()
                labels = (most_frequent_labels(cache, task, plan.train_cutoffs, StackConfig().max_labels)
                          if task_of(task).stacking.per_label else None)
                trunk = foundation.model.trunk
                parts = [collect(cache, fspec, task, trunk, c, labels=labels) for c in plan.train_cutoffs]
                data = {"train": Rows(*(np.concatenate([getattr(p, k) for p in parts]) for k in
                                        ("entities", "hand", "embedding", "y"))),
                        "val": collect(cache, fspec, task, trunk, plan.val_cutoff, labels=labels, model=tuned.model),
                        "test": collect(cache, fspec, task, trunk, plan.test_cutoff, labels=labels, model=tuned.model)}
                row["collect_s"] = round(time.time() - t0, 1)
                row["collect_rows"] = int(sum(len(r) for r in data.values()))
                t0 = time.time()
                lgbm = lightgbm_scores(cache, fspec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff)
                row["lightgbm_s"] = round(time.time() - t0, 1)
                if labels is not None and hasattr(lgbm, "scores"):
                    lgbm = lgbm.scores
                # the bench's own figure of the network, through habitus.models.evaluate.holdout (the check of the rows' order)
                report = evaluate(tuned.model, cache, fspec, task, plan.test_cutoff)
                row["network_evaluate"] = report["model"][row["metric"]]
                if saved:
                    keep.mkdir(parents=True, exist_ok=True)
                    _save(saved, data, {"lightgbm": lgbm, "finetune_s": row["finetune_s"],
                                        "collect_s": row["collect_s"], "lightgbm_s": row["lightgbm_s"],
                                        "labels": labels})
            test = data["test"]
            sign = -1 if row["metric"] in LOWER_IS_BETTER else 1
            row["entities"] = int(len(test))
            row["network"] = sign * score(task.task, test.y, test.network)
            row["lightgbm"] = sign * score(task.task, test.y, lgbm) if lgbm is not None else None
            row["variants"] = {}
            for variant in variants:
                cfg = variant_config(variant)
                stack = fit_stack(task.task, data["train"], data["val"], cfg, labels=labels, log=log)
                t0 = time.time()
                gbt = stack.gbt_scores(test)
                predict_s = time.time() - t0
                w = stack.validation["blend_weight"]
                v = {**stack.summary(), "seconds": stack.seconds,  # (then its validation scores in the metric's own sign)
                     "test": {"gbt": sign * score(task.task, test.y, gbt),
                              "blend": None if w is None else sign * score(task.task, test.y,
                                                                           blend(task.task, test.network, gbt, w)),
                              "chosen": sign * score(task.task, test.y, stack.predict(test, gbt)),
                              "best_weight_on_test": _best_on_test(task.task, test, gbt, cfg.weights, sign)},
                     "validation": {k: (sign * x if isinstance(x, float) and k not in ("blend_weight",) else x)
                                    for k, x in stack.validation.items() if k != "by_weight"},
                     "by_weight": {k: sign * x for k, x in stack.validation["by_weight"].items()},
                     "predict_us_per_entity": round(1e6 * predict_s / max(len(test), 1), 1)}
                row["variants"][variant] = v
                log(f"{dataset} {name} [{variant}]: test network {row['network']:.4f}, lightgbm {row['lightgbm']:.4f}, "
                    f"gbt {v['test']['gbt']:.4f}, blend {v['test']['blend']} (w {w}), chosen {stack.chosen} "
                    f"{v['test']['chosen']:.4f}; fit {stack.seconds}s")
            out["rows"].append(row)
    out["total_s"] = round(time.time() - t_run, 1)
    return out


def variant_config(name: str) -> StackConfig:
    """`default`, or `components=8/choice_share=0.3`: StackConfig fields to change."""
    cfg = StackConfig()
    for change in ([] if name == "default" else name.split("/")):
        key, value = change.split("=")
        kind_of = type(getattr(cfg, key))
        cfg = replace(cfg, **{key: value in ("1", "true", "True") if kind_of is bool else kind_of(value)})
    return cfg


def _best_on_test(task: str, test: Rows, gbt: np.ndarray, weights, sign: int) -> list:
    """(weight, score) of the best blend on the test cut-off itself: an upper bound, never a choice."""
    grid = {w: score(task, test.y, blend(task, test.network, gbt, w)) for w in weights}
    w = max(grid, key=lambda k: grid[k])
    return [w, sign * grid[w]]


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']} ({result['machine']}; foundation {result.get('foundation_s')}s, "
             f"whole run {result['total_s']}s)",
             f"{'task':<11} {'metric':<12} {'variant':<20} {'':<5} {'network':>8} {'lightgbm':>9} {'gbt':>8} "
             f"{'blend':>8} {'w':>4} {'chosen':>8}  {'picked':<8} {'fit s':>6} {'tune s':>6}"]
    for r in result["rows"]:
        for variant, v in r["variants"].items():
            t, val = v["test"], v["validation"]
            f = lambda x: "" if x is None else f"{x:.4f}"  # noqa: E731
            lines.append(f"{r['task']:<11} {r['metric']:<12} {variant:<20} {'test':<5} {r['network']:>8.4f} "
                         f"{f(r['lightgbm']):>9} {t['gbt']:>8.4f} {f(t['blend']):>8} "
                         f"{'' if val['blend_weight'] is None else val['blend_weight']:>4} {t['chosen']:>8.4f}  "
                         f"{v['chosen']:<8} {v['seconds']:>6} {r['finetune_s']:>6}")
            lines.append(f"{'':<11} {'':<12} {'':<20} {'val':<5} {val['network']:>8.4f} {'':>9} {val['gbt']:>8.4f} "
                         f"{f(val['blend']):>8} {'':>4} {val['chosen']:>8.4f}  (w {v['weight']}; "
                         f"best w on test {t['best_weight_on_test'][0]}: {t['best_weight_on_test'][1]:.4f})")
    lines.append("(mae: lower is better; the others higher. val: the validation cut-off, each row scored by the trees of the other fold)")
    return "\n".join(lines)


def main() -> None:
    parser = dataset_parser(__doc__)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--variants", default="default",
                        help="comma-separated variants: `default`, or StackConfig field=value changes joined "
                             "by / (components=8/choice_rule=best)")
    parser.add_argument("--keep", help="folder for each task's rows (npz)")
    parser.add_argument("--reuse", action="store_true", help="read the rows from --keep instead of training")
    args = parser.parse_args()
    only = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    variants = tuple(e.strip() for e in args.variants.split(",") if e.strip())
    result = run(args.dataset, args.customers, only, variants, Path(args.keep) if args.keep else None, args.reuse,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
