"""Per-label co-occurrence affinity (models/data/affinity.py, `affinity_features`) added to the baseline's
LightGBM, with and without, on a temporal hold-out: a paired entity bootstrap interval of the difference.

    python bench/affinity.py --dataset tafeng [--seeds 0,1,2] [--json out.json] [--scores out.npz]
    python bench/affinity.py --dataset demo --customers 20000
    python bench/affinity.py --dataset tafeng --seeds 0 --variants attributes,attributes_cosine,attributes_mass

Variants (`--variants`, comma-separated; each is one more LightGBM arm against the same one without):
which levels (embedded columns) give a label its columns and which of the two features per level.
"all": every categorical event column (cosine and mass); "attributes": the item attribute columns only
(models/data/affinity.py's attribute_columns: the cache's lookup columns, functions of the item like
a subclass, category or brand; neither the item id nor per-visit context like a store); "label": the
label column alone; a suffix "_cosine" or "_mass" keeps that feature only.

The protocol is bench/quality.py's (its dataset specs and propensity task, imported): at every cut-off
(training, validation, test) the affinity is fitted on that cut-off's past only. "lightgbm" is the
baseline's per-label LightGBM (models/tasks/multilabel.py's parameters, the same training rows, early
stopped on the validation cut-off) over the hand features, with and without each label's own
affinity columns. The hand features come from the stack's rows (models/heads/stacked_rows.collect,
which needs a foundation trunk: one is trained, its representation is not read).
`affinity_lightgbm_scores` is the same LightGBM with every categorical column's affinity as the
quality panel's reference arm "lightgbm + affinity" (bench/panel.py), built from the hand features
directly (no trunk).

Macro AUROC at the test cut-off over the labels with both classes; the interval is a paired bootstrap
over test entities (this script's own, 200 resamples, the seeds' mean difference in each resample).
"""

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
from habitus.models.data.affinity import Affinity, affinity_features, attribute_columns  # noqa: E402
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec, chunk_at  # noqa: E402
from habitus.models.evaluate.baselines import (MULTILABEL_MAX_LABELS, MULTILABEL_ROWS, hand_features,  # noqa: E402
                                               most_frequent_labels)
from habitus.models.tasks import task as task_of  # noqa: E402
from habitus.models.tasks.base import LabelScores  # noqa: E402
from habitus.models.evaluate.holdout import protocol  # noqa: E402
from habitus.models.heads.stacked_rows import Rows, collect  # noqa: E402
from habitus.models.heads.stacking import StackConfig  # noqa: E402
from habitus.models.nn.network import load_trunk  # noqa: E402
from habitus.models.train.config import TRAIN_CUTOFFS, FoundationConfig  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402


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


def lightgbm_per_label(train: tuple, val: tuple, test: tuple, seed: int, with_affinity: bool) -> np.ndarray:
    """The baseline's per-label LightGBM (models/tasks/multilabel.py's parameters) over the hand features
    (+ each label's own affinity columns)."""
    import warnings

    import lightgbm as lgb

    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # (as baselines.lightgbm_scores)
    params = dict(n_estimators=100, learning_rate=0.1, num_leaves=15, min_child_samples=50, subsample=0.8,
                  subsample_freq=1, colsample_bytree=0.8, max_bin=63, random_state=seed, verbose=-1, n_jobs=1)
    rows = np.random.default_rng(seed).permutation(len(train[0]))[:MULTILABEL_ROWS]
    sub = (train[0].take(rows), train[1][rows])
    out = np.zeros(test[0].y.shape, np.float32)

    def x(r: tuple, j: int) -> np.ndarray:  # (Rows, affinity [n, labels, width])
        return np.concatenate([r[0].hand, r[1][:, j, :]], 1) if with_affinity else r[0].hand

    y, y_val = sub[0].y, val[0].y
    for j in range(y.shape[1]):
        if y[:, j].min() == y[:, j].max():
            out[:, j] = y[0, j]
            continue
        model = lgb.LGBMClassifier(**params)
        model.fit(x(sub, j), np.ascontiguousarray(y[:, j]),
                  eval_set=[(x(val, j), np.ascontiguousarray(y_val[:, j]))], callbacks=[lgb.early_stopping(15, verbose=False)])
        out[:, j] = model.predict_proba(x(test, j))[:, 1]
    return out


