"""Extraction speed and peak memory per source, at 1x and 10x the rows: the connector's streamed
read (batches -> Parquet) next to the same query fetched whole by the driver. Streaming keeps the
peak flat as the table grows; fetching whole grows with it. (The source asset also sorts each
partition into canonical Parquet: bench/extract_speed.py measures that path per source.)

    .venv/bin/python bench/extract_memory.py                 # 200k and 2M events
    .venv/bin/python bench/extract_memory.py --scales 1,10,50 --sources duckdb,parquet,s3
    .venv/bin/python bench/extract_memory.py --rows 1000000 --sources duckdb,parquet,s3

Each measurement runs in a fresh process; "peak RSS MB" is that process's peak RSS above its RSS
after imports and connecting, "Arrow MB" the most pyarrow's memory pool held at once. Sources whose server or package is missing here are left out with
the reason. Never part of the test pass/fail.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
COLUMNS = ["customer_id", "ts", "product_id", "price", "note"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_peak() -> None:
    """Start the peak (VmHWM) over from the current RSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --------------------------------------------------------------------------- the child: one measurement


def _warehouse(kind: str, spec: dict):
    if kind == "duckdb":
        from habitus.resources.warehouses.duckdb import DuckDBWarehouse
        return DuckDBWarehouse(path=spec["path"])
    if kind in ("parquet", "s3"):
        from habitus.resources.warehouses.parquet import ParquetWarehouse
        return ParquetWarehouse(path=spec["path"], endpoint=spec.get("endpoint"))
    if kind == "clickhouse":
        from habitus.resources.warehouses.clickhouse import ClickHouseWarehouse
        return ClickHouseWarehouse(interface="chdb", options={"path": spec["path"]})
    if kind == "snowflake":
        from habitus.resources.warehouses.snowflake import SnowflakeWarehouse
        return SnowflakeWarehouse(account="fakesnow", user="fake", password="snow", database="BENCH",
                                  schema_name="PUBLIC", options={"host": "127.0.0.1", "port": spec["port"],
                                                                 "protocol": "http"})
    raise ValueError(kind)


def _direct(kind: str, spec: dict, table: str):
    """The same projection fetched whole by the driver: the baseline a naive extractor would use."""
    from habitus.resources.warehouses.sql import select_sql

    if kind == "duckdb":
        import duckdb
        con = duckdb.connect(spec["path"], read_only=True)
        return con.sql(select_sql("duckdb", table, COLUMNS)).to_arrow_table()
    if kind in ("parquet", "s3"):
        wh = _warehouse(kind, spec)
        return wh._dataset(table).to_table(columns=COLUMNS)
    if kind == "clickhouse":
        wh = _warehouse(kind, spec)
        return wh._client().query_arrow(select_sql("clickhouse", table, COLUMNS), use_strings=True)
    if kind == "snowflake":
        wh = _warehouse(kind, spec)
        cur = wh._connect().cursor()
        cur.execute(select_sql("snowflake", table, COLUMNS))
        return cur.fetch_arrow_all()
    raise ValueError(kind)


def measure(wh, table: str, write) -> dict:
    """One measurement: `write(out, out_schema) -> rows` puts `table`'s COLUMNS into the Parquet file
    `out`; rows, seconds and the peak RSS above the RSS after connecting and describing the table (as
    the source asset does)."""
    import pyarrow as pa

    schema = wh.schema(table)
    out_schema = pa.schema([schema.field(c) for c in COLUMNS])
    base = _rss_mb()
    _reset_peak()
    out = Path(tempfile.mkdtemp()) / "out.parquet"
    started = time.perf_counter()
    rows = write(out, out_schema)
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": seconds, "peak_mb": _peak_mb() - base}


def stream_to_parquet(batches, out: Path, out_schema) -> int:
    """Batches as they come to one Parquet file (the connector's streamed read); returns the rows."""
    import pyarrow.parquet as pq

    rows = 0
    with pq.ParquetWriter(out, out_schema, compression="zstd") as w:
        for b in batches:
            w.write_batch(b)
            rows += len(b)
    return rows


