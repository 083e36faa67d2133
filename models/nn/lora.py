"""LoRA adapters for scenarios: low-rank updates on the frozen foundation trunk's Linear layers.

A scenario tuned this way trains only the adapters (rank r: r * (in + out) numbers per layer) and
its head; the trunk's own weights stay the foundation's. The adapters and the head are stored as
a small safetensors file next to the foundation checkpoint (`save_adapters`), and `merge_lora`
folds them into plain weights, so a merged model is an ordinary scenario checkpoint that
habitus.models.serve.predict loads as it is.

    result = finetune(cache, state, foundation_info, task, train_cutoffs, val_cutoff, cfg,
                      adapters=LoraConfig())                # models/train/finetune.py, models/train/config.py
    save_adapters(result.model, folder / "adapters.safetensors")
    save_checkpoint(folder, merge_lora(result.model), config)
"""

import copy
import json
import math
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from habitus.models.nn.network import Model
from habitus.models.storage.files import durable_replace


class LoRALinear(nn.Linear):
    """y = x W^T + b + (alpha / r) x A^T B^T with W, b frozen. B starts at zero, so before training
    the layer is exactly the pretrained one. Its state dict keeps the Linear's own keys (weight,
    bias), so a plain foundation state loads into it; adapters missing from such a state keep
    their initialization."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, base.bias is not None,
                         device=base.weight.device, dtype=base.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(base.weight)
            if base.bias is not None:
                self.bias.copy_(base.bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_a.T @ self.lora_b.T) * (self.alpha / self.rank)

    def merged(self) -> nn.Linear:
        out = nn.Linear(self.in_features, self.out_features, self.bias is not None, device=self.weight.device)
        with torch.no_grad():
            out.weight.copy_(self.weight + (self.alpha / self.rank) * self.lora_b @ self.lora_a)
            if self.bias is not None:
                out.bias.copy_(self.bias)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        before = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        adapters = {prefix + "lora_a", prefix + "lora_b"}
        missing_keys[before:] = [k for k in missing_keys[before:] if k not in adapters]


def apply_lora(model: Model, rank: int, alpha: float) -> Model:
    """Put adapters on every Linear layer of the trunk and freeze the rest of the trunk (in place;
    returns the model). The head stays trainable: a scenario's outputs are its own."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {rank}")
    for p in model.trunk.parameters():
        p.requires_grad_(False)
    for parent in list(model.trunk.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, LoRALinear(child, rank, alpha))
    return model


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


def adapter_state(model: Model) -> dict[str, torch.Tensor]:
    """What a LoRA-tuned scenario adds to its foundation: the adapters and the head."""
    if not has_lora(model):
        raise ValueError("the model carries no LoRA adapters (apply_lora first)")
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
            if ".lora_" in k or k.startswith("head.")}


def save_adapters(model: Model, path: str | os.PathLike) -> int:
    """Write the adapters and the head as safetensors (atomically); returns the file's size in bytes."""
    ranks = {m.rank for m in model.modules() if isinstance(m, LoRALinear)}
    alphas = {m.alpha for m in model.modules() if isinstance(m, LoRALinear)}
    state = adapter_state(model)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(state, tmp, metadata={"lora": json.dumps({"rank": ranks.pop(), "alpha": alphas.pop()})})
    durable_replace(tmp, path)
    return os.path.getsize(path)


def load_adapters(model: Model, path: str | os.PathLike) -> Model:
    """Load adapters + head saved by save_adapters into `model`, whose trunk holds the foundation
    weights and carries adapters of the same rank (apply_lora). Every key must match."""
    state = load_file(os.fspath(path))
    own = adapter_state(model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(f"{path}: adapters do not fit this model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}, other shapes {shapes[:5]}); apply_lora with the rank they were "
                         f"trained with, on the same task")
    model.load_state_dict(state, strict=False)
    return model


def merge_lora(model: Model) -> Model:
    """A copy with every adapter folded into its layer's weight: a plain Model of the same shape."""
    merged = copy.deepcopy(model)
    for parent in list(merged.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                setattr(parent, name, child.merged())
    for p in merged.parameters():
        p.requires_grad_(True)
    return merged

