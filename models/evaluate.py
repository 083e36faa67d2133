"""The temporal hold-out: a scenario model and its baselines scored on the same entities at a test
cut-off later than anything the model trained on.

Protocol (RelBench-style): test cut-off T; validation cut-off T - window (its labels end at T);
training cut-offs every `step` before that. Features from events <= cut-off, labels from
(cut-off, cut-off + window]; churn only for entities active before the cut-off.
"""

from dataclasses import dataclass

import numpy as np
import torch

from models.baselines import LabelScores
from models.cache import Cache
from models.features import DAY, FeatureSpec, chunk_at
from models.items import SparseRows, top_k_items
from models.metrics import (auroc, average_precision, blockwise_macro_auroc, macro_auroc, mae, normalized_gini,
                            ranking_metrics_at, rmse)
from models.network import Model
from models.targets import compute_target, eligible
from models.labels import item_popularity, label_history, task_inputs
from models.loop import chunk_plan, day_floor
from models.scoring import rank_items, scores
from models.specs import TaskSpec


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


def baseline_scores(task: TaskSpec, chunk, x_hist: SparseRows | np.ndarray | None, popularity: np.ndarray | None,
                    past_window: np.ndarray | None, channel: int = 1) -> dict[str, np.ndarray]:
    """Heuristics a practitioner would try first, from the same history the model sees.
    `x_hist`: the label history (label_history's sparse rows, or a dense [n, labels, channels]);
    `channel`: its habitual decayed count (FeatureSpec.habitual_channel)."""
    if task.task == "binary":
        begins = np.r_[0, np.flatnonzero(np.diff(chunk.local)) + 1]
        last_age = chunk.age_days[np.r_[begins[1:] - 1, len(chunk.local) - 1]]
        count90 = np.bincount(chunk.local, chunk.age_days <= 90, minlength=chunk.n)
        return {"recency": last_age, "frequency": -count90.astype(np.float32)}
    if task.task == "multilabel":
        past = x_hist.dense(channel) if isinstance(x_hist, SparseRows) else x_hist[:, :, channel]
        return {"past frequency": past, "popularity": np.broadcast_to(popularity, past.shape)}
    if task.task == "regression":
        return {} if past_window is None else {"previous window": past_window}
    raise ValueError(task.task)


