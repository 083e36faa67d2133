"""Explanations of the score a scenario serves where its head chosen on validation (models/heads/stacked_head.py)
blends LightGBM trees into the network: w x trees + (1 - w) x network, on logits for probabilities, on
amounts for regression (habitus.models.heads.stacking.blend; w is the trees' weight).

On that scale the served score is linear in its two parts, so its attributions are (1 - w) x the network's
Integrated Gradients (of its logit, or amount) + w x the trees' exact contributions (LightGBM's
`pred_contrib`, TreeSHAP). Both are taken from the same baseline, the stranger of habitus.models.explain.inputs (no
history, the population's average attributes), so the served baseline score is the served head's score of
that stranger, and the attributions sum to served score - served baseline score:

- the trees' contributions of the entity minus the stranger's (each TreeSHAP sums to its margin minus the
  trees' mean, so the difference sums to margin(entity) - margin(stranger)); the stack averages its folds'
  *probabilities*, so each fold's contributions are carried to probabilities by that fold's secant
  (sigmoid(m) - sigmoid(m0)) / (m - m0), averaged, and to the logit of the average by the secant of the
  logit: exact, sign-preserving rescalings (regression: the folds' mean, nothing to rescale);
- the hand features go to the groups of the columns and values they are computed from (HandMap);
- the foundation representation's components are linear in the foundation trunk's output, so component k's
  contribution T_k is spread over the network's inputs by Integrated Gradients of a_k x component_k(trunk(x)),
  a_k = T_k / (component_k(entity) - component_k(stranger)); a component the entity barely moves (under 1% of
  the representation's movement, where a_k would blow up) stays in one `representation` group;
- for probabilities the logit-scale attributions are then put in probability units by one more secant,
  (p - p0) / (z - z0) per score: completeness holds in the units predictions write.
"""

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from habitus.models.data.features import ENTITY_BUCKETS, HALF_LIVES, bucket_count
from habitus.models.evaluate.baselines import MAX_VOCAB, TOP_VALUES
from habitus.models.explain.inputs import Groups, scalar_names, with_tokens
from habitus.models.explain.integrated import ABS_TOLERANCE, Explained, Explainer, integrated_gradients
from habitus.models.tasks import task as task_of

REPRESENTATION = ("representation", "foundation", "representation", "foundation representation (other components)")
STABLE_SHARE = 0.01  # a component moved by less than this share of the representation's movement stays whole
CLIP = float(np.log((1 - 1e-6) / 1e-6))  # habitus.models.heads.stacking._logit's clip, on the logit scale


@dataclass
class HandMap:
    """Per hand feature of the trees (habitus.models.evaluate.baselines.hand_features): its group (-1: a rare label's own
    history, a reason of its own), its label position (label columns, else -1) and the stranger's value."""

    group: np.ndarray
    label: np.ndarray
    baseline: np.ndarray


def served_groups(groups: Groups, spec) -> tuple[Groups, dict]:
    """The network's groups plus those only the trees read (a hand scalar at a half-life the network has
    not) and the `representation` group, none with network inputs; and (kind, column, text) -> group of
    every scalar."""
    kind, source, column, value = list(groups.kind), list(groups.source), list(groups.column), list(groups.value)
    events = groups.source[0]
    scalars = {(k, c, d): g for g, (k, c, d) in enumerate(scalar_names(spec))}
    for k, c, d in scalar_names(dataclasses.replace(spec, half_lives=HALF_LIVES, visits=True)):
        if (k, c, d) not in scalars:
            scalars[(k, c, d)] = len(kind)
            kind.append(k), source.append(events), column.append(c), value.append(d)
    for lst, v in zip((kind, source, column, value), REPRESENTATION):
        lst.append(v)
    extra = len(kind) - len(groups)
    out = Groups(kind, source, column, value, np.r_[groups.value_id, np.full(extra, -1)].astype(np.int64),
                 groups.of_input, groups.baseline, groups.bucket_group)
    return out, scalars


