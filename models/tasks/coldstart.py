"""Items first seen after a recommendation scenario was trained: an embedding from what an item has
on its first day, in the space of the trained item embeddings.

At training, a ridge regression is fitted from each known item's attributes to what training moved
its embedding by (the item head's `items` row less its random start: the start is noise no attribute
predicts, some 25 times the movement in mean square on Ta-Feng), and saved with the head
(`ItemHead.set_item_map`). The attributes are what the cache holds about an item whatever its age:

- every categorical event column an item determines (its most frequent value covers at least
  `PURITY` of the item's events, over the catalog): a category, a brand, a subclass, a store, also
  through an attributes table joined on the item; one-hot over its `MAX_VALUES` most common values;
- every numeric event column: the item's mean (sign-log, standardized) and its quantile tier
  (`TIERS`): a price tier, a pack size;
- every text column (`type: text`, habitus.models.cache.text): the vector of the item's name.

At scoring (`new_item_embeddings`), the items the cache gained since training (ids above the
trained catalog, as the vocabularies keep a value's id and give new values the next ones) and seen
by the cut-off get the mapped embedding; their popularity at the cut-off and the entity's own
history of them are read as for any item. Everything is a pass over the events with per-item
bincounts, and the map is [features, dim]: nothing grows as entities x catalog.
"""

import json

import numpy as np
import torch

from habitus.models.cache.text import text_vectors
from habitus.models.tasks.metrics import ranking_metrics_at

PURITY = 0.9  # a column describes an item where the item's most frequent value covers this share of its events
MAX_VALUES = 1_024  # one-hot slots per categorical column (its most common values; the rest share one)
TIERS = 8  # quantile tiers of a numeric column's per-item mean
MIN_EVENTS = 5  # known items with fewer events do not train the map (their embeddings barely moved from the start)
ALPHAS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)  # ridge penalties (x the mean feature variance) chosen on held-out items
HELD = 5  # one known item in HELD (by id) chooses the penalty


def item_profile(cache, column: str, ids: np.ndarray, cutoff: int) -> dict:
    """What the events at or before `cutoff` say about the items `ids` (sorted vocabulary ids of
    `column`): {"events": [n], "modes": {categorical column: ([n] most frequent id, [n] its count)},
    "means": {numeric column: [n] mean (NaN where none)}}."""
    n = len(ids)
    index = np.full(int(cache.columns[column]["vocab_size"]) + 1, -1, np.int64)
    index[ids] = np.arange(n)
    cats = [c for c, m in cache.columns.items() if m["type"] == "categorical" and c != column]
    nums = [c for c, m in cache.columns.items() if m["type"] == "numeric"]
    events = np.zeros(n, np.int64)
    sums = {c: np.zeros((2, n)) for c in nums}
    pairs: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {c: [] for c in cats}
    for s in range(cache.shard_count):
        sh = cache.shard(s)
        it = sh.columns[column]
        pos = index[np.minimum(it, len(index) - 1)]
        keep = (sh.ts <= cutoff) & (pos >= 0) & (it < len(index))
        pos = pos[keep]
        events += np.bincount(pos, minlength=n)
        for c in nums:
            x = sh.columns[c][keep].astype(np.float64)
            ok = np.isfinite(x)
            sums[c][0] += np.bincount(pos[ok], _signed_log(x[ok]), minlength=n)
            sums[c][1] += np.bincount(pos[ok], minlength=n)
        for c in cats:
            key = pos * np.int64(cache.columns[c]["vocab_size"] + 1) + sh.columns[c][keep]
            uniq, counts = np.unique(key, return_counts=True)
            pairs[c].append((uniq, counts))
    modes = {}
    for c in cats:
        width = np.int64(cache.columns[c]["vocab_size"] + 1)
        keys = np.concatenate([u for u, _ in pairs[c]]) if pairs[c] else np.zeros(0, np.int64)
        uniq, inverse = np.unique(keys, return_inverse=True)
        counts = np.bincount(inverse, np.concatenate([k for _, k in pairs[c]]) if pairs[c] else None,
                             minlength=len(uniq)).astype(np.int64)
        item, value = uniq // width, uniq % width
        value_of, count_of = np.zeros(n, np.int64), np.zeros(n, np.int64)
        order = np.lexsort((-counts, item))  # by item, its most frequent value first
        first = order[np.r_[True, item[order][1:] != item[order][:-1]]] if len(order) else order
        value_of[item[first]], count_of[item[first]] = value[first], counts[first]
        modes[c] = (value_of, count_of)
    means = {c: np.where(v[1] > 0, v[0] / np.maximum(v[1], 1), np.nan) for c, v in sums.items()}
    return {"events": events, "modes": modes, "means": means}


def _signed_log(x: np.ndarray) -> np.ndarray:
    return np.sign(x) * np.log1p(np.abs(x))


