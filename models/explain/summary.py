"""A cut-off explained chunk by chunk, and the global figures a run adds up."""

from dataclasses import dataclass

import numpy as np
import torch

from models.explain.inputs import Groups, vocab_reader
from models.explain.integrated import DEFAULT_STEPS, Explained, Explainer
from models.explain.reasons import column_totals, rendered
from models.features import FeatureSpec, chunk_at
from models.network import Model
from models.tasks import task as task_of


@dataclass
class Summary:
    """What a run of `explain_cutoff` adds up: mean |attribution| by (source, column) and the
    completeness gaps, for the materialization's table and chart."""

    keys: list
    abs_sum: np.ndarray
    pairs: int = 0
    entities: int = 0
    gap_abs_sum: float = 0.0
    gap_max: float = 0.0
    moved_abs_sum: float = 0.0

    @classmethod
    def of(cls, groups: Groups) -> "Summary":
        keys = list(dict.fromkeys(groups.columns()))
        return cls(keys, np.zeros(len(keys)))

    def add(self, groups: Groups, ex: Explained, label_column: str | None, entities: int) -> None:
        keys, per = column_totals(groups, ex, label_column)
        self.abs_sum += np.abs(per).sum(0)
        self.pairs += len(ex.rows)
        self.entities += entities
        gap = np.abs(ex.gap)
        self.gap_abs_sum += float(gap.sum())
        self.gap_max = max(self.gap_max, float(gap.max(initial=0.0)))
        self.moved_abs_sum += float(np.abs(ex.score - ex.baseline).sum())

    def importance(self) -> list[tuple[str, str, float]]:
        """(source, column, mean |attribution|), largest first."""
        mean = self.abs_sum / max(self.pairs, 1)
        return sorted(((s, c, float(v)) for (s, c), v in zip(self.keys, mean)), key=lambda t: -t[2])

    @property
    def gap_mean(self) -> float:
        return self.gap_abs_sum / max(self.pairs, 1)

    @property
    def relative_gap(self) -> float:
        """Mean |gap| over mean |score - baseline score|."""
        return self.gap_abs_sum / max(self.moved_abs_sum, 1e-12)


def explain_cutoff(model: Model, cache, spec: FeatureSpec, task, cutoff: int, groups: Groups, *, top: int = 5,
                   labels: list | None = None, per_entity: int = 3, label_names: list | None = None,
                   steps: int = DEFAULT_STEPS, device: str = "cpu", chunk_entities: int = 4096,
                   summary: Summary | None = None):
    """Record batches of every eligible entity's `top` reasons at `cutoff`, one row per reason:
    entity_index, label (None for one score), score, baseline_score, rank, kind, source, column,
    value, contribution, count, days_since_last, entity_value, reason, others, gap (the README's
    "Explanations" section). Label heads explain the positions `labels` for every entity, else each
    entity's `per_entity` best labels (or recommended items). `summary` gathers the global figures."""
    import pyarrow as pa

    from models.labels import task_inputs
    from models.loop import chunk_plan

    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    vocab = vocab_reader(cache)
    t = task_of(task)
    extra = t.chunk_extra(cache, task.target, cutoff)  # (recommendation: the item popularity)
    if task.uses_label_history and label_names is None:  # items: the column's own vocabulary
        values = vocab(task.target.column)
        label_names = [values[i - 1] for i in task.target.labels]
    names = np.asarray([str(v) for v in label_names], object) if label_names is not None else None
    explainer = Explainer(model, spec, task, groups, steps=steps, device=device,
                          item_features=extra[0] if extra else None)
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = np.flatnonzero(t.eligible(chunk, task.target)) if chunk.n else np.zeros(0, np.int64)
        if not len(keep):
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        target = None
        rows = keep
        if task.uses_label_history:
            if labels:
                rows, target = np.repeat(keep, len(labels)), np.tile(np.asarray(labels, np.int64), len(keep))
            else:
                with torch.no_grad():
                    best, _ = t.top(model, x[keep], h[keep], per_entity, extra, device)
                rows, target = np.repeat(keep, best.shape[1]), best.ravel()
        ex = explainer.explain(x, h, rows, target)
        if summary is not None:
            summary.add(groups, ex, task.target.column, len(keep))
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
