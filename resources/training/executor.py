"""Where training runs: the device, the precision, the CPU threads and the number of processes.

Every training (the foundation, a scenario's measured run, its refit) goes through `train`, which runs
models/train/recipe.run_training on a job: inside the asset's process with one process (the default),
or under `torchrun`, one process per GPU (or CPU share), with DistributedDataParallel
(models/train/distributed.py): `launch` starts them and streams their output to the asset's log; rank 0
writes the result. Both ways the same precision (bf16: torch.autocast) and the same resumable saves
(`resume`: the folder and the steps between saves); torchrun restarts its processes `max_restarts`
times after a failure (default: 0 on one machine, 3 across nodes), each restart resuming.

    resources: {executor: {config: {device: cuda, precision: bf16, processes: 8}}}

Several machines (`nnodes` > 1): each node runs torchrun with a c10d rendezvous at `rdzv_endpoint`
(host:port of a c10d store, by convention node 0's), `processes` processes per node; ranks are given by
the rendezvous. Every node's torchrun reads the same job folder (a shared filesystem: the workspace).
"""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import dagster as dg
from pydantic import Field

ROOT = Path(__file__).resolve().parents[2]
TRAIN_PRECISIONS = ("fp32", "bf16")
INFERENCE_PRECISIONS = ("fp32", "int8", "bf16")


