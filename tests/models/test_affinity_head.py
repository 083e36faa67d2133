"""The served head's label trees read each label's co-occurrence mass at the item attribute columns
(models/data/affinity.py's served_affinity, models/heads/stacked_head.py): fitted on each cut-off's
past only, saved beside the trees, and a reloaded checkpoint scores what was measured."""

import numpy as np
import pytest

from habitus.models.data.affinity import SERVED, Affinity, attribute_columns, served_affinity
from habitus.models.data.features import DAY, FeatureSpec, chunk_at
from habitus.models.data.targets import TargetSpec
from habitus.models.evaluate.holdout import protocol, score_holdout
from habitus.models.heads.stacked_head import AFFINITY_FILE, fit_head, load_head, save_head
from habitus.models.heads.stacked_rows import collect
from habitus.models.heads.stacking import StackConfig, refit_stack
from habitus.models.nn.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from habitus.models.nn.network import load_trunk
from habitus.models.serve.predict import load_model, predict
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.config import FinetuneConfig

pytest.importorskip("lightgbm")
pytestmark = pytest.mark.usefixtures("one_thread")

GROUPS, PER_GROUP, DAYS, HORIZON = 8, 4, 112, 14  # 8 categories of 4 products: enough values for a level
FORCED = StackConfig(n_estimators=20, label_n_estimators=10, weights=(0.5,))  # a blend: the trees are read


def _attributed_cache(sources, customers: int = 160):
    """Customers each loyal to one category (70% of what they buy; 20% the next category), a basket of
    2-4 products on about one day in five; a products table gives every product its category (an
    item attribute)."""
    from habitus.models.cache import TableInput

    rng = np.random.default_rng(5)
    customer, ts, product = [], [], []
    for i in range(customers):
        for d in np.sort(rng.choice(DAYS, 22, replace=False)):
            for p in rng.choice(PER_GROUP, rng.integers(2, 5), replace=False):
                r = rng.random()  # its own category, the next one (co-bought with it), now and then any
                g = i % GROUPS if r < 0.7 else (i + 1) % GROUPS if r < 0.9 else rng.integers(GROUPS)
                customer.append(f"c{i:03d}")
                ts.append(sources.at(float(d), 10))
                product.append(f"p{g}_{p}")
    events = sources.events(sources.write_events("purchases", customer, ts, product, [1.0] * len(ts)))
    names = [f"p{g}_{p}" for g in range(GROUPS) for p in range(PER_GROUP)]
    products = TableInput("products", [sources.write("products", product_id=names,
                                                     category=[n.split("_")[0] for n in names])],
                          {"category": "categorical"}, key="product_id")
    return sources.build(events, attributes=[products], shard_events=2000)


@pytest.fixture(scope="module")
def world(module_sources):
    from habitus.models.train.config import FoundationConfig
    from habitus.models.train.foundation import train_foundation

    cache = _attributed_cache(module_sources)
    test_cutoff = module_sources.at(DAYS - HORIZON)
    cfg = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=1, batch_size=16,
                           learning_rate=5e-3, buckets=32, seed=0, cutoffs_per_chunk=1, chunk_entities=64,
                           min_history_days=28)
    foundation = train_foundation(cache, cfg, test_cutoff - HORIZON * DAY, device="cpu", log=lambda _: None)
    return cache, test_cutoff, foundation, FeatureSpec.from_dict(foundation.info["feature_spec"])


def test_the_served_affinity_is_the_mass_at_the_attribute_columns(world):
    cache, test_cutoff, _, _ = world
    assert attribute_columns(cache) == ("category",)  # not the item id itself
    labels = np.arange(1, cache.columns["category"]["vocab_size"] + 1)
    aff = served_affinity(cache, test_cutoff, "category", labels)
    assert list(aff.levels) == ["category"] and aff.width == 1 and aff.cfg == SERVED  # the mass alone
    sh = cache.shard(0)
    mass = aff.features(chunk_at(sh, 0, len(sh.entities), test_cutoff))[:, :, 0]
    both = Affinity.fit(cache, test_cutoff, "category", labels, levels=("category",))
    np.testing.assert_allclose(mass, both.features(chunk_at(sh, 0, len(sh.entities), test_cutoff))[:, :, 1], rtol=1e-6)
    # each customer (c{i}: loyal to category i % 8) has the most mass near its own category's label
    vocab = cache.vocab("category").column("value").to_pylist()
    names = cache.entity_ids(sh.entities).to_pylist()
    own = np.array([vocab.index(f"p{int(n[1:]) % GROUPS}") for n in names])
    assert (mass.argmax(1) == own).mean() > 0.95


