"""The next window's sketch: a pretext target that is not the scenarios' labels.

The foundation model forecasts which buckets of every categorical column an entity touches next
(models/data/targets.foundation_target); a frequent value has a bucket of its own, so that forecast
repeats the top labels of propensity. The sketch asks where the next window's events fall in
co-occurrence space instead: each column's values (the PMI + SVD embeddings of models/data/affinity.py,
fitted at the foundation's last cut-off) are cut by `partitions` independent sets of `bits` random
hyperplanes, each at its event-weighted median (EMDE-style: balanced codes, related values share
codes), and the target is which of the 2 ** bits codes of each partition the next window touches.
To forecast it the trunk has to learn how related the things an entity buys are, at every level the
events carry (products, subclasses, brands, categories, stores).

The codes are used in pretraining only (their outputs are the foundation head's last columns, read
by nothing downstream); values without an embedding, or first seen later, touch no code.
"""

from dataclasses import dataclass

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.affinity import AffinityConfig, baskets, cooccurrence_vectors
from habitus.models.data.related import FIT_EVENTS


@dataclass
class Sketch:
    codes: dict[str, np.ndarray]  # column -> [vocab + 1, partitions] code of each value id (-1: none)
    size: int  # codes per partition (2 ** bits)
    weight: float  # of the sketch's loss, per column, beside one column's bucket forecast

    @property
    def width(self) -> int:
        return sum(c.shape[1] for c in self.codes.values()) * self.size

    def target(self, columns: dict[str, np.ndarray], local: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
        """[n, width] 0/1: which codes of each column's partitions the events at shard `rows` (of
        matrix rows `local`) touch."""
        parts = []
        for c, codes in self.codes.items():
            ids = np.asarray(columns[c][rows], np.int64)
            code = np.where((ids < len(codes))[:, None], codes[np.minimum(ids, len(codes) - 1)], -1)
            hot = np.zeros((n, codes.shape[1], self.size), np.float32)
            for p in range(codes.shape[1]):
                has = code[:, p] >= 0
                hot[local[has], p, code[has, p]] = 1.0
            parts.append(hot.reshape(n, codes.shape[1] * self.size))
        return np.concatenate(parts, axis=1) if parts else np.zeros((n, 0), np.float32)


def fit_sketch(cache: Cache, cutoff: int, weight: float, partitions: int = 4, bits: int = 4,
               seed: int = 0) -> Sketch | None:
    """The codes of every categorical column with co-occurrence embeddings, from events at or
    before `cutoff` (at most FIT_EVENTS of them, whole shards); None where no column has any."""
    cats = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    if not cats:
        return None
    basket, values = baskets(cache, cutoff, list(cats), FIT_EVENTS)
    rng = np.random.default_rng(seed)
    codes = {}
    for c, vocab in cats.items():
        vec = cooccurrence_vectors(basket, values[c], vocab, AffinityConfig(seed=seed))
        if vec is None:
            continue
        has = np.linalg.norm(vec, axis=1) > 0
        weight_of = np.bincount(values[c], minlength=vocab + 1)[has].astype(np.float64)
        code = np.full((vocab + 1, partitions), -1, np.int16)
        for p in range(partitions):
            proj = vec[has] @ rng.standard_normal((vec.shape[1], bits))
            above = proj > np.stack([_weighted_median(proj[:, b], weight_of) for b in range(bits)])
            code[has, p] = (above * (1 << np.arange(bits))).sum(axis=1)
        codes[c] = code
    return Sketch(codes, 1 << bits, weight) if codes else None


def _weighted_median(x: np.ndarray, w: np.ndarray) -> float:
    order = np.argsort(x)
    cum = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cum, cum[-1] / 2)])
