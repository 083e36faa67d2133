"""The project config: one YAML file parsed into typed objects.

Errors name the file, the key path and what was expected. Secrets are never written in the file:
`${VAR}` (or `${VAR:-default}`) is replaced from the environment before parsing. Relative paths
resolve against the config file's folder, so a project folder can be moved as a whole.
"""

import dataclasses
import os
import re
import warnings
from datetime import date, timedelta
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BeforeValidator, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from habitus.models.cache import DUCKDB_MEMORY, DUCKDB_THREADS, PART_EVENTS
from habitus.models.serve.defaults import DEFAULT_SELECT, DEFAULT_SHARE, DEFAULT_STEPS, DEFAULT_TOP, SELECT, TOP_K
from habitus.models.train.config import (REFIT, SAVE_EVERY_STEPS, TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig,
                                         LoraConfig)
from habitus.models.tasks import RANKING_K, TASKS
from habitus.pipelines.config.base import Strict
from habitus.pipelines.config.operations import (ExecutorSettings, KubernetesSettings, Precision, RealizedSettings,
                                                RetrySettings, ScheduleSettings)
from habitus.pipelines.config.file import CONFIG_ENV, ConfigError, format_errors, read_yaml, resolve_path
from habitus.pipelines.config.tracking import MlflowSettings
from habitus.resources.store.redaction import redact_url

DEFAULT_CONFIG = "examples/demo.yaml"
_DURATION = re.compile(r"^\s*(\d+)\s*([dw])\s*$")


