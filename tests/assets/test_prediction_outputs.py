"""The outputs' options: `predictions.format: all` (every multilabel label, best first) and
`predictions.without_history: flag` (a row with null scores for each entity without history); and
the head the scenario assets choose on the validation cut-off (models/heads/stacked_head.py): the
checkpoint records the choice and carries the stack, the hold-out report has the network alone next
to the chosen head, and the predictions asset scores with the stack of the serving checkpoint."""

from datetime import datetime

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.pipelines.run.runner import materialize_all
from habitus.pipelines.config.project import load_project

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


@pytest.mark.parametrize("name", ["churn", "brands"])
def test_the_checkpoint_records_the_chosen_head_and_predictions_score_with_it(scored, name):
    pytest.importorskip("lightgbm")
    from habitus.assets.cache import current_cache
    from habitus.assets.serving import serving_checkpoint
    from habitus.models.nn.checkpoint import load_checkpoint
    from habitus.models.serve.predict import load_model, predict
    from habitus.models.heads.stacked_head import STACK_FILE, TRUNK_FILE, load_head
    from habitus.resources.store.workspace import Workspace

    workspace = Workspace(root=str(scored[0] / "ws"))
    newest = workspace.scenario(name)
    _, config = load_checkpoint(newest)
    assert (newest / STACK_FILE).exists() and (newest / TRUNK_FILE).exists()
    assert config["stack"]["chosen"] in ("network", "gbt", "blend")
    assert config["head"] == {"chosen": config["stack"]["chosen"], "weight": config["stack"]["weight"]}
    metrics = config["metrics"]
    assert metrics["head"]["chosen"] == config["stack"]["chosen"] and set(metrics["network"]) == set(metrics["model"])
    key = config["headline"]
    assert metrics["head"]["candidates"]["chosen"][key] == pytest.approx(metrics["model"][key], abs=1e-6)

    # what the predictions asset wrote (the rows with history; brands: all 6 labels) is what the serving
    # checkpoint's stack scores
    path, _ = serving_checkpoint(workspace, name)
    state, config = load_checkpoint(path)
    model, spec, task = load_model(state, config)
    head = load_head(path, config)
    cache = current_cache(workspace)
    cutoff = int((AS_OF - datetime(1970, 1, 1)).total_seconds())
    column = "score" if name == "churn" else "scores"

    def scores(batches) -> np.ndarray:
        return np.asarray([x for b in batches for x in b.column(column).to_pylist()], np.float32)

    labels = config.get("label_values")
    want = scores(predict(model, cache, spec, task, cutoff, k=6, label_names=labels, head=head))
    alone = scores(predict(model, cache, spec, task, cutoff, k=6, label_names=labels))
    table = pq.read_table(workspace.predictions(name) / f"{DAY}.parquet")
    got = scores([table.filter(table.column("has_history"))])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if head.weight > 0:
        assert not np.allclose(got, alone)


def test_two_scoring_processes_write_the_files_one_process_writes(scored, monkeypatch):
    """executor inference_processes 2 (models/serve/parts.py): the predictions (the chosen heads, LightGBM
    included) and the embeddings of the day are the files one process writes, bit for bit, on the same
    chunks (64 entities here, so that both processes get some); nothing is left staged."""
    import shutil

    import dagster as dg

    from habitus.assets.embeddings import EMBEDDINGS_KEY
    from habitus.assets.predictions import predictions_key
    from habitus.pipelines.orchestration.build import build_assets, build_resources
    from habitus.resources.training.executor import TrainingExecutor

    root = scored[0]
    project = load_project(root / "project.yaml")
    monkeypatch.setattr("habitus.assets.predictions.CHUNK_ENTITIES", 64)
    monkeypatch.setattr("habitus.assets.embeddings.CHUNK_ENTITIES", 64)
    files = {"churn": root / "ws" / "predictions" / "churn" / f"{DAY}.parquet",
             "brands": root / "ws" / "predictions" / "brands" / f"{DAY}.parquet",
             "embeddings": root / "ws" / "embeddings" / f"{DAY}.parquet"}
    written = {}
    for n in (1, 2):
        resources = {**build_resources(project), "executor": TrainingExecutor(device="cpu", inference_processes=n)}
        result = dg.materialize(build_assets(project), resources=resources, partition_key=DAY,
                                selection=[predictions_key("churn"), predictions_key("brands"), EMBEDDINGS_KEY],
                                instance=dg.DagsterInstance.ephemeral())
        assert result.success
        for name, path in files.items():
            written[name, n] = root / f"{name}-{n}.parquet"
            shutil.copy(path, written[name, n])
            assert not list(path.parent.glob(".*.parts"))  # the day's parts go once its file is in place
    for name in files:
        one, two = pq.read_table(written[name, 1]), pq.read_table(written[name, 2])
        assert one.num_rows > 0 and one.equals(two), name
