"""Retraining and scoring schedules: what each tick requests, and that nothing retrains when its
inputs (the extracted data, the foundation model) have not changed. Checkpoints are written as the
assets write them (config.json); the schedules read nothing else."""

import json
from datetime import datetime, timezone

import dagster as dg
import duckdb
import pytest
import yaml
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.assets.serving import passed_path
from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.pipelines.orchestration.schedules import cache_in_use, data_fingerprint

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")


TICK = datetime(2026, 11, 2, 5, 0, tzinfo=timezone.utc)  # a Monday, 05:00: scores 2026-11-01


def _project(root, schedules=None):
    cfg = {"workspace": "ws", "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}},
           "entity": "customer_id",
           "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                        "timestamp": "ts", "columns": ["product_id"], "start": "2026-09-01"}],
           "scenarios": {"churn": {"task": "binary", "target": {"no_event": "purchases", "within": "14d"}},
                         "items": {"task": "recommendation", "target": {"items": "purchases.product_id",
                                                                        "within": "14d"}}},
           "predictions": {"scenarios": ["churn"], "start": "2026-10-01"}}
    if schedules:
        cfg["schedules"] = schedules
    (root / "project.yaml").write_text(yaml.safe_dump(cfg))
    return load_project(root / "project.yaml")


@pytest.fixture
def project(tmp_path):
    con = duckdb.connect(str(tmp_path / "warehouse.duckdb"))
    con.sql("CREATE TABLE purchases AS SELECT 'c' || (i % 40) AS customer_id, "
            "TIMESTAMP '2026-09-01' + to_seconds(i * 3000) AS ts, 'p' || (i % 7) AS product_id FROM range(1500) t(i)")
    con.close()
    return _project(tmp_path)


def _extract(project, start="2026-09-01", end="2026-10-01", cache=False):
    keys = [dg.AssetKey(["source", "purchases"])] + ([dg.AssetKey("cache")] if cache else [])
    tags = {ASSET_PARTITION_RANGE_START_TAG: start, ASSET_PARTITION_RANGE_END_TAG: end}
    assert dg.materialize(build_assets(project), selection=keys, resources=build_resources(project), tags=tags).success


