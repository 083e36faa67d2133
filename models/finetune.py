"""A scenario model: the foundation trunk plus a fresh head, fine-tuned on a task's labels at the
training cut-offs, the epochs chosen (and averaged: a greedy soup) on the validation cut-off."""

import contextlib
import math
import time

import numpy as np
import torch

from models.cache import Cache
from models.distributed import Dist, Lockstep, shard, sum_over_ranks, wrap
from models.features import FeatureSpec, chunk_at
from models.items import SparseRows, batch_history, candidates, sampled_softmax_loss
from models.labels import history_rows, item_popularity, task_inputs
from models.loop import (Log, TrainResult, batches, by_shard, chunk_plan, epoch_loss, fast_bf16, fused, iso, processes,
                         processes_info, state_copy, step)
from models.losses import multilabel_loss, sampled_multilabel_loss, task_loss
from models.network import Model, NetConfig
from models.resume import Resumer
from models.scoring import build_model, rank_items
from models.specs import FinetuneConfig, TaskSpec
from models.spill import Kept, Recomputed
from models.targets import compute_target, eligible

HEAD_ZERO_INIT = True
POPULARITY_INIT = 0.2  # recommendation starts as "what they bought, habitually" blended with what sells now


def finetune(cache: Cache, foundation_state: dict[str, torch.Tensor], foundation_info: dict, task: TaskSpec,
             train_cutoffs: list[int], val_cutoff: int, cfg: FinetuneConfig, *, device: str = "auto",
             log: Log = print, from_scratch: bool = False, resume: Resumer | None = None,
             dist: Dist | None = None) -> TrainResult:
    """A scenario model: the foundation trunk (its weights as the start) + a fresh head, trained on
    labels at `train_cutoffs`; the epoch with the best loss at `val_cutoff` is kept.
    `from_scratch` keeps only the foundation's input scaling and starts the trunk at random: the
    comparison that shows what pretraining is worth.
    Under torchrun (`dist`, by default read from its variables) each rank trains on its share of the
    entity chunks with DDP in lockstep; validation runs on all of it on every rank; only rank 0 logs."""
    started = time.time()
    dist, dev, log = processes(dist, device, log, resume)
    rng = np.random.default_rng(cfg.seed)
    order = rng  # the epochs' data order; several processes draw it alike, their batches each its own
    if dist.enabled:
        order, rng = np.random.default_rng(cfg.seed), np.random.default_rng([cfg.seed, dist.rank])
    torch.manual_seed(cfg.seed)
    spec = FeatureSpec.from_dict(foundation_info["feature_spec"])
    net = NetConfig(**foundation_info["net"])
    model = build_model(net, task, spec).to(dev)
    trunk_state = {k.removeprefix("trunk."): v for k, v in foundation_state.items() if k.startswith("trunk.")}
    if from_scratch:
        trunk_state = {k: v for k, v in trunk_state.items() if k.startswith("in_")}
    model.trunk.load_state_dict(trunk_state, strict=not from_scratch)
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    plan = chunk_plan(cache, cfg.chunk_entities)

    popularity: dict[int, np.ndarray] = {}

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)  # (the cache keeps the last shard read)
        keep = eligible(chunk, task.target)
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        y = compute_target(chunk, task.target, vocab_sizes.get(task.target.column), cache)
        if task.task == "binary" and task.target.kind == "function" and not np.isin(y, (0.0, 1.0)).all():
            raise ValueError(f"scenario {task.target.scenario!r}: target function {task.target.function!r} must return "
                             f"0 or 1 for a binary scenario, got values such as {np.unique(y)[:5].tolist()}")
        if task.task == "recommendation":  # plus the catalog's popularity at the cut-off, shared by its chunks
            if cutoff not in popularity:
                popularity[cutoff] = item_popularity(cache, task.target, cutoff)
            return x[keep], h[keep], y[keep], popularity[cutoff]
        return x[keep], (None if h is None else h[keep]), y[keep]

    # features of every (chunk, cut-off) are the same each epoch: computed once, kept in memory or in
    # files within the budgets (validation's first: it is read the most), else computed again
    kept = Kept(data, cfg.memory_budget_bytes, cfg.spill_budget_bytes, cfg.spill_dir)
    first = kept.get(plan[0] + (val_cutoff,))
    val = Recomputed(lambda: (kept.get((s, lo, hi, val_cutoff)) for s, lo, hi in plan))
    n_val, y_sum, y_log = 0, 0.0, 0.0
    for arrays in val:
        y = arrays[2]
        n_val += len(y)
        y_sum = y_sum + (y.col_counts() if isinstance(y, SparseRows) else y.astype(np.float64).sum(0))
        y_log += float(np.log1p(np.clip(y, 0, None)).sum()) if task.task == "regression" else 0.0
    y_mean = np.asarray(y_sum, np.float64) / max(n_val, 1)
    # the head starts near the base rate, so the first steps do not wreck the pretrained trunk
    with torch.no_grad():
        if task.task != "recommendation" and HEAD_ZERO_INIT:
            model.head.linear.weight.zero_()  # the first steps train the head, not wreck the trunk (as LP-FT)
        if task.task in ("binary", "multilabel"):
            p = np.clip(y_mean, 1e-4, 1 - 1e-4)
            model.head.linear.bias.copy_(torch.as_tensor(np.log(p / (1 - p)), dtype=torch.float32).reshape(-1))
        elif task.task == "regression":
            model.head.linear.bias.fill_(y_log / max(n_val, 1))
        elif task.task == "recommendation":  # popularity breaks ties among what the entity already buys
            model.head.popularity.weight.zero_()
            model.head.popularity.weight[0, -1] = POPULARITY_INIT
            rate = float(np.clip(y_mean.mean(), 1e-9, 0.5))  # chance that an entity buys a given item
            model.head.popularity.bias.fill_(math.log(rate / (1 - rate))
                                             - POPULARITY_INIT * float(popularity[val_cutoff][:, -1].mean()))
            model.head.query.weight.zero_()
            model.head.query.bias.zero_()
            model.head.skip.weight.zero_()
            model.head.skip.weight[0, spec.habitual_channel] = 5.0
        if task.task == "multilabel":
            # start at the strong baseline ("what they bought, habitually", measured best on the demo
            # data), so training only has to learn what the trunk adds on top
            model.head.linear.weight.zero_()
            model.head.skip.weight.zero_()
            model.head.skip.weight[0, spec.habitual_channel] = 5.0
    # wide multilabel heads: sampled negatives (0: the full loss)
    negatives = (cfg.sampled_negatives if task.task == "multilabel" and task.outputs > cfg.sampled_above_labels
                 and 0 < cfg.sampled_negatives < task.outputs else 0)
    val_negatives = min(cfg.val_sampled_negatives, task.outputs) if negatives else 0
    label_skip = [p for n, p in model.head.named_parameters() if n == "label_skip"]
    pair_labels = [p for n, p in model.head.named_parameters() if n == "pair.label.weight"]
    params = [{"params": model.trunk.parameters(), "lr": cfg.learning_rate * cfg.trunk_lr_scale},
              {"params": [p for n, p in model.head.named_parameters() if n not in ("label_skip", "pair.label.weight")],
               "lr": cfg.learning_rate}]
    if label_skip:  # per-label history weights must travel to O(1) values in a few hundred steps
        params.append({"params": label_skip, "lr": cfg.learning_rate * cfg.label_skip_lr_scale})
    if pair_labels:
        params.append({"params": pair_labels, "lr": cfg.learning_rate * cfg.pair_label_lr_scale})
    opt = torch.optim.AdamW(params, weight_decay=cfg.weight_decay, fused=fused(dev))
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    mixed = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if negatives and cfg.sampled_bf16 \
        and fast_bf16(dev) else contextlib.nullcontext  # (sampled wide heads: bf16 matrix products)
    # the starting point (epoch 0) competes too: fine-tuning is kept only where it helps on validation
    with mixed():
        best = (_val_criterion(model, task, val, dev, negatives=val_negatives), state_copy(model), -1)
    log(f"{task.task} start: validation criterion {best[0]:.4f}")
    rows = 0
    # >>> resume hook (models/resume.py): continue a killed run from its last saved state
    modules = {"model": model, "opt": opt}
    at = resume.restore(modules, rng) if resume is not None else None
    if at:
        curves, rows, best = at["curves"], at["rows"], tuple(at["best"])
    # <<< resume hook
    # (criterion, weights, epoch) of every epoch, for the greedy soup (restored after a resume)
    snapshots = [tuple(snap) for snap in at["snapshots"]] if at else []
    # one process: the model itself and the whole plan; several: DDP, this rank's entity chunks
    net = wrap(model, dist, find_unused=task.task == "recommendation")  # history terms may sit a batch out
    mine, lock = set(shard(plan, dist)), Lockstep(dist)
    last = (first, np.arange(min(len(first[0]), cfg.batch_size)))  # a batch for padding steps (loss x 0)
    for epoch in range(at["epoch"] if at else 0, cfg.epochs):
        net.train()
        if at and epoch == at["epoch"]:  # resume hook: the saved epoch's data order and losses so far
            work, losses, first = at["work"], at["losses"], at["next"]
        else:
            work = by_shard([(s, lo, hi, c) for s, lo, hi in plan for c in train_cutoffs], order)
            if dist.enabled:  # this rank's entity chunks
                work = [w for w in work if tuple(w[:3]) in mine]
            losses, first = [], 0
        for i, (s, lo, hi, cutoff) in enumerate(work[first:], first):
            arrays = kept.get((s, lo, hi, int(cutoff)))
            rows += len(arrays[0])
            for b in batches(len(arrays[0]), cfg.batch_size, rng):
                lock.real()
                with mixed():
                    loss = batch_loss(net, task, arrays, b, dev, rng, negatives)
                last = (arrays, b) if dist.enabled else last
                step(model, opt, loss)
                losses.append(loss.item())
            if resume is not None:  # resume hook: save between chunks every N steps
                resume.after_chunk(math.ceil(len(arrays[0]) / cfg.batch_size), modules, rng, lambda: {
                    "epoch": epoch, "next": i + 1, "work": work, "losses": losses, "curves": curves,
                    "rows": rows, "best": list(best), "snapshots": [list(snap) for snap in snapshots]})
        for _ in lock.padding():  # several processes: this rank's share is spent, the others' is not
            loss = batch_loss(net, task, last[0], last[1], dev, rng, negatives) * 0.0
            step(model, opt, loss)
        curves["train_loss"].append(epoch_loss(losses, dist))
        with mixed():
            curves["val_loss"].append(_val_loss(model, task, val, dev, negatives=val_negatives))
        log(f"{task.task} epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f}")
        criterion = _val_criterion(model, task, val, dev, curves["val_loss"][-1], negatives=val_negatives)
        if task.task == "recommendation":
            log(f"{task.task} epoch {epoch + 1}: validation criterion {criterion:.4f}")
        snapshots.append((criterion, state_copy(model), epoch))
        if criterion < best[0]:
            best = (criterion, state_copy(model), epoch)
    with mixed():
        soup = greedy_soup(model, task, val, dev, best, snapshots, val_negatives) if cfg.soup else [best[2]]
    kept.close()
    model.eval()
    rows = int(sum_over_ranks([rows], dist)[0]) if dist.enabled else rows
    info = {"best_epoch": best[2] + 1, "soup_epochs": [e + 1 for e in soup], "seconds": round(time.time() - started, 2), "rows_seen": rows,
            "train_cutoffs": [iso(c) for c in train_cutoffs], "val_cutoff": iso(val_cutoff),
            "val_rows": int(n_val), "val_target_mean": float(np.mean(y_mean)) if n_val else 0.0,
            "device": str(dev), **processes_info(dist), **({"sampled_negatives": negatives} if negatives else {})}
    return TrainResult(model, curves, info)


