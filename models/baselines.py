"""The practitioner's baseline: hand-made features and LightGBM, trained on the same cut-offs.

Hand features: recency / frequency (events and visits) / monetary scalars, the entity's attributes, and for each
low-cardinality categorical column (categories, brands) the decayed counts of its most frequent
values; for label tasks also each label's own count. One model per task (one per label for
multilabel), early-stopped on the validation cut-off, scored on the test cut-off.
"""

import dataclasses
import warnings

import numpy as np

from models.cache import Cache
from models.features import (HALF_LIVES, FeatureSpec, chunk_at, entity_features, scalar_features, value_history,
                             visit_features)
from models.items import SparseRows
from models.targets import compute_target, eligible
from models.train import TaskSpec, chunk_plan, label_history

TOP_VALUES = 20
MAX_VOCAB = 5_000  # columns with more values (product ids) are left to the per-label counts
MULTILABEL_ROWS = 30_000


def hand_features(chunk, spec: FeatureSpec, task: TaskSpec, entity_table, vocab_sizes: dict[str, int]) -> np.ndarray:
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
        parts.append(label_history(chunk, task.target, vocab_sizes[task.target.column], spec.half_lives).dense(1))
    return np.concatenate(parts, axis=1)


def _dataset(cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoffs, chunk_entities: int = 8192):
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    xs, ys = [], []
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, chunk_entities):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n == 0:
                continue
            keep = eligible(chunk, task.target)
            xs.append(hand_features(chunk, spec, task, entity_table, vocab_sizes)[keep])
            y = compute_target(chunk, task.target, vocab_sizes.get(task.target.column), cache)[keep]
            ys.append(y.dense() if isinstance(y, SparseRows) else y)  # multilabel: the 0/1 matrix
    return np.concatenate(xs), np.concatenate(ys)


def lightgbm_scores(cache: Cache, spec: FeatureSpec, task: TaskSpec, train_cutoffs, val_cutoff: int,
                    test_cutoff: int, *, seed: int = 0) -> np.ndarray | None:
    """LightGBM predictions for the entities `evaluate` scores at `test_cutoff` (same order), or
    None where LightGBM does not apply (recommendation over a whole catalog) or is not installed."""
    if task.task == "recommendation":
        return None
    try:
        import lightgbm as lgb
    except ImportError:
        return None
    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # the spelling 4.0-4.6 know
    x_train, y_train = _dataset(cache, spec, task, train_cutoffs)
    x_val, y_val = _dataset(cache, spec, task, [val_cutoff])
    x_test, _ = _dataset(cache, spec, task, [test_cutoff])
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
    return out
