"""Two "nodes" of one process each, meeting at a c10d rendezvous on 127.0.0.1 (torchrun --nnodes 2
--rdzv-backend c10d), train the foundation model exactly as two processes on one node do
(--standalone --nproc_per_node 2): the same weights, bit for bit, and the same curves. Each node is
its own torchrun, started by TrainingExecutor.launch as a machine of a cluster would start it, on a
job folder both see (on a cluster: the shared workspace)."""

import socket
import threading

import numpy as np
import pytest
import torch

from habitus.models.train.launch import read_result, write_job
from habitus.models.train.recipe import foundation_job
from habitus.models.train.config import FoundationConfig
from habitus.resources.training.executor import ExecutorError, TrainingExecutor

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SPAN, HORIZON = 100, 14
FOUNDATION = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=2, batch_size=16,
                              learning_rate=5e-3, buckets=32, seed=0, cutoffs_per_chunk=2, chunk_entities=40,
                              min_history_days=28)


def _purchases(rng, i):
    days = np.sort(rng.uniform(0, SPAN, rng.poisson(rng.uniform(0.1, 0.5) * SPAN)))
    return days, [f"p{j}" for j in rng.choice(5, len(days))], rng.gamma(2.0, 5.0, len(days)).round(2)


@pytest.fixture(scope="module")
def cache(module_sources):
    return module_sources.build(module_sources.customer_events(160, _purchases, seed=2), shard_events=1500)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_train_like_two_processes_on_one(cache, tmp_path, module_sources):
    job = foundation_job(cache, FOUNDATION, module_sources.at(SPAN - 2 * HORIZON), "cpu")
    one_node = TrainingExecutor(device="cpu", processes=2, threads=1).train(job, "cpu", log=lambda _: None)

    port = _free_port()
    node = TrainingExecutor(device="cpu", processes=1, threads=1, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}",
                            rdzv_id=f"test-{port}")
    write_job(tmp_path, {**job, "precision": "fp32"})
    logs, errors = [[], []], []

    def start(i):
        try:
            node.launch(["-m", "habitus.models.train.launch", str(tmp_path)], log=logs[i].append)
        except Exception as e:  # noqa: BLE001 (reported below with the node's output)
            errors.append(f"node {i}: {e}")

    nodes = [threading.Thread(target=start, args=(i,)) for i in range(2)]
    for t in nodes:
        t.start()
    for t in nodes:
        t.join(timeout=600)
    assert not errors and not any(t.is_alive() for t in nodes), "\n".join(errors + logs[0][-20:] + logs[1][-20:])
    assert any("--nnodes 2 --rdzv-backend c10d" in line for line in logs[0])
    two_nodes = read_result(tmp_path, "cpu")

    assert two_nodes.info["processes"] == one_node.info["processes"] == 2
    assert two_nodes.info["weights_gap"] == 0.0
    for (name, a), (_, b) in zip(one_node.model.state_dict().items(), two_nodes.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert two_nodes.curves == one_node.curves
    assert two_nodes.info["steps"] == one_node.info["steps"]


def test_several_nodes_need_a_rendezvous_and_a_way_to_start_them(cache, module_sources):
    with pytest.raises(ExecutorError, match="nnodes 2 needs rdzv_endpoint as host:port"):
        TrainingExecutor(nnodes=2, rdzv_endpoint="node0").torchrun_command(["-m", "habitus.models.train.launch", "x"])
    job = foundation_job(cache, FOUNDATION, module_sources.at(SPAN - 2 * HORIZON), "cpu")
    # (started by `habitus train` on every node, or by the asset through Kubernetes: docs/clusters.md)
    with pytest.raises(ExecutorError, match=r"habitus train --nnodes 2 --node-rank R --rdzv HOST:PORT.*kubernetes"):
        TrainingExecutor(device="cpu", nnodes=2, rdzv_endpoint="node0:29400").train(job, "cpu")
