"""habitus.models.heads.stacked_head: the head chosen on validation as a scenario uses it. Fitted after
fine-tuning, it is what evaluate reports as the model, it saves with the checkpoint (stack.json and
the foundation trunk's safetensors, fingerprinted in config.json), and the loaded checkpoint's
predictions are the scores evaluate measured; a checkpoint without it scores with the network alone."""

import json

import numpy as np
import pytest

from habitus.models.nn.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from habitus.models.evaluate.holdout import evaluate, holdout_chunks, protocol, score_holdout
from habitus.models.data.features import FeatureSpec
from habitus.models.serve.predict import load_model, predict
from habitus.models.tasks.scoring import scores
from habitus.models.train.config import FinetuneConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.heads.stacking import StackConfig, score
from habitus.models.heads.stacked_head import STACK_FILE, TRUNK_FILE, fit_head, load_head, save_head
from habitus.models.nn.network import load_trunk
from habitus.models.heads.stacked_rows import collect
from habitus.models.data.targets import TargetSpec

pytest.importorskip("lightgbm")
pytestmark = pytest.mark.usefixtures("one_thread")

# a forced blend (w = 0.5), so the trees are read wherever the head scores
FORCED = StackConfig(n_estimators=20, label_n_estimators=10, weights=(0.5,))
TASKS = {"binary": TaskSpec("binary", TargetSpec("no_event", 14, active_days=90)),
         "regression": TaskSpec("regression", TargetSpec("sum", 14, "price")),
         "multilabel": TaskSpec("multilabel", TargetSpec("any_event", 14, "product_id", tuple(range(1, 7))), k=3)}


@pytest.fixture(scope="module")
def world(segment_foundation):
    cache, test_cutoff, foundation = segment_foundation
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    return cache, test_cutoff, foundation, spec


def _scenario(world, name: str, cfg: StackConfig = FORCED):
    from habitus.models.train.finetune import finetune

    cache, test_cutoff, foundation, spec = world
    task = TASKS[name]
    plan = protocol(test_cutoff, 14, 3, cache.time_range[0])
    tuned = finetune(cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                     plan.val_cutoff, FinetuneConfig(epochs=1, batch_size=64), log=lambda _: None, device="cpu")
    trunk = load_trunk(foundation.model.state_dict(), foundation.info["net"])
    head = fit_head(cache, spec, task, trunk, tuned.model, plan.train_cutoffs, plan.val_cutoff, cfg=cfg)
    return task, plan, tuned.model, head


def _save(tmp_path, model, task, foundation, head=None):
    path = tmp_path / "scenario"
    config = {"kind": "scenario", "task": task.to_dict(), "feature_spec": foundation.info["feature_spec"],
              "net": foundation.info["net"]}
    save_checkpoint(path, model, config, extra=None if head is None else lambda f: {"stack": save_head(f, head)})
    return path


def _predicted(model, cache, spec, task, cutoff, head=None, k=20):
    out = list(predict(model, cache, spec, task, cutoff, k=k, head=head))
    entities = np.concatenate([b.column("entity_index").to_numpy() for b in out])
    if "score" in out[0].schema.names:
        return entities, np.concatenate([b.column("score").to_numpy() for b in out])
    labels = [x for b in out for x in b.column("labels").to_pylist()]
    values = [x for b in out for x in b.column("scores").to_pylist()]
    return entities, (labels, values)


@pytest.mark.parametrize("name", ["binary", "regression"])
def test_the_chosen_head_is_evaluated_saved_and_predicts_what_was_evaluated(world, tmp_path, name):
    cache, test_cutoff, foundation, spec = world
    task, plan, model, head = _scenario(world, name)
    assert head is not None and head.chosen == "blend" and head.weight == 0.5
    # (chunks as collect's and predict's: a trunk's matrix products round by their batch, which can move a
    # tree's split on an amount by a float's last bit)
    held = score_holdout(model, cache, spec, task, plan.test_cutoff, head=head, chunk_entities=8192)
    report = held.report
    plain = evaluate(model, cache, spec, task, plan.test_cutoff, chunk_entities=8192)
    metric = "auroc" if name == "binary" else "mae"
    # the network alone is reported as it was; the model is the chosen blend
    assert report["network"][metric] == pytest.approx(plain["model"][metric], abs=1e-6)
    rows = collect(cache, spec, task, head.trunk, plan.test_cutoff, model=model)
    chosen = head.stack.predict(rows)
    sign = -1 if metric == "mae" else 1
    assert report["model"][metric] == pytest.approx(sign * score(task.task, rows.y, chosen), abs=1e-6)
    assert report["head"]["chosen"] == "blend" and report["head"]["candidates"]["chosen"][metric] == \
        pytest.approx(report["model"][metric], abs=1e-6)
    assert set(report["head"]["candidates"]) >= {"network", "gbt", "chosen"}
    # the scores it measured, for the hold-out's charts (assets/scenarios.py): the chosen head's, in collect's order
    np.testing.assert_allclose(held.y, rows.y, rtol=0, atol=0)
    np.testing.assert_allclose(held.scores, chosen, rtol=1e-5, atol=1e-6)

    path = _save(tmp_path, model, task, foundation, head)
    assert (path / STACK_FILE).exists() and (path / TRUNK_FILE).exists()
    assert "pickle" not in (path / STACK_FILE).read_text()[:100]
    state, config = load_checkpoint(path)
    assert config["stack"]["chosen"] == "blend" and config["stack"]["weight"] == 0.5
    loaded_model, loaded_spec, loaded_task = load_model(state, config)
    loaded = load_head(path, config)
    entities, predicted = _predicted(loaded_model, cache, loaded_spec, loaded_task, plan.test_cutoff, loaded)
    np.testing.assert_array_equal(entities, rows.entities)
    np.testing.assert_allclose(predicted, chosen, rtol=1e-5, atol=1e-6)  # what evaluate measured

    # the network alone (a checkpoint written before heads were chosen) scores as before
    old = _save(tmp_path / "old", model, task, foundation)
    state, config = load_checkpoint(old)
    assert "stack" not in config and load_head(old, config) is None
    old_model, _, _ = load_model(state, config)
    entities, predicted = _predicted(old_model, cache, loaded_spec, loaded_task, plan.test_cutoff)
    np.testing.assert_allclose(predicted, rows.network, rtol=1e-5, atol=1e-6)
    assert not np.allclose(predicted, chosen)


