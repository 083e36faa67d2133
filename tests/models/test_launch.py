"""The real training functions under torchrun: `train_foundation` and `finetune` in 2 gloo CPU
processes, launched as the assets launch them (TrainingExecutor.train -> `python -m
habitus.models.train.launch`), against the same functions in this process, on a tiny cache.

Why they agree, and how closely. Each rank trains on half of the entity chunks (habitus.models.train.distributed
.shard, balanced by entities) and DDP averages the two ranks' gradients at every step, so a step
of the 2 processes is a step on two batches, one from each half, and an epoch covers the same rows
as one process in about half the optimizer steps. The trajectory is not the single process's
(other batch composition, half the steps: tests/models/test_distributed.py shows exact equality on
a loop built for it), so the test checks:

- exactly: both ranks end with the same weights (`weights_gap` 0.0: without the gradient
  all-reduce, or with a rank that stops stepping when its share runs out, they drift apart), and
  the ranks together saw every training row once per epoch (`rows_seen` equal to one process's:
  a rank training on everything, or a share dropped, doubles or shrinks it);
- within bounds: the foundation's loss on every entity at the last cut-off. 2 processes for 2
  epochs take the optimizer steps of one process for 1 epoch, on twice the rows each, so they end
  between one process after 1 epoch and after 2 (5% slack either way; the untrained model is at
  3x that). Each scenario's validation loss is within 10% of one process's with the same config
  (fine-tuning starts near its optimum, so both end close to it); 15% for a wide label head trained on
  sampled labels, which each rank draws with its own generator.
"""

import dataclasses

import numpy as np
import pytest
import torch

from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.evaluate.holdout import protocol
from habitus.models.data.features import DAY, FeatureSpec, chunk_at, featurize
from habitus.models.train.recipe import Training, foundation_job, scenario_job
from habitus.models.data.targets import TargetSpec, foundation_target
from habitus.models.train.finetune import finetune
from habitus.models.train.foundation import foundation_loss, train_foundation
from habitus.models.train.loop import chunk_plan
from habitus.models.train.config import FinetuneConfig, FoundationConfig, ScenarioConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.resources.training.executor import ExecutorError, TrainingExecutor

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SPAN, HORIZON = 126, 14
FOUNDATION = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=2, batch_size=16,
                              learning_rate=5e-3, buckets=32, seed=0, cutoffs_per_chunk=2, chunk_entities=48,
                              min_history_days=28)
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=48, seed=0)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=30))
TWO = TrainingExecutor(device="cpu", processes=2, threads=1)


@pytest.fixture(scope="module")
def world(module_sources):
    """300 customers of three segments, half of whom stop buying; 5 shards of 2 chunks each (one
    full, one small), so the ranks' shares hold different numbers of batches."""
    src = module_sources
    cache = src.churning_purchases(300, SPAN, seed=0, price_scales=(4.0, 10.0, 16.0), shard_events=2500)
    return cache, src.at(SPAN - HORIZON)


def fit(model, cache, cutoff: int) -> float:
    """The foundation loss over every entity at `cutoff` (less noisy than the small probe)."""
    spec = FeatureSpec.from_cache(cache, FOUNDATION.buckets, FOUNDATION.half_lives)
    chunks = [chunk_at(cache.shard(s), lo, hi, cutoff) for s, lo, hi in chunk_plan(cache, 48)]
    x = np.concatenate([featurize(c, spec, cache.entity_table()) for c in chunks])
    y = np.concatenate([foundation_target(c, HORIZON, spec) for c in chunks])
    with torch.no_grad():
        return float(foundation_loss(model.eval()(torch.from_numpy(x)), torch.from_numpy(y), len(spec.categorical)))


def test_foundation_and_scenarios_in_two_processes_match_one(world, tmp_path):
    cache, test_cutoff = world
    last_cutoff = test_cutoff - HORIZON * DAY
    lines: list[str] = []
    two = TWO.train(foundation_job(cache, FOUNDATION, last_cutoff, "cpu"), "cpu", log=lines.append)
    assert two.info["processes"] == 2 and two.info["weights_gap"] == 0.0
    assert sum("foundation epoch" in ln for ln in lines) == FOUNDATION.epochs  # rank 0 alone reports
    one_epoch = train_foundation(cache, dataclasses.replace(FOUNDATION, epochs=1), last_cutoff, device="cpu",
                                 log=lambda _: None)
    one = train_foundation(cache, FOUNDATION, last_cutoff, device="cpu", log=lambda _: None)
    assert "processes" not in one.info
    assert two.info["steps"] <= 0.55 * one.info["steps"]  # the work was split
    losses = {name: fit(r.model, cache, last_cutoff) for name, r in [("two", two), ("one", one), ("half", one_epoch)]}
    assert 0.95 * losses["one"] <= losses["two"] <= 1.05 * losses["half"], losses
    assert losses["half"] < fit(train_foundation(cache, dataclasses.replace(FOUNDATION, epochs=0), last_cutoff,
                                                 device="cpu", log=lambda _: None).model, cache, last_cutoff) / 2

    save_checkpoint(tmp_path / "foundation", one.model, {"feature_spec": one.info["feature_spec"],
                                                          "net": one.info["net"]})
    state, config = load_checkpoint(tmp_path / "foundation")
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    items = TaskSpec("recommendation", TargetSpec("items", HORIZON, "product_id", tuple(
        range(1, cache.columns["product_id"]["vocab_size"] + 1))), 5)
    # a wide label head (here: wider than 4 labels) trains on sampled labels, its rows' gradients sparse and
    # added into the weight's kept dense gradient (network.Head._rows): DDP must still average them
    wide = dataclasses.replace(FINETUNE, sampled_above_labels=4, sampled_negatives=2, val_sampled_negatives=4)
    labels = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "product_id", items.target.labels))
    # items: some head weights can sit a batch out (DDP's find_unused)
    for task, cfg in ((CHURN, FINETUNE), (items, FINETUNE), (labels, wide)):
        single = finetune(cache, state, config, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                          device="cpu", log=lambda _: None)
        t = Training(ScenarioConfig(task.task, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, cfg))
        ddp = TWO.train(scenario_job(cache, tmp_path / "foundation", config["weights_sha256"], t, "cpu"), "cpu",
                        log=lambda _: None)
        assert ddp.info.get("sampled_negatives") == single.info.get("sampled_negatives") == \
            (2 if task is labels else None), task.task
        assert ddp.info["weights_gap"] == 0.0, task.task
        assert ddp.info["rows_seen"] == single.info["rows_seen"], task.task
        assert ddp.info["val_rows"] == single.info["val_rows"]  # validation: all of it, on every rank
        # (the wide head: 15%, its negatives drawn by each rank's own generator, its validation loss sampled)
        assert ddp.curves["val_loss"][-1] == pytest.approx(single.curves["val_loss"][-1],
                                                           rel=0.15 if task is labels else 0.1), task.task
        assert type(ddp.model.head) is type(single.model.head)


def test_a_failing_rank_fails_the_training_with_its_error(world, tmp_path):
    cache, test_cutoff = world
    save_checkpoint(tmp_path / "foundation", torch.nn.Linear(1, 1), {})
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    t = Training(ScenarioConfig("churn", CHURN, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff, FINETUNE))
    job = scenario_job(cache, tmp_path / "foundation", "not-the-digest-the-asset-read", t, "cpu")
    with pytest.raises(ExecutorError, match="(?s)torchrun exited with status 1.*rank 0:.*changed after the asset "
                                            "read it"):
        TWO.train(job, "cpu", log=lambda _: None)
