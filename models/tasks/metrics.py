"""Hold-out metrics, in NumPy so that models, baselines and benchmarks share one implementation."""

from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:  # (habitus.models.data.items imports torch; these metrics need NumPy only)
    from habitus.models.data.items import SparseRows


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties averaged."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(len(x), np.float64)
    bounds = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1, len(x)]
    avg = (bounds[:-1] + bounds[1:] + 1) / 2.0
    ranks[order] = np.repeat(avg, np.diff(bounds))
    return ranks


def auroc(y: np.ndarray, score: np.ndarray) -> float:
    y = np.asarray(y).astype(bool)
    pos, neg = y.sum(), (~y).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    r = _ranks(np.asarray(score, np.float64))
    return float((r[y].sum() - pos * (pos + 1) / 2) / (pos * neg))


def average_precision(y: np.ndarray, score: np.ndarray) -> float:
    """Area under the precision-recall steps, one step per distinct score (ties count together)."""
    y = np.asarray(y).astype(bool)
    if y.sum() == 0:
        return float("nan")
    score = np.asarray(score, np.float64)
    order = np.argsort(-score, kind="mergesort")
    hits, s = y[order], score[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # end of each group of tied scores
    tp = np.cumsum(hits)[last]
    precision = tp / (last + 1)
    recall_gain = np.diff(np.r_[0, tp]) / tp[-1]
    return float((recall_gain * precision).sum())


def macro_auroc(y: np.ndarray, score: np.ndarray, min_positives: int = 5) -> float:
    """Mean AUROC over labels with enough positives (and negatives) to measure."""
    values = [auroc(y[:, j], score[:, j]) for j in range(y.shape[1])
              if min_positives <= y[:, j].sum() <= len(y) - min_positives]
    return float(np.mean(values)) if values else float("nan")


LABEL_BLOCK_VALUES = 1 << 24  # scores ranked at a time (64 MB of float32): memory stays rows x block at any width


def measured_labels(y: "SparseRows", labels: np.ndarray | None = None, min_positives: int = 5) -> np.ndarray:
    """The label positions (sorted; of `labels`, default all) macro_auroc measures: enough positives and negatives."""
    counts, n = y.col_counts(), len(y)
    labels = np.arange(y.n_cols) if labels is None else np.unique(np.asarray(labels, np.int64))
    return labels[(counts[labels] >= min_positives) & (counts[labels] <= n - min_positives)]


def column_aurocs(score: np.ndarray, pos_rows: np.ndarray, pos_cols: np.ndarray) -> np.ndarray:
    """auroc of each column of `score` [rows, b] whose positives are the (row, column) pairs given:
    ties averaged as in auroc, from each positive's place in its sorted column, so the 0/1 matrix is never built."""
    s = np.ascontiguousarray(score.T)  # [b, rows]: one contiguous row per label
    n, srt = s.shape[1], np.sort(s, axis=1)
    order = np.argsort(pos_cols, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(pos_cols, minlength=len(s)))]
    out = np.full(len(s), np.nan)
    for j in range(len(s)):
        v = s[j, pos_rows[order[bounds[j]:bounds[j + 1]]]]
        p = len(v)
        if 0 < p < n:  # average 1-based rank of a score: (#less + #less-or-equal + 1) / 2
            ranks = (np.searchsorted(srt[j], v, "left") + np.searchsorted(srt[j], v, "right") + 1) / 2.0
            out[j] = (ranks.sum() - p * (p + 1) / 2) / (p * (n - p))
    return out


