"""Property-based tests (hypothesis) on generated input: the config parser never fails with anything but
a ConfigError and substitutes secrets verbatim; the quarantine keeps every valid row and counts every
other; the encoder round-trips every kept event; the target functions match a plain-Python reference."""

import calendar
import math
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
from habitus.models.data.features import chunk_at
from habitus.models.cache.quarantine import DROP_REASONS, quarantine
from habitus.models.data.target_functions import resolve
from habitus.models.data.targets import TargetSpec, compute_target
from habitus.pipelines.config.project import ConfigError, load_project, parse_duration

NOW = calendar.timegm((2026, 11, 1, 0, 0, 0))
DAY = 86_400
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

BASE = {"workspace": "ws", "connections": {"w": {"type": "duckdb", "path": "x.duckdb"}}, "entity": "customer_id",
        "sources": [{"name": "e", "role": "events", "connection": "w", "table": "t", "timestamp": "ts",
                     "start": "2026-01-01"}]}


def _load(text: str):
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "project.yaml"
        path.write_text(text)
        return load_project(path)


# --------------------------------------------------------------------------- config parser

yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8)


@FAST
@given(st.text(max_size=200))
def test_any_text_is_a_project_or_a_config_error(text):
    try:
        _load(text)
    except ConfigError as e:
        assert str(e).startswith(str(Path(tempfile.gettempdir())))  # the message names the file
    except UnicodeEncodeError:
        pass  # a lone surrogate cannot even be written to the file


@FAST
@given(key=st.sampled_from(["foundation", "scenarios", "predictions", "quality", "sources", "entity", "schedules"]),
       value=yaml_values)
def test_any_value_under_a_known_key_is_a_project_or_a_config_error(key, value):
    cfg = {**BASE, key: value}
    try:
        text = yaml.safe_dump(cfg)
    except yaml.YAMLError:
        return
    try:
        _load(text)
    except ConfigError as e:
        assert "invalid project config" in str(e) or "not valid YAML" in str(e) or "expected a mapping" in str(e)


@FAST
@given(secret=st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40))
def test_secrets_are_substituted_verbatim_after_parsing(secret, monkeypatch):
    """A value with ':', ' #', quotes, braces or '${' stays exactly what the environment holds."""
    monkeypatch.setenv("HABITUS_PROP_VALUE", secret)
    vault = {"type": "snowflake", "account": "a", "password": "${HABITUS_PROP_VALUE}"}
    project = _load(yaml.safe_dump({**BASE, "connections": {**BASE["connections"], "v": vault}}))
    assert project.connections["v"].password == secret


@FAST
@given(n=st.integers(1, 10_000), unit=st.sampled_from(["d", "w"]), pad=st.sampled_from(["", " "]))
def test_durations(n, unit, pad):
    assert parse_duration(f"{pad}{n}{pad}{unit}{pad}").days == n * (7 if unit == "w" else 1)


# --------------------------------------------------------------------------- quarantine

