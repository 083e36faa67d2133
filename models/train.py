"""Training: the self-supervised foundation model and the scenario models fine-tuned from it.

One straight loop each. Work is cut into chunks of entities of one shard at one cut-off; a chunk's
features are computed (vectorized) and fed in shuffled mini-batches. Cut-offs fall on midnights
(UTC); features read events at or before the cut-off, targets the window after it.
"""

import contextlib
import math
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from models.cache import Cache
from models.distributed import Dist, Lockstep, detect, shard, sum_over_ranks, wrap
from models.features import DAY, HALF_LIVES, RECENCY_DAYS, Chunk, FeatureSpec, chunk_at, featurize
from models.items import SparseRows, batch_history, candidates, group_history, sampled_softmax_loss, top_k_items
from models.network import Model, NetConfig
from models.resume import Resumer
from models.targets import TargetSpec, compute_target, eligible, foundation_target, label_positions

Log = Callable[[str], None]


@dataclass
class FoundationConfig:
    horizon_days: int = 14
    cutoff_every_days: int = 7
    hidden: int = 256
    layers: int = 2
    epochs: int = 3
    batch_size: int = 512
    learning_rate: float = 2e-3
    buckets: int = 256
    seed: int = 0
    cutoffs_per_chunk: int = 2  # cut-offs sampled for each chunk of entities in each epoch
    chunk_entities: int = 4096
    min_history_days: int = 28
    # inputs are divided by max(std, floor): a small floor blows rare histogram buckets up to huge
    # values and the model overfits them (Ta-Feng churn AUROC 0.708 at 1e-3, 0.729 at 1.0)
    std_floor: float = 1.0
    dropout: float = 0.1
    half_lives: tuple[float, ...] = HALF_LIVES  # days: decayed counts per value at each of these
    # quantile bins of the piecewise-linear scalar inputs (network.NetConfig.ple_bins; 0: off). Worth
    # +0.003 churn AUROC on Ta-Feng, +0.002 churn / +0.002 propensity on the demo (docs/quality.md)
    ple_bins: int = 16


PAIR_WIDTH = 128
PAIR_LAYERS = 2


@dataclass
class TaskSpec:
    task: str  # binary | multilabel | regression | recommendation
    target: TargetSpec
    k: int = 10
    item_dim: int = 64  # recommendation: width of the item embeddings
    # multilabel: width and depth of the shared pairwise scorer of (entity, label, its own history of
    # that label) (network.PairScorer; 0: the per-label linear head alone, as checkpoints before it).
    # Propensity macro AUROC, demo 0.9119 -> 0.9134, Ta-Feng 0.7722 -> 0.7720 (docs/quality.md)
    pair_width: int = PAIR_WIDTH
    pair_layers: int = PAIR_LAYERS

    @property
    def outputs(self) -> int:
        return len(self.target.labels) if self.task in ("multilabel", "recommendation") else 1

    @property
    def uses_label_history(self) -> bool:
        return self.task in ("multilabel", "recommendation")

    def to_dict(self) -> dict:
        return {"task": self.task, "target": self.target.to_dict(), "k": self.k, "item_dim": self.item_dim,
                "pair_width": self.pair_width, "pair_layers": self.pair_layers}

    @classmethod
    def from_dict(cls, d: dict) -> "TaskSpec":
        # (saved before the pairwise scorer: the linear head alone)
        return cls(d["task"], TargetSpec.from_dict(d["target"]), d["k"], d.get("item_dim", 64), d.get("pair_width", 0),
                   d.get("pair_layers", PAIR_LAYERS))


def build_model(net: NetConfig, task: TaskSpec, spec: FeatureSpec) -> Model:
    """The scenario network of a task: the trunk plus the task's head."""
    channels = spec.channels if task.uses_label_history else 0
    if task.task == "recommendation":
        return Model(net, task.outputs, channels, task.item_dim, len(POPULARITY_DAYS))
    pair = task.pair_width if task.task == "multilabel" else 0
    return Model(net, task.outputs, channels, pair_width=pair, pair_layers=task.pair_layers)


