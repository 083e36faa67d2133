"""A scenario model: the foundation trunk plus a fresh head, fine-tuned on a task's labels at the
training cut-offs, the epochs chosen (and averaged: a greedy soup) on the validation cut-off."""

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from habitus.models.cache import Cache
from habitus.models.train.distributed import Dist, Lockstep, shard, sum_over_ranks, wrap
from habitus.models.data.features import FeatureSpec, chunk_at
from habitus.models.storage.heap import keep_on_heap
from habitus.models.data.items import SparseRows
from habitus.models.data.labels import task_inputs
from habitus.models.train.loop import (Log, TrainResult, by_shard, chunk_plan, epoch_loss, fast_bf16, fused,
                                       iso, processes, processes_info, seeded, state_copy, step)
from habitus.models.nn.lora import apply_lora
from habitus.models.nn.network import Model, NetConfig
from habitus.models.train.prior import foundation_forecast, start_at_forecast
from habitus.models.train.resume import Resumer
from habitus.models.tasks.scoring import build_model
from habitus.models.train.config import FinetuneConfig, LoraConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.spill import Kept, Recomputed
from habitus.models.tasks import task as task_of


def finetune(cache: Cache, foundation_state: dict[str, torch.Tensor], foundation_info: dict, task: TaskSpec,
             train_cutoffs: list[int], val_cutoff: int, cfg: FinetuneConfig, *, device: str = "auto",
             log: Log = print, from_scratch: bool = False, adapters: LoraConfig | None = None,
             resume: Resumer | None = None, dist: Dist | None = None, fixed: "Fixed | None" = None) -> TrainResult:
    """A scenario model: the foundation trunk (its weights as the start) + a fresh head, trained on
    labels at `train_cutoffs`; the epoch with the best loss at `val_cutoff` is kept.
    `from_scratch` keeps only the foundation's input scaling and starts the trunk at random: the
    comparison that shows what pretraining is worth. `adapters`: LoRA adapters on a frozen trunk
    (models/nn/lora.py); only they and the head learn (merge_lora folds them in for scoring).
    Under torchrun (`dist`, by default read from its variables) each rank trains on its share of the
    entity chunks with DDP in lockstep; validation runs on all of it on every rank; only rank 0 logs.
    `resume`: a killed run continues from its last saved state, in one process or several (the same number).
    `fixed`: a recipe already chosen (the refit, models/train/refit.py): its start, its epochs and the
    soup of its epochs, nothing chosen or scored at `val_cutoff` (there only the head's base rates)."""
    started = time.time()
    dist, dev, log = processes(dist, device, log, None)  # (resumable under torchrun too: train_epochs)
    order, rng = seeded(cfg.seed, dist)  # (before the model: its fresh weights are drawn from torch's seed)
    spec = FeatureSpec.from_dict(foundation_info["feature_spec"])
    model = start_model(foundation_state, foundation_info, task, spec, dev, from_scratch, adapters)
    data = plan_features(cache, task, spec, cfg, val_cutoff)
    with torch.no_grad():  # the head starts near the base rate, so the first steps do not wreck the pretrained trunk
        task_of(task).init_head(model, task, spec, data.val, data.y_mean, data.n_val, data.extras[val_cutoff])
    validation = Validation.of(task, cfg, data, dev)
    opt = optimizer(model, cfg, dev)
    if fixed is not None:
        refit = fixed_recipe(model, opt, task, spec, cfg, data, validation, train_cutoffs, foundation_state, fixed,
                             order, rng, dist, log, started, resume)
        task_of(task).fit_new_items(refit.model, task, cache, max(train_cutoffs), log)
        return refit
    best, start = choose_start(model, task, spec, data, validation, train_cutoffs, foundation_state,
                               use_forecast=cfg.foundation_start and not from_scratch, log=log)
    curves, rows, best, snapshots = train_epochs(model, opt, task, cfg, data, validation, train_cutoffs, best, order,
                                                 rng, dist, resume, log)
    with validation.mixed():
        soup = (greedy_soup(model, task, validation.scored, dev, best, snapshots, validation.negatives) if cfg.soup
                else [best[2]])
    model.eval()
    # a second stage where the task has one (recommendation: re-ranking trees), chosen on validation too
    second = task_of(task).second_stage(
        model, task, (data.kept.get((s, lo, hi, c)) for s, lo, hi in data.plan for c in train_cutoffs), data.val,
        str(dev), log) if cfg.second_stage else None
    data.kept.close()
    # (recommendation: the item map, chosen on validation)
    new_items = task_of(task).fit_new_items(model, task, cache, val_cutoff, log, data.val)
    rows = int(sum_over_ranks([rows], dist)[0]) if dist.enabled else rows
    info = {"best_epoch": best[2] + 1, "soup_epochs": [e + 1 for e in soup], "seconds": round(time.time() - started, 2),
            "rows_seen": rows, "train_cutoffs": [iso(c) for c in train_cutoffs], "val_cutoff": iso(val_cutoff),
            "val_rows": int(data.n_val), "val_chunk_stride": validation.stride, "head_start": start,
            **({"second_stage": second} if second else {}), **({"new_items": new_items} if new_items else {}),
            "val_target_mean": float(np.mean(data.y_mean)) if data.n_val else 0.0,
            "device": str(dev), **processes_info(dist),
            **({"sampled_negatives": validation.train_negatives} if validation.train_negatives else {})}
    if adapters is not None:
        info.update(lora_rank=adapters.rank, lora_alpha=adapters.alpha,
                    trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad))
    return TrainResult(model, curves, info)


