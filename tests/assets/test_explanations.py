"""explanations/<scenario> end to end on a tiny generated warehouse: the asset writes its daily
partition, one row per reason of every entity predictions/<scenario> scored (`select: all`) or of
the highest-scored tenth (the default), and the reasons add up."""

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from habitus.pipelines.run.runner import materialize_all
from habitus.pipelines.config.project import load_project
from habitus.pipelines.orchestration.build import build_assets, build_resources

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_project):
    import dagster as dg

    root = tmp_path_factory.mktemp("explain")
    config = small_project.config(  # `end:` fixes every partition set: nothing here depends on today's date
        purchases=["product_id", "quantity", "price"], events={"end": "2026-09-01"}, customers=["age", "segment"],
        products=["category", "brand"], foundation={"batch_size": 256},
        scenarios={"churn": small_project.churn(epochs=1, explain={"top": 3, "steps": 32, "select": "all"}),
                   "brands": small_project.brands(6, epochs=1, explain={"top": 4, "per_entity": 2, "write_back": True})},
        predictions={"top_k": 3, "start": "2026-08-25", "sink": {"connection": "warehouse", "table": "scores"}})
    project = load_project(small_project.write(root, config, customers=300, products=80, stores=4, end="2026-08-31",
                                               seed=5))
    result = materialize_all(project, log=lambda _: None)
    day = result["prediction_day"]
    keys = [dg.AssetKey(["explanations", "churn"]), dg.AssetKey(["explanations", "brands"])]
    out = dg.materialize(build_assets(project), selection=keys, resources=build_resources(project), partition_key=day)
    assert out.success
    return root, day, {k.path[-1]: out.asset_materializations_for_node(f"explanations__{k.path[-1]}")[0].metadata
                       for k in keys}


def _columns(path) -> dict:
    return {k: np.asarray(v, dtype=object) for k, v in pq.read_table(path).to_pydict().items()}


def _by_entity(df: dict) -> dict:
    out = {}
    for i, c in enumerate(df["customer_id"]):
        out.setdefault(c, []).append(i)
    return {c: np.asarray(v) for c, v in out.items()}


def test_explanations_cover_the_scored_entities_and_add_up(run):
    root, day, meta = run
    df = _columns(root / "ws" / "explanations" / "churn" / f"{day}.parquet")
    assert {"customer_id", "label", "score", "baseline_score", "rank", "kind", "source", "column", "value",
            "contribution", "count", "days_since_last", "entity_value", "reason", "others", "gap",
            "model_fingerprint", "as_of"} <= set(df)
    scored = _columns(root / "ws" / "predictions" / "churn" / f"{day}.parquet")
    predicted = dict(zip(scored["customer_id"], scored["score"]))
    groups = _by_entity(df)
    assert set(groups) == set(predicted)  # every entity predictions scored
    for c, i in groups.items():
        assert list(df["rank"][i]) == list(range(1, len(i) + 1)) and len(i) <= 3
        contribution = df["contribution"][i].astype(float)
        assert np.all(np.diff(np.abs(contribution)) <= 1e-7)
        first = i[0]
        # the explanation's score is the one predictions wrote (both fp32 here), whichever head serves
        assert df["score"][first] == pytest.approx(predicted[c], abs=1e-5)
        # reasons + the rest + the integration's gap = score - baseline score
        assert contribution.sum() + df["others"][first] + df["gap"][first] == \
            pytest.approx(df["score"][first] - df["baseline_score"][first], abs=1e-4)
    assert len(set(df["baseline_score"])) == 1  # one "no history" baseline for everyone
    # (a head blending trees in adds the foundation representation's components the entity barely moves)
    assert set(df["kind"]) <= {"value", "recency", "frequency", "money", "attribute", "representation"}
    assert set(df["source"]) <= {"purchases", "customers", "products", "foundation"}
    values = df["kind"] == "value"
    assert all(n > 0 for n in df["count"][values]) and all(d >= 0 for d in df["days_since_last"][values])
    assert meta["churn"]["completeness_gap_relative"].value < 0.02 and meta["churn"]["over_tolerance"].value == 0
    assert re.fullmatch(r"network|(gbt|blend) \(trees weighted [01]\.\d\d\)", meta["churn"]["explained_head"].value)
    assert "data:image/png;base64," in meta["churn"]["global_importance"].value
    table = meta["churn"]["importance_table"].value
    assert "| purchases | recency |" in table or "| purchases | frequency |" in table


def test_multilabel_explains_the_best_labels_of_the_highest_scored_tenth(run):
    root, day, meta = run
    df = _columns(root / "ws" / "explanations" / "brands" / f"{day}.parquet")
    scored = _columns(root / "ws" / "predictions" / "brands" / f"{day}.parquet")
    best = {c: set(v[:2]) for c, v in zip(scored["customer_id"], scored["labels"])}
    assert all(v is not None for v in df["label"])
    # by default the 10% of the scored entities (one block of them here) whose best brand is most probable
    first = np.asarray([s[0] for s in scored["scores"]], float)
    assert meta["brands"]["scored_entities"].value == len(first) and len(_by_entity(df)) == int(np.ceil(0.1 * len(first)))
    top = set(scored["customer_id"][np.argsort(-first, kind="stable")[:int(np.ceil(0.1 * len(first)))]])
    assert set(_by_entity(df)) == top  # by the scores predictions serve
    assert meta["brands"]["selection"].value == "top 10%"
    for c, i in _by_entity(df).items():
        assert len(set(df["label"][i])) == 2  # each entity's two most probable brands
        assert set(df["label"][i]) == best[c]
    assert meta["brands"]["explained_scores"].value == 2 * meta["brands"]["entities"].value
    # a brand's own history shows up as a reason "brand = <label>" with the entity's counts
    own = (df["column"] == "brand") & (df["value"] == df["label"])
    assert own.sum() > 0 and all(n > 0 for n in df["count"][own])


def test_explanations_with_write_back_land_in_the_warehouse_and_a_rerun_replaces_them(run):
    import dagster as dg
    import duckdb

    from habitus.pipelines.orchestration.build import build_assets, build_resources

    root, day, meta = run

    def stored(table):
        con = duckdb.connect(str(root / "warehouse.duckdb"), read_only=True)
        try:
            return con.sql(f"SELECT * FROM {table} ORDER BY customer_id, label, rank").to_arrow_table()
        finally:
            con.close()

    path = root / "ws" / "explanations" / "brands" / f"{day}.parquet"
    file = pq.read_table(path).sort_by([("customer_id", "ascending"), ("label", "ascending"), ("rank", "ascending")])
    table = stored("scores_brands_explanations")
    assert meta["brands"]["written_to_warehouse"].value == file.num_rows == table.num_rows > 0
    assert table.column_names == file.column_names
    for name in file.column_names:
        if name != "as_of":
            assert table.column(name).to_pylist() == file.column(name).to_pylist(), name
    assert meta["churn"]["written_to_warehouse"].value == 0  # churn has no write_back
    with duckdb.connect(str(root / "warehouse.duckdb"), read_only=True) as con:
        assert "scores_churn_explanations" not in {r[0] for r in con.sql("SHOW TABLES").fetchall()}
    project = load_project(root / "project.yaml")
    out = dg.materialize(build_assets(project), selection=[dg.AssetKey(["explanations", "brands"])],
                         resources=build_resources(project), partition_key=day)
    assert out.success
    assert stored("scores_brands_explanations").num_rows == file.num_rows  # replaced, not added
