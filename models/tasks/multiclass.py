"""multiclass: which one of the classes (a categorical column's top values: which category) will the
entity's next event be in? The target is the class of the entity's first event in the window whose
value is one of the classes; entities with no such event are not eligible for training or the
hold-out (predictions score every entity with history). One softmax over the classes; the head
also reads each class's own history, as label heads do.

Config: `{task: multiclass, target: {any_event: <events source>, by: <column>, within: 14d, top: 10}}`.
"""

import numpy as np
import torch
from torch import nn

from habitus.models.data.labels import recent_popularity, top_values
from habitus.models.data.targets import TargetSpec, future_rows, label_positions
from habitus.models.tasks.base import (PerEntity, Task, ValueLabels, categorical_column, function_label_lists,
                               function_label_target)
from habitus.models.tasks.metrics import list_metrics, top_k

LIST_K = 3  # realized: the hit rate of the 3 best written classes, next to the top class's accuracy
HABITUAL_SKIP = 1.0  # the head starts leaning to the classes the entity bought, habitually
EPS = 1e-7


class Multiclass(ValueLabels, Task):
    name = "multiclass"
    # log-loss decides: predictions are each class's probability, and a proper scoring rule judges the
    # whole distribution. Accuracy is reported next to it; on the demo it is capped by the entity's habit
    # (the network pushed all the way to past frequency's argmax reaches exactly its accuracy: README, "Status")
    headline = "log_loss"
    lower_is_better = frozenset({"log_loss"})
    uses_label_history = True
    label_outputs = True
    writes_every_label = True
    explained_labels = 1  # its one prediction: the predicted class

    def target_spec(self, name, target, cache, cutoff) -> TargetSpec:
        if getattr(target, "function", None):  # the function returns each entity's class value (None: none)
            return function_label_target(name, target, cache, cutoff)
        column = categorical_column(name, target.by, cache)
        return TargetSpec("any_event", target.within, column, top_values(cache, column, cutoff, target.top))

    def labels(self, chunk, target, cache):
        """The class position of each entity's first event in the window among the classes (-1: none)."""
        if target.kind == "function":
            y = np.asarray([v[0] if v else -1 for v in function_label_lists(chunk, target, cache)], np.int64)
            keep = self.eligible(chunk, target) & (y >= 0)
            return keep, y[keep]
        local, rows = future_rows(chunk, target.window_days)  # (by entity, then time)
        pos = label_positions(target.labels, chunk.shard.columns[target.column][rows])
        hit = pos >= 0
        y = np.full(chunk.n, -1, np.int64)
        first, at = np.unique(local[hit], return_index=True)
        y[first] = pos[hit][at]
        keep = self.eligible(chunk, target) & (y >= 0)
        return keep, y[keep]

    def forecast_targets(self, y, positions):
        # a class index per row: each class's output is calibrated against "the next class is this one"
        return (np.asarray(y, np.int64)[:, None] == np.asarray(positions)[None, :]).astype(np.float32)

    def target_sums(self, spec, y):
        return np.bincount(y, minlength=self.outputs(spec)).astype(np.float64)

    def init_head(self, model, spec, features, val, y_mean, n_val, extra) -> None:
        super().init_head(model, spec, features, val, y_mean, n_val, extra)
        model.head.linear.bias.copy_(torch.as_tensor(np.log(np.clip(y_mean, 1e-4, None)), dtype=torch.float32))
        model.head.skip.weight.zero_()
        model.head.skip.weight[0, features.habitual_channel] = HABITUAL_SKIP

    def loss(self, out, y):
        return nn.functional.cross_entropy(out.float(), y)

    def transform(self, out):
        return torch.softmax(out.float(), dim=-1)

    def pair_scores(self, out, target):
        return self.transform(out).gather(1, target[:, None])[:, 0]

    def top(self, model, x, h, k, extra, device):
        p = self.scores(model, x, h, device=device)
        best = np.argsort(-p, axis=1, kind="stable")[:, :min(k, p.shape[1])]
        return best, np.take_along_axis(p, best, 1)

    def metrics(self, y, score):
        return multiclass_metrics(y, score)

    def summary(self, y):
        return {"majority_share": float(np.bincount(y).max() / len(y)) if len(y) else float("nan")}

    def evaluation(self, model, cache, features, spec, cutoff, *, constant=None, extra=None, device="cpu"):
        return WithPrior(self, model, spec, features, class_shares(cache, spec, cutoff), extra, device)

    # realized: the written classes, best first; accuracy is the hold-out's (the top class is its argmax)
    def list_k(self, spec):
        return min(LIST_K, len(spec.target.labels))

    def list_headline(self, spec):
        return "accuracy"

    def relevant(self, y):
        return np.arange(len(y)), np.asarray(y, np.int64)

    def list_metrics(self, spec, top, rows, cols):
        k = self.list_k(spec)
        return {"accuracy": list_metrics(top[:, :1], rows, cols, 1)["hr@1"],
                f"hr@{k}": list_metrics(top, rows, cols, k)[f"hr@{k}"]}

    def list_baselines(self, spec, cache, cutoff):
        prior = class_shares(cache, spec, cutoff)
        return lambda h, k, channel: {name: top_k(p, k) for name, p in class_baselines(h, prior, channel).items()}

    def lightgbm(self, lgb, params, spec, dataset, seed):
        (x_train, y_train), (x_val, y_val), (x_test, _) = dataset("train"), dataset("val"), dataset("test")
        seen = np.isin(y_val, np.unique(y_train))  # (early stopping scores classes the model knows)
        model = lgb.LGBMClassifier(**params)
        model.fit(x_train, y_train, eval_set=[(x_val[seen], y_val[seen])],
                  callbacks=[lgb.early_stopping(30, verbose=False)])
        out = np.zeros((len(x_test), self.outputs(spec)), np.float32)
        out[:, model.classes_] = model.predict_proba(x_test)
        return out


