"""habitus.models.data.features and habitus.models.data.targets: what a cut-off lets the features see, and what it labels."""

import numpy as np
import pytest

from habitus.models.cache import TableInput
from habitus.models.data.features import (DAY, HALF_LIVES, RECENCY_DAYS, WINDOWS, FeatureSpec, bucket_count, bucketize, chunk_at,
                             featurize, visit_features, visit_width)
from habitus.models.data.targets import TargetSpec, compute_target, eligible, foundation_target
from habitus.models.train.loop import chunk_plan

CUT_DAY = 120  # the cut-off: T0 + 120 days, a midnight


def _features_by_id(cache, spec, cutoff, chunk_entities=2):
    """{entity id: feature row} over every chunk of every shard."""
    table = cache.entity_table()
    out = {}
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        x = featurize(chunk, spec, table)
        assert x.shape == (chunk.n, spec.width) and x.dtype == np.float32
        for entity, row in zip(cache.entity_ids(chunk.entities).to_pylist(), x):
            out[entity] = row
    return out


def _history(sources, rng, n=12):
    """Events of n customers over the 120 days up to (and exactly at) the cut-off."""
    customer, ts, product, price = [], [], [], []
    for i in range(n):
        k = int(rng.integers(2, 9))
        days = np.sort(rng.uniform(CUT_DAY - 110, CUT_DAY, k))
        customer += [f"c{i:02d}"] * k
        ts += [sources.at(d) for d in days]
        product += [f"p{int(p)}" for p in rng.choice(4, k, p=[0.5, 0.25, 0.15, 0.1])]
        price += rng.gamma(2.0, 5.0, k).round(2).tolist()
    customer.append("c00")  # one event exactly at the cut-off: history, not future
    ts.append(sources.at(CUT_DAY))
    product.append("p0")
    price.append(3.0)
    return customer, ts, product, price


def _customers(sources):
    return TableInput("customers", [sources.write(
        "customers", customer_id=[f"c{i:02d}" for i in range(12)],
        segment=["gold", "silver", "bronze", None] * 3,
        age=[20.0 + i for i in range(11)] + [None],
        signup=sources.stamps([sources.at(-400 + 30 * i) for i in range(12)]))],
        {"customer_id": "categorical", "segment": "categorical", "age": "numeric", "signup": "timestamp"})


def test_features_never_read_events_after_the_cutoff(sources):
    rng = np.random.default_rng(3)
    customer, ts, product, price = _history(sources, rng)
    past = sources.write_events("past", customer, ts, product, price)
    # the future: only the most frequent product (p0), so the vocabulary keeps its ids, plus a new
    # customer who only appears later
    future_customer = ["c00", "c03", "c03", "c07", "c11", "zz_new"]
    future_ts = [sources.at(CUT_DAY, seconds=1), sources.at(CUT_DAY + 1), sources.at(CUT_DAY + 30),
                 sources.at(CUT_DAY + 2.5), sources.at(CUT_DAY + 60), sources.at(CUT_DAY + 3)]
    future = sources.write_events("future", future_customer, future_ts, ["p0"] * 6, [500.0] * 6)
    customers = _customers(sources)
    before = sources.build(sources.events(past), [customers], shard_events=7, root="before")
    after = sources.build(sources.events(past, future), [customers], shard_events=5, root="after")
    assert after.manifest["n_events"] == before.manifest["n_events"] + 6
    assert before.vocab("product_id").column("value").to_pylist() == \
        after.vocab("product_id").column("value").to_pylist()

    spec = FeatureSpec.from_cache(before)
    assert FeatureSpec.from_cache(after) == spec
    cutoff = sources.at(CUT_DAY)
    x_before = _features_by_id(before, spec, cutoff)
    x_after = _features_by_id(after, spec, cutoff)
    assert sorted(x_before) == sorted(x_after) == [f"c{i:02d}" for i in range(12)]  # zz_new has no history yet
    for entity in x_before:
        np.testing.assert_array_equal(x_before[entity], x_after[entity], err_msg=entity)
    # ...while a later cut-off does see the new events
    later = sources.at(CUT_DAY + 1)
    assert not np.array_equal(_features_by_id(before, spec, later)["c00"], _features_by_id(after, spec, later)["c00"])


