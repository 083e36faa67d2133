"""No variable substitution in written data, against Spark's Thrift server (HiveServer2): labels and ids
such as `${env:HOME}` and `${hiveconf:x}` are written and read back unchanged, through the one-statement
and the staged write, with the session's substitution off (resources/warehouses/hive.py) and even with it switched
back on (the literals never hold `${`: resources/warehouses/remote.py text_literal)."""

import uuid
from datetime import datetime

import pyarrow as pa
import pytest

pytestmark = pytest.mark.integration

HOSTILE = ["${env:HOME}", "${hiveconf:x}", "${system:user.name}", "a${env:HOME}b${x}c$", "$", "${", "}${}", "{$}"]
SCHEMA = pa.schema([("customer_id", pa.string()), ("label", pa.string()), ("as_of", pa.timestamp("us"))])


@pytest.fixture(scope="module")
def wh(hive_server):
    from habitus.resources.warehouses.hive import HiveWarehouse

    boot = HiveWarehouse(name="lake", host="127.0.0.1", port=hive_server.port, username="habitus", auth="NONE")
    database = f"habitus_{uuid.uuid4().hex[:8]}"
    con = boot._connect()
    con.cursor().execute(f"CREATE DATABASE `{database}`")
    con.close()
    return boot.model_copy(update={"database": database})


def _write_and_read(wh, table: str, insert_rows: int) -> list[tuple]:
    day = datetime(2026, 3, 1)
    batch = pa.record_batch([pa.array(HOSTILE), pa.array(list(reversed(HOSTILE))), pa.array([day] * len(HOSTILE))],
                            schema=SCHEMA)
    assert wh.write(table, iter([batch]), SCHEMA, replace=("as_of", day), insert_rows=insert_rows) == len(HOSTILE)
    with wh._cursor(table) as cur:
        cur.execute(f"SELECT customer_id, label FROM `{table}`")
        return sorted(cur.fetchall())


def test_the_server_would_expand_variables_in_a_literal(wh):
    """The threat is real on this server: with substitution on, a literal's ${env:HOME} is replaced."""
    con = wh._connect()
    cur = con.cursor()
    cur.execute("SET spark.sql.variable.substitute=true")
    cur.execute("SELECT '${env:HOME}'")
    assert cur.fetchall()[0][0] != "${env:HOME}"
    con.close()


@pytest.mark.parametrize("insert_rows", [100, 3])  # one INSERT OVERWRITE ... VALUES; staged, then one SELECT
def test_hostile_labels_read_back_unchanged(wh, insert_rows):
    got = _write_and_read(wh, f"subst_{insert_rows}", insert_rows)
    assert got == sorted(zip(HOSTILE, reversed(HOSTILE)))


def test_hostile_labels_read_back_unchanged_with_substitution_switched_back_on(wh, monkeypatch):
    from habitus.resources.warehouses.hive import HiveWarehouse

    connect = HiveWarehouse._connect

    def substituting(self):
        con = connect(self)
        con.cursor().execute("SET spark.sql.variable.substitute=true")
        return con

    monkeypatch.setattr(HiveWarehouse, "_connect", substituting)
    got = _write_and_read(wh, "subst_on", 100)
    assert got == sorted(zip(HOSTILE, reversed(HOSTILE)))
