"""Real servers for the connector integration tests, and the checks every connector must pass.

Each server is started by a fixture on a free loopback port, waited for, and stopped by its PID;
a server whose program or package is missing here skips its tests with the reason (`make
test-integration` / .ci/run install them). `<server>_events` fixtures give a connector on each
server with the events loaded (`Loaded`); test_connector_contract.py runs the shared checks
(`Contract`, the `contract` fixture) against every one of them, so nothing imports this file by name.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable

import dagster as dg
import pyarrow as pa
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 2, 20)
N = 120  # one event every 12 hours: 2026-02-20 .. 2026-04-19
BIG = 2**62  # ids beyond 32 bits (and beyond float64's exact integers)


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening; log {log}:\n"
                               f"{log.read_text()[-3000:]}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"server not listening on 127.0.0.1:{port} after {timeout}s; log {log}:\n{log.read_text()[-3000:]}")


class Server:
    """A program started in its own process group on loopback; stopped by PID (stop_process_group)."""

    def __init__(self, cmd: list[str], port: int, log: Path, timeout: float = 60, env: dict | None = None, cwd=None):
        self.port, self.log = port, log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        try:
            wait_for_port(port, self.proc, log, timeout)
        except Exception:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process_group(self.proc)
        self._out.close()


def stop_process_group(proc: subprocess.Popen, grace: float = 10, kill_grace: float = 10) -> None:
    """Stops a process started with start_new_session=True and whatever it started (its process
    group): SIGTERM, then SIGKILL if it still runs after `grace` seconds. Test modules get it as the
    `stop_process_group` fixture."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(kill_grace)


@pytest.fixture(scope="session", name="stop_process_group")
def _stop_process_group():
    """conftest's stop_process_group (pytest loads this file as a plugin, not by name)."""
    return stop_process_group