def greedy_soup(model: Model, task: TaskSpec, val, dev, best, snapshots, negatives: int = 0) -> list[int]:
    """Average the weights of epochs, best first, keeping each only if the average does better on the
    validation cut-off (a "greedy soup": the epochs share one start, so their average is a model of
    the same shape, often better than any one of them). Leaves the chosen weights in `model`;
    returns the epochs averaged (-1: the starting point)."""
    chosen, total, score = [best[2]], {k: v.clone() for k, v in best[1].items()}, best[0]
    for _, state, epoch in sorted(snapshots, key=lambda t: t[0]):
        if epoch in chosen:
            continue
        model.load_state_dict({k: (v + state[k]) / (len(chosen) + 1) if v.is_floating_point() else v
                               for k, v in total.items()})
        trial = _val_criterion(model, task, val, dev, negatives=negatives)
        if trial < score:
            chosen.append(epoch)
            score = trial
            total = {k: v + state[k] if v.is_floating_point() else v for k, v in total.items()}
    model.load_state_dict({k: v / len(chosen) if v.is_floating_point() else v for k, v in total.items()})
    return chosen


def batch_loss(model: Model, task: TaskSpec, arrays, b: np.ndarray, dev, rng: np.random.Generator,
               negatives: int = 0) -> torch.Tensor:
    """The task's loss on rows `b` of (features, label history, targets). `negatives` > 0 (multilabel):
    sampled_multilabel_loss over that many labels drawn from `rng`, instead of the full loss."""
    x, h, y = arrays[:3]
    if task.task == "recommendation" and model.training:
        b = b[np.diff(y.indptr)[b] > 0]  # entities that bought nothing add nothing to the loss
    xb = torch.from_numpy(x[b]).to(dev)
    if task.task == "recommendation":
        hb, yb = h[b], y[b]
        cand = candidates(hb, arrays[3], rng)
        cand_t = torch.from_numpy(cand).to(dev)
        pop = torch.from_numpy(arrays[3]).to(dev)
        return sampled_softmax_loss(model(xb, batch_history(hb, dev), cand_t, pop), yb, cand)
    if negatives and isinstance(y, SparseRows):
        return sampled_multilabel_loss(model, xb, history_rows(h, b, dev), y[b], negatives, rng, dev)
    out = model(xb, history_rows(h, b, dev))
    if isinstance(y, SparseRows):  # multilabel: the labels each entity touched, sparse
        return multilabel_loss(out, y[b], dev)
    return task_loss(task.task, out, torch.from_numpy(y[b]).to(dev))