HEAD_ZERO_INIT = True
POPULARITY_INIT = 0.2  # recommendation starts as "what they bought, habitually" blended with what sells now
POPULARITY_DAYS = (7, 30)  # item popularity at a cut-off: events in the last 7 and 30 days


def item_popularity(cache: Cache, target: TargetSpec, cutoff: int) -> np.ndarray:
    """[labels, len(POPULARITY_DAYS)] log(1 + how often each label was touched by anyone in the last
    7 / 30 days before the cut-off): what sells now, read from history only."""
    vocab = cache.columns[target.column]["vocab_size"]
    counts = np.zeros((len(POPULARITY_DAYS), max(vocab, max(target.labels, default=0)) + 1), np.float64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        for j, days in enumerate(POPULARITY_DAYS):
            recent = (sh.ts <= cutoff) & (sh.ts > cutoff - days * DAY)
            counts[j] += np.bincount(sh.columns[target.column][recent], minlength=counts.shape[1])[:counts.shape[1]]
    return np.log1p(counts[:, np.asarray(target.labels, np.int64)].T).astype(np.float32)


@dataclass
class FinetuneConfig:
    epochs: int = 6
    learning_rate: float = 1e-3
    batch_size: int = 512
    chunk_entities: int = 4096
    weight_decay: float = 1e-4
    seed: int = 0
    # the features of every (chunk, cut-off) are computed once: kept in memory up to
    # `memory_budget_bytes` (validation's first), then written to files in `spill_dir` (None: the
    # system's temporary folder) up to `spill_budget_bytes` and read back at each epoch, then computed
    # again at each use. 2 GiB in memory made the peak grow with the data (churn at 10M events kept
    # ~1 GB of validation features); a file costs a read from the page cache (~26 MB a chunk).
    memory_budget_bytes: int = 512 << 20
    spill_budget_bytes: int = 16 << 30
    spill_dir: str | None = None
    soup: bool = True  # average the weights of the epochs that help on validation (greedy soup)
    # the learning rate of the per-label history weights, relative to the head's (Ta-Feng propensity
    # macro AUROC 0.753 at 1x, 0.766 at 10x, 0.768 at 30x; demo 0.892 / 0.908 / 0.910; docs/quality.md)
    label_skip_lr_scale: float = 30.0
    # the learning rate of the pairwise scorer's label embeddings, relative to the head's
    pair_label_lr_scale: float = 1.0
    # the pretrained trunk's learning rate, relative to the head's (demo churn AUROC over three seeds:
    # 0.8597 at 1.0, 0.8595 at 0.3, 0.8592 at 0.1; docs/quality.md)
    trunk_lr_scale: float = 0.3
    # multilabel heads wider than `sampled_above_labels` train on the labels of each batch's positives
    # plus `sampled_negatives` other labels drawn uniformly per batch (sampled_multilabel_loss): the
    # head's matrix products shrink by labels / columns (16,000 / ~3,600 at the 16k scenario); narrow
    # heads (Ta-Feng's 50 brands) keep the full loss. Validation samples `val_sampled_negatives` per
    # batch with a fixed seed (the same labels at every epoch). 0 negatives: the full loss everywhere.
    sampled_negatives: int = 1024
    sampled_above_labels: int = 2048
    val_sampled_negatives: int = 2048
    # sampled heads train and validate with their matrix products in bfloat16 (torch.autocast; the
    # weights, their updates and the losses stay float32) where the hardware multiplies bf16 natively
    # (CUDA with bf16, CPUs with AVX-512 BF16 or AMX): 16k fine-tuning at 1M, one thread, CPU time
    # 76 s -> 36 s with fused AdamW, test macro AUROC 0.91579 -> 0.91582 (the same epochs chosen)
    sampled_bf16: bool = True


@dataclass
class TrainResult:
    model: Model
    curves: dict[str, list[float]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def day_floor(ts: int) -> int:
    return int(ts) // DAY * DAY


def cutoff_grid(first_ts: int, last_cutoff: int, every_days: int, min_history_days: int) -> list[int]:
    """Cut-offs every `every_days` back from `last_cutoff`, leaving `min_history_days` of history."""
    earliest = day_floor(first_ts) + min_history_days * DAY
    grid = list(range(day_floor(last_cutoff), earliest - 1, -every_days * DAY))
    return sorted(grid)


def chunk_plan(cache: Cache, chunk_entities: int) -> list[tuple[int, int, int]]:
    """(shard, first entity position, end position) covering every entity of every shard."""
    plan = []
    for s, meta in enumerate(cache.manifest["shards"]):
        for lo in range(0, meta["entities"], chunk_entities):
            plan.append((s, lo, min(lo + chunk_entities, meta["entities"])))
    return plan


def label_history(chunk: Chunk, target: TargetSpec, vocab_size: int, half_lives) -> SparseRows:
    """The history of each label for each entity as sparse rows [n, labels] of channels: per (entity,
    label) it touched, the decayed counts per half-life (log-scaled) and the decayed recency, as
    features.value_history computes them; labels it never touched are zero. Stored entries grow with
    the events, never with n x labels (16,000 products, a whole catalog): `.dense(channel)` gives one
    channel as [n, labels], and a mini-batch's rows feed the head as (row, label, values)."""
    pos = label_positions(target.labels, chunk.shard.columns[target.column][chunk.rows])
    keep = pos >= 0
    return group_history(chunk.local[keep], pos[keep], chunk.age_days[keep], chunk.n, len(target.labels),
                         half_lives, RECENCY_DAYS)


def by_shard(work: list, rng: np.random.Generator) -> list:
    """`work` (shard, ...) items shuffled, then grouped by shard (the shards in the order they first
    appear, each keeping its items' shuffled order): training reads one shard at a time, where holding
    every shard in memory was most of the peak at 10M events (3 shards of ~155 MB). One shard: just
    the shuffle."""
    rng.shuffle(work)
    first: dict = {}
    for w in work:
        first.setdefault(w[0], len(first))
    return sorted(work, key=lambda w: first[w[0]])  # (stable)


def _batches(n: int, size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    order = rng.permutation(n)
    for i in range(0, n, size):
        yield order[i:i + size]


def fast_bf16(dev: torch.device) -> bool:
    """Whether `dev` multiplies bfloat16 matrices natively (faster than float32)."""
    if dev.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if dev.type == "cpu":
        return any(getattr(torch.cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def _fused(dev: torch.device) -> bool | None:
    """AdamW's fused kernel where torch has one (one pass over each tensor): torch's default on CPUs,
    one step per operation, took 9 ms a step for the 16,000 x 256 head (the fused one ~2 ms)."""
    return True if dev.type in ("cpu", "cuda") else None


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# --------------------------------------------------------------------------- foundation


def foundation_loss(out: torch.Tensor, y: torch.Tensor, n_columns: int) -> torch.Tensor:
    bce = nn.functional.binary_cross_entropy_with_logits
    loss = bce(out[:, 0], y[:, 0]) + nn.functional.mse_loss(out[:, 1], y[:, 1])
    if out.shape[1] > 2:
        loss = loss + n_columns * bce(out[:, 2:], y[:, 2:])
    return loss


def train_foundation(cache: Cache, cfg: FoundationConfig, last_cutoff: int, *, device: str = "auto",
                     log: Log = print, resume: Resumer | None = None, dist: Dist | None = None) -> TrainResult:
    """Self-supervised training: from the history before many sampled cut-offs, predict the next
    `horizon_days` (whether the entity acts, how much, and which values of every categorical column).
    `last_cutoff + horizon` is the latest time any target may read.
    Under torchrun (`dist`, by default read from its variables) each rank trains on its share of the
    entity chunks with DDP in lockstep (models.distributed); only rank 0 logs."""
    started = time.time()
    dist, dev, log = _processes(dist, device, log, resume)
    rng = np.random.default_rng(cfg.seed)
    order = rng  # the epochs' data order; several processes draw it alike, their batches each its own
    if dist.enabled:
        order, rng = np.random.default_rng(cfg.seed), np.random.default_rng([cfg.seed, dist.rank])
    torch.manual_seed(cfg.seed)
    spec = FeatureSpec.from_cache(cache, cfg.buckets, cfg.half_lives)
    cutoffs = cutoff_grid(cache.time_range[0], last_cutoff, cfg.cutoff_every_days, cfg.min_history_days)
    if not cutoffs:
        raise ValueError(f"no foundation cut-off fits: the data spans {_days(cache.time_range)} days, which leaves no "
                         f"{cfg.min_history_days} days of history before {_iso(last_cutoff)}; more history is needed")
    entity_table = cache.entity_table()
    plan = chunk_plan(cache, cfg.chunk_entities)

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)  # (the cache keeps the last shard read)
        x = featurize(chunk, spec, entity_table)
        y = foundation_target(chunk, cfg.horizon_days, spec.categorical, spec.buckets)
        return chunk, x, y

    # hold out a tenth of the entities (by id) to watch generalization, at the latest cut-off
    probe = [data(s, lo, hi, cutoffs[-1]) for s, lo, hi in plan[: max(1, math.ceil(len(plan) / 4))]]
    val_rows = [np.flatnonzero(c.entities % 10 == 0) for c, _, _ in probe]
    targets_width = probe[0][2].shape[1]
    net = NetConfig(spec.width, cfg.hidden, cfg.layers, cfg.dropout, spec.scalar_width if cfg.ple_bins else 0,
                    cfg.ple_bins, spec.entity_scalar_width if cfg.ple_bins else 0)
    model = Model(net, targets_width).to(dev)
    model.trunk.fit_input_scale(torch.from_numpy(np.concatenate([x for _, x, _ in probe])).to(dev), cfg.std_floor)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=1e-4)
    steps_total = cfg.epochs * math.ceil(len(plan) / dist.world) * min(cfg.cutoffs_per_chunk, len(cutoffs)) * math.ceil(
        cfg.chunk_entities / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.learning_rate, total_steps=max(steps_total, 1), pct_start=0.1)
    n_cols = len(spec.categorical)
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    events_seen = entities_seen = steps = 0
    # >>> resume hook (models/resume.py): continue a killed run from its last saved state
    modules = {"model": model, "opt": opt, "sched": sched}
    at = resume.restore(modules, rng) if resume is not None else None
    if at:
        curves, (events_seen, entities_seen, steps) = at["curves"], at["counters"]
    # <<< resume hook
    net, mine, lock = wrap(model, dist), set(shard(plan, dist)), Lockstep(dist)  # one process: model, plan, no-op
    pad = torch.zeros(1, spec.width, device=dev), torch.zeros(1, targets_width, device=dev)
    for epoch in range(at["epoch"] if at else 0, cfg.epochs):
        net.train()
        if at and epoch == at["epoch"]:  # resume hook: the saved epoch's data order and losses so far
            work, losses, first = at["work"], at["losses"], at["next"]
        else:
            work = [(s, lo, hi, c) for s, lo, hi in plan
                    for c in order.choice(cutoffs, min(cfg.cutoffs_per_chunk, len(cutoffs)), replace=False)]
            work = by_shard(work, order)
            if dist.enabled:  # this rank's entity chunks
                work = [w for w in work if tuple(w[:3]) in mine]
            losses, first = [], 0
        for i, (s, lo, hi, cutoff) in enumerate(work[first:], first):
            chunk, x, y = data(s, lo, hi, int(cutoff))
            train = np.flatnonzero(chunk.entities % 10 != 0)
            events_seen += len(chunk.rows)
            entities_seen += len(train)
            xt, yt = torch.from_numpy(x[train]).to(dev), torch.from_numpy(y[train]).to(dev)
            for b in _batches(len(train), cfg.batch_size, rng):
                lock.real()
                loss = foundation_loss(net(xt[b]), yt[b], n_cols)
                _step(model, opt, loss)
                if steps < steps_total:
                    sched.step()
                steps += 1
                losses.append(loss.item())
            if resume is not None:  # resume hook: save between chunks every N steps
                resume.after_chunk(math.ceil(len(train) / cfg.batch_size), modules, rng, lambda: {
                    "epoch": epoch, "next": i + 1, "work": work, "losses": losses, "curves": curves,
                    "counters": [events_seen, entities_seen, steps]})
        for _ in lock.padding():  # several processes: this rank's share is spent, the others' is not
            loss = foundation_loss(net(pad[0]), pad[1], n_cols) * 0.0
            _step(model, opt, loss)
            if steps < steps_total:
                sched.step()
            steps += 1
        curves["train_loss"].append(_epoch_loss(losses, dist))
        curves["val_loss"].append(_foundation_val(model, probe, val_rows, n_cols, dev))
        log(f"foundation epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f} ({time.time() - started:.0f}s)")
    model.eval()
    if dist.enabled:  # what every rank saw
        events_seen, entities_seen = (int(v) for v in sum_over_ranks([events_seen, entities_seen], dist))
    seconds = time.time() - started
    info = {"cutoffs": [_iso(c) for c in cutoffs], "last_target_time": _iso(last_cutoff + cfg.horizon_days * DAY),
            "events_seen": events_seen, "entities_seen": entities_seen, "seconds": round(seconds, 2),
            "steps": steps, "feature_spec": spec.to_dict(), "net": model.trunk.cfg.to_dict(),
            "targets_width": targets_width, "device": str(dev), **_processes_info(dist)}
    return TrainResult(model, curves, info)


def _step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One optimizer step on `loss`, gradients clipped to norm 1."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def _processes(dist: Dist | None, device: str, log: Log, resume) -> tuple[Dist, torch.device, Log]:
    """This process's place among torchrun's (or alone), its device, and its log (rank 0's only)."""
    dist = detect(device) if dist is None else dist
    if not dist.enabled:
        return dist, resolve_device(device), log
    if resume is not None:
        raise ValueError(f"resumable training runs in one process; {dist.world} processes start afresh (pass no "
                         f"resume, or train with executor processes: 1 to continue a killed run)")
    return dist, torch.device(dist.device), log if dist.is_writer else (lambda _: None)


def _processes_info(dist: Dist) -> dict:
    return {"processes": dist.world} if dist.enabled else {}


def _epoch_loss(losses: list[float], dist: Dist) -> float:
    """The epoch's mean training loss (over every rank's batches when several train)."""
    if not dist.enabled:
        return float(np.mean(losses)) if losses else float("nan")
    total, count = sum_over_ranks([float(np.sum(losses)), float(len(losses))], dist)
    return total / count if count else float("nan")


@torch.no_grad()
def _foundation_val(model, probe, val_rows, n_cols, dev) -> float:
    model.eval()
    xs = np.concatenate([x[r] for (_, x, _), r in zip(probe, val_rows)])
    ys = np.concatenate([y[r] for (_, _, y), r in zip(probe, val_rows)])
    if len(xs) == 0:
        return float("nan")
    return float(foundation_loss(model(torch.from_numpy(xs).to(dev)), torch.from_numpy(ys).to(dev), n_cols))


# --------------------------------------------------------------------------- scenarios


def task_loss(task: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task in ("binary", "multilabel"):
        return nn.functional.binary_cross_entropy_with_logits(out, y)
    if task == "regression":
        # the absolute error in the target's own units (what MAE scores; its optimum is the median),
        # the output staying a log amount; divided by the batch's mean target so that amounts in
        # cents or in thousands train alike. Ta-Feng spend MAE 342.2 -> 335.4 against a Huber loss
        # on log amounts (docs/quality.md)
        error = (torch.expm1(out.float().clamp(max=30.0)) - y).abs().mean()
        return error / y.abs().mean().detach().clamp_min(1e-3)
    raise ValueError(f"{task}: recommendation is trained by items.sampled_softmax_loss (see batch_loss)")


def task_inputs(chunk: Chunk, spec: FeatureSpec, task: TaskSpec, entity_table, vocab_sizes: dict[str, int]):
    x = featurize(chunk, spec, entity_table)
    h = label_history(chunk, task.target, vocab_sizes[task.target.column], spec.half_lives) \
        if task.uses_label_history else None
    return x, h


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
    dist, dev, log = _processes(dist, device, log, resume)
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
    kept = _Kept(data, cfg.memory_budget_bytes, cfg.spill_budget_bytes, cfg.spill_dir)
    first = kept.get(plan[0] + (val_cutoff,))
    val = _Recomputed(lambda: (kept.get((s, lo, hi, val_cutoff)) for s, lo, hi in plan))
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
    opt = torch.optim.AdamW(params, weight_decay=cfg.weight_decay, fused=_fused(dev))
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    mixed = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if negatives and cfg.sampled_bf16 \
        and fast_bf16(dev) else contextlib.nullcontext  # (sampled wide heads: bf16 matrix products)
    # the starting point (epoch 0) competes too: fine-tuning is kept only where it helps on validation
    with mixed():
        best = (_val_criterion(model, task, val, dev, negatives=val_negatives), _state(model), -1)
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
            for b in _batches(len(arrays[0]), cfg.batch_size, rng):
                lock.real()
                with mixed():
                    loss = batch_loss(net, task, arrays, b, dev, rng, negatives)
                last = (arrays, b) if dist.enabled else last
                _step(model, opt, loss)
                losses.append(loss.item())
            if resume is not None:  # resume hook: save between chunks every N steps
                resume.after_chunk(math.ceil(len(arrays[0]) / cfg.batch_size), modules, rng, lambda: {
                    "epoch": epoch, "next": i + 1, "work": work, "losses": losses, "curves": curves,
                    "rows": rows, "best": list(best), "snapshots": [list(snap) for snap in snapshots]})
        for _ in lock.padding():  # several processes: this rank's share is spent, the others' is not
            loss = batch_loss(net, task, last[0], last[1], dev, rng, negatives) * 0.0
            _step(model, opt, loss)
        curves["train_loss"].append(_epoch_loss(losses, dist))
        with mixed():
            curves["val_loss"].append(_val_loss(model, task, val, dev, negatives=val_negatives))
        log(f"{task.task} epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f}")
        criterion = _val_criterion(model, task, val, dev, curves["val_loss"][-1], negatives=val_negatives)
        if task.task == "recommendation":
            log(f"{task.task} epoch {epoch + 1}: validation criterion {criterion:.4f}")
        snapshots.append((criterion, _state(model), epoch))
        if criterion < best[0]:
            best = (criterion, _state(model), epoch)
    with mixed():
        soup = greedy_soup(model, task, val, dev, best, snapshots, val_negatives) if cfg.soup else [best[2]]
    kept.close()
    model.eval()
    rows = int(sum_over_ranks([rows], dist)[0]) if dist.enabled else rows
    info = {"best_epoch": best[2] + 1, "soup_epochs": [e + 1 for e in soup], "seconds": round(time.time() - started, 2), "rows_seen": rows,
            "train_cutoffs": [_iso(c) for c in train_cutoffs], "val_cutoff": _iso(val_cutoff),
            "val_rows": int(n_val), "val_target_mean": float(np.mean(y_mean)) if n_val else 0.0,
            "device": str(dev), **_processes_info(dist), **({"sampled_negatives": negatives} if negatives else {})}
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


def multilabel_loss(out: torch.Tensor, y: SparseRows, dev) -> torch.Tensor:
    """binary_cross_entropy_with_logits(out, y.dense()), the mean over rows x labels, from the sparse
    targets: per element BCE(z, y) = softplus(z) - y z, and y z is read at the entries only. The
    [rows, labels] targets are never built, and one pass over the logits replaces the dense
    loss's several (3x faster at 16,000 labels); the same value up to float rounding."""
    out = out.float()  # (as autocast runs binary_cross_entropy_with_logits: in float32)
    out = out[:, None] if out.dim() == 1 else out  # one label: the model squeezes its outputs
    picked = out[torch.from_numpy(y.rows).to(dev), torch.from_numpy(y.cols).to(dev)]
    return (nn.functional.softplus(out).sum() - (picked * torch.from_numpy(y.values[:, 0]).to(dev)).sum()) / out.numel()


COLUMN_MULTIPLE = 256


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
    # where every new one costs oneDNN a cached kernel: the 16k fine-tuning in bf16 peaked 0.55 GB higher)
    drawn = rng.choice(rest, min(negatives + (-(len(positive) + negatives)) % COLUMN_MULTIPLE, len(rest)),
                       replace=False)
    cols = np.sort(np.concatenate([positive, drawn]))
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    out, _ = model(xb, history, labels=(t(cols), empty, empty))
    out = out.float()  # (as autocast runs the BCE: in float32)
    weight = np.where(np.isin(cols, positive), 1.0, len(rest) / max(len(drawn), 1)).astype(np.float32)
    picked = out[t(y.rows), t(np.searchsorted(cols, y.cols))]
    per_column = nn.functional.softplus(out).sum(0)
    return ((per_column * t(weight)).sum() - (picked * t(y.values[:, 0])).sum()) / (len(y) * n_labels)


def history_rows(h: np.ndarray | SparseRows | None, b: np.ndarray, dev):
    """Rows `b` of a label history as the head takes it: (row, label, values) of sparse rows (what
    label_history gives), a tensor of a dense [n, labels, channels] array, or None."""
    if h is None:
        return None
    if isinstance(h, SparseRows):
        return batch_history(h[b], dev)
    return torch.from_numpy(h[b]).to(dev)


# what feature files leave free of the spill folder's disk: the larger of the two (the checkpoint
# written after training, and whatever else shares the volume, need it more than the spill does)
SPILL_RESERVE_BYTES = 1 << 30
SPILL_RESERVE_SHARE = 0.05


class _Kept:
    """Arrays computed once by `make(*key)` and read many times (fine-tuning's features at every
    epoch): the first `memory_bytes` of them stay in memory; the next `disk_bytes` are written to
    files in a temporary folder (under `folder`) and read back at each use, so the process holds one
    such chunk at a time and the page cache the rest; any beyond are computed again at each use."""

    def __init__(self, make, memory_bytes: int, disk_bytes: int, folder: str | None = None):
        self.make, self.memory_bytes, self.disk_bytes, self.folder = make, memory_bytes, disk_bytes, folder
        self.memory: dict = {}
        self.files: dict = {}
        self.in_memory = self.on_disk = 0
        self._dir: str | None = None

    def get(self, key: tuple):
        if key in self.memory:
            return self.memory[key]
        if key in self.files:
            return _load_arrays(self.files[key])
        arrays = self.make(*key)
        size = sum(a.nbytes for a in arrays if a is not None)
        if self.in_memory + size <= self.memory_bytes:
            self.memory[key] = arrays
            self.in_memory += size
        elif self.on_disk + size <= self.disk_bytes:
            if self._room_for(size) and self._spill(key, arrays):
                self.on_disk += size
            else:  # a disk near its reserve, or full: spilling stops, the rest is computed again at each use
                self.disk_bytes = self.on_disk
        return arrays

    def _room_for(self, size: int) -> bool:
        """Whether writing `size` more bytes leaves the reserve free."""
        usage = shutil.disk_usage(self._dir or self.folder or tempfile.gettempdir())
        return usage.free - size >= max(SPILL_RESERVE_BYTES, SPILL_RESERVE_SHARE * usage.total)

    def _spill(self, key: tuple, arrays: tuple) -> bool:
        """Write `arrays` to a file of their own; False (the half-written file removed) on a full disk."""
        if self._dir is None:
            # in a given folder, named as models.storage names a writer's temporary copy: the next
            # run of the stage removes what a killed one left (storage.recover_tree)
            self._dir = (tempfile.mkdtemp(prefix="habitus-features-") if self.folder is None else
                         tempfile.mkdtemp(prefix=".features-", suffix=f".tmp-{os.getpid()}", dir=self.folder))
            weakref.finalize(self, shutil.rmtree, self._dir, True)
        path = os.path.join(self._dir, f"{len(self.files)}.npz")
        try:
            _save_arrays(path, arrays)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(path)
            return False
        self.files[key] = path
        return True

    def close(self) -> None:
        """Forget the arrays and remove the files."""
        self.memory, self.files = {}, {}
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _save_arrays(path: str, arrays: tuple) -> None:
    """A tuple of arrays, SparseRows and Nones as one uncompressed .npz (no pickle)."""
    out = {}
    for i, a in enumerate(arrays):
        if isinstance(a, SparseRows):
            out.update({f"{i}.indptr": a.indptr, f"{i}.cols": a.cols, f"{i}.values": a.values,
                        f"{i}.n_cols": np.asarray(a.n_cols)})
        elif a is not None:
            out[f"{i}"] = a
    np.savez(path, n=np.asarray(len(arrays)), **out)


def _load_arrays(path: str) -> tuple:
    with np.load(path, allow_pickle=False) as z:
        return tuple(SparseRows(z[f"{i}.indptr"], z[f"{i}.cols"], z[f"{i}.values"], int(z[f"{i}.n_cols"]))
                     if f"{i}.indptr" in z else z[f"{i}"] if f"{i}" in z else None for i in range(int(z["n"])))


class _Recomputed:
    """An iterable that computes its items again at every pass (for data too large to keep)."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return iter(self.make())


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


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


@torch.no_grad()
def scores(model: Model, task: str, x: np.ndarray, h: np.ndarray | SparseRows | None, *, device: str = "cpu",
           batch: int = 8192) -> np.ndarray:
    """Model outputs in the task's own units: probabilities or amounts (rank_items for items)."""
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    out = []
    for i in range(0, len(x), batch):
        o = model(torch.from_numpy(x[i:i + batch]).to(dev), history_rows(h, np.arange(i, min(i + batch, len(x))), dev))
        if task in ("binary", "multilabel"):
            o = torch.sigmoid(o)
        elif task == "regression":
            o = torch.expm1(o).clamp_min(0)
        out.append(o.float().cpu().numpy())
    if not out:
        return np.zeros((0,) if task in ("binary", "regression") else (0, model.head.linear.out_features), np.float32)
    return np.concatenate(out)


@torch.no_grad()
def rank_items(model: Model, x: np.ndarray, hist: SparseRows, popularity: np.ndarray, k: int, *,
               device: str = "cpu", batch: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """The k best items of every row over the whole catalog, best first: (label positions, scores).
    `popularity`: item_popularity at the rows' cut-off."""
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    model.eval()
    head = model.head
    trunk = [model.trunk(torch.from_numpy(x[i:i + batch]).to(dev)) for i in range(0, len(x), batch)]
    h = torch.cat(trunk) if trunk else torch.zeros((0, model.trunk.cfg.hidden), device=dev)
    extra = None
    if hist is not None:
        rows = torch.from_numpy(hist.rows).to(dev)
        values = head.history_scores(h, rows, torch.from_numpy(hist.values).to(dev)).float().cpu().numpy()
        extra = SparseRows(hist.indptr, hist.cols, values[:, None], hist.n_cols)
    pop = torch.from_numpy(popularity).to(dev)
    return top_k_items(len(x), head.n_items, k, lambda r0, r1, i0, i1: head.dense(h[r0:r1], pop, i0, i1), extra)


def top_values(cache: Cache, column: str, before: int, n: int) -> tuple[int, ...]:
    """The n most frequent value ids of `column` among events at or before `before` (no peeking)."""
    vocab = cache.columns[column]["vocab_size"]
    counts = np.zeros(vocab + 1, np.int64)
    for i in range(cache.shard_count):
        sh = cache.shard(i)
        counts += np.bincount(sh.columns[column][sh.ts <= before], minlength=vocab + 1)
    counts[0] = 0
    order = np.argsort(-counts, kind="mergesort")
    return tuple(int(i) for i in order[:n] if counts[i] > 0)


def _iso(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(ts)))


def _days(rng) -> float:
    return round((rng[1] - rng[0]) / DAY, 1)


def config_dict(cfg) -> dict:
    return asdict(cfg)