def table_to_parquet(table, out: Path) -> int:
    """A table fetched whole to one Parquet file (the driver's way); returns the rows."""
    import pyarrow.parquet as pq

    pq.write_table(table, out, compression="zstd")
    return table.num_rows


def child(kind: str, spec: dict, table: str, mode: str) -> dict:
    import pyarrow as pa

    wh = _warehouse(kind, spec)
    if mode == "stream":
        def write(out, schema):
            return stream_to_parquet(wh.read(table, COLUMNS, batch_rows=65_536), out, schema)
    else:
        def write(out, _):
            return table_to_parquet(_direct(kind, spec, table), out)
    m = measure(wh, table, write)
    return {**m, "arrow_mb": pa.default_memory_pool().max_memory() / 2**20}


# --------------------------------------------------------------------------- the parent: data + table


def _make_data(folder: Path, rows: int, name: str) -> Path:
    import duckdb

    path = folder / f"{name}.parquet"
    con = duckdb.connect()
    con.execute(f"""COPY (SELECT i AS id, 'C' || (i % 50000) AS customer_id,
                          TIMESTAMP '2026-01-01' + INTERVAL (i) SECOND AS ts,
                          4611686018427387904 + (i % 20000) AS product_id, (i % 1000) / 10.0 AS price,
                          CASE WHEN i % 7 = 0 THEN NULL ELSE 'note-' || (i % 13) END AS note
                   FROM range({rows}) t(i)) TO '{path}' (FORMAT PARQUET, ROW_GROUP_SIZE 100000)""")
    con.close()
    return path


def _load(kind: str, folder: Path, files: dict, servers: dict) -> dict:
    """Put each table into the source; returns the child's spec."""
    import pyarrow.parquet as pq

    if kind == "duckdb":
        import duckdb
        path = folder / "bench.duckdb"
        con = duckdb.connect(str(path))
        for name, f in files.items():
            con.execute(f"CREATE TABLE {name} AS SELECT * FROM read_parquet('{f}')")
        con.close()
        return {"path": str(path)}
    if kind == "parquet":
        return {"path": str(folder)}
    if kind == "s3":
        from pyarrow.fs import S3FileSystem
        fs = S3FileSystem(endpoint_override=servers["s3"], scheme="http", region="us-east-1", allow_bucket_creation=True)
        fs.create_dir("bench")
        for name, f in files.items():
            with open(f, "rb") as src, fs.open_output_stream(f"bench/{name}.parquet") as dst:
                dst.write(src.read())
        return {"path": "s3://bench", "endpoint": f"http://{servers['s3']}"}
    spec = {"clickhouse": lambda: {"path": str(folder / "chdb")},
            "snowflake": lambda: {"port": servers.get("snowflake")}}[kind]()
    if kind == "snowflake":
        con = _warehouse("snowflake", {**spec}).model_copy(update={"database": None})._connect()
        con.cursor().execute("CREATE DATABASE IF NOT EXISTS BENCH")
        con.cursor().execute("CREATE SCHEMA IF NOT EXISTS BENCH.PUBLIC")
        con.close()
    wh = _warehouse(kind, spec)
    for name, f in files.items():
        pf = pq.ParquetFile(f)
        wh.write(name, pf.iter_batches(batch_size=200_000), pf.schema_arrow)
    return spec


def _wait_port(port: int, wait: float) -> None:
    import socket

    deadline = time.time() + wait
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {wait}s")


