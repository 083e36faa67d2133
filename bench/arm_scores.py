"""Per-entity scores of every arm of bench/quality.py's rows, on identical entities, and one seed for all.

The hold-out (habitus.models.evaluate.holdout.score_holdout) reports metrics and keeps no scores for
label tasks (multilabel is scored a block of labels at a time). Within `captured()`, every hold-out
report also records, in evaluate's entity order: the entity indices, the labels, and the scores of
the model (the head chosen on validation where there is one), the network alone and each extra
baseline (LightGBM). Label tasks record dense [entities, labels] matrices of the labels the report
measures (LightGBM on a wide head: a second record on its own labels). A read-only wrap of the
evaluation objects, removed on exit: the product code is unchanged.

`seeded_lightgbm(seed)`: within the block, the scenario recipe fits its LightGBM baseline with
`seed` (the recipe itself always passes the default, 0).
"""

import contextlib

import numpy as np


@contextlib.contextmanager
def captured():
    """Yields a list that each hold-out report appends a record to: {"entities", "y", "scores":
    {arm: scores}, "labels": label positions (label tasks) or None}."""
    from habitus.models.tasks import base, multilabel
    from habitus.models.tasks.metrics import measured_labels

    records: list[dict] = []
    per_add, per_report = base.PerEntity.add, base.PerEntity.report
    block_add, block_report, block_auroc = multilabel.Blockwise.add, multilabel.Blockwise.report, \
        multilabel.blockwise_macro_auroc

    def add(self, chunk, keep, *args):
        self.__dict__.setdefault("_entities", []).append(np.asarray(chunk.entities)[keep].astype(np.int64))
        return (per_add if isinstance(self, base.PerEntity) else block_add)(self, chunk, keep, *args)

    def entities(self) -> np.ndarray:
        parts = self.__dict__.get("_entities", [])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def report(self, chosen=None):
        out = per_report(self, chosen)
        y = np.concatenate(self.ys) if self.ys else np.zeros(0)
        network = np.concatenate(self.preds) if self.preds else np.zeros(0)
        scores = {"model": network if chosen is None else np.asarray(chosen)}
        if chosen is not None:
            scores["network"] = network
        scores.update({k: np.asarray(v) for k, v in self.extra.items() if v is not None})
        records.append({"entities": entities(self), "y": y, "scores": scores, "labels": None})
        return out

    def macro(y, scorers, labels=None, **kwargs):  # evaluates each scorer on every measured label at once
        out, measured = block_auroc(y, scorers, labels, **kwargs)
        cols = measured_labels(y, labels)
        skip = {"past frequency", "popularity"}
        pending.append({"y": y.dense(0, cols).astype(np.int8), "labels": cols,
                        "scores": {k: np.asarray(f(cols), np.float32) for k, f in scorers.items() if k not in skip}})
        return out, measured

    pending: list[dict] = []

    def label_report(self, chosen=None):
        pending.clear()
        out = block_report(self, chosen)
        for p in pending:
            records.append({"entities": entities(self), **p})
        return out

    base.PerEntity.add, base.PerEntity.report = add, report
    multilabel.Blockwise.add, multilabel.Blockwise.report = add, label_report
    multilabel.blockwise_macro_auroc = macro
    try:
        yield records
    finally:
        base.PerEntity.add, base.PerEntity.report = per_add, per_report
        multilabel.Blockwise.add, multilabel.Blockwise.report = block_add, block_report
        multilabel.blockwise_macro_auroc = block_auroc


@contextlib.contextmanager
def seeded_lightgbm(seed: int):
    """The scenario recipe's LightGBM baseline fitted with `seed` within the block."""
    import functools

    from habitus.models.train import scenario

    original = scenario.lightgbm_scores
    scenario.lightgbm_scores = functools.partial(original, seed=seed)
    try:
        yield
    finally:
        scenario.lightgbm_scores = original