def test_feature_width_matches_the_spec(sources):
    rng = np.random.default_rng(5)
    customer, ts, product, price = _history(sources, rng)
    cache = sources.build(sources.events(sources.write_events("e", customer, ts, product, price)), [_customers(sources)])
    for buckets in (256, 4):  # 4 < vocab + 1: the tail is hashed
        spec = FeatureSpec.from_cache(cache, buckets=buckets)
        # globals 3 + 3 windows + 2 half-lives; price 2 decays + mean; product buckets x 3 channels;
        # segment one-hot (3 values + unknown); age and signup (value, missing flag) each; visits
        expected = 8 + 3 + min(5, buckets) * 3 + 4 + 2 + 2 + visit_width(HALF_LIVES)
        assert spec.width == expected
        x = _features_by_id(cache, spec, sources.at(CUT_DAY))
        assert all(row.shape == (expected,) for row in x.values())
        assert all(np.isfinite(row).all() for row in x.values())
        assert FeatureSpec.from_dict(spec.to_dict()) == spec


def test_decayed_counts_follow_the_closed_form(sources):
    cutoff = sources.at(CUT_DAY)
    ages = np.array([10.0, 3.5, 0.0])  # days before the cut-off; the last one is exactly at it
    products = ["p_x", "p_y", "p_x"]
    prices = [10.0, 4.0, 6.0]
    path = sources.write_events("e", ["solo"] * 4, [cutoff - int(a * DAY) for a in ages] + [cutoff + 3600],
                                products + ["p_y"], prices + [1000.0])
    cache = sources.build(sources.events(path))
    spec = FeatureSpec.from_cache(cache)
    x = _features_by_id(cache, spec, cutoff)["solo"]
    ids = dict(zip(cache.vocab("product_id").column("value").to_pylist(), cache.vocab("product_id").column("id").to_pylist()))

    def decayed(a, h):
        return 2.0 ** (-np.asarray(a) / h)

    expected_globals = [np.log1p(3), np.log1p(0.0), np.log1p(10.0)]  # count, most recent age, oldest age
    expected_globals += [np.log1p(np.sum(ages <= w)) for w in WINDOWS]
    expected_globals += [np.log1p(decayed(ages, h).sum()) for h in HALF_LIVES]
    np.testing.assert_allclose(x[:8], expected_globals, rtol=1e-6)
    # visits: three days (10, 3 and 0 days before); mean gap (10 - 0) / 2 = 5; last visit 0 days ago
    days = np.floor(ages)
    expected_visits = [np.log1p(3)] + [np.log1p(np.sum(days < w)) for w in WINDOWS]
    expected_visits += [np.log1p(decayed(days, h).sum()) for h in HALF_LIVES]
    expected_visits += [np.log1p(5.0), np.log1p(1.0) - np.log1p(6.0), 1.0, np.log1p(1.0)]
    v = visit_width(HALF_LIVES)
    price = [np.log1p((decayed(ages, h) * prices).sum()) for h in HALF_LIVES] + [np.log1p(np.mean(prices))]
    np.testing.assert_allclose(x[8:11], price, rtol=1e-6)
    np.testing.assert_allclose(x[11:11 + v], expected_visits, rtol=1e-6, atol=1e-7)

    hist = x[11 + v:11 + v + bucket_count(2, spec.buckets) * 3].reshape(-1, 3)  # [bucket, (h=14, h=60, recency)]
    for name, mask in (("p_x", np.array([True, False, True])), ("p_y", np.array([False, True, False]))):
        row = hist[ids[name]]
        np.testing.assert_allclose(np.expm1(row[:2]), [decayed(ages[mask], h).sum() for h in HALF_LIVES], rtol=1e-5)
        np.testing.assert_allclose(row[2], decayed(ages[mask].min(), RECENCY_DAYS), rtol=1e-6)
    np.testing.assert_array_equal(hist[0], 0.0)  # nothing unknown


# --------------------------------------------------------------------------- targets

WINDOW = 7