def hand_map(spec, task, groups: Groups, scalars: dict, label_group: np.ndarray, labels) -> HandMap:
    """Where each hand feature goes, in hand_features' order: the RFM and visit scalars (the same names as
    the network's), the entity's attributes (the network's own encoding), the decayed counts of each small
    column's most frequent values, the labels' own history."""
    group, label, base = [], [], []
    for k, c, d in scalar_names(dataclasses.replace(spec, half_lives=HALF_LIVES, visits=True)):
        g = scalars[(k, c, d)]
        group.append(g), label.append(-1)
        base.append(float(groups.baseline[g]) if g < spec.scalar_width else 0.0)  # network scalars: one input each
    ent = sum(bucket_count(v, ENTITY_BUCKETS) for v in spec.entity_categorical.values()) + spec.entity_scalar_width
    for i in range(spec.width - ent, spec.width):  # the same columns as the network's last ones
        group.append(int(groups.of_input[i])), label.append(-1), base.append(float(groups.baseline[i]))
    for c, vocab in spec.categorical.items():
        if vocab > MAX_VOCAB:
            continue
        ids = np.arange(1, min(TOP_VALUES, vocab) + 1)
        for b in spec.bucket(c, ids):
            group.append(groups.bucket_group[(c, int(b))]), label.append(-1), base.append(0.0)
    if task.uses_label_history:
        positions = np.arange(task.outputs) if labels is None else np.asarray(labels, np.int64)
        for lab in positions:
            group.append(int(label_group[lab])), label.append(int(lab)), base.append(0.0)
    return HandMap(np.asarray(group, np.int64), np.asarray(label, np.int64), np.asarray(base, np.float32))


@dataclass
class StackInputs:
    """The stack's rows of a chunk's eligible entities (HeadStack.rows, as predictions computes them) and
    `position[r]`: the row of chunk row r among them (-1: not eligible)."""

    rows: object
    position: np.ndarray


def _secant(hi, lo, f, df):
    """(f(hi) - f(lo)) / (hi - lo), the derivative at hi where they (nearly) coincide."""
    d = hi - lo
    near = np.abs(d) < 1e-9
    return np.where(near, df(hi), (f(hi) - f(lo)) / np.where(near, 1.0, d))


def _sigmoid(z):
    return 1 / (1 + np.exp(-z))


def _logit(p):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


