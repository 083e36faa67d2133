"""The foundation's own forecast as a scenario head's start (models/train/prior.py): which foundation target
columns forecast which outputs, the calibration, what the head holds after the start, and that
fine-tuning chooses between the two starts on validation."""

import numpy as np
import pytest
import torch

from habitus.models.data.features import FeatureSpec, chunk_at, encode_tail
from habitus.models.train.finetune import finetune
from habitus.models.data.items import SparseRows
from habitus.models.train.loop import chunk_plan
from habitus.models.nn.network import Model, NetConfig
from habitus.models.train import prior
from habitus.models.train.prior import Forecast, calibrate, foundation_forecast, start_at_forecast
from habitus.models.train.config import FinetuneConfig
from habitus.models.tasks import task as task_of
from habitus.models.tasks.spec import TaskSpec
from habitus.models.data.targets import TargetSpec, compute_target, foundation_target

pytestmark = pytest.mark.usefixtures("one_thread")
FINETUNE = FinetuneConfig(epochs=1, learning_rate=3e-3, batch_size=32, chunk_entities=64, seed=0)


def test_each_label_reads_the_foundation_column_of_its_own_value(segment_labels):
    cache, test_cutoff, foundation, task = segment_labels("multilabel")
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    state = foundation.model.state_dict()
    forecast = foundation_forecast(state, spec, task.target, task.outputs)
    assert forecast is not None and len(forecast.positions) == task.outputs  # 12 products, 32 buckets
    s, lo, hi = chunk_plan(cache, 1000)[0]
    chunk = chunk_at(cache.shard(s), lo, hi, test_cutoff - 14 * 86_400)
    future = foundation_target(chunk, 14, spec)
    labels = compute_target(chunk, task.target, cache.columns["product_id"]["vocab_size"]).dense()
    # the foundation's target column of each label is exactly that label's target
    np.testing.assert_array_equal(future[:, forecast.columns], labels[:, forecast.positions])
    torch.testing.assert_close(forecast.weight, state["head.linear.weight"][torch.from_numpy(forecast.columns)])
    # churn reads "acts in the window", negated; targets it has no forecast for get none
    churn = foundation_forecast(state, spec, TargetSpec("no_event", 14), 1)
    torch.testing.assert_close(churn.weight, -state["head.linear.weight"][:1])
    assert foundation_forecast(state, spec, TargetSpec("sum", 14, "price"), 1) is None
    items = TargetSpec("items", 14, "product_id", task.target.labels)  # recommendation: measured worse
    assert foundation_forecast(state, spec, items, task.outputs) is None
    assert foundation_forecast(state, spec, TargetSpec("any_event", 14, "store", (1, 2)), 2) is None


def test_long_tail_values_start_at_their_group_of_related_values_not_at_a_hashed_mix(segment_labels, monkeypatch):
    cache, _, foundation, task = segment_labels("multilabel")
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    spec.categorical = {"product_id": 1000}  # 1,000 values in 32 buckets: ids from 24 on share 8 buckets
    target = TargetSpec("any_event", 14, "product_id", (1, 5, 23, 24, 500, 1200))
    state = {"head.linear.weight": torch.zeros(2 + 31, 4), "head.linear.bias": torch.zeros(2 + 31)}
    forecast = foundation_forecast(state, spec, target, 6)  # the tail hashed by id: a mix, no forecast
    np.testing.assert_array_equal(forecast.positions, [0, 1, 2])
    np.testing.assert_array_equal(forecast.columns, [2, 6, 24])
    tail = np.arange(1000 - 24 + 1) % 8  # grouped by relatedness (models/data/related.py): 24 -> 0, 500 -> 4
    spec.tails = {"product_id": encode_tail(tail)}
    spec.__dict__.pop("_decoded", None)
    forecast = foundation_forecast(state, spec, target, 6)
    np.testing.assert_array_equal(forecast.positions, [0, 1, 2, 3, 4])  # 1,200: never seen by the foundation
    np.testing.assert_array_equal(forecast.columns, [2, 6, 24, 25, 29])  # buckets 24 + group, less "unknown"
    monkeypatch.setattr(prior, "GROUP_START_LABELS", 4)  # only a head's first labels start at their group
    np.testing.assert_array_equal(foundation_forecast(state, spec, target, 6).positions, [0, 1, 2, 3])