def _start(cmd: list[str], port: int, cwd: Path | None = None, env: dict | None = None, wait: float = 30):
    """A server in its own process group, once it listens on `port`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            cwd=cwd, env=env)
    try:
        _wait_port(port, wait)
    except RuntimeError:
        os.killpg(proc.pid, 9)
        raise
    return proc


def _stop(procs: list) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, 15)
            p.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(p.pid, 9)


def start_s3_and_snowflake(wanted: list[str], procs: list, skipped: list) -> dict:
    """moto (S3) and fakesnow (Snowflake) on loopback when `wanted`; the servers' addresses by source.
    Started processes go to `procs`, sources left out (with why) to `skipped`."""
    servers = {}
    if "s3" in wanted:
        prog = _program("moto_server")
        if prog:
            port = _free_port()
            procs.append(_start([prog, "-H", "127.0.0.1", "-p", str(port)], port))
            servers["s3"] = f"127.0.0.1:{port}"
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        else:
            skipped.append("s3 (moto_server not installed)")
    if "snowflake" in wanted:
        prog = _program("fakesnow", ".venv-fakesnow")
        if prog:
            port = _free_port()
            procs.append(_start([prog, "-s", "-p", str(port)], port))
            servers["snowflake"] = port
        else:
            skipped.append("snowflake (fakesnow not installed: make .venv-fakesnow/.installed)")
    return servers


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _program(name: str, venv: str | None = None) -> str | None:
    import shutil
    for p in ([ROOT / venv / "bin" / name] if venv else []) + [Path(sys.executable).parent / name]:
        if p.exists():
            return str(p)
    return shutil.which(name)


def loaded_sources(wanted: list[str], servers: dict, skipped: list, load, served=("s3", "snowflake")):
    """(source, spec) for each wanted source, its table loaded by `load(source)`; a source in `served`
    whose server did not start is passed over, one whose package is missing is left out with why."""
    for kind in wanted:
        if kind in served and kind not in servers:
            continue
        try:
            spec = load(kind)
        except ImportError as e:
            skipped.append(f"{kind} ({e.name} not installed)")
            continue
        yield kind, spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="rows at 1x")
    ap.add_argument("--scales", default="1,10", help="multiples of --rows to measure (e.g. 1,10,50)")
    ap.add_argument("--sources", default="duckdb,parquet,s3,clickhouse,snowflake")
    ap.add_argument("--child", nargs=4, metavar=("KIND", "SPEC", "TABLE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, spec, table, mode = args.child
        print(json.dumps(child(kind, json.loads(spec), table, mode)))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="habitus-bench-"))
    files = {f"events_{k}x": _make_data(folder, args.rows * int(k), f"events_{k}x") for k in args.scales.split(",")}
    procs, skipped = [], []
    wanted = args.sources.split(",")
    try:
        servers = start_s3_and_snowflake(wanted, procs, skipped)
        print(f"{'source':<11} {'mode':<13} {'rows':>10} {'seconds':>8} {'rows/s':>11} {'peak RSS MB':>11} "
              f"{'Arrow MB':>8}")
        for kind, spec in loaded_sources(wanted, servers, skipped, lambda k: _load(k, folder, files, servers)):
            for table in files:
                for mode in ("stream", "driver-whole"):
                    r = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec), table, mode],
                                       capture_output=True, text=True)
                    if r.returncode:
                        print(f"{kind:<11} {mode:<13} failed: {r.stderr.strip().splitlines()[-1]}")
                        continue
                    m = json.loads(r.stdout.strip().splitlines()[-1])
                    print(f"{kind:<11} {mode:<13} {m['rows']:>10,} {m['seconds']:>8.2f} "
                          f"{m['rows'] / max(m['seconds'], 1e-9):>11,.0f} {m['peak_mb']:>11.0f} "
                          f"{m['arrow_mb']:>8.0f}", flush=True)
    finally:
        _stop(procs)
    if skipped:
        print("left out: " + "; ".join(skipped))
    print("stream = the connector's read() in 65,536-row batches to Parquet (the source asset's read); "
          "driver-whole = the same query fetched as one Arrow table.\npeak RSS MB = the process's peak above its "
          "RSS after connecting (allocator arenas of reader threads included); Arrow MB = the most memory "
          "pyarrow's pool held at once\n(the data in flight; memory a driver allocates itself, e.g. DuckDB's "
          "or chDB's, is only in the RSS column).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
