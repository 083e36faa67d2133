"""Realized performance: a day's served scores against what happened in the target window after it.

A day D's predictions were scored as of the end of D (cut-off C = the next midnight, UTC). Once the
cache holds every day of the window after C (its newest event day is D + window or later), the
targets of (C, C + window] are known: the same labels the hold-out reads (habitus.models.data.targets
through the task's `labels`), on the same eligible entities, scored by the task's own metrics, next
to the task's baselines as of C (its history heuristics, the training mean, and LightGBM fitted on
the serving version's training and validation cut-offs, scored at C). Entities the day's file does
not score (scored from an older cache, or without history then) are left out of every figure.
A label task's file holds top-k lists (realized_lists): they are scored by the task's list metrics
against the realized labels, next to its history baselines cut to their top k (models/tasks).
"""

from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from habitus.models.cache import Cache
from habitus.models.data.chunks import day_floor
from habitus.models.data.features import DAY, FeatureSpec
from habitus.models.evaluate.baselines import lightgbm_scores
from habitus.models.evaluate.holdout import LOWER_IS_BETTER, headline, holdout_chunks
from habitus.models.tasks import task as task_of
from habitus.models.tasks.spec import TaskSpec


def window_end(cutoff: int, window_days: int) -> int:
    """The first midnight after the target window of cut-off `cutoff` (seconds, UTC)."""
    return day_floor(cutoff) + window_days * DAY


def window_complete(newest_ts: int, cutoff: int, window_days: int) -> bool:
    """Whether the cache's newest event (`newest_ts`) is on the window's last day or later: every day of
    (cutoff, cutoff + window] is in (days are extracted whole, so a day with an event is complete)."""
    return day_floor(newest_ts) + DAY >= window_end(cutoff, window_days)


def seconds(iso: str) -> int:
    """A checkpoint's ISO time ('2026-10-04T00:00:00Z') as epoch seconds."""
    return int(datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp())


