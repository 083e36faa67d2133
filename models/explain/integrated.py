"""Integrated Gradients of a batch of (entity, output) pairs against the empty-history baseline."""

from dataclasses import dataclass

import numpy as np
import torch

from habitus.models.explain.inputs import Groups, with_tokens
from habitus.models.data.features import FeatureSpec, exact_buckets
from habitus.models.data.items import SparseRows, batch_history
from habitus.models.nn.network import ItemHead, Model
from habitus.models.serve.defaults import DEFAULT_STEPS
from habitus.models.tasks import task as task_of


MAX_STEPS = 64  # a pair whose gap is over the tolerance is integrated again at twice the steps, up to this
TOLERANCE = 0.01  # |gap| at most 1% of |score - baseline| ...
ABS_TOLERANCE = 1e-4  # ... plus 1e-4 x (1 + |baseline score|): float32 rounding
PAIR_BATCH = 256  # (entity, output) pairs integrated at a time: steps x pairs rows through the network


@dataclass
class Explained:
    """Attributions of m (entity row, output) pairs: `dense` [m, groups] plus, for labels whose value
    has no histogram bucket of its own (a rare item), `extra` (pair, label position, attribution)."""

    rows: np.ndarray  # [m] entity row in the chunk
    target: np.ndarray  # [m] output position (label or item), -1 for one score
    score: np.ndarray  # [m]
    baseline: np.ndarray  # [m]
    dense: np.ndarray  # [m, groups]
    extra: tuple  # (pair [e], label position [e], attribution [e])
    steps: np.ndarray | None = None  # [m] the integration steps each pair's attributions took

    def replaced(self, pairs: np.ndarray, again: "Explained") -> "Explained":
        """These attributions with those of `pairs` (positions) taken from `again` (the same pairs,
        integrated again)."""
        dense = self.dense.copy()
        dense[pairs] = again.dense
        steps = self.steps.copy()
        steps[pairs] = again.steps
        keep = ~np.isin(self.extra[0], pairs)
        extra = tuple(np.r_[a[keep], b] for a, b in zip(self.extra, (pairs[again.extra[0]], *again.extra[1:])))
        return Explained(self.rows, self.target, self.score, self.baseline, dense, extra, steps)

    @property
    def total(self) -> np.ndarray:
        """Sum of every attribution of each pair."""
        return self.dense.sum(1) + np.bincount(self.extra[0], self.extra[2], minlength=len(self.rows))

    @property
    def gap(self) -> np.ndarray:
        """Completeness: score - baseline score - the attributions' sum (0 for exact integration)."""
        return self.score - self.baseline - self.total


