"""habitus.Project, the Python API, on a small generated warehouse whose data ends on 2026-10-31: the
main job, the report as a table, a day scored through the API equal to what the assets wrote, and errors
that name the scenario, the day or the setting to change."""

import json
import os
from datetime import datetime, timezone

import pyarrow.parquet as pq
import pytest

import habitus
from habitus.assets.check_measures import baseline_margin
from habitus.assets.serving import serving_checkpoint
from habitus.pipelines.api import ProjectError
from habitus.pipelines.config.project import ConfigError


def _config(small_project) -> dict:
    return small_project.config(
        events={"start": "2026-08-01", "end": "2026-11-01"}, foundation={"cutoff_every": "14d"},
        scenarios={"churn": small_project.churn("14d", epochs=1), "brands": small_project.brands(4, "14d", epochs=1)},
        predictions={"start": "2026-10-01", "scenarios": ["churn"], "top_k": 2},
        executor={"device": "cpu", "threads": 1, "processes": 1})


@pytest.fixture(scope="module")
def project(tmp_path_factory, small_project):
    root = tmp_path_factory.mktemp("api")
    path = small_project.write(root, _config(small_project), customers=200, products=40, stores=3, start="2026-08-01",
                               end="2026-10-31", seed=5)
    return habitus.Project(path, log=lambda line: None)


def test_errors_name_the_scenario_the_day_or_the_setting(tmp_path, small_project):
    project = habitus.Project(small_project.write(tmp_path, _config(small_project)), log=lambda line: None)
    with pytest.raises(ConfigError, match=r"no scenario 'nope' in the project config; its scenarios: churn, brands"):
        project.predict("nope", "2026-10-15")
    with pytest.raises(ConfigError, match=r"scenario 'brands' is not scored: add it to `predictions.scenarios`"):
        project.predict("brands", "2026-10-15")
    with pytest.raises(ConfigError, match=r"2026-09-01 is before the first day that can be scored, 2026-10-01"):
        project.predict("churn", "2026-09-01")
    with pytest.raises(ProjectError, match=r"scenario 'churn' is not trained in the workspace .*run materialize\(\)"):
        project.predict("churn", "2026-10-15")
    with pytest.raises(ConfigError, match=r"no asset named 'scenario/nope'"):
        project.materialize(["scenario/nope"])
    with pytest.raises(ConfigError, match=r"predictions/churn: daily assets; give the days to score"):
        project.materialize(["cache", "predictions/churn"])
    with pytest.raises(TypeError, match="unknown executor setting"):
        habitus.Project(tmp_path / "project.yaml", gpu=True)
    assert project.report().column("task").to_pylist() == [None, None]  # nothing trained yet


@pytest.mark.slow
def test_materialize_report_predict_and_embed_a_day(project, capfd):
    result = project.materialize()
    assert result["prediction_days"] == ["2026-10-31"] and not result["stopped"]

    report = project.report()
    assert report.column("scenario").to_pylist() == ["churn", "brands"]
    for row in report.to_pylist():
        saved = json.loads((project.workspace.scenario(row["scenario"]) / "config.json").read_text())
        margin = baseline_margin(saved)
        assert (row["metric"], row["model"], row["baseline"]) == (margin["metric"], margin["model"], margin["baseline"])
        assert row["entities"] == saved["metrics"]["entities"] and row["beats_baselines"] == saved["beats_baselines"]

    # the day the main job scored: read back as the asset wrote it, not scored again
    written = project.workspace.predictions("churn") / "2026-10-31.parquet"
    stamp = written.stat().st_mtime_ns
    assert project.predict("churn", "2026-10-31").equals(pq.read_table(written))
    assert written.stat().st_mtime_ns == stamp

    # a day not scored yet: the predictions asset scores it, from the checkpoint serving the scenario
    day = project.workspace.predictions("churn") / "2026-10-15.parquet"
    assert not day.exists()
    extracted = sorted(project.workspace.sources("purchases").glob("*.parquet"))
    after_the_data = datetime(2026, 11, 2, tzinfo=timezone.utc).timestamp()
    for f in extracted:  # each extracted after its time window closed (the data ends on 2026-10-31)
        os.utime(f, (after_the_data, after_the_data))
    lines = []
    project.log = lines.append
    capfd.readouterr()
    scores = project.predict("churn", "2026-10-15")
    # nothing extracted again, and the runner's own lines, not Dagster's log
    assert "the sources are extracted up to that day already" in lines
    assert not any(line.startswith("materializing source/") for line in lines), lines
    assert "materializing predictions for 2026-10-15 ..." in lines
    assert " - dagster - " not in capfd.readouterr().err
    assert scores.equals(pq.read_table(day))
    # a partition extracted while its window was open is extracted again: its days may have grown
    before = datetime(2026, 10, 20, tzinfo=timezone.utc).timestamp()
    os.utime(extracted[-1], (before, before))
    lines.clear()
    project.predict("churn", "2026-10-16")
    project.log = lambda line: None
    assert any(line.startswith(f"materializing source/purchases (1 partitions, {extracted[-1].stem}")
               for line in lines), lines
    serving = json.loads((serving_checkpoint(project.workspace, "churn")[0] / "config.json").read_text())
    assert set(scores.column("model_fingerprint").to_pylist()) == {serving["weights_sha256"][:16]}
    assert str(scores.column("as_of")[0].as_py()) == "2026-10-16 00:00:00"
    assert 0 < scores.num_rows <= 200 and scores.column("customer_id").null_count == 0

    vectors = project.embeddings("2026-10-15")
    assert vectors.equals(pq.read_table(project.workspace.embeddings / "2026-10-15.parquet"))
    assert set(vectors.column("customer_id").to_pylist()) >= set(scores.column("customer_id").to_pylist())
    assert len(vectors.column("embedding")[0]) >= 4  # the trunk's leading components (a small population)

    # named assets and a day, as the UI materializes a partition
    summary = project.materialize(["cache", "predictions/churn", "embeddings"], days=["2026-10-20"])
    assert set(summary["timings"]) == {"cache", "predictions/churn, embeddings for 2026-10-20"}
    assert pq.read_table(project.workspace.predictions("churn") / "2026-10-20.parquet").equals(
        project.predict("churn", "2026-10-20"))
    assert (project.workspace.embeddings / "2026-10-20.parquet").exists()

    pandas = pytest.importorskip("pandas")
    assert isinstance(scores.to_pandas(), pandas.DataFrame) and len(scores.to_pandas()) == scores.num_rows
