"""Heads chosen on validation: the fine-tuned network, gradient-boosted trees over [the foundation
model's embedding + the hand features habitus already builds], or a blend of both.

Candidates, for a task type with a `stacking` (habitus.models.tasks.base.Stacking: binary,
regression, multilabel):

- "network": the fine-tuned scenario network alone (what habitus scored before);
- "gbt": LightGBM over [hand features (habitus.models.evaluate.baselines.hand_features, what the LightGBM baseline
  reads) + the entity's representation by the *foundation* trunk, reduced to its first 16 principal
  components (`StackConfig.components`)]. The foundation's trunk, not the fine-tuned
  one: that trunk has seen the training cut-offs' labels, so trees fitted on it there would trust
  it more than it deserves at a later cut-off. Its 256 floats as they are dilute the trees' inputs
  (docs/journal/quality.md, "Heads chosen on validation");
- "blend": w x gbt + (1 - w) x network, on logits for probabilities, on amounts for regression
  (`Stacking.logits`), one w from `StackConfig.weights` for the whole head.

The choice is made on the validation cut-off only, never the test cut-off. The trees train on the
training cut-offs; the validation entities are split in two folds by a hash of the entity index
(`choice_fold`): trees early-stopped on one fold score the other, and the other way round
(`StackConfig.cross_fit`), so every validation row is scored by trees that did not pick their
number of trees on it, and the candidates and the weight are compared on all of them. The stack
keeps both folds' trees and scores with their mean. The weight (`StackConfig.choice_rule`,
"one_se"): of the weights whose validation score is within one standard error of the best one's,
the nearest to an equal blend, so a small validation set (MovieLens's) does not pick a
lopsided weight on noise. The network's epochs (habitus.models.train.finetune's greedy soup) were chosen on all
of the validation rows: its validation figure is that much optimistic.

The LightGBM *baseline* (habitus.models.evaluate.baselines.lightgbm_scores) stays the same trees without the
foundation's inputs, so what the foundation model adds is measured, not hidden.

Multilabel heads (`Stacking.per_label`): one small model per label (as the baseline, on
`multilabel_rows` training rows), on the `max_labels` labels with the most training positives;
every other label keeps the network's score (a 16,000-product head: trees for 50 of them, so it
stays fast to fit and to score). The labels' models share one binned dataset. A Stack saves as plain values (`state()` / `Stack.from_state`): LightGBM boosters as their text
dumps, the embedding's reduction as arrays, and the choice with every candidate's validation score
(`summary()`).
"""

import time
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np

from habitus.models.evaluate.baselines import MULTILABEL_ROWS
from habitus.models.heads.stacked_rows import Rows, choice_fold
from habitus.models.nn.profile import principal_axes
from habitus.models.tasks import task as task_of
from habitus.models.tasks.base import Stacking


@dataclass
class StackConfig:
    # the foundation's representation enters the trees as its first `components` principal components
    # (fitted on the training rows): its floats as they are dilute the trees' inputs
    components: int = 16
    choice_share: float = 0.5  # validation entities kept out of early stopping, for the choice
    cross_fit: bool = True  # and the other way round: the choice reads every validation row
    weights: tuple[float, ...] = tuple(round(0.1 * i, 1) for i in range(11))  # w of the trees in the blend
    # "best": the weight with the best validation score; "one_se": of the weights whose score is
    # within one standard error of the best (from `se_blocks` disjoint blocks of the validation
    # entities), the one nearest an equal blend (0.5): equal weights are the robust combination
    # of two forecasts when the validation rows cannot tell the weights apart
    choice_rule: str = "one_se"
    se_blocks: int = 10
    max_labels: int = 50  # multilabel: labels with trees (the rest keep the network's score)
    multilabel_rows: int = MULTILABEL_ROWS  # training rows per label's model
    # the baseline's LightGBM parameters (habitus.models.evaluate.baselines.lightgbm_scores), so the two differ by their inputs
    n_estimators: int = 400
    learning_rate: float = 0.05
    num_leaves: int = 31
    min_child_samples: int = 50
    colsample_bytree: float = 0.8
    early_stopping: int = 30
    label_n_estimators: int = 100
    label_learning_rate: float = 0.1
    label_num_leaves: int = 15
    label_early_stopping: int = 15
    seed: int = 0
    threads: int = 0  # LightGBM's: 0 = OpenMP's default (OMP_NUM_THREADS, else every core)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StackConfig":
        d = dict(d)
        d["weights"] = tuple(d.get("weights", cls.weights))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# ---------------------------------------------------------------- the embedding's way into the trees


