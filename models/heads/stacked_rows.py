"""The rows a stack of heads reads (models/heads/stacking.py): per eligible entity at one cut-off, the hand
features, the foundation trunk's representation, the targets and the network's scores, in
habitus.models.evaluate.holdout's order; and the hashed fold of validation entities that makes the choice."""

from dataclasses import dataclass

import numpy as np
import torch

from habitus.models.cache import Cache
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
from habitus.models.data.features import FeatureSpec, chunk_at, featurize
from habitus.models.data.items import SparseRows, batch_history
from habitus.models.data.labels import label_history
from habitus.models.evaluate.baselines import hand_features
from habitus.models.tasks import task as task_of


@dataclass
class Rows:
    """What the stack reads of the eligible entities at one cut-off, in habitus.models.evaluate.holdout's order."""

    entities: np.ndarray  # [n] entity index
    hand: np.ndarray  # [n, hand features]
    embedding: np.ndarray  # [n, hidden] the foundation trunk's representation
    y: np.ndarray  # [n] targets, or [n, len(labels)] 0/1 (multilabel)
    network: np.ndarray | None = None  # [n] or [n, len(labels)]: the network's probabilities / amounts

    def __len__(self) -> int:
        return len(self.entities)

    def take(self, index) -> "Rows":
        return Rows(self.entities[index], self.hand[index], self.embedding[index], self.y[index],
                    None if self.network is None else self.network[index])


@torch.no_grad()
def collect(cache: Cache, spec: FeatureSpec, task, trunk, cutoff: int, *, labels: np.ndarray | None = None,
            model=None, chunk_entities: int = SCORING_CHUNK_ENTITIES, device: str = "cpu") -> Rows:
    """Rows of the entities `task` scores at `cutoff`: hand features, the foundation `trunk`'s
    representation, targets and (with the fine-tuned `model`) the network's scores; multilabel:
    of the label positions `labels` (sorted; default all)."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    parts = []
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
        if chunk.n == 0:
            continue
        keep, y = task_of(task).labels(chunk, task.target, cache)  # (as habitus.models.evaluate.holdout reads them)
        if not keep.any():
            continue
        y = y.dense(0, labels) if isinstance(y, SparseRows) else np.asarray(y, np.float32)
        parts.append(chunk_rows(chunk, keep, spec, task, trunk, entity_table, vocab_sizes, labels=labels,
                                model=model, y=y, device=device))
    if not parts:
        width = len(labels) if labels is not None else task.outputs
        empty_y = np.zeros((0, width) if _per_label(task) else 0, np.float32)
        return Rows(np.zeros(0, np.int64), np.zeros((0, 0), np.float32), np.zeros((0, trunk.cfg.hidden), np.float32),
                    empty_y, empty_y.copy() if model is not None else None)
    return Rows(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("entities", "hand", "embedding", "y")),
                network=np.concatenate([p.network for p in parts]) if model is not None else None)


@torch.no_grad()
def chunk_rows(chunk, keep: np.ndarray, spec: FeatureSpec, task, trunk, entity_table, vocab_sizes: dict, *,
               labels: np.ndarray | None = None, model=None, y: np.ndarray | None = None, x: np.ndarray | None = None,
               device: str = "cpu") -> Rows:
    """The stack's rows of one chunk's `keep` rows (what scoring calls chunk by chunk, then
    Stack.predict): hand features, the foundation `trunk`'s representation and, with `model`, the
    network's scores. `x`: the chunk's network inputs (featurize) where the caller has them already."""
    dev = torch.device(device)
    x = featurize(chunk, spec, entity_table)[keep] if x is None else x[keep]
    network = None
    if model is not None:
        h = (label_history(chunk, task.target, vocab_sizes[task.target.column], spec.half_lives)[keep]
             if task.uses_label_history else None)
        network = network_scores(model, task, x, h, labels, dev)
    return Rows(chunk.entities[keep].astype(np.int64),
                hand_features(chunk, spec, task, entity_table, vocab_sizes, labels)[keep],
                _forward(trunk.to(dev).eval(), x, dev), np.zeros(0, np.float32) if y is None else y, network)


def _forward(trunk, x: np.ndarray, dev, batch: int = 8192) -> np.ndarray:
    out = [trunk(torch.from_numpy(x[i:i + batch]).to(dev)).float().cpu().numpy() for i in range(0, len(x), batch)]
    return np.concatenate(out) if out else np.zeros((0, trunk.cfg.hidden), np.float32)


@torch.no_grad()
def network_scores(model, task, x: np.ndarray, h: SparseRows | None, labels: np.ndarray | None, dev,
                   batch: int = 4096) -> np.ndarray:
    """The fine-tuned network's probabilities / amounts; multilabel: of the columns `labels` only (a
    16,000-label head is never scored over all its labels here)."""
    model = model.to(dev).eval()
    if not _per_label(task):
        return task_of(task).scores(model, x, h, device=str(dev))
    cols = torch.from_numpy(np.arange(task.outputs) if labels is None else np.asarray(labels, np.int64)).to(dev)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    out = []
    for i in range(0, len(x), batch):
        rows = np.arange(i, min(i + batch, len(x)))
        hist = batch_history(h[rows], dev) if h is not None else None
        logits = model.head.sampled(model.trunk(torch.from_numpy(x[rows]).to(dev)), hist, cols, empty, empty)[0]
        out.append(torch.sigmoid(logits).float().cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, len(cols)), np.float32)


def _per_label(task) -> bool:
    """Whether the stack fits trees per label (Stacking.per_label), its rows then [n, labels]."""
    rule = task_of(task).stacking
    return rule is not None and rule.per_label


def choice_fold(entities: np.ndarray, share: float) -> np.ndarray:
    """[n] bool: the entities whose hashed index falls in the choice fold (the same entity always does)."""
    h = (np.asarray(entities, np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(31)
    return (h % np.uint64(10_000)).astype(np.int64) < int(round(share * 10_000))
