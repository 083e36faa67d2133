"""SIGKILL the whole pipeline (`habitus materialize` in a subprocess) at random moments and at chosen
stages; after every kill no visible file is half-written, and re-running ends with outputs identical to
an uninterrupted run, with no manual clean-up. Numbers are printed for docs/reliability.md."""

import random
import re
import signal

import duckdb
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.faults

KILLS = 20


@pytest.fixture(scope="module")
def clean(faults, tmp_path_factory):
    folder = faults.project(tmp_path_factory.mktemp("clean"))
    rc, out, seconds = faults.run(folder)
    assert rc == 0, out[-3000:]
    return folder, faults.outputs(folder / "ws"), seconds


def _rows_lost(folder) -> int:
    """Warehouse rows of the configured window that are not in the extracted sources."""
    con = duckdb.connect(str(folder / "warehouse.duckdb"), read_only=True)
    want = con.sql("SELECT count(*) FROM purchases WHERE ts >= TIMESTAMP '2026-03-01' "
                   "AND ts < TIMESTAMP '2026-09-01'").fetchall()[0][0]
    con.close()
    have = sum(pq.read_metadata(f).num_rows for f in (folder / "ws" / "sources" / "purchases").glob("*.parquet"))
    return want - have


def test_killed_at_random_points_and_rerun_ends_identical_to_a_clean_run(faults, clean, tmp_path):
    clean_folder, expected, seconds = clean
    folder = faults.project(tmp_path / "killed")
    rng = random.Random(20261129)
    kills, finished, resumed, cleaned, attempts = 0, 0, 0, 0, 0
    while kills < KILLS and attempts < 3 * KILLS:
        attempts += 1
        killed, out = faults.run_killed(folder, rng.uniform(0.2, seconds))
        kills += killed
        finished += not killed
        resumed += len(re.findall(r"resuming from the state saved at step", out))
        cleaned += len(re.findall(r"cleaned up after a killed run", out))
        assert faults.half_written(folder / "ws") == [], f"after kill {kills}"
    rc, out, _ = faults.run(folder)
    assert rc == 0, out[-3000:]
    resumed += len(re.findall(r"resuming from the state saved at step", out))
    cleaned += len(re.findall(r"cleaned up after a killed run", out))
    assert kills == KILLS
    assert faults.leftovers(folder / "ws") == []
    diffs = faults.differences(faults.outputs(folder / "ws"), expected)
    assert not diffs, "\n".join(diffs)
    assert _rows_lost(folder) == 0 and _rows_lost(clean_folder) == 0
    print(f"\nfaults: {kills} SIGKILLs at random points over {attempts} runs ({finished} finished before their "
          f"kill); {kills} runs recovered by re-running; {resumed} training resumes from saved state; "
          f"{cleaned} leftovers of killed writers cleaned up; outputs identical to the clean run "
          f"({len(expected)} files); rows lost 0")


@pytest.mark.parametrize("stage_line", [r"foundation epoch 1/", r"binary epoch 1/"])
def test_killed_during_training_resumes_from_its_saved_state(faults, clean, tmp_path, stage_line):
    _, expected, _ = clean
    folder = faults.project(tmp_path / "stage")
    verbose = ("materialize", "--config", str(folder / "project.yaml"), "-v")  # the training loop's log lines
    proc = faults.start(folder, *verbose)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.search(stage_line, line):
            break
    import os

    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert any(re.search(stage_line, s) for s in seen), "".join(seen)[-3000:]
    # (a scenario keeps the measured run's state and the refit's apart: scenarios/<name>/<scenario|refit>)
    state = folder / "ws" / "resume" / ("foundation" if "foundation" in stage_line else "scenarios/churn/scenario") / "latest"
    assert (state / "state.json").exists() and (state / "state.safetensors").exists()
    assert faults.half_written(folder / "ws") == []
    rc, out, _ = faults.run(folder, *verbose)
    assert rc == 0, out[-3000:]
    assert re.search(r"resuming from the state saved at step \d+", out)
    diffs = faults.differences(faults.outputs(folder / "ws"), expected)
    assert not diffs, "\n".join(diffs)
    assert not state.exists()  # cleared once the checkpoint is saved
