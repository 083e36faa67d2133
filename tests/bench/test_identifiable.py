"""bench/identifiable.py: the history inputs count what happened before the cut-off and nothing after
it, the fit recovers a probability that its inputs determine, and on a small demo the churn row runs
through the real oracle, cache and LightGBM with a fit that follows the oracle."""

import calendar
import datetime as dt

import numpy as np

DAY = 86_400
CUTOFF = calendar.timegm(dt.date(2026, 3, 1).timetuple())


def test_visit_history_bins_the_weeks_before_the_cutoff_and_reads_nothing_after_it(bench):
    identifiable = bench("identifiable")
    ago = np.array([1, 2, 9, 200, 0, -3, 5])  # days before the cut-off; 0 and -3 are on or after it
    visits = dict(customer_id=np.array(["a", "a", "a", "a", "a", "a", "b"]), day=CUTOFF - ago * DAY)
    h = identifiable.visit_history(visits, np.array(["b", "a", "nobody"]), CUTOFF)
    weeks = np.expm1(h[:, :identifiable.WEEKS + 1]).round()
    assert weeks[1, 0] == 2 and weeks[1, 1] == 1 and weeks[1, identifiable.WEEKS] == 1 and weeks[1].sum() == 4
    assert weeks[0, 0] == 1 and weeks[0].sum() == 1 and weeks[2].sum() == 0
    total, first, last = np.expm1(h[:, identifiable.WEEKS + 1:]).round().T
    assert total.tolist() == [1, 4, 0] and first.tolist() == [5, 200, 0] and last[:2].tolist() == [5, 1]


def test_purchase_history_counts_each_code_and_halves_at_the_half_life(bench):
    identifiable = bench("identifiable")
    purchases = dict(customer_id=np.array(["a", "a", "a", "b"]),
                     ts=CUTOFF - np.array([60, 1, -1, 3]) * DAY,  # the third is after the cut-off
                     product=np.array([2, 0, 2, 1]), category=np.array([1, 0, 1, 0]), tier=np.array([0, 0, 0, 1]),
                     label=np.array([1, -1, 1, 0]))
    h = identifiable.purchase_history(purchases, np.array(["a", "b"]), CUTOFF, n_labels=2)
    counts = np.expm1(h)
    # blocks: product (3) x2, category (2) x2, tier (2) x2, label (2) x2, last purchase
    product, product_decayed = counts[:, 0:3], counts[:, 3:6]
    label, label_decayed = counts[:, 14:16], counts[:, 16:18]
    assert product[0].tolist() == [1, 0, 1] and product[1].tolist() == [0, 1, 0]
    assert np.isclose(product_decayed[0, 2], 0.5) and np.isclose(label_decayed[0, 1], 0.5)
    assert label[0].tolist() == [0, 1] and label[1].tolist() == [1, 0]  # a non-label brand counts nowhere
    assert np.round(counts[:, -1]).tolist() == [1, 3]


def test_the_fit_recovers_a_probability_its_inputs_determine(bench):
    identifiable = bench("identifiable")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6000, 8)).astype(np.float32)
    p = 1 / (1 + np.exp(-(1.5 * x[:, 0] - x[:, 1] * x[:, 2])))
    predict = identifiable.fit_to_oracle(x[:4000], p[:4000], x[4000:5000], p[4000:5000], epochs=20)
    fitted = predict(x[5000:])
    assert fitted.shape == (1000,)
    assert np.corrcoef(fitted, p[5000:])[0, 1] > 0.9


def test_the_churn_row_of_a_small_demo_follows_the_oracle(tmp_path, bench):
    from habitus.models.cache import Cache, build_cache
    from habitus.models.evaluate.holdout import protocol
    from habitus.models.train.config import TRAIN_CUTOFFS

    identifiable, quality = bench("identifiable"), bench("quality")  # the demo and tasks main() makes
    spec, test_cutoff, params = quality.demo_spec(3000, tmp_path, products=400)
    cache = Cache(build_cache(spec, tmp_path / "cache", log=lambda _: None))
    task = quality.tasks(cache, test_cutoff, params)["churn"]
    plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
    row = identifiable.identified("churn", tmp_path, cache, task, plan, None, draws=20)
    assert row["entities"] > 200
    assert row["corr"] > 0.5  # the fit follows the oracle, from the history alone
    assert row["oracle"] > row["hand"] > 0.6
    assert row["lo"] <= row["diff"] <= row["hi"]
