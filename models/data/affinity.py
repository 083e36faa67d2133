"""What else an entity buys, and how close that is to each label: co-occurrence embeddings of the
values of every categorical column and per-label affinity features built from them.

Embeddings (`cooccurrence_vectors`): a basket is one entity's events of one day; the values of a
column that share baskets before the cut-off are counted in pairs (a sparse [values, values]
matrix, never dense), turned into positive pointwise mutual information (context counts raised to
0.75) and reduced by a randomized truncated SVD to `AffinityConfig.dim` dimensions (rows U sqrt(S),
unit length). Values seen in fewer than `min_count` baskets get no vector (zeros). Item attributes
(subclass, category, brand) are event columns of the cache, so parents get their own embeddings
from the same baskets; `attribute_columns` names them (the "category-level" arm's levels).

Per-label features (`Affinity`): for a label column L and its labels, and for every embedded column
X (the "levels": products and their parents), the label's centroid at level X is the normalized sum
of the X vectors of the events that carried the label before the cut-off. Per entity, with its
events decayed at a 60-day half-life:

- cosine: of the entity's decayed mean X vector to the label's centroid;
- mass: log(1 + the decayed count of the entity's events weighted by the positive cosine of their X
  value to the label's centroid) (how much of its history lies near the label).

Everything is fitted on events at or before the cut-off only: features at a cut-off are the same
whether or not later events exist.
"""

from dataclasses import dataclass, field

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.features import DAY, HABITUAL_DAYS, Chunk, chunk_at
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan

FEATURES_PER_LEVEL = 2  # cosine, mass


@dataclass(frozen=True)
class AffinityConfig:
    dim: int = 32  # SVD dimensions (fewer where a column has fewer values)
    min_count: int = 5  # baskets a value needs for a vector
    min_values: int = 8  # a column with fewer embedded values is not worth a level
    max_basket: int = 64  # values kept per basket (the first ones): pairs grow with its square
    half_life: float = HABITUAL_DAYS  # days: the entity's decayed history
    seed: int = 0


def attribute_columns(cache: Cache) -> tuple[str, ...]:
    """The categorical columns the cache looks up through a key (an item's attributes: its subclass,
    category, brand; neither the item id nor per-visit context such as a store), in the cache's
    column order; empty where the events have no item table."""
    looked_up = {c for lookup in cache.manifest.get("lookups", []) for c in lookup["columns"]}
    return tuple(c for c, m in cache.columns.items() if m["type"] == "categorical" and c in looked_up)


