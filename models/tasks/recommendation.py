"""recommendation: which items of the whole catalog will each entity buy in the window? Ranked with
an item head (network.ItemHead) trained by a sampled softmax; scored by hit rate and NDCG at k."""

import dataclasses
import math

import numpy as np
import torch

from habitus.models.tasks.coldstart import fit_item_map, held_out_ndcg, new_item_embeddings, spec_bytes
from habitus.models.data.items import SparseRows, batch_history, candidates, sampled_softmax_loss, top_k_items
from habitus.models.data.labels import POPULARITY_DAYS, item_popularity, recent_popularity
from habitus.models.data.targets import TargetSpec
from habitus.models.nn.network import Model
from habitus.models.tasks.base import Task, event_column, function_label_target
from habitus.models.tasks.metrics import ranking_metrics_at
from habitus.models.tasks.rerank import RERANK_CANDIDATES, fit_reranker
from habitus.models.tasks.rerank import rerank as reorder

VAL_ROWS = 512  # rows per validation-loss batch
POPULARITY_INIT = 0.2  # the start: "what they bought, habitually" blended with what sells now
HABITUAL_SKIP = 5.0


class Recommendation(Task):
    name = "recommendation"
    headline = "ndcg@{k}"
    uses_label_history = True
    label_outputs = True
    find_unused_parameters = True  # history terms may sit a batch out

    def target_spec(self, name, target, cache, cutoff) -> TargetSpec:
        if getattr(target, "function", None):  # the function returns each entity's items (by: the item column)
            return function_label_target(name, target, cache, cutoff, every_value=True)
        column = event_column(name, target.items, cache, "categorical")
        return TargetSpec("items", target.within, column, tuple(range(1, cache.columns[column]["vocab_size"] + 1)))

    def build_model(self, net, spec, features):
        return Model(net, self.outputs(spec), features.channels, spec.item_dim, len(POPULARITY_DAYS))

    def chunk_extra(self, cache, target, cutoff) -> tuple:  # the catalog's popularity at the cut-off
        return (item_popularity(cache, target, cutoff),)

    def init_head(self, model, spec, features, val, y_mean, n_val, extra) -> None:
        # the item embeddings' random start: what training moved them by is what the item map learns
        model.head.start_items = model.head.items.weight.detach().clone()
        # popularity breaks ties among what the entity already buys
        model.head.popularity.weight.zero_()
        model.head.popularity.weight[0, -1] = POPULARITY_INIT
        rate = float(np.clip(y_mean.mean(), 1e-9, 0.5))  # chance that an entity buys a given item
        model.head.popularity.bias.fill_(math.log(rate / (1 - rate)) - POPULARITY_INIT * float(extra[0][:, -1].mean()))
        model.head.query.weight.zero_()
        model.head.query.bias.zero_()
        model.head.skip.weight.zero_()
        model.head.skip.weight[0, features.habitual_channel] = HABITUAL_SKIP

    def second_stage(self, model, spec, train, val, device, log):
        def retrieve(x, h, popularity, m):  # the network's own best items: the candidates
            return rank_items(model, x, h, popularity, m, device=device, rerank=False)

        return fit_reranker(model.head, retrieve, train, val, spec.k, log=log)

    def fit_new_items(self, model, spec, cache, cutoff, log, val=None):
        if spec.target.function or not spec.target.labels:
            return None
        start = getattr(model.head, "start_items", None)
        item_spec, weight, info, held = fit_item_map(cache, spec.target.column, spec.target.labels,
                                                     model.head.items.weight.detach().float().cpu().numpy(), cutoff,
                                                     None if start is None else start.float().cpu().numpy())
        model.head.start_items = None
        if held is not None and val is not None:  # the attributes, or the intercept alone: chosen on validation
            info.update(held_out_ndcg(model, held, val, spec.k))
            if info["chosen"] == "intercept":
                weight[:-1] = 0.0
        model.head.set_item_map(spec_bytes(item_spec), torch.from_numpy(weight).to(model.head.items.weight.device))
        log(f"recommendation new items: embeddings mapped from {info['features']} attribute features "
            f"(fitted on {info['items']:,} items; on validation, held-out items ranked as new: "
            f"{info.get('chosen', 'attributes')})")
        return info

    def with_new_items(self, model, spec, cache, cutoff):
        found = model.head.item_map_of
        if found is None or spec.target.labels != tuple(range(1, len(spec.target.labels) + 1)):
            model.head.add_items(model.head.items.weight[:0].detach())  # (none from an earlier call either)
            return spec  # (a head without an item map, or a catalog that is not the whole column)
        item_spec, weight = found
        ids, emb = new_item_embeddings(cache, item_spec, weight.float().cpu().numpy(), len(spec.target.labels), cutoff)
        model.head.add_items(torch.from_numpy(emb))
        target = dataclasses.replace(spec.target, labels=spec.target.labels + tuple(int(i) for i in ids))
        return dataclasses.replace(spec, target=target)

    def batch_loss(self, model, spec, arrays, b, dev, rng, negatives=0):
        x, h, y, popularity = arrays[:4]
        if model.training:
            b = b[np.diff(y.indptr)[b] > 0]  # entities that bought nothing add nothing to the loss
        xb = torch.from_numpy(x[b]).to(dev)
        hb, yb = h[b], y[b]
        cand = candidates(hb, popularity, rng)
        return sampled_softmax_loss(model(xb, batch_history(hb, dev), torch.from_numpy(cand).to(dev),
                                          torch.from_numpy(popularity).to(dev)), yb, cand)

    criterion_is_loss = False

    def val_batch(self, spec, batch):
        """As many rows as a training batch (FinetuneConfig's default): a batch's candidates are its
        entities' past items, so a batch four times as large over a long-tail catalog ranks several
        times the candidates per row, and its loss estimates another quantity than the training loss."""
        return min(batch, VAL_ROWS)

    @torch.no_grad()
    def val_criterion(self, model, spec, val, dev):
        """The ranking metric (its softmax loss can fall while the top of the ranking gets worse)."""
        model.eval()
        total, n = 0.0, 0
        for x, h, y, pop in val:
            bought = np.flatnonzero(np.diff(y.indptr) > 0)  # the metric counts only these: rank only them
            if not len(bought):
                continue
            top, _ = rank_items(model, x[bought], h[bought], pop, spec.k, device=str(dev))
            yb = y[bought]
            total += ranking_metrics_at(top, yb.rows, yb.cols, spec.k)[f"ndcg@{spec.k}"] * len(bought)
            n += len(bought)
        return -total / n if n else 0.0

    def label_names(self, cache, spec, names):
        if names is None:  # items: the column's own vocabulary, in label order
            vocab = cache.vocab(spec.target.column).column("value").to_numpy(zero_copy_only=False)
            names = [vocab[i - 1] for i in spec.target.labels]
        return np.asarray(names, dtype=object)

    def top(self, model, x, h, k, extra, device):  # full-catalog ranking, a block of items at a time
        return rank_items(model, x, h, extra[0], k, device=device)

    def report_metrics(self, spec):
        return [f"hr@{spec.k}", f"ndcg@{spec.k}"]

    def list_headline(self, spec):  # the hold-out's headline: realized and hold-out values compare
        return f"ndcg@{spec.k}"

    def list_baselines(self, spec, cache, cutoff):
        popularity = recent_popularity(cache, spec.target, cutoff)
        return lambda h, k, channel: baseline_rankings(h, popularity, k, channel)

    def evaluation(self, model, cache, features, spec, cutoff, *, constant=None, extra=None, device="cpu"):
        return Rankings(model, spec, recent_popularity(cache, spec.target, cutoff),
                        item_popularity(cache, spec.target, cutoff), features.habitual_channel, device)