def find_program(name: str, env_var: str, *venvs: str) -> str | None:
    """$env_var, then <repo>/<venv>/bin/<name> for each venv, then this interpreter's bin, then PATH."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    for venv in venvs:
        p = ROOT / venv / "bin" / name
        if p.exists():
            return str(p)
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    return shutil.which(name)


@pytest.fixture(scope="session")
def fakesnow_server(tmp_path_factory):
    """A Snowflake-compatible server (fakesnow, in its own virtualenv .venv-fakesnow: it needs a
    snowflake-connector-python < 5 and a sqlglot of its own)."""
    program = find_program("fakesnow", "HABITUS_FAKESNOW", ".venv-fakesnow")
    if program is None:
        pytest.skip("fakesnow not installed: `make .venv-fakesnow` (or set HABITUS_FAKESNOW)")
    port = free_port()
    server = Server([program, "-s", "--host", "127.0.0.1", "-p", str(port)], port,
                    tmp_path_factory.mktemp("fakesnow") / "server.log", timeout=60)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    """An S3 server (moto) on loopback; yields its endpoint 'host:port'."""
    program = find_program("moto_server", "HABITUS_MOTO_SERVER")
    if program is None:
        pytest.skip("moto_server not installed: pip install 'moto[server]'")
    port = free_port()
    server = Server([program, "-H", "127.0.0.1", "-p", str(port)], port,
                    tmp_path_factory.mktemp("moto") / "server.log", timeout=60)
    yield f"127.0.0.1:{port}"
    server.stop()


class StartingServer:
    """A server started in the background (`uri` known at once); `ready()` waits until it listens."""

    def __init__(self, uri: str, cmd: list[str], port: int, log: Path, timeout: float, env: dict):
        self.uri, self.port, self.log, self.timeout = uri, port, log, timeout
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._ready = False

    def ready(self) -> str:
        if not self._ready:
            wait_for_port(self.port, self.proc, self.log, self.timeout)
            self._ready = True
        return self.uri

    def stop(self) -> None:
        stop_process_group(self.proc, grace=3)  # nothing to flush: SQLite commits each request
        self._out.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """An MLflow tracking server on loopback (full mlflow, in its own virtualenv .venv-mlflow: it pins
    pyarrow<26), its runs in SQLite and its artifacts in a temporary folder. It starts in the background
    (about 30 s of imports on a busy 2-core machine) while the test prepares its data; `.ready()` waits
    for it and returns its URI. The client is the mlflow extra in this interpreter."""
    pytest.importorskip("mlflow", reason="the MLflow client is not installed: pip install -e '.[mlflow]'")
    program = find_program("mlflow", "HABITUS_MLFLOW", ".venv-mlflow")
    if program is None:
        pytest.skip("no mlflow server: `make .venv-mlflow/.installed` (or set HABITUS_MLFLOW)")
    folder, port = tmp_path_factory.mktemp("mlflow"), free_port()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    server = StartingServer(f"http://127.0.0.1:{port}", [
        program, "server", "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
        str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        port, folder / "server.log", timeout=180, env=env)
    yield server
    server.stop()


# --------------------------------------------------------------------------- the shared data


def events_table() -> pa.Table:
    """The events every connector is checked with: nulls, decimals, booleans, big integer ids."""
    ts = [T0 + timedelta(hours=12 * i) for i in range(N)]
    return pa.table({
        "id": pa.array(range(N), pa.int64()),
        "customer_id": pa.array([f"C{i % 7}" for i in range(N)]),
        "ts": pa.array(ts, pa.timestamp("us")),
        "price": pa.array([i / 2 for i in range(N)], pa.float64()),
        "amount": pa.array([None if i % 10 == 3 else i * 125 // 100 for i in range(N)], pa.decimal128(12, 2)),
        "note": pa.array([None if i % 5 == 0 else f"n{i % 3}" for i in range(N)]),
        "flag": pa.array([i % 2 == 0 for i in range(N)]),
        "product_id": pa.array([BIG + i % 11 for i in range(N)], pa.int64()),
    })


def typed_table(null_times: bool = True) -> pa.Table:
    """One column per type that must survive every server, sorted by id (as extraction sorts it)."""
    from datetime import timezone
    from decimal import Decimal

    n = 8
    return pa.table({
        "id": pa.array([BIG + i for i in range(n)], pa.int64()),
        "aware": pa.array([None if i == 3 and null_times else datetime(2026, 3, 1, 23, 59, 59, 123456 + i, tzinfo=timezone.utc)
                           for i in range(n)], pa.timestamp("us", "UTC")),
        "naive": pa.array([None if i == 4 and null_times else datetime(1999, 12, 31, 23, 59, 59, 999999 - i) for i in range(n)],
                          pa.timestamp("us")),
        "amount": pa.array([None if i == 5 else Decimal(f"-{10**9 + i}.0{i}") for i in range(n)], pa.decimal128(12, 2)),
        "note": pa.array([None if i == 6 else ["", "naïve ☃", "it's", 'a "b"', "x" * 300][i % 5] for i in range(n)]),
        "ok": pa.array([None if i == 7 else i % 2 == 0 for i in range(n)]),
    })


SCORES = pa.schema([("customer_id", pa.string()), ("score", pa.float64()), ("as_of", pa.timestamp("s"))])


def scores(as_of: datetime, n: int, offset: float = 0.0) -> list[pa.RecordBatch]:
    t = pa.table({"customer_id": [f"C{i}" for i in range(n)], "score": [i / n + offset for i in range(n)],
                  "as_of": pa.array([as_of] * n, pa.timestamp("s"))}, schema=SCORES)
    return t.to_batches(max_chunksize=max(1, n // 3))


def expected_ids(start: datetime, end: datetime) -> list[int]:
    return [i for i in range(N) if start <= T0 + timedelta(hours=12 * i) < end]


class Contract:
    """The checks every warehouse resource passes on a table loaded with `events_table()`."""

    N, T0, BIG = N, T0, BIG
    events_table = staticmethod(events_table)
    scores = staticmethod(scores)
    SCORES = SCORES

    @staticmethod
    def schema(wh, table="events", decimal_scale: int | None = 2):
        """`decimal_scale=None` where the server does not keep a decimal's declared scale."""
        s = wh.schema(table)
        assert s.names == events_table().column_names
        assert pa.types.is_integer(s.field("id").type)
        assert pa.types.is_timestamp(s.field("ts").type) and s.field("ts").type.tz is None
        assert pa.types.is_floating(s.field("price").type)
        assert pa.types.is_decimal(s.field("amount").type)
        assert decimal_scale is None or s.field("amount").type.scale == decimal_scale
        assert pa.types.is_string(s.field("note").type) or pa.types.is_large_string(s.field("note").type)
        assert pa.types.is_boolean(s.field("flag").type)
        assert s.field("product_id").type == pa.int64()
        return s

    @staticmethod
    def time_range(wh, table="events"):
        assert wh.time_range(table, "ts") == (T0, T0 + timedelta(hours=12 * (N - 1)))

    @staticmethod
    def read_window(wh, table="events"):
        start, end = datetime(2026, 3, 1), datetime(2026, 4, 1)
        batches = list(wh.read(table, ["id", "price", "product_id"], "ts", start, end))
        assert batches and all(isinstance(b, pa.RecordBatch) for b in batches)
        t = pa.Table.from_batches(batches).sort_by("id")
        assert t.column_names == ["id", "price", "product_id"]
        ids = t.column("id").to_pylist()
        assert ids == expected_ids(start, end) and len(ids) == 62
        assert t.column("price").to_pylist() == [i / 2 for i in ids]
        assert t.column("product_id").to_pylist() == [BIG + i % 11 for i in ids]  # exact, not via float
        # half open: the row at `start` is in, the one at `end` out
        s2, e2 = T0 + timedelta(hours=12 * 10), T0 + timedelta(hours=12 * 13)
        got = pa.Table.from_batches(list(wh.read(table, ["id"], "ts", s2, e2))).column("id").to_pylist()
        assert sorted(got) == [10, 11, 12]

    # a row filter with every construct `where:` takes, and the ids it keeps, said in Python
    WHERE = ("(NOT flag AND note IN ('n1', 'n2') AND price >= 5) OR (note IS NULL AND id < 30) "
             "OR (LOWER(note) LIKE 'n0%' AND amount > 100) OR id BETWEEN 117 AND 200")

    @staticmethod
    def where_keeps(i: int) -> bool:
        note, amount = None if i % 5 == 0 else f"n{i % 3}", None if i % 10 == 3 else i * 125 // 100
        return ((i % 2 == 1 and note in ("n1", "n2") and i / 2 >= 5) or (note is None and i < 30)
                or (note == "n0" and amount is not None and amount > 100) or 117 <= i <= 200)

    @staticmethod
    def read_where(wh, table="events"):
        """A source's `where:` runs in the server's query (Parquet: the scan), with the time window."""
        got = pa.Table.from_batches(list(wh.read(table, ["id", "note"], where=Contract.WHERE))).sort_by("id")
        want = [i for i in range(N) if Contract.where_keeps(i)]
        assert 10 < len(want) < N - 10
        assert got.column("id").to_pylist() == want
        start, end = datetime(2026, 3, 1), datetime(2026, 4, 1)
        got = pa.Table.from_batches(list(wh.read(table, ["id"], "ts", start, end, where=Contract.WHERE)))
        assert sorted(got.column("id").to_pylist()) == [i for i in expected_ids(start, end) if Contract.where_keeps(i)]

    @staticmethod
    def outputs_written_back(wh, tmp_path, layout: str, table="habitus_scores"):
        """Embeddings (`layout`: assets/embeddings.py) and explanations written to `<table>_embeddings` and
        `<table>_churn_explanations` as the assets write them (assets/predictions.py `write_back`), a
        re-run of a day replacing its rows, and read back whole."""
        from functools import partial

        import numpy as np
        import pyarrow.parquet as pq

        from habitus.assets.embeddings import warehouse_rows
        from habitus.assets.predictions import write_back

        d1, d2, width = datetime(2026, 3, 1), datetime(2026, 3, 2), 5

        def embeddings(day, n, offset):
            values = (np.arange(n * width, dtype=np.float16) / 8 + offset).astype(np.float16)
            return pa.table({"customer_id": [f"C{i}" for i in range(n)],
                             "embedding": pa.FixedSizeListArray.from_arrays(pa.array(values, pa.float16()), width),
                             "model_fingerprint": ["0123456789abcdef"] * n,
                             "as_of": pa.array([day] * n, pa.timestamp("s"))})

        def explanations(day, n):
            return pa.table({"customer_id": [f"C{i // 2}" for i in range(n)], "label": pa.array([None] * n, pa.string()),
                             "score": pa.array([0.5 + i / 100 for i in range(n)], pa.float32()),
                             "rank": pa.array([1 + i % 2 for i in range(n)], pa.int16()),
                             "kind": ["value"] * n, "contribution": pa.array([i / 4 - 1 for i in range(n)], pa.float32()),
                             "count": pa.array([None if i % 3 else i for i in range(n)], pa.int32()),
                             "reason": [f"brand = B{i}: +{i / 4 - 1:.4g}" for i in range(n)],
                             "model_fingerprint": ["0123456789abcdef"] * n, "as_of": pa.array([day] * n, pa.timestamp("s"))})

        def day_file(t, name):
            path = tmp_path / f"{name}.parquet"
            pq.write_table(t, path)
            return path

        def read_back(name):
            got = pa.Table.from_batches(list(wh.read(name)))
            rows = []
            for r in got.to_pylist():
                t = r["as_of"]
                r["as_of"] = t.astimezone(__import__("datetime").timezone.utc).replace(tzinfo=None) if t.tzinfo else t
                rows.append(r)
            return sorted(rows, key=lambda r: (r["as_of"], r["customer_id"], r.get("rank") or 0))

        shape = partial(warehouse_rows, layout=layout)
        emb, expl = f"{table}_embeddings", f"{table}_churn_explanations"
        tables = {d1: embeddings(d1, 6, 0.0), d2: embeddings(d2, 3, 1.0)}
        assert write_back(wh, emb, day_file(embeddings(d1, 9, 5.0), "e0"), d1, shape) == 9
        for day, t in tables.items():  # d1 again: a re-run replaces the day's 9 rows with 6
            assert write_back(wh, emb, day_file(t, f"e{day.day}"), day, shape) == t.num_rows
        want = sorted((r for t in tables.values() for r in shape(t).to_pylist()), key=lambda r: (r["as_of"], r["customer_id"]))
        got = read_back(emb)
        assert len(got) == 9
        if layout == "array":
            assert [r["embedding"] for r in got] == [r["embedding"] for r in want]
        else:
            assert [[r[f"embedding_{i}"] for i in range(width)] for r in got] == [
                [r[f"embedding_{i}"] for i in range(width)] for r in want]
        assert [(r["customer_id"], r["model_fingerprint"], r["as_of"]) for r in got] == [
            (r["customer_id"], r["model_fingerprint"], r["as_of"]) for r in want]

        assert write_back(wh, expl, day_file(explanations(d1, 10), "x1"), d1) == 10
        assert write_back(wh, expl, day_file(explanations(d1, 4), "x2"), d1) == 4  # a re-run
        got = read_back(expl)
        want = explanations(d1, 4).to_pylist()
        assert len(got) == 4
        for column in ("customer_id", "label", "rank", "kind", "count", "reason", "as_of"):
            assert sorted(map(str, (r[column] for r in got))) == sorted(map(str, (r[column] for r in want))), column
        assert sorted(r["contribution"] for r in got) == sorted(r["contribution"] for r in want)  # float32 exactly

    @staticmethod
    def read_all_values(wh, table="events"):
        """Every value survives: nulls, decimals, booleans, strings, timestamps."""
        got = pa.Table.from_batches(list(wh.read(table))).sort_by("id")
        want = events_table()
        assert got.num_rows == N
        for name in want.column_names:
            g, w = got.column(name), want.column(name)
            if pa.types.is_timestamp(w.type):
                g = g.cast(pa.timestamp("us"))
            if pa.types.is_decimal(w.type):
                g = g.cast(w.type)
            assert g.to_pylist() == w.to_pylist(), name

    @staticmethod
    def small_batches(wh, table="events"):
        batches = list(wh.read(table, ["id", "ts"], batch_rows=16))
        assert len(batches) > 1 and all(len(b) <= 16 for b in batches)
        assert sum(len(b) for b in batches) == N
        schema = wh.schema(table)
        assert all(b.schema.names == ["id", "ts"] for b in batches)
        assert all(b.schema.field("ts").type == schema.field("ts").type for b in batches)

    @staticmethod
    def sensor_queries(wh, table="events"):
        """What the new-data sensor asks: rows and newest time, and both per month and per day."""
        times = [T0 + timedelta(hours=12 * i) for i in range(N)]
        assert wh.freshness(table, "ts") == (N, times[-1])
        for grain, start_of in (("month", lambda t: t.replace(day=1, hour=0)), ("day", lambda t: t.replace(hour=0))):
            want = {}
            for t in times:
                n, _ = want.get(start_of(t), (0, None))
                want[start_of(t)] = (n + 1, t)
            got = wh.partition_counts(table, "ts", grain)
            assert got == want, grain
            assert all(type(k) is datetime and k.tzinfo is None for k in got)

    @staticmethod
    def types_survive_extraction(wh, tmp_path, table="types_roundtrip", aware=True, null_times=True):
        """Each type written to the server, read back and extracted as canonical Parquet keeps its
        values: zone-aware and naive timestamps (microseconds), decimals, NULLs, text, booleans and
        ids beyond 2**53. `aware=False` for servers without a zone-aware type (Hive): the instant
        then comes back as naive UTC. `null_times=False` leaves NULL timestamps out (fakesnow
        sends them as 1970-01-01: its timestamp_to_sf_struct drops the validity bitmap)."""
        import pyarrow.parquet as pq
        from datetime import timezone

        from habitus.resources.warehouses.canonical import write_canonical_parquet

        t = typed_table(null_times)
        assert wh.write(table, iter(t.to_batches(max_chunksize=3)), t.schema) == t.num_rows
        path = tmp_path / f"{table}.parquet"
        assert write_canonical_parquet(wh.read(table), path, wh.schema(table), first=["id"], table=table) == 8
        got = pq.read_table(path)
        aware_type = pa.timestamp("us", "UTC") if aware else pa.timestamp("us")
        assert got.schema == pa.schema([("id", pa.int64()), ("aware", aware_type), ("naive", pa.timestamp("us")),
                                        ("amount", pa.decimal128(38, 9)), ("note", pa.string()), ("ok", pa.bool_())])
        for name in t.column_names:
            want = t.column(name).to_pylist()
            if name == "aware" and not aware:
                want = [None if v is None else v.astimezone(timezone.utc).replace(tzinfo=None) for v in want]
            assert got.column(name).to_pylist() == want, name

    @staticmethod
    def lossy_value_is_an_error(wh, tmp_path, table: str, column: str):
        """Extracting a value the canonical type cannot hold fails, naming the table and column,
        and leaves no file behind."""
        from habitus.resources.warehouses.canonical import write_canonical_parquet
        from habitus.resources.warehouses.errors import WarehouseError

        path = tmp_path / "lossy" / "part.parquet"
        with pytest.raises(WarehouseError, match=rf"table '{table}'.*column '{column}'") as err:
            write_canonical_parquet(wh.read(table), path, wh.schema(table), table=table)
        assert "view" in str(err.value)  # says what to do
        assert not path.exists()

    @staticmethod
    def missing_table(wh, table="events"):
        """A misspelled table: each question fails naming it and listing the tables there (`table` among them),
        and `tables()` lists the table."""
        from habitus.resources.warehouses.errors import WarehouseError

        assert table in wh.tables()
        for ask in (lambda t: wh.schema(t), lambda t: list(wh.read(t, ["id"])), lambda t: wh.time_range(t, "ts")):
            with pytest.raises(WarehouseError) as err:
                ask("no_such_table")
            assert "'no_such_table'" in str(err.value)
            assert table in Contract.listed(str(err.value)), str(err.value)

    @staticmethod
    def listed(message: str) -> list[str]:
        """The names after "the tables there: " in an error message ([] when it lists none)."""
        found = re.search(r"; the tables there: (.*?)(?: \(a permanent error: not retried\))?$", message)
        return found.group(1).split(", ") if found else []

    @staticmethod
    def write_replaces_partition(wh, read_rows, table="habitus_scores"):
        """`read_rows(table)` -> list of (customer_id, score, as_of) as the warehouse holds them."""
        d1, d2 = datetime(2026, 3, 1), datetime(2026, 3, 2)
        assert wh.write(table, iter(scores(d1, 10)), SCORES, replace=("as_of", d1)) == 10
        assert wh.write(table, iter(scores(d2, 4)), SCORES, replace=("as_of", d2)) == 4
        assert wh.write(table, iter(scores(d1, 6, offset=1.0)), SCORES, replace=("as_of", d1)) == 6  # a re-run
        rows = read_rows(table)
        by_day = {}
        for cid, score, as_of in rows:
            by_day.setdefault(as_of.replace(tzinfo=None), []).append((cid, score))
        assert sorted(by_day) == [d1, d2]
        assert sorted(by_day[d1]) == [(f"C{i}", i / 6 + 1.0) for i in range(6)]
        assert len(by_day[d2]) == 4
        assert wh.write(table, iter([]), SCORES, replace=("as_of", d2)) == 0  # an empty day empties it
        assert len(read_rows(table)) == 6

    @staticmethod
    def failed_write_keeps_previous_rows(wh, read_rows, table="habitus_failed_load"):
        """A load that breaks half way (the batches stop with an error) leaves the day as it was."""
        d1 = datetime(2026, 3, 1)
        assert wh.write(table, iter(scores(d1, 10)), SCORES, replace=("as_of", d1)) == 10

        def broken():
            yield from scores(d1, 6, offset=1.0)[:1]
            raise RuntimeError("the scoring run died half way")

        with pytest.raises(Exception, match="half way"):  # some connectors wrap it, naming the table
            wh.write(table, broken(), SCORES, replace=("as_of", d1))
        assert sorted((cid, score) for cid, score, _ in read_rows(table)) == [(f"C{i}", i / 10) for i in range(10)]

    @staticmethod
    def _materialize_source(tmp_path, connection: dict, table: str, env: dict | None):
        from habitus.assets.sources import build_source_asset
        from habitus.pipelines.config.project import load_project
        from habitus.pipelines.orchestration.build import build_resources
        from habitus.pipelines.orchestration.partitions import events_partitions

        cfg = {"workspace": "ws", "connections": {"wh": connection}, "entity": "customer_id",
               "sources": [{"name": "events", "role": "events", "connection": "wh", "table": table,
                            "timestamp": "ts", "columns": ["product_id", "price", "amount"], "start": "2026-03-01"}]}
        path = tmp_path / "project.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        old = {k: os.environ.get(k) for k in (env or {})}
        os.environ.update(env or {})
        try:
            project = load_project(path)
            source = project.source("events")
            asset = build_source_asset(project, source, events_partitions(source))
            resources = build_resources(project)
            result = dg.materialize([asset], resources=resources, partition_key="2026-03-01", raise_on_error=False)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return project, resources, result

    @staticmethod
    def misspelled_source(tmp_path, connection: dict, table="events", env: dict | None = None):
        """A source whose `table:` is misspelled fails naming it and listing the tables there (`table` among
        them), with no driver exception chained to the error (nothing for a traceback to show)."""
        misspelled = table[:-2] + table[-1] + table[-2]  # events -> evenst
        _, _, result = Contract._materialize_source(tmp_path, connection, misspelled, env)
        assert not result.success
        [failure] = [e.event_specific_data.error for e in result.all_events if e.is_step_failure]
        assert failure.cause is None, failure.cause  # the driver's exception is not chained: no traceback of it
        message = failure.message.strip()
        assert message.startswith(f"dagster._core.definitions.events.Failure: source/events (partition 2026-03-01, "
                                  f"attempt 1): table {misspelled!r} in "), message
        assert message.endswith("(a permanent error: not retried)"), message
        assert table in Contract.listed(message), message
        return message

    @staticmethod
    def source_asset(tmp_path, connection: dict, table="events", env: dict | None = None):
        """The source asset materialized through the project config's connection (secrets as ${ENV})."""
        import pyarrow.parquet as pq

        project, resources, result = Contract._materialize_source(tmp_path, connection, table, env)
        assert result.success
        out = pq.read_table(project.workspace_path / "sources" / "events" / "2026-03-01.parquet")
        assert out.column_names == ["customer_id", "ts", "product_id", "price", "amount"]
        assert sorted(out.column("product_id").to_pylist()) == sorted(
            BIG + i % 11 for i in expected_ids(datetime(2026, 3, 1), datetime(2026, 4, 1)))
        return resources["connection_wh"], out


