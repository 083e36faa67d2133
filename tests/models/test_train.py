"""A tiny end-to-end run: foundation training, a churn scenario fine-tuned from it, its hold-out
evaluation and batch predictions, on generated behaviour with a learnable signal."""

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from habitus.models.evaluate.holdout import evaluate, protocol
from habitus.models.data.chunks import chunk_plan
from habitus.models.data.features import DAY, FeatureSpec, chunk_at
from habitus.models.nn.profile import Profile, profile_shape
from habitus.models.serve.predict import predict
from habitus.models.data.targets import TargetSpec
from habitus.models.train.finetune import finetune
from habitus.models.train.foundation import train_foundation
from habitus.models.train.config import FinetuneConfig, FoundationConfig
from habitus.models.tasks.spec import TaskSpec

N_CUSTOMERS = 300
SPAN_DAYS = 126
HORIZON = 14
ACTIVE_DAYS = 30
FOUNDATION = FoundationConfig(horizon_days=HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=2,
                              batch_size=16, learning_rate=5e-3, buckets=32, seed=0, cutoffs_per_chunk=2,
                              chunk_entities=48, min_history_days=28)
FINETUNE = FinetuneConfig(epochs=2, learning_rate=3e-3, batch_size=32, chunk_entities=48, seed=0)
CHURN = TaskSpec("binary", TargetSpec("no_event", HORIZON, active_days=ACTIVE_DAYS))

pytestmark = pytest.mark.usefixtures("one_thread")


def _behaviour(sources, seed=0):
    """Customers of three segments, each buying its own four products at its own pace; half of them
    stop for good on a random day. Who acts next and what they buy follows from their history."""
    rng = np.random.default_rng(seed)
    customer, ts, product, price = [], [], [], []
    for i in range(N_CUSTOMERS):
        segment = i % 3
        per_day = rng.uniform(0.15, 0.6)
        stop = rng.uniform(20, SPAN_DAYS + 40) if rng.random() < 0.5 else SPAN_DAYS
        stop = min(stop, SPAN_DAYS)
        k = rng.poisson(per_day * stop)
        days = np.sort(rng.uniform(0, stop, k))
        customer += [f"cust{i:04d}"] * k
        ts += [sources.at(d) for d in days]
        product += [f"p{segment}{j}" for j in rng.choice(4, k, p=[0.55, 0.25, 0.15, 0.05])]
        price += (rng.gamma(2.0, 4.0 + 6.0 * segment, k)).round(2).tolist()
    return customer, ts, product, price


@pytest.fixture(scope="module")
def world(module_sources):
    customer, ts, product, price = _behaviour(module_sources)
    cache = module_sources.build(module_sources.events(module_sources.write_events("purchases", customer, ts,
                                                                                    product, price)),
                                 shard_events=2500)
    test_cutoff = module_sources.at(SPAN_DAYS - HORIZON)  # its window ends with the data
    raw = {"customer": np.array(customer), "ts": np.array(ts, np.int64)}
    return cache, test_cutoff, raw


@pytest.fixture(scope="module")
def foundation(world):
    cache, test_cutoff, _ = world
    return train_foundation(cache, FOUNDATION, test_cutoff - HORIZON * DAY, device="cpu", log=lambda _: None)


@pytest.fixture(scope="module")
def scenario(world, foundation):
    cache, test_cutoff, _ = world
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    state = foundation.model.state_dict()
    result = finetune(cache, state, foundation.info, CHURN, list(plan.train_cutoffs), plan.val_cutoff, FINETUNE,
                      device="cpu", log=lambda _: None)
    return plan, result


def test_generated_cache_is_sharded(world):
    cache, _, raw = world
    assert cache.shard_count >= 2
    assert cache.manifest["n_events"] == len(raw["ts"])


