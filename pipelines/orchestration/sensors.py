"""New-data sensors: one per events source, asking the warehouse whether data landed and where.

A tick asks the connection one aggregate: the table's row count and newest timestamp. Only when that
changed since the last tick, or a partition became complete (a month or a day ended), it asks for
the rows and newest timestamp of each month (or day) and requests runs of `extract_<source>` for
exactly the complete partitions whose numbers changed: new partitions, and older ones that received
late rows. Consecutive partitions share a run, at most as many as the source's backfill policy puts
in one run, so a year of history is a handful of runs. Each run's `run_key` is made of its
partitions and their numbers: the same data is never extracted twice, however often the sensor
ticks. The cursor (JSON) remembers the numbers of every partition it has requested.

The first tick (no cursor) takes partitions already materialized in this Dagster instance as up to
date and requests the others that hold data. Rows of the period in progress wait until it ends.

Then the chain runs on its own: the cache automation sensor appends the new partitions to the cache
once their blocking checks passed, and `score_after_cache` scores the days the new cache covers
with the checkpoints in service. Retraining waits for its schedule (pipelines/orchestration/schedules.py).
"""

import hashlib
import json
from datetime import date, datetime, timedelta, timezone

import dagster as dg
# private: RunRequest takes one partition_key, and Dagster exports no name for the range tags of a one-run range
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.assets.cache import CACHE_KEY
from habitus.assets.embeddings import EMBEDDINGS_KEY
from habitus.assets.predictions import predictions_key
from habitus.assets.sources import connection_key, extraction_fingerprint, source_key
from habitus.pipelines.orchestration.jobs import extract_job_name
from habitus.pipelines.orchestration.schedules import cache_in_use, predictions_request

GRAIN = {"monthly": "month", "daily": "day"}


def sensor_name(source_name: str) -> str:
    return f"{source_name}_new_data"


def _stamp(rows: int, newest) -> list:
    return [int(rows), newest.isoformat() if newest is not None else None]


def plan_runs(changed: list[str], order: list[str], per_run: int) -> list[list[str]]:
    """Group partition keys into runs of consecutive partitions (consecutive in `order`), at most
    `per_run` each."""
    position = {k: i for i, k in enumerate(order)}
    runs: list[list[str]] = []
    for key in sorted(changed, key=position.__getitem__):
        last = runs[-1] if runs else None
        if last and position[key] == position[last[-1]] + 1 and len(last) < per_run:
            last.append(key)
        else:
            runs.append([key])
    return runs


def run_request(source_name: str, keys: list[str], stamps: dict, extraction: str | None = None) -> dg.RunRequest:
    """One run for consecutive partitions; its run_key changes whenever their numbers change, or what
    they are extracted with (`extraction`: the source's fingerprint, a new `where:`)."""
    parts = [[k, stamps.get(k)] for k in keys] + ([extraction] if extraction else [])
    digest = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]
    run_key = f"{source_name}:{keys[0]}..{keys[-1]}:{digest}"
    if len(keys) == 1:
        return dg.RunRequest(run_key=run_key, partition_key=keys[0])
    return dg.RunRequest(run_key=run_key, tags={ASSET_PARTITION_RANGE_START_TAG: keys[0],
                                                ASSET_PARTITION_RANGE_END_TAG: keys[-1]})


def build_new_data_sensor(project, source, asset_def: dg.AssetsDefinition, job) -> dg.SensorDefinition:
    partitions_def = asset_def.partitions_def
    per_run = asset_def.backfill_policy.max_partitions_per_run or 1
    conn_key = connection_key(source.connection)
    grain = GRAIN[source.partition]

    @dg.sensor(
        name=sensor_name(source.name), job=job, minimum_interval_seconds=project.schedules.sensor_interval,
        default_status=dg.DefaultSensorStatus.RUNNING if project.schedules.running else dg.DefaultSensorStatus.STOPPED,
        required_resource_keys={conn_key},
        description=f"Extracts new or changed {grain}s of table {source.table!r} into source/{source.name}",
    )
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        warehouse = getattr(context.resources, conn_key)
        if not (hasattr(warehouse, "freshness") and hasattr(warehouse, "partition_counts")):
            return dg.SensorResult(skip_reason=f"the {type(warehouse).__name__} connector cannot yet tell where new "
                                               f"data landed (freshness, partition_counts); extract new partitions "
                                               f"with a backfill of source/{source.name}")
        state = json.loads(context.cursor) if context.cursor else None
        extraction = extraction_fingerprint(source)[:16]
        # a cursor of before the fingerprint was kept: its partitions were extracted without a row filter
        if state is not None and state.get("extraction", extraction_fingerprint(source, None)[:16]) != extraction:
            state = {**state, "table": None, "partitions": {}}  # another `where:` or `columns:`: extract all again
        keys = partitions_def.get_partition_keys()
        table = _stamp(*warehouse.freshness(source.table, source.timestamp))
        last_key = keys[-1] if keys else None
        if state is not None and state["table"] == table and state["last_key"] == last_key:
            return dg.SensorResult(skip_reason=f"no new data in {source.table!r}: {table[0]:,} rows, newest {table[1]}",
                                   cursor=context.cursor)
        in_def = set(keys)
        current, waiting = {}, 0
        for start, (rows, newest) in warehouse.partition_counts(source.table, source.timestamp, grain).items():
            key = start.strftime(partitions_def.fmt)
            if key in in_def:
                current[key] = _stamp(rows, newest)
            elif keys and key > keys[-1]:
                waiting += rows
        if state is None:  # first tick: what this instance already extracted counts as done
            done = context.instance.get_materialized_partitions(source_key(source.name))
            known = {k: v for k, v in current.items() if k in done}
        else:
            known = state["partitions"]
        changed = [k for k in keys if current.get(k) != known.get(k)]
        cursor = json.dumps({"table": table, "last_key": last_key, "partitions": current, "extraction": extraction},
                            sort_keys=True)
        note = f"; {waiting:,} rows of the {grain} in progress wait until it ends" if waiting else ""
        if not changed:
            return dg.SensorResult(skip_reason=f"no new or changed complete {grain} in {source.table!r}{note}",
                                   cursor=cursor)
        runs = plan_runs(changed, keys, per_run)
        context.log.info(f"{source.table}: {len(changed)} new or changed {grain}(s) "
                         f"({', '.join(changed[:6])}{' ...' if len(changed) > 6 else ''}) in {len(runs)} run(s){note}")
        return dg.SensorResult(run_requests=[run_request(source.name, r, current, extraction) for r in runs], cursor=cursor)

    return _sensor


