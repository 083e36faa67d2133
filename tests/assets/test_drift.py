"""Drift checks on each day's predictions: simulated days appended one at a time and run as the daemons
run them (the new-data sensor extracts the day, the cache grows, `score_after_cache` scores it). On
days with the generator's usual behaviour no drift check fires; on shifted days (pipelines/demo/data.py:
a volume drop, a new store, two weeks of an outage) the volume, unknown-value and score checks fire,
their messages naming the numbers. Three trainings make three versions; a rollback from the CLI and
one from the UI's job make the next day's predictions carry the chosen fingerprint."""

import dataclasses
import re

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

import habitus.models.train.scenario
from habitus.models.evaluate.drift import psi, reference_distribution, volume_ratio
from habitus.assets.serving import versions
from habitus.pipelines.cli import main
from habitus.pipelines.config.project import Scenario, load_project
from habitus.pipelines.demo.data import append_demo_day
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.build import build_assets, build_resources

DRIFT = ("score_drift", "unknown_values", "event_volume")


def test_psi_reads_a_shift_and_not_a_resample():
    rng = np.random.default_rng(0)
    reference = reference_distribution(rng.beta(2, 5, 2000))
    assert psi(reference, rng.beta(2, 5, 2000)) < 0.02
    assert psi(reference, rng.beta(5, 2, 2000)) > 1.0
    assert reference_distribution(np.ones((5, 3))) is None and reference_distribution(None) is None
    assert volume_ratio(np.array([0, 10, 30, 10])) == (10, 20.0, 0.5)  # days without events are not history


def _project(tmp_path, small_project):
    config = small_project.config(
        purchases=["product_id", "store_id", "price"], events={"partition": "daily", "start": "2026-07-01"},
        customers=["age", "segment"], foundation={"cutoff_every": "14d"},
        scenarios={"churn": small_project.churn("14d", epochs=1)}, predictions={"start": "2026-10-01"},
        # PSI 0.25 is a large shift; this one-epoch churn model on 1,000 customers moves less (measured
        # 2026-12-03: 0.009-0.018 on unshifted days, 0.145 after a 14-day outage), so the test warns at 0.1
        drift={"max_psi": 0.1})
    return load_project(small_project.write(tmp_path, config, customers=1000, products=60, stores=4,
                                            start="2026-07-01", end="2026-10-31", seed=3))


def _retrain_with_other_weights(monkeypatch, k: int):
    """Fine-tuning with another seed and learning rate: a retrained model with other weights."""
    monkeypatch.setattr(Scenario, "finetune_config", lambda scenario, spill_dir=None: dataclasses.replace(
        FINETUNE_CONFIG(scenario, spill_dir), seed=k, learning_rate=scenario.learning_rate * (1 + k)))