@dataclass(frozen=True)
class Fixed:
    """A recipe chosen on validation already (the refit, models/train/refit.py): the start ("baseline",
    or "foundation (calibrated)": finetune's head_start) and the epochs averaged (finetune's soup_epochs:
    1-based, 0 the start); the epochs trained are the last of them."""
    start: str
    soup: tuple[int, ...]


def fixed_recipe(model: Model, opt, task: TaskSpec, spec: FeatureSpec, cfg: FinetuneConfig, data: "Features",
                 validation: "Validation", train_cutoffs, foundation_state: dict, fixed: Fixed, order, rng, dist: Dist,
                 log: Log, started: float, resume: Resumer | None = None) -> TrainResult:
    """finetune with `fixed`: the recorded start, max(soup) epochs, the recorded epochs' weights averaged;
    nothing scored on a validation cut-off."""
    if fixed.start != "baseline":
        forecast = foundation_forecast(foundation_state, spec, task.target, task.outputs)
        if forecast is None:
            raise ValueError(f"the recipe starts at the foundation's forecast ({fixed.start}); this foundation has none")
        start_at_calibrated_forecast(model, forecast, task, spec, data, train_cutoffs, validation.dev)
    first = (math.nan, state_copy(model), -1)
    epochs = max(fixed.soup)
    curves, rows, _, snapshots = train_epochs(model, opt, task, dataclasses.replace(cfg, epochs=epochs), data,
                                              validation, train_cutoffs, first, order, rng, dist, resume, log,
                                              scored=False)
    weights = {epoch + 1: state for _, state, epoch in [first, *snapshots]}
    chosen = [weights[e] for e in fixed.soup]
    model.load_state_dict({k: sum(w[k] for w in chosen) / len(chosen) if v.is_floating_point() else v
                           for k, v in chosen[0].items()})
    model.eval()
    data.kept.close()
    info = {"epochs": epochs, "soup_epochs": list(fixed.soup), "head_start": fixed.start,
            "seconds": round(time.time() - started, 2), "rows_seen": int(rows),
            "train_cutoffs": [iso(c) for c in train_cutoffs],
            "val_target_mean": float(np.mean(data.y_mean)) if data.n_val else 0.0, "device": str(validation.dev),
            **processes_info(dist)}
    return TrainResult(model, curves, info)


def start_model(foundation_state: dict, foundation_info: dict, task: TaskSpec, spec: FeatureSpec, dev,
                from_scratch: bool, adapters: LoraConfig | None) -> Model:
    """The task's network with the foundation's trunk weights (from scratch: its input scaling only),
    LoRA adapters on the trunk when asked."""
    model = build_model(NetConfig.from_dict(foundation_info["net"]), task, spec)
    if adapters is not None:  # (a plain trunk state loads into the adapted layers: models/nn/lora.py)
        apply_lora(model, adapters.rank, adapters.alpha)
    model = model.to(dev)
    keep_on_heap(max(p.numel() * p.element_size() for p in model.parameters()))  # (its gradient, every step)
    trunk_state = {k.removeprefix("trunk."): v for k, v in foundation_state.items() if k.startswith("trunk.")}
    if from_scratch:
        trunk_state = {k: v for k, v in trunk_state.items() if k.startswith("in_")}
    model.trunk.load_state_dict(trunk_state, strict=not from_scratch)
    return model


