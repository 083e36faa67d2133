"""Next items in two stages (models/tasks/rerank.py): the network's best items re-ordered by ranking trees,
chosen on validation, carried in the item head's state through a checkpoint."""

import numpy as np
import pytest
import torch

from habitus.models.evaluate.holdout import protocol
from habitus.models.data.features import FeatureSpec
from habitus.models.train.finetune import finetune
from habitus.models.data.items import SparseRows
from habitus.models.nn.network import Model, NetConfig
from habitus.models.serve.predict import load_model
from habitus.models.tasks.rerank import candidate_features, rerank
from habitus.models.tasks.recommendation import rank_items
from habitus.models.train.config import FinetuneConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.data.targets import TargetSpec

lgb = pytest.importorskip("lightgbm")
pytestmark = pytest.mark.usefixtures("one_thread")


def _history():
    # row 0 touched items 2 and 5, row 1 item 0; channels (14-day, 60-day, recency)
    return SparseRows.from_pairs(np.array([0, 0, 1]), np.array([2, 5, 0]),
                                 np.array([[1.0, 2.0, 0.5], [0.5, 1.0, 0.2], [3.0, 4.0, 0.9]]), 2, 8)


def test_candidate_features_read_each_rows_own_history_of_each_candidate():
    top = np.array([[5, 1, 2], [0, 2, 7]])
    scores = np.array([[3.0, 2.0, 1.0], [9.0, 1.0, 0.5]], np.float32)
    pop = np.arange(16, dtype=np.float32).reshape(8, 2)
    f = candidate_features(top, scores, _history(), pop)
    assert f.shape == (2, 3, 3 + 3 + 1 + 2 + 3)
    np.testing.assert_array_equal(f[..., 0], scores)  # the network's score, its gap to the best, the rank
    np.testing.assert_array_equal(f[0, :, 1], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(f[1, :, 2], [0, 1, 2])
    np.testing.assert_allclose(f[0, 0, 3:6], [0.5, 1.0, 0.2], rtol=1e-6)  # item 5 of row 0
    np.testing.assert_array_equal(f[0, 1, 3:7], [0, 0, 0, 0])  # item 1: never touched
    np.testing.assert_allclose(f[0, 2, 3:7], [1.0, 2.0, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(f[1, 0, 3:7], [3.0, 4.0, 0.9, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(f[1, 2, 7:9], pop[7])  # the item's popularity
    np.testing.assert_array_equal(f[:, 0, 9], [2, 1])  # history size, habitual mass, the item's share
    np.testing.assert_allclose(f[0, :, 10], 3.0)
    np.testing.assert_allclose(f[0, 2, 11], 2.0 / 3.0)


def _trees_preferring_history():
    """A ranker that learned "the entity's own 60-day count first" on random lists."""
    rng = np.random.default_rng(0)
    x = rng.random((400, 10, 12)).astype(np.float32)
    y = (x[..., 4] > 0.8).astype(np.float32)
    ranker = lgb.LGBMRanker(n_estimators=20, min_child_samples=5, verbose=-1, n_jobs=1)
    ranker.fit(x.reshape(-1, 12), y.reshape(-1), group=np.full(400, 10))
    return ranker.booster_.model_to_string()


def test_the_trees_reorder_the_candidates_and_travel_in_the_checkpoint(tmp_path):
    from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    task = TaskSpec("recommendation", TargetSpec("items", 14, "product_id", tuple(range(1, 9))), k=3, item_dim=4)
    spec = FeatureSpec({"product_id": 8}, {}, {}, {}, {}, 16)
    model = Model(NetConfig(spec.width, 8, 1, 0.0), 8, 3, 4, 2).eval()
    hist, pop = _history(), np.random.default_rng(1).random((8, 2)).astype(np.float32)
    x = np.random.default_rng(2).normal(size=(2, spec.width)).astype(np.float32)
    alone = rank_items(model, x, hist, pop, 3)
    assert model.head.booster is None
    model.head.set_reranker(_trees_preferring_history())
    top, scores = rank_items(model, x, hist, pop, 3)
    candidates, cand_scores = rank_items(model, x, hist, pop, 8, rerank=False)
    expected = rerank(model.head.booster, candidates, cand_scores, hist, pop, 3)
    np.testing.assert_array_equal(top, expected[0])
    assert np.all(np.diff(scores, axis=1) <= 0)
    np.testing.assert_array_equal(rank_items(model, x, hist, pop, 3, rerank=False)[0], alone[0])
    # saved and loaded with the weights: the same ranking, and the fingerprint covers the trees
    config = {"kind": "scenario", "task": task.to_dict(), "feature_spec": spec.to_dict(), "net": model.trunk.cfg.to_dict()}
    save_checkpoint(tmp_path / "ckpt", model, config)
    state, saved = load_checkpoint(tmp_path / "ckpt")
    loaded, _, _ = load_model(state, saved)
    assert loaded.head.booster is not None
    np.testing.assert_array_equal(rank_items(loaded, x, hist, pop, 3)[0], top)


def test_finetuning_fits_the_trees_and_keeps_them_only_where_they_win_on_validation(segment_labels):
    cache, test_cutoff, foundation, _ = segment_labels("multilabel")
    vocab = cache.columns["product_id"]["vocab_size"]
    task = TaskSpec("recommendation", TargetSpec("items", 14, "product_id", tuple(range(1, vocab + 1))), k=3,
                    item_dim=8)
    plan = protocol(test_cutoff, 14, 3, cache.time_range[0])
    said = []
    args = (cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff)
    result = finetune(*args, FinetuneConfig(epochs=1, batch_size=32, chunk_entities=64), device="cpu", log=said.append)
    second = result.info["second_stage"]
    assert second["chosen"] in ("trees", "network") and second["candidates"] == vocab  # a catalog of 12
    assert (result.model.head.booster is not None) == (second["chosen"] == "trees")
    assert (second["val_ndcg@3_trees"] > second["val_ndcg@3_network"]) == (second["chosen"] == "trees")
    assert any("re-ranking" in m for m in said)
    off = finetune(*args, FinetuneConfig(epochs=1, batch_size=32, chunk_entities=64, second_stage=False),
                   device="cpu", log=lambda _: None)
    assert "second_stage" not in off.info and off.model.head.booster is None
