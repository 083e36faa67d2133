"""The demo's oracle: each task's best possible score, from the simulator's own latent state.

The demo warehouse (pipelines/demo/data.py) is drawn from a behavioural model
(pipelines/demo/simulation.py): every customer has a churn day, a visit rate, category and price-tier
tastes, favourite brands and staple products, fixed before the first visit. Given that state, visits
are independent Poisson draws per day and the items of a basket independent draws per item, so what
happens after a cut-off does not depend on what happened before it. The probability of a window's
outcome given the latent state is then the best score any model of the events can reach (in
expectation): the ceiling the demo rows are measured against.

    demo_oracle(folder, entity_ids, cutoff, window_days, "churn")                 # [n] P(no purchase)
    demo_oracle(folder, entity_ids, cutoff, window_days, "propensity", brands)   # [n, labels] P(buys the brand)

    python bench/oracle.py [--customers 20000]   # the oracle beside LightGBM on bench/quality.py's demo

Both are closed forms of the simulator's process over the window (cutoff, cutoff + window_days]:
- churn: visits on day d are Poisson(rate_d), rate_d = weekly / 7 x the calendar's day factor x the
  slowdown before the churn day (0 from the churn day on), times the share of the day's opening hours
  inside the window; a customer who signs up inside it makes a first visit at the till with
  probability 0.7. P(no purchase) = exp(-sum of rates) x (1 - 0.7 x that share).
- propensity: an item is a staple (its brand from the customer's staples, weighted as the simulator
  picks them) or drawn from the category tastes x the day's seasonality, then a favourite brand's
  product (brand loyalty) or a product of the preferred tier (by product popularity). With q_d the
  chance an item is of the brand, a visit misses it with probability E_store[(1 - q_d)(1 - p q_d)^7]
  (1 + Binomial(7, p) items, p from the basket propensity and the store's format); the days' visits
  thin the Poisson rates as above.

The latent state is regenerated from the seed (pipelines/demo/simulation.py latent_blocks, the draws that precede
any visit, so nothing after the cut-off is read), with the sizes and dates of the warehouse, and
checked against its customers table. The formulas mirror pipelines/demo/simulation.py's _simulate_visits,
_ProductChooser.choose and _simulate; tests/bench/test_oracle.py checks they agree with the tables
the simulator writes (calibration) and that the oracle ranks above every model on a small demo.
"""

import argparse
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

from habitus.pipelines.demo import simulation as sim

DAY = 86_400
FIRST_VISIT = 0.7  # the share of sign-ups during the period who make a first visit that day (_simulate_visits)
STORE_CHOICE = (0.8, 0.17, 0.03)  # home store, another of the region (by pull), any store (_simulate)
CHUNK = 4096  # customers scored at a time (propensity: [chunk, days, labels] arrays)


def demo_oracle(warehouse_folder: Path, entity_ids: np.ndarray, cutoff: int, window_days: int, task: str,
                labels: list | None = None, seed: int = 0) -> np.ndarray:
    """The oracle's scores of `entity_ids` (customer ids of the demo warehouse in `warehouse_folder`, a
    folder holding one DuckDB file or the file itself) for the window (cutoff, cutoff + window_days
    days], `cutoff` in unix seconds. `task`: "churn" -> [n] P(no purchase in the window); "propensity"
    -> [n, len(labels)] P(at least one item of each label), `labels` brand names as in the products
    table (label_values maps a cache's label ids to them). `seed`: the seed the warehouse was
    generated with."""
    if task not in SCORERS:
        raise ValueError(f"oracle task {task!r}: one of {', '.join(SCORERS)}")
    if task == "propensity" and not labels:
        raise ValueError("the propensity oracle needs `labels`: brand names of the demo's products table")
    settings, blocks = latent_state(warehouse_folder, seed)
    day, share = window_days_share(cutoff, window_days, settings["start"], settings["n_days"])
    ids = np.asarray(entity_ids).astype(str)
    out = np.full((len(ids),) + (() if task == "churn" else (len(labels),)), np.nan)
    for first, state in blocks:
        known = np.char.add("C", np.char.zfill(np.arange(first + 1, first + 1 + state["cust"]["n"]).astype(str), 7))
        pos = np.searchsorted(known, ids).clip(0, len(known) - 1)
        mine = np.flatnonzero(known[pos] == ids)
        for lo in range(0, len(mine), CHUNK):
            rows = mine[lo:lo + CHUNK]
            out[rows] = SCORERS[task](state, pos[rows], day, share, labels)
    missing = np.isnan(out.reshape(len(ids), -1)).any(axis=1)
    if missing.any():
        raise ValueError(f"{missing.sum()} entity id(s) such as {ids[missing][:3].tolist()} are not customers "
                         f"the demo simulator drew for {settings['db']}: the oracle scores generated customers only")
    return out