@pytest.fixture(scope="session")
def contract():
    return Contract


@pytest.fixture(scope="session")
def chdb_path(tmp_path_factory):
    """The folder of this process's one chDB engine (chDB hosts a single engine path per process)."""
    pytest.importorskip("chdb", reason="chdb not installed: pip install chdb")
    return str(tmp_path_factory.mktemp("chdb"))


def spark_thrift_command(program: str, home: Path, port: int) -> tuple[list[str], dict]:
    """(command, environment) of Spark's Thrift server on 127.0.0.1:`port`, local[2], 1 GB, its
    warehouse, Derby metastore and logs under `home`."""
    cmd = [program, "--class", "org.apache.spark.sql.hive.thriftserver.HiveThriftServer2", "--master", "local[2]",
           "--driver-memory", "1g", "--conf", "spark.ui.enabled=false",
           "--conf", f"spark.sql.warehouse.dir={home / 'warehouse'}",
           "--conf", f"spark.driver.extraJavaOptions=-Dderby.system.home={home}",
           "--conf", "spark.sql.session.timeZone=UTC",
           "--hiveconf", f"hive.server2.thrift.port={port}", "--hiveconf", "hive.server2.thrift.bind.host=127.0.0.1",
           "spark-internal"]
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(home), "SPARK_PID_DIR": str(home),
           # spark-submit finds SPARK_HOME through the `python` of its own virtualenv
           "PATH": f"{Path(program).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return cmd, env


