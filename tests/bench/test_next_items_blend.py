"""bench/next_items_blend.py: its exact softmax over the catalog (one sum over the catalog plus one
correction per history entry) equals the softmax over a dense [entities, catalog] score matrix,
and its blockwise ranking puts the scorer's best items first."""

import sys
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from next_items_blend import Scorer, item_stats, nll, ranked, softmax_rows  # noqa: E402

from habitus.models.data.items import SparseRows  # noqa: E402


def _data(seed=0, n=40, items=30):
    rng = np.random.default_rng(seed)
    pairs = {(int(r), int(c)) for r, c in zip(rng.integers(0, n, 200), rng.integers(0, items, 200))}
    rows, cols = map(np.array, zip(*sorted(pairs)))
    hist = SparseRows.from_pairs(rows, cols, rng.random((len(rows), 3)).astype(np.float32), n, items)
    bought = {(int(r), int(c)) for r, c in zip(rng.integers(0, n - 5, 60), rng.integers(0, items, 60))}
    yr, yc = map(np.array, zip(*sorted(bought)))
    y = SparseRows.from_pairs(yr, yc, np.ones(len(yr), np.float32), n, items)
    return hist, y, rng.random((items, 2)).astype(np.float32)


def _scorer():
    s = Scorer()
    with torch.no_grad():
        s.w_hist.copy_(torch.tensor([0.5, 2.0, -1.0]))
        s.w_item.copy_(torch.tensor([0.3, -0.2, 0.1, 0.7]))
        s.w_cross.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 10)
    return s


def test_exact_softmax_matches_the_dense_one():
    hist, y, pop = _data()
    s = _scorer()
    with torch.no_grad():
        got = float(nll(s, softmax_rows(hist, y, pop)))
        stats = torch.from_numpy(item_stats(hist, pop))
        dense = s.item(stats).double().expand(len(hist), -1).clone()
        extra = s.history(torch.from_numpy(hist.values), stats[torch.from_numpy(hist.cols)]).double()
        dense[torch.from_numpy(hist.rows), torch.from_numpy(hist.cols)] += extra
        logp = torch.log_softmax(dense, 1)
    per_row = np.bincount(y.rows, minlength=len(y))
    want = -sum(float(logp[r, c]) / per_row[r] for r, c in zip(y.rows, y.cols)) / (per_row > 0).sum()
    assert abs(got - want) < 1e-9


def test_ranking_hits_what_the_scorer_ranks_first():
    hist, _, pop = _data(1)
    s = _scorer()
    with torch.no_grad():
        stats = torch.from_numpy(item_stats(hist, pop))
        dense = s.item(stats).expand(len(hist), -1).clone()
        dense[torch.from_numpy(hist.rows), torch.from_numpy(hist.cols)] += s.history(
            torch.from_numpy(hist.values), stats[torch.from_numpy(hist.cols)])
    best = dense.argmax(1).numpy()
    y = SparseRows.from_pairs(np.arange(len(hist)), best, np.ones(len(hist), np.float32), len(hist), hist.n_cols)
    assert ranked(s, hist, y, pop, k=1)["hr@1"] == 1.0
