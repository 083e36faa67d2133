"""A training on several Kubernetes nodes as an asset runs it (TrainingExecutor.train with
pipelines/kubernetes_nodes.run_group): the job folder written on the workspace, the headless Service and
the indexed Job created with the rendered specs, pod 0's log followed into the asset's log, rank 0's
result read, and both deleted after a success, a failure and a cancellation.

No API server can run here, so the Kubernetes API is a recorded fake (`Cluster`): the calls run_group
makes on the client's CoreV1Api and BatchV1Api, answered with the client's own models (V1Job,
V1JobStatus, V1PodList, V1Pod), the pod log streamed through the client's own `watch` as from a real
response. Its "kubelet" runs each pod's container command for real (sh -c, JOB_COMPLETION_INDEX set as
the Job controller sets it, the rendezvous on 127.0.0.1): two torchrun nodes train the foundation
together, which is what makes the result worth comparing."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from habitus.models.train.config import FoundationConfig
from habitus.models.train.launch import child_env
from habitus.models.train.recipe import foundation_job
from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.kubernetes_nodes import INDEX, GroupError, run_group, training_group
from habitus.resources.training.executor import TrainingExecutor

kubernetes = pytest.importorskip("kubernetes")
from kubernetes.client import V1Job, V1JobStatus, V1ObjectMeta, V1Pod, V1PodList, V1PodStatus  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[2]
SPAN, HORIZON = 100, 14
FOUNDATION = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=2, batch_size=16,
                              learning_rate=5e-3, buckets=32, seed=0, cutoffs_per_chunk=2, chunk_entities=40,
                              min_history_days=28)


class Response:
    """A streamed pod log as urllib3 hands it to kubernetes.watch: chunks of bytes until the pod ends."""

    def __init__(self, path: Path, proc: subprocess.Popen):
        self.path, self.proc = path, proc

    def stream(self, amt=None, decode_content=False):
        with open(self.path, "rb") as f:
            while True:
                chunk = f.read()
                if chunk:
                    yield chunk
                elif self.proc.poll() is not None:
                    yield f.read()
                    return
                else:
                    time.sleep(0.05)

    def release_conn(self):
        pass

    def close(self):
        pass


class Cluster:
    """The CoreV1Api and BatchV1Api calls of run_group, recorded in `calls`; create_namespaced_job runs
    the pods' container command as local processes, delete_namespaced_job kills them."""

    def __init__(self, tmp: Path, cancel_at_poll: int | None = None):
        self.tmp, self.calls, self.pods, self.polls, self.cancel_at_poll = tmp, [], {}, 0, cancel_at_poll
        self.service = self.job = None

    def create_namespaced_service(self, namespace, body):
        self.calls.append(("create_namespaced_service", namespace, body["metadata"]["name"]))
        self.service = body

    def create_namespaced_job(self, namespace, body):
        self.calls.append(("create_namespaced_job", namespace, body["metadata"]["name"]))
        self.job = body
        spec = body["spec"]["template"]["spec"]
        container = spec["containers"][0]
        env = child_env({e["name"]: e["value"] for e in container.get("env", [])})
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the image's python
        for i in range(body["spec"]["completions"]):
            log = self.tmp / f"pod-{i}.log"
            proc = subprocess.Popen(container["command"], cwd=ROOT, env={**env, "JOB_COMPLETION_INDEX": str(i)},
                                    stdout=open(log, "wb"), stderr=subprocess.STDOUT)
            self.pods[i] = (f"{body['metadata']['name']}-{i}-x7k2p", proc, log)

    def _phase(self, proc) -> str:
        return "Running" if proc.poll() is None else ("Succeeded" if proc.returncode == 0 else "Failed")

    def list_namespaced_pod(self, namespace, label_selector):
        assert label_selector == f"habitus/group={self.job['metadata']['name']}"
        return V1PodList(items=[V1Pod(metadata=V1ObjectMeta(name=name, annotations={INDEX: str(i)}),
                                      status=V1PodStatus(phase=self._phase(proc)))
                                for i, (name, proc, _) in self.pods.items()])

    def read_namespaced_job_status(self, name, namespace):
        self.polls += 1
        if self.polls == self.cancel_at_poll:  # the run cancelled: Dagster interrupts the step's thread
            raise KeyboardInterrupt
        phases = [self._phase(proc) for _, proc, _ in self.pods.values()]
        return V1Job(status=V1JobStatus(succeeded=phases.count("Succeeded") or None,
                                        failed=phases.count("Failed") or None))

    def read_namespaced_pod_log(self, name, namespace, follow=False, tail_lines=None, _preload_content=True):
        """:param follow: (as the client's docstring says it: kubernetes.watch streams a log on it)"""
        _, proc, log = next(p for p in self.pods.values() if p[0] == name)
        if not _preload_content:
            return Response(log, proc)
        return "\n".join(log.read_text().splitlines()[-(tail_lines or 0):])

    def delete_namespaced_job(self, name, namespace, propagation_policy):
        self.calls.append(("delete_namespaced_job", namespace, name))
        for _, proc, _ in self.pods.values():  # the Job's pods go with it
            proc.kill()
            proc.wait()

    def delete_namespaced_service(self, name, namespace):
        self.calls.append(("delete_namespaced_service", namespace, name))


