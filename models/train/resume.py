"""Resumable training: the whole state of a training loop, saved every N steps and restored after a kill.

A save is one folder, `<folder>/latest/`, renamed into place whole (habitus.models.storage.files.atomic_path):

    state.safetensors   every tensor: weights, optimizer moments, the best epoch's weights, torch RNG
    state.json          everything else: step, epoch, position in the epoch's data order, the order
                        itself, numpy's RNG state, loss curves, counters; plus the SHA-256 of
                        state.safetensors and the fingerprint of the run's inputs

No pickle anywhere: nested optimizer / scheduler state dicts are split into tensors (safetensors)
and plain values (JSON). A state is used only when its fingerprint matches the run's (same cache,
same config, same cut-offs) and its tensors match their recorded SHA-256; otherwise training starts
from the beginning. A resumed run ends with the same weights as an uninterrupted one, because every
source of randomness is restored along with the position in the data.

Under torchrun (`dist` with several ranks) the ranks save together, at the same optimizer step
(`after_step`: lockstep keeps their step counts equal): the weights and optimizer state are the same
on every rank and rank 0 writes them once; what differs by rank (its position in its share of the
data, its batch generator, torch's generator) is gathered to rank 0 and written beside them, one entry
per rank, and each rank takes its own entry back. Every rank reads the same folder (on several
machines a shared one, or each machine its own, which its first process writes: `writes`); ranks that
find different states refuse to go on.
"""

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from habitus.models.storage.files import atomic_path, file_sha256
from habitus.models.train.config import SAVE_EVERY_STEPS
from habitus.models.train.distributed import Dist

_FORMAT = 2