def test_a_cache_without_an_item_table_gets_no_served_affinity(sources):
    cache = sources.segment_purchases(30, 40, seed=0)
    assert attribute_columns(cache) == ()
    assert served_affinity(cache, sources.at(30), "product_id", np.arange(1, 5)) is None


def test_the_head_saves_its_affinity_and_a_reload_scores_what_was_measured(world, tmp_path):
    from habitus.models.train.finetune import finetune

    cache, test_cutoff, foundation, spec = world
    labels = tuple(range(1, cache.columns["category"]["vocab_size"] + 1))
    task = TaskSpec("multilabel", TargetSpec("any_event", HORIZON, "category", labels), k=3)
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    tuned = finetune(cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                     plan.val_cutoff, FinetuneConfig(epochs=1, batch_size=64), log=lambda _: None, device="cpu")
    trunk = load_trunk(foundation.model.state_dict(), foundation.info["net"])
    head = fit_head(cache, spec, task, trunk, tuned.model, plan.train_cutoffs, plan.val_cutoff, cfg=FORCED)
    plain = fit_head(cache, spec, task, trunk, tuned.model, plan.train_cutoffs, plan.val_cutoff,
                     cfg=StackConfig(**{**FORCED.to_dict(), "affinity": False}))
    assert head.affinity is not None and plain.affinity is None
    assert head.stack.info["hand_width"] == plain.stack.info["hand_width"]
    booster = head.stack.boosters[0][0]
    assert booster.num_feature() == plain.stack.boosters[0][0].num_feature() + 1  # the label's mass
    # the affinity the head keeps is the validation cut-off's: fitted on its past only
    at_val = Affinity.fit(cache, plan.val_cutoff, "category", labels, SERVED, ("category",))
    np.testing.assert_array_equal(head.affinity.centroids["category"], at_val.centroids["category"])

    rows = collect(cache, spec, task, head.trunk, plan.test_cutoff, labels=head.labels, model=tuned.model,
                   affinity=head.affinity)
    assert head.labels is None and rows.affinity.shape == (len(rows), len(labels), 1)  # (8 labels: all have trees)
    chosen = head.stack.predict(rows)
    held = score_holdout(tuned.model, cache, spec, task, plan.test_cutoff, head=head)
    assert held.report["head"]["chosen"] == "blend"

    path = tmp_path / "scenario"
    config = {"kind": "scenario", "task": task.to_dict(), "feature_spec": foundation.info["feature_spec"],
              "net": foundation.info["net"]}
    save_checkpoint(path, tuned.model, config, extra=lambda f: {"stack": save_head(f, head)})
    assert (path / AFFINITY_FILE).exists()
    state, config = load_checkpoint(path)
    assert config["stack"]["affinity"]["levels"] == ["category"]
    loaded = load_head(path, config)
    np.testing.assert_array_equal(loaded.affinity.levels["category"], head.affinity.levels["category"])
    assert loaded.affinity.cfg == head.affinity.cfg
    loaded_model, loaded_spec, loaded_task = load_model(state, config)
    out = list(predict(loaded_model, cache, loaded_spec, loaded_task, plan.test_cutoff, k=len(labels), head=loaded))
    entities = np.concatenate([b.column("entity_index").to_numpy() for b in out])
    np.testing.assert_array_equal(entities, rows.entities)
    vocab = cache.vocab("category").column("value").to_pylist()
    got = np.zeros((len(entities), len(labels)), np.float32)
    for r, (ls, vs) in enumerate(zip([x for b in out for x in b.column("labels").to_pylist()],
                                     [x for b in out for x in b.column("scores").to_pylist()])):
        got[r, [vocab.index(v) for v in ls]] = vs  # (label value id i + 1 is position i here)
    np.testing.assert_allclose(got, chosen, rtol=1e-4, atol=1e-5)

    # the refit (models/train/refit.py): the trees again on a later cut-off's rows, with that cut-off's affinity
    later, aff = head.collect(cache, spec, task, plan.test_cutoff)
    assert aff is not head.affinity and later.affinity.shape == (len(later), len(labels), 1)
    refitted = refit_stack(head.stack, later)
    assert refitted.gbt_scores(later).shape == (len(later), len(labels))

    (path / AFFINITY_FILE).write_bytes((path / AFFINITY_FILE).read_bytes()[:-4] + b"\0\0\0\0")
    with pytest.raises(CheckpointError, match="changed after training"):
        load_head(path, config)
