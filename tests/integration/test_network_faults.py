"""Network faults on the connectors whose servers run here: the server is SIGKILLed in the middle of an
extraction (and started again), or, for S3, a loopback proxy cuts the connection after N bytes.

For each of fakesnow (Snowflake), Spark's Thrift server (Hive), bqemulator (BigQuery) and moto (S3):

- the source asset's attempt fails naming the connection and its host, the error is classified
  transient, Dagster's RetryPolicy retries the step, and the retried run's Parquet files have the same
  bytes (and rows) as an undisturbed run's;
- permanent errors (a missing table, bad SQL; a refused login on S3) fail at once: one attempt, no retry;
- a write-back whose connection drops in the middle of the load leaves the day with its old rows; the
  next write gives the new rows: never a mix, never none.

Each test starts its own servers (module scope, own data folders), since it kills them.
"""

import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from habitus.resources.warehouses.errors import WarehouseError


def _helpers():
    """tests/integration/conftest.py's server and data helpers (pytest imports it as a plugin, not by name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_integration_helpers", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_h = _helpers()
SCORES, expected_ids, find_program, free_port, scores, wait_for_port, events_table, load_events = (
    _h.SCORES, _h.expected_ids, _h.find_program, _h.free_port, _h.scores, _h.wait_for_port, _h.events_table,
    _h.load_events)

pytestmark = [pytest.mark.integration, pytest.mark.faults]

PARTITIONS = ("2026-03-01", "2026-04-01")  # two monthly partitions in one run (the events: 2026-02-20..04-19)


# --------------------------------------------------------------------------- servers that can be killed


class Restartable:
    """A server in its own process group on a fixed loopback port: `kill()` (SIGKILL, as a crash),
    `start()` again on the same port and data folder."""

    def __init__(self, cmd: list[str], port: int, log: Path, timeout: float = 60, env=None, cwd=None,
                 ready=None, extra_ports=()):
        self.cmd, self.port, self.log, self.timeout, self.env, self.cwd = cmd, port, log, timeout, env, cwd
        self.ready, self.extra_ports, self.proc = ready, extra_ports, None
        self.start()

    def start(self) -> None:
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
                                     start_new_session=True)
        out.close()
        try:
            for port in (self.port, *self.extra_ports):
                wait_for_port(port, self.proc, self.log, self.timeout)
            if self.ready:
                self.ready(self)
        except Exception:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class Fault:
    """Armed: the `after`-th item of the `nth` read (counting from 0; the first item is the described
    schema, then batches) is handed on only after `fire` ran: the server is killed once that item arrived,
    so the next request of the read meets a dead server (after=-1: before the read starts). `fire` starts
    it again `down_s` later."""

    def __init__(self):
        self.armed, self.reads, self.fired = None, 0, 0
        self.restarted = threading.Event()

    def arm(self, server: Restartable, nth: int = 0, after: int = 0, down_s: float = 1.0, after_restart=None):
        self.armed, self.reads, self.fired = (server, nth, after, down_s, after_restart), 0, 0
        self.restarted.clear()

    def disarm(self):
        self.armed = None

    def wrap(self, items):
        """`items` (a read's generator, not started yet) passed through; after=-1 fires before it starts."""
        read, self.reads = self.reads, self.reads + 1
        if self.armed and read == self.armed[1] and self.armed[2] == -1:
            self.fire()
        for i, item in enumerate(items):
            if self.armed and read == self.armed[1] and i == self.armed[2]:
                self.fire()
            yield item

    def fire(self):
        server, _, _, down_s, after_restart = self.armed
        self.armed = None
        server.kill()
        self.fired += 1

        def restart():
            time.sleep(down_s)
            server.start()
            if after_restart:
                after_restart()
            self.restarted.set()

        threading.Thread(target=restart, daemon=True).start()


FAULT = Fault()


def faulty(wh):
    """`wh` as an instance of a subclass whose reads pass through FAULT (the real driver, the real server)."""
    base = type(wh)
    if hasattr(base, "_chunks"):
        def _chunks(self, *args):
            return FAULT.wrap(base._chunks(self, *args))
        body = {"_chunks": _chunks}
    else:
        def read(self, *args, **kw):
            return FAULT.wrap(base.read(self, *args, **kw))
        body = {"read": read}
    cls = type(f"Faulty{base.__name__}", (base,), {"__module__": __name__, **body})
    return cls(**{k: getattr(wh, k) for k in base.model_fields})


# --------------------------------------------------------------------------- the extraction, as Dagster runs it


def source_run(tmp_path, wh, table="events", instance=None, delay=2, retries=5):
    """The source asset of `table` on connection `wh` (any resource), partitions PARTITIONS in one run,
    with the RetryPolicy short (the config's `retries: {max_retries: 5, delay_s: 2}`: 2 s, 6 s, 14 s, 30 s, 62 s).
    Returns (result, files)."""
    from habitus.assets.sources import build_source_asset
    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.partitions import events_partitions
    from habitus.resources.store.workspace import Workspace

    cfg = {"workspace": "ws", "connections": {"wh": {"type": "duckdb", "path": "unused.duckdb"}},
           "entity": "customer_id",
           "sources": [{"name": "events", "role": "events", "connection": "wh", "table": table, "timestamp": "ts",
                        "columns": ["product_id", "price", "amount"], "start": "2026-03-01", "end": "2026-05-01"}],
           "retries": {"max_retries": retries, "delay_s": delay}}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    project = load_project(tmp_path / "project.yaml")
    source = project.source("events")
    asset = build_source_asset(project, source, events_partitions(source))
    assert (asset.op.retry_policy.max_retries, asset.op.retry_policy.delay) == (retries, delay)
    resources = {"connection_wh": wh, "workspace": Workspace(root=str(project.workspace_path))}
    result = dg.materialize([asset], resources=resources, raise_on_error=False, instance=instance,
                            tags={"dagster/asset_partition_range_start": PARTITIONS[0],
                                  "dagster/asset_partition_range_end": PARTITIONS[-1]})
    folder = project.workspace_path / "sources" / "events"
    return result, {k: (folder / f"{k}.parquet") for k in PARTITIONS}


def events_of(result, kind: str) -> list:
    return [e for e in result.all_events if e.event_type_value == kind]


def _messages(error) -> str:
    """An error's message and its causes' (a retry's error is the RetryRequested; its cause the asset's)."""
    parts = []
    while error is not None:
        parts.append(error.message.strip())
        error = error.cause or error.context
    return "\n".join(parts)


def retry_messages(result) -> list[str]:
    return [_messages(e.event_specific_data.error) for e in events_of(result, "STEP_UP_FOR_RETRY")]


def failure_message(result) -> str:
    failures = events_of(result, "STEP_FAILURE")
    return _messages(failures[-1].event_specific_data.error) if failures else ""


def check_retried_extraction(tmp_path, wh, server, host: str, nth=1, after=0, down_s=1.0, after_restart=None,
                             names="connection 'wh'", delay=2):
    """An undisturbed run, then one whose server is killed at the `after`-th item of read `nth`: the attempt
    fails naming the connection (`names`) and `host`, is retried, and the files equal the undisturbed run's."""
    clean, clean_files = source_run(tmp_path / "clean", wh)
    assert clean.success, failure_message(clean)
    want = {k: f.read_bytes() for k, f in clean_files.items()}
    FAULT.arm(server, nth=nth, after=after, down_s=down_s, after_restart=after_restart)
    try:
        result, files = source_run(tmp_path / "killed", faulty(wh), delay=delay)
    finally:
        FAULT.disarm()
    assert FAULT.fired == 1, "the fault never fired: the read ended before its trigger"
    assert FAULT.restarted.wait(600), "the server did not come back"
    messages = retry_messages(result)
    assert result.success, failure_message(result) + "\n" + "\n".join(messages)
    assert messages, "the step succeeded without a retry: the fault did not reach the extraction"
    first = messages[0]
    assert names in first and host in first, first
    assert "source/events" in first and "attempt 1" in first, first
    got = {k: f.read_bytes() for k, f in files.items()}
    differing = sum(got[k] != want[k] for k in want)
    lost = 0
    for k, f in files.items():
        start = datetime.fromisoformat(k)
        end = datetime(start.year + start.month // 12, start.month % 12 + 1, 1)
        lost += len(expected_ids(start, end)) - pq.read_metadata(f).num_rows
    assert differing == 0, "the retried run's Parquet differs from the undisturbed run's"
    assert lost == 0
    return messages


def check_permanent_errors_fail_at_once(tmp_path, wh, bad_sql):
    """A missing table: the step fails on its first attempt (no retry), naming the table. Bad SQL through
    the connector: a permanent WarehouseError."""
    result, files = source_run(tmp_path / "missing", wh, table="no_such_table")
    assert not result.success
    assert retry_messages(result) == [], "a missing table was retried"
    message = failure_message(result)
    assert "no_such_table" in message and "permanent" in message and "attempt 1" in message, message
    assert not any(f.exists() for f in files.values())
    with pytest.raises(WarehouseError) as err:
        bad_sql(wh)
    assert err.value.transient is False, str(err.value)


def check_write_survives_a_drop(wh, rows_of, table: str, host: str, drop, restore, absorbed=False, **write_options):
    """Day d1 holds 10 rows; a re-write of 6 rows whose connection is dropped (`drop()`: the server killed,
    or the network cut) after its second batch fails (a transient error naming the host) and leaves the 10
    rows; once `restore()` returned, the re-write gives the 6 rows. Never a mix, never none. `absorbed`: the
    driver may instead retry until the server is back and the write goes through whole (the new rows)."""
    d1 = datetime(2026, 3, 1)
    assert wh.write(table, iter(scores(d1, 10)), SCORES, replace=("as_of", d1), **write_options) == 10
    old = sorted((c, s) for c, s, _ in rows_of(table))
    assert old == [(f"C{i}", i / 10) for i in range(10)]
    new_batches = pa.Table.from_batches(scores(d1, 6, offset=1.0)).to_batches(max_chunksize=1)

    def dropping():
        yield new_batches[0]
        yield new_batches[1]
        drop()  # the connection goes in the middle of the load
        yield from new_batches[2:]

    new = [(f"C{i}", i / 6 + 1.0) for i in range(6)]
    try:
        wh.write(table, dropping(), SCORES, replace=("as_of", d1), **write_options)
    except WarehouseError as err:
        assert err.transient, str(err)
        assert host in str(err), str(err)
        restore()
        assert sorted((c, s) for c, s, _ in rows_of(table)) == old  # the old rows, all of them
    else:  # the driver's own retries outlasted the outage: the write went through whole
        assert absorbed, "the write succeeded although its connection was dropped"
        restore()
        assert sorted((c, s) for c, s, _ in rows_of(table)) == new
    assert wh.write(table, iter(new_batches), SCORES, replace=("as_of", d1), **write_options) == 6
    assert sorted((c, s) for c, s, _ in rows_of(table)) == new


def load(wh, table="events"):
    load_events(wh, table)


# --------------------------------------------------------------------------- Snowflake (fakesnow)


@pytest.fixture(scope="module")
def fakesnow(tmp_path_factory):
    """fakesnow keeps its databases in memory (its FAKESNOW_DB_PATH files take one session at a time), so
    after a restart the table is put back, as a warehouse's tables outlive its restart. Yields (server,
    warehouse, host, put back, warehouse through a proxy)."""
    program = find_program("fakesnow", "HABITUS_FAKESNOW", ".venv-fakesnow")
    if program is None:
        pytest.skip("fakesnow not installed: `make .venv-fakesnow/.installed`")
    pytest.importorskip("snowflake.connector", reason="install the snowflake extra")
    home = tmp_path_factory.mktemp("fakesnow-faults")
    port = free_port()
    server = Restartable([program, "-s", "--host", "127.0.0.1", "-p", str(port)], port, home / "server.log")
    proxy = CuttingProxy(port)
    from habitus.resources.warehouses.snowflake import SnowflakeWarehouse

    def wh(database=None, via=port):
        return SnowflakeWarehouse(name="wh", account="fakesnow", user="fake", password="snow", database=database,
                                  schema_name="PUBLIC", login_timeout=5,
                                  options={"host": "127.0.0.1", "port": via, "protocol": "http",
                                           "network_timeout": 5, "socket_timeout": 5})

    def put_back():
        con = wh()._connect()
        con.cursor().execute("CREATE DATABASE IF NOT EXISTS SHOP")
        con.cursor().execute("CREATE SCHEMA IF NOT EXISTS SHOP.PUBLIC")
        con.close()
        load(wh("SHOP"))

    put_back()
    yield server, wh("SHOP"), f"127.0.0.1:{port}", put_back, proxy, wh("SHOP", via=proxy.port)
    proxy.close()
    server.stop()


def kill_and_restart(server: Restartable, down_s: float = 0.5):
    """(drop, restore) for check_write_survives_a_drop: SIGKILL the server; start it again and wait for it."""
    def drop():
        FAULT.arm(server, down_s=down_s)
        FAULT.fire()

    def restore():
        assert FAULT.restarted.wait(600), "the server did not come back"

    return drop, restore


def _cursor_rows(wh, quote: str):
    """A write-back table's rows through a DB-API connector's cursor (Snowflake quotes names with ", Hive with `)."""
    def rows(table):
        with wh._cursor(table) as cur:
            cur.execute(f"SELECT {', '.join(quote + c + quote for c in ('customer_id', 'score', 'as_of'))} "
                        f"FROM {quote}{table}{quote}")
            return cur.fetchall()
    return rows


def _cursor_bad_sql(wh):
    with wh._cursor("events") as cur:
        cur.execute("SELEC customer_id FROM events")


def test_snowflake_extraction_survives_a_server_restart(fakesnow, tmp_path):
    server, wh, host, put_back, _, _ = fakesnow
    # killed once partition 2026-03-01 is written and the next one's table is described: its SELECT meets a
    # dead server
    check_retried_extraction(tmp_path, wh, server, host, nth=1, after=0, after_restart=put_back)


def test_snowflake_permanent_errors_are_not_retried(fakesnow, tmp_path):
    _, wh, _, _, _, _ = fakesnow
    check_permanent_errors_fail_at_once(tmp_path, wh, _cursor_bad_sql)


def test_snowflake_write_back_survives_a_dropped_connection(fakesnow):
    """The network between client and server goes (a proxy resets every connection) after the first staged
    file: fakesnow's rows live in memory, so its server stays up and keeps the day's old rows to check."""
    _, _, _, _, proxy, wh = fakesnow
    check_write_survives_a_drop(wh, _cursor_rows(wh, '"'), "habitus_scores", f"127.0.0.1:{proxy.port}", proxy.down,
                                proxy.up, file_rows=2)


# --------------------------------------------------------------------------- Hive (Spark Thrift server)


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    program = find_program("spark-submit", "HABITUS_SPARK_SUBMIT", ".venv-spark")
    if program is None or (not os.environ.get("JAVA_HOME") and not __import__("shutil").which("java")):
        pytest.skip("spark-submit (make .venv-spark/.installed) and Java 17 needed")
    pytest.importorskip("pyhive", reason="install the hive extra")
    from habitus.resources.warehouses.hive import HiveWarehouse

    home = tmp_path_factory.mktemp("spark-faults")
    port = free_port()
    cmd, env = _h.spark_thrift_command(program, home, port)

    server = Restartable(cmd, port, home / "server.log", timeout=400, env=env, cwd=home,
                         ready=lambda server: _h._wait_for_hive_session(port, server, timeout=400))
    database = f"habitus_{uuid.uuid4().hex[:8]}"
    boot = HiveWarehouse(name="wh", host="127.0.0.1", port=port, username="habitus", auth="NONE", connect_timeout=10)
    con = boot._connect()
    con.cursor().execute(f"CREATE DATABASE `{database}`")
    con.close()
    wh = boot.model_copy(update={"database": database})
    load(wh)
    yield server, wh, f"127.0.0.1:{port}"
    server.stop()


class SmallFetches:
    """Hive reads 8 rows a fetch here, so a read makes many round trips and the kill lands between two."""
    default_batch_rows = 8


def test_hive_extraction_survives_a_server_restart(spark, tmp_path):
    server, wh, host = spark
    small = type("SmallFetchHive", (SmallFetches, type(wh)), {"__module__": __name__})(
        **{k: getattr(wh, k) for k in type(wh).model_fields})
    # killed in the middle of partition 2026-03-01's result: after its first fetch of 8 rows. Spark's restart
    # takes 15 s on a quiet machine, minutes on a busy one: retries after 5, 15, 35, 75 and 155 s cover it
    check_retried_extraction(tmp_path, small, server, host, nth=0, after=2, delay=5)


def test_hive_permanent_errors_are_not_retried(spark, tmp_path):
    _, wh, _ = spark
    check_permanent_errors_fail_at_once(tmp_path, wh, _cursor_bad_sql)


def test_hive_write_back_survives_a_dropped_connection(spark):
    server, wh, host = spark
    # 2 rows a statement: the load goes through a staging table, and dies after its first INSERT
    check_write_survives_a_drop(wh, _cursor_rows(wh, '`'), "habitus_scores", host, *kill_and_restart(server),
                                insert_rows=2)


# --------------------------------------------------------------------------- BigQuery (bqemulator)


@pytest.fixture(scope="module")
def bqemulator(tmp_path_factory):
    program = find_program("bqemulator", "HABITUS_BQEMULATOR", ".venv-bqemulator")
    if program is None:
        pytest.skip("bqemulator not installed: `make .venv-bqemulator/.installed`")
    pytest.importorskip("google.cloud.bigquery", reason="install the bigquery extra")
    from habitus.resources.warehouses.bigquery import BigQueryWarehouse

    home = tmp_path_factory.mktemp("bq-faults")
    python = Path(program).parent / "python"
    subprocess.run([str(python), "-c", "import duckdb, glob, importlib.util, os; "
                    "d = os.path.dirname(importlib.util.find_spec('duckdb_extension_spatial').origin); "
                    "p = glob.glob(d + '/extensions/*/spatial.duckdb_extension')[0]; duckdb.sql(f\"INSTALL '{p}'\")"],
                   check=True, cwd=home)
    rest, grpc_port = free_port(), free_port()
    server = Restartable([program, "start", "--rest-port", str(rest), "--grpc-port", str(grpc_port), "--project",
                          "habitus", "--persistent", "--data-dir", str(home / "data")], rest, home / "server.log",
                         cwd=home, extra_ports=(grpc_port,))
    dataset = f"habitus_{uuid.uuid4().hex[:8]}"
    wh = BigQueryWarehouse(name="wh", project="habitus", dataset=dataset, api_endpoint=f"http://127.0.0.1:{rest}",
                           grpc_endpoint=f"127.0.0.1:{grpc_port}", timeout=10)
    client = wh._client()
    client.create_dataset(dataset)
    client.close()
    load(wh)
    yield server, wh, f"127.0.0.1:{rest}"
    server.stop()


def _bq_rows(wh):
    def rows(table):
        client = wh._client()
        try:
            return [tuple(r.values()) for r in client.query(
                f"SELECT customer_id, score, as_of FROM `{wh.dataset}.{table}`").result()]
        finally:
            client.close()
    return rows


def _bq_bad_sql(wh):
    with wh._session("events") as client:
        client.query("SELEC customer_id FROM events").result()


def test_bigquery_extraction_survives_a_server_restart(bqemulator, tmp_path):
    server, wh, host = bqemulator
    # killed before partition 2026-04-01 is read, for longer than the client's own retries of a metadata call
    # (`timeout`, 10 s); a shorter outage is absorbed by google-cloud-bigquery itself (Storage reads retry for
    # up to 600 s)
    check_retried_extraction(tmp_path, wh, server, host, nth=1, after=-1, down_s=14)


def test_bigquery_permanent_errors_are_not_retried(bqemulator, tmp_path):
    _, wh, _ = bqemulator
    check_permanent_errors_fail_at_once(tmp_path, wh, _bq_bad_sql)


def test_bigquery_write_back_survives_a_dropped_connection(bqemulator):
    server, wh, host = bqemulator
    # google-cloud-bigquery retries a load for up to 600 s: a short outage is absorbed, never half-applied
    check_write_survives_a_drop(wh, _bq_rows(wh), "habitus_scores", host, *kill_and_restart(server), absorbed=True,
                                file_rows=2)


# --------------------------------------------------------------------------- S3 (moto), and a proxy that cuts


class CuttingProxy:
    """A loopback TCP proxy to `upstream_port`. `cut(n, direction, times)`: the next `times` connections are
    closed (both ends) after `n` bytes sent in `direction` ('down': server to client, 'up': client to server)."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.plan, self.cuts, self.lock = None, 0, threading.Lock()
        self.is_down, self.open = False, set()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, n: int, direction: str = "down", times: int = 1):
        with self.lock:
            self.plan, self.cuts = [n, direction, times], 0

    def down(self):
        """The network goes away: every open connection is reset, new ones are reset at once."""
        with self.lock:
            self.is_down = True
            conns, self.open = list(self.open), set()
        for s in conns:
            _reset(s)

    def up(self):
        with self.lock:
            self.is_down = False

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                if self.is_down:
                    _reset(client)
                    continue
                limit = None
                if self.plan and self.plan[2] > 0:
                    limit = (self.plan[0], self.plan[1])
                    self.plan[2] -= 1
            threading.Thread(target=self._serve, args=(client, limit), daemon=True).start()

    def _serve(self, client, limit):
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream))
        except OSError:
            client.close()
            return
        done = threading.Event()
        with self.lock:
            self.open.update((client, server))

        def pump(src, dst, direction):
            sent = 0
            try:
                while not done.is_set():
                    data = src.recv(4096)
                    if not data:
                        break
                    if limit and limit[1] == direction and sent + len(data) >= limit[0]:
                        dst.sendall(data[:max(0, limit[0] - sent)])
                        with self.lock:
                            self.cuts += 1
                        break
                    dst.sendall(data)
                    sent += len(data)
            except OSError:
                pass
            finally:
                done.set()
                with self.lock:
                    self.open.difference_update((client, server))
                for s in (client, server):
                    _reset(s)

        threading.Thread(target=pump, args=(server, client, "down"), daemon=True).start()
        pump(client, server, "up")

    def close(self):
        self.sock.close()


def _reset(s: socket.socket) -> None:
    """Close with linger 0: the peer sees a reset, as with a dropped connection."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    except OSError:
        pass


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    program = find_program("moto_server", "HABITUS_MOTO_SERVER")
    if program is None:
        pytest.skip("moto_server not installed: pip install 'moto[server]'")
    home = tmp_path_factory.mktemp("moto-faults")
    port = free_port()
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    server = Restartable([program, "-H", "127.0.0.1", "-p", str(port)], port, home / "server.log")
    proxy = CuttingProxy(port)
    put_lake(port)
    yield server, port, proxy
    proxy.close()
    server.stop()


def put_lake(port):
    """The events as s3://lake/shop/events.parquet (moto keeps its objects in memory: a restart loses them,
    so they are put back after one, as a store's objects outlive its restart)."""
    from pyarrow.fs import S3FileSystem

    fs = S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                      allow_bucket_creation=True, access_key="testing", secret_key="testing")
    fs.create_dir("lake")
    pq.write_table(events_table(), "lake/shop/events.parquet", filesystem=fs, row_group_size=25)


def s3(port, **kw):
    from habitus.resources.warehouses.parquet import ParquetWarehouse

    return ParquetWarehouse(path="s3://lake/shop", endpoint=f"http://127.0.0.1:{port}", region="us-east-1",
                            connect_timeout=3, request_timeout=5, **kw)


def _s3_rows(wh):
    def rows(table):
        t = pa.Table.from_batches(list(wh.read(table)))
        return list(zip(*(t.column(c).to_pylist() for c in ("customer_id", "score", "as_of"))))
    return rows


class BehindProxy:
    """moto killed and started again behind the proxy: the proxy refuses connections from the kill until the
    restarted server holds its objects again (moto keeps them in memory), as a store that comes back whole."""

    def __init__(self, server: Restartable, proxy: CuttingProxy, port: int):
        self.server, self.proxy, self.port = server, proxy, port

    def kill(self):
        self.proxy.down()  # with the kill: the store is away until it holds its objects again
        self.server.kill()

    def start(self):
        self.server.start()
        put_lake(self.port)
        self.proxy.up()


def test_s3_extraction_survives_a_server_restart(moto, tmp_path):
    server, port, proxy = moto
    check_retried_extraction(tmp_path, s3(proxy.port), BehindProxy(server, proxy, port), f"127.0.0.1:{proxy.port}",
                             nth=1, after=0, names="s3://lake/shop")


def test_s3_extraction_survives_connections_cut_after_n_bytes(moto, tmp_path):
    """Through the proxy: every connection of the next few is cut after 3,000 bytes of the answer (the
    client's own retries meet a cut too), then the proxy passes everything again."""
    _, port, proxy = moto
    wh = s3(proxy.port)
    clean, clean_files = source_run(tmp_path / "clean", wh)
    assert clean.success, failure_message(clean)
    want = {k: f.read_bytes() for k, f in clean_files.items()}
    size = pq.ParquetFile(clean_files[PARTITIONS[0]]).metadata.serialized_size
    assert size > 0
    proxy.cut(3000, "down", times=6)
    result, files = source_run(tmp_path / "cut", wh)
    messages = retry_messages(result)
    assert proxy.cuts >= 1, "no connection carried 3,000 bytes: nothing was cut"
    assert result.success, failure_message(result) + "\n".join(messages)
    assert messages, "the cuts never reached the extraction (the client's own retries absorbed them all)"
    assert f"127.0.0.1:{proxy.port}" in messages[0] and "s3://lake/shop" in messages[0], messages[0]
    assert {k: f.read_bytes() for k, f in files.items()} == want


def test_s3_permanent_errors_are_not_retried(moto, tmp_path):
    """A missing object and refused credentials (a second moto that checks them) fail at once."""
    _, port, _ = moto
    result, _ = source_run(tmp_path / "missing", s3(port), table="no_such_table")
    assert not result.success and retry_messages(result) == []
    assert "no_such_table" in failure_message(result) and "permanent" in failure_message(result)
    program = find_program("moto_server", "HABITUS_MOTO_SERVER")
    strict_port = free_port()
    # moto checks credentials against its IAM once INITIAL_NO_AUTH_ACTION_COUNT requests were let through
    strict = Restartable([program, "-H", "127.0.0.1", "-p", str(strict_port)], strict_port,
                         tmp_path / "strict.log", env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        with pytest.raises(WarehouseError) as err:
            s3(strict_port).schema("events")
        assert err.value.transient is False, str(err.value)
        assert f"127.0.0.1:{strict_port}" in str(err.value)
    finally:
        strict.stop()


def test_s3_write_back_survives_a_cut_upload(moto):
    """The upload of the day's new object is cut after 2,000 bytes (every attempt of the client's): the write
    fails, transient, naming the endpoint; the day keeps its old object, and the next write gives the new."""
    _, port, proxy = moto
    wh = s3(proxy.port)
    table, d1 = "habitus_scores", datetime(2026, 3, 1)
    rows_of = _s3_rows(wh)
    assert wh.write(table, iter(scores(d1, 10)), SCORES, replace=("as_of", d1)) == 10
    big = pa.table({"customer_id": [f"C{i}" for i in range(2000)], "score": [i / 2000 + 1.0 for i in range(2000)],
                    "as_of": pa.array([d1] * 2000, pa.timestamp("s"))}, schema=SCORES)
    proxy.cut(2000, "up", times=6)
    with pytest.raises(WarehouseError) as err:
        wh.write(table, iter(big.to_batches(max_chunksize=500)), SCORES, replace=("as_of", d1))
    assert err.value.transient and f"127.0.0.1:{proxy.port}" in str(err.value), str(err.value)
    assert proxy.cuts >= 1, "no upload carried 2,000 bytes: nothing was cut"
    proxy.cut(0, "up", times=0)
    assert sorted((c, s) for c, s, _ in rows_of(table)) == [(f"C{i}", i / 10) for i in range(10)]
    assert wh.write(table, iter(big.to_batches(max_chunksize=500)), SCORES, replace=("as_of", d1)) == 2000
    assert sorted(s for _, s, _ in rows_of(table)) == sorted(big.column("score").to_pylist())
