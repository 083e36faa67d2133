"""What a task type is: the one interface every task module (models/tasks/<name>.py) implements.

A Task is stateless; the scenario's own settings (its target, k, widths) travel in a
habitus.models.tasks.spec.TaskSpec, passed to each method as `spec`. The defaults here are those of a task with one
output per entity (binary, regression): a task overrides what it does differently.
"""

import dataclasses
from typing import Callable

import numpy as np
import pyarrow as pa
import torch

from habitus.models.data import targets
from habitus.models.data.features import FeatureSpec
from habitus.models.data.items import SparseRows
from habitus.models.data.labels import history_rows, top_values
from habitus.models.data.target_functions import function_labels, resolve
from habitus.models.data.targets import TargetSpec
from habitus.models.nn.network import Model, NetConfig
from habitus.models.tasks.metrics import list_metrics


@dataclasses.dataclass(frozen=True)
class Stacking:
    """How the head chosen on validation (models/heads/stacking.py) treats a task's scores."""

    objective: str  # LightGBM's objective for the trees ("binary": probabilities, "l1": amounts)
    logits: bool  # the blend of trees and network runs on logits (probabilities), else on amounts
    per_label: bool  # one tree model per label (on the most frequent labels), else one per entity
    criterion: Callable[[np.ndarray, np.ndarray], float]  # the choice's criterion on validation, higher is better


class TargetError(ValueError):
    """A scenario's target that does not fit the data (the asset turns it into a failure)."""


@dataclasses.dataclass
class LabelScores:
    """Scores of some labels only: `scores` [entities, len(labels)] for the label positions `labels` (sorted)."""

    labels: np.ndarray
    scores: np.ndarray


