"""One training job on several Kubernetes nodes, one pod per node: an indexed Job plus the headless
Service that gives its pods stable DNS names, rendered from the project config's `kubernetes:` and
`executor:` sections (docs/clusters.md, "Several machines on Kubernetes").

    python -m habitus.pipelines.orchestration.kubernetes_nodes --config examples/k8s.yaml --stage foundation --nodes 2 \\
        --job-dir /data/workspace/jobs/foundation-2026-11-01 --image registry.example.com/habitus-gpu:1.0 \\
        | kubectl apply -f -

Every pod runs the command habitus.resources.training.executor.TrainingExecutor.torchrun_command builds for several nodes: `torchrun --nnodes N --rdzv-backend c10d ... -m habitus.models.train.launch JOB_DIR`, with
`kubernetes.<stage>.gpus` processes per pod. The pod index (JOB_COMPLETION_INDEX, set by the Job
controller) wires the rendezvous: pod 0 hosts the c10d store (`--rdzv-conf is_host=1`), the others
join it at `<name>-0.<name>:<port>`, pod 0's name under the Service; the global ranks are then given
by the rendezvous, DDP and the entity sharding as on one node. JOB_DIR (job.json in, rank 0's
`result` out) must be on the shared workspace claim every pod mounts.

Why an indexed Job and not the Kubeflow training operator's PyTorchJob: it is batch/v1, on every
cluster since Kubernetes 1.24, with nothing to install or upgrade (the training operator's v1 CRDs are
being replaced by Kubeflow Trainer's TrainJob); torchrun's c10d rendezvous already does what the
operator's MASTER_ADDR/RANK wiring does, and torchrun's --max-restarts restarts the processes of a pod,
which resume from the last saved step (models/train/resume.py): a failed pod fails the Job (backoffLimit
0, no pod restarts) and the whole group is run again, resuming too. Required pod anti-affinity
on the node's hostname keeps it one pod per node.

`run_group` is what a training asset runs with `kubernetes.<stage>.nodes` above 1 (through
TrainingExecutor.train's `nodes`): it writes the job folder on the workspace claim, creates the Service
and the Job with the `kubernetes` client (dagster-k8s brings it), follows pod 0's log (rank 0's lines)
into the asset's log, waits for the Job, and deletes both whatever happens: success, failure, or the
run cancelled (Dagster interrupts the step: the `finally` still runs). The asset then reads rank 0's
result from the job folder.
"""

import argparse
import re
import sys
import threading
import time
from pathlib import Path, PurePosixPath
from typing import Callable

import yaml

from habitus.pipelines.config.file import ConfigError
from habitus.pipelines.config.project import ProjectConfig, load_project
from habitus.pipelines.orchestration.kubernetes import GPU, WORKSPACE_VOLUME
from habitus.resources.training.executor import TrainingExecutor

RDZV_PORT = 29400
GROUP_LABEL = "habitus/group"
# a name becomes the Job's, the Service's and (with "-<index>") each pod's hostname: DNS-1123 labels
_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


class GroupError(ValueError):
    pass


def node_command(nodes: int, processes: int, endpoint: str, rdzv_id: str, target: list[str]) -> str:
    """The shell command of every pod: torchrun as TrainingExecutor builds it for `nodes` machines,
    pod 0 (by JOB_COMPLETION_INDEX) hosting the c10d store; every store read may wait for pod 0 as
    long as a join does (a pod scheduled later, an image still pulling)."""
    cmd = TrainingExecutor(device="auto", processes=processes, nnodes=nodes, rdzv_endpoint=endpoint,
                           rdzv_id=rdzv_id).torchrun_command(target)
    # the image's python (PATH=/opt/venv/bin:...), not this process's
    argv = ["python", *cmd[1:]]
    at = argv.index("--nproc_per_node")
    argv[at:at] = ["--rdzv-conf", "is_host=$HOST,read_timeout=600"]
    quoted = " ".join(a if re.fullmatch(r"[\w./:=,$@%+-]+", a) else "'" + a.replace("'", "'\\''") + "'" for a in argv)
    return ('if [ "${JOB_COMPLETION_INDEX:?set by the indexed Job}" = 0 ]; then HOST=1; else HOST=0; fi; '
            f"exec {quoted}")


