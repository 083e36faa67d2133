"""The `mlflow:` block without a server: the config takes `${VAR}` in it and keeps its password out of what it
shows, a missing client names the extra to install before training starts, and a server that does not answer
is one warning naming its URI (the real server: tests/integration/test_mlflow_tracking.py)."""

import importlib.util
import json
import time

import dagster as dg
import pytest

from habitus.assets.tracking import (check_installed, complete_foundation_record, complete_scenario_record,
                                     track_scenario, tracked_rollback)
from habitus.pipelines.config.project import load_project
from habitus.resources.store.redaction import redact_url
from habitus.resources.training.mlflow_tracking import MlflowMissing, Tracker, numbers, require
from habitus.resources.store.workspace import Workspace


def test_redact_url_hides_user_password_and_tokens():
    assert redact_url("https://bob:s3cret@mlflow.example.com:8443/x") == "https://***@mlflow.example.com:8443/x"
    assert redact_url("https://ghp_tok3n@mlflow.example.com/x") == "https://***@mlflow.example.com/x"  # a token as user
    # every query value and the fragment go (what the output store's logs cut: endpoints, tokens of any name)
    assert redact_url("https://u:pa/ss?w@h:5000/api?token=t0k&run=1#top") == "https://***@h:5000/api?token=***&run=***#***"
    assert redact_url("https://h/p?X-Amz-Signature=abc&sig=def&api_key=ghi&x=1") == (
        "https://h/p?X-Amz-Signature=***&sig=***&api_key=***&x=***")
    assert redact_url("https://h/users?email=a@b.c") == "https://h/users?email=***"  # an @ after the host: the host kept
    assert redact_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact_url("databricks") == "databricks"


def test_metric_names_are_ones_mlflow_takes():
    assert numbers({"model": {"ndcg@10": 0.5, "auroc": float("nan"), "n": True}, "lgbm": {"mae": 3}}, "holdout.") == {
        "holdout.model.ndcg_10": 0.5, "holdout.lgbm.mae": 3.0}


def test_the_block_reads_the_environment_and_its_password_stays_out_of_the_public_config(tmp_path, small_project,
                                                                                         monkeypatch):
    monkeypatch.setenv("MLFLOW_PW", "s3cret")
    config = small_project.config(mlflow={"tracking_uri": "https://bob:${MLFLOW_PW}@mlflow.example.com"})
    project = load_project(small_project.write(tmp_path, config))
    assert project.mlflow.tracking_uri == "https://bob:s3cret@mlflow.example.com"
    assert (project.mlflow.experiment, project.mlflow.model_prefix, project.mlflow.alias) == (
        "habitus", "habitus-", "serving")
    assert "s3cret" not in json.dumps(project.public_dict())
    assert project.public_dict()["mlflow"]["tracking_uri"] == "https://***@mlflow.example.com"


def test_a_missing_client_names_the_extra_before_anything_moves(tmp_path, monkeypatch):
    settings = type("S", (), {"tracking_uri": "https://bob:s3cret@host"})()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(MlflowMissing, match=r"pip install 'habitus\[mlflow\]'") as e:
        require(settings)
    assert "s3cret" not in str(e.value)
    with pytest.raises(dg.Failure, match=r"habitus\[mlflow\]"):
        check_installed(settings)
    ws = Workspace(root=str(tmp_path / "ws"))
    with pytest.raises(MlflowMissing):  # before the pointer moves (there is no version to move to here)
        tracked_rollback(settings, ws, "churn", None, 5, True, print)
    require(None)  # no block: nothing is checked, nothing imported
    check_installed(None)
    track_scenario(None, ws, "churn", {}, "0" * 16, print)
    complete_scenario_record(None, ws, "churn", {}, "0" * 16, print)
    complete_foundation_record(None, "0" * 64, {}, print)


def test_a_server_that_does_not_answer_is_a_warning_naming_it(tmp_path, small_project, monkeypatch):
    pytest.importorskip("mlflow", reason="the MLflow client is not installed: pip install -e '.[mlflow]'")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config = small_project.config(mlflow={"tracking_uri": "http://bob:pw@127.0.0.1:9"})  # nothing listens on 9
    project = load_project(small_project.write(tmp_path, config))
    version = tmp_path / "version"
    version.mkdir()
    (version / "config.json").write_text(json.dumps({"metrics": {"model": {"auroc": 0.8}}, "protocol": {}}))
    warnings = []
    start = time.monotonic()
    tracker = Tracker(project.mlflow, warnings.append)
    assert tracker.log_scenario("churn", {"task": "binary"}, version, "a" * 16) is None
    assert tracker.follow_pointer("churn", "a" * 16) is None
    assert tracker.log_foundation({"hidden": 16}, {"train_loss": [1.0]}, {}) is None
    # a run with nothing to train asks what the server lacks: unanswered, it logs nothing and says so
    assert tracker.foundation_logged("a" * 16) is None and tracker.registered("churn", "a" * 16) is None
    complete_foundation_record(project.mlflow, "a" * 64, {"config": {"hidden": 16}}, warnings.append)
    assert time.monotonic() - start < 60
    assert len(warnings) == 6 and all(w.startswith("MLflow at http://***@127.0.0.1:9: ") for w in warnings)
    assert "version aaaaaaaaaaaaaaaa is kept in the workspace" in warnings[0]
    assert "serves all the same" in warnings[1]
    assert all("looked up again on the next run" in w for w in warnings[3:])