@dataclass
class Reduction:
    """The foundation's representation as tree inputs: its first principal components."""

    mean: np.ndarray  # [hidden]
    matrix: np.ndarray  # [hidden, components]
    kind = "pca"  # (as stack.json records it)

    @classmethod
    def fit(cls, emb: np.ndarray, cfg: StackConfig) -> "Reduction":
        rng = np.random.default_rng(cfg.seed)
        mean, _, vt = principal_axes(emb[rng.permutation(len(emb))[:100_000]])
        return cls(mean.astype(np.float32), vt[:cfg.components].T.astype(np.float32))

    def apply(self, emb: np.ndarray) -> np.ndarray:
        # in float64, then float32: a float32 product rounds by how many rows it has (its BLAS kernel), and
        # one float's last bit can move an entity across a tree's split (scored in chunks or all at once)
        z = emb.astype(np.float64) - self.mean
        return (z @ self.matrix.astype(np.float64)).astype(np.float32)

    def state(self) -> dict:
        return {"kind": self.kind, "mean": self.mean.tolist(), "matrix": self.matrix.tolist()}

    @classmethod
    def from_state(cls, d: dict) -> "Reduction":
        if d.get("kind") != cls.kind:
            raise ValueError(f"the trees read the representation as {d.get('kind')!r}; only {cls.kind!r} is known")
        return cls(np.asarray(d["mean"], np.float32), np.asarray(d["matrix"], np.float32))


# ---------------------------------------------------------------- the stack


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(p, np.float64), 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def stacking(task: str) -> Stacking:
    """The task type's Stacking (a task without one has no stack)."""
    rule = task_of(task).stacking
    if rule is None:
        raise ValueError(f"no stack for {task} scenarios")
    return rule


def blend(task: str, network: np.ndarray, gbt: np.ndarray, w: float) -> np.ndarray:
    """w x trees + (1 - w) x network: on logits for probabilities, on amounts (Stacking.logits)."""
    if w == 0:
        return np.asarray(network, np.float32)
    if w == 1:
        return np.asarray(gbt, np.float32)
    if not stacking(task).logits:
        return (w * gbt + (1 - w) * network).astype(np.float32)
    return (1 / (1 + np.exp(-(w * _logit(gbt) + (1 - w) * _logit(network))))).astype(np.float32)


def score(task: str, y: np.ndarray, s: np.ndarray) -> float:
    """The choice's criterion, higher is better (Stacking.criterion: AUROC, macro AUROC, minus MAE)."""
    return stacking(task).criterion(y, s)


