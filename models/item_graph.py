"""Item embeddings from the entity-item graph, as of a cut-off (issue 15, item 3).

Entities who buy similar things should sit near each other even where the per-value histograms
cannot see it (the long tail that shares hash buckets, a catalog of 1M items). At a cut-off c, every
item of `column` gets an embedding from the graph of who bought what at or before c only, so a
feature at c never reads the window after it, and neither does the graph its items are placed by:

- a randomized factorization with a fixed basis (Cleora-style propagation): every item starts at a
  fixed random vector R_i (a seeded stream: the same vector for an id at every cut-off and for every
  vocabulary size); each iteration averages the items of every entity (an entity's profile), then sums
  the profiles of every item's buyers, centres and L2-normalizes. One iteration is a random projection
  of each item's co-occurrence row (Johnson-Lindenstrauss), two are its two-hop neighbourhood. The
  basis stays the same across cut-offs (no SVD signs or rotations to align), so a network trained on
  the graphs of many cut-offs reads the graph of a later one the same way;
- items with few buyers are shrunk towards their attribute embedding, the mean of the items that
  share their attribute values (the cache's lookups of `column`: brand, category, ...), and an item
  with no buyer yet is that attribute embedding: an item first seen today is placed by its attributes;
- the cost is blockwise over shards: per iteration one sparse product per shard with `dim` columns
  (nnz x dim), an [items, dim] table, never an [entities, items] or [items, items] matrix.

`features.featurize` appends each entity's decayed-count-weighted mean of its items' embeddings
(`graph_features`). The cache that holds the graph is found by the lineage the spec records:
`register(cache)` before featurizing (the foundation and fine-tuning do it; predict must too).
"""

import weakref

import numpy as np
from scipy import sparse

GRAPH_HALF_LIFE = 60.0  # days: an entity's items weighed by their decayed counts, "habitually"
MEMO_BYTES = 512 << 20  # graphs kept per cache, newest last; older ones are computed again
_SOURCES: dict[str, "weakref.ref"] = {}  # lineage -> the cache whose events make the graph
_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # cache -> {key: table}


def graph_config(cache, dim: int, column: str = "", iterations: int = 2, prior: float = 2.0, seed: int = 0) -> dict:
    """What FeatureSpec.graph records: the column (default: the event categorical column with the
    largest vocabulary, the items), the width, the iterations, the attribute prior (in buyers) and the
    seed of the basis, and the cache's lineage."""
    if not column:
        cats = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
        if not cats:
            raise ValueError("graph inputs need a categorical event column (the items); the cache has none")
        column = max(cats, key=cats.get)
    return {"column": column, "dim": int(dim), "iterations": int(iterations), "prior": float(prior),
            "seed": int(seed), "lineage": cache.lineage}


def register(cache) -> None:
    """Make `cache` the graph's source for its lineage. A view with fewer entities (an EntitySubset:
    labels of some entities only) does not replace the whole cache; a cache with as many or more (a
    newer version of the lineage) does."""
    ref = _SOURCES.get(cache.lineage)
    old = ref() if ref is not None else None
    if old is None or old is cache or cache.n_entities >= old.n_entities:
        _SOURCES[cache.lineage] = weakref.ref(cache)


def source(graph: dict):
    ref = _SOURCES.get(graph["lineage"])
    cache = ref() if ref is not None else None
    if cache is None:
        raise RuntimeError(f"the model's inputs include item-graph embeddings of {graph['column']!r}: call "
                           "models.item_graph.register(cache) with the cache being scored before featurizing")
    return cache


def basis(n: int, dim: int, seed: int) -> np.ndarray:
    """[n, dim] fixed random start vectors; row i is the same for every n (one seeded stream)."""
    return (np.random.default_rng(seed).standard_normal((n, dim)) / np.sqrt(dim)).astype(np.float32)


