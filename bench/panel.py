"""The quality panel: every model decision judged on Ta-Feng and the demo (50,000 customers), over
seeds, with paired intervals and a verdict per row.

    OMP_NUM_THREADS=1 python bench/panel.py [--datasets tafeng,demo] [--seeds 0,1,2] [--json out.json]
                                            [--state panel-state.json] [--rows churn,propensity,...]
    python bench/panel.py --datasets movielens --seeds 0     # the smoke run, outside the verdicts

Each seed reseeds everything that has one: the foundation model, the fine-tuning, the head's trees,
every LightGBM and the 10% of entities whose labels the few-label rows keep. Every arm of a row is
scored on the same entities (bench/arm_scores.py). Per seed, a paired stratified entity bootstrap
(B = 1,000, every label recomputed for macro AUROC) gives the difference's variance; over S seeds,
Var = s^2_seed / S + the mean bootstrap variance, and the 95% interval (bench/intervals.py). Verdict:
pass when the mean reaches the bar and the lower bound is above the floor, fail when the upper bound
is below the bar, else undecided. MovieLens (471 churn users) is a smoke run: its rows carry no bar.

Rows (the datasets' caches leave the withheld attribute out of every input, for every row):
- churn, propensity (50 labels): habitus (the served head) against LightGBM; propensity against the
  stronger (higher mean) of LightGBM and the practitioner's LightGBM (bench/practitioner.py); the
  served recipe against the same recipe without the foundation (random trunk, no representation in
  the trees); the pretrained network against the same network from scratch. Propensity rows also
  against LightGBM + per-label co-occurrence affinity (bench/affinity.py), a reference outside the
  verdicts.
- churn_10pct, propensity_10pct: the labels of 10% of the entities (bench/label_share.py), against
  LightGBM on the same 10% and against LightGBM on all labels (derived labels cost nothing).
- withheld: the withheld attribute (bench/withheld.py) from the labels of 10% of the entities.
- propensity_500 (Ta-Feng): 500 product subclasses by frequency, on the labels both LightGBMs learn.
- probe: the embeddings without the appended scalars, read by a C = 1 logistic regression fitted at
  the validation cut-off and scored at the test cut-off, against the RFM / visit scalars.
The demo's rows carry the simulator's oracle (bench/oracle.py, where present) and the gap left to it.
"""

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import withheld  # noqa: E402
from intervals import combine, metric, paired_many, panel_mean, verdict  # noqa: E402
from label_share import EntitySubset, labeled_entities  # noqa: E402
from practitioner import practitioner_scores  # noqa: E402
from affinity import affinity_lightgbm_scores  # noqa: E402
from foundation_settings import settings  # noqa: E402
from quality import dataset_spec, machine, tasks, train_arms  # noqa: E402

