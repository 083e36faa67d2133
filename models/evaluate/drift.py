"""What the drift checks of a day's predictions measure (the drift checks in assets/checks.py read them):

    score distribution   population stability index of the day's scores against the serving version's
                         hold-out scores, stored when it was trained (models with one score per entity)
    unknown values       the share of the day's events with a categorical value the model never saw
                         (its id is past the vocabulary the checkpoint was trained with)
    volume               the day's events and distinct entities against the mean of the trailing days

Everything is read from the cache's memory-mapped shards and the day's Parquet, a shard at a time.
"""

import numpy as np

from habitus.models.data.features import DAY

BINS = 10
_FLOOR = 1e-4  # an empty bin's share: the index stays finite


def reference_distribution(scores, bins: int = BINS) -> dict | None:
    """Quantile bin edges of hold-out scores and the share in each (None: no one-score-per-entity scores)."""
    if scores is None:
        return None
    s = np.asarray(scores, float)
    if s.ndim != 1:
        return None
    s = s[np.isfinite(s)]
    if len(s) < bins:
        return None
    edges = np.unique(np.quantile(s, np.linspace(0, 1, bins + 1)[1:-1]))
    return {"edges": edges.tolist(), "shares": _shares(s, edges).tolist(), "n": int(len(s))}


def _shares(scores: np.ndarray, edges: np.ndarray) -> np.ndarray:
    counts = np.bincount(np.searchsorted(edges, scores, side="right"), minlength=len(edges) + 1)
    return counts / max(len(scores), 1)


def psi(reference: dict, scores) -> float:
    """Population stability index of `scores` against a reference_distribution (0: the same shares;
    0.1-0.25 a moderate shift, above 0.25 a large one, by the usual reading)."""
    s = np.asarray(scores, float)
    s = s[np.isfinite(s)]
    expected = np.maximum(np.asarray(reference["shares"], float), _FLOOR)
    actual = np.maximum(_shares(s, np.asarray(reference["edges"], float)), _FLOOR)
    return float(np.sum((actual - expected) * np.log(actual / expected)))


def day_events(cache, first_day: int, days: int, vocab: dict[str, int]) -> dict:
    """Per day from `first_day` (seconds, UTC midnight) for `days` days: events, distinct entities, and
    events with a value past the model's vocabulary (`vocab`: column -> vocabulary size at training),
    counted per column and in all."""
    events = np.zeros(days, np.int64)
    entities = np.zeros(days, np.int64)
    unknown = np.zeros(days, np.int64)
    per_column = {c: np.zeros(days, np.int64) for c in vocab}
    lo, hi = first_day, first_day + days * DAY
    for i in range(cache.shard_count):
        shard = cache.shard(i)
        keep = (shard.ts >= lo) & (shard.ts < hi)
        if not keep.any():
            continue
        day = ((shard.ts[keep] - lo) // DAY).astype(np.int64)
        events += np.bincount(day, minlength=days)
        # distinct (entity, day) pairs; a shard holds all of an entity's events
        pairs = np.unique(shard.entity[keep].astype(np.int64) * days + day)
        entities += np.bincount(pairs % days, minlength=days)
        seen_nothing = np.zeros(len(day), bool)
        for c, size in vocab.items():
            new = shard.columns[c][keep] > size
            per_column[c] += np.bincount(day[new], minlength=days)
            seen_nothing |= new
        unknown += np.bincount(day[seen_nothing], minlength=days)
    return {"events": events, "entities": entities, "unknown": unknown, "unknown_by_column": per_column}


def volume_ratio(counts: np.ndarray) -> tuple[int, float, float]:
    """(the last day's count, the mean of the days before it that had any, their ratio; nan without any)."""
    today, before = int(counts[-1]), counts[:-1]
    before = before[before > 0]
    mean = float(before.mean()) if len(before) else float("nan")
    return today, mean, today / mean if len(before) else float("nan")
