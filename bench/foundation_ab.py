"""Two foundation settings, A/B, by what the fine-tuned network scores downstream.

    OMP_NUM_THREADS=1 python bench/foundation_ab.py --dataset tafeng --seeds 0,1 --a related_buckets=false \
        [--b default] [--customers 20000]

    OMP_NUM_THREADS=1 python bench/foundation_ab.py --cost --dataset demo --customers 175000   # ~10M events
    OMP_NUM_THREADS=1 python bench/foundation_ab.py --arm-cost --dataset demo --customers 175000 --a default --b contrastive_weight=0.1

`--a` / `--b`: "default" or one FoundationConfig field as name=value (bench/foundation_settings.py).
`--cost`: the seconds and memory of the rare values' grouping (models/data/related.py) at scale.
`--arm-cost`: each arm's foundation training alone, in a fresh process: seconds, entities/s, peak RSS.

Per seed: the foundation model at that seed under each arm (a, b), churn and propensity fine-tuned with the
network head alone (the head the stacked trees read at a tenth on Ta-Feng), scored at the test
cut-off on the same entities, and the paired entity bootstrap of b - a; over the seeds, the panel's
combination (bench/intervals.py).
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

from arm_scores import captured  # noqa: E402
from intervals import Paired, combine, paired_many  # noqa: E402
from foundation_settings import settings  # noqa: E402
from quality import dataset_spec, demo_spec, tasks  # noqa: E402

def next_class_task(cache, test_cutoff: int, params: dict):
    """The demo config's next_category: which of the 10 most frequent values of the label column's
    parent (the demo's category; Ta-Feng's product subclass itself) the next 14 days' first event has."""
    from habitus.models.data.labels import top_values
    from habitus.models.data.targets import TargetSpec
    from habitus.models.tasks.spec import TaskSpec

    column = "category" if "category" in cache.columns else params["label_column"]
    return TaskSpec("multiclass", TargetSpec("any_event", 14, column, top_values(cache, column, test_cutoff, 10)))


def log_loss_difference(y: np.ndarray, pb: np.ndarray, pa: np.ndarray) -> Paired:
    """Mean log loss of b minus a over the same entities and its variance (a mean of per-entity terms:
    the paired differences' variance / n, no resampling needed)."""
    eps = 1e-7
    lb = -np.log(np.clip(pb[np.arange(len(y)), y], eps, 1))
    la = -np.log(np.clip(pa[np.arange(len(y)), y], eps, 1))
    d = lb - la
    return Paired(float(d.mean()), float(d.var(ddof=1) / len(d)), float(lb.mean()), float(la.mean()))


def run(dataset: str, customers: int, seeds: list[int], draws: int, a: str = "related_buckets=false",
        b: str = "default", log=print, names: tuple[str, ...] = ("churn", "propensity")):
    from habitus.models.cache import Cache, build_cache
    from habitus.models.data.features import DAY
    from habitus.models.evaluate.holdout import protocol
    from habitus.models.tasks import task as task_of
    from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig
    from habitus.models.train.foundation import train_foundation
    from habitus.models.train.scenario import train_scenario

    quiet = lambda msg: None  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, params = dataset_spec(dataset, customers, Path(tmp))
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=quiet))
        todo = {**tasks(cache, test_cutoff, params), "next_class": next_class_task(cache, test_cutoff, params)}
        todo = {k: v for k, v in todo.items() if k in names}
        per_seed = {name: [] for name in todo}
        for seed in seeds:
            scores = {}
            for arm in (a, b):
                fcfg = FoundationConfig(**{**settings(arm), "seed": seed})
                last = test_cutoff - fcfg.horizon_days * DAY
                t0 = time.time()
                foundation = train_foundation(cache, fcfg, last, log=quiet)
                log(f"{dataset} seed {seed} {arm}: foundation {time.time() - t0:.0f}s, "
                    f"val loss {[round(v, 4) for v in foundation.curves['val_loss']]}")
                for name, task in todo.items():
                    plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
                    cfg = ScenarioConfig(name, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                                         FinetuneConfig(seed=seed), head="network", refit=False)
                    t0 = time.time()
                    with captured() as rec:
                        train_scenario(cache, foundation.model.state_dict(), foundation.info, cfg, log=quiet,
                                       baselines=False)
                    r = rec[0]
                    scores[(name, arm)] = r
                    log(f"  {name}: {time.time() - t0:.0f}s")
            for name in todo:
                ra, rb = scores[(name, b)], scores[(name, a)]
                if not np.array_equal(ra["entities"], rb["entities"]):
                    raise AssertionError("the arms scored different entities")
                y, sa, sb = ra["y"], ra["scores"]["model"], rb["scores"]["model"]
                if task_of(todo[name]).headline == "log_loss":  # (multiclass) a class per entity: log loss
                    p = log_loss_difference(np.asarray(y, np.int64), sa, sb)
                    per_seed[name].append(p)
                    log(f"RESULT {dataset} seed {seed} {name} (log loss): b ({b}) {p.a:.4f} a ({a}) {p.b:.4f} "
                        f"diff {p.diff:+.4f} [{p.diff - 1.96 * p.var ** 0.5:+.4f}, {p.diff + 1.96 * p.var ** 0.5:+.4f}]")
                    continue
                if ra["labels"] is not None:
                    common = np.intersect1d(ra["labels"], rb["labels"])
                    y = y[:, np.searchsorted(ra["labels"], common)]
                    sa, sb = sa[:, np.searchsorted(ra["labels"], common)], sb[:, np.searchsorted(rb["labels"], common)]
                p = paired_many(y, {"b": sa, "a": sb}, [("b", "a")], draws)[("b", "a")]
                per_seed[name].append(p)
                log(f"RESULT {dataset} seed {seed} {name}: b ({b}) {p.a:.4f} a ({a}) {p.b:.4f} "
                    f"diff {p.diff:+.4f} [{p.diff - 1.96 * p.var ** 0.5:+.4f}, {p.diff + 1.96 * p.var ** 0.5:+.4f}]")
        for name, ps in per_seed.items():  # over the seeds: Var = s^2_seed / S + the mean bootstrap variance
            c = combine([p.diff for p in ps], [p.var for p in ps])
            log(f"SEEDS {dataset} {name} ({len(ps)}): {c.mean:+.4f} [{c.lo:+.4f}, {c.hi:+.4f}]")


