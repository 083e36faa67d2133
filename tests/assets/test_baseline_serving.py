"""Serving that keeps the promise: a scenario whose model has never beaten its best baseline serves that
baseline (LightGBM's model fitted on the same cut-offs, or the rule), recorded as a version of kind
"baseline"; `habitus versions` says what serves and why; a rollback with nothing to go back to names
`--to`; and a scenario (and foundation) whose cache, foundation and settings did not change is not
trained again."""

import json
import shutil

import dagster as dg
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.assets.cache import current_cache
from habitus.assets.check_measures import baseline_margin
from habitus.assets.checks import build_checks
from habitus.assets.serving import serve_baseline, serving_checkpoint, versions
from habitus.models.data.features import FeatureSpec
from habitus.models.evaluate.baselines import LIGHTGBM_FILE, _dataset, baseline_predictions
from habitus.models.tasks import task as task_of
from habitus.models.tasks.spec import TaskSpec
from habitus.pipelines.cli import main
from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.pipelines.demo.data import generate_demo_warehouse

DAY = "2026-05-31"
# fine-tuning at an absurd learning rate diverges and the network alone is kept (no trees to rescue it):
# constant scores, AUROC 0.5, a genuine loss to every baseline
BAD_CHURN = {"task": "binary", "epochs": 1, "train_cutoffs": 1, "learning_rate": 1e4, "head": "network",
             "target": {"no_event": "purchases", "within": "14d"}}


def _config(root, warehouse) -> dict:
    return {"workspace": str(root / "ws"), "connections": {"warehouse": {"type": "duckdb", "path": str(warehouse)}},
            "entity": "customer_id",
            "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                         "timestamp": "ts", "columns": ["product_id", "price"], "start": "2026-03-01",
                         "end": "2026-06-01"},
                        {"name": "customers", "role": "entity_attributes", "connection": "warehouse",
                         "table": "customers", "columns": ["age", "segment"]},
                        {"name": "products", "role": "attributes", "connection": "warehouse", "table": "products",
                         "key": "product_id", "columns": ["brand", "category"]}],
            "foundation": {"hidden": 16, "layers": 1, "epochs": 1, "batch_size": 256},
            "scenarios": {"churn": BAD_CHURN},
            "predictions": {"start": "2026-05-01", "top_k": 3},
            "executor": {"device": "cpu", "threads": 1, "processes": 1}}