def latent_state(warehouse_folder: Path, seed: int = 0) -> tuple[dict, list[tuple[int, dict]]]:
    """(the warehouse's settings, its blocks of latent state as simulation.latent_blocks gives them),
    regenerated with the warehouse's sizes and dates and checked against its customers table."""
    import duckdb

    db = _database(Path(warehouse_folder))
    con = duckdb.connect(str(db), read_only=True)
    try:
        first, last = con.sql("SELECT min(ts)::DATE, max(ts)::DATE FROM purchases").fetchall()[0]
        sizes = [con.sql(f"SELECT count(*) FROM {t}").fetchall()[0][0] for t in ("customers", "products", "stores")]
        stored = con.sql("SELECT customer_id, age, region, signup_date, segment FROM customers "
                         "ORDER BY customer_id").fetchnumpy()
    finally:
        con.close()
    settings = dict(db=db, start=first, n_days=(last - first).days + 1, customers=sizes[0], products=sizes[1],
                    stores=sizes[2], seed=seed)
    blocks = [(f, state) for f, state, _ in sim.latent_blocks(first, settings["n_days"], *sizes, seed)]
    drawn = {k: np.concatenate([v(s["cust"]) for _, s in blocks]) for k, v in (
        ("age", lambda c: c["age"]), ("region", lambda c: sim.REGIONS[c["region"]]),
        ("segment", lambda c: sim.SEGMENTS[c["segment"]]),
        ("signup_date", lambda c: np.datetime64(first, "D") + c["signup"]))}
    same = (len(stored["age"]) == len(drawn["age"]) and all(
        np.array_equal(np.asarray(stored[k]).astype(v.dtype), v) for k, v in drawn.items()))
    if not same:
        raise ValueError(f"{db}: its customers are not those the demo simulator draws with seed {seed} for "
                         f"{sizes[0]} customers, {sizes[1]} products and {sizes[2]} stores from {first} to {last}; "
                         "the oracle needs a warehouse written by `habitus demo-data` as it was (pass its seed)")
    return settings, blocks


