"""A cut-off explained chunk by chunk, and the global figures a run adds up."""

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from habitus.models.data.chunks import CHUNK_ENTITIES, chunk_plan
from habitus.models.serve.defaults import DEFAULT_SELECT, DEFAULT_SHARE, DEFAULT_TOP, SELECT
from habitus.models.data.features import FeatureSpec, chunk_at
from habitus.models.data.labels import task_inputs
from habitus.models.explain.inputs import Groups, vocab_reader
from habitus.models.explain.integrated import ABS_TOLERANCE, DEFAULT_STEPS, MAX_STEPS, TOLERANCE, Explained, Explainer
from habitus.models.explain.reasons import column_totals, rendered
from habitus.models.explain.served import ServedExplainer
from habitus.models.nn.network import Model
from habitus.models.tasks import task as task_of


@dataclass
class Summary:
    """What a run of `explain_cutoff` adds up: mean |attribution| by (source, column) and the
    completeness gaps, for the materialization's table and chart."""

    keys: list
    abs_sum: np.ndarray
    pairs: int = 0
    entities: int = 0  # entities explained
    eligible: int = 0  # entities scored, of which `select` chose those explained
    gap_abs_sum: float = 0.0
    gap_max: float = 0.0
    moved_abs_sum: float = 0.0
    steps_sum: int = 0  # integration steps over the pairs (Explained.steps)
    over_tolerance: int = 0  # pairs whose gap is still over the tolerance at the largest steps

    @classmethod
    def of(cls, groups: Groups) -> "Summary":
        keys = list(dict.fromkeys(groups.columns()))
        return cls(keys, np.zeros(len(keys)))

    def add(self, groups: Groups, ex: Explained, label_column: str | None, entities: int, eligible: int = 0) -> None:
        keys, per = column_totals(groups, ex, label_column)
        for k in keys:  # a served head's groups add the trees' own (models/explain/served.py)
            if k not in self.keys:
                self.keys.append(k)
                self.abs_sum = np.r_[self.abs_sum, 0.0]
        np.add.at(self.abs_sum, [self.keys.index(k) for k in keys], np.abs(per).sum(0))
        self.pairs += len(ex.rows)
        self.entities += entities
        self.eligible += max(eligible, entities)
        gap = np.abs(ex.gap)
        self.gap_abs_sum += float(gap.sum())
        self.gap_max = max(self.gap_max, float(gap.max(initial=0.0)))
        moved = np.abs(ex.score - ex.baseline)
        self.moved_abs_sum += float(moved.sum())
        self.steps_sum += int(ex.steps.sum()) if ex.steps is not None else 0
        self.over_tolerance += int((gap > TOLERANCE * moved + ABS_TOLERANCE * (1 + np.abs(ex.baseline))).sum())

    def importance(self) -> list[tuple[str, str, float]]:
        """(source, column, mean |attribution|), largest first."""
        mean = self.abs_sum / max(self.pairs, 1)
        return sorted(((s, c, float(v)) for (s, c), v in zip(self.keys, mean)), key=lambda t: -t[2])

    @property
    def steps_mean(self) -> float:
        return self.steps_sum / max(self.pairs, 1)

    @property
    def gap_mean(self) -> float:
        return self.gap_abs_sum / max(self.pairs, 1)

    @property
    def relative_gap(self) -> float:
        """Mean |gap| over mean |score - baseline score|."""
        return self.gap_abs_sum / max(self.moved_abs_sum, 1e-12)




def default_per_entity(task) -> int:
    """Scores explained per entity where the config does not say (Task.explained_labels): the predicted
    class of a multiclass scenario (its one prediction), the 3 best labels or items of the other label heads."""
    return task_of(task).explained_labels


