"""habitus.models.tasks.metrics against small cases computed by hand."""

import math

import numpy as np
import pytest

from habitus.models.tasks.metrics import (auroc, average_precision, macro_auroc, mae, normalized_gini, ranking_metrics_at,
                                          rmse, top_k)


def ranking_metrics(relevant: np.ndarray, score: np.ndarray, k: int) -> dict[str, float]:
    """HR@k, NDCG@k and MAP@k from a dense relevance matrix and dense scores; rows without any
    relevant item are skipped."""
    rows, cols = np.nonzero(relevant > 0)
    return ranking_metrics_at(top_k(score, k), rows, cols, k)


def test_auroc_hand_case_with_ties():
    # positives score {0.8, 0.6, 0.9}, negatives {0.8, 0.2}: of the 6 pairs, 4 are won and the tie
    # 0.8 vs 0.8 counts one half -> 4.5 / 6
    y = np.array([1, 0, 1, 0, 1])
    score = np.array([0.8, 0.8, 0.6, 0.2, 0.9])
    assert auroc(y, score) == pytest.approx(0.75)


def test_auroc_perfect_reversed_and_all_tied():
    y = np.array([0, 0, 1, 1, 1])
    score = np.array([0.1, 0.2, 0.3, 0.4, 0.5])
    assert auroc(y, score) == pytest.approx(1.0)
    assert auroc(y, -score) == pytest.approx(0.0)
    assert auroc(y, np.zeros(5)) == pytest.approx(0.5)


def test_auroc_single_class_is_nan():
    assert math.isnan(auroc(np.ones(4), np.arange(4.0)))
    assert math.isnan(auroc(np.zeros(4), np.arange(4.0)))


def test_average_precision_hand_case():
    # ranked: hit, miss, hit, miss -> precision at the hits 1 and 2/3
    y = np.array([1, 0, 1, 0])
    score = np.array([0.9, 0.8, 0.7, 0.1])
    assert average_precision(y, score) == pytest.approx((1 + 2 / 3) / 2)
    # the same rows in another order give the same value
    perm = np.array([3, 1, 0, 2])
    assert average_precision(y[perm], score[perm]) == pytest.approx((1 + 2 / 3) / 2)
    # reversed: miss, hit, miss, hit -> precision 1/2 and 2/4
    assert average_precision(y, -score) == pytest.approx((1 / 2 + 2 / 4) / 2)
    assert math.isnan(average_precision(np.zeros(3), np.arange(3.0)))


def test_average_precision_does_not_depend_on_row_order_for_tied_scores():
    # one positive and one negative with the same score: the only threshold recalls everything at
    # precision 1/2 (sklearn.metrics.average_precision_score gives 0.5 for both orders)
    tied = np.array([0.5, 0.5])
    assert average_precision(np.array([1, 0]), tied) == pytest.approx(0.5)
    assert average_precision(np.array([0, 1]), tied) == pytest.approx(0.5)


def test_macro_auroc_skips_labels_with_too_few_positives_or_negatives():
    n = 8
    ranks = np.arange(n, dtype=float)
    y = np.zeros((n, 4))
    score = np.tile(ranks[:, None], (1, 4))
    y[7, 0] = 1  # label 0: one positive -> skipped
    y[5:, 1] = 1  # label 1: 3 positives ranked on top -> 1.0
    y[:3, 2] = 1  # label 2: 3 positives ranked at the bottom -> 0.0
    y[1:, 3] = 1  # label 3: one negative -> skipped
    assert macro_auroc(y, score, min_positives=2) == pytest.approx(0.5)
    # with a lower bar every label counts: (1 + 1 + 0 + 1) / 4, the single negative of label 3 is rank 0
    assert macro_auroc(y, score, min_positives=1) == pytest.approx(0.75)
    assert math.isnan(macro_auroc(y, score, min_positives=4))


def test_mae_and_rmse():
    y = np.array([1.0, 2.0, 3.0])
    pred = np.array([2.0, 2.0, 5.0])
    assert mae(y, pred) == pytest.approx(1.0)
    assert rmse(y, pred) == pytest.approx(math.sqrt(5 / 3))
    assert mae(y, y) == 0.0 and rmse(y, y) == 0.0


def test_normalized_gini():
    y = np.array([3.0, 0.0, 1.0, 7.0, 2.0])
    assert normalized_gini(y, y) == pytest.approx(1.0)
    assert normalized_gini(y, np.log1p(y) * 3 + 10) == pytest.approx(1.0)  # only the order matters
    # by hand: y = [3, 0, 1], ordered by pred desc -> [1, 0, 3]; cumulative shares .25, .25, 1
    # gini = 1.5 / 3 - 4 / 6 = -1/6; perfect order [3, 1, 0] -> (.75 + 1 + 1) / 3 - 4 / 6 = 1/4
    assert normalized_gini([3.0, 0.0, 1.0], np.array([0.1, 0.5, 0.9])) == pytest.approx(-2 / 3)
    assert math.isnan(normalized_gini(np.zeros(3), np.arange(3.0)))


def test_top_k_orders_best_first():
    score = np.array([[0.1, 0.9, 0.5, 0.7],
                      [4.0, 3.0, 2.0, 1.0]])
    np.testing.assert_array_equal(top_k(score, 2), [[1, 3], [0, 1]])
    np.testing.assert_array_equal(top_k(score, 3), [[1, 3, 2], [0, 1, 2]])
    np.testing.assert_array_equal(top_k(score, 10), [[1, 3, 2, 0], [0, 1, 2, 3]])  # k is capped


def test_ranking_metrics_hand_case():
    score = np.array([[0.9, 0.8, 0.1, 0.5],    # top 2 = items 0, 1: one hit, at rank 2
                      [0.2, 0.95, 0.4, 0.3],   # top 2 = items 1, 2: the relevant item 3 is missed
                      [0.1, 0.2, 0.3, 0.4]])   # nothing relevant: skipped
    relevant = np.array([[0, 1, 1, 0],
                         [0, 0, 0, 1],
                         [0, 0, 0, 0]])
    m = ranking_metrics(relevant, score, 2)
    dcg_a = 1 / math.log2(3)
    ideal_a = 1 + 1 / math.log2(3)
    assert m["hr@2"] == pytest.approx(0.5)
    assert m["ndcg@2"] == pytest.approx((dcg_a / ideal_a + 0.0) / 2)
    # AP@2 of row 0: precision 1/2 at its only hit, over min(2 relevant, k=2)
    assert m["map@2"] == pytest.approx((0.25 + 0.0) / 2)


def test_ranking_metrics_perfect_and_empty():
    relevant = np.array([[1, 0, 0], [0, 0, 1]])
    score = relevant + 0.1 * np.arange(3)
    m = ranking_metrics(relevant, score, 1)
    assert m == pytest.approx({"hr@1": 1.0, "ndcg@1": 1.0, "map@1": 1.0})
    empty = ranking_metrics(np.zeros((2, 3)), score, 1)
    assert all(math.isnan(v) for v in empty.values())
