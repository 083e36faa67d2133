"""Refit or not (ScenarioConfig.refit, models/train/refit.py): a backtest one window back.

    python bench/refit_backtest.py --dataset demo --customers 5000 [--tasks churn,propensity,spend] [--json out.json]
    python bench/refit_backtest.py --dataset movielens
    python bench/refit_backtest.py --dataset tafeng                  # ../shared/data/tafeng

"Now" is one window before the dataset's test cut-off (bench/quality.py's). The product trains as it
would then: the foundation model on data before now, each scenario by its recipe (models/train/scenario.py)
with the protocol's cut-offs ending at now (training, validation, a hold-out window ending at now).
Refit off serves that measured model; refit on serves the same recipe trained again on cut-offs
through the hold-out's (its newest window ends at now). One run of the recipe gives both: the
measured model is what refit off serves (the refit does not touch it). Both served models, and the
LightGBM baseline fitted on the recipe's cut-offs, are then scored on the next window (the dataset's
real test window, after now) on the same entities.
"""

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quality import DATASETS, dataset_spec, machine, tasks  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec  # noqa: E402
from habitus.models.evaluate.baselines import lightgbm_scores  # noqa: E402
from habitus.models.evaluate.holdout import LOWER_IS_BETTER, protocol, score_holdout  # noqa: E402
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402
from habitus.models.train.scenario import train_scenario  # noqa: E402

TASKS = ("churn", "propensity", "spend")


def run(dataset: str, customers: int, only: tuple[str, ...] = TASKS, seeds: tuple[int, ...] = (0,), log=print) -> dict:
    """The table's rows: per task and fine-tuning seed (FinetuneConfig.seed; the foundation's is 0)."""
    t_run = time.time()
    quiet = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True) if " start" in msg else None  # noqa: E731
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec, real_test, params = dataset_spec(dataset, customers, tmp)
        window = params["window"]
        now = real_test - window * DAY  # the hold-out window of the product run ends at the real test cut-off
        cache = Cache(build_cache(spec, tmp / "cache", log=quiet))
        fcfg = FoundationConfig()
        foundation = train_foundation(cache, fcfg, now - fcfg.horizon_days * DAY, log=quiet)
        state, info = foundation.model.state_dict(), foundation.info
        fspec = FeatureSpec.from_dict(info["feature_spec"])
        log(f"{dataset}: foundation {time.time() - t_run:.0f}s; product's test cut-off {iso(now)}, scored at {iso(real_test)}")
        for name, task in tasks(cache, now, params).items():
            if name not in only:
                continue
            plan = protocol(now, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
            for seed in seeds:
                rows += backtest(cache, state, info, fspec, name, task, plan, seed, real_test, t_run, log)
    return {"dataset": dataset, "customers": customers if dataset == "demo" else None, "now": iso(now),
            "scored_at": iso(real_test), "window_days": window, "total_s": round(time.time() - t_run, 1),
            "machine": machine(), "rows": rows}


def backtest(cache, state, info, fspec, name, task, plan, seed: int, real_test: int, t_run: float, log) -> list[dict]:
    """One recipe run with refit on as of the plan's test cut-off: the measured model (what refit off
    serves), the refitted one and LightGBM, all scored at `real_test`."""
    quiet = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True) if " start" in msg or "refit" in msg else None  # noqa: E731
    rows = []
    cfg = ScenarioConfig(name, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                         FinetuneConfig(seed=seed), refit=True)
    t0 = time.time()
    r = train_scenario(cache, state, info, cfg, log=quiet, baselines=False)
    trained_s = time.time() - t0
    lgb = lightgbm_scores(cache, fspec, task, plan.train_cutoffs, plan.val_cutoff, real_test)
    constant = r.trained.info["val_target_mean"]
    off = score_holdout(r.trained.model, cache, fspec, task, real_test, constant=constant,
                        extra={"lightgbm": lgb}, head=r.head).report
    model, head = r.served
    on = score_holdout(model, cache, fspec, task, real_test, constant=constant, head=head).report
    for metric in ("auroc", "macro_auroc", "mae"):
        if metric not in off["model"]:
            continue
        rows.append({"task": name, "seed": seed, "metric": metric, "off": off["model"][metric],
                     "on": on["model"][metric], "off_network": off.get("network", {}).get(metric),
                     "on_network": on.get("network", {}).get(metric),
                     "lightgbm": off["baselines"].get("lightgbm", {}).get(metric),
                     "entities": off["entities"], "entities_on": on["entities"],
                     "head": r.head.chosen if r.head else "network",
                     "head_weight": r.head.weight if r.head else 0.0,
                     "soup_epochs": r.trained.info["soup_epochs"],
                     "refit_cutoffs": [iso(c) for c in r.refit.cutoffs] if r.refit else None,
                     "train_s": round(trained_s, 1), "refit_s": r.seconds.get("refit")})
        log(f"{name} seed {seed} {metric}: off {rows[-1]['off']:.4f}, on {rows[-1]['on']:.4f} "
            f"({time.time() - t_run:.0f}s so far)")
    return rows


def iso(ts: int) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).date().isoformat()


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']}: product run as of {result['now']}, served models scored on the window "
             f"from {result['scored_at']} ({result['window_days']} days); {result['total_s']}s on {result['machine']}",
             f"{'task':<11} {'seed':>4} {'metric':<12} {'refit off':>9} {'refit on':>9} {'on - off':>9} {'LightGBM':>9}  "
             f"{'entities':>8}  head (weight), soup epochs"]
    for r in result["rows"]:
        sign = -1 if r["metric"] in LOWER_IS_BETTER else 1
        lgb = "" if r["lightgbm"] is None else f"{r['lightgbm']:.4f}"
        lines.append(f"{r['task']:<11} {r['seed']:>4} {r['metric']:<12} {r['off']:>9.4f} {r['on']:>9.4f} "
                     f"{sign * (r['on'] - r['off']):>+9.4f} {lgb:>9}  {r['entities']:>8}  "
                     f"{r['head']} ({r['head_weight']}), {r['soup_epochs']}")
    seeds = sorted({r["seed"] for r in result["rows"]})
    if len(seeds) > 1:  # the mean over the seeds, and on how many seeds the refit was better
        for task, metric in dict.fromkeys((r["task"], r["metric"]) for r in result["rows"]):
            group = [r for r in result["rows"] if (r["task"], r["metric"]) == (task, metric)]
            sign = -1 if metric in LOWER_IS_BETTER else 1
            diffs = [sign * (r["on"] - r["off"]) for r in group]
            mean = lambda k: sum(r[k] for r in group) / len(group)  # noqa: E731
            lines.append(f"{task:<11} {'mean':>4} {metric:<12} {mean('off'):>9.4f} {mean('on'):>9.4f} "
                         f"{sum(diffs) / len(diffs):>+9.4f}  refit better on {sum(d > 0 for d in diffs)} of {len(diffs)} seeds")
    lines.append("(on - off > 0: the refitted model is better; for mae the sign is flipped)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="demo")
    parser.add_argument("--customers", type=int, default=5000, help="demo size")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, among {','.join(TASKS)}")
    parser.add_argument("--seeds", default="0", help="fine-tuning seeds, comma-separated (the foundation's: 0)")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    only = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if set(only) - set(TASKS):
        parser.error(f"--tasks: choose among {','.join(TASKS)}")
    seeds = tuple(int(s) for s in args.seeds.split(","))
    result = run(args.dataset, args.customers, only, seeds, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