def scores_of(entity_ids: pa.Array, predicted_ids: pa.Array, predicted: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the score of each of `entity_ids` in the day's file, whether it has one)."""
    at = pc.index_in(entity_ids, value_set=predicted_ids)
    has = at.is_valid().to_numpy(zero_copy_only=False)
    values = np.full(len(entity_ids), np.nan, np.float64)
    if has.any():
        taken = predicted.take(at.filter(at.is_valid()))
        values[has] = taken.to_numpy(zero_copy_only=False).astype(np.float64)
    has &= np.isfinite(values)  # a row without history (null score) counts as not scored
    return values, has


def written_lists(entity_ids: pa.Array, predicted_ids: pa.Array, predicted: pa.Array, names, k: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(the first k labels each of `entity_ids` was written, as label positions in `names` [entities, k],
    whether it has a list): `predicted` is the day's `labels` column; a label not in `names`, or a list
    shorter than k, is padded with len(names) (a position no label has)."""
    at = pc.index_in(entity_ids, value_set=predicted_ids)
    has = at.is_valid().to_numpy(zero_copy_only=False)
    top = np.full((len(entity_ids), k), len(names), np.int64)
    if not has.any():
        return top, has
    lists = predicted.take(at.filter(at.is_valid()))
    lengths = pc.list_value_length(lists).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.index_in(pc.cast(pc.list_flatten(lists), pa.string()), value_set=pa.array([str(n) for n in names]))
    flat = flat.fill_null(len(names)).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    rows = np.flatnonzero(has)
    for j in range(k):
        inside = lengths > j
        top[rows[inside], j] = flat[starts[inside] + j]
    has[rows[lengths == 0]] = False  # a row without history (no list) counts as not scored
    return top, has


def realized_lists(cache: Cache, features: FeatureSpec, task: TaskSpec, cutoff: int, predicted_ids: pa.Array,
                   predicted: pa.Array, names) -> dict:
    """A label task's written top-k lists (`predicted`, the day's `labels` column, named by `names` in label
    order) against the labels realized after `cutoff`, next to the task's history baselines as top-k lists
    as of `cutoff` (Task.list_baselines: the hold-out's baselines, without the model), on the same
    entities; scored by Task.list_metrics."""
    t = task_of(task)
    k = t.list_k(task)
    lists_of = t.list_baselines(task, cache, cutoff)
    ids, rel_rows, rel_cols, base, n = [], [], [], {}, 0
    for chunk, keep, _, h, y in holdout_chunks(cache, features, task, cutoff):
        rows, cols = t.relevant(y)
        rel_rows.append(np.asarray(rows, np.int64) + n)
        rel_cols.append(np.asarray(cols, np.int64))
        ids.append(chunk.entities[keep])
        for name, top in lists_of(h[keep], k, features.habitual_channel).items():
            base.setdefault(name, []).append(top)
        n += int(keep.sum())
    entities = cache.entity_ids(np.concatenate(ids)) if ids else pa.array([], predicted_ids.type)
    model, scored = written_lists(entities, predicted_ids, predicted, names, k)
    rows, cols = (np.concatenate(rel_rows), np.concatenate(rel_cols)) if ids else (np.zeros(0, np.int64),) * 2
    index = np.cumsum(scored) - 1  # a scored row's position among the scored rows
    kept = scored[rows]
    rows, cols = index[rows[kept]], cols[kept]
    key = t.list_headline(task)
    return {"metric": key, "lower_is_better": key in t.lower_is_better, "k": k,
            "model": t.list_metrics(task, model[scored], rows, cols),
            "baselines": {name: t.list_metrics(task, np.concatenate(v)[scored], rows, cols)
                          for name, v in base.items()},
            "entities": int(scored.sum()), "not_scored": int((~scored).sum()),
            "with_labels": int(len(np.unique(rows)))}


def realized(cache: Cache, features: FeatureSpec, task: TaskSpec, cutoff: int, predicted_ids: pa.Array,
             predicted: pa.Array, *, constant: float | None = None,
             lightgbm: tuple[list[int], int] | None = None, names=None) -> dict:
    """The served scores `predicted` of entities `predicted_ids` (one score per entity: what the day's
    predictions file holds) against the realized targets after `cutoff`, next to the baselines as of
    `cutoff`: {"model", "baselines", "entities", "not_scored", "metric", "lower_is_better", ...the task's
    summary}. `constant`: the training mean (the fixed baseline); `lightgbm`: (training cut-offs,
    validation cut-off) of the serving version, to fit the LightGBM baseline again and score it at `cutoff`.
    A label task (top-k lists in `predicted`, the `labels` column, named by `names`): realized_lists."""
    t = task_of(task)
    if t.label_outputs:
        return realized_lists(cache, features, task, cutoff, predicted_ids, predicted, names)
    ys, ids, base = [], [], {}
    for chunk, keep, _, h, y in holdout_chunks(cache, features, task, cutoff):
        ys.append(np.asarray(y))
        ids.append(chunk.entities[keep])
        for name, values in t.baselines(task, chunk, h, features.habitual_channel).items():
            base.setdefault(name, []).append(np.asarray(values)[keep])
    y = np.concatenate(ys) if ys else np.zeros(0, np.float32)
    entities = cache.entity_ids(np.concatenate(ids)) if ids else pa.array([], predicted_ids.type)
    model, scored = scores_of(entities, predicted_ids, predicted)
    baselines = {name: np.concatenate(v) for name, v in base.items()}
    baselines.update(t.fixed_baselines(task, constant, len(y)))
    if lightgbm is not None:
        gbt = lightgbm_scores(cache, features, task, lightgbm[0], lightgbm[1], cutoff)
        if gbt is not None:
            baselines["lightgbm"] = np.asarray(gbt)
    y = y[scored]
    key = headline(task)
    return {"metric": key, "lower_is_better": key in LOWER_IS_BETTER,
            "model": t.metrics(y, model[scored]),
            "baselines": {name: t.metrics(y, v[scored]) for name, v in baselines.items()},
            "entities": int(scored.sum()), "not_scored": int((~scored).sum()), **t.summary(y)}


def best_baseline(report: dict) -> tuple[str | None, float]:
    """(name, value) of the baseline best on the report's metric (nan: none measured)."""
    key, lower = report["metric"], report["lower_is_better"]
    values = {b: m.get(key, np.nan) for b, m in report["baselines"].items()}
    values = {b: v for b, v in values.items() if v == v}
    if not values:
        return None, float("nan")
    best = (min if lower else max)(values, key=values.__getitem__)
    return best, float(values[best])


def worse(value: float, than: float, lower_is_better: bool) -> bool:
    """Whether `value` is worse than `than` on a metric (False when either is nan)."""
    if value != value or than != than:
        return False
    return value > than if lower_is_better else value < than


def shortfall(value: float, reference: float, lower_is_better: bool) -> float:
    """How much worse `value` is than `reference`, as a share of |reference| (negative: better)."""
    if value != value or reference != reference or reference == 0:
        return float("nan")
    gap = value - reference if lower_is_better else reference - value
    return gap / abs(reference)