PANEL = ("tafeng", "demo")
SMOKE = ("movielens",)
ROWS = ("churn", "propensity", "probe", "withheld", "churn_10pct", "propensity_10pct", "propensity_500")
SHARE = 0.1
WIDE = {"tafeng": 500}  # the datasets of the wide propensity row: its labels
PARENT = {"demo": "category"}  # the label column's parent column, where the data has one
STRONGER = "habitus - stronger lightgbm"
# (row, comparison, arm a, arm b, bar, floor); per-dataset rows. Churn's bar on each dataset is its
# lower bound above -0.003 (bar and floor -0.003); the panel rows below carry the means' bars.
COMPARISONS = [
    ("churn", "habitus - lightgbm", "habitus", "lightgbm", -0.003, -0.003),
    ("churn", "served - no foundation", "habitus", "bare", 0.005, 0.0),
    ("churn", "pretrained - scratch (network)", "network", "scratch", None, None),
    ("propensity", "habitus - lightgbm", "habitus", "lightgbm", None, None),
    ("propensity", "habitus - practitioner lightgbm", "habitus", "practitioner", None, None),
    ("propensity", "habitus - lightgbm + affinity", "habitus", "lightgbm + affinity", None, None),
    ("propensity", "served - no foundation", "habitus", "bare", 0.005, 0.0),
    ("propensity", "pretrained - scratch (network)", "network", "scratch", None, None),
    ("propensity_500", "habitus - lightgbm", "habitus", "lightgbm", None, None),
    ("propensity_500", "habitus - practitioner lightgbm", "habitus", "practitioner", None, None),
    ("propensity_500", "habitus - lightgbm + affinity", "habitus", "lightgbm + affinity", None, None),
    ("withheld", "pretrained - scratch (network)", "network", "scratch", 0.01, 0.0),
    ("withheld", "habitus - lightgbm", "habitus", "lightgbm", 0.02, 0.0),
    ("probe", "embeddings - rfm scalars (C = 1)", "embeddings", "rfm scalars", -0.002, -0.002),
] + [(f"{t}_10pct", c, a, b, None, None) for t in ("churn", "propensity") for c, a, b in (
    ("habitus - lightgbm (same 10%)", "habitus", "lightgbm"),
    ("habitus - lightgbm on all labels", "habitus", "lightgbm all labels"),
    ("served - no foundation", "habitus", "bare"),
    ("pretrained - scratch (network)", "network", "scratch"))]


def practitioner_arm(cache, fspec, task, plan, *, dataset: str, seed: int, train_cache):
    return practitioner_scores(cache, fspec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                               parent_column=PARENT.get(dataset), seed=seed, train_cache=train_cache)


def affinity_arm(cache, fspec, task, plan, *, dataset: str, seed: int, train_cache):
    return affinity_lightgbm_scores(cache, fspec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                                    seed=seed, train_cache=train_cache)


# the hand-built reference models of label rows, beside the recipe's arms: name -> fit(cache, feature
# spec, task, plan, dataset=, seed=, train_cache=) -> LabelScores of the test entities in evaluate's
# order. Another reference is one entry here and its lines in COMPARISONS.
LABEL_ARMS = {"practitioner": practitioner_arm, "lightgbm + affinity": affinity_arm}
# rows whose comparison is against the stronger of two LightGBMs: (row, bar, floor)
STRONGER_ROWS = {"propensity": (None, None), "propensity_500": (0.02, 0.0)}
# panel rows over the datasets' means: (row, comparison, bar, floor)
PANEL_ROWS = [("propensity", STRONGER, 0.02, 0.01), ("churn", "habitus - lightgbm", 0.003, 0.0)]


def arm_set(arms) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, dict]:
    """(labels y, their label positions or None, entities, {arm: (label positions or None, scores)}) of
    a row's three recipe runs, each checked to score the same entities."""
    first = arms.records["run"][0]
    y, labels, ents = first["y"], first["labels"], first["entities"]
    out = {"habitus": (labels, first["scores"]["model"]),
           "network": (labels, first["scores"].get("network", first["scores"]["model"]))}
    if "lightgbm" in first["scores"]:
        out["lightgbm"] = (labels, first["scores"]["lightgbm"])
    for r in arms.records["run"][1:]:  # LightGBM on the most frequent labels of a wide head
        out["lightgbm"] = (r["labels"], r["scores"]["lightgbm"])
    out["scratch"] = (arms.records["scratch"][0]["labels"], arms.records["scratch"][0]["scores"]["model"])
    out["bare"] = (arms.records["bare"][0]["labels"], arms.records["bare"][0]["scores"]["model"])
    for recs in arms.records.values():
        for r in recs:
            if not np.array_equal(r["entities"], ents):
                raise AssertionError("the arms of a row scored different entities")
    return y, labels, ents, out


def common_labels(labels: np.ndarray, *arms) -> np.ndarray:
    """The label positions of `labels` that every arm (label positions, scores) scores."""
    for lab, _ in arms:
        labels = np.intersect1d(labels, lab)
    return labels


