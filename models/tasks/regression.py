"""regression: how much (spend in the window: a sum of a numeric column, or a count of events)."""

import numpy as np
import torch

from habitus.models.data.targets import TargetSpec
from habitus.models.tasks.base import Stacking, Task, event_column, function_target
from habitus.models.tasks.metrics import mae, normalized_gini, rmse


def negative_mae(y: np.ndarray, pred: np.ndarray) -> float:
    return -mae(y, pred)


class Regression(Task):
    name = "regression"
    headline = "mae"
    stacking = Stacking("l1", logits=False, per_label=False, criterion=negative_mae)
    lower_is_better = frozenset({"mae", "rmse"})

    def target_spec(self, name, target, cache, cutoff) -> TargetSpec:
        if getattr(target, "function", None):
            return function_target(name, target)
        if "." in target.sum:
            return TargetSpec("sum", target.within, event_column(name, target.sum, cache, "numeric"))
        return TargetSpec("count", target.within)

    def init_head(self, model, spec, features, val, y_mean, n_val, extra) -> None:
        super().init_head(model, spec, features, val, y_mean, n_val, extra)
        y_log = 0.0  # the mean log amount: the output is a log amount
        for arrays in val:
            y_log += float(np.log1p(np.clip(arrays[2], 0, None)).sum())
        model.head.linear.bias.fill_(y_log / max(n_val, 1))

    def loss(self, out, y):
        # the absolute error in the target's own units (what MAE scores; its optimum is the median),
        # the output staying a log amount; divided by the batch's mean target so that amounts in
        # cents or in thousands train alike. It beat a Huber loss on log amounts on Ta-Feng's spend
        # (docs/journal/quality.md)
        error = (torch.expm1(out.float().clamp(max=30.0)) - y).abs().mean()
        return error / y.abs().mean().detach().clamp_min(1e-3)

    def transform(self, out):
        return torch.expm1(out).clamp_min(0)

    def metrics(self, y, score):
        return {"mae": mae(y, score), "rmse": rmse(y, score), "normalized_gini": normalized_gini(y, score)}

    def baselines(self, spec, chunk, h, channel):
        # a user function's "previous window" is not defined: only the training mean stands in for it
        return {} if spec.target.kind == "function" else {"previous window": previous_window(chunk, spec.target)}

    def fixed_baselines(self, spec, constant, n):
        return {} if constant is None else {"training mean": np.full(n, constant, np.float32)}

    def lightgbm(self, lgb, params, spec, dataset, seed):
        (x_train, y_train), (x_val, y_val), (x_test, _) = dataset("train"), dataset("val"), dataset("test")
        model = lgb.LGBMRegressor(objective="l1", **params)
        model.fit(x_train, y_train, eval_set=[(x_val, y_val)], callbacks=[lgb.early_stopping(30, verbose=False)])
        return model.predict(x_test).astype(np.float32)


def previous_window(chunk, target) -> np.ndarray:
    """The same sum or count over the window that ended at the cut-off."""
    inside = chunk.age_days < target.window_days
    if target.kind == "count":
        return np.bincount(chunk.local, inside, minlength=chunk.n).astype(np.float32)
    v = np.nan_to_num(chunk.shard.columns[target.column][chunk.rows].astype(np.float64))
    return np.bincount(chunk.local, np.where(inside, v, 0.0), minlength=chunk.n).astype(np.float32)


TASK = Regression()
