"""Each check's message names its real cause first (habitus.assets.checks.keys_message)."""

from habitus.assets.checks import keys_message


def test_duplicates_alone_are_named_as_the_cause():
    msg = keys_message({"rows": 1_406_039, "null_keys": 0, "duplicates": 5}, "household_id", "events", "all 12 file(s)")
    assert msg.startswith("all 12 file(s): 5 duplicate rows (whole rows repeated")
    assert msg.endswith("no row without 'household_id'")
    assert "0 of" not in msg


def test_null_keys_and_repeated_attribute_keys():
    msg = keys_message({"rows": 82, "null_keys": 3, "duplicates": 2}, "product_id", "attributes", "partition x")
    assert msg == ("partition x: 3 of 82 rows without 'product_id' (dropped); 2 repeated 'product_id' values "
                   "(one row per key is used)")


def test_a_clean_source():
    assert keys_message({"rows": 10, "null_keys": 0, "duplicates": 0}, "customer_id", "events", "s") == \
        "s: every one of 10 rows has 'customer_id'; no duplicate rows"
