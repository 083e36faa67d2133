"""The panel's uncertainty and verdicts (bench/panel.py).

- `paired_bootstrap`: the difference of two arms' AUROC (macro AUROC over labels for [entities,
  labels] targets) on the same entities, and its variance over B resamples of the entities, drawn
  within strata (churners and stayers; entities with and without a positive label), both arms on
  the same resample, every label's AUROC recomputed on each. Vectorised: a block of resamples is a
  [block, entities] matrix of counts, and a weighted AUROC is one sort of each arm's scores.
- `combine`: over S seeds, the mean difference with Var = s^2_seed / S + the mean bootstrap variance,
  and its 95% interval.
- `verdict`: pass when the mean reaches the bar and the lower bound is above the floor, fail when the
  upper bound is below the bar, else undecided (None without a bar).
"""

import math
from dataclasses import dataclass

import numpy as np

Z95 = 1.959963984540054
MIN_POSITIVES = 5  # labels measured: as habitus.models.tasks.metrics.macro_auroc


def resample_counts(strata: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """[draws, entities] int32: how often each entity is drawn in each resample, every stratum
    resampled to its own size."""
    strata = np.asarray(strata)
    counts = np.zeros((draws, len(strata)), np.int32)
    for value in np.unique(strata):
        members = np.flatnonzero(strata == value)
        m = len(members)
        picks = rng.integers(0, m, (draws, m)) + (np.arange(draws) * m)[:, None]
        counts[:, members] = np.bincount(picks.ravel(), minlength=draws * m).reshape(draws, m)
    return counts


def weighted_auroc(y: np.ndarray, score: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC of `score` against 0/1 `y` under each row of `weights` [draws, entities] (ties count
    one half): [draws]; NaN where a row has no positive or no negative weight."""
    order = np.argsort(score, kind="stable")
    s, pos = score[order], np.asarray(y, bool)[order]
    starts = np.r_[0, np.flatnonzero(np.diff(s)) + 1]  # groups of equal scores
    w = weights[:, order]
    p = np.add.reduceat(np.where(pos, w, 0), starts, axis=1, dtype=np.float64)
    n = np.add.reduceat(np.where(pos, 0, w), starts, axis=1, dtype=np.float64)
    below = np.cumsum(n, axis=1) - n
    total = p.sum(1) * n.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (p * (below + 0.5 * n)).sum(1) / total, np.nan)


def measured(y: np.ndarray) -> np.ndarray:
    """The label columns a macro AUROC averages: at least MIN_POSITIVES positives and negatives."""
    k = y.sum(0)
    return np.flatnonzero((k >= MIN_POSITIVES) & (k <= len(y) - MIN_POSITIVES))


def metric(y: np.ndarray, score: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """AUROC ([entities] y) or macro AUROC ([entities, labels] y) under each row of `weights`."""
    if y.ndim == 1:
        return weighted_auroc(y, score, weights)
    per = np.stack([weighted_auroc(y[:, j], score[:, j], weights) for j in measured(y)], 1)
    return np.nanmean(per, 1)


def strata_of(y: np.ndarray) -> np.ndarray:
    """Churners / stayers; for label sets, entities with and without a positive label."""
    return np.asarray(y).astype(bool) if y.ndim == 1 else np.asarray(y).any(1)


@dataclass
class Paired:
    """One seed's paired comparison: the difference on all entities and its bootstrap variance."""
    diff: float
    var: float
    a: float  # arm a's figure on all entities
    b: float


def paired_bootstrap(y: np.ndarray, a: np.ndarray, b: np.ndarray, draws: int = 1000, seed: int = 0,
                     block: int = 100) -> Paired:
    """metric(a) - metric(b) on the same entities and its variance over `draws` stratified resamples."""
    return paired_many(y, {"a": a, "b": b}, [("a", "b")], draws, seed, block)[("a", "b")]


def paired_many(y: np.ndarray, arms: dict, pairs: list[tuple[str, str]], draws: int = 1000, seed: int = 0,
                block: int = 100) -> dict:
    """paired_bootstrap of each (a, b) of `pairs` over the arms' scores, every arm scored once on each
    resample (the same resamples for all): {(a, b): Paired}."""
    y = np.asarray(y)
    if y.ndim == 2:  # only the measured labels, as 0/1
        keep = measured(y)
        y, arms = y[:, keep], {k: np.asarray(v)[:, keep] for k, v in arms.items()}
    used = sorted({n for pair in pairs for n in pair})
    ones = np.ones((1, len(y)), np.int32)
    full = {n: float(metric(y, arms[n], ones)[0]) for n in used}
    rng, strata, per = np.random.default_rng(seed), strata_of(y), {n: [] for n in used}
    for start in range(0, draws, block):
        w = resample_counts(strata, min(block, draws - start), rng)
        for n in used:
            per[n].append(metric(y, arms[n], w))
    per = {n: np.concatenate(v) for n, v in per.items()}
    return {(a, b): Paired(full[a] - full[b], float(np.nanvar(per[a] - per[b], ddof=1)), full[a], full[b])
            for a, b in pairs}


@dataclass
class Interval:
    mean: float
    lo: float
    hi: float
    var: float
    seeds: int


def combine(diffs, variances) -> Interval:
    """Over seeds: mean difference, Var = s^2_seed / S + mean bootstrap variance, 95% interval."""
    d, v = np.asarray(diffs, np.float64), np.asarray(variances, np.float64)
    s = len(d)
    var = (d.var(ddof=1) / s if s > 1 else 0.0) + float(v.mean())
    half = Z95 * math.sqrt(var)
    mean = float(d.mean())
    return Interval(mean, mean - half, mean + half, var, s)


def panel_mean(intervals: list[Interval]) -> Interval:
    """The mean over datasets of their means (independent datasets: variances add, / D^2)."""
    d = len(intervals)
    mean = float(np.mean([i.mean for i in intervals]))
    var = float(sum(i.var for i in intervals)) / d ** 2
    half = Z95 * math.sqrt(var)
    return Interval(mean, mean - half, mean + half, var, min(i.seeds for i in intervals))


def verdict(mean: float, lo: float, hi: float, bar: float | None, floor: float | None) -> str | None:
    """pass: the mean reaches the bar and the lower bound is above the floor; fail: the upper bound
    is below the bar; else undecided. None: a row without a bar."""
    if bar is None:
        return None
    if mean >= bar and lo > (bar if floor is None else floor):
        return "pass"
    if hi < bar:
        return "fail"
    return "undecided"
