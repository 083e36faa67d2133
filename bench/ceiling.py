"""How much churn signal is there? The LightGBM baseline next to richer features and to an in-distribution
ceiling, on the same entities as bench/quality.py.

    python bench/ceiling.py --dataset tafeng      # or --dataset demo

Rows (test AUROC at the test cut-off, churn as bench/quality.py defines it):
- lightgbm: the baseline's hand features, trained on the protocol's cut-offs (bench/quality.py's row);
- + more features: plus generic features neither model had: the spread, longest, shortest and last
  of the gaps between visits, visits by day of week and by fortnight, how many distinct values of
  each column, and how often the other buyers of the entity's values came back (collaborative, from
  the past only);
- ceiling: LightGBM fitted on the test cut-off's own labels (5-fold cross-fitting over its entities)
  plus every earlier cut-off. Not a model anyone can deploy (it reads labels from the test window):
  an upper bound on what these features can rank, free of the shift between cut-offs.
A bar above the ceiling asks for signal the features do not carry.
"""

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from quality import demo_spec, tafeng_spec, tasks  # noqa: E402

from habitus.models.evaluate.baselines import hand_features  # noqa: E402
from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.evaluate.holdout import protocol  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec, chunk_at  # noqa: E402
from habitus.models.tasks.metrics import auroc  # noqa: E402
from habitus.models.data.targets import compute_target, eligible  # noqa: E402
from habitus.models.train.loop import chunk_plan  # noqa: E402

PARAMS = dict(n_estimators=2000, learning_rate=0.02, num_leaves=31, min_child_samples=50, subsample=0.8,
              subsample_freq=1, colsample_bytree=0.8, max_bin=63, random_state=0, verbose=-1, n_jobs=0)


def all_events(cache: Cache) -> dict[str, np.ndarray]:
    """Every event's entity, time and categorical values, as flat arrays."""
    cols = [c for c, m in cache.columns.items() if m["type"] == "categorical"]
    shards = [cache.shard(s) for s in range(cache.shard_count)]
    return {"e": np.concatenate([np.repeat(sh.entities, np.diff(sh.starts)) for sh in shards]),
            "ts": np.concatenate([sh.ts for sh in shards]),
            **{c: np.concatenate([sh.columns[c] for sh in shards]) for c in cols}}


def return_rates(ev: dict, cutoff: int, window: int, column: str, lookback: int = 60, prior: float = 20):
    """Per value of `column`: the share of its buyers in the `lookback` days before (cutoff - window)
    who had an event in the window that ends at the cut-off (smoothed towards the overall share)."""
    ts, e, v = ev["ts"], ev["e"], ev[column].astype(np.int64)
    seen = (ts <= cutoff - window * DAY) & (ts > cutoff - (window + lookback) * DAY)
    back = np.unique(e[(ts > cutoff - window * DAY) & (ts <= cutoff)])
    pairs = np.unique(np.stack([e[seen], v[seen]], 1), axis=0)  # (buyer, value) once each
    came = np.isin(pairs[:, 0], back).astype(float)
    base = came.mean() if len(came) else 0.0
    size = int(v.max(initial=0)) + 1
    hits, buyers = np.bincount(pairs[:, 1], came, size), np.bincount(pairs[:, 1], minlength=size)
    return (hits + prior * base) / (buyers + prior)


