"""The multiclass task (models/tasks/multiclass.py): which product class the next purchase is in, on
a world of three segments each buying mostly its own 4 of 12 products. Its target, training, hold-out
(accuracy, macro-F1, log-loss next to the majority-class, past-frequency and LightGBM baselines),
predictions and config."""

import math

import numpy as np
import pyarrow as pa
import pytest

from habitus.models.evaluate.baselines import lightgbm_scores
from habitus.models.evaluate.holdout import LOWER_IS_BETTER, evaluate, headline, protocol
from habitus.models.data.features import FeatureSpec, chunk_at
from habitus.models.train.finetune import finetune
from habitus.models.serve.predict import predict
from habitus.models.train.config import FinetuneConfig
from habitus.models.data.targets import future_rows
from habitus.models.tasks import TASKS, task
from habitus.models.tasks.multiclass import multiclass_metrics

N_CUSTOMERS, HORIZON = 240, 14  # (tests/models/conftest.py: segment_foundation)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(segment_labels):
    return segment_labels("multiclass")


@pytest.fixture(scope="module")
def trained(world):
    cache, test_cutoff, foundation, spec = world
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    cfg = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=64, seed=0)
    result = finetune(cache, foundation.model.state_dict(), foundation.info, spec, list(plan.train_cutoffs),
                      plan.val_cutoff, cfg, device="cpu", log=lambda _: None)
    return plan, result


def test_the_target_is_the_class_of_the_first_event_in_the_window(world):
    cache, test_cutoff, _, spec = world
    shard = cache.shard(0)
    chunk = chunk_at(shard, 0, len(shard.entities), test_cutoff)
    keep, y = task(spec).labels(chunk, spec.target, cache)
    local, rows = future_rows(chunk, HORIZON)
    first = {}
    for r, row in zip(local, rows):
        first.setdefault(int(r), int(shard.columns["product_id"][row]) - 1)  # (labels: ids 1.., positions 0..)
    assert sorted(first) == np.flatnonzero(keep).tolist()  # no event in the window: not eligible
    assert y.tolist() == [first[r] for r in np.flatnonzero(keep)]


def test_metrics_by_hand():
    y = np.array([0, 0, 1, 2])
    p = np.array([[0.7, 0.2, 0.1], [0.4, 0.5, 0.1], [0.2, 0.6, 0.2], [0.1, 0.1, 0.8]])
    m = multiclass_metrics(y, p)
    assert m["accuracy"] == pytest.approx(0.75)
    # class 0: tp 1 fn 1 -> 2/3; class 1: tp 1 fp 1 -> 2/3; class 2: 1
    assert m["macro_f1"] == pytest.approx((2 / 3 + 2 / 3 + 1) / 3)
    assert m["log_loss"] == pytest.approx(-np.mean(np.log([0.7, 0.4, 0.6, 0.8])))
    assert "log_loss" in LOWER_IS_BETTER and "accuracy" not in LOWER_IS_BETTER


def test_trains_and_beats_the_majority_class_on_the_holdout(world, trained):
    cache, test_cutoff, foundation, spec = world
    plan, result = trained
    assert result.model.head.linear.out_features == spec.outputs == 12
    assert all(math.isfinite(v) for v in result.curves["train_loss"] + result.curves["val_loss"])
    fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    lgbm = lightgbm_scores(cache, fspec, spec, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff)
    report = evaluate(result.model, cache, fspec, spec, plan.test_cutoff, extra={"lightgbm": lgbm})
    assert headline(spec) == "log_loss"
    assert set(report["model"]) == {"accuracy", "macro_f1", "log_loss"}
    names = {"majority class", "past frequency"} | ({"lightgbm"} if lgbm is not None else set())
    assert set(report["baselines"]) == names
    assert report["entities"] > 50
    model, majority = report["model"], report["baselines"]["majority class"]
    assert model["accuracy"] > majority["accuracy"] + 0.05, report
    assert model["log_loss"] < majority["log_loss"], report
    assert 0 < report["majority_share"] < 1
    if lgbm is not None:
        assert lgbm.shape == (report["entities"], 12)
        assert report["baselines"]["lightgbm"]["accuracy"] > majority["accuracy"], report


def test_predictions_are_the_top_classes_with_probabilities(world, trained):
    cache, test_cutoff, foundation, spec = world
    _, result = trained
    fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    table = pa.Table.from_batches(list(predict(result.model, cache, fspec, spec, test_cutoff, k=3, chunk_entities=64)))
    assert table.column_names == ["entity_index", "labels", "scores"]
    assert table.num_rows == N_CUSTOMERS  # every entity with history is scored, events in the window or not
    scores = np.array(table.column("scores").to_pylist())
    assert scores.shape == (N_CUSTOMERS, 3) and (np.diff(scores, axis=1) <= 0).all() and (scores.sum(1) <= 1 + 1e-5).all()
    vocab = set(cache.vocab("product_id").column("value").to_pylist())
    assert all(set(v) <= vocab for v in table.column("labels").to_pylist())


def test_the_config_takes_multiclass_with_a_label_target():
    from pydantic import ValidationError

    from habitus.pipelines.config.project import Scenario

    assert "multiclass" in TASKS and TASKS["multiclass"].targets == ("any_event", "function")
    sc = Scenario.model_validate({"task": "multiclass", "target": {"any_event": "purchases", "by": "category",
                                                                   "within": "14d", "top": 10}})
    assert sc.task == "multiclass"
    with pytest.raises(ValidationError, match="task 'multiclass' takes a target with any_event"):
        Scenario.model_validate({"task": "multiclass", "target": {"no_event": "purchases", "within": "14d"}})
