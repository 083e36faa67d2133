"""habitus.models.heads.stacking: the candidates (network, trees over embedding + hand features, blend), the choice
on the validation cut-off's choice fold, and the stack's round trip through plain values."""

import json

import numpy as np
import pytest
import torch

from habitus.models.data.features import FeatureSpec
from habitus.models.tasks.spec import TaskSpec
from habitus.models.heads.stacking import Reduction, Stack, StackConfig, blend, fit_stack, score
from habitus.models.heads.stacked_rows import Rows, choice_fold, collect
from habitus.models.data.targets import TargetSpec

pytest.importorskip("lightgbm")


def _rows(rng, n, task, informative_network: bool, labels: int = 3, offset: int = 0) -> Rows:
    """Hand features whose first column drives the target; a network score that knows it or not."""
    hand = rng.normal(size=(n, 4)).astype(np.float32)
    emb = rng.normal(size=(n, 8)).astype(np.float32)
    signal = hand[:, 0] + 0.5 * emb[:, 0]
    if task == "binary":
        y = (signal + rng.normal(scale=0.5, size=n) > 0).astype(np.float32)
        net = 1 / (1 + np.exp(-signal)) if informative_network else rng.random(n)
    elif task == "regression":
        y = np.exp(signal + rng.normal(scale=0.3, size=n)).astype(np.float32)
        net = np.exp(signal) if informative_network else rng.random(n) * 3
    else:
        y = (signal[:, None] + rng.normal(scale=0.5, size=(n, labels)) > np.arange(labels)[None] * 0.3).astype(np.float32)
        net = np.tile(1 / (1 + np.exp(-signal))[:, None], (1, labels)) if informative_network else rng.random((n, labels))
    return Rows(np.arange(offset, offset + n), hand, emb, y, np.asarray(net, np.float32))


def test_choice_fold_is_a_stable_share_of_the_entities():
    ids = np.arange(100_000)
    fold = choice_fold(ids, 0.5)
    assert abs(fold.mean() - 0.5) < 0.01
    assert np.array_equal(fold[[5, 17, 99_999]], choice_fold(np.array([5, 17, 99_999]), 0.5))
    assert not choice_fold(ids, 0.0).any() and choice_fold(ids, 1.0).all()


def test_blend_ends_are_the_candidates_and_the_middle_mixes_logits():
    net, gbt = np.array([0.2, 0.9], np.float32), np.array([0.6, 0.1], np.float32)
    assert np.array_equal(blend("binary", net, gbt, 0.0), net)
    assert np.array_equal(blend("binary", net, gbt, 1.0), gbt)
    mid = blend("binary", net, gbt, 0.5)
    logit = lambda p: np.log(p / (1 - p))  # noqa: E731
    np.testing.assert_allclose(logit(mid), 0.5 * (logit(net) + logit(gbt)), atol=1e-5)
    np.testing.assert_allclose(blend("regression", net, gbt, 0.25), 0.25 * gbt + 0.75 * net, rtol=1e-6)


@pytest.mark.parametrize("task", ["binary", "regression", "multilabel"])
def test_an_uninformed_network_loses_to_the_trees_and_the_stack_round_trips(task):
    rng = np.random.default_rng(0)
    train, val, test = (_rows(rng, n, task, False, offset=o) for n, o in ((3000, 0), (2000, 10_000), (500, 20_000)))
    stack = fit_stack(task, train, val, StackConfig(n_estimators=60, label_n_estimators=30, choice_rule="best"))
    assert stack.weight >= 0.8 and stack.chosen in ("gbt", "blend")
    v = stack.validation
    assert v["chosen"] == max(v["by_weight"].values()) and v["gbt"] > v["network"]
    assert v["choice_rows"] == len(val) and v["folds"] == 2 and len(stack.boosters) == 2  # cross-fitted
    assert score(task, test.y, stack.predict(test)) > score(task, test.y, test.network)
    again = Stack.from_state(json.loads(json.dumps(stack.state())))  # plain values: JSON survives
    np.testing.assert_allclose(again.predict(test), stack.predict(test), rtol=1e-5, atol=1e-6)
    assert again.summary() == json.loads(json.dumps(stack.summary()))


