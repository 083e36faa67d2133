"""The practitioner's baseline: hand-made features and LightGBM, trained on the same cut-offs.

Hand features: recency / frequency (events and visits) / monetary scalars, the entity's attributes, and for each
low-cardinality categorical column (categories, brands) the decayed counts of its most frequent
values; for label tasks also each label's own count. One model per task (one per label for
multilabel, on at most MULTILABEL_MAX_LABELS labels), early-stopped on the validation cut-off,
scored on the test cut-off.
"""

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np

from models.cache import Cache
from models.features import (HALF_LIVES, FeatureSpec, chunk_at, entity_features, scalar_features, value_history,
                             visit_features)
from models.items import SparseRows
from models.targets import compute_target, eligible
from models.labels import label_history
from models.loop import chunk_plan
from models.specs import TaskSpec

TOP_VALUES = 20
MAX_VOCAB = 5_000  # columns with more values (product ids) are left to the per-label counts
MULTILABEL_ROWS = 30_000
# one model per label: a wider head (16,000 products) would take hours, so LightGBM learns its most frequent labels only
MULTILABEL_MAX_LABELS = 200


@dataclass
class LabelScores:
    """Scores of some labels only: `scores` [entities, len(labels)] for the label positions `labels` (sorted)."""

    labels: np.ndarray
    scores: np.ndarray


def hand_features(chunk, spec: FeatureSpec, task: TaskSpec, entity_table, vocab_sizes: dict[str, int],
                  labels: np.ndarray | None = None) -> np.ndarray:
    """`labels`: the label positions whose own counts are features (default all)."""
    spec = dataclasses.replace(spec, half_lives=HALF_LIVES)  # the baseline's own features, whatever habitus uses
    # frequency counted in visits as well as events (event rows are often lines of one basket)
    parts = [scalar_features(chunk, spec), visit_features(chunk, spec),
             entity_features(chunk.entities, chunk.cutoff, spec, entity_table)]
    for c, vocab in spec.categorical.items():
        if vocab > MAX_VOCAB:
            continue
        ids = chunk.shard.columns[c][chunk.rows]
        top = min(TOP_VALUES, vocab)
        keep = (ids >= 1) & (ids <= top)  # ids are ordered by frequency: 1..top are the most frequent
        parts.append(np.log1p(value_history(chunk, np.where(keep, ids - 1, 0), top, spec.half_lives[-1:], keep)[:, :, 0]))
    if task.uses_label_history:
        hist = label_history(chunk, task.target, vocab_sizes[task.target.column], spec.half_lives)
        parts.append(hist.dense(1, labels))
    return np.concatenate(parts, axis=1)


def _dataset(cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoffs, chunk_entities: int = 8192,
             labels: np.ndarray | None = None):
    """Hand features and targets; multilabel: the 0/1 matrix of `labels` (default all)."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    xs, ys = [], []
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, chunk_entities):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n == 0:
                continue
            keep = eligible(chunk, task.target)
            xs.append(hand_features(chunk, spec, task, entity_table, vocab_sizes, labels)[keep])
            y = compute_target(chunk, task.target, vocab_sizes.get(task.target.column), cache)[keep]
            if isinstance(y, SparseRows):  # multilabel: the 0/1 matrix
                y = y.dense(0, labels)
            ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def lightgbm_scores(cache: Cache, spec: FeatureSpec, task: TaskSpec, train_cutoffs, val_cutoff: int,
                    test_cutoff: int, *, seed: int = 0,
                    max_labels: int = MULTILABEL_MAX_LABELS) -> np.ndarray | LabelScores | None:
    """LightGBM predictions for the entities `evaluate` scores at `test_cutoff` (same order), or
    None where LightGBM does not apply (recommendation over a whole catalog) or is not installed.
    A multilabel head of more than `max_labels` labels gets LabelScores of its `max_labels` labels
    with the most training positives (the hand features count those labels only)."""
    if task.task == "recommendation":
        return None
    try:
        import lightgbm as lgb
    except ImportError:
        return None
    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # the spelling 4.0-4.6 know
    labels = _top_labels(cache, task, train_cutoffs, max_labels) if task.task == "multilabel" else None
    x_train, y_train = _dataset(cache, spec, task, train_cutoffs, labels=labels)
    x_val, y_val = _dataset(cache, spec, task, [val_cutoff], labels=labels)
    x_test, _ = _dataset(cache, spec, task, [test_cutoff], labels=labels)
    params = dict(n_estimators=400, learning_rate=0.05, num_leaves=31, min_child_samples=50, subsample=0.8,
                  subsample_freq=1, colsample_bytree=0.8, max_bin=63, random_state=seed, verbose=-1, n_jobs=0)
    stop = [lgb.early_stopping(30, verbose=False)]
    if task.task == "regression":
        model = lgb.LGBMRegressor(objective="l1", **params)
        model.fit(x_train, y_train, eval_set=[(x_val, y_val)], callbacks=stop)
        return model.predict(x_test).astype(np.float32)
    if task.task == "binary":
        model = lgb.LGBMClassifier(**params)
        model.fit(x_train, y_train, eval_set=[(x_val, y_val)], callbacks=stop)
        return model.predict_proba(x_test)[:, 1].astype(np.float32)
    # multilabel: one small model per label, on at most MULTILABEL_ROWS training rows (cost is labels x rows)
    rows = np.random.default_rng(seed).permutation(len(x_train))[:MULTILABEL_ROWS]
    x_sub, y_sub = x_train[rows], y_train[rows]
    out = np.zeros((len(x_test), y_train.shape[1]), np.float32)
    small = {**params, "n_estimators": 100, "learning_rate": 0.1, "num_leaves": 15}
    for j in range(y_train.shape[1]):
        if y_sub[:, j].min() == y_sub[:, j].max():
            out[:, j] = y_sub[0, j]
            continue
        model = lgb.LGBMClassifier(**small)
        model.fit(x_sub, y_sub[:, j], eval_set=[(x_val, y_val[:, j])], callbacks=[lgb.early_stopping(15, verbose=False)])
        out[:, j] = model.predict_proba(x_test)[:, 1]
    return out if labels is None else LabelScores(labels, out)


def _top_labels(cache: Cache, task: TaskSpec, cutoffs, n: int, chunk_entities: int = 8192) -> np.ndarray | None:
    """The n label positions with the most positives at the training cut-offs (sorted), or None if
    the head has no more than n labels."""
    if task.outputs <= n:
        return None
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    positives = np.zeros(task.outputs, np.int64)
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, chunk_entities):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n:
                y = compute_target(chunk, task.target, vocab_sizes.get(task.target.column), cache)
                positives += y[eligible(chunk, task.target)].col_counts()
    return np.sort(np.argsort(-positives, kind="stable")[:n])
