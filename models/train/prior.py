"""The foundation model's own forecast as a scenario head's start.

The self-supervised head already predicts, from the same trunk, whether an entity acts in the next
window and which values of every categorical column it touches (models/targets.foundation_target).
A churn scenario ("no event in the window") and a propensity scenario over a column's top values ask
the same questions, over their own window. So their heads can start at the foundation's answer,
recalibrated per output (a slope and an offset: the windows differ), instead of at the base rate or
at "what they bought, habitually": what pretraining learned is then used from the first step, which
matters most where labels are few. Propensity also fits how much each label's own history adds
(the forecast and the history together, label by label). Validation chooses between this start and
the task's own (models/train/finetune.py).
"""

from dataclasses import dataclass

import numpy as np
import torch

from habitus.models.data.features import FeatureSpec, bucket_count, exact_buckets, tail_start
from habitus.models.data.targets import TargetSpec

CALIBRATION_ROWS = 8_192  # training rows the slope and offset are fitted on
# the first labels of a head (the most frequent, where chosen by frequency) that start at their group's
# forecast: each costs a Newton fit over CALIBRATION_ROWS rows (about 40 ms on one core), and further
# down a 16,000-label head a label has too few positives in those rows for the fit to say much
GROUP_START_LABELS = 1_024
LABEL_BLOCK = 128  # labels calibrated at once (memory: rows x labels x inputs, in float64: ~40 MB)
PRIOR_ROWS = 50  # the pull of the fitted weights towards the forecast as it is, in rows (calibrate)


@dataclass
class Forecast:
    """The foundation head's rows that forecast a scenario's outputs: output `positions[i]` is forecast
    by weight[i] . h + bias[i] (for churn, minus the "acts" row: not acting is churning)."""

    positions: np.ndarray  # [k] the scenario's output positions that have a forecast
    columns: np.ndarray  # [k] the foundation target columns (habitus.models.data.targets.foundation_target) they read
    weight: torch.Tensor  # [k, hidden]
    bias: torch.Tensor  # [k]


def column_offsets(spec: FeatureSpec) -> dict[str, int]:
    """Where each categorical column's buckets start among the foundation's targets (after [any event,
    log count]; bucket 0, "unknown", is not a target)."""
    offsets, at = {}, 2
    for column, vocab in spec.categorical.items():
        offsets[column] = at
        at += bucket_count(vocab, spec.buckets) - 1
    return offsets


def foundation_forecast(state: dict[str, torch.Tensor], spec: FeatureSpec, target: TargetSpec,
                        outputs: int) -> Forecast | None:
    """The foundation head's forecast of a target, where it has one: churn (`no_event`: minus the
    "acts in the window" logit) and propensity or the next class over a categorical column's values
    (`any_event`: the bucket of each label, its own or, in a long tail grouped by relatedness, its
    group's: FeatureSpec.tails; a class's output is calibrated against "the next class is this one",
    Task.forecast_targets). None for every other target: recommendation
    (`items`) too, where adding the forecast of the items that have a bucket to the start made the
    demo's validation NDCG@10 worse at every weight tried (docs/journal/quality.md)."""
    weight, bias = state.get("head.linear.weight"), state.get("head.linear.bias")
    if weight is None or bias is None:
        return None
    if target.kind == "no_event" and outputs == 1:
        return Forecast(np.zeros(1, np.int64), np.zeros(1, np.int64), -weight[:1].clone(), -bias[:1].clone())
    if target.kind == "any_event" and target.column in spec.categorical and len(target.labels) == outputs:
        ids = np.asarray(target.labels, np.int64)
        vocab, buckets = spec.categorical[target.column], spec.bucket(target.column, ids)
        own = exact_buckets(ids, vocab, spec.buckets)
        if spec.tail(target.column) is not None:  # a rarer label starts at its group of related values
            own |= (buckets >= tail_start(spec.buckets)) & (ids <= vocab) & (np.arange(len(ids)) < GROUP_START_LABELS)
        if not own.any():
            return None
        rows = column_offsets(spec)[target.column] + buckets[own] - 1
        if rows.max() >= len(weight):  # (a head of another layout)
            return None
        index = torch.from_numpy(rows)
        return Forecast(np.flatnonzero(own), rows, weight[index].clone(), bias[index].clone())
    return None


