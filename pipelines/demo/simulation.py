"""The demo retail warehouse's behavioural model: customers, products, stores and purchases as
Arrow tables (pipelines/demo/data.py writes them to DuckDB).

The data trains the demo scenarios (churn, brand propensity, future spend, next products), so it
is simulated from a small behavioural model rather than drawn at random:

- every customer has latent, fixed tastes: a concentrated Dirichlet over categories, a few
  favourite brands, a price-tier preference tied to segment, and a personal set of "staple"
  products bought again and again;
- visits are a Poisson process per customer and day: lognormal base rates (a few heavy shoppers,
  many occasional ones), busier weekends, a payday bump, a mild upward trend;
- each customer has a churn time drawn from a hazard that depends on segment, age, engagement and
  tenure; visits thin out over the eight weeks before it and stop after it;
- customers sign up over time (60% before `start`, the rest during the period) and shop mostly in
  a home store of their own region.

Everything is vectorized numpy (the only Python loops run over days, categories or tiers), so the
default size (20k customers, ~1.1M purchase rows) takes a few seconds. Same seed, same tables.
"""

from __future__ import annotations

from datetime import date
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

REGIONS = np.array(["north", "south", "east", "west", "central", "coast", "mountain", "lakes"])
REGION_WEIGHT = np.array([0.18, 0.16, 0.15, 0.14, 0.13, 0.10, 0.07, 0.07])

SEGMENTS = np.array(["value", "regular", "premium", "family"])
SEGMENT_WEIGHT = np.array([0.30, 0.35, 0.15, 0.20])
VALUE, REGULAR, PREMIUM, FAMILY = range(4)

TIERS = np.array(["budget", "mid", "premium"])
TIER_PRICE = np.array([0.6, 1.0, 1.8])

FORMATS = np.array(["hypermarket", "supermarket", "convenience"])
FORMAT_WEIGHT = np.array([0.2, 0.5, 0.3])
FORMAT_PULL = np.array([3.0, 2.0, 1.0])  # how strongly a store of that format attracts visits
FORMAT_BASKET = np.array([1.3, 1.0, 0.6])  # bigger shops, bigger baskets

# name, base popularity, typical price, seasonal amplitude, day of year of the seasonal peak
CATEGORIES = [
    ("dairy", 1.6, 2.5, 0.0, 0), ("bakery", 1.4, 2.5, 0.0, 0), ("produce", 1.8, 2.0, 0.1, 200),
    ("meat & fish", 1.2, 7.0, 0.1, 190), ("frozen", 0.8, 4.0, 0.3, 200), ("beverages", 1.3, 2.5, 0.3, 195),
    ("snacks", 1.1, 2.5, 0.0, 0), ("breakfast", 0.8, 3.5, 0.0, 0), ("pantry", 1.3, 3.0, 0.0, 0),
    ("baby", 0.35, 6.0, 0.0, 0), ("pet", 0.45, 6.0, 0.0, 0), ("household", 0.9, 4.0, 0.0, 0),
    ("personal care", 0.7, 4.0, 0.0, 0), ("health", 0.4, 7.0, 0.2, 300), ("beauty", 0.4, 9.0, 0.0, 0),
    ("alcohol", 0.6, 10.0, 0.15, 200), ("garden", 0.25, 12.0, 0.6, 140), ("toys", 0.25, 15.0, 0.3, 300),
    ("electronics", 0.2, 30.0, 0.0, 0), ("clothing", 0.3, 20.0, 0.2, 250),
]
# Segments tilt category tastes: families buy baby food and toys, premium shoppers wine and beauty.
SEGMENT_TILT = {
    VALUE: {"pantry": 1.5, "household": 1.3, "alcohol": 0.7, "beauty": 0.6},
    PREMIUM: {"alcohol": 2.0, "beauty": 2.0, "produce": 1.3, "electronics": 1.5},
    FAMILY: {"baby": 4.0, "toys": 3.0, "snacks": 1.5, "breakfast": 1.5, "alcohol": 0.5},
}

