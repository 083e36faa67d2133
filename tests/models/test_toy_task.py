"""A new task type is one module plus one registry line: "bought twice", a binary task whose label is
"bought at least twice in the window", judged by its own metric (the precision of the top decile of
scores) against its own baseline (the purchases of the window before the cut-off), is defined in this
module, registered, and trained, scored and evaluated end to end through the scenario recipe
(models/train/scenario.py) without a line of models/ knowing its name."""

import numpy as np
import pyarrow as pa
import pytest

from habitus.models.data.features import DAY
from habitus.models.data.targets import TargetSpec, future_rows
from habitus.models.evaluate.holdout import evaluate, protocol
from habitus.models.heads.stacked_head import load_head
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.serve.predict import load_model, predict
from habitus.models.tasks import TASKS, register, task
from habitus.models.tasks.binary import Binary
from habitus.models.tasks.metrics import auroc
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.config import FinetuneConfig, ScenarioConfig
from habitus.models.train.scenario import train_scenario

HORIZON = 14  # (churn_foundation's horizon, tests/models/conftest.py)
NAME = "bought_twice"

pytestmark = pytest.mark.usefixtures("one_thread")


def top_decile_precision(y: np.ndarray, score: np.ndarray) -> float:
    """The share of positives among the tenth of the entities scored highest."""
    y = np.asarray(y, np.float64)
    if not len(y):
        return float("nan")
    top = np.argsort(-np.asarray(score, np.float64), kind="stable")[:max(1, len(y) // 10)]
    return float(y[top].mean())


class BoughtTwice(Binary):
    """Will the entity buy at least twice in the window? One probability per entity (Binary's head,
    loss and stacked head); its own labels, metric and baseline."""

    name = NAME
    headline = "top_decile_precision"

    def target_spec(self, name, target, cache, cutoff) -> TargetSpec:
        return TargetSpec("count", target.within)

    def labels(self, chunk, target, cache):
        local, _ = future_rows(chunk, target.window_days)
        y = (np.bincount(local, minlength=chunk.n) >= 2).astype(np.float32)
        keep = self.eligible(chunk, target)
        return keep, y[keep]

    def metrics(self, y, score):
        return {"top_decile_precision": top_decile_precision(y, score), "auroc": auroc(y, score)}

    def baselines(self, spec, chunk, h, channel):
        inside = chunk.age_days < spec.target.window_days
        return {"previous window": np.bincount(chunk.local, inside, minlength=chunk.n).astype(np.float32)}


TASK = BoughtTwice()


@pytest.fixture(scope="module")
def registered():
    """The scenario's TaskSpec, once the task type is registered (for this module's tests only)."""
    register(NAME, __name__, ("function",))  # the one registry line
    yield TaskSpec(NAME, TargetSpec("count", HORIZON))
    TASKS.pop(NAME)


@pytest.fixture(scope="module")
def world(registered, churn_foundation, tmp_path_factory):
    """(cache, the recipe's run, its checkpoint folder, the scenario's config)."""
    cache, test_cutoff, state, info = churn_foundation
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    cfg = ScenarioConfig("twice", registered, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                         FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64), refit=False)
    path = tmp_path_factory.mktemp("scenario") / "twice"
    run = train_scenario(cache, state, info, cfg, path=path, device="cpu", log=lambda _: None)
    return cache, run, path, cfg


def test_a_registered_task_type_is_found_by_name_and_a_second_module_is_refused(registered):
    assert task(NAME) is TASK and task(registered) is TASK and registered.outputs == 1
    register(NAME, __name__, ("function",))  # the same line again changes nothing
    with pytest.raises(ValueError, match="registered already"):
        register(NAME, "somewhere.else", ("function",))


def test_the_recipe_trains_and_evaluates_it_with_its_own_labels_metric_and_baseline(world, frame):
    cache, run, _, cfg = world
    report = run.report
    assert set(report["model"]) == {"top_decile_precision", "auroc"}
    assert set(report["baselines"]) >= {"previous window", "lightgbm"}
    assert report["model"]["top_decile_precision"] == top_decile_precision(run.holdout.y, run.holdout.scores)
    # its labels, counted from the events themselves: entities with history at the cut-off that buy twice after
    events = frame(cache)
    seen = np.unique(events["entity"][events["ts"] <= cfg.test_cutoff])
    after = (events["ts"] > cfg.test_cutoff) & (events["ts"] <= cfg.test_cutoff + HORIZON * DAY)
    twice = np.bincount(events["entity"][after], minlength=events["entity"].max() + 1) >= 2
    assert report["entities"] == len(seen) == len(run.holdout.y)
    assert run.holdout.y.sum() == twice[seen].sum() > 10
    assert report["model"]["auroc"] > 0.6  # (the churning half of the customers buys less: a learnable signal)


def test_the_saved_checkpoint_scores_what_the_holdout_measured(world):
    cache, run, path, cfg = world
    weights, config = load_checkpoint(path)
    assert config["task"]["task"] == NAME and config["headline"] == "top_decile_precision"
    model, spec, task_spec = load_model(weights, config)
    head = load_head(path, config)
    assert run.head is not None and head.chosen == run.head.chosen and head.stack.task == NAME
    scored = pa.Table.from_batches(list(predict(model, cache, spec, task_spec, cfg.test_cutoff, head=head)))
    np.testing.assert_allclose(scored.column("score").to_numpy(), run.holdout.scores, rtol=1e-5, atol=1e-6)
    again = evaluate(model, cache, spec, task_spec, cfg.test_cutoff, head=head)
    assert again["model"] == pytest.approx(run.report["model"])
