"""Resume under torchrun: a 2-process fine-tuning whose rank 0 is killed (SIGKILL) right after a save of
its step state is restarted by torchrun (`--max-restarts 1`), resumes from that state and ends with
the weights of an uninterrupted 2-process run, bit for bit (tolerance 0: the same batches, the same
random draws, the same gloo all-reduces in the same order), with the same curves and choices."""

import json
from pathlib import Path

import pytest
import torch

from habitus.models.data.targets import TargetSpec
from habitus.models.evaluate.holdout import protocol
from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.nn.network import Model, NetConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.config import FinetuneConfig, ScenarioConfig
from habitus.models.train.launch import rank_errors, read_result, write_job
from habitus.models.train.recipe import Training, scenario_job, with_resume
from habitus.resources.training.executor import ExecutorError, TrainingExecutor

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

HORIZON = 14  # (churn_foundation's, tests/models/conftest.py)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))
# dropout in the trunk (the foundation's 0.1): torch's generator of each rank matters too
FINETUNE = FinetuneConfig(epochs=3, learning_rate=3e-3, batch_size=16, chunk_entities=64, seed=4)
EVERY = 3


def test_a_killed_two_process_finetuning_resumes_and_ends_as_an_uninterrupted_one(churn_foundation, tmp_path):
    cache, test_cutoff, state, info = churn_foundation
    model = Model(NetConfig.from_dict(info["net"]), info["targets_width"])
    model.load_state_dict(state)
    save_checkpoint(tmp_path / "foundation", model, {"feature_spec": info["feature_spec"], "net": info["net"]})
    _, config = load_checkpoint(tmp_path / "foundation")
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    t = Training(ScenarioConfig("churn", CHURN, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, FINETUNE))
    job = scenario_job(cache, tmp_path / "foundation", config["weights_sha256"], t, "cpu")
    two = TrainingExecutor(device="cpu", processes=2, threads=1)
    clean = two.train(job, "cpu", log=lambda _: None)  # no saves at all

    folder, lines = tmp_path / "killed", []
    folder.mkdir()
    write_job(folder, with_resume({**job, "precision": "fp32"}, tmp_path / "resume", EVERY))
    restarting = TrainingExecutor(device="cpu", processes=2, threads=1, max_restarts=1)
    try:
        restarting.launch([str(Path(__file__).with_name("killed_launch.py")), str(folder)], log=lines.append,
                          env={"KILL_AFTER_SAVES": "10"})
    except ExecutorError as e:  # (the ranks' tracebacks, of both attempts)
        pytest.fail(f"{e}\n{rank_errors(folder)}")
    assert any("--max-restarts 1" in ln for ln in lines)
    resumed_at = [ln for ln in lines if "resuming from the state saved at step" in ln]
    assert resumed_at == [f"resuming from the state saved at step {10 * EVERY} in {tmp_path / 'resume' / 'latest'}"]
    resumed = read_result(folder)
    # the state it resumed from: two ranks' own positions, one of them mid-chunk or in another epoch's share
    saved = json.loads((tmp_path / "resume" / "latest" / "state.json").read_text())
    assert len(saved["ranks"]) == 2 and saved["step"] > 10 * EVERY

    for k, v in clean.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[k], v, rtol=0, atol=0, msg=k)
    assert resumed.curves == clean.curves
    assert {k: resumed.info[k] for k in ("best_epoch", "soup_epochs", "rows_seen", "processes")} == \
        {k: clean.info[k] for k in ("best_epoch", "soup_epochs", "rows_seen", "processes")}