@dataclass
class Features:
    """What fine-tuning reads: the features of every (chunk, cut-off), computed once (`kept`), and the
    validation rows with their base rates."""
    kept: Kept
    plan: list[tuple[int, int, int]]  # (shard, first entity, end) of every chunk
    extras: dict[int, tuple]  # what every chunk at a cut-off shares (recommendation: the item popularity)
    val_cutoff: int
    first: tuple  # the first validation chunk's arrays
    n_val: int = 0
    y_mean: np.ndarray | None = None

    def validation(self, chunks: list | None = None) -> Recomputed:
        """The arrays of `chunks` (default every chunk) at the validation cut-off, read again at each pass."""
        chunks = self.plan if chunks is None else chunks
        return Recomputed(lambda: (self.kept.get((s, lo, hi, self.val_cutoff)) for s, lo, hi in chunks))

    @property
    def val(self) -> Recomputed:
        return self.validation()


def plan_features(cache: Cache, task: TaskSpec, spec: FeatureSpec, cfg: FinetuneConfig, val_cutoff: int) -> Features:
    """Features of every (chunk, cut-off) are the same each epoch: computed once, kept in memory or in
    files within the budgets (validation's first: it is read the most), else computed again."""
    t = task_of(task)
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    plan = chunk_plan(cache, cfg.chunk_entities)
    extras: dict[int, tuple] = {}

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)  # (the cache keeps the last shard read)
        keep, y = t.labels(chunk, task.target, cache)
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        if cutoff not in extras:
            extras[cutoff] = t.chunk_extra(cache, task.target, cutoff)
        return (x[keep], None if h is None else h[keep], y, *extras[cutoff])

    kept = Kept(data, cfg.memory_budget_bytes, cfg.spill_budget_bytes, cfg.spill_dir)
    features = Features(kept, plan, extras, val_cutoff, kept.get(plan[0] + (val_cutoff,)))
    y_sum = 0.0
    for arrays in features.val:
        y = arrays[2]
        features.n_val += len(y)
        y_sum = y_sum + (y.col_counts() if isinstance(y, SparseRows) else t.target_sums(task, y))
    features.y_mean = np.asarray(y_sum, np.float64) / max(features.n_val, 1)
    return features


@dataclass
class Validation:
    """How the validation cut-off scores a start, an epoch or a soup: on which rows (`scored`), with how
    many sampled labels, under which precision."""
    scored: Recomputed  # the validation rows that pick the epochs
    stride: int  # every stride-th validation chunk is scored
    train_negatives: int  # labels sampled per training batch (0: the full loss)
    negatives: int  # labels sampled per validation batch (0: the full loss)
    mixed: Callable  # the context of the matrix products (bf16 where the hardware has it, for sampled heads)
    dev: torch.device

    @classmethod
    def of(cls, task: TaskSpec, cfg: FinetuneConfig, data: Features, dev) -> "Validation":
        negatives = task_of(task).sampled_negatives(task, cfg)  # wide label heads: sampled negatives (0: the full loss)
        val_negatives = min(cfg.val_sampled_negatives, task.outputs) if negatives else 0
        # a wide head's sampled validation loss, run after every epoch and for every soup candidate, reads
        # about cfg.val_sampled_rows rows: every k-th chunk (reading them all was a fifth of the wide
        # head's fine-tuning, docs/journal/speed.md); the base rates count every row
        stride = max(1, math.ceil(data.n_val / cfg.val_sampled_rows)) if negatives else 1
        scored = data.val if stride == 1 else data.validation(data.plan[::stride])
        mixed = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if negatives and cfg.sampled_bf16 \
            and fast_bf16(dev) else contextlib.nullcontext
        return cls(scored, stride, negatives, val_negatives, mixed, dev)

    def criterion(self, model, task: TaskSpec, loss: float | None = None) -> float:
        with self.mixed():
            return _val_criterion(model, task, self.scored, self.dev, loss, negatives=self.negatives)

    def loss(self, model, task: TaskSpec) -> float:
        with self.mixed():
            return _val_loss(model, task, self.scored, self.dev, negatives=self.negatives)


