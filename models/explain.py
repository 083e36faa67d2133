"""Why the model scored an entity as it did: Integrated Gradients (Captum) over the network's inputs,
summed into what a person reads.

Every input of the network belongs to one group:

- value     one value of a categorical column (source -> column -> value): its decayed counts and
            recency in the histogram inputs, and for a label head (multilabel, recommendation) the
            entity's own history of that label ("brand = Acme: bought 6 times, last 41 days ago");
- recency / frequency / money   the entity's scalars (days since the last event, events and visits
            per window, sums and means of each numeric column);
- attribute one entity attribute (segment, age, signup date), whatever its one-hot or value/missing
            inputs.

The baseline is "an entity we know nothing about": no history at all (counts, sums and every value's
history at zero, the days since the first and the last event at the largest value seen in training)
and the population's average attributes (the trunk's input means). Integrated Gradients then
splits score - baseline score over the inputs (completeness); what the integration misses is the
`gap`, reported with every explanation. Scores are in the units predictions report them
(probabilities, amounts; raw scores for recommended items), from the fp32 network, through the
same `model(x, history)` call predict makes.
"""

from dataclasses import dataclass

import numpy as np
import torch

from models.features import (ENTITY_BUCKETS, WINDOWS, Chunk, FeatureSpec, bucket_count, bucketize,
                             chunk_at, visit_width)
from models.items import SparseRows, batch_history
from models.network import ItemHead, Model
from models.tasks import task as task_of

DEFAULT_STEPS = 8  # Gauss-Legendre points: mean gap 0.3% of |score - baseline| at half the cost of 16 (docs/explanations.md)
PAIR_BATCH = 256  # (entity, output) pairs integrated at a time: steps x pairs rows through the network


@dataclass
class Groups:
    """The network's inputs in groups. Per group: kind, source, column, value (the text of the value,
    or None for an attribute, whose value is the entity's own) and `value_id` (the histogram bucket of
    a value group, else -1). `of_input[i]` is the group of input i; `baseline` the "no history" input."""

    kind: list[str]
    source: list[str]
    column: list[str]
    value: list
    value_id: np.ndarray
    of_input: np.ndarray
    baseline: np.ndarray
    bucket_group: dict  # (column, bucket) -> group of a value group

    def __len__(self) -> int:
        return len(self.kind)

    def columns(self) -> list[tuple[str, str]]:
        """(source, column) of every group: what the global importance is summed by."""
        return list(zip(self.source, self.column))


def scalar_names(spec: FeatureSpec) -> list[tuple[str, str, str]]:
    """(kind, column, description) of the leading scalar inputs, in the order features.py writes them."""
    hl = [f"{h:g}" for h in spec.half_lives]
    out = [("frequency", "frequency", "events"), ("recency", "recency", "days since the last event"),
           ("recency", "recency", "days since the first event")]
    out += [("frequency", "frequency", f"events in the last {w} days") for w in WINDOWS]
    out += [("frequency", "frequency", f"events, decayed over {h} days") for h in hl]
    for c in spec.numeric:
        out += [("money", c, f"sum of {c}, decayed over {h} days") for h in hl]
        out.append(("money", c, f"mean {c} per event"))
    if spec.visits:
        out += [("frequency", "frequency", "visits (days with events)")]
        out += [("frequency", "frequency", f"visits in the last {w} days") for w in WINDOWS]
        out += [("frequency", "frequency", f"visits, decayed over {h} days") for h in hl]
        out += [("frequency", "frequency", "mean days between visits"),
                ("recency", "recency", "days since the last visit against the usual gap"),
                ("frequency", "frequency", "visited on two days or more"),
                ("frequency", "frequency", "events per visit")]
    assert len(out) == spec.scalar_width, (len(out), spec.scalar_width)
    return out