def affinity_lightgbm_scores(cache: Cache, spec: FeatureSpec, task, train_cutoffs, val_cutoff: int, test_cutoff: int,
                             *, seed: int = 0, train_cache: Cache | None = None, levels: tuple[str, ...] | None = None,
                             max_labels: int = MULTILABEL_MAX_LABELS) -> LabelScores:
    """The panel's reference arm "lightgbm + affinity" (bench/panel.py): lightgbm_per_label over the hand
    features and each label's own affinity columns (`levels`: every categorical column by default, cosine
    and mass each), at every cut-off the affinity fitted on that cut-off's past; the test entities'
    scores (evaluate's order) of the `max_labels` most frequent labels. `train_cache`: the entities
    whose labels train it (default `cache`)."""
    train = cache if train_cache is None else train_cache
    labels = most_frequent_labels(train, task, train_cutoffs, max_labels)
    labels = np.arange(task.outputs) if labels is None else labels
    values = np.asarray(task.target.labels)[labels]
    # the levels embedded at the oldest cut-off (later ones only add events): every cut-off's rows as wide
    levels = tuple(Affinity.fit(train, int(min(train_cutoffs)), task.target.column, values, levels=levels).levels)

    def rows(c: Cache, cutoffs) -> tuple:  # (Rows of the hand features and targets, affinity [n, labels, width])
        entity_table = c.entity_table()
        vocab_sizes = {k: m["vocab_size"] for k, m in c.columns.items() if m["type"] == "categorical"}
        hands, affs, ys = [], [], []
        for cutoff in cutoffs:
            aff = Affinity.fit(c, int(cutoff), task.target.column, values, levels=levels)
            for s, lo, hi in chunk_plan(c, SCORING_CHUNK_ENTITIES):
                chunk = chunk_at(c.shard(s), lo, hi, int(cutoff))
                if chunk.n == 0:
                    continue
                keep, y = task_of(task).labels(chunk, task.target, c)
                hands.append(hand_features(chunk, spec, task, entity_table, vocab_sizes, labels)[keep])
                affs.append(aff.features(chunk)[keep])
                ys.append(y.dense(0, labels))
        hand, y = np.concatenate(hands), np.concatenate(ys).astype(np.float32)
        return Rows(np.arange(len(hand)), hand, np.zeros((len(hand), 0), np.float32), y), np.concatenate(affs)

    out = lightgbm_per_label(rows(train, train_cutoffs), rows(train, [val_cutoff]), rows(cache, [test_cutoff]), seed,
                             True)
    return LabelScores(labels, out)


VARIANT_LEVELS = ("all", "attributes", "label")
VARIANT_FEATURES = {"": (0, 1), "_cosine": (0,), "_mass": (1,)}