@pytest.fixture(scope="session")
def hive_server(tmp_path_factory):
    """A HiveServer2 endpoint: Spark's Thrift server (pyspark in .venv-spark, Java 17), local[2], 1 GB."""
    program = find_program("spark-submit", "HABITUS_SPARK_SUBMIT", ".venv-spark")
    if program is None:
        pytest.skip("spark-submit not found: `make .venv-spark/.installed` (pyspark) and a Java 17 runtime")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("no Java runtime for the Spark Thrift server (apt-get install openjdk-17-jre-headless)")
    home = tmp_path_factory.mktemp("spark")
    port = free_port()
    cmd, env = spark_thrift_command(program, home, port)
    server = Server(cmd, port, home / "server.log", timeout=120, env=env, cwd=home)
    try:
        _wait_for_hive_session(port, server, timeout=120)
    except Exception:
        server.stop()
        raise
    yield server
    server.stop()


def _wait_for_hive_session(port: int, server: Server, timeout: float) -> None:
    """The Thrift server listens seconds before it opens sessions; on a loaded machine the first one
    can take longer than a connector's connect timeout. Wait until one opens (without PyHive the
    tests skip anyway)."""
    try:
        from habitus.resources.warehouses.hive import HiveWarehouse
        import pyhive  # noqa: F401
    except ImportError:
        return
    from habitus.resources.warehouses.errors import WarehouseError

    deadline = time.time() + timeout
    while True:
        try:
            HiveWarehouse(host="127.0.0.1", port=port, username="habitus", auth="NONE",
                          connect_timeout=30)._connect().close()
            return
        except WarehouseError:
            if time.time() > deadline or server.proc.poll() is not None:
                raise RuntimeError(f"Spark Thrift server opens no session on 127.0.0.1:{port}; log "
                                   f"{server.log}:\n{server.log.read_text()[-3000:]}") from None
            time.sleep(1)