def _run(project, selection, instance, **kw) -> dg.ExecuteInProcessResult:
    return dg.materialize([*build_assets(project), *build_checks(project)], selection=selection,
                          resources=build_resources(project), raise_on_error=False, instance=instance, **kw)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small project whose churn model loses to its baselines, materialized once: (root, config path,
    project, instance, the run that trained and scored)."""
    root = tmp_path_factory.mktemp("baseline_serving")
    warehouse = root / "warehouse.duckdb"
    generate_demo_warehouse(warehouse, customers=300, products=80, stores=5, end="2026-05-31", seed=1)
    path = root / "project.yaml"
    path.write_text(yaml.safe_dump(_config(root, warehouse)))
    project = load_project(path)
    instance = dg.DagsterInstance.ephemeral()
    tags = {ASSET_PARTITION_RANGE_START_TAG: "2026-03-01", ASSET_PARTITION_RANGE_END_TAG: "2026-05-01"}
    assert _run(project, [dg.AssetKey(["source", "purchases"])], instance, tags=tags).success
    first = [dg.AssetKey(["source", "customers"]), dg.AssetKey(["source", "products"]), dg.AssetKey("cache"),
             dg.AssetKey("foundation_model"), dg.AssetKey(["scenario", "churn"]), dg.AssetKey(["predictions", "churn"])]
    result = _run(project, first, instance, partition_key=DAY)
    return root, path, project, instance, result


def test_a_scenario_that_loses_serves_its_best_baseline(trained):
    root, _, project, _, result = trained
    ws = build_resources(project)["workspace"]
    assert result.success  # the lost comparison is a WARN: the run goes on and scores with the baseline
    check = next(e for e in result.get_asset_check_evaluations() if e.check_name == "beats_baselines")
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
    assert "predictions use the baseline version" in check.description

    model = json.loads((ws.scenario("churn") / "config.json").read_text())
    assert model["beats_baselines"] is False
    best = baseline_margin(model)["best_baseline"]
    store = versions(ws, "churn")
    serving = store.serving()
    assert serving is not None and serving != model["weights_sha256"][:16]
    info = store.info(serving)
    assert info["kind"] == "baseline" and info["best_baseline"] == best
    assert info["model"] == model["metrics"]["baselines"][best]["auroc"]  # what serves scores what the baseline did
    folder, passed = serving_checkpoint(ws, "churn")
    config = json.loads((folder / "config.json").read_text())
    assert folder == store.path(serving) and not passed and config["baseline"] == best

    table = pq.read_table(ws.predictions("churn") / f"{DAY}.parquet")
    assert set(table.column("model_fingerprint").to_pylist()) == {serving}
    meta = result.asset_materializations_for_node("predictions__churn")[0].metadata
    assert meta["model_fingerprint"].text == serving and meta["checkpoint"].text.startswith("baseline version")

    # the scores are the baseline's own: LightGBM's saved model on the hand features as of the day's end
    cache = current_cache(ws)
    spec, task = FeatureSpec.from_dict(config["feature_spec"]), TaskSpec.from_dict(config["task"])
    cutoff = int(np.datetime64("2026-06-01T00:00:00", "s").astype(np.int64))
    assert best == "lightgbm"  # on this warehouse: lightgbm 0.7999, frequency 0.7824, recency 0.7481
    import lightgbm as lgb

    booster = lgb.Booster(model_file=str(folder / LIGHTGBM_FILE))
    x, _ = _dataset(cache, spec, task, [cutoff])  # the eligible entities in scoring order
    np.testing.assert_array_equal(table.column("score").to_numpy(), booster.predict(x).astype(np.float32))
    assert table.num_rows == len(x) > 0
    # the saved model is the one the hold-out measured: same cut-offs, parameters and seed
    test = int(np.datetime64(model["protocol"]["test_cutoff"].rstrip("Z"), "s").astype(np.int64))
    xt, yt = _dataset(cache, spec, task, [test])
    assert task_of(task).metrics(yt, booster.predict(xt))["auroc"] == pytest.approx(info["model"], abs=1e-6)


def test_versions_names_what_serves_and_rollback_names_to(trained, capsys):
    _, path, project, _, _ = trained
    serving = versions(build_resources(project)["workspace"], "churn").serving()
    capsys.readouterr()
    assert main(["versions", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"churn: serving the baseline version {serving} (lightgbm, which no trained model has beaten)" in out
    assert "foundation: serving " in out and "none" not in out
    assert main(["versions", "churn", "--config", str(path)]) == 0
    listing = capsys.readouterr().out
    assert f"* {serving}" in listing and "baseline " in listing and " model " in listing

    assert main(["report", "--config", str(path)]) == 0  # the written day says what scored it
    assert f"scored by its baseline lightgbm, version {serving})" in capsys.readouterr().out

    kept = versions(build_resources(project)["workspace"], "churn").fingerprints()
    assert main(["rollback", "churn", "--config", str(path)]) == 2  # nothing served before: what --to takes
    err = capsys.readouterr().err
    other = next(fp for fp in kept if fp != serving)
    assert "no version served before" in err and f"habitus rollback churn --to {other}" in err


def test_nothing_is_trained_again_when_nothing_changed(trained):
    _, _, project, instance, _ = trained
    ws = build_resources(project)["workspace"]
    before = versions(ws, "churn").fingerprints(), versions(ws, "churn").serving()
    foundation = (ws.foundation / "model.safetensors").stat().st_mtime_ns
    again = _run(project, [dg.AssetKey("foundation_model"), dg.AssetKey(["scenario", "churn"])], instance)
    assert again.success
    fm = again.asset_materializations_for_node("foundation_model")[0].metadata
    sm = again.asset_materializations_for_node("scenario__churn")[0].metadata
    assert fm["trained"].value is False and "not trained again" in fm["skipped"].text
    assert sm["trained"].value is False and "not trained again" in sm["skipped"].text
    assert (versions(ws, "churn").fingerprints(), versions(ws, "churn").serving()) == before
    assert (ws.foundation / "model.safetensors").stat().st_mtime_ns == foundation

    # a setting that changes training trains again
    changed = project.model_copy(update={"scenarios": {"churn": project.scenarios["churn"].model_copy(
        update={"epochs": 2})}})
    result = _run(changed, [dg.AssetKey(["scenario", "churn"])], instance)
    assert result.success
    meta = result.asset_materializations_for_node("scenario__churn")[0].metadata
    assert meta["trained"].value is True and "skipped" not in meta


def test_a_rule_baseline_serves_its_rule(trained):
    """Where the best baseline is a rule (here frequency: minus the events of the last 90 days), that
    rule scores, each entity from its own history."""
    import duckdb

    root, _, project, instance, _ = trained
    ws = build_resources(project)["workspace"]
    model = json.loads((ws.scenario("churn") / "config.json").read_text())
    cache, serving = current_cache(ws), versions(ws, "churn").serving()

    def probe(config, folder):  # what the scenario asset checks before a baseline serves
        next(baseline_predictions(config, folder, cache, int(np.datetime64("2026-05-21", "s").astype(np.int64)), k=1))

    # a baseline that is no rule of the task (LightGBM on a wide head's top labels) cannot serve: nothing moves
    other = {**model, "metrics": {**model["metrics"], "baselines": {
        **model["metrics"]["baselines"], "lightgbm (top 200 labels)": {"auroc": 0.99}}}}
    assert serve_baseline(ws, "churn", other, fit=lambda folder: pytest.fail("no model"), probe=probe) is None
    assert versions(ws, "churn").serving() == serving
    mark = versions(ws, "churn").folder / "unservable-baselines.json"  # (recorded: not tried again by each run)
    assert json.loads(mark.read_text()) == {
        model["weights_sha256"][:16]: "lightgbm (top 200 labels): no rule of the task serves it"}
    mark.unlink()  # (this hold-out was made up: the version's own best baseline can serve)

    model["metrics"]["baselines"]["lightgbm"]["auroc"] = 0.5  # frequency is now the best baseline
    fp = serve_baseline(ws, "churn", model, fit=lambda folder: pytest.fail("a rule fits no model"), probe=probe)
    assert versions(ws, "churn").serving() == fp and versions(ws, "churn").info(fp)["best_baseline"] == "frequency"
    result = _run(project, [dg.AssetKey(["predictions", "churn"])], instance, partition_key="2026-05-20")
    assert result.success
    table = pq.read_table(ws.predictions("churn") / "2026-05-20.parquet")
    assert set(table.column("model_fingerprint").to_pylist()) == {fp}
    with duckdb.connect(str(root / "warehouse.duckdb"), read_only=True) as con:
        counts = dict(con.execute(
            "SELECT customer_id, count(*) FROM purchases WHERE ts >= TIMESTAMP '2026-05-21' - INTERVAL 90 DAY "
            "AND ts <= TIMESTAMP '2026-05-21' GROUP BY 1").fetchall())
    scores = dict(zip(table.column("customer_id").to_pylist(), table.column("score").to_pylist()))
    assert len(scores) > 0 and scores == {c: -float(counts.get(c, 0)) for c in scores}


def test_a_model_per_label_is_saved_and_scores_what_the_hold_out_measured(trained, tmp_path):
    """A multilabel scenario's LightGBM baseline is a model per label: each saved at its label (a label
    without both classes in training: its constant), and served, they give the hold-out's scores."""
    from habitus.assets.foundation import test_cutoff
    from habitus.assets.scenarios import scenario_config
    from habitus.models.evaluate.baselines import lightgbm_scores, save_lightgbm
    from habitus.pipelines.config.project import Scenario

    _, _, project, _, _ = trained
    ws = build_resources(project)["workspace"]
    cache = current_cache(ws)
    foundation = json.loads((ws.foundation / "config.json").read_text())
    brands = Scenario(task="multilabel", target={"any_event": "purchases", "by": "brand", "within": "14d", "top": 4})
    cfg = scenario_config("brands", brands, cache, test_cutoff(project, cache))
    spec = FeatureSpec.from_dict(foundation["feature_spec"])
    saved = save_lightgbm(cache, spec, cfg.task, cfg.train_cutoffs, cfg.val_cutoff, cfg.test_cutoff, tmp_path)
    assert len(saved["labels"]) + len(saved["constants"]) == 4 and saved["labels"]
    measured = lightgbm_scores(cache, spec, cfg.task, cfg.train_cutoffs, cfg.val_cutoff, cfg.test_cutoff)
    names = task_of(cfg.task).label_values(cache, cfg.task)
    config = {"kind": "baseline", "baseline": "lightgbm", "lightgbm": saved, "feature_spec": foundation["feature_spec"],
              "task": cfg.task.to_dict(), "label_values": names}
    served = [dict(zip(labels, scores)) for b in baseline_predictions(config, tmp_path, cache, cfg.test_cutoff, k=4)
              for labels, scores in zip(b.column("labels").to_pylist(), b.column("scores").to_pylist())]
    assert len(served) == len(measured) > 0
    np.testing.assert_array_equal(np.array([[row[str(n)] for n in names] for row in served], np.float32), measured)


