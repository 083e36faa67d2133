"""habitus.models.cache.quarantine on DuckDB directly: every bad row is dropped or repaired for one counted reason,
every valid row is kept (rows lost: 0), and hostile names reach SQL only quoted."""

import calendar
import math
from datetime import datetime

import duckdb
import pyarrow as pa
import pytest

from habitus.models.cache.quarantine import DROP_REASONS, quarantine, summary

NOW = calendar.timegm((2026, 11, 1, 0, 0, 0))
DAY = 86_400
COLUMNS = {"product_id": "categorical", "price": "numeric"}


def _view(con, rows, name="raw_events", columns=("product_id", "price"), price_type=pa.float64()):
    """rows: (entity, ts seconds or None, source, product, price)."""
    table = pa.table({
        "__entity": pa.array([r[0] for r in rows], pa.string()),
        "__ts": pa.array([None if r[1] is None else r[1] * 1_000_000 for r in rows], pa.timestamp("us")),
        "__source": pa.array([r[2] for r in rows], pa.int32()),
        columns[0]: pa.array([r[3] for r in rows], pa.string()),
        columns[1]: pa.array([r[4] for r in rows], price_type),
    })
    con.register("arrow_rows", table)
    con.sql(f'CREATE OR REPLACE TEMP VIEW "{name.replace(chr(34), chr(34) * 2)}" AS SELECT * FROM arrow_rows')
    return name


def _rows(con, view):
    return con.sql(f'SELECT * FROM "{view}" ORDER BY ALL').fetchall()


