"""The scenario assets choose their head on the validation cut-off (models/stacking_head.py): the
checkpoint records the choice and carries the stack, the hold-out report has the network alone next
to the chosen head, and the predictions asset scores with the stack it loads from the serving
checkpoint."""

from datetime import datetime

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipelines.cli import materialize_all
from pipelines.config import load_project

pytest.importorskip("lightgbm")
pytestmark = pytest.mark.slow

DAY, AS_OF = "2026-10-20", datetime(2026, 10, 21)


@pytest.fixture(scope="module")
def project(tmp_path_factory, small_project):
    root = tmp_path_factory.mktemp("head")
    config = small_project.config(
        events={"end": "2026-11-01"}, foundation={"batch_size": 256},
        scenarios={"churn": small_project.churn(epochs=1), "brands": small_project.brands(6, epochs=1)},
        predictions={"top_k": 6, "start": "2026-10-01"})
    project = load_project(small_project.write(root, config, customers=250, products=60, stores=4, seed=6))
    materialize_all(project, log=lambda _: None, days=[DAY])
    return project


@pytest.mark.parametrize("name", ["churn", "brands"])
def test_the_checkpoint_records_the_chosen_head_and_predictions_score_with_it(project, name):
    from assets.cache import current_cache
    from assets.serving import serving_checkpoint
    from models.checkpoint import load_checkpoint
    from models.predict import load_model, predict
    from models.stacking_head import STACK_FILE, TRUNK_FILE, load_head
    from resources.workspace import Workspace

    workspace = Workspace(root=project.workspace)
    newest = workspace.scenario(name)
    _, config = load_checkpoint(newest)
    assert (newest / STACK_FILE).exists() and (newest / TRUNK_FILE).exists()
    assert config["stack"]["chosen"] in ("network", "gbt", "blend")
    assert config["head"] == {"chosen": config["stack"]["chosen"], "weight": config["stack"]["weight"]}
    metrics = config["metrics"]
    assert metrics["head"]["chosen"] == config["stack"]["chosen"] and set(metrics["network"]) == set(metrics["model"])
    key = config["headline"]
    assert metrics["head"]["candidates"]["chosen"][key] == pytest.approx(metrics["model"][key], abs=1e-6)

    # what the predictions asset wrote is what the serving checkpoint's stack scores
    path, _ = serving_checkpoint(workspace, name)
    state, config = load_checkpoint(path)
    model, spec, task = load_model(state, config)
    head = load_head(path, config)
    cache = current_cache(workspace)
    cutoff = int((AS_OF - datetime(1970, 1, 1)).total_seconds())
    expected = list(predict(model, cache, spec, task, cutoff, k=6, label_names=config.get("label_values"), head=head))
    network = list(predict(model, cache, spec, task, cutoff, k=6, label_names=config.get("label_values")))
    table = pq.read_table(workspace.predictions(name) / f"{DAY}.parquet")
    column = "score" if name == "churn" else "scores"
    got = np.asarray(table.column(column).to_pylist(), np.float32)
    want = np.asarray([x for b in expected for x in b.column(column).to_pylist()], np.float32)
    alone = np.asarray([x for b in network for x in b.column(column).to_pylist()], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if head.weight > 0:
        assert not np.allclose(got, alone)
