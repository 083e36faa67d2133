"""Inference precisions for a loaded model: fp32 (as trained), int8 (dynamic quantization of the
Linear layers, CPU) and bf16 (weights and matrix products in bfloat16).

    model = for_inference(model, "int8")
    with precision_context("int8", device):
        batches = predict(model, cache, spec, task, cutoff)

Both return copies; the model passed in is unchanged. Their speed and metric change on this
machine are measured by bench/speed.py (never assumed). Recommendation heads (ItemHead) keep
fp32: they read their weights directly (embedding rows, the skip weights), which neither
quantized Linear layers nor mixed dtypes allow; their trunk still changes precision.
"""

import contextlib
import copy
import warnings

import torch
from torch import nn

from habitus.models.nn.network import Head, ItemHead, Model, Trunk

PRECISIONS = ("fp32", "int8", "bf16")


def for_inference(model: Model | Trunk, precision: str) -> Model | Trunk:
    """A copy of `model` (a Model or a bare Trunk) for inference at `precision`, in eval mode."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown inference precision {precision!r}; choose one of {PRECISIONS}")
    model = copy.deepcopy(model).eval()
    if precision == "int8":
        return _int8(model)
    if precision == "bf16":
        return _bf16(model)
    return model


def precision_context(precision: str, device: str = "cpu"):
    """The context to run a model of `precision` in. int8 kernels exist on the CPU only: a model
    quantized there must run there, which this checks early with a clear message."""
    if precision == "int8" and not str(device).startswith("cpu"):
        raise ValueError(f"int8 dynamic quantization runs on the CPU only (device {device!r}); use bf16 on GPUs")
    return contextlib.nullcontext()


def _quantize(module: nn.Module, which: set | None = None) -> nn.Module:
    """`which`: the Linear layers to quantize (types or submodule names); all of them by default."""
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():  # torch marks torch.ao as deprecated (moving to torchao); it still works
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(module, which or {nn.Linear}, dtype=torch.qint8)


def _int8(model: Model | Trunk) -> Model | Trunk:
    if isinstance(model, Trunk):
        return _quantize(model.cpu())
    model = model.cpu()
    model.trunk = _quantize(model.trunk)
    if isinstance(model.head, Head):  # the skip weights are read directly (per label): they stay fp32
        model.head = _quantize(model.head, {"linear"})
    return model


def _cast_inputs(module: nn.Module, args: tuple):
    """Forward pre-hook: floating inputs to the module's weight dtype (bf16)."""
    dtype = module.weight.dtype
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() and a.dtype != dtype else a for a in args)


def _to_float(_module, _args, out):
    return out.float() if torch.is_tensor(out) else out


def _bf16(model: Model | Trunk) -> Model | Trunk:
    parts = [model] if isinstance(model, Trunk) else [model.trunk] + ([model.head] if isinstance(model.head, Head) else [])
    for part in parts:
        part.to(torch.bfloat16)
        if isinstance(part, Trunk):  # the input scaling stays fp32: a bf16 mean loses the inputs' small differences
            part.in_mean.data, part.in_std.data = part.in_mean.float(), part.in_std.float()
        for m in part.modules():
            if isinstance(m, (nn.Linear, nn.LayerNorm)):
                m.register_forward_pre_hook(_cast_inputs)
    # whatever reads the result (NumPy, an fp32 item head) gets fp32
    if isinstance(model, Trunk) or isinstance(model.head, ItemHead):
        (model if isinstance(model, Trunk) else model.trunk).register_forward_hook(_to_float)
    if isinstance(model, Model):
        model.register_forward_hook(_to_float)
    return model