class Rankings:
    """The hold-out of a ranking: each chunk ranked (no [n, catalog] matrix), metrics weighted by the
    entities that bought something."""

    def __init__(self, model, spec, popularity, item_pop, channel, device):
        self.model, self.spec, self.popularity, self.item_pop = model, spec, popularity, item_pop
        self.channel, self.device = channel, device
        self.ranking: dict[str, list] = {}

    def add(self, chunk, keep, x, h, y) -> None:
        tops = item_rankings(self.model, x[keep], h[keep], self.popularity, self.item_pop, self.spec.k, self.device,
                             self.channel)
        for name, top in tops.items():
            self.ranking.setdefault(name, []).append((ranking_metrics_at(top, y.rows, y.cols, self.spec.k),
                                                      int((np.diff(y.indptr) > 0).sum())))

    def report(self) -> dict:
        results = {name: _weighted(parts) for name, parts in self.ranking.items()}
        n = sum(w for _, w in self.ranking["model"]) if self.ranking else 0
        return {"model": results.pop("model", {}), "baselines": results, "entities": n}


def item_rankings(model: Model, x: np.ndarray, hist: SparseRows, popularity: np.ndarray, item_pop: np.ndarray,
                  k: int, device: str, channel: int = 1) -> dict[str, np.ndarray]:
    """Top-k item positions per entity for the model and the two baselines (baseline_rankings)."""
    return {"model": rank_items(model, x, hist, item_pop, k, device=device)[0],
            **baseline_rankings(hist, popularity, k, channel)}