def test_foundation_learns(foundation, world):
    cache, test_cutoff, _ = world
    curves = foundation.curves
    assert len(curves["train_loss"]) == len(curves["val_loss"]) == FOUNDATION.epochs
    assert all(math.isfinite(v) for v in curves["train_loss"] + curves["val_loss"])
    assert curves["val_loss"][-1] < curves["val_loss"][0]
    info = foundation.info
    spec = FeatureSpec.from_dict(info["feature_spec"])
    assert spec == FeatureSpec.from_cache(cache, FOUNDATION.buckets)
    assert info["net"]["in_dim"] == spec.width and info["net"]["hidden"] == 16
    # [any event, log count] + one column per product (12 products, bucket 0 is not predicted)
    assert info["targets_width"] == 2 + 12
    # no foundation target reads past the hold-out cut-off
    assert info["last_target_time"] <= np.datetime_as_string(np.datetime64(test_cutoff, "s")) + "Z"
    assert info["steps"] > 0 and info["entities_seen"] > 0


def test_protocol_orders_cutoffs_and_keeps_windows_before_the_test_cutoff(world):
    cache, test_cutoff, _ = world
    plan = protocol(test_cutoff + 3 * 3600, HORIZON, 3, cache.time_range[0])  # floored to the midnight
    assert plan.test_cutoff == test_cutoff
    assert plan.val_cutoff == test_cutoff - HORIZON * DAY
    assert len(plan.train_cutoffs) == 3 and list(plan.train_cutoffs) == sorted(plan.train_cutoffs)
    assert max(plan.train_cutoffs) < plan.val_cutoff < plan.test_cutoff
    assert plan.val_cutoff + HORIZON * DAY <= plan.test_cutoff
    for c in plan.train_cutoffs:
        assert c % DAY == 0 and c + HORIZON * DAY <= plan.val_cutoff
        assert c >= cache.time_range[0] // DAY * DAY + 28 * DAY  # 28 days of history before each
    # asking for more cut-offs than the history holds keeps only those that fit
    many = protocol(test_cutoff, HORIZON, 50, cache.time_range[0])
    assert 3 < len(many.train_cutoffs) < 50
    with pytest.raises(ValueError, match="history"):
        protocol(cache.time_range[0] + 40 * DAY, HORIZON, 3, cache.time_range[0])


def test_finetune_and_holdout_report(world, foundation, scenario):
    cache, _, _ = world
    plan, result = scenario
    assert all(math.isfinite(v) for v in result.curves["train_loss"] + result.curves["val_loss"])
    # 0: the starting point (the foundation's own churn forecast, or the base rate) beat every epoch
    assert 0 <= result.info["best_epoch"] <= FINETUNE.epochs
    assert result.info["head_start"] in ("foundation (calibrated)", "baseline")
    assert result.info["val_rows"] > 0 and 0 < result.info["val_target_mean"] < 1
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    report = evaluate(result.model, cache, spec, CHURN, plan.test_cutoff, chunk_entities=64)
    assert report["entities"] > 0 and 0 < report["positive_rate"] < 1
    assert set(report["baselines"]) == {"recency", "frequency"}
    for metrics in [report["model"], *report["baselines"].values()]:
        assert set(metrics) == {"auroc", "average_precision"}
        assert all(0.0 <= v <= 1.0 for v in metrics.values()), metrics
    assert report["model"]["auroc"] > 0.6  # churn is predictable from recency and pace
    # the report covers the same entities whatever the chunking
    again = evaluate(result.model, cache, spec, CHURN, plan.test_cutoff, chunk_entities=1000)
    assert again["entities"] == report["entities"]
    assert again["model"]["auroc"] == pytest.approx(report["model"]["auroc"], abs=1e-6)


def test_the_foundation_saves_the_embeddings_profile_fitted_at_its_last_cutoff(world, foundation):
    """The projection the embeddings asset writes (habitus.models.nn.profile) comes with the training
    info (saved in config.json), sized for the entities with history at the last cut-off."""
    cache, test_cutoff, _ = world
    profile = Profile.of(foundation.info)
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    assert profile.components is not None and profile.components.shape[1] == FOUNDATION.hidden
    with_history = sum(chunk_at(cache.shard(s), lo, hi, test_cutoff - HORIZON * DAY).n
                       for s, lo, hi in chunk_plan(cache, FOUNDATION.chunk_entities))
    assert profile.entities == pytest.approx(with_history, rel=0.3)  # estimated from a quarter of the chunks
    k, scalars = profile_shape(profile.entities, FOUNDATION.hidden, spec.scalar_width)
    assert profile.scalars == scalars and len(profile.components) <= k