# inputs whose "no history" value is the largest seen in training, not zero: the days since the first
# and the last event, the mean days between visits (features.py; log1p of days)
def _age_inputs(spec: FeatureSpec) -> list[int]:
    ages = [1, 2]
    if spec.visits:
        ages.append(spec.scalar_width - visit_width(spec.half_lives) + 1 + len(WINDOWS) + len(spec.half_lives))
    return ages


def _bucket_names(vocab: list, vocab_size: int, buckets: int) -> list[str]:
    n = bucket_count(vocab_size, buckets)
    exact = n if vocab_size + 1 <= buckets else buckets - buckets // 4
    names = ["(unknown)"] + [str(vocab[i - 1]) if i - 1 < len(vocab) else f"(id {i})" for i in range(1, exact)]
    names += [f"(rarer values, shared bucket {b - exact + 1} of {n - exact})" for b in range(exact, n)]
    return names


def input_groups(spec: FeatureSpec, vocab, trunk, sources: dict[str, str] | None = None) -> Groups:
    """The groups of a feature spec's inputs. `vocab(column)` -> the column's values in id order
    (`entity.<column>` for entity attributes: Cache.vocab's names); `sources` maps a column to the
    source it comes from (events and attribute columns, entity attributes), default "events" /
    "entity"; `trunk` gives the "no history" baseline (its input means and, when it has them, the
    piecewise-linear bins' top edges)."""
    sources = sources or {}
    events = sources.get("__events__", "events")
    kind, source, column, value, value_id, of_input, bucket_group = [], [], [], [], [], [], {}

    def add(k, s, c, v, vid=-1, width=1):
        kind.append(k), source.append(s), column.append(c), value.append(v), value_id.append(vid)
        of_input.extend([len(kind) - 1] * width)

    for k, c, d in scalar_names(spec):
        add(k, events, c, d)
    for c, size in spec.categorical.items():
        for b, name in enumerate(_bucket_names(vocab(c), size, spec.buckets)):
            bucket_group[(c, b)] = len(kind)
            add("value", sources.get(c, events), c, name, b, spec.channels)
    for c, size in spec.entity_categorical.items():
        add("attribute", sources.get(c, "entity"), c, None, width=bucket_count(size, ENTITY_BUCKETS))
    for c in list(spec.entity_numeric) + list(spec.entity_timestamp):
        add("attribute", sources.get(c, "entity"), c, None, width=2)
    of_input = np.asarray(of_input, np.int64)
    assert len(of_input) == spec.width, (len(of_input), spec.width)

    mean = trunk.in_mean.detach().float().cpu().numpy()
    std = trunk.in_std.detach().float().cpu().numpy()
    base = np.zeros(spec.width, np.float32)
    attr = np.isin(of_input, [g for g, k in enumerate(kind) if k == "attribute"])
    base[attr] = mean[attr]  # the population's average attributes
    top = mean + 3 * std
    if getattr(trunk.cfg, "ple_bins", 0) and trunk.cfg.ple_columns:
        edges = trunk.ple_edges.detach().float().cpu().numpy()[:trunk.cfg.ple_columns, -1]
        top[:len(edges)] = edges * std[:len(edges)] + mean[:len(edges)]
    for i in _age_inputs(spec):
        base[i] = max(top[i], 0.0)
    return Groups(kind, source, column, value, np.asarray(value_id, np.int64), of_input, base, bucket_group)


