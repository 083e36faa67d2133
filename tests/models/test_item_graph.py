"""Item-graph inputs (models/item_graph.py): the graph of a cut-off reads only the events at or before
it, items nobody bought yet are placed by their attributes, and models saved without the inputs load
and score as before."""

import numpy as np
import pytest
import torch

from models import item_graph
from models.cache import Cache, TableInput
from models.cache.reader import Shard
from models.features import FeatureSpec, chunk_at, featurize

pytestmark = pytest.mark.usefixtures("one_thread")

# 12 products in 3 categories; each of 90 customers buys mostly the 4 of its segment
PRODUCTS = [f"p{i}" for i in range(12)]
CATEGORY = {f"p{i}": f"cat{i // 4}" for i in range(12)}


def _world(sources, span_days=60, late=(), name="purchases", seed=0):
    """(cache, cut-off at day 40): segments of customers buying their category's products; `late`:
    extra (customer, day, product) events, written in too."""
    rng = np.random.default_rng(seed)
    customer, ts, product = [], [], []
    for i in range(90):
        for d in np.sort(rng.uniform(0, span_days, 20)):
            customer.append(f"c{i:03d}")
            ts.append(sources.at(d))
            product.append(f"p{(i % 3) * 4 + int(rng.integers(0, 4))}" if rng.random() < 0.9
                           else f"p{int(rng.integers(0, 12))}")
    for c, d, p in late:
        customer.append(c), ts.append(sources.at(d)), product.append(p)
    products = list(CATEGORY) + ["p12"]  # p12: a new product of category 0, first sold after the cut-off
    attrs = TableInput("products", [sources.write(f"{name}_products", product_id=products,
                                                  category=[CATEGORY.get(p, "cat0") for p in products])],
                       {"product_id": "categorical", "category": "categorical"}, key="product_id")
    events = sources.events(sources.write_events(name, customer, ts, product, [1.0] * len(ts)))
    cache = sources.build(events, attributes=[attrs], root=f"cache_{name}")
    return cache, sources.at(40)


def _ids(cache, column="product_id"):
    vocab = cache.vocab(column)
    return dict(zip(vocab.column("value").to_pylist(), vocab.column("id").to_pylist()))


class _Before(Cache):
    """The cache at `cache.path` with the events after `cutoff` left out (the same ids)."""

    def __init__(self, cache, cutoff):
        super().__init__(cache.path)
        self.cutoff = cutoff

    def _read_shard(self, i: int) -> Shard:
        full = super()._read_shard(i)
        rows = full.ts <= self.cutoff
        entity = full.entity[rows]
        starts = np.r_[0, np.flatnonzero(np.diff(entity)) + 1, len(entity)].astype(np.int64)
        return Shard(entity=entity, ts=full.ts[rows], columns={c: v[rows] for c, v in full.columns.items()},
                     entities=entity[starts[:-1]], starts=starts)


def test_the_graph_reads_only_events_at_or_before_the_cutoff(sources):
    late = [(f"c{i:03d}", 41 + i % 19, "p12" if i % 2 else "p0") for i in range(90)]  # a new product, switches
    cache, cutoff = _world(sources, late=late)
    graph = item_graph.graph_config(cache, 8)
    assert graph["column"] == "product_id"
    full = item_graph.fit(cache, graph, cutoff)
    np.testing.assert_array_equal(item_graph.fit(_Before(cache, cutoff), graph, cutoff), full)
    assert not np.allclose(item_graph.fit(cache, graph, sources.at(60)), full, atol=1e-3)
    # and so do the entities' inputs at the cut-off
    spec = FeatureSpec.from_cache(cache, buckets=32)
    spec.graph = graph
    x = {}
    for name, c in (("full", cache), ("before", _Before(cache, cutoff))):
        item_graph._SOURCES.pop(c.lineage, None)
        item_graph._GRAPHS.clear()
        item_graph.register(c)
        x[name] = featurize(chunk_at(c.shard(0), 0, 90, cutoff), spec, c.entity_table())
    np.testing.assert_array_equal(x["full"], x["before"])


def test_items_of_one_segment_sit_together(sources):
    cache, cutoff = _world(sources)
    emb = item_graph.fit(cache, item_graph.graph_config(cache, 16), cutoff)
    ids = _ids(cache)
    e = {p: emb[ids[p]] / np.linalg.norm(emb[ids[p]]) for p in PRODUCTS}
    same = np.mean([e[a] @ e[b] for a in PRODUCTS for b in PRODUCTS if a != b and CATEGORY[a] == CATEGORY[b]])
    other = np.mean([e[a] @ e[b] for a in PRODUCTS for b in PRODUCTS if CATEGORY[a] != CATEGORY[b]])
    assert same > other + 0.5, (same, other)