def chosen(score: np.ndarray, select: str = DEFAULT_SELECT, share: float = DEFAULT_SHARE,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """Positions (sorted) of the entities explained among those scored: `top` the ceil(share * n)
    highest scores, `sample` as many drawn at random (rng), `all` every one."""
    if select not in SELECT:
        raise ValueError(f"select must be one of {SELECT}, got {select!r}")
    n = len(score)
    if select == "all" or share >= 1 or n == 0:
        return np.arange(n)
    k = min(n, max(1, int(np.ceil(share * n - 1e-9))))
    if select == "top":
        return np.sort(np.argsort(-np.asarray(score, np.float64), kind="stable")[:k])
    return np.sort((rng or np.random.default_rng(0)).choice(n, k, replace=False))


def explain_cutoff(model: Model, cache, spec: FeatureSpec, task, cutoff: int, groups: Groups, *, top: int = DEFAULT_TOP,
                   labels: list | None = None, per_entity: int | None = None, label_names: list | None = None,
                   steps: int = DEFAULT_STEPS, max_steps: int = MAX_STEPS, device: str = "cpu", chunk_entities: int = CHUNK_ENTITIES,
                   select: str = DEFAULT_SELECT, share: float = DEFAULT_SHARE, summary: Summary | None = None,
                   head=None):
    """Record batches of the `top` reasons of the entities `select` chooses at `cutoff`, one row per
    reason: entity_index, label (None for one score), score, baseline_score, rank, kind, source,
    column, value, contribution, count, days_since_last, entity_value, reason, others, gap (the
    README's "Explanations" section). Every eligible entity of a block of `chunk_entities` is scored
    (its best explained score for label heads), then `chosen` picks the `share` of the block to explain
    (`top`: the highest scores; `sample`: at random, the same draw for the same cut-off; `all`).
    Label heads explain the positions `labels` for every chosen entity, else each one's `per_entity`
    best labels (or recommended items; default_per_entity). Pairs whose gap is over the tolerance at
    `steps` are integrated again at up to `max_steps` (Explainer.explain). `summary` gathers the global
    figures. `head`: the checkpoint's head chosen on validation (habitus.models.heads.stacked_head.load_head): where it
    blends trees in, the score explained, chosen by and written is the served one (ServedExplainer);
    None or the network alone: the network's."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    vocab = vocab_reader(cache)
    t = task_of(task)
    extra = t.chunk_extra(cache, task.target, cutoff)  # (recommendation: the item popularity)
    if task.uses_label_history and label_names is None:  # items: the column's own vocabulary
        values = vocab(task.target.column)
        label_names = [values[i - 1] for i in task.target.labels]
    names = np.asarray([str(v) for v in label_names], object) if label_names is not None else None
    served = head is not None and head.weight > 0
    if served:
        explainer = ServedExplainer(model, head, spec, task, groups, steps=steps, max_steps=max_steps, device=device)
        groups = explainer.groups
    else:
        explainer = Explainer(model, spec, task, groups, steps=steps, max_steps=max_steps, device=device,
                              item_features=extra[0] if extra else None)
    per_entity = per_entity or default_per_entity(task)
    rng = np.random.default_rng(int(cutoff))  # `sample`: the same entities for the same day
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = np.flatnonzero(t.eligible(chunk, task.target)) if chunk.n else np.zeros(0, np.int64)
        if not len(keep):
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        more = (explainer.inputs(model, chunk, keep, x, entity_table, vocab_sizes),) if served else ()
        target = None
        if task.uses_label_history:
            if labels:
                lab = np.asarray(labels, np.int64)
                best = np.broadcast_to(lab, (len(keep), len(lab)))
                entity_score = (explainer.score(x, h, np.repeat(keep, len(lab)), best.ravel(), *more)
                                .reshape(best.shape).max(1) if select == "top" else np.zeros(len(keep)))
            else:
                adjust = {"adjust": head.adjust_logits(head.gbt(more[0].rows))} if served else {}
                with torch.no_grad():  # (a served blend: the top-k predictions wrote)
                    best, top_scores = t.top(model, x[keep], h[keep], per_entity, extra, device, **adjust)
                entity_score = top_scores[:, 0]
            pick = chosen(entity_score, select, share, rng)
            rows, target = np.repeat(keep[pick], best.shape[1]), np.ascontiguousarray(best[pick]).ravel()
        else:
            entity_score = explainer.score(x, h, keep, None, *more) if select == "top" else np.zeros(len(keep))
            pick = chosen(entity_score, select, share, rng)
            rows = keep[pick]
        ex = explainer.explain(x, h, rows, target, *more)
        if summary is not None:
            summary.add(groups, ex, task.target.column, len(pick), len(keep))
        out = rendered(spec, groups, ex, x, chunk, entity_table, vocab, task, names, top)
        p = out.pop("pair")
        out.pop("row")
        label = None if names is None else pa.array(names[ex.target[p]].astype(str))
        yield pa.record_batch({
            "entity_index": pa.array(chunk.entities[ex.rows[p]].astype(np.int64)),
            "label": label if label is not None else pa.nulls(len(p), pa.string()),
            "score": pa.array(ex.score[p]), "baseline_score": pa.array(ex.baseline[p]),
            **{k: pa.array(v) for k, v in out.items() if k not in ("count", "days_since_last", "entity_value")},
            "count": pa.array(out["count"], mask=out["count"] < 0),
            "days_since_last": pa.array(out["days_since_last"], mask=np.isnan(out["days_since_last"])),
            "entity_value": pa.array(out["entity_value"], mask=np.isnan(out["entity_value"])),
        })