entities = st.sampled_from(["a", "b", "c", "", "  ", None])
times = st.one_of(st.none(), st.sampled_from([-DAY, 0, NOW - 5 * DAY, NOW - DAY, NOW + DAY // 2, NOW + 3 * DAY]),
                  st.integers(0, NOW))
prices = st.one_of(st.none(), st.sampled_from([math.inf, -math.inf, math.nan, 0.0, 1.5]),
                   st.floats(-1e6, 1e6, allow_nan=False))
rows = st.lists(st.tuples(entities, times, st.integers(0, 1), st.sampled_from(["p1", "p2", None]), prices),
                max_size=40)


def _reference(data):
    """The quarantine in plain Python: (counts by drop reason, the kept rows as a set)."""
    counts, kept = Counter(), set()
    for e, t, src, product, price in data:
        if e is None:
            counts["null_entity"] += 1
        elif e.strip() == "":
            counts["blank_entity"] += 1
        elif t is None:
            counts["null_timestamp"] += 1
        elif t < 0:
            counts["timestamp_before_1970"] += 1
        elif t > NOW + DAY:
            counts["timestamp_in_future"] += 1
        else:
            row = (e, t, src, product, price if price is not None and math.isfinite(price) else None)
            if row in kept:
                counts["duplicate_event"] += 1
            kept.add(row)
    return counts, kept


@FAST
@given(data=rows)
def test_quarantine_keeps_every_valid_row_and_counts_every_other(data):
    con = duckdb.connect()
    con.register("arrow_rows", pa.table({
        "__entity": pa.array([r[0] for r in data], pa.string()),
        "__ts": pa.array([None if r[1] is None else r[1] * 1_000_000 for r in data], pa.timestamp("us")),
        "__source": pa.array([r[2] for r in data], pa.int32()),
        "product_id": pa.array([r[3] for r in data], pa.string()),
        "price": pa.array([r[4] for r in data], pa.float64())}))
    con.sql("CREATE TEMP VIEW raw AS SELECT * FROM arrow_rows")
    kept, counts = quarantine(con, "raw", {"product_id": "categorical", "price": "numeric"}, now_s=NOW)
    expected, expected_rows = _reference(data)
    assert {r: counts[r] for r in DROP_REASONS} == {r: expected.get(r, 0) for r in DROP_REASONS}
    got = {(e, int(t.timestamp()) if t else None, s, p, v)
           for e, t, s, p, v in con.sql(f'SELECT * FROM "{kept}"').fetchall()}
    assert got == {(e, t, s, p, v) for e, t, s, p, v in expected_rows}  # rows lost: 0
    assert counts["rows_kept"] + sum(counts[r] for r in DROP_REASONS) == counts["rows_in"] == len(data)
    valid = [v for e, t, s, p, v in data if e is not None and e.strip() and t is not None and 0 <= t <= NOW + DAY]
    assert counts["numeric_not_finite"] == sum(1 for v in valid if v is not None and not math.isfinite(v))
    con.close()


# --------------------------------------------------------------------------- encoder and targets

events = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 60 * 24), st.sampled_from(["p1", "p2", "p3", None]),
                            st.one_of(st.none(), st.floats(0, 1000, allow_nan=False, width=32))),
                  min_size=1, max_size=60)


def _cache(data, folder: Path) -> Cache:
    """Events of generated customers (id, hours after T0, product, price) -> a built cache."""
    t0 = NOW - 60 * DAY
    table = pa.table({"customer_id": pa.array([f"c{c}" for c, *_ in data], pa.string()),
                      "ts": pa.array([(t0 + h * 3600) for _, h, _, _ in data], pa.timestamp("s")),
                      "product_id": pa.array([p for _, _, p, _ in data], pa.string()),
                      "price": pa.array([v for *_, v in data], pa.float64())})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "events.parquet")
    spec = CacheSpec("customer_id", [TableInput("ev", [str(folder / "events.parquet")],
                                                {"product_id": "categorical", "price": "numeric"}, timestamp="ts")],
                     shard_events=25)
    return Cache(build_cache(spec, folder / "cache", log=lambda _: None))


def _decoded(cache: Cache) -> Counter:
    vocab = [None] + cache.vocab("product_id").column("value").to_pylist()
    out = Counter()
    for s in range(cache.shard_count):
        sh = cache.shard(s)
        ids = cache.entity_ids(sh.entity).to_pylist()
        for e, t, p, v in zip(ids, sh.ts.tolist(), sh.columns["product_id"].tolist(), sh.columns["price"].tolist()):
            out[(e, t, vocab[p], None if math.isnan(v) else v)] += 1
    return out


