"""`kubernetes:` in the project config: Definitions with dagster-k8s's k8s_job_executor, and the
training assets' `dagster-k8s/config` op tags asking for GPUs, checked down to the Kubernetes Job
that dagster-k8s would create for a step (no cluster needed)."""

import json

import dagster as dg
import pytest
import yaml

from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.build import build_resources
from habitus.pipelines.orchestration.kubernetes import K8S_CONFIG_TAG, executor_config

CLUSTER = {"namespace": "habitus", "workspace_claim": "habitus-workspace", "max_concurrent": 4,
           "env_secrets": ["warehouse-credentials"], "node_selector": {"gpu": "true"},
           "foundation": {"gpus": 8, "cpu": "32", "memory": "256Gi"}, "scenarios": {"gpus": 1, "memory": "64Gi"}}
FOUNDATION, CHURN, CACHE = dg.AssetKey("foundation_model"), dg.AssetKey(["scenario", "churn"]), dg.AssetKey("cache")


def _project(tmp_path, kubernetes=None):
    cfg = {"workspace": "ws", "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}},
           "entity": "customer_id",
           "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                        "timestamp": "ts", "columns": ["product_id"], "start": "2026-03-01"}],
           "scenarios": {"churn": {"task": "binary", "target": {"no_event": "purchases", "within": "28d"}}}}
    if kubernetes is not None:
        cfg["kubernetes"] = kubernetes
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return load_project(tmp_path / "project.yaml")


def _pod(defs, key) -> dict:
    tags = defs.resolve_assets_def(key).op.tags
    return json.loads(tags[K8S_CONFIG_TAG]) if K8S_CONFIG_TAG in tags else {}


def test_without_kubernetes_nothing_changes(tmp_path):
    project = _project(tmp_path)
    defs = build_definitions(project)
    assert defs.resolve_job_def("train").executor_def.name != "k8s"
    assert _pod(defs, FOUNDATION) == {} and _pod(defs, CHURN) == {}
    assert build_resources(project)["executor"].processes == 1


def test_training_assets_ask_for_their_gpus(tmp_path):
    project = _project(tmp_path, CLUSTER)
    defs = build_definitions(project)
    foundation, churn = _pod(defs, FOUNDATION), _pod(defs, CHURN)
    assert foundation["container_config"]["resources"] == {"limits": {"nvidia.com/gpu": "8"},
                                                           "requests": {"cpu": "32", "memory": "256Gi"}}
    assert churn["container_config"]["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"memory": "64Gi"}}
    for pod in (foundation, churn):
        assert pod["pod_spec_config"]["node_selector"] == {"gpu": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
            pod["pod_spec_config"]["tolerations"]
    # several processes in one pod share memory through /dev/shm (NCCL): a Memory emptyDir there
    assert {"name": "dshm", "mount_path": "/dev/shm"} in foundation["container_config"]["volume_mounts"]
    assert "volume_mounts" not in churn["container_config"]
    assert _pod(defs, CACHE) == {}  # extraction and the cache stay on plain pods
    # each training pod trains with one process per GPU it got
    assert build_resources(project)["executor"].processes == 0
    workspace = executor_config(project)["volume_mounts"][0]
    assert workspace["mount_path"] == project.workspace and workspace["name"] == "habitus-workspace"


def test_bad_kubernetes_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="gpus"):
        _project(tmp_path, {"foundation": {"gpus": -1}})
    with pytest.raises(ConfigError, match="gpu_count"):
        _project(tmp_path, {"foundation": {"gpu_count": 8}})


def test_the_k8s_executor_and_the_step_job_it_would_create(tmp_path):
    pytest.importorskip("dagster_k8s")
    from dagster._config import process_config
    from dagster_k8s import k8s_job_executor
    from dagster_k8s.job import DagsterK8sJobConfig, construct_dagster_k8s_job, get_user_defined_k8s_config

    project = _project(tmp_path, CLUSTER)
    defs = build_definitions(project)
    for job in ("train", "train_scenarios", "score"):
        assert defs.resolve_job_def(job).executor_def.name == "k8s_habitus"
    config = executor_config(project)
    checked = process_config(k8s_job_executor.config_schema.config_type, config)
    assert checked.success, checked.errors
    assert config["job_namespace"] == "habitus" and config["max_concurrent"] == 4

    # the Job of the foundation step, as dagster-k8s's executor builds it from the op tag
    job_config = DagsterK8sJobConfig(job_image="habitus:latest", dagster_home="/opt/dagster/dagster_home",
                                     instance_config_map="dagster-instance", env_secrets=config["env_secrets"],
                                     volumes=config["volumes"], volume_mounts=config["volume_mounts"])
    tags = defs.resolve_assets_def(FOUNDATION).op.tags
    job = construct_dagster_k8s_job(job_config, ["dagster", "api", "execute_step"], "dagster-step-foundation",
                                    get_user_defined_k8s_config(tags), pod_name="dagster-step-foundation",
                                    component="step_worker")
    pod = job.spec.template.spec
    container = pod.containers[0]
    assert container.resources.limits == {"nvidia.com/gpu": "8"}
    assert container.resources.requests == {"cpu": "32", "memory": "256Gi"}
    assert {(m.name, m.mount_path) for m in container.volume_mounts} == {
        ("habitus-workspace", project.workspace), ("dshm", "/dev/shm")}
    volumes = {v.name: v for v in pod.volumes}
    assert volumes["habitus-workspace"].persistent_volume_claim.claim_name == "habitus-workspace"
    assert volumes["dshm"].empty_dir.medium == "Memory"
    assert pod.node_selector == {"gpu": "true"} and pod.tolerations[0].key == "nvidia.com/gpu"


def test_the_example_config_builds(monkeypatch):
    from pathlib import Path

    monkeypatch.delenv("HABITUS_WORKSPACE", raising=False)
    project = load_project(Path(__file__).resolve().parents[2] / "examples" / "k8s.yaml")
    assert project.kubernetes.foundation.gpus == 8 and project.kubernetes.scenarios.gpus == 1
    defs = build_definitions(project)
    assert _pod(defs, FOUNDATION)["container_config"]["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert executor_config(project)["volume_mounts"][0]["mount_path"] == "/data/workspace"
