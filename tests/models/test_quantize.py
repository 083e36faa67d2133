"""Inference precisions (models/nn/quantize.py): int8 and bf16 copies follow the fp32 model closely,
leave it unchanged, and run through predict / embed on a real cache."""

import numpy as np
import pytest
import torch
from habitus.models.data.features import FeatureSpec, chunk_at, featurize
from habitus.models.nn.network import Model, NetConfig, Trunk
from habitus.models.serve.predict import embed, predict
from habitus.models.nn.quantize import for_inference, precision_context
from habitus.models.data.targets import TargetSpec
from habitus.models.data.chunks import chunk_plan
from habitus.models.tasks.scoring import build_model
from habitus.models.tasks.spec import TaskSpec


def _model(seed=0) -> Model:
    torch.manual_seed(seed)
    return Model(NetConfig(40, 32, 2, 0.0), 5, history_channels=3).eval()


def test_int8_and_bf16_follow_fp32_and_leave_the_model_unchanged():
    model = _model()
    x, h = torch.randn(256, 40), torch.rand(256, 5, 3)
    with torch.no_grad():
        ref = model(x, h)
        outs = {p: for_inference(model, p)(x, h) for p in ("fp32", "int8", "bf16")}
        again = model(x, h)
    assert torch.equal(ref, again) and model.trunk.inp.weight.dtype == torch.float32  # the original is untouched
    assert torch.equal(outs["fp32"], ref)
    scale = float(ref.abs().mean())
    for p in ("int8", "bf16"):
        assert outs[p].dtype == torch.float32 and outs[p].shape == ref.shape
        err = float((outs[p] - ref).abs().mean())
        assert 0 < err < 0.05 * scale, (p, err, scale)  # changed (a real conversion), but only a little
    quantized = [m for m in for_inference(model, "int8").modules() if "quantized.dynamic" in type(m).__module__]
    assert len(quantized) == 1 + 2 * 2 + 1  # trunk input, 2 blocks x (up, down), head linear (the skip stays fp32)
    assert for_inference(model, "bf16").trunk.blocks[0].up.weight.dtype == torch.bfloat16
    assert for_inference(model, "bf16").trunk.in_mean.dtype == torch.float32  # the input scaling keeps fp32


def test_unknown_precision_and_int8_on_a_gpu_are_refused():
    with pytest.raises(ValueError, match="fp16.*choose one of"):
        for_inference(_model(), "fp16")
    with pytest.raises(ValueError, match="CPU only"):
        precision_context("int8", "cuda")


def _cache(sources):
    rng = np.random.default_rng(0)
    n = 3000
    customer = [f"c{i % 200:03d}" for i in range(n)]
    ts = [sources.at(float(d)) for d in rng.uniform(0, 90, n)]
    product = [f"p{j}" for j in rng.integers(0, 30, n)]
    return sources.build(sources.events(sources.write_events("purchases", customer, ts, product,
                                                              rng.gamma(2.0, 5.0, n).round(2))))


def test_predict_and_embed_at_each_precision(sources):
    cache = _cache(sources)
    spec = FeatureSpec.from_cache(cache, buckets=16)
    task = TaskSpec("binary", TargetSpec("no_event", 14, active_days=60))
    torch.manual_seed(0)
    model = build_model(NetConfig(spec.width, 32, 2, 0.0), task, spec).eval()
    cutoff = sources.at(70)
    chunk = chunk_at(cache.shard(0), *chunk_plan(cache, 10_000)[0][1:], cutoff)
    model.trunk.fit_input_scale(torch.from_numpy(featurize(chunk, spec, cache.entity_table())), 1.0)
    scores = {}
    for p in ("fp32", "int8", "bf16"):
        with precision_context(p, "cpu"):
            batches = list(predict(for_inference(model, p), cache, spec, task, cutoff))
        scores[p] = (np.concatenate([b.column("entity_index").to_numpy() for b in batches]),
                     np.concatenate([b.column("score").to_numpy() for b in batches]))
    ids, ref = scores["fp32"]
    assert len(ids) > 100
    for p in ("int8", "bf16"):
        assert np.array_equal(scores[p][0], ids)
        assert np.abs(scores[p][1] - ref).max() < 0.03, p
    plain = np.concatenate([b.column("embedding").to_numpy(zero_copy_only=False).tolist()
                            for b in embed(model.trunk, cache, spec, cutoff, dtype=np.float32)])
    for p in ("int8", "bf16"):
        trunk = for_inference(model.trunk, p)
        assert isinstance(trunk, Trunk)
        low = np.concatenate([b.column("embedding").to_numpy(zero_copy_only=False).tolist()
                              for b in embed(trunk, cache, spec, cutoff, dtype=np.float32)])
        assert low.shape == plain.shape and np.abs(low - plain).mean() < 0.05, p