@SLOW
@given(data=events)
def test_encoder_round_trips_every_event(data, tmp_path_factory):
    cache = _cache(data, tmp_path_factory.mktemp("enc"))
    t0 = NOW - 60 * DAY
    want = Counter((f"c{c}", t0 + h * 3600, p, None if v is None else float(np.float32(v))) for c, h, p, v in data)
    # duplicates are dropped by the quarantine where the cache uses it; compare the distinct events then
    got = _decoded(cache)
    assert set(got) == set(want)
    assert sum(got.values()) in (sum(want.values()), len(want))


FUNCTION_MODULE = textwrap.dedent("""
    def future_count(history, future, entities):
        counts = [0] * entities.num_rows
        for r in future.column("row").to_pylist():
            counts[r] += 1
        return counts
""")


@SLOW
@given(data=events, cutoff_day=st.integers(10, 50), window=st.integers(1, 14))
def test_targets_match_a_plain_python_reference(data, cutoff_day, window, tmp_path_factory):
    folder = tmp_path_factory.mktemp("targets")
    cache = _cache(data, folder)
    (folder / "habitus_prop_targets.py").write_text(FUNCTION_MODULE)
    sys.path.insert(0, str(folder))
    try:
        t0 = NOW - 60 * DAY
        cutoff = t0 + cutoff_day * DAY
        by_entity: dict[str, list] = {}
        for c, h, p, v in data:
            by_entity.setdefault(f"c{c}", []).append((t0 + h * 3600, v))
        specs = {"no_event": TargetSpec("no_event", window), "count": TargetSpec("count", window),
                 "sum": TargetSpec("sum", window, "price"),
                 "function": TargetSpec("function", window, function="habitus_prop_targets:future_count")}
        for s in range(cache.shard_count):
            sh = cache.shard(s)
            chunk = chunk_at(sh, 0, len(sh.entities), cutoff)
            names = cache.entity_ids(chunk.entities).to_pylist()
            for kind, spec in specs.items():
                got = compute_target(chunk, spec, cache=cache)
                for name, value in zip(names, np.asarray(got).tolist()):
                    evs = by_entity[name]
                    assert any(t <= cutoff for t, _ in evs)  # only entities with history are rows
                    future = [(t, v) for t, v in evs if cutoff < t <= cutoff + window * DAY]
                    expected = {"no_event": float(not future), "count": float(len(future)),
                                "function": float(len(future)),
                                "sum": float(np.float32(sum(float(np.float32(v)) for _, v in future if v is not None)))}[kind]
                    assert value == pytest.approx(expected, rel=1e-5, abs=1e-3), (kind, name)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("habitus_prop_targets", None)
        resolve.cache_clear()


@pytest.mark.parametrize("ref", ["os.system('id')", "__import__('os').system:x", "../evil:f", "mod:func; import os",
                                 "mod:func()", "mod", ":f", "a..b:f"])
def test_target_function_refs_that_are_not_module_function_are_refused(ref):
    cfg = {**BASE, "scenarios": {"s": {"task": "binary", "target": {"function": ref, "within": "14d"}}}}
    with pytest.raises(ConfigError, match=r"scenarios\.s\.target\.function"):
        _load(yaml.safe_dump(cfg))
    with pytest.raises(ValueError, match="package.module:function"):
        resolve(ref, "s")


def test_only_the_named_module_is_imported(tmp_path, monkeypatch):
    (tmp_path / "habitus_named.py").write_text("def f(history, future, entities):\n    return []\n")
    (tmp_path / "habitus_unnamed.py").write_text("raise SystemExit('must never be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert resolve("habitus_named:f", "s").__name__ == "f"
        assert "habitus_unnamed" not in sys.modules
        with pytest.raises(ValueError, match="has no function 'g'"):
            resolve("habitus_named:g", "s")
        with pytest.raises(ValueError, match="cannot import module 'habitus_missing_mod'"):
            resolve("habitus_missing_mod:f", "s")
    finally:
        sys.modules.pop("habitus_named", None)
        resolve.cache_clear()
