"""Next items in two stages: the fine-tuned network retrieves each entity's RERANK_CANDIDATES best
items over the whole catalog (blockwise, so 1M items work), and gradient-boosted trees trained with a
ranking objective (LightGBM lambdarank, NDCG@k) re-order them.

The network's softmax over the catalog rewards spreading probability over items the entity has not
bought, while NDCG@10 rewards ordering the few it will buy: fine-tuning lowered the validation loss
and never improved the validation ranking (docs/journal/quality.md). The trees read, per (entity,
candidate): the network's score and rank, the entity's own history of the item (decayed counts,
recency), the item's popularity at the cut-off and the size of the entity's history, and are
trained on the training cut-offs with a listwise objective: "own history predicts a repeat" is
learned once for every item, as the pairwise propensity scorer does for labels.

Chosen on validation: the validation entities are split in two by their index; the trees stop
early on one half and are kept only if they beat the network's NDCG@k on the other. The trees
travel inside the item head's state (`ItemHead.reranker`, the model's text dump as bytes), so the
checkpoint, its fingerprint and every reader of the model carry them without another file.
"""

import time
import warnings

import numpy as np

from habitus.models.data.items import SparseRows
from habitus.models.tasks.metrics import ranking_metrics_at

RERANK_CANDIDATES = 50  # items the network retrieves per entity for the trees to re-order
RERANK_GROUPS = 20_000  # (entity, cut-off) lists the trees train on at most (about 1M candidate rows)
TREES = {"n_estimators": 300, "learning_rate": 0.05, "num_leaves": 31, "min_child_samples": 50, "subsample": 0.8,
         "subsample_freq": 1, "colsample_bytree": 0.8, "verbose": -1, "n_jobs": 1, "random_state": 0}


def candidate_features(top: np.ndarray, scores: np.ndarray, hist: SparseRows, popularity: np.ndarray) -> np.ndarray:
    """[rows, candidates, features] for the network's candidates `top` (their `scores`, best first):
    score, score below the row's best, rank; the row's history of the item (every channel; zero where
    it never touched it) and whether it did; the item's popularity channels; the row's history size
    and total habitual mass, and the item's share of it."""
    n, m = top.shape
    channels = hist.values.shape[1]
    own = np.zeros((n, m, channels), np.float32)
    if len(hist.cols):
        keys = hist.rows * np.int64(hist.n_cols) + hist.cols  # sorted: rows by row, then item
        want = (np.arange(n)[:, None] * np.int64(hist.n_cols) + top).ravel()
        at = np.searchsorted(keys, want).clip(max=len(keys) - 1)
        found = keys[at] == want
        own.reshape(n * m, channels)[found] = hist.values[at[found]]
    touched = (own != 0).any(-1, keepdims=True).astype(np.float32)
    size = np.diff(hist.indptr).astype(np.float32)
    mass = np.bincount(hist.rows, hist.values[:, 1] if channels > 1 else hist.values[:, 0], minlength=n)
    per_row = lambda v: np.broadcast_to(np.asarray(v, np.float32)[:, None, None], (n, m, 1))  # noqa: E731
    share = own[..., 1:2] / np.maximum(mass, 1e-6)[:, None, None] if channels > 1 else own[..., :1] * 0
    return np.concatenate([scores[..., None], (scores[:, :1] - scores)[..., None],
                           np.broadcast_to(np.arange(m, dtype=np.float32)[None, :, None], (n, m, 1)),
                           own, touched, popularity[top].astype(np.float32), per_row(size), per_row(mass), share],
                          -1).astype(np.float32)