def training_group(project: ProjectConfig, stage: str, nodes: int, job_dir: str, *, name: str | None = None,
                   image: str | None = None, port: int = RDZV_PORT, rdzv_host: str | None = None,
                   target: list[str] | None = None) -> list[dict]:
    """[Service, Job]: `nodes` pods of `kubernetes.<stage>` (foundation or scenarios: GPUs, CPU and
    memory per pod), each running torchrun on JOB_DIR. `rdzv_host` replaces pod 0's DNS name (a test
    on loopback); `target` replaces `-m habitus.models.train.launch JOB_DIR`."""
    k8s = project.kubernetes
    if k8s is None:
        raise GroupError("the project config has no `kubernetes:` section")
    if stage not in ("foundation", "scenarios"):
        raise GroupError(f"stage {stage!r}: choose foundation or scenarios")
    if nodes < 2:
        raise GroupError(f"nodes {nodes}: a group is 2 nodes or more (one node: the Dagster step's own pod)")
    if not k8s.workspace_claim:
        raise GroupError("every node reads the job folder and rank 0 writes its result there: set "
                         "kubernetes.workspace_claim (a ReadWriteMany claim mounted at the workspace)")
    workspace = PurePosixPath(project.workspace)
    if not PurePosixPath(job_dir).is_relative_to(workspace):
        raise GroupError(f"job folder {job_dir} is not under the workspace {workspace}, the one folder every pod "
                         f"mounts")
    image = image or k8s.image
    if not image:
        raise GroupError("no image: set kubernetes.image or pass --image")
    name = name or f"habitus-{stage}"
    if not _NAME.fullmatch(name) or len(name) + 1 + len(str(nodes - 1)) > 63:
        raise GroupError(f"name {name!r}: lowercase letters, digits and '-', starting with a letter, at most "
                         f"{62 - len(str(nodes - 1))} characters (each pod's hostname is <name>-<index>)")
    pod = getattr(k8s, stage)
    processes = max(pod.gpus, 1)
    host = rdzv_host or f"{name}-0.{name}"
    command = node_command(nodes, processes, f"{host}:{port}", name, target or ["-m", "habitus.models.train.launch", job_dir])
    threads = project.executor.threads if project.executor else None

    labels = {"app.kubernetes.io/name": "habitus", "app.kubernetes.io/component": f"{stage}-training",
              GROUP_LABEL: name}

    def meta():
        return {"name": name, **({"namespace": k8s.namespace} if k8s.namespace else {}), "labels": dict(labels)}

    resources: dict = {}
    requests = {k: v for k, v in (("cpu", pod.cpu), ("memory", pod.memory)) if v}
    if requests:
        resources["requests"] = requests
    if pod.gpus:
        resources["limits"] = {GPU: str(pod.gpus)}
    mounts = [{"name": WORKSPACE_VOLUME, "mountPath": str(workspace)}]
    volumes = [{"name": WORKSPACE_VOLUME, "persistentVolumeClaim": {"claimName": k8s.workspace_claim}}]
    if pod.gpus > 1:  # NCCL between the processes of one pod: /dev/shm is 64 MiB in a container otherwise
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    container = {"name": "trainer", "image": image, "workingDir": "/app", "command": ["sh", "-c", command],
                 "ports": [{"name": "rendezvous", "containerPort": port}], "volumeMounts": mounts}
    if threads:  # what the asset's launch sets for its ranks
        container["env"] = [{"name": "OMP_NUM_THREADS", "value": str(threads)}]
    if resources:
        container["resources"] = resources
    spec: dict = {
        "subdomain": name,  # with the Service of that name: <name>-<index>.<name> resolves to pod <index>
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": volumes,
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {GROUP_LABEL: name}}, "topologyKey": "kubernetes.io/hostname"}]}},
    }
    if pod.gpus:
        spec["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
        if k8s.node_selector:
            spec["nodeSelector"] = dict(k8s.node_selector)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": meta(), "spec": {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,  # pod 0's name resolves as soon as it has an address
        "selector": {GROUP_LABEL: name},
        "ports": [{"name": "rendezvous", "port": port, "targetPort": port}]}}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(), "spec": {
        "completionMode": "Indexed",
        "completions": nodes,
        "parallelism": nodes,  # all at once: the rendezvous waits for every node
        "backoffLimit": 0,  # a failed pod fails the group; its processes' restarts are torchrun's (--max-restarts)
        "template": {"metadata": {"labels": dict(labels)}, "spec": spec}}}
    return [service, job]


def group_of(project: ProjectConfig, stage: str, what: str):
    """TrainingExecutor.train's `group` for a training of `stage` (`what`: foundation, or the scenario's
    name) when `kubernetes.<stage>.nodes` is above 1: a job folder on the workspace and run_group; else None."""
    k8s = project.kubernetes
    if k8s is None or getattr(k8s, stage).nodes < 2:
        return None
    folder = Path(project.workspace, "jobs", f"{what}-{time.strftime('%Y%m%dT%H%M%S')}")
    name = re.sub(r"[^a-z0-9-]+", "-", f"habitus-{what}".lower())[:40].rstrip("-") + f"-{int(time.time()) % 10**8}"
    return folder, lambda job_dir, log: run_group(project, stage, job_dir, log, name=name)


INDEX = "batch.kubernetes.io/job-completion-index"  # the pod's index, as the Job controller annotates it