def aligned(y: np.ndarray, labels, *arms) -> list[np.ndarray]:
    """y and each arm's scores on the label positions they all have (binary: as they are)."""
    if labels is None:
        return [y, *[s for _, s in arms]]
    common = common_labels(labels, *arms)
    return [y[:, np.searchsorted(labels, common)]] + [s[:, np.searchsorted(lab, common)] for lab, s in arms]


def oracle_rows(dataset: str, folder: Path, cache, entities: np.ndarray, cutoff: int, window: int, task_name: str,
                label_values: list | None):
    """The simulator's best possible scores of the demo's entities (bench/oracle.py: churn [n], propensity
    [n, labels]), or None: other datasets, other tasks, or no bench/oracle.py."""
    if dataset != "demo" or task_name not in ("churn", "propensity"):
        return None
    try:
        from oracle import demo_oracle
    except ImportError:
        return None
    ids = np.asarray(cache.entity_ids(entities).to_pylist())
    return np.asarray(demo_oracle(folder, ids, cutoff, window, task_name, label_values))


def probe_arms(foundation, cache, fspec, target, plan) -> tuple[np.ndarray, dict]:
    """The probe's test labels and scores: a C = 1 logistic regression on the embeddings (the asset's
    profile without the appended scalars) and one on the RFM / visit scalars, fitted at the validation
    cut-off, scored at the test cut-off."""
    from probe import _vectors, rfm_scalars
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from habitus.models.nn.profile import Profile
    from habitus.models.nn.quantize import for_inference

    trunk = for_inference(foundation.model.trunk, "fp32")
    profile = dataclasses.replace(Profile.of(foundation.info), scalars=False)
    sets = {}
    for name, cutoff in (("fit", plan.val_cutoff), ("test", plan.test_cutoff)):
        ents, rfm, y = rfm_scalars(cache, fspec, target, cutoff)
        sets[name] = (y.astype(np.int64), {"embeddings": _vectors(trunk, cache, fspec, cutoff, ents, profile),
                                           "rfm scalars": rfm})
    out = {}
    for arm in ("embeddings", "rfm scalars"):
        reader = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
        reader.fit(sets["fit"][1][arm], sets["fit"][0])
        out[arm] = (None, reader.predict_proba(sets["test"][1][arm])[:, 1])
    return sets["test"][0], out


def applicable(dataset: str) -> tuple[str, ...]:
    """The rows a dataset has (the wide row only where WIDE names its labels)."""
    return tuple(r for r in ROWS if r != "propensity_500" or dataset in WIDE)


