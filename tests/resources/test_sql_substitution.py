"""The SQL text of Hive's and Databricks' VALUES writes never holds `${` (HiveServer2 and Spark expand
`${env:...}` / `${hiveconf:...}` inside string literals): a value holding it is written as CONCAT of
pieces that rejoin to it. Databricks has no server here: this checks the statement its driver is given;
Hive's is checked against Spark's Thrift server in tests/integration/test_hive_substitution.py."""

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from habitus.resources.warehouses.databricks import values_sql
from habitus.resources.warehouses.hive import DIALECT as HIVE, _values
from habitus.resources.warehouses.remote import text_literal

HOSTILE = ["${env:DATABRICKS_TOKEN}", "${hiveconf:x}", "a${b}c${d}e", "$", "${", "}${}", "'${x}'", "\\${x}"]


@pytest.mark.parametrize("text", HOSTILE)
def test_databricks_values_hold_no_substitution(text):
    sql = values_sql("t", ["customer_id", "label"], [(text, "ok"), ("c1", text)])
    assert "${" not in sql and ("CONCAT(" in sql) == ("${" in text)


@pytest.mark.parametrize("text", HOSTILE)
def test_hive_values_hold_no_substitution(text):
    assert "${" not in _values([(text, 1)]).sql(HIVE)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("${}:ab'\\ "), max_size=12))
def test_the_pieces_rejoin_to_the_value(text):
    """Evaluated by an SQL engine (DuckDB: the same CONCAT and quoting), the literal is the text itself."""
    sql = text_literal(text).sql("duckdb")
    assert "${" not in sql
    assert duckdb.connect().execute(f"SELECT {sql}").fetchone()[0] == text
