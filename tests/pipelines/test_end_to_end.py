"""The whole graph on a tiny generated warehouse: every stage runs and its outputs are checked
against the warehouse itself."""

import json
from datetime import datetime, timedelta
from pathlib import Path

import dagster as dg
import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.data.features import FeatureSpec
from habitus.models.nn.profile import Profile, profile_shape
from habitus.pipelines.run.runner import materialize_all
from habitus.pipelines.run.report import report
from habitus.pipelines.config.project import load_project
from habitus.pipelines.definitions import build_definitions

pytestmark = pytest.mark.slow



def _config(small_project) -> dict:
    return small_project.config(
        purchases=["product_id", "store_id", "quantity", "price"], events={"end": "2026-11-01"},
        customers=["age", "region", "segment", "signup_date"], products=["category", "brand", "price_tier"],
        foundation={"hidden": 32, "epochs": 2, "batch_size": 256},
        scenarios={"churn": small_project.churn(epochs=2), "brands": small_project.brands(10, epochs=2),
                   "spend": {"task": "regression", "epochs": 2, "target": {"sum": "purchases.price", "within": "28d"}},
                   "next": {"task": "recommendation", "epochs": 2, "top_k": 5,
                            "target": {"items": "purchases.product_id", "within": "14d"}}},
        predictions={"top_k": 5, "start": "2026-10-01", "sink": {"connection": "warehouse", "table": "habitus_scores"}})


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_project):
    root = tmp_path_factory.mktemp("e2e")
    project = load_project(small_project.write(root, _config(small_project), customers=600, products=150, stores=10,
                                               seed=3))
    result = materialize_all(project, log=lambda _: None)
    return root, project, result


def _sql(root: Path, query: str):
    con = duckdb.connect(str(root / "warehouse.duckdb"), read_only=True)
    try:
        return con.sql(query).fetchall()
    finally:
        con.close()


def test_definitions_hold_every_stage(tmp_path, small_project):
    defs = build_definitions(load_project(small_project.write(tmp_path, _config(small_project))))
    keys = {k.to_user_string() for k in defs.resolve_asset_graph().get_all_asset_keys()}
    assert keys == {"source/purchases", "source/customers", "source/products", "cache", "foundation_model",
                    "scenario/churn", "scenario/brands", "scenario/spend", "scenario/next",
                    "predictions/churn", "predictions/brands", "predictions/spend", "predictions/next",
                    "embeddings", "realized/churn", "realized/brands", "realized/spend", "realized/next"}


def test_asset_checks_run_with_each_stage(run):
    _, _, result = run
    assert result["checks_passed"] >= 5
    # what may fail on a tiny warehouse: the volume guidelines (a warning) and models that lose to a baseline
    assert all("volume_guidelines (warn)" in f or "beats_baselines" in f for f in result["checks_failed"]), \
        result["checks_failed"]


def test_sources_hold_every_warehouse_row(run):
    root, project, _ = run
    files = sorted((root / "ws" / "sources" / "purchases").glob("*.parquet"))
    assert [f.stem for f in files] == [f"2026-{m:02d}-01" for m in range(3, 11)]
    extracted = sum(pq.read_metadata(f).num_rows for f in files)
    assert extracted == _sql(root, "SELECT count(*) FROM purchases")[0][0]
    assert pq.read_schema(files[0]).names == ["customer_id", "ts", "product_id", "store_id", "quantity", "price"]


def test_cache_matches_sources_and_is_reused(run):
    root, project, _ = run
    current = json.loads((root / "ws" / "cache" / "current.json").read_text())
    manifest = json.loads((root / "ws" / "cache" / current["folder"] / "manifest.json").read_text())
    assert manifest["n_events"] == _sql(root, "SELECT count(*) FROM purchases")[0][0]
    assert manifest["n_entities"] == 600  # every customer, with or without purchases
    assert manifest["join_coverage"]["products"] == 1.0
    assert {"category", "brand", "price_tier", "product_id", "store_id"} <= set(manifest["columns"])
    from habitus.pipelines.orchestration.build import build_assets, build_resources

    res = dg.materialize(build_assets(project), selection=[dg.AssetKey("cache")], resources=build_resources(project))
    meta = res.asset_materializations_for_node("cache")[0].metadata
    assert meta["reused"].value is True