def attribute_spec(cache, column: str, profile: dict) -> dict:
    """Which columns describe the items and how they are encoded, from the known items' profile."""
    seen = profile["events"] > 0
    spec: dict = {"column": column, "categorical": {}, "numeric": {}, "text": {}}
    for c, (value, count) in profile["modes"].items():
        covered = count[seen].sum() / max(profile["events"][seen].sum(), 1)
        if covered < PURITY or not (value[seen] > 0).any():
            continue
        values, n = np.unique(value[seen & (value > 0)], return_counts=True)
        kept = values[np.argsort(-n, kind="stable")[:MAX_VALUES]]
        if cache.columns[c].get("text"):  # a name: its vector, not a one-hot of every distinct name
            spec["text"][c] = int(cache.columns[c]["text"])
        if len(kept) > 1 and c not in spec["text"]:
            spec["categorical"][c] = sorted(int(v) for v in kept)
    if cache.columns[column].get("text"):  # the item column itself is a name
        spec["text"][column] = int(cache.columns[column]["text"])
    for c, mean in profile["means"].items():
        x = mean[seen & np.isfinite(mean)]
        if len(x) < 2 or x.std() == 0:
            continue
        edges = np.unique(np.quantile(x, np.arange(1, TIERS) / TIERS))
        spec["numeric"][c] = {"mean": float(x.mean()), "std": float(x.std()), "edges": edges.tolist()}
    return spec


def encode(cache, spec: dict, ids: np.ndarray, profile: dict):
    """[items, features] sparse (CSR, float32) attribute encoding of the items `ids` (the order of
    `profile`): a few entries per item, so a catalog of a million items is a few million numbers."""
    import scipy.sparse as sp

    n, parts = len(ids), []
    rows = np.arange(n)

    def one_hot(slot, width):
        return sp.csr_matrix((np.ones(n, np.float32), (rows, slot)), shape=(n, width))

    for c, kept in spec["categorical"].items():
        value, kept = profile["modes"][c][0], np.asarray(kept, np.int64)
        slot = np.searchsorted(kept, value).clip(max=len(kept) - 1)
        parts.append(one_hot(np.where(kept[slot] == value, slot, len(kept)), len(kept) + 1))  # else: "other"
    for c, s in spec["numeric"].items():
        mean = profile["means"][c]
        ok = np.isfinite(mean)
        edges = np.asarray(s["edges"])
        parts.append(one_hot(np.where(ok, np.searchsorted(edges, np.nan_to_num(mean)), len(edges) + 1), len(edges) + 2))
        parts.append(sp.csr_matrix(np.where(ok, (np.nan_to_num(mean) - s["mean"]) / s["std"], 0.0)
                                   .astype(np.float32)[:, None]))
    if spec["text"]:
        for c in spec["text"]:
            parts.append(sp.csr_matrix(text_vectors(cache, c, ids if c == spec["column"] else profile["modes"][c][0])))
    return sp.hstack(parts, format="csr", dtype=np.float32) if parts else sp.csr_matrix((n, 0), dtype=np.float32)


def fit_item_map(cache, column: str, labels: tuple[int, ...], embeddings: np.ndarray, cutoff: int,
                 start: np.ndarray | None = None) -> tuple[dict, np.ndarray, dict, dict | None]:
    """(attribute spec, map [features + 1, dim], what was measured, the held-out items) from the
    catalog `labels` (vocabulary ids of `column`, in head order) and their trained `embeddings`
    [labels, dim]: a ridge regression on the items with at least MIN_EVENTS events by `cutoff`, its
    penalty chosen on one item in HELD. `start`: the embeddings before training (random): the map
    learns what training moved them by, not the random start, which no attribute predicts (and which
    a new item does not have). The held-out items, as new items would be scored by the map fitted
    without them: {"positions": their head positions, "mapped": [held, dim], "intercept": [dim]}
    (None where there are none): what chooses between the map and its intercept alone."""
    ids = np.asarray(labels, np.int64)
    order = np.argsort(ids, kind="stable")
    profile = item_profile(cache, column, ids[order], cutoff)
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    profile = _take(profile, back)  # head order
    spec = attribute_spec(cache, column, profile)
    x = encode(cache, spec, ids, profile)
    train = profile["events"] >= MIN_EVENTS
    y = embeddings.astype(np.float64) - (0.0 if start is None else start)
    info = {"items": int(train.sum()), "features": int(x.shape[1]),
            "columns": {k: sorted(spec[k]) for k in ("categorical", "numeric", "text")}}
    if train.sum() < 2 * HELD:  # too few items to learn from: the known items' mean embedding
        w = np.zeros((x.shape[1] + 1, y.shape[1]))
        w[-1] = y[train].mean(0) if train.any() else y.mean(0)
        return spec, w.astype(np.float32), info, None
    held = train & (ids % HELD == 0)
    fit = train & ~held
    best, scores, out = ALPHAS[0], {}, None
    if held.any() and fit.sum() > 1 and x.shape[1]:
        path = _ridge_path(x[fit], y[fit])
        for alpha in ALPHAS:
            w = path(alpha)
            scores[alpha] = float(((x[held] @ w[:-1] + w[-1] - y[held]) ** 2).sum(1).mean())
        best = min(scores, key=scores.get)
        w = path(best)
        out = {"positions": np.flatnonzero(held), "mapped": np.asarray(x[held] @ w[:-1] + w[-1], np.float32),
               "intercept": w[-1].astype(np.float32)}
    w = _ridge_path(x[train], y[train])(best)
    info.update(alpha=best, held_mse=scores.get(best, float("nan")),
                held_mse_mean_embedding=float(((y[held] - y[fit].mean(0)) ** 2).sum(1).mean()) if held.any()
                else float("nan"))
    return spec, w.astype(np.float32), info, out


