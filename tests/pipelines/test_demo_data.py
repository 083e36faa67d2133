"""Tests for the demo warehouse generator: shape, integrity, determinism, and learnable signal.

The signal tests compare the generated purchases with the same rows after shuffling product ids
(or timestamps) across customers: structure the models are meant to learn must beat that baseline.
"""

from datetime import date

import duckdb
import numpy as np
import pytest

from habitus.pipelines.demo.data import generate_demo_warehouse, main

START, END = "2026-03-01", "2026-10-31"
SMALL = dict(customers=400, products=300, stores=10, start=START, end=END)


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "warehouse.duckdb"
    counts = generate_demo_warehouse(path, seed=7, **SMALL)
    con = duckdb.connect(str(path), read_only=True)
    yield con, counts
    con.close()


def _column(con, sql):
    return con.execute(sql).fetchnumpy()


def _per_customer(customer, values, stat):
    """stat(values of one customer) for every customer, vectorized via a sort by customer."""
    order = np.argsort(customer, kind="stable")
    customer, values = customer[order], values[order]
    bounds = np.flatnonzero(np.r_[True, customer[1:] != customer[:-1], True])
    return np.array([stat(values[a:b]) for a, b in zip(bounds[:-1], bounds[1:])])


def _repeat_rate(values):
    return 1 - len(np.unique(values)) / len(values)


def _top_share(values):
    return np.unique(values, return_counts=True)[1].max() / len(values)


# --- shape and integrity ---------------------------------------------------------------------

def test_schema_and_counts(warehouse):
    con, counts = warehouse
    expected = {
        "customers": [("customer_id", "VARCHAR"), ("age", "INTEGER"), ("region", "VARCHAR"),
                      ("signup_date", "DATE"), ("segment", "VARCHAR")],
        "products": [("product_id", "VARCHAR"), ("category", "VARCHAR"), ("brand", "VARCHAR"),
                     ("price_tier", "VARCHAR"), ("price", "DOUBLE")],
        "stores": [("store_id", "VARCHAR"), ("region", "VARCHAR"), ("format", "VARCHAR")],
        "purchases": [("customer_id", "VARCHAR"), ("ts", "TIMESTAMP"), ("product_id", "VARCHAR"),
                      ("store_id", "VARCHAR"), ("quantity", "INTEGER"), ("price", "DOUBLE")],
    }
    for table, columns in expected.items():
        assert [tuple(r[:2]) for r in con.execute(f"DESCRIBE {table}").fetchall()] == columns
        assert con.execute(f"SELECT count(*) FROM {table}").fetchone()[0] == counts[table]
    assert counts["customers"] == 400 and counts["products"] == 300 and counts["stores"] == 10
    # ~50 purchase rows per customer over eight months, scaled with the customer count.
    assert 20 * 400 < counts["purchases"] < 100 * 400


def test_values_look_like_a_retail_warehouse(warehouse):
    con, _ = warehouse
    assert con.execute("SELECT count(*) FROM customers WHERE NOT regexp_full_match(customer_id, 'C[0-9]{7}')").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM products WHERE NOT regexp_full_match(product_id, 'P[0-9]{6}')").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM stores WHERE NOT regexp_full_match(store_id, 'S[0-9]{3}')").fetchone()[0] == 0
    for table, key in [("customers", "customer_id"), ("products", "product_id"), ("stores", "store_id")]:
        assert con.execute(f"SELECT count(DISTINCT {key}) = count(*) FROM {table}").fetchone()[0]
    segments = {r[0] for r in con.execute("SELECT DISTINCT segment FROM customers").fetchall()}
    assert segments == {"value", "regular", "premium", "family"}
    tiers = {r[0] for r in con.execute("SELECT DISTINCT price_tier FROM products").fetchall()}
    assert tiers == {"budget", "mid", "premium"}
    n_regions, min_age, max_age = con.execute("SELECT count(DISTINCT region), min(age), max(age) FROM customers").fetchone()
    assert 2 <= n_regions <= 8 and min_age >= 18 and max_age <= 100
    assert con.execute("SELECT count(DISTINCT category) FROM products").fetchone()[0] >= 10
    # Every brand sells in one or two categories.
    assert con.execute("SELECT max(n) FROM (SELECT count(DISTINCT category) n FROM products GROUP BY brand)").fetchone()[0] <= 2
    assert con.execute("SELECT min(price) > 0 AND min(quantity) >= 1 FROM purchases").fetchone()[0]
    assert con.execute("SELECT count(*) FROM purchases WHERE price IS NULL OR ts IS NULL").fetchone()[0] == 0


def test_referential_integrity(warehouse):
    con, _ = warehouse
    for table, key in [("customers", "customer_id"), ("products", "product_id"), ("stores", "store_id")]:
        orphans = con.execute(f"SELECT count(*) FROM purchases p ANTI JOIN {table} t USING ({key})").fetchone()[0]
        assert orphans == 0, f"purchases reference missing {table}"