_SYLLABLE_A = np.array(["Nor", "Sun", "Blue", "Green", "Gold", "Silver", "Oak", "River",
                        "Star", "Maple", "Red", "North", "Bright", "Pure", "Wild", "Crest"])
_SYLLABLE_B = np.array(["vale", "brook", "field", "wood", "stone", "leaf", "bay", "ridge",
                        "farm", "well", "crest", "mill", "gate", "land", "peak", "shore"])

SHOP_OPEN = 8  # shops open 08:00-22:00, one weight per opening hour
# Visits by hour: a late-morning bump and a bigger after-work peak.
HOUR_WEIGHT = np.array([2, 4, 6, 7, 6, 5, 5, 6, 8, 10, 9, 6, 4, 2], dtype=float)
WEEKDAY_FACTOR = np.array([0.85, 0.85, 0.9, 0.95, 1.15, 1.45, 1.1])  # Monday .. Sunday

N_FAVOURITE_BRANDS = 3
MAX_STAPLES = 15
SLOWDOWN_DAYS = 56  # visits thin out over the last eight weeks before churn
WEEKLY_VISITS = 0.53  # median base visit rate; calibrated for ~55 purchase rows per customer


class _GroupSampler:
    """Draws, for many rows at once, one member of a given group with probability ∝ its weight.

    Members are sorted by group and their weights cumulated once; a draw is then a searchsorted
    into that group's slice of the cumulative sum, so no per-row Python work is needed.
    """

    def __init__(self, group_of: np.ndarray, weight: np.ndarray, n_groups: int):
        self.order = np.argsort(group_of, kind="stable")
        cum = np.concatenate([[0.0], np.cumsum(weight[self.order])])
        self.cum = cum[1:]
        self.counts = np.bincount(group_of, minlength=n_groups)
        self.end = np.cumsum(self.counts)
        self.start = self.end - self.counts
        self.lo, self.hi = cum[self.start], cum[self.end]

    def sample(self, group: np.ndarray, u: np.ndarray) -> np.ndarray:
        target = self.lo[group] + u * (self.hi[group] - self.lo[group])
        pos = np.searchsorted(self.cum, target, side="right")
        return self.order[np.clip(pos, self.start[group], self.end[group] - 1)]


def _sample_columns(probs_of, n_cols: int, u: np.ndarray) -> np.ndarray:
    """Per-row categorical draw where `probs_of(k)` gives column k's unnormalized weight per row.

    Loops over the (few) columns instead of materializing a rows x columns matrix.
    """
    total = np.zeros(len(u))
    for k in range(n_cols):
        total += probs_of(k)
    target, acc = u * total, np.zeros(len(u))
    choice = np.zeros(len(u), dtype=np.int64)
    for k in range(n_cols - 1):
        acc += probs_of(k)
        choice += target >= acc
    return choice


def _ids(prefix: str, n: int, width: int, first: int = 1) -> pa.Array:
    return pa.array(np.char.add(prefix, np.char.zfill(np.arange(first, first + n).astype(str), width)))


def _labels(names: np.ndarray, codes: np.ndarray) -> pa.Array:
    return pc.take(pa.array(names), pa.array(codes))


def _make_stores(rng, n_stores):
    n_regions = min(len(REGIONS), n_stores)
    weight = REGION_WEIGHT[:n_regions] / REGION_WEIGHT[:n_regions].sum()
    # The first stores cover every region once so each customer has a home region with a store.
    region = np.concatenate([np.arange(n_regions), rng.choice(n_regions, n_stores - n_regions, p=weight)])
    fmt = rng.choice(len(FORMATS), n_stores, p=FORMAT_WEIGHT)
    return dict(region=region, format=fmt, n_regions=n_regions, region_weight=weight)


