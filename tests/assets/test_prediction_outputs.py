"""The outputs' options: `predictions.format: all` (every multilabel label, best first) and
`predictions.without_history: flag` (a row with null scores for each entity without history)."""

from datetime import datetime

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.cli import materialize_all
from pipelines.config import load_project

pytestmark = pytest.mark.slow

DAY, AS_OF = "2026-10-20", datetime(2026, 10, 21)


@pytest.fixture(scope="module")
def scored(tmp_path_factory, small_project):
    root = tmp_path_factory.mktemp("outputs")
    config = small_project.config(
        events={"end": "2026-11-01"}, foundation={"batch_size": 256},
        scenarios={"churn": small_project.churn(epochs=1), "brands": small_project.brands(6, epochs=1)},
        predictions={"top_k": 2, "format": "all", "without_history": "flag", "start": "2026-10-01",
                     "sink": {"connection": "warehouse", "table": "scores"}})
    project = load_project(small_project.write(root, config, customers=250, products=60, stores=4, seed=6))
    materialize_all(project, log=lambda _: None, days=[DAY])
    con = duckdb.connect(str(root / "warehouse.duckdb"), read_only=True)
    try:
        customers = con.sql("SELECT count(*) FROM customers").fetchall()[0][0]
        buyers = con.sql(f"SELECT count(DISTINCT customer_id) FROM purchases WHERE ts <= TIMESTAMP '{AS_OF}'"
                         ).fetchall()[0][0]
        written = con.sql("SELECT count(*), count(*) FILTER (WHERE NOT has_history) FROM scores_churn").fetchall()[0]
    finally:
        con.close()
    return root, customers, buyers, written


def test_multilabel_all_writes_every_label_best_first(scored):
    root, customers, buyers, _ = scored
    table = pq.read_table(root / "ws" / "predictions" / "brands" / f"{DAY}.parquet")
    scored_rows = table.filter(table.column("has_history"))
    assert scored_rows.num_rows == buyers
    assert {len(x) for x in scored_rows.column("labels").to_pylist()} == {6}  # all 6 labels, not top_k 2
    assert {frozenset(x) for x in scored_rows.column("labels").to_pylist()} == \
        {frozenset(scored_rows.column("labels")[0].as_py())}  # the same label set for everyone
    scores = np.array(scored_rows.column("scores").to_pylist())
    assert (np.diff(scores, axis=1) <= 0).all()  # best first


def test_entities_without_history_get_a_flagged_row(scored):
    root, customers, buyers, written = scored
    assert customers > buyers  # the demo has customers who never bought
    for name, score_cols in (("brands", ["labels", "scores"]), ("churn", ["score"])):
        table = pq.read_table(root / "ws" / "predictions" / name / f"{DAY}.parquet")
        flagged = table.filter(pa.compute.invert(table.column("has_history")))
        assert flagged.num_rows == customers - buyers, name
        assert all(flagged.column(c).null_count == flagged.num_rows for c in score_cols)
        assert set(flagged.column("as_of").to_pylist()) == {AS_OF}
        assert flagged.column("customer_id").null_count == 0
        ids = table.column("customer_id").to_pylist()
        assert len(set(ids)) == len(ids)  # one row per entity
    # churn scores the active entities only (an event within active_within, 90 days): the flagged rows are
    # those without any event, not the lapsed ones
    churn = pq.read_table(root / "ws" / "predictions" / "churn" / f"{DAY}.parquet")
    assert churn.filter(churn.column("has_history")).num_rows <= buyers
    assert written == (churn.num_rows, customers - buyers)  # written back with the flag