def parse_duration(text: str) -> timedelta:
    """'14d' or '2w' -> timedelta. Windows are whole days: the model's clock is daily cut-offs."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"expected a duration such as '14d' or '2w', got {text!r}")
    n, unit = int(m.group(1)), m.group(2)
    return timedelta(days=n * (7 if unit == "w" else 1))


def _to_days(v) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    days = parse_duration(v).days
    if days <= 0:
        raise ValueError(f"expected a positive duration such as '14d', got {v!r}")
    return days


# Durations are written '14d' / '2w' and held as whole days.
Duration = Annotated[int, BeforeValidator(_to_days)]


from habitus.pipelines.config.sources import (ColumnType, Connection, DuckDBConnection, ParquetConnection,  # noqa: F401
                                              Source, WarehouseConnection)


# --------------------------------------------------------------------------- models


_FOUNDATION, _FINETUNE, _LORA = FoundationConfig(), FinetuneConfig(), LoraConfig()  # the defaults: models/train/config.py


class FoundationSettings(Strict):
    horizon: Duration = Field(_FOUNDATION.horizon_days, description="the window after each cut-off the "
                              "foundation model learns to forecast (acts, how much, which values)")
    cutoff_every: Duration = Field(_FOUNDATION.cutoff_every_days, description="spacing of the sampled training "
                                   "cut-offs")
    hidden: int = Field(_FOUNDATION.hidden, ge=8, description="width of the residual MLP trunk (and of the "
                        "embeddings' trunk part)")
    layers: int = Field(_FOUNDATION.layers, ge=1, description="residual blocks of the trunk")
    epochs: int = Field(_FOUNDATION.epochs, ge=1, description="passes over the training cut-offs")
    batch_size: int = Field(_FOUNDATION.batch_size, ge=8, description="entities per optimizer step")
    learning_rate: float = Field(_FOUNDATION.learning_rate, gt=0, description="AdamW's learning rate")
    buckets: int = Field(_FOUNDATION.buckets, ge=8, description="histogram width per categorical column")
    related_buckets: bool = Field(_FOUNDATION.related_buckets, description="a column with more values than "
                                  "buckets shares its last quarter among groups of values bought together "
                                  "(co-occurrence clusters; false: by id, at random; docs/models.md)")
    contrastive: float = Field(_FOUNDATION.contrastive_weight, ge=0, description="weight of the contrastive "
                               "objective beside the forecast: each entity told apart from the others of its "
                               "batch by half of its history (0: off; docs/models.md)")
    seed: int = Field(_FOUNDATION.seed, description="random seed of the initialization and the data order")
    save_every_steps: int = Field(SAVE_EVERY_STEPS, ge=1, description="optimizer steps between two saves of the "
                                  "resumable training state (a killed run continues from the last)")
    sequence_events: int = Field(_FOUNDATION.sequence_events, ge=0, le=1024, description="the last events of each "
                                 "entity the trunk's sequence encoder reads (0: the aggregate trunk alone; "
                                 "docs/models.md)")
    masked_events: float = Field(_FOUNDATION.masked_events, ge=0, lt=1, description="share of those events masked "
                                 "and predicted while the foundation trains (0: the next-window forecast alone)")

    def config(self) -> FoundationConfig:
        """The models-level settings of this section (the one translation: assets, CLI and benchmarks use it)."""
        return dataclasses.replace(_FOUNDATION, horizon_days=self.horizon, cutoff_every_days=self.cutoff_every,
                                   hidden=self.hidden, layers=self.layers, epochs=self.epochs,
                                   batch_size=self.batch_size, learning_rate=self.learning_rate,
                                   buckets=self.buckets, related_buckets=self.related_buckets,
                                   contrastive_weight=self.contrastive, seed=self.seed,
                                   sequence_events=self.sequence_events,
                                   masked_events=self.masked_events)


class CacheSettings(Strict):
    """How the cache build runs (never what it writes: these leave its bytes and fingerprint alone)."""
    duckdb_memory: str = Field(DUCKDB_MEMORY, pattern=r"^\s*\d+(\.\d+)?\s*[KMGT]i?B\s*$",
                               description="DuckDB's memory limit during the build ('2GB'); beyond it, it spills "
                                           "into the workspace")
    duckdb_threads: int | None = Field(DUCKDB_THREADS, ge=1, description="DuckDB threads; default one per core")
    part_events: int = Field(PART_EVENTS, ge=1, description="events sorted at a time (~150 MB of sort at 2M)")

    def build_options(self) -> dict:
        """The keyword arguments of habitus.models.cache.build_cache."""
        return {"duckdb_memory": self.duckdb_memory, "duckdb_threads": self.duckdb_threads,
                "part_events": self.part_events}


class NoEventTarget(Strict):
    no_event: str = Field(description="binary (churn): 1 when the entity has no event of this events source "
                                      "within `within` after the cut-off")
    within: Duration = Field(description="the window after the cut-off")
    active_within: Duration = Field(90, description="only entities with an event within this window before the "
                                                    "cut-off are scored (the others have already lapsed)")


class AnyEventTarget(Strict):
    any_event: str = Field(description="multilabel / multiclass: the events source whose values within "
                                       "`within` are the labels")
    by: str = Field(description="the categorical column whose values are the labels (brand, category)")
    within: Duration = Field(description="the window after the cut-off")
    top: int = Field(50, ge=1, description="the labels are the `top` most frequent values of `by`")


class SumTarget(Strict):
    sum: str = Field(description="<events source>.<numeric column>, or <events source> to count events")
    within: Duration = Field(description="the window after the cut-off")


class ItemsTarget(Strict):
    items: str = Field(description="<events source>.<categorical column>")
    within: Duration = Field(description="the window after the cut-off")


class FunctionTarget(Strict):
    function: str = Field(pattern=r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$",
                          description="package.module:function, called with (history, future, entities) Arrow "
                                      "tables; see models/data/target_functions.py")
    within: Duration = Field(description="the window after the cut-off the function reads")
    by: str | None = Field(None, description="label tasks: the categorical column whose values the function "
                                             "returns (multiclass: one per entity; multilabel, recommendation: a list)")
    top: int = Field(50, ge=1, description="multilabel / multiclass: the labels are the top values of `by`")


_TARGET_KEYS = {NoEventTarget: "no_event", AnyEventTarget: "any_event", SumTarget: "sum", ItemsTarget: "items",
                FunctionTarget: "function"}


def _target_kind(v) -> str | None:
    if isinstance(v, dict):
        return next((k for k in _TARGET_KEYS.values() if k in v), None)
    return _TARGET_KEYS.get(type(v))


# One clear error for a target of unknown shape instead of one per possible shape.
Target = Annotated[
    Union[tuple(Annotated[cls, Tag(key)] for cls, key in _TARGET_KEYS.items())],
    Discriminator(_target_kind, custom_error_type="target_kind",
                  custom_error_message="a target needs one of the keys no_event, any_event, sum, items, function"),
]


class LoraSettings(Strict):
    rank: int = Field(_LORA.rank, ge=1, description="rank of the adapters on the frozen trunk (models/nn/lora.py)")
    alpha: float = Field(_LORA.alpha, gt=0, description="scale of the adapters' update (alpha / rank)")


class ExplainSettings(Strict):
    """explanations/<scenario>: each entity's top reasons, daily (assets/explanations.py)."""
    top: int = Field(DEFAULT_TOP, ge=1, le=50, description="reasons kept per entity and score")
    steps: int = Field(DEFAULT_STEPS, ge=2, le=256, description="integration steps; scores whose completeness gap is over 1% "
                       "are integrated again at up to 64 (docs/explanations.md: cost and precision)")
    select: Literal[SELECT] = Field(DEFAULT_SELECT, description="which scored entities are explained: the "
                                                   "`share` with the highest scores, a random `share`, or all")
    share: float = Field(DEFAULT_SHARE, gt=0, le=1, description="the share of the scored entities explained (select: top | sample)")
    labels: list[str] = Field(default_factory=list, description="multilabel / multiclass: the labels explained for "
                                                                "every entity; default: each entity's `per_entity` best")
    per_entity: int | None = Field(None, ge=1, le=50, description="label heads: best labels, classes or items explained; "
                                   "default 1 for multiclass (the predicted class), else 3")
    write_back: bool = Field(False, description="also write to <predictions.sink.table>_<scenario>_explanations")