def test_same_seed_same_weights(world, foundation):
    cache, test_cutoff, _ = world
    again = train_foundation(cache, FOUNDATION, test_cutoff - HORIZON * DAY, device="cpu", log=lambda _: None)
    first, second = foundation.model.state_dict(), again.model.state_dict()
    assert set(first) == set(second)
    for k in first:
        torch.testing.assert_close(second[k], first[k], rtol=0, atol=0, msg=k)
    assert again.curves == foundation.curves


def test_predict_scores_every_eligible_entity_once(world, foundation, scenario):
    cache, test_cutoff, raw = world
    _, result = scenario
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    batches = list(predict(result.model, cache, spec, CHURN, test_cutoff, chunk_entities=64))
    table = pa.Table.from_batches(batches)
    assert table.column_names == ["entity_index", "score"]
    index = table.column("entity_index").to_numpy()
    assert len(np.unique(index)) == len(index)
    # eligible = at least one event in the ACTIVE_DAYS up to (and including) the cut-off
    recent = (raw["ts"] <= test_cutoff) & (raw["ts"] >= test_cutoff - ACTIVE_DAYS * DAY)
    expected = set(raw["customer"][recent].tolist())
    assert set(cache.entity_ids(index).to_pylist()) == expected
    score = table.column("score").to_numpy()
    assert np.all((score >= 0) & (score <= 1))


def test_recommendation_trains_on_sampled_candidates_and_ranks_the_catalog(world, foundation, monkeypatch):
    """The catalog-scale path (sampled candidates, sparse histories, blockwise top-k) on 12 products
    made to look like a large catalog: few best-sellers and negatives per batch, items in blocks of 5."""
    import habitus.models.data.items as items

    monkeypatch.setattr(items, "RERANK_POPULAR", 2)
    monkeypatch.setattr(items, "SAMPLED_NEGATIVES", 3)
    monkeypatch.setattr(items, "ITEM_BLOCK", 5)
    cache, test_cutoff, _ = world
    vocab = cache.columns["product_id"]["vocab_size"]
    task = TaskSpec("recommendation", TargetSpec("items", HORIZON, "product_id", tuple(range(1, vocab + 1))), k=3,
                    item_dim=8)
    plan = protocol(test_cutoff, HORIZON, 3, cache.time_range[0])
    result = finetune(cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                      plan.val_cutoff, FINETUNE, device="cpu", log=lambda _: None)
    assert all(math.isfinite(v) for v in result.curves["train_loss"] + result.curves["val_loss"])
    spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
    report = evaluate(result.model, cache, spec, task, plan.test_cutoff, chunk_entities=64)
    assert set(report["baselines"]) == {"popularity", "past frequency"} and report["entities"] > 0
    for metrics in [report["model"], *report["baselines"].values()]:
        assert set(metrics) == {"hr@3", "ndcg@3", "map@3"} and all(0 <= v <= 1 for v in metrics.values())
    # each segment buys only its own products: knowing the customer beats the global best-sellers
    assert report["model"]["hr@3"] > report["baselines"]["popularity"]["hr@3"]
    table = pa.Table.from_batches(list(predict(result.model, cache, spec, task, test_cutoff, k=3, chunk_entities=64)))
    assert table.column_names == ["entity_index", "labels", "scores"]
    lists = table.column("labels").to_pylist()
    assert all(len(v) == 3 and len(set(v)) == 3 for v in lists)
    scores = table.column("scores").to_pylist()
    assert all(s[0] >= s[1] >= s[2] for s in scores)


def test_tiny_binary_head_loss_trajectory():
    """A head that starts at the base rate p has loss H(p) exactly, then falls step by step on a
    separable problem."""
    torch.manual_seed(0)
    from habitus.models.nn.network import Model, NetConfig
    from habitus.models.tasks import task

    x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]] * 4)
    y = torch.tensor([1.0, 1.0, 0.0, 0.0] * 3 + [0.0] * 4)  # base rate 6/16
    model = Model(NetConfig(in_dim=2, hidden=4, layers=1, dropout=0.0), outputs=1)
    p = float(y.mean())
    with torch.no_grad():
        model.head.linear.weight.zero_()
        model.head.linear.bias.fill_(math.log(p / (1 - p)))
    first = task("binary").loss(model(x), y).item()
    assert first == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)), rel=1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(8):
        loss = task("binary").loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(first)
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert losses[-1] < 0.9 * first


