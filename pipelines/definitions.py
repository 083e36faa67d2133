"""The Dagster code location: every asset, resource and job of the project config.

The config is chosen by $HABITUS_CONFIG (default examples/demo.yaml). Importing this module builds
nothing: Dagster's workspace (workspace.yaml, `dagster dev -m habitus.pipelines.definitions`) calls `defs()`
when it loads the code location. The assets and resources are built in
pipelines/orchestration/build.py, the jobs, sensors and schedules beside it.
"""

import dagster as dg

from habitus.assets.checks import build_checks
from habitus.assets.realized import realized_scenarios
from habitus.pipelines.config.project import ProjectConfig, load_project
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.pipelines.orchestration.jobs import build_jobs
from habitus.pipelines.orchestration.kubernetes import k8s_executor
from habitus.pipelines.orchestration.monitoring import build_realized_sensor, realized_job
from habitus.pipelines.orchestration.schedules import build_schedules
from habitus.pipelines.orchestration.sensors import (build_scoring_sensor, build_sensors, cache_automation_sensor,
                                                     with_cache_automation)


def build_definitions(project: ProjectConfig) -> dg.Definitions:
    """Assets with their checks, the jobs, the new-data sensors, the cache automation and the
    retraining/scoring schedules (pipelines/orchestration/jobs.py, sensors.py, schedules.py; assets/checks.py)."""
    assets = with_cache_automation(build_assets(project))
    jobs = build_jobs(project)
    sensors = build_sensors(project, assets, jobs) + [cache_automation_sensor(project)]
    scoring = build_scoring_sensor(project, jobs, assets)
    sensors += [scoring] if scoring is not None else []
    if realized_scenarios(project):  # realized/<name>: the job and the sensor that requests its days
        jobs["realized"] = realized_job()
        sensors.append(build_realized_sensor(project, jobs["realized"], assets))
    executor = None
    if project.kubernetes is not None:  # every step its own Kubernetes Job, training on GPU pods
        executor = k8s_executor(project)
    return dg.Definitions(assets=assets, asset_checks=build_checks(project), resources=build_resources(project),
                          jobs=list(jobs.values()), sensors=sensors, schedules=build_schedules(project, jobs, assets),
                          executor=executor)


@dg.definitions
def defs() -> dg.Definitions:
    """The code location of the project named by $HABITUS_CONFIG (default examples/demo.yaml)."""
    return build_definitions(load_project())