class Scenario(Strict):
    task: Literal[tuple(TASKS)] = Field(description="the task type (models/tasks/); it decides the targets "
                                                    "it takes, the metric and the baselines")
    explain: ExplainSettings | None = Field(None, description="write explanations/<scenario> daily ({top: 5})")
    lora: LoraSettings | None = Field(None, description="fine-tune LoRA adapters on the frozen trunk, not all weights")
    inference_precision: Precision | None = Field(None, description="this scenario's predictions; default: the "
                                                                    "executor's")
    head: Literal["chosen", "network"] = Field(
        "chosen", description="chosen: the fine-tuned network, LightGBM over hand features + the foundation's "
        "representation, or their blend, whichever scores best on the validation cut-off (binary, regression, "
        "multilabel); network: the network alone (scoring about 1.7x faster)")
    target: Target = Field(description="what is predicted: one of the target shapes below")
    epochs: int = Field(_FINETUNE.epochs, ge=1, description="fine-tuning epochs at most (the weights of the "
                        "epochs that lower the validation loss are averaged)")
    learning_rate: float = Field(_FINETUNE.learning_rate, gt=0, description="fine-tuning learning rate")
    train_cutoffs: int = Field(TRAIN_CUTOFFS, ge=1, description="training cut-offs before the validation cut-off")
    top_k: int = Field(RANKING_K, ge=1, description="k of the ranking metrics (recommendation)")
    refit: bool = Field(REFIT, description="serve the chosen recipe trained again on cut-offs through the test cut-off "
                        "(the hold-out figures stay the measured model's: docs/models.md, \"Refit\")")
    save_every_steps: int = Field(SAVE_EVERY_STEPS, ge=1, description="optimizer steps between two saves of the "
                                  "resumable training state (a killed run continues from the last)")

    def finetune_config(self, spill_dir: str | None = None) -> FinetuneConfig:
        """The models-level fine-tuning settings of this scenario; `spill_dir`: where features beyond the
        memory budget go (the workspace: a real filesystem with its space checked)."""
        return dataclasses.replace(_FINETUNE, epochs=self.epochs, learning_rate=self.learning_rate, spill_dir=spill_dir)

    @model_validator(mode="after")
    def _target_fits_task(self):
        allowed = TASKS[self.task].targets  # the config target keys that fit the task (models/tasks/__init__.py)
        if _TARGET_KEYS[type(self.target)] not in allowed:
            raise ValueError(f"task {self.task!r} takes a target with {' or '.join(sorted(allowed))}")
        return self