@pytest.fixture(scope="session")
def bq_emulator(tmp_path_factory):
    """bqemulator (BigQuery REST + Storage gRPC on DuckDB) from its own virtualenv .venv-bqemulator;
    yields (rest endpoint URL, grpc 'host:port')."""
    program = find_program("bqemulator", "HABITUS_BQEMULATOR", ".venv-bqemulator")
    if program is None:
        pytest.skip("bqemulator not installed: `make .venv-bqemulator/.installed`")
    python = Path(program).parent / "python"
    home = tmp_path_factory.mktemp("bqemulator")
    # its spatial extension ships in a wheel: install it into DuckDB's extension folder once
    subprocess.run([str(python), "-c", "import duckdb, glob, importlib.util, os; "
                    "d = os.path.dirname(importlib.util.find_spec('duckdb_extension_spatial').origin); "
                    "p = glob.glob(d + '/extensions/*/spatial.duckdb_extension')[0]; duckdb.sql(f\"INSTALL '{p}'\")"],
                   check=True, cwd=home)
    rest, grpc_port = free_port(), free_port()
    server = Server([program, "start", "--rest-port", str(rest), "--grpc-port", str(grpc_port), "--project", "habitus"],
                    rest, home / "server.log", timeout=60, cwd=home)
    wait_for_port(grpc_port, server.proc, server.log, 30)
    yield f"http://127.0.0.1:{rest}", f"127.0.0.1:{grpc_port}"
    server.stop()


