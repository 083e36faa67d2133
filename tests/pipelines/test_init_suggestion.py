"""`habitus init`'s suggestion as it stands: it materializes on the demo warehouse, it reads a Parquet
folder and a warehouse holding habitus's own write-back tables, and it warns with numbers about
volume, coverage and infrequent domains. No test here depends on today's date: data ends in the
past, and where "now" matters it is passed in."""

from datetime import date, datetime, timedelta

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from habitus.pipelines.cli import main as cli
from habitus.pipelines.run.runner import materialize_all
from habitus.pipelines.config.project import load_project
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.pipelines.init.profile import EventsVolume, profile_table
from habitus.pipelines.init.suggest import suggest
from habitus.resources.warehouses.duckdb import DuckDBWarehouse


@pytest.fixture(scope="module")
def materialized(tmp_path_factory):
    """The demo warehouse, init's suggestion written unchanged to a file, and every asset of it."""
    root = tmp_path_factory.mktemp("init_demo")
    generate_demo_warehouse(root / "warehouse.duckdb", customers=250, products=80, stores=6, seed=5)
    rc = cli(["init", "--duckdb", str(root / "warehouse.duckdb"), "--out", str(root / "suggested.yaml")])
    assert rc == 0
    project = load_project(root / "suggested.yaml")
    result = materialize_all(project, log=lambda _: None)
    return root, project, result


@pytest.mark.slow
def test_the_demo_suggestion_materializes_unchanged(materialized):
    root, project, result = materialized
    events = project.events_sources[0]
    # the demo's data ends on 2026-10-31: monthly partitions up to it, none after it
    assert (events.partition, events.start, events.end) == ("monthly", date(2026, 3, 1), date(2026, 11, 1))
    assert result["prediction_day"] == "2026-10-31"
    files = sorted((root / ".habitus" / "project" / "sources" / "purchases").glob("*.parquet"))
    assert [f.stem for f in files] == [f"2026-{m:02d}-01" for m in range(3, 11)]
    preds = pq.read_table(root / ".habitus" / "project" / "predictions" / "churn" / "2026-10-31.parquet")
    assert preds.num_rows > 0 and set(preds.column("as_of").to_pylist()) == {datetime(2026, 11, 1)}
    emb = pq.read_table(root / ".habitus" / "project" / "embeddings" / "2026-10-31.parquet")
    assert emb.num_rows >= preds.num_rows
    # on 250 customers only the volume guideline (a warning) and the baselines may fail
    assert all("volume_guidelines (warn)" in f or "beats_baselines" in f for f in result["checks_failed"]), \
        result["checks_failed"]


@pytest.mark.slow
def test_a_warehouse_holding_habitus_write_back_tables(materialized, habitus_init):
    """The demo warehouse after habitus wrote predictions back (one score column; labels and scores as
    lists): init skips those tables, and names them when asked for them."""
    root, project, result = materialized
    wh = DuckDBWarehouse(path=str(root / "warehouse.duckdb"))
    churn = pq.read_table(root / ".habitus" / "project" / "predictions" / "churn" / "2026-10-31.parquet")
    wh.write("habitus_scores_churn", churn.to_batches(), churn.schema)
    n = 300  # more rows than the purchases' sample would make it the "events" table if it were profiled
    multi = pa.table({"customer_id": [f"C{i:07d}" for i in range(n)],
                      "labels": pa.array([["b1", "b2"]] * n, pa.list_(pa.string())),
                      "scores": pa.array([[0.7, 0.2]] * n, pa.list_(pa.float32())),
                      "model_fingerprint": ["0123456789abcdef"] * n,
                      "as_of": pa.array([datetime(2026, 11, 1)] * n, pa.timestamp("s"))})
    wh.write("habitus_scores_brands", multi.to_batches(), multi.schema)
    out_file = root / "again.yaml"
    _, out, err = habitus_init.suggestion("--duckdb", str(root / "warehouse.duckdb"), "--out", str(out_file))
    assert "skipping habitus_scores_brands: written by habitus" in err
    assert "#   habitus_scores_churn: not used (written by habitus" in out
    again = load_project(out_file)
    assert [s.table for s in again.sources] == [s.table for s in project.sources]
    rc, _, err = habitus_init("--duckdb", str(root / "warehouse.duckdb"), "--tables", "purchases",
                              "habitus_scores_brands")
    assert rc == 2 and "--tables habitus_scores_brands: a table habitus wrote" in err