def test_a_changed_stack_file_is_refused(world, tmp_path):
    cache, test_cutoff, foundation, spec = world
    task, plan, model, head = _scenario(world, "binary")
    path = _save(tmp_path, model, task, foundation, head)
    state, config = load_checkpoint(path)
    stack = json.loads((path / STACK_FILE).read_text())
    stack["weight"] = 1.0
    (path / STACK_FILE).write_text(json.dumps(stack))
    with pytest.raises(CheckpointError, match="changed after training"):
        load_head(path, config)
    (path / TRUNK_FILE).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_head(path, config)


def test_a_wide_multilabel_head_stacks_its_most_frequent_labels_only(world, tmp_path):
    cache, test_cutoff, foundation, spec = world
    task, plan, model, head = _scenario(world, "multilabel", StackConfig(**{**FORCED.to_dict(), "max_labels": 3}))
    assert head is not None and len(head.labels) == 3
    report = evaluate(model, cache, spec, task, plan.test_cutoff, head=head)
    plain = evaluate(model, cache, spec, task, plan.test_cutoff)
    assert report["network"]["macro_auroc"] == pytest.approx(plain["model"]["macro_auroc"], abs=1e-6)
    assert report["head"]["labels"] == 3 and report["model"]["macro_auroc"] != report["network"]["macro_auroc"]

    path = _save(tmp_path, model, task, foundation, head)
    state, config = load_checkpoint(path)
    loaded_model, loaded_spec, loaded_task = load_model(state, config)
    loaded = load_head(path, config)
    every = len(task.target.labels)
    entities, (labels, values) = _predicted(loaded_model, cache, loaded_spec, loaded_task, plan.test_cutoff, loaded,
                                            k=every)
    names = np.asarray(loaded_task.target.labels)  # (label_names None: the predictions name them by vocabulary)
    rows = collect(cache, spec, task, head.trunk, plan.test_cutoff, labels=head.labels, model=model)
    np.testing.assert_array_equal(entities, rows.entities)
    chosen = head.stack.predict(rows)  # [n, 3]: the covered labels' blend
    network = _network_all(model, cache, spec, task, plan.test_cutoff)
    vocab = cache.vocab("product_id").column("value").to_pylist()
    position = {vocab[v - 1]: i for i, v in enumerate(names)}
    got = np.zeros((len(entities), every), np.float32)
    for r, (ls, vs) in enumerate(zip(labels, values)):
        got[r, [position[v] for v in ls]] = vs
    covered = np.asarray(head.labels)
    others = np.setdiff1d(np.arange(every), covered)
    np.testing.assert_allclose(got[:, covered], chosen, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[:, others], network[:, others], rtol=1e-4, atol=1e-5)


def _network_all(model, cache, spec, task, cutoff):
    """The network's scores of every label, in evaluate's order."""
    return np.concatenate([scores(model, task.task, x[keep], h[keep])
                           for _, keep, x, h, _ in holdout_chunks(cache, spec, task, cutoff, 8192)])


def test_tasks_without_a_stack_get_none(world):
    cache, test_cutoff, foundation, spec = world
    rec = TaskSpec("recommendation", TargetSpec("items", 14, "product_id", tuple(range(1, 13))), k=3)
    assert fit_head(cache, spec, rec, load_trunk(foundation.model.state_dict(), foundation.info["net"]), None,
                    [test_cutoff - 28 * 86400], test_cutoff - 14 * 86400) is None
