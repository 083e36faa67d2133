"""habitus.models.data.items: sparse label rows, the sampled softmax and the blockwise top-k that let
recommendation scale to a large catalog, checked against dense computations and hand cases."""

import math

import numpy as np
import pytest
import torch

from habitus.models.data.features import Chunk, value_history
from habitus.models.data.items import SparseRows, candidates, group_history, sampled_softmax_loss, top_k_items
from habitus.models.tasks.metrics import ranking_metrics_at, top_k
from habitus.models.nn.network import ItemHead


def _random_sparse(rng, n_rows=7, n_cols=11, density=0.3) -> tuple[SparseRows, np.ndarray]:
    dense = (rng.random((n_rows, n_cols)) < density) * rng.random((n_rows, n_cols))
    rows, cols = np.nonzero(dense)
    order = rng.permutation(len(rows))  # from_pairs accepts any order
    sparse = SparseRows.from_pairs(rows[order], cols[order], dense[rows, cols][order], n_rows, n_cols)
    return sparse, dense.astype(np.float32)


def test_sparse_rows_select_like_numpy():
    rng = np.random.default_rng(0)
    sparse, dense = _random_sparse(rng)
    np.testing.assert_array_equal(sparse.dense(), dense)
    mask = np.array([True, False, True, True, False, False, True])
    np.testing.assert_array_equal(sparse[mask].dense(), dense[mask])
    index = np.array([6, 0, 0, 3])  # any order, repeats allowed
    np.testing.assert_array_equal(sparse[index].dense(), dense[index])
    assert len(sparse[np.array([], np.int64)]) == 0
    np.testing.assert_array_equal(sparse.col_counts(), (dense > 0).sum(0))


def test_group_history_matches_the_dense_value_history():
    rng = np.random.default_rng(1)
    n, labels, events = 5, 9, 60
    local = np.sort(rng.integers(0, n, events))
    pos = rng.integers(0, labels, events)
    age = rng.uniform(0, 100, events).astype(np.float32)
    chunk = Chunk(np.arange(n), local, age, np.arange(events), cutoff=0, shard=None)
    dense = value_history(chunk, pos, labels, (14.0, 60.0))
    dense[:, :, :-1] = np.log1p(dense[:, :, :-1])
    sparse = group_history(local, pos, age, n, labels, (14.0, 60.0), 30.0)
    for channel in range(3):
        np.testing.assert_allclose(sparse.dense(channel), dense[:, :, channel], rtol=1e-5, atol=1e-7)


def test_blockwise_top_k_equals_the_dense_top_k():
    rng = np.random.default_rng(2)
    n_rows, n_items = 13, 50
    base = torch.from_numpy(rng.normal(size=(n_rows, n_items)).astype(np.float32))
    sparse, dense_extra = _random_sparse(rng, n_rows, n_items)
    idx, score = top_k_items(n_rows, n_items, 5, lambda r0, r1, i0, i1: base[r0:r1, i0:i1], sparse,
                             row_block=4, item_block=7)
    full = base.numpy() + dense_extra
    np.testing.assert_array_equal(idx, top_k(full, 5))
    np.testing.assert_allclose(score, np.take_along_axis(full, idx, 1), rtol=1e-6)
    # k larger than the catalog: every item, best first
    idx, _ = top_k_items(2, 3, 10, lambda r0, r1, i0, i1: torch.tensor([[1.0, 3.0, 2.0]]).expand(r1 - r0, -1))
    np.testing.assert_array_equal(idx, [[1, 2, 0], [1, 2, 0]])


@pytest.mark.parametrize("k,row_block,item_block", [(5, 16, 9), (12, 7, 5), (1, 64, 64)])
def test_blockwise_top_k_with_signed_entries_over_many_blocks(k, row_block, item_block):
    """Many item blocks (the running threshold skips most of them), history entries of either sign (one
    that lowers a row's best item, one that lifts an item past the threshold), k wider than a block:
    the same items as ranking the whole matrix, and the matrix `dense` hands out is not written to."""
    rng = np.random.default_rng(5)
    n_rows, n_items = 40, 300
    base = torch.from_numpy(rng.normal(size=(n_rows, n_items)).astype(np.float32))
    before = base.clone()
    rows, cols = np.nonzero(rng.random((n_rows, n_items)) < 0.05)
    values = rng.normal(scale=3.0, size=len(rows)).astype(np.float32)
    sparse = SparseRows.from_pairs(rows, cols, values, n_rows, n_items)
    full = base.numpy().copy()
    full[rows, cols] += values
    idx, score = top_k_items(n_rows, n_items, k, lambda r0, r1, i0, i1: base[r0:r1, i0:i1], sparse,
                             row_block=row_block, item_block=item_block)
    np.testing.assert_array_equal(idx, top_k(full, k))
    np.testing.assert_allclose(score, np.take_along_axis(full, idx, 1), rtol=1e-6)
    assert torch.equal(base, before)