def _normalize(e: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = np.zeros_like(e)
    if rows.any():
        z = e[rows] - e[rows].mean(0)
        out[rows] = z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
    return out


def _attributes(cache, column: str) -> list[np.ndarray]:
    """The value ids of each attribute of `column` (the cache's lookups keyed by it), per item id."""
    out = []
    for lookup in cache.manifest.get("lookups", []):
        if lookup["key"] == column:
            out += [v.astype(np.int64) for c, v in cache._lookup(lookup["file"]).items()
                    if cache.columns.get(c, {}).get("type") == "categorical"]
    return out


def _shard_graphs(cache, column: str, n: int, cutoff: int):
    """Per shard: its (entity, item) matrix of the events at or before `cutoff`, log(1 + count)
    weighted, and the inverse of each entity's total weight (a profile is the mean of its items).
    Built again at each iteration: one shard's matrix in memory at a time."""
    for s in range(cache.shard_count):
        sh = cache.shard(s)
        seen = sh.ts <= cutoff
        ent = np.searchsorted(sh.entities, sh.entity[seen])
        items = sh.columns[column][seen].astype(np.int64)
        a = sparse.csr_matrix((np.ones(len(items), np.float32), (ent, items)), shape=(len(sh.entities), n))
        a.sum_duplicates()
        a.data = np.log1p(a.data)
        norm = np.asarray(a.sum(1)).ravel()
        yield a, sparse.diags((1.0 / np.maximum(norm, 1e-12)).astype(np.float32))


def fit(cache, graph: dict, cutoff: int) -> np.ndarray:
    """[vocab + 1, dim] float32 item embeddings from the events at or before `cutoff` only (row 0, the
    null item, is zero)."""
    column, dim = graph["column"], graph["dim"]
    n = int(cache.columns[column]["vocab_size"]) + 1
    emb = basis(n, dim, graph["seed"])
    emb[0] = 0.0
    buyers = np.zeros(n, np.float64)
    for it in range(max(graph["iterations"], 1)):
        acc = np.zeros((n, dim), np.float32)
        for a, inv in _shard_graphs(cache, column, n, cutoff):  # each item: the sum of its buyers' profiles
            acc += a.T @ (inv @ (a @ emb))
            if it == 0:
                buyers += np.bincount(a.indices, minlength=n)
        bought = buyers > 0
        bought[0] = False
        emb = _normalize(acc, bought)
    prior = np.zeros((n, dim), np.float64)
    parts = np.zeros(n, np.float64)
    for values in _attributes(cache, column):  # the mean embedding of the bought items of each value
        values = values[:n] if len(values) >= n else np.r_[values, np.zeros(n - len(values), np.int64)]
        m = int(values.max()) + 1 if len(values) else 1
        w = bought.astype(np.float64)
        sums = np.stack([np.bincount(values, w * emb[:, k], minlength=m) for k in range(dim)], 1)
        count = np.bincount(values, w, minlength=m)
        known = (count > 0) & (np.arange(m) > 0)  # (value 0: null)
        sums[known] /= count[known, None]
        has = known[values]
        prior[has] += sums[values[has]]
        parts += has
    prior[parts > 0] /= parts[parts > 0, None]
    k = graph["prior"]
    out = (buyers[:, None] * emb + k * prior) / np.maximum(buyers + k, 1e-12)[:, None]
    out[0] = 0.0
    return out.astype(np.float32)


def embeddings_at(graph: dict, cutoff: int) -> np.ndarray:
    """The item embeddings at `cutoff` of the registered cache, computed once per cut-off and kept
    within MEMO_BYTES."""
    cache = source(graph)
    memo = _GRAPHS.setdefault(cache, {})
    key = (int(cutoff), graph["column"], graph["dim"], graph["iterations"], graph["prior"], graph["seed"])
    if key not in memo:
        table = fit(cache, graph, int(cutoff))
        while memo and sum(t.nbytes for t in memo.values()) + table.nbytes > MEMO_BYTES:
            memo.pop(next(iter(memo)))
        memo[key] = table
    return memo[key]


def graph_features(chunk, graph: dict) -> np.ndarray:
    """[n, dim]: each entity's mean of its items' embeddings at the chunk's cut-off, weighted by
    decayed counts (half-life GRAPH_HALF_LIFE), scaled by sqrt(dim) so its columns are O(1)."""
    table = embeddings_at(graph, chunk.cutoff)
    ids = chunk.shard.columns[graph["column"]][chunk.rows].astype(np.int64)
    ids = np.where(ids < len(table), ids, 0)
    w = np.exp2(-chunk.age_days / GRAPH_HALF_LIFE).astype(np.float32) * (ids > 0)
    if chunk.n == 0 or not len(ids):
        return np.zeros((chunk.n, graph["dim"]), np.float32)
    begins = np.r_[0, np.flatnonzero(np.diff(chunk.local)) + 1]  # events are in (entity, time) order
    num = np.add.reduceat(table[ids] * w[:, None], begins, axis=0)
    den = np.add.reduceat(w, begins)
    out = np.zeros((chunk.n, graph["dim"]), np.float32)
    out[chunk.local[begins]] = num / np.maximum(den, 1e-12)[:, None] * np.sqrt(graph["dim"])
    return out