def test_timestamps_in_period_shop_hours_and_sorted(warehouse):
    con, _ = warehouse
    ts = _column(con, "SELECT ts FROM purchases")["ts"]  # insertion order, as written
    assert ts.min() >= np.datetime64(START)
    assert ts.max() < np.datetime64(END) + np.timedelta64(1, "D")
    assert np.all(np.diff(ts) >= np.timedelta64(0)), "purchases are not ordered by ts"
    hour = (ts - ts.astype("datetime64[D]")) / np.timedelta64(1, "h")
    assert hour.min() >= 8 and hour.max() < 22
    assert np.all(ts.astype("datetime64[s]") == ts), "timestamps have sub-second parts"


def test_signups_precede_purchases_and_keep_arriving(warehouse):
    con, _ = warehouse
    early = con.execute("SELECT count(*) FROM purchases JOIN customers USING (customer_id) "
                        "WHERE ts < signup_date").fetchone()[0]
    assert early == 0
    before, during = con.execute(f"SELECT count(*) FILTER (WHERE signup_date < DATE '{START}'), "
                                 f"count(*) FILTER (WHERE signup_date >= DATE '{START}') FROM customers").fetchone()
    assert before > 100 and during > 50
    # New customers keep arriving through the period, not only at its start.
    late = con.execute("SELECT count(*) FROM customers WHERE signup_date >= DATE '2026-08-01'").fetchone()[0]
    assert late > 20


# --- determinism and file handling ------------------------------------------------------------

def _dump(path):
    with duckdb.connect(str(path), read_only=True) as con:
        return {t: con.execute(f"SELECT * FROM {t}").fetchall()
                for t in ("customers", "products", "stores", "purchases")}


def test_same_seed_same_tables_other_seed_differs(tmp_path):
    small = dict(SMALL, customers=150, products=120)
    generate_demo_warehouse(tmp_path / "a.duckdb", seed=3, **small)
    generate_demo_warehouse(tmp_path / "b.duckdb", seed=3, **small)
    generate_demo_warehouse(tmp_path / "c.duckdb", seed=4, **small)
    a, b, c = (_dump(tmp_path / f"{n}.duckdb") for n in "abc")
    assert a == b
    assert a["purchases"] != c["purchases"] and a["customers"] != c["customers"]


def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "warehouse.duckdb"
    with duckdb.connect(str(path)) as con:
        con.execute("CREATE TABLE stale AS SELECT 1 AS x")
        con.execute("CREATE TABLE customers AS SELECT 'old' AS customer_id")
    (tmp_path / "warehouse.duckdb.tmp").write_text("left over from a crash")

    counts = generate_demo_warehouse(str(path), seed=1, **dict(SMALL, customers=100, products=90))
    with duckdb.connect(str(path), read_only=True) as con:
        tables = {r[0] for r in con.execute("SHOW TABLES").fetchall()}
        assert tables == {"customers", "products", "stores", "purchases"}
        assert con.execute("SELECT count(*) FROM customers").fetchone()[0] == counts["customers"] == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["warehouse.duckdb"]


def test_rejects_an_empty_period(tmp_path):
    with pytest.raises(ValueError):
        generate_demo_warehouse(tmp_path / "x.duckdb", start="2026-05-01", end="2026-04-30")


def test_command_line_prints_counts(tmp_path, capsys):
    out = tmp_path / "sub" / "demo.duckdb"
    main(["--out", str(out), "--customers", "60", "--products", "90", "--seed", "2",
          "--start", "2026-03-01", "--end", "2026-04-30"])
    printed = capsys.readouterr().out
    assert "purchases" in printed and "customers" in printed and out.exists()
    with duckdb.connect(str(out), read_only=True) as con:
        assert con.execute("SELECT max(ts) < TIMESTAMP '2026-05-01' FROM purchases").fetchone()[0]


# --- learnable signal ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows(warehouse):
    con, _ = warehouse
    return _column(con, """
        SELECT p.customer_id, p.ts, p.product_id, pr.category, pr.price_tier, c.segment,
               c.region AS customer_region, s.region AS store_region
        FROM purchases p JOIN products pr USING (product_id) JOIN customers c USING (customer_id)
             JOIN stores s USING (store_id)""")


def _shuffled(rows, column):
    return np.random.default_rng(0).permutation(rows[column])


def _regulars(rows, minimum=20):
    customers, counts = np.unique(rows["customer_id"], return_counts=True)
    return np.isin(rows["customer_id"], customers[counts >= minimum])


def test_customers_concentrate_on_few_categories(rows):
    keep = _regulars(rows)
    customer = rows["customer_id"][keep]
    real = _per_customer(customer, rows["category"][keep], _top_share).mean()
    random = _per_customer(customer, _shuffled(rows, "category")[keep], _top_share).mean()
    assert real > 0.3 and real > random + 0.1, (real, random)


