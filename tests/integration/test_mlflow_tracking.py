"""MLflow tracking and registry against a real `mlflow server` (SQLite store, artifacts in a temporary folder):
a small demo project with an `mlflow:` block trains its foundation model once and its churn scenario twice;
each training is one run with its metrics, each scenario training one registered version tagged with its
fingerprint, the `serving` alias on the version the pointer names, following a rollback from the CLI and
from the `rollback` job. Then the server stops answering: training and rollback go on, with a warning, and
the next runs, with nothing to train, record what the server missed."""

import dataclasses

import dagster as dg
import pytest
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

import habitus.models.train.scenario
from habitus.assets.serving import versions
from habitus.pipelines.cli import main
from habitus.pipelines.config.project import Scenario, load_project
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.build import build_assets, build_resources

pytestmark = [pytest.mark.integration, pytest.mark.slow]
FINETUNE_CONFIG = Scenario.finetune_config
CHURN = dg.AssetKey(["scenario", "churn"])


def _project(tmp_path, small_project, uri: str):
    config = small_project.config(
        purchases=["product_id", "price"], events={"partition": "monthly", "start": "2026-07-01"},
        foundation={"cutoff_every": "14d"}, scenarios={"churn": small_project.churn("14d", epochs=1)},
        mlflow={"tracking_uri": uri, "experiment": f"test-{tmp_path.name}", "model_prefix": f"{tmp_path.name}-"})
    path = small_project.write(tmp_path, config, customers=400, products=40, stores=3, start="2026-07-01",
                               end="2026-10-31", seed=5)
    return load_project(path), str(path)


def _train_churn(assets, resources, instance, monkeypatch, k: int) -> str:
    """Fine-tuning with another seed: a retrained model with other weights. Returns the kept fingerprint."""
    monkeypatch.setattr(Scenario, "finetune_config", lambda scenario, spill_dir=None: dataclasses.replace(
        FINETUNE_CONFIG(scenario, spill_dir), seed=k, learning_rate=scenario.learning_rate * (1 + k)))
    assert dg.materialize(assets, selection=[CHURN], resources=resources, instance=instance).success
    return versions(resources["workspace"], "churn").fingerprints()[-1]


