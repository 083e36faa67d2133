"""Errors a new user meets, run through the `habitus` command as a person runs it: each names the source,
table, column or key at fault and what to do, and prints no traceback."""

import shutil

import pytest

from habitus.pipelines.cli import EXIT_OK, EXIT_STAGE_FAILED, EXIT_USAGE, main


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    from habitus.pipelines.demo.data import generate_demo_warehouse

    path = tmp_path_factory.mktemp("errors") / "warehouse.duckdb"
    generate_demo_warehouse(path, customers=40, products=20, stores=2, start="2026-09-01", end="2026-10-31", seed=3)
    return path


def _project(folder, small_project, warehouse, **keys):
    shutil.copy(warehouse, folder / "warehouse.duckdb")
    config = small_project.config(scenarios={"churn": small_project.churn()},
                                  events={"start": "2026-09-01", "end": "2026-11-01"}, **keys)
    return small_project.write(folder, config)


def _run(capsys, *argv) -> tuple[int, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_a_timestamp_stored_as_text_names_the_source_the_column_the_key_and_the_cast(tmp_path, capsys, warehouse,
                                                                                      small_project, duckdb_sql):
    config = _project(tmp_path, small_project, warehouse)
    duckdb_sql(tmp_path / "warehouse.duckdb",
               "CREATE TABLE p AS SELECT * REPLACE (CAST(ts AS VARCHAR) AS ts) FROM purchases",
               "DROP TABLE purchases", "ALTER TABLE p RENAME TO purchases")
    rc, text = _run(capsys, "materialize", "--config", str(config))
    assert rc == EXIT_STAGE_FAILED
    assert ("source 'purchases' (table 'purchases'): its `timestamp:` column 'ts' is stored as text (string), not as "
            "a timestamp") in text
    assert "CAST(ts AS TIMESTAMP) AS ts" in text
    assert "Cannot compare values" not in text and "Traceback" not in text


@pytest.mark.parametrize("kind", ["duckdb", "parquet"])
def test_a_missing_table_lists_the_tables_that_exist(tmp_path, capsys, warehouse, small_project, duckdb_sql, kind):
    connection = None
    if kind == "parquet":
        (tmp_path / "lake").mkdir()
        duckdb_sql(warehouse, *(f"COPY {t} TO '{tmp_path / 'lake' / t}.parquet' (FORMAT parquet)"
                                for t in ("customers", "products", "purchases")))
        connection = {"type": "parquet", "path": "lake"}
    config = _project(tmp_path, small_project, warehouse, connection=connection)
    text = config.read_text().replace("table: purchases", "table: purchase")
    config.write_text(text)
    rc, text = _run(capsys, "materialize", "--config", str(config))
    assert rc == EXIT_STAGE_FAILED
    listed = "customers, products, purchases" + (", stores" if kind == "duckdb" else "")
    assert "table 'purchase'" in text and f"the tables there: {listed}" in text, text
    assert "Traceback" not in text


def test_an_unknown_key_suggests_the_nearest_one(tmp_path, capsys, warehouse, small_project):
    config = _project(tmp_path, small_project, warehouse)
    text = (config.read_text().replace("timestamp: ts", "timestmap: ts").replace("hidden: 16", "hiden: 16")
            .replace("within: 28d", "withn: 28d").replace("path: warehouse.duckdb", "paht: warehouse.duckdb"))
    config.write_text(text)
    rc, text = _run(capsys, "report", "--config", str(config))
    assert rc == EXIT_USAGE
    for where, near in (("sources[0].timestmap", "timestamp"), ("foundation.hiden", "hidden"),
                        ("scenarios.churn.target.withn", "within"), ("connections.warehouse.paht", "path")):
        assert f"  - {where}: unknown key; did you mean `{near}`? (every key: docs/reference/config.md)" in text, text
    assert "Traceback" not in text


def test_an_unknown_key_with_nothing_close_asks_to_check_its_spelling(tmp_path, capsys, warehouse, small_project):
    config = _project(tmp_path, small_project, warehouse, colour="blue")
    rc, text = _run(capsys, "report", "--config", str(config))
    assert rc == EXIT_USAGE and "  - colour: unknown key (check its spelling; every key: docs/reference/config.md)" in text


def test_init_flags_times_stored_as_text_and_an_entity_below_the_guidelines(tmp_path, capsys, duckdb_file):
    path = duckdb_file(
        "shop.duckdb",
        # the events, their time stored as text: init cannot take them as the events table
        "CREATE TABLE purchases AS SELECT 'C' || (i % 500) AS customer_id, "
        "CAST(TIMESTAMP '2026-06-01' + INTERVAL (i) MINUTE AS VARCHAR) AS ts, i % 7 AS price FROM range(20000) t(i)",
        # a small timed table with three accounts: what init falls back on
        "CREATE TABLE logins AS SELECT 'A' || (i % 3) AS account_id, TIMESTAMP '2026-06-01' + INTERVAL (i) HOUR AS "
        "at, i % 2 AS device FROM range(300) t(i)")
    rc, text = _run(capsys, "init", "--duckdb", str(path))
    assert rc == EXIT_OK
    assert "warning: purchases.ts holds times stored as text (e.g. '2026-06-01 00:00:00'), which habitus does not " \
           "read as times; with 20,000 sampled rows against 300 of logins, purchases may be the events table" in text
    assert "CAST(ts AS TIMESTAMP) AS ts" in text
    assert ("warning: volume: 3 entities in logins (guideline: at least 10,000; below it the models are unreliable; "
            "the entity is account_id: if that is not what you score, name it with --entity)") in text
    assert "Traceback" not in text


def test_init_with_no_readable_time_names_the_text_time_column(tmp_path, capsys, duckdb_file):
    path = duckdb_file("shop.duckdb", "CREATE TABLE purchases AS SELECT 'C' || (i % 50) AS customer_id, "
                       "CAST(DATE '2026-06-01' + INTERVAL (i) HOUR AS VARCHAR) AS ts FROM range(2000) t(i)")
    rc, text = _run(capsys, "init", "--duckdb", str(path))
    assert rc == EXIT_USAGE
    assert "no table has a timestamp or date column" in text and "purchases.ts holds times stored as text" in text
    assert "Traceback" not in text
