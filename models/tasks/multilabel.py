"""multilabel: which of the labels (a categorical column's top values: categories, brands) will each
entity touch in the window? One probability per label; the head reads each label's own history and
scores the touched (entity, label) pairs with a shared pairwise scorer (network.PairScorer)."""

import numpy as np
import torch
from torch import nn

from habitus.models.data.items import SparseRows
from habitus.models.data.labels import history_rows, recent_popularity, top_values
from habitus.models.data.targets import TargetSpec
from habitus.models.nn.network import Model
from habitus.models.tasks.base import LabelScores, Stacking, Task, ValueLabels, categorical_column, function_label_target
from habitus.models.tasks.binary import logit_bias
from habitus.models.tasks.metrics import blockwise_macro_auroc, macro_auroc

HABITUAL_SKIP = 5.0  # the head starts at "what they bought, habitually" (the habitual channel's weight)
VAL_OUTPUTS = 1 << 23  # outputs per validation batch of a wide head (32 MB of float32 logits)
COLUMN_MULTIPLE = 256
AUROC_CRITERION_LABELS = 2048  # heads up to this wide pick their epochs by validation macro AUROC, not the loss
LABEL_BLOCK = 1_024  # rows scored over every label at a time: 1,024 x 16,000 labels = 66 MB of logits
VAL_CRITERION_VALUES = 1 << 25  # scores that criterion reads at most (128 MB of float32; rows = this / labels)