# --------------------------------------------------------------------------- each server, loaded with the events


@dataclass
class Loaded:
    """A warehouse resource whose `table` holds `events_table()`, and what the contract checks
    (test_connector_contract.py) must know of its server."""

    wh: Any
    rows: Callable[[str], list]  # a table's (customer_id, score, as_of) rows as the server holds them
    table: str = "events"
    schema_types: dict = field(default_factory=dict)  # exact types the schema check asserts besides the contract's
    decimal_scale: int | None = 2  # the scale the server reports for the events' decimal(12, 2); None: not kept
    types: dict = field(default_factory=dict)  # options of Contract.types_survive_extraction
    drop: Callable[[str], None] | None = None  # removes a table a write check made (a shared server)
    stages: Callable[[], list[str]] | None = None  # staging tables left on the server, where it can list them


def load_events(wh, table: str = "events") -> None:
    events = events_table()
    assert wh.write(table, iter(events.to_batches(max_chunksize=50)), events.schema) == N


def driver(module: str, extra: str) -> None:
    """Skips (at run time, not at collection: the default test run deselects these modules) without the driver."""
    pytest.importorskip(module, reason=f"install the {extra} extra: pip install -e '.[{extra}]'")


def _env_or_skip(names: tuple[str, ...], what: str) -> None:
    if not all(os.environ.get(v) for v in names):
        pytest.skip(f"no {what}: set {', '.join(names)}")


def snowflake_warehouse(server, database, **kw):
    from habitus.resources.warehouses.snowflake import SnowflakeWarehouse

    return SnowflakeWarehouse(name="wh", account="fakesnow", user="fake", password="snow", database=database,
                              schema_name="PUBLIC", options={"host": "127.0.0.1", "port": server.port,
                                                             "protocol": "http"}, **kw)


def cursor_rows(wh, sql: str) -> Callable[[str], list]:
    """A table's rows as `sql` (with {} for the quoted table name) selects them, through the
    connector's own cursor."""
    def rows(table):
        with wh._cursor(table) as cur:
            cur.execute(sql.format(table))
            return cur.fetchall()
    return rows


@pytest.fixture(scope="module")
def snowflake_events(request):
    """SnowflakeWarehouse through the real snowflake-connector-python against a local fakesnow server."""
    driver("snowflake.connector", "snowflake")
    server = request.getfixturevalue("fakesnow_server")
    database = f"HABITUS_{uuid.uuid4().hex[:8].upper()}"
    con = snowflake_warehouse(server, None)._connect()
    con.cursor().execute(f"CREATE DATABASE {database}")
    con.cursor().execute(f"CREATE SCHEMA {database}.PUBLIC")
    con.close()
    wh = snowflake_warehouse(server, database)
    load_events(wh)
    # fakesnow sends NULL timestamps as 1970-01-01 (its timestamp_to_sf_struct drops the validity bitmap)
    return Loaded(wh, cursor_rows(wh, 'SELECT "customer_id", "score", "as_of" FROM "{}"'), types={"null_times": False})