def test_a_run_killed_after_keeping_its_checkpoints_is_completed_by_the_next(trained):
    """A run killed after the foundation's checkpoint was saved but before it was kept as a version, and
    after the scenario's version was kept but before its best baseline served: the next run trains
    nothing and completes both (the outputs of a clean run, tests/faults/test_kill.py)."""
    _, _, project, instance, _ = trained
    ws = build_resources(project)["workspace"]
    store, foundations = versions(ws, "churn"), ws.foundation.parent / "foundation_versions"
    foundation = json.loads((ws.foundation / "config.json").read_text())["weights_sha256"][:16]
    shutil.rmtree(store.path(store.serving()))
    (store.folder / "serving.json").unlink()
    shutil.rmtree(foundations / foundation)
    (foundations / "serving.json").unlink()

    again = _run(project, [dg.AssetKey("foundation_model"), dg.AssetKey(["scenario", "churn"])], instance)
    assert again.success
    assert again.asset_materializations_for_node("foundation_model")[0].metadata["trained"].value is False
    assert again.asset_materializations_for_node("scenario__churn")[0].metadata["trained"].value is False
    assert json.loads((foundations / "serving.json").read_text())["serving"] == foundation
    assert (foundations / foundation / "version.json").exists()
    assert store.serving() is not None and store.info(store.serving())["kind"] == "baseline"
    # completed: the next run changes nothing (the pointer moved after the version was kept)
    history = store.pointer()["history"]
    assert _run(project, [dg.AssetKey(["scenario", "churn"])], instance).success
    assert store.pointer()["history"] == history
    assert (ws.foundation.parent / "foundation_loss.png").exists() and (ws.scenario("churn").parent / "churn_loss.png").exists()


