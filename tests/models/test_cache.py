"""habitus.models.cache: encoding, sorting, sharding, vocabularies, the manifest and reuse by fingerprint."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.models.cache import Cache, CacheError, TableInput, build_cache

T0 = 1767225600  # 2026-01-01T00:00:00Z, as in conftest


def at(day: float) -> int:
    return int(T0 + round(day * 86_400))


# (customer, day after T0, product, price); written in this (unsorted) order
ROWS = [
    ("c1", 1.0, "p_a", 10.0),
    ("c1", 3.0, "p_b", 5.0),
    ("c1", 2.0, "p_a", 10.0),
    ("c2", 5.0, "p_a", 12.5),
    ("c2", 4.0, "p_c", 3.0),
    ("c10", 7.0, "p_a", 8.0),
    ("c10", 6.0, "p_b", 5.0),
    ("c10", 9.0, None, 1.0),  # null product -> id 0
    ("c3", 8.0, "p_c", 3.0),
    ("c3", 2.5, "p_d", 20.0),
    ("c4", 3.5, "p_a", 10.0),
    ("c4", 1.5, "p_b", 5.0),
    ("c5", 10.0, "p_c", 3.5),
    ("c5", 11.0, "p_z", 99.0),  # p_z has no row in the products table
    ("c6", 4.5, "p_a", 10.0),
    ("c6", 12.0, "p_c", 4.0),
    ("c7", 6.5, "p_b", None),  # null price -> NaN
    ("c7", 2.25, "p_d", 18.0),
    (None, 5.0, None, 1.0),  # dropped: no customer
    ("c2", None, None, 1.0),  # dropped: no timestamp
]
KEPT = [r for r in ROWS if r[0] is not None and r[1] is not None]
# product frequencies among kept events: p_a 6, p_b 4, p_c 4 (tie broken by value), p_d 2, p_z 1
EXPECTED_VOCAB = [("p_a", 1, 6), ("p_b", 2, 4), ("p_c", 3, 4), ("p_d", 4, 2), ("p_z", 5, 1)]
PRODUCTS = {"product_id": ["p_a", "p_b", "p_c", "p_d", "p_q"], "brand": ["B1", "B1", "B2", "B2", "B3"]}
CUSTOMERS = {"customer_id": ["c1", "c2", "c10", "c3", "c99"],  # c99 has no events; c4..c7 no row here
             "segment": ["gold", "silver", "gold", None, "gold"],
             "age": [30.0, None, 50.0, 40.0, 20.0]}


def _write_events(sources, rows=ROWS, name="purchases"):
    customer, day, product, price = zip(*rows)
    ts = [None if d is None else sources.at(d) for d in day]
    return sources.write_events(name, customer, ts, product, price)


def _inputs(sources, rows=ROWS):
    assert sources.at(2.25) == at(2.25)
    events = sources.events(_write_events(sources, rows))
    customers = TableInput("customers", [sources.write("customers", **CUSTOMERS)],
                           {"customer_id": "categorical", "segment": "categorical", "age": "numeric"})
    products = TableInput("products", [sources.write("products", **PRODUCTS)],
                          {"product_id": "categorical", "brand": "categorical"}, key="product_id")
    return events, [customers], [products]


@pytest.fixture
def built(sources):
    events, customers, products = _inputs(sources)
    return sources.build(events, customers, products, shard_events=4)


def _decode(cache, frame):
    """The cache's events back as (customer, ts, product, price) tuples."""
    customer = cache.entity_ids(frame["entity"]).to_pylist()
    vocab = [None] + cache.vocab("product_id").column("value").to_pylist()
    price = [None if np.isnan(p) else float(p) for p in frame["price"]]
    return sorted(zip(customer, frame["ts"].tolist(), [vocab[i] for i in frame["product_id"]], price),
                  key=repr)


