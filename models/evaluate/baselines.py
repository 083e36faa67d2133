"""The practitioner's baseline: hand-made features and LightGBM, trained on the same cut-offs.

Hand features: recency / frequency (events and visits) / monetary scalars, the entity's attributes, and for each
low-cardinality categorical column (categories, brands) the decayed counts of its most frequent
values; for label tasks also each label's own count. One model per task (one per label for
multilabel, on at most MULTILABEL_MAX_LABELS labels), early-stopped on the validation cut-off,
scored on the test cut-off.

A scenario whose model has never beaten its best baseline serves that baseline instead: LightGBM's
fitted model, saved in LightGBM's own text format (`save_lightgbm`), or the rule a task computes from
history (recency, the previous window, past frequency...); `baseline_predictions` scores either as
the scenario's network would (assets/serving.py keeps it as a version of kind "baseline").
"""

import dataclasses
import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from habitus.models.cache import Cache
from habitus.models.data.features import (HALF_LIVES, FeatureSpec, chunk_at, entity_features, scalar_features, value_history,
                             visit_features)
from habitus.models.data.items import SparseRows
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
from habitus.models.data.labels import label_history, task_inputs
from habitus.models.tasks import task as task_of
from habitus.models.tasks.base import LabelScores
from habitus.models.tasks.spec import TaskSpec

TOP_VALUES = 20
MAX_VOCAB = 5_000  # columns with more values (product ids) are left to the per-label counts
MULTILABEL_ROWS = 30_000
# one model per label: a wider head (16,000 products) would take hours, so LightGBM learns its most frequent labels only
MULTILABEL_MAX_LABELS = 200
LIGHTGBM_PARAMS = dict(n_estimators=400, learning_rate=0.05, num_leaves=31, min_child_samples=50, subsample=0.8,
                       subsample_freq=1, colsample_bytree=0.8, max_bin=63, verbose=-1, n_jobs=0)


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


def _dataset(cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoffs, chunk_entities: int = SCORING_CHUNK_ENTITIES,
             labels: np.ndarray | None = None):
    """Hand features and targets; label tasks: the 0/1 matrix of `labels` (default all)."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    t = task_of(task)
    xs, ys = [], []
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, chunk_entities):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n == 0:
                continue
            keep, y = t.labels(chunk, task.target, cache)
            xs.append(hand_features(chunk, spec, task, entity_table, vocab_sizes, labels)[keep])
            if isinstance(y, SparseRows):  # label sets: the 0/1 matrix
                y = y.dense(0, labels)
            ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


@dataclass
class Datasets:
    """The hand-feature datasets of a task at the "train", "val" and "test" cut-offs: `data(which,
    labels)` -> (x, y); `max_labels`: the widest label set LightGBM learns whole; `label_rows`: the
    training rows of each label's model."""

    cache: Cache
    spec: FeatureSpec
    task: TaskSpec
    cutoffs: dict
    max_labels: int
    label_rows: int = MULTILABEL_ROWS

    def __call__(self, which: str, labels: np.ndarray | None = None):
        return _dataset(self.cache, self.spec, self.task, self.cutoffs[which], labels=labels)

    def most_frequent_labels(self) -> np.ndarray | None:
        """The `max_labels` labels with the most positives at the training cut-offs (None: every label)."""
        return most_frequent_labels(self.cache, self.task, self.cutoffs["train"], self.max_labels)


def lightgbm_scores(cache: Cache, spec: FeatureSpec, task: TaskSpec, train_cutoffs, val_cutoff: int,
                    test_cutoff: int, *, seed: int = 0,
                    max_labels: int = MULTILABEL_MAX_LABELS) -> np.ndarray | LabelScores | None:
    """LightGBM predictions for the entities `evaluate` scores at `test_cutoff` (same order), or
    None where LightGBM does not apply (recommendation over a whole catalog) or is not installed.
    A multilabel head of more than `max_labels` labels gets LabelScores of its `max_labels` labels
    with the most training positives (the hand features count those labels only)."""
    try:
        import lightgbm as lgb
    except ImportError:
        return None
    return _fit(lgb, cache, spec, task, train_cutoffs, val_cutoff, test_cutoff, seed, max_labels)