class Task:
    name = ""
    headline = ""  # the metric that decides (may name {k}); every metric of `metrics` is reported
    lower_is_better: frozenset = frozenset()  # metrics where lower is better
    uses_label_history = False  # the network reads each label's own history (habitus.models.data.labels.label_history)
    label_outputs = False  # one output per label (the target's labels), else one per entity
    writes_every_label = False  # predictions `format: all` writes every label, best first
    one_probability = False  # one probability per entity (the hold-out calibration chart)
    find_unused_parameters = False  # DDP: some parameters may sit a batch out
    # the head chosen on the validation cut-off among the network, LightGBM over [hand features +
    # the foundation trunk's PCA] and their blend (models/heads/stacking.py, models/heads/stacked_head.py);
    # None: the network alone
    stacking: Stacking | None = None
    explained_labels = 3  # label heads: the best labels explained per entity where the config does not say

    @property
    def stackable(self) -> bool:
        return self.stacking is not None

    # ------------------------------------------------------------------ the target

    def target_spec(self, name: str, target, cache, cutoff: int) -> TargetSpec:
        """The scenario's config target (pipelines/config/project.py) -> a TargetSpec; label sets are chosen
        from history at or before `cutoff`."""
        if getattr(target, "function", None):
            return function_target(name, target)
        raise NotImplementedError(self.name)

    def outputs(self, spec) -> int:
        return len(spec.target.labels) if self.label_outputs else 1

    def eligible(self, chunk, target: TargetSpec) -> np.ndarray:
        """Which rows are scored at a cut-off (from their history only)."""
        return targets.eligible(chunk, target)

    def labels(self, chunk, target: TargetSpec, cache) -> tuple[np.ndarray, object]:
        """(the rows of the chunk that have a label, their labels): training and the hold-out."""
        if target.kind == "function" and self.label_outputs:  # a user function's labels, as sparse rows
            y = label_rows(function_label_lists(chunk, target, cache), chunk.n, len(target.labels))
        else:
            y = targets.compute_target(chunk, target, _vocab(cache, target), cache)
        keep = self.eligible(chunk, target)
        self.check_labels(target, y)
        return keep, y[keep]

    def check_labels(self, target: TargetSpec, y) -> None:
        """A user function's values that cannot be this task's labels fail here, naming them."""

    def forecast_targets(self, y, positions: np.ndarray) -> np.ndarray:
        """[rows, len(positions)] 0/1: whether each kept row of `y` (labels()) has each of the output
        `positions`, what the foundation's forecast of those outputs is calibrated against
        (models/train/prior.py). One output per entity: `y` itself."""
        if isinstance(y, SparseRows):
            return y.dense(0, positions)
        y = np.asarray(y)
        return y[:, positions] if y.ndim == 2 else y[:, None]

    # ------------------------------------------------------------------ the network and its training

    def build_model(self, net: NetConfig, spec, features: FeatureSpec) -> Model:
        channels = features.channels if self.uses_label_history else 0
        return Model(net, self.outputs(spec), channels)

    def chunk_extra(self, cache, target: TargetSpec, cutoff: int) -> tuple:
        """Arrays every chunk at `cutoff` shares, after (x, h, y) (recommendation: item popularity)."""
        return ()

    def target_sums(self, spec, y: np.ndarray) -> np.ndarray:
        """The validation targets' sums (their mean: the base rate the head starts at)."""
        return y.astype(np.float64).sum(0)

    def init_head(self, model: Model, spec, features: FeatureSpec, val, y_mean: np.ndarray, n_val: int,
                  extra: tuple) -> None:
        """Start the head near the validation targets' base rate (under torch.no_grad). Its weights start
        at zero: the first steps train the head, not wreck the trunk."""
        model.head.linear.weight.zero_()

    def second_stage(self, model: Model, spec, train, val, device: str, log) -> dict | None:
        """After fine-tuning: a second stage fitted on the training chunks `train` and chosen on the
        validation chunks `val` (recommendation: re-ranking trees, models/tasks/rerank.py). Returns what
        was measured, or None where the task has none."""
        return None

    def fit_new_items(self, model: Model, spec, cache, cutoff: int, log, val=None) -> dict | None:
        """After training: what scores labels first seen after it (recommendation: the item map of
        models/tasks/coldstart.py, saved with the head, chosen on the validation chunks `val`).
        Returns what was measured, or None."""
        return None

    def with_new_items(self, model: Model, spec, cache, cutoff: int):
        """The task spec that scores `cache` at `cutoff`: with the labels the cache gained since training
        where the model can score them (recommendation: items first seen after training, added to
        the head's catalog); by default `spec` itself."""
        return spec

    def sampled_negatives(self, spec, cfg) -> int:
        """Labels drawn per batch by a sampled loss (0: the full loss)."""
        return 0

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(self.name)

    def batch_loss(self, model, spec, arrays, b: np.ndarray, dev, rng: np.random.Generator,
                   negatives: int = 0) -> torch.Tensor:
        """The loss on rows `b` of (features, label history, targets, *extra)."""
        x, h, y = arrays[:3]
        out = model(torch.from_numpy(x[b]).to(dev), history_rows(h, b, dev))
        return self.loss(out, torch.from_numpy(y[b]).to(dev))

    def val_batch(self, spec, batch: int) -> int:
        return batch

    criterion_is_loss = True  # the validation loss picks the epoch, else val_criterion

    def loss_is_criterion(self, spec) -> bool:
        """Whether the validation loss picks the epoch for this scenario (else val_criterion)."""
        return self.criterion_is_loss

    def val_criterion(self, model, spec, val, dev) -> float:
        """What picks the epoch where the loss does not (lower is better)."""
        raise NotImplementedError(self.name)

    # ------------------------------------------------------------------ scores

    def transform(self, out: torch.Tensor) -> torch.Tensor:
        """Network outputs -> the task's own units (probabilities, amounts)."""
        return out

    def pair_scores(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The score of output `target[i]` of row i (explanations), in the task's units."""
        if out.dim() == 2:
            out = out.gather(1, target[:, None])[:, 0]
        return self.transform(out)

    def empty_scores(self, model: Model) -> np.ndarray:
        return np.zeros((0,), np.float32)

    @torch.no_grad()
    def scores(self, model: Model, x: np.ndarray, h, *, device: str = "cpu", batch: int = 8192) -> np.ndarray:
        """Model outputs in the task's own units: probabilities or amounts (rank_items for items)."""
        dev = next(model.parameters()).device if device == "auto" else torch.device(device)
        out = []
        for i in range(0, len(x), batch):
            o = self.transform(model(torch.from_numpy(x[i:i + batch]).to(dev),
                                     history_rows(h, np.arange(i, min(i + batch, len(x))), dev)))
            out.append(o.float().cpu().numpy())
        if not out:
            return self.empty_scores(model)
        return np.concatenate(out)

    def label_names(self, cache, spec, names: list | None) -> np.ndarray | None:
        """The names predictions give the labels (None: one score per entity)."""
        return None

    def label_values(self, cache, spec) -> list:
        """The labels' values as the checkpoint records them (label tasks)."""
        return []

    def top(self, model: Model, x: np.ndarray, h, k: int, extra: tuple, device: str) -> tuple[np.ndarray, np.ndarray]:
        """The k best labels of every row, best first: (label positions, scores)."""
        raise NotImplementedError(self.name)

    def predictions(self, model: Model, x: np.ndarray, h, k: int, names, extra: tuple, device: str,
                    head=None) -> dict:
        """The prediction columns of these rows (after entity_index). `head`: the head chosen on validation
        (models/heads/stacked_head.py) of these rows: their scores (one per entity), or for label tasks a
        `fn(rows, logits) -> logits` that the top-k reads the logits through."""
        if names is None:
            s = self.scores(model, x, h, device=device) if head is None else head
            return {"score": pa.array(np.asarray(s, np.float32))}
        best, best_scores = (self.top(model, x, h, k, extra, device) if head is None
                             else self.top(model, x, h, k, extra, device, adjust=head))
        n, kk = best.shape
        offsets = pa.array(np.arange(0, n * kk + 1, kk, dtype=np.int32))
        return {"labels": pa.ListArray.from_arrays(offsets, pa.array(names[best.ravel()].astype(str))),
                "scores": pa.ListArray.from_arrays(offsets, pa.array(best_scores.ravel().astype(np.float32)))}

    # ------------------------------------------------------------------ the hold-out

    def headline_metric(self, spec) -> str:
        return self.headline.format(k=spec.k)

    def report_metrics(self, spec) -> list[str]:
        """The metrics a benchmark table shows."""
        return [self.headline_metric(spec)]

    def metrics(self, y: np.ndarray, score: np.ndarray) -> dict[str, float]:
        raise NotImplementedError(self.name)

    def baselines(self, spec, chunk, h, channel: int) -> dict[str, np.ndarray]:
        """Heuristics a practitioner would try first, for every row of the chunk, from its history."""
        return {}

    def fixed_baselines(self, spec, constant: float | None, n: int) -> dict[str, np.ndarray]:
        """Baselines from the training run (e.g. the training mean)."""
        return {}

    def summary(self, y: np.ndarray) -> dict:
        return {"positive_rate": float(np.mean(y)) if len(y) else float("nan")}

    # ------------------------------------------------------------------ realized top-k lists (label tasks)
    # A label task's predictions hold each entity's top-k labels, not a score of every label: its realized
    # performance (models/evaluate/realized.py) scores those lists against the labels the window realized.

    def list_k(self, spec) -> int:
        """k of the metrics of written top-k lists."""
        return spec.k

    def list_headline(self, spec) -> str:
        """The metric of written top-k lists that decides."""
        raise NotImplementedError(self.name)

    def relevant(self, y) -> tuple[np.ndarray, np.ndarray]:
        """The realized labels of the kept rows `y` (labels()) as (rows, label positions)."""
        if isinstance(y, SparseRows):
            return y.rows, y.cols
        return np.nonzero(np.asarray(y) != 0)

    def list_metrics(self, spec, top: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> dict[str, float]:
        """Metrics of top-k label positions `top` [entities, k] against the realized pairs (rows, cols)."""
        return list_metrics(top, rows, cols, self.list_k(spec))

    def list_baselines(self, spec, cache, cutoff: int) -> Callable:
        """The hold-out's history baselines as top-k lists, without the model: a function
        (label history of some rows, k, habitual channel) -> {name: label positions [rows, k]}."""
        raise NotImplementedError(self.name)

    def evaluation(self, model: Model, cache, features: FeatureSpec, spec, cutoff: int, *, constant=None,
                   extra=None, device: str = "cpu") -> "PerEntity":
        """The hold-out's accumulator: add(chunk, keep, x, h, y) per chunk, then report()."""
        return PerEntity(self, model, spec, features, constant, extra, device)

    # ------------------------------------------------------------------ LightGBM on hand features

    def lightgbm(self, lgb, params: dict, spec, dataset, seed: int):
        """LightGBM's scores of the test rows: `dataset(which, labels=None)` -> (x, y) of "train", "val" or
        "test". None where LightGBM does not apply."""
        return None


class PerEntity:
    """The hold-out of a task with one score (or one row of scores) per entity: the model's and the
    baselines' scores, gathered chunk by chunk, scored by the task's metrics at the end."""

    def __init__(self, task: Task, model, spec, features, constant, extra, device):
        self.task, self.model, self.spec, self.features = task, model, spec, features
        self.constant, self.extra, self.device = constant, extra or {}, device
        self.ys, self.preds, self.base = [], [], {}

    def add(self, chunk, keep: np.ndarray, x: np.ndarray, h, y) -> None:
        p = self.task.scores(self.model, x[keep], None if h is None else h[keep], device=self.device)
        b = self.task.baselines(self.spec, chunk, h, self.features.habitual_channel)
        self.ys.append(y)
        self.preds.append(p)
        for k, v in b.items():
            self.base.setdefault(k, []).append(np.asarray(v)[keep])

    def report(self, chosen: np.ndarray | None = None) -> dict:
        """`chosen`: the scores of the head chosen on validation (models/heads/stacked_head.py), in the rows'
        order: they are the "model"'s, and the network's own figures are reported as "network"."""
        t = self.task
        y = np.concatenate(self.ys) if self.ys else np.zeros(0)
        model_scores = np.concatenate(self.preds) if self.preds else np.zeros(0)
        network = None
        if chosen is not None:
            assert len(chosen) == len(y), f"the chosen head: {len(chosen)} scores for {len(y)} entities"
            network, model_scores = t.metrics(y, model_scores), np.asarray(chosen)
        baselines = {k: np.concatenate(v) for k, v in self.base.items()}
        baselines.update(t.fixed_baselines(self.spec, self.constant, len(y)))
        for name, values in self.extra.items():
            if values is not None:
                assert len(values) == len(y), f"baseline {name}: {len(values)} scores for {len(y)} entities"
                baselines[name] = values
        return {"model": t.metrics(y, model_scores), "baselines": {k: t.metrics(y, v) for k, v in baselines.items()},
                "entities": int(len(y)), **t.summary(y), **({} if network is None else {"network": network})}


# ---------------------------------------------------------------------- helpers of the task modules


def _vocab(cache, target: TargetSpec) -> int | None:
    meta = cache.columns.get(target.column) if target.column else None
    return meta["vocab_size"] if meta and meta["type"] == "categorical" else None


def function_target(name: str, target) -> TargetSpec:
    """A user-defined target (habitus.models.data.target_functions): imported now, so a typo fails before training."""
    try:
        resolve(target.function, name)
    except ValueError as e:
        raise TargetError(f"scenarios.{name}.target.function: {e}") from e
    return TargetSpec("function", target.within, function=target.function, scenario=name)


def function_label_target(name: str, target, cache, cutoff: int, every_value: bool = False) -> TargetSpec:
    """A user function's target of a label task: its labels are the values of `by:` (the `top:` most
    frequent at or before `cutoff`, or `every_value`), which the function returns per entity."""
    spec = function_target(name, target)
    if not getattr(target, "by", None):
        raise TargetError(f"scenarios.{name}.target.by: a label task's function target names the column of its "
                          f"labels as by: <column>")
    column = categorical_column(name, target.by, cache)
    labels = (tuple(range(1, cache.columns[column]["vocab_size"] + 1)) if every_value
              else top_values(cache, column, cutoff, target.top))
    return dataclasses.replace(spec, column=column, labels=labels)


def function_label_lists(chunk, target: TargetSpec, cache) -> list[list[int]]:
    """Each entity's label positions, as the user function gives them."""
    local, rows = targets.future_rows(chunk, target.window_days)
    return function_labels(chunk, target, cache, local, rows)


def label_rows(lists: list[list[int]], n: int, labels: int):
    """Sparse rows [n, labels] of ones at each row's label positions."""
    rows = np.repeat(np.arange(n, dtype=np.int64), [len(v) for v in lists])
    cols = np.asarray([c for v in lists for c in v], np.int64)
    key = np.unique(rows * labels + cols)
    return SparseRows.from_pairs(key // labels, key % labels, np.ones(len(key), np.float32), n, labels)


def event_column(name: str, ref: str, cache, kind: str) -> str:
    """The column of `<source>.<column>`, which must be a `kind` column of the cache."""
    column = ref.split(".", 1)[1] if "." in ref else None
    if column is None or column not in cache.columns or cache.columns[column]["type"] != kind:
        have = sorted(c for c, m in cache.columns.items() if m["type"] == kind)
        raise TargetError(f"scenarios.{name}.target: {ref!r} must name a {kind} column of the events as "
                          f"<source>.<column>; {kind} columns in the cache: {have}")
    return column


def categorical_column(name: str, column: str, cache) -> str:
    """`by:` of a label target: a categorical column of the events or their attributes."""
    if column not in cache.columns or cache.columns[column]["type"] != "categorical":
        raise TargetError(f"scenarios.{name}.target.by: {column!r} is not a categorical column of the events or their "
                          f"attributes; choose one of "
                          f"{sorted(c for c, m in cache.columns.items() if m['type'] == 'categorical')}")
    return column


class ValueLabels:
    """For tasks whose outputs are the values of a categorical column (multilabel, multiclass): one
    score per label, named by the column's values (mixed in before Task)."""

    def empty_scores(self, model: Model) -> np.ndarray:
        return np.zeros((0, model.head.linear.out_features), np.float32)

    def label_names(self, cache, spec, names: list | None) -> np.ndarray:
        return np.asarray(vocab_names(cache, spec.target) if names is None else names, dtype=object)

    def label_values(self, cache, spec) -> list:
        return vocab_names(cache, spec.target)


def vocab_names(cache, target: TargetSpec) -> list:
    """The values of the target's labels, in label order."""
    vocab = cache.vocab(target.column).column("value").to_pylist()
    return [vocab[i - 1] for i in target.labels]