def test_manifest_counts_columns_and_coverage(built):
    m = built.manifest
    assert m["n_events"] == len(KEPT) == 18
    assert m["n_entities"] == 9  # c1..c7, c10 from the events + c99 from the customers table
    assert m["dropped"] == {"null_entity": 1, "null_timestamp": 1}
    assert m["entity"] == "customer_id" and m["entity_type"] == "string"
    assert m["columns"]["product_id"] == {"type": "categorical", "vocab_size": 5}
    assert m["columns"]["brand"] == {"type": "categorical", "vocab_size": 2}  # B3 is never bought
    price = m["columns"]["price"]
    kept_prices = np.array([r[3] for r in KEPT if r[3] is not None])
    assert price["type"] == "numeric" and price["nulls"] == 1
    assert price["mean"] == pytest.approx(kept_prices.mean())
    assert price["std"] == pytest.approx(kept_prices.std())
    assert (price["min"], price["max"]) == (kept_prices.min(), kept_prices.max())
    # 17 events have a product id, 16 of them find a products row (p_z does not)
    assert m["join_coverage"] == {"products": pytest.approx(round(16 / 17, 6))}
    assert 0 < m["join_coverage"]["products"] < 1
    assert m["time_range"] == [at(min(r[1] for r in KEPT)), at(max(r[1] for r in KEPT))]
    assert set(m["sources"]) == {"purchases", "customers", "products"}
    assert len(m["fingerprint"]) == 64 and built.path.name == m["fingerprint"][:16]
    assert set(m["entity_columns"]) == {"segment", "age"}


def test_every_event_lands_once_sorted_by_entity_and_time(built, frame):
    assert built.shard_count > 1  # shard_events=4 forces several shards
    f = frame(built)
    assert len(f["ts"]) == built.manifest["n_events"]
    assert sum(s["rows"] for s in built.manifest["shards"]) == len(f["ts"])
    for i in range(built.shard_count):
        sh = built.shard(i)
        assert len(sh.ts) == built.manifest["shards"][i]["rows"]
        assert len(sh.entities) == built.manifest["shards"][i]["entities"]
        key = sh.entity.astype(np.int64) * 10**12 + sh.ts
        assert np.all(np.diff(key) > 0), f"shard {i} is not sorted by (entity, ts)"
        np.testing.assert_array_equal(sh.entity[sh.starts[:-1]], sh.entities)
    # shards partition the entities: no entity appears in two shards
    owners = {}
    for s, e in zip(f["shard"], f["entity"]):
        assert owners.setdefault(int(e), int(s)) == int(s)
    assert len(owners) == 8
    # the events are the input's kept rows, unchanged
    expected = sorted(((c, at(d), p, pr) for c, d, p, pr in KEPT), key=repr)
    assert _decode(built, f) == expected


def test_shards_spanning_several_arrow_batches_keep_their_counts(sources):
    # the encoder streams batches of up to 65,536 rows: shards (and entities) begin and end inside a
    # batch or span two, and the manifest's counts must still match the files
    rng = np.random.default_rng(0)
    n = 150_000
    path = sources.write("many", customer_id=pa.array(np.array([f"c{i}" for i in range(7)])[rng.integers(0, 7, n)]),
                         ts=pa.array(T0 + rng.integers(0, 100 * 86_400, n)).cast(pa.timestamp("s")),
                         product_id=pa.array(rng.choice(["a", "b", "c"], n)), price=pa.array(rng.random(n)))
    cache = sources.build(sources.events(path), shard_events=50_000)
    assert cache.manifest["n_events"] == n and cache.n_entities == 7
    seen = []
    for i, meta in enumerate(cache.manifest["shards"]):
        sh = cache.shard(i)
        assert meta["rows"] == len(sh.ts) and meta["entities"] == len(sh.entities)
        assert np.all(np.diff(sh.entity.astype(np.int64) * 10**12 + sh.ts) >= 0)
        seen += sh.entities.tolist()
    assert sorted(seen) == list(range(7))


def test_vocabulary_ids_follow_frequency_and_null_is_zero(built, frame):
    vocab = built.vocab("product_id")
    assert list(zip(*(vocab.column(c).to_pylist() for c in ("value", "id", "count")))) == EXPECTED_VOCAB
    f = frame(built)
    ids = dict(zip(vocab.column("value").to_pylist(), vocab.column("id").to_pylist()))
    decoded = dict(zip(zip(built.entity_ids(f["entity"]).to_pylist(), f["ts"].tolist()), f["product_id"].tolist()))
    for customer, day, product, _ in KEPT:
        assert decoded[customer, at(day)] == (0 if product is None else ids[product])
    # brand joined through product_id: B1 (p_a, p_b: 10 events) = 1, B2 (p_c, p_d: 6) = 2, p_z / null -> 0
    brand_of = {"p_a": 1, "p_b": 1, "p_c": 2, "p_d": 2, "p_z": 0, None: 0}
    decoded_brand = dict(zip(zip(built.entity_ids(f["entity"]).to_pylist(), f["ts"].tolist()), f["brand"].tolist()))
    for customer, day, product, _ in KEPT:
        assert decoded_brand[customer, at(day)] == brand_of[product]
    assert f["product_id"].dtype == np.int32 and f["brand"].dtype == np.int32
    assert f["price"].dtype == np.float32 and f["ts"].dtype == np.int64


