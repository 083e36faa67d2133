"""The contrastive objective beside the foundation's forecast (habitus.models.train.contrastive): a
thinned view keeps the entities and a share of their events, and training with it makes the trunk
recognise an entity from half of its history."""

import numpy as np
import pytest
import torch

from habitus.models.data.features import FeatureSpec, chunk_at, featurize
from habitus.models.train.config import FoundationConfig
from habitus.models.train.contrastive import thinned
from habitus.models.train.foundation import train_foundation
from habitus.models.train.loop import chunk_plan

pytestmark = pytest.mark.usefixtures("one_thread")
DAYS = 98


def test_a_thinned_view_keeps_the_entities_and_a_share_of_their_events(sources):
    cache = sources.churning_purchases(60, DAYS, seed=1)
    s, lo, hi = chunk_plan(cache, 1000)[0]
    chunk = chunk_at(cache.shard(s), lo, hi, sources.at(DAYS))
    view = thinned(chunk, 0.5, np.random.default_rng(0))
    np.testing.assert_array_equal(view.entities, chunk.entities)
    assert set(view.rows) < set(chunk.rows)
    assert 0.4 < len(view.rows) / len(chunk.rows) < 0.6
    assert np.all(np.isin(view.rows, chunk.rows))
    at = np.searchsorted(chunk.rows, view.rows)  # each kept event keeps its entity row and its age
    np.testing.assert_array_equal(view.local, chunk.local[at])
    np.testing.assert_array_equal(view.age_days, chunk.age_days[at])


def _recognised(cache, foundation, cutoff: int) -> float:
    """The share of entities whose thinned history's representation is nearest (cosine) to their own
    full history's, among every entity's."""
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    trunk, table = foundation.model.trunk.eval(), cache.entity_table()
    s, lo, hi = chunk_plan(cache, 10_000)[0]
    chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
    with torch.no_grad():
        full = trunk(torch.from_numpy(featurize(chunk, spec, table)))
        half = trunk(torch.from_numpy(featurize(thinned(chunk, 0.5, np.random.default_rng(1)), spec, table)))
    sim = torch.nn.functional.normalize(half, dim=1) @ torch.nn.functional.normalize(full, dim=1).T
    return float((sim.argmax(1) == torch.arange(len(sim))).float().mean())


def test_the_objective_teaches_the_trunk_to_recognise_an_entity_from_part_of_its_history(sources):
    cache = sources.churning_purchases(240, DAYS, seed=3, shard_events=100_000)
    last = sources.at(DAYS - 14)
    base = dict(horizon_days=14, hidden=32, layers=1, epochs=3, batch_size=64, buckets=16, chunk_entities=240,
                related_buckets=False, cutoffs_per_chunk=4)
    off = train_foundation(cache, FoundationConfig(**base, contrastive_weight=0.0), last, device="cpu", log=lambda _: None)
    on = train_foundation(cache, FoundationConfig(**base, contrastive_weight=1.0), last, device="cpu", log=lambda _: None)
    assert _recognised(cache, on, last) > _recognised(cache, off, last) + 0.05  # (0.22 against 0.07)