def column_sources(project) -> dict[str, str]:
    """column -> source name of a project config (the sources' `columns` lists), plus "__events__",
    the name the entity's scalars go under (the events source, or "events" when there are several)."""
    out = {}
    for s in project.sources:
        for c in s.columns:
            out.setdefault(c, s.name)
    ev = project.events_sources
    out["__events__"] = ev[0].name if len(ev) == 1 else "events"
    return out


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
                 device: str = "cpu", item_features: np.ndarray | None = None):
        self.model, self.spec, self.task, self.groups, self.steps = model, spec, task, groups, steps
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
            size = spec.categorical[col]
            b = bucketize(np.asarray(labels, np.int64), size, spec.buckets)
            exact = bucket_count(size, spec.buckets) if size + 1 <= spec.buckets else spec.buckets - spec.buckets // 4
            self.label_group = np.where(b < exact, [groups.bucket_group.get((col, int(v)), -1) for v in b], -1)

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
                return task_of(self.task).pair_scores(self.model(x, history), t)
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

    def explain(self, x: np.ndarray, h: SparseRows | None, rows: np.ndarray, target: np.ndarray | None = None) -> Explained:
        """Attributions of the pairs (entity rows[i] of x and h, output target[i]); target None for
        one score per entity."""
        rows = np.asarray(rows, np.int64)
        target = np.full(len(rows), -1, np.int64) if target is None else np.asarray(target, np.int64)
        parts = []
        hook = self.ple.register_forward_pre_hook(self._ple_hook) if self.ple is not None else None
        try:
            for i in range(0, len(rows), PAIR_BATCH):
                parts.append(self._explain_batch(x, h, rows[i:i + PAIR_BATCH], target[i:i + PAIR_BATCH], i))
        finally:
            if hook is not None:
                hook.remove()
        cat = lambda j, dt: np.concatenate([p[j] for p in parts]).astype(dt) if parts else np.zeros(0, dt)  # noqa: E731
        dense = np.concatenate([p[2] for p in parts]) if parts else np.zeros((0, len(self.groups)), np.float32)
        return Explained(rows, target, cat(0, np.float32), cat(1, np.float32), dense,
                         (cat(3, np.int64), cat(4, np.int64), cat(5, np.float32)))

    def _explain_batch(self, x, h, rows, target, offset: int) -> tuple:
        """(score, baseline score, grouped attributions [pairs, groups], extra pair, label, attribution)."""
        from captum.attr import IntegratedGradients

        xb, vb, hr, hc = self._batch(x, h, rows)
        f = self._forward(torch.from_numpy(np.maximum(target, 0)).to(self.dev), hr, hc)
        xbase = self.base.expand_as(xb).contiguous()
        with torch.no_grad():
            score = f(xb, *self._plain(vb)).float().cpu().numpy()
            base = f(xbase).float().cpu().numpy()  # no history at all: not even the entries, at zero
            # the path starts at the entity's history entries with zero values; a head that scores an
            # entry for being there (a pairwise scorer) moves the score by that alone: credited to the
            # explained label's own value, it keeps the sum equal to score - baseline score
            present = (f(xbase, *self._plain(torch.zeros_like(vb))).float().cpu().numpy() - base
                       if vb is not None else np.zeros_like(base))
            inputs, bases = [xb], [xbase]
            if self.ple is not None:
                inputs.append(self._encoding(xb))
                bases.append(self._encoding(xbase))
        if vb is not None:
            inputs.append(vb)
            bases.append(torch.zeros_like(vb))
        attr = IntegratedGradients(f).attribute(tuple(inputs), baselines=tuple(bases), n_steps=self.steps,
                                                method="gausslegendre")
        ax = attr[0].detach()
        if self.ple is not None:  # each bin's share goes to the scalar it encodes
            ax = ax.index_add(1, self.ple_input, attr[1].detach().to(ax.dtype))
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


def column_totals(groups: Groups, ex: Explained, label_column: str | None = None) -> tuple[list, np.ndarray]:
    """Each pair's attribution summed by (source, column): (the (source, column) list, [m, columns]).
    Rare labels' own history (`extra`) counts for the label column."""
    keys = list(dict.fromkeys(groups.columns()))
    index = {k: j for j, k in enumerate(keys)}
    of_group = np.array([index[k] for k in groups.columns()], np.int64)
    out = np.zeros((len(ex.rows), len(keys)), np.float64)
    np.add.at(out.T, of_group, ex.dense.T.astype(np.float64))
    if len(ex.extra[0]) and label_column is not None:
        j = next(index[k] for k in keys if k[1] == label_column)
        np.add.at(out[:, j], ex.extra[0], ex.extra[2])
    return keys, out


