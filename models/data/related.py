"""Rare values share buckets by what they are bought with, not by their id.

A categorical column with more values than buckets keeps a bucket for each frequent value and puts
the long tail into the last quarter of the buckets (features.bucketize). By id modulo, a tail bucket
is a random mix of products (on Ta-Feng 23.6k of 23.8k products share 64 buckets), so its counts
say little more than "bought something rare" and forecasting it teaches nothing. Here the tail
values are clustered by their co-occurrence embeddings (PMI + SVD over baskets, models/data/affinity.py;
k-means weighted by each value's events): a tail bucket becomes a group of related products, what
the foundation model reads (decayed counts per group) and forecasts (which groups the next window
touches), a pretext the scenarios' labels do not repeat.

Fitted on events at or before the foundation's last cut-off; values without an embedding (too few
baskets) and values first seen later keep their hashed bucket. The map travels inside the feature
spec (`FeatureSpec.tails`, features.encode_tail), so every checkpoint carries the buckets it was trained on.
"""

import warnings

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.affinity import AffinityConfig, baskets, cooccurrence_vectors
from habitus.models.data.features import bucketize, tail_start

# the co-occurrence counts read at most this many events (whole shards): on the demo at 10.4M events
# the fit took 35 s and 1.1 GB over the process before it (2026-12-06, a loaded 2-core machine)
FIT_EVENTS = 10_000_000


def related_tails(cache: Cache, cutoff: int, buckets: int, seed: int = 0,
                  cfg: AffinityConfig | None = None) -> dict[str, np.ndarray]:
    """{column: tail bucket (0 .. buckets // 4 - 1) of every value id from tail_start(buckets) up}
    for each categorical column with more values than buckets and enough co-occurring values."""
    from sklearn.cluster import KMeans
    from sklearn.exceptions import ConvergenceWarning

    cfg = cfg or AffinityConfig(seed=seed)
    wide = {c: m["vocab_size"] for c, m in cache.columns.items()
            if m["type"] == "categorical" and m["vocab_size"] + 1 > buckets}
    if not wide:
        return {}
    basket, values = baskets(cache, cutoff, list(wide), FIT_EVENTS)
    exact, groups = tail_start(buckets), buckets // 4
    out = {}
    for c, vocab in wide.items():
        vec = cooccurrence_vectors(basket, values[c], vocab, cfg)
        if vec is None:
            continue
        ids = np.arange(exact, vocab + 1)
        tail = bucketize(ids, vocab, buckets) - exact  # the hashed buckets, kept where no embedding
        has = np.linalg.norm(vec[ids], axis=1) > 0
        if has.sum() < groups:
            continue
        weight = np.bincount(values[c], minlength=vocab + 1)[ids[has]].astype(np.float64)
        with warnings.catch_warnings():  # values with identical vectors leave some groups empty: harmless
            warnings.simplefilter("ignore", ConvergenceWarning)
            km = KMeans(groups, n_init=1, random_state=seed).fit(vec[ids[has]], sample_weight=weight)
        tail[has] = km.labels_
        out[c] = tail.astype(np.uint16)
    return out