def evaluate(model: Model, cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, *,
             constant: float | None = None, extra: dict[str, np.ndarray | LabelScores | None] | None = None,
             chunk_entities: int = 4096, device: str = "cpu") -> dict:
    """Metrics of the model and of each baseline on the entities eligible at `cutoff`.
    `extra`: scores of other baselines (e.g. LightGBM) for the same entities in the same order; for
    multilabel also LabelScores (a subset of the labels), reported on that subset next to the model's."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    target = task.target
    popularity = recent_popularity(cache, target, cutoff) if task.uses_label_history else None
    item_pop = item_popularity(cache, target, cutoff) if task.task == "recommendation" else None
    ys, preds, base = [], [], {}
    trunks, hists = [], []  # multilabel
    ranking: dict[str, list] = {}
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n == 0:
            continue
        keep = eligible(chunk, target)
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        y = compute_target(chunk, target, vocab_sizes.get(target.column), cache)[keep]
        if task.task == "multilabel":  # the trunk's output and sparse rows only: labels are scored in blocks later
            ys.append(_sparse(y))
            trunks.append(_trunk(model, x[keep], dev))
            hists.append(_sparse(h[keep]))
            continue
        if task.task == "recommendation":  # rank per chunk: [n, catalog] matrices never exist
            tops = item_rankings(model, x[keep], h[keep], popularity, item_pop, task.k, device, spec.habitual_channel)
            for name, top in tops.items():
                ranking.setdefault(name, []).append((ranking_metrics_at(top, y.rows, y.cols, task.k),
                                                     int((np.diff(y.indptr) > 0).sum())))
            continue
        p = scores(model, task.task, x[keep], None if h is None else h[keep], device=device)
        # a user function's "previous window" is not defined: only the training mean stands in for it
        past = _previous_window(chunk, target) if task.task == "regression" and target.kind != "function" else None
        b = baseline_scores(task, chunk, None if h is None else h, popularity, past, spec.habitual_channel)
        b = {k: np.asarray(v)[keep] for k, v in b.items()}
        ys.append(y)
        preds.append(p)
        for k, v in b.items():
            base.setdefault(k, []).append(v)
    if task.task == "recommendation":
        results = {name: _weighted(parts) for name, parts in ranking.items()}
        n = sum(w for _, w in ranking["model"]) if ranking else 0
        return {"model": results.pop("model", {}), "baselines": results, "entities": n}
    if task.task == "multilabel":
        return _multilabel_report(model, ys, trunks, hists, popularity, extra or {},
                                  spec.habitual_channel, dev)
    y = np.concatenate(ys) if ys else np.zeros(0)
    model_scores = np.concatenate(preds) if preds else np.zeros(0)
    baselines = {k: np.concatenate(v) for k, v in base.items()}
    if task.task == "regression" and constant is not None:
        baselines["training mean"] = np.full(len(y), constant, np.float32)
    for name, values in (extra or {}).items():
        if values is not None:
            assert len(values) == len(y), f"baseline {name}: {len(values)} scores for {len(y)} entities"
            baselines[name] = values
    return {"model": task_metrics(task.task, y, model_scores),
            "baselines": {k: task_metrics(task.task, y, v) for k, v in baselines.items()},
            "entities": int(len(y)), "positive_rate": float(np.mean(y)) if len(y) else float("nan")}


def _multilabel_report(model: Model, ys: list[SparseRows], trunks: list[torch.Tensor], hists: list[SparseRows],
                       popularity: np.ndarray, extra: dict, channel: int, dev) -> dict:
    """macro AUROC of the model and the baselines, a block of labels at a time: what exists at once is
    the trunk's output [entities, hidden], the sparse targets and histories, and [entities, block] scores."""
    labels = ys[0].n_cols if ys else 0
    y, hist = SparseRows.stack(ys, labels), SparseRows.stack(hists, labels)
    h = torch.cat(trunks) if trunks else torch.zeros((0, model.trunk.cfg.hidden), device=dev)
    history = tuple(torch.from_numpy(a).to(dev) for a in (hist.rows, hist.cols, hist.values))
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    n = len(y)

    @torch.no_grad()
    def model_scores(cols):  # the head's columns `cols`: what scores() gives for them
        logits = model.head.sampled(h, history, torch.from_numpy(cols).to(dev), empty, empty)[0]
        return torch.sigmoid(logits).float().cpu().numpy()

    scorers = {"model": model_scores, "past frequency": lambda cols: hist.dense(channel, cols),
               "popularity": lambda cols: np.broadcast_to(popularity[cols], (n, len(cols)))}
    subsets = {}
    for name, values in extra.items():
        if isinstance(values, LabelScores):  # e.g. LightGBM on the most frequent labels of a wide head
            subsets[name] = values
        elif values is not None:
            assert len(values) == n, f"baseline {name}: {len(values)} scores for {n} entities"
            scorers[name] = lambda cols, v=values: v[:, cols]
    aucs, measured = blockwise_macro_auroc(y, scorers)
    report = {"model": {"macro_auroc": aucs.pop("model")},
              "baselines": {k: {"macro_auroc": v} for k, v in aucs.items()}, "entities": n,
              "positive_rate": len(y.cols) / (n * y.n_cols) if n and y.n_cols else float("nan"),
              "labels_measured": measured}
    for name, sub in subsets.items():  # habitus on the same labels, so the comparison stays like for like
        assert len(sub.scores) == n, f"baseline {name}: {len(sub.scores)} scores for {n} entities"
        order = np.argsort(sub.labels)  # label position -> its column of sub.scores
        pair, k = blockwise_macro_auroc(y, {"model": model_scores, name: lambda cols, v=sub, o=order: v.scores[
            :, o[np.searchsorted(v.labels[o], cols)]]}, labels=sub.labels)
        report["baselines"][f"{name} (top {len(sub.labels)} labels)"] = {
            "macro_auroc": pair[name], "model_macro_auroc": pair["model"], "labels_measured": k}
    return report