def _fit(lgb, cache: Cache, spec: FeatureSpec, task: TaskSpec, train_cutoffs, val_cutoff: int, test_cutoff: int,
         seed: int, max_labels: int = MULTILABEL_MAX_LABELS):
    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # the spelling 4.0-4.6 know
    data = Datasets(cache, spec, task, {"train": list(train_cutoffs), "val": [val_cutoff], "test": [test_cutoff]},
                    max_labels)
    return task_of(task).lightgbm(lgb, dict(LIGHTGBM_PARAMS, random_state=seed), task, data, seed)


class _Keeping:
    """The lightgbm module as a task's `lightgbm` sees it, keeping every model the task makes, in order,
    with the scores its last predict_proba gave (what places a per-label model at its label)."""

    def __init__(self, lgb):
        self._lgb, self.models, self.scored = lgb, [], {}

    def __getattr__(self, name: str):
        made = getattr(self._lgb, name)
        if not name.startswith("LGBM"):
            return made

        def keep(*args, **kwargs):
            model = made(*args, **kwargs)
            self.models.append(model)
            if hasattr(model, "predict_proba"):
                proba = model.predict_proba

                def recorded(x, *a, **kw):
                    self.scored[id(model)] = out = proba(x, *a, **kw)
                    return out
                model.predict_proba = recorded
            return model
        return keep


LIGHTGBM_FILE = "lightgbm.txt"  # the LightGBM baseline of a baseline version, in LightGBM's own text format


def save_lightgbm(cache: Cache, spec: FeatureSpec, task: TaskSpec, train_cutoffs, val_cutoff: int, test_cutoff: int,
                  folder: str | Path, *, seed: int = 0) -> dict | None:
    """Fit the LightGBM baseline exactly as lightgbm_scores does (same cut-offs, parameters, seed) and save
    its model to `folder`/lightgbm.txt (the early-stopped iterations), or a task's per-label models to
    `folder`/lightgbm-<label position>.txt. Returns what a baseline version's config records of it
    ({"sha256", "classes"}, or {"sha256", "labels": {position: file}, "constants": {position: value},
    "feature_labels"}), or None where LightGBM is not installed or does not apply."""
    try:
        import lightgbm as lgb
    except ImportError:
        return None
    keeping = _Keeping(lgb)
    out = _fit(keeping, cache, spec, task, train_cutoffs, val_cutoff, test_cutoff, seed)
    if out is None or not keeping.models:
        return None
    if len(keeping.models) == 1:
        model, path = keeping.models[0], Path(folder) / LIGHTGBM_FILE
        model.booster_.save_model(str(path))
        classes = getattr(model, "classes_", None)
        return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "classes": None if classes is None else np.asarray(classes).astype(int).tolist()}
    # a model per label, made in label order; a label without both classes in training is a constant
    covered = getattr(out, "labels", None)
    scores = np.asarray(getattr(out, "scores", out))
    positions = np.arange(scores.shape[1]) if covered is None else np.asarray(covered)
    files, constants, digest, models = {}, {}, hashlib.sha256(), iter(keeping.models)
    model = next(models, None)
    for j, position in enumerate(positions.tolist()):
        mine = keeping.scored.get(id(model)) if model is not None else None
        if mine is not None and np.array_equal(scores[:, j], np.asarray(mine)[:, 1].astype(scores.dtype)):
            files[str(position)] = f"lightgbm-{position}.txt"
            model.booster_.save_model(str(Path(folder) / files[str(position)]))
            digest.update((Path(folder) / files[str(position)]).read_bytes())
            model = next(models, None)
        else:
            constants[str(position)] = float(scores[0, j]) if len(scores) else 0.0
    if model is not None:  # a model left over: the order is not the one assumed, so nothing is served
        return None
    digest.update(repr(sorted(constants.items())).encode())
    return {"sha256": digest.hexdigest(), "labels": files, "constants": constants,
            "feature_labels": None if covered is None else positions.tolist()}


