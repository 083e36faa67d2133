"""A scenario network: built for its task, and its outputs in the task's own units."""

import numpy as np
import torch

from models.features import FeatureSpec
from models.items import SparseRows, top_k_items
from models.labels import POPULARITY_DAYS, history_rows
from models.network import Model, NetConfig
from models.specs import TaskSpec


def build_model(net: NetConfig, task: TaskSpec, spec: FeatureSpec) -> Model:
    """The scenario network of a task: the trunk plus the task's head."""
    channels = spec.channels if task.uses_label_history else 0
    if task.task == "recommendation":
        return Model(net, task.outputs, channels, task.item_dim, len(POPULARITY_DAYS))
    pair = task.pair_width if task.task == "multilabel" else 0
    return Model(net, task.outputs, channels, pair_width=pair, pair_layers=task.pair_layers)


@torch.no_grad()
def scores(model: Model, task: str, x: np.ndarray, h: np.ndarray | SparseRows | None, *, device: str = "cpu",
           batch: int = 8192) -> np.ndarray:
    """Model outputs in the task's own units: probabilities or amounts (rank_items for items)."""
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    out = []
    for i in range(0, len(x), batch):
        o = model(torch.from_numpy(x[i:i + batch]).to(dev), history_rows(h, np.arange(i, min(i + batch, len(x))), dev))
        if task in ("binary", "multilabel"):
            o = torch.sigmoid(o)
        elif task == "regression":
            o = torch.expm1(o).clamp_min(0)
        out.append(o.float().cpu().numpy())
    if not out:
        return np.zeros((0,) if task in ("binary", "regression") else (0, model.head.linear.out_features), np.float32)
    return np.concatenate(out)


@torch.no_grad()
def rank_items(model: Model, x: np.ndarray, hist: SparseRows, popularity: np.ndarray, k: int, *,
               device: str = "cpu", batch: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """The k best items of every row over the whole catalog, best first: (label positions, scores).
    `popularity`: item_popularity at the rows' cut-off."""
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
    return top_k_items(len(x), head.n_items, k, lambda r0, r1, i0, i1: head.dense(h[r0:r1], pop, i0, i1), extra)