FINETUNE_CONFIG = Scenario.finetune_config


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::dagster.BetaWarning")
def test_versions_rollback_and_drift_checks_over_appended_days(tmp_path, instance, small_project, monkeypatch,
                                                               capsys, sensor_driver):
    project = _project(tmp_path, small_project)
    config = str(tmp_path / "project.yaml")
    monkeypatch.setenv("HABITUS_CONFIG", config)  # the CLI sets it: undone after the test
    defs, resources, assets = build_definitions(project), build_resources(project), build_assets(project)
    ws = resources["workspace"]
    purchases = dg.AssetKey(["source", "purchases"])
    keys = next(a for a in assets if a.key == purchases).partitions_def.get_partition_keys()
    assert dg.materialize(assets, selection=[purchases], resources=resources, instance=instance,
                          tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}).success
    # three trainings, each promoted (the verdict forced: this test is about what follows promotion)
    monkeypatch.setattr(habitus.models.train.scenario, "beats_baselines", lambda task, report: True)
    first = [dg.AssetKey(["source", "customers"]), dg.AssetKey(["source", "products"]), dg.AssetKey("cache"),
             dg.AssetKey("foundation_model")]
    assert dg.materialize(assets, selection=first, resources=resources, instance=instance).success
    trained = []
    for k in range(3):
        _retrain_with_other_weights(monkeypatch, k)
        assert dg.materialize(assets, selection=[dg.AssetKey(["scenario", "churn"])], resources=resources,
                              instance=instance).success
        trained.append(versions(ws, "churn").serving())
    assert len(set(trained)) == 3 and versions(ws, "churn").fingerprints() == trained
    capsys.readouterr()
    assert main(["versions", "churn", "--config", config]) == 0
    listing = capsys.readouterr().out
    assert f"churn: serving the version {trained[2]} (beat its baselines); 3 version(s) kept" in listing
    assert all(f"{fp}  " in listing for fp in trained) and listing.count(" auroc ") == 3

    driver = sensor_driver(defs, instance, resources)
    tick, run = driver.tick, driver.run

    extract, scoring = tick("purchases_new_data", None), tick("score_after_cache", None)

    def days(*shifts) -> dict[str, dict]:
        """Append a day per shift, then run what the sensors ask for: the extraction, the cache, the scoring
        of each new day. Returns {day: {drift check: (passed, message)}}."""
        nonlocal extract, scoring
        for s in shifts:
            append_demo_day(tmp_path / "warehouse.duckdb", seed=3, shift=s)
        extract = tick("purchases_new_data", extract.cursor)
        for request in extract.run_requests:
            run("extract_purchases", request)
        assert dg.materialize(assets, selection=[dg.AssetKey("cache")], resources=resources, instance=instance).success
        scoring = tick("score_after_cache", scoring.cursor)
        out = {}
        for request in scoring.run_requests:
            result = run("score", request)
            out[request.partition_key] = {e.check_name: (e.passed, e.description)
                                          for e in result.get_asset_check_evaluations() if e.check_name in DRIFT}
        assert len(out) == len(shifts)
        for day, checks in out.items():
            print(day, checks)
        return out

    def quiet(checks: dict) -> bool:
        return all(passed for passed, _ in checks.values())

    def fingerprints(day: str) -> set:
        return set(pq.read_table(ws.predictions("churn") / f"{day}.parquet").column("model_fingerprint").to_pylist())

    # a rollback from the command line: the next day's predictions carry that version's fingerprint
    assert main(["rollback", "churn", "--to", trained[0][:8], "--config", config]) == 0
    ((day, checks),) = days(None).items()
    assert fingerprints(day) == {trained[0]} and quiet(checks), checks
    # and from the UI's job
    job = defs.resolve_job_def("rollback")
    assert job.execute_in_process(instance=instance, run_config={"ops": {"move_serving_pointer": {
        "config": {"scenario": "churn", "to": trained[1]}}}}).success
    ((day, checks),) = days(None).items()
    assert fingerprints(day) == {trained[1]} and quiet(checks), checks

    # unshifted days: nothing fires
    assert all(quiet(checks) for checks in days(None, None).values())
    # a volume drop
    ((day, checks),) = days("volume_drop").items()
    assert not checks["event_volume"][0] and checks["unknown_values"][0]
    assert re.search(rf"{day}: \d+ events against a mean of [\d.,]+ over the 28 days before \(0\.\d\dx\)",
                     checks["event_volume"][1])
    # a new store: values the model never saw
    ((day, checks),) = days("new_store").items()
    assert not checks["unknown_values"][0] and checks["event_volume"][0]
    assert re.search(rf"{day}: \d+ of [\d,]+ events \(\d+\.\d\d%\) have a value the model never saw "
                     rf"\(store_id \d+\)", checks["unknown_values"][1])
    # two weeks of an outage: the customers look like leaving, and the churn scores move
    outage = days(*["outage"] * 14)
    day, checks = list(outage.items())[-1]
    assert not checks["score_drift"][0] and not checks["event_volume"][0]
    assert re.search(rf"{day}: score PSI \d\.\d{{3}} against the hold-out of version {trained[1]}",
                     checks["score_drift"][1])