def more_features(chunk, ev: dict, columns: list[str], window: int) -> np.ndarray:
    n, local = chunk.n, chunk.local
    day = np.floor(chunk.age_days)
    new = np.r_[True, (np.diff(local) != 0) | (np.diff(day) != 0)]
    v_e, v_age = local[new], day[new]  # visits, oldest first within an entity
    same = np.r_[False, v_e[1:] == v_e[:-1]]
    gap_e, gap = v_e[same], (v_age[:-1] - v_age[1:])[same[1:]]
    count = np.bincount(gap_e, minlength=n)
    mean = np.bincount(gap_e, gap, n) / np.maximum(count, 1)
    std = np.sqrt(np.maximum(np.bincount(gap_e, gap ** 2, n) / np.maximum(count, 1) - mean ** 2, 0))
    longest, shortest, last = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    np.fmax.at(longest, gap_e, gap)
    np.fmin.at(shortest, gap_e, gap)
    ends = np.r_[np.flatnonzero(np.diff(gap_e)), len(gap_e) - 1] if len(gap_e) else np.zeros(0, np.int64)
    last[gap_e[ends]] = gap[ends]  # each entity's latest gap
    none = count == 0
    blocks = [np.stack([np.where(none, np.nan, std), longest, shortest, last], 1)]
    dow = np.zeros((n, 7))
    np.add.at(dow, (v_e, v_age.astype(int) % 7), 1.0)  # the cut-off's weekday is everyone's
    fortnight = np.zeros((n, 8))
    np.add.at(fortnight, (v_e, np.minimum(v_age // 14, 7).astype(int)), 1.0)
    blocks += [dow / np.maximum(dow.sum(1, keepdims=True), 1), fortnight]
    recent = chunk.age_days <= 90
    weight = np.exp2(-chunk.age_days[recent] / 30)
    for c in columns:
        values = chunk.shard.columns[c][chunk.rows].astype(np.int64)
        blocks.append(np.bincount(np.unique(np.stack([local, values], 1), axis=0)[:, 0], minlength=n)[:, None])
        rate = return_rates(ev, chunk.cutoff, window, c)
        r = rate[np.minimum(values[recent], len(rate) - 1)]
        lowest = np.full(n, np.nan)
        np.fmin.at(lowest, local[recent], r)
        total = np.bincount(local[recent], weight, n)
        blocks.append(np.stack([np.where(total > 0, np.bincount(local[recent], weight * r, n) / np.maximum(total, 1e-12),
                                         np.nan), lowest], 1))
    return np.concatenate(blocks, axis=1).astype(np.float32)


def dataset(cache, spec, task, cutoffs, ev, columns):
    entity_table = cache.entity_table()
    vocab = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    hand, more, ys = [], [], []
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, 1 << 20):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n == 0:
                continue
            keep = eligible(chunk, task.target)
            hand.append(hand_features(chunk, spec, task, entity_table, vocab)[keep])
            more.append(more_features(chunk, ev, columns, task.target.window_days)[keep])
            ys.append(compute_target(chunk, task.target, None, cache)[keep])
    return np.concatenate(hand), np.concatenate(more), np.concatenate(ys)


def run(name: str, customers: int) -> list[tuple[str, float, str]]:
    import lightgbm as lgb
    from sklearn.model_selection import StratifiedKFold

    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # (as models/evaluate/baselines.py)

    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, params = tafeng_spec() if name == "tafeng" else demo_spec(customers, Path(tmp))
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=lambda _: None))
        fspec = FeatureSpec.from_cache(cache)
        task = tasks(cache, test_cutoff, params)["churn"]
        plan = protocol(test_cutoff, task.target.window_days, 4, cache.time_range[0])
        ev = all_events(cache)
        columns = list(fspec.categorical)
        tr, va, te = (dataset(cache, fspec, task, c, ev, columns)
                      for c in (plan.train_cutoffs, [plan.val_cutoff], [plan.test_cutoff]))
    rows = []
    for label, pick in (("hand features", lambda d: d[0]), ("hand + more features", lambda d: np.c_[d[0], d[1]])):
        model = lgb.LGBMClassifier(**PARAMS)
        model.fit(pick(tr), tr[2], eval_set=[(pick(va), va[2])], callbacks=[lgb.early_stopping(100, verbose=False)])
        rows.append((f"lightgbm, {label}", auroc(te[2], model.predict_proba(pick(te))[:, 1]),
                     f"protocol cut-offs, {model.best_iteration_} trees"))
    for label, pick in (("hand features", lambda d: d[0]), ("hand + more features", lambda d: np.c_[d[0], d[1]])):
        earlier_x, earlier_y = np.r_[pick(tr), pick(va)], np.r_[tr[2], va[2]]
        x, oof = pick(te), np.zeros(len(te[2]))
        for fit, held in StratifiedKFold(5, shuffle=True, random_state=0).split(x, te[2]):
            model = lgb.LGBMClassifier(**{**PARAMS, "n_estimators": 300, "learning_rate": 0.03})
            model.fit(np.r_[earlier_x, x[fit]], np.r_[earlier_y, te[2][fit]])
            oof[held] = model.predict_proba(x[held])[:, 1]
        rows.append((f"ceiling, {label}", auroc(te[2], oof), "test labels, 5-fold, + every earlier cut-off"))
    rows.append(("entities / churn rate", float(len(te[2])), f"{te[2].mean():.3f} churn at the test cut-off"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["tafeng", "demo"], default="tafeng")
    parser.add_argument("--customers", type=int, default=20_000, help="demo size")
    args = parser.parse_args()
    print(f"dataset {args.dataset}: churn AUROC at the test cut-off")
    for label, value, how in run(args.dataset, args.customers):
        print(f"{label:<40} {value:>9.4f}  {how}" if value < 1 else f"{label:<40} {value:>9.0f}  {how}")


if __name__ == "__main__":
    main()
