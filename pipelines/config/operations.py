"""The project config's operations sections: where training and scoring run (`executor:`, which the command
line's flags and habitus.Project's arguments may override), when runs happen (`schedules:`), how an
extraction retries a warehouse that failed for a moment (`retries:`), where steps run on a cluster
(`kubernetes:`) and when the realized-performance checks fire (`realized:`).
Part of the schema of pipelines/config/project.py."""

import argparse
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from habitus.pipelines.config.base import Strict
from habitus.pipelines.config.file import ConfigError


Precision = Literal["fp32", "int8", "bf16"]


class ExecutorSettings(Strict):
    """Where training and scoring run (resources/training/executor.py); the CLI's --device, --processes,
    --precision and --inference-precision override these."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d+)$", description="auto, cpu, cuda or cuda:N")
    processes: int = Field(1, ge=0, description="training processes (torchrun when > 1); 0: one per visible GPU")
    threads: int | None = Field(None, ge=1, description="CPU threads of each process")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="training precision (bf16: autocast on GPUs)")
    inference_precision: Precision = Field("fp32", description="predictions and embeddings (int8: CPU only)")
    inference_processes: int | None = Field(None, ge=1, description="processes scoring predictions and embeddings "
                                            "(models/serve/parts.py); default one per GPU, or one per 2 CPU cores, "
                                            "while each gets 2 chunks of the cache")


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    """The command line's flags over `executor:` (`habitus materialize`, `demo`, `train`, `score`, `embed`)."""
    g = p.add_argument_group("executor (overrides the project's `executor:`)")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--processes", type=int, help="training processes (torchrun when > 1; 0: one per GPU)")
    g.add_argument("--threads", type=int, help="CPU threads per process")
    g.add_argument("--precision", choices=("fp32", "bf16"), help="training precision")
    g.add_argument("--inference-precision", choices=("fp32", "int8", "bf16"), help="predictions and embeddings")


def executor_settings(project) -> dict:
    """The project's `executor:` as the training executor takes it; unset: one process, or on Kubernetes
    one per GPU of the pod (pipelines/orchestration/kubernetes.py)."""
    return project.executor.model_dump() if project.executor else {"processes": 0 if project.kubernetes else 1}


def with_executor(project, args):
    """The project with the executor settings given on the command line (or as habitus.Project's
    arguments: any object with those attributes) put over its `executor:`."""
    given = {k: getattr(args, k, None) for k in ExecutorSettings.model_fields}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return project
    try:
        settings = ExecutorSettings(**{**executor_settings(project), **given})
    except ValidationError as e:
        bad = "; ".join(f"--{str(x['loc'][0]).replace('_', '-')}: {x['msg']}" for x in e.errors())
        raise ConfigError(f"executor settings on the command line: {bad}") from None
    return project.model_copy(update={"executor": settings})


def _cron(v: str) -> str:
    from dagster._utils.schedules import is_valid_cron_string  # dagster only when a config is validated

    if not isinstance(v, str) or not is_valid_cron_string(v):
        raise ValueError(f"expected a cron string of 5 fields such as '0 2 1 * *' (minute hour day month weekday), "
                         f"got {v!r}")
    return v


def _timezone(v: str) -> str:
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        ZoneInfo(v)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {v!r}; use an IANA name such as 'UTC' or 'Europe/Berlin'") from None
    return v


Cron = Annotated[str, BeforeValidator(_cron)]


class ScheduleSettings(Strict):
    """When retraining and scoring run (cron strings in `timezone`); each skips when its inputs are unchanged."""

    foundation: Cron = Field("0 2 1 * *", description="retrain the foundation model and its scenarios (monthly)")
    scenarios: Cron = Field("0 3 * * 1", description="retrain scenarios whose inputs changed (weekly, Mondays)")
    predictions: Cron = Field("0 5 * * *", description="score the previous day (daily)")
    timezone: Annotated[str, BeforeValidator(_timezone)] = Field("UTC", description="the cron strings' time zone")
    sensor_interval: int = Field(60, ge=5, description="seconds between two checks of a source for new data")
    running: bool = Field(False, description="start sensors, schedules and the cache automation switched on "
                                             "(otherwise switch them on in the UI)")


