"""Scenario versions: every trained checkpoint kept by fingerprint, a pointer naming the serving one,
rollback from the CLI and the `rollback` job, pruning that keeps the newest N and every served one.
Checkpoints here are folders with a config.json (no training): what the store copies and reads."""

import json

import numpy as np
import pytest

from habitus.assets.serving import (keep_version, passed_path, rollback, serve_baseline, serving_checkpoint, serving_note,
                                    trained_with, unchanged, versions, versions_table)
from habitus.models.storage.versions import INFO, VersionError
from habitus.pipelines.cli import main
from habitus.pipelines.config.project import load_project
from habitus.resources.store.workspace import Workspace


def train(ws: Workspace, n: int, *, beats: bool = True, auroc: float = 0.8, scores=None, keep: int = 5,
          trained_on: dict | None = None) -> str:
    """A checkpoint of scenario churn written as training writes it, then kept as a version."""
    folder = ws.scenario("churn")
    folder.mkdir(parents=True, exist_ok=True)
    sha = f"{n:02d}" * 32
    (folder / "model.safetensors").write_bytes(bytes([n]) * 64)
    (folder / "config.json").write_text(json.dumps({
        "weights_sha256": sha, "headline": "auroc", "beats_baselines": beats,
        "metrics": {"model": {"auroc": auroc}, "baselines": {"recency": {"auroc": 0.75}}, "entities": 100},
        "protocol": {"train_cutoffs": ["2026-05-01T00:00:00Z"], "val_cutoff": "2026-06-01T00:00:00Z",
                     "test_cutoff": "2026-07-01T00:00:00Z"},
        "foundation_sha256": "f" * 64, "cache_fingerprint": "c" * 64}))
    fp, _ = keep_version(ws, "churn", scores, keep=keep, trained_on=trained_on)
    return fp


@pytest.fixture
def ws(tmp_path):
    return Workspace(root=str(tmp_path / "ws"))


def test_each_checkpoint_is_a_version_and_the_pointer_follows_promotion(ws):
    assert serving_checkpoint(ws, "churn") == (ws.scenario("churn"), False)
    first = train(ws, 1, scores=np.linspace(0, 1, 200))
    worse = train(ws, 2, beats=False, auroc=0.7)
    store = versions(ws, "churn")
    assert store.fingerprints() == [first, worse]
    assert store.serving() == first  # the worse one is kept, not served
    assert serving_checkpoint(ws, "churn") == (store.path(first), True)
    assert serving_note(ws, "churn") == f"version {first}"
    info = store.info(first)
    assert (info["metric"], info["model"], info["best_baseline"], info["baseline"]) == ("auroc", 0.8, "recency", 0.75)
    assert info["foundation"] == "f" * 16 and info["data"]["test_cutoff"] == "2026-07-01T00:00:00Z"
    assert len(info["scores"]["shares"]) == 10 and info["scores"]["n"] == 200
    assert store.info(worse)["scores"] is None  # none given
    # the version is a copy: retraining rewrites checkpoints/scenarios/churn, not the version
    assert (store.path(first) / "model.safetensors").read_bytes() == bytes([1]) * 64
    third = train(ws, 3)
    assert store.serving() == third
    table = versions_table(store)
    assert len(table.splitlines()) == 4 and table.splitlines()[3].startswith(f"* {third}")
    assert "0.8000" in table and "recency: 0.7500" in table and "never" in table.splitlines()[2]


def test_behind_a_served_baseline_the_trained_version_of_the_same_settings_is_found(ws):
    """A run with nothing to train records the trained version in MLflow, never a baseline version."""
    before, now = {"settings": "a"}, {"settings": "b"}
    train(ws, 1, trained_on=before)
    lost = train(ws, 2, beats=False, auroc=0.7, trained_on=now)
    baseline = serve_baseline(ws, "churn", json.loads((ws.scenario("churn") / "config.json").read_text()),
                              fit=None, trained_on=now)
    store = versions(ws, "churn")
    assert store.serving() == baseline and store.info(baseline)["kind"] == "baseline"
    assert unchanged(ws, "churn", now) == baseline  # what serves was made with these settings: nothing to train
    assert trained_with(ws, "churn", now) == lost
    assert trained_with(ws, "churn", before) == store.fingerprints()[0]
    assert trained_with(ws, "churn", {"settings": "c"}) is None


