"""Shared helpers for the models tests: tiny Parquet sources in a temporary folder, cached with
habitus.models.cache.build_cache.

Test modules get them through the `sources` / `module_sources` fixtures (a `Sources` object), so
nothing has to import this file by name.
"""

import calendar
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
from habitus.models.cache.reader import Shard

DAY = 86_400
T0 = calendar.timegm((2026, 1, 1, 0, 0, 0))  # a midnight (UTC): every test's time origin

EVENT_COLUMNS = {"product_id": "categorical", "price": "numeric"}


class Sources:
    """Writes small Parquet files under `root/sources` and builds caches from them under `root/cache`."""

    DAY = DAY
    T0 = T0

    def __init__(self, root: Path):
        self.root = Path(root)
        (self.root / "sources").mkdir(parents=True, exist_ok=True)

    def at(self, days: float, hours: float = 0.0, seconds: int = 0) -> int:
        """Epoch seconds, `days` (+ hours, seconds) after T0."""
        return int(T0 + round(days * DAY + hours * 3600) + seconds)

    @staticmethod
    def stamps(seconds) -> pa.Array:
        """Epoch seconds (None = null) -> a naive timestamp[s] column."""
        return pa.array([None if s is None else int(s) for s in seconds], pa.timestamp("s"))

    def write(self, name: str, **columns) -> str:
        """Write one Parquet file from columns (lists, numpy arrays or Arrow arrays); returns its path."""
        path = self.root / "sources" / f"{name}.parquet"
        pq.write_table(pa.table(columns), path)
        return str(path)

    def write_events(self, name: str, customer, ts, product=None, price=None) -> str:
        cols = {"customer_id": pa.array(customer, pa.string()), "ts": self.stamps(ts)}
        if product is not None:
            cols["product_id"] = pa.array(product, pa.string())
        if price is not None:
            cols["price"] = pa.array(price, pa.float64())
        return self.write(name, **cols)

    @staticmethod
    def events(*files: str, columns: dict | None = None, name: str = "purchases") -> TableInput:
        return TableInput(name, list(files), dict(EVENT_COLUMNS if columns is None else columns), timestamp="ts")

    def spec(self, events, entity_attributes=(), attributes=(), shard_events: int = 4_000_000) -> CacheSpec:
        events = [events] if isinstance(events, TableInput) else list(events)
        return CacheSpec("customer_id", events, list(entity_attributes), list(attributes), shard_events)

    def build(self, events, entity_attributes=(), attributes=(), shard_events: int = 4_000_000,
              root: str = "cache") -> Cache:
        spec = self.spec(events, entity_attributes, attributes, shard_events)
        return Cache(build_cache(spec, self.root / root, log=lambda _: None))

    def customer_events(self, customers: int, draw, seed: int, ids: str = "cust{:04d}",
                        name: str = "purchases") -> TableInput:
        """The events of `customers` customers: `draw(rng, i)` -> customer i's (days, products, prices),
        drawn in customer order from one generator seeded `seed`; customer i is named ids.format(i)."""
        rng = np.random.default_rng(seed)
        customer, ts, product, price = [], [], [], []
        for i in range(customers):
            days, products, prices = draw(rng, i)
            customer += [ids.format(i)] * len(days)
            ts += [self.at(d) for d in days]
            product += list(products)
            price += list(prices)
        return self.events(self.write_events(name, customer, ts, product, price))

    def segment_purchases(self, customers: int, span_days: int, seed: int, shard_events: int = 3000) -> Cache:
        """Customers of three segments, each buying mostly (80%) its own 4 of 12 products, about 0.4
        purchases a day over `span_days`: a multilabel world whose labels a model can learn."""
        def draw(rng, i):
            k = rng.poisson(0.4 * span_days)
            days = np.sort(rng.uniform(0, span_days, k))
            own = rng.random(k) < 0.8
            return days, [f"p{(i % 3) * 4 + j}" if o else f"p{j}" for j, o in zip(rng.integers(0, 4, k), own)], [1.0] * k

        return self.build(self.customer_events(customers, draw, seed, ids="c{:04d}"), shard_events=shard_events)

    def churning_purchases(self, customers: int, span_days: int, seed: int, price_scales=(5.0, 5.0, 5.0),
                           shard_events: int = 4_000_000) -> Cache:
        """Customers of three segments (i % 3: their own products, prices gamma(2, price_scales[i % 3])),
        half of whom stop buying at a random day before `span_days`: a churn world for the training loops."""
        def draw(rng, i):
            stop = min(rng.uniform(20, span_days + 40) if rng.random() < 0.5 else span_days, span_days)
            days = np.sort(rng.uniform(0, stop, rng.poisson(rng.uniform(0.15, 0.6) * stop)))
            return (days, [f"p{i % 3}{j}" for j in rng.choice(4, len(days), p=[0.55, 0.25, 0.15, 0.05])],
                    rng.gamma(2.0, price_scales[i % 3], len(days)).round(2))

        return self.build(self.customer_events(customers, draw, seed), shard_events=shard_events)

    def loyal_groups(self, customers: int = 80, days: int = 90, staples: int = 5) -> Cache:
        """Customers loyal to group a or group b (10 rare products each, 2-4 a basket), plus `staples`
        products in every basket (thrice: the most frequent ids 1..staples): the rarer products are two
        groups bought together."""
        def draw(rng, i):
            visits = []
            for d in np.sort(rng.choice(days, 10, replace=False)):
                rare = [f"{'ab'[i % 2]}{p}" for p in rng.choice(10, rng.integers(2, 5), replace=False)]
                visits += [(d + 9 / 24, item) for item in [f"s{k}" for k in range(staples)] * 3 + rare]
            at, products = zip(*visits)
            return at, products, [1.0] * len(at)

        return self.build(self.customer_events(customers, draw, 5, ids="c{:03d}"), shard_events=2000)

    def random_purchases(self, events: int, customers: int, span_days: float, seed: int = 0) -> Cache:
        """`events` purchases of 20 products by `customers` customers at uniform times over `span_days`,
        gamma-distributed prices: a world with no pattern, for what must hold on any data."""
        rng = np.random.default_rng(seed)
        customer = [f"c{i:03d}" for i in rng.integers(0, customers, events)]
        ts = [self.at(float(d)) for d in rng.uniform(0, span_days, events)]
        return self.build(self.events(self.write_events(
            "purchases", customer, ts, [f"p{j}" for j in rng.integers(0, 20, events)],
            rng.gamma(2.0, 5.0, events).round(2))))


