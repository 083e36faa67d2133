"""The scenario recipe (models/train/scenario.py) on a tiny churn world: what it saves, what it
reports, that it is the steps it names and nothing else, and that the asset and the benches run it."""

import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from habitus.models.data.features import FeatureSpec
from habitus.models.data.targets import TargetSpec
from habitus.models.evaluate.baselines import lightgbm_scores
from habitus.models.evaluate.holdout import protocol, score_holdout
from habitus.models.heads.stacked_head import fit_head, load_head
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.nn.network import load_trunk
from habitus.models.serve.predict import load_model
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train import scenario as recipe
from habitus.models.train.config import FinetuneConfig, LoraConfig, ScenarioConfig
from habitus.models.train.finetune import finetune

ROOT = Path(__file__).resolve().parents[2]
HORIZON = 14  # (churn_foundation's horizon, tests/models/conftest.py)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(churn_foundation):
    """(cache, foundation state, foundation info with its weights' fingerprint, the churn scenario's config)."""
    cache, test_cutoff, state, info = churn_foundation
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    cfg = ScenarioConfig("churn", CHURN, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, FINETUNE,
                         refit=False)  # (the measured model saved: tests/models/test_refit.py has the refit)
    return cache, state, info, cfg


@pytest.fixture(scope="module")
def saved(world, tmp_path_factory):
    cache, state, info, cfg = world
    path = tmp_path_factory.mktemp("scenario") / "churn"
    return recipe.train_scenario(cache, state, info, cfg, path=path, device="cpu", log=lambda _: None), path


def test_the_checkpoint_holds_the_model_its_head_and_its_report(world, saved):
    cache, _, info, cfg = world
    run, path = saved
    weights, config = load_checkpoint(path)
    assert config["weights_sha256"] == run.digest and config["scenario"] == "churn"
    assert config["metrics"] == run.report and config["foundation_sha256"] == info["weights_sha256"]
    assert config["beats_baselines"] == recipe.beats_baselines(CHURN, run.report)
    assert config["finetune"] == dataclasses.asdict(FINETUNE) and config["lora"] is None
    model, spec, task = load_model(weights, config)
    x = torch.randn(7, info["net"]["in_dim"])
    with torch.no_grad():
        assert torch.equal(model(x), run.trained.model.eval()(x))
    assert task == CHURN
    # the head chosen on validation is saved beside the weights and loads back as the same choice
    assert run.head is not None and config["head"] == {"chosen": run.head.chosen, "weight": run.head.weight}
    assert load_head(path, config).chosen == run.head.chosen


def test_the_report_puts_the_model_next_to_its_baselines_on_the_holdout(saved):
    run, _ = saved
    report = run.report
    assert set(report["baselines"]) >= {"lightgbm"}
    for metrics in [report["model"], report["network"], *report["baselines"].values()]:
        assert 0.0 <= metrics["auroc"] <= 1.0
    assert report["entities"] == len(run.holdout.y) > 50
    assert report["model"]["auroc"] > 0.6  # (half the customers stop: a learnable signal)
    assert set(run.seconds) == {"finetune", "head", "baselines", "holdout"}


def test_the_recipe_is_finetune_then_the_head_then_the_baselines_then_the_holdout(world, saved):
    """The same steps written out by hand give the same model and the same figures, to the last digit."""
    cache, state, info, cfg = world
    run, _ = saved
    trained = finetune(cache, state, info, CHURN, list(cfg.train_cutoffs), cfg.val_cutoff, FINETUNE, device="cpu",
                       log=lambda _: None)
    spec = FeatureSpec.from_dict(info["feature_spec"])
    head = fit_head(cache, spec, CHURN, load_trunk(state, info["net"]), trained.model, cfg.train_cutoffs,
                    cfg.val_cutoff)
    lgbm = lightgbm_scores(cache, spec, CHURN, cfg.train_cutoffs, cfg.val_cutoff, cfg.test_cutoff)
    report = score_holdout(trained.model, cache, spec, CHURN, cfg.test_cutoff, constant=trained.info["val_target_mean"],
                           extra={"lightgbm": lgbm}, head=head).report
    assert report == run.report
    for k, v in trained.model.state_dict().items():
        assert torch.equal(v, run.trained.model.state_dict()[k]), k


