"""The training executor resource: device and precision checks with messages that say what to
change, and a real two-process launch under torchrun (gloo on the CPU)."""

import pytest
import torch

from habitus.resources.training.executor import ExecutorError, TrainingExecutor


def test_cpu_device_threads_and_the_plain_precision():
    threads = torch.get_num_threads()
    try:
        assert TrainingExecutor(device="cpu", threads=1).setup() == "cpu"
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert TrainingExecutor().setup() == expected
    with TrainingExecutor(device="cpu").autocast("cpu"):
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.parametrize("settings, message", [
    ({"precision": "fp16"}, "precision 'fp16': choose one of"),
    ({"inference_precision": "int4"}, "inference_precision 'int4'"),
    ({"device": "tpu"}, "device 'tpu': choose auto, cpu, cuda"),
    ({"device": "cuda:1", "processes": 2}, "names one GPU but processes is 2"),
])
def test_settings_that_cannot_work_are_refused_with_the_fix(settings, message):
    with pytest.raises(ExecutorError, match=message):
        TrainingExecutor(**settings).setup()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_a_gpu_asked_for_without_one():
    with pytest.raises(ExecutorError, match="torch sees no CUDA device"):
        TrainingExecutor(device="cuda").setup()


def test_torchrun_command():
    cmd = TrainingExecutor(processes=4).torchrun_command(["-m", "habitus.models.train.distributed", "cpu"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m",
                       "habitus.models.train.distributed", "cpu"]
    # several nodes: the rendezvous, this node's rank, and torchrun's restarts (3 unless said)
    node = TrainingExecutor(processes=2, nnodes=3, node_rank=1, rdzv_endpoint="n0:29400", rdzv_id="j7")
    assert node.torchrun_command(["x.py"])[3:] == ["--nnodes", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                                   "n0:29400", "--rdzv-id", "j7", "--node-rank", "1",
                                                   "--max-restarts", "3", "--nproc_per_node", "2", "x.py"]
    assert "--max-restarts" not in TrainingExecutor(processes=2, nnodes=2, rdzv_endpoint="n0:1",
                                                    max_restarts=0).torchrun_command(["x.py"])
    with pytest.raises(ExecutorError, match="an asset starts the nodes through `habitus train --nnodes 2"):
        TrainingExecutor(device="cpu", nnodes=2, rdzv_endpoint="n0:1").train({}, "cpu")


@pytest.mark.slow
def test_launch_runs_every_rank_and_reports_a_failure():
    lines = []
    TrainingExecutor(device="cpu", processes=2, threads=1).launch(["-m", "habitus.models.train.distributed", "cpu"], log=lines.append)
    assert sorted(ln for ln in lines if "all-reduce ok" in ln) == ["rank 0/2 on cpu: all-reduce ok",
                                                                  "rank 1/2 on cpu: all-reduce ok"]
    with pytest.raises(ExecutorError, match="torchrun exited with status 1 .*no_such_module"):
        TrainingExecutor(device="cpu", processes=2, threads=1).launch(["-m", "no_such_module"], log=lambda _: None)


def test_several_processes_are_set_up_for_the_assets_to_launch():
    """processes > 1: setup() checks and returns the device; the assets then launch torchrun
    (TrainingExecutor.train; tests/models/test_launch.py, tests/assets/test_distributed_training.py)."""
    executor = TrainingExecutor(device="cpu", processes=2)
    assert executor.setup() == "cpu" and executor.distributed
    assert not TrainingExecutor(device="cpu").distributed
    # 0: one process per visible GPU (a Kubernetes pod's request), one on a CPU
    assert TrainingExecutor(device="cpu", processes=0).process_count == 1