def blockwise_macro_auroc(y: "SparseRows", scorers: dict[str, Callable[[np.ndarray], np.ndarray]],
                          labels: np.ndarray | None = None, min_positives: int = 5,
                          block_values: int | None = None) -> tuple[dict[str, float], int]:
    """macro_auroc of every scorer, over `labels` (default all), with sparse targets `y` [rows, labels]:
    `scorer(cols)` gives the [rows, len(cols)] scores of those label positions, asked for a block of
    labels at a time (block_values, default LABEL_BLOCK_VALUES, // rows of them), so no [rows, labels]
    matrix ever exists.
    Returns ({name: macro AUROC}, how many labels were measured)."""
    measured = measured_labels(y, labels, min_positives)
    n = len(y)
    step = max(1, (block_values or LABEL_BLOCK_VALUES) // max(n, 1))
    y_rows, y_cols = y.rows, y.cols
    per = {name: [] for name in scorers}
    for i in range(0, len(measured), step):
        cols = measured[i:i + step]
        inside = np.isin(y_cols, cols)
        r, c = y_rows[inside], np.searchsorted(cols, y_cols[inside])
        for name, scorer in scorers.items():
            per[name].append(column_aurocs(scorer(cols), r, c))
    return {name: float(np.mean(np.concatenate(v))) if v else float("nan") for name, v in per.items()}, len(measured)


def mae(y, pred) -> float:
    return float(np.mean(np.abs(np.asarray(y, np.float64) - pred)))


def rmse(y, pred) -> float:
    return float(np.sqrt(np.mean((np.asarray(y, np.float64) - pred) ** 2)))


def normalized_gini(y, pred) -> float:
    """Gini of the prediction's ordering over the perfect ordering's (1 = perfect, 0 = random)."""
    def gini(actual, order_by):
        actual = np.asarray(actual, np.float64)[np.argsort(-np.asarray(order_by), kind="mergesort")]
        total = actual.sum()
        if total == 0:
            return 0.0
        return float((np.cumsum(actual) / total).sum() / len(actual) - (len(actual) + 1) / (2 * len(actual)))
    best = gini(y, y)
    return gini(y, pred) / best if best else float("nan")


def top_k(score: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k best columns per row, best first."""
    k = min(k, score.shape[1])
    part = np.argpartition(-score, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(score, part, 1), axis=1, kind="mergesort")
    return np.take_along_axis(part, order, 1)


def ranking_metrics_at(top: np.ndarray, rel_rows: np.ndarray, rel_cols: np.ndarray, k: int) -> dict[str, float]:
    """HR@k, NDCG@k and MAP@k from each row's top-ranked columns (best first) and the (row, column) pairs
    that are relevant (rows without any are skipped), so a catalog of any width never needs a dense
    score or label matrix."""
    n, width = top.shape[0], min(k, top.shape[1])
    top = top[:, :width]
    n_rel = np.bincount(rel_rows, minlength=n)
    keep = n_rel > 0
    if not keep.any():
        return {f"hr@{k}": float("nan"), f"ndcg@{k}": float("nan"), f"map@{k}": float("nan")}
    span = int(max(top.max(initial=0), rel_cols.max(initial=0))) + 1
    relevant_keys = np.asarray(rel_rows, np.int64) * span + rel_cols
    hits = np.isin(np.arange(n, dtype=np.int64)[:, None] * span + top, relevant_keys)[keep].astype(np.float64)
    n_rel = n_rel[keep]
    discount = 1.0 / np.log2(np.arange(2, width + 2))
    ideal = np.cumsum(discount)[np.minimum(n_rel, width) - 1]
    precision_at = np.cumsum(hits, 1) / np.arange(1, width + 1)
    ap = (precision_at * hits).sum(1) / np.minimum(n_rel, width)
    return {f"hr@{k}": float((hits.sum(1) > 0).mean()), f"ndcg@{k}": float(((hits * discount).sum(1) / ideal).mean()),
            f"map@{k}": float(ap.mean())}


def list_metrics(top: np.ndarray, rel_rows: np.ndarray, rel_cols: np.ndarray, k: int) -> dict[str, float]:
    """Metrics of written top-k lists (label positions, best first; a position past every label pads a
    short list) against the (row, column) pairs that were relevant: ranking_metrics_at's HR@k, NDCG@k,
    MAP@k, and precision@k (the share of the k positions that were relevant), over the rows with at
    least one relevant column."""
    out = ranking_metrics_at(top, rel_rows, rel_cols, k)
    n, width = top.shape[0], min(k, top.shape[1])
    keep = np.bincount(rel_rows, minlength=n) > 0
    if not keep.any() or width == 0:
        return {**out, f"precision@{k}": float("nan")}
    span = int(max(top.max(initial=0), rel_cols.max(initial=0))) + 1
    hits = np.isin(np.arange(n, dtype=np.int64)[:, None] * span + top[:, :width],
                   np.asarray(rel_rows, np.int64) * span + rel_cols)[keep]
    return {**out, f"precision@{k}": float(hits.sum(1).mean() / k)}
