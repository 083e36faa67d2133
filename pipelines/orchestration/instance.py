"""The Dagster instance that `habitus` commands run in: $DAGSTER_HOME's, given the project's
dagster.yaml (telemetry off, the run queue) when it has none; without DAGSTER_HOME an ephemeral one."""

import os
from pathlib import Path

DAGSTER_YAML = Path(__file__).resolve().parents[2] / "dagster.yaml"  # the project's instance settings


def dagster_instance():
    """The instance whose runs show in the UI (`make ui` shares $DAGSTER_HOME)."""
    import dagster as dg

    home = os.environ.get("DAGSTER_HOME")
    if home:
        Path(home).mkdir(parents=True, exist_ok=True)
        target = Path(home) / "dagster.yaml"
        if not target.exists() and DAGSTER_YAML.exists():
            target.write_text(DAGSTER_YAML.read_text())
        return dg.DagsterInstance.get()
    return dg.DagsterInstance.ephemeral()
