"""The jobs that sensors, schedules and people launch.

    extract_<source>   one events source, the partitions a run asks for (the new-data sensors' target)
    train              cache, foundation model and every scenario (the foundation schedule's target)
    train_scenarios    cache and the scenarios (the scenarios schedule's target; a run selects the stale ones)
    score              predictions and embeddings of one day (the predictions schedule's target)
    rollback           serve another kept version of a scenario, or of the foundation (scenario: foundation),
                       (config: scenario, to), as `habitus rollback`

Asset checks of the selected assets run with them, so a blocking check stops what follows it.
Each job tags its runs with habitus/kind (extraction, training, scoring): dagster.yaml's run queue
lets one training run at a time start on a machine.

An extraction run executes in its run's own process (Dagster's in-process executor; off Kubernetes):
the multiprocess default starts a Python per step and asset check (6 for a source), each importing the
whole code location (torch included, ~7 s of CPU), for a step that takes seconds; the queue already
runs extractions side by side, and the RetryPolicy works the same in process.
"""

import dagster as dg
from pydantic import Field

from habitus.assets.cache import CACHE_KEY
from habitus.assets.foundation_versions import rollback_foundation
from habitus.assets.scenarios import scenario_key
from habitus.assets.sources import source_key
from habitus.assets.tracking import tracked_rollback
from habitus.models.storage.versions import VersionError
from habitus.resources.training.mlflow_tracking import MlflowMissing


KIND_TAG = "habitus/kind"
EXTRACTION, TRAINING, SCORING = ({KIND_TAG: k} for k in ("extraction", "training", "scoring"))


def extract_job_name(source_name: str) -> str:
    return f"extract_{source_name}"


def build_jobs(project) -> dict:
    jobs = {}
    for s in project.events_sources:
        name = extract_job_name(s.name)
        jobs[name] = dg.define_asset_job(
            name, selection=dg.AssetSelection.assets(source_key(s.name)), tags=EXTRACTION,
            executor_def=None if project.kubernetes is not None else dg.in_process_executor,
            description=f"Extract partitions of source/{s.name} (launched by the sensor {s.name}_new_data)")
    jobs["train"] = dg.define_asset_job(
        "train", selection=dg.AssetSelection.groups("training", "scenarios"), tags=TRAINING,
        description="Cache, foundation model and every scenario (sources must be extracted)")
    scenarios = [scenario_key(n) for n in project.scenarios]
    if scenarios:
        jobs["train_scenarios"] = dg.define_asset_job(
            "train_scenarios", selection=dg.AssetSelection.assets(CACHE_KEY, *scenarios), tags=TRAINING,
            description="Fine-tune scenarios on the current foundation model (the cache is reused when unchanged)")
    jobs["score"] = dg.define_asset_job(
        "score", selection=dg.AssetSelection.groups("predictions"), tags=SCORING,
        description="Predictions of every scenario and the entity embeddings for one day")
    jobs["rollback"] = rollback_job(project)  # the foundation's versions, with or without scenarios
    return jobs


class RollbackConfig(dg.Config):
    scenario: str = Field(description="the scenario whose serving version moves, or foundation: the foundation "
                                      "model's (that version is put back into checkpoints/foundation/)")
    to: str = Field("", description="a kept version's fingerprint (or its unique prefix); empty: the version "
                                    "that served before the serving one")


def rollback_job(project) -> dg.JobDefinition:
    """The UI's `habitus rollback`: the next predictions of the scenario are scored by the chosen version."""
    @dg.op(required_resource_keys={"workspace"}, description="Move a scenario's (or the foundation's) serving pointer "
                                                        "to a kept version")
    def move_serving_pointer(context: dg.OpExecutionContext, config: RollbackConfig) -> str:
        if config.scenario == "foundation":  # config validation keeps scenarios from taking this name
            try:
                fp = rollback_foundation(context.resources.workspace, config.to or None, project.versions.keep,
                                         project.versions.keep_served)
            except VersionError as e:
                raise dg.Failure(f"foundation: {e}") from e
            context.log.info(f"foundation: version {fp} is in checkpoints/foundation/ from now on")
            context.add_output_metadata({"scenario": "foundation", "serving": fp})
            return fp
        if config.scenario not in project.scenarios:
            raise dg.Failure(f"no scenario {config.scenario!r} in the project (scenarios: {', '.join(project.scenarios)})")
        try:
            fp = tracked_rollback(project.mlflow, context.resources.workspace, config.scenario, config.to or None,
                                  project.versions.keep, project.versions.keep_served, context.log.warning)
        except (VersionError, MlflowMissing) as e:
            raise dg.Failure(f"{config.scenario}: {e}") from e
        context.log.info(f"scenario {config.scenario}: version {fp} serves from now on")
        context.add_output_metadata({"scenario": config.scenario, "serving": fp})
        return fp

    @dg.job(name="rollback", description="Serve another kept version of a scenario, or of the foundation model "
                                         "(config: scenario, or foundation, and to: a fingerprint, or empty for the "
                                         "version that served before)")
    def rollback_scenario():
        move_serving_pointer()

    return rollback_scenario
