"""A scenario network: built for its task, and its outputs in the task's own units."""

import numpy as np
import torch

from habitus.models.data.features import FeatureSpec
from habitus.models.data.items import SparseRows, top_k_items
from habitus.models.data.labels import history_rows
from habitus.models.nn.network import Model, NetConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.tasks import task as task_of


def build_model(net: NetConfig, task: TaskSpec, spec: FeatureSpec) -> Model:
    """The scenario network of a task: the trunk plus the task's head."""
    return task_of(task).build_model(net, task, spec)


@torch.no_grad()
def scores(model: Model, task: str | TaskSpec, x: np.ndarray, h: np.ndarray | SparseRows | None, *, device: str = "cpu",
           batch: int = 8192) -> np.ndarray:
    """Model outputs in the task's own units: probabilities or amounts (rank_items for items)."""
    t = task_of(task)
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    out = []
    for i in range(0, len(x), batch):
        o = t.transform(model(torch.from_numpy(x[i:i + batch]).to(dev),
                              history_rows(h, np.arange(i, min(i + batch, len(x))), dev)))
        out.append(o.float().cpu().numpy())
    if not out:
        return t.empty_scores(model)
    return np.concatenate(out)


@torch.no_grad()
def rank_items(model: Model, x: np.ndarray, hist: SparseRows, popularity: np.ndarray, k: int, *,
               device: str = "cpu", batch: int = 8192, rerank: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """The k best items of every row over the whole catalog, best first: (label positions, scores).
    `popularity`: item_popularity at the rows' cut-off. A head with re-ranking trees (models/heads/rerank.py)
    retrieves RERANK_CANDIDATES items and returns the trees' k best (their scores); `rerank=False`
    ranks with the network alone."""
    booster = model.head.booster if rerank and hist is not None else None
    if booster is not None:
        from habitus.models.heads.rerank import RERANK_CANDIDATES, rerank as reorder

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