def seed_run(dataset: str, customers: int, seed: int, rows: tuple[str, ...], draws: int, log, save=None,
             done: dict | None = None, setting: str = "default") -> dict:
    """One seed of one dataset: {row: {comparison: {diff, var, a, b}, "oracle": figure}} and timings;
    `save(result)` after each row (the result so far, "complete": False). The rows of `done` (a killed
    run's saved result) are kept, not run again: every arm is seeded, so they would come out the same.
    `setting`: the foundation model's, "default" or one FoundationConfig field as name=value."""
    from habitus.models.cache import Cache, build_cache
    from habitus.models.data.features import DAY, FeatureSpec
    from habitus.models.data.targets import TargetSpec
    from habitus.models.evaluate.holdout import protocol
    from habitus.models.tasks import task as task_of
    from habitus.models.tasks.spec import TaskSpec
    from habitus.models.train.config import TRAIN_CUTOFFS, FoundationConfig
    from habitus.models.train.foundation import train_foundation

    t0 = time.time()
    out, seconds = dict((done or {}).get("rows", {})), dict((done or {}).get("seconds", {}))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec, test_cutoff, params = dataset_spec(dataset, customers, tmp)
        _, column, positive, meaning = withheld.ATTRIBUTES[dataset]
        table = next(t for t in spec.entity_attributes if column in t.columns)
        spec = withheld.without(spec, dataset)
        cache = Cache(build_cache(spec, tmp / "cache", log=lambda _: None))
        fcfg = FoundationConfig(**{**settings(setting), "seed": seed})
        foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=lambda _: None)
        seconds["foundation"] = round(time.time() - t0, 1)
        fspec, state = FeatureSpec.from_dict(foundation.info["feature_spec"]), foundation.model.state_dict()
        specs = tasks(cache, test_cutoff, params)
        if dataset in WIDE:
            specs["propensity_500"] = tasks(cache, test_cutoff, {**params, "labels": WIDE[dataset]})["propensity"]
        specs["withheld"] = TaskSpec("binary", TargetSpec("function", params["window"], function=withheld.FUNCTION,
                                                          scenario="withheld"))
        share = withheld.load(table.files[0], spec.entity, column, positive)
        log(f"{dataset} seed {seed}: withheld {column} ({meaning}: {share:.3f} of the entities); foundation "
            f"{seconds['foundation']:.0f}s")
        subset = EntitySubset(cache, labeled_entities(cache, SHARE, seed=seed))
        full_lightgbm = {}
        for row in rows:
            if row in out:
                continue
            base = row.removesuffix("_10pct")
            task = specs.get("churn" if row == "probe" else base)
            if task is None:  # (the wide row on a dataset without one)
                continue
            t1 = time.time()
            plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
            if row == "probe":
                (y, arms), labels, ents = probe_arms(foundation, cache, fspec, specs["churn"].target, plan), None, None
            else:
                few = subset if row.endswith("_10pct") or row == "withheld" else None
                run = train_arms(cache, state, foundation.info, task, plan, row, few, seed=seed)
                y, labels, ents, arms = arm_set(run)
                for name, fit in LABEL_ARMS.items() if task_of(task).label_outputs else ():
                    found = fit(cache, fspec, task, plan, dataset=dataset, seed=seed, train_cache=few)
                    arms[name] = (found.labels, found.scores)
                if few is None:
                    full_lightgbm[row] = arms.get("lightgbm")
                elif full_lightgbm.get(base) is not None:
                    arms["lightgbm all labels"] = full_lightgbm[base]
            result = {}
            wanted = [(name, a, b) for r, name, a, b, _, _ in COMPARISONS if r == row and a in arms and b in arms]
            groups: dict = {}  # comparisons on the same labels share their resamples
            for name, a, b in wanted:
                common = None if labels is None else tuple(common_labels(labels, arms[a], arms[b]))
                groups.setdefault(common, []).append((name, a, b))
            for common, group in groups.items():
                names = sorted({n for _, a, b in group for n in (a, b)})
                ys, *scores = aligned(y, labels, *[arms[n] for n in names])
                found = paired_many(ys, dict(zip(names, scores)), [(a, b) for _, a, b in group], draws, seed=seed)
                result.update({name: dataclasses.asdict(found[(a, b)]) for name, a, b in group})
            if ents is not None:
                label_values = None if labels is None else list(task_of(task).label_values(cache, task))
                oracle = oracle_rows(dataset, tmp, cache, ents, test_cutoff, task.target.window_days, base,
                                     label_values)
                if oracle is not None:
                    yo, so = aligned(y, labels, arms["habitus"], (labels if labels is None else
                                                                   np.arange(oracle.shape[1]), oracle))[::2]
                    result["oracle"] = float(metric(yo, so, np.ones((1, len(yo)), np.int32))[0])
            result["entities"] = int(len(y))
            out[row] = result
            seconds[row] = round(time.time() - t1, 1)
            if save is not None:
                save({"rows": out, "seconds": seconds, "machine": machine(), "foundation": setting, "complete": False})
            log(f"{dataset} seed {seed} {row} ({seconds[row]:.0f}s): " + ", ".join(
                f"{k} {v['diff']:+.4f}" for k, v in result.items() if isinstance(v, dict)))
    seconds["total"] = round(time.time() - t0, 1)
    return {"rows": out, "seconds": seconds, "machine": machine(), "foundation": setting, "complete": True}


