"""bench/oracle.py: the demo's oracle, each task's probability given the simulator's latent state. Its
probabilities match what the simulator then writes (calibration), and on a small demo at
bench/quality.py's test cut-off it ranks above every model: LightGBM, the history baselines and a
tiny habitus scenario."""

import calendar
import datetime as dt

import duckdb
import numpy as np
import pytest

from habitus.models.cache import Cache, build_cache
from habitus.models.data.features import DAY
from habitus.models.evaluate.holdout import headline, protocol
from habitus.models.tasks import task as task_of
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig
from habitus.models.train.foundation import train_foundation
from habitus.models.train.scenario import train_scenario
from habitus.pipelines.demo.data import generate_demo_warehouse

SEED = 7


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory, bench):
    """A demo of 3,000 customers (seed 7) and its purchases read back: (oracle module, folder, connection)."""
    folder = tmp_path_factory.mktemp("oracle")
    generate_demo_warehouse(folder / "demo.duckdb", customers=3000, products=400, stores=12, seed=SEED)
    con = duckdb.connect(str(folder / "demo.duckdb"), read_only=True)
    yield bench("oracle"), folder, con
    con.close()


def _realised(con, cutoff: int, window_days: int, brands: list[str]):
    """Every customer, whether they bought nothing in the window, and which of `brands` they bought."""
    ids = con.sql("SELECT customer_id FROM customers ORDER BY customer_id").fetchnumpy()["customer_id"].astype(str)
    bought = con.sql(f"SELECT DISTINCT customer_id, brand FROM purchases JOIN products USING (product_id) "
                     f"WHERE epoch(ts) > {cutoff} AND epoch(ts) <= {cutoff + window_days * DAY}").fetchnumpy()
    pairs = set(zip(bought["customer_id"].astype(str), bought["brand"].astype(str)))
    none = ~np.isin(ids, bought["customer_id"].astype(str))
    return ids, none, np.array([[(i, b) in pairs for b in brands] for i in ids])


@pytest.mark.parametrize("start, days", [("2026-09-20T00:00:00", 28), ("2026-05-03T13:30:00", 10)])
def test_the_oracle_expects_what_the_simulator_then_writes(warehouse, start, days):
    """Summed over the customers, the oracle's probabilities are the counts the simulator wrote inside the
    window (a midnight cut-off and one in opening hours), within four standard deviations."""
    oracle, folder, con = warehouse
    cutoff = calendar.timegm(dt.datetime.fromisoformat(start).timetuple())
    brands = [r[0] for r in con.sql("SELECT brand FROM purchases JOIN products USING (product_id) "
                                    "GROUP BY brand ORDER BY count(*) DESC, brand LIMIT 20").fetchall()]
    ids, none, bought = _realised(con, cutoff, days, brands)
    churn = oracle.demo_oracle(folder, ids, cutoff, days, "churn", seed=SEED)
    assert churn.shape == (len(ids),) and ((churn >= 0) & (churn <= 1)).all()
    assert 0.2 < none.mean() < 0.8 and abs(none.sum() - churn.sum()) < 4 * np.sqrt((churn * (1 - churn)).sum())
    p = oracle.demo_oracle(folder, ids, cutoff, days, "propensity", brands, seed=SEED)
    assert p.shape == (len(ids), len(brands))
    z = (bought.sum(axis=0) - p.sum(axis=0)) / np.sqrt((p * (1 - p)).sum(axis=0))
    assert bought.sum(axis=0).min() >= 20 and np.abs(z).max() < 4, z
    # and the probabilities rank: the customers the oracle ranks highest buy far more often
    top = p > np.quantile(p, 0.9, axis=0)
    assert bought[top].mean() > 4 * bought[~top].mean()


