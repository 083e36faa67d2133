"""Fault injection: a small demo project, the pipeline run as a real subprocess (`habitus materialize`),
SIGKILLed at chosen moments, and the workspace inspected afterwards.

Helpers reach the tests through the `faults` fixture (a `Harness`), so nothing imports this file by name.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest

from safetensors.torch import load_file

from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.heads.stacked_head import load_head
from habitus.models.storage.files import file_sha256

ROOT = Path(__file__).resolve().parents[2]

# values that differ between two clean runs by design: wall-clock times and durations
# "added": when a model version was kept; "from" / "to": when a version started and stopped serving
VOLATILE_KEYS = {"build_seconds", "seconds", "at", "added", "from", "to"}


def fault_project_config(small_project) -> dict:
    """The project the kill tests run: small, with saves every few steps so that kills land between them."""
    return small_project.config(
        purchases=["product_id", "store_id", "quantity", "price"], events={"end": "2026-09-01"},
        customers=["age", "segment"], products=["brand", "category"],
        foundation={"epochs": 2, "batch_size": 64, "save_every_steps": 4},
        scenarios={"churn": small_project.churn(epochs=2, train_cutoffs=2, save_every_steps=1)},
        predictions={"top_k": 3, "start": "2026-08-01"})


class Harness:
    def __init__(self, warehouse: Path, small_project):
        self.warehouse = warehouse
        self.small_project = small_project
        self.config = fault_project_config(small_project)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        self.env.pop("HABITUS_CONFIG", None)

    def project(self, folder: Path, config: dict | None = None) -> Path:
        """A project folder: the small demo warehouse (copied) and its config (the harness's by default)."""
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.warehouse, folder / "warehouse.duckdb")
        self.small_project.write(folder, config or self.config)
        return folder

    def start(self, folder: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-c", "import sys; from habitus.pipelines.cli import main; sys.exit(main())",
               *(args or ("materialize", "--config", str(folder / "project.yaml")))]
        return subprocess.Popen(cmd, cwd=ROOT, env={**self.env, "DAGSTER_HOME": str(folder / "dagster"),
                                                   **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def run(self, folder: Path, *args: str, env: dict | None = None, timeout: float = 600) -> tuple[int, str, float]:
        started = time.monotonic()
        proc = self.start(folder, *args, env=env)
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, time.monotonic() - started

    def run_killed(self, folder: Path, after_s: float) -> tuple[bool, str]:
        """Run the pipeline and SIGKILL it (its whole process group) after `after_s` seconds.
        Returns (killed: False when it finished first, its output)."""
        proc = self.start(folder)
        try:
            out, _ = proc.communicate(timeout=after_s)
            return False, out
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return True, out

    # ------------------------------------------------------------------ what a workspace holds

    @staticmethod
    def half_written(ws: Path) -> list[str]:
        """Visible (not dot-named) files that are not whole: each must parse as what its name says."""
        problems = []
        if not ws.exists():
            return problems
        for path in sorted(p for p in ws.rglob("*") if p.is_file()):
            rel = path.relative_to(ws)
            if any(part.startswith(".") for part in rel.parts):
                continue  # temporary names: never read by habitus
            try:
                if path.suffix == ".parquet":
                    pq.read_table(path)
                elif path.suffix == ".arrow":
                    ipc.open_file(path).read_all()
                elif path.suffix == ".json":
                    json.loads(path.read_text())
                elif path.name == "model.safetensors":
                    load_checkpoint(path.parent)  # verifies the SHA-256 recorded in config.json
                elif path.name == "stack_trunk.safetensors":  # the head chosen on validation (stacking_head)
                    assert load_head(path.parent, json.loads((path.parent / "config.json").read_text())) is not None
                elif path.name == "state.safetensors":  # resumable training state (habitus.models.train.resume)
                    body = json.loads((path.parent / "state.json").read_text())
                    assert body["tensors_sha256"] == file_sha256(path), "state does not match its state.json"
                    load_file(str(path))
                elif path.suffix == ".png":
                    raw = path.read_bytes()
                    assert raw.startswith(b"\x89PNG") and raw.endswith(b"IEND\xaeB`\x82"), "truncated PNG"
                elif path.suffix == ".lock":
                    pass  # a lock file's record may be empty (released) or name its holder
                elif path.name.startswith("lightgbm") and path.suffix == ".txt":  # a served baseline's booster
                    import lightgbm

                    lightgbm.Booster(model_file=str(path))
                else:
                    problems.append(f"{rel}: unexpected file")
            except Exception as e:  # noqa: BLE001 - any failure to read is the finding
                problems.append(f"{rel}: {type(e).__name__}: {str(e)[:200]}")
        for cache_dir in (ws / "cache").glob("*") if (ws / "cache").exists() else []:
            if cache_dir.is_dir() and not cache_dir.name.startswith(".") and not (cache_dir / "manifest.json").exists():
                problems.append(f"cache/{cache_dir.name}: a cache folder without manifest.json")
        return problems

    @staticmethod
    def leftovers(ws: Path) -> list[str]:
        """Temporary or moved-aside copies still in the workspace (after a run that finished)."""
        return sorted(str(p.relative_to(ws)) for p in ws.rglob(".*") if re.search(r"\.(tmp|old|unsorted)-\d+$", p.name))

    @staticmethod
    def differences(a, b) -> list[str]:
        return differences(a, b)

    @staticmethod
    def outputs(ws: Path) -> dict:
        """Everything a run produced, comparable across runs: file bytes, JSON with the workspace path and
        wall-clock values taken out (floats to 12 significant digits), PNGs by presence only."""
        out = {}
        for path in sorted(p for p in ws.rglob("*") if p.is_file()):
            rel = str(path.relative_to(ws))
            if any(part.startswith(".") for part in Path(rel).parts) or rel.startswith(("locks/", "resume/")):
                continue
            if path.suffix == ".json":
                out[rel] = _normalized(json.loads(path.read_text().replace(str(ws), "<ws>")))
            elif path.suffix == ".png":
                out[rel] = "png"
            elif path.suffix == ".arrow":
                # DuckDB orders events of one entity at the same second (a basket) differently from run to
                # run; the rows, not their order among equals, are the output
                table = ipc.open_file(path).read_all()
                table = table.sort_by([(c, "ascending") for c in table.column_names]).combine_chunks()
                sink = pa.BufferOutputStream()
                with ipc.new_stream(sink, table.schema) as writer:
                    writer.write_table(table)
                out[rel] = sink.getvalue().to_pybytes()
            else:
                out[rel] = path.read_bytes()
        return out


def differences(a, b, where: str = "") -> list[str]:
    """Where two `outputs` differ (paths into files and JSON), for a readable failure."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str)
                for d in (differences(a.get(k), b.get(k), f"{where}/{k}") if k in a and k in b
                          else [f"{where}/{k}: only in {'the first' if k in a else 'the second'}"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if a != b:
        return [f"{where}: {str(a)[:80]} != {str(b)[:80]}"]
    return []


def _normalized(value):
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    if isinstance(value, float) and math.isfinite(value) and value != 0:
        # DuckDB's parallel aggregates (cache statistics) may differ in the last bits between runs
        return float(f"{value:.12g}")
    return value


@pytest.fixture(scope="session")
def faults(tmp_path_factory, small_project) -> Harness:
    from habitus.pipelines.demo.data import generate_demo_warehouse

    warehouse = tmp_path_factory.mktemp("faults-warehouse") / "warehouse.duckdb"
    generate_demo_warehouse(warehouse, customers=400, products=60, stores=5, start="2026-03-01", end="2026-08-31",
                            seed=2)
    return Harness(warehouse, small_project)


def pytest_collection_modifyitems(config, items):
    """The kill tests take minutes: they run with `-m faults` (`make test-faults`, CI), not in `make test`."""
    if "faults" in (config.getoption("-m") or ""):
        return
    kept = [i for i in items if i.get_closest_marker("faults") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("faults") is not None])
        items[:] = kept
