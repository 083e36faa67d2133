"""habitus.models.serve.predict.embed: what the `embeddings` asset writes for every entity, the trunk's
leading principal components (the whole trunk for a checkpoint saved without them) followed by the
entity's recency / frequency / monetary / visit scalars."""

import numpy as np
import torch

from habitus.models.data.features import FeatureSpec, chunk_at, featurize, scalar_features, visit_features
from habitus.models.nn.network import NetConfig, Trunk
from habitus.models.nn.profile import Profile
from habitus.models.serve.predict import embed, embedding_width
from habitus.models.data.chunks import chunk_plan


def _rows(batches) -> tuple[np.ndarray, np.ndarray]:
    batches = list(batches)
    ids = np.concatenate([b.column("entity_index").to_numpy() for b in batches])
    vectors = np.concatenate([b.column("embedding").flatten().to_numpy(zero_copy_only=False)
                              .reshape(b.num_rows, -1) for b in batches]).astype(np.float64)
    return ids, vectors


def test_embeddings_end_with_the_standardized_rfm_scalars(sources, frame):
    cache = sources.random_purchases(3000, 150, 90)
    spec = FeatureSpec.from_cache(cache, buckets=16)
    torch.manual_seed(0)
    trunk = Trunk(NetConfig(spec.width, 32, 1, 0.0)).eval()
    cutoff = sources.at(60)
    chunk = chunk_at(cache.shard(0), *chunk_plan(cache, 10_000)[0][1:], cutoff)
    x = featurize(chunk, spec, cache.entity_table())
    trunk.fit_input_scale(torch.from_numpy(x), 1.0)

    ids, vectors = _rows(embed(trunk, cache, spec, cutoff, dtype=np.float32))
    assert np.array_equal(ids, chunk.entities)
    assert vectors.shape == (chunk.n, embedding_width(trunk, spec)) == (chunk.n, 32 + spec.scalar_width)
    with torch.no_grad():
        np.testing.assert_allclose(vectors[:, :32], trunk(torch.from_numpy(x)).numpy(), atol=1e-5)
    # the trailing columns are the network's leading inputs, standardized as the trunk reads them
    rfm = np.concatenate([scalar_features(chunk, spec), visit_features(chunk, spec)], axis=1)
    mean, std = trunk.in_mean[:spec.scalar_width].numpy(), trunk.in_std[:spec.scalar_width].numpy()
    np.testing.assert_allclose(vectors[:, 32:] * std + mean, rfm, atol=1e-4)
    # the first of them: log(1 + events at or before the cut-off), against the raw events
    events = frame(cache)
    counts = np.bincount(events["entity"][events["ts"] <= cutoff], minlength=cache.n_entities)
    np.testing.assert_allclose(vectors[:, 32] * std[0] + mean[0], np.log1p(counts[ids]), atol=1e-4)
    assert np.abs(vectors[:, 32:].mean(0)).max() < 1e-3  # centred on the rows the scaling was fitted on

    # a profile fitted on these rows: its components of the trunk's output, then the same scalars
    # (float16 by default); a small population has no scalars
    with torch.no_grad():
        h = trunk(torch.from_numpy(x)).numpy()
    for entities, scalars in ((20_000, True), (1_000, False)):
        profile = Profile.fit(h, entities, spec.scalar_width)
        ids16, compact = _rows(embed(trunk, cache, spec, cutoff, profile=profile))
        k = len(profile.components)
        assert profile.scalars == scalars and np.array_equal(ids16, ids)
        assert compact.shape == (chunk.n, k + spec.scalar_width * scalars) == (chunk.n, embedding_width(trunk, spec, profile))
        np.testing.assert_allclose(compact[:, :k], (h - profile.mean) @ profile.components.T, atol=2e-2)
        np.testing.assert_allclose(compact[:, :k].std(0), 1, atol=2e-2)  # fitted on these very rows
        if scalars:
            np.testing.assert_allclose(compact[:, k:], vectors[:, 32:], atol=5e-3)


def test_the_same_day_embeds_to_the_same_bytes_and_the_documented_width(sources):
    """Two exports of one cut-off are identical (files of one fingerprint compare), chunked
    differently they agree to float16 rounding, and the asset's `columns` metadata names exactly the
    positions written."""
    from habitus.assets.embeddings import embedding_columns

    cache = sources.random_purchases(3000, 150, 90)
    spec = FeatureSpec.from_cache(cache, buckets=16)
    torch.manual_seed(0)
    trunk = Trunk(NetConfig(spec.width, 32, 1, 0.0)).eval()
    cutoff = sources.at(60)
    first, again = list(embed(trunk, cache, spec, cutoff)), list(embed(trunk, cache, spec, cutoff))
    assert [b.equals(c) for b, c in zip(first, again)] == [True] * len(first) and len(first) == len(again)
    ids, vectors = _rows(first)
    small_ids, small = _rows(embed(trunk, cache, spec, cutoff, chunk_entities=64))
    assert np.array_equal(np.sort(small_ids), np.sort(ids))
    np.testing.assert_allclose(small[np.argsort(small_ids)], vectors[np.argsort(ids)], atol=2e-3)
    named = []
    for key in embedding_columns(spec, trunk.cfg.hidden):
        lo, _, hi = key.partition("-")
        named += list(range(int(lo), int(hi or lo) + 1))
    assert named == list(range(vectors.shape[1]))
