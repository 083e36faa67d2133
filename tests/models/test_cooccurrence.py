"""habitus.models.data.affinity: PMI + SVD co-occurrence embeddings recover items bought together, the
per-label affinity reads only the past, and its features line up with the labels they describe."""

import dataclasses

import numpy as np
import pytest

from habitus.models.data.affinity import (Affinity, AffinityConfig, affinity_features, attribute_columns,
                                          cooccurrence_vectors)
from habitus.models.data.features import chunk_at

GROUPS, PER_GROUP = 4, 10  # planted: 4 groups of 10 products, each basket from one group


def _planted_baskets(rng, baskets: int = 3000):
    """(basket per event, product id per event): each basket draws 2-6 products of one group (ids 1..40)."""
    basket, ids = [], []
    for b in range(baskets):
        g = rng.integers(GROUPS)
        items = rng.choice(PER_GROUP, rng.integers(2, 7), replace=False) + 1 + g * PER_GROUP
        basket += [b] * len(items)
        ids += list(items)
    return np.asarray(basket, np.int64), np.asarray(ids, np.int64)


def test_pmi_svd_recovers_planted_co_occurring_groups():
    basket, ids = _planted_baskets(np.random.default_rng(0))
    vec = cooccurrence_vectors(basket, ids, GROUPS * PER_GROUP, AffinityConfig(dim=8))
    assert vec.shape == (GROUPS * PER_GROUP + 1, 8)
    np.testing.assert_allclose(np.linalg.norm(vec[1:], axis=1), 1.0, atol=1e-5)
    assert not vec[0].any()  # the unknown id has no vector
    group = (np.arange(1, GROUPS * PER_GROUP + 1) - 1) // PER_GROUP
    sim = vec[1:] @ vec[1:].T
    same = group[:, None] == group[None, :]
    np.fill_diagonal(sim, -np.inf)
    assert (group[sim.argmax(1)] == group).all()  # every product's nearest neighbour is in its group
    np.fill_diagonal(sim, np.nan)
    assert np.nanmean(sim[same]) > 0.8 and np.nanmean(sim[~same]) < 0.2


def test_rare_values_get_no_vector_and_a_column_with_too_few_values_none():
    basket, ids = _planted_baskets(np.random.default_rng(1), 400)
    rare = np.r_[ids, 41]  # product 41 once
    vec = cooccurrence_vectors(np.r_[basket, basket[-1]], rare, 41, AffinityConfig(dim=8, min_count=5))
    assert not vec[41].any() and vec[1:41].any(axis=1).all()
    assert cooccurrence_vectors(basket, np.minimum(ids, 3), 3, AffinityConfig()) is None  # 3 values < min_values


def _planted_cache(sources, days: int = 80, customers: int = 120):
    """Customers each loyal to one group of products (category = the group: 85% of what they buy), a
    basket on 12 days of `days`."""
    rng = np.random.default_rng(3)
    customer, ts, product = [], [], []
    for i in range(customers):
        g = i % GROUPS
        for d in np.sort(rng.choice(days, 12, replace=False)):
            for p in rng.choice(PER_GROUP, rng.integers(2, 5), replace=False):
                grp = g if rng.random() < 0.85 else rng.integers(GROUPS)  # now and then another group's
                customer.append(f"c{i:03d}")
                ts.append(sources.at(float(d), 10))
                product.append(f"p{grp}_{p}")
    events = sources.events(sources.write_events("purchases", customer, ts, product, [1.0] * len(ts)))
    names = [f"p{g}_{p}" for g in range(GROUPS) for p in range(PER_GROUP)]
    from habitus.models.cache import TableInput

    products = TableInput("products", [sources.write("products", product_id=names,
                                                     category=[n.split("_")[0] for n in names])],
                          {"category": "categorical"}, key="product_id")
    return sources.build(events, attributes=[products], shard_events=1500)


