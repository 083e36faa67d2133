"""dagster.yaml, the instance of `make ui` and `make demo`: telemetry and the onboarding pop-up off,
and a run queue that starts one training run at a time (the jobs carry the tag it counts)."""

import shutil
from pathlib import Path

import dagster as dg
from dagster._core.run_coordinator import QueuedRunCoordinator

from habitus.pipelines.orchestration.instance import DAGSTER_YAML, dagster_instance
from habitus.pipelines.config.project import load_project
from habitus.pipelines.definitions import build_definitions
from habitus.pipelines.orchestration.jobs import KIND_TAG

ROOT = Path(__file__).resolve().parents[2]


def test_the_instance_settings(tmp_path):
    shutil.copy(ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    instance = dg.DagsterInstance.from_config(str(tmp_path))
    try:
        assert not instance.telemetry_enabled
        assert not instance.nux_enabled
        coordinator = instance.run_coordinator
        assert isinstance(coordinator, QueuedRunCoordinator)
        limits = {(c["key"], c.get("value")): c["limit"]
                  for c in coordinator.get_run_queue_config().tag_concurrency_limits}
        assert limits[(KIND_TAG, "training")] == 1
        assert limits[(KIND_TAG, "extraction")] <= 4
    finally:
        instance.dispose()


def test_every_job_tags_its_runs_with_its_kind(tmp_path):
    text = (ROOT / "examples" / "demo.yaml").read_text().replace("start: 2026-03-01",
                                                                 "start: 2026-03-01\n    end: 2026-11-01")
    (tmp_path / "demo.yaml").write_text(text)
    defs = build_definitions(load_project(tmp_path / "demo.yaml"))
    kinds = {name: defs.resolve_job_def(name).tags.get(KIND_TAG)
             for name in ("extract_purchases", "train", "train_scenarios", "score")}
    assert kinds == {"extract_purchases": "extraction", "train": "training", "train_scenarios": "training",
                     "score": "scoring"}


def test_the_cli_gives_a_dagster_home_without_settings_the_projects(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    instance = dagster_instance()
    try:
        assert (tmp_path / "home" / "dagster.yaml").read_text() == DAGSTER_YAML.read_text()
        assert not instance.telemetry_enabled
    finally:
        instance.dispose()
