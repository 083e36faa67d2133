"""`habitus init` on the demo warehouse and on a warehouse with the traps it must spot."""

from datetime import date

import pytest

from habitus.pipelines.config.project import load_project
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.pipelines.init.profile import profile_table
from habitus.pipelines.init.suggest import _key_format, suggest
from habitus.resources.warehouses.duckdb import DuckDBWarehouse


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "demo.duckdb"
    generate_demo_warehouse(path, customers=500, products=120)
    return path


def test_demo_warehouse_suggestion_matches_the_hand_written_config(demo, habitus_init, tmp_path):
    out_file = tmp_path / "suggested.yaml"
    cfg, out, err = habitus_init.suggestion("--duckdb", str(demo), "--out", str(out_file))
    assert cfg["entity"] == "customer_id"
    by_name = {s["name"]: s for s in cfg["sources"]}
    ev = cfg["sources"][0]
    assert (ev["name"], ev["role"], ev["timestamp"]) == ("purchases", "events", "ts")
    assert ev["columns"] == ["product_id", "store_id", "quantity", "price"] and "types" not in ev
    assert ev["start"] == date(2026, 3, 1)
    assert by_name["customers"]["role"] == "entity_attributes"
    assert by_name["customers"]["columns"] == ["age", "region", "signup_date", "segment"]
    assert (by_name["products"]["role"], by_name["products"]["key"]) == ("attributes", "product_id")
    assert (by_name["stores"]["role"], by_name["stores"]["key"]) == ("attributes", "store_id")
    # a 500-customer warehouse is below the volume guidelines; nothing else is wrong with it
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warned and all(w.startswith("warning: volume: ") for w in warned), warned
    assert ev["end"] == date(2026, 11, 1) and ev["partition"] == "monthly"
    assert "products.price: left out (a column named 'price' is already taken" in out
    # the suggestion is a valid project config as it stands
    project = load_project(out_file)
    assert [s.name for s in project.sources] == ["purchases", "customers", "products", "stores"]


@pytest.fixture
def traps(duckdb_file):
    return duckdb_file(
        "traps.duckdb",
        """CREATE TABLE events AS SELECT i AS event_id, 'C' || lpad(CAST(i % 40 AS VARCHAR), 4, '0') AS customer_id,
           TIMESTAMP '2026-04-03' + i * INTERVAL 1 HOUR AS event_time,
           'P' || CAST(i % 25 AS VARCHAR) AS product_id, 'Product ' || CAST(i % 25 AS VARCHAR) AS product_name,
           'EUR' AS currency, CAST(NULL AS VARCHAR) AS note, (i % 17) * 1.5 AS amount
           FROM range(2000) t(i)""",
        "CREATE TABLE customers AS SELECT i AS customer_id, 20 + i % 50 AS age FROM range(40) t(i)",
        "CREATE TABLE products AS SELECT 'p-' || CAST(i AS VARCHAR) AS product_id, "
        "CASE WHEN i % 2 = 0 THEN 'food' ELSE 'toys' END AS category FROM range(25) t(i)")


def test_traps_are_left_out_and_mismatched_keys_warned(traps, habitus_init):
    cfg, out, err = habitus_init.suggestion("--duckdb", str(traps))
    ev = cfg["sources"][0]
    assert (ev["table"], ev["timestamp"], cfg["entity"]) == ("events", "event_time", "customer_id")
    assert ev["columns"] == ["product_id", "amount"]
    assert ev["start"] == date(2026, 4, 1)
    assert "events.event_id: left out (unique per row" in out
    assert "events.currency: left out (constant ('EUR'))" in out
    assert "events.note: left out (always null)" in out
    assert "events.product_name: left out (one-to-one with product_id" in out
    # customers keyed by an INTEGER customer_id while events carry 'C0001'; products 'p-1' vs 'P1'
    assert "events.customer_id (string) -> customers.customer_id (int64): the key types differ" in out
    assert "only 0% of sampled event keys are found" in out
    assert "events.product_id (string) -> products.product_id (string): only 0% of sampled event keys are found " \
           "in the attribute table; formats A9 vs A-9" in out
    assert len([w for w in err.splitlines() if w.startswith("warning: events.") and " -> " in w]) == 3


def test_entity_override_and_errors(traps, habitus_init):
    cfg, _, _ = habitus_init.suggestion("--duckdb", str(traps), "--entity", "product_id", "--tables", "events",
                                        "products")
    assert cfg["entity"] == "product_id"
    rc, _, err = habitus_init("--duckdb", str(traps), "--entity", "nope")
    assert rc == 2 and "--entity nope: events has no such column" in err
    rc, _, err = habitus_init("--duckdb", str(traps), "--tables", "customers")
    assert rc == 2 and "no table has a timestamp" in err
    rc, _, err = habitus_init("--duckdb", str(traps), "--tables", "no_such_table")
    assert rc == 2 and "no_such_table" in err


def test_secrets_are_printed_as_references():
    """A connection given with a literal secret is printed with a ${VAR} in its place."""
    from habitus.pipelines.init.command import _hide_secrets

    assert _hide_secrets("wh", {"type": "snowflake", "password": "hunter2", "user": "bob"}) == \
        {"type": "snowflake", "password": "${WH_PASSWORD}", "user": "bob"}
    assert _hide_secrets("wh", {"password": "${SF_PASSWORD}"}) == {"password": "${SF_PASSWORD}"}


def test_profile_reads_a_bounded_sample(demo):
    p = profile_table(DuckDBWarehouse(path=str(demo)), "purchases", sample_rows=1000)
    assert p.rows == 1000 and p.capped
    assert p.columns["customer_id"].distinct <= 1000 and p.time_range["ts"][0].year == 2026
    s = suggest([p], "wh", {"type": "duckdb", "path": "x"}, entity="customer_id")
    assert s.config["sources"][0]["timestamp"] == "ts"


def test_key_format():
    assert _key_format(["C0001", "C0002"]) == "A9"
    assert _key_format(["p-1"]) == "A-9"
    assert _key_format([1, 22]) == "9"
