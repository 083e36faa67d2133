"""Training: the self-supervised foundation model and the scenario models fine-tuned from it.

One straight loop each. Work is cut into chunks of entities of one shard at one cut-off; a chunk's
features are computed (vectorized) and fed in shuffled mini-batches. Cut-offs fall on midnights
(UTC); features read events at or before the cut-off, targets the window after it.
"""

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from models.cache import Cache
from models.features import DAY, Chunk, FeatureSpec, chunk_at, featurize, value_history
from models.network import Model, NetConfig
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


@dataclass
class TaskSpec:
    task: str  # binary | multilabel | regression | recommendation
    target: TargetSpec
    k: int = 10

    @property
    def outputs(self) -> int:
        return len(self.target.labels) if self.task in ("multilabel", "recommendation") else 1

    @property
    def uses_label_history(self) -> bool:
        return self.task in ("multilabel", "recommendation")

    def to_dict(self) -> dict:
        return {"task": self.task, "target": self.target.to_dict(), "k": self.k}

    @classmethod
    def from_dict(cls, d: dict) -> "TaskSpec":
        return cls(d["task"], TargetSpec.from_dict(d["target"]), d["k"])


@dataclass
class FinetuneConfig:
    epochs: int = 6
    learning_rate: float = 1e-3
    batch_size: int = 512
    chunk_entities: int = 4096
    weight_decay: float = 1e-4
    seed: int = 0
    memory_budget_bytes: int = 2 << 30  # features kept in memory across epochs up to this size


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


def label_history(chunk: Chunk, target: TargetSpec, vocab_size: int, half_lives) -> np.ndarray:
    """[n, labels, channels] history of each label for each entity (counts log-scaled)."""
    pos = label_positions(target.labels, chunk.shard.columns[target.column][chunk.rows])
    keep = pos >= 0
    hist = value_history(chunk, np.where(keep, pos, 0), len(target.labels), half_lives, keep)
    hist[:, :, :-1] = np.log1p(hist[:, :, :-1])
    return hist


def _batches(n: int, size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    order = rng.permutation(n)
    for i in range(0, n, size):
        yield order[i:i + size]


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
                     log: Log = print) -> TrainResult:
    """Self-supervised training: from the history before many sampled cut-offs, predict the next
    `horizon_days` (whether the entity acts, how much, and which values of every categorical column).
    `last_cutoff + horizon` is the latest time any target may read."""
    started = time.time()
    dev = resolve_device(device)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    spec = FeatureSpec.from_cache(cache, cfg.buckets)
    cutoffs = cutoff_grid(cache.time_range[0], last_cutoff, cfg.cutoff_every_days, cfg.min_history_days)
    if not cutoffs:
        raise ValueError(f"no foundation cut-off fits: the data spans {_days(cache.time_range)} days, which leaves no "
                         f"{cfg.min_history_days} days of history before {_iso(last_cutoff)}; more history is needed")
    entity_table = cache.entity_table()
    plan = chunk_plan(cache, cfg.chunk_entities)
    shards = [cache.shard(i) for i in range(cache.shard_count)]

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(shards[s], lo, hi, cutoff)
        x = featurize(chunk, spec, entity_table)
        y = foundation_target(chunk, cfg.horizon_days, spec.categorical, spec.buckets)
        return chunk, x, y

    # hold out a tenth of the entities (by id) to watch generalization, at the latest cut-off
    probe = [data(s, lo, hi, cutoffs[-1]) for s, lo, hi in plan[: max(1, math.ceil(len(plan) / 4))]]
    val_rows = [np.flatnonzero(c.entities % 10 == 0) for c, _, _ in probe]
    targets_width = probe[0][2].shape[1]
    model = Model(NetConfig(spec.width, cfg.hidden, cfg.layers, cfg.dropout), targets_width).to(dev)
    model.trunk.fit_input_scale(torch.from_numpy(np.concatenate([x for _, x, _ in probe])).to(dev), cfg.std_floor)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=1e-4)
    steps_total = cfg.epochs * len(plan) * min(cfg.cutoffs_per_chunk, len(cutoffs)) * math.ceil(
        cfg.chunk_entities / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.learning_rate, total_steps=max(steps_total, 1), pct_start=0.1)
    n_cols = len(spec.categorical)
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    events_seen = entities_seen = steps = 0
    for epoch in range(cfg.epochs):
        model.train()
        work = [(s, lo, hi, c) for s, lo, hi in plan
                for c in rng.choice(cutoffs, min(cfg.cutoffs_per_chunk, len(cutoffs)), replace=False)]
        rng.shuffle(work)
        losses = []
        for s, lo, hi, cutoff in work:
            chunk, x, y = data(s, lo, hi, int(cutoff))
            train = np.flatnonzero(chunk.entities % 10 != 0)
            events_seen += len(chunk.rows)
            entities_seen += len(train)
            xt, yt = torch.from_numpy(x[train]).to(dev), torch.from_numpy(y[train]).to(dev)
            for b in _batches(len(train), cfg.batch_size, rng):
                loss = foundation_loss(model(xt[b]), yt[b], n_cols)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if steps < steps_total:
                    sched.step()
                steps += 1
                losses.append(loss.item())
        curves["train_loss"].append(float(np.mean(losses)) if losses else float("nan"))
        curves["val_loss"].append(_foundation_val(model, probe, val_rows, n_cols, dev))
        log(f"foundation epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f} ({time.time() - started:.0f}s)")
    model.eval()
    seconds = time.time() - started
    info = {"cutoffs": [_iso(c) for c in cutoffs], "last_target_time": _iso(last_cutoff + cfg.horizon_days * DAY),
            "events_seen": events_seen, "entities_seen": entities_seen, "seconds": round(seconds, 2),
            "steps": steps, "feature_spec": spec.to_dict(), "net": model.trunk.cfg.to_dict(),
            "targets_width": targets_width, "device": str(dev)}
    return TrainResult(model, curves, info)


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
        return nn.functional.huber_loss(out, torch.log1p(y.clamp_min(0)))
    if task == "recommendation":  # softmax over the full catalog against the bought items
        has = y.sum(1) > 0
        if not has.any():
            return out.sum() * 0.0
        target = y[has] / y[has].sum(1, keepdim=True)
        return -(target * torch.log_softmax(out[has], 1)).sum(1).mean()
    raise ValueError(task)