class Sink(Strict):
    connection: str = Field(description="a name under `connections:`")
    table: str = Field(description="predictions go to <table>_<scenario>, a day's rows replaced on a re-run")


class PredictionSettings(Strict):
    scenarios: list[str] = Field(default_factory=list, description="empty = every scenario")
    top_k: int = Field(TOP_K, ge=1, description="labels (multilabel) and items (recommendation) kept per entity, best first")
    format: Literal["top_k", "all"] = Field("top_k", description="multilabel: each entity's top_k labels, or all of "
                                                                 "them (every label with its score, best first)")
    without_history: Literal["skip", "flag"] = Field("skip", description="entities with no event before as_of: no "
                                                     "row (skip), or a row with null scores and has_history false")
    start: date | None = Field(None, description="first daily partition; default: the first events source's start")
    sink: Sink | None = Field(None, description="write the predictions back to the warehouse too")


class QualitySettings(Strict):
    """How much bad input a run tolerates before its asset checks fail (see docs/reliability.md)."""

    max_dropped_share: float = Field(0.01, ge=0, le=1, description="events dropped by the quarantine (null or blank "
                                                                   "ids, impossible times, duplicates), of all events")
    max_repaired_share: float = Field(0.05, ge=0, le=1, description="events with a numeric value repaired to null "
                                                                    "(inf, NaN, not a number), of all events")
    max_categories: int = Field(1_000_000, ge=1, description="distinct values above which a categorical column "
                                                             "is flagged (an id or free text used as a category?)")


class VersionSettings(Strict):
    """Which model versions are kept (assets/serving.py, assets/foundation_versions.py, docs/guide/operations.md)."""

    keep: int = Field(5, ge=1, description="the newest versions of each model (scenario, foundation) kept; the rest go")
    keep_served: bool = Field(True, description="also keep every version that ever served, however old (the "
                                                "serving one is never deleted)")


class DriftSettings(Strict):
    """When the drift checks of a day's predictions warn (assets/checks.py, docs/guide/operations.md)."""

    max_psi: float = Field(0.25, gt=0, description="population stability index of the day's scores against the "
                                                   "serving version's hold-out scores above which the check warns")
    max_unknown_share: float = Field(0.02, ge=0, le=1, description="share of the day's events with a categorical "
                                                                   "value the serving model never saw")
    trailing_days: int = Field(28, ge=2, description="days before the scored day whose mean the day's volume is "
                                                     "compared with")
    min_volume_ratio: float = Field(0.5, gt=0, description="the day's events or entities under this share of the "
                                                           "trailing mean warn")
    max_volume_ratio: float = Field(2.0, gt=0, description="the day's events or entities over this multiple of "
                                                           "the trailing mean warn")


