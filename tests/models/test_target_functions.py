"""User-defined targets: a Python function over (history, future window, entity attributes), named in
the config as `target: {function: "package.module:func"}`; values checked by hand."""

import textwrap

import numpy as np

import pytest

from habitus.models.cache import TableInput
from habitus.models.data.features import DAY, chunk_at
from habitus.models.data.target_functions import resolve
from habitus.models.data.targets import TargetSpec, compute_target
from habitus.pipelines.config.project import FunctionTarget, Scenario

CUT_DAY = 40
WINDOW = 10

MODULE = '''
import numpy as np
import pyarrow.compute as pc

def big_future_spender(history, future, entities):
    """1 when the future window's spend beats the entity's whole past spend, for gold customers only."""
    n = entities.num_rows
    past = np.bincount(history["row"].to_numpy(), history["price"].to_numpy(), minlength=n)
    ahead = np.bincount(future["row"].to_numpy(), future["price"].to_numpy(), minlength=n)
    gold = pc.equal(entities["segment"], "gold").to_numpy(zero_copy_only=False)
    return ((ahead > past) & gold).astype(float)

def p2_bought(history, future, entities):
    return [float(v) for v in np.bincount(future["row"].to_numpy()[
        pc.equal(future["product_id"], "p2").to_numpy(zero_copy_only=False)], minlength=entities.num_rows)]

def wrong_length(history, future, entities):
    return [1.0]

def broken(history, future, entities):
    raise KeyError("no_such_column")

def first_product(history, future, entities):
    """Each entity's first product in the window, or None."""
    first = {}
    for row, product in zip(future["row"].to_pylist(), future["product_id"].to_pylist()):
        first.setdefault(row, product)
    return [first.get(i) for i in range(entities.num_rows)]

def products(history, future, entities):
    out = [[] for _ in range(entities.num_rows)]
    for row, product in zip(future["row"].to_pylist(), future["product_id"].to_pylist()):
        out[row].append(product)
    return out
'''


@pytest.fixture
def world(sources, monkeypatch):
    (sources.root / "my_targets_mod.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(sources.root))
    resolve.cache_clear()
    # a: past spend 10, future 30 (gold); b: past 50, future 20 (gold); c: past 5, future 100 (silver)
    events = sources.write_events(
        "e", ["a", "a", "b", "c", "a", "b", "c", "c"],
        [sources.at(d) for d in (5, 30, 20, 35, CUT_DAY + 1, CUT_DAY + 3, CUT_DAY + 9, CUT_DAY + WINDOW + 1)],
        ["p1", "p1", "p1", "p1", "p2", "p2", "p1", "p2"], [4.0, 6.0, 50.0, 5.0, 30.0, 20.0, 100.0, 7.0])
    customers = TableInput("customers", [sources.write("customers", customer_id=["a", "b", "c"],
                                                       segment=["gold", "gold", "silver"])],
                           {"customer_id": "categorical", "segment": "categorical"})
    cache = sources.build(sources.events(events), [customers])
    shard = cache.shard(0)
    chunk = chunk_at(shard, 0, len(shard.entities), sources.at(CUT_DAY))
    names = cache.entity_ids(chunk.entities).to_pylist()
    return cache, chunk, names


def _target(func: str) -> TargetSpec:
    return TargetSpec("function", WINDOW, function=f"my_targets_mod:{func}", scenario="vip")


def test_function_target_sees_history_future_and_attributes(world):
    cache, chunk, names = world
    y = compute_target(chunk, _target("big_future_spender"), cache=cache)
    assert dict(zip(names, y.tolist())) == {"a": 1.0, "b": 0.0, "c": 0.0}  # c's 100 is silver; b spent less
    # categories arrive as their original text; c's p2 lies past the window
    y = compute_target(chunk, _target("p2_bought"), cache=cache)
    assert dict(zip(names, y.tolist())) == {"a": 1.0, "b": 1.0, "c": 0.0}


def test_function_target_window_is_the_one_declared(world):
    cache, chunk, names = world
    wider = TargetSpec("function", WINDOW + 1, function="my_targets_mod:p2_bought", scenario="vip")
    assert dict(zip(names, compute_target(chunk, wider, cache=cache).tolist()))["c"] == 1.0
    assert chunk.cutoff + WINDOW * DAY < cache.time_range[1]


@pytest.mark.parametrize("ref, message", [
    ("my_targets_mod:wrong_length", "returned 1 values for 3 entities"),
    ("my_targets_mod:broken", "raised KeyError"),
    ("my_targets_mod:nothing_here", "has no function 'nothing_here'"),
    ("no_such_package_xyz.mod:f", "cannot import module 'no_such_package_xyz.mod'"),
    ("not a reference", "package.module:function"),
])
def test_function_target_errors_name_the_scenario_and_the_function(world, ref, message):
    cache, chunk, _ = world
    with pytest.raises(ValueError) as err:
        compute_target(chunk, TargetSpec("function", WINDOW, function=ref, scenario="vip"), cache=cache)
    assert "scenario 'vip'" in str(err.value) and repr(ref) in str(err.value) and message in str(err.value)


def test_function_targets_of_label_tasks_return_values_of_their_column(world):
    """multiclass: one value per entity (None: not eligible); multilabel and recommendation: lists.
    Values that are not labels are dropped."""
    from habitus.models.tasks import task

    cache, chunk, names = world
    vocab = cache.vocab("product_id").column("value").to_pylist()
    labels = (vocab.index("p2") + 1, vocab.index("p1") + 1)  # positions: p2 -> 0, p1 -> 1
    one = TargetSpec("function", WINDOW, "product_id", labels, function="my_targets_mod:first_product", scenario="x")
    keep, y = task("multiclass").labels(chunk, one, cache)
    # a: p2 first; b: p2; c: p1 (its p2 lies past the window)
    assert dict(zip(np.asarray(names)[keep], y.tolist())) == {"a": 0, "b": 0, "c": 1}
    many = TargetSpec("function", WINDOW, "product_id", labels, function="my_targets_mod:products", scenario="x")
    for name in ("multilabel", "recommendation"):
        keep, y = task(name).labels(chunk, many, cache)
        assert dict(zip(names, y.dense().tolist())) == {"a": [1.0, 0.0], "b": [1.0, 0.0], "c": [0.0, 1.0]}
    only_p1 = TargetSpec("function", WINDOW, "product_id", labels[1:], function="my_targets_mod:first_product",
                         scenario="x")
    keep, y = task("multiclass").labels(chunk, only_p1, cache)
    assert np.asarray(names)[keep].tolist() == ["c"] and y.tolist() == [0]


def test_config_accepts_function_targets_for_every_task():
    for task in ("binary", "regression", "multilabel", "multiclass", "recommendation"):
        sc = Scenario(task=task, target={"function": "my_pkg.targets:high_value", "within": "28d", "by": "brand"})
        assert isinstance(sc.target, FunctionTarget) and sc.target.within == 28 and sc.target.top == 50
    with pytest.raises(ValueError, match="pattern"):
        Scenario(task="binary", target={"function": "my_pkg.targets.high_value", "within": "28d"})