@torch.no_grad()
def _trunk(model: Model, x: np.ndarray, dev, batch: int = 8192) -> torch.Tensor:
    out = [model.trunk(torch.from_numpy(x[i:i + batch]).to(dev)) for i in range(0, len(x), batch)]
    return torch.cat(out) if out else torch.zeros((0, model.trunk.cfg.hidden), device=dev)


def _sparse(a: SparseRows | np.ndarray) -> SparseRows:
    """Sparse rows of a dense [n, labels] matrix or [n, labels, channels] history (its nonzero entries)."""
    if isinstance(a, SparseRows):
        return a
    a = a if a.ndim == 3 else a[:, :, None]
    rows, cols = np.nonzero((a != 0).any(-1))
    return SparseRows.from_pairs(rows, cols, a[rows, cols], len(a), a.shape[1])


def item_rankings(model: Model, x: np.ndarray, hist: SparseRows, popularity: np.ndarray, item_pop: np.ndarray,
                  k: int, device: str, channel: int = 1) -> dict[str, np.ndarray]:
    """Top-k item positions per entity for the model and the two baselines: popularity (the same
    list for everyone) and past frequency (what the entity bought, habitually; popularity breaks ties)."""
    n, n_items = len(x), len(popularity)
    pop = torch.from_numpy(popularity.astype(np.float32))
    tie = pop * (1e-3 / max(float(popularity.max()), 1e-9))
    past = SparseRows(hist.indptr, hist.cols, hist.values[:, channel:channel + 1], hist.n_cols)  # habitual count
    return {"model": rank_items(model, x, hist, item_pop, k, device=device)[0],
            "popularity": top_k_items(n, n_items, k, lambda r0, r1, i0, i1: pop[i0:i1].expand(r1 - r0, -1))[0],
            "past frequency": top_k_items(n, n_items, k, lambda r0, r1, i0, i1: tie[i0:i1].expand(r1 - r0, -1),
                                          past)[0]}


def task_metrics(task: str, y: np.ndarray, score: np.ndarray) -> dict[str, float]:
    if task == "binary":
        return {"auroc": auroc(y, score), "average_precision": average_precision(y, score)}
    if task == "multilabel":
        return {"macro_auroc": macro_auroc(y, score)}
    if task == "regression":
        return {"mae": mae(y, score), "rmse": rmse(y, score), "normalized_gini": normalized_gini(y, score)}
    raise ValueError(task)


HEADLINE = {"binary": "auroc", "multilabel": "macro_auroc", "regression": "mae", "recommendation": "ndcg@{k}"}
LOWER_IS_BETTER = {"mae", "rmse"}


def headline(task: TaskSpec) -> str:
    return HEADLINE[task.task].format(k=task.k)


def _weighted(parts: list[tuple[dict, int]]) -> dict[str, float]:
    total = sum(w for _, w in parts)
    keys = parts[0][0].keys() if parts else []
    return {k: float(sum(m[k] * w for m, w in parts if w) / total) if total else float("nan") for k in keys}


def recent_popularity(cache: Cache, target, cutoff: int, days: int = 30) -> np.ndarray:
    """How often each label was touched by anyone in the `days` before the cut-off."""
    vocab = max(cache.columns[target.column]["vocab_size"], max(target.labels, default=0))  # (absent labels: 0)
    counts = np.zeros(vocab + 1, np.float64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        recent = (sh.ts <= cutoff) & (sh.ts > cutoff - days * DAY)
        counts += np.bincount(sh.columns[target.column][recent], minlength=vocab + 1)
    return counts[np.asarray(target.labels, np.int64)].astype(np.float32)


def _previous_window(chunk, target) -> np.ndarray:
    """The same sum or count over the window that ended at the cut-off."""
    inside = chunk.age_days < target.window_days
    if target.kind == "count":
        return np.bincount(chunk.local, inside, minlength=chunk.n).astype(np.float32)
    v = np.nan_to_num(chunk.shard.columns[target.column][chunk.rows].astype(np.float64))
    return np.bincount(chunk.local, np.where(inside, v, 0.0), minlength=chunk.n).astype(np.float32)


__all__ = ["Protocol", "protocol", "evaluate", "task_metrics", "headline", "LOWER_IS_BETTER", "label_history"]