def window_days_share(cutoff: int, window_days: int, start: date, n_days: int) -> tuple[np.ndarray, np.ndarray]:
    """The simulated days the window (cutoff, cutoff + window_days days] touches and the share of each
    day's visits inside it (visits fall in opening hours, HOUR_WEIGHT, at a uniform second of the hour)."""
    origin = (start - date(1970, 1, 1)).days * DAY
    a, b = cutoff - origin, cutoff - origin + window_days * DAY
    day = np.arange(max(a // DAY, 0), min(b // DAY, n_days - 1) + 1)
    hour_start = (sim.SHOP_OPEN + np.arange(len(sim.HOUR_WEIGHT))) * 3600
    weight = sim.HOUR_WEIGHT / sim.HOUR_WEIGHT.sum()

    def at_or_before(second):  # P(a visit's second of the day <= second)
        return (weight * np.clip(second[:, None] - hour_start + 1, 0, 3600) / 3600).sum(axis=1)

    return day, at_or_before(b - day * DAY) - at_or_before(a - day * DAY)


def _visit_rates(cust: dict, c: np.ndarray, day: np.ndarray, day_factor: np.ndarray) -> np.ndarray:
    """[customers, days] expected visits inside the window: _simulate_visits' Poisson rates."""
    to_churn = cust["churn_day"][c, None] - day
    slowdown = 0.2 + 0.8 * np.clip(to_churn / sim.SLOWDOWN_DAYS, 0.0, 1.0)
    active = (cust["first_day"][c, None] <= day) & (to_churn > 0)
    return cust["weekly"][c, None] / 7 * day_factor[day] * slowdown * active


def _signup_visit(cust: dict, c: np.ndarray, day: np.ndarray, share: np.ndarray) -> np.ndarray:
    """[customers, days] the probability of the first visit at the till on each day of the window."""
    return FIRST_VISIT * (cust["new"][c, None] & (cust["signup"][c, None] == day)) * share


def _churn(state: dict, c: np.ndarray, day: np.ndarray, share: np.ndarray, labels=None) -> np.ndarray:
    """P(no purchase in the window) of the block's customers `c`."""
    cust = state["cust"]
    rate = _visit_rates(cust, c, day, state["day_factor"]) * share
    return np.exp(-rate.sum(axis=1)) * np.prod(1 - _signup_visit(cust, c, day, share), axis=1)


def _propensity(state: dict, c: np.ndarray, day: np.ndarray, share: np.ndarray, labels) -> np.ndarray:
    """P(at least one item of each label's brand in the window) of the block's customers `c`."""
    cust, prod, stores = state["cust"], state["prod"], state["stores"]
    brand = _brand_ids(prod, labels)
    q = _item_brand(state, c, day, brand)  # [c, days, labels]
    fmt = _store_formats(cust, c, stores)  # [c, formats]
    p = np.clip(cust["basket_p"][c, None] * sim.FORMAT_BASKET[None, :], 0.01, 0.99)  # [c, formats]
    miss = sum(fmt[:, f, None, None] * (1 - q) * (1 - p[:, f, None, None] * q) ** 7 for f in range(len(sim.FORMATS)))
    rate = (_visit_rates(cust, c, day, state["day_factor"]) * share)[:, :, None]
    first = _signup_visit(cust, c, day, share)[:, :, None]
    return 1 - np.exp(-(rate * (1 - miss)).sum(axis=1)) * np.prod(1 - first * (1 - miss), axis=1)


def _brand_ids(prod: dict, labels) -> np.ndarray:
    index = {name: i for i, name in enumerate(prod["brand_names"].tolist())}
    unknown = [v for v in labels if str(v) not in index]
    if unknown:
        raise ValueError(f"propensity labels {unknown[:3]} are not brands of the demo's products table")
    return np.array([index[str(v)] for v in labels], np.int64)


def _item_brand(state: dict, c: np.ndarray, day: np.ndarray, brand: np.ndarray) -> np.ndarray:
    """[customers, days, labels] P(one basket item is of the brand): a staple, or a category from the
    tastes x season, then a favourite brand's product (brand loyalty) or one of the preferred tier."""
    cust, prod, chooser = state["cust"], state["prod"], state["chooser"]
    n_cat, n_brands = prod["n_cat"], prod["n_brands"]
    is_label = prod["brand"][:, None] == brand[None, :]  # [products, labels]
    by_tier = np.zeros((n_cat, len(sim.TIERS), len(brand)))  # P(label | category, tier), by popularity
    for k in range(n_cat):
        in_cat = prod["category"] == k
        for t in range(len(sim.TIERS)):
            pool = in_cat & (prod["tier"] == t) if (in_cat & (prod["tier"] == t)).any() else in_cat
            by_tier[k, t] = prod["popularity"][pool] @ is_label[pool] / prod["popularity"][pool].sum()
    # favourites: the first favourite of the category, its brand, taken with probability brand_loyalty
    fav_cat = chooser.fav_cat[c]
    fav_brand = np.unique(prod["category"] * n_brands + prod["brand"])[chooser.fav_group[c]] % n_brands
    match = fav_cat[:, None, :] == np.arange(n_cat)[None, :, None]  # [c, categories, favourites]
    loyal = cust["brand_loyalty"][c, None] * match.any(axis=2)  # [c, categories]
    fav_of_cat = np.take_along_axis(fav_brand, match.argmax(axis=2), axis=1)  # [c, categories]
    per_cat = ((1 - loyal)[:, :, None] * np.einsum("nt,ktb->nkb", cust["tier_pref"][c], by_tier)
               + loyal[:, :, None] * (fav_of_cat[:, :, None] == brand[None, None, :]))
    taste = cust["cat_pref"][c][:, :, None] * state["season"][None, :n_cat, day]  # [c, categories, days]
    taste /= taste.sum(axis=1, keepdims=True)
    drawn = np.einsum("nkd,nkb->ndb", taste, per_cat)
    # staples: slot j of the customer's n_staples is picked with P = ((j+1)/n)^(2/3) - (j/n)^(2/3)
    slots = np.arange(sim.MAX_STAPLES)[None, :]
    n = cust["n_staples"][c, None]
    w = (np.minimum(slots + 1, n) / n) ** (2 / 3) - (np.minimum(slots, n) / n) ** (2 / 3)
    staple = np.einsum("nj,njb->nb", w, prod["brand"][cust["staples"][c]][:, :, None] == brand[None, None, :])
    s = cust["staple_rate"][c, None, None]
    return s * staple[:, None, :] + (1 - s) * drawn


def _store_formats(cust: dict, c: np.ndarray, stores: dict) -> np.ndarray:
    """[customers, formats] P(a visit's store has each format): the home store, another of the region
    by store pull, or any store."""
    n_formats = len(sim.FORMATS)
    onehot = np.eye(n_formats)[stores["format"]]  # [stores, formats]
    pull = sim.FORMAT_PULL[stores["format"]]
    in_region = np.stack([(stores["region"] == r) * pull for r in range(stores["n_regions"])])
    by_region = in_region @ onehot / in_region.sum(axis=1, keepdims=True)  # [regions, formats]
    home, region, anywhere = STORE_CHOICE
    return home * onehot[cust["home_store"][c]] + region * by_region[cust["region"][c]] + anywhere * onehot.mean(axis=0)


def label_values(cache, column: str, ids) -> list[str]:
    """A cache's vocabulary ids of `column` (bench/quality.py's propensity labels) -> the values."""
    vocab = cache.vocab(column).to_pydict()
    value = dict(zip(vocab["id"], vocab["value"]))
    return [str(value[int(i)]) for i in ids]


def _database(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.glob("*.duckdb")) if path.is_dir() else []
    if len(found) != 1:
        raise ValueError(f"{path}: expected a demo warehouse's DuckDB file or a folder holding exactly one "
                         f"(found {len(found)}); write one with `habitus demo-data --out {path}/demo.duckdb`")
    return found[0]


SCORERS = {"churn": _churn, "propensity": _propensity}


def holdout_labels(cache, task, cutoff: int) -> tuple[np.ndarray, np.ndarray]:
    """The entity ids and labels the hold-out scores at `cutoff`, in evaluate's order."""
    from habitus.models.data.chunks import CHUNK_ENTITIES, chunk_plan
    from habitus.models.data.features import chunk_at
    from habitus.models.tasks import task as task_of

    ids, ys = [], []
    for s, lo, hi in chunk_plan(cache, CHUNK_ENTITIES):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n:
            keep, y = task_of(task).labels(chunk, task.target, cache)
            ids.append(np.asarray(cache.entity_ids(chunk.entities[keep])).astype(str))
            ys.append(y.dense(0) if hasattr(y, "dense") else np.asarray(y))
    return np.concatenate(ids), np.concatenate(ys)


def paired_interval(y: np.ndarray, a: np.ndarray, b: np.ndarray, metric, draws: int = 200, seed: int = 0):
    """metric(y, a) - metric(y, b) and its 95% interval over an entity bootstrap (both on the same draws)."""
    rng = np.random.default_rng(seed)
    diffs = []
    for _ in range(draws):
        i = rng.integers(0, len(y), len(y))
        diffs.append(metric(y[i], a[i]) - metric(y[i], b[i]))
    return metric(y, a) - metric(y, b), np.percentile(diffs, 2.5), np.percentile(diffs, 97.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--customers", type=int, default=20_000, help="demo size (bench/quality.py's --customers)")
    parser.add_argument("--draws", type=int, default=200, help="bootstrap draws of the intervals")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quality import demo_spec, tasks

    from habitus.models.cache import Cache, build_cache
    from habitus.models.data.features import FeatureSpec
    from habitus.models.evaluate.baselines import lightgbm_scores
    from habitus.models.evaluate.holdout import headline, protocol
    from habitus.models.tasks import task as task_of
    from habitus.models.train.config import TRAIN_CUTOFFS

    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, params = demo_spec(args.customers, Path(tmp))
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=lambda _: None))
        print(f"demo, {args.customers:,} customers, test cut-off {np.datetime64(test_cutoff, 's')}, "
              f"window {params['window']} days; 95% intervals over {args.draws} entity bootstrap draws")
        for name, task in list(tasks(cache, test_cutoff, params).items())[:2]:
            plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
            ids, y = holdout_labels(cache, task, plan.test_cutoff)
            labels = label_values(cache, params["label_column"], task.target.labels) if task.target.labels else None
            best = demo_oracle(Path(tmp), ids, plan.test_cutoff, task.target.window_days, name, labels)
            lgb = lightgbm_scores(cache, FeatureSpec.from_cache(cache), task, plan.train_cutoffs, plan.val_cutoff,
                                  plan.test_cutoff)
            key = headline(task)
            metric = lambda y, s: task_of(task).metrics(y, s)[key]  # noqa: E731
            diff, lo, hi = paired_interval(y, best, lgb, metric, args.draws)
            print(f"{name:<11} {key:<12} {len(ids):>7,} entities  oracle {metric(y, best):.4f}  lightgbm "
                  f"{metric(y, lgb):.4f}  oracle - lightgbm {diff:+.4f} [{lo:+.4f}, {hi:+.4f}]", flush=True)


if __name__ == "__main__":
    main()
