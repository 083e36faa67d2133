"""The scenario losses (recommendation's sampled softmax lives with the items, models.items)."""

import numpy as np
import torch
from torch import nn

from models.items import SparseRows
from models.network import Model


def task_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task in ("binary", "multilabel"):
        return nn.functional.binary_cross_entropy_with_logits(out, y)
    if task == "regression":
        # the absolute error in the target's own units (what MAE scores; its optimum is the median),
        # the output staying a log amount; divided by the batch's mean target so that amounts in
        # cents or in thousands train alike. Ta-Feng spend MAE 342.2 -> 335.4 against a Huber loss
        # on log amounts (docs/quality.md)
        error = (torch.expm1(out.float().clamp(max=30.0)) - y).abs().mean()
        return error / y.abs().mean().detach().clamp_min(1e-3)
    raise ValueError(f"{task}: recommendation is trained by items.sampled_softmax_loss (see batch_loss)")


def multilabel_loss(out: torch.Tensor, y: SparseRows, dev) -> torch.Tensor:
    """binary_cross_entropy_with_logits(out, y.dense()), the mean over rows x labels, from the sparse
    targets: per element BCE(z, y) = softplus(z) - y z, and y z is read at the entries only. The
    [rows, labels] targets are never built, and one pass over the logits replaces the dense
    loss's several (3x faster at 16,000 labels); the same value up to float rounding."""
    out = out.float()  # (as autocast runs binary_cross_entropy_with_logits: in float32)
    out = out[:, None] if out.dim() == 1 else out  # one label: the model squeezes its outputs
    picked = out[torch.from_numpy(y.rows).to(dev), torch.from_numpy(y.cols).to(dev)]
    return (nn.functional.softplus(out).sum() - (picked * torch.from_numpy(y.values[:, 0]).to(dev)).sum()) / out.numel()


COLUMN_MULTIPLE = 256


def sampled_multilabel_loss(model: Model, xb: torch.Tensor, history, y: SparseRows, negatives: int,
                            rng: np.random.Generator, dev) -> torch.Tensor:
    """An unbiased estimate of multilabel_loss (the mean BCE over rows x labels) from the logits of a
    few label columns shared by the batch's rows, never the [rows, labels] matrix: every label that
    is a positive of some row of the batch, plus `negatives` of the other labels drawn uniformly
    without replacement.

    Full loss x rows x labels = the sum over label columns of sum_rows BCE(z, y). The columns of the
    batch's positives are summed exactly (every positive, and the negatives that matter most: labels
    others in the batch buy, the popular ones); one of the other L - P labels is drawn with
    probability negatives / (L - P), so its column is weighted by (L - P) / negatives (Horvitz-
    Thompson). The estimate's expectation, and its gradient's, is the full loss's, so training still
    fits calibrated per-label probabilities (what ranking by score, validation and prediction read).
    A logQ correction, the alternative, fits a sampled softmax (one label among many) and shifts each
    label's logit by how often it is sampled; with independent per-label BCE terms the inverse-
    probability weight is the exact correction."""
    n_labels = y.n_cols
    positive = np.unique(y.cols)
    pool = np.ones(n_labels, bool)
    pool[positive] = False
    rest = np.flatnonzero(pool)
    # (as many more as make the columns a multiple of COLUMN_MULTIPLE: a few shapes of matrix products,
    # where every new one costs oneDNN a cached kernel: the 16k fine-tuning in bf16 peaked 0.55 GB higher)
    drawn = rng.choice(rest, min(negatives + (-(len(positive) + negatives)) % COLUMN_MULTIPLE, len(rest)),
                       replace=False)
    cols = np.sort(np.concatenate([positive, drawn]))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    out, _ = model(xb, history, labels=(t(cols), empty, empty))
    out = out.float()  # (as autocast runs the BCE: in float32)
    weight = np.where(np.isin(cols, positive), 1.0, len(rest) / max(len(drawn), 1)).astype(np.float32)
    picked = out[t(y.rows), t(np.searchsorted(cols, y.cols))]
    per_column = nn.functional.softplus(out).sum(0)
    return ((per_column * t(weight)).sum() - (picked * t(y.values[:, 0])).sum()) / (len(y) * n_labels)

