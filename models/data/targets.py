"""What happens after a cut-off: the labels of every task, from events in (cutoff, cutoff + window].

Targets are declared as data (`TargetSpec`), so the same definition drives training cut-offs,
the hold-out evaluation and the baselines. Features never read these rows.
"""

from dataclasses import asdict, dataclass

import numpy as np

from habitus.models.data.features import DAY, Chunk, FeatureSpec, bucket_count
from habitus.models.data.items import SparseRows
from habitus.models.data.target_functions import function_target


@dataclass(frozen=True)
class TargetSpec:
    kind: str  # "no_event" | "any_event" | "sum" | "count" | "items" | "function"
    window_days: int
    column: str | None = None  # any_event: the label column; sum: the numeric column; items: the item column
    labels: tuple[int, ...] = ()  # any_event / items: the vocabulary ids that are labels
    active_days: int = 90  # no_event: only entities active this long before the cut-off are eligible
    function: str | None = None  # function: "package.module:func", see habitus.models.data.target_functions
    scenario: str = ""  # the scenario's name, for error messages

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TargetSpec":
        return cls(**{**d, "labels": tuple(d.get("labels", ()))})


def future_rows(chunk: Chunk, window_days: int) -> tuple[np.ndarray, np.ndarray]:
    """(matrix row, shard row) of each event of the chunk's entities inside the window after the cut-off."""
    shard = chunk.shard
    r0, r1 = shard.starts[chunk.lo], shard.starts[chunk.hi]
    ts = shard.ts[r0:r1]
    inside = (ts > chunk.cutoff) & (ts <= chunk.cutoff + window_days * DAY)
    rows = np.flatnonzero(inside) + r0
    # map shard rows -> matrix rows of the entities that have history
    pos = np.searchsorted(shard.starts, rows, side="right") - 1  # entity position in the shard
    row_of = np.full(chunk.hi - chunk.lo, -1, np.int64)
    row_of[np.searchsorted(shard.entities[chunk.lo:chunk.hi], chunk.entities)] = np.arange(chunk.n)
    local = row_of[pos - chunk.lo]
    keep = local >= 0
    return local[keep], rows[keep]


def eligible(chunk: Chunk, spec: TargetSpec) -> np.ndarray:
    """Which matrix rows take part: churn only for entities active shortly before the cut-off."""
    if spec.kind != "no_event":
        return np.ones(chunk.n, bool)
    recent = np.bincount(chunk.local, chunk.age_days <= spec.active_days, minlength=chunk.n)
    return recent > 0


def label_positions(labels: tuple[int, ...], ids: np.ndarray) -> np.ndarray:
    """vocabulary id -> label position (-1 for ids that are not labels, including ids the cache
    gained after the labels were chosen)."""
    top = max(int(ids.max(initial=0)), max(labels, default=0))
    index = np.full(top + 1, -1, np.int64)
    index[np.asarray(labels, np.int64)] = np.arange(len(labels))
    return index[ids]


def compute_target(chunk: Chunk, spec: TargetSpec, vocab_size: int | None = None, cache=None) -> np.ndarray | SparseRows:
    """Labels of every matrix row: [n] for binary/regression, and for any_event (multilabel) and
    items the sparse rows [n, len(labels)] of the labels each row touched (`.dense()` for the 0/1
    matrix). A function target needs the cache (to decode values)."""
    local, rows = future_rows(chunk, spec.window_days)
    n = chunk.n
    if spec.kind == "function":
        if cache is None:
            raise ValueError(f"scenario {spec.scenario!r}: the target function {spec.function!r} needs the cache")
        return function_target(chunk, spec, cache, local, rows)
    if spec.kind == "no_event":
        return (np.bincount(local, minlength=n) == 0).astype(np.float32)
    if spec.kind == "count":
        return np.bincount(local, minlength=n).astype(np.float32)
    if spec.kind == "sum":
        v = np.nan_to_num(chunk.shard.columns[spec.column][rows].astype(np.float64))
        return np.bincount(local, v, minlength=n).astype(np.float32)
    if spec.kind in ("any_event", "items"):
        # the labels (a catalog can be huge: 16,000 products, a million items) each row touched in the
        # window, as sparse rows of ones: .dense() is the [n, labels] 0/1 matrix
        pos = label_positions(spec.labels, chunk.shard.columns[spec.column][rows])
        hit = pos >= 0
        key = np.unique(local[hit].astype(np.int64) * len(spec.labels) + pos[hit])
        return SparseRows.from_pairs(key // len(spec.labels), key % len(spec.labels),
                                     np.ones(len(key), np.float32), n, len(spec.labels))
    raise ValueError(f"unknown target kind {spec.kind!r}")


def foundation_target(chunk: Chunk, window_days: int, spec: FeatureSpec) -> np.ndarray:
    """The self-supervised target: [any event, log(1 + events)] then, per categorical column,
    which buckets the entity touches in the next window (multi-hot; `spec.bucket`: a long tail's
    buckets are groups of related values where the spec has a tail map)."""
    local, rows = future_rows(chunk, window_days)
    n = chunk.n
    count = np.bincount(local, minlength=n).astype(np.float32)
    parts = [(count > 0).astype(np.float32)[:, None], np.log1p(count)[:, None]]
    for c, vocab in spec.categorical.items():
        hot = np.zeros((n, bucket_count(vocab, spec.buckets)), np.float32)
        hot[local, spec.bucket(c, chunk.shard.columns[c][rows])] = 1.0
        parts.append(hot[:, 1:])  # bucket 0 is "unknown": not worth predicting
    return np.concatenate(parts, axis=1)