class Multilabel(ValueLabels, Task):
    name = "multilabel"
    headline = "macro_auroc"
    stacking = Stacking("binary", logits=True, per_label=True, criterion=macro_auroc)
    uses_label_history = True
    label_outputs = True
    writes_every_label = True

    def target_spec(self, name, target, cache, cutoff) -> TargetSpec:
        if getattr(target, "function", None):
            return function_label_target(name, target, cache, cutoff)
        column = categorical_column(name, target.by, cache)
        return TargetSpec("any_event", target.within, column, top_values(cache, column, cutoff, target.top))

    def build_model(self, net, spec, features):
        return Model(net, self.outputs(spec), features.channels, pair_width=spec.pair_width,
                     pair_layers=spec.pair_layers)

    def init_head(self, model, spec, features, val, y_mean, n_val, extra) -> None:
        super().init_head(model, spec, features, val, y_mean, n_val, extra)
        logit_bias(model, y_mean)
        # start at the strong baseline ("what they bought, habitually", measured best on the demo
        # data), so training only has to learn what the trunk adds on top
        model.head.linear.weight.zero_()
        model.head.skip.weight.zero_()
        model.head.skip.weight[0, features.habitual_channel] = HABITUAL_SKIP

    def sampled_negatives(self, spec, cfg) -> int:
        """Wide heads (more than cfg.sampled_above_labels) train on sampled negatives."""
        outputs = self.outputs(spec)
        return (cfg.sampled_negatives if outputs > cfg.sampled_above_labels and 0 < cfg.sampled_negatives < outputs
                else 0)

    def loss(self, out, y):
        return nn.functional.binary_cross_entropy_with_logits(out, y)

    def batch_loss(self, model, spec, arrays, b, dev, rng, negatives=0):
        """`negatives` > 0: sampled_multilabel_loss over that many labels drawn from `rng`."""
        x, h, y = arrays[:3]
        xb = torch.from_numpy(x[b]).to(dev)
        if negatives and isinstance(y, SparseRows):
            return sampled_multilabel_loss(model, xb, history_rows(h, b, dev), y[b], negatives, rng, dev)
        out = model(xb, history_rows(h, b, dev))
        if isinstance(y, SparseRows):  # the labels each entity touched, sparse
            return multilabel_loss(out, y[b], dev)
        return self.loss(out, torch.from_numpy(y[b]).to(dev))

    def loss_is_criterion(self, spec) -> bool:
        """Narrow heads are chosen by macro AUROC: the loss rewards calibrated base rates and can fall
        while the ranking within each label gets worse (MovieLens with 10% of the labels: the validation
        loss fell over three epochs while the test macro AUROC fell too, docs/journal/quality.md). Wide heads keep their
        sampled loss (a [rows, 16,000] validation matrix costs too much every epoch)."""
        return self.outputs(spec) > AUROC_CRITERION_LABELS

    @torch.no_grad()
    def val_criterion(self, model, spec, val, dev):
        """Minus the macro AUROC on the validation rows (at most VAL_CRITERION_VALUES scores)."""
        model.eval()
        cap = max(1, VAL_CRITERION_VALUES // max(self.outputs(spec), 1))
        scores, labels, n = [], [], 0
        for x, h, y, *_ in val:
            take = min(len(x), cap - n)
            for i in range(0, take, 2048):
                b = np.arange(i, min(i + 2048, take))
                scores.append(torch.sigmoid(model(torch.from_numpy(x[b]).to(dev), history_rows(h, b, dev))).float().cpu().numpy())
            labels.append(y[np.arange(take)].dense() if isinstance(y, SparseRows) else np.asarray(y[:take]))
            n += take
            if n >= cap:
                break
        if not n:
            return 0.0
        # every label with a positive and a negative counts: few labelled rows still rank the epochs
        value = macro_auroc(np.concatenate(labels), np.concatenate(scores).reshape(n, -1), min_positives=1)
        return 0.0 if np.isnan(value) else -value

    def val_batch(self, spec, batch):  # [rows, labels] logits of at most VAL_OUTPUTS (524 rows at 16,000 labels)
        return max(1, min(batch, VAL_OUTPUTS // max(self.outputs(spec), 1)))

    def transform(self, out):
        return torch.sigmoid(out)

    def top(self, model, x, h, k, extra, device, adjust=None):
        return top_labels(model, x, h, k, device=device, adjust=adjust)

    def metrics(self, y, score):
        return {"macro_auroc": macro_auroc(y, score)}

    def list_k(self, spec):  # (a head narrower than k: every label)
        return min(spec.k, len(spec.target.labels))

    def list_headline(self, spec):
        return f"precision@{self.list_k(spec)}"

    def list_baselines(self, spec, cache, cutoff):
        popularity = recent_popularity(cache, spec.target, cutoff)
        return lambda h, k, channel: history_lists(_sparse(h), popularity, k, channel)

    def evaluation(self, model, cache, features, spec, cutoff, *, constant=None, extra=None, device="cpu"):
        return Blockwise(model, recent_popularity(cache, spec.target, cutoff), extra or {},
                         features.habitual_channel, device)

    def lightgbm(self, lgb, params, spec, dataset, seed):
        """One small model per label, on at most dataset.label_rows training rows (cost is labels x rows);
        a head wider than dataset.max_labels: LabelScores of its most frequent labels."""
        labels = dataset.most_frequent_labels()
        (x_train, y_train), (x_val, y_val) = dataset("train", labels), dataset("val", labels)
        x_test, _ = dataset("test", labels)
        rows = np.random.default_rng(seed).permutation(len(x_train))[:dataset.label_rows]
        x_sub, y_sub = x_train[rows], y_train[rows]
        out = np.zeros((len(x_test), y_train.shape[1]), np.float32)
        small = {**params, "n_estimators": 100, "learning_rate": 0.1, "num_leaves": 15}
        for j in range(y_train.shape[1]):
            if y_sub[:, j].min() == y_sub[:, j].max():
                out[:, j] = y_sub[0, j]
                continue
            model = lgb.LGBMClassifier(**small)
            label, val_label = np.ascontiguousarray(y_sub[:, j]), np.ascontiguousarray(y_val[:, j])  # (not views)
            model.fit(x_sub, label, eval_set=[(x_val, val_label)], callbacks=[lgb.early_stopping(15, verbose=False)])
            out[:, j] = model.predict_proba(x_test)[:, 1]
        return out if labels is None else LabelScores(labels, out)


class Blockwise:
    """macro AUROC of the model and the baselines, a block of labels at a time: what exists at once is
    the trunk's output [entities, hidden], the sparse targets and histories, and [entities, block] scores.
    `extra`: other baselines' [entities, labels] scores, or LabelScores of a subset of the labels
    (reported on that subset next to the model's)."""

    def __init__(self, model, popularity, extra, channel, device):
        self.model, self.popularity, self.extra, self.channel = model, popularity, extra, channel
        self.dev = next(model.parameters()).device if device == "auto" else torch.device(device)
        self.ys, self.trunks, self.hists = [], [], []

    def add(self, chunk, keep, x, h, y) -> None:  # the trunk's output and sparse rows only
        self.ys.append(_sparse(y))
        self.trunks.append(_trunk(self.model, x[keep], self.dev))
        self.hists.append(_sparse(h[keep]))

    def report(self, chosen=None) -> dict:
        """`chosen`: LabelScores of the head chosen on validation (models/heads/stacked_head.py) at the labels it
        covers: the "model" reads them there and the network elsewhere; the network alone is "network"."""
        model, dev, ys = self.model, self.dev, self.ys
        labels = ys[0].n_cols if ys else 0
        y, hist = SparseRows.stack(ys, labels), SparseRows.stack(self.hists, labels)
        h = torch.cat(self.trunks) if self.trunks else torch.zeros((0, model.trunk.cfg.hidden), device=dev)
        history = tuple(torch.from_numpy(a).to(dev) for a in (hist.rows, hist.cols, hist.values))
        empty = torch.zeros(0, dtype=torch.int64, device=dev)
        n = len(y)

        @torch.no_grad()
        def model_scores(cols):  # the head's columns `cols`: what scores() gives for them
            logits = model.head.sampled(h, history, torch.from_numpy(cols).to(dev), empty, empty)[0]
            return torch.sigmoid(logits).float().cpu().numpy()

        network = model_scores
        if chosen is not None:
            assert len(chosen.scores) == n, f"the chosen head: {len(chosen.scores)} scores for {n} entities"
            model_scores = _overridden(network, chosen)
        scorers = {"model": model_scores, **history_baselines(hist, self.popularity, self.channel)}
        if chosen is not None:
            scorers["network"] = network
        subsets = {}
        for name, values in self.extra.items():
            if isinstance(values, LabelScores):  # e.g. LightGBM on the most frequent labels of a wide head
                subsets[name] = values
            elif values is not None:
                assert len(values) == n, f"baseline {name}: {len(values)} scores for {n} entities"
                scorers[name] = lambda cols, v=values: v[:, cols]
        aucs, measured = blockwise_macro_auroc(y, scorers)
        report = {"model": {"macro_auroc": aucs.pop("model")},
                  **({} if chosen is None else {"network": {"macro_auroc": aucs.pop("network")}}),
                  "baselines": {k: {"macro_auroc": v} for k, v in aucs.items()}, "entities": n,
                  "positive_rate": len(y.cols) / (n * y.n_cols) if n and y.n_cols else float("nan"),
                  "labels_measured": measured}
        for name, sub in subsets.items():  # habitus on the same labels, so the comparison stays like for like
            assert len(sub.scores) == n, f"baseline {name}: {len(sub.scores)} scores for {n} entities"
            order = np.argsort(sub.labels)  # label position -> its column of sub.scores
            pair, k = blockwise_macro_auroc(y, {"model": model_scores, name: lambda cols, v=sub, o=order: v.scores[
                :, o[np.searchsorted(v.labels[o], cols)]]}, labels=sub.labels)
            report["baselines"][f"{name} (top {len(sub.labels)} labels)"] = {
                "macro_auroc": pair[name], "model_macro_auroc": pair["model"], "labels_measured": k}
        return report


def history_baselines(hist: SparseRows, popularity: np.ndarray, channel: int) -> dict:
    """The hold-out's baselines as blockwise scorers (label columns -> [rows, columns] scores): past
    frequency (each row's own habitual count of the label) and popularity (the label's recent count)."""
    n = len(hist)
    return {"past frequency": lambda cols: hist.dense(channel, cols),
            "popularity": lambda cols: np.broadcast_to(popularity[cols], (n, len(cols)))}


def history_lists(hist: SparseRows, popularity: np.ndarray, k: int, channel: int,
                  block: int = LABEL_BLOCK) -> dict[str, np.ndarray]:
    """The k best label positions of each row under each of history_baselines, best first, a block of
    rows at a time; equal scores go to the more popular label (a stable sort of the labels in order of
    popularity)."""
    order = np.argsort(-popularity, kind="stable")
    every = np.arange(len(popularity))
    out = {name: [np.zeros((0, min(k, len(order))), np.int64)] for name in history_baselines(hist, popularity, channel)}
    for i in range(0, len(hist), block):
        for name, scorer in history_baselines(hist[np.arange(i, min(i + block, len(hist)))], popularity,
                                              channel).items():
            scores = np.asarray(scorer(every), np.float32)[:, order]
            out[name].append(order[np.argsort(-scores, axis=1, kind="stable")[:, :k]])
    return {name: np.concatenate(parts) for name, parts in out.items()}


def _overridden(scorer, chosen):
    """A blockwise scorer: `scorer`'s columns, those of `chosen` (LabelScores, labels sorted) replaced."""
    labels = np.asarray(chosen.labels, np.int64)

    def fn(cols):
        out = np.array(scorer(cols), np.float32, copy=True)
        pos = np.searchsorted(labels, cols).clip(0, max(len(labels) - 1, 0))
        hit = labels[pos] == cols if len(labels) else np.zeros(len(cols), bool)
        out[:, hit] = chosen.scores[:, pos[hit]]
        return out
    return fn


@torch.no_grad()
def _trunk(model: Model, x: np.ndarray, dev, batch: int = 8192) -> torch.Tensor:
    out = [model.trunk(torch.from_numpy(x[i:i + batch]).to(dev)) for i in range(0, len(x), batch)]
    return torch.cat(out) if out else torch.zeros((0, model.trunk.cfg.hidden), device=dev)


def _sparse(a: SparseRows | np.ndarray) -> SparseRows:
    """Sparse rows of a dense [n, labels] matrix or [n, labels, channels] history (its nonzero entries)."""
    if isinstance(a, SparseRows):
        return a
    a = a if a.ndim == 3 else a[:, :, None]
    rows, cols = np.nonzero((a != 0).any(-1))
    return SparseRows.from_pairs(rows, cols, a[rows, cols], len(a), a.shape[1])


def multilabel_loss(out: torch.Tensor, y: SparseRows, dev) -> torch.Tensor:
    """binary_cross_entropy_with_logits(out, y.dense()), the mean over rows x labels, from the sparse
    targets: per element BCE(z, y) = softplus(z) - y z, and y z is read at the entries only. The
    [rows, labels] targets are never built, and one pass over the logits replaces the dense
    loss's several (faster at 16,000 labels: docs/journal/speed.md); the same value up to float rounding."""
    out = out.float()  # (as autocast runs binary_cross_entropy_with_logits: in float32)
    out = out[:, None] if out.dim() == 1 else out  # one label: the model squeezes its outputs
    picked = out[torch.from_numpy(y.rows).to(dev), torch.from_numpy(y.cols).to(dev)]
    return (nn.functional.softplus(out).sum() - (picked * torch.from_numpy(y.values[:, 0]).to(dev)).sum()) / out.numel()


def sampled_multilabel_loss(model: Model, xb: torch.Tensor, history, y: SparseRows, negatives: int,
                            rng: np.random.Generator, dev) -> torch.Tensor:
    """An unbiased estimate of multilabel_loss (the mean BCE over rows x labels) from the logits of a
    few label columns shared by the batch's rows, never the [rows, labels] matrix: every label that
    is a positive of some row of the batch, plus `negatives` of the other labels drawn uniformly
    without replacement.

    Full loss x rows x labels = the sum over label columns of sum_rows BCE(z, y). The columns of the
    batch's positives are summed exactly (every positive, and the negatives that matter most: labels
    others in the batch buy, the popular ones); one of the other L - P labels is drawn with
    probability negatives / (L - P), so its column is weighted by (L - P) / negatives (Horvitz-
    Thompson). The estimate's expectation, and its gradient's, is the full loss's, so training still
    fits calibrated per-label probabilities (what ranking by score, validation and prediction read).
    A logQ correction, the alternative, fits a sampled softmax (one label among many) and shifts each
    label's logit by how often it is sampled; with independent per-label BCE terms the inverse-
    probability weight is the exact correction."""
    n_labels = y.n_cols
    positive = np.unique(y.cols)
    pool = np.ones(n_labels, bool)
    pool[positive] = False
    rest = np.flatnonzero(pool)
    # (as many more as make the columns a multiple of COLUMN_MULTIPLE: a few shapes of matrix products,
    # where every new one costs oneDNN a cached kernel: the 16k fine-tuning in bf16 peaked higher,
    # docs/journal/speed.md)
    drawn = rng.choice(rest, min(negatives + (-(len(positive) + negatives)) % COLUMN_MULTIPLE, len(rest)),
                       replace=False)
    cols = np.sort(np.concatenate([positive, drawn]))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    out, _ = model(xb, history, labels=(t(cols), empty, empty))
    weight = np.where(pool[cols], len(rest) / max(len(drawn), 1), 1.0).astype(np.float32)  # (pool: not a positive)
    return _ColumnLoss.apply(out, t(weight), t(y.rows), t(np.searchsorted(cols, y.cols)), t(y.values[:, 0]),
                             len(y) * n_labels)


class _ColumnLoss(torch.autograd.Function):
    """(sum over columns c of weight[c] * sum_rows softplus(z) - sum over the positives (r, c) of
    value * z[r, c]) / n, on [rows, columns] logits z. The value and gradient autograd gives the same
    expression, bit for bit (its backward is softplus_backward plus the positives' term at their entries),
    without the [rows, columns] zeros and the whole-matrix sum autograd's graph makes for the
    positives' term: 0.5-0.9 ms of a 16k fine-tuning step (docs/journal/speed.md)."""

    @staticmethod
    def forward(ctx, out, weight, rows, cols, values, n):
        z = out.float()  # (as autocast runs the BCE: in float32)
        ctx.save_for_backward(z, weight, rows, cols, values)
        ctx.n, ctx.dtype = n, out.dtype
        return ((nn.functional.softplus(z).sum(0) * weight).sum() - (z[rows, cols] * values).sum()) / n

    @staticmethod
    def backward(ctx, grad):
        z, weight, rows, cols, values = ctx.saved_tensors
        scale = grad / ctx.n
        dz = torch.ops.aten.softplus_backward((scale * weight).expand_as(z), z, 1, 20)
        dz.index_put_((rows, cols), -scale * values, accumulate=True)
        return dz.to(ctx.dtype), None, None, None, None, None


@torch.no_grad()
def top_labels(model: Model, x: np.ndarray, h, k: int, *, device: str = "cpu",
               block: int = LABEL_BLOCK, adjust=None) -> tuple[np.ndarray, np.ndarray]:
    """The k most probable labels of every row of a multilabel model, best first, as (label
    positions [rows, k], probabilities [rows, k]). Rows are scored a block at a time, so a wide label
    set (16,000 products) never holds a chunk's [rows, labels] scores at once; the k best logits are
    the k best probabilities (the sigmoid is monotonic), so only those k go through it. What
    scores() + metrics.top_k gave over the whole chunk, up to float rounding (a block's matrix
    products may round differently from a chunk's) and the order among exactly equal scores.
    `adjust(rows, logits) -> logits`: the head chosen on validation, applied to each block's logits."""
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    kk = min(k, model.head.linear.out_features)
    best, best_scores = [np.zeros((0, kk), np.int64)], [np.zeros((0, kk), np.float32)]
    for i in range(0, len(x), block):
        rows = np.arange(i, min(i + block, len(x)))
        logits = model(torch.from_numpy(x[i:i + block]).to(dev), history_rows(h, rows, dev)).float()
        if adjust is not None:
            logits = adjust(rows, logits[:, None] if logits.dim() == 1 else logits)
        top, index = torch.topk(logits[:, None] if logits.dim() == 1 else logits, kk, dim=1)
        best.append(index.cpu().numpy())
        best_scores.append(torch.sigmoid(top).cpu().numpy())
    return np.concatenate(best), np.concatenate(best_scores)


TASK = Multilabel()