def baseline_rankings(hist: SparseRows, popularity: np.ndarray, k: int, channel: int = 1) -> dict[str, np.ndarray]:
    """Top-k item positions per entity of the two baselines, from history alone: popularity (the same
    list for everyone) and past frequency (what the entity bought, habitually; popularity breaks ties)."""
    n, n_items = len(hist), len(popularity)
    pop = torch.from_numpy(popularity.astype(np.float32))
    tie = pop * (1e-3 / max(float(popularity.max(initial=0)), 1e-9))
    past = SparseRows(hist.indptr, hist.cols, hist.values[:, channel:channel + 1], hist.n_cols)  # habitual count
    return {"popularity": top_k_items(n, n_items, k, lambda r0, r1, i0, i1: pop[i0:i1].expand(r1 - r0, -1))[0],
            "past frequency": top_k_items(n, n_items, k, lambda r0, r1, i0, i1: tie[i0:i1].expand(r1 - r0, -1),
                                          past)[0]}


@torch.no_grad()
def rank_items(model: Model, x: np.ndarray, hist: SparseRows, popularity: np.ndarray, k: int, *,
               device: str = "cpu", batch: int = 8192, rerank: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The k best items of every row over the whole catalog, best first: (label positions, scores).
    `popularity`: item_popularity at the rows' cut-off. A head with re-ranking trees (models/tasks/rerank.py)
    retrieves RERANK_CANDIDATES items and returns the trees' k best (their scores); `rerank=False`
    ranks with the network alone."""
    booster = model.head.booster if rerank and hist is not None else None
    if booster is not None:
        top, scores = rank_items(model, x, hist, popularity, max(k, RERANK_CANDIDATES), device=device, batch=batch,
                                 rerank=False)
        return reorder(booster, top, scores, hist, popularity, k)
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    model.eval()
    head = model.head
    trunk = [model.trunk(torch.from_numpy(x[i:i + batch]).to(dev)) for i in range(0, len(x), batch)]
    h = torch.cat(trunk) if trunk else torch.zeros((0, model.trunk.cfg.hidden), device=dev)
    extra = None
    if hist is not None:
        rows = torch.from_numpy(hist.rows).to(dev)
        values = head.history_scores(h, rows, torch.from_numpy(hist.values).to(dev)).float().cpu().numpy()
        extra = SparseRows(hist.indptr, hist.cols, values[:, None], hist.n_cols)
    pop = torch.from_numpy(popularity).to(dev)
    return top_k_items(len(x), head.n_items, k, head.scorer(h, pop), extra)


def _weighted(parts: list[tuple[dict, int]]) -> dict[str, float]:
    total = sum(w for _, w in parts)
    keys = parts[0][0].keys() if parts else []
    return {k: float(sum(m[k] * w for m, w in parts if w) / total) if total else float("nan") for k in keys}


TASK = Recommendation()
