"""Sparse per-entity label sets and the catalog-scale pieces of recommendation.

A catalog can hold up to a million items, so nothing here builds an [entities, catalog] matrix for
more than a block of rows and a block of items at a time: an entity's item history and its future
purchases are sparse rows (`SparseRows`), training ranks a sampled candidate set whose size does
not grow with the catalog (`candidates`), and inference keeps a running top-k over item blocks
(`top_k_items`).
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

SAMPLED_NEGATIVES = 1_024  # uniform negatives per training batch
# a block of [ROW_BLOCK, ITEM_BLOCK] scores at a time: 2 MB, under models/storage/heap.py's mmap threshold (a
# bigger block is a fresh mapping, page-faulted in at every block: 1M items, k 10, 672 -> 235 rows/s at 8 MB)
ITEM_BLOCK = 512
ROW_BLOCK = 1_024
RERANK_POPULAR = 200  # training ranks the entities' past items and this many best-sellers


@dataclass
class SparseRows:
    """A row-compressed sparse matrix [rows, n_cols]: row r holds cols[indptr[r]:indptr[r+1]] with
    `values` (one vector of channels per entry). Indexing with a mask or index array selects rows,
    like a NumPy array, so features, label histories and targets are cut the same way."""

    indptr: np.ndarray  # [rows + 1] int64
    cols: np.ndarray  # [nnz] int64, label position
    values: np.ndarray  # [nnz, channels] float32
    n_cols: int

    @classmethod
    def from_pairs(cls, rows: np.ndarray, cols: np.ndarray, values: np.ndarray, n_rows: int, n_cols: int) -> "SparseRows":
        """Entries given in any order (each (row, col) at most once)."""
        order = np.lexsort((cols, rows))
        counts = np.bincount(rows, minlength=n_rows)
        values = np.asarray(values, np.float32)
        values = values[:, None] if values.ndim == 1 else values  # one channel, or [entries, channels]
        return cls(np.r_[0, np.cumsum(counts)].astype(np.int64), cols[order].astype(np.int64), values[order], n_cols)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    @property
    def rows(self) -> np.ndarray:
        """The row of every entry."""
        return np.repeat(np.arange(len(self)), np.diff(self.indptr))

    @property
    def nbytes(self) -> int:
        return self.indptr.nbytes + self.cols.nbytes + self.values.nbytes

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.n_cols

    def __getitem__(self, index) -> "SparseRows":
        index = np.asarray(index)
        if index.dtype == bool:
            index = np.flatnonzero(index)
        starts, lengths = self.indptr[index], np.diff(self.indptr)[index]
        indptr = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        take = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1])
        return SparseRows(indptr, self.cols[take], self.values[take], self.n_cols)

    @classmethod
    def stack(cls, parts: list["SparseRows"], n_cols: int, channels: int = 1) -> "SparseRows":
        """The rows of `parts`, one part under another."""
        if not parts:
            return cls(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros((0, channels), np.float32), n_cols)
        indptr = np.r_[0, np.cumsum(np.concatenate([np.diff(p.indptr) for p in parts]))].astype(np.int64)
        return cls(indptr, np.concatenate([p.cols for p in parts]), np.concatenate([p.values for p in parts]), n_cols)

    def dense(self, channel: int = 0, cols: np.ndarray | None = None) -> np.ndarray:
        """One channel as [rows, n_cols], or as [rows, len(cols)] for the sorted positions `cols` only."""
        if cols is None:
            out = np.zeros((len(self), self.n_cols), np.float32)
            out[self.rows, self.cols] = self.values[:, channel]
            return out
        out = np.zeros((len(self), len(cols)), np.float32)
        if len(cols):
            at = np.searchsorted(cols, self.cols).clip(max=len(cols) - 1)
            inside = cols[at] == self.cols
            out[self.rows[inside], at[inside]] = self.values[inside, channel]
        return out

    def col_counts(self) -> np.ndarray:
        """How many rows hold each column."""
        return np.bincount(self.cols, minlength=self.n_cols)


def group_history(local: np.ndarray, pos: np.ndarray, age_days: np.ndarray, n_rows: int, n_labels: int,
                  half_lives, recency_days: float) -> SparseRows:
    """Per (row, label) touched: decayed counts per half-life (log-scaled) and the decayed recency
    of the last touch, as in features.value_history but without the dense [rows, labels] matrix."""
    key = local.astype(np.int64) * n_labels + pos
    uniq, inverse = np.unique(key, return_inverse=True)
    values = np.empty((len(uniq), len(half_lives) + 1), np.float32)
    for k, h in enumerate(half_lives):
        values[:, k] = np.log1p(np.bincount(inverse, np.exp2(-age_days / h), minlength=len(uniq)))
    recency = np.full(len(uniq), -np.inf)
    np.maximum.at(recency, inverse, np.exp2(-age_days / recency_days))
    values[:, -1] = recency
    # the unique keys are sorted by row, then label: the rows' order already (no sort in from_pairs)
    indptr = np.r_[0, np.cumsum(np.bincount(uniq // n_labels, minlength=n_rows))].astype(np.int64)
    return SparseRows(indptr, uniq % n_labels, values, n_labels)


def batch_history(hist: SparseRows, dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, col, values) tensors of a batch's sparse rows."""
    return (torch.from_numpy(hist.rows).to(dev), torch.from_numpy(hist.cols).to(dev),
            torch.from_numpy(hist.values).to(dev))