def test_rollback_to_a_version_or_to_the_one_before(ws):
    a, b = train(ws, 1), train(ws, 2)
    store = versions(ws, "churn")
    assert rollback(ws, "churn") == a  # the one that served before b
    assert serving_checkpoint(ws, "churn")[0] == store.path(a)
    # the copy an upload carries to a machine that only scores follows the pointer
    assert json.loads((passed_path(ws, "churn") / "config.json").read_text())["weights_sha256"][:16] == a
    assert rollback(ws, "churn", to=b[:6]) == b
    history = store.pointer()["history"]
    assert [h["fingerprint"] for h in history] == [a, b, a, b]
    assert all(h["to"] for h in history[:-1]) and history[-1]["to"] is None
    assert history[2]["why"] == f"rollback from {b}"
    with pytest.raises(VersionError, match="names no version"):
        rollback(ws, "churn", to="ffff")
    worse = train(ws, 3, beats=False)
    assert rollback(ws, "churn", to=worse) == worse  # a person may choose one that lost to its baselines
    assert serving_checkpoint(ws, "churn") == (store.path(worse), False)


def test_pruning_keeps_the_newest_and_every_served_version(ws):
    served = train(ws, 1, keep=2)
    failed = [train(ws, n, beats=False, keep=2) for n in (2, 3, 4)]
    store = versions(ws, "churn")
    assert store.fingerprints() == [served, *failed[1:]]  # the oldest never-served one went
    rollback(ws, "churn", to=failed[1], keep=2)
    newest = train(ws, 5, beats=False, keep=2)
    assert store.fingerprints() == [served, *failed[1:], newest]  # two served, the newest two
    # keep_served off: only the newest N and the serving one
    keep_version(ws, "churn", keep=1, keep_served=False)
    assert store.fingerprints() == [failed[1], newest]
    assert store.serving() == failed[1]


def test_the_cli_lists_versions_and_rolls_back(ws, tmp_path, small_project, capsys, monkeypatch):
    config = small_project.write(tmp_path, small_project.config(scenarios={"churn": small_project.churn()}))
    monkeypatch.setenv("HABITUS_CONFIG", str(config))  # the CLI sets it: undone after the test
    a, b = train(ws, 1), train(ws, 2)
    assert main(["versions", "churn", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"churn: serving the version {b} (beat its baselines); 2 version(s) kept" in out and a in out
    assert main(["rollback", "churn", "--config", str(config)]) == 0
    assert f"version {a} serves from now on" in capsys.readouterr().out
    assert main(["versions", "--config", str(config)]) == 0  # every scenario: what serves and why
    assert f"churn: serving the version {a} (rollback from {b}); 2 version(s) kept" in capsys.readouterr().out
    assert main(["rollback", "churn", "--to", "0303", "--config", str(config)]) == 2
    assert "names no version" in capsys.readouterr().err
    assert main(["versions", "spend", "--config", str(config)]) == 2
    capsys.readouterr()
    other = small_project.write(tmp_path, small_project.config(scenarios={"churn": small_project.churn(),
                                                                         "later": small_project.churn()}))
    assert main(["versions", "--config", str(other)]) == 0
    assert "later: not trained yet (materialize scenario/later)" in capsys.readouterr().out
    assert versions(ws, "churn").serving() == a


def test_the_rollback_job_moves_the_pointer(ws, tmp_path, small_project, instance):
    from habitus.pipelines.definitions import build_definitions

    project = load_project(small_project.write(tmp_path, small_project.config(
        scenarios={"churn": small_project.churn()})))
    a, b = train(ws, 1), train(ws, 2)
    job = build_definitions(project).resolve_job_def("rollback")
    config = {"ops": {"move_serving_pointer": {"config": {"scenario": "churn", "to": a}}}}
    result = job.execute_in_process(run_config=config, instance=instance)
    assert result.success and result.output_for_node("move_serving_pointer") == a
    assert versions(ws, "churn").serving() == a
    bad = {"ops": {"move_serving_pointer": {"config": {"scenario": "churn", "to": "nothing"}}}}
    assert not job.execute_in_process(run_config=bad, instance=instance, raise_on_error=False).success
    assert versions(ws, "churn").serving() == a


def test_a_version_is_whole_or_absent(ws):
    fp = train(ws, 1)
    store = versions(ws, "churn")
    assert sorted(p.name for p in store.path(fp).iterdir()) == ["config.json", "model.safetensors", INFO]
    assert not store.add(ws.scenario("churn"), fp, {})  # kept once, never rewritten