def test_item_head_scorer_is_its_dense_scores_by_block():
    torch.manual_seed(0)
    head = ItemHead(16, 50, 3, 8, 4).eval()
    h, feats = torch.randn(9, 16), torch.rand(50, 4)
    with torch.no_grad():
        score = head.scorer(h, feats)
        for r0, r1, i0, i1 in [(0, 9, 0, 50), (2, 5, 10, 31), (8, 9, 49, 50)]:
            torch.testing.assert_close(score(r0, r1, i0, i1), head.dense(h[r0:r1], feats, i0, i1), rtol=0, atol=1e-6)


def test_softmax_loss_hand_case_and_sampled_candidates():
    # two rows over 3 items: row 0 bought items 0 and 2 (half the mass each), row 1 bought nothing
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)], [5.0, 0.0, 0.0]])
    y = SparseRows.from_pairs(np.array([0, 0]), np.array([0, 2]), np.ones(2), 2, 3)
    expected = -0.5 * (math.log(1 / 4) + math.log(2 / 4))
    assert float(sampled_softmax_loss(logits, y, None)) == pytest.approx(expected)
    # candidates [1, 2]: the softmax runs over those two; item 0 is not among them and does not count
    cand = np.array([1, 2])
    assert float(sampled_softmax_loss(logits[:, cand], y, cand)) == pytest.approx(-math.log(2 / 3))
    # no bought item among the candidates: nothing to learn, a zero loss
    assert float(sampled_softmax_loss(logits[:, :2], SparseRows.from_pairs(
        np.array([0]), np.array([2]), np.ones(1), 2, 3), np.array([0, 1]))) == 0.0


def test_candidates_hold_past_items_best_sellers_and_negatives():
    rng = np.random.default_rng(3)
    popularity = np.zeros((1000, 2), np.float32)
    popularity[[10, 20, 30], 1] = [5.0, 9.0, 7.0]  # the best-sellers, by the last channel
    hist = SparseRows.from_pairs(np.array([1, 1]), np.array([777, 5]), np.ones((2, 3)), 2, 1000)
    cand = candidates(hist, popularity, rng, popular=2, negatives=16)
    assert {5, 777, 20, 30} <= set(cand.tolist())
    assert len(cand) <= 2 + 2 + 16 and np.all(np.diff(cand) > 0)  # sorted and unique: found by binary search
    # the size follows the batch, not the catalog
    big = np.zeros((1_000_000, 2), np.float32)
    assert len(candidates(hist, big, rng, popular=2, negatives=16)) <= 20


def test_item_head_scores_candidates_as_it_scores_the_catalog():
    torch.manual_seed(0)
    head = ItemHead(hidden=6, items=20, history_channels=3, dim=4, item_channels=2)
    with torch.no_grad():
        head.gate.weight.normal_()  # a non-zero per-entity adjustment
    h = torch.randn(3, 6)
    pop = torch.rand(20, 2)
    history = (torch.tensor([0, 0, 2]), torch.tensor([4, 11, 4]), torch.rand(3, 3))
    full = head(h, pop, history)
    cand = torch.tensor([1, 4, 7, 11])
    np.testing.assert_allclose(head(h, pop, history, cand).detach(), full[:, cand].detach(), rtol=1e-5, atol=1e-6)
    # the history term lands on (row, item) only
    plain = head(h, pop, None).detach()
    diff = (full.detach() - plain).numpy()
    assert set(zip(*np.nonzero(np.abs(diff) > 1e-7))) <= {(0, 4), (0, 11), (2, 4)}


def ranking_metrics(relevant: np.ndarray, score: np.ndarray, k: int) -> dict[str, float]:
    """HR@k, NDCG@k and MAP@k from a dense relevance matrix and dense scores; rows without any
    relevant item are skipped."""
    rows, cols = np.nonzero(relevant > 0)
    return ranking_metrics_at(top_k(score, k), rows, cols, k)


def test_ranking_metrics_from_top_lists_equal_the_dense_metrics():
    rng = np.random.default_rng(4)
    relevant = (rng.random((30, 40)) < 0.1).astype(np.float32)
    score = rng.normal(size=(30, 40))
    rows, cols = np.nonzero(relevant)
    dense = ranking_metrics(relevant, score, 5)
    sparse = ranking_metrics_at(top_k(score, 5), rows, cols, 5)
    assert sparse == pytest.approx(dense)


def test_an_entity_chunk_without_any_label_history_is_empty_rows():
    none = np.array([], np.int64)
    empty = group_history(none, none, np.array([], np.float32), 4, 10, (14.0, 60.0), 30.0)
    assert len(empty) == 4 and empty.values.shape == (0, 3) and empty.dense().sum() == 0
    assert len(empty[np.array([True, False, True, False])]) == 2