class ExecutorError(ValueError):
    pass


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's CPU set), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# fewer than this many entity chunks per scoring process and the children's start (importing torch:
# 2-4 CPU-seconds each) costs more than they score (a chunk of 8,192 entities takes seconds on a core)
CHUNKS_PER_PROCESS = 2
# CPU cores per scoring process by default. Half a chunk's CPU time is featurization (NumPy, one
# thread: 0.45 of 0.95 CPU-s per 8,192 entities), so one process leaves extra cores idle half the time;
# but on this 2-core machine, shared (our runs got 0.2-0.5 of its 2 cores), 2 processes over 1 with 2
# threads measured 0.50-1.36x spawned and 1.01-2.17x forked (median 1.15; bench/inference_procs.py,
# load 7-24): no gain that stands out of the noise, for a second process's memory. So one per 2 cores
# (1 here, 8 on 16); `inference_processes` asks for more.
CORES_PER_PROCESS = 2


class TrainingExecutor(dg.ConfigurableResource):
    """`device`: auto (a GPU when one is visible), cpu, cuda or cuda:N. `precision`: fp32, or bf16
    mixed precision (torch.autocast) on GPUs. `inference_precision`: fp32, int8 (dynamic
    quantization, CPU) or bf16, for predictions and embeddings. `processes`: 1 trains in the
    asset's process; N > 1 runs N processes under torchrun (one per GPU); 0 takes one per GPU
    visible (one without a GPU), as a Kubernetes pod with a GPU request does.
    `inference_processes`: how many processes score predictions and embeddings (models/serve/parts.py),
    each writing its part of the day: unset takes one per GPU on GPUs and one per 2 cores on CPUs, as
    long as each gets two chunks of the cache (a small cache: one process), each with `threads` torch
    threads (default: the cores this process may use, shared among them)."""

    device: str = "auto"
    threads: int | None = None
    precision: str = "fp32"
    inference_precision: str = "fp32"
    processes: int = Field(1, ge=0)
    inference_processes: int | None = Field(None, ge=1)
    nnodes: int = Field(1, ge=1)
    rdzv_endpoint: str | None = None
    rdzv_id: str = "habitus"
    node_rank: int | None = Field(None, ge=0)  # several nodes: this one's place (None: the rendezvous gives it)
    max_restarts: int | None = Field(None, ge=0)
    # several nodes each preparing its own inputs (`habitus train` on every node): this node's folder for the
    # jobs; every node then keeps the result and the resumable state (its local rank 0 writes them)
    job_dir: str | None = None

    def _check(self) -> None:
        if self.precision not in TRAIN_PRECISIONS:
            raise ExecutorError(f"executor precision {self.precision!r}: choose one of {TRAIN_PRECISIONS}")
        if self.inference_precision not in INFERENCE_PRECISIONS:
            raise ExecutorError(f"executor inference_precision {self.inference_precision!r}: choose one of "
                                f"{INFERENCE_PRECISIONS}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ExecutorError(f"executor device {self.device!r}: choose auto, cpu, cuda or cuda:N")
        if self.nnodes > 1 and not (self.rdzv_endpoint and re.fullmatch(r"[\w.-]+:\d+", self.rdzv_endpoint)):
            raise ExecutorError(f"executor nnodes {self.nnodes} needs rdzv_endpoint as host:port (node 0's address and a "
                                f"free port, the same on every node), got {self.rdzv_endpoint!r}")
        if self.processes > 1 and self.device.startswith("cuda:"):
            raise ExecutorError(f"executor device {self.device!r} names one GPU but processes is {self.processes}: "
                                f"use device cuda (each process takes the GPU of its local rank)")

    def setup(self) -> str:
        """Apply the thread setting and return the device this process trains on (with processes > 1:
        the device every rank takes its GPU or CPU share of, after the asset launches them)."""
        import torch

        self._check()
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ExecutorError(f"executor device {self.device!r} was asked for but torch sees no CUDA device "
                                f"(torch {torch.__version__}); install a CUDA build of torch or use device: cpu")
        device = "cuda" if self.device == "auto" and torch.cuda.is_available() else (
            "cpu" if self.device == "auto" else self.device)
        if self.inference_precision == "int8" and not device.startswith("cpu"):
            raise ExecutorError("executor inference_precision int8 runs on the CPU only; use bf16 on GPUs")
        if self.process_count > 1 and device.startswith("cuda") and torch.cuda.device_count() < self.process_count:
            raise ExecutorError(f"executor processes {self.processes} > the {torch.cuda.device_count()} GPU(s) "
                                f"visible; lower processes or request more GPUs")
        return device

    def inference_plan(self, device: str, chunks: int) -> tuple[list[str], int]:
        """(the device of each scoring process, torch threads per process) for predictions and
        embeddings of `chunks` entity chunks on `device` (what `setup` returned): `inference_processes`,
        else one per GPU or per CORES_PER_PROCESS cores, at most one per CHUNKS_PER_PROCESS chunks; each
        with `threads` threads, else a share of the cores this process may use."""
        import torch

        cores = cpu_cores()
        most = max(1, chunks // CHUNKS_PER_PROCESS)
        if device.startswith("cuda"):
            gpus = torch.cuda.device_count()
            n = self.inference_processes or (min(gpus, most) if device == "cuda" else 1)
            if n > 1 and device != "cuda":
                raise ExecutorError(f"executor device {device!r} names one GPU but inference_processes is {n}: use "
                                    f"device cuda (each scoring process takes a GPU of its own)")
            if n > gpus:
                raise ExecutorError(f"executor inference_processes {n} > the {gpus} GPU(s) visible; lower it or "
                                    f"request more GPUs")
            devices = [f"cuda:{i}" for i in range(n)] if n > 1 else [device]
        else:
            n = self.inference_processes or max(1, min(cores // CORES_PER_PROCESS, most))
            devices = ["cpu"] * n
        return devices, self.threads or max(1, cores // n)

    def autocast(self, device: str):
        """The training precision's context (bf16: torch.autocast on the device, fp32 master weights)."""
        from habitus.models.train.distributed import autocast

        return autocast(self.precision, device)

    @property
    def process_count(self) -> int:
        """`processes`, 0 resolved: one per visible GPU when training may use them, else one."""
        if self.processes:
            return self.processes
        import torch

        gpus = torch.cuda.device_count() if self.device in ("auto", "cuda") and torch.cuda.is_available() else 0
        return max(gpus, 1)

    @property
    def distributed(self) -> bool:
        return self.process_count > 1 or self.nnodes > 1

    def torchrun_command(self, target: list[str]) -> list[str]:
        """The command that runs `target` (`-m module args...` or `script args...`) in `processes`
        processes on this machine (torchrun --standalone picks a free rendezvous port), or on each of
        `nnodes` machines that meet at the c10d rendezvous `rdzv_endpoint`."""
        self._check()
        where = ["--standalone"] if self.nnodes == 1 else [
            "--nnodes", str(self.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint,
            "--rdzv-id", self.rdzv_id, *(["--node-rank", str(self.node_rank)] if self.node_rank is not None else [])]
        restarts = self.max_restarts if self.max_restarts is not None else (3 if self.nnodes > 1 else 0)
        return [sys.executable, "-m", "torch.distributed.run", *where, *(["--max-restarts", str(restarts)] if restarts
                                                                        else []),
                "--nproc_per_node", str(self.process_count), *target]

    def train(self, job: dict, device: str, log: Callable[[str], None] = print,
              resume: tuple[str | os.PathLike, int] | None = None,
              group: tuple[Path, Callable[[Path, Callable[[str], None]], None]] | None = None):
        """Train `job` (habitus.models.train.recipe.foundation_job / scenario_job) and return its result as a
        habitus.models.train.TrainResult, the model on `device`: in this process, or in `processes`
        processes under torchrun (rank 0's result). `resume`: (folder, steps between saves), a killed run
        continues from its state there. Under torchrun the job and the result pass through a temporary
        folder ($TMPDIR), or on several nodes through `job_dir`, this node's own, where this node's first
        process writes the result too (every node trained the same weights); a rank's failure raises with
        its traceback."""
        import shutil
        import tempfile

        from habitus.models.train.launch import child_env, rank_errors, read_result, write_job
        from habitus.models.train.recipe import run_training, with_resume

        job = {**job, "precision": self.precision}  # every rank trains under the same autocast
        if resume is not None:
            job = with_resume(job, *resume)
        if group is not None:  # pods of a cluster, on a folder they share; rank 0 writes the result
            folder, start = group
            folder.mkdir(parents=True, exist_ok=True)
            write_job(folder, job)
            start(folder, log)
            return read_result(folder, device)
        if not self.distributed:
            from habitus.models.train.distributed import Dist

            return run_training(job, Dist(device=device), log)[0]
        if self.nnodes > 1 and self.job_dir is None:
            raise ExecutorError(f"executor nnodes {self.nnodes}: an asset starts the nodes through `habitus train --nnodes "
                                f"{self.nnodes} --node-rank R --rdzv HOST:PORT` on every node, or through Kubernetes "
                                f"(`kubernetes:` with `nnodes`); docs/clusters.md")
        env = child_env()  # the ranks import what this process can (a scenario's target function, say)
        with tempfile.TemporaryDirectory(prefix="habitus-torchrun-") as tmp:
            folder = Path(tmp) if self.job_dir is None else Path(self.job_dir, job["kind"] + (
                f"-{job['mode']}" if "mode" in job else ""))
            folder.mkdir(parents=True, exist_ok=True)
            job = {**job, "every_node": self.job_dir is not None}
            shutil.rmtree(folder / "result", ignore_errors=True)  # (a folder used before)
            for stale in folder.glob("error-*.txt"):
                stale.unlink()
            write_job(folder, job)
            try:
                self.launch(["-m", "habitus.models.train.launch", str(folder)], log=log, env=env)
            except ExecutorError as e:
                errors = rank_errors(folder)
                raise ExecutorError(f"{e}\nthe failed ranks' errors:\n{errors}" if errors else str(e)) from None
            return read_result(folder, device)

    def launch(self, target: list[str], log: Callable[[str], None] = print, env: dict | None = None) -> None:
        """Run `target` under torchrun, streaming every line it prints to `log`. Raises with the
        exit status and the last lines when any process fails."""
        cmd = self.torchrun_command(target)
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        tail: list[str] = []
        log(f"launching {self.process_count} processes: {' '.join(cmd[2:])}")
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=ROOT) as proc:
            for line in proc.stdout:
                line = line.rstrip()
                log(line)
                tail = (tail + [line])[-20:]
        if proc.returncode:
            raise ExecutorError(f"torchrun exited with status {proc.returncode} running {' '.join(target)}; "
                                f"its last lines:\n" + "\n".join(tail))