def baseline_predictions(config: dict, folder: str | Path, cache: Cache, cutoff: int, *, k: int,
                         chunk_entities: int = SCORING_CHUNK_ENTITIES) -> Iterator[pa.RecordBatch]:
    """A baseline version's predictions as of `cutoff`, in the columns models/serve/predict.py writes:
    (entity index, score), or (entity index, top-k labels, top-k scores). `config`: the version's
    config.json (its "baseline" names the rule, or "lightgbm" for the model in `folder`). LightGBM's
    scores are its probabilities or amounts; a rule scores in its own units (recency: days since the
    last event, higher is likelier; a list rule's k labels carry 1, 1/2, 1/3...)."""
    spec, task = FeatureSpec.from_dict(config["feature_spec"]), TaskSpec.from_dict(config["task"])
    t, name = task_of(task), config["baseline"]
    names = t.label_names(cache, task, config.get("label_values") or None)
    booster = saved = config.get("lightgbm")
    if saved:
        import lightgbm as lgb

        if "labels" in saved:  # a model per label
            booster = {int(p): lgb.Booster(model_file=str(Path(folder) / f)) for p, f in saved["labels"].items()}
        else:
            booster = lgb.Booster(model_file=str(Path(folder) / LIGHTGBM_FILE))
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    lists = None
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = t.eligible(chunk, task.target) if chunk.n else np.zeros(0, bool)
        if not keep.any():
            continue
        if isinstance(booster, dict):  # each label's own model (its probability), or its constant
            feature_labels = saved["feature_labels"]
            x = hand_features(chunk, spec, task, entity_table, vocab_sizes,
                              None if feature_labels is None else np.asarray(feature_labels))[keep]
            wide = np.zeros((len(x), len(names)), np.float32)
            for position, model in booster.items():
                wide[:, position] = model.predict(x)
            for position, value in saved["constants"].items():
                wide[:, int(position)] = value
            columns = _lists(names, np.argsort(-wide, axis=1, kind="stable")[:, :k], wide)
        elif booster is not None:
            scores = booster.predict(hand_features(chunk, spec, task, entity_table, vocab_sizes)[keep])
            if names is not None:  # the classes the model knew, at their label positions
                wide = np.zeros((len(scores), len(names)), np.float32)
                wide[:, config["lightgbm"]["classes"]] = scores.reshape(len(scores), -1)
                columns = _lists(names, np.argsort(-wide, axis=1, kind="stable")[:, :k], wide)
            else:
                columns = {"score": pa.array(np.asarray(scores, np.float32))}
        else:
            _, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
            hk = None if h is None else h[keep]
            if names is not None:
                lists = lists or t.list_baselines(task, cache, cutoff)
                columns = _lists(names, np.asarray(lists(hk, k, spec.habitual_channel)[name]), None)
            else:
                rules = t.baselines(task, chunk, h, spec.habitual_channel)
                values = (np.asarray(rules[name])[keep] if name in rules
                          else t.fixed_baselines(task, config.get("constant"), int(keep.sum()))[name])
                columns = {"score": pa.array(np.asarray(values, np.float32))}
        yield pa.record_batch({"entity_index": pa.array(chunk.entities[keep].astype(np.int64)), **columns})


def _lists(names, top: np.ndarray, scores: np.ndarray | None) -> dict:
    """The labels and scores columns of top-k label positions `top` [rows, k] (scores: a row's values at
    every label, else 1/rank)."""
    n, kk = top.shape
    values = (np.take_along_axis(scores, top, axis=1) if scores is not None
              else np.broadcast_to(1.0 / np.arange(1, kk + 1), (n, kk)))
    offsets = pa.array(np.arange(0, n * kk + 1, kk, dtype=np.int32))
    return {"labels": pa.ListArray.from_arrays(offsets, pa.array(np.asarray(names)[top.ravel()].astype(str))),
            "scores": pa.ListArray.from_arrays(offsets, pa.array(np.asarray(values, np.float32).ravel()))}


def most_frequent_labels(cache: Cache, task: TaskSpec, cutoffs, n: int, chunk_entities: int = SCORING_CHUNK_ENTITIES) -> np.ndarray | None:
    """The n label positions with the most positives at the training cut-offs (sorted), or None if
    the head has no more than n labels."""
    if task.outputs <= n:
        return None
    positives = np.zeros(task.outputs, np.int64)
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, chunk_entities):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n:
                positives += task_of(task).labels(chunk, task.target, cache)[1].col_counts()
    return np.sort(np.argsort(-positives, kind="stable")[:n])