@pytest.mark.slow
def test_the_oracle_is_the_simulators_own_probability(warehouse):
    """The simulator's process run 300 times from one latent state (fresh generators after the latent
    draws): how often each customer buys nothing, and each brand, inside a window that starts in opening
    hours is what the oracle says: overall, customer by customer (chi-square) and brand by brand."""
    oracle = warehouse[0]
    sim = oracle.sim  # (pipelines/demo/simulation.py)
    start, n_days, reps = dt.date(2026, 3, 1), 75, 300
    (_, state, _), = sim.latent_blocks(start, n_days, 400, 300, 12, 11)
    cutoff = calendar.timegm((start + dt.timedelta(days=60)).timetuple()) + 15 * 3600
    a = cutoff - calendar.timegm(start.timetuple())
    brands = state["prod"]["brand_names"]  # every brand, every category among their primaries
    day, share = oracle.window_days_share(cutoff, 10, start, n_days)
    rows = np.arange(400)
    churn = oracle.SCORERS["churn"](state, rows, day, share)
    p = oracle.SCORERS["propensity"](state, rows, day, share, list(brands))
    none, bought = np.zeros(400), np.zeros((400, len(brands)))
    for r in range(reps):
        rows_of = sim._simulate(np.random.default_rng([SEED, r]), **state)
        inside = (rows_of["second"] > a) & (rows_of["second"] <= a + 10 * DAY)
        cust, brand = rows_of["cust"][inside], state["prod"]["brand"][rows_of["product"][inside]]
        none += np.bincount(cust, minlength=400) == 0
        for j in range(len(brands)):
            bought[np.unique(cust[brand == j]), j] += 1
    for seen, expected in ((none, churn), (bought.ravel(), p.ravel())):
        sd = np.sqrt(expected * (1 - expected) * reps)
        assert abs((seen - reps * expected).sum()) < 4 * np.sqrt((sd ** 2).sum())  # no bias overall
        # nor customer by customer: the chi-square of the cells with five expected either way (1 a cell)
        measured = (reps * expected >= 5) & (reps * (1 - expected) >= 5)
        z = (seen - reps * expected)[measured] / sd[measured]
        assert measured.sum() > 300 and np.mean(z ** 2) < 1.25, (measured.sum(), np.mean(z ** 2))
        assert (seen[expected == 0] == 0).all() and (seen[expected == 1] == reps).all()
    by_brand = (bought - reps * p).sum(axis=0) / np.sqrt((reps * p * (1 - p)).sum(axis=0))
    assert np.abs(by_brand).max() < 4, by_brand  # each brand's count over the customers (seasons move some)


def test_the_oracle_reads_the_warehouse_it_was_drawn_for(warehouse, tmp_path):
    oracle, folder, _ = warehouse
    ids = np.array(["C0000001", "C0000002"])
    with pytest.raises(ValueError, match="seed 8"):
        oracle.demo_oracle(folder, ids, 1_780_000_000, 28, "churn", seed=8)
    with pytest.raises(ValueError, match="C_NEW"):
        oracle.demo_oracle(folder, np.array(["C0000001", "C_NEW"]), 1_780_000_000, 28, "churn", seed=SEED)
    with pytest.raises(ValueError, match="not brands"):
        oracle.demo_oracle(folder, ids, 1_780_000_000, 28, "propensity", ["no such brand"], seed=SEED)
    with pytest.raises(ValueError, match="one of churn, propensity"):
        oracle.demo_oracle(folder, ids, 1_780_000_000, 28, "spend", seed=SEED)
    with pytest.raises(ValueError, match="exactly one"):
        oracle.demo_oracle(tmp_path, ids, 1_780_000_000, 28, "churn")


@pytest.mark.slow
def test_the_oracle_ranks_above_every_model_of_a_small_demo(tmp_path, bench):
    """bench/quality.py's demo (2,000 customers) at its test cut-off: the oracle's churn AUROC and propensity
    macro AUROC on the hold-out's own labels and entities beat the scenario (a tiny foundation, two
    epochs of fine-tuning, the head chosen on validation), LightGBM and the history baselines."""
    import torch

    quality, oracle = bench("quality"), bench("oracle")
    spec, test_cutoff, params = quality.demo_spec(2000, tmp_path)
    cache = Cache(build_cache(spec, tmp_path / "cache", log=lambda _: None))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fcfg = FoundationConfig(hidden=16, layers=1, epochs=1, batch_size=64, buckets=16)
        foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, device="cpu",
                                      log=lambda _: None)
        for name, task in list(quality.tasks(cache, test_cutoff, params).items())[:2]:
            plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
            cfg = ScenarioConfig(name, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                                 FinetuneConfig(epochs=2, batch_size=64), refit=False)
            report = train_scenario(cache, foundation.model.state_dict(), foundation.info, cfg, device="cpu",
                                    log=lambda _: None).report
            ids, y = oracle.holdout_labels(cache, task, plan.test_cutoff)
            assert len(ids) == report["entities"]
            labels = oracle.label_values(cache, params["label_column"], task.target.labels) if task.target.labels else None
            scores = oracle.demo_oracle(tmp_path, ids, plan.test_cutoff, task.target.window_days, name, labels)
            key = headline(task)
            best = task_of(task).metrics(y, scores)[key]
            models = {"habitus": report["model"][key], **{b: m[key] for b, m in report["baselines"].items()}}
            assert {"lightgbm", "recency" if name == "churn" else "past frequency"} <= set(models)
            assert best > 0.85 and all(best > v + 0.02 for v in models.values()), (name, best, models)
    finally:
        torch.set_num_threads(threads)