@dataclass
class Stack:
    task: str
    config: StackConfig
    reduction: Reduction
    # lightgbm Boosters: per validation fold (StackConfig.cross_fit: two), one (binary, regression)
    # or one per label (Stacking.per_label; None: a label constant in training, scored `constants[label]`)
    boosters: list
    constants: list
    labels: np.ndarray | None  # multilabel: the label positions the trees cover (sorted; None: all)
    weight: float  # w of the trees: 0 = network, 1 = trees
    validation: dict = field(default_factory=dict)  # every candidate's score on the choice fold(s)
    info: dict = field(default_factory=dict)
    seconds: float | None = None  # the fit's wall-clock time (metadata only; not saved in stack.json)

    @property
    def chosen(self) -> str:
        return "network" if self.weight == 0 else "gbt" if self.weight == 1 else "blend"

    def gbt_scores(self, rows: Rows, folds: list[int] | None = None) -> np.ndarray:
        """The trees' probabilities / amounts for `rows`: the mean over the folds' boosters (`folds`:
        those only)."""
        folds = range(len(self.boosters)) if folds is None else folds
        return np.mean([self._fold_scores(self.boosters[f], rows) for f in folds], axis=0).astype(np.float32)

    def _fold_scores(self, boosters: list, rows: Rows) -> np.ndarray:
        x = np.concatenate([rows.hand, self.reduction.apply(rows.embedding)], 1)
        if not stacking(self.task).per_label:
            return boosters[0].predict(x)
        out = np.zeros((len(rows), len(boosters)), np.float32)
        for j, (b, c) in enumerate(zip(boosters, self.constants)):
            out[:, j] = c if b is None else b.predict(x)
        return out

    def predict(self, rows: Rows, gbt: np.ndarray | None = None) -> np.ndarray:
        """The chosen candidate's scores (rows.network: the network's, needed unless the trees alone
        were chosen); multilabel: of the covered labels (self.labels), the network's elsewhere."""
        if self.weight == 0:
            return rows.network
        gbt = self.gbt_scores(rows) if gbt is None else gbt
        return gbt if self.weight == 1 else blend(self.task, rows.network, gbt, self.weight)

    def summary(self) -> dict:
        """What the checkpoint's metadata records: the choice and every candidate's validation score."""
        return {"chosen": self.chosen, "weight": self.weight, "embedding": self.reduction.kind,
                "validation": self.validation,
                "labels": None if self.labels is None else len(self.labels), **self.info}

    def state(self) -> dict:
        """Plain values (strings, lists, numbers): saved with the scenario's checkpoint."""
        return {"task": self.task, "config": self.config.to_dict(), "reduction": self.reduction.state(),
                "boosters": [[None if b is None else b.model_to_string() for b in fold] for fold in self.boosters],
                "constants": [float(c) for c in self.constants],
                "labels": None if self.labels is None else self.labels.tolist(), "weight": self.weight,
                "validation": self.validation, "info": self.info}

    @classmethod
    def from_state(cls, d: dict) -> "Stack":
        import lightgbm as lgb

        boosters = [[None if s is None else lgb.Booster(model_str=s) for s in fold] for fold in d["boosters"]]
        return cls(d["task"], StackConfig.from_dict(d["config"]), Reduction.from_state(d["reduction"]), boosters,
                   list(d["constants"]), None if d["labels"] is None else np.asarray(d["labels"], np.int64),
                   float(d["weight"]), d.get("validation", {}), d.get("info", {}))


def fit_stack(task: str, train: Rows, val: Rows, cfg: StackConfig | None = None,
              labels: np.ndarray | None = None, log=lambda _: None) -> Stack:
    """The trees on `train`, early-stopped on one fold of the validation entities, and the choice
    among network, trees and blends on the other fold (val.network: the fine-tuned network's scores).
    With `cfg.cross_fit` the folds swap too: every validation row is scored by the trees that did not
    stop on it, the choice reads all of them, and the stack keeps both folds' trees (their mean)."""
    cfg = cfg or StackConfig()
    rule = stacking(task)
    started = time.time()
    fold = choice_fold(val.entities, cfg.choice_share)
    splits = [(~fold, fold)] + ([(fold, ~fold)] if cfg.cross_fit else [])
    if not fold.any() or fold.all():  # too few validation entities to split: both use all of them
        everything = np.ones(len(val), bool)
        splits = [(everything, everything)]
    reduction = Reduction.fit(train.embedding, cfg)
    if rule.per_label:
        train = train.take(np.sort(np.random.default_rng(cfg.seed).permutation(len(train))[:cfg.multilabel_rows]))
    boosters, constants = [], []
    oof = None  # the trees' scores of each validation row, from the trees that did not stop on it
    chosen_rows = np.zeros(len(val), bool)
    for stop, choose in splits:
        fold_boosters, constants = _fit_fold(rule, train, val.take(stop), reduction, cfg)
        boosters.append(fold_boosters)
        part = Stack(task, cfg, reduction, [fold_boosters], constants, labels, 1.0).gbt_scores(val.take(choose))
        oof = np.zeros((len(val),) + part.shape[1:], np.float32) if oof is None else oof
        oof[choose] = part
        chosen_rows |= choose
    fit_s = time.time() - started
    stack = Stack(task, cfg, reduction, boosters, constants, labels, 0.0)
    picked = val.take(chosen_rows)
    gbt = oof[chosen_rows]
    # every weight's validation score, the candidates' ends (0, 1) always; the choice among cfg.weights
    grid = {w: score(task, picked.y, blend(task, picked.network, gbt, w))
            for w in sorted({float(w) for w in cfg.weights} | {0.0, 1.0})}
    allowed = {w: grid[float(w)] for w in cfg.weights}
    best_w = max(allowed, key=lambda w: (np.nan_to_num(allowed[w], nan=-np.inf), -abs(w)))  # ties: the network
    se = None
    if cfg.choice_rule == "one_se":
        best_w, se = _one_se(task, picked, gbt, allowed, best_w, cfg)
    elif cfg.choice_rule != "best":
        raise ValueError(f"StackConfig.choice_rule must be 'best' or 'one_se', got {cfg.choice_rule!r}")
    inner = {w: v for w, v in grid.items() if 0 < w < 1}
    best_inner = max(inner, key=lambda w: np.nan_to_num(inner[w], nan=-np.inf)) if inner else None
    stack.weight = float(best_w)
    stack.validation = {"network": grid.get(0.0), "gbt": grid.get(1.0),
                        "blend": None if best_inner is None else inner[best_inner],
                        "blend_weight": best_inner, "chosen": grid[best_w],
                        "by_weight": {str(w): v for w, v in grid.items()},
                        "choice_rows": int(chosen_rows.sum()), "folds": len(splits), "rule": cfg.choice_rule,
                        **({} if se is None else {"standard_errors": se})}
    trees = [b.num_trees() for fold_boosters in boosters for b in fold_boosters if b is not None]
    width = reduction.apply(train.embedding[:1]).shape[1]
    # the fit's wall-clock time is metadata, not part of stack.json: the same data gives the same file
    stack.seconds = round(fit_s, 1)
    stack.info = {"trees": int(np.sum(trees)), "models": len(trees),
                  "train_rows": int(len(train)), "hand_width": int(train.hand.shape[1]), "embedding_width": int(width)}
    log(f"stack {task}: chose {stack.chosen} (w {stack.weight}) on {int(chosen_rows.sum())} validation rows: "
        f"network {grid.get(0.0):.4f}, trees {grid.get(1.0):.4f}, best blend {stack.validation['blend']}; "
        f"{fit_s:.0f}s")
    return stack