def build_sensors(project, assets: list[dg.AssetsDefinition], jobs: dict) -> list[dg.SensorDefinition]:
    by_key = {a.key: a for a in assets if len(a.keys) == 1}
    return [build_new_data_sensor(project, s, by_key[source_key(s.name)], jobs[extract_job_name(s.name)])
            for s in project.events_sources]


# The cache follows its sources: once any source partition was (re-)extracted, no source run is in
# progress and no blocking check of a source failed, the automation sensor requests `cache`.
# ("failed", not "not passed": sources extracted by `habitus materialize` carry no check results.)
CACHE_CONDITION = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
    & ~dg.AutomationCondition.any_deps_match(
        dg.AutomationCondition.any_checks_match(dg.AutomationCondition.check_failed(), blocking_only=True)
    ).with_label("no source's blocking check failed")
).with_label("after new source data")


def with_cache_automation(assets: list[dg.AssetsDefinition]) -> list[dg.AssetsDefinition]:
    return dg.map_asset_specs(
        lambda spec: spec.replace_attributes(automation_condition=CACHE_CONDITION) if spec.key == CACHE_KEY else spec,
        assets)


def cache_automation_sensor(project) -> dg.AutomationConditionSensorDefinition:
    return dg.AutomationConditionSensorDefinition(
        "cache_after_new_data", target=dg.AssetSelection.assets(CACHE_KEY),
        minimum_interval_seconds=project.schedules.sensor_interval,
        default_status=dg.DefaultSensorStatus.RUNNING if project.schedules.running else dg.DefaultSensorStatus.STOPPED,
        description="Rebuilds the cache after new source partitions were extracted and their blocking checks passed")


def _day(epoch_s: int) -> date:
    return datetime.fromtimestamp(epoch_s, timezone.utc).date()


def days_to_score(newest: date, state: dict | None, fingerprint: str, limit: int) -> list[str]:
    """The days a new cache version should be scored for: those after the newest day scored before,
    up to the cache's newest event day (at most `limit`, the newest ones); the newest day again when
    the cache changed without getting newer (late rows); just the newest day on the first tick."""
    if state is not None and state["fingerprint"] == fingerprint:
        return []
    start = newest if state is None else min(date.fromisoformat(state["newest_day"]) + timedelta(days=1), newest)
    start = max(start, newest - timedelta(days=limit - 1))
    return [(start + timedelta(days=i)).isoformat() for i in range((newest - start).days + 1)]


def build_scoring_sensor(project, jobs: dict, assets: list[dg.AssetsDefinition]) -> dg.SensorDefinition | None:
    by_key = {k: a for a in assets for k in a.keys}
    scored = [by_key[predictions_key(n)] for n in project.prediction_scenarios if predictions_key(n) in by_key]
    with_embeddings = EMBEDDINGS_KEY in by_key
    if not scored and not with_embeddings:
        return None
    partitions_def = (scored or [by_key[EMBEDDINGS_KEY]])[0].partitions_def
    per_run = 31

    @dg.sensor(
        name="score_after_cache", job=jobs["score"], minimum_interval_seconds=project.schedules.sensor_interval,
        default_status=dg.DefaultSensorStatus.RUNNING if project.schedules.running else dg.DefaultSensorStatus.STOPPED,
        required_resource_keys={"workspace"},
        description="Scores the days a new version of the cache covers, with the checkpoints in service")
    def _sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        cache = cache_in_use(context.resources.workspace)
        if cache is None:
            return dg.SensorResult(skip_reason="no cache yet")
        state = json.loads(context.cursor) if context.cursor else None
        newest = _day(cache.time_range[1])
        days = days_to_score(newest, state, cache.fingerprint, per_run)
        cursor = json.dumps({"fingerprint": cache.fingerprint, "newest_day": newest.isoformat()})
        if not days:
            return dg.SensorResult(skip_reason=f"the cache in use ({cache.fingerprint[:16]}) was scored already",
                                   cursor=context.cursor)
        requests, skipped = [], []
        for day in days:
            r = predictions_request(project, context.resources.workspace, day, partitions_def, with_embeddings,
                                    run_key=f"score:{day}:{cache.fingerprint[:16]}")
            (requests if isinstance(r, dg.RunRequest) else skipped).append(r)
        if not requests:
            return dg.SensorResult(skip_reason="; ".join(s.skip_message for s in skipped[:3]), cursor=cursor)
        context.log.info(f"cache {cache.fingerprint[:16]} ({cache.manifest.get('mode')}) covers up to {newest}: "
                         f"scoring {', '.join(days)}")
        return dg.SensorResult(run_requests=requests, cursor=cursor)

    return _sensor