def test_a_best_baseline_that_cannot_serve_is_not_fitted_again_by_each_run(trained, monkeypatch):
    """A version whose best baseline cannot serve (no model could be saved, no rule of that name) is
    recorded once: the runs that train nothing after it do not fit LightGBM again every time."""
    import habitus.assets.scenarios as scenarios

    _, _, project, instance, _ = trained
    ws = build_resources(project)["workspace"]
    store = versions(ws, "churn")
    trained_fp = json.loads((ws.scenario("churn") / "config.json").read_text())["weights_sha256"][:16]
    baseline = store.serving()
    shutil.rmtree(store.path(baseline))  # as if killed before its best baseline served
    (store.folder / "serving.json").unlink()
    fits = []
    monkeypatch.setattr(scenarios, "save_lightgbm", lambda *a, **k: fits.append(a) and None)
    for _ in range(2):
        assert _run(project, [dg.AssetKey(["scenario", "churn"])], instance).success
    assert len(fits) == 1 and store.serving() is None
    assert store.unservable_baseline(trained_fp) == "lightgbm: no model could be saved"
    # a baseline that can be saved serves once the mark is gone (here removed by hand)
    monkeypatch.undo()
    (store.folder / "unservable-baselines.json").unlink()
    assert _run(project, [dg.AssetKey(["scenario", "churn"])], instance).success
    assert store.info(store.serving())["kind"] == "baseline"