def test_a_new_item_gets_the_mean_of_the_items_sharing_its_attributes(sources):
    late = [("c000", 50, "p12"), ("c003", 51, "p12")]  # p12 first sold after the cut-off
    cache, cutoff = _world(sources, late=late, name="newitem")
    graph = item_graph.graph_config(cache, 8)
    ids = _ids(cache)
    table = item_graph.fit(cache, graph, cutoff)
    new = table[ids["p12"]]
    assert np.abs(new).sum() > 0
    # what the factorization gave the bought items of category 0 (the prior shrinks bought ones a little:
    # undo it with prior 0)
    plain = item_graph.fit(cache, {**graph, "prior": 0.0}, cutoff)
    np.testing.assert_allclose(new, np.mean([plain[ids[f"p{i}"]] for i in range(4)], axis=0), atol=1e-5)
    # once it has buyers it has its own graph embedding, shrunk towards that mean
    assert not np.allclose(item_graph.fit(cache, graph, sources.at(60))[ids["p12"]], new, atol=1e-4)


def test_the_basis_is_the_same_for_every_vocabulary_size():
    np.testing.assert_array_equal(item_graph.basis(100, 8, 0)[:40], item_graph.basis(40, 8, 0))


def test_featurize_appends_the_entities_graph_means_before_their_attributes(sources):
    cache, cutoff = _world(sources)
    spec = FeatureSpec.from_cache(cache, buckets=32)
    plain = featurize(chunk_at(cache.shard(0), 0, 90, cutoff), spec, cache.entity_table())
    spec.graph = item_graph.graph_config(cache, 8)
    item_graph.register(cache)
    chunk = chunk_at(cache.shard(0), 0, 90, cutoff)
    x = featurize(chunk, spec, cache.entity_table())
    assert x.shape == (90, plain.shape[1] + 8) == (90, spec.width)
    np.testing.assert_array_equal(x[:, :plain.shape[1]], plain)  # (this world has no entity attributes)
    g = x[:, plain.shape[1]:]
    # customers of one segment are nearer each other than to the others'
    seg = np.array([int(str(v)[1:]) % 3 for v in cache.entity_ids(chunk.entities).to_pylist()])
    g = g / np.linalg.norm(g, axis=1, keepdims=True)
    sim = g @ g.T
    same = sim[seg[:, None] == seg[None, :]].mean()
    assert same > sim[seg[:, None] != seg[None, :]].mean() + 0.3
    spec_dict = FeatureSpec.from_dict(spec.to_dict())
    assert spec_dict.graph == spec.graph and spec_dict.width == spec.width


def test_a_spec_saved_before_graph_inputs_loads_without_them(sources):
    cache, cutoff = _world(sources)
    spec = FeatureSpec.from_cache(cache, buckets=32)
    saved = spec.to_dict()
    saved.pop("graph")
    old = FeatureSpec.from_dict(saved)
    assert old.graph is None and old.width == spec.width
    chunk = chunk_at(cache.shard(0), 0, 90, cutoff)
    table = cache.entity_table()
    np.testing.assert_array_equal(featurize(chunk, old, table), featurize(chunk, spec, table))


def test_an_unregistered_cache_is_named():
    with pytest.raises(RuntimeError, match="register"):
        item_graph.source({"lineage": "nowhere", "column": "product_id"})


def test_old_checkpoints_score_unchanged_and_graph_models_train_end_to_end(sources, tmp_path):
    from models.checkpoint import load_checkpoint, save_checkpoint
    from models.foundation_training import train_foundation
    from models.network import Model, NetConfig
    from models.specs import FoundationConfig

    cache, cutoff = _world(sources)
    kw = dict(horizon_days=7, cutoff_every_days=7, hidden=16, layers=1, epochs=1, batch_size=32, buckets=32,
              cutoffs_per_chunk=1, chunk_entities=64, min_history_days=14)
    quiet = lambda _: None  # noqa: E731
    old = train_foundation(cache, FoundationConfig(**kw), cutoff, device="cpu", log=quiet)
    assert "graph" not in old.info["feature_spec"] or old.info["feature_spec"]["graph"] is None
    info = dict(old.info)
    info["feature_spec"] = {k: v for k, v in info["feature_spec"].items() if k != "graph"}  # as saved before
    save_checkpoint(tmp_path / "old", old.model, info)
    state, config = load_checkpoint(tmp_path / "old")
    spec = FeatureSpec.from_dict(config["feature_spec"])
    model = Model(NetConfig(**config["net"]), config["targets_width"])
    model.load_state_dict(state)
    model.eval()
    x = torch.from_numpy(featurize(chunk_at(cache.shard(0), 0, 90, cutoff), spec, cache.entity_table()))
    with torch.no_grad():
        torch.testing.assert_close(model(x), old.model.eval()(x))

    new = train_foundation(cache, FoundationConfig(**kw, graph_dim=8), cutoff, device="cpu", log=quiet)
    gspec = FeatureSpec.from_dict(new.info["feature_spec"])
    assert gspec.graph["dim"] == 8 and new.info["net"]["in_dim"] == spec.width + 8
    xg = featurize(chunk_at(cache.shard(0), 0, 90, cutoff), gspec, cache.entity_table())
    with torch.no_grad():
        assert torch.isfinite(new.model.eval()(torch.from_numpy(xg))).all()