def aggregate(runs: dict, smoke: bool) -> list[dict]:
    """The panel's rows from {dataset: {seed: seed_run's result}}: per dataset, its comparisons over its
    seeds; then the panel rows over the datasets' means (smoke datasets: no bars, not in the panel)."""
    rows, by = [], {}
    for dataset, seeds in runs.items():
        outside = dataset in SMOKE
        listed = [(r, n, a, bar, floor) for r, n, a, _, bar, floor in COMPARISONS]
        listed += [(r, STRONGER, "habitus", bar, floor) for r, (bar, floor) in STRONGER_ROWS.items()]
        for row, name, arm_a, bar, floor in listed:
            per = [(s, res["rows"][row]) for s, res in sorted(seeds.items()) if row in res["rows"]]
            if name == STRONGER:  # the LightGBM with the higher mean figure on its seeds
                pairs = [n for n in ("habitus - lightgbm", "habitus - practitioner lightgbm")
                         if per and all(n in r for _, r in per)]
                if not pairs:
                    continue
                chosen = max(pairs, key=lambda n: np.mean([r[n]["b"] for _, r in per]))
                label = f"{STRONGER} ({chosen.removeprefix('habitus - ')})"
            else:
                chosen, label = name, name
            per = [(s, r) for s, r in per if chosen in r]
            if not per:
                continue
            iv = combine([r[chosen]["diff"] for _, r in per], [r[chosen]["var"] for _, r in per])
            bar, floor = (None, None) if outside else (bar, floor)
            oracle = [r["oracle"] for _, r in per if "oracle" in r]
            a_mean = float(np.mean([r[chosen]["a"] for _, r in per]))
            rows.append({"dataset": dataset, "task": row, "comparison": label, "mean": iv.mean, "lo": iv.lo,
                         "hi": iv.hi, "bar": bar, "floor": floor, "verdict": verdict(iv.mean, iv.lo, iv.hi, bar, floor),
                         "seeds": [int(s) for s, _ in per], "a": a_mean,
                         "b": float(np.mean([r[chosen]["b"] for _, r in per])),
                         "oracle": float(np.mean(oracle)) if oracle else None,
                         "oracle_gap": float(np.mean(oracle)) - a_mean if oracle else None})
            if not outside:
                by.setdefault((row, name), []).append((iv, rows[-1]))
    for row, name, bar, floor in PANEL_ROWS:
        found = by.get((row, name), [])
        if not found or smoke:
            continue
        iv = panel_mean([i for i, _ in found])
        v = verdict(iv.mean, iv.lo, iv.hi, bar, floor)
        if row == "churn":  # and every dataset's lower bound above -0.003
            v = "fail" if any(r["hi"] < -0.003 for _, r in found) else (
                "undecided" if v == "pass" and any(r["lo"] <= -0.003 for _, r in found) else v)
        rows.append({"dataset": "panel (" + ", ".join(r["dataset"] for _, r in found) + ")", "task": row,
                     "comparison": name + " (mean of the datasets)", "mean": iv.mean, "lo": iv.lo, "hi": iv.hi,
                     "bar": bar, "floor": floor, "verdict": v,
                     "seeds": sorted(set().union(*(r["seeds"] for _, r in found))), "a": None, "b": None,
                     "oracle": None, "oracle_gap": None})
    return rows


SCHEMA = ("dataset", "task", "comparison", "mean", "lo", "hi", "bar", "floor", "verdict", "seeds", "oracle", "oracle_gap")