def test_per_label_history_weights_learn_what_one_shared_weight_cannot():
    """Label 0 is bought again by whoever bought it (a staple), label 1 never by the same people (a
    one-off): one weight shared by both labels cannot fit both, the per-label weights can, and they
    take opposite signs. At zero they leave the shared skip's outputs unchanged."""
    from habitus.models.nn.network import Head

    torch.manual_seed(0)
    n = 512
    history = torch.zeros(n, 2, 3)
    bought = torch.rand(n, 2) < 0.5
    history[..., 1] = bought.float()  # the habitual channel
    y = torch.stack([bought[:, 0], ~bought[:, 1]], 1).float()
    h = torch.zeros(n, 4)
    shared = Head(4, 2, 3)
    with torch.no_grad():
        shared.skip.weight.fill_(0.3)
    before = shared(h, history)
    assert torch.allclose(before, shared.linear(h) + 0.3 * history.sum(-1))  # label_skip starts at zero
    losses = {}
    for per_label in (False, True):
        head = Head(4, 2, 3)
        params = [head.skip.weight, head.linear.bias] + ([head.label_skip] if per_label else [])
        opt = torch.optim.Adam(params, lr=0.1)
        for _ in range(200):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head(h, history), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[per_label] = loss.item()
        if per_label:
            w = (head.skip.weight[0] + head.label_skip)[:, 1]
            assert w[0] > 1.0 and w[1] < -1.0
    assert losses[True] < 0.1 < 0.5 < losses[False]


def test_feature_budgets_move_features_between_memory_files_and_recomputing_not_the_result(world, foundation,
                                                                                           scenario, tmp_path):
    """Fine-tuning with no memory budget (every chunk's features in files under spill_dir, read back
    at each epoch), or with neither budget (computed again at each use), trains the same weights as
    with everything in memory; the files are gone afterwards."""
    from dataclasses import replace

    cache, _, _ = world
    plan, kept = scenario
    state = foundation.model.state_dict()
    for memory, disk in ((0, 1 << 30), (0, 0)):
        cfg = replace(FINETUNE, memory_budget_bytes=memory, spill_budget_bytes=disk, spill_dir=str(tmp_path))
        again = finetune(cache, state, foundation.info, CHURN, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                         device="cpu", log=lambda _: None)
        assert again.curves == kept.curves
        for k, v in kept.model.state_dict().items():
            assert torch.equal(again.model.state_dict()[k], v), k
        assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_spill_reserve")
def test_kept_arrays_fill_memory_then_files_then_recompute(tmp_path):
    from habitus.models.train import spill

    made, make = _counted_arrays()
    kept = spill.Kept(make, memory_bytes=2000, disk_bytes=1000, folder=str(tmp_path))
    for _ in range(2):
        for i in range(4):
            x, h = kept.get((i,))
            assert h is None and (x == i).all()
    assert made == [0, 1, 2, 3, 3]  # two in memory, one in a file, the fourth computed at each use
    assert len(kept.memory) == 2 and len(kept.files) == 1 and len(list(tmp_path.iterdir())) == 1
    kept.close()
    assert list(tmp_path.iterdir()) == []


def _counted_arrays():
    """A producer for spill.Kept of 1,000-byte arrays (all equal to their key), and the keys it made, in order."""
    made = []

    def make(i):
        made.append(i)
        return np.full(250, i, np.float32), None

    return made, make


@pytest.fixture
def no_spill_reserve(monkeypatch):
    """Spill tests that write real files: whatever the machine's disk holds, the reserve lets them."""
    from habitus.models.train import spill

    monkeypatch.setattr(spill, "SPILL_RESERVE_BYTES", 0)
    monkeypatch.setattr(spill, "SPILL_RESERVE_SHARE", 0.0)


