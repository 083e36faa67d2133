"""Managed-job entry points (pipelines/run/managed.py) in a simulated SageMaker layout: the warehouse as a
mounted input channel (Parquet), the project YAML in another channel, the local disk as the workspace,
the model folder as `output:`, the failure file; then a scoring job on another "machine" that starts
from that model folder. And the executor settings: the project's `executor:` and the CLI over it."""

import json
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from habitus.pipelines.cli import main
from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.orchestration.build import build_resources
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.pipelines.config.operations import with_executor

CHURN = {"task": "binary", "target": {"no_event": "purchases", "within": "14d"}, "epochs": 1}


def _config(small_project, scenarios: dict | None = None, **top) -> dict:
    spend = {"task": "regression", "target": {"sum": "purchases.price", "within": "14d"}, "epochs": 1,
             "lora": {"rank": 4}, "inference_precision": "int8", "head": "network"}  # (int8's effect: the network's)
    return small_project.config(
        purchases=["product_id", "store_id", "price"], events={"start": "2026-07-01", "end": "2026-11-01"},
        customers=["age", "segment"], foundation={"cutoff_every": "14d"},
        scenarios=scenarios or {"churn": CHURN, "spend": spend}, predictions={"start": "2026-10-01"}, **top)


def _finished(rc: int, failure: Path) -> None:
    """Exit 0 with no failure file: every stage ran (a model below its baseline on this tiny warehouse is
    not promoted, and is not a failed job)."""
    assert rc == 0 and not failure.exists(), failure.read_text() if failure.exists() else rc


@pytest.fixture(scope="module")
def layout(tmp_path_factory, small_project):
    """/opt/ml of a training job, in a temporary folder: input channels, model folder, output folder."""
    root = tmp_path_factory.mktemp("sagemaker")
    db = root / "warehouse.duckdb"
    generate_demo_warehouse(db, customers=400, products=60, stores=4, start="2026-07-01", end="2026-10-31", seed=3)
    channel = root / "opt/ml/input/data/warehouse"  # what SageMaker mounts from s3://.../warehouse/
    channel.mkdir(parents=True)
    con = duckdb.connect(str(db), read_only=True)
    for table in ("purchases", "customers", "products"):
        con.sql(f"COPY {table} TO '{channel / table}.parquet' (FORMAT parquet)")
    con.close()
    config = root / "opt/ml/input/data/config"
    config.mkdir(parents=True)
    small_project.write(config, _config(
        small_project, workspace="${HABITUS_WORKSPACE}", output="${SM_MODEL_DIR}",
        connection={"type": "parquet", "path": "${SM_CHANNEL_WAREHOUSE}"},
        executor={"device": "cpu", "threads": 1, "processes": 1}))
    return root