def rerank(booster, top: np.ndarray, scores: np.ndarray, hist: SparseRows, popularity: np.ndarray,
           k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each row's candidates by the trees: (item positions, the trees' scores), best first."""
    n, m = top.shape
    if n == 0:
        return top[:, :k], scores[:, :k]
    s = booster.predict(candidate_features(top, scores, hist, popularity).reshape(n * m, -1)).reshape(n, m)
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(top, order, 1), np.take_along_axis(s, order, 1).astype(np.float32)


def _lists(retrieve, arrays, m: int, rows_cap: int):
    """(features [groups, m, F], relevance [groups, m], candidates, bought items) of the entities that
    bought something, from (features, history, targets, popularity) chunks, at most rows_cap of them."""
    feats, rel, tops, ys, n = [], [], [], [], 0
    for x, h, y, pop, *_ in arrays:
        bought = np.flatnonzero(np.diff(y.indptr) > 0)[: rows_cap - n]
        if not len(bought):
            continue
        hb, yb = h[bought], y[bought]
        top, scores = retrieve(x[bought], hb, pop, m)
        ykeys = yb.rows * np.int64(yb.n_cols) + yb.cols
        rel.append(np.isin(np.arange(len(bought))[:, None] * np.int64(yb.n_cols) + top, ykeys).astype(np.float32))
        feats.append(candidate_features(top, scores, hb, pop))
        tops.append(top)
        ys.append(yb)
        n += len(bought)
        if n >= rows_cap:
            break
    return feats, rel, tops, ys


def _ndcg(tops: list[np.ndarray], ys: list[SparseRows], k: int) -> float:
    total = sum(ranking_metrics_at(t[:, :k], y.rows, y.cols, k)[f"ndcg@{k}"] * len(t) for t, y in zip(tops, ys))
    return total / max(sum(len(t) for t in tops), 1)


def fit_reranker(head, retrieve, train, val, k: int, log=print) -> dict:
    """Train the trees on the training cut-offs' chunks `train` (iterables of (x, h, y, popularity)),
    choose them on the validation chunks `val`; sets the item head's reranker where they win.
    `retrieve(x, h, popularity, m)`: the network's m best items of those rows and their scores
    (habitus.models.tasks.recommendation.rank_items without re-ranking). Returns what was measured (validation NDCG@k of
    the network and of the trees, on the held half)."""
    try:
        import lightgbm as lgb
    except ImportError:
        return {"chosen": "network", "reason": "LightGBM is not installed"}
    started = time.time()
    m = max(RERANK_CANDIDATES, k)
    feats, rel, _, _ = _lists(retrieve, train, m, RERANK_GROUPS)
    vfeats, vrel, vtops, vys = _lists(retrieve, val, m, RERANK_GROUPS)
    if not feats or not vfeats:
        return {"chosen": "network", "reason": "no entity bought anything at a training or the validation cut-off"}
    x, y = np.concatenate(feats), np.concatenate(rel)
    vx, vy, vtop = np.concatenate(vfeats), np.concatenate(vrel), np.concatenate(vtops)
    bought = SparseRows.stack(vys, vys[0].n_cols)  # what the validation entities bought
    stop, held = np.arange(len(vx)) % 2 == 0, np.arange(len(vx)) % 2 == 1  # early stopping / the choice
    if held.sum() == 0 or y.sum() == 0:
        return {"chosen": "network", "reason": "too few validation entities"}
    width, f = x.shape[1], x.shape[-1]  # (a catalog smaller than RERANK_CANDIDATES: all of it)
    ranker = lgb.LGBMRanker(**TREES)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # the spelling 4.0-4.6 know
        ranker.fit(x.reshape(-1, f), y.reshape(-1), group=np.full(len(x), width),
                   eval_set=[(vx[stop].reshape(-1, f), vy[stop].reshape(-1))],
                   eval_group=[np.full(int(stop.sum()), width)], eval_at=[k],
                   callbacks=[lgb.early_stopping(30, verbose=False)])
    booster = ranker.booster_
    s = booster.predict(vx[held].reshape(-1, f), num_iteration=ranker.best_iteration_).reshape(-1, width)
    reordered = np.take_along_axis(vtop[held], np.argsort(-s, axis=1, kind="stable"), 1)
    held_y = bought[np.flatnonzero(held)]
    network, trees = _ndcg([vtop[held]], [held_y], k), _ndcg([reordered], [held_y], k)
    chosen = "trees" if trees > network else "network"
    if chosen == "trees":
        head.set_reranker(booster.model_to_string(num_iteration=ranker.best_iteration_))
    out = {"chosen": chosen, f"val_ndcg@{k}_network": network, f"val_ndcg@{k}_trees": trees,
           "trees": int(ranker.best_iteration_ or TREES["n_estimators"]), "candidates": width, "lists": len(x),
           "seconds": round(time.time() - started, 1)}
    log(f"recommendation re-ranking: validation NDCG@{k} network {network:.4f}, trees {trees:.4f} "
        f"({out['trees']} trees on {len(x):,} lists): {chosen}")
    return out

