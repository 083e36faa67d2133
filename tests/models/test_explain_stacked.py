"""Explanations of a stacked head's served score (models/explain/served.py): on a tiny blend of the
fine-tuned network and LightGBM trees (w = 0.5, forced), the attributions sum to served score - the
served stranger's score, the served score is what predictions wrote, the groups sum back to the total,
the hand features land on the groups of the columns they are computed from, and a checkpoint whose
head is the network alone is explained exactly as before."""

import dataclasses

import numpy as np
import pytest
import torch

from habitus.models.evaluate.holdout import protocol
from habitus.models.explain import ServedExplainer, column_totals, explain_cutoff, input_groups
from habitus.models.explain.served import _logit
from habitus.models.data.features import FeatureSpec, chunk_at
from habitus.models.data.items import SparseRows
from habitus.models.data.labels import task_inputs
from habitus.models.serve.predict import predict
from habitus.models.train.config import FinetuneConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.heads.stacking import StackConfig
from habitus.models.heads.stacked_head import fit_head
from habitus.models.nn.network import load_trunk
from habitus.models.data.targets import TargetSpec
from habitus.models.tasks import task as task_of

pytest.importorskip("lightgbm")
pytestmark = pytest.mark.usefixtures("one_thread")

# Completeness tolerance, in the served score's units (probability, amount): |served score - served
# baseline - sum of attributions| at most 1% of |served score - served baseline| + 1e-4 x (1 + |baseline|),
# the asset's own (habitus.models.explain.integrated.TOLERANCE, ABS_TOLERANCE), integrating up to 64 steps. The
# trees' part is exact (TreeSHAP, then exact rescalings: checked to 1e-9 below); the gap is the
# network's and the foundation trunk's quadrature, and float32 rounding.
TOLERANCE, ABSOLUTE, STEPS = 0.01, 1e-4, 16
FORCED = StackConfig(n_estimators=20, label_n_estimators=10, weights=(0.5,))
TASKS = {"binary": TaskSpec("binary", TargetSpec("no_event", 3, active_days=90)),
         "regression": TaskSpec("regression", TargetSpec("sum", 14, "price")),
         "multilabel": TaskSpec("multilabel", TargetSpec("any_event", 14, "product_id", tuple(range(1, 7))), k=3)}


@pytest.fixture(scope="module")
def world(segment_foundation):
    cache, test_cutoff, foundation = segment_foundation
    return cache, test_cutoff, foundation, FeatureSpec.from_dict(foundation.info["feature_spec"])


@pytest.fixture(scope="module")
def scenarios(world):
    from habitus.models.train.finetune import finetune

    cache, test_cutoff, foundation, spec = world
    out = {}
    for name, task in TASKS.items():
        cfg = dataclasses.replace(FORCED, max_labels=4) if name == "multilabel" else FORCED
        plan = protocol(test_cutoff, 14, 3, cache.time_range[0])
        tuned = finetune(cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                         plan.val_cutoff, FinetuneConfig(epochs=1, batch_size=64), log=lambda _: None, device="cpu")
        # one epoch leaves this world's single-score heads constant (nothing of the network's to explain):
        # their weights drawn, as tests/models/test_explain.py's networks, whatever the fit made of them
        torch.manual_seed(1)
        with torch.no_grad():
            for p in tuned.model.head.parameters():
                p.normal_(0.0, 0.3)
            if name == "regression":  # amounts away from the clamp at 0, a kink no quadrature integrates fast
                tuned.model.head.linear.bias.add_(2.0)
        trunk = load_trunk(foundation.model.state_dict(), foundation.info["net"])
        head = fit_head(cache, spec, task, trunk, tuned.model, plan.train_cutoffs, plan.val_cutoff, cfg=cfg)
        assert head is not None and head.weight == 0.5
        out[name] = (task, tuned.model.eval(), head)
    return out


def _vocab(cache):
    return lambda c: cache.vocab(c).column("value").to_pylist()


def _chunk(world, task, model, explainer):
    cache, test_cutoff, _, spec = world
    vs = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), test_cutoff)
    keep = np.flatnonzero(task_of(task).eligible(chunk, task.target))
    x, h = task_inputs(chunk, spec, task, cache.entity_table(), vs)
    return chunk, keep, x, h, explainer.inputs(model, chunk, keep, x, cache.entity_table(), vs)


def _explained(world, scenarios, name):
    cache, _, _, spec = world
    task, model, head = scenarios[name]
    groups = input_groups(spec, _vocab(cache), model.trunk)
    explainer = ServedExplainer(model, head, spec, task, groups, steps=STEPS)
    chunk, keep, x, h, si = _chunk(world, task, model, explainer)
    rows, target = keep[:40], None
    if name == "multilabel":  # every label of each entity: the covered ones (trees) and the others
        rows, target = np.repeat(keep[:15], 6), np.tile(np.arange(6), 15)
    return explainer, (x, h, si), explainer.explain(x, h, rows, target, si), groups