@pytest.mark.usefixtures("no_spill_reserve")
def test_spilled_features_of_a_killed_run_are_removed_by_the_next_run(tmp_path):
    import os

    from habitus.models.train import spill
    from habitus.models.storage.files import recover_tree

    kept = spill.Kept(lambda i: (np.zeros(250, np.float32), None), memory_bytes=0, disk_bytes=10_000,
                       folder=str(tmp_path))
    kept.get((0,))
    (mine,) = tmp_path.iterdir()
    assert mine.name.endswith(f".tmp-{os.getpid()}")
    assert recover_tree(tmp_path) == [] and mine.exists()  # a live writer's files stay
    dead = tmp_path / mine.name.replace(f".tmp-{os.getpid()}", ".tmp-999999999")  # as a killed run leaves them
    mine.rename(dead)
    assert recover_tree(tmp_path) == [f"removed {dead}"] and list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_spill_reserve")
def test_a_full_disk_stops_the_spilling_not_the_training(tmp_path, monkeypatch):
    import errno

    from habitus.models.train import spill

    real = spill.save_arrays

    def save(path, arrays):
        if len(made) > 3:  # the disk fills up while chunk 3 is written
            open(path, "wb").write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, arrays)

    monkeypatch.setattr(spill, "save_arrays", save)
    made, make = _counted_arrays()
    kept = spill.Kept(make, memory_bytes=1000, disk_bytes=10_000, folder=str(tmp_path))
    for _ in range(2):
        for i in range(5):
            assert (kept.get((i,))[0] == i).all()
    # chunk 0 in memory, 1 and 2 in files; 3 failed to write (its half file removed), so 3 and 4 are
    # computed again at each use and never written
    assert made == [0, 1, 2, 3, 4, 3, 4] and len(kept.files) == 2
    (folder,) = tmp_path.iterdir()
    assert sorted(f.name for f in folder.iterdir()) == ["0.npz", "1.npz"]
    kept.close()


def test_by_shard_groups_the_shuffled_work_and_leaves_one_shard_as_shuffled():
    from habitus.models.train.loop import by_shard

    work = [(s, c) for s in range(3) for c in range(5)]
    got = by_shard(list(work), np.random.default_rng(0))
    shuffled = list(work)
    np.random.default_rng(0).shuffle(shuffled)
    assert sorted(got) == sorted(work)
    assert [s for s, _ in got] == sorted([s for s, _ in got], key=[s for s, _ in shuffled].index)  # grouped
    for s in range(3):  # each shard's items in their shuffled order
        assert [w for w in got if w[0] == s] == [w for w in shuffled if w[0] == s]
    one = [(0, c) for c in range(9)]
    alone = list(one)
    np.random.default_rng(1).shuffle(alone)
    assert by_shard(list(one), np.random.default_rng(1)) == alone


def test_spilling_leaves_the_reserve_of_the_disk_free(tmp_path, monkeypatch):
    """Feature files stop where the disk would drop under the reserve: the checkpoint written after
    training (and anything else on the volume) needs the space more."""
    import shutil
    from collections import namedtuple

    from habitus.models.train import spill

    monkeypatch.setattr(spill, "SPILL_RESERVE_BYTES", 0)
    monkeypatch.setattr(spill, "SPILL_RESERVE_SHARE", 0.2)

    usage = namedtuple("usage", "total used free")
    written = []
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10_000, 0, 10_000 - 1000 * len(written) - 7_000))
    real = spill.save_arrays
    monkeypatch.setattr(spill, "save_arrays", lambda path, arrays: (written.append(path), real(path, arrays)))
    made, make = _counted_arrays()
    kept = spill.Kept(make, memory_bytes=0, disk_bytes=10_000, folder=str(tmp_path))
    for _ in range(2):
        for i in range(3):
            assert (kept.get((i,))[0] == i).all()
    # 3,000 free of 10,000 and a 2,000 reserve: one file fits (leaving 2,000), the second would not
    assert len(written) == 1 and made == [0, 1, 2, 1, 2] and kept.disk_bytes == 1000
    kept.close()
