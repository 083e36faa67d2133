"""Realized performance, run by itself: the job `realized` and the sensor `realized_after_cache`.

Whenever the cache in use gets newer, the sensor requests realized/<name> for exactly the days whose
target window the new days complete: day D once the cache's newest event day reaches D + the scenario's
window (the days D + window in (the newest day it saw before, the newest day now]); on its first tick,
the one day whose window ends on the newest day. A day without predictions/<name> is left out (said in
the log). Each run's run_key is its scenario and day: a day is never requested twice.
"""

import json
from datetime import date, datetime, timedelta, timezone

import dagster as dg

from habitus.assets.realized import GROUP, realized_key, realized_scenarios
from habitus.pipelines.orchestration.jobs import SCORING
from habitus.pipelines.orchestration.schedules import cache_in_use

MAX_DAYS = 31  # days one tick requests per scenario (a cache that jumped months ahead: the newest ones)


def realized_job():
    return dg.define_asset_job("realized", selection=dg.AssetSelection.groups(GROUP), tags=SCORING,
                               description="Scenarios' realized performance of one day, once its target window passed")


def completed_days(newest: date, seen: date | None, window_days: int, limit: int = MAX_DAYS) -> list[str]:
    """The days whose `window_days`-day window ends after `seen` and at or before `newest` (the newest
    `limit`); with no `seen` (a first tick), the one day whose window ends on `newest`."""
    last = newest - timedelta(days=window_days)
    first = last if seen is None else seen - timedelta(days=window_days - 1)
    first = max(first, last - timedelta(days=limit - 1))
    return [(first + timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def build_realized_sensor(project, job, assets: list[dg.AssetsDefinition]) -> dg.SensorDefinition | None:
    by_key = {k: a for a in assets for k in a.keys}
    names = [n for n in realized_scenarios(project) if realized_key(n) in by_key]
    if not names:
        return None
    partitions_def = by_key[realized_key(names[0])].partitions_def
    windows = {n: project.scenarios[n].target.within for n in names}

    @dg.sensor(
        name="realized_after_cache", job=job, minimum_interval_seconds=project.schedules.sensor_interval,
        default_status=dg.DefaultSensorStatus.RUNNING if project.schedules.running else dg.DefaultSensorStatus.STOPPED,
        required_resource_keys={"workspace"},
        description="Scores each scenario's predictions of the days whose target window a new cache completes")
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        workspace = context.resources.workspace
        cache = cache_in_use(workspace)
        if cache is None:
            return dg.SensorResult(skip_reason="no cache yet")
        state = json.loads(context.cursor) if context.cursor else None
        newest = datetime.fromtimestamp(cache.time_range[1], timezone.utc).date()
        seen = date.fromisoformat(state["newest_day"]) if state else None
        if seen is not None and newest <= seen:
            return dg.SensorResult(skip_reason=f"the cache's newest day ({newest}) completes no new target window",
                                   cursor=context.cursor)
        cursor = json.dumps({"newest_day": newest.isoformat()})
        requests, left_out = [], []
        for name in names:
            for day in completed_days(newest, seen, windows[name]):
                if not partitions_def.has_partition_key(day):
                    continue
                if not (workspace.predictions(name) / f"{day}.parquet").exists():
                    left_out.append(f"{name} {day}: no predictions")
                    continue
                requests.append(dg.RunRequest(run_key=f"realized:{name}:{day}", partition_key=day,
                                              asset_selection=[realized_key(name)]))
        if left_out:
            context.log.info("left out: " + "; ".join(left_out[:10]))
        if not requests:
            return dg.SensorResult(skip_reason=f"no scored day's window ended with {newest}"
                                               + (f" ({'; '.join(left_out[:3])})" if left_out else ""), cursor=cursor)
        context.log.info(f"the cache covers up to {newest}: realized "
                         + ", ".join(f"{r.asset_selection[0].path[-1]} {r.partition_key}" for r in requests))
        return dg.SensorResult(run_requests=requests, cursor=cursor)

    return _sensor