EXTRACT_RETRIES, EXTRACT_RETRY_DELAY_S = 3, 10.0


class RetrySettings(Strict):
    """How a source's extraction retries a transient warehouse error (a dropped connection, a restarting
    server, throttling; resources/warehouses/retries.py): `max_retries` more attempts of the step, the n-th after
    (2**n - 1) x `delay_s` seconds +- `delay_s` of jitter (10 s, 30 s, 70 s by default). Permanent errors
    (a refused login, a missing table or column, bad SQL) are never retried. Top level: every source;
    in a source: that source, key by key over the top level's."""

    max_retries: int = Field(EXTRACT_RETRIES, ge=0, le=20, description="retries of a failed extraction step "
                             "(0: fail on the first transient error)")
    delay_s: float = Field(EXTRACT_RETRY_DELAY_S, ge=0, le=3600, description="seconds before the first retry; "
                           "retry n waits (2**n - 1) times it")


class TrainingPod(Strict):
    gpus: int = Field(1, ge=0, description="GPUs (nvidia.com/gpu) of the step's pod; training runs one process "
                                           "per GPU it gets (torchrun when more than one)")
    cpu: str | None = Field(None, description="CPU request, a Kubernetes quantity ('8', '500m')")
    memory: str | None = Field(None, description="memory request, a Kubernetes quantity ('64Gi')")
    nodes: int = Field(1, ge=1, description="pods, one per node, that train together (an indexed Job and a "
                                            "headless Service the asset creates and deletes; docs/clusters.md)")


class KubernetesSettings(Strict):
    """Every asset runs as its own Kubernetes Job (dagster-k8s's k8s_job_executor); the training
    assets on pods with GPUs (docs/clusters.md). Needs `pip install 'habitus[k8s]'`."""
    namespace: str | None = Field(None, description="namespace of the step Jobs; default: the run's")
    image: str | None = Field(None, description="image of the step pods; default: the run's (the code location's)")
    workspace_claim: str | None = Field(None, description="a ReadWriteMany PersistentVolumeClaim mounted at the "
                                                          "workspace path in every step pod (the steps share it)")
    max_concurrent: int | None = Field(None, ge=1, description="step pods of one run at the same time")
    env_secrets: list[str] = Field(default_factory=list, description="Secrets whose keys become environment "
                                                                     "variables of every step pod (credentials)")
    node_selector: dict[str, str] = Field(default_factory=dict, description="node labels the GPU pods need")
    foundation: TrainingPod = Field(TrainingPod(), description="the foundation model's training pod")
    scenarios: TrainingPod = Field(TrainingPod(), description="each scenario's training pod")


class RealizedSettings(Strict):
    """When the checks of a scenario's realized performance fire (assets/realized.py, docs/guide/operations.md)."""

    days: int = Field(7, ge=1, description="the latest realized days the baseline check reads (L)")
    beaten_days: int = Field(3, ge=1, description="days of those on which the model is worse than its best "
                                                  "baseline before the check warns (K)")
    max_holdout_shortfall: float = Field(0.1, ge=0, description="how much worse than the serving version's "
                                         "hold-out metric a day's realized metric may be, as a share of the "
                                         "hold-out value, before the check fails (ERROR)")
    lightgbm: bool = Field(True, description="fit the LightGBM baseline again for each realized day (the "
                                             "serving version's cut-offs, scored as of the day)")

    @model_validator(mode="after")
    def _k_of_l(self):
        if self.beaten_days > self.days:
            raise ValueError(f"realized.beaten_days ({self.beaten_days}) is more than realized.days ({self.days})")
        return self