def refit_stack(stack: Stack, train: Rows) -> Stack:
    """The trees of `stack` trained again on `train` (later cut-offs: the refit, models/train/refit.py)
    with the same settings, labels, rounds (each measured booster's, no early stopping: nothing is
    read beyond `train`) and the same weight; the reduction is fitted again on `train`. The choice and
    its validation figures are the measured stack's."""
    import lightgbm as lgb

    cfg, rule = stack.config, stacking(stack.task)
    reduction = Reduction.fit(train.embedding, cfg)
    if rule.per_label:
        train = train.take(np.sort(np.random.default_rng(cfg.seed).permutation(len(train))[:cfg.multilabel_rows]))
    x = np.concatenate([train.hand, reduction.apply(train.embedding)], 1)
    y = train.y if rule.per_label else train.y[:, None]
    params = (_params(cfg, rule.objective, cfg.label_learning_rate, cfg.label_num_leaves) if rule.per_label
              else _params(cfg, rule.objective, cfg.learning_rate, cfg.num_leaves))
    data = _data(x, np.ascontiguousarray(y[:, 0]))
    boosters, constants = [], []
    for fold in stack.boosters:
        out, constants = [], []
        for j, measured in enumerate(fold):
            column = y[:, j]
            if measured is None or column.min() == column.max():
                out.append(None)
                constants.append(float(column.mean()) if len(column) else 0.0)
                continue
            data.set_label(np.ascontiguousarray(column))
            out.append(lgb.train(params, data, max(1, measured.num_trees())))
            constants.append(0.0)
        boosters.append(out)
    info = {**stack.info, "refit_train_rows": int(len(train))}
    return Stack(stack.task, cfg, reduction, boosters, constants, stack.labels, stack.weight, stack.validation, info)