def test_without_cross_fitting_the_choice_reads_one_fold():
    rng = np.random.default_rng(4)
    train, val = _rows(rng, 2000, "binary", False), _rows(rng, 2000, "binary", False, offset=10_000)
    stack = fit_stack("binary", train, val, StackConfig(n_estimators=30, cross_fit=False))
    assert len(stack.boosters) == 1
    assert stack.validation["choice_rows"] == int(choice_fold(val.entities, 0.5).sum()) < len(val)


def test_an_informed_network_keeps_its_share():
    rng = np.random.default_rng(1)
    train, val = _rows(rng, 3000, "binary", True), _rows(rng, 2000, "binary", True, offset=10_000)
    stack = fit_stack("binary", train, val, StackConfig(n_estimators=60))
    assert stack.weight < 1.0  # the network knows the embedding's half of the signal too


def test_a_constant_label_gets_a_constant_and_no_model():
    rng = np.random.default_rng(2)
    train, val = _rows(rng, 2000, "multilabel", False), _rows(rng, 1000, "multilabel", False, offset=10_000)
    train.y[:, 1] = 0
    stack = fit_stack("multilabel", train, val, StackConfig(label_n_estimators=20))
    assert all(fold[1] is None for fold in stack.boosters) and stack.constants[1] == 0.0
    assert np.all(stack.gbt_scores(val)[:, 1] == 0.0)


def test_the_reduction_saves_and_loads():
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(500, 8)).astype(np.float32)
    r = Reduction.fit(emb, StackConfig(components=3))
    assert r.apply(emb).shape == (500, 3)
    back = Reduction.from_state(json.loads(json.dumps(r.state())))
    np.testing.assert_allclose(back.apply(emb), r.apply(emb), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="readout"):  # a stack.json of another reduction is refused, by name
        Reduction.from_state({**r.state(), "kind": "readout"})


def test_collect_reads_the_entities_evaluate_scores_in_its_order(sources):
    from habitus.models.evaluate.holdout import evaluate
    from habitus.models.train.finetune import finetune
    from habitus.models.train.foundation import train_foundation
    from habitus.models.train.config import FinetuneConfig, FoundationConfig

    cache = sources.random_purchases(4000, 300, 120)
    foundation = train_foundation(cache, FoundationConfig(hidden=16, layers=1, epochs=1, buckets=16), sources.at(100),
                                  log=lambda _: None, device="cpu")
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    task = TaskSpec("binary", TargetSpec("no_event", 14, active_days=90))
    tuned = finetune(cache, foundation.model.state_dict(), foundation.info, task, [sources.at(70), sources.at(84)],
                     sources.at(98), FinetuneConfig(epochs=1), log=lambda _: None, device="cpu")
    rows = collect(cache, spec, task, foundation.model.trunk, sources.at(106), model=tuned.model)
    report = evaluate(tuned.model, cache, spec, task, sources.at(106))
    assert len(rows) == report["entities"] and rows.embedding.shape[1] == 16
    assert score("binary", rows.y, rows.network) == pytest.approx(report["model"]["auroc"], abs=1e-6)
    with torch.no_grad():  # the representation is the foundation's trunk's, not the fine-tuned one's
        x = torch.from_numpy(rows.embedding[:1])
        assert x.shape == (1, foundation.model.trunk.cfg.hidden)


def test_one_se_rule_takes_the_equal_blend_when_validation_cannot_tell():
    rng = np.random.default_rng(5)
    train, val = _rows(rng, 2000, "binary", True), _rows(rng, 300, "binary", True, offset=10_000)
    best = fit_stack("binary", train, val, StackConfig(n_estimators=30, choice_rule="best"))
    one_se = fit_stack("binary", train, val, StackConfig(n_estimators=30))  # (the default rule)
    v = one_se.validation
    assert v["rule"] == "one_se" and set(v["standard_errors"]) == {str(w) for w in StackConfig().weights}
    # within one standard error of the best, and no farther from 0.5 than the best weight
    assert v["by_weight"][str(best.weight)] - v["by_weight"][str(one_se.weight)] <= v["standard_errors"][str(one_se.weight)]
    assert abs(one_se.weight - 0.5) <= abs(best.weight - 0.5)
    with pytest.raises(ValueError, match="choice_rule"):
        fit_stack("binary", train, val, StackConfig(n_estimators=5, choice_rule="median"))