def table(rows: list[dict], draws: int) -> str:
    fmt = lambda v, f="+.4f": "-" if v is None else format(v, f)  # noqa: E731
    lines = [f"{'dataset':<22} {'task':<17} {'comparison':<50} {'mean':>8} {'95% interval':>19} {'bar':>7} "
             f"{'floor':>7} {'verdict':<10} {'seeds':<8} {'a':>7} {'b':>7} {'oracle gap':>10}"]
    for r in rows:
        lines.append(f"{r['dataset']:<22} {r['task']:<17} {r['comparison']:<50} {r['mean']:>+8.4f} "
                     f"[{r['lo']:+.4f}, {r['hi']:+.4f}] {fmt(r['bar'], '+.3f'):>7} {fmt(r['floor'], '+.3f'):>7} "
                     f"{r['verdict'] or '-':<10} {','.join(map(str, r['seeds'])):<8} {fmt(r['a'], '.4f'):>7} "
                     f"{fmt(r['b'], '.4f'):>7} {fmt(r['oracle_gap']):>10}")
    lines.append("mean: arm a - arm b (AUROC; macro AUROC over labels), paired on the same entities; a, b: the arms' "
                 f"means; interval: Var = s^2_seed / S + mean bootstrap variance (B = {draws:,})")
    return "\n".join(lines)


def write(path: Path, result: dict) -> None:
    """A seed's result, whole or not at all (a killed run keeps its last finished row)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def load_state(folder: Path) -> dict:
    runs: dict = {}
    for f in sorted(folder.glob("*-seed*.json")):
        dataset, _, seed = f.stem.rpartition("-seed")
        runs.setdefault(dataset, {})[int(seed)] = json.loads(f.read_text())
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default=",".join(PANEL), help="comma-separated, of tafeng, demo, movielens")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (add up to 8 until decided)")
    parser.add_argument("--customers", type=int, default=50_000, help="demo size")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {','.join(ROWS)}")
    parser.add_argument("--draws", type=int, default=1000, help="bootstrap resamples per seed")
    parser.add_argument("--state", default="panel-state", help="folder of the finished seeds (<dataset>-seed<N>.json): "
                        "a seed found there is not run again")
    parser.add_argument("--report-only", action="store_true", help="only aggregate what --state holds")
    parser.add_argument("--json", help="write {'rows': [...]} to this path")
    parser.add_argument("--foundation", default="default", help="the foundation setting judged: default, or one "
                        "FoundationConfig field as name=value (bench/foundation_settings.py); a --state folder holds one")
    args = parser.parse_args()
    settings(args.foundation)  # (an unknown field fails here, before any seed runs)
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    rows = tuple(r.strip() for r in args.rows.split(",") if r.strip())
    bad = sorted(set(datasets) - set(PANEL + SMOKE)) + sorted(set(rows) - set(ROWS))
    if bad:
        parser.error(f"unknown dataset(s) or row(s): {', '.join(bad)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds: expected comma-separated integers, got {args.seeds!r}")
    state = Path(args.state)
    state.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    for seed in [] if args.report_only else seeds:
        for dataset in datasets:
            path = state / f"{dataset}-seed{seed}.json"
            done = json.loads(path.read_text()) if path.exists() else None
            if done and done.get("foundation", "default") != args.foundation:
                parser.error(f"{path} holds the foundation setting {done.get('foundation', 'default')!r}, not "
                             f"{args.foundation!r}: give each setting its own --state folder")
            if done and done.get("complete") and all(r in done["rows"] for r in rows if r in applicable(dataset)):
                continue  # (a finished seed runs again only for rows it lacks: they are added to it)
            write(path, seed_run(dataset, args.customers, seed, rows, args.draws, log, done=done,
                                 save=lambda r, p=path: write(p, r), setting=args.foundation))
    runs = {d: {s: r for s, r in v.items() if s in seeds} for d, v in load_state(state).items() if d in datasets}
    out = aggregate(runs, smoke=all(d in SMOKE for d in datasets))
    print(table(out, args.draws))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [{k: r[k] for k in SCHEMA} for r in out]}, indent=2))


if __name__ == "__main__":
    main()
