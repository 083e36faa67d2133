"""The project config's operations sections: when runs happen (`schedules:`), how an extraction retries
a warehouse that failed for a moment (`retries:`), where steps run on a cluster (`kubernetes:`) and when
the realized-performance checks fire (`realized:`).
Part of the schema of pipelines/config/project.py."""

from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator

from habitus.pipelines.config.base import Strict


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
