"""One training job on several nodes, one pod each (pipelines/orchestration/kubernetes_nodes.py): the indexed Job
and headless Service rendered from `kubernetes:`, checked against the Kubernetes API's own models
(the kubernetes Python client, which dagster-k8s brings), their wiring (selector, subdomain, pod 0's
DNS name, anti-affinity, the shared claim), and the pods' command run for real: two "pods" on
loopback, told apart only by JOB_COMPLETION_INDEX, form one c10d group. No cluster runs here."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.kubernetes_nodes import GroupError, main, to_yaml, training_group

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = {"namespace": "habitus", "workspace_claim": "habitus-workspace", "node_selector": {"gpu": "true"},
           "foundation": {"gpus": 8, "cpu": "32", "memory": "256Gi"}, "scenarios": {"gpus": 1, "memory": "64Gi"}}
IMAGE = "registry.example.com/habitus-gpu:1.0"


def _project(tmp_path, kubernetes=CLUSTER, executor=None):
    cfg = {"workspace": "/data/workspace",
           "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}}, "entity": "customer_id",
           "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                        "timestamp": "ts", "columns": ["product_id"], "start": "2026-03-01"}],
           "scenarios": {"churn": {"task": "binary", "target": {"no_event": "purchases", "within": "28d"}}},
           "kubernetes": kubernetes}
    if executor:
        cfg["executor"] = executor
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return load_project(tmp_path / "project.yaml")


def _api_round_trip(manifest: dict) -> dict:
    """The manifest read into the client's model of its kind (V1Service, V1Job: required fields and
    types checked) and written back: a key the API does not know is dropped, so it no longer equals."""
    kubernetes = pytest.importorskip("kubernetes")

    class Response:
        data = json.dumps(manifest)

    api = kubernetes.client.ApiClient()
    model = {"Service": "V1Service", "Job": "V1Job"}[manifest["kind"]]
    return api.sanitize_for_serialization(api.deserialize(Response(), model))


def test_the_group_is_valid_kubernetes(tmp_path):
    service, job = training_group(_project(tmp_path), "foundation", 4, "/data/workspace/jobs/f1", image=IMAGE)
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    for manifest in (service, job):
        assert _api_round_trip(manifest) == manifest
    # the check sees a misspelled key, and a missing required field
    bad = json.loads(json.dumps(job))
    bad["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    assert _api_round_trip(bad) != bad
    del bad["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(ValueError, match="name"):
        _api_round_trip(bad)


def test_one_pod_per_node_wired_by_its_index(tmp_path):
    project = _project(tmp_path, executor={"threads": 6})
    service, job = training_group(project, "foundation", 4, "/data/workspace/jobs/f1", image=IMAGE, name="fm-1101")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    # the headless Service selects exactly the group's pods, and names them <job>-<index>.<service>
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= labels.items()
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"] == "fm-1101"
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == "habitus"
    # no two pods of the group on one node
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["labelSelector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    assert container["image"] == IMAGE and pod["restartPolicy"] == "Never"
    assert container["resources"] == {"requests": {"cpu": "32", "memory": "256Gi"}, "limits": {"nvidia.com/gpu": "8"}}
    assert container["env"] == [{"name": "OMP_NUM_THREADS", "value": "6"}]
    assert pod["nodeSelector"] == {"gpu": "true"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["habitus-workspace"]["persistentVolumeClaim"]["claimName"] == "habitus-workspace"
    assert {"name": "habitus-workspace", "mountPath": "/data/workspace"} in container["volumeMounts"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # torchrun on several nodes (its processes restarted up to 3 times, resuming), pod 0 hosting the store
    # at its DNS name
    command = container["command"][2]
    assert container["command"][:2] == ["sh", "-c"]
    assert ("python -m torch.distributed.run --nnodes 4 --rdzv-backend c10d --rdzv-endpoint fm-1101-0.fm-1101:29400 "
            "--rdzv-id fm-1101 --max-restarts 3 --rdzv-conf is_host=$HOST,read_timeout=600 --nproc_per_node 8 "
            "-m habitus.models.train.launch /data/workspace/jobs/f1") in command
    assert '"${JOB_COMPLETION_INDEX:?set by the indexed Job}" = 0 ]; then HOST=1; else HOST=0' in command
    assert container["ports"] == [{"name": "rendezvous", "containerPort": 29400}]

    # a scenario pod of one GPU: one process per node, no /dev/shm volume
    _, scenario = training_group(project, "scenarios", 2, "/data/workspace/jobs/s1", image=IMAGE)
    (container,) = scenario["spec"]["template"]["spec"]["containers"]
    assert "--nproc_per_node 1" in container["command"][2] and "dshm" not in json.dumps(container)
    assert scenario["metadata"]["name"] == "habitus-scenarios"


def test_what_a_group_cannot_do_is_refused(tmp_path):
    project = _project(tmp_path)
    with pytest.raises(GroupError, match="2 nodes or more"):
        training_group(project, "foundation", 1, "/data/workspace/jobs/x", image=IMAGE)
    with pytest.raises(GroupError, match="not under the workspace"):
        training_group(project, "foundation", 2, "/tmp/jobs/x", image=IMAGE)
    with pytest.raises(GroupError, match="no image"):
        training_group(project, "foundation", 2, "/data/workspace/jobs/x")
    with pytest.raises(GroupError, match="name 'Habitus_FM'"):
        training_group(project, "foundation", 2, "/data/workspace/jobs/x", image=IMAGE, name="Habitus_FM")
    with pytest.raises(GroupError, match="workspace_claim"):
        training_group(_project(tmp_path, {"foundation": {"gpus": 8}}), "foundation", 2, "/data/workspace/j",
                       image=IMAGE)


def test_the_committed_example_is_the_rendering_of_examples_k8s(monkeypatch, capsys):
    """deploy/k8s/foundation-2-nodes.yaml is what the CLI prints for examples/k8s.yaml."""
    for var in ("HABITUS_WORKSPACE", "HABITUS_K8S_NAMESPACE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["--config", str(ROOT / "examples" / "k8s.yaml"), "--nodes", "2", "--job-dir",
                 "/data/workspace/jobs/foundation-2026-11-01", "--image", IMAGE]) == 0
    printed = capsys.readouterr().out
    committed = (ROOT / "deploy" / "k8s" / "foundation-2-nodes.yaml").read_text()
    header = committed[:len(committed) - len(printed)]
    assert committed.endswith(printed) and all(line.startswith("#") for line in header.splitlines()), \
        "regenerate deploy/k8s/foundation-2-nodes.yaml (its header says how)"
    docs = list(yaml.safe_load_all(committed))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for manifest in docs:
        assert _api_round_trip(manifest) == manifest
    assert main(["--config", str(ROOT / "examples" / "k8s.yaml"), "--nodes", "2", "--job-dir", "/elsewhere",
                 "--image", IMAGE]) == 2


RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
open(os.path.join(sys.argv[1], f"pod-{os.environ['JOB_COMPLETION_INDEX']}"), "w").write(
    f"{dist.get_rank()} {dist.get_world_size()} {t.item()} {os.environ['GROUP_RANK']}")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_pods_told_apart_by_their_index_form_one_group(tmp_path):
    """Each "pod" runs the container's own `sh -c` command, on 127.0.0.1 in place of pod 0's DNS
    name; pod 1 starts first and waits for the store pod 0 hosts (is_host from the index)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script, out = tmp_path / "ranks.py", tmp_path / "out"
    script.write_text(RANK_SCRIPT)
    out.mkdir()
    project = _project(tmp_path, {**CLUSTER, "foundation": {"gpus": 0}})
    _, job = training_group(project, "foundation", 2, "/data/workspace/jobs/t", image=IMAGE, name=f"t{port}",
                            port=port, rdzv_host="127.0.0.1", target=[str(script), str(out)])
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    pods = []
    for index in (1, 0):
        pods.append(subprocess.Popen(container["command"], env={**env, "JOB_COMPLETION_INDEX": str(index)},
                                     cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if index == 1:
            try:  # pod 1 alone cannot finish: it waits for pod 0's store
                pods[0].wait(timeout=3)
                pytest.fail(f"pod 1 ran without pod 0: {pods[0].stdout.read()}")
            except subprocess.TimeoutExpired:
                pass
    logs = [p.communicate(timeout=300)[0] for p in pods]
    assert [p.returncode for p in pods] == [0, 0], "\n".join(logs)
    results = {i: (out / f"pod-{i}").read_text().split() for i in (0, 1)}
    assert sorted(r[0] for r in results.values()) == ["0", "1"]  # global ranks, one per pod
    assert all(r[1] == "2" and r[2] == "3.0" for r in results.values())  # one group of two, all_reduce across it
    assert sorted(r[3] for r in results.values()) == ["0", "1"]  # node (group) ranks from the rendezvous


def test_to_yaml_is_two_documents(tmp_path):
    text = to_yaml(training_group(_project(tmp_path), "foundation", 2, "/data/workspace/j", image=IMAGE))
    assert [d["kind"] for d in yaml.safe_load_all(text)] == ["Service", "Job"] and "&id" not in text