def _env(monkeypatch, root: Path, disk: str, model: Path) -> Path:
    monkeypatch.setenv("SM_CHANNEL_WAREHOUSE", str(root / "opt/ml/input/data/warehouse"))
    monkeypatch.setenv("SM_CHANNEL_CONFIG", str(root / "opt/ml/input/data/config"))
    monkeypatch.setenv("SM_MODEL_DIR", str(model))
    monkeypatch.setenv("SM_OUTPUT_DIR", str(root / "opt/ml/output"))
    monkeypatch.setenv("HABITUS_WORKSPACE", str(root / disk))  # the instance's local disk
    monkeypatch.delenv("HABITUS_FAILURE_FILE", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    return root / "opt/ml/output/failure"


@pytest.mark.slow
def test_a_training_job_then_a_scoring_job_elsewhere(layout, monkeypatch, capsys):
    model = layout / "opt/ml/model"
    failure = _env(monkeypatch, layout, "local-disk/train", model)
    config = str(layout / "opt/ml/input/data/config/project.yaml")
    # spend (the scenario with a "training mean" baseline) passes whatever it scores: this test reads its
    # network's int8 scores on the scoring machine; churn's verdict is its own (a loss serves its baseline)
    import habitus.models.train.scenario as recipe

    verdict = recipe.beats_baselines
    monkeypatch.setattr(recipe, "beats_baselines",
                        lambda task, report: "training mean" in report["baselines"] or verdict(task, report))

    _finished(main(["train", "--config", config, "--stage", "foundation"]), failure)
    assert json.loads((model / "manifests" / "foundation.json").read_text())["files"]
    assert not (model / "manifests" / "scenario").exists()  # that stage did not run
    _finished(main(["train", "--config", config, "--stage", "scenarios"]), failure)
    out = capsys.readouterr().out
    assert "churn" in out and "binary" in out and "auroc" in out  # the report `habitus demo` prints
    ws = layout / "local-disk/train"
    trained = json.loads((ws / "checkpoints/scenarios/churn/config.json").read_text())
    assert trained["training"]["device"] == "cpu"  # the project's executor
    for rel in ("checkpoints/foundation/model.safetensors", "checkpoints/scenarios/churn/model.safetensors"):
        assert (model / rel).read_bytes() == (ws / rel).read_bytes()

    # a scoring job on another machine: the first job's model folder mounted as its `model` channel,
    # its own output folder, an empty local disk
    monkeypatch.setenv("SM_CHANNEL_MODEL", str(model))
    scored_out = layout / "opt/ml/processing/output"
    failure = _env(monkeypatch, layout, "local-disk/score", scored_out)
    assert main(["restore", "--config", config, "--from", str(model)]) == 0
    _finished(main(["score", "--config", config, "--date", "2026-10-30"]), failure)
    _finished(main(["embed", "--config", config, "--date", "2026-10-30"]), failure)
    other = layout / "local-disk/score"
    table = pq.read_table(other / "predictions/churn/2026-10-30.parquet")
    assert table.num_rows > 300
    # what the training job left serving: the trained model where it beat its baselines, else the best
    # baseline's (a version of kind "baseline"), carried by the upload to the scoring machine
    served = json.loads((model / "checkpoints/passed/churn/config.json").read_text())
    assert (served["weights_sha256"] == trained["weights_sha256"] if trained["beats_baselines"]
            else served["kind"] == "baseline")
    assert set(table.column("model_fingerprint").to_pylist()) == {served["weights_sha256"][:16]}
    assert pq.read_metadata(other / "embeddings/2026-10-30.parquet").num_rows > 300
    uploaded = json.loads((scored_out / "manifests/predictions/churn.json").read_text())["files"]
    assert list(uploaded) == ["predictions/churn/2026-10-30.parquet"]
    assert (scored_out / "embeddings/2026-10-30.parquet").exists()
    assert not (other / "sources/purchases/2026-11.parquet").exists()  # extracted up to the scored day only

    # spend: LoRA adapters of rank 4 trained (and merged), scored in int8 (its own setting), churn in fp32
    spend = json.loads((ws / "checkpoints/scenarios/spend/config.json").read_text())
    assert spend["lora"] == {"rank": 4, "alpha": 16.0} and spend["training"]["lora_rank"] == 4
    from habitus.models.nn.checkpoint import load_checkpoint

    weights = sum(t.numel() for t in load_checkpoint(ws / "checkpoints/scenarios/spend")[0].values())
    assert 0 < spend["training"]["trainable_parameters"] < weights / 2  # the adapters and the head only
    assert _scores(other, "spend", int8=False) != pytest.approx(_scores(other, "spend", int8=True), abs=0)
    assert _scores(other, "spend", int8=True) == pytest.approx(_written(other, "spend"), abs=1e-6)
    if served.get("kind") != "baseline":
        assert _scores(other, "churn", int8=False) == pytest.approx(_written(other, "churn"), abs=1e-6)
    else:  # LightGBM's saved model (or the rule) scored it on the scoring machine
        assert _baseline_scores(other, "churn", served) == pytest.approx(_written(other, "churn"), abs=1e-6)


def _written(ws: Path, name: str) -> list[float]:
    return pq.read_table(ws / f"predictions/{name}/2026-10-30.parquet").column("score").to_pylist()


def _baseline_scores(ws: Path, name: str, served: dict) -> list[float]:
    """The scenario's scores of 2026-10-30 from the baseline version serving it: LightGBM's saved model on
    the hand features of the eligible entities (a rule: the task's own rule)."""
    from datetime import datetime, timezone

    from habitus.assets.serving import serving_checkpoint
    from habitus.models.cache import Cache
    from habitus.models.data.features import FeatureSpec
    from habitus.models.evaluate.baselines import LIGHTGBM_FILE, _dataset
    from habitus.models.storage.files import read_json
    from habitus.models.tasks.spec import TaskSpec
    from habitus.resources.store.workspace import Workspace

    assert served["baseline"] == "lightgbm", served["baseline"]
    import lightgbm as lgb

    workspace = Workspace(root=str(ws))
    cache = Cache(workspace.cache_root / read_json(workspace.cache_root / "current.json")["folder"])
    booster = lgb.Booster(model_file=str(serving_checkpoint(workspace, name)[0] / LIGHTGBM_FILE))
    cutoff = int(datetime(2026, 10, 31, tzinfo=timezone.utc).timestamp())
    x, _ = _dataset(cache, FeatureSpec.from_dict(served["feature_spec"]), TaskSpec.from_dict(served["task"]), [cutoff])
    return booster.predict(x).tolist()


def _scores(ws: Path, name: str, *, int8: bool) -> list[float]:
    """The scenario's scores of 2026-10-30 computed here from its checkpoint, in fp32 or int8."""
    from datetime import datetime, timezone

    import numpy as np

    from habitus.assets.serving import serving_checkpoint
    from habitus.models.cache import Cache
    from habitus.models.nn.checkpoint import load_checkpoint
    from habitus.models.serve.predict import load_model, predict
    from habitus.models.nn.quantize import for_inference
    from habitus.models.heads.stacked_head import load_head
    from habitus.models.storage.files import read_json
    from habitus.resources.store.workspace import Workspace

    workspace = Workspace(root=str(ws))
    cache = Cache(workspace.cache_root / read_json(workspace.cache_root / "current.json")["folder"])
    path = serving_checkpoint(workspace, name)[0]
    state, config = load_checkpoint(path)
    model, spec, task = load_model(state, config)
    model = for_inference(model, "int8" if int8 else "fp32")
    cutoff = int(datetime(2026, 10, 31, tzinfo=timezone.utc).timestamp())
    batches = predict(model, cache, spec, task, cutoff, device="cpu", head=load_head(path, config))
    return np.concatenate([b.column("score").to_numpy() for b in batches]).tolist()


def test_a_failed_job_writes_the_failure_file(layout, monkeypatch, tmp_path):
    failure = _env(monkeypatch, layout, "local-disk/empty", tmp_path / "nothing-uploaded")
    config = str(layout / "opt/ml/input/data/config/project.yaml")
    assert main(["score", "--config", config, "--date", "2026-10-30"]) == 3
    text = failure.read_text()
    assert "habitus score failed" in text and "no foundation checkpoint was uploaded there" in text
    failure.unlink()
    assert main(["score", "--config", config, "--date", "2027-01-05"]) == 3
    assert "--date 2027-01-05: not a day of the predictions' partitions" in failure.read_text()
    failure.unlink()
    monkeypatch.delenv("SM_MODEL_DIR")
    assert main(["train", "--config", config]) == 2  # ${SM_MODEL_DIR} is not set: a config error
    assert "environment variable SM_MODEL_DIR is not set" in failure.read_text()


def _project(small_project, tmp_path, **extra) -> Path:
    return small_project.write(tmp_path, _config(small_project, connection={"type": "parquet", "path": "data"},
                                                 **extra))


def test_executor_settings_come_from_the_yaml_and_the_command_line(tmp_path, small_project):
    import argparse

    path = _project(small_project, tmp_path, executor={"device": "cpu", "processes": 2, "precision": "fp32",
                                        "inference_precision": "int8", "threads": 3, "inference_processes": 2})
    project = load_project(path)
    executor = build_resources(project)["executor"]
    assert (executor.device, executor.processes, executor.threads, executor.inference_precision) == ("cpu", 2, 3, "int8")
    assert executor.inference_processes == 2
    args = argparse.Namespace(device="cuda", processes=None, threads=None, precision="bf16", inference_precision=None)
    over = build_resources(with_executor(project, args))["executor"]
    assert (over.device, over.processes, over.threads, over.precision, over.inference_precision) == \
        ("cuda", 2, 3, "bf16", "int8")
    no_executor = load_project(_project(small_project, tmp_path))
    assert build_resources(no_executor)["executor"].processes == 1  # no `executor:`
    with pytest.raises(ConfigError, match=r"--processes: Input should be greater than or equal to 0"):
        with_executor(project, argparse.Namespace(processes=-1))


def test_bad_executor_and_scenario_settings_name_the_key(tmp_path, small_project):
    with pytest.raises(ConfigError, match=r"executor.device: String should match pattern"):
        load_project(_project(small_project, tmp_path, executor={"device": "tpu"}))
    with pytest.raises(ConfigError, match=r"executor.precision: Input should be 'fp32' or 'bf16'"):
        load_project(_project(small_project, tmp_path, executor={"precision": "fp16"}))
    scenarios = {"churn": {**CHURN, "lora": {"rank": 0}}}
    with pytest.raises(ConfigError, match=r"scenarios.churn.lora.rank: Input should be greater than or equal to 1"):
        load_project(_project(small_project, tmp_path, scenarios=scenarios))
    scenarios = {"churn": {**CHURN, "inference_precision": "int4"}}
    with pytest.raises(ConfigError, match=r"scenarios.churn.inference_precision: Input should be"):
        load_project(_project(small_project, tmp_path, scenarios=scenarios))
    with pytest.raises(ConfigError, match=r"output 'ftp://host/x': use s3://, gs://, abfs://"):
        load_project(_project(small_project, tmp_path, output="ftp://host/x"))
    ok = load_project(_project(small_project, tmp_path, output="models/out",
                               scenarios={"churn": {**CHURN, "lora": {"rank": 4},
                                                    "inference_precision": "int8"}}))
    assert ok.output == str((tmp_path / "models/out").resolve())  # a folder resolves against the file
    assert ok.scenarios["churn"].lora.rank == 4 and ok.scenarios["churn"].inference_precision == "int8"
