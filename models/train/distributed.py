"""Training in several processes under `torchrun` (DistributedDataParallel), or in one.

torchrun starts one process per device and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; `from_env` joins the process group from them (nccl on GPUs, gloo on CPUs). Each
rank trains on its own share of the cache's entity chunks (`shard`), DDP averages the gradients
at every step (`wrap`), ranks whose share has fewer batches keep stepping with the others'
average (`Lockstep`; or shadow their all-reduces without stepping: `uneven`, DDP's join), and
only rank 0 writes checkpoints and reports (`Dist.is_writer`).

Without torchrun's variables everything here is a no-op: one process, no process group, the
model unwrapped. A training loop written once runs both ways (models/train/foundation.py and
models/train/finetune.py do; models/train/launch.py is what torchrun starts for the assets):

    dist = detect(device)                         # from_env under torchrun, else one process
    plan = shard(chunk_plan(cache, cfg.chunk_entities), dist)
    net, lock = wrap(model, dist), Lockstep(dist)  # forward/backward through `net`
    for epoch in ...:
        for batch in this rank's batches:
            lock.real(); ... step on loss(net(batch)) ...
        for _ in lock.padding():
            ... step on loss(net(any batch)) * 0 ...
    if dist.is_writer:
        save_checkpoint(path, unwrap(net), config)
"""

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_writer(self) -> bool:
        """Rank 0 writes checkpoints, metadata and logs; the others only train."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer (torchrun sets it; "
                         f"unset it to train in one process)") from None


def from_env(device: str = "auto", timeout_s: float = 1800.0) -> Dist:
    """The process's place among torchrun's processes; joins the process group when there are
    several (once per process). `device` auto/cuda picks this rank's GPU (cuda:LOCAL_RANK)."""
    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was asked for but torch sees no CUDA device; use device cpu")
    if cuda:
        dev = f"cuda:{local}" if device in ("auto", "cuda") else device
        torch.cuda.set_device(torch.device(dev))
    else:
        dev = "cpu"
    if world > 1 and not torch.distributed.is_initialized():
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise RuntimeError(f"WORLD_SIZE={world} but {name} is not set: start several processes with "
                                   f"`torchrun --nproc_per_node N` (it sets them)")
        torch.distributed.init_process_group("nccl" if cuda else "gloo", store=_store(rank, world, timeout_s),
                                             rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(rank, world, local, dev)


def _store(rank: int, world: int, timeout_s: float):
    """The rendezvous store of torchrun's MASTER_ADDR:MASTER_PORT (its agent's when it hosts one), its
    keys under the attempt's own prefix: after torchrun restarts the processes (--max-restarts), the
    keys of the attempt that died are still there, and a rank that read its dead peer's address hung
    connecting to it (seen: gloo's full-mesh connect, both ranks waiting, on a restarted 2-process run)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                       is_master=not agent and rank == 0,
                                       timeout=datetime.timedelta(seconds=timeout_s), multi_tenant=not agent)
    return torch.distributed.PrefixStore(f"habitus/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def shard(plan: list, dist: Dist) -> list:
    """This rank's share of a chunk plan ((shard, lo, hi) entity chunks), in plan order. The shares
    together cover the plan once and hold about as many entities each: chunks go, largest first,
    to the rank with the fewest entities so far (the lowest rank on a tie), so a cache whose shards
    end in small remainder chunks does not hand every full chunk to one rank. Chunks of one size
    are dealt every world-th, as cards."""
    if not dist.enabled:
        return list(plan)
    load, owner = [0] * dist.world, {}
    for i in sorted(range(len(plan)), key=lambda i: -(plan[i][2] - plan[i][1])):  # stable: plan order on ties
        rank = min(range(dist.world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += plan[i][2] - plan[i][1]
    return [c for i, c in enumerate(plan) if owner[i] == dist.rank]


def detect(device: str = "auto") -> Dist:
    """`from_env` when torchrun's variables say several processes (WORLD_SIZE > 1); one process
    otherwise, without touching the device or any process group (what a plain call gets)."""
    if _env_int("WORLD_SIZE", 1) > 1:
        return from_env(device)
    return Dist(device=device)


def wrap(model: nn.Module, dist: Dist, find_unused: bool = False) -> nn.Module:
    """DistributedDataParallel around `model` when several processes train; `model` itself otherwise.
    Buffers (the input scaling) are broadcast from rank 0 once, at wrapping, and not at every
    forward: fit them before wrapping. `find_unused`: some parameters may take no part in a step
    (a recommendation head's history terms when a batch has no history)."""
    if not dist.enabled:
        return model
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    ids = [torch.device(dist.device).index] if dist.device.startswith("cuda") else None
    # torch >= 2.13 spells "sync buffers at wrapping only" forward_sync_buffers=False; older, broadcast_buffers
    newer = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused,
                                   **({"forward_sync_buffers": False} if newer else {"broadcast_buffers": False}))


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def uneven(model: nn.Module):
    """The context for a loop whose ranks run different numbers of batches (DDP's join): a rank
    that runs out shadows the others' gradient all-reduces instead of waiting for ever."""
    return model.join() if hasattr(model, "join") and hasattr(model, "module") else contextlib.nullcontext()


def mean_over_ranks(value: float, dist: Dist) -> float:
    """A scalar (a loss) averaged over the ranks, for what rank 0 reports."""
    if not dist.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=dist.device)
    torch.distributed.all_reduce(t)
    return float(t.item()) / dist.world


