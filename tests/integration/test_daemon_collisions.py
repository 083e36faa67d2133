"""Runs that collide through the real `dagster-daemon` and its queued run coordinator (the repo's
dagster.yaml run queue), once on the default SQLite instance storage and once on PostgreSQL
(deploy/dagster.postgres.yaml, verbatim, against a server started here on loopback).

A tiny project (150 customers, three monthly partitions). The attribute tables and two months are
extracted first; then, all at once: the new-data sensor is switched on (it requests the partitions this
instance has not extracted: all three, in one run), a backfill of months 2 and 3 of `extract_purchases`
starts (a run each), and `train` (the foundation schedule's target) is launched by hand. The runs queue (at
most 3 extractions and 1 training at once) and wait for each other's stage locks; the test waits until the
queue has drained and checks: every run went through the queue, every extraction succeeded (in its run's
process), the training run succeeded or stopped with a clear message, no workspace file is half-written or
left over, the extracted partitions equal a serial run's byte for byte, and (on SQLite) a final `habitus
materialize` in that workspace gives exactly the outputs of the same history run serially (from scratch, or
`train` on months 1-2 first when the collided one got there before month 3: `serial_run`).
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.daemon]

ROOT = Path(__file__).resolve().parents[2]
MONTHS = ("2026-01-01", "2026-02-01", "2026-03-01")
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}


def _faults_harness():
    """tests/faults/conftest.py's workspace checks (half_written, leftovers, outputs, differences)."""
    spec = importlib.util.spec_from_file_location("_faults_helpers", ROOT / "tests" / "faults" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Harness


Harness = _faults_harness()


def project_config() -> dict:
    source = lambda name, role, columns, **kw: {"name": name, "role": role, "connection": "warehouse", "table": name,
                                                "columns": columns, **kw}
    return {
        "workspace": "ws",
        "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}},
        "entity": "customer_id",
        "sources": [source("purchases", "events", ["product_id", "price"], timestamp="ts", start=MONTHS[0],
                           end="2026-04-01"),
                    source("customers", "entity_attributes", ["age"]),
                    source("products", "attributes", ["brand"], key="product_id")],
        "foundation": {"horizon": "7d", "cutoff_every": "7d", "hidden": 16, "layers": 1, "epochs": 1},
        "scenarios": {"churn": {"task": "binary", "target": {"no_event": "purchases", "within": "14d"}, "epochs": 1}},
        "predictions": {"start": "2026-03-30", "top_k": 3},
        "schedules": {"sensor_interval": 5},
    }


@pytest.fixture(scope="module")
def warehouse(tmp_path_factory):
    from habitus.pipelines.demo.data import generate_demo_warehouse

    path = tmp_path_factory.mktemp("daemon-warehouse") / "warehouse.duckdb"
    generate_demo_warehouse(path, customers=150, products=30, stores=3, start=MONTHS[0], end="2026-03-31", seed=3)
    return path


# Dagster's deadline for a call to the code server (default 60 s), read by the daemon and the CLI. Starting a
# run is one: the code server spawns the run's process and answers once it has opened the instance, which on a
# loaded machine (Postgres storage: its drivers imported too) took over 60 s, and the queue then failed the run
# ("User code server request timed out"; nothing was retried). deploy/dagster.postgres.yaml says the same.
GRPC_TIMEOUT_S = "300"


def env_for(folder: Path, home: Path, extra: dict | None = None) -> dict:
    env = {**os.environ, "DAGSTER_HOME": str(home), "HABITUS_CONFIG": str(folder / "project.yaml"),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
           "DAGSTER_GRPC_TIMEOUT_SECONDS": GRPC_TIMEOUT_S, **(extra or {})}
    return env


def project(folder: Path, warehouse: Path) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(warehouse, folder / "warehouse.duckdb")
    (folder / "project.yaml").write_text(yaml.safe_dump(project_config(), sort_keys=False))
    return folder


def habitus(folder: Path, env: dict, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run([sys.executable, "-c", "import sys; from habitus.pipelines.cli import main; sys.exit(main())",
                           *(args or ("materialize",)), "--config", str(folder / "project.yaml")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def serial_run(warehouse: Path, base: Path, train_first: bool) -> dict:
    """The serial reference: the project materialized by one `habitus materialize` from scratch, or, when the
    collided `train` run built its cache before month 3 was there (`train_first`), the same history one step
    at a time: the attribute tables and months 1-2 extracted, the `train` job on them (its scenario stops: too
    little history, as the collided one did), then `habitus materialize`. The cache appends new months to the
    version a model was trained on (its ids and statistics stay: models/cache/append.py), so a workspace that
    saw months 1-2 first ends with other bytes than one built once from three months, by design."""
    folder = project(base / "p", warehouse)
    home = folder / "dagster"
    home.mkdir()
    if train_first:
        import dagster as dg

        from habitus.pipelines.config.project import load_project
        from habitus.pipelines.definitions import build_definitions

        extract_first_months(folder)
        job = build_definitions(load_project(folder / "project.yaml")).resolve_job_def("train")
        with dg.DagsterInstance.ephemeral() as instance:
            job.execute_in_process(instance=instance, raise_on_error=False)
    habitus(folder, env_for(folder, home))
    return Harness.outputs(folder / "ws")


def cache_built_before_the_last_month(ws: Path) -> bool:
    """Whether the workspace's current cache was appended to a version built on months 1-2 (the collided
    `train` run got there before the sensor's or the backfill's month 3) or built once from all three."""
    current = json.loads((ws / "cache" / "current.json").read_text())["folder"]
    manifest = json.loads((ws / "cache" / current / "manifest.json").read_text())
    assert manifest["mode"] in ("fresh", "append") and manifest["appends"] <= 1, {
        k: manifest.get(k) for k in ("mode", "appends", "parent")}
    return manifest["mode"] == "append"


@pytest.fixture(scope="module")
def serial_sources(warehouse, tmp_path_factory):
    """The extracted files of a serial extraction (every table, every month, in-process)."""
    folder = project(tmp_path_factory.mktemp("daemon-serial-sources") / "p", warehouse)
    extract_first_months(folder, MONTHS)
    return Harness.outputs(folder / "ws")


def extract_first_months(folder: Path, months=MONTHS[:2]) -> None:
    """The attribute tables and months 1 and 2 extracted in-process (a throwaway instance: the daemon's does
    not know them, so its sensor asks for all three months)."""
    import dagster as dg

    from habitus.assets.sources import build_source_asset
    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.build import build_resources
    from habitus.pipelines.orchestration.partitions import events_partitions

    p = load_project(folder / "project.yaml")
    for name in ("customers", "products"):
        assert dg.materialize([build_source_asset(p, p.source(name), None)], resources=build_resources(p)).success
    source = p.source("purchases")
    asset = build_source_asset(p, source, events_partitions(source))
    for month in months:
        assert dg.materialize([asset], resources=build_resources(p), partition_key=month).success


# --------------------------------------------------------------------------- instance storages


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server (Debian's, run as the postgres user) on a loopback port with a password-protected
    role: DAGSTER_PG_* as deploy/dagster.postgres.yaml reads them. Skips where PostgreSQL or dagster-postgres
    is missing (.ci/run installs both)."""
    pytest.importorskip("dagster_postgres", reason="pip install 'dagster-postgres==0.29.27'")
    import glob

    # Debian's postgresql package keeps its programs in /usr/lib/postgresql/<version>/bin, off the PATH
    bins = [os.path.dirname(p) for p in (shutil.which("initdb"),) if p] + sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    found = [b for b in bins if os.path.exists(os.path.join(b, "initdb")) and os.path.exists(os.path.join(b, "pg_ctl"))]
    initdb, pg_ctl = (os.path.join(found[0], "initdb"), os.path.join(found[0], "pg_ctl")) if found else (None, None)
    if not initdb:
        pytest.skip("PostgreSQL not installed (apt-get install postgresql)")
    import pwd

    try:
        pg = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no postgres system user to run the server as")
    as_pg = (lambda cmd: cmd) if os.getuid() == pg.pw_uid else (lambda cmd: ["runuser", "-u", "postgres", "--", *cmd])
    base = Path(tempfile.mkdtemp(prefix="habitus-pg-"))  # outside pytest's root-only tmp folders
    password = "pg-" + os.urandom(6).hex()
    (base / "pw").write_text(password)
    os.chown(base, pg.pw_uid, pg.pw_gid)
    os.chown(base / "pw", pg.pw_uid, pg.pw_gid)
    port = _free_port()
    subprocess.run(as_pg([initdb, "-D", str(base / "data"), "-U", "dagster", f"--pwfile={base / 'pw'}",
                          "-A", "scram-sha-256", "--no-sync"]), check=True, capture_output=True)
    subprocess.run(as_pg([pg_ctl, "-D", str(base / "data"), "-l", str(base / "server.log"), "-w", "-t", "60", "-o",
                          f"-p {port} -c listen_addresses=127.0.0.1 -k {base} -c fsync=off", "start"]),
                   check=True, capture_output=True)
    env = {"DAGSTER_PG_HOST": "127.0.0.1", "DAGSTER_PG_PORT": str(port), "DAGSTER_PG_USER": "dagster",
           "DAGSTER_PG_PASSWORD": password, "DAGSTER_PG_DB": "postgres"}
    try:
        yield env, base
    finally:
        subprocess.run(as_pg([pg_ctl, "-D", str(base / "data"), "-m", "immediate", "-w", "stop"]), capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def instance_home(folder: Path, storage: str, request) -> tuple[Path, dict]:
    """$DAGSTER_HOME with the repo's dagster.yaml (SQLite) or deploy/dagster.postgres.yaml, and the env it needs."""
    home = folder / "dagster"
    home.mkdir()
    if storage == "sqlite":
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        return home, {}
    env, _ = request.getfixturevalue("postgres")
    shutil.copy(ROOT / "deploy" / "dagster.postgres.yaml", home / "dagster.yaml")
    # a database of its own per test: the same server, nothing shared with another run of the test
    db = f"habitus_{os.urandom(4).hex()}"
    import psycopg2

    con = psycopg2.connect(host=env["DAGSTER_PG_HOST"], port=env["DAGSTER_PG_PORT"], user=env["DAGSTER_PG_USER"],
                           password=env["DAGSTER_PG_PASSWORD"], dbname="postgres")
    con.autocommit = True
    con.cursor().execute(f"CREATE DATABASE {db}")
    con.close()
    return home, {**env, "DAGSTER_PG_DB": db}


# --------------------------------------------------------------------------- the daemon


class Daemon:
    """`dagster-daemon run` on a workspace file, in its own process group (stopped with conftest's
    stop_process_group: SIGTERM, then SIGKILL by PID)."""

    def __init__(self, folder: Path, env: dict):
        self.workspace = folder / "workspace.yaml"
        self.workspace.write_text(yaml.safe_dump({"load_from": [{"python_module": {
            "module_name": "habitus.pipelines.definitions", "working_directory": str(ROOT)}}]}))
        self.env, self.log = env, folder / "daemon.log"
        out = open(self.log, "wb")
        # a daemon started from a script ignores SIGINT/SIGTERM (COMPONENTS.md); default handlers first
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "signal.signal(signal.SIGTERM, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])",
             str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", str(self.workspace)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()

    def cli(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([str(Path(sys.executable).parent / "dagster"), *args, "-w", str(self.workspace)],
                                cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_until_drained(instance, daemon: Daemon, stall: float = 900, settle: float = 20) -> list:
    """All runs terminal, the sensor ticked since it was started, and nothing new for `settle` seconds.

    The deadline follows progress, not the clock: it fails only when no run has written an event and no run
    changed state for `stall` seconds (a wedged queue or a lock never released), however long a loaded
    machine takes to get through the runs."""
    progress, moved, stable_since, last = None, time.time(), None, None
    while True:
        assert daemon.proc.poll() is None, f"dagster-daemon exited; log:\n{daemon.log.read_text()[-3000:]}"
        runs = instance.get_runs()
        state = sorted((r.run_id, r.status.value) for r in runs)
        busy = [r for r in runs if r.status.value not in TERMINAL]
        now = (state, sum(len(instance.all_logs(r.run_id)) for r in busy))
        if now != progress:
            progress, moved = now, time.time()
        elif time.time() - moved > stall:
            raise AssertionError(
                f"no run moved for {stall:.0f}s: {[(r.job_name, r.status.value) for r in runs]}"
                f"\ndaemon log:\n{daemon.log.read_text()[-3000:]}")
        origin = _sensor_origin(instance)
        ticks = [t for t in instance.get_ticks(*origin) if t.status.value != "STARTED"] if origin else []
        if not busy and ticks and runs:
            if state != last:
                stable_since, last = time.time(), state
            elif time.time() - stable_since >= settle:
                return runs
        else:
            stable_since, last = None, None
        time.sleep(2)


def _sensor_origin(instance):
    states = [s for s in instance.all_instigator_state() if s.instigator_name == "purchases_new_data"]
    return (states[0].instigator_origin_id, states[0].selector_id) if states else None


def rows_lost(folder: Path, ws: Path) -> int:
    """The warehouse's purchases in the three months minus the rows of the extracted partition files."""
    import duckdb
    import pyarrow.parquet as pq

    con = duckdb.connect(str(folder / "warehouse.duckdb"), read_only=True)
    try:
        (want,) = con.execute("SELECT count(*) FROM purchases WHERE ts >= ? AND ts < ?",
                              [MONTHS[0], "2026-04-01"]).fetchone()
    finally:
        con.close()
    files = [ws / "sources" / "purchases" / f"{m}.parquet" for m in MONTHS]
    return want - sum(pq.read_metadata(f).num_rows for f in files if f.exists())


def run_log(instance, run) -> list[str]:
    return [e.user_message or "" for e in instance.all_logs(run.run_id)]


@pytest.mark.parametrize("storage", ["sqlite", "postgres"])
def test_sensor_backfill_and_a_manual_training_run_collide_through_the_daemon(storage, warehouse, serial_sources,
                                                                              tmp_path, request, stop_process_group):
    from dagster import DagsterInstance

    folder = project(tmp_path / "p", warehouse)
    home, extra = instance_home(folder, storage, request)
    env = env_for(folder, home, extra)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the instance opened here reads the same dagster.yaml and variables
    try:
        extract_first_months(folder)
        instance = DagsterInstance.from_config(str(home))
        assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
        assert ("Postgres" if storage == "postgres" else "Sqlite") in type(instance.run_storage).__name__
        daemon = Daemon(folder, env)
        try:
            started = time.time()
            # all at once: the sensor on, a backfill of the three months, the training run by hand
            submitted = [daemon.cli("sensor", "start", "purchases_new_data"),
                         daemon.cli("job", "backfill", "-j", "extract_purchases", "--partitions",
                                    ",".join(MONTHS[1:]), "--noprompt"),
                         # one process for the training run's steps (the multiprocess default starts one per
                         # step and asset check: minutes on two cores, and nothing more to show)
                         daemon.cli("job", "launch", "-j", "train", "--config-json",
                                    json.dumps({"execution": {"config": {"in_process": {}}}}))]
            for proc in submitted:
                out, _ = proc.communicate(timeout=300)
                assert proc.returncode == 0, out[-3000:]
            runs = wait_until_drained(instance, daemon)
            drained_s = time.time() - started
        finally:
            stop_process_group(daemon.proc, grace=30, kill_grace=30)
        by_job = {}
        for r in runs:
            by_job.setdefault(r.job_name, []).append(r)
        logs = {r.run_id: run_log(instance, r) for r in runs}
        report = [(r.job_name, r.status.value, r.tags.get("dagster/partition") or r.tags.get(
            "dagster/asset_partition_range_start"), r.tags.get("dagster/sensor_name") or r.tags.get("dagster/backfill"))
                  for r in runs]
        # every run went through the queue (enqueued, then dequeued by the daemon)
        from dagster import DagsterEventType

        # enqueued by the coordinator, then started by the daemon's queue (1.13.27 stores no DEQUEUED event)
        queued = {DagsterEventType.RUN_ENQUEUED.value, DagsterEventType.RUN_STARTING.value}
        for r in runs:
            kinds = {e.dagster_event.event_type_value for e in instance.all_logs(r.run_id) if e.dagster_event}
            assert queued <= kinds, (r.job_name, sorted(kinds))
        extractions = by_job.get("extract_purchases", [])
        assert len(extractions) >= 3, report  # the backfill's two, and the sensor's
        # each extraction ran its step and checks in its run's process (no worker process per step)
        for r in extractions:
            kinds = [e.dagster_event.event_type_value for e in instance.all_logs(r.run_id) if e.dagster_event]
            assert DagsterEventType.STEP_WORKER_STARTING.value not in kinds, (r.run_id, kinds)
        assert any(r.tags.get("dagster/sensor_name") == "purchases_new_data" for r in extractions), report
        dequeue_errors = [line for line in daemon.log.read_text(errors="replace").splitlines()
                          if "error dequeuing" in line or "UserCodeUnreachable" in line]
        assert all(r.status.value == "SUCCESS" for r in extractions), (report, dequeue_errors)
        (train,) = by_job["train"]
        if train.status.value != "SUCCESS":  # it may have started before the third month landed, or failed clearly
            assert any("failed" in m or "Error" in m for m in logs[train.run_id]), logs[train.run_id][-5:]
        waits = [m for ms in logs.values() for m in ms if "in use by pid" in m]
        ws = folder / "ws"
        assert Harness.half_written(ws) == []
        assert Harness.leftovers(ws) == []
        sources = {k: v for k, v in Harness.outputs(ws).items() if k.startswith("sources/")}
        assert Harness.differences(sources, serial_sources) == []
        lost = rows_lost(folder, ws)
        assert lost == 0, f"{lost} warehouse rows of the three months are in no extracted partition"
        train_first = None
        if storage == "sqlite":
            # after the collisions, one more run in this workspace ends exactly where the same history run
            # serially does (once: the instance storage does not touch the workspace's files)
            habitus(folder, env)
            train_first = cache_built_before_the_last_month(ws)
            reference = serial_run(warehouse, tmp_path / "serial", train_first)
            # the foundation's kept versions are the history of its trainings, the one on months 1-2 included,
            # trained here in the daemon's run process and there in this one (other threads, other last bits);
            # the foundation that serves (checkpoints/foundation) is compared
            final = lambda outputs: {k: v for k, v in outputs.items()  # noqa: E731
                                     if not k.startswith("checkpoints/foundation_versions/")}
            assert Harness.differences(final(Harness.outputs(ws)), final(reference)) == [], train_first
        print(f"\n{storage}: {len(runs)} runs ({', '.join(f'{j}: {len(rs)}' for j, rs in sorted(by_job.items()))}), "
              f"train {train.status.value}, {len(waits)} lock waits logged, drained in {drained_s:.0f}s, rows lost "
              f"{lost}" + (f", train before month 3: {train_first}" if train_first is not None else ""))
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_extraction_jobs_run_in_process_off_kubernetes_and_as_pods_on_it(tmp_path):
    """The daemon's extraction runs (sensor, backfill) execute in their run's process: the multiprocess default
    started a Python per step and asset check (6 a source), each importing the code location, which made a
    seconds-long extraction take minutes on two cores. On Kubernetes every step stays its own Job."""
    from dagster import in_process_executor

    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.definitions import build_definitions

    cfg = project_config()
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    defs = build_definitions(load_project(tmp_path / "project.yaml"))
    assert defs.resolve_job_def("extract_purchases").executor_def is in_process_executor
    assert defs.resolve_job_def("train").executor_def is not in_process_executor  # training keeps its default
    pytest.importorskip("dagster_k8s")
    cfg["kubernetes"] = {"workspace_claim": "habitus-workspace"}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    defs = build_definitions(load_project(tmp_path / "project.yaml"))
    executors = {defs.resolve_job_def(j).executor_def.name for j in ("extract_purchases", "train")}
    assert executors == {"k8s_habitus"}, executors  # pipelines/orchestration/kubernetes.py's k8s_job_executor, for every job


def test_the_postgres_example_queues_runs_as_the_repo_instance_does():
    example = yaml.safe_load((ROOT / "deploy" / "dagster.postgres.yaml").read_text())
    repo = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    assert example["run_queue"] == repo["run_queue"] and example["retention"] == repo["retention"]
    db = example["storage"]["postgres"]["postgres_db"]
    assert db["password"] == {"env": "DAGSTER_PG_PASSWORD"}  # never a password in the file