def run_group(project: ProjectConfig, stage: str, job_dir: Path, log: Callable[[str], None] = print, *, apis=None,
              poll_s: float = 5.0, name: str | None = None, **render) -> None:
    """Train the job in `job_dir` (job.json written, on the workspace claim) on `kubernetes.<stage>.nodes`
    pods: create the Service and the indexed Job (training_group), stream pod 0's log to `log`, return when
    the Job succeeds, raise with the failed pods' last lines when it fails; delete both in every case.
    `apis`: (CoreV1Api, BatchV1Api), default the client's, configured in the cluster or from kubeconfig;
    `render`: training_group's other arguments (image, port, rdzv_host, target)."""
    nodes = getattr(project.kubernetes, stage).nodes
    name = name or f"habitus-{stage}-{int(time.time())}"
    service, job = training_group(project, stage, nodes, str(job_dir), name=name, **render)
    core, batch = apis or _apis()
    namespace = project.kubernetes.namespace or _namespace()
    created = []
    try:
        core.create_namespaced_service(namespace, service)
        created.append(("service", name))
        batch.create_namespaced_job(namespace, job)
        created.append(("job", name))
        log(f"kubernetes: Job {namespace}/{name} created: {nodes} pods of {stage} training, one per node")
        follower = None
        while True:
            status = batch.read_namespaced_job_status(name, namespace).status
            if follower is None:
                pod = _pod(core, namespace, name, "0")
                if pod is not None and pod.status.phase in ("Running", "Succeeded", "Failed"):
                    follower = threading.Thread(target=_follow, args=(core, namespace, pod.metadata.name, log),
                                                daemon=True)
                    follower.start()
            if status.failed:
                raise GroupError(f"kubernetes: Job {namespace}/{name} failed:\n" + _failed_lines(core, namespace, name))
            if (status.succeeded or 0) >= nodes:
                if follower is not None:
                    follower.join(timeout=60)  # (pod 0's last lines)
                log(f"kubernetes: Job {namespace}/{name} succeeded")
                return
            time.sleep(poll_s)
    finally:
        _delete(core, batch, namespace, created, log)


def _apis():
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api(), client.BatchV1Api()


def _namespace() -> str:
    own = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")  # the pod's own, in a cluster
    return own.read_text().strip() if own.exists() else "default"


def _pod(core, namespace: str, name: str, index: str):
    pods = core.list_namespaced_pod(namespace, label_selector=f"{GROUP_LABEL}={name}").items
    return next((p for p in pods if (p.metadata.annotations or {}).get(INDEX) == index), None)


def _follow(core, namespace: str, pod: str, log) -> None:
    """Pod 0's log, line by line, until it ends (its ranks' output: rank 0 logs the epochs)."""
    from kubernetes import watch

    try:
        for line in watch.Watch().stream(core.read_namespaced_pod_log, pod, namespace, follow=True):
            log(line)
    except Exception as e:  # noqa: BLE001 (the log is a view; the Job's status decides)
        log(f"kubernetes: following the log of {pod} stopped ({type(e).__name__}: {e})")


def _failed_lines(core, namespace: str, name: str) -> str:
    pods = core.list_namespaced_pod(namespace, label_selector=f"{GROUP_LABEL}={name}").items
    out = []
    for p in pods:
        if p.status.phase == "Failed":
            tail = core.read_namespaced_pod_log(p.metadata.name, namespace, tail_lines=20)
            out.append(f"pod {p.metadata.name} (index {(p.metadata.annotations or {}).get(INDEX)}):\n{tail}")
    return "\n".join(out) or "(no failed pod left to read)"


def _delete(core, batch, namespace: str, created: list, log) -> None:
    """What run_group created, newest first; the Job with its pods (background propagation)."""
    for kind, name in reversed(created):
        try:
            if kind == "job":
                batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
            else:
                core.delete_namespaced_service(name, namespace)
            log(f"kubernetes: {kind} {namespace}/{name} deleted")
        except Exception as e:  # noqa: BLE001 (the others are still deleted; what failed is said)
            log(f"kubernetes: deleting {kind} {namespace}/{name} failed ({type(e).__name__}: {e}); delete it by hand")


def to_yaml(manifests: list[dict]) -> str:
    return "---\n".join(yaml.safe_dump(m, sort_keys=False, width=120) for m in manifests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m habitus.pipelines.orchestration.kubernetes_nodes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="project YAML with `kubernetes:` (default: $HABITUS_CONFIG)")
    parser.add_argument("--stage", choices=["foundation", "scenarios"], default="foundation",
                        help="whose pod size (kubernetes.<stage>) each node gets")
    parser.add_argument("--nodes", type=int, required=True, help="pods, one per node (2 or more)")
    parser.add_argument("--job-dir", required=True, help="the job folder on the shared workspace (job.json)")
    parser.add_argument("--name", help="Job and Service name (default: habitus-<stage>); also the rendezvous id")
    parser.add_argument("--image", help="default: kubernetes.image")
    parser.add_argument("--port", type=int, default=RDZV_PORT, help="the c10d store's port on pod 0")
    args = parser.parse_args(argv)
    try:
        project = load_project(args.config)
        manifests = training_group(project, args.stage, args.nodes, args.job_dir, name=args.name, image=args.image,
                                   port=args.port)
    except (ConfigError, GroupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(to_yaml(manifests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
