"""Tests for habitus.resources.warehouses.bigquery up to the wire: type mapping and the typed time window. The real
client against an emulator is tested in tests/integration/test_connector_contract.py and
test_bigquery_connector.py."""

from datetime import datetime

import pyarrow as pa
import pytest
import sqlglot

from habitus.resources.warehouses.bigquery import BigQueryWarehouse, arrow_type, window
from habitus.resources.warehouses.errors import WarehouseError


@pytest.mark.parametrize("t, p, s, expected", [
    ("INTEGER", None, None, pa.int64()), ("INT64", None, None, pa.int64()), ("FLOAT", None, None, pa.float64()),
    ("NUMERIC", None, None, pa.decimal128(38, 9)), ("NUMERIC", 12, 2, pa.decimal128(12, 2)),
    ("BIGNUMERIC", None, None, pa.decimal256(76, 38)), ("STRING", None, None, pa.string()),
    ("BOOLEAN", None, None, pa.bool_()), ("DATE", None, None, pa.date32()),
    ("DATETIME", None, None, pa.timestamp("us")), ("TIMESTAMP", None, None, pa.timestamp("us", "UTC")),
    ("BYTES", None, None, pa.binary()), ("JSON", None, None, pa.string()),
])
def test_arrow_type(t, p, s, expected):
    assert arrow_type("c", t, "NULLABLE", p, s) == expected


def test_nested_fields_are_refused_by_name():
    with pytest.raises(WarehouseError, match="'tags'.*REPEATED"):
        arrow_type("tags", "STRING", "REPEATED")
    with pytest.raises(WarehouseError, match="'addr'.*RECORD"):
        arrow_type("addr", "RECORD")


def test_window_bounds_take_the_column_type():
    a, b = datetime(2026, 3, 1), datetime(2026, 4, 1, 6)
    assert window("ts", pa.timestamp("us"), a, b).sql("bigquery") == (
        "`ts` >= CAST('2026-03-01 00:00:00' AS DATETIME) AND `ts` < CAST('2026-04-01 06:00:00' AS DATETIME)")
    assert window("at", pa.timestamp("us", "UTC"), a, None).sql("bigquery") == (
        "`at` >= CAST('2026-03-01 00:00:00' AS TIMESTAMP)")
    # whole days: a bound inside a day moves to the next midnight, so [start, end) holds
    assert window("day", pa.date32(), datetime(2026, 3, 1, 12), b).sql("bigquery") == (
        "`day` >= CAST('2026-03-02' AS DATE) AND `day` < CAST('2026-04-02' AS DATE)")
    hostile = window("x`; DROP TABLE t; --", pa.timestamp("us"), a, None).sql("bigquery")
    assert len(sqlglot.parse(hostile, read="bigquery")) == 1 and "DROP" in hostile and hostile.startswith("`x\\`")


def test_table_references():
    wh = BigQueryWarehouse(project="proj", dataset="shop")
    assert wh._qualified("events") == "proj.shop.events"
    assert wh._qualified("other.events") == "proj.other.events"
    assert wh._qualified("p2.other.events") == "p2.other.events"
    with pytest.raises(WarehouseError, match="dataset"):
        BigQueryWarehouse(project="proj")._qualified("events")