def test_entity_ids_and_entity_attributes(built):
    n = built.n_entities
    ids = built.entity_ids(np.arange(n))
    assert ids.type == pa.string()
    assert ids.to_pylist() == sorted(["c1", "c2", "c3", "c4", "c5", "c6", "c7", "c10", "c99"])  # ordered as text
    table = built.entity_table()
    assert len(table["entity"]) == n
    index = {c: i for i, c in enumerate(ids.to_pylist())}
    segment = built.vocab("entity.segment")  # gold x3 = 1, silver = 2
    assert segment.column("value").to_pylist() == ["gold", "silver"]
    expected_segment = {"c1": 1, "c2": 2, "c10": 1, "c3": 0, "c99": 1, "c4": 0, "c7": 0}
    for c, seg in expected_segment.items():
        assert table["segment"][index[c]] == seg, c
    assert table["age"][index["c10"]] == 50.0
    assert np.isnan(table["age"][index["c2"]]) and np.isnan(table["age"][index["c5"]])
    assert built.entity_columns["age"]["mean"] == pytest.approx(35.0)


def test_integer_entity_ids_come_back_as_integers(sources):
    path = sources.write("ints", customer_id=pa.array([10, 9, 10, 200], pa.int64()),
                         ts=sources.stamps([sources.at(d) for d in (1, 2, 3, 4)]),
                         product_id=pa.array(["a", "b", "a", "a"]), price=pa.array([1.0, 2.0, 3.0, 4.0]))
    cache = sources.build(sources.events(path))
    ids = cache.entity_ids(np.arange(cache.n_entities))
    assert ids.type == pa.int64()
    assert sorted(ids.to_pylist()) == [9, 10, 200]
    assert cache.manifest["entity_type"] == "int64"


def test_unchanged_inputs_reuse_the_cache(sources):
    events, customers, products = _inputs(sources)
    spec = sources.spec(events, customers, products, shard_events=4)
    first = build_cache(spec, sources.root / "cache", log=lambda _: None)
    stamp = (first / "manifest.json").stat().st_mtime_ns
    messages = []
    again = build_cache(spec, sources.root / "cache", log=messages.append)
    assert again == first
    assert (first / "manifest.json").stat().st_mtime_ns == stamp
    assert any("reusing" in m for m in messages)

    # re-extracted with the same bytes (new mtime): same fingerprint, same folder, no rebuild
    path = Path(events.files[0])
    data = path.read_bytes()
    path.write_bytes(data)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 5_000_000_000))
    assert spec.fingerprint() == Cache(first).fingerprint
    assert build_cache(spec, sources.root / "cache", log=lambda _: None) == first
    assert (first / "manifest.json").stat().st_mtime_ns == stamp

    # one price changed: a new fingerprint and a new cache folder
    rows = list(ROWS)
    rows[0] = ("c1", 1.0, "p_a", 11.0)
    _write_events(sources, rows)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10_000_000_000))
    assert spec.fingerprint() != Cache(first).fingerprint
    changed = build_cache(spec, sources.root / "cache", log=lambda _: None)
    assert changed != first
    assert Cache(changed).fingerprint == spec.fingerprint()
    assert Cache(changed).manifest["columns"]["price"]["max"] == 99.0


def test_attributes_key_missing_from_events_names_the_column(sources):
    events, _, _ = _inputs(sources)
    stores = TableInput("stores", [sources.write("stores", store_id=["s1"], city=["Paris"])],
                        {"store_id": "categorical", "city": "categorical"}, key="store_id")
    with pytest.raises(CacheError, match="store_id"):
        sources.build(events, attributes=[stores])


