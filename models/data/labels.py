"""Label sets and the per-label inputs of label tasks: which values are labels, each entity's own
history of each label, and what sells now."""

import numpy as np
import torch

from habitus.models.cache import Cache
from habitus.models.data.features import DAY, RECENCY_DAYS, Chunk, FeatureSpec, featurize
from habitus.models.data.items import SparseRows, batch_history, group_history
from habitus.models.data.targets import TargetSpec, label_positions

POPULARITY_DAYS = (7, 30)  # item popularity at a cut-off: events in the last 7 and 30 days


def item_popularity(cache: Cache, target: TargetSpec, cutoff: int) -> np.ndarray:
    """[labels, len(POPULARITY_DAYS)] log(1 + how often each label was touched by anyone in the last
    7 / 30 days before the cut-off): what sells now, read from history only."""
    vocab = cache.columns[target.column]["vocab_size"]
    counts = np.zeros((len(POPULARITY_DAYS), max(vocab, max(target.labels, default=0)) + 1), np.float64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        for j, days in enumerate(POPULARITY_DAYS):
            recent = (sh.ts <= cutoff) & (sh.ts > cutoff - days * DAY)
            counts[j] += np.bincount(sh.columns[target.column][recent], minlength=counts.shape[1])[:counts.shape[1]]
    return np.log1p(counts[:, np.asarray(target.labels, np.int64)].T).astype(np.float32)


def label_history(chunk: Chunk, target: TargetSpec, vocab_size: int, half_lives) -> SparseRows:
    """The history of each label for each entity as sparse rows [n, labels] of channels: per (entity,
    label) it touched, the decayed counts per half-life (log-scaled) and the decayed recency, as
    features.value_history computes them; labels it never touched are zero. Stored entries grow with
    the events, never with n x labels (16,000 products, a whole catalog): `.dense(channel)` gives one
    channel as [n, labels], and a mini-batch's rows feed the head as (row, label, values)."""
    pos = label_positions(target.labels, chunk.shard.columns[target.column][chunk.rows])
    keep = pos >= 0
    return group_history(chunk.local[keep], pos[keep], chunk.age_days[keep], chunk.n, len(target.labels),
                         half_lives, RECENCY_DAYS)


def task_inputs(chunk: Chunk, spec: FeatureSpec, task, entity_table, vocab_sizes: dict[str, int]):
    """The network's inputs of a chunk: its features and, where the scenario's head reads them (`task`:
    a habitus.models.tasks.spec.TaskSpec), its label histories."""
    x = featurize(chunk, spec, entity_table)
    h = label_history(chunk, task.target, vocab_sizes[task.target.column], spec.half_lives) \
        if task.uses_label_history else None
    return x, h


def history_rows(h: np.ndarray | SparseRows | None, b: np.ndarray, dev):
    """Rows `b` of a label history as the head takes it: (row, label, values) of sparse rows (what
    label_history gives), a tensor of a dense [n, labels, channels] array, or None."""
    if h is None:
        return None
    if isinstance(h, SparseRows):
        return batch_history(h[b], dev)
    return torch.from_numpy(h[b]).to(dev)


def top_values(cache: Cache, column: str, before: int, n: int) -> tuple[int, ...]:
    """The n most frequent value ids of `column` among events at or before `before` (no peeking)."""
    vocab = cache.columns[column]["vocab_size"]
    counts = np.zeros(vocab + 1, np.int64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        counts += np.bincount(sh.columns[column][sh.ts <= before], minlength=vocab + 1)
    counts[0] = 0
    order = np.argsort(-counts, kind="mergesort")
    return tuple(int(i) for i in order[:n] if counts[i] > 0)


def recent_popularity(cache: Cache, target: TargetSpec, cutoff: int, days: int = 30) -> np.ndarray:
    """How often each label was touched by anyone in the `days` before the cut-off."""
    vocab = max(cache.columns[target.column]["vocab_size"], max(target.labels, default=0))  # (absent labels: 0)
    counts = np.zeros(vocab + 1, np.float64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        recent = (sh.ts <= cutoff) & (sh.ts > cutoff - days * DAY)
        counts += np.bincount(sh.columns[target.column][recent], minlength=vocab + 1)
    return counts[np.asarray(target.labels, np.int64)].astype(np.float32)
