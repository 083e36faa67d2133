"""Checkpoints: a folder with `model.safetensors` (weights only, never pickle) and `config.json`.

The folder is written under a temporary name and renamed, and config.json records the SHA-256 of
the weights, so a checkpoint that was altered after training is refused on load.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from habitus.models.storage.files import atomic_path, file_sha256


class CheckpointError(ValueError):
    pass


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, config: dict,
                    extra: Callable[[Path], dict] | None = None) -> str:
    """Write the checkpoint folder atomically; returns the weights' fingerprint. `extra(folder)`: writes
    more files into the folder being written (the head chosen on validation: models/heads/stacked_head.py)
    and returns what config.json records of them."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    with atomic_path(path, needed_bytes=sum(v.numel() * v.element_size() for v in state.values())) as tmp:
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / "model.safetensors"))
        digest = file_sha256(tmp / "model.safetensors")
        config = {**config, **(extra(tmp) if extra is not None else {})}
        (tmp / "config.json").write_text(json.dumps({**config, "weights_sha256": digest}, indent=2, default=str))
    return digest


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    path = Path(path)
    weights, cfg_file = path / "model.safetensors", path / "config.json"
    if not weights.exists() or not cfg_file.exists():
        raise CheckpointError(f"{path} is not a checkpoint (needs model.safetensors and config.json); "
                              f"materialize the asset that writes it")
    try:
        config = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-materialize the checkpoint") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_file} holds a {type(config).__name__}, not a checkpoint config; re-materialize it")
    # hashed and parsed from the same bytes (one read): a checkpoint promoted between a hash and a second
    # open can never pair this config.json with other weights
    data = weights.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if config.get("weights_sha256") != digest:
        raise CheckpointError(f"{weights}: SHA-256 {digest[:16]}… does not match the {str(config.get('weights_sha256'))[:16]}… "
                              f"recorded in config.json; the file was changed after training. Re-materialize it")
    try:  # safetensors parses a JSON header and raw bytes: nothing in the file can run as code
        return load(data), config
    except SafetensorError as e:
        raise CheckpointError(f"{weights} is not a safetensors file ({e}); checkpoints are never read as pickle or "
                              f"torch.save archives. Re-materialize it") from None