def top_reasons(ex: Explained, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The `top` largest |attributions| of each pair, largest first: (pair, group, label position of
    an `extra` or -1, contribution), pair-major. Groups outside the top are summed by the caller."""
    m, G = ex.dense.shape
    k = min(top, G)
    cand = np.argpartition(-np.abs(ex.dense), k - 1, axis=1)[:, :k]
    pair = np.repeat(np.arange(m), k)
    group = cand.ravel()
    label = np.full(len(group), -1, np.int64)
    value = ex.dense[pair, group]
    if len(ex.extra[0]):
        pair = np.r_[pair, ex.extra[0]]
        group = np.r_[group, np.full(len(ex.extra[0]), -1)]
        label = np.r_[label, ex.extra[1]]
        value = np.r_[value, ex.extra[2]]
    order = np.lexsort((-np.abs(value), pair))
    pair, group, label, value = pair[order], group[order], label[order], value[order]
    first = np.searchsorted(pair, pair, side="left")
    keep = (np.arange(len(pair)) - first) < top
    keep &= value != 0
    return pair[keep], group[keep], label[keep], value[keep]


def value_stats(chunk: Chunk, column: np.ndarray, rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each (entity row, key) asked: how many of the entity's events before the cut-off have
    `column` (per history event: a bucket or a value id) == key, and days since the last of them
    (NaN when none)."""
    n_keys = int(max(column.max(initial=0), keys.max(initial=0))) + 1
    ev = chunk.local.astype(np.int64) * n_keys + column
    order = np.lexsort((chunk.age_days, ev))  # by key, the most recent event of a key first
    ev, age = ev[order], chunk.age_days[order]
    want = rows.astype(np.int64) * n_keys + keys
    lo, hi = np.searchsorted(ev, want, "left"), np.searchsorted(ev, want, "right")
    count = hi - lo
    last = np.full(len(want), np.nan, np.float32)
    has = count > 0
    last[has] = age[lo[has]]
    return count.astype(np.int32), last


def rendered(spec: FeatureSpec, groups: Groups, ex: Explained, x: np.ndarray, chunk: Chunk, entity_table: dict,
             vocab, task, label_names, top: int) -> dict[str, np.ndarray]:
    """The `top` reasons of every pair as flat columns (one row per reason): what the explanations
    asset writes. `vocab(column)` as for input_groups; `label_names[l]`: the text of label position l."""
    pair, group, label, value = top_reasons(ex, top)
    rank = (np.arange(len(pair)) - np.searchsorted(pair, pair, side="left") + 1).astype(np.int16)
    is_extra = group < 0
    g = np.where(is_extra, 0, group)
    kind = np.asarray(groups.kind, object)[g]
    source = np.asarray(groups.source, object)[g]
    col = np.asarray(groups.column, object)[g]
    text = np.asarray(groups.value, object)[g].copy()
    tcol = task.target.column
    if is_extra.any():  # a rare label's own history: the label column's source, the label's own name
        j = groups.column.index(tcol) if tcol in groups.column else 0
        kind[is_extra], source[is_extra], col[is_extra] = "value", groups.source[j], tcol
        text[is_extra] = np.asarray(label_names, object)[label[is_extra]]
    ent_row = ex.rows[pair]
    count = np.full(len(pair), -1, np.int32)
    last = np.full(len(pair), np.nan, np.float32)
    raw = np.full(len(pair), np.nan, np.float32)
    for c in spec.categorical:  # the value's own counts and recency
        ids = chunk.shard.columns[c][chunk.rows]
        sel = (col == c) & (kind == "value")
        if not sel.any():
            continue
        b = sel & ~is_extra
        if b.any():
            count[b], last[b] = value_stats(chunk, bucketize(ids, spec.categorical[c], spec.buckets), ent_row[b],
                                            groups.value_id[g[b]])
        e = sel & is_extra
        if e.any():
            count[e], last[e] = value_stats(chunk, ids.astype(np.int64), ent_row[e],
                                            np.asarray(task.target.labels, np.int64)[label[e]])
    scalars = kind != "value"
    scalars &= kind != "attribute"
    if scalars.any():  # the entity's own value of the scalar, in days / counts / amounts
        _, first_input = np.unique(groups.of_input, return_index=True)
        v = x[ent_row[scalars], first_input[g[scalars]]]
        raw[scalars] = _raw_scalar(v, np.asarray(groups.value, object)[g[scalars]])
    attr = kind == "attribute"
    for c in set(col[attr]):  # the entity's own attribute value
        sel = attr & (col == c)
        vals = entity_table[c][chunk.entities[ent_row[sel]]]
        if c in spec.entity_categorical:
            names = vocab(f"entity.{c}")
            text[sel] = [names[int(i) - 1] if 0 < int(i) <= len(names) else "(unknown)" for i in vals]
        elif c in spec.entity_timestamp:
            years = (chunk.cutoff - vals.astype(np.float64)) / (365.0 * 86_400)
            text[sel] = [f"{y:.1f} years ago" if np.isfinite(y) else "(missing)" for y in years]
            raw[sel] = years
        else:
            text[sel] = [f"{float(v):g}" if np.isfinite(v) else "(missing)" for v in vals.astype(np.float64)]
            raw[sel] = vals.astype(np.float64)
    reason = [_sentence(*r) for r in zip(kind, col, text, count, last, raw, value)]
    gap = ex.gap
    total = ex.total
    top_sum = np.bincount(pair, value, minlength=len(ex.rows))
    return {"row": ent_row, "pair": pair, "rank": rank, "kind": kind.astype(str), "source": source.astype(str),
            "column": col.astype(str), "value": text.astype(str), "contribution": value.astype(np.float32),
            "count": count, "days_since_last": last, "entity_value": raw, "reason": np.asarray(reason, str),
            "others": (total - top_sum)[pair].astype(np.float32), "gap": gap[pair].astype(np.float32)}


@dataclass
class Summary:
    """What a run of `explain_cutoff` adds up: mean |attribution| by (source, column) and the
    completeness gaps, for the materialization's table and chart."""

    keys: list
    abs_sum: np.ndarray
    pairs: int = 0
    entities: int = 0
    gap_abs_sum: float = 0.0
    gap_max: float = 0.0
    moved_abs_sum: float = 0.0

    @classmethod
    def of(cls, groups: Groups) -> "Summary":
        keys = list(dict.fromkeys(groups.columns()))
        return cls(keys, np.zeros(len(keys)))

    def add(self, groups: Groups, ex: Explained, label_column: str | None, entities: int) -> None:
        keys, per = column_totals(groups, ex, label_column)
        self.abs_sum += np.abs(per).sum(0)
        self.pairs += len(ex.rows)
        self.entities += entities
        gap = np.abs(ex.gap)
        self.gap_abs_sum += float(gap.sum())
        self.gap_max = max(self.gap_max, float(gap.max(initial=0.0)))
        self.moved_abs_sum += float(np.abs(ex.score - ex.baseline).sum())

    def importance(self) -> list[tuple[str, str, float]]:
        """(source, column, mean |attribution|), largest first."""
        mean = self.abs_sum / max(self.pairs, 1)
        return sorted(((s, c, float(v)) for (s, c), v in zip(self.keys, mean)), key=lambda t: -t[2])

    @property
    def gap_mean(self) -> float:
        return self.gap_abs_sum / max(self.pairs, 1)

    @property
    def relative_gap(self) -> float:
        """Mean |gap| over mean |score - baseline score|."""
        return self.gap_abs_sum / max(self.moved_abs_sum, 1e-12)


def explain_cutoff(model: Model, cache, spec: FeatureSpec, task, cutoff: int, groups: Groups, *, top: int = 5,
                   labels: list | None = None, per_entity: int = 3, label_names: list | None = None,
                   steps: int = DEFAULT_STEPS, device: str = "cpu", chunk_entities: int = 4096,
                   summary: Summary | None = None):
    """Record batches of every eligible entity's `top` reasons at `cutoff`, one row per reason:
    entity_index, label (None for one score), score, baseline_score, rank, kind, source, column,
    value, contribution, count, days_since_last, entity_value, reason, others, gap (the README's
    "Explanations" section). Label heads explain the positions `labels` for every entity, else each
    entity's `per_entity` best labels (or recommended items). `summary` gathers the global figures."""
    import pyarrow as pa

    from models.labels import task_inputs
    from models.loop import chunk_plan

    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    vocab = vocab_reader(cache)
    t = task_of(task)
    extra = t.chunk_extra(cache, task.target, cutoff)  # (recommendation: the item popularity)
    if task.uses_label_history and label_names is None:  # items: the column's own vocabulary
        values = vocab(task.target.column)
        label_names = [values[i - 1] for i in task.target.labels]
    names = np.asarray([str(v) for v in label_names], object) if label_names is not None else None
    explainer = Explainer(model, spec, task, groups, steps=steps, device=device,
                          item_features=extra[0] if extra else None)
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = np.flatnonzero(t.eligible(chunk, task.target)) if chunk.n else np.zeros(0, np.int64)
        if not len(keep):
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        target = None
        rows = keep
        if task.uses_label_history:
            if labels:
                rows, target = np.repeat(keep, len(labels)), np.tile(np.asarray(labels, np.int64), len(keep))
            else:
                with torch.no_grad():
                    best, _ = t.top(model, x[keep], h[keep], per_entity, extra, device)
                rows, target = np.repeat(keep, best.shape[1]), best.ravel()
        ex = explainer.explain(x, h, rows, target)
        if summary is not None:
            summary.add(groups, ex, task.target.column, len(keep))
        out = rendered(spec, groups, ex, x, chunk, entity_table, vocab, task, names, top)
        p = out.pop("pair")
        out.pop("row")
        label = None if names is None else pa.array(names[ex.target[p]].astype(str))
        yield pa.record_batch({
            "entity_index": pa.array(chunk.entities[ex.rows[p]].astype(np.int64)),
            "label": label if label is not None else pa.nulls(len(p), pa.string()),
            "score": pa.array(ex.score[p]), "baseline_score": pa.array(ex.baseline[p]),
            **{k: pa.array(v) for k, v in out.items() if k not in ("count", "days_since_last", "entity_value")},
            "count": pa.array(out["count"], mask=out["count"] < 0),
            "days_since_last": pa.array(out["days_since_last"], mask=np.isnan(out["days_since_last"])),
            "entity_value": pa.array(out["entity_value"], mask=np.isnan(out["entity_value"])),
        })


def vocab_reader(cache):
    """column -> its values in id order (`entity.<column>` for entity attributes), read once each."""
    seen = {}

    def vocab(column: str) -> list:
        if column not in seen:
            seen[column] = cache.vocab(column).column("value").to_pylist()
        return seen[column]

    return vocab


def _raw_scalar(v: np.ndarray, names: np.ndarray) -> np.ndarray:
    """A scalar input back in its own units (features.py stores most as log1p, signed for sums)."""
    out = np.sign(v) * np.expm1(np.abs(v))
    keep = np.array([n.startswith("days since the last visit against") or n.startswith("visited on") for n in names])
    out[keep] = v[keep]
    return out


def _sentence(kind, column, value, count, last, raw, contribution) -> str:
    sign = f"{contribution:+.4g}"
    if kind == "value":
        seen = f"{count} events, last {last:.0f} days ago" if count > 0 else "never"
        return f"{column} = {value}: {seen}: {sign}"
    if kind == "attribute":
        return f"{column} = {value}: {sign}"
    return f"{value}: {raw:.4g}: {sign}"


__all__ = ["DEFAULT_STEPS", "Explained", "Explainer", "Groups", "Summary", "column_sources", "column_totals",
           "explain_cutoff", "input_groups", "rendered", "scalar_names", "top_reasons", "value_stats", "vocab_reader"]
