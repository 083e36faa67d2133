"""A day of new events, end to end, as the daemons would run it: the new-data sensor extracts the new
partition, the cache automation appends it to the cache, and `score_after_cache` scores that day
with the checkpoints in service. Nothing retrains: the models trained before score the new day."""

import json

import dagster as dg
import pyarrow.parquet as pq
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.pipelines.config.project import load_project
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.pipelines.orchestration.schedules import cache_in_use
from habitus.pipelines.orchestration.sensors import days_to_score

pytestmark = [pytest.mark.filterwarnings("ignore::dagster.BetaWarning"), pytest.mark.slow]

NEW_DAY = "2026-11-01"


def _project(tmp_path, small_project):
    config = small_project.config(
        purchases=["product_id", "store_id", "price"], events={"partition": "daily", "start": "2026-07-01"},
        customers=["age", "segment"], foundation={"cutoff_every": "14d"},
        scenarios={"churn": small_project.churn("14d", epochs=1)}, predictions={"start": "2026-10-01"})
    return load_project(small_project.write(tmp_path, config, customers=400, products=60, stores=4,
                                            start="2026-07-01", end="2026-10-31", seed=3))


def test_a_new_day_flows_to_the_cache_and_that_days_predictions(tmp_path, instance, small_project, sensor_driver):
    project = _project(tmp_path, small_project)
    defs, resources = build_definitions(project), build_resources(project)
    assets = build_assets(project)
    # the history, materialized once by a person (habitus demo / the UI)
    keys = next(a for a in assets if a.key == dg.AssetKey(["source", "purchases"])).partitions_def.get_partition_keys()
    assert dg.materialize(assets, selection=[dg.AssetKey(["source", "purchases"])], resources=resources,
                          instance=instance, tags={ASSET_PARTITION_RANGE_START_TAG: keys[0],
                                                   ASSET_PARTITION_RANGE_END_TAG: keys[-1]}).success
    trained = [dg.AssetKey(["source", "customers"]), dg.AssetKey(["source", "products"]), dg.AssetKey("cache"),
               dg.AssetKey("foundation_model"), dg.AssetKey(["scenario", "churn"])]
    assert dg.materialize(assets, selection=trained, resources=resources, instance=instance).success
    ws = resources["workspace"]
    first = cache_in_use(ws)
    foundation_weights = (ws.foundation / "model.safetensors").read_bytes()
    scenario_weights = (ws.scenario("churn") / "model.safetensors").read_bytes()

    driver = sensor_driver(defs, instance, resources)
    tick, run = driver.tick, driver.run

    # the daemons' first ticks: the history counts as done; the newest day gets scored
    extract = tick("purchases_new_data", None)
    assert not extract.run_requests
    automation = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    scoring = tick("score_after_cache", None)
    (request,) = scoring.run_requests
    assert request.partition_key == "2026-10-31"
    run("score", request)

    # a day of new events lands in the warehouse
    small_project.append_day(tmp_path / "warehouse.duckdb")  # NEW_DAY
    extract = tick("purchases_new_data", extract.cursor)
    (request,) = extract.run_requests
    assert request.partition_key == NEW_DAY
    run("extract_purchases", request)
    automation = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=automation.cursor)
    assert automation.get_requested_partitions(dg.AssetKey("cache")) == {None}
    assert dg.materialize(assets, selection=[dg.AssetKey("cache")], resources=resources, instance=instance).success
    grown = cache_in_use(ws)
    assert grown.manifest["mode"] == "append" and grown.lineage == first.lineage
    assert grown.manifest["n_events"] == first.manifest["n_events"] + 30
    assert grown.n_entities == first.n_entities + 1

    scoring = tick("score_after_cache", scoring.cursor)
    (request,) = scoring.run_requests
    assert request.partition_key == NEW_DAY
    assert set(request.asset_selection) == {dg.AssetKey(["predictions", "churn"]), dg.AssetKey("embeddings")}
    run("score", request)
    scores = pq.read_table(ws.predictions("churn") / f"{NEW_DAY}.parquet").to_pydict()
    assert "C_NEW" in scores["customer_id"]  # a customer first seen today is scored too
    assert all(0.0 <= s <= 1.0 for s in scores["score"])
    embedded = pq.read_table(ws.embeddings / f"{NEW_DAY}.parquet")
    assert "C_NEW" in embedded.column("customer_id").to_pylist()

    # nothing retrained, and the next ticks find nothing new
    assert (ws.foundation / "model.safetensors").read_bytes() == foundation_weights
    assert (ws.scenario("churn") / "model.safetensors").read_bytes() == scenario_weights
    assert not tick("purchases_new_data", extract.cursor).run_requests
    assert not tick("score_after_cache", scoring.cursor).run_requests


def test_days_to_score():
    from datetime import date

    newest = date(2026, 11, 3)
    assert days_to_score(newest, None, "fp1", 31) == ["2026-11-03"]
    state = {"fingerprint": "fp0", "newest_day": "2026-11-01"}
    assert days_to_score(newest, state, "fp1", 31) == ["2026-11-02", "2026-11-03"]
    assert days_to_score(newest, state, "fp1", 1) == ["2026-11-03"]
    assert days_to_score(newest, {"fingerprint": "fp1", "newest_day": "2026-11-03"}, "fp1", 31) == []
    # late rows: the cache changed without getting newer, so its newest day is scored again
    assert days_to_score(newest, {"fingerprint": "fp0", "newest_day": "2026-11-03"}, "fp1", 31) == ["2026-11-03"]
    assert json.dumps(days_to_score(newest, state, "fp1", 31))
