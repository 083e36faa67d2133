"""Rare values share buckets by relatedness (habitus.models.data.related): planted groups of products
bought together land in one tail bucket each, the map reads only the past, travels in the feature
spec and falls back to hashing where it has no entry."""

import numpy as np

from habitus.models.data.features import (FeatureSpec, bucketize, chunk_at, decode_tail, encode_tail, featurize,
                                          tail_start)
from habitus.models.data.related import related_tails
from habitus.models.data.targets import foundation_target
from habitus.models.train.config import FoundationConfig
from habitus.models.train.foundation import train_foundation

BUCKETS = 8  # ids 1..5 a bucket of their own (0: unknown), 2 shared tail buckets


def _tail_groups(cache) -> tuple[np.ndarray, np.ndarray]:
    """(tail value ids, their group: 0 for a*, 1 for b*) of the product column."""
    vocab = cache.vocab("product_id").column(0).to_pylist()  # id i + 1 -> its value
    ids = np.arange(tail_start(BUCKETS), len(vocab) + 1)
    return ids, np.array([vocab[i - 1][0] == "b" for i in ids], np.int64)


def test_products_bought_together_share_a_tail_bucket(sources):
    cache = sources.loyal_groups()
    ids, group = _tail_groups(cache)
    assert len(ids) == 20 and set(group) == {0, 1}  # the staples took ids 1..5
    tails = related_tails(cache, sources.at(90), BUCKETS)
    assert set(tails) == {"product_id"}
    vocab = cache.columns["product_id"]["vocab_size"]
    related = bucketize(ids, vocab, BUCKETS, tails["product_id"])
    assert (related >= tail_start(BUCKETS)).all() and (related < BUCKETS).all()
    for g in (0, 1):  # one bucket per group, a different one for each
        assert len(set(related[group == g])) == 1
    assert related[group == 0][0] != related[group == 1][0]
    hashed = bucketize(ids, vocab, BUCKETS)
    assert all(len(set(hashed[group == g])) == 2 for g in (0, 1))  # by id, each bucket mixes the groups


def test_the_map_reads_only_the_past(sources, past):
    cache = sources.loyal_groups()
    cutoff = sources.at(45)
    a = related_tails(cache, cutoff, BUCKETS)["product_id"]
    np.testing.assert_array_equal(a, related_tails(past(cache, cutoff), cutoff, BUCKETS)["product_id"])


def test_spec_round_trip_and_fallbacks():
    tail = np.array([1, 0, 1, 1], np.uint16)  # ids 6..9
    assert np.array_equal(decode_tail(encode_tail(tail)), tail)
    spec = FeatureSpec({"product_id": 40}, [], {}, {}, [], buckets=BUCKETS, tails={"product_id": encode_tail(tail)})
    back = FeatureSpec.from_dict(spec.to_dict())
    assert back == spec
    ids = np.array([0, 1, 5, 6, 7, 8, 9, 10, 41, 100])
    exact = tail_start(BUCKETS)
    expected = np.r_[0, 1, 5, exact + tail, bucketize(np.array([10, 41, 100]), 40, BUCKETS)]
    np.testing.assert_array_equal(back.bucket("product_id", ids), expected)  # beyond the map: hashed, as before
    old = spec.to_dict()
    del old["tails"]  # a checkpoint saved before tail maps: hashed
    np.testing.assert_array_equal(FeatureSpec.from_dict(old).bucket("product_id", ids), bucketize(ids, 40, BUCKETS))


def test_the_foundation_reads_and_forecasts_related_buckets(sources, one_thread):
    cache = sources.loyal_groups()
    cfg = FoundationConfig(buckets=BUCKETS, epochs=1, hidden=16, ple_bins=0, min_history_days=14)
    result = train_foundation(cache, cfg, sources.at(70), log=lambda _: None)
    spec = FeatureSpec.from_dict(result.info["feature_spec"])
    assert set(spec.tails) == {"product_id"}
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), sources.at(60))
    x, y = featurize(chunk, spec, cache.entity_table()), foundation_target(chunk, 14, spec)
    # the tail's two buckets are the two groups: each customer reads (and forecasts) only its own group's
    tail_counts = x[:, spec.scalar_width + 3 * tail_start(BUCKETS):spec.scalar_width + 3 * BUCKETS:3]
    assert (np.count_nonzero(tail_counts, axis=1) == 1).all()
    future_tail = y[:, 2 + tail_start(BUCKETS) - 1:2 + BUCKETS - 1]
    assert future_tail.sum(1).max() == 1
    hashed = train_foundation(cache, FoundationConfig(**{**cfg.__dict__, "related_buckets": False}), sources.at(70),
                              log=lambda _: None)
    assert FeatureSpec.from_dict(hashed.info["feature_spec"]).tails == {}


def test_explanations_name_a_related_bucket_by_its_most_frequent_member():
    from habitus.models.explain.inputs import _bucket_names

    vocab = [f"v{i}" for i in range(1, 11)]  # ids 1..10
    names = _bucket_names(vocab, 10, BUCKETS, np.array([1, 1, 0, 0, 1]))  # ids 6..10
    assert names[:6] == ["(unknown)", "v1", "v2", "v3", "v4", "v5"]
    assert names[6:] == ["(rarer values like v8, shared bucket 1 of 2)", "(rarer values like v6, shared bucket 2 of 2)"]
    assert _bucket_names(vocab, 10, BUCKETS)[6] == "(rarer values, shared bucket 1 of 2)"  # hashed: no member named


def test_the_fit_reads_whole_shards_up_to_its_cap(sources):
    from habitus.models.data.affinity import baskets

    cache = sources.loyal_groups()
    assert cache.shard_count > 2
    cutoff = sources.at(90)
    first = int((cache.shard(0).ts <= cutoff).sum())
    basket, values = baskets(cache, cutoff, ["product_id"], max_events=1)
    assert len(basket) == len(values["product_id"]) == first  # the first shard, whole
    everything, _ = baskets(cache, cutoff, ["product_id"])
    assert len(everything) == sum(int((cache.shard(i).ts <= cutoff).sum()) for i in range(cache.shard_count))