def _bigquery_events(request, storage_api: bool) -> Loaded:
    """BigQueryWarehouse through the real google-cloud-bigquery client (REST) and Storage Read API
    (gRPC) against bqemulator, reading through the Storage Read API or through a query."""
    driver("google.cloud.bigquery", "bigquery")
    from habitus.resources.warehouses.bigquery import BigQueryWarehouse

    rest, grpc = request.getfixturevalue("bq_emulator")
    dataset = f"habitus_{uuid.uuid4().hex[:8]}"
    wh = BigQueryWarehouse(name="bq", project="habitus", dataset=dataset, api_endpoint=rest, grpc_endpoint=grpc,
                           storage_api=storage_api)
    client = wh._client()
    client.create_dataset(dataset)
    client.close()
    load_events(wh)

    def rows(table):
        client = wh._client()
        try:
            return [tuple(r.values()) for r in client.query(f"SELECT customer_id, score, as_of FROM "
                                                            f"`{dataset}.{table}`").result()]
        finally:
            client.close()

    def stages():
        client = wh._client()
        try:
            return [t.table_id for t in client.list_tables(dataset) if t.table_id.startswith("_habitus_stage")]
        finally:
            client.close()

    # ts is a DATETIME; bqemulator reports NUMERIC(12, 2) as NUMERIC (38, 9)
    return Loaded(wh, rows, schema_types={"id": pa.int64(), "ts": pa.timestamp("us")}, decimal_scale=None,
                  stages=stages)


@pytest.fixture(scope="module")
def bigquery_storage_events(request):
    return _bigquery_events(request, storage_api=True)


@pytest.fixture(scope="module")
def bigquery_query_events(request):
    return _bigquery_events(request, storage_api=False)


def clickhouse_server_warehouse(database):
    from habitus.resources.warehouses.clickhouse import ClickHouseWarehouse

    return ClickHouseWarehouse(name="ch", host=os.environ["CLICKHOUSE_HOST"],
                               port=int(os.environ.get("CLICKHOUSE_PORT", "8123")),
                               username=os.environ.get("CLICKHOUSE_USER", "default"),
                               password=os.environ.get("CLICKHOUSE_PASSWORD"), database=database,
                               secure=os.environ.get("CLICKHOUSE_SECURE", "") in ("1", "true"))


def _clickhouse_events(boot, wh):
    client = boot._client()
    client.command(f"CREATE DATABASE `{wh.database}`")
    client.close()
    load_events(wh)

    def rows(table):
        with wh._session(table) as client:
            return client.query(f"SELECT customer_id, score, as_of FROM `{table}`").result_rows

    yield Loaded(wh, rows, schema_types={"ts": pa.timestamp("us")})  # DateTime64(6): microseconds kept
    client = boot._client()
    client.command(f"DROP DATABASE IF EXISTS `{wh.database}`")
    client.close()


@pytest.fixture(scope="module")
def clickhouse_chdb_events(request):
    """ClickHouseWarehouse through the real clickhouse-connect client on chDB (ClickHouse 26.x
    in-process, through clickhouse-connect's chdb interface): every statement the connector sends
    runs on a current ClickHouse engine."""
    driver("clickhouse_connect", "clickhouse")
    from habitus.resources.warehouses.clickhouse import ClickHouseWarehouse

    path = request.getfixturevalue("chdb_path")
    database = f"habitus_{uuid.uuid4().hex[:8]}"
    yield from _clickhouse_events(ClickHouseWarehouse(name="ch", interface="chdb", options={"path": path}),
                                  ClickHouseWarehouse(name="ch", interface="chdb", database=database,
                                                      options={"path": path}))


@pytest.fixture(scope="module")
def clickhouse_server_events():
    """The same against a ClickHouse server over HTTP when CLICKHOUSE_HOST is set (CLICKHOUSE_PORT,
    CLICKHOUSE_USER, CLICKHOUSE_PASSWORD, CLICKHOUSE_SECURE optional)."""
    driver("clickhouse_connect", "clickhouse")
    if not os.environ.get("CLICKHOUSE_HOST"):
        pytest.skip("no ClickHouse server: set CLICKHOUSE_HOST (and CLICKHOUSE_PORT/USER/PASSWORD)")
    yield from _clickhouse_events(clickhouse_server_warehouse(None),
                                  clickhouse_server_warehouse(f"habitus_{uuid.uuid4().hex[:8]}"))


@pytest.fixture(scope="module")
def hive_events(request):
    """HiveWarehouse through PyHive against a real HiveServer2 endpoint (Spark's Thrift server)."""
    driver("pyhive", "hive")
    from habitus.resources.warehouses.hive import HiveWarehouse

    server = request.getfixturevalue("hive_server")
    database = f"habitus_{uuid.uuid4().hex[:8]}"
    boot = HiveWarehouse(name="lake", host="127.0.0.1", port=server.port, username="habitus", auth="NONE")
    con = boot._connect()
    con.cursor().execute(f"CREATE DATABASE `{database}`")
    con.close()
    wh = boot.model_copy(update={"database": database})
    load_events(wh)
    # Hive has no zone-aware timestamp: an instant comes back as naive UTC
    return Loaded(wh, cursor_rows(wh, "SELECT customer_id, score, as_of FROM `{}`"), types={"aware": False})


