"""Items first seen after a recommendation scenario was trained (models/tasks/coldstart.py): held back
from training, appended on the days they start selling, ranked by the next day's predictions."""

import numpy as np
import pyarrow as pa
import pytest

from habitus.models.cache import Cache, TableInput, build_cache
from habitus.models.tasks.coldstart import fit_item_map, new_item_embeddings
from habitus.models.data.features import DAY
from habitus.models.evaluate.holdout import protocol
from habitus.models.serve.predict import load_model, predict
from habitus.models.train.config import FinetuneConfig, FoundationConfig
from habitus.models.train.finetune import finetune
from habitus.models.train.foundation import train_foundation
from habitus.models.tasks.spec import TaskSpec
from habitus.models.data.targets import TargetSpec

pytestmark = pytest.mark.usefixtures("one_thread")

CUSTOMERS, SPAN, SPLIT = 180, 112, 98  # days of data; the held-back items start selling on day SPLIT
CATEGORIES, PER_CATEGORY = 3, 6


def _products(n_new: int) -> dict:
    """Three categories of 6 known products (p<c>_<j>) and `n_new` new ones of category 0 (n<j>)."""
    ids = [f"p{c}_{j}" for c in range(CATEGORIES) for j in range(PER_CATEGORY)] + [f"n{j}" for j in range(n_new)]
    cat = [f"cat{c}" for c in range(CATEGORIES) for _ in range(PER_CATEGORY)] + ["cat0"] * n_new
    return {"product_id": ids, "category": cat}


def _world(sources, n_new: int = 2):
    """Customers of three segments (i % 3), each buying 85% in its own category; from day SPLIT on,
    segment 0 buys the new products of its category too. Returns (events before SPLIT, after it)."""
    rng = np.random.default_rng(0)
    rows = {"before": ([], [], [], []), "after": ([], [], [], [])}
    for i in range(CUSTOMERS):
        days = np.sort(rng.uniform(0, SPAN, rng.poisson(0.5 * SPAN)))
        for d in days:
            cat = i % 3 if rng.random() < 0.85 else int(rng.integers(0, CATEGORIES))
            product = f"p{cat}_{rng.integers(0, PER_CATEGORY)}"
            if d >= SPLIT and cat == 0 and rng.random() < 0.4:
                product = f"n{rng.integers(0, n_new)}"
            part = rows["after" if d >= SPLIT else "before"]
            for col, v in zip(part, (f"c{i:04d}", sources.at(float(d)), product, 2.0 + (cat == 0))):
                col.append(v)
    files = {}
    for name, (c, t, p, price) in rows.items():
        files[name] = sources.write_events(f"events_{name}", c, t, p, price)
    return files


