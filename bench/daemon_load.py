"""Load on the orchestration: the new-data sensor over three years of daily partitions, and sixty queued
runs drained by the real dagster-daemon with the repo's run queue (dagster.yaml).

    .venv/bin/python bench/daemon_load.py [--days 1100] [--runs 60] [--storage sqlite|postgres]

Rows:
- sensor ticks on a DuckDB table with rows on every one of `--days` days (a daily source of that many
  partitions): the first tick (no cursor: it plans runs for every partition), a tick with nothing new (one
  aggregate query), and a tick after late rows landed in an old day (the per-day counts, one run). Each
  tick is the sensor's own function, evaluated as the daemon does (build_sensor_context with the instance).
- `--runs` runs of `extract_<source>` (one daily partition each, a backfill) queued at once and drained by
  `dagster-daemon run` through the queued run coordinator (at most 3 extractions at once): time until the
  queue is empty, runs that failed.

`--storage postgres` reads DAGSTER_PG_HOST / _PORT / _USER / _PASSWORD / _DB (deploy/dagster.postgres.yaml).
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.tables import text_table  # noqa: E402


def make_project(folder: Path, days: int, start: date) -> Path:
    import duckdb
    import yaml

    con = duckdb.connect(str(folder / "warehouse.duckdb"))
    # 40 events a day, 200 customers, every day of the range
    con.sql(f"""CREATE TABLE purchases AS
        SELECT 'C' || (i % 200) AS customer_id,
               TIMESTAMP '{start.isoformat()}' + INTERVAL (i // 40) DAY + INTERVAL (i % 40) MINUTE AS ts,
               (i % 37) AS product_id, (i % 13) * 1.5 AS price
        FROM range({days * 40}) t(i)""")
    con.close()
    end = start + timedelta(days=days)
    cfg = {"workspace": "ws", "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}},
           "entity": "customer_id",
           "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                        "timestamp": "ts", "columns": ["product_id", "price"], "partition": "daily",
                        "start": start.isoformat(), "end": end.isoformat()}],
           "foundation": {"horizon": "7d", "hidden": 16, "layers": 1, "epochs": 1}, "scenarios": {},
           "schedules": {"sensor_interval": 5}}
    (folder / "project.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder / "project.yaml"


def sensor_ticks(config: Path, instance) -> list[dict]:
    import dagster as dg
    import duckdb

    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.definitions import build_definitions
    from habitus.pipelines.orchestration.build import build_resources

    project = load_project(config)
    defs = build_definitions(project)
    sensor = defs.resolve_sensor_def("purchases_new_data")
    resources = build_resources(project)
    rows, cursor = [], None

    def tick(what: str):
        nonlocal cursor
        context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources, definitions=defs)
        started = time.perf_counter()
        result = sensor.evaluate_tick(context)
        seconds = time.perf_counter() - started
        cursor = result.cursor
        rows.append({"what": what, "seconds": seconds, "runs": len(result.run_requests or [])})

    tick("first tick (no cursor)")
    tick("nothing new")
    con = duckdb.connect(str(config.parent / "warehouse.duckdb"))
    old_day = (project.source("purchases").start + timedelta(days=10)).isoformat()
    con.sql(f"INSERT INTO purchases SELECT 'C1', ts + INTERVAL 1 SECOND, product_id, price FROM purchases "
            f"WHERE ts >= TIMESTAMP '{old_day}' ORDER BY ts LIMIT 3")  # late rows in an old day
    con.close()
    tick("late rows in an old day")
    tick("nothing new again")
    return rows


def drain(config: Path, home: Path, runs: int, start: date, env: dict) -> tuple:
    from dagster import DagsterInstance

    workspace = config.parent / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - python_module:\n      module_name: habitus.pipelines.definitions\n"
                         f"      working_directory: {ROOT}\n")
    log = open(config.parent / "daemon.log", "wb")
    bin_dir = Path(sys.executable).parent
    daemon = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
         "signal.signal(signal.SIGTERM, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])",
         str(bin_dir / "dagster-daemon"), "run", "-w", str(workspace)],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        instance = DagsterInstance.from_config(str(home))
        keys = [(start + timedelta(days=i)).isoformat() for i in range(runs)]
        started = time.time()
        subprocess.run([str(bin_dir / "dagster"), "job", "backfill", "-j", "extract_purchases", "--partitions",
                        ",".join(keys), "--noprompt", "-w", str(workspace)], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        submitted = time.time() - started
        peak, done = 0, []
        while time.time() - started < 3600:
            all_runs = instance.get_runs()
            peak = max(peak, sum(r.status.value == "STARTED" for r in all_runs))
            done = [r for r in all_runs if r.status.value in ("SUCCESS", "FAILURE", "CANCELED")]
            if len(done) >= runs:
                break
            time.sleep(1)
        seconds = time.time() - started
        failed = sum(r.status.value != "SUCCESS" for r in done)
        return len(done), failed, peak, submitted, seconds
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--days", type=int, default=1100)
    p.add_argument("--runs", type=int, default=60)
    p.add_argument("--storage", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--skip-drain", action="store_true")
    args = p.parse_args()
    start = date(2023, 1, 1)
    folder = Path(tempfile.mkdtemp(prefix="habitus-daemon-load-"))
    home = folder / "dagster"
    home.mkdir()
    shutil.copy(ROOT / ("deploy/dagster.postgres.yaml" if args.storage == "postgres" else "dagster.yaml"),
                home / "dagster.yaml")
    config = make_project(folder, args.days, start)
    # what deploy/dagster.postgres.yaml asks of a deployment: Dagster's 60 s code-server deadline is too short
    # for starting a run on a loaded small machine (the queue fails the run)
    env = {"DAGSTER_GRPC_TIMEOUT_SECONDS": "300", **os.environ, "DAGSTER_HOME": str(home), "HABITUS_CONFIG": str(config),
           "OMP_NUM_THREADS": "1"}
    os.environ.update(DAGSTER_HOME=str(home), HABITUS_CONFIG=str(config))
    from dagster import DagsterInstance

    try:
        instance = DagsterInstance.from_config(str(home))
        ticks = sensor_ticks(config, instance)
        print(text_table(ticks, [(f"sensor tick, {args.days:,} daily partitions", "what", ""),
                                 ("seconds", "seconds", ".3f"), ("runs requested", "runs", ",")]))
        if not args.skip_drain:
            done, failed, peak, submitted, seconds = drain(config, home, args.runs, start, env)
            print()
            row = {"runs": args.runs, "done": done, "failed": failed, "peak": peak, "submitted": submitted,
                   "seconds": seconds, "per_min": 60 * done / max(seconds, 1e-9)}
            print(text_table([row], [(f"queued runs ({args.storage})", "runs", ","), ("finished", "done", ","),
                                     ("failed", "failed", ","), ("most at once", "peak", ","),
                                     ("submit s", "submitted", ".1f"), ("drained s", "seconds", ".0f"),
                                     ("runs / min", "per_min", ".1f")]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