class Resumer:
    """Saves and restores a training loop's state in `folder` for the run whose inputs hash to `fingerprint`."""

    def __init__(self, folder: str | os.PathLike, fingerprint: str, every_steps: int = SAVE_EVERY_STEPS,
                 log: Callable[[str], None] = print, dist: Dist | None = None, writes: bool | None = None):
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.every_steps = every_steps
        self.log = log
        self.dist = dist or Dist()
        self.writes = self.dist.is_writer if writes is None else writes  # (several: rank 0, or each node's first)
        self.saves = 0
        self.step = 0  # optimizer steps done by the run, restored with the state
        self._last_saved_step = 0

    @property
    def latest(self) -> Path:
        return self.folder / "latest"

    def after_chunk(self, batches: int, modules: dict, rng: np.random.Generator, loop: Callable[[], dict]) -> None:
        """Called by a training loop after each chunk of work (`batches` optimizer steps): saves the
        state once `every_steps` steps have passed since the last save. `loop()` builds the loop's
        position only when a save is due."""
        self.step += int(batches)
        if self.step - self._last_saved_step >= self.every_steps:
            self.save(self.step, modules, rng, loop())

    def after_step(self, modules: dict, rng: np.random.Generator, own_rng: np.random.Generator,
                   loop: Callable[[], tuple[dict, dict]]) -> None:
        """Called by a training loop after every optimizer step, on every rank: saves the state once
        `every_steps` steps have passed since the last save. `loop()` builds (the position every rank
        shares, this rank's own) only when a save is due; `rng` draws what every rank draws alike (the
        data order), `own_rng` this rank's own draws (the same generator in one process)."""
        self.step += 1
        if self.step - self._last_saved_step >= self.every_steps:
            shared, own = loop()
            self.save(self.step, modules, rng, shared, own_rng, own)

    def save(self, step: int, modules: dict, rng: np.random.Generator, loop: dict,
             own_rng: np.random.Generator | None = None, own: dict | None = None) -> None:
        """Write the state atomically (rank 0, or each node's first process on nodes that do not share a
        folder; every rank calls it at the same step under torchrun).
        `modules`: name -> object with state_dict() (model, optimizer, scheduler), the same on every
        rank; `loop`: the loop's position and counters every rank shares (JSON values and tensors);
        `own`, `own_rng`: this rank's own position and generator."""
        mine = {"loop": own or {}, "numpy_rng": None if own_rng is None else own_rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        ranks = [mine]
        if self.dist.enabled:  # (in memory, between the ranks: pickled by torch, never written)
            ranks = [None] * self.dist.world
            torch.distributed.all_gather_object(ranks, mine)
        self._last_saved_step = int(step)
        if not self.writes:
            return
        tensors: dict[str, torch.Tensor] = {}
        body = {
            "format": _FORMAT,
            "fingerprint": self.fingerprint,
            "step": int(step),
            "modules": {name: _split(m.state_dict(), tensors, f"modules.{name}") for name, m in modules.items()},
            "loop": _split(loop, tensors, "loop"),
            "numpy_rng": _split(rng.bit_generator.state, tensors, "numpy_rng"),
            "ranks": [_split(r, tensors, f"ranks.{i}") for i, r in enumerate(ranks)],
        }
        with atomic_path(self.latest) as tmp:
            tmp.mkdir(parents=True)
            save_file(tensors, str(tmp / "state.safetensors"))
            body["tensors_sha256"] = file_sha256(tmp / "state.safetensors")
            (tmp / "state.json").write_text(json.dumps(body, allow_nan=True))
        self.saves += 1

    def restore(self, modules: dict, rng: np.random.Generator, own_rng: np.random.Generator | None = None
                ) -> dict | None:
        """Load the saved state into `modules`, `rng` and `own_rng` (this rank's entry) and return the
        loop's saved position (the shared one with this rank's own on top), or None (nothing saved, or
        saved by a run with other inputs or another number of processes, or damaged: training starts
        afresh). Under torchrun every rank must find the same state."""
        body = self._read()
        if body is not None and len(body["ranks"]) != self.dist.world:
            self.log(f"the state saved in {self.latest} is of {len(body['ranks'])} processes, not "
                     f"{self.dist.world}; starting afresh")
            body = None
        self._agree(-1 if body is None else body["step"])
        if body is None:
            return None
        tensors = load_file(str(self.latest / "state.safetensors"))
        for name, m in modules.items():
            m.load_state_dict(_join(body["modules"][name], tensors))
        rng.bit_generator.state = _join(body["numpy_rng"], tensors)
        mine = _join(body["ranks"][self.dist.rank], tensors)
        if own_rng is not None and mine["numpy_rng"] is not None:
            own_rng.bit_generator.state = mine["numpy_rng"]
        torch.set_rng_state(mine["torch_rng"])
        cuda = mine["cuda_rng"]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        self.step = self._last_saved_step = body["step"]
        self.log(f"resuming from the state saved at step {body['step']} in {self.latest}")
        return {**_join(body["loop"], tensors), **mine["loop"]}

    def saved(self, key: str):
        """What the saved loop holds under `key`, read before the loop builds what depends on it (the
        foundation's rare-value groups); None where no state of this run's inputs and processes is saved.
        Reads state.json only: the tensors' hash is restore's to check (a value of the same inputs serves a
        run that starts afresh as well). Under torchrun only the rank that decides calls it (from_rank0)."""
        body = self._read(quiet=True, tensors=False)  # (restore says why a state is not used)
        if body is None or len(body["ranks"]) != self.dist.world:
            return None
        return body["loop"].get(key)

    def _agree(self, step: int) -> None:
        """Under torchrun: every rank found the state of the same step (or none)."""
        if not self.dist.enabled:
            return
        t = torch.tensor([step, -step], dtype=torch.int64, device=self.dist.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(f"the ranks found different saved states in {self.folder} (steps {-int(t[1])} to "
                               f"{int(t[0])}): every node must read the same resume folder (a shared filesystem), or "
                               f"each keep its own (`habitus train` on every node)")

    def _read(self, quiet: bool = False, tensors: bool = True) -> dict | None:
        """state.json when it belongs to this run (and, with `tensors`, state.safetensors matches its hash)."""
        log = (lambda _: None) if quiet else self.log
        state_json, state_st = self.latest / "state.json", self.latest / "state.safetensors"
        if not state_json.exists() or not state_st.exists():
            return None
        try:
            body = json.loads(state_json.read_text())
        except ValueError:
            log(f"{state_json} is not valid JSON; ignoring the saved state and starting afresh")
            return None
        if body.get("format") != _FORMAT or body.get("fingerprint") != self.fingerprint:
            log(f"the state saved in {self.latest} belongs to a run with other inputs; starting afresh")
            return None
        if tensors and body.get("tensors_sha256") != file_sha256(state_st):
            log(f"{state_st} does not match the SHA-256 recorded in state.json (changed after it was "
                f"written); ignoring it and starting afresh")
            return None
        return body

    def clear(self) -> None:
        """Forget the saved state (after the finished model is saved)."""
        import shutil

        shutil.rmtree(self.latest, ignore_errors=True)


# --------------------------------------------------------------------------- nested state <-> tensors + JSON


def _split(obj, tensors: dict, key: str):
    """A nested state (dicts with any keys, lists, tuples, tensors, numpy scalars) as JSON values,
    its tensors moved into `tensors` under unique names."""
    if isinstance(obj, torch.Tensor):
        # a copy: safetensors refuses tensors that share memory, and the caller keeps training
        tensors[key] = obj.detach().to("cpu").clone().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _split(v, tensors, f"{key}.{k}") for k, v in obj.items()}
        return {"__items__": [[_split(k, tensors, f"{key}.k{i}"), _split(v, tensors, f"{key}.{i}")]
                              for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split(v, tensors, f"{key}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot save a {type(obj).__name__} in a resumable state at {key!r} (no pickle)")


def _join(obj, tensors: dict):
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__tuple__" in obj:
        return tuple(_join(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_join(k, tensors): _join(v, tensors) for k, v in obj["__items__"]}
    return {k: _join(v, tensors) for k, v in obj.items()}