class Explainer:
    """Integrated Gradients of one scenario model's scores. A label head's input of the entity's own
    history of label l (its skip) joins the value group of that label (`label_group`), so "bought
    this brand before" is one reason whether the trunk or the head used it; labels without a
    histogram bucket of their own (rare items) are reasons of their own (`Explained.extra`)."""

    def __init__(self, model: Model, spec: FeatureSpec, task, groups: Groups, *, steps: int = DEFAULT_STEPS,
                 max_steps: int = MAX_STEPS, tolerance: float = TOLERANCE, device: str = "cpu",
                 item_features: np.ndarray | None = None, raw: bool = False):
        self.model, self.spec, self.task, self.groups, self.steps = model, spec, task, groups, steps
        self.raw = raw  # the network's output before the task's transform (a blend's logit: models/explain/served.py)
        self.max_steps, self.tolerance = max(max_steps, steps), tolerance
        self.dev = torch.device(device)
        self.model.to(self.dev).eval()
        self.items = isinstance(model.head, ItemHead)
        self.pop = None if item_features is None else torch.from_numpy(item_features).to(self.dev)
        self.base = torch.from_numpy(groups.baseline).to(self.dev)
        # The piecewise-linear inputs (network.Trunk.piecewise) are ramps over quantile bins, and a bin
        # whose edges coincide (a count most entities share) is a step: no quadrature integrates across
        # it. So their encoding, as the trunk's `ple` layer receives it, is integrated as inputs of its
        # own along the straight line between its two ends (a path method, like Captum's layer
        # attributions), and credited to the scalar each bin encodes: completeness then holds to
        # the quadrature's precision.
        self.ple = getattr(model.trunk, "ple", None) if getattr(model.trunk.cfg, "ple_bins", 0) else None
        self._swap, self._seen = None, None
        if self.ple is not None:
            cfg = model.trunk.cfg
            cols = np.r_[np.arange(cfg.ple_columns), spec.width - cfg.ple_tail + np.arange(cfg.ple_tail)]
            self.ple_input = torch.from_numpy(np.repeat(cols, cfg.ple_bins).astype(np.int64)).to(self.dev)

        labels = task.target.labels if task.uses_label_history else ()
        col = task.target.column
        self.label_group = np.full(len(labels), -1, np.int64)  # -1: no bucket of its own (an `extra`)
        if labels and col in spec.categorical:
            ids = np.asarray(labels, np.int64)
            own = exact_buckets(ids, spec.categorical[col], spec.buckets)
            self.label_group = np.where(own, [groups.bucket_group.get((col, int(v)), -1)
                                              for v in spec.bucket(col, ids)], -1)

    def _ple_hook(self, module, args):
        if self._swap is not None:
            return (self._swap.to(args[0].dtype),)
        self._seen = args[0].detach()
        return None

    def _transform(self, out: torch.Tensor) -> torch.Tensor:
        return task_of(self.task).transform(out)  # (recommendation: the raw item score that ranks the catalog)

    def _forward(self, targets: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None):
        """f(x [steps * m, width], values [steps * entries, channels]) -> score of each pair's target."""
        m = len(targets)

        def f(x, *more):
            s = x.shape[0] // m
            more = list(more)
            self._swap = more.pop(0) if self.ple is not None and more else None
            values = more.pop(0) if more else None
            history = None
            if values is not None:
                offset = (torch.arange(s, device=x.device) * m).repeat_interleave(len(rows))
                history = (rows.repeat(s) + offset, cols.repeat(s), values)
            elif self.task.uses_label_history:  # no history in this batch: an empty sparse history
                z = torch.zeros(0, dtype=torch.int64, device=x.device)
                history = (z, z, torch.zeros((0, self.spec.channels), dtype=x.dtype, device=x.device))
            t = targets.repeat(s)
            try:
                if self.items:
                    cand, pos = torch.unique(t, sorted=True, return_inverse=True)
                    out = self.model(x, history, cand=cand, item_features=self.pop)
                    return self._transform(out.gather(1, pos[:, None])[:, 0])
                out = self.model(x, history)
                if self.raw:
                    return out.gather(1, t[:, None])[:, 0] if out.dim() == 2 else out
                return task_of(self.task).pair_scores(out, t)
            finally:
                self._swap = None

        return f

    def _encoding(self, x: torch.Tensor) -> torch.Tensor:
        """What the trunk's `ple` layer receives for inputs x (read by its hook on a forward pass)."""
        self._seen = None
        self.model.trunk(x)
        return self._seen

    def score(self, x: np.ndarray, h: SparseRows | None, rows: np.ndarray, target: np.ndarray | None) -> np.ndarray:
        """The model's score of each (row, target) pair, inputs as given (no gradients)."""
        target = np.full(len(rows), -1, np.int64) if target is None else np.asarray(target, np.int64)
        out = []
        with torch.no_grad():
            for i in range(0, len(rows), PAIR_BATCH * 4):
                b = slice(i, i + PAIR_BATCH * 4)
                xb, vb, hr, hc = self._batch(x, h, rows[b])
                f = self._forward(torch.from_numpy(np.maximum(target[b], 0)).to(self.dev), hr, hc)
                out.append(f(xb, *self._plain(vb)).float().cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def _plain(self, vb) -> tuple:
        """The extra inputs of a forward pass with the network's own piecewise encoding."""
        return () if vb is None else ((None, vb) if self.ple is not None else (vb,))

    def _batch(self, x, h, rows):
        xb = torch.from_numpy(np.ascontiguousarray(x[rows])).to(self.dev)
        if h is None:
            return xb, None, None, None
        hr, hc, vb = batch_history(h[rows], self.dev)
        return (xb, vb, hr, hc) if len(vb) else (xb, None, None, None)

    def explain(self, x: np.ndarray, h: SparseRows | None, rows: np.ndarray, target: np.ndarray | None = None,
                steps: int | None = None) -> Explained:
        """Attributions of the pairs (entity rows[i] of x and h, output target[i]); target None for
        one score per entity. Integrated at `steps`; each pair whose gap is then over the tolerance
        (`tolerance` x |score - baseline| + ABS_TOLERANCE x (1 + |baseline|)) again at twice the
        steps, until it holds or `max_steps` is reached (Explained.steps says which). `steps` given:
        at that many only (a caller that checks a gap of its own: models/explain/served.py)."""
        rows = np.asarray(rows, np.int64)
        target = np.full(len(rows), -1, np.int64) if target is None else np.asarray(target, np.int64)
        hook = self.ple.register_forward_pre_hook(self._ple_hook) if self.ple is not None else None
        last = self.max_steps if steps is None else steps
        try:
            steps = self.steps if steps is None else steps
            ex = self._explain_pairs(x, h, rows, target, steps)
            while steps < last:
                over = np.flatnonzero(np.abs(ex.gap) > self.tolerance * np.abs(ex.score - ex.baseline)
                                      + ABS_TOLERANCE * (1 + np.abs(ex.baseline)))
                if not len(over):
                    break
                steps = min(2 * steps, last)
                ex = ex.replaced(over, self._explain_pairs(x, h, rows[over], target[over], steps))
        finally:
            if hook is not None:
                hook.remove()
        return ex

    def _explain_pairs(self, x, h, rows: np.ndarray, target: np.ndarray, steps: int) -> Explained:
        parts = [self._explain_batch(x, h, rows[i:i + PAIR_BATCH], target[i:i + PAIR_BATCH], i, steps)
                 for i in range(0, len(rows), PAIR_BATCH)]
        cat = lambda j, dt: np.concatenate([p[j] for p in parts]).astype(dt) if parts else np.zeros(0, dt)  # noqa: E731
        dense = np.concatenate([p[2] for p in parts]) if parts else np.zeros((0, len(self.groups)), np.float32)
        return Explained(rows, target, cat(0, np.float32), cat(1, np.float32), dense,
                         (cat(3, np.int64), cat(4, np.int64), cat(5, np.float32)), np.full(len(rows), steps, np.int64))

    def _explain_batch(self, x, h, rows, target, offset: int, steps: int) -> tuple:
        """(score, baseline score, grouped attributions [pairs, groups], extra pair, label, attribution)."""
        xb, vb, hr, hc = self._batch(x, h, rows)
        f = self._forward(torch.from_numpy(np.maximum(target, 0)).to(self.dev), hr, hc)
        xempty = self.base.expand_as(xb).contiguous()
        xbase = with_tokens(xempty, xb, self.spec.width)  # (the empty history itself without a sequence encoder)
        with torch.no_grad():
            score = f(xb, *self._plain(vb)).float().cpu().numpy()
            base = f(xempty).float().cpu().numpy()  # no history at all: not even the entries, at zero
            tokens = f(xbase).float().cpu().numpy() - base if xbase is not xempty else None
            start = base if tokens is None else base + tokens
            # the path starts at the entity's history entries with zero values; a head that scores an
            # entry for being there (a pairwise scorer) moves the score by that alone: credited to the
            # explained label's own value, it keeps the sum equal to score - baseline score
            present = (f(xbase, *self._plain(torch.zeros_like(vb))).float().cpu().numpy() - start
                       if vb is not None else np.zeros_like(base))
            inputs, bases = [xb], [xbase]
            if self.ple is not None:
                inputs.append(self._encoding(xb))
                bases.append(self._encoding(xbase))
        if vb is not None:
            inputs.append(vb)
            bases.append(torch.zeros_like(vb))
        attr = integrated_gradients(f, inputs, bases, steps)
        ax = attr[0].detach()
        if self.ple is not None:  # each bin's share goes to the scalar it encodes
            ax = ax.index_add(1, self.ple_input, attr[1].detach().to(ax.dtype))
        if tokens is not None:  # what the tokens add to the empty history: the sequence group's (with_tokens)
            ax[:, self.spec.width] += torch.from_numpy(tokens).to(ax)
        of_input = torch.from_numpy(self.groups.of_input).to(self.dev)
        g = torch.zeros((len(xb), len(self.groups)), dtype=ax.dtype, device=self.dev).index_add_(1, of_input, ax)
        g = g.float().cpu().numpy()
        e_pair, e_label, e_value = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        if vb is not None:  # each history entry's attribution joins its label's value group
            pair = np.r_[hr.cpu().numpy(), np.flatnonzero(present)]
            label = np.r_[hc.cpu().numpy(), target[present != 0]]
            value = np.r_[attr[-1].detach().sum(1).float().cpu().numpy(), present[present != 0]]
            grp = self.label_group[label]
            own = grp >= 0
            np.add.at(g, (pair[own], grp[own]), value[own])
            rest = ~own & (value != 0)  # a rare label: a reason of its own
            e_pair, e_label, e_value = pair[rest] + offset, label[rest], value[rest]
        return score, base, g, e_pair, e_label, e_value

    def masked(self, x: np.ndarray, h: SparseRows | None, rows: np.ndarray, mask: np.ndarray
               ) -> tuple[np.ndarray, SparseRows | None]:
        """The pairs' inputs with the groups mask[i] (bool [m, groups]) deleted: their inputs at the
        baseline, the history entries of their labels dropped (a rare label's own history, which has
        no group, stays). The inputs of the deletion test (bench/explain.py): (x [m, width], history
        [m rows])."""
        xm = np.array(x[rows], copy=True)
        hide = mask[:, self.groups.of_input]
        xm[hide] = np.broadcast_to(self.groups.baseline, xm.shape)[hide]
        if h is None:
            return xm, None
        hm = h[rows]
        grp = self.label_group[hm.cols]
        entry_rows = hm.rows
        keep = ~((grp >= 0) & mask[entry_rows, np.maximum(grp, 0)])
        kept = SparseRows.from_pairs(entry_rows[keep], hm.cols[keep], hm.values[keep], len(rows), hm.n_cols)
        return xm, kept


def integrated_gradients(f, inputs: list[torch.Tensor], bases: list[torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Integrated Gradients of f's outputs (one per row of inputs[0]) along the straight line from
    `bases` to `inputs`, by `steps`-point Gauss-Legendre quadrature: what Captum's
    IntegratedGradients(f).attribute(inputs, baselines=bases, n_steps=steps, method="gausslegendre")
    returns (tests/models/test_explain.py compares them), without its import or its bookkeeping. f
    takes each input stacked `steps` times along dim 0, step after step, and returns one output per
    row of the stacked first input; outputs depend only on their own row (and its history entries)."""
    nodes, weights = np.polynomial.legendre.leggauss(steps)
    alphas, weights = (nodes + 1) / 2, weights / 2
    paths = [torch.cat([b + float(a) * (i - b) for a in alphas]).requires_grad_(True) for i, b in zip(inputs, bases)]
    with torch.enable_grad():
        grads = torch.autograd.grad(f(*paths).sum(), paths, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, paths)]
    w = torch.as_tensor(weights, dtype=inputs[0].dtype, device=inputs[0].device)
    return [(g.view(steps, *i.shape) * w.view(-1, *([1] * i.dim()))).sum(0) * (i - b)
            for g, i, b in zip(grads, inputs, bases)]
