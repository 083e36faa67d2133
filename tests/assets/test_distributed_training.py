"""The training assets with the executor's `processes: 2`: foundation_model and a scenario each run
torchrun (2 gloo CPU processes) from the asset, stream the ranks' lines into the Dagster log, and
go on with rank 0's result exactly as after training in their own process: the checkpoint, its
metadata, the scenario's hold-out report and its check."""

import dagster as dg
import pytest
import yaml
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.assets.checks import build_checks
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.resources.training.executor import TrainingExecutor

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::dagster.BetaWarning")]
FOUNDATION, CHURN = dg.AssetKey("foundation_model"), dg.AssetKey(["scenario", "churn"])


def _project(root):
    warehouse = root / "warehouse.duckdb"
    generate_demo_warehouse(warehouse, customers=300, products=60, stores=5, end="2026-05-31", seed=2)
    cfg = {"workspace": str(root / "ws"), "connections": {"warehouse": {"type": "duckdb", "path": str(warehouse)}},
           "entity": "customer_id",
           "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                        "timestamp": "ts", "columns": ["product_id", "price"], "start": "2026-03-01",
                        "end": "2026-06-01"}],
           "foundation": {"hidden": 16, "layers": 1, "epochs": 2, "batch_size": 64},
           "scenarios": {"churn": {"task": "binary", "epochs": 2, "train_cutoffs": 2,
                                   "target": {"no_event": "purchases", "within": "14d"}}}}
    (root / "project.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return load_project(root / "project.yaml")


def test_training_assets_run_in_two_processes(tmp_path, instance):
    project = _project(tmp_path)
    assets, checks = build_assets(project), build_checks(project)
    resources = {**build_resources(project), "executor": TrainingExecutor(device="cpu", processes=2, threads=1)}

    def run(selection, **kw):
        result = dg.materialize([*assets, *checks], selection=selection, resources=resources, instance=instance,
                                raise_on_error=False, **kw)
        failed = [e.step_key for e in result.all_events if e.is_step_failure]
        # a tiny model may lose to its baselines: that blocking check may fail, nothing else
        assert set(failed) <= {"scenario__churn_beats_baselines"}, [e.event_specific_data for e in result.all_events
                                                                   if e.is_failure]
        return result

    run([dg.AssetKey(["source", "purchases"])],
        tags={ASSET_PARTITION_RANGE_START_TAG: "2026-03-01", ASSET_PARTITION_RANGE_END_TAG: "2026-05-01"})
    run([dg.AssetKey("cache")])
    foundation = run([FOUNDATION])
    meta = foundation.asset_materializations_for_node("foundation_model")[0].metadata
    state, config = load_checkpoint(tmp_path / "ws" / "checkpoints" / "foundation")  # refuses a damaged one
    assert meta["fingerprint"].value == config["weights_sha256"][:16]
    assert meta["final_validation_loss"].value == config["curves"]["val_loss"][-1] > 0
    assert config["training"]["device"] == "cpu" and config["training"]["steps"] > 0
    assert meta["parameters"].value == sum(v.numel() for k, v in state.items()   # buffers are not parameters
                                           if not k.startswith(("trunk.in_", "trunk.ple_edges")))
    logs = [e.message for e in instance.all_logs(foundation.run_id) if e.message]
    assert any("launching 2 processes" in m for m in logs)
    assert sum("foundation epoch" in m for m in logs) == 2  # rank 0's lines only, streamed into the run's log

    scenario = run([CHURN])  # fine-tuned from that checkpoint, in 2 processes too
    meta = scenario.asset_materializations_for_node("scenario__churn")[0].metadata
    _, churn = load_checkpoint(tmp_path / "ws" / "checkpoints" / "scenarios" / "churn")
    assert churn["foundation_sha256"] == config["weights_sha256"]
    assert churn["training"]["processes"] == 2 and churn["training"]["weights_gap"] == 0.0
    assert 0.0 <= meta["auroc"].value <= 1.0 and meta["holdout_entities"].value > 0
    assert [e.check_name for e in scenario.get_asset_check_evaluations()] == ["beats_baselines"]