def _ridge_path(x, y: np.ndarray):
    """alpha -> [features + 1, dim] (weights, then the intercept) of the ridge regression of y on the
    sparse x, centered without densifying x; the penalty is alpha x the mean feature variance. One
    eigendecomposition of the [features, features] Gram matrix serves every alpha."""
    n = x.shape[0]
    mx, my = np.asarray(x.mean(0)).ravel(), y.mean(0)
    if not x.shape[1]:
        return lambda alpha: np.vstack([np.zeros((0, y.shape[1])), my])
    gram = np.asarray((x.T @ x).todense(), np.float64) - n * np.outer(mx, mx)
    xty = np.asarray(x.T @ y) - n * np.outer(mx, my)
    scale = max(float(np.trace(gram)) / x.shape[1], 1e-9)
    s, v = np.linalg.eigh(gram)
    proj = v.T @ xty

    def solve(alpha: float) -> np.ndarray:
        b = v @ (proj / (np.clip(s, 0, None) + alpha * scale)[:, None])
        return np.vstack([b, my - mx @ b])

    return solve


def _take(profile: dict, index: np.ndarray) -> dict:
    return {"events": profile["events"][index],
            "modes": {c: (v[index], k[index]) for c, (v, k) in profile["modes"].items()},
            "means": {c: m[index] for c, m in profile["means"].items()}}


def new_item_embeddings(cache, spec: dict, weight: np.ndarray, n_known: int, cutoff: int
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(vocabulary ids, mapped embeddings [new items, dim]) of the items of the cache's catalog
    column above the trained ones (ids > `n_known`) with an event at or before `cutoff`."""
    column = spec["column"]
    ids = np.arange(n_known + 1, int(cache.columns[column]["vocab_size"]) + 1, dtype=np.int64)
    if not len(ids):
        return ids, np.zeros((0, weight.shape[1]), np.float32)
    profile = item_profile(cache, column, ids, cutoff)
    seen = profile["events"] > 0
    ids, profile = ids[seen], _take(profile, np.flatnonzero(seen))
    x = encode(cache, spec, ids, profile)
    return ids, np.asarray(x @ weight[:-1] + weight[-1], np.float32)


@torch.no_grad()
def held_out_ndcg(model, held: dict, val, k: int) -> dict:
    """NDCG@k among the held-out items (fit_item_map's `held`) of the validation entities that bought
    one, each item scored as a new one would be (no history of it, its popularity at the cut-off):
    with the mapped embedding and with the map's intercept alone. `val`: (x, history, bought,
    popularity) chunks. Returns both and the one chosen ("attributes" where it is higher)."""
    head, dev = model.head, model.head.items.weight.device
    cand = np.sort(held["positions"])
    order = np.argsort(held["positions"])
    arms = {"attributes": torch.from_numpy(held["mapped"][order]).to(dev),
            "intercept": torch.from_numpy(np.broadcast_to(held["intercept"], held["mapped"].shape).copy()).to(dev)}
    sums, n = dict.fromkeys(arms, 0.0), 0
    for x, _, y, pop, *_ in val:
        pos = np.searchsorted(cand, y.cols).clip(max=len(cand) - 1)
        inside = cand[pos] == y.cols
        rows = np.unique(y.rows[inside])
        if not len(rows):
            continue
        local = np.searchsorted(rows, y.rows[inside])
        h = model.trunk(torch.from_numpy(x[rows]).to(dev))
        query, bias = head.query(h), head.popularity(torch.from_numpy(pop[cand]).to(dev)).squeeze(-1)
        for arm, emb in arms.items():
            scores = (query @ emb.to(query.dtype).T + bias).float().cpu().numpy()
            top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
            sums[arm] += ranking_metrics_at(top, local, pos[inside], k)[f"ndcg@{k}"] * len(rows)
        n += len(rows)
    if not n:
        return {}
    out = {f"held_ndcg@{k}_{arm}": sums[arm] / n for arm in arms}
    return {**out, "held_entities": n,
            "chosen": "attributes" if out[f"held_ndcg@{k}_attributes"] > out[f"held_ndcg@{k}_intercept"] else "intercept"}


def spec_bytes(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True)