@torch.no_grad()
def _val_criterion(model, task: TaskSpec, val, dev, loss: float | None = None, negatives: int = 0) -> float:
    """What picks the epoch (lower is better): the ranking metric for recommendation (its softmax
    loss can fall while the top of the ranking gets worse), the validation loss otherwise."""
    if task.task != "recommendation":
        return _val_loss(model, task, val, dev, negatives=negatives) if loss is None else loss
    from models.metrics import ranking_metrics_at

    model.eval()
    total, n = 0.0, 0
    for x, h, y, pop in val:
        rows = int((np.diff(y.indptr) > 0).sum()) if len(y) else 0
        if rows == 0:
            continue
        top, _ = rank_items(model, x, h, pop, task.k, device=str(dev))
        total += ranking_metrics_at(top, y.rows, y.cols, task.k)[f"ndcg@{task.k}"] * rows
        n += rows
    return -total / n if n else 0.0


VAL_OUTPUTS = 1 << 23  # outputs per validation batch of a wide multilabel head (32 MB of float32 logits)


@torch.no_grad()
def _val_loss(model, task: TaskSpec, val, dev, batch: int = 2048, negatives: int = 0) -> float:
    """The mean loss over the validation rows; `negatives` > 0 (a wide multilabel head): the sampled
    estimate, its labels drawn from a fixed seed, so every epoch is scored on the same labels."""
    model.eval()
    rng = np.random.default_rng(0)  # the same sampled candidates at every epoch
    if task.task == "multilabel":  # [rows, labels] logits of at most VAL_OUTPUTS (524 rows at 16,000 labels)
        batch = max(1, min(batch, VAL_OUTPUTS // max(task.outputs, 1)))
    total, n = 0.0, 0
    for arrays in val:
        size = len(arrays[0])
        for i in range(0, size, batch):
            b = np.arange(i, min(i + batch, size))
            total += float(batch_loss(model, task, arrays, b, dev, rng, negatives)) * len(b)
            n += len(b)
    return total / n if n else float("nan")

