"""LoRA adapters (models/nn/lora.py): exact at the start, only adapters and head learn, the small
adapters file restores the tuned model, and merging gives a plain model with the same outputs."""

import numpy as np
import pytest
import torch
from torch import nn

from habitus.models.nn.checkpoint import save_checkpoint
from habitus.models.evaluate.holdout import protocol
from habitus.models.data.features import DAY, FeatureSpec
from habitus.models.nn.lora import LoRALinear, apply_lora, load_adapters, merge_lora, save_adapters
from habitus.models.nn.network import NetConfig
from habitus.models.data.targets import TargetSpec
from habitus.models.train.foundation import train_foundation
from habitus.models.tasks.scoring import build_model
from habitus.models.train.config import FinetuneConfig, FoundationConfig, LoraConfig
from habitus.models.train.finetune import finetune
from habitus.models.tasks.spec import TaskSpec

HORIZON = 14
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))


def test_lora_linear_starts_as_the_base_layer_and_loads_its_state():
    torch.manual_seed(0)
    base = nn.Linear(12, 7)
    lora = LoRALinear(base, rank=4, alpha=8.0)
    x = torch.randn(5, 12)
    assert torch.equal(lora(x), base(x))  # B = 0: exactly the pretrained layer
    assert not lora.weight.requires_grad and not lora.bias.requires_grad
    assert lora.lora_a.requires_grad and lora.lora_b.requires_grad
    other = nn.Linear(12, 7)
    lora.load_state_dict(other.state_dict())  # strict: a plain Linear's state fits, adapters keep their values
    assert torch.equal(lora.weight, other.weight)
    with torch.no_grad():
        lora.lora_b.normal_()
    assert not torch.allclose(lora(x), other(x))
    assert torch.allclose(lora.merged()(x), lora(x), atol=1e-5)


def _world(sources):
    rng = np.random.default_rng(1)
    customer, ts, product = [], [], []
    for i in range(240):
        stop = rng.uniform(30, 126) if rng.random() < 0.5 else 126
        days = np.sort(rng.uniform(0, stop, rng.poisson(rng.uniform(0.15, 0.5) * stop)))
        customer += [f"c{i:04d}"] * len(days)
        ts += [sources.at(float(d)) for d in days]
        product += [f"p{i % 3}{j}" for j in rng.integers(0, 4, len(days))]
    cache = sources.build(sources.events(sources.write_events("purchases", customer, ts, product,
                                                              rng.gamma(2.0, 5.0, len(ts)).round(2))))
    return cache, sources.at(126 - HORIZON)


@pytest.mark.slow
def test_finetune_with_adapters_trains_adapters_and_head_only(sources, tmp_path, one_thread):
    cache, test_cutoff = _world(sources)
    fcfg = FoundationConfig(horizon_days=HORIZON, hidden=16, layers=1, epochs=1, batch_size=32, buckets=16,
                            chunk_entities=64)
    foundation = train_foundation(cache, fcfg, test_cutoff - HORIZON * DAY, device="cpu", log=lambda _: None)
    state = {k: v.clone() for k, v in foundation.model.state_dict().items()}
    plan = protocol(test_cutoff, HORIZON, 2, cache.time_range[0])
    result = finetune(cache, state, foundation.info, CHURN, list(plan.train_cutoffs), plan.val_cutoff,
                      FinetuneConfig(epochs=2, batch_size=32, chunk_entities=64, soup=False),
                      adapters=LoraConfig(rank=2, alpha=4.0), device="cpu", log=lambda _: None)
    model = result.model
    assert result.info["lora_rank"] == 2
    # the trunk's own weights are the foundation's; the adapters moved
    for k, v in model.trunk.state_dict().items():
        if ".lora_" not in k:
            assert torch.equal(v, state["trunk." + k]), k
    assert max(float(m.lora_b.detach().abs().max()) for m in model.modules() if isinstance(m, LoRALinear)) > 0
    trainable = result.info["trainable_parameters"]
    assert trainable < sum(p.numel() for p in model.parameters()) / 2

    # the adapters file alone (plus the foundation) restores the tuned model
    size = save_adapters(model, tmp_path / "adapters.safetensors")
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    fresh = apply_lora(build_model(NetConfig.from_dict(foundation.info["net"]), CHURN, spec), 2, 4.0)
    fresh.trunk.load_state_dict({k.removeprefix("trunk."): v for k, v in state.items() if k.startswith("trunk.")})
    load_adapters(fresh, tmp_path / "adapters.safetensors")
    x = torch.randn(20, foundation.info["net"]["in_dim"])
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.allclose(fresh(x), model(x))
        merged = merge_lora(model).eval()
        assert not any(isinstance(m, LoRALinear) for m in merged.modules())
        assert torch.allclose(merged(x), model(x), atol=1e-5)
    save_checkpoint(tmp_path / "full", merged, {})
    assert size < (tmp_path / "full" / "model.safetensors").stat().st_size / 2


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    spec_net = NetConfig(10, 8, 1, 0.0)
    spec = FeatureSpec({}, [], {}, {}, [])
    model = apply_lora(build_model(spec_net, CHURN, spec), rank=2, alpha=16.0)
    save_adapters(model, tmp_path / "a.safetensors")
    other = apply_lora(build_model(spec_net, CHURN, spec), rank=3, alpha=16.0)
    with pytest.raises(ValueError, match="adapters do not fit this model"):
        load_adapters(other, tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapters(build_model(spec_net, CHURN, spec), tmp_path / "b.safetensors")
