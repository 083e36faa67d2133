"""A managed training job with two instances, simulated on loopback: two `habitus train` processes, each
with its own SageMaker host variables ($SM_HOSTS, $SM_CURRENT_HOST) and its own local disk, one shared
model folder (`output:`). Each extracts and caches the data itself, and the foundation's training runs
once across both (torchrun: one node each, the first host's rendezvous): both end with the weights two
processes on one machine train, and only the first host uploads. Then how the hosts are read."""

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
import torch

from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.storage.files import read_json
from habitus.models.train.config import FoundationConfig
from habitus.models.train.recipe import foundation_job
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.pipelines.run.managed import nodes
from habitus.resources.training.executor import TrainingExecutor

HOSTS = ["127.0.0.1", "localhost"]
HABITUS = str(Path(sys.executable).with_name("habitus"))  # the command of this environment


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_hosts_train_one_foundation_and_the_first_uploads(tmp_path, small_project):
    db = tmp_path / "warehouse.duckdb"
    generate_demo_warehouse(db, customers=200, products=30, stores=3, start="2026-07-01", end="2026-10-31", seed=5)
    channel = tmp_path / "warehouse"
    channel.mkdir()
    con = duckdb.connect(str(db), read_only=True)
    for table in ("purchases", "customers", "products"):
        con.sql(f"COPY {table} TO '{channel / table}.parquet' (FORMAT parquet)")
    con.close()
    config = small_project.write(tmp_path, small_project.config(
        events={"start": "2026-07-01", "end": "2026-11-01"}, foundation={"cutoff_every": "14d", "epochs": 2},
        workspace="${HABITUS_WORKSPACE}", output="${SM_MODEL_DIR}",
        connection={"type": "parquet", "path": str(channel)}, executor={"device": "cpu", "threads": 1}))
    port = _free_port()
    hosts = []
    for host in HOSTS:
        env = {**os.environ, "SM_HOSTS": json.dumps(HOSTS), "SM_CURRENT_HOST": host, "HABITUS_RDZV_PORT": str(port),
               "TRAINING_JOB_NAME": f"test-{port}", "HABITUS_WORKSPACE": str(tmp_path / host / "disk"),
               "SM_MODEL_DIR": str(tmp_path / "model"), "SM_OUTPUT_DIR": str(tmp_path / host / "output"),
               "OMP_NUM_THREADS": "1"}
        env.pop("DAGSTER_HOME", None)
        hosts.append(subprocess.Popen([HABITUS, "train", "--config", str(config),
                                       "--stage", "foundation"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in hosts]
    assert [p.returncode for p in hosts] == [0, 0], "\n\n".join(log[-4000:] for log in logs)
    assert "--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:" in logs[0]
    assert "--node-rank 1" in logs[1] and "node 1 of 2" in logs[1]

    # exactly one host uploaded: the first (the shared model folder's upload lines are in its log only)
    assert "foundation: " in logs[0] and "uploaded" in logs[0].split("foundation: ", 1)[1]
    assert "uploaded" not in logs[1]
    model = tmp_path / "model/checkpoints/foundation/model.safetensors"
    disks = [tmp_path / host / "disk" for host in HOSTS]
    assert model.read_bytes() == (disks[0] / "checkpoints/foundation/model.safetensors").read_bytes() == \
        (disks[1] / "checkpoints/foundation/model.safetensors").read_bytes()  # every node keeps the result

    # the same weights as 2 processes on one machine, trained on the first host's cache
    from habitus.models.cache import Cache

    state, trained = load_checkpoint(disks[0] / "checkpoints/foundation")
    cache_root = disks[0] / "cache"
    cache = Cache(cache_root / read_json(cache_root / "current.json")["folder"])
    cfg = FoundationConfig(**{**trained["config"], "half_lives": tuple(trained["config"]["half_lives"])})
    last_cutoff = _seconds(trained["data_window"]["last_cutoff"])
    one = TrainingExecutor(device="cpu", processes=2, threads=1).train(
        foundation_job(cache, cfg, last_cutoff, "cpu"), "cpu", log=lambda _: None)
    for k, v in one.model.state_dict().items():
        assert torch.equal(state[k], v), k


def _seconds(iso: str) -> int:
    import numpy as np

    return int(np.datetime64(iso.rstrip("Z"), "s").astype(np.int64))


def test_the_hosts_come_from_the_flags_the_variables_or_the_resource_config(tmp_path, monkeypatch):
    none = argparse.Namespace(nnodes=None, node_rank=None, rdzv=None)
    for k in ("SM_HOSTS", "SM_CURRENT_HOST", "HABITUS_RDZV_PORT", "TRAINING_JOB_NAME", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    missing = tmp_path / "resourceconfig.json"
    assert nodes(none, missing) is None  # one machine
    assert nodes(argparse.Namespace(nnodes=3, node_rank=2, rdzv="n0:29500"), missing) == {
        "nnodes": 3, "node_rank": 2, "rdzv_endpoint": "n0:29500", "rdzv_id": "habitus"}
    with pytest.raises(ValueError, match="all of --nnodes, --node-rank and --rdzv"):
        nodes(argparse.Namespace(nnodes=2, node_rank=None, rdzv=None), missing)
    with pytest.raises(ValueError, match="--node-rank 2 is not one of 0..1"):
        nodes(argparse.Namespace(nnodes=2, node_rank=2, rdzv="n0:1"), missing)

    missing.write_text(json.dumps({"current_host": "algo-2", "hosts": ["algo-1", "algo-2", "algo-3"]}))
    monkeypatch.setenv("TRAINING_JOB_NAME", "job-7")
    assert nodes(none, missing) == {"nnodes": 3, "node_rank": 1, "rdzv_endpoint": "algo-1:29400", "rdzv_id": "job-7"}
    monkeypatch.setenv("SM_HOSTS", '["algo-1", "algo-2"]')  # the variables first
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-1")
    monkeypatch.setenv("HABITUS_RDZV_PORT", "7000")
    assert nodes(none, missing)["node_rank"] == 0 and nodes(none, missing)["rdzv_endpoint"] == "algo-1:7000"
    monkeypatch.setenv("SM_CURRENT_HOST", "algo-9")
    with pytest.raises(ValueError, match=r"'algo-9' is not one of the job's hosts"):
        nodes(none, missing)
    monkeypatch.setenv("SM_HOSTS", '["algo-1"]')
    assert nodes(none, missing) is None  # one instance