def variant_levels(cache: Cache, column: str, variant: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(levels, feature indices within a level: 0 cosine, 1 mass) of a variant name (module docstring)."""
    base, _, feature = variant.partition("_")
    if base not in VARIANT_LEVELS or f"_{feature}" not in VARIANT_FEATURES and feature:
        raise ValueError(f"unknown variant {variant!r}: one of {VARIANT_LEVELS}, optionally with _cosine or _mass")
    features = VARIANT_FEATURES[f"_{feature}" if feature else ""]
    if base == "all":
        return tuple(c for c, m in cache.columns.items() if m["type"] == "categorical"), features
    return (attribute_columns(cache) if base == "attributes" else (column,)), features


def run(dataset: str, customers: int, seeds: list[int], workdir: Path, log=print, scores: Path | None = None,
        variants: tuple[str, ...] = ("all",)) -> dict:
    spec, test_cutoff, params = dataset_spec(dataset, customers, workdir)
    cache = Cache(build_cache(spec, workdir / "cache", log=lambda _: None))
    fcfg = FoundationConfig()
    foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=lambda _: None)
    fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    trunk = load_trunk(foundation.model.state_dict(), foundation.info["net"]).float().eval()
    task = tasks(cache, test_cutoff, params)["propensity"]
    plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
    labels = most_frequent_labels(cache, task, plan.train_cutoffs, StackConfig().max_labels)
    values = np.asarray(task.target.labels)[labels] if labels is not None else np.asarray(task.target.labels)
    chosen = {v: variant_levels(cache, task.target.column, v) for v in variants}
    levels = sorted({c for lv, _ in chosen.values() for c in lv})  # each level is fitted on its own
    fit_s, rows, width = {c: [] for c in levels}, {}, {}
    for name, cutoffs in (("train", plan.train_cutoffs), ("val", [plan.val_cutoff]), ("test", [plan.test_cutoff])):
        parts = []
        for cut in cutoffs:
            r = collect(cache, fspec, task, trunk, cut, labels=labels)  # (the hand features, in the holdout's order)
            per_level = {}
            for c in levels:
                t0 = time.time()
                per_level[c] = affinity_features(cache, cut, task.target.column, values, entities=r.entities, levels=(c,))
                fit_s[c].append(time.time() - t0)
            parts.append((r, per_level))
        rows[name] = (Rows(*(np.concatenate([getattr(p[0], k) for p in parts])
                             for k in ("entities", "hand", "embedding", "y"))),
                      {c: np.concatenate([p[1][c] for p in parts]) for c in levels})
    for c in levels:
        width[c] = rows["test"][1][c].shape[2]  # 0 where the column has too few values for a level
        log(f"affinity level {c}: fit + features {np.mean(fit_s[c]):.1f}s per cut-off, width {width[c]}")
    log(f"rows train {len(rows['train'][0])}, val {len(rows['val'][0])}, test {len(rows['test'][0])}")

    def arm(name: str, variant: str | None) -> tuple:
        r, per_level = rows[name]
        if variant is None:
            return r, np.zeros((len(r), r.y.shape[1], 0), np.float32)
        lv, feats = chosen[variant]
        blocks = [per_level[c][:, :, list(feats)] for c in lv if width[c]]
        return r, np.concatenate(blocks, 2) if blocks else np.zeros((len(r), r.y.shape[1], 0), np.float32)

    lgbm = {v: [] for v in (None, *variants)}
    for seed in seeds:
        for v in lgbm:
            lgbm[v].append(lightgbm_per_label(arm("train", v), arm("val", v), arm("test", v), seed, v is not None))
            log(f"seed {seed} {v or 'without'} done")
    y = rows["test"][0].y
    if scores is not None:  # the test scores, before the bootstrap
        np.savez_compressed(scores, y=y, entities=rows["test"][0].entities, lightgbm_without=np.stack(lgbm[None]),
                            **{f"lightgbm_{v}": np.stack(lgbm[v]) for v in variants})
    result = {"dataset": dataset, "seeds": seeds, "labels": int(y.shape[1]), "test_entities": int(len(y)),
              "affinity_s_per_cutoff": {c: round(float(np.mean(fit_s[c])), 2) for c in levels}, "variants": {}}
    for v in variants:
        lv, feats = chosen[v]
        d = paired(y, lgbm[v], lgbm[None])
        d["levels"] = [c for c in lv if width[c]]
        d["width"] = int(arm("test", v)[1].shape[2])
        result["variants"][v] = d
        log(f"lightgbm {v} ({', '.join(d['levels'])}; {d['width']} per label) - without: {d['a']:.4f} - {d['b']:.4f} "
            f"= {d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]")
    return result


def main() -> None:
    parser = dataset_parser(__doc__)
    parser.add_argument("--seeds", default="0,1,2", help="the trees' seeds (comma-separated)")
    parser.add_argument("--tafeng", default=str(quality.TAFENG), help="the Ta-Feng folder (shared/data/tafeng)")
    parser.add_argument("--scores", help="also save the test scores (.npz) here, before the bootstrap")
    parser.add_argument("--variants", default="all", help="the affinity variants (comma-separated; the docstring)")
    args = parser.parse_args()
    quality.TAFENG = Path(args.tafeng)
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args.dataset, args.customers, seeds, Path(tmp),
                     log=lambda m: print(m, file=sys.stderr, flush=True), scores=None if args.scores is None else Path(args.scores),
                     variants=tuple(args.variants.split(",")))
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