def _one_se(task: str, picked: Rows, gbt: np.ndarray, grid: dict, best_w: float, cfg: StackConfig):
    """(weight, {weight: standard error of its gap to the best}): the weight nearest 0.5 among those
    within one standard error of the best. The error of each gap is read from `cfg.se_blocks`
    disjoint blocks of the rows (by a hash of the entity, as the folds), each block scored alone."""
    h = (np.asarray(picked.entities, np.uint64) * np.uint64(0xD1B54A32D192ED03)) >> np.uint64(40)
    block = (h % np.uint64(cfg.se_blocks)).astype(np.int64)
    per = {w: [] for w in grid}
    for b in range(cfg.se_blocks):
        rows = picked.take(block == b)
        if len(rows) < 2:
            continue
        g = gbt[block == b]
        for w in grid:
            per[w].append(score(task, rows.y, blend(task, rows.network, g, w)))
    se, near = {}, []
    for w in grid:
        gaps = np.asarray(per[best_w], np.float64) - np.asarray(per[w], np.float64)
        gaps = gaps[np.isfinite(gaps)]
        se[str(w)] = float(gaps.std(ddof=1) / np.sqrt(len(gaps))) if len(gaps) > 1 else float("inf")
        if np.isfinite(grid[w]) and grid[best_w] - grid[w] <= se[str(w)]:
            near.append(w)
    pick = min(near, key=lambda w: (abs(w - 0.5), -grid[w])) if near else best_w
    return float(pick), se


def _fit_fold(rule: Stacking, train: Rows, stop: Rows, reduction: Reduction, cfg: StackConfig) -> tuple[list, list]:
    """(boosters, constants): the trees on `train`, early-stopped on `stop`."""
    x_train = np.concatenate([train.hand, reduction.apply(train.embedding)], 1)
    x_stop = np.concatenate([stop.hand, reduction.apply(stop.embedding)], 1)
    if not rule.per_label:
        params = _params(cfg, rule.objective, cfg.learning_rate, cfg.num_leaves)
        d_tr = _data(x_train, train.y)
        d_st = _data(x_stop, stop.y, d_tr)
        return [_train(params, d_tr, d_st, cfg.n_estimators, cfg.early_stopping)], [0.0]
    params = _params(cfg, rule.objective, cfg.label_learning_rate, cfg.label_num_leaves)
    # one binned dataset for every label's model: only the label changes
    d_tr = _data(x_train, train.y[:, 0])
    d_st = _data(x_stop, stop.y[:, 0], d_tr)
    boosters, constants = [], []
    for j in range(train.y.shape[1]):
        y = train.y[:, j]
        if y.min() == y.max():
            boosters.append(None)
            constants.append(float(y[0]) if len(y) else 0.0)
            continue
        d_tr.set_label(np.ascontiguousarray(y))  # (a column view: LightGBM warns about sliced arrays)
        d_st.set_label(np.ascontiguousarray(stop.y[:, j]))
        boosters.append(_train(params, d_tr, d_st, cfg.label_n_estimators, cfg.label_early_stopping))
        constants.append(0.0)
    return boosters, constants


def _params(cfg: StackConfig, objective: str, learning_rate: float, leaves: int) -> dict:
    """The baseline's LightGBM parameters (habitus.models.evaluate.baselines.lightgbm_scores) in LightGBM's own names."""
    return dict(objective=objective, learning_rate=learning_rate, num_leaves=leaves,
                min_data_in_leaf=cfg.min_child_samples, bagging_fraction=0.8, bagging_freq=1,
                feature_fraction=cfg.colsample_bytree, max_bin=63, seed=cfg.seed, verbose=-1,
                num_threads=cfg.threads)


def _data(x: np.ndarray, y: np.ndarray, reference=None):
    import lightgbm as lgb

    with warnings.catch_warnings():  # ("Overriding the parameters from Reference Dataset": the same ones)
        warnings.simplefilter("ignore", UserWarning)
        return lgb.Dataset(np.ascontiguousarray(x, np.float32), label=np.ascontiguousarray(y), reference=reference,
                           params={"max_bin": 63, "verbose": -1}, free_raw_data=True).construct()


def _train(params: dict, d_train, d_stop, rounds: int, patience: int):
    """A booster early-stopped on `d_stop`, cut at its best iteration (its text dump predicts alike)."""
    import lightgbm as lgb

    b = lgb.train(params, d_train, rounds, valid_sets=[d_stop],
                  callbacks=[lgb.early_stopping(patience, verbose=False)])
    if b.best_iteration and b.best_iteration < b.current_iteration():
        b = lgb.Booster(model_str=b.model_to_string(num_iteration=b.best_iteration))
    return b