@pytest.mark.filterwarnings("ignore::dagster.BetaWarning")
def test_runs_versions_and_the_serving_alias_follow_training_and_rollback(mlflow_server, tmp_path, instance,
                                                                         small_project, monkeypatch, capsys):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = mlflow_server.uri  # the server starts while the data is generated, extracted and cached
    project, config = _project(tmp_path, small_project, uri)
    monkeypatch.setenv("HABITUS_CONFIG", config)
    resources, assets = build_resources(project), build_assets(project)
    ws = resources["workspace"]
    purchases = dg.AssetKey(["source", "purchases"])
    keys = next(a for a in assets if a.key == purchases).partitions_def.get_partition_keys()
    assert dg.materialize(assets, selection=[purchases], resources=resources, instance=instance,
                          tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}).success
    first = [dg.AssetKey(["source", "customers"]), dg.AssetKey(["source", "products"]), dg.AssetKey("cache")]
    assert dg.materialize(assets, selection=first, resources=resources, instance=instance).success
    mlflow_server.ready()
    assert dg.materialize(assets, selection=[dg.AssetKey("foundation_model")], resources=resources,
                          instance=instance).success
    # two trainings, each promoted (the verdict forced: this test is about what follows promotion)
    monkeypatch.setattr(habitus.models.train.scenario, "beats_baselines", lambda task, report: True)
    a = _train_churn(assets, resources, instance, monkeypatch, 0)
    b = _train_churn(assets, resources, instance, monkeypatch, 1)
    store = versions(ws, "churn")
    assert a != b and store.serving() == b

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(project.mlflow.experiment)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.run_name for r in runs] == ["foundation_model", "scenario/churn", "scenario/churn"]
    assert all(r.info.status == "FINISHED" for r in runs)
    foundation_run, *churn_runs = runs
    assert {"train_loss", "val_loss"} <= set(foundation_run.data.metrics)
    assert foundation_run.data.params["hidden"] == "16" and foundation_run.data.tags["habitus.fingerprint"]
    for run, fp in zip(churn_runs, [a, b]):
        data = run.data
        assert data.tags["habitus.fingerprint"] == fp and data.tags["habitus.scenario"] == "churn"
        assert data.tags["habitus.foundation_fingerprint"] == foundation_run.data.tags["habitus.fingerprint"]
        assert data.tags["habitus.data.test_cutoff"] == store.info(fp)["data"]["test_cutoff"]
        assert data.tags["habitus.data.first_train_cutoff"] == store.info(fp)["data"]["first_train_cutoff"]
        assert data.metrics["holdout.model.auroc"] == pytest.approx(store.info(fp)["model"])
        assert any(k.startswith("holdout.baseline.") and k.endswith(".auroc") for k in data.metrics)
        assert data.params["task"] == "binary" and data.params["target.within"] == "14"
        assert data.params["finetune.seed"] == str(churn_runs.index(run))
        files = {f.path for f in client.list_artifacts(run.info.run_id, "checkpoint")}
        assert {"checkpoint/config.json", "checkpoint/version.json"} <= files

    name = f"{tmp_path.name}-churn"
    registered = {v.tags["habitus.fingerprint"]: v for v in client.search_model_versions(f"name='{name}'")}
    assert set(registered) == {a, b}  # one version per scenario training
    assert {registered[fp].run_id for fp in (a, b)} == {r.info.run_id for r in churn_runs}

    def alias() -> str:
        return client.get_model_version_by_alias(name, "serving").tags["habitus.fingerprint"]

    assert alias() == b
    # a rollback from the command line, then one from the UI's job: the alias follows the pointer
    assert main(["rollback", "churn", "--config", config]) == 0
    assert store.serving() == a and alias() == a
    job = build_definitions(project).resolve_job_def("rollback")
    assert job.execute_in_process(instance=instance, run_config={"ops": {"move_serving_pointer": {
        "config": {"scenario": "churn", "to": b[:8]}}}}).success
    assert store.serving() == b and alias() == b
    capsys.readouterr()

    # the server stops answering: a rollback moves the pointer all the same, with a warning naming the URI
    down = project.model_copy(update={"mlflow": project.mlflow.model_copy(update={"tracking_uri": "http://127.0.0.1:9"})})
    monkeypatch.setattr("habitus.pipelines.cli.load_project", lambda path=None: down)
    assert main(["rollback", "churn", "--config", config]) == 0
    assert store.serving() == a and alias() == b  # the registry keeps the alias where it was
    assert "MLflow at http://127.0.0.1:9" in capsys.readouterr().err

    # a training while the server does not answer, then a foundation run lost (as if killed between saving the
    # checkpoint and logging it): the next runs train nothing and record both
    c = _train_churn(build_assets(down), build_resources(down), instance, monkeypatch, 2)
    assert store.serving() == c and c not in registered and alias() == b
    client.delete_run(foundation_run.info.run_id)
    kept = store.fingerprints()
    assert dg.materialize(assets, selection=[dg.AssetKey("foundation_model"), CHURN], resources=resources,
                          instance=instance).success
    assert store.fingerprints() == kept  # nothing trained again
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.info.run_name for r in runs] == ["scenario/churn", "scenario/churn", "foundation_model", "scenario/churn"]
    assert runs[2].data.tags["habitus.fingerprint"] == foundation_run.data.tags["habitus.fingerprint"]
    assert runs[3].data.tags["habitus.fingerprint"] == c and alias() == c
    assert dg.materialize(assets, selection=[dg.AssetKey("foundation_model"), CHURN], resources=resources,
                          instance=instance).success
    assert len(client.search_runs([experiment.experiment_id])) == 4  # once recorded, not again