def test_each_reason_is_counted_and_valid_rows_are_all_kept():
    con = duckdb.connect()
    t = NOW - 10 * DAY
    good = [("a", t, 0, "p1", 1.5), ("a", t + 60, 0, "p2", None), ("b", t, 1, None, 3.0),
            ("c", NOW + DAY // 2, 0, "p1", 2.0),  # half a day ahead: clock skew, kept
            ("d", 0, 0, "p1", 2.0)]  # 1970-01-01 exactly: kept
    bad = [(None, t, 0, "p1", 1.0), ("", t, 0, "p1", 1.0), ("  ", t, 0, "p1", 1.0), ("e", None, 0, "p1", 1.0),
           ("e", -1, 0, "p1", 1.0), ("e", NOW + 2 * DAY, 0, "p1", 1.0), ("e", 1_700_000_000_000, 0, "p1", 1.0),
           ("a", t, 0, "p1", 1.5), ("a", t, 0, "p1", 1.5)]  # two exact copies of the first good row
    repaired = [("f", t, 0, "p3", math.inf), ("f", t + 1, 0, "p3", -math.inf), ("f", t + 2, 0, "p3", math.nan)]
    kept, n = quarantine(con, _view(con, good + bad + repaired), COLUMNS, now_s=NOW)
    assert n["rows_in"] == len(good + bad + repaired)
    assert {r: n[r] for r in DROP_REASONS} == {
        "null_entity": 1, "blank_entity": 2, "null_timestamp": 1, "timestamp_before_1970": 1,
        "timestamp_in_future": 2, "duplicate_event": 2}
    assert n["numeric_not_finite"] == n["numeric_not_finite.price"] == 3 and n["rows_repaired"] == 3
    assert n["numeric_unparseable"] == 0
    assert n["rows_kept"] == len(good) + len(repaired)
    assert n["dropped_share"] == pytest.approx(9 / 17, abs=1e-6)
    rows = _rows(con, kept)
    kept_keys = {(r[0], r[2], r[3]) for r in rows}
    for e, ts, src, product, _ in good:  # rows lost: 0
        assert (e, src, product) in kept_keys
    assert [r[4] for r in rows if r[0] == "f"] == [None, None, None]
    assert summary(n).startswith("17 rows in, 8 kept: 1 null entity, 2 blank entity") and "3 numeric not finite" in summary(n)


def test_rows_differing_in_any_column_are_not_duplicates():
    con = duckdb.connect()
    t = NOW - DAY
    rows = [("a", t, 0, "p1", 1.0), ("a", t, 1, "p1", 1.0), ("a", t, 0, "p2", 1.0), ("a", t, 0, "p1", 2.0),
            ("a", t + 1, 0, "p1", 1.0), ("a", t, 0, None, 1.0), ("a", t, 0, None, 1.0)]
    _, n = quarantine(con, _view(con, rows), COLUMNS, now_s=NOW)
    assert n["duplicate_event"] == 1 and n["rows_kept"] == 6


def test_text_in_a_numeric_column_is_repaired_and_counted():
    con = duckdb.connect()
    rows = [("a", NOW - DAY, 0, "p1", "12.5"), ("a", NOW - DAY + 1, 0, "p1", "n/a"), ("a", NOW - DAY + 2, 0, "p1", None)]
    kept, n = quarantine(con, _view(con, rows, price_type=pa.string()), COLUMNS, now_s=NOW)
    assert n["numeric_unparseable"] == n["numeric_unparseable.price"] == 1
    assert sorted((r[4] for r in _rows(con, kept)), key=lambda v: (v is None, v)) == [12.5, None, None]


def test_clean_input_passes_unchanged():
    con = duckdb.connect()
    rows = [(f"c{i}", NOW - i * 3600, i % 2, f"p{i % 5}", float(i)) for i in range(200)]
    kept, n = quarantine(con, _view(con, rows), COLUMNS, now_s=NOW)
    assert n["rows_kept"] == n["rows_in"] == 200 and n["dropped_share"] == 0 and n["repaired_share"] == 0
    assert "nothing dropped or repaired" in summary(n)
    assert len(_rows(con, kept)) == 200


def test_empty_input_counts_zero():
    con = duckdb.connect()
    kept, n = quarantine(con, _view(con, []), COLUMNS, now_s=NOW)
    assert n["rows_in"] == n["rows_kept"] == 0 and n["dropped_share"] == 0.0
    assert _rows(con, kept) == []


def test_hostile_view_and_column_names_stay_quoted():
    con = duckdb.connect()
    con.sql("CREATE TABLE y AS SELECT 1 AS x")
    hostile = 'x"; DROP TABLE y; --'
    columns = (hostile, "price'); DROP TABLE y; --")
    view = _view(con, [("a", NOW - DAY, 0, "p1", math.inf)], name='ev"; DROP TABLE y; --', columns=columns)
    kept, n = quarantine(con, view, {columns[0]: "categorical", columns[1]: "numeric"}, now_s=NOW)
    assert n["rows_kept"] == 1 and n[f"numeric_not_finite.{columns[1]}"] == 1
    assert con.sql("SELECT * FROM y").fetchall() == [(1,)]  # still there
    assert [d[0] for d in con.sql(f'SELECT * FROM "{kept.replace(chr(34), chr(34) * 2)}"').description][3:] == list(columns)


def test_unknown_column_type_is_refused():
    con = duckdb.connect()
    with pytest.raises(ValueError, match="'when'.*timestamp"):
        quarantine(con, _view(con, []), {"when": "timestamp"}, now_s=NOW)


def test_columns_not_named_pass_through_unchanged():
    con = duckdb.connect()
    con.sql("CREATE TEMP VIEW v AS SELECT 'a' AS __entity, TIMESTAMP '2026-10-01' AS __ts, 0 AS __source, "
            "'p1' AS product_id, 'inf'::DOUBLE AS price, TIMESTAMP '2026-09-30 12:00' AS delivered_at")
    kept, n = quarantine(con, "v", COLUMNS, now_s=NOW)
    assert con.sql(f'SELECT product_id, price, delivered_at FROM "{kept}"').fetchall() == [
        ("p1", None, datetime(2026, 9, 30, 12, 0))]
    assert n["numeric_not_finite"] == 1 and n["rows_kept"] == 1
