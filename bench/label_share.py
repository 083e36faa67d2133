"""Few labels: the scenario and LightGBM see the labels of only a share of the entities.

`bench/quality.py --label-share 0.1` draws 10% of the cache's entities (a seeded permutation of
the entity indices: the same entities on every run of the same data) and trains the fine-tuned
network, the network from scratch and LightGBM on those entities only, at the training and the
validation cut-offs alike (a team with few labels has few for validation too). The foundation model
still learns from every entity's history: that unlabeled history is what pretraining can add. All
models are scored at the test cut-off on every eligible entity, as in the full run.

The subset is a read-only view of the cache (`EntitySubset`): the same files, ids and features,
with the other entities' events left out of each shard, so every habitus function that reads a
cache (finetune, lightgbm_scores) trains on it unchanged.
"""

import contextlib
import math

import numpy as np

from habitus.models.cache import Cache, Shard


def labeled_entities(cache: Cache, share: float, seed: int = 0) -> np.ndarray:
    """[n_entities] bool: the ceil(share x entities) entity indices drawn by a seeded permutation."""
    if not 0 < share <= 1:
        raise ValueError(f"label share must be in (0, 1], got {share}")
    n = cache.n_entities
    keep = np.zeros(n, bool)
    keep[np.random.default_rng(seed).permutation(n)[:math.ceil(share * n)]] = True
    return keep


class EntitySubset(Cache):
    """The cache at `cache.path` with only the entities whose index is True in `keep`."""

    def __init__(self, cache: Cache, keep: np.ndarray):
        super().__init__(cache.path)
        self.keep = np.asarray(keep, bool)
        if len(self.keep) < self.n_entities:
            raise ValueError(f"keep has {len(self.keep)} entries for a cache of {self.n_entities} entities")
        self.manifest = {**self.manifest, "shards": [dict(m) for m in self.manifest["shards"]]}
        for i, meta in enumerate(self.manifest["shards"]):  # chunk_plan reads the entity counts here
            meta["entities"] = int(self.keep[super()._read_shard(i).entities].sum())
        self.n_entities = int(self.keep.sum())

    def _read_shard(self, i: int) -> Shard:
        full = super()._read_shard(i)
        rows = self.keep[full.entity]  # an entity's rows are contiguous and stay in order
        entity = full.entity[rows]
        cut = np.flatnonzero(np.diff(entity)) + 1
        starts = np.r_[0, cut, len(entity)].astype(np.int64)
        return Shard(entity=entity, ts=full.ts[rows], columns={c: v[rows] for c, v in full.columns.items()},
                     entities=entity[starts[:-1]] if len(entity) else entity[:0], starts=starts)


@contextlib.contextmanager
def lightgbm_trained_on(subset: Cache, test_cutoff: int):
    """Within the block, habitus.models.evaluate.baselines.lightgbm_scores builds its training and validation rows
    from `subset` and its test rows (every eligible entity at `test_cutoff`) from the cache it is
    given: the same LightGBM, fitted on the labeled entities only. lightgbm_scores takes one cache
    for all three, so its row builder is wrapped here, by cut-off, not by call order."""
    from habitus.models.evaluate import baselines

    original = baselines._dataset

    def rows(cache, spec, task, cutoffs, *args, **kwargs):
        test_only = [int(c) for c in cutoffs] == [int(test_cutoff)]
        return original(cache if test_only else subset, spec, task, cutoffs, *args, **kwargs)

    baselines._dataset = rows
    try:
        yield
    finally:
        baselines._dataset = original