def test_items_first_seen_after_training_are_ranked_by_the_next_daily_predictions(sources):
    files = _world(sources)
    products = sources.write("products", **_products(2))
    attrs = [TableInput("products", [products], {"category": "categorical"}, key="product_id")]
    columns = {"product_id": "categorical", "price": "numeric"}
    before = Cache(build_cache(sources.spec(sources.events(files["before"], columns=columns), attributes=attrs),
                               sources.root / "cache", log=lambda _: None))
    known = before.columns["product_id"]["vocab_size"]
    assert known == CATEGORIES * PER_CATEGORY  # the new products have no id before they sell

    cutoff = sources.at(SPLIT)
    fcfg = FoundationConfig(horizon_days=14, hidden=16, layers=1, epochs=1, batch_size=32, buckets=16,
                            chunk_entities=64, min_history_days=28)
    foundation = train_foundation(before, fcfg, cutoff - 14 * DAY, device="cpu", log=lambda _: None)
    task = TaskSpec("recommendation", TargetSpec("items", 14, "product_id", tuple(range(1, known + 1))), k=3,
                    item_dim=8)
    plan = protocol(cutoff, 14, 3, before.time_range[0])
    said = []
    result = finetune(before, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                      plan.val_cutoff, FinetuneConfig(epochs=2, batch_size=32, chunk_entities=64, second_stage=False),
                      device="cpu", log=said.append)
    assert result.info["new_items"]["columns"]["categorical"] == ["category"]  # price: numeric, too
    assert any("new items" in m for m in said)
    model = result.model
    # the attributes, or every new item the map's intercept: chosen on validation, held-out items ranked as new
    fitted = result.info["new_items"]
    assert fitted["held_entities"] > 0
    assert (fitted["chosen"] == "attributes") == (fitted["held_ndcg@3_attributes"] > fitted["held_ndcg@3_intercept"])
    assert bool((model.head.item_map_of[1][:-1] == 0).all()) == (fitted["chosen"] == "intercept")

    # the days they sell are appended: the new products get the next ids, nothing collides
    after = Cache(build_cache(sources.spec(sources.events(files["before"], files["after"], columns=columns),
                                           attributes=attrs), sources.root / "cache", previous=before.path,
                              log=lambda _: None))
    assert after.manifest["mode"] == "append"
    vocab = after.vocab("product_id").to_pydict()
    new_ids = {v: i for v, i in zip(vocab["value"], vocab["id"]) if v.startswith("n")}
    assert sorted(new_ids.values()) == [known + 1, known + 2]
    # their events carry their category (the attributes table, through the appended lookup): a propensity
    # over categories counts them at once
    cats = after.vocab("category").to_pydict()
    rows = [after.shard(s) for s in range(after.shard_count)]
    of_new = np.concatenate([np.isin(r.columns["product_id"], list(new_ids.values())) for r in rows])
    category = np.concatenate([r.columns["category"] for r in rows])
    assert of_new.sum() > 50 and set(category[of_new]) == {cats["id"][cats["value"].index("cat0")]}

    # a checkpoint's round trip: the item map travels in the head's state
    loaded, spec, saved_task = load_model(model.state_dict(), {"feature_spec": foundation.info["feature_spec"],
                                                              "task": task.to_dict(),
                                                              "net": foundation.info["net"]})
    assert loaded.head.item_map_of is not None
    day = sources.at(SPLIT + 7)  # a week after they started selling
    k = PER_CATEGORY + 2  # the size of a category, new products included
    table = pa.Table.from_batches(list(predict(loaded, after, spec, saved_task, day, k=k, device="cpu"))).to_pydict()
    segment = np.array([int(v[1:]) % 3 for v in after.entity_ids(np.array(table["entity_index"])).to_pylist()])
    has_new = np.array([any(str(v).startswith("n") for v in labels) for labels in table["labels"]])
    # the customers of the new products' category get them in their top k; the others hardly
    assert has_new[segment == 0].mean() > 0.4
    assert has_new[segment != 0].mean() < 0.15
    assert all(np.isfinite(s).all() for s in table["scores"])

    # a head without the map ranks only the trained catalog: the new products are never recommended
    del loaded.head.item_map_spec
    plain = pa.Table.from_batches(list(predict(loaded, after, spec, saved_task, day, k=k, device="cpu"))).to_pydict()
    assert not any(str(v).startswith("n") for labels in plain["labels"] for v in labels)


def test_the_item_map_reads_a_category_into_the_embedding_space(sources):
    files = _world(sources)
    attrs = [TableInput("products", [sources.write("products", **_products(2))], {"category": "categorical"},
                        key="product_id")]
    cache = Cache(build_cache(sources.spec(sources.events(files["before"], files["after"],
                                                          columns={"product_id": "categorical", "price": "numeric"}),
                                           attributes=attrs), sources.root / "cache", log=lambda _: None))
    vocab = cache.vocab("product_id").to_pydict()
    cat = {i: int(v[1]) if v.startswith("p") else 0 for v, i in zip(vocab["value"], vocab["id"])}
    labels = tuple(sorted(cat))
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(CATEGORIES, 8))
    emb = np.stack([centers[cat[i]] + 0.05 * rng.normal(size=8) for i in labels]).astype(np.float32)
    spec, weight, info, _ = fit_item_map(cache, "product_id", labels, emb, sources.at(SPAN))
    assert "category" in spec["categorical"] and info["held_mse"] < 0.1 * info["held_mse_mean_embedding"]

    ids, mapped = new_item_embeddings(cache, spec, weight, len(labels) - 2, sources.at(SPAN))  # the last two as new
    np.testing.assert_array_equal(ids, labels[-2:])
    for i, m in zip(ids, mapped):  # the nearest category center is the item's own
        assert np.argmin(((centers - m) ** 2).sum(1)) == cat[int(i)]