def _project(tmp_path):
    cfg = {"workspace": str(tmp_path / "ws"),
           "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}}, "entity": "customer_id",
           "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                        "timestamp": "ts", "columns": ["product_id"], "start": "2026-03-01"}],
           "executor": {"threads": 1},
           "kubernetes": {"namespace": "habitus", "workspace_claim": "ws-claim", "image": "habitus:test",
                          "foundation": {"gpus": 0, "nodes": 2}}}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    return load_project(tmp_path / "project.yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(project, cluster, port, lines, **kw):
    """TrainingExecutor.train's `group`: the job folder on the workspace and run_group on the fake."""
    folder = Path(project.workspace, "jobs", "foundation-1")
    return folder, lambda job_dir, log: run_group(project, "foundation", job_dir, lambda ln: (lines.append(ln), log(ln)),
                                                  apis=(cluster, cluster), poll_s=0.2, name="habitus-foundation-1",
                                                  rdzv_host="127.0.0.1", port=port, **kw)


@pytest.fixture(scope="module")
def cache(module_sources):
    import numpy as np

    def purchases(rng, i):
        days = np.sort(rng.uniform(0, SPAN, rng.poisson(rng.uniform(0.1, 0.5) * SPAN)))
        return days, [f"p{j}" for j in rng.choice(5, len(days))], rng.gamma(2.0, 5.0, len(days)).round(2)

    return module_sources.build(module_sources.customer_events(160, purchases, seed=2), shard_events=1500)


def test_a_two_node_job_is_created_followed_read_and_deleted(cache, module_sources, tmp_path):
    project, cluster, lines, port = _project(tmp_path), Cluster(tmp_path), [], _free_port()
    job = foundation_job(cache, FOUNDATION, module_sources.at(SPAN - 2 * HORIZON), "cpu")
    result = TrainingExecutor(device="cpu").train(job, "cpu", log=lambda _: None,
                                                  group=_start(project, cluster, port, lines))
    folder = Path(project.workspace, "jobs", "foundation-1")
    # the rendered specs, created in the config's namespace, then both deleted (the Job first)
    service, spec = training_group(project, "foundation", 2, str(folder), name="habitus-foundation-1",
                                   rdzv_host="127.0.0.1", port=port)
    assert (cluster.service, cluster.job) == (service, spec)
    assert [c[0] for c in cluster.calls] == ["create_namespaced_service", "create_namespaced_job",
                                             "delete_namespaced_job", "delete_namespaced_service"]
    assert {c[1] for c in cluster.calls} == {"habitus"}
    # pod 0's log followed into the asset's log: rank 0's epochs
    assert sum("foundation epoch" in ln for ln in lines) == FOUNDATION.epochs
    # rank 0's result read back: the weights of 2 processes on one machine
    assert (folder / "job.json").exists() and result.info["processes"] == 2
    one = TrainingExecutor(device="cpu", processes=2, threads=1).train(job, "cpu", log=lambda _: None)
    for k, v in one.model.state_dict().items():
        assert torch.equal(result.model.state_dict()[k], v), k


def test_a_failed_job_is_deleted_and_its_pods_lines_quoted(tmp_path):
    project, cluster, lines = _project(tmp_path), Cluster(tmp_path), []
    folder = Path(project.workspace, "jobs", "empty")
    folder.mkdir(parents=True)  # no job.json: every rank fails reading it
    with pytest.raises(GroupError, match=r"(?s)Job habitus/habitus-foundation-1 failed.*pod habitus-foundation-1-"):
        _start(project, cluster, _free_port(), lines)[1](folder, lambda _: None)
    assert [c[0] for c in cluster.calls][-2:] == ["delete_namespaced_job", "delete_namespaced_service"]
    assert any("deleted" in ln for ln in lines)


def test_a_cancelled_run_deletes_the_job_and_its_pods(tmp_path):
    project, cluster, lines = _project(tmp_path), Cluster(tmp_path, cancel_at_poll=2), []
    folder = Path(project.workspace, "jobs", "cancelled")
    folder.mkdir(parents=True)
    with pytest.raises(KeyboardInterrupt):
        _start(project, cluster, _free_port(), lines)[1](folder, lambda _: None)
    assert [c[0] for c in cluster.calls] == ["create_namespaced_service", "create_namespaced_job",
                                             "delete_namespaced_job", "delete_namespaced_service"]
    assert all(proc.poll() is not None for _, proc, _ in cluster.pods.values())  # no pod left running