class ServedExplainer:
    """Attributions of the served score of a stacked head (module docstring). `explain` and `score` take
    what Explainer's do plus the chunk's StackInputs."""

    def __init__(self, model, head, spec, task, groups: Groups, *, device: str = "cpu", **integration):
        self.head, self.spec, self.task = head, spec, task
        self.stack = head.stack
        self.w = float(head.weight)
        rule = task_of(task).stacking
        self.logits, self.per_label = rule.logits, rule.per_label  # the blend's scale; trees per label
        self.net = Explainer(model, spec, task, groups, device=device, raw=self.logits, **integration)
        self.steps, self.max_steps, self.tolerance = self.net.steps, self.net.max_steps, self.net.tolerance
        self.label_group = self.net.label_group
        self.groups, scalars = served_groups(groups, spec)
        self.rep_group = len(self.groups) - 1
        self.hand = hand_map(spec, task, groups, scalars, self.label_group, self.stack.labels)
        width = self.stack.info.get("hand_width")
        if width is not None and width != len(self.hand.group):
            raise ValueError(f"the stack's trees read {width} hand features, the explanation maps {len(self.hand.group)}")
        self.dev = torch.device(device)
        self.trunk = head.trunk.float().to(self.dev).eval()
        with torch.no_grad():
            self.base_emb = self.trunk(torch.from_numpy(groups.baseline[None]).to(self.dev)).double().cpu().numpy()
        self.ple = getattr(self.trunk, "ple", None) if getattr(self.trunk.cfg, "ple_bins", 0) else None
        self._swap = None
        if self.ple is not None:
            cfg = self.trunk.cfg
            cols = np.r_[np.arange(cfg.ple_columns), spec.width - cfg.ple_tail + np.arange(cfg.ple_tail)]
            self.ple_input = torch.from_numpy(np.repeat(cols, cfg.ple_bins).astype(np.int64)).to(self.dev)

    # ------------------------------------------------------------ the trees
    def covered(self, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the trees' weight of each pair, the label's column among the stack's labels): multilabel labels
        without trees keep the network's score (weight 0)."""
        if not self.per_label:
            return np.full(len(target), self.w), np.zeros(len(target), np.int64)
        labels = np.arange(self.task.outputs) if self.stack.labels is None else self.stack.labels
        j = np.clip(np.searchsorted(labels, target), 0, len(labels) - 1)
        cov = labels[j] == target
        return np.where(cov, self.w, 0.0), np.where(cov, j, -1)

    def _tree_inputs(self, hand: np.ndarray, emb: np.ndarray) -> np.ndarray:
        return np.concatenate([hand, self.stack.reduction.apply(emb.astype(np.float32))], 1).astype(np.float32)

    def trees(self, hand: np.ndarray, emb: np.ndarray, column: np.ndarray) -> tuple:
        """For m pairs (hand [m, H], foundation representation [m, hidden], the stack's label column, -1 for
        none): the trees' score and the stranger's on the blend's scale (logit, amount), and the
        contributions [m, H + tree inputs of the representation] that sum to their difference."""
        m, H = hand.shape
        z, z0 = np.zeros(m), np.zeros(m)
        contrib = None
        labelled = self.per_label
        for j in (np.unique(column[column >= 0]) if labelled else [None]):
            sel = np.flatnonzero(column == j) if labelled else np.arange(m)
            x = self._tree_inputs(hand[sel], emb[sel])
            xs = self._tree_inputs(self.hand.baseline[None], self.base_emb)
            prob, prob0, part = np.zeros(len(sel)), np.zeros(1), np.zeros((len(sel), x.shape[1]))
            folds = [f[0 if j is None else int(j)] for f in self.stack.boosters]
            for b in folds:
                if b is None:  # a label constant in training: no contribution, the constant's score
                    c = self.stack.constants[int(j)]
                    prob += c / len(folds)
                    prob0 += c / len(folds)
                    continue
                phi = b.predict(x, pred_contrib=True)
                phi0 = b.predict(xs, pred_contrib=True)
                mg, mg0 = phi.sum(1), phi0.sum(1)
                delta = phi[:, :-1] - phi0[:, :-1]
                if self.logits:  # this fold's contributions to its probability
                    delta *= _secant(mg, mg0, _sigmoid, lambda v: _sigmoid(v) * (1 - _sigmoid(v)))[:, None]
                    mg, mg0 = _sigmoid(mg), _sigmoid(mg0)
                prob += mg / len(folds)
                prob0 += mg0 / len(folds)
                part += delta / len(folds)
            if self.logits:  # to the logit of the folds' mean probability
                lo = np.clip(prob, 1e-6, 1 - 1e-6)
                part *= _secant(prob, prob0, _logit, lambda p: 1 / (lo * (1 - lo)))[:, None]
                prob, prob0 = _logit(prob), _logit(prob0)
            if contrib is None:
                contrib = np.zeros((m, part.shape[1]))
            contrib[sel], z[sel], z0[sel] = part, prob, prob0
        if contrib is None:
            contrib = np.zeros((m, H))
        return z, z0, contrib

    # ------------------------------------------------------------ the representation through the trunk
    def _ple_hook(self, module, args):
        return None if self._swap is None else (self._swap.to(args[0].dtype),)

    def _trunk_ig(self, x: torch.Tensor, v: torch.Tensor, steps: int) -> torch.Tensor:
        """[m, width]: Integrated Gradients of <v[i], trunk(x[i])> from the stranger to x (the trunk's
        piecewise-linear encoding integrated as an input of its own, as Explainer does)."""
        empty = torch.from_numpy(self.groups.baseline).to(self.dev).expand_as(x).contiguous()
        base = with_tokens(empty, x, self.spec.width)
        m = len(x)

        def f(xp, *enc):
            self._swap = enc[0] if enc else None
            try:
                return (self.trunk(xp).double() * v.repeat(xp.shape[0] // m, 1)).sum(1)
            finally:
                self._swap = None

        inputs, bases = [x], [base]
        if self.ple is not None:
            with torch.no_grad():
                z = lambda t: (t[:, :self.spec.width] - self.trunk.in_mean) / self.trunk.in_std  # noqa: E731
                inputs.append(self.trunk.piecewise(z(x)))
                bases.append(self.trunk.piecewise(z(base)))
        hook = self.ple.register_forward_pre_hook(self._ple_hook) if self.ple is not None else None
        try:
            attr = integrated_gradients(f, inputs, bases, steps)
        finally:
            if hook is not None:
                hook.remove()
        ax = attr[0].detach().double()
        if self.ple is not None:
            ax = ax.index_add(1, self.ple_input, attr[1].detach().double())
        if base is not empty:  # what the tokens add to the empty history: the sequence group's (with_tokens)
            with torch.no_grad():
                ax[:, self.spec.width] += f(base) - f(empty)
        return ax

    def representation(self, x: np.ndarray, emb: np.ndarray, part: np.ndarray,
                       steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The representation's tree contributions `part` [m, tree inputs] spread over the network's
        inputs at `steps`: (grouped [m, groups], the rest [m] for the representation group)."""
        m = len(x)
        dense = np.zeros((m, len(self.groups)))
        if part.shape[1] == 0:
            return dense, np.zeros(m)
        e = emb.astype(np.float64) - self.base_emb  # the representation's movement
        matrix = self.stack.reduction.matrix.astype(np.float64)
        moved = e @ matrix  # each component's
        stable = np.abs(moved) >= STABLE_SHARE * np.linalg.norm(moved, axis=1, keepdims=True)
        stable &= np.abs(moved) > 1e-12
        a = np.where(stable, part / np.where(stable, moved, 1.0), 0.0)
        rest = np.where(stable, 0.0, part).sum(1)
        v = a @ matrix.T
        todo = np.flatnonzero(np.abs(a).sum(1) > 0)
        if len(todo):
            xt = torch.from_numpy(np.ascontiguousarray(x[todo])).to(self.dev)
            vt = torch.from_numpy(v[todo]).to(self.dev)
            got = torch.cat([self._trunk_ig(xt[i:i + 256], vt[i:i + 256], steps) for i in range(0, len(todo), 256)])
            of_input = torch.from_numpy(self.groups.of_input).to(self.dev)
            g = torch.zeros((len(todo), len(self.groups)), dtype=got.dtype, device=self.dev).index_add_(1, of_input, got)
            dense[todo] = g.cpu().numpy()
        return dense, rest

    # ------------------------------------------------------------ the served score
    def inputs(self, model, chunk, keep: np.ndarray, x: np.ndarray, entity_table, vocab_sizes: dict) -> StackInputs:
        """The stack's rows of the chunk's eligible rows `keep`, as predictions computes them."""
        net = None if self.per_label else model
        rows = self.head.rows(chunk, keep, x, self.spec, self.task, entity_table, vocab_sizes, model=net,
                              device=str(self.dev))
        position = np.full(len(x), -1, np.int64)
        position[keep] = np.arange(len(keep))
        return StackInputs(rows, position)

    def _blend(self, net: np.ndarray, trees: np.ndarray, wp: np.ndarray) -> np.ndarray:
        """On the blend's scale: the network's logit or amount. One probability per entity: serving blends
        the logit of the network's probability, clipped (stacking._logit); per label it blends the
        network's logits as they are (HeadStack.adjust_logits)."""
        if self.logits and not self.per_label:
            net = np.clip(net, -CLIP, CLIP)
        return (1 - wp) * net + wp * trees

    def tree_scores(self, hand: np.ndarray, emb: np.ndarray, column: np.ndarray) -> np.ndarray:
        """The trees' scores of m pairs on the blend's scale (0 where a pair has no trees)."""
        out = np.zeros(len(hand))
        labelled = self.per_label
        for j in (np.unique(column[column >= 0]) if labelled else [None]):
            sel = np.flatnonzero(column == j) if labelled else np.arange(len(hand))
            x = self._tree_inputs(hand[sel], emb[sel])
            folds = [f[0 if j is None else int(j)] for f in self.stack.boosters]
            s = np.mean([np.full(len(sel), self.stack.constants[int(j)]) if b is None else b.predict(x)
                         for b in folds], axis=0)
            out[sel] = _logit(s) if self.logits else s
        return out

    def score(self, x, h, rows: np.ndarray, target: np.ndarray | None, si: StackInputs) -> np.ndarray:
        """The served score of each (row, target) pair (what predictions wrote)."""
        rows = np.asarray(rows, np.int64)
        target = np.full(len(rows), -1, np.int64) if target is None else np.asarray(target, np.int64)
        pos = si.position[rows]
        if not self.per_label:
            r = si.rows
            picked = dataclasses.replace(r, entities=r.entities[pos], hand=r.hand[pos], embedding=r.embedding[pos],
                                         network=r.network[pos])  # (no targets: Rows.take would index them)
            return self.head.choose(picked.network, self.stack.gbt_scores(picked))
        return self.scores_of(x[rows], None if h is None else h[rows], si.rows.hand[pos], si.rows.embedding[pos], target)

    def scores_of(self, x, h, hand, emb, target) -> np.ndarray:
        """The served score of m pairs from their own inputs (row i: x[i], h's row i, hand[i], emb[i]; emb
        None: the foundation trunk's of x): what the deletion test scores masked inputs with."""
        target = np.full(len(x), -1, np.int64) if target is None else np.asarray(target, np.int64)
        if emb is None:
            with torch.no_grad():
                emb = self.trunk(torch.from_numpy(np.ascontiguousarray(x)).to(self.dev)).float().cpu().numpy()
        wp, col = self.covered(target)
        net = self.net.score(x, h, np.arange(len(x)), target).astype(np.float64) if (wp < 1).any() else np.zeros(len(x))
        z = self._blend(net, self.tree_scores(hand, emb, col), wp)
        return (_sigmoid(z) if self.logits else z).astype(np.float32)

    def masked(self, x, h, rows: np.ndarray, mask: np.ndarray, si: StackInputs) -> tuple:
        """The pairs' inputs with the groups mask[i] deleted (Explainer.masked for the network's; the hand
        features of those groups at the stranger's; the representation the stranger's where its group is
        masked, else the trunk's of the masked inputs): (x, history, hand, representation or None)."""
        xm, hm = self.net.masked(x, h, rows, mask[:, :len(self.net.groups)])
        pos = si.position[rows]
        hand = np.array(si.rows.hand[pos], copy=True)
        g = self.hand.group
        own = np.flatnonzero(g >= 0)
        hide = np.zeros(hand.shape, bool)
        hide[:, own] = mask[:, g[own]]
        hand[hide] = np.broadcast_to(self.hand.baseline, hand.shape)[hide]
        with torch.no_grad():
            emb = self.trunk(torch.from_numpy(np.ascontiguousarray(xm)).to(self.dev)).float().cpu().numpy()
        rep = mask[:, self.rep_group]
        emb[rep] = self.base_emb.astype(np.float32)
        return xm, hm, hand, emb

    def explain(self, x, h, rows: np.ndarray, target: np.ndarray | None, si: StackInputs) -> Explained:
        """Attributions of the served score of each (row, target) pair, in the units predictions writes,
        summing to served score - the served stranger's score (module docstring). Both integrations (the
        network's, the representation's through the trunk) run at `steps`; a pair whose *served* gap is over
        the tolerance is integrated again at twice the steps, up to `max_steps` (the trees' part is exact)."""
        rows = np.asarray(rows, np.int64)
        target = np.full(len(rows), -1, np.int64) if target is None else np.asarray(target, np.int64)
        wp, col = self.covered(target)
        pos = si.position[rows]
        hand, emb = si.rows.hand[pos], si.rows.embedding[pos]
        trees = (np.zeros(len(rows)), np.zeros(len(rows)), None)
        tp = np.flatnonzero(wp > 0)
        if len(tp):  # once: exact, whatever the steps
            z, z0, c = self.trees(hand[tp], emb[tp], col[tp])
            full = np.zeros((len(rows), c.shape[1]))
            full[tp] = c
            trees = (np.zeros(len(rows)), np.zeros(len(rows)), full)
            trees[0][tp], trees[1][tp] = z, z0
        score = self.score(x, h, rows, target, si) if not self.per_label else None
        every = np.arange(len(rows))
        ex, steps = self._explained(x, h, rows, target, wp, col, emb, trees, score, every, self.steps), self.steps
        while steps < self.max_steps:
            over = np.flatnonzero(np.abs(ex.gap) > self.tolerance * np.abs(ex.score - ex.baseline)
                                  + ABS_TOLERANCE * (1 + np.abs(ex.baseline)))
            if not len(over):
                break
            steps = min(2 * steps, self.max_steps)
            ex = ex.replaced(over, self._explained(x, h, rows, target, wp, col, emb, trees, score, over, steps))
        return ex

    def _explained(self, x, h, rows, target, wp, col, emb, trees, served, sub: np.ndarray, steps: int) -> Explained:
        """The pairs `sub` (positions) at `steps`: the network's part integrated, the trees' (`trees`: their
        scores, the stranger's, contributions) spread; the served score `served` where predictions gives it."""
        rows, target, wp, col, emb = rows[sub], target[sub], wp[sub], col[sub], emb[sub]
        m, G = len(sub), len(self.groups)
        dense = np.zeros((m, G))
        extra = [np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)]
        net, net0 = np.zeros(m), np.zeros(m)
        part = np.flatnonzero(wp < 1)  # the network's part
        if len(part):
            ex = self.net.explain(x, h, rows[part], target[part], steps=steps)
            keep = 1 - wp[part]
            dense[part, :ex.dense.shape[1]] = keep[:, None] * ex.dense
            extra = [part[ex.extra[0]], ex.extra[1], keep[ex.extra[0]] * ex.extra[2]]
            net[part], net0[part] = ex.score, ex.baseline
        tz, tz0 = trees[0][sub], trees[1][sub]
        tp = np.flatnonzero(wp > 0)  # the trees' part
        if len(tp):
            c = trees[2][sub[tp]]
            H = self.hand.group.shape[0]
            th = c[:, :H] * wp[tp, None]
            g = self.hand.group
            own = np.flatnonzero(g >= 0)
            part_dense = np.zeros((len(tp), G))
            np.add.at(part_dense.T, g[own], th[:, own].T)
            rare = np.flatnonzero(g < 0)  # a rare label's own history: a reason of its own, as the network's
            if len(rare):
                pr, pc = np.nonzero(th[:, rare])
                extra = [np.r_[extra[0], tp[pr]], np.r_[extra[1], self.hand.label[rare[pc]]],
                         np.r_[extra[2], th[pr, rare[pc]]]]
            rd, rest = self.representation(x[rows[tp]], emb[tp], c[:, H:], steps)
            part_dense += wp[tp, None] * rd
            part_dense[:, self.rep_group] += wp[tp] * rest
            dense[tp] += part_dense
        z, z0 = self._blend(net, tz, wp), self._blend(net0, tz0, wp)
        if self.logits:  # to probabilities: the secant of the sigmoid, one positive factor per score
            rho = _secant(z, z0, _sigmoid, lambda v: _sigmoid(v) * (1 - _sigmoid(v)))
            dense *= rho[:, None]
            extra[2] = extra[2] * rho[extra[0]]
            score, base = _sigmoid(z), _sigmoid(z0)
        else:
            score, base = z, z0
        if served is not None:  # exactly what predictions wrote
            score = served[sub]
        return Explained(rows, target, np.asarray(score, np.float32), base.astype(np.float32), dense.astype(np.float32),
                         (extra[0].astype(np.int64), extra[1].astype(np.int64), extra[2].astype(np.float32)),
                         np.full(m, steps, np.int64))