def test_scenarios_beat_chance_on_the_holdout(run):
    root, project, _ = run
    ckpt = root / "ws" / "checkpoints"
    foundation = json.loads((ckpt / "foundation" / "config.json").read_text())
    for name in project.scenarios:
        cfg = json.loads((ckpt / "scenarios" / name / "config.json").read_text())
        if name != "next":  # LightGBM on hand features stands beside every scenario but recommendation
            assert "lightgbm" in cfg["metrics"]["baselines"]
        assert cfg["foundation_sha256"] == foundation["weights_sha256"]
        test_cutoff = cfg["protocol"]["test_cutoff"]
        assert all(c < cfg["protocol"]["val_cutoff"] < test_cutoff for c in cfg["protocol"]["train_cutoffs"])
        # the foundation model never read targets past the hold-out cut-off
        assert foundation["data_window"]["last_target_time"] <= test_cutoff
        model = cfg["metrics"]["model"]
        assert cfg["metrics"]["entities"] > 100 and cfg["metrics"]["baselines"]
        if name == "churn":
            assert 0.6 < model["auroc"] <= 1.0
        elif name == "brands":
            assert 0.6 < model["macro_auroc"] <= 1.0
        elif name == "spend":
            assert model["mae"] < cfg["metrics"]["baselines"]["training mean"]["mae"]
        else:
            assert model["hr@5"] > cfg["metrics"]["baselines"]["popularity"]["hr@5"]
    assert "churn" in report(project)


def test_predictions_cover_the_eligible_entities(run):
    root, project, result = run
    day = result["prediction_day"]
    as_of = datetime.fromisoformat(day) + timedelta(days=1)
    buyers = _sql(root, f"SELECT count(DISTINCT customer_id) FROM purchases WHERE ts <= TIMESTAMP '{as_of}'")[0][0]
    active = _sql(root, f"SELECT count(DISTINCT customer_id) FROM purchases WHERE ts <= TIMESTAMP '{as_of}' "
                        f"AND ts > TIMESTAMP '{as_of - timedelta(days=90)}'")[0][0]
    for name, expected in {"churn": active, "brands": buyers, "spend": buyers, "next": buyers}.items():
        table = pq.read_table(root / "ws" / "predictions" / name / f"{day}.parquet")
        assert table.num_rows == expected, name
        assert table.column("customer_id").null_count == 0
        assert len(set(table.column("customer_id").to_pylist())) == expected
        assert set(table.column("as_of").to_pylist()) == {as_of}
        if name in ("brands", "next"):
            assert {len(x) for x in table.column("labels").to_pylist()} == {5}
        # written back to the warehouse once, however often it runs
        assert _sql(root, f"SELECT count(*) FROM habitus_scores_{name}")[0][0] == expected
    # a re-run of the day replaces its file and its warehouse rows instead of adding to them
    from habitus.pipelines.orchestration.build import build_assets, build_resources

    dg.materialize(build_assets(project), selection=[dg.AssetKey(["predictions", "churn"])],
                   resources=build_resources(project), partition_key=day)
    assert _sql(root, "SELECT count(*) FROM habitus_scores_churn")[0][0] == active
    churn = pq.read_table(root / "ws" / "predictions" / "churn" / f"{day}.parquet").column("score").to_numpy()
    assert ((churn >= 0) & (churn <= 1)).all()


def test_embeddings_have_fixed_width_for_every_entity_with_history(run):
    root, project, result = run
    day = result["prediction_day"]
    as_of = datetime.fromisoformat(day) + timedelta(days=1)
    buyers = _sql(root, f"SELECT count(DISTINCT customer_id) FROM purchases WHERE ts <= TIMESTAMP '{as_of}'")[0][0]
    table = pq.read_table(root / "ws" / "embeddings" / f"{day}.parquet")
    assert table.num_rows == buyers
    emb_type = table.schema.field("embedding").type
    _, config = load_checkpoint(root / "ws" / "checkpoints" / "foundation")
    spec = FeatureSpec.from_dict(config["feature_spec"])
    # the trunk's leading principal components, sized for the population (a few hundred customers:
    # about 100 per column, too few to carry the 24 recency / frequency / monetary / visit scalars too)
    profile = Profile.of(config)
    k = len(profile.components)
    assert (k, profile.scalars) == profile_shape(profile.entities, 32, spec.scalar_width) == (k, False)
    assert emb_type.list_size == k and 4 <= k < 32 and emb_type.value_type == pa.float16()
    values = table.column("embedding").combine_chunks().flatten().to_numpy(zero_copy_only=False)
    vectors = values.reshape(table.num_rows, -1).astype(np.float64)
    assert 0.5 < vectors[:, 0].std() < 2  # unit variance on the rows fitted (the customers of an earlier day)
    # and, with the predictions' sink, in the warehouse: the same vectors (float32), one row per entity and day
    stored = _sql(root, f"SELECT customer_id, embedding, model_fingerprint, as_of FROM habitus_scores_embeddings "
                        f"WHERE as_of = TIMESTAMP '{as_of}' ORDER BY customer_id")
    order = np.argsort(np.asarray(table.column("customer_id").to_pylist()))
    assert [r[0] for r in stored] == [table.column("customer_id")[int(i)].as_py() for i in order]
    assert np.array_equal(np.asarray([r[1] for r in stored], np.float32), vectors[order].astype(np.float32))
    assert {r[2] for r in stored} == set(table.column("model_fingerprint").to_pylist())
    assert {r[3] for r in stored} == {as_of}
