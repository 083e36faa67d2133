"""The temporal hold-out: a scenario model and its baselines scored on the same entities at a test
cut-off later than anything the model trained on.

Protocol (RelBench-style): test cut-off T; validation cut-off T - window (its labels end at T);
training cut-offs every `step` before that. Features from events <= cut-off, labels from
(cut-off, cut-off + window]; churn only for entities active before the cut-off.
"""

from dataclasses import dataclass

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.chunks import CHUNK_ENTITIES, chunk_plan, day_floor
from habitus.models.data.features import DAY, FeatureSpec, chunk_at
from habitus.models.data.labels import task_inputs
from habitus.models.nn.network import Model
from habitus.models.tasks import TASKS
from habitus.models.tasks import task as task_of
from habitus.models.tasks.base import LabelScores, PerEntity
from habitus.models.tasks.spec import TaskSpec


@dataclass(frozen=True)
class Protocol:
    test_cutoff: int
    val_cutoff: int
    train_cutoffs: tuple[int, ...]


def protocol(test_cutoff: int, window_days: int, n_train: int, first_ts: int, min_history_days: int = 28,
             step_days: int | None = None) -> Protocol:
    step = (step_days or window_days) * DAY
    test = day_floor(test_cutoff)
    val = test - window_days * DAY
    earliest = day_floor(first_ts) + min_history_days * DAY
    train = tuple(sorted(c for c in (val - window_days * DAY - i * step for i in range(n_train)) if c >= earliest))
    if not train:
        raise ValueError(f"no training cut-off fits before the validation cut-off {np.datetime64(val, 's')}: "
                         f"the data needs at least {min_history_days + 2 * window_days} days of history before the "
                         f"test cut-off {np.datetime64(test, 's')}")
    return Protocol(test, val, train)


@dataclass
class Holdout:
    """evaluate's report and, for a task with one score (or one row of scores) per entity, the labels
    and the model's scores (the chosen head's, with one) of the entities it scored, in its order: what
    the hold-out's charts read without scoring it again."""
    report: dict
    y: np.ndarray | None = None
    scores: np.ndarray | None = None


def holdout_chunks(cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, chunk_entities: int = CHUNK_ENTITIES):
    """The hold-out at `cutoff` a chunk at a time, in evaluate's order: (chunk, keep, x, h, y), `keep`
    the chunk's eligible rows, x and h the network's inputs of every row, y the kept rows' labels."""
    entity_table, vocab_sizes = cache.entity_table(), _vocab_sizes(cache)
    t = task_of(task)
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n == 0:
            continue
        keep, y = t.labels(chunk, task.target, cache)
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        yield chunk, keep, x, h, y


def evaluate(model: Model, cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, **options) -> dict:
    """Metrics of the model and of each baseline on the entities eligible at `cutoff`: score_holdout's
    report (`options`: score_holdout's)."""
    return score_holdout(model, cache, spec, task, cutoff, **options).report


def score_holdout(model: Model, cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, *,
                  constant: float | None = None, extra: dict[str, np.ndarray | LabelScores | None] | None = None,
                  chunk_entities: int = CHUNK_ENTITIES, device: str = "cpu", head=None) -> Holdout:
    """The model and each baseline on the entities eligible at `cutoff`: their metrics (`report`) and,
    where the task has one score per entity, the labels and the model's scores.
    `extra`: scores of other baselines (e.g. LightGBM) for the same entities in the same order; for
    multilabel also LabelScores (a subset of the labels), reported on that subset next to the model's.
    `head`: the head chosen on validation (models/heads/stacked_head.py): the "model" is then the chosen
    one (multilabel: at the labels it covers, the network's elsewhere), "network" the network alone,
    and "head" the choice with each candidate's figures here (network, trees, the validation's best
    blend, the chosen; multilabel: on the covered labels)."""
    t = task_of(task)
    holdout = t.evaluation(model, cache, spec, task, cutoff, constant=constant, extra=extra, device=device)
    if head is not None:
        entity_table, vocab_sizes = cache.entity_table(), _vocab_sizes(cache)
    parts = []  # with a head: per chunk (targets of the covered labels, the network's and the trees' scores)
    for chunk, keep, x, h, y in holdout_chunks(cache, spec, task, cutoff, chunk_entities):
        holdout.add(chunk, keep, x, h, y)
        if head is not None and keep.any():
            rows = head.rows(chunk, keep, x, spec, task, entity_table, vocab_sizes, model=model, device=device)
            parts.append((y.dense(0, head.labels) if hasattr(y, "dense") else np.asarray(y, np.float32),
                          rows.network, head.stack.gbt_scores(rows)))
    if head is None or not parts:
        if not isinstance(holdout, PerEntity):  # (rankings, blockwise multilabel: no per-entity scores kept)
            return Holdout(holdout.report())
        y, scores = (np.concatenate(v) if v else np.zeros(0) for v in (holdout.ys, holdout.preds))
        return Holdout(holdout.report(), y, scores)
    return with_head(holdout, t, head, parts)


def with_head(holdout, t, head, parts: list) -> Holdout:
    """The hold-out's report with the chosen head as the "model" (evaluate's `head`)."""
    y, network, gbt = (np.concatenate([p[i] for p in parts]) for i in range(3))
    chosen = head.choose(network, gbt)
    inner = head.stack.validation.get("blend_weight")
    candidates = {"network": network, "gbt": gbt, "chosen": chosen}
    if inner is not None:
        candidates[f"blend {inner}"] = head.choose(network, gbt, inner)
    one = head.labels is None and not t.stacking.per_label  # one score per entity (not some labels' scores)
    report = holdout.report(chosen if one else LabelScores(_covered(head.labels, y), chosen))
    report["head"] = {"chosen": head.chosen, "weight": head.weight, "labels": None if head.labels is None
                      else len(head.labels), "candidates": {k: t.metrics(y, v) for k, v in candidates.items()},
                      "validation": {k: v for k, v in head.stack.validation.items() if k in
                                     ("network", "gbt", "blend", "blend_weight", "chosen", "choice_rows")}}
    return Holdout(report, y, chosen) if one else Holdout(report)


def _vocab_sizes(cache: Cache) -> dict[str, int]:
    return {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}


def _covered(labels, y: np.ndarray) -> np.ndarray:
    return np.arange(y.shape[1]) if labels is None else np.asarray(labels, np.int64)


LOWER_IS_BETTER = frozenset().union(*(task_of(name).lower_is_better for name in TASKS))


def headline(task: TaskSpec) -> str:
    return task_of(task).headline_metric(task)


__all__ = ["Protocol", "protocol", "Holdout", "evaluate", "score_holdout", "holdout_chunks", "headline",
           "LOWER_IS_BETTER"]
