"""The refit (ScenarioConfig.refit, models/train/refit.py) on the tiny churn world: it trains on
cut-offs through the test cut-off and reads no target past the data's end, the report stays the
measured model's, the checkpoint holds the refitted weights and says so, and refit off is the recipe
as it was (the same weights for the same seed)."""

import dataclasses

import numpy as np
import pytest
import torch

from habitus.models.data.features import DAY, FeatureSpec
from habitus.models.data.targets import TargetSpec
from habitus.models.evaluate.holdout import protocol
from habitus.models.heads import stacked_rows
from habitus.models.heads.stacked_rows import Rows, collect
from habitus.models.heads.stacking import refit_stack
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train import finetune as finetune_module
from habitus.models.train import refit as refit_module
from habitus.models.train import scenario as recipe
from habitus.models.train.config import REFIT, FinetuneConfig, ScenarioConfig
from habitus.models.train.loop import iso

HORIZON = 14  # (churn_foundation's horizon, tests/models/conftest.py)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(churn_foundation):
    cache, test_cutoff, state, info = churn_foundation
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    cfg = ScenarioConfig("churn", CHURN, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, FINETUNE, refit=False)
    return cache, state, info, cfg


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    """(run and checkpoint folder) with refit off, then on; the cut-offs every chunk was read at during the refit."""
    cache, state, info, cfg = world
    folder = tmp_path_factory.mktemp("refit")
    off = recipe.train_scenario(cache, state, info, cfg, path=folder / "off", device="cpu", log=lambda _: None)
    seen = []
    real = finetune_module.chunk_at

    def recording(shard, lo, hi, cutoff):
        seen.append(int(cutoff))
        return real(shard, lo, hi, cutoff)

    cfg_on = dataclasses.replace(cfg, refit=True)
    on = recipe.train_scenario(cache, state, info, cfg_on, path=folder / "on", device="cpu", log=lambda _: None)
    # the refit alone again, every chunk it reads recorded (same inputs: the same refit)
    finetune_module.chunk_at = stacked_rows.chunk_at = recording
    try:
        again = refit_module.refit(cache, state, info, cfg_on, on.trained, on.head, device="cpu", log=lambda _: None)
    finally:
        finetune_module.chunk_at = stacked_rows.chunk_at = real
    return (off, folder / "off"), (on, folder / "on"), seen, again


def test_refit_trains_on_cutoffs_through_the_test_cutoff_and_reads_nothing_past_the_data(world, runs):
    cache, _, _, cfg = world
    _, (on, _), seen, again = runs
    cutoffs = refit_module.refit_cutoffs(cfg)
    assert max(cutoffs) == cfg.test_cutoff and len(cutoffs) == len(cfg.train_cutoffs)
    assert np.array_equal(np.diff(cutoffs), np.diff(cfg.train_cutoffs))
    assert on.refit.cutoffs == cutoffs and on.refit.trained.info["train_cutoffs"] == [iso(c) for c in cutoffs]
    # the newest target window ends at the data's newest complete day, never after it
    assert max(cutoffs) + HORIZON * DAY <= refit_module.data_end(cache)
    assert set(seen) == set(cutoffs)  # no validation cut-off of its own, nothing later than the test cut-off
    # the recorded recipe: the measured soup's epochs and start, nothing chosen again
    assert on.refit.trained.info["soup_epochs"] == on.trained.info["soup_epochs"]
    assert on.refit.trained.info["head_start"] == on.trained.info.get("head_start", "baseline")
    assert again.trained.info["epochs"] == max(on.trained.info["soup_epochs"])
    a, b = again.trained.model.state_dict(), on.refit.trained.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # (the same refit: recorded above is what served)
    # a refit whose newest window would end past the data is refused
    late = dataclasses.replace(cfg, refit=True, test_cutoff=cfg.test_cutoff + DAY)
    with pytest.raises(ValueError, match="after the data's newest complete day"):
        refit_module.refit(cache, world[1], world[2], late, on.trained, None, device="cpu", log=lambda _: None)
    # ... and the recipe serves the measured model there (a config's own test cut-off too late for a refit)
    assert "after the data's newest complete day" in refit_module.refit_skipped(cache, late, on.trained.info)
    assert refit_module.refit_skipped(cache, cfg, on.trained.info) is None


def test_the_holdout_is_the_measured_models_and_the_served_checkpoint_is_the_refit(runs):
    (off, _), (on, path), _, _ = runs
    assert on.report == off.report  # the measured model's hold-out, refit or not
    weights, config = load_checkpoint(path)
    assert config["metrics"] == on.report and config["refit"]["refit"] is True
    assert config["refit"]["train_cutoffs"] == [iso(c) for c in on.refit.cutoffs]
    assert config["protocol"]["train_cutoffs"] == on.trained.info["train_cutoffs"]  # what the hold-out measured
    served = on.refit.trained.model.state_dict()
    assert all(torch.equal(weights[k], served[k]) for k in served)
    measured = on.trained.model.state_dict()
    assert any(not torch.equal(measured[k], served[k]) for k in measured)
    if on.head is not None:
        assert config["refit"]["head"] == {"chosen": on.head.chosen, "weight": on.head.weight}
        assert on.refit.head.weight == on.head.weight


def test_refit_off_is_the_recipe_as_it_was(runs):
    """Off: no refit, no "refit" entry, and the weights of the same seed are those the refit leaves
    untouched (the measured network of the run with refit on)."""
    (off, off_path), (on, _), _, _ = runs
    assert off.refit is None and "refit" not in off.checkpoint
    a, b = off.trained.model.state_dict(), on.trained.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights, _ = load_checkpoint(off_path)
    assert all(torch.equal(weights[k], a[k]) for k in a)


def test_refit_stack_keeps_the_choice_labels_and_rounds(world, runs):
    cache, _, info, cfg = world
    _, (on, _), _, _ = runs
    if on.head is None:
        pytest.skip("LightGBM is not installed")
    spec = FeatureSpec.from_dict(info["feature_spec"])
    cutoffs = refit_module.refit_cutoffs(cfg)
    parts = [collect(cache, spec, CHURN, on.head.trunk, c, labels=on.head.labels) for c in cutoffs]
    rows = Rows(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("entities", "hand", "embedding", "y")))
    stack = refit_stack(on.head.stack, rows)
    assert stack.weight == on.head.stack.weight and stack.validation == on.head.stack.validation
    assert [[b.num_trees() for b in fold] for fold in stack.boosters] == \
        [[b.num_trees() for b in fold] for fold in on.head.stack.boosters]
    assert stack.info["refit_train_rows"] == len(rows)


def test_the_scenario_setting_reaches_the_recipe(world):
    from habitus.assets.scenarios import scenario_config
    from habitus.pipelines.config.project import Scenario

    cache, _, _, cfg = world
    settings = {"task": "binary", "target": {"no_event": "purchases", "within": "14d"}}
    assert scenario_config("churn", Scenario.model_validate({**settings, "refit": True}), cache, cfg.test_cutoff).refit
    default = scenario_config("churn", Scenario.model_validate(settings), cache, cfg.test_cutoff)
    assert default.refit is REFIT and ScenarioConfig("x", CHURN, (0,), 1, 2).refit is REFIT