def test_a_list_column_of_an_input_is_left_out_with_its_type(duckdb_file):
    path = duckdb_file("w.duckdb", "CREATE TABLE t AS SELECT i % 7 AS customer_id, "
                       "TIMESTAMP '2026-01-01' + i * INTERVAL 1 HOUR AS ts, [i, i + 1] AS tags FROM range(100) r(i)")
    p = profile_table(DuckDBWarehouse(path=str(path)), "t")
    s = suggest([p], "wh", {"type": "duckdb", "path": str(path)}, entity="customer_id")
    assert s.config["sources"][0]["columns"] == []
    assert any(n.startswith("t.tags: left out (type list<") for n in s.notes), s.notes


def test_a_parquet_folder(tmp_path, habitus_init):
    """The demo tables as a folder of Parquet files, one of them a folder of parts."""
    db = tmp_path / "demo.duckdb"
    generate_demo_warehouse(db, customers=300, products=60, stores=5, seed=2)
    folder = tmp_path / "lake"
    (folder / "purchases").mkdir(parents=True)
    con = duckdb.connect(str(db), read_only=True)
    try:
        for t in ("customers", "products", "stores"):
            con.execute(f"COPY {t} TO '{folder / t}.parquet' (FORMAT parquet)")
        con.execute(f"COPY (SELECT * FROM purchases WHERE ts < TIMESTAMP '2026-07-01') TO "
                    f"'{folder / 'purchases' / 'a.parquet'}' (FORMAT parquet)")
        con.execute(f"COPY (SELECT * FROM purchases WHERE ts >= TIMESTAMP '2026-07-01') TO "
                    f"'{folder / 'purchases' / 'b.parquet'}' (FORMAT parquet)")
        buyers = con.execute("SELECT count(DISTINCT customer_id) FROM purchases").fetchall()[0][0]
    finally:
        con.close()
    out_file = tmp_path / "suggested.yaml"
    _, _, err = habitus_init.suggestion("--parquet", str(folder), "--out", str(out_file))
    project = load_project(out_file)
    assert project.connections["warehouse"].type == "parquet"
    ev = project.events_sources[0]
    assert (ev.table, ev.timestamp, project.entity, ev.end) == ("purchases", "ts", "customer_id", date(2026, 11, 1))
    assert {s.table: s.role for s in project.sources} == {"purchases": "events", "customers": "entity_attributes",
                                                          "products": "attributes", "stores": "attributes"}
    assert f"warning: volume: {buyers:,} entities in purchases (guideline: at least 10,000" in err


@pytest.fixture
def infrequent(duckdb_file):
    """600 households buying every 33 days or so for 200 days (dates, not times); attributes for 56% of them."""
    return duckdb_file(
        "w.duckdb",
        """CREATE TABLE orders AS SELECT 'H' || lpad(CAST(h AS VARCHAR), 5, '0') AS household_id,
           DATE '2017-01-01' + CAST(h % 33 + 33 * k + (h * k) % 3 AS INTEGER) AS order_date,
           (h * 7 + k) % 40 AS amount
           FROM range(600) a(h), range(6) b(k)""",
        """CREATE TABLE households AS SELECT 'H' || lpad(CAST(h AS VARCHAR), 5, '0') AS household_id,
           CASE WHEN h % 3 = 0 THEN 'urban' ELSE 'rural' END AS area,
           CASE WHEN h % 4 = 0 THEN 20 + h % 50 END AS age
           FROM range(336) a(h)""")


