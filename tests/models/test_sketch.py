"""The next window's co-occurrence sketch (habitus.models.data.sketch): related values share codes,
the codes read only the past, the target only the window, and the foundation forecasts it beside
its buckets without moving the outputs the scenarios read."""

import numpy as np
import pytest

from habitus.models.data.features import DAY, FeatureSpec, chunk_at
from habitus.models.data.sketch import fit_sketch
from habitus.models.data.targets import foundation_target
from habitus.models.train.config import FoundationConfig
from habitus.models.train.foundation import train_foundation

pytestmark = pytest.mark.usefixtures("one_thread")


def _groups(cache) -> np.ndarray:
    """The group of each product id (0: a staple, 1: a*, 2: b*; index 0 is the unknown value)."""
    vocab = [v[0] for v in cache.vocab("product_id").column(0).to_pylist()]
    return np.array([0] + ["sab".index(v[0]) for v in vocab])


def test_products_bought_together_share_codes(sources):
    cache = sources.loyal_groups()
    sketch = fit_sketch(cache, sources.at(90), weight=1.0)
    codes, group = sketch.codes["product_id"], _groups(cache)
    assert codes.shape == (len(group), 4) and sketch.size == 16
    rare = np.flatnonzero(group > 0)
    assert (codes[rare] >= 0).all() and (codes[rare] < 16).all()
    same = codes[rare][:, None, :] == codes[rare][None, :, :]  # [pair, pair, partition]
    together = group[rare][:, None] == group[rare][None, :]
    off = ~np.eye(len(rare), dtype=bool)
    # products of one group share a code far more often than products of the two groups
    assert same[together & off].mean() > 2 * same[~together].mean()


def test_the_codes_read_only_the_past(sources, past):
    cache = sources.loyal_groups()
    cutoff = sources.at(45)
    a, b = fit_sketch(cache, cutoff, 1.0), fit_sketch(past(cache, cutoff), cutoff, 1.0)
    assert a.codes.keys() == b.codes.keys()
    for c in a.codes:
        np.testing.assert_array_equal(a.codes[c], b.codes[c])


def test_the_target_is_the_window_after_the_cutoff(sources, past):
    cache = sources.loyal_groups()
    sketch = fit_sketch(cache, sources.at(45), 1.0)
    spec = FeatureSpec.from_cache(cache, 8, (7.0, 30.0), 0)
    cutoff = sources.at(50)
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), cutoff)
    y = foundation_target(chunk, 14, spec, sketch)
    assert y.shape[1] == foundation_target(chunk, 14, spec).shape[1] + sketch.width
    cut = past(cache, cutoff + 14 * DAY)
    np.testing.assert_array_equal(y, foundation_target(chunk_at(cut.shard(0), 0, len(cut.shard(0).entities), cutoff),
                                                       14, spec, sketch))
    part = y[:, -sketch.width:].reshape(len(y), -1, sketch.size)  # [entity, column x partition, code]
    acts = y[:, 0] > 0
    assert acts.any() and (~acts).any()
    assert (part[~acts] == 0).all()  # nothing next: no code
    assert (part[acts].sum(-1) >= 1).all()  # every partition of an active entity touches a code
    none = np.zeros(0, np.int64)  # a chunk without entities (a shard's last, a rank's padding)
    assert sketch.target(cache.shard(0).columns, none, none, 0).shape == (0, sketch.width)


def test_the_foundation_forecasts_the_sketch_after_its_buckets(sources):
    cache = sources.loyal_groups()
    cfg = FoundationConfig(buckets=8, epochs=1, hidden=16, ple_bins=0, min_history_days=14, contrastive_weight=0.0)
    plain = train_foundation(cache, cfg, sources.at(70), log=lambda _: None)
    with_sketch = train_foundation(cache, FoundationConfig(**{**cfg.__dict__, "sketch_weight": 1.0}), sources.at(70),
                                   log=lambda _: None)
    width = fit_sketch(cache, sources.at(70), 1.0).width
    assert with_sketch.info["targets_width"] == plain.info["targets_width"] + width
    assert all(np.isfinite(with_sketch.curves["val_loss"]))