def _databricks_events(volume: bool):
    """DatabricksWarehouse against a real SQL warehouse; runs only when DATABRICKS_SERVER_HOSTNAME,
    DATABRICKS_HTTP_PATH and DATABRICKS_TOKEN are set (DATABRICKS_CATALOG, DATABRICKS_SCHEMA optional;
    DATABRICKS_STAGING_VOLUME for the PUT + REPLACE WHERE writes). Everything short of a workspace is
    in tests/resources/test_databricks.py."""
    driver("databricks.sql", "databricks")
    _env_or_skip(("DATABRICKS_SERVER_HOSTNAME", "DATABRICKS_HTTP_PATH", "DATABRICKS_TOKEN"), "Databricks workspace")
    from habitus.resources.warehouses.databricks import DatabricksWarehouse

    staging = os.environ.get("DATABRICKS_STAGING_VOLUME")
    if volume and not staging:
        pytest.skip("set DATABRICKS_STAGING_VOLUME to test the PUT + REPLACE WHERE path")
    wh = DatabricksWarehouse(name="dbx", server_hostname=os.environ["DATABRICKS_SERVER_HOSTNAME"],
                             http_path=os.environ["DATABRICKS_HTTP_PATH"], access_token=os.environ["DATABRICKS_TOKEN"],
                             catalog=os.environ.get("DATABRICKS_CATALOG"), schema_name=os.environ.get("DATABRICKS_SCHEMA"),
                             staging_volume=staging if volume else None)
    table = f"habitus_events_{uuid.uuid4().hex[:8]}"
    load_events(wh, table)

    def drop(t):
        with wh._cursor(t) as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{t}`")

    yield Loaded(wh, cursor_rows(wh, "SELECT customer_id, score, as_of FROM `{}`"), table=table, drop=drop)
    drop(table)


@pytest.fixture(scope="module")
def databricks_values_events():
    yield from _databricks_events(volume=False)


@pytest.fixture(scope="module")
def databricks_volume_events():
    yield from _databricks_events(volume=True)


@pytest.fixture(scope="module")
def synapse_events():
    """SynapseWarehouse against a real Synapse SQL pool or SQL Server; runs only when SYNAPSE_SERVER,
    SYNAPSE_DATABASE, SYNAPSE_USER and SYNAPSE_PASSWORD are set (SYNAPSE_AUTHENTICATION optional).
    Everything short of a server is in tests/resources/test_synapse.py."""
    driver("mssql_python", "synapse")
    _env_or_skip(("SYNAPSE_SERVER", "SYNAPSE_DATABASE", "SYNAPSE_USER", "SYNAPSE_PASSWORD"), "Synapse / SQL Server")
    from habitus.resources.warehouses.synapse import SynapseWarehouse

    wh = SynapseWarehouse(name="syn", server=os.environ["SYNAPSE_SERVER"], database=os.environ["SYNAPSE_DATABASE"],
                          username=os.environ["SYNAPSE_USER"], password=os.environ["SYNAPSE_PASSWORD"],
                          authentication=os.environ.get("SYNAPSE_AUTHENTICATION"))
    table = f"habitus_events_{uuid.uuid4().hex[:8]}"
    load_events(wh, table)
    yield Loaded(wh, cursor_rows(wh, "SELECT customer_id, score, as_of FROM [{}]"), table=table)
    with wh._session(table) as (con, cur):
        cur.execute(f"DROP TABLE [{table}]")
        con.commit()


@pytest.fixture(scope="session")
def s3_lake(request):
    """Bucket 'lake' on a local S3 server (moto): events as one file (shop/events.parquet, many row
    groups) and as a hive-partitioned folder (shop/events_by_month/month=...). Yields the endpoint."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from pyarrow.fs import S3FileSystem

    endpoint = request.getfixturevalue("moto_s3")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    fs = S3FileSystem(endpoint_override=endpoint, scheme="http", region="us-east-1", allow_bucket_creation=True)
    fs.create_dir("lake")
    events = events_table()
    pq.write_table(events, "lake/shop/events.parquet", filesystem=fs, row_group_size=25)
    by_month = events.append_column("month", pa.array([t.strftime("%Y-%m") for t in events.column("ts").to_pylist()]))
    ds.write_dataset(by_month, "lake/shop/events_by_month", filesystem=fs, format="parquet",
                     partitioning=["month"], partitioning_flavor="hive")
    return endpoint


def s3_warehouse(endpoint):
    from habitus.resources.warehouses.parquet import ParquetWarehouse

    return ParquetWarehouse(path="s3://lake/shop", endpoint=f"http://{endpoint}", region="us-east-1")


def read_back(wh) -> Callable[[str], list]:
    """A table's (customer_id, score, as_of) rows read through the connector itself (a folder of files
    has no SQL of its own)."""
    def rows(table):
        t = pa.Table.from_batches(list(wh.read(table)))
        return list(zip(t.column("customer_id").to_pylist(), t.column("score").to_pylist(),
                        t.column("as_of").to_pylist()))
    return rows


@pytest.fixture(scope="module")
def s3_events(s3_lake):
    """ParquetWarehouse on object storage: s3:// paths read in streaming mode through pyarrow's S3 filesystem."""
    wh = s3_warehouse(s3_lake)
    return Loaded(wh, read_back(wh))


@pytest.fixture(scope="module")
def s3_by_month_events(s3_lake):
    """The same events as a hive-partitioned folder (a `month` column besides the events' own)."""
    wh = s3_warehouse(s3_lake)
    return Loaded(wh, read_back(wh), table="events_by_month")


@pytest.fixture(scope="module")
def duckdb_events(tmp_path_factory):
    """The embedded default: a DuckDB database file."""
    from habitus.resources.warehouses.duckdb import DuckDBWarehouse

    wh = DuckDBWarehouse(path=str(tmp_path_factory.mktemp("duckdb") / "wh.duckdb"))
    load_events(wh)

    def rows(table):
        import duckdb

        con = duckdb.connect(wh.path, read_only=True)
        try:
            return con.sql(f'SELECT customer_id, score, as_of FROM "{table}"').fetchall()
        finally:
            con.close()

    return Loaded(wh, rows)


@pytest.fixture(scope="module")
def parquet_events(tmp_path_factory):
    """Local Parquet files as a warehouse."""
    from habitus.resources.warehouses.parquet import ParquetWarehouse

    wh = ParquetWarehouse(path=str(tmp_path_factory.mktemp("lake")))
    load_events(wh)
    return Loaded(wh, read_back(wh))