def test_source_without_files_is_refused(sources):
    with pytest.raises(CacheError, match="purchases"):
        sources.build(sources.events())


def test_folder_without_manifest_is_not_a_cache(built, tmp_path):
    with pytest.raises(CacheError, match="manifest"):
        Cache(tmp_path / "nothing")
    (built.path / "manifest.json").rename(built.path / "manifest.json.bak")
    with pytest.raises(CacheError, match="manifest"):
        Cache(built.path)


# --------------------------------------------------------------------------- time zones

_BUILD_IN_NEW_YORK = textwrap.dedent("""
    import json, sys
    from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
    root, naive, aware = sys.argv[1:]
    out = {}
    for name, path in (("naive", naive), ("aware", aware)):
        spec = CacheSpec("customer_id", [TableInput(name, [path], {}, timestamp="ts")])
        out[name] = Cache(build_cache(spec, root + "/" + name, log=lambda _: None)).time_range[0]
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def new_york_build(tmp_path_factory):
    """Build caches in a process whose local time zone is not UTC; returns their first event times
    and the instant that was written (2026-01-02T12:00:00Z)."""
    root = tmp_path_factory.mktemp("tz")
    instant = T0 + 86_400 + 12 * 3600
    naive = root / "naive.parquet"
    aware = root / "aware.parquet"
    pq.write_table(pa.table({"customer_id": ["a"], "ts": pa.array([instant], pa.timestamp("s"))}), naive)
    pq.write_table(pa.table({"customer_id": ["a"],
                             "ts": pa.array([instant * 1_000_000], pa.timestamp("us", tz="UTC"))}), aware)
    env = {**os.environ, "TZ": "America/New_York",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _BUILD_IN_NEW_YORK, str(root), str(naive), str(aware)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), instant


def test_naive_timestamps_do_not_depend_on_the_local_time_zone(new_york_build):
    times, instant = new_york_build
    assert times["naive"] == instant


def test_time_zone_aware_timestamps_keep_their_utc_instant(new_york_build):
    times, instant = new_york_build
    assert times["aware"] == instant


# --------------------------------------------------------------------------- new data: append / rebuild

from habitus.models.cache import MAX_SHARD_FILES  # noqa: E402

FIRST = [r for r in KEPT if r[1] <= 6.0]
LATER = [r for r in KEPT if r[1] > 6.0] + [
    ("c1", 13.0, "p_new", 7.0),  # a new product for an old customer
    ("c_new", 14.0, "p_a", 9.0),  # a new customer
    ("c99", 15.0, "p_b", 5.0),  # first events of a customer known only from the customers table
]


def _grow(sources, prev, files, root="cache", build=None, **kw):
    """A cache of `files` (+ customers and products); `build`: build_cache's keyword arguments."""
    events = sources.events(*files)
    customers = TableInput("customers", [sources.write("customers", **CUSTOMERS)],
                           {"customer_id": "categorical", "segment": "categorical", "age": "numeric"})
    products = TableInput("products", [sources.write("products", **PRODUCTS)],
                          {"product_id": "categorical", "brand": "categorical"}, key="product_id")
    spec = sources.spec(events, [customers], [products], **kw)
    return Cache(build_cache(spec, sources.root / root, previous=prev and prev.path, log=lambda _: None,
                             **(build or {})))


def _snapshot(cache):
    return {f.name: f.read_bytes() for f in cache.path.rglob("*") if f.is_file()}


def test_new_partition_is_appended_and_every_id_stays(sources, frame):
    first = _grow(sources, None, [_write_events(sources, FIRST, "day1")], shard_events=4)
    before = _snapshot(first)
    grown = _grow(sources, first, [_write_events(sources, FIRST, "day1"), _write_events(sources, LATER, "day2")],
                  shard_events=4)
    m = grown.manifest
    assert m["mode"] == "append" and m["appends"] == 1
    assert m["lineage"] == first.lineage == first.fingerprint and m["parent"] == first.fingerprint
    assert grown.fits({"cache_lineage": first.lineage}) and grown.shard_count == first.shard_count
    # ids given before never change; new values and entities get the next ids
    old_vocab, new_vocab = first.vocab("product_id").to_pylist(), grown.vocab("product_id").to_pylist()
    assert [(v["value"], v["id"]) for v in new_vocab[:len(old_vocab)]] == [(v["value"], v["id"]) for v in old_vocab]
    assert [v["value"] for v in new_vocab[len(old_vocab):]] == ["p_new", "p_z"]  # count, then value
    counts = {v["value"]: v["count"] for v in new_vocab}
    assert counts["p_a"] == sum(1 for r in FIRST + LATER if r[2] == "p_a")
    old_ids = first.entity_ids(np.arange(first.n_entities)).to_pylist()
    assert grown.entity_ids(np.arange(first.n_entities)).to_pylist() == old_ids
    assert grown.entity_ids(np.arange(first.n_entities, grown.n_entities)).to_pylist() == ["c5", "c_new"]
    # the events are exactly the union, sorted, with per-shard counts that match the merged pieces
    f = frame(grown)
    assert _decode(grown, f) == sorted(((c, at(d), p, pr) for c, d, p, pr in FIRST + LATER), key=repr)
    assert m["n_events"] == len(FIRST) + len(LATER) == sum(s["rows"] for s in m["shards"])
    for i, meta in enumerate(m["shards"]):
        sh = grown.shard(i)
        assert (len(sh.ts), len(sh.entities)) == (meta["rows"], meta["entities"])
        assert np.all(np.diff(sh.entity.astype(np.int64) * 10**12 + sh.ts) >= 0)
    assert m["time_range"] == [at(min(r[1] for r in FIRST)), at(max(r[1] for r in LATER))]
    assert any(len(s["files"]) == 2 for s in m["shards"])  # old pieces linked, new ones beside them
    # the version in use before is untouched, byte for byte, and still readable
    assert _snapshot(first) == before and Cache(first.path).manifest["n_events"] == len(FIRST)


def test_appended_cache_holds_the_same_events_as_a_fresh_build(sources, frame):
    files = [_write_events(sources, FIRST, "day1"), _write_events(sources, LATER, "day2")]
    first = _grow(sources, None, files[:1])
    grown = _grow(sources, first, files)
    fresh = _grow(sources, None, files, root="fresh")
    assert grown.fingerprint == fresh.fingerprint  # same inputs...
    assert fresh.manifest["mode"] == "fresh" and fresh.lineage != grown.lineage  # ...but ids of another lineage
    assert not fresh.fits({"cache_lineage": grown.lineage, "cache_fingerprint": "x"})
    assert _decode(grown, frame(grown)) == _decode(fresh, frame(fresh))
    assert grown.manifest["n_entities"] == fresh.manifest["n_entities"]
    assert grown.manifest["join_coverage"] == fresh.manifest["join_coverage"]


def test_a_changed_partition_reencodes_with_the_same_ids(sources, frame):
    first = _grow(sources, None, [_write_events(sources, FIRST, "day1")])
    late = FIRST + [("c2", 6.0, "p_late", 1.0)]  # late rows: day1 re-extracted
    rebuilt = _grow(sources, first, [_write_events(sources, late, "day1")])
    assert rebuilt.manifest["mode"] == "rebuild" and rebuilt.lineage == first.lineage
    old_vocab = first.vocab("product_id").to_pylist()
    assert rebuilt.vocab("product_id").to_pylist()[:len(old_vocab)] == old_vocab  # ids and counts kept
    assert rebuilt.vocab("product_id").column("value").to_pylist()[-1] == "p_late"
    assert _decode(rebuilt, frame(rebuilt)) == sorted(((c, at(d), p, pr) for c, d, p, pr in late), key=repr)
    assert all(len(s["files"]) == 1 for s in rebuilt.manifest["shards"])


def test_many_appends_are_merged_back_into_one_file_per_shard(sources, frame):
    days = [[r for r in FIRST + LATER if d <= r[1] < d + 3] for d in range(0, 16, 3)]
    files, cache = [], None
    for i, rows in enumerate(days):
        files.append(_write_events(sources, rows, f"part{i}"))
        cache = _grow(sources, cache, files, shard_events=8)
    m = cache.manifest
    assert m["appends"] == len(days) - 1 > MAX_SHARD_FILES
    assert all(1 <= len(s["files"]) <= MAX_SHARD_FILES for s in m["shards"])
    assert any(f.endswith("-merged.arrow") for s in m["shards"] for f in s["files"])
    everything = [r for rows in days for r in rows]
    assert _decode(cache, frame(cache)) == sorted(((c, at(d), p, pr) for c, d, p, pr in everything), key=repr)
    for i, meta in enumerate(m["shards"]):
        assert len(cache.shard(i).entities) == meta["entities"]


def test_other_settings_start_a_new_lineage(sources):
    first = _grow(sources, None, [_write_events(sources, FIRST, "day1")])
    spec = sources.spec(sources.events(_write_events(sources, FIRST, "day1"), columns={"product_id": "categorical"}))
    other = Cache(build_cache(spec, sources.root / "cache", previous=first.path, log=lambda _: None))
    assert other.manifest["mode"] == "fresh" and other.lineage != first.lineage
    assert not other.fits({"cache_lineage": first.lineage, "cache_fingerprint": first.fingerprint})


def test_quarantine_counts_are_recorded_and_added_up_over_appends(sources, frame):
    bad = FIRST + [FIRST[0], ("c1", 4.0, "p_a", float("inf")), ("c9", 3000.0, "p_a", 1.0)]  # copy, inf, far future
    first = _grow(sources, None, [_write_events(sources, bad, "day1")])
    q = first.manifest["quarantine"]
    assert (q["duplicate_event"], q["numeric_not_finite"], q["timestamp_in_future"]) == (1, 1, 1)
    assert q["rows_in"] == len(bad) and q["rows_kept"] == len(bad) - 2 == first.manifest["n_events"]
    later = LATER + [(None, 14.0, "p_a", 1.0)]
    grown = _grow(sources, first, [_write_events(sources, bad, "day1"), _write_events(sources, later, "day2")])
    g = grown.manifest["quarantine"]
    assert g["rows_in"] == len(bad) + len(later) and g["null_entity"] == 1 and g["duplicate_event"] == 1
    assert g["rows_kept"] == grown.manifest["n_events"] == len(bad) - 2 + len(LATER)
    assert g["dropped_share"] == round(3 / (len(bad) + len(later)), 6)
    assert np.isnan(frame(grown)["price"]).sum() == 1 + sum(1 for r in FIRST + LATER if r[3] is None)  # inf -> missing


def test_a_version_in_use_is_not_pruned(sources):
    import gc

    files = [_write_events(sources, FIRST, "day1")]
    first = _grow(sources, None, files)  # held open, as by a training run
    cache = first
    for i, rows in enumerate([LATER[:3], LATER[3:6], LATER[6:]]):
        files.append(_write_events(sources, rows, f"more{i}"))
        cache = _grow(sources, cache, files)  # keep=2: `first` is past the two newest
    assert (first.path / "manifest.json").exists() and first.shard(0).ts.size >= 0
    path = first.path
    del first
    gc.collect()
    files.append(_write_events(sources, [("c1", 15.5, "p_a", 1.0)], "last"))
    _grow(sources, cache, files)
    assert not path.exists()
    assert len([p for p in (sources.root / "cache").iterdir() if (p / "manifest.json").exists()]) == 2


def test_the_same_inputs_give_the_same_bytes(sources):
    basket = FIRST + [("c1", 1.0, "p_b", 3.0), ("c1", 1.0, "p_c", 2.0)]  # three events in one second
    files = [_write_events(sources, basket, "day1")]
    one, two = _grow(sources, None, files, root="one"), _grow(sources, None, files, root="two")
    a = {p.relative_to(one.path): p.read_bytes() for p in one.path.rglob("*.arrow")}
    b = {p.relative_to(two.path): p.read_bytes() for p in two.path.rglob("*.arrow")}
    assert a == b and a
    strip = lambda m: {k: v for k, v in m.items() if k not in ("build_seconds",)}  # noqa: E731
    assert strip(one.manifest) == strip(two.manifest)


def test_sorting_in_entity_ranges_gives_the_same_bytes(sources):
    # the encoding pass sorts a range of entities at a time (part_events events): the files must not
    # depend on where the ranges fall, with duplicates (the DISTINCT path) or without
    basket = FIRST + LATER + [("c1", 1.0, "p_b", 3.0), ("c1", 1.0, "p_c", 2.0)]
    for rows, name in ((basket, "clean"), (basket + basket[:3], "copies")):
        files = [_write_events(sources, rows, name)]
        whole = _grow(sources, None, files, root=f"{name}-whole", shard_events=6)
        ranged = _grow(sources, None, files, root=f"{name}-ranged", shard_events=6, build={"part_events": 3})
        assert whole.shard_count > 1
        a = {p.relative_to(whole.path): p.read_bytes() for p in whole.path.rglob("*.arrow")}
        b = {p.relative_to(ranged.path): p.read_bytes() for p in ranged.path.rglob("*.arrow")}
        assert a == b
        strip = lambda m: {k: v for k, v in m.items() if k != "build_seconds"}  # noqa: E731
        assert strip(whole.manifest) == strip(ranged.manifest)
        assert whole.manifest["quarantine"]["duplicate_event"] == (3 if name == "copies" else 0)
        assert whole.manifest["n_events"] == len(basket)



def test_duckdb_settings_reach_the_connection_and_change_no_byte(sources, monkeypatch):
    """duckdb_memory / duckdb_threads are build_cache's arguments (the project config's `cache:` keys),
    not environment variables: they configure the build's connection and are not in the fingerprint."""
    import duckdb

    configs, connect = [], duckdb.connect
    monkeypatch.setattr(duckdb, "connect", lambda *a, config=None, **kw: configs.append(config) or connect(
        *a, config=config, **kw))
    files = [_write_events(sources, FIRST + LATER, "all")]
    plain = _grow(sources, None, files, root="plain")
    tuned = _grow(sources, None, files, root="tuned", build={"duckdb_memory": "256MB", "duckdb_threads": 1})
    assert configs[0]["memory_limit"] == "2GB" and "threads" not in configs[0]
    assert configs[-1]["memory_limit"] == "256MB" and configs[-1]["threads"] == 1
    assert tuned.fingerprint == plain.fingerprint
    assert ({p.relative_to(plain.path): p.read_bytes() for p in plain.path.rglob("*.arrow")}
            == {p.relative_to(tuned.path): p.read_bytes() for p in tuned.path.rglob("*.arrow")})

def test_the_cache_is_no_bigger_than_its_source_parquet(tmp_path):
    """The product's promise: the cache is roughly 1:1 with the extracted source (it was 3-4x while its
    Arrow buffers were uncompressed). Monthly partitions of generated purchases, written as extraction
    writes them (zstd Parquet), against every file of the cache folder."""
    import duckdb

    from habitus.models.storage.files import folder_bytes
    from habitus.pipelines.demo.data import generate_demo_warehouse
    from habitus.resources.warehouses.canonical import PARQUET_OPTIONS

    generate_demo_warehouse(tmp_path / "w.duckdb", customers=3000, products=300, stores=8, seed=1,
                            start="2026-03-01", end="2026-05-31")
    con = duckdb.connect(str(tmp_path / "w.duckdb"), read_only=True)
    events, products = [], tmp_path / "products.parquet"
    for month in ("03", "04", "05"):
        table = con.sql(f"SELECT customer_id, ts, product_id, store_id, quantity, price FROM purchases "
                        f"WHERE strftime(ts, '%m') = '{month}' ORDER BY ts").to_arrow_table()
        events.append(tmp_path / f"2026-{month}-01.parquet")
        pq.write_table(table, events[-1], **PARQUET_OPTIONS)
    pq.write_table(con.sql("SELECT product_id, category, brand, price_tier FROM products").to_arrow_table(), products,
                   **PARQUET_OPTIONS)
    con.close()
    spec_events = TableInput("purchases", [str(f) for f in events],
                             {"product_id": "categorical", "store_id": "categorical", "quantity": "numeric",
                              "price": "numeric"}, timestamp="ts")
    spec_products = TableInput("products", [str(products)], {"category": "categorical", "brand": "categorical",
                                                              "price_tier": "categorical"}, key="product_id")
    from habitus.models.cache import CacheSpec

    folder = build_cache(CacheSpec(entity="customer_id", events=[spec_events], attributes=[spec_products]),
                         tmp_path / "cache")
    source = sum(f.stat().st_size for f in [*events, products])
    ratio = folder_bytes(folder) / source
    assert Cache(folder).manifest["n_events"] > 50_000
    assert ratio <= 1.0, f"cache {folder_bytes(folder):,} bytes vs source {source:,}: {ratio:.2f}x"