def optimizer(model: Model, cfg: FinetuneConfig, dev) -> torch.optim.Optimizer:
    """AdamW with a learning rate per part: the pretrained trunk slower than the head, the per-label
    history weights and the pairwise scorer's label embeddings at their own scales."""
    label_skip = [p for n, p in model.head.named_parameters() if n == "label_skip"]
    pair_labels = [p for n, p in model.head.named_parameters() if n == "pair.label.weight"]
    params = [{"params": model.trunk.parameters(), "lr": cfg.learning_rate * cfg.trunk_lr_scale},
              {"params": [p for n, p in model.head.named_parameters() if n not in ("label_skip", "pair.label.weight")],
               "lr": cfg.learning_rate}]
    if label_skip:  # per-label history weights must travel to O(1) values in a few hundred steps
        params.append({"params": label_skip, "lr": cfg.learning_rate * cfg.label_skip_lr_scale})
    if pair_labels:
        params.append({"params": pair_labels, "lr": cfg.learning_rate * cfg.pair_label_lr_scale})
    return torch.optim.AdamW(params, weight_decay=cfg.weight_decay, fused=fused(dev))


def start_at_calibrated_forecast(model: Model, forecast, task: TaskSpec, spec: FeatureSpec, data: "Features",
                                 train_cutoffs, dev) -> None:
    """The head's start at the foundation's forecast, calibrated on the latest training cut-offs' rows."""
    t = task_of(task)
    calibration = (data.kept.get((s, lo, hi, c)) for c in reversed(train_cutoffs) for s, lo, hi in data.plan)
    with torch.no_grad():
        start_at_forecast(model, forecast, calibration, dev, spec.channels if t.uses_label_history else 0,
                          t.forecast_targets)


def choose_start(model: Model, task: TaskSpec, spec: FeatureSpec, data: Features, validation: Validation, train_cutoffs,
                 foundation_state: dict, *, use_forecast: bool, log: Log) -> tuple[tuple, str]:
    """The starting point competes too (epoch -1: fine-tuning is kept only where it helps on
    validation), and where the foundation already forecasts the head's outputs, a second start: its own
    forecast, recalibrated. Leaves the better start in `model`; returns (criterion, weights, -1) and its name."""
    best = (validation.criterion(model, task), state_copy(model), -1)
    log(f"{task.task} start: validation criterion {best[0]:.4f}")
    forecast = foundation_forecast(foundation_state, spec, task.target, task.outputs) if use_forecast else None
    if forecast is None:
        return best, "baseline"
    start = "baseline"
    start_at_calibrated_forecast(model, forecast, task, spec, data, train_cutoffs, validation.dev)
    criterion = validation.criterion(model, task)
    log(f"{task.task} start at the foundation's forecast, calibrated ({len(forecast.positions)} of "
        f"{task.outputs} outputs): validation criterion {criterion:.4f}")
    if criterion < best[0]:
        best, start = (criterion, state_copy(model), -1), "foundation (calibrated)"
    model.load_state_dict(best[1])
    return best, start


