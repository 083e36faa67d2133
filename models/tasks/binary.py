"""binary: will it happen (churn: no event in the window)? One probability per entity."""

import numpy as np
import torch
from torch import nn

from habitus.models.data.targets import TargetSpec
from habitus.models.tasks.metrics import auroc, average_precision
from habitus.models.tasks.base import Stacking, Task, function_target


class Binary(Task):
    name = "binary"
    headline = "auroc"
    stacking = Stacking("binary", logits=True, per_label=False, criterion=auroc)
    one_probability = True

    def target_spec(self, name, target, cache, cutoff) -> TargetSpec:
        if getattr(target, "function", None):
            return function_target(name, target)
        return TargetSpec("no_event", target.within, active_days=target.active_within)

    def check_labels(self, target, y) -> None:
        if target.kind == "function" and not np.isin(y, (0.0, 1.0)).all():
            raise ValueError(f"scenario {target.scenario!r}: target function {target.function!r} must return "
                             f"0 or 1 for a binary scenario, got values such as {np.unique(y)[:5].tolist()}")

    def init_head(self, model, spec, features, val, y_mean, n_val, extra) -> None:
        super().init_head(model, spec, features, val, y_mean, n_val, extra)
        logit_bias(model, y_mean)

    def loss(self, out, y):
        return nn.functional.binary_cross_entropy_with_logits(out, y)

    def transform(self, out):
        return torch.sigmoid(out)

    def metrics(self, y, score):
        return {"auroc": auroc(y, score), "average_precision": average_precision(y, score)}

    def baselines(self, spec, chunk, h, channel):
        begins = np.r_[0, np.flatnonzero(np.diff(chunk.local)) + 1]
        last_age = chunk.age_days[np.r_[begins[1:] - 1, len(chunk.local) - 1]]
        count90 = np.bincount(chunk.local, chunk.age_days <= 90, minlength=chunk.n)
        return {"recency": last_age, "frequency": -count90.astype(np.float32)}

    def lightgbm(self, lgb, params, spec, dataset, seed):
        (x_train, y_train), (x_val, y_val), (x_test, _) = dataset("train"), dataset("val"), dataset("test")
        model = lgb.LGBMClassifier(**params)
        model.fit(x_train, y_train, eval_set=[(x_val, y_val)], callbacks=[lgb.early_stopping(30, verbose=False)])
        return model.predict_proba(x_test)[:, 1].astype(np.float32)


def logit_bias(model, y_mean: np.ndarray) -> None:
    """The head's biases at the log-odds of the base rates (the first steps start there)."""
    p = np.clip(y_mean, 1e-4, 1 - 1e-4)
    model.head.linear.bias.copy_(torch.as_tensor(np.log(p / (1 - p)), dtype=torch.float32).reshape(-1))


TASK = Binary()