def _checkpoint(folder, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def _tick(project, instance, name, when=TICK):
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    # an earlier dg.materialize's own instance, once collected, can leave its disposed storage current
    # (tests/conftest.py): the definitions load with the test's instance's
    with set_defs_state_storage(instance.defs_state_storage):
        defs = build_definitions(project)
        schedule = defs.resolve_schedule_def(name)
        context = dg.build_schedule_context(instance=instance, scheduled_execution_time=when,
                                            resources=build_resources(project), repository_def=defs.get_repository_def())
        return schedule.evaluate_tick(context)


def _ws(project):
    return build_resources(project)["workspace"]


def test_cron_strings_come_from_the_config(tmp_path, project):
    defs = build_definitions(project)
    crons = {s.name: (s.cron_schedule, s.job_name, s.execution_timezone) for s in defs.schedules}
    assert crons == {"foundation_schedule": ("0 2 1 * *", "train", "UTC"),
                     "scenarios_schedule": ("0 3 * * 1", "train_scenarios", "UTC"),
                     "predictions_schedule": ("0 5 * * *", "score", "UTC")}
    assert all(s.default_status == dg.DefaultScheduleStatus.STOPPED for s in defs.schedules)
    custom = _project(tmp_path, {"foundation": "30 1 * * 0", "timezone": "Europe/Berlin", "running": True})
    schedule = build_definitions(custom).resolve_schedule_def("foundation_schedule")
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("30 1 * * 0", "Europe/Berlin")
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    with pytest.raises(ConfigError, match=r"schedules.scenarios: expected a cron string of 5 fields"):
        _project(tmp_path, {"scenarios": "every monday"})
    with pytest.raises(ConfigError, match=r"schedules.timezone: unknown time zone 'Mars/Olympus'"):
        _project(tmp_path, {"timezone": "Mars/Olympus"})


def test_foundation_retrains_only_when_the_data_changed(project, instance):
    data = _tick(project, instance, "foundation_schedule")
    assert data.run_requests == [] and "nothing to train on yet" in data.skip_message
    _extract(project)
    data = _tick(project, instance, "foundation_schedule")
    assert [r.run_key for r in data.run_requests] == [f"train:{data_fingerprint(project, _ws(project))[:16]}"]
    assert data.run_requests[0].tags["habitus/reason"] == "no foundation model yet"

    _checkpoint(_ws(project).foundation, cache_fingerprint=data_fingerprint(project, _ws(project)), weights_sha256="f1")
    data = _tick(project, instance, "foundation_schedule")
    assert data.run_requests == [] and "trained on the current data" in data.skip_message

    _extract(project, "2026-09-01", "2026-09-01")  # re-extracting the same rows changes nothing
    assert _tick(project, instance, "foundation_schedule").run_requests == []

    con = duckdb.connect(str(project.connections["warehouse"].path))
    con.sql("INSERT INTO purchases VALUES ('c1', TIMESTAMP '2026-09-15 10:00:00', 'p1')")
    con.close()
    _extract(project, "2026-09-01", "2026-09-01")  # a late row in September: the data changed
    data = _tick(project, instance, "foundation_schedule")
    assert len(data.run_requests) == 1
    assert data.run_requests[0].tags["habitus/reason"] == "the extracted data changed since the foundation model was trained"


def test_scenarios_retrain_only_the_stale_ones(project, instance):
    _extract(project, cache=True)
    ws, fp = _ws(project), data_fingerprint(project, _ws(project))
    lineage = cache_in_use(ws).lineage
    data = _tick(project, instance, "scenarios_schedule")
    assert data.run_requests == [] and "no foundation model yet" in data.skip_message

    _checkpoint(ws.foundation, cache_fingerprint="older data", cache_lineage="other settings", weights_sha256="f0")
    data = _tick(project, instance, "scenarios_schedule")
    assert data.run_requests == [] and "the foundation schedule retrains it and its scenarios" in data.skip_message

    _checkpoint(ws.foundation, cache_fingerprint=fp, cache_lineage=lineage, weights_sha256="f1")
    _checkpoint(ws.scenario("churn"), cache_fingerprint=fp, foundation_sha256="f1", weights_sha256="s1")
    _checkpoint(ws.scenario("items"), cache_fingerprint=fp, foundation_sha256="f0", weights_sha256="s2")
    data = _tick(project, instance, "scenarios_schedule")
    assert [r.asset_selection for r in data.run_requests] == [[dg.AssetKey("cache"), dg.AssetKey(["scenario", "items"])]]

    _checkpoint(ws.scenario("items"), cache_fingerprint=fp, foundation_sha256="f1", weights_sha256="s3")
    data = _tick(project, instance, "scenarios_schedule")
    assert data.run_requests == [] and "every scenario was trained on the current data" in data.skip_message

    # late rows re-encode the cache with the same ids: the scenarios are stale, the foundation model (same
    # lineage) still fits
    con = duckdb.connect(str(project.connections["warehouse"].path))
    con.sql("INSERT INTO purchases VALUES ('c1', TIMESTAMP '2026-10-20 10:00:00', 'p1')")
    con.close()
    _extract(project, "2026-10-01", "2026-10-01", cache=True)
    assert cache_in_use(ws).manifest["mode"] == "rebuild" and cache_in_use(ws).lineage == lineage
    (request,) = _tick(project, instance, "scenarios_schedule").run_requests
    assert request.asset_selection == [dg.AssetKey("cache"), dg.AssetKey(["scenario", "churn"]),
                                       dg.AssetKey(["scenario", "items"])]


def test_predictions_score_the_previous_day_with_the_serving_checkpoint(project, instance):
    data = _tick(project, instance, "predictions_schedule")
    assert data.run_requests == [] and "no cache yet" in data.skip_message
    _extract(project, cache=True)
    ws = _ws(project)
    cache_fp = data_fingerprint(project, ws)
    data = _tick(project, instance, "predictions_schedule")
    assert data.run_requests == []
    assert data.skip_message == ("nothing to score for 2026-11-01: churn: not trained yet; embeddings: the "
                                 "foundation model was trained on a cache with other settings or not at all")

    _checkpoint(ws.foundation, cache_fingerprint=cache_fp, weights_sha256="f1")
    _checkpoint(ws.scenario("churn"), cache_fingerprint=cache_fp, weights_sha256="s1")
    (request,) = _tick(project, instance, "predictions_schedule").run_requests
    assert (request.partition_key, request.run_key) == ("2026-11-01", "score:2026-11-01")
    assert request.asset_selection == [dg.AssetKey(["predictions", "churn"]), dg.AssetKey("embeddings")]

    # the checkpoint that passed its check serves, even when a newer one exists
    _checkpoint(passed_path(ws, "churn"), cache_fingerprint="an older cache", cache_lineage="other settings",
                weights_sha256="s0")
    (request,) = _tick(project, instance, "predictions_schedule").run_requests
    assert request.asset_selection == [dg.AssetKey("embeddings")]
    assert "churn: its serving checkpoint was trained on a cache with other settings" in request.tags["habitus/left_out"]
    # a checkpoint trained on an older version of the same lineage (new data appended since) still serves
    _checkpoint(passed_path(ws, "churn"), cache_fingerprint="an older version", cache_lineage=cache_in_use(ws).lineage,
                weights_sha256="s0")
    (request,) = _tick(project, instance, "predictions_schedule").run_requests
    assert request.asset_selection == [dg.AssetKey(["predictions", "churn"]), dg.AssetKey("embeddings")]


def test_predictions_skip_days_outside_the_partitions(project, instance):
    _extract(project, cache=True)
    data = _tick(project, instance, "predictions_schedule", when=datetime(2026, 9, 15, 5, tzinfo=timezone.utc))
    assert data.run_requests == [] and "2026-09-14 is not a predictions partition" in data.skip_message


def test_definitions_wire_every_job_sensor_and_schedule(project):
    defs = build_definitions(project)
    repo = defs.get_repository_def()
    assert {j.name for j in repo.get_all_jobs() if not j.name.startswith("__")} == {
        "extract_purchases", "train", "train_scenarios", "score", "rollback", "realized"}
    assert {s.name for s in repo.sensor_defs} == {"purchases_new_data", "cache_after_new_data", "score_after_cache",
                                                  "realized_after_cache"}
    checks = {(k.asset_key.to_user_string(), k.name) for k in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {("source/purchases", "schema_matches_config"), ("source/purchases", "keys_present"),
                      ("source/purchases", "timestamps_plausible"), ("source/purchases", "volume_guidelines"),
                      ("source/purchases", "categorical_cardinality"), ("cache", "rows_quarantined"),
                      ("cache", "join_coverage"), ("cache", "free_space_for_training"),
                      ("scenario/churn", "beats_baselines"), ("scenario/items", "beats_baselines"),
                      *(("predictions/churn", c) for c in ("score_drift", "unknown_values", "event_volume")),
                      *(("realized/churn", c) for c in ("beats_baselines_realized", "holds_holdout_realized"))}
    # a backfill of a year is a handful of runs: 1 for monthly sources, 12 for daily predictions
    graph = defs.resolve_asset_graph()
    assert graph.get(dg.AssetKey(["source", "purchases"])).backfill_policy.max_partitions_per_run == 12
    assert graph.get(dg.AssetKey(["predictions", "churn"])).backfill_policy.max_partitions_per_run == 31
    assert graph.get(dg.AssetKey("embeddings")).backfill_policy.max_partitions_per_run == 31