@torch.no_grad()
def calibrate(inputs: torch.Tensor, y: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """Per label, a logistic regression over its own inputs: `inputs` [rows, k, F] (the forecast's
    logit first, then the label's own history channels), `y` [rows, k] of 0/1. Returns [k, F + 1]
    (the weights, then the intercept), by Newton for every label at once. The weights are pulled
    towards [1, 0, ...] (the forecast as it is) by PRIOR_ROWS pseudo-rows and the intercept kept in
    [-8, 8], so that a few hundred labelled rows, or a label none of them has, cannot push the start
    to extremes."""
    x = torch.cat([inputs.double(), torch.ones_like(inputs[..., :1], dtype=torch.float64)], -1)  # [n, k, F + 1]
    n, k, f = x.shape
    y = y.double()
    prior = torch.zeros(k, f, dtype=torch.float64)
    prior[:, 0] = 1.0
    ridge = torch.full((f,), PRIOR_ROWS / max(n, 1), dtype=torch.float64)
    ridge[-1] = 1e-6  # (the intercept: nearly free)
    beta = prior.clone()
    for _ in range(iterations):
        p = torch.sigmoid((x * beta).sum(-1))  # [n, k]
        w = (p * (1 - p)).clamp_min(1e-9)
        grad = torch.einsum("nk,nkf->kf", p - y, x) / n + ridge * (beta - prior)
        hess = torch.einsum("nk,nkf,nkg->kfg", w, x, x) / n + torch.diag_embed(ridge.expand(k, f))
        beta = beta - torch.linalg.solve(hess, grad)
        beta[:, -1] = beta[:, -1].clamp(-8.0, 8.0)
    return beta.float()


@torch.no_grad()
def start_at_forecast(model, forecast: Forecast, arrays, dev, history_channel_count: int, targets) -> int:
    """Set the head's outputs that have a forecast to a calibrated mix of the forecast and the label's
    own history: their linear rows to a x (the foundation's rows), their biases to a x (its bias) + c,
    their history weights to the fitted ones (`calibrate`). `arrays`: training chunks (features, label
    history, targets), read until CALIBRATION_ROWS rows; `targets(y, positions)`: the task's 0/1 of
    each row at each forecast output (Task.forecast_targets: a class index is not a 0/1 label).
    Labels are calibrated LABEL_BLOCK at a time: a 16,000-label head never holds rows x labels at once.
    Returns the rows it read."""
    xs, hs, ys, n = [], [], [], 0
    for x, h, y, *_ in arrays:
        take = min(len(x), CALIBRATION_ROWS - n)
        rows = np.arange(take)
        xs.append(x[:take])
        if history_channel_count:
            hs.append(h[rows] if hasattr(h, "dense") else h[:take])
        ys.append(y[rows])
        n += take
        if n >= CALIBRATION_ROWS:
            break
    if not n:
        return 0
    model.eval()
    trunk = torch.cat([model.trunk(torch.from_numpy(x).to(dev)) for x in xs]).cpu()
    head = model.head
    for lo in range(0, len(forecast.positions), LABEL_BLOCK):
        positions = forecast.positions[lo:lo + LABEL_BLOCK]
        weight = forecast.weight[lo:lo + LABEL_BLOCK].to(trunk.dtype)
        bias = forecast.bias[lo:lo + LABEL_BLOCK].to(trunk.dtype)
        inputs = (trunk @ weight.T + bias)[..., None]  # [n, k, 1]
        if history_channel_count:  # [n, k, channels] of the labels with a forecast
            own = [np.stack([h.dense(c, positions) for c in range(history_channel_count)], -1)
                   if hasattr(h, "dense") else h[:, positions] for h in hs]
            inputs = torch.cat([inputs, torch.from_numpy(np.concatenate(own).astype(np.float32))], -1)
        labels = np.concatenate([targets(y, positions) for y in ys]).astype(np.float32)
        beta = calibrate(inputs, torch.from_numpy(labels))
        at = torch.from_numpy(positions).to(head.linear.weight.device)
        a = beta[:, 0]
        head.linear.weight[at] = (a[:, None] * weight).to(head.linear.weight)
        head.linear.bias[at] = (a * bias + beta[:, -1]).to(head.linear.bias)
        if history_channel_count and getattr(head, "label_skip", None) is not None:
            head.label_skip[at] = (beta[:, 1:-1] - head.skip.weight[0]).to(head.label_skip)  # (shared + own = fitted)
    return n