class ProjectConfig(Strict):
    workspace: str = Field(description="POSIX folder of the cache, checkpoints and outputs (a real filesystem; "
                                       "s3:// is refused); relative to the config file")
    output: str | None = Field(None, description="where each stage uploads what it finished: s3://, gs://, "
                                                 "abfs:// or a folder (managed jobs, restore)")
    output_pins: dict[str, str] = Field(default_factory=dict, description="{stage: fingerprint} restore accepts "
                                        "from `output:` (each upload logs its stage's fingerprint); with pins set, "
                                        "restore takes the pinned stages only (resources/store/output.py)")
    connections: dict[str, Connection] = Field(description="named warehouse connections the sources read")
    entity: str = Field(description="the id column every event and entity attribute row carries (customer_id)")
    sources: list[Source] = Field(min_length=1, description="the tables to extract")
    cache: CacheSettings = Field(CacheSettings(), description="how the cache build runs")
    foundation: FoundationSettings = Field(FoundationSettings(), description="the foundation model")
    scenarios: dict[str, Scenario] = Field(default_factory=dict, description="the models fine-tuned on the "
                                           "foundation, by name")
    predictions: PredictionSettings = Field(PredictionSettings(), description="the daily scores")
    schedules: ScheduleSettings = Field(ScheduleSettings(), description="retraining and scoring schedules, sensors")
    quality: QualitySettings = Field(QualitySettings(), description="bad input tolerated before checks fail")
    versions: VersionSettings = Field(VersionSettings(), description="scenario versions kept for rollback")
    drift: DriftSettings = Field(DriftSettings(), description="thresholds of the drift checks on each day's "
                                                              "predictions")
    realized: RealizedSettings = Field(RealizedSettings(), description="checks of each scenario's realized "
                                       "performance, once its target window has passed")
    retries: RetrySettings = Field(RetrySettings(), description="extraction retries of transient warehouse errors, "
                                   "for every source (a source's own `retries:` overrides keys of it)")
    test_cutoff: date | None = Field(None, description="hold-out cut-off; default: data end minus the longest window")
    kubernetes: KubernetesSettings | None = Field(None, description="run on a Kubernetes cluster (docs/clusters.md)")
    executor: ExecutorSettings | None = Field(None, description="device, processes and precisions; default: auto, "
                                                                "1 process (0 on Kubernetes), fp32")
    mlflow: MlflowSettings | None = Field(None, description="log trainings to an MLflow tracking server and "
                                          "register scenario versions (docs/guide/operations.md)")

    @field_validator("workspace")
    @classmethod
    def _posix_workspace(cls, v: str) -> str:
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", v):
            raise ValueError(
                f"the workspace must be a POSIX path on a real filesystem (cache and checkpoints are memory-mapped "
                f"and renamed into place), got {v!r}; mount object storage or use `output: {v}` to upload artifacts "
                f"after training"
            )
        return v

    @field_validator("output_pins")
    @classmethod
    def _pins(cls, v: dict[str, str]) -> dict[str, str]:
        for stage, pin in v.items():
            if not re.fullmatch(r"foundation|scenario/[A-Za-z_][A-Za-z0-9_-]*", stage):
                raise ValueError(f"output_pins: {stage!r} is not a stage with a checkpoint (foundation, scenario/NAME)")
            if not re.fullmatch(r"[0-9a-f]{64}", pin):
                raise ValueError(f"output_pins.{stage}: expected the 64 hex digits its upload logged as fingerprint")
        return v

    @field_validator("output")
    @classmethod
    def _output_url(cls, v: str | None) -> str | None:
        m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", v or "")
        if m and m.group(1) not in ("s3", "s3a", "gs", "gcs", "abfs", "abfss", "file"):
            raise ValueError(f"output {redact_url(v)!r}: use s3://, gs://, abfs:// (pyarrow.fs) or a folder (resources/store/output.py)")
        return v

    @model_validator(mode="after")
    def _references(self):
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be unique, got {names}")
        for i, s in enumerate(self.sources):
            if s.connection not in self.connections:
                raise ValueError(f"sources[{i}] ({s.name}): connection {s.connection!r} is not among "
                                 f"connections {sorted(self.connections)}")
        if not self.events_sources:
            raise ValueError("at least one source needs role: events")
        for name, sc in self.scenarios.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", name) or name == "foundation":  # folders, tables, CLI
                raise ValueError(f"scenarios: scenario name {name!r} must be letters, digits, '_' or '-' (it names "
                                 f"workspace folders and warehouse tables) and not 'foundation' (`habitus versions "
                                 f"foundation` and `habitus rollback foundation` name the foundation model's versions)")
            self._check_target(name, sc)
        for name in self.predictions.scenarios:
            if name not in self.scenarios:
                raise ValueError(f"predictions.scenarios: {name!r} is not a scenario; scenarios are {sorted(self.scenarios)}")
        if self.predictions.sink and self.predictions.sink.connection not in self.connections:
            raise ValueError(f"predictions.sink.connection {self.predictions.sink.connection!r} is not among "
                             f"connections {sorted(self.connections)}")
        return self

    def _check_target(self, name: str, sc: Scenario) -> None:
        t = sc.target
        events = {s.name for s in self.events_sources}
        ref = getattr(t, "no_event", None) or getattr(t, "any_event", None) or getattr(t, "sum", None) or getattr(t, "items", None)
        if ref is None:
            return
        source = ref.split(".", 1)[0]
        if source not in events:
            raise ValueError(f"scenarios.{name}.target: {source!r} is not an events source; events sources are {sorted(events)}")

    # ------------------------------------------------------------------ derived views

    @property
    def events_sources(self) -> list[Source]:
        return [s for s in self.sources if s.role == "events"]

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)

    def extraction_retries(self, source: Source) -> RetrySettings:
        """The retries of `source`'s extraction: the top-level `retries:` with the keys its own block sets."""
        if source.retries is None:
            return self.retries
        return self.retries.model_copy(update=source.retries.model_dump(exclude_unset=True))

    @property
    def prediction_scenarios(self) -> list[str]:
        return list(self.predictions.scenarios or self.scenarios)

    @property
    def workspace_path(self) -> Path:
        return Path(self.workspace)

    def public_dict(self) -> dict:
        """The config as saved next to artifacts: connection parameters (possible secrets) left out."""
        d = self.model_dump(mode="json")
        d["connections"] = {k: {"type": v["type"]} for k, v in d["connections"].items()}
        if d.get("mlflow"):  # a tracking URI may carry a password
            d["mlflow"]["tracking_uri"] = redact_url(d["mlflow"]["tracking_uri"])
        return d