@pytest.fixture
def target_cache(sources):
    """'a' and 'c' have history; 'b' only acts after the cut-off (it sorts between them)."""
    c = sources.at(CUT_DAY)
    w = WINDOW * DAY
    rows = [
        ("a", c - 5 * DAY, "p1", 1.0),
        ("a", c, "p2", 2.0),  # at the cut-off: history
        ("a", c + 1, "p3", 10.0),  # first second of the window
        ("a", c + w, "p1", 20.0),  # last second of the window
        ("a", c + w + 1, "p2", 400.0),  # after the window: neither
        ("b", c + DAY, "p1", 3000.0),
        ("c", c - 100 * DAY, "p1", 1.0),
        ("c", c - 91 * DAY, "p2", 1.0),
        ("c", c + 2 * DAY, "p2", 50000.0),
        ("d", c - 90 * DAY, "p3", 1.0),  # exactly active_days before the cut-off
    ]
    customer, ts, product, price = zip(*rows)
    cache = sources.build(sources.events(sources.write_events("e", customer, ts, product, price)))
    assert cache.shard_count == 1
    shard = cache.shard(0)
    chunk = chunk_at(shard, 0, len(shard.entities), c)
    ids = dict(zip(cache.vocab("product_id").column("value").to_pylist(), cache.vocab("product_id").column("id").to_pylist()))
    return cache, chunk, ids


def test_chunk_rows_are_the_entities_with_history(target_cache):
    cache, chunk, _ = target_cache
    assert cache.entity_ids(chunk.entities).to_pylist() == ["a", "c", "d"]
    assert chunk.n == 3
    # history: a's two events (one at the cut-off), c's two, d's one
    np.testing.assert_array_equal(chunk.local, [0, 0, 1, 1, 2])
    np.testing.assert_allclose(chunk.age_days, [5, 0, 100, 91, 90])


def test_compute_target_window_boundaries(target_cache):
    cache, chunk, ids = target_cache
    vocab = cache.columns["product_id"]["vocab_size"]
    np.testing.assert_array_equal(compute_target(chunk, TargetSpec("no_event", WINDOW)), [0, 0, 1])
    np.testing.assert_array_equal(compute_target(chunk, TargetSpec("count", WINDOW)), [2, 1, 0])
    np.testing.assert_allclose(compute_target(chunk, TargetSpec("sum", WINDOW, "price")), [30.0, 50000.0, 0.0])
    # a wider window reaches a's last event
    np.testing.assert_array_equal(compute_target(chunk, TargetSpec("count", WINDOW + 1)), [3, 1, 0])

    labels = (ids["p1"], ids["p2"], ids["p3"])
    expected = [[1, 0, 1],  # a: p3 at c + 1s, p1 at c + window (p2 at c + window + 1s is too late)
                [0, 1, 0],  # c: p2
                [0, 0, 0]]
    for kind in ("any_event", "items"):
        y = compute_target(chunk, TargetSpec(kind, WINDOW, "product_id", labels), vocab)
        np.testing.assert_array_equal(y.dense(), expected)  # sparse rows: whatever the number of labels
    # a label subset: only p2 counts
    y = compute_target(chunk, TargetSpec("any_event", WINDOW, "product_id", (ids["p2"],)), vocab)
    np.testing.assert_array_equal(y.dense(), [[0], [1], [0]])


def test_foundation_target_is_next_window_activity(target_cache):
    cache, chunk, ids = target_cache
    spec = FeatureSpec.from_cache(cache)
    y = foundation_target(chunk, WINDOW, spec)
    assert y.shape == (3, 2 + cache.columns["product_id"]["vocab_size"])
    np.testing.assert_array_equal(y[:, 0], [1, 1, 0])
    np.testing.assert_allclose(y[:, 1], np.log1p([2, 1, 0]))
    hot = y[:, 2:]  # bucket b -> column b - 1
    assert hot[0, ids["p3"] - 1] == 1 and hot[0, ids["p1"] - 1] == 1 and hot[0, ids["p2"] - 1] == 0
    assert hot[1].tolist() == [1.0 if i == ids["p2"] - 1 else 0.0 for i in range(hot.shape[1])]


