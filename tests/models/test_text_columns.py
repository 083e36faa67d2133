"""Text columns (`type: text`, models/cache/text.py): hashed n-grams reduced by an SVD fitted when the
cache is first built, carried unchanged by later versions; the item map reads a product's name."""

import filecmp

import numpy as np
import pytest

from habitus.models.cache import Cache, CacheError, build_cache
from habitus.models.tasks.coldstart import fit_item_map, new_item_embeddings
from habitus.models.cache.text import TEXT_WIDTH, encoder_path, fit_encoder, text_vectors, transform

NAMES = ["organic whole milk 1l", "organic skim milk 1l", "whole milk 2l", "dog food chicken 2kg",
         "dog food beef 2kg", "cat food salmon", "dark chocolate 70%", "milk chocolate bar", "white bread loaf",
         "rye bread loaf", "green tea 20 bags", "black tea 50 bags"]


def _cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_the_encoder_is_deterministic_and_embeds_an_unseen_text_near_similar_ones():
    a, b = fit_encoder(NAMES), fit_encoder(list(NAMES))
    np.testing.assert_array_equal(a["components"], b["components"])
    v = transform(a, ["organic whole milk 2l", "dog food lamb 2kg", None])
    known = transform(a, NAMES)
    assert v.shape == (3, TEXT_WIDTH) and np.abs(v[0]).sum() > 0
    np.testing.assert_array_equal(v[2], 0)  # a null text: zeros
    assert _cos(v[0], known[0]) > _cos(v[0], known[3]) + 0.3  # milk is nearer milk than dog food
    assert _cos(v[1], known[3]) > _cos(v[1], known[0]) + 0.3


def _events(sources, names, days, name="events"):
    customers = [f"c{i % 7}" for i in range(len(names))]
    return sources.write(name, customer_id=customers, ts=sources.stamps([sources.at(d) for d in days]),
                         product_name=names)


def test_a_text_column_is_embedded_once_and_carried_by_every_later_version(sources):
    first = _events(sources, NAMES * 3, [i % 30 for i in range(36)])
    columns = {"product_name": "text"}
    spec = sources.spec(sources.events(first, columns=columns))
    assert spec.fingerprint() != sources.spec(sources.events(first, columns={"product_name": "categorical"})).fingerprint()
    cache = Cache(build_cache(spec, sources.root / "cache", log=lambda _: None))
    assert cache.columns["product_name"] == {"type": "categorical", "vocab_size": len(NAMES), "text": TEXT_WIDTH}
    before = text_vectors(cache, "product_name", np.arange(1, len(NAMES) + 1))
    assert np.abs(before).sum(1).min() > 0

    later = _events(sources, ["organic oat milk 1l"], [31], name="events_later")
    grown = Cache(build_cache(sources.spec(sources.events(first, later, columns=columns)), sources.root / "cache",
                              previous=cache.path, log=lambda _: None))
    assert grown.manifest["mode"] == "append" and grown.columns["product_name"]["vocab_size"] == len(NAMES) + 1
    assert filecmp.cmp(encoder_path(cache.path, "product_name"), encoder_path(grown.path, "product_name"), shallow=False)
    np.testing.assert_array_equal(text_vectors(grown, "product_name", np.arange(1, len(NAMES) + 1)), before)
    new = text_vectors(grown, "product_name", np.array([len(NAMES) + 1]))[0]  # a name first seen on append
    assert np.abs(new).sum() > 0
    vocab = grown.vocab("product_name").column("value").to_pylist()  # (ids by count, then text)
    milk = [i for i, n in enumerate(vocab[:len(NAMES)]) if "milk" in n and "chocolate" not in n]
    assert max(_cos(new, before[i]) for i in milk) > max(_cos(new, before[i]) for i in range(len(NAMES)) if i not in milk)


def test_a_text_type_on_a_column_of_numbers_fails_naming_it(sources):
    path = sources.write("events", customer_id=["a", "b"], ts=sources.stamps([sources.at(0), sources.at(1)]),
                         price=[1.0, 2.0])
    with pytest.raises(CacheError, match=r"column 'price' of source 'purchases' has `type: text`.*double"):
        build_cache(sources.spec(sources.events(path, columns={"price": "text"})), sources.root / "cache",
                    log=lambda _: None)


def test_the_item_map_reads_a_products_name(sources):
    # products named by kind ("... milk", "... dog food"); their embeddings cluster by kind
    kinds = {"milk": ["organic whole milk", "skim milk", "oat milk", "goat milk", "whole milk 2l", "lactose free milk"],
             "dog": ["dog food chicken", "dog food beef", "dog food lamb", "puppy dog food", "dog food fish",
                     "senior dog food"]}
    names = [n for group in kinds.values() for n in group]
    rng = np.random.default_rng(0)
    sold = [names[i] for i in rng.integers(0, len(names), 600)]
    path = sources.write("events", customer_id=[f"c{i % 40}" for i in range(600)],
                         ts=sources.stamps([sources.at(float(d)) for d in rng.uniform(0, 60, 600)]), product=sold,
                         product_name=sold)
    cache = Cache(build_cache(sources.spec(sources.events(path, columns={"product": "categorical",
                                                                          "product_name": "text"})),
                              sources.root / "cache", log=lambda _: None))
    vocab = cache.vocab("product").column("value").to_pylist()
    labels = tuple(range(1, len(vocab) - 1))  # the last two are not in the trained catalog
    center = {"milk": np.full(8, 1.0), "dog": np.full(8, -1.0)}
    emb = np.stack([center["dog" if "dog" in vocab[i - 1] else "milk"] + 0.1 * rng.normal(size=8) for i in labels])
    spec, weight, info, _ = fit_item_map(cache, "product", labels, emb.astype(np.float32), sources.at(61))
    assert "product_name" in spec["text"] and "product_name" not in spec["categorical"]
    # the two new products: each lands on its kind's side, from its name alone
    ids, mapped = new_item_embeddings(cache, spec, weight, len(labels), sources.at(61))
    assert len(ids) == 2
    for i, m in zip(ids, mapped):
        assert np.sign(m.mean()) == (-1 if "dog" in vocab[i - 1] else 1)