def shard_frame(cache: Cache) -> dict[str, np.ndarray]:
    """All events of a cache, shards concatenated, plus the shard index of every row."""
    parts = [cache.shard(i) for i in range(cache.shard_count)]
    out = {"shard": np.concatenate([np.full(len(p.ts), i) for i, p in enumerate(parts)]),
           "entity": np.concatenate([p.entity for p in parts]),
           "ts": np.concatenate([p.ts for p in parts])}
    for c in cache.columns:
        out[c] = np.concatenate([p.columns[c] for p in parts])
    return out


class PastCache:
    """A cache whose shards hold only the events at or before `cutoff` (the same ids): what the world
    looked like at that cut-off."""

    def __init__(self, cache, cutoff: int):
        self._cache, self._cutoff = cache, cutoff

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def shard(self, i: int) -> Shard:
        sh = self._cache.shard(i)
        keep = sh.ts <= self._cutoff
        entity = sh.entity[keep]
        entities = np.unique(entity)
        starts = np.r_[np.searchsorted(entity, entities), len(entity)]
        return Shard(entity, sh.ts[keep], {c: v[keep] for c, v in sh.columns.items()}, entities, starts)


@pytest.fixture
def past():
    """`past(cache, cutoff)`: the cache as it stood at the cut-off (PastCache)."""
    return PastCache


@pytest.fixture
def sources(tmp_path) -> Sources:
    return Sources(tmp_path)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny networks train several times faster on one thread, above all on a busy machine.
    Modules that train take it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def module_sources(tmp_path_factory) -> Sources:
    return Sources(tmp_path_factory.mktemp("sources"))


SEGMENT_CUSTOMERS, SEGMENT_SPAN_DAYS, SEGMENT_HORIZON = 240, 112, 14


@pytest.fixture(scope="module")
def segment_foundation(module_sources):
    """(cache, test cut-off, foundation TrainResult): 240 customers of three segments over 112 days,
    each buying mostly its own products of 12, and a tiny foundation model whose targets end 14 days
    (the horizon) before the test cut-off, which leaves 14 days after it."""
    from habitus.models.train.foundation import train_foundation
    from habitus.models.train.config import FoundationConfig

    cfg = FoundationConfig(horizon_days=SEGMENT_HORIZON, cutoff_every_days=7, hidden=16, layers=1, epochs=1,
                           batch_size=16, learning_rate=5e-3, buckets=32, seed=0, cutoffs_per_chunk=1,
                           chunk_entities=64, min_history_days=28)
    cache = module_sources.segment_purchases(SEGMENT_CUSTOMERS, SEGMENT_SPAN_DAYS, seed=0)
    test_cutoff = module_sources.at(SEGMENT_SPAN_DAYS - SEGMENT_HORIZON)
    foundation = train_foundation(cache, cfg, test_cutoff - SEGMENT_HORIZON * DAY, device="cpu", log=lambda _: None)
    return cache, test_cutoff, foundation


@pytest.fixture(scope="module")
def segment_labels(segment_foundation):
    """`segment_labels(task)`: segment_foundation's (cache, test cut-off, foundation) and a TaskSpec of
    `task` ("multilabel", "multiclass") whose labels are every product, over the 14 days of the horizon."""
    from habitus.models.tasks.spec import TaskSpec
    from habitus.models.data.targets import TargetSpec

    cache, test_cutoff, foundation = segment_foundation
    every = tuple(range(1, cache.columns["product_id"]["vocab_size"] + 1))
    return lambda task: (cache, test_cutoff, foundation,
                         TaskSpec(task, TargetSpec("any_event", SEGMENT_HORIZON, "product_id", every)))


CHURN_SPAN_DAYS, CHURN_HORIZON = 126, 14


@pytest.fixture(scope="module")
def churn_foundation(module_sources):
    """(cache, test cut-off, foundation state, foundation info) as the scenario recipe takes them: 240
    customers over 126 days, half of whom stop buying (Sources.churning_purchases), and a tiny
    foundation whose targets end 14 days before the test cut-off; the info carries the weights'
    fingerprint a checkpoint's config would."""
    from habitus.models.train.config import FoundationConfig
    from habitus.models.train.foundation import train_foundation

    cache = module_sources.churning_purchases(240, CHURN_SPAN_DAYS, seed=3, shard_events=2500)
    test_cutoff = module_sources.at(CHURN_SPAN_DAYS - CHURN_HORIZON)
    cfg = FoundationConfig(horizon_days=CHURN_HORIZON, hidden=16, layers=1, epochs=1, batch_size=32, buckets=16,
                           chunk_entities=64)
    foundation = train_foundation(cache, cfg, test_cutoff - CHURN_HORIZON * DAY, device="cpu", log=lambda _: None)
    return cache, test_cutoff, foundation.model.state_dict(), {**foundation.info, "weights_sha256": "f" * 64}


@pytest.fixture
def frame():
    """`frame(cache)`: the cache's events as flat numpy columns (see `shard_frame`)."""
    return shard_frame