def _make_products(rng, n_products):
    n_cat = max(1, min(len(CATEGORIES), n_products // len(TIERS)))
    # Brands: each has a primary category (round robin, so every category has brands) and 40% a
    # second one.
    n_brands = int(np.clip(n_products // 10, n_cat, 200))
    brand_pop = rng.lognormal(0.0, 1.0, n_brands)
    primary = np.arange(n_brands) % n_cat
    sells = np.zeros((n_cat, n_brands), dtype=bool)
    sells[primary, np.arange(n_brands)] = True
    second = rng.random(n_brands) < 0.4
    sells[rng.integers(0, n_cat, n_brands)[second], np.arange(n_brands)[second]] = True

    # The first products cover every (category, tier) pair, the next give every brand one product
    # in its primary category, the rest follow category popularity.
    n_cover = min(n_products, n_cat * len(TIERS))
    n_seed = min(n_products - n_cover, n_brands)
    n_rest = n_products - n_cover - n_seed
    cat_pop = np.array([c[1] for c in CATEGORIES[:n_cat]])
    category = np.concatenate([np.arange(n_cover) // len(TIERS), primary[:n_seed],
                               rng.choice(n_cat, n_rest, p=cat_pop / cat_pop.sum())])
    tier = np.concatenate([np.arange(n_cover) % len(TIERS),
                           rng.choice(len(TIERS), n_seed + n_rest, p=[0.35, 0.45, 0.2])])
    # Other products pick a brand among those selling in their category, popular brands more often.
    brand = np.zeros(n_products, dtype=np.int64)
    for k in range(n_cat):
        in_cat = np.flatnonzero(category == k)
        w = brand_pop * sells[k]
        brand[in_cat] = rng.choice(n_brands, len(in_cat), p=w / w.sum())
    brand[n_cover:n_cover + n_seed] = np.arange(n_seed)
    names = np.char.add(_SYLLABLE_A[:, None], _SYLLABLE_B[None, :]).ravel()
    brand_names = names[rng.permutation(len(names))[:n_brands]]  # 256 names >= 200 brands

    cat_price = np.array([c[2] for c in CATEGORIES[:n_cat]])
    price = cat_price[category] * TIER_PRICE[tier] * rng.lognormal(0.0, 0.25, n_products)
    price = np.maximum(np.round(price, 2), 0.29)
    popularity = rng.lognormal(0.0, 1.2, n_products)  # a few hits, a long tail
    return dict(category=category, tier=tier, brand=brand, brand_names=brand_names, price=price,
                popularity=popularity, n_cat=n_cat, n_brands=n_brands)


def _make_customers(rng, n, n_days, stores, prod):
    n_cat = prod["n_cat"]
    # Signup: 60% before the period (up to three years back), the rest arrive during it at a
    # slowly rising rate. Ids follow signup order, as a real sequence would.
    new = rng.random(n) < 0.4
    signup = np.where(new, np.floor(n_days * rng.random(n) ** 0.85), -rng.integers(1, 3 * 365, n))
    signup = np.sort(signup.astype(np.int64))
    new = signup >= 0

    segment = rng.choice(len(SEGMENTS), n, p=SEGMENT_WEIGHT)
    age_mean = np.array([38.0, 45.0, 50.0, 38.0])[segment]
    age_sd = np.array([14.0, 15.0, 12.0, 8.0])[segment]
    age = np.clip(np.round(rng.normal(age_mean, age_sd)), 18, 90).astype(np.int32)
    region = rng.choice(stores["n_regions"], n, p=stores["region_weight"])

    # Category tastes: a concentrated Dirichlet (total concentration ~3), tilted by segment.
    names = [c[0] for c in CATEGORIES[:n_cat]]
    alpha = np.tile(np.array([c[1] for c in CATEGORIES[:n_cat]]), (len(SEGMENTS), 1))
    for seg, tilt in SEGMENT_TILT.items():
        for name, factor in tilt.items():
            if name in names:
                alpha[seg, names.index(name)] *= factor
    alpha *= 3.0 / alpha.sum(axis=1, keepdims=True)
    cat_pref = rng.gamma(alpha[segment]) + 1e-9
    cat_pref /= cat_pref.sum(axis=1, keepdims=True)

    # Price sensitivity drives the tier preference; segment shifts it (value -> budget, premium -> premium).
    sens_a = np.array([5.0, 3.0, 1.5, 4.0])[segment]
    sens_b = np.array([2.0, 3.0, 5.0, 3.0])[segment]
    sensitivity = rng.beta(sens_a, sens_b)
    logits = np.stack([2.5 * sensitivity, np.full(n, 0.8), 2.5 * (1 - sensitivity) - 0.8], axis=1)
    logits[:, 2] += np.where(segment == PREMIUM, 0.8, 0.0)
    tier_pref = np.exp(logits)
    tier_pref /= tier_pref.sum(axis=1, keepdims=True)

    # Engagement: lognormal weekly visit rates, so a few heavy shoppers and many occasional ones.
    seg_rate = np.array([0.9, 1.0, 1.1, 1.2])[segment]
    weekly = WEEKLY_VISITS * seg_rate * rng.lognormal(0.0, 0.75, n)

    # Churn hazard per day: value shoppers, the young, the disengaged and new sign-ups leave sooner.
    hazard = (1 / 500) * np.array([1.4, 1.0, 0.6, 0.75])[segment]
    hazard *= np.where(age < 30, 1.4, np.where(age >= 60, 0.8, 1.0))
    hazard *= np.clip((weekly / np.median(weekly)) ** -0.5, 0.4, 3.0)
    hazard *= np.where(new, 1.5, 1.0)
    first_day = np.maximum(signup, 0)
    churn_day = first_day + rng.exponential(1 / hazard)

    # A home store in the customer's own region, chosen by store pull (hypermarkets draw more).
    store_sampler = _GroupSampler(stores["region"], FORMAT_PULL[stores["format"]], stores["n_regions"])
    home_store = store_sampler.sample(region, rng.random(n))

    return dict(
        n=n, signup=signup, new=new, segment=segment, age=age, region=region, cat_pref=cat_pref,
        sensitivity=sensitivity, tier_pref=tier_pref, weekly=weekly, first_day=first_day,
        churn_day=churn_day, home_store=home_store, store_sampler=store_sampler,
        basket_p=rng.beta(4, 7, n) * np.where(segment == FAMILY, 1.25, 1.0),
        brand_loyalty=rng.beta(2.0, 2.5, n),
        staple_rate=rng.beta(3.0, 3.5, n),
        n_staples=rng.integers(3, MAX_STAPLES + 1, n),
    )


class _ProductChooser:
    """Picks products for (customer, day) rows from the customer's latent tastes."""

    def __init__(self, prod, cust, season):
        self.prod, self.cust, self.season = prod, cust, season
        n_cat, n_brands = prod["n_cat"], prod["n_brands"]
        n_tiers = len(TIERS)
        self.by_cat = _GroupSampler(prod["category"], prod["popularity"], n_cat)
        self.by_cat_tier = _GroupSampler(prod["category"] * n_tiers + prod["tier"], prod["popularity"],
                                         n_cat * n_tiers)
        # (category, brand) groups: what a favourite brand means inside one category.
        pair, group = np.unique(prod["category"] * n_brands + prod["brand"], return_inverse=True)
        self.group_cat = pair // n_brands
        self.by_group = _GroupSampler(group, prod["popularity"], len(pair))
        self.group_by_cat = _GroupSampler(self.group_cat, np.bincount(group, prod["popularity"]), n_cat)

    def favourite_groups(self, rng):
        """A few (category, brand) favourites per customer, drawn from their category tastes."""
        n = self.cust["n"]
        rows = np.repeat(np.arange(n), N_FAVOURITE_BRANDS)
        cat = _sample_columns(lambda k: self.cust["cat_pref"][rows, k], self.prod["n_cat"], rng.random(len(rows)))
        group = self.group_by_cat.sample(cat, rng.random(len(rows)))
        self.fav_group = group.reshape(n, N_FAVOURITE_BRANDS)
        self.fav_cat = self.group_cat[self.fav_group]

    def choose(self, rng, cust_idx, day=None):
        """Category from tastes (x seasonality), then a favourite brand's product or a tier-matched one."""
        pref, n_cat = self.cust["cat_pref"], self.prod["n_cat"]

        def weight(k):
            w = pref[cust_idx, k]
            return w if day is None else w * self.season[k, day]

        cat = _sample_columns(weight, n_cat, rng.random(len(cust_idx)))
        u_loyal, u_tier, u_item = rng.random((3, len(cust_idx)))

        tier = _sample_columns(lambda k: self.cust["tier_pref"][cust_idx, k], len(TIERS), u_tier)
        group = cat * len(TIERS) + tier
        product = np.where(self.by_cat_tier.counts[group] > 0,
                           self.by_cat_tier.sample(group, u_item), self.by_cat.sample(cat, u_item))

        match = self.fav_cat[cust_idx] == cat[:, None]
        loyal = (u_loyal < self.cust["brand_loyalty"][cust_idx]) & match.any(axis=1)
        fav = self.fav_group[cust_idx[loyal], match[loyal].argmax(axis=1)]
        product[loyal] = self.by_group.sample(fav, u_item[loyal])
        return product


def _calendar(start: date, n_days: int):
    """Per day: the visit multiplier (weekday x payday x trend) and the day of year (seasons)."""
    days = np.datetime64(start, "D") + np.arange(n_days)
    weekday = (days.astype(np.int64) + 3) % 7  # 1970-01-01 was a Thursday; Monday = 0
    day_of_month = (days - days.astype("datetime64[M]")).astype(np.int64) + 1
    day_of_year = (days - days.astype("datetime64[Y]")).astype(np.int64)
    payday = np.where(day_of_month <= 3, 1.1, 1.0)
    trend = 1.0 + 0.1 * np.arange(n_days) / max(n_days - 1, 1)
    return WEEKDAY_FACTOR[weekday] * payday * trend, day_of_year


def _simulate_visits(rng, cust, day_factor):
    """Poisson visits per customer and day; one vectorized step per day."""
    rate = cust["weekly"] / 7
    visit_cust, visit_day = [], []
    for d, factor in enumerate(day_factor):
        to_churn = cust["churn_day"] - d
        slowdown = 0.2 + 0.8 * np.clip(to_churn / SLOWDOWN_DAYS, 0.0, 1.0)
        active = (cust["first_day"] <= d) & (to_churn > 0)
        count = rng.poisson(rate * factor * slowdown * active)
        who = np.flatnonzero(count)
        visit_cust.append(np.repeat(who, count[who]))
        visit_day.append(np.full(count.sum(), d))
    # Most people who sign up during the period do so at the till: a first visit that day.
    first = np.flatnonzero(cust["new"] & (rng.random(cust["n"]) < 0.7))
    visit_cust.append(first)
    visit_day.append(cust["signup"][first])
    return np.concatenate(visit_cust), np.concatenate(visit_day)


BLOCK_CUSTOMERS = 50_000  # customers simulated at a time: memory stays ~0.5 GB whatever the total


def _world(start: date, n_days: int, n_products: int, n_stores: int, seed: int):
    """What every block shares: the generator (block 0 goes on drawing from it), stores, products and
    the calendar."""
    rng = np.random.default_rng(seed)
    stores = _make_stores(rng, n_stores)
    prod = _make_products(rng, n_products)
    day_factor, day_of_year = _calendar(start, n_days)
    amp = np.array([c[3] for c in CATEGORIES[:prod["n_cat"]]])
    peak = np.array([c[4] for c in CATEGORIES[:prod["n_cat"]]])
    season = 1.0 + amp[:, None] * np.cos(2 * np.pi * (day_of_year[None, :] - peak[:, None]) / 365)
    return rng, stores, prod, day_factor, season


def _latent(rng, n_days: int, n_customers: int, stores, prod, season):
    """A block's customers and their latent state, drawn before any visit: (cust, chooser)."""
    cust = _make_customers(rng, n_customers, n_days, stores, prod)
    chooser = _ProductChooser(prod, cust, season)
    chooser.favourite_groups(rng)
    # Staples: a personal, ordered list; the first ones are bought most often.
    staple_rows = np.repeat(np.arange(n_customers), MAX_STAPLES)
    cust["staples"] = chooser.choose(rng, staple_rows).reshape(n_customers, MAX_STAPLES)
    return cust, chooser


def _simulate(rng, cust, chooser, stores, prod, day_factor, **_):
    """The purchases of one block of customers (customers are independent given the world)."""
    n_products, n_stores, staples = len(prod["category"]), len(stores["region"]), cust["staples"]
    v_cust, v_day = _simulate_visits(rng, cust, day_factor)
    n_visits = len(v_cust)
    # Store: mostly the home store, sometimes another one in the region, rarely anywhere.
    u = rng.random(n_visits)
    v_store = np.where(u < 0.8, cust["home_store"][v_cust],
                       cust["store_sampler"].sample(cust["region"][v_cust], rng.random(n_visits)))
    v_store = np.where(u < 0.97, v_store, rng.integers(0, n_stores, n_visits))
    hour = SHOP_OPEN + rng.choice(len(HOUR_WEIGHT), n_visits, p=HOUR_WEIGHT / HOUR_WEIGHT.sum())
    v_second = v_day * 86400 + hour * 3600 + rng.integers(0, 3600, n_visits)
    p_item = np.clip(cust["basket_p"][v_cust] * FORMAT_BASKET[stores["format"][v_store]], 0.01, 0.99)
    basket = 1 + rng.binomial(7, p_item)  # 1..8 items per visit

    # One row per basket item; every item of a visit shares its time and store.
    visit = np.repeat(np.arange(n_visits), basket)
    r_cust, r_day, n_rows = v_cust[visit], v_day[visit], len(visit)
    product = chooser.choose(rng, r_cust, r_day)
    u = rng.random(n_rows)
    is_staple = u < cust["staple_rate"][r_cust]
    pick = (cust["n_staples"][r_cust] * rng.random(n_rows) ** 1.5).astype(np.int64)
    product = np.where(is_staple, staples[r_cust, pick], product)

    quantity = 1 + rng.poisson(np.where(cust["segment"][r_cust] == FAMILY, 0.5, 0.2))
    # A product drawn twice for one basket becomes one line with the summed quantity.
    _, line_first, line_of = np.unique(visit * n_products + product, return_index=True, return_inverse=True)
    quantity = np.minimum(np.bincount(line_of.ravel(), quantity), 12).astype(np.int32)
    visit, r_cust, product = visit[line_first], r_cust[line_first], product[line_first]
    n_rows = len(visit)

    # Paid unit price: list price with small noise; promotions more often for price-sensitive people.
    promo = rng.random(n_rows) < 0.05 + 0.15 * cust["sensitivity"][r_cust]
    discount = np.where(promo, rng.uniform(0.1, 0.3, n_rows), 0.0)
    paid = prod["price"][product] * rng.normal(1.0, 0.02, n_rows) * (1 - discount)
    paid = np.maximum(np.round(paid, 2), 0.01)

    # Sorted by time; lexsort is stable, so the lines of a basket stay together.
    order = np.lexsort((visit, v_second[visit]))
    return dict(cust=r_cust[order], second=v_second[visit][order], product=product[order],
                store=v_store[visit][order], quantity=quantity[order], price=paid[order])


def _world_tables(stores, prod) -> dict[str, pa.Table]:
    return {
        "products": pa.table({
            "product_id": _ids("P", len(prod["category"]), 6),
            "category": _labels(np.array([c[0] for c in CATEGORIES]), prod["category"]),
            "brand": _labels(prod["brand_names"], prod["brand"]),
            "price_tier": _labels(TIERS, prod["tier"]),
            "price": pa.array(prod["price"], pa.float64()),
        }),
        "stores": pa.table({"store_id": _ids("S", len(stores["region"]), 3),
                            "region": _labels(REGIONS, stores["region"]), "format": _labels(FORMATS, stores["format"])}),
    }


def _block_tables(start: date, first_id: int, world: dict[str, pa.Table], cust, purchases) -> dict[str, pa.Table]:
    """A block's customers (ids from `first_id`) and purchases as Arrow tables."""
    customer_id = _ids("C", cust["n"], 7, first_id)
    start_day = (start - date(1970, 1, 1)).days
    return {
        "customers": pa.table({
            "customer_id": customer_id,
            "age": pa.array(cust["age"], pa.int32()),
            "region": _labels(REGIONS, cust["region"]),
            "signup_date": pa.array((start_day + cust["signup"]).astype(np.int32), pa.date32()),
            "segment": _labels(SEGMENTS, cust["segment"]),
        }),
        "purchases": pa.table({
            "customer_id": pc.take(customer_id, pa.array(purchases["cust"])),
            "ts": pa.array(start_day * 86_400_000_000 + purchases["second"] * 1_000_000, pa.timestamp("us")),
            "product_id": pc.take(world["products"].column("product_id"), pa.array(purchases["product"])),
            "store_id": pc.take(world["stores"].column("store_id"), pa.array(purchases["store"])),
            "quantity": pa.array(purchases["quantity"], pa.int32()),
            "price": pa.array(purchases["price"], pa.float64()),
        }),
    }


def simulate_blocks(start: date, n_days: int, customers: int, products: int, stores: int, seed: int) -> Iterator[dict[str, pa.Table]]:
    """The tables of `n_days` from `start` a block of BLOCK_CUSTOMERS customers at a time: the first
    block's dict also holds products and stores; every block holds its customers and their purchases
    (sorted by ts within the block). Block 0 draws on after the world from the seed's generator, block
    b from its own ([seed, b]): a warehouse of up to BLOCK_CUSTOMERS customers is what one draw gave."""
    world = None
    for first, state, rng in latent_blocks(start, n_days, customers, products, stores, seed):
        world = world or _world_tables(state["stores"], state["prod"])
        tables = _block_tables(start, first + 1, world, state["cust"], _simulate(rng, **state))
        yield {**world, **tables} if first == 0 else tables


def latent_blocks(start: date, n_days: int, customers: int, products: int, stores: int, seed: int):
    """What simulate_blocks draws before any visit, a block at a time: (the block's first customer, the
    latent state: the world's stores, prod, day_factor and season, the block's cust and chooser; its rng)."""
    rng, store_info, prod, day_factor, season = _world(start, n_days, products, stores, seed)
    for b, first in enumerate(range(0, customers, BLOCK_CUSTOMERS)):
        block_rng = rng if b == 0 else np.random.default_rng([seed, b])
        cust, chooser = _latent(block_rng, n_days, min(BLOCK_CUSTOMERS, customers - first), store_info, prod, season)
        yield first, dict(stores=store_info, prod=prod, day_factor=day_factor, season=season, cust=cust, chooser=chooser), block_rng


def simulate_tables(start: date, n_days: int, customers: int, products: int, stores: int,
                    seed: int) -> dict[str, pa.Table]:
    """The four tables of `n_days` from `start` (customers, products, stores; purchases sorted by ts
    within each block of customers), in memory: simulate_blocks for large sizes."""
    parts: dict[str, list[pa.Table]] = {}
    for tables in simulate_blocks(start, n_days, customers, products, stores, seed):
        for name, t in tables.items():
            parts.setdefault(name, []).append(t)
    return {name: pa.concat_tables(ts) for name, ts in parts.items()}