class Lockstep:
    """Every rank runs the same number of optimizer steps in an epoch, whatever its share holds.

    Call `real()` before each step of a batch of this rank's own, and after the rank's last batch
    run a step for each round of `padding()`: a step whose loss is multiplied by 0 (on any batch),
    so the rank joins the others' gradient all-reduce and steps its optimizer with their average,
    until no rank has a batch left. One flag is all-reduced per step (as DDP's join does). Unlike
    join, where a rank that ran out stops stepping, every rank applies every averaged gradient: the
    weights, the optimizer moments and the schedule stay identical on all ranks, so validation and
    the choice of epochs can be computed on any of them. One process: both are no-ops."""

    def __init__(self, dist: Dist):
        self.dist = dist

    def _others(self, mine: int) -> int:
        t = torch.tensor([mine], dtype=torch.int64, device=self.dist.device)
        torch.distributed.all_reduce(t)
        return int(t.item())

    def real(self) -> None:
        if self.dist.enabled:
            self._others(1)

    def padding(self):
        while self.dist.enabled and self._others(0) > 0:
            yield


def from_rank0(make, dist: Dist):
    """make() run on rank 0 and its (picklable) result on every rank: a fit whose float sums may
    differ between processes (k-means, a randomized SVD) must give every rank the same features."""
    if not dist.enabled:
        return make()
    box = [make() if dist.rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0, device=dist.device)
    return box[0]


def sum_over_ranks(values: list[float], dist: Dist) -> list[float]:
    """Numbers (counters, sums of losses) added up over the ranks; as they are with one process."""
    if not dist.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=dist.device)
    torch.distributed.all_reduce(t)
    return [float(v) for v in t.tolist()]


def weights_gap(model: nn.Module, dist: Dist) -> float:
    """The largest difference between this rank's weights and rank 0's (0.0 with one process):
    ranks that trained in lockstep hold the same weights; anything else is a bug worth seeing."""
    if not dist.enabled:
        return 0.0
    gap = torch.zeros(1, dtype=torch.float64, device=dist.device)
    for value in unwrap(model).state_dict().values():
        theirs = value.detach().clone()
        torch.distributed.broadcast(theirs, 0)
        if value.numel() and value.is_floating_point():
            gap = torch.maximum(gap, (value.detach().double() - theirs.double()).abs().max().reshape(1))
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    return float(gap.item())


def autocast(precision: str, device: str):
    """bf16 mixed precision (torch.autocast, fp32 master weights) on GPUs, and on CPUs, where it is
    fast with AVX-512 BF16 or AMX only and serves otherwise to run the GPU's precision path on a CPU
    (the tests); fp32 is the plain context. It wraps a whole training loop, so autocast's cache of
    casted weights is off: that cache lives until the context exits, and the forward passes would keep
    reading the bf16 copy of the weights before the first optimizer step (measured: no learning at all)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        kind = "cuda" if str(device).startswith("cuda") else "cpu"
        return torch.autocast(kind, dtype=torch.bfloat16, cache_enabled=False)
    raise ValueError(f"unknown training precision {precision!r}; choose fp32 or bf16")


def close(dist: Dist) -> None:
    """Leave the process group together: a rank that tears gloo down while another still writes
    (rank 0 its checkpoint) can abort that one ("terminate called without an active exception",
    seen in CI); the barrier lets every rank arrive first. (habitus.models.train.launch then also skips the
    interpreter's teardown, where the same abort came back once.)"""
    if dist.enabled and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def check(device: str = "auto") -> str:
    """Join the process group, all-reduce one number and say so: the smoke test of a launch
    (`torchrun --nproc_per_node N -m habitus.models.train.distributed`)."""
    dist = from_env(device)
    t = torch.tensor([float(dist.rank + 1)], device=dist.device)
    if dist.enabled:
        torch.distributed.all_reduce(t)
    expected = dist.world * (dist.world + 1) / 2
    if float(t.item()) != expected:
        raise RuntimeError(f"rank {dist.rank}: all-reduce gave {float(t.item())}, expected {expected}")
    close(dist)
    return f"rank {dist.rank}/{dist.world} on {dist.device}: all-reduce ok"


if __name__ == "__main__":
    import sys

    # one write() per line: the ranks share torchrun's stdout, and two writes could interleave
    sys.stdout.buffer.write((check(sys.argv[1] if len(sys.argv) > 1 else "auto") + "\n").encode())
    sys.stdout.flush()