@pytest.mark.parametrize("name", ["binary", "regression", "multilabel"])
def test_the_served_score_is_explained_to_its_baseline(world, scenarios, name):
    explainer, (x, h, si), ex, _ = _explained(world, scenarios, name)
    moved = np.abs(ex.score - ex.baseline)
    assert moved.max() > 1e-3  # (something to explain, by the network and by the trees)
    assert np.abs(explainer.net.explain(x, h, ex.rows[:5], ex.target[:5]).dense).max() > 1e-4
    assert np.all(np.abs(ex.gap) <= TOLERANCE * moved + ABSOLUTE * (1 + np.abs(ex.baseline))), np.abs(ex.gap).max()
    # the score is the served one, the baseline the served head's score of the stranger (its representation
    # as the explainer computes it once: a split can fall within a float's last bit of the trunk's output)
    np.testing.assert_allclose(ex.score, explainer.score(x, h, ex.rows, ex.target, si), atol=1e-6)
    n = len(ex.rows)
    none = None if h is None else SparseRows.from_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64),
                                                        np.zeros((0, h.values.shape[1]), np.float32), n, h.n_cols)
    stranger = explainer.scores_of(np.repeat(explainer.groups.baseline[None], n, 0), none,
                                   np.repeat(explainer.hand.baseline[None], n, 0),
                                   np.repeat(explainer.base_emb, n, 0).astype(np.float32), ex.target)
    np.testing.assert_allclose(ex.baseline, stranger, atol=2e-5)
    wp, _ = explainer.covered(ex.target)
    if name == "multilabel":
        assert (wp == 0).any() and (wp == 0.5).any()  # labels with trees and labels without


def test_binary_served_score_is_what_predictions_wrote(world, scenarios):
    cache, test_cutoff, _, spec = world
    task, model, head = scenarios["binary"]
    explainer, _, ex, _ = _explained(world, scenarios, "binary")
    batches = list(explain_cutoff(model, cache, spec, task, test_cutoff, explainer.net.groups, top=3, steps=STEPS,
                                  select="all", head=head))
    out = list(predict(model, cache, spec, task, test_cutoff, head=head))
    predicted = dict(zip(np.concatenate([b.column("entity_index").to_numpy() for b in out]),
                         np.concatenate([b.column("score").to_numpy() for b in out])))
    got = {e: s for b in batches for e, s in zip(b.column("entity_index").to_numpy(), b.column("score").to_numpy())}
    assert set(got) == set(predicted)
    assert max(abs(got[e] - predicted[e]) for e in got) < 1e-6


@pytest.mark.parametrize("name", ["binary", "multilabel"])
def test_the_trees_contributions_are_exact_and_the_groups_sum_back(world, scenarios, name):
    explainer, (x, h, si), ex, _ = _explained(world, scenarios, name)
    wp, col = explainer.covered(ex.target)
    tp = np.flatnonzero(wp > 0)
    pos = si.position[ex.rows[tp]]
    z, z0, c = explainer.trees(si.rows.hand[pos], si.rows.embedding[pos], col[tp])
    np.testing.assert_allclose(c.sum(1), z - z0, atol=1e-9)  # TreeSHAP and the secants: exact
    r = si.rows
    gbt = explainer.stack.gbt_scores(dataclasses.replace(r, entities=r.entities[pos], hand=r.hand[pos], embedding=r.embedding[pos]))
    gbt = gbt if gbt.ndim == 1 else gbt[np.arange(len(tp)), col[tp]]
    np.testing.assert_allclose(z, _logit(gbt.astype(np.float64)), atol=1e-5)  # the trees serving reads
    # every attribution is in a group; by (source, column) they sum to the total
    keys, per = column_totals(explainer.groups, ex, TASKS[name].target.column)
    np.testing.assert_allclose(per.sum(1), ex.total, rtol=1e-5, atol=1e-6)
    assert ("foundation", "representation") in keys
    # the representation's share spread over the network's inputs leaves a little in its own group
    rep = np.abs(ex.dense[:, explainer.rep_group]).sum()
    assert rep <= np.abs(ex.dense).sum()


def test_hand_features_map_to_the_columns_and_values_they_count(world, scenarios):
    cache, _, _, spec = world
    task, model, head = scenarios["multilabel"]
    explainer, _, _, groups = _explained(world, scenarios, "multilabel")
    hm = explainer.hand
    assert len(hm.group) == head.stack.info["hand_width"]
    g = explainer.groups
    names = _vocab(cache)("product_id")
    # the small columns' most frequent values: their own value group, named by the value
    own = [g.value[k] for k in hm.group[hm.label < 0] if g.kind[k] == "value" and g.column[k] == "product_id"]
    assert own == names[:len(own)] and len(own) == min(20, len(names))
    # the labels' own history goes to the label's value group; scalars keep the network's names
    lab = hm.label >= 0
    assert list(hm.label[lab]) == list(head.labels)
    for k, l in zip(hm.group[lab], hm.label[lab]):
        assert k == explainer.label_group[l]
    assert g.value[hm.group[0]] == "events" and g.kind[hm.group[1]] == "recency"
    assert hm.baseline[1] == pytest.approx(groups.baseline[1])  # the stranger's days since the last event


def test_a_network_only_head_explains_as_before(world, scenarios):
    cache, test_cutoff, _, spec = world
    task, model, head = scenarios["binary"]
    groups = input_groups(spec, _vocab(cache), model.trunk)
    network_only = dataclasses.replace(head, stack=dataclasses.replace(head.stack, weight=0.0))
    args = dict(top=3, steps=8, select="all")
    before = list(explain_cutoff(model, cache, spec, task, test_cutoff, groups, **args))
    after = list(explain_cutoff(model, cache, spec, task, test_cutoff, groups, head=network_only, **args))
    assert len(before) == len(after) and sum(len(b) for b in before) > 0
    for b, a in zip(before, after):
        assert b.equals(a)