def test_features_at_a_cutoff_do_not_see_later_events(sources, past):
    cache = _planted_cache(sources)
    cutoff = sources.at(50)
    labels = np.arange(1, cache.columns["category"]["vocab_size"] + 1)
    full = Affinity.fit(cache, cutoff, "category", labels)
    before = Affinity.fit(past(cache, cutoff), cutoff, "category", labels)
    assert set(full.levels) == {"product_id"}  # category: 4 values, too few for a level of its own
    np.testing.assert_array_equal(full.levels["product_id"], before.levels["product_id"])
    np.testing.assert_array_equal(full.centroids["product_id"], before.centroids["product_id"])
    a = affinity_features(cache, cutoff, "category", labels)
    b = affinity_features(past(cache, cutoff), cutoff, "category", labels)
    np.testing.assert_array_equal(a, b)
    later = affinity_features(cache, sources.at(80), "category", labels)
    assert not np.array_equal(a, later)  # (later events do change later features)


def test_the_attribute_levels_at_a_cutoff_do_not_see_later_events(sources, past):
    cache = _planted_cache(sources)
    cutoff = sources.at(50)
    assert attribute_columns(cache) == ("category",)  # the products table's column, not the product id
    labels = np.arange(1, cache.columns["category"]["vocab_size"] + 1)
    cfg = AffinityConfig(min_values=4)  # (4 categories here)
    a, b = (affinity_features(c, cutoff, "category", labels, cfg=cfg, levels=attribute_columns(cache))
            for c in (cache, past(cache, cutoff)))
    assert a.shape == (cache.n_entities, len(labels), 2) and a.any()  # one level: cosine, mass
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, affinity_features(cache, sources.at(80), "category", labels, cfg=cfg,
                                                    levels=attribute_columns(cache)))


def test_a_cache_without_an_item_table_has_no_attribute_columns(sources):
    assert attribute_columns(sources.segment_purchases(30, 40, seed=0)) == ()


def test_affinity_is_aligned_with_its_labels(sources):
    cache = _planted_cache(sources)
    cutoff = sources.at(60)
    vocab = cache.vocab("category").column(0).to_pylist()  # id i + 1 -> its value
    labels = np.array([vocab.index(f"p{g}") + 1 for g in (2, 0, 3, 1)])  # in an order of our own
    feats = affinity_features(cache, cutoff, "category", labels, cfg=AffinityConfig(min_values=4))
    aff = Affinity.fit(cache, cutoff, "category", labels, AffinityConfig(min_values=4))
    assert feats.shape == (cache.n_entities, 4, 4) and aff.width == 4  # 2 levels x (cosine, mass)
    # each customer (c{i}: group i % 4) is nearest its own group's label, by cosine and by mass
    names = cache.entity_ids(np.arange(cache.n_entities)).to_pylist()
    own = np.array([[2, 0, 3, 1].index(int(n[1:]) % GROUPS) for n in names])
    for k in range(aff.width):
        assert (feats[:, :, k].argmax(1) == own).mean() > 0.95, k
    # a subset of label positions gives those labels' columns, chunk by chunk as the stack reads them
    sh = cache.shard(0)
    chunk = chunk_at(sh, 0, len(sh.entities), cutoff)
    sub = aff.features(chunk, np.array([1, 3]))
    np.testing.assert_allclose(sub, aff.features(chunk)[:, [1, 3]], rtol=1e-6)
    np.testing.assert_allclose(aff.features(chunk), feats[chunk.entities], rtol=1e-6)


def test_an_entity_without_embedded_history_gets_zeros(sources):
    cache = _planted_cache(sources)
    cutoff = sources.at(60)
    aff = Affinity.fit(cache, cutoff, "category", np.array([1, 2]))
    empty = dataclasses.replace(aff, levels={}, centroids={})
    sh = cache.shard(0)
    chunk = chunk_at(sh, 0, len(sh.entities), cutoff)
    assert empty.width == 0 and empty.features(chunk).shape == (chunk.n, 2, 0)
