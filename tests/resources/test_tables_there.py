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