def candidates(hist: SparseRows, popularity: np.ndarray, rng: np.random.Generator, popular: int | None = None,
               negatives: int | None = None) -> np.ndarray:
    """The items a training batch is ranked over (sorted, unique): what a top-k list is made of (the
    batch's entities' past items and the current best-sellers, `popularity` [items, channels] ranked
    by its last channel) plus uniform negatives, so that items outside both still learn to stay
    low. Its size does not grow with the catalog."""
    popular = RERANK_POPULAR if popular is None else popular
    negatives = SAMPLED_NEGATIVES if negatives is None else negatives
    n_items = len(popularity)
    best = np.argpartition(-popularity[:, -1], min(popular, n_items) - 1)[:popular]
    return np.unique(np.concatenate([hist.cols, best, rng.integers(0, n_items, negatives)]))


def sampled_softmax_loss(logits: torch.Tensor, y: SparseRows, cand: np.ndarray | None) -> torch.Tensor:
    """Cross-entropy of the softmax over the candidates against the batch's bought items that are
    among them (each entity's purchases share its probability mass); entities that bought none of
    the candidates do not count."""
    rows, cols = y.rows, y.cols
    if cand is not None:
        pos = np.searchsorted(cand, cols).clip(max=len(cand) - 1)
        inside = cand[pos] == cols
        rows, cols = rows[inside], pos[inside]
    if len(rows) == 0:
        return logits.sum() * 0.0
    dev = logits.device
    per_row = np.bincount(rows, minlength=len(y)).astype(np.float32)
    if not (per_row > 0).any():
        return logits.sum() * 0.0
    weight = torch.from_numpy(1.0 / per_row[rows]).to(dev)
    logp = torch.log_softmax(logits, 1)
    picked = logp[torch.from_numpy(rows).to(dev), torch.from_numpy(cols).to(dev)]
    return -(picked * weight).sum() / float((per_row > 0).sum())


DenseBlock = Callable[[int, int, int, int], torch.Tensor]  # (row lo, row hi, item lo, item hi) -> scores


@torch.no_grad()
def top_k_items(n_rows: int, n_items: int, k: int, dense: DenseBlock, sparse: SparseRows | None = None,
                *, row_block: int | None = None, item_block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The k best items per row, best first, as (indices [rows, k], scores [rows, k]), where an item's
    score is dense(row, item) plus the row's sparse entry for it (values[:, 0]) if it has one. Only a
    [row_block, item_block] block of scores exists at any time, small enough to stay in the CPU's cache.

    Each block is compared with every row's k-th best score so far, and only the rows with a score
    above it are ranked again: after the first blocks few items beat the running top k, so the cost
    is about one matrix product and one maximum per score (torch.topk over every score cost 5-15x
    the product itself at 1M items). An item that only ties the k-th best does not enter."""
    row_block, item_block = row_block or ROW_BLOCK, item_block or ITEM_BLOCK
    k = min(k, n_items)
    best_i = np.zeros((n_rows, k), np.int64)
    best_s = np.zeros((n_rows, k), np.float32)
    for r0 in range(0, n_rows, row_block):
        r1 = min(r0 + row_block, n_rows)
        entries = _by_item(sparse[np.arange(r0, r1)] if sparse is not None else None)
        top_s = top_i = None
        for i0 in range(0, n_items, item_block):
            i1 = min(i0 + item_block, n_items)
            block = dense(r0, r1, i0, i1).float()  # read only: `dense` may hand out a view
            er, ec, ev = (t.to(block.device) for t in _entries(entries, i0, i1))
            if top_s is None or top_s.shape[1] < k:  # the first k items: every row is ranked
                rows = torch.arange(r1 - r0, device=block.device)
            else:  # a row's best here is at most its dense best or an entry's own score
                most = block.amax(1).scatter_reduce(0, er, block[er, ec] + ev, "amax")
                rows = torch.nonzero(most > top_s[:, -1]).squeeze(1)
                if not len(rows):
                    continue
            sub = block.index_select(0, rows)
            at = torch.searchsorted(rows, er).clamp_max(len(rows) - 1)
            keep = rows[at] == er
            sub.index_put_((at[keep], ec[keep]), ev[keep], accumulate=True)
            s, i = torch.topk(sub, min(k, i1 - i0), dim=1)
            i = i + i0
            if top_s is None:
                top_s, top_i = s, i
                continue
            s, j = torch.topk(torch.cat([top_s[rows], s], 1), min(k, top_s.shape[1] + s.shape[1]), dim=1)
            i = torch.gather(torch.cat([top_i[rows], i], 1), 1, j)
            if s.shape[1] > top_s.shape[1]:  # (still filling the first k: every row was ranked)
                top_s, top_i = s, i
            else:
                top_s[rows], top_i[rows] = s, i
        best_i[r0:r1], best_s[r0:r1] = top_i.cpu().numpy(), top_s.cpu().numpy()
    return best_i, best_s


def _by_item(rows: SparseRows | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block of rows' sparse entries ordered by item: (row, item, first-channel value) tensors."""
    if rows is None:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0)
    order = np.argsort(rows.cols, kind="stable")
    return (torch.from_numpy(rows.rows[order]), torch.from_numpy(rows.cols[order]),
            torch.from_numpy(np.ascontiguousarray(rows.values[order, 0], np.float32)))


def _entries(entries, i0: int, i1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, item - i0, value) of the sparse entries of items i0..i1."""
    r, c, v = entries
    lo, hi = torch.searchsorted(c, torch.tensor([i0, i1])).tolist()
    return r[lo:hi], c[lo:hi] - i0, v[lo:hi]
