"""A practitioner-strength propensity baseline: LightGBM per label over the baseline's hand features
(habitus.models.evaluate.baselines.hand_features: RFM, visits, attributes, top values, every label's
60-day count) plus the label's own history as a practitioner would build it:

- its decayed counts at three half-lives (7, 30 and 120 days, log-scaled), its decayed recency
  (30 days, the most recent event's weight) and the days since its last event (NaN: never);
- the same five figures for the label's parent (the parent column's value its events carry most
  often before the cut-off: the demo's brand -> category), where the data has a parent column.

One model per label on the labels the product's LightGBM learns (its `max_labels` most frequent),
fitted on at most `label_rows` training rows, early-stopped on the validation cut-off, with the
product baseline's per-label parameters: it differs from it by its inputs only.
"""

import warnings

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
from habitus.models.data.features import FeatureSpec, chunk_at, value_history
from habitus.models.data.targets import label_positions
from habitus.models.evaluate.baselines import MULTILABEL_MAX_LABELS, MULTILABEL_ROWS, hand_features, most_frequent_labels
from habitus.models.tasks import task as task_of
from habitus.models.tasks.base import LabelScores
from habitus.models.tasks.spec import TaskSpec

HALF_LIVES = (7.0, 30.0, 120.0)
PER_LABEL = 2 * (len(HALF_LIVES) + 2)  # the label's and its parent's five figures


def history_figures(chunk, ids: np.ndarray, n_values: int, keep: np.ndarray) -> np.ndarray:
    """[n, n_values, 5]: log1p decayed counts at HALF_LIVES, decayed recency, days since the last event
    (NaN: none) of each value id (`ids` aligned with the chunk's history events, `keep` those counted)."""
    out = value_history(chunk, ids, n_values, HALF_LIVES, keep)
    out[:, :, :-1] = np.log1p(out[:, :, :-1])
    last = np.full(chunk.n * n_values, np.inf)
    flat = chunk.local[keep].astype(np.int64) * n_values + ids[keep]
    np.minimum.at(last, flat, chunk.age_days[keep].astype(np.float64))
    last = np.where(np.isinf(last), np.nan, last).reshape(chunk.n, n_values, 1).astype(np.float32)
    return np.concatenate([out, last], axis=2)


def label_figures(chunk, task: TaskSpec, labels: np.ndarray, parent: tuple | None) -> np.ndarray:
    """[n, len(labels), PER_LABEL] (float16): the figures of each of the label positions `labels` and of
    its parent (`parent`: (column, parent value id of each label position, the column's ids + 1); NaN
    without one)."""
    target = task.target
    column_of = np.full(len(target.labels), -1, np.int64)  # label position -> its column among `labels`
    column_of[labels] = np.arange(len(labels))
    pos = label_positions(target.labels, chunk.shard.columns[target.column][chunk.rows])
    col = np.where(pos >= 0, column_of[np.maximum(pos, 0)], -1)
    own = history_figures(chunk, np.maximum(col, 0), len(labels), col >= 0)
    if parent is None:
        up = np.full_like(own, np.nan)
    else:
        column, of_label, n_values = parent
        ids = chunk.shard.columns[column][chunk.rows].astype(np.int64)
        up = history_figures(chunk, ids, n_values, ids >= 1)[:, of_label[labels]]
    return np.concatenate([own, up], axis=2).astype(np.float16)


def parent_of(cache: Cache, task: TaskSpec, column: str, before: int) -> np.ndarray:
    """[labels]: the value id of `column` that each label's events carry most often at or before `before`."""
    target = task.target
    n_labels, vocab = len(target.labels), cache.columns[column]["vocab_size"] + 1
    pairs = np.zeros((n_labels, vocab), np.int64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        past = sh.ts <= before
        pos = label_positions(target.labels, sh.columns[target.column][past])
        ok = pos >= 0
        np.add.at(pairs, (pos[ok], sh.columns[column][past][ok].astype(np.int64)), 1)
    return pairs.argmax(1)


def dataset(cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoffs, labels: np.ndarray, parent) -> tuple:
    """(hand features, label figures [rows, len(labels), PER_LABEL], 0/1 targets of `labels`)."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    t = task_of(task)
    xs, fs, ys = [], [], []
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, SCORING_CHUNK_ENTITIES):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n == 0:
                continue
            keep, y = t.labels(chunk, task.target, cache)
            xs.append(hand_features(chunk, spec, task, entity_table, vocab_sizes, labels)[keep])
            fs.append(label_figures(chunk, task, labels, parent)[keep])
            ys.append(y.dense(0, labels))
    return np.concatenate(xs), np.concatenate(fs), np.concatenate(ys)


def practitioner_scores(cache: Cache, spec: FeatureSpec, task: TaskSpec, train_cutoffs, val_cutoff: int,
                        test_cutoff: int, *, parent_column: str | None = None, seed: int = 0,
                        train_cache: Cache | None = None, max_labels: int = MULTILABEL_MAX_LABELS,
                        label_rows: int = MULTILABEL_ROWS) -> LabelScores:
    """LightGBM per label over hand features + the label's and its parent's figures: the test
    entities' scores (evaluate's order) of the `max_labels` most frequent labels (all if fewer).
    `train_cache`: the entities whose labels train it (default `cache`)."""
    import lightgbm as lgb

    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")
    train = cache if train_cache is None else train_cache
    labels = most_frequent_labels(train, task, train_cutoffs, max_labels)
    labels = np.arange(task.outputs) if labels is None else labels
    parent = None if parent_column is None else (parent_column, parent_of(cache, task, parent_column, test_cutoff),
                                                  cache.columns[parent_column]["vocab_size"] + 1)
    xt, ft, yt = dataset(train, spec, task, list(train_cutoffs), labels, parent)
    rows = np.sort(np.random.default_rng(seed).permutation(len(xt))[:label_rows])
    xt, ft, yt = xt[rows], ft[rows], yt[rows]
    xv, fv, yv = dataset(train, spec, task, [val_cutoff], labels, parent)
    xs, fs, _ = dataset(cache, spec, task, [test_cutoff], labels, parent)
    params = dict(n_estimators=100, learning_rate=0.1, num_leaves=15, min_child_samples=50, subsample=0.8,
                  subsample_freq=1, colsample_bytree=0.8, max_bin=63, random_state=seed, verbose=-1, n_jobs=0)
    out = np.zeros((len(xs), len(labels)), np.float32)
    for j in range(len(labels)):
        if yt[:, j].min() == yt[:, j].max():
            out[:, j] = yt[0, j]
            continue
        model = lgb.LGBMClassifier(**params)
        model.fit(np.c_[xt, ft[:, j]], np.ascontiguousarray(yt[:, j]),
                  eval_set=[(np.c_[xv, fv[:, j]], np.ascontiguousarray(yv[:, j]))],
                  callbacks=[lgb.early_stopping(15, verbose=False)])
        out[:, j] = model.predict_proba(np.c_[xs, fs[:, j]])[:, 1]
    return LabelScores(labels, out)