class WithPrior(PerEntity):
    """The hold-out, with the baselines read from history: the majority class (every entity gets the
    classes' shares among everyone's events of the last 30 days) and past frequency (the entity's own
    most frequent class, habitually; the shares break ties and stand in for entities without one)."""

    def __init__(self, task, model, spec, features, prior, extra, device):
        super().__init__(task, model, spec, features, None, extra, device)
        self.prior = prior

    def add(self, chunk, keep, x, h, y) -> None:
        super().add(chunk, keep, x, h, y)
        for name, p in class_baselines(h[keep], self.prior, self.features.habitual_channel).items():
            self.base.setdefault(name, []).append(p)


def class_baselines(h, prior: np.ndarray, channel: int) -> dict[str, np.ndarray]:
    """The hold-out's baselines of rows with label history `h`, as class probabilities: the majority class
    (the classes' shares `prior` for everyone) and past frequency (the row's own habitual counts; the
    shares break ties and stand in for rows without any)."""
    past = h.dense(channel).astype(np.float64) + 1e-3 * prior  # (the shares: ties and no history)
    return {"majority class": np.broadcast_to(prior, (len(past), len(prior))),
            "past frequency": past / past.sum(1, keepdims=True)}


def class_shares(cache, spec, cutoff: int) -> np.ndarray:
    """Each class's share of everyone's events of the last 30 days before `cutoff`."""
    prior = recent_popularity(cache, spec.target, cutoff).astype(np.float64)
    return prior / max(prior.sum(), 1.0)


def multiclass_metrics(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """accuracy, macro-F1 (over the classes present in y or predicted) and log-loss of probabilities
    p [n, classes] against class positions y."""
    y = np.asarray(y, np.int64)
    if len(y) == 0:
        return {"accuracy": float("nan"), "macro_f1": float("nan"), "log_loss": float("nan")}
    p = np.asarray(p, np.float64)
    pred = p.argmax(1)
    f1 = []
    for c in np.union1d(y, pred):
        tp = float(np.sum((pred == c) & (y == c)))
        fp, fn = float(np.sum((pred == c) & (y != c))), float(np.sum((pred != c) & (y == c)))
        f1.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    q = np.clip(p[np.arange(len(y)), y] / np.clip(p.sum(1), EPS, None), EPS, 1.0)
    return {"accuracy": float(np.mean(pred == y)), "macro_f1": float(np.mean(f1)), "log_loss": float(-np.log(q).mean())}


TASK = Multiclass()