def test_an_infrequent_domain_gets_a_wider_churn_window_and_warnings(infrequent, habitus_init):
    cfg, out, err = habitus_init.suggestion("--duckdb", str(infrequent))
    ev = cfg["sources"][0]
    assert (ev["table"], ev["timestamp"], cfg["entity"]) == ("orders", "order_date", "household_id")
    target = cfg["scenarios"]["churn"]["target"]
    assert target["within"] == "105d" and target["active_within"] == "210d"  # 3 x 33 days, in whole weeks
    assert "warning: infrequent domain: the typical gap between an entity's active days is 33 days" in err
    assert "days of history is under the guideline of a year for infrequent domains" in err
    assert "warning: volume: 600 entities in orders (guideline: at least 10,000" in err
    assert "warning: coverage: households has a row for 56% of the entities of orders (336 of 600)" in err
    assert "warning: coverage: households.age is null in 75% of rows (252 of 336)" in err
    assert ev["end"] == date(2017, 8, 1)  # the newest order is from 2017-07-19


def _volume(rows: int, first: datetime, last: datetime, **kw) -> EventsVolume:
    return EventsVolume(rows=rows, first=first, last=last, per_month={}, entities=kw.pop("entities", 50_000),
                        scanned=rows, capped=False, **kw)


def test_end_and_grain_follow_the_data_not_the_clock(duckdb_file):
    path = duckdb_file("w.duckdb", "CREATE TABLE e AS SELECT i % 50 AS customer_id, "
                       "TIMESTAMP '2025-01-01' + i * INTERVAL 1 HOUR AS ts FROM range(2000) r(i)")
    p = profile_table(DuckDBWarehouse(path=str(path)), "e")
    conn = {"type": "duckdb", "path": str(path)}
    first, last = datetime(2025, 1, 1), datetime(2025, 12, 14, 18)
    # data still arriving (the newest event a day old): no end
    live = suggest([p], "wh", conn, "customer_id", _volume(10_000_000, first, last), now=last + timedelta(days=1))
    assert "end" not in live.config["sources"][0]
    # stopped long ago: end at the end of the newest event's partition; 10M events over 11.5 months are monthly
    stopped = suggest([p], "wh", conn, "customer_id", _volume(10_000_000, first, last), now=datetime(2027, 3, 1))
    ev = stopped.config["sources"][0]
    assert (ev["partition"], ev["start"], ev["end"]) == ("monthly", date(2025, 1, 1), date(2026, 1, 1))
    assert not any(w.startswith("volume:") for w in stopped.warnings)
    # 100M events a year: a month would be 8M rows, so partitions are days; the end is the next day
    busy = suggest([p], "wh", conn, "customer_id", _volume(100_000_000, first, last), now=datetime(2027, 3, 1))
    ev = busy.config["sources"][0]
    assert (ev["partition"], ev["end"]) == ("daily", date(2025, 12, 15))
    assert any("daily partitions (over 3,000,000 events a month)" in n for n in busy.notes)


def test_init_runs_from_any_folder_without_a_project_config(tmp_path, duckdb_file):
    """Outside the repository, with no HABITUS_CONFIG: importing the code location builds nothing."""
    import os
    import subprocess
    import sys

    duckdb_file("w.duckdb", "CREATE TABLE visits AS SELECT 'U' || CAST(i % 30 AS VARCHAR) AS user_id, "
                "TIMESTAMP '2025-05-01' + i * INTERVAL 3 HOUR AS ts, i % 4 AS channel FROM range(900) r(i)")
    env = {k: v for k, v in os.environ.items() if k != "HABITUS_CONFIG"}
    done = subprocess.run([sys.executable, "-c", "import sys; from habitus.pipelines.cli import main; sys.exit(main())",
                           "init", "--duckdb", "w.duckdb"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    cfg = yaml.safe_load(done.stdout)
    assert (cfg["entity"], cfg["sources"][0]["timestamp"]) == ("user_id", "ts")
    assert cfg["sources"][0]["end"] == date(2025, 9, 1)  # the newest visit is from 2025-08-21