def test_lora_adapters_are_trained_then_merged_into_plain_weights(world, tmp_path):
    cache, state, info, cfg = world
    run = recipe.train_scenario(cache, state, info, dataclasses.replace(cfg, lora=LoraConfig(rank=2, alpha=4.0),
                                                                         head="network"),
                                path=tmp_path / "lora", device="cpu", log=lambda _: None, baselines=False)
    weights, config = load_checkpoint(tmp_path / "lora")
    assert config["lora"] == {"rank": 2, "alpha": 4.0} and config["training"]["lora_rank"] == 2
    assert not any(".lora_" in k for k in weights) and run.head is None and config["head"]["chosen"] == "network"
    assert "lightgbm" not in run.report["baselines"]
    # the trunk moved only through its adapters: a change of rank 2 to each layer's weight
    singular = torch.linalg.svdvals(weights["trunk.blocks.0.up.weight"] - state["trunk.blocks.0.up.weight"])
    assert singular[1] > 0 and singular[2] < 1e-3 * singular[0]


def test_a_resumed_recipe_clears_its_saved_state_once_the_checkpoint_is_written(world, tmp_path):
    cache, state, info, cfg = world
    resume = tmp_path / "resume"
    recipe.train_scenario(cache, state, info, dataclasses.replace(cfg, save_every_steps=1, head="network"),
                          path=tmp_path / "churn", device="cpu", log=lambda _: None, resume_dir=resume,
                          baselines=False)
    # saved while it trained (resume/scenario, resume/refit), cleared after
    assert (tmp_path / "churn" / "model.safetensors").exists() and (resume / "scenario").is_dir()
    assert not list(resume.rglob("latest"))


def _calls(path: Path) -> set[str]:
    return {node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
            and isinstance(node.func, (ast.Name, ast.Attribute))}


@pytest.mark.parametrize("module", ["assets/scenarios.py", "bench/quality.py", "bench/explain_setup.py"])
def test_the_asset_and_the_benches_run_the_recipe_not_a_copy_of_it(module):
    calls = _calls(ROOT / module)
    assert "train_scenario" in calls
    assert not calls & {"finetune", "fit_head", "lightgbm_scores", "score_holdout", "evaluate", "save_checkpoint"}


def test_the_quality_bench_reports_what_the_recipe_measured(world, monkeypatch):
    cache, state, info, cfg = world
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("quality_bench", ROOT / "bench" / "quality.py")
        quality = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(quality)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    runs, configs = [], []

    def spy(*args, **kwargs):
        configs.append((args[3], kwargs.get("stack")))
        runs.append(recipe.train_scenario(*args, **{**kwargs, "device": "cpu"}))
        return runs[-1]

    monkeypatch.setattr(quality, "train_scenario", spy)
    monkeypatch.setattr(quality, "finetune_config", lambda row: FINETUNE)
    plan = protocol(cfg.test_cutoff, HORIZON, 3, cache.time_range[0])
    rows = quality.score_task(cache, state, info, CHURN, plan, "churn")
    tuned, scratch, bare = runs
    assert not tuned.trained.info.get("lora_rank") and scratch.head is None
    # the served recipe without the foundation: a random trunk, and trees that read no representation
    (bare_cfg, bare_stack) = configs[2]
    assert bare_cfg.from_scratch and bare_cfg.head == configs[0][0].head and bare_stack.components == 0
    if bare.head is not None:
        assert bare.head.stack.reduction.matrix.shape[1] == 0
    assert rows and rows[0]["metric"] == "auroc"
    for row in rows:
        metric = row["metric"]
        assert row["habitus"] == tuned.report["model"][metric]
        assert row["baselines"]["lightgbm"] == tuned.report["baselines"]["lightgbm"][metric]
        assert row["baselines"]["habitus (network alone)"] == tuned.report["network"][metric]
        assert row["baselines"]["habitus (no pretraining)"] == scratch.report["model"][metric]
        assert row["baselines"]["served head, no foundation"] == bare.report["model"][metric]