def _scaled_cache(dataset: str, customers: int, tmp: Path):
    """(cache, test cut-off) of the costs: the demo with bench/speed.py's 20,000 products (its 10m dataset:
    175,000 customers), or the dataset as the quality benches build it."""
    from habitus.models.cache import Cache, build_cache

    spec, test_cutoff, _ = (demo_spec(customers, tmp, products=20_000) if dataset == "demo"
                            else dataset_spec(dataset, customers, tmp))
    return Cache(build_cache(spec, tmp / "cache", log=lambda _: None)), test_cutoff


def cost(dataset: str, customers: int, log=print):
    """What the groups cost: the fit's seconds and its peak memory over the process's before it,
    against one foundation training (3 epochs, groups included) on the same cache."""
    import resource

    from habitus.models.data.features import DAY
    from habitus.models.data.related import related_tails
    from habitus.models.train.config import FoundationConfig
    from habitus.models.train.foundation import train_foundation

    with tempfile.TemporaryDirectory() as tmp:
        cache, test_cutoff = _scaled_cache(dataset, customers, Path(tmp))
        cfg = FoundationConfig()
        last = test_cutoff - cfg.horizon_days * DAY
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        t0 = time.time()
        tails = related_tails(cache, last, cfg.buckets)
        fit_s, peak = time.time() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        t0 = time.time()
        train_foundation(cache, cfg, last, log=lambda _: None)
        train_s = time.time() - t0
        log(f"| {dataset} | {cache.manifest['n_events']:,} | {cache.n_entities:,} | {', '.join(tails)} | {fit_s:.1f} | "
            f"{train_s:.1f} | {fit_s / train_s:.2f} | {before:.2f} | {peak:.2f} |")


def arm_cost(dataset: str, customers: int, arms: tuple[str, str], log=print):
    """Each arm's foundation training (3 epochs, the default protocol's last cut-off) on one cache, each
    in a fresh process: its seconds, entities per second and peak RSS (os.wait4), and b / a."""
    import json
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        cache, test_cutoff = _scaled_cache(dataset, customers, Path(tmp))
        got = []
        for arm in arms:
            proc = subprocess.Popen([sys.executable, __file__, "--child-cost", str(cache.path), arm, str(test_cutoff)],
                                    stdout=subprocess.PIPE, text=True)
            out = proc.stdout.read()
            _, status, usage = os.wait4(proc.pid, 0)
            if os.waitstatus_to_exitcode(status):
                raise RuntimeError(f"{arm}: the foundation's process failed")
            seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
            got.append((seconds, usage.ru_maxrss / 2**20))
            log(f"| {dataset} | {arm} | {cache.manifest['n_events']:,} | {cache.n_entities:,} | {seconds:.1f} | "
                f"{cache.n_entities / seconds:,.0f} | {usage.ru_maxrss / 2**20:.2f} |")
        log(f"b / a: seconds {got[1][0] / got[0][0]:.2f}x, peak {got[1][1] / got[0][1]:.2f}x")


def _child_cost(root: str, arm: str, test_cutoff: int):
    import json

    from habitus.models.cache import Cache
    from habitus.models.data.features import DAY
    from habitus.models.train.config import FoundationConfig
    from habitus.models.train.foundation import train_foundation

    cfg = FoundationConfig(**settings(arm))
    t0 = time.time()
    train_foundation(Cache(root), cfg, int(test_cutoff) - cfg.horizon_days * DAY, log=lambda _: None)
    print(json.dumps({"seconds": time.time() - t0}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="tafeng")
    ap.add_argument("--customers", type=int, default=20_000)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--a", default="related_buckets=false", help="arm a's foundation setting")
    ap.add_argument("--b", default="default", help="arm b's foundation setting (b - a is reported)")
    ap.add_argument("--tasks", default="churn,propensity", help="of churn, propensity, next_class")
    ap.add_argument("--cost", action="store_true", help="the fit's seconds and memory against a foundation training")
    ap.add_argument("--arm-cost", action="store_true", help="each arm's foundation: seconds and peak memory")
    ap.add_argument("--child-cost", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_cost:
        return _child_cost(*a.child_cost)
    if a.arm_cost:
        print("| dataset | arm | events | entities | foundation s | entities/s | peak GB |\n|---|---|---|---|---|---|---|")
        return arm_cost(a.dataset, a.customers, (a.a, a.b), log=lambda m: print(m, flush=True))
    if a.cost:
        print("| dataset | events | entities | grouped columns | fit s | foundation s (fit included) | fit / foundation "
              "| peak GB before | peak GB after the fit |\n|---|---|---|---|---|---|---|---|---|")
        return cost(a.dataset, a.customers, log=lambda m: print(m, flush=True))
    run(a.dataset, a.customers, [int(s) for s in a.seeds.split(",")], a.draws, a.a, a.b,
        log=lambda m: print(m, flush=True), names=tuple(a.tasks.split(",")))


if __name__ == "__main__":
    main()
