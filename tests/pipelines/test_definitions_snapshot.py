"""The demo project's Dagster definitions against a checked-in list (as dagster-open-platform does):
every asset key, asset check, job, schedule and sensor of examples/demo.yaml, loaded the way Dagster
loads the code location (`habitus.pipelines.definitions.defs()`). A rename or a lost asset fails here first.

When a change is intended, regenerate the list and commit it with the change:

    HABITUS_UPDATE_SNAPSHOT=1 .venv/bin/python -m pytest tests/pipelines/test_definitions_snapshot.py
    # or: .venv/bin/python tests/pipelines/test_definitions_snapshot.py
"""

import difflib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.yaml"
SNAPSHOT = Path(__file__).with_name("definitions_snapshot.txt")
UPDATE = "HABITUS_UPDATE_SNAPSHOT"
REGENERATE = (f"{UPDATE}=1 .venv/bin/python -m pytest tests/pipelines/test_definitions_snapshot.py "
              f"(or .venv/bin/python tests/pipelines/test_definitions_snapshot.py)")

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")


def definitions_lines(config: Path = DEMO) -> list[str]:
    """One sorted line per definition: `<kind> <name>`, asset checks as `check <asset key>:<check>`.
    Dagster's implicit `__ASSET_JOB` is left out (it is not the project's)."""
    previous = os.environ.get("HABITUS_CONFIG")
    os.environ["HABITUS_CONFIG"] = str(config)
    try:
        from habitus.pipelines.definitions import defs

        repo = defs().get_repository_def()
    finally:
        if previous is None:
            os.environ.pop("HABITUS_CONFIG", None)
        else:
            os.environ["HABITUS_CONFIG"] = previous
    graph = repo.asset_graph
    lines = [f"asset {key.to_user_string()}" for key in graph.get_all_asset_keys()]
    lines += [f"check {key.asset_key.to_user_string()}:{key.name}" for key in graph.asset_check_keys]
    lines += [f"job {job.name}" for job in repo.get_all_jobs() if not job.name.startswith("__")]
    lines += [f"schedule {s.name}" for s in repo.schedule_defs]
    lines += [f"sensor {s.name}" for s in repo.sensor_defs]
    return sorted(lines)


def write_snapshot() -> None:
    SNAPSHOT.write_text("\n".join(definitions_lines()) + "\n")


def test_the_demo_definitions_match_the_snapshot():
    if os.environ.get(UPDATE):
        write_snapshot()
        pytest.skip(f"{SNAPSHOT.name} regenerated; review its diff and commit it")
    actual = definitions_lines()
    expected = SNAPSHOT.read_text().splitlines() if SNAPSHOT.exists() else []
    diff = "\n".join(difflib.unified_diff(expected, actual, "definitions_snapshot.txt", "defs()", lineterm=""))
    assert actual == expected, (f"the definitions of examples/demo.yaml changed:\n{diff}\n\nif this is intended, "
                                f"regenerate the snapshot and commit it: {REGENERATE}")


if __name__ == "__main__":
    write_snapshot()
    print(f"wrote {SNAPSHOT.relative_to(ROOT)}")
