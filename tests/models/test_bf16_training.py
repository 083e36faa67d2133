"""bf16 mixed precision around the real training loops (what the executor's `precision: bf16` does:
habitus.models.train.distributed.autocast around train_foundation / finetune, in the asset or in every torchrun
rank). On GPUs the context is torch.autocast("cuda", bfloat16); this machine has no GPU, so the
loops are run under the CPU's bfloat16 autocast, the same context with the same casting rules: it
must engage (other numbers than fp32), keep the weights in fp32 (master weights) and train about
as well. The GPU test runs where a GPU is."""

import numpy as np
import pytest
import torch

from habitus.models.train.distributed import autocast
from habitus.models.evaluate.holdout import protocol
from habitus.models.data.features import DAY
from habitus.models.data.targets import TargetSpec
from habitus.models.train.finetune import finetune
from habitus.models.train.foundation import train_foundation
from habitus.models.train.config import FinetuneConfig, FoundationConfig
from habitus.models.tasks.spec import TaskSpec

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SPAN, HORIZON = 120, 14
FOUNDATION = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=2, batch_size=32,
                              learning_rate=5e-3, buckets=32, seed=0, chunk_entities=64, min_history_days=28)
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64, seed=0)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))


@pytest.fixture(scope="module")
def world(module_sources):
    return module_sources.churning_purchases(200, SPAN, seed=1), module_sources.at(SPAN - HORIZON)


def _cpu_bf16():  # as habitus.models.train.distributed.autocast on a GPU: no weight cache across the loop's steps
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


def _cached_cpu_bf16():  # autocast's default, its casted weights kept until the context exits
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _train(cache, test_cutoff, mixed):
    quiet = lambda _: None  # noqa: E731
    with mixed():
        foundation = train_foundation(cache, FOUNDATION, test_cutoff - HORIZON * DAY, device="cpu", log=quiet)
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    state = {k: v for k, v in foundation.model.state_dict().items()}
    info = {**foundation.info, "net": foundation.model.trunk.cfg.to_dict()}
    with mixed():
        scenario = finetune(cache, state, info, CHURN, list(plan.train_cutoffs), plan.val_cutoff, FINETUNE,
                            device="cpu", log=quiet)
    return foundation, scenario


def test_both_loops_train_under_bf16_autocast_with_fp32_master_weights(world):
    cache, test_cutoff = world
    plain = _train(cache, test_cutoff, lambda: autocast("fp32", "cpu"))
    mixed = _train(cache, test_cutoff, _cpu_bf16)
    for fp32, bf16 in zip(plain, mixed):
        assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # master weights stay fp32
        a, b = np.array(fp32.curves["val_loss"]), np.array(bf16.curves["val_loss"])
        assert np.isfinite(b).all()
        assert not np.array_equal(a, b)  # the matrix products ran in bfloat16
        assert abs(b[-1] - a[-1]) <= 0.05 * abs(a[-1])  # and trains as well (measured: within 0.6%)
    # autocast's default keeps its bf16 copies of the weights until the context exits: around a whole
    # loop every forward pass would read the weights as they were before the first step
    stale = _train(cache, test_cutoff, _cached_cpu_bf16)
    assert stale[0].curves["val_loss"][-1] > 3 * plain[0].curves["val_loss"][-1]


def test_bf16_is_the_uncached_autocast_of_the_device_and_unknown_precisions_named():
    with autocast("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="unknown training precision 'fp16'"):
        autocast("fp16", "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_the_gpu(world):
    cache, test_cutoff = world
    with autocast("bf16", "cuda"):
        result = train_foundation(cache, FOUNDATION, test_cutoff - HORIZON * DAY, device="cuda", log=lambda _: None)
    assert all(p.dtype == torch.float32 for p in result.model.parameters())
    assert np.isfinite(result.curves["val_loss"]).all()