def baskets(cache: Cache, cutoff: int, columns, max_events: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(basket id per event, {column: value id per event}) of every event at or before `cutoff`; with
    `max_events`, of the first shards up to that many events (shards hold entities by a hash of their
    id: a random sample of entities, whole baskets)."""
    basket, values, offset, events = [], {c: [] for c in columns}, 0, 0
    for i in range(cache.shard_count):
        if max_events is not None and events >= max_events:
            break
        sh = cache.shard(i)
        seen = sh.ts <= cutoff
        if not seen.any():
            continue
        key = sh.entity[seen].astype(np.int64) * 1_000_000 + sh.ts[seen] // DAY
        uniq, inv = np.unique(key, return_inverse=True)
        basket.append(inv.astype(np.int64) + offset)
        offset, events = offset + len(uniq), events + len(inv)
        for c in columns:
            values[c].append(np.asarray(sh.columns[c][seen], np.int64))
    if not basket:
        return np.zeros(0, np.int64), {c: np.zeros(0, np.int64) for c in columns}
    return np.concatenate(basket), {c: np.concatenate(v) for c, v in values.items()}


def cooccurrence_vectors(basket: np.ndarray, ids: np.ndarray, vocab: int, cfg: AffinityConfig) -> np.ndarray | None:
    """[vocab + 1, d] unit vectors of the value ids `ids` (aligned with `basket`) from their PPMI over
    shared baskets, or None where fewer than `cfg.min_values` values are seen often enough."""
    import scipy.sparse as sp
    from sklearn.utils.extmath import randomized_svd

    pairs = np.unique(basket * (vocab + 1) + ids)  # (basket, value) once each, sorted by basket
    b, v = pairs // (vocab + 1), pairs % (vocab + 1)
    keep = v > 0  # 0: unknown
    b, v = b[keep], v[keep]
    rank = np.arange(len(b)) - np.searchsorted(b, b)  # position of the value within its basket
    b, v = b[rank < cfg.max_basket], v[rank < cfg.max_basket]
    count = np.bincount(v, minlength=vocab + 1)
    embedded = count >= cfg.min_count
    if embedded.sum() < cfg.min_values:
        return None
    keep = embedded[v]
    b, v = b[keep], v[keep]
    _, b = np.unique(b, return_inverse=True)
    m = sp.csr_matrix((np.ones(len(b), np.float32), (b, v)), shape=(int(b.max()) + 1, vocab + 1))
    c = (m.T @ m).tocoo()
    off = c.row != c.col
    rows, cols, n = c.row[off], c.col[off], c.data[off].astype(np.float64)
    if len(n) == 0:
        return None
    marginal = np.bincount(rows, n, minlength=vocab + 1)
    context = marginal ** 0.75
    pmi = np.log(n * context.sum() / (marginal[rows] * context[cols]))
    pos = pmi > 0
    ppmi = sp.csr_matrix((pmi[pos].astype(np.float32), (rows[pos], cols[pos])), shape=(vocab + 1, vocab + 1))
    d = int(min(cfg.dim, embedded.sum() - 1))
    u, s, _ = randomized_svd(ppmi, d, n_iter=5, random_state=cfg.seed)
    vec = (u * np.sqrt(s)).astype(np.float32)
    return _unit(np.where(embedded[:, None], vec, 0.0)).astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


@dataclass
class Affinity:
    """Per-label affinity of entities to the labels of `column` (value ids `labels`) at one cut-off:
    per level (an embedded column), its value vectors and the labels' centroids."""

    column: str
    labels: np.ndarray  # [labels] value ids of `column`
    levels: dict[str, np.ndarray] = field(default_factory=dict)  # column -> [vocab + 1, d] unit vectors
    centroids: dict[str, np.ndarray] = field(default_factory=dict)  # column -> [labels, d] unit vectors
    cfg: AffinityConfig = AffinityConfig()

    @property
    def width(self) -> int:
        """Features per label."""
        return FEATURES_PER_LEVEL * len(self.levels)

    @classmethod
    def fit(cls, cache: Cache, cutoff: int, column: str, labels, cfg: AffinityConfig | None = None,
            levels: tuple[str, ...] | None = None) -> "Affinity":
        """Embeddings of every categorical column (or `levels`) and the centroids of the labels (value
        ids of `column`), from the events at or before `cutoff` only."""
        import scipy.sparse as sp

        cfg = cfg or AffinityConfig()
        labels = np.asarray(labels, np.int64)
        cats = [c for c, m in cache.columns.items() if m["type"] == "categorical"]
        levels = tuple(cats if levels is None else levels)
        basket, values = baskets(cache, int(cutoff), set(levels) | {column})
        out = cls(column, labels, cfg=cfg)
        position = np.full(cache.columns[column]["vocab_size"] + 2, -1, np.int64)
        position[np.clip(labels, 0, len(position) - 1)] = np.arange(len(labels))
        label_of = position[np.clip(values[column], 0, len(position) - 1)]
        carried = label_of >= 0
        for c in levels:
            vec = cooccurrence_vectors(basket, values[c], cache.columns[c]["vocab_size"], cfg)
            if vec is None:
                continue
            ids = np.clip(values[c][carried], 0, len(vec) - 1)
            counts = sp.csr_matrix((np.ones(len(ids)), (label_of[carried], ids)), shape=(len(labels), len(vec)))
            centroid = counts @ vec.astype(np.float64)
            out.levels[c] = vec
            out.centroids[c] = _unit(centroid).astype(np.float32)
        return out

    def features(self, chunk: Chunk, positions: np.ndarray | None = None) -> np.ndarray:
        """[chunk.n, labels, width] float32 of the labels at `positions` (indices into `self.labels`;
        default all): per level, cosine then mass."""
        import scipy.sparse as sp

        n = chunk.n
        pick = slice(None) if positions is None else np.asarray(positions, np.int64)
        n_labels = len(self.labels) if positions is None else len(pick)
        out = np.zeros((n, n_labels, self.width), np.float32)
        if n == 0 or not self.levels:
            return out
        w = np.exp2(-chunk.age_days / self.cfg.half_life).astype(np.float64)
        for k, (c, vec) in enumerate(self.levels.items()):
            ids = np.clip(np.asarray(chunk.shard.columns[c][chunk.rows], np.int64), 0, len(vec) - 1)
            uniq, inv = np.unique(ids, return_inverse=True)
            cent = self.centroids[c][pick]
            touched = vec[uniq].astype(np.float64)  # only the values this chunk touched
            history = sp.csr_matrix((w, (chunk.local, inv)), shape=(n, len(uniq)))  # decayed counts
            out[:, :, 2 * k] = _unit(history @ touched) @ cent.T
            out[:, :, 2 * k + 1] = np.log1p(history @ np.maximum(touched @ cent.T, 0.0))
        return out


def affinity_features(cache: Cache, cutoff: int, column: str, labels, *, entities: np.ndarray | None = None,
                      cfg: AffinityConfig | None = None, levels: tuple[str, ...] | None = None,
                      chunk_entities: int = SCORING_CHUNK_ENTITIES) -> np.ndarray:
    """[len(entities), len(labels), 2 x levels]: the per-label co-occurrence affinity of `entities`
    (entity indices; default all, 0..n_entities - 1) to `labels` (value ids of `column`) at `cutoff`,
    embeddings and centroids fitted on events at or before `cutoff`; zeros for an entity without
    history. The reference arm "LightGBM + per-label co-occurrence affinity" appends row i's
    [labels, width] block to that entity's features (the label's own block to each label's model)."""
    aff = Affinity.fit(cache, cutoff, column, labels, cfg, levels)
    entities = np.arange(cache.n_entities) if entities is None else np.asarray(entities, np.int64)
    where = np.full(cache.n_entities, -1, np.int64)
    where[entities] = np.arange(len(entities))
    out = np.zeros((len(entities), len(aff.labels), aff.width), np.float32)
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
        at = where[chunk.entities]
        if (at >= 0).any():
            out[at[at >= 0]] = aff.features(chunk)[at >= 0]
    return out