# --------------------------------------------------------------------------- loading


# Read until 2026-12: the retries are the config's `retries:` now (`${VAR:-3}` there reads a variable).
_RETIRED_ENV = {"HABITUS_EXTRACT_RETRIES": "max_retries", "HABITUS_EXTRACT_RETRY_DELAY_S": "delay_s"}


def _warn_retired_env(path: Path) -> None:
    for var, key in _RETIRED_ENV.items():
        if var in os.environ:
            warnings.warn(f"{var} is set but no longer read: write `retries: {{{key}: ...}}` in {path} (or "
                          f"`{key}: ${{{var}:-...}}` there to keep reading the variable)", stacklevel=3)


def load_project(path: str | os.PathLike | None = None) -> ProjectConfig:
    """Read, substitute `${ENV}`, validate. `path` defaults to $HABITUS_CONFIG, then examples/demo.yaml."""
    path = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)
    _warn_retired_env(path)
    raw = read_yaml(path)
    try:
        project = ProjectConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_errors(path, e, ProjectConfig)) from None
    base = path.resolve().parent
    update: dict = {"workspace": resolve_path(base, project.workspace)}
    if project.output and "://" not in project.output:
        update["output"] = resolve_path(base, project.output)
    conns = {}
    for name, c in project.connections.items():
        if isinstance(c, (DuckDBConnection, ParquetConnection)):
            c = c.model_copy(update={"path": resolve_path(base, c.path)})
        conns[name] = c
    update["connections"] = conns
    return project.model_copy(update=update)
