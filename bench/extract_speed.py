"""Extraction speed and peak memory per source on the same events table (1M rows by default),
each next to the same query run directly by its driver.

    .venv/bin/python bench/extract_speed.py                       # every source that runs here
    .venv/bin/python bench/extract_speed.py --rows 200000 --sources duckdb,parquet,clickhouse
    .venv/bin/python bench/extract_speed.py --json > extract_speed.json

Three measurements per source, each in a fresh process:

    driver   the projection fetched whole by the driver as it comes (Arrow where it has it, Python
             rows for Hive) and written to one Parquet file: what a hand-written extractor does
    read     the connector's read() streamed in 65,536-row batches to Parquet
    extract  what the source asset runs: read() -> canonical types -> rows sorted out of core by
             DuckDB -> canonical Parquet (resources/warehouses/canonical.py), identical bytes from every source

"peak MB" is the process's peak RSS above its RSS after imports and connecting. Servers run on
loopback (moto, fakesnow, bqemulator, Spark Thrift server, chDB in-process): the numbers measure
the client path and a local server, not a network. Sources whose server or package is missing are
left out with the reason. Never part of the test pass/fail.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
import extract_memory as em  # noqa: E402  (its data generator, RSS probes and server helpers)

COLUMNS = ["customer_id", "ts", "product_id", "price", "note"]
SOURCES = ["duckdb", "parquet", "s3", "snowflake", "bigquery", "hive", "clickhouse"]
TABLE = "events"


# --------------------------------------------------------------------------- the child: one measurement


def _warehouse(kind: str, spec: dict):
    if kind == "bigquery":
        from habitus.resources.warehouses.bigquery import BigQueryWarehouse
        return BigQueryWarehouse(name="bench", project="bench", dataset=spec["dataset"], api_endpoint=spec["rest"],
                                 grpc_endpoint=spec["grpc"])
    if kind == "hive":
        from habitus.resources.warehouses.hive import HiveWarehouse
        return HiveWarehouse(name="bench", host="127.0.0.1", port=spec["port"], username="bench", auth="NONE",
                             database=spec.get("database", "default"))
    return em._warehouse(kind, spec)


def _direct(kind: str, spec: dict, wh):
    """The same projection fetched whole by the driver, as an Arrow table."""
    import pyarrow as pa

    from habitus.resources.warehouses.sql import select_sql

    if kind == "bigquery":
        client = wh._client()
        sql = select_sql("bigquery", f"{spec['dataset']}.{TABLE}", COLUMNS)
        # REST pages: the emulator's Storage API cannot read a query's anonymous result table
        return client.query(sql).result().to_arrow(create_bqstorage_client=False)
    if kind == "hive":
        cur = wh._connect().cursor()
        cur.execute(select_sql("hive", TABLE, COLUMNS))
        rows = cur.fetchall()
        schema = wh.schema(TABLE)
        from habitus.resources.warehouses.remote import column_array
        cols = list(zip(*rows)) if rows else [[] for _ in COLUMNS]
        return pa.table({c: column_array(list(v), schema.field(c).type, c) for c, v in zip(COLUMNS, cols)})
    return em._direct(kind, spec, TABLE)


def child(kind: str, spec: dict, mode: str) -> dict:
    from habitus.resources.warehouses.canonical import write_canonical_parquet

    wh = _warehouse(kind, spec)
    writes = {
        "extract": lambda out, schema: write_canonical_parquet(wh.read(TABLE, COLUMNS, batch_rows=65_536), out, schema,
                                                               first=["customer_id", "ts"], table=TABLE),
        "read": lambda out, schema: em.stream_to_parquet(wh.read(TABLE, COLUMNS, batch_rows=65_536), out, schema),
        "driver": lambda out, _: em.table_to_parquet(_direct(kind, spec, wh), out),
    }
    return em.measure(wh, TABLE, writes[mode])


# --------------------------------------------------------------------------- the parent: servers and tables


def _start_bigquery(home: Path, procs: list) -> dict | None:
    prog = em._program("bqemulator", ".venv-bqemulator")
    if prog is None:
        return None
    python = Path(prog).parent / "python"
    subprocess.run([str(python), "-c", "import duckdb, glob, importlib.util, os; "
                    "d = os.path.dirname(importlib.util.find_spec('duckdb_extension_spatial').origin); "
                    "p = glob.glob(d + '/extensions/*/spatial.duckdb_extension')[0]; duckdb.sql(f\"INSTALL '{p}'\")"],
                   check=True, cwd=home, capture_output=True)
    rest, grpc = em._free_port(), em._free_port()
    procs.append(em._start([prog, "start", "--rest-port", str(rest), "--grpc-port", str(grpc), "--project", "bench"],
                           rest, home, wait=60))
    em._wait_port(grpc, 30)  # the gRPC port (Storage Read API) opens after the REST one
    return {"rest": f"http://127.0.0.1:{rest}", "grpc": f"127.0.0.1:{grpc}", "dataset": "bench"}


def _start_hive(home: Path, procs: list) -> dict | None:
    import shutil

    prog = em._program("spark-submit", ".venv-spark")
    if prog is None or (shutil.which("java") is None and not os.environ.get("JAVA_HOME")):
        return None
    port = em._free_port()
    conf = {"spark.ui.enabled": "false", "spark.sql.warehouse.dir": home / "warehouse",
            "spark.driver.extraJavaOptions": f"-Dderby.system.home={home}", "spark.sql.session.timeZone": "UTC"}
    hiveconf = {"hive.server2.thrift.port": port, "hive.server2.thrift.bind.host": "127.0.0.1"}
    cmd = [prog, "--class", "org.apache.spark.sql.hive.thriftserver.HiveThriftServer2", "--master", "local[2]",
           "--driver-memory", "2g", *(a for k, v in conf.items() for a in ("--conf", f"{k}={v}")),
           *(a for k, v in hiveconf.items() for a in ("--hiveconf", f"{k}={v}")), "spark-internal"]
    env = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(home), "SPARK_PID_DIR": str(home),
           "PATH": f"{Path(prog).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    procs.append(em._start(cmd, port, home, env=env, wait=120))
    return {"port": port, "database": "default"}


def _load(kind: str, folder: Path, data: Path, servers: dict) -> dict:
    """Put the events table into the source; returns the child's spec."""
    if kind in ("duckdb", "parquet", "s3", "clickhouse", "snowflake"):
        return em._load(kind, folder, {TABLE: data}, servers)
    spec = servers[kind]
    wh = _warehouse(kind, spec)
    if kind == "hive":  # the Thrift server reads the local file itself: a bulk load
        con = wh._connect()
        con.cursor().execute(f"CREATE TABLE `{TABLE}` USING parquet LOCATION '{data}'")
        con.close()
        return spec
    import pyarrow.parquet as pq

    client = wh._client()
    client.create_dataset(spec["dataset"], exists_ok=True)
    client.close()
    pf = pq.ParquetFile(data)
    wh.write(TABLE, pf.iter_batches(batch_size=200_000), pf.schema_arrow)
    return spec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--json", action="store_true", help="print the measurements as JSON instead of a table")
    ap.add_argument("--child", nargs=3, metavar=("KIND", "SPEC", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, spec, mode = args.child
        print(json.dumps(child(kind, json.loads(spec), mode)))
        return 0

    folder = Path(tempfile.mkdtemp(prefix="habitus-speed-"))
    data = em._make_data(folder, args.rows, TABLE)
    wanted = args.sources.split(",")
    procs, skipped, results = [], [], []
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    try:
        servers = em.start_s3_and_snowflake(wanted, procs, skipped)
        for kind, start in (("bigquery", _start_bigquery), ("hive", _start_hive)):
            if kind in wanted:
                home = folder / kind
                home.mkdir()
                spec = start(home, procs)
                if spec is None:
                    skipped.append(f"{kind} (server not installed: make .venv-bqemulator/.installed or .venv-spark)")
                else:
                    servers[kind] = spec
        log(f"{'source':<11} {'mode':<8} {'rows':>10} {'seconds':>8} {'rows/s':>11} {'peak MB':>8}")
        for kind, spec in em.loaded_sources(wanted, servers, skipped, lambda k: _load(k, folder, data, servers),
                                            served=("s3", "snowflake", "bigquery", "hive")):
            for mode in ("driver", "read", "extract"):
                r = subprocess.run([sys.executable, __file__, "--child", kind, json.dumps(spec), mode],
                                   capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                if r.returncode:
                    log(f"{kind:<11} {mode:<8} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
                    continue
                m = json.loads(r.stdout.strip().splitlines()[-1])
                m.update(source=kind, mode=mode, rows_per_s=round(m["rows"] / max(m["seconds"], 1e-9)))
                results.append(m)
                log(f"{kind:<11} {mode:<8} {m['rows']:>10,} {m['seconds']:>8.2f} {m['rows_per_s']:>11,} "
                    f"{m['peak_mb']:>8.0f}", flush=True)
    finally:
        em._stop(procs)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if args.json:
        print(json.dumps({"date": when, "machine": machine, "rows": args.rows, "skipped": skipped,
                          "results": results}, indent=1))
    else:
        if skipped:
            print("left out: " + "; ".join(skipped))
        print(f"{when}; {machine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
