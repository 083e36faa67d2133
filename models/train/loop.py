"""What the two training loops (habitus.models.train.foundation, habitus.models.train.finetune) share: the cut-off
grid, the work plan of entity chunks, mini-batches, one optimizer step, and the processes and device."""

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from habitus.models.train.distributed import Dist, detect, sum_over_ranks
from habitus.models.data.chunks import chunk_plan, day_floor  # noqa: F401 (the training loops read them here too)
from habitus.models.data.features import DAY
from habitus.models.nn.network import Model

Log = Callable[[str], None]


@dataclass
class TrainResult:
    model: Model
    curves: dict[str, list[float]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)


def cutoff_grid(first_ts: int, last_cutoff: int, every_days: int, min_history_days: int) -> list[int]:
    """Cut-offs every `every_days` back from `last_cutoff`, leaving `min_history_days` of history."""
    earliest = day_floor(first_ts) + min_history_days * DAY
    grid = list(range(day_floor(last_cutoff), earliest - 1, -every_days * DAY))
    return sorted(grid)


def by_shard(work: list, rng: np.random.Generator) -> list:
    """`work` (shard, ...) items shuffled, then grouped by shard (the shards in the order they first
    appear, each keeping its items' shuffled order): training reads one shard at a time, where holding
    every shard in memory was most of the peak at 10M events (docs/journal/speed.md). One shard: just the
    shuffle."""
    rng.shuffle(work)
    first: dict = {}
    for w in work:
        first.setdefault(w[0], len(first))
    return sorted(work, key=lambda w: first[w[0]])  # (stable)


def batches(n: int, size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
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


def fused(dev: torch.device) -> bool | None:
    """AdamW's fused kernel where torch has one (one pass over each tensor): torch's default on CPUs,
    one step per operation, was several times slower a step on the 16,000-label head (docs/results/speed.md,
    "Fused AdamW")."""
    return True if dev.type in ("cpu", "cuda") else None


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, kept: tuple = ()) -> None:
    """One optimizer step on `loss`, gradients clipped to norm 1. `kept`: parameters whose dense
    gradient stays allocated and is zeroed in place, so the sparse gradient of the rows a step
    touched (network.Head._rows) is added into it; every other gradient is freed and made anew."""
    grads = [p.grad for p in kept]
    opt.zero_grad(set_to_none=True)
    for p, g in zip(kept, grads):
        p.grad = torch.zeros_like(p) if g is None else g.zero_()
    loss.backward()
    clip(model, 1.0)
    opt.step()


def clip(model: nn.Module, max_norm: float) -> None:
    """nn.utils.clip_grad_norm_, without its multiply when the factor is exactly 1 (a norm within
    the bound): the same gradients bit for bit, one pass over them fewer. Fine-tuning's losses are means
    over rows x labels, so their gradients' norms stay far below 1 (at most about 1e-3 in the
    16,000-label fine-tuning at 10m)."""
    norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if torch.clamp(max_norm / (norm + 1e-6), max=1.0) != 1.0:  # (as clip_grad_norm_ computes it; NaN too)
        nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)


def processes(dist: Dist | None, device: str, log: Log, resume) -> tuple[Dist, torch.device, Log]:
    """This process's place among torchrun's (or alone), its device, and its log (rank 0's only)."""
    dist = detect(device) if dist is None else dist
    if not dist.enabled:
        return dist, resolve_device(device), log
    if resume is not None:
        raise ValueError(f"resumable training runs in one process; {dist.world} processes start afresh (pass no "
                         f"resume, or train with executor processes: 1 to continue a killed run)")
    return dist, torch.device(dist.device), log if dist.is_writer else (lambda _: None)


def seeded(seed: int, dist: Dist) -> tuple[np.random.Generator, np.random.Generator]:
    """(the epochs' data order, this process's batch draws), torch seeded too: one process draws both
    from one generator; several draw the order alike and their batches each its own."""
    torch.manual_seed(seed)
    if dist.enabled:
        return np.random.default_rng(seed), np.random.default_rng([seed, dist.rank])
    rng = np.random.default_rng(seed)
    return rng, rng


def processes_info(dist: Dist) -> dict:
    return {"processes": dist.world} if dist.enabled else {}


def epoch_loss(losses: list[float], dist: Dist) -> float:
    """The epoch's mean training loss (over every rank's batches when several train)."""
    if not dist.enabled:
        return float(np.mean(losses)) if losses else float("nan")
    total, count = sum_over_ranks([float(np.sum(losses)), float(len(losses))], dist)
    return total / count if count else float("nan")


def state_copy(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def iso(ts: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(ts)))


def days(rng) -> float:
    return round((rng[1] - rng[0]) / DAY, 1)

