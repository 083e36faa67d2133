"""Dagster on Kubernetes: with `kubernetes:` in the project config every step (asset) runs as its own
Kubernetes Job through dagster-k8s's `k8s_job_executor`, and the training assets ask for GPUs
through their `dagster-k8s/config` op tag (docs/clusters.md).

    kubernetes:
      namespace: habitus
      workspace_claim: habitus-workspace      # ReadWriteMany PVC, mounted at the workspace path
      foundation: {gpus: 8, cpu: "32", memory: 256Gi}
      scenarios: {gpus: 1, cpu: "8", memory: 64Gi}

The training executor resource then trains with one process per GPU its pod got (`processes: 0`),
under torchrun when that is more than one. Nothing here needs a cluster to build: the tags are
plain dictionaries and dagster-k8s is imported only for the executor.
"""

from habitus.pipelines.config.project import ProjectConfig
from habitus.pipelines.config.operations import KubernetesSettings, TrainingPod

K8S_CONFIG_TAG = "dagster-k8s/config"  # dagster_k8s.job.USER_DEFINED_K8S_CONFIG_KEY
GPU = "nvidia.com/gpu"
WORKSPACE_VOLUME = "habitus-workspace"


def pod_config(pod: TrainingPod, k8s: KubernetesSettings) -> dict:
    """The `dagster-k8s/config` of a training step: its container's requests and GPU limit (GPUs are
    requested through limits), the GPU nodes' selector and taint toleration, and shared memory for
    the processes of one pod (NCCL moves data through /dev/shm, 64 MiB in a container otherwise)."""
    container: dict = {}
    requests = {k: v for k, v in (("cpu", pod.cpu), ("memory", pod.memory)) if v}
    resources = {"requests": requests} if requests else {}
    if pod.gpus:
        resources["limits"] = {GPU: str(pod.gpus)}
    if resources:
        container["resources"] = resources
    pod_spec: dict = {}
    if pod.gpus:
        pod_spec["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
        if k8s.node_selector:
            pod_spec["node_selector"] = dict(k8s.node_selector)
    if pod.gpus > 1:
        pod_spec["volumes"] = [{"name": "dshm", "empty_dir": {"medium": "Memory"}}]
        container["volume_mounts"] = [{"name": "dshm", "mount_path": "/dev/shm"}]
    config = {}
    if container:
        config["container_config"] = container
    if pod_spec:
        config["pod_spec_config"] = pod_spec
    return config


def pod_tags(project: ProjectConfig, stage: str) -> dict:
    """Op tags of a training asset (`stage`: foundation or scenarios): the GPU pod on Kubernetes,
    nothing otherwise."""
    if project.kubernetes is None:
        return {}
    config = pod_config(getattr(project.kubernetes, stage), project.kubernetes)
    return {K8S_CONFIG_TAG: config} if config else {}


def executor_config(project: ProjectConfig) -> dict:
    """The k8s_job_executor's config: namespace, image, concurrency, secrets and the workspace volume
    (every step pod mounts the same ReadWriteMany claim where the config puts the workspace)."""
    k8s = project.kubernetes
    config: dict = {}
    for key, value in (("job_namespace", k8s.namespace), ("job_image", k8s.image),
                       ("max_concurrent", k8s.max_concurrent), ("env_secrets", list(k8s.env_secrets) or None)):
        if value is not None:
            config[key] = value
    if k8s.workspace_claim:
        config["volumes"] = [{"name": WORKSPACE_VOLUME, "persistent_volume_claim": {"claim_name": k8s.workspace_claim}}]
        config["volume_mounts"] = [{"name": WORKSPACE_VOLUME, "mount_path": project.workspace}]
    return config


def k8s_executor(project: ProjectConfig):
    """dagster-k8s's k8s_job_executor with the project's settings."""
    try:
        from dagster_k8s import k8s_job_executor
    except ImportError as e:
        raise ImportError(f"the project config has `kubernetes:`, which runs steps with dagster-k8s; install it: "
                          f"pip install 'habitus[k8s]' ({e})") from e
    config = executor_config(project)
    return k8s_job_executor.configured(config, name="k8s_habitus") if config else k8s_job_executor
