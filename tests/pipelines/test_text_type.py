"""`type: text` in a source's `types:` (habitus.models.cache.text): accepted where a text describes events
or items, refused with the source and column named elsewhere."""

import pytest
from pydantic import ValidationError

from habitus.pipelines.config.sources import Source

EVENTS = {"name": "purchases", "role": "events", "connection": "wh", "table": "purchases", "timestamp": "ts",
          "start": "2024-01-01"}


def test_a_text_column_is_accepted_in_events_and_attributes_sources():
    assert Source(**EVENTS, types={"product_name": "text"}).types == {"product_name": "text"}
    products = Source(name="products", role="attributes", connection="wh", table="products", key="product_id",
                      types={"description": "text"})
    assert products.types["description"] == "text"


@pytest.mark.parametrize("source, message", [
    ({"name": "customers", "role": "entity_attributes", "connection": "wh", "table": "customers",
      "types": {"bio": "text"}}, r"source 'customers': `type: text` \(\['bio'\]\) describes events or the items"),
    ({**EVENTS, "types": {"ts": "text"}}, r"source 'purchases': column 'ts' is the source's `timestamp` or `key`"),
    ({**EVENTS, "types": {"name": "txt"}}, r"types\.name\s+Input should be 'categorical', 'numeric', 'timestamp' or 'text'"),
])
def test_a_misplaced_text_type_fails_naming_the_source_and_column(source, message):
    with pytest.raises(ValidationError, match=message):
        Source(**source)
