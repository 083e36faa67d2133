"""The list of tables a missing table's error ends with (resources/warehouses/errors.py `tables_there`): never a
failure of its own, never a listing inside a listing."""

from habitus.resources.warehouses.errors import WarehouseError, qualified_names, tables_there


def test_names_the_tables_up_to_the_limit():
    assert tables_there(lambda: ["customers", "events"]) == "; the tables there: customers, events"
    many = [f"t{i:02d}" for i in range(33)]
    assert tables_there(lambda: many, limit=3) == "; the tables there: t00, t01, t02, ... (30 more)"
    assert tables_there(lambda: []) == "; there are no tables there"


def test_a_failed_listing_adds_nothing():
    def refused():
        raise WarehouseError("permission denied on information_schema")

    assert tables_there(refused) == ""
    assert tables_there(lambda: 1 / 0) == ""


def test_a_listing_that_meets_a_missing_table_itself_does_not_list_again():
    """A connector whose `tables()` fails with its own missing-table error (a schema that does not exist) asks
    `tables_there` again from inside the listing: that inner call lists nothing, and the listing runs once."""
    calls = []

    def listing():
        calls.append(1)
        raise WarehouseError("information_schema.tables: does not exist" + tables_there(listing))

    assert tables_there(listing) == "" and calls == [1]
    assert tables_there(lambda: ["events"]) == "; the tables there: events"  # the guard is lifted afterwards


def test_qualified_names_name_other_schemas():
    rows = [("PUBLIC", "events", "PUBLIC"), ("RAW", "events", "PUBLIC"), ("PUBLIC", "customers", "PUBLIC")]
    assert qualified_names(rows) == ["customers", "events", "RAW.events"]


def test_duckdb_keeps_its_missing_table_error_when_the_listing_fails(tmp_path, monkeypatch):
    import duckdb
    import pytest

    from habitus.resources.warehouses.duckdb import DuckDBWarehouse

    path = str(tmp_path / "w.duckdb")
    duckdb.connect(path).execute("CREATE TABLE events AS SELECT 1 AS id").close()
    wh = DuckDBWarehouse(path=path)
    with pytest.raises(WarehouseError, match=r"table 'evnts' in DuckDB database .*; the tables there: events$"):
        wh.schema("evnts")

    def refused(self):
        raise WarehouseError("the listing failed")

    monkeypatch.setattr(DuckDBWarehouse, "tables", refused)
    with pytest.raises(WarehouseError) as err:
        wh.schema("evnts")
    assert "table 'evnts' in DuckDB database" in str(err.value) and "evnts" in str(err.value).split(": ", 1)[1]
    assert "tables there" not in str(err.value) and "listing failed" not in str(err.value)