def test_calibration_recovers_slope_and_offset_and_stays_bounded_on_few_rows():
    rng = np.random.default_rng(0)
    z = torch.from_numpy(rng.normal(size=(20_000, 2, 1)).astype(np.float32))
    y = torch.bernoulli(torch.sigmoid(torch.stack([2.0 * z[:, 0, 0] - 1.0, 0.5 * z[:, 1, 0] + 0.5], 1)),
                        generator=torch.Generator().manual_seed(0))
    beta = calibrate(z, y)
    np.testing.assert_allclose(beta.numpy(), [[2.0, -1.0], [0.5, 0.5]], atol=0.1)
    # 30 rows, one label that none of them has: finite, the offset bounded, the slope held near 1
    few = calibrate(z[:30, :1], torch.zeros(30, 1))
    assert torch.isfinite(few).all() and few[0, 1] >= -8.0 and abs(float(few[0, 0]) - 1.0) < 0.5


def test_the_start_is_the_calibrated_forecast_plus_each_labels_own_history(monkeypatch):
    torch.manual_seed(0)
    model = Model(NetConfig(6, 8, 1, 0.0), 5, 3).eval()
    with torch.no_grad():
        model.head.skip.weight.fill_(5.0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 6)).astype(np.float32)
    h = SparseRows.from_pairs(np.arange(400), rng.integers(0, 5, 400), rng.random((400, 3)), 400, 5)
    y = SparseRows.from_pairs(np.arange(400), rng.integers(0, 5, 400), np.ones(400), 400, 5)
    forecast = Forecast(np.array([1, 3]), np.array([7, 9]), torch.randn(2, 8), torch.zeros(2))
    with torch.no_grad():
        read = start_at_forecast(model, forecast, [(x, h, y)], "cpu", 3, task_of("multilabel").forecast_targets)
    assert read == 400
    w = model.head.linear.weight.detach()
    for i, p in enumerate(forecast.positions):  # the foundation's row, scaled by the fitted slope
        cos = torch.nn.functional.cosine_similarity(w[p], forecast.weight[i], dim=0)
        assert float(cos) == pytest.approx(1.0, abs=1e-5)
    total = model.head.skip.weight[0] + model.head.label_skip  # the history weight each label ends with
    assert torch.all(total[[0, 2, 4]] == 5.0)  # outputs without a forecast keep the task's own start
    assert not torch.allclose(total[[1, 3]], torch.full((2, 3), 5.0))

    # a wide head is calibrated a block of labels at a time, each label on its own: the same start
    blocked = Model(NetConfig(6, 8, 1, 0.0), 5, 3).eval()
    blocked.load_state_dict(start)
    monkeypatch.setattr(prior, "LABEL_BLOCK", 1)
    start_at_forecast(blocked, forecast, [(x[:150], h[np.arange(150)], y[np.arange(150)]),
                                          (x[150:], h[np.arange(150, 400)], y[np.arange(150, 400)])],
                      "cpu", 3, task_of("multilabel").forecast_targets)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(blocked.state_dict()[name], value, msg=name)


def test_a_class_index_is_calibrated_as_one_of_the_classes():
    # a multiclass row's label is the index of its class, not a 0/1 per output: each class's forecast
    # is calibrated against "the next class is this one"
    y = np.array([0, 3, 1, 3])
    np.testing.assert_array_equal(task_of("multiclass").forecast_targets(y, np.array([1, 3])),
                                  [[0, 0], [0, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(task_of("binary").forecast_targets(np.array([1.0, 0.0]), np.array([0])), [[1], [0]])


@pytest.mark.parametrize("kind", ["multilabel", "binary", "multiclass"])
def test_finetuning_keeps_whichever_start_validates_better(segment_labels, kind):
    cache, test_cutoff, foundation, task = segment_labels("multiclass" if kind == "multiclass" else "multilabel")
    if kind == "binary":
        task = TaskSpec("binary", TargetSpec("no_event", 14, active_days=30))
    cutoffs = [test_cutoff - w * 14 * 86_400 for w in (4, 3, 2)]
    args = (cache, foundation.model.state_dict(), foundation.info, task, cutoffs, test_cutoff - 14 * 86_400)
    said = []
    result = finetune(*args, FINETUNE, device="cpu", log=said.append)
    start = [float(m.rsplit(" ", 1)[1]) for m in said if "start: validation criterion" in m][0]
    forecast = [float(m.rsplit(" ", 1)[1]) for m in said if "start at the foundation's forecast" in m]
    assert len(forecast) == 1
    if kind == "multiclass":  # log loss: the calibrated classes beat a uniform guess (as 0/1 labels: 26.5)
        assert forecast[0] < np.log(task.outputs)
    assert result.info["head_start"] == ("foundation (calibrated)" if forecast[0] < start else "baseline")
    # no forecast without pretraining, or when switched off
    said.clear()
    scratch = finetune(*args, FINETUNE, device="cpu", log=said.append, from_scratch=True)
    off = finetune(*args, FinetuneConfig(**{**FINETUNE.__dict__, "foundation_start": False}), device="cpu",
                   log=lambda _: None)
    assert scratch.info["head_start"] == off.info["head_start"] == "baseline"
    assert not any("foundation's forecast" in m for m in said)