def train_epochs(model: Model, opt, task: TaskSpec, cfg: FinetuneConfig, data: Features, validation: Validation,
                 train_cutoffs, best: tuple, order: np.random.Generator, rng: np.random.Generator, dist: Dist,
                 resume: Resumer | None, log: Log, scored: bool = True) -> tuple[dict, int, tuple, list]:
    """The epochs: each a shuffled pass over every (chunk, training cut-off), then scored on validation.
    Returns the loss curves, the rows seen, the best (criterion, weights, epoch) and every epoch's
    (criterion, weights, epoch) for the soup. With `resume`: continues a killed run from its last
    saved state and saves between chunks every N steps (models/train/resume.py). `scored` False: no
    validation after the epochs (a fixed recipe: every epoch's weights kept, none chosen)."""
    t, dev = task_of(task), validation.dev
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    rows = 0
    modules = {"model": model, "opt": opt}
    at = resume.restore(modules, order, rng) if resume is not None else None
    if at:
        curves, rows, best = at["curves"], at["rows"], tuple(at["best"])
    snapshots = [tuple(snap) for snap in at["snapshots"]] if at else []
    # one process: the model itself and the whole plan; several: DDP, this rank's entity chunks
    net = wrap(model, dist, find_unused=t.find_unused_parameters)
    mine, lock = set(shard(data.plan, dist)), Lockstep(dist)
    kept = (model.head.linear.weight,) if validation.train_negatives else ()  # a wide head: sparse row gradients
    if kept:
        model.head.sparse_rows = True
    # a batch for padding steps (loss x 0): its chunk's key and rows
    last = (at["last"][0], at["last"][1]) if at and at["last"] else (None, np.arange(min(len(data.first[0]),
                                                                                            cfg.batch_size)))

    def position(epoch, work, i, perm, offset, losses) -> tuple[dict, dict]:
        """(what every rank shares, this rank's own) at a step: the resumable state of the loop."""
        return ({"epoch": epoch, "curves": curves, "best": list(best), "snapshots": [list(s) for s in snapshots]},
                {"work": work, "next": i, "perm": perm, "offset": offset, "losses": losses, "rows": rows,
                 "last": None if last[0] is None else [list(last[0]), last[1]]})

    for epoch in range(at["epoch"] if at else 0, cfg.epochs):
        net.train()
        if at and epoch == at["epoch"]:  # resumed: the saved epoch's data order, place in it and losses so far
            work, losses, first, perm, offset = at["work"], at["losses"], at["next"], at["perm"], at["offset"]
        else:
            work = by_shard([(s, lo, hi, c) for s, lo, hi in data.plan for c in train_cutoffs], order)
            if dist.enabled:  # this rank's entity chunks
                work = [w for w in work if tuple(w[:3]) in mine]
            losses, first, perm, offset = [], 0, None, 0
        for i, (s, lo, hi, cutoff) in enumerate(work[first:], first):
            key = (int(s), int(lo), int(hi), int(cutoff))
            arrays = data.kept.get(key)
            if perm is None:  # a chunk begun (a resumed one has its order drawn and its rows counted)
                rows += len(arrays[0])
                perm = rng.permutation(len(arrays[0]))  # (as loop.batches draws it)
            for j in range(offset, len(perm), cfg.batch_size):
                b = perm[j:j + cfg.batch_size]
                lock.real()
                with validation.mixed():
                    loss = batch_loss(net, task, arrays, b, dev, rng, validation.train_negatives)
                last = (key, b) if dist.enabled else last
                step(model, opt, loss, kept)
                losses.append(loss.item())
                if resume is not None:  # the chunk's rest, or the next chunk when this batch was its last
                    done = j + cfg.batch_size >= len(perm)
                    resume.after_step(modules, order, rng, lambda: position(
                        epoch, work, i + done, None if done else perm, 0 if done else j + cfg.batch_size, losses))
            perm, offset = None, 0
        padding = (data.first, last[1]) if last[0] is None else (data.kept.get(last[0]), last[1])
        for _ in lock.padding():  # several processes: this rank's share is spent, the others' is not
            loss = batch_loss(net, task, padding[0], padding[1], dev, rng, validation.train_negatives) * 0.0
            step(model, opt, loss, kept)
            if resume is not None:
                resume.after_step(modules, order, rng, lambda: position(epoch, work, len(work), None, 0, losses))
        curves["train_loss"].append(epoch_loss(losses, dist))
        if not scored:
            log(f"{task.task} epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}")
            snapshots.append((math.nan, state_copy(model), epoch))
            continue
        curves["val_loss"].append(validation.loss(model, task))
        log(f"{task.task} epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f}")
        criterion = _val_criterion(model, task, validation.scored, dev, curves["val_loss"][-1],
                                   negatives=validation.negatives)
        if not t.loss_is_criterion(task):
            log(f"{task.task} epoch {epoch + 1}: validation criterion {criterion:.4f}")
        snapshots.append((criterion, state_copy(model), epoch))
        if criterion < best[0]:
            best = (criterion, state_copy(model), epoch)
    return curves, rows, best, snapshots


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
    """The task's loss on rows `b` of (features, label history, targets, *extra). `negatives` > 0 (a wide
    label head): a sampled loss over that many labels drawn from `rng`, instead of the full loss."""
    return task_of(task).batch_loss(model, task, arrays, b, dev, rng, negatives)


@torch.no_grad()
def _val_criterion(model, task: TaskSpec, val, dev, loss: float | None = None, negatives: int = 0) -> float:
    """What picks the epoch (lower is better): the validation loss, or the task's own criterion."""
    t = task_of(task)
    if t.loss_is_criterion(task):
        return _val_loss(model, task, val, dev, negatives=negatives) if loss is None else loss
    return t.val_criterion(model, task, val, dev)


@torch.no_grad()
def _val_loss(model, task: TaskSpec, val, dev, batch: int = 2048, negatives: int = 0) -> float:
    """The mean loss over the validation rows; `negatives` > 0 (a wide multilabel head): the sampled
    estimate, its labels drawn from a fixed seed, so every epoch is scored on the same labels."""
    model.eval()
    rng = np.random.default_rng(0)  # the same sampled candidates at every epoch
    batch = task_of(task).val_batch(task, batch)
    total, n = 0.0, 0
    for arrays in val:
        size = len(arrays[0])
        for i in range(0, size, batch):
            b = np.arange(i, min(i + batch, size))
            total += float(batch_loss(model, task, arrays, b, dev, rng, negatives)) * len(b)
            n += len(b)
    return total / n if n else float("nan")