def task_inputs(chunk: Chunk, spec: FeatureSpec, task: TaskSpec, entity_table, vocab_sizes: dict[str, int]):
    x = featurize(chunk, spec, entity_table)
    h = label_history(chunk, task.target, vocab_sizes[task.target.column], spec.half_lives) \
        if task.uses_label_history else None
    return x, h


def _to(dev, *arrays):
    return [None if a is None else torch.from_numpy(a).to(dev) for a in arrays]


def finetune(cache: Cache, foundation_state: dict[str, torch.Tensor], foundation_info: dict, task: TaskSpec,
             train_cutoffs: list[int], val_cutoff: int, cfg: FinetuneConfig, *, device: str = "auto",
             log: Log = print, from_scratch: bool = False) -> TrainResult:
    """A scenario model: the foundation trunk (its weights as the start) + a fresh head, trained on
    labels at `train_cutoffs`; the epoch with the best loss at `val_cutoff` is kept.
    `from_scratch` keeps only the foundation's input scaling and starts the trunk at random: the
    comparison that shows what pretraining is worth."""
    started = time.time()
    dev = resolve_device(device)
    rng = np.random.default_rng(cfg.seed)
    torch.manual_seed(cfg.seed)
    spec = FeatureSpec.from_dict(foundation_info["feature_spec"])
    net = NetConfig(**foundation_info["net"])
    model = Model(net, task.outputs, spec.channels if task.uses_label_history else 0).to(dev)
    trunk_state = {k.removeprefix("trunk."): v for k, v in foundation_state.items() if k.startswith("trunk.")}
    if from_scratch:
        trunk_state = {k: v for k, v in trunk_state.items() if k.startswith("in_")}
    model.trunk.load_state_dict(trunk_state, strict=not from_scratch)
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    plan = chunk_plan(cache, cfg.chunk_entities)
    shards = [cache.shard(i) for i in range(cache.shard_count)]

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(shards[s], lo, hi, cutoff)
        keep = eligible(chunk, task.target)
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        y = compute_target(chunk, task.target, vocab_sizes.get(task.target.column))
        return x[keep], (None if h is None else h[keep]), y[keep]

    # features of every (chunk, cut-off) are the same each epoch: keep them while they fit the budget
    # (wide label sets such as a whole catalog are recomputed instead of filling the memory)
    first = data(*plan[0], val_cutoff)
    per_row = sum(a.nbytes for a in first if a is not None) / max(len(first[2]), 1)
    total_rows = sum(hi - lo for _, lo, hi in plan)
    if per_row * total_rows <= cfg.memory_budget_bytes:
        val = [first] + [data(s, lo, hi, val_cutoff) for s, lo, hi in plan[1:]]
    else:
        val = _Recomputed(lambda: (data(s, lo, hi, val_cutoff) for s, lo, hi in plan))
    kept: dict | None = {} if per_row * total_rows * (len(train_cutoffs) + 1) <= cfg.memory_budget_bytes else None
    n_val, y_sum, y_log = 0, 0.0, 0.0
    for _, _, y in val:
        n_val += len(y)
        y_sum = y_sum + y.astype(np.float64).sum(0)
        y_log += float(np.log1p(np.clip(y, 0, None)).sum()) if task.task == "regression" else 0.0
    y_mean = np.asarray(y_sum, np.float64) / max(n_val, 1)
    # the head starts near the base rate, so the first steps do not wreck the pretrained trunk
    with torch.no_grad():
        if task.task in ("binary", "multilabel"):
            p = np.clip(y_mean, 1e-4, 1 - 1e-4)
            model.head.linear.bias.copy_(torch.as_tensor(np.log(p / (1 - p)), dtype=torch.float32).reshape(-1))
        elif task.task == "regression":
            model.head.linear.bias.fill_(y_log / max(n_val, 1))
        else:  # recommendation: popularity breaks ties among what the entity already buys
            model.head.linear.bias.copy_(torch.as_tensor(0.2 * np.log(y_mean + 1e-6), dtype=torch.float32))
        if task.uses_label_history:
            # start at the strong baseline ("what they bought, habitually", measured best on the demo
            # data), so training only has to learn what the trunk adds on top
            model.head.linear.weight.zero_()
            model.head.skip.weight.zero_()
            model.head.skip.weight[0, len(spec.half_lives) - 1] = 5.0
    params = [{"params": model.trunk.parameters(), "lr": cfg.learning_rate * 0.3},
              {"params": model.head.parameters(), "lr": cfg.learning_rate}]
    opt = torch.optim.AdamW(params, weight_decay=cfg.weight_decay)
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    # the starting point (epoch 0) competes too: fine-tuning is kept only where it helps on validation
    best = (_val_criterion(model, task, val, dev), _state(model), -1)
    rows = 0
    for epoch in range(cfg.epochs):
        model.train()
        work = [(s, lo, hi, c) for s, lo, hi in plan for c in train_cutoffs]
        rng.shuffle(work)
        losses = []
        for s, lo, hi, cutoff in work:
            key = (s, lo, int(cutoff))
            arrays = kept.get(key) if kept is not None else None
            if arrays is None:
                arrays = data(s, lo, hi, int(cutoff))
                if kept is not None:
                    kept[key] = arrays
            x, h, y = _to(dev, *arrays)
            rows += len(x)
            for b in _batches(len(x), cfg.batch_size, rng):
                loss = task_loss(task.task, model(x[b], None if h is None else h[b]), y[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                losses.append(loss.item())
        curves["train_loss"].append(float(np.mean(losses)) if losses else float("nan"))
        curves["val_loss"].append(_val_loss(model, task.task, val, dev))
        log(f"{task.task} epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f}")
        criterion = _val_criterion(model, task, val, dev, curves["val_loss"][-1])
        if criterion < best[0]:
            best = (criterion, _state(model), epoch)
    model.load_state_dict(best[1])
    model.eval()
    info = {"best_epoch": best[2] + 1, "seconds": round(time.time() - started, 2), "rows_seen": rows,
            "train_cutoffs": [_iso(c) for c in train_cutoffs], "val_cutoff": _iso(val_cutoff),
            "val_rows": int(n_val), "val_target_mean": float(np.mean(y_mean)) if n_val else 0.0,
            "device": str(dev)}
    return TrainResult(model, curves, info)


class _Recomputed:
    """An iterable that computes its items again at every pass (for data too large to keep)."""

    def __init__(self, make):
        self.make = make

    def __iter__(self):
        return iter(self.make())


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@torch.no_grad()
def _val_criterion(model, task: TaskSpec, val, dev, loss: float | None = None) -> float:
    """What picks the epoch (lower is better): the ranking metric for recommendation (its softmax
    loss can fall while the top of the ranking gets worse), the validation loss otherwise."""
    if task.task != "recommendation":
        return _val_loss(model, task.task, val, dev) if loss is None else loss
    from models.metrics import ranking_metrics

    total, n = 0.0, 0
    for x, h, y in val:
        rows = int((y.sum(1) > 0).sum()) if len(y) else 0
        if rows == 0:
            continue
        out = scores(model, task.task, x, h, device=str(dev))
        total += ranking_metrics(y, out, task.k)[f"ndcg@{task.k}"] * rows
        n += rows
    return -total / n if n else 0.0


@torch.no_grad()
def _val_loss(model, task, val, dev) -> float:
    model.eval()
    total, n = 0.0, 0
    for x, h, y in val:
        if len(x) == 0:
            continue
        x, h, y = _to(dev, x, h, y)
        total += float(task_loss(task, model(x, h), y)) * len(x)
        n += len(x)
    return total / n if n else float("nan")


@torch.no_grad()
def scores(model: Model, task: str, x: np.ndarray, h: np.ndarray | None, *, device: str = "cpu",
           batch: int = 8192) -> np.ndarray:
    """Model outputs in the task's own units: probabilities, amounts, or item scores."""
    dev = next(model.parameters()).device if device == "auto" else torch.device(device)
    out = []
    for i in range(0, len(x), batch):
        xb, hb = _to(dev, x[i:i + batch], None if h is None else h[i:i + batch])
        o = model(xb, hb)
        if task in ("binary", "multilabel"):
            o = torch.sigmoid(o)
        elif task == "regression":
            o = torch.expm1(o).clamp_min(0)
        out.append(o.float().cpu().numpy())
    if not out:
        return np.zeros((0,) if task in ("binary", "regression") else (0, model.head.linear.out_features), np.float32)
    return np.concatenate(out)


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