def test_customers_buy_the_same_products_again(rows):
    keep = _regulars(rows)
    customer = rows["customer_id"][keep]
    real = _per_customer(customer, rows["product_id"][keep], _repeat_rate).mean()
    random = _per_customer(customer, _shuffled(rows, "product_id")[keep], _repeat_rate).mean()
    assert real > random + 0.15, (real, random)


def test_some_customers_churn(rows):
    end = np.datetime64(END) + np.timedelta64(1, "D")
    customer, ts = rows["customer_id"], rows["ts"]
    first = _per_customer(customer, ts, np.min)
    last = _per_customer(customer, ts, np.max)
    active_early = first < np.datetime64(START) + np.timedelta64(60, "D")
    lapsed = last < end - np.timedelta64(30, "D")
    share = lapsed[active_early].mean()
    # With ~50 purchases per customer spread evenly, almost nobody would be silent for 30 days.
    assert 0.15 < share < 0.7, share


def test_churners_slow_down_before_leaving(tmp_path):
    """Lapsed customers shopped less often in the six weeks before their last visit than earlier.

    Pooled over customers, since each has only a handful of visits; the first and last shopping
    days are left out of the counts because they are there by selection. Without the pre-churn
    slowdown the ratio is ~1.0; the effect is small, hence 2,000 customers here.
    """
    path = tmp_path / "warehouse.duckdb"
    generate_demo_warehouse(path, seed=7, **dict(SMALL, customers=2000))
    with duckdb.connect(str(path), read_only=True) as con:
        purchases = _column(con, "SELECT customer_id, ts::DATE AS day FROM purchases")
    end = np.datetime64(END) + np.timedelta64(1, "D")
    window = np.timedelta64(42, "D")

    def visit_days(days):
        """(visit days in the window before the last, visit days before that, length of that span)"""
        first, last = days.min(), days.max()
        if last >= end - np.timedelta64(30, "D") or last - first < 2 * window:
            return np.full(3, np.nan)
        days = np.unique(days)[1:-1]
        return np.array([(days > last - window).sum(), (days <= last - window).sum(),
                         (last - window - first).astype(int)])

    counts = np.stack(_per_customer(purchases["customer_id"], purchases["day"].astype("datetime64[D]"), visit_days))
    counts = counts[~np.isnan(counts[:, 0])]
    recent_rate = counts[:, 0].sum() / (41 * len(counts))
    earlier_rate = counts[:, 1].sum() / counts[:, 2].sum()
    assert len(counts) > 100 and recent_rate < 0.9 * earlier_rate, (len(counts), recent_rate / earlier_rate)


def test_weekends_are_busier(rows):
    day = rows["ts"].astype("datetime64[D]")
    days, per_day = np.unique(day, return_counts=True)
    weekday = (days.astype(np.int64) + 3) % 7  # Monday = 0
    weekend = weekday >= 5
    assert per_day[weekend].mean() > 1.15 * per_day[~weekend].mean()


def test_customers_shop_in_their_region(rows):
    assert (rows["customer_region"] == rows["store_region"]).mean() > 0.85


def test_price_tier_depends_on_segment(rows):
    budget = rows["price_tier"] == "budget"
    by_segment = {s: budget[rows["segment"] == s].mean() for s in ("value", "premium")}
    assert by_segment["value"] > by_segment["premium"] + 0.1, by_segment


def test_append_day_adds_the_next_day_only(tmp_path):
    from habitus.pipelines.demo.data import append_demo_day

    path = tmp_path / "w.duckdb"
    generate_demo_warehouse(path, customers=300, products=40, stores=3, start="2026-09-01", end="2026-09-30")
    con = duckdb.connect(str(path))
    before = con.sql("SELECT count(*) FROM purchases").fetchall()[0][0]
    con.close()
    day, rows = append_demo_day(path)
    assert day == "2026-10-01" and rows > 0
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.sql("SELECT count(*) FROM purchases").fetchall()[0][0] == before + rows
        assert con.sql("SELECT count(*), min(ts)::DATE, max(ts)::DATE FROM purchases WHERE ts >= DATE '2026-10-01'"
                       ).fetchall()[0] == (rows, date(2026, 10, 1), date(2026, 10, 1))
        # the new day's customers and products exist in the attribute tables (the joins keep working)
        assert con.sql("SELECT count(*) FROM purchases p ANTI JOIN customers c USING (customer_id) "
                       "WHERE p.ts >= DATE '2026-10-01'").fetchall()[0][0] == 0
        assert con.sql("SELECT count(*) FROM purchases p ANTI JOIN products c USING (product_id) "
                       "WHERE p.ts >= DATE '2026-10-01'").fetchall()[0][0] == 0
    finally:
        con.close()