def test_eligible_keeps_recently_active_entities_for_churn(target_cache):
    _, chunk, _ = target_cache
    # a: 0 days since last event, c: 91 days, d: exactly 90 days
    np.testing.assert_array_equal(eligible(chunk, TargetSpec("no_event", WINDOW, active_days=90)), [True, False, True])
    np.testing.assert_array_equal(eligible(chunk, TargetSpec("no_event", WINDOW, active_days=30)), [True, False, False])
    for kind in ("count", "sum", "any_event", "items"):
        assert eligible(chunk, TargetSpec(kind, WINDOW, "price")).all()


def test_bucketize_keeps_frequent_ids_and_hashes_the_tail():
    ids = np.arange(0, 1001)
    b = bucketize(ids, vocab_size=1000, buckets=16)
    np.testing.assert_array_equal(b[:12], np.arange(12))  # exact: the first 16 - 16 // 4 = 12 ids
    tail = b[12:]
    assert tail.min() == 12 and tail.max() == 15  # the tail shares the last quarter
    np.testing.assert_array_equal(tail, 12 + ids[12:] % 4)
    # a small vocabulary keeps every id
    np.testing.assert_array_equal(bucketize(np.arange(8), vocab_size=7, buckets=16), np.arange(8))
    assert bucket_count(7, 16) == 8 and bucket_count(1000, 16) == 16


def test_target_spec_round_trip():
    spec = TargetSpec("items", 14, "product_id", (3, 1, 2), active_days=45)
    assert TargetSpec.from_dict(spec.to_dict()) == spec
    assert TargetSpec.from_dict({**spec.to_dict(), "labels": [3, 1, 2]}) == spec


def test_half_lives_are_configurable_and_the_habitual_channel_follows(sources):
    rng = np.random.default_rng(7)
    customer, ts, product, price = _history(sources, rng)
    cache = sources.build(sources.events(sources.write_events("e", customer, ts, product, price)))
    default = FeatureSpec.from_cache(cache)
    assert default.half_lives == HALF_LIVES and default.habitual_channel == 1  # 60 days
    four = FeatureSpec.from_cache(cache, half_lives=(3.0, 14.0, 60.0, 180.0))
    assert four.channels == 5 and four.habitual_channel == 2
    # two more decayed counts per value, per numeric column, among the global scalars and the visits
    assert four.width - default.width == 2 * (1 + 1 + 1 + 5)
    x = _features_by_id(cache, four, sources.at(CUT_DAY))
    assert all(row.shape == (four.width,) and np.isfinite(row).all() for row in x.values())
    assert FeatureSpec.from_dict(four.to_dict()) == four


def test_events_of_one_day_are_one_visit(sources):
    """Basket lines share a day: visits count days, events per visit the lines."""
    cutoff = sources.at(CUT_DAY)
    at = [cutoff - 5 * DAY + 60, cutoff - 5 * DAY + 120, cutoff - 5 * DAY + 180, cutoff - 20 * DAY]
    cache = sources.build(sources.events(sources.write_events("e", ["a"] * 4, at, ["p1", "p2", "p3", "p1"],
                                                               [1.0] * 4)))
    spec = FeatureSpec.from_cache(cache)
    chunk = chunk_at(cache.shard(0), 0, 1, cutoff)
    v = visit_features(chunk, spec)[0]
    assert v[0] == pytest.approx(np.log1p(2))  # two visits, not four events
    assert v[-1] == pytest.approx(np.log1p(2.0))  # four events over two visits
    assert v[-2] == 1.0  # more than one visit: the mean gap is defined


def test_specs_saved_before_visit_features_keep_their_width(sources):
    rng = np.random.default_rng(5)
    customer, ts, product, price = _history(sources, rng)
    cache = sources.build(sources.events(sources.write_events("e", customer, ts, product, price)))
    spec = FeatureSpec.from_cache(cache)
    old = {k: v for k, v in spec.to_dict().items() if k != "visits"}
    assert FeatureSpec.from_dict(old).width == spec.width - visit_width(spec.half_lives)
