"""Every training through one launcher: a scenario with its refit, launched as the asset launches it
(TrainingExecutor.train on models/train/recipe.scenario_job) with `processes: 2`, runs both the
measured fine-tuning and the refit under torchrun (two launches of 2 gloo CPU processes), and the
served checkpoint says so; the same under bf16 autocast (on the CPU here: the GPU's precision path,
with the CPU's bfloat16 kernels)."""

import numpy as np
import pytest
import torch

from habitus.models.data.targets import TargetSpec
from habitus.models.evaluate.holdout import protocol
from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.nn.network import Model, NetConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.config import FinetuneConfig, ScenarioConfig
from habitus.models.train.recipe import scenario_job
from habitus.models.train.scenario import train_scenario
from habitus.resources.training.executor import TrainingExecutor

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

HORIZON = 14  # (churn_foundation's, tests/models/conftest.py)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64)


@pytest.fixture(scope="module")
def foundation(churn_foundation, tmp_path_factory):
    """The tiny foundation as a checkpoint folder (what the ranks load), with its state and config."""
    cache, test_cutoff, state, info = churn_foundation
    model = Model(NetConfig.from_dict(info["net"]), info["targets_width"])
    model.load_state_dict(state)
    folder = tmp_path_factory.mktemp("launcher") / "foundation"
    save_checkpoint(folder, model, {"feature_spec": info["feature_spec"], "net": info["net"]})
    return cache, test_cutoff, folder, *load_checkpoint(folder)


@pytest.fixture(scope="module")
def runs(foundation, tmp_path_factory):
    """precision -> (the run, the served checkpoint's config, the log) of the churn scenario with its refit
    in 2 processes."""
    cache, test_cutoff, folder, state, info = foundation
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    cfg = ScenarioConfig("churn", CHURN, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, FINETUNE,
                         head="network", refit=True)
    out = {}
    for precision in ("fp32", "bf16"):
        tmp = tmp_path_factory.mktemp(precision)
        executor = TrainingExecutor(device="cpu", processes=2, threads=1, precision=precision)
        lines: list[str] = []

        def launch(t):
            return executor.train(scenario_job(cache, folder, info["weights_sha256"], t, "cpu"), "cpu",
                                  log=lines.append, resume=(tmp / "resume" / t.mode, cfg.save_every_steps))

        run = train_scenario(cache, state, info, cfg, path=tmp / "churn", device="cpu", log=lines.append,
                             launch=launch, resume_dir=tmp / "resume", baselines=False)
        out[precision] = run, load_checkpoint(tmp / "churn"), lines
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_measured_run_and_the_refit_both_run_under_torchrun(runs, precision):
    run, (weights, config), lines = runs[precision]
    launches = [ln for ln in lines if ln.startswith("launching 2 processes")]
    assert len(launches) == 2 and all("torch.distributed.run --standalone --nproc_per_node 2" in ln
                                      for ln in launches)
    assert any("refit on the cut-offs" in ln for ln in lines)
    # the measured model and the served one (the refit) were both trained by 2 processes, in `precision`
    assert config["training"]["processes"] == 2 and config["training"]["precision"] == precision
    assert config["refit"]["processes"] == 2 and config["refit"]["precision"] == precision
    assert run.refit.trained.info["weights_gap"] == 0.0 and run.trained.info["weights_gap"] == 0.0
    # the checkpoint holds the refit's weights, not the measured model's
    served = run.refit.trained.model.state_dict()
    assert all(torch.equal(weights[k], served[k].cpu()) for k in weights)
    assert not all(torch.equal(weights[k], run.trained.model.state_dict()[k]) for k in weights)
    assert np.isfinite(run.trained.curves["val_loss"]).all() and np.isfinite(run.refit.trained.curves["train_loss"]).all()


def test_bf16_autocast_reached_the_ranks(runs):
    """The same recipe, the same seeds: only the matrix products' precision differs, so the losses do
    (a little: bf16 keeps fp32 master weights)."""
    fp32, bf16 = runs["fp32"][0].trained.curves["val_loss"], runs["bf16"][0].trained.curves["val_loss"]
    assert fp32 != bf16
    assert bf16[-1] == pytest.approx(fp32[-1], rel=0.05)
