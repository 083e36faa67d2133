"""`output: s3://...` on a real S3 server (moto): a small demo trains with one upload killed halfway,
is re-run, and the bucket holds every artifact and manifest exactly once; a fresh workspace restored
from the bucket scores the next day exactly as the machine that trained."""

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest
import yaml

from habitus.pipelines.demo.data import generate_demo_warehouse

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "habitus-artifacts"

# the upload of one scenario checkpoint dies with half of its bytes sent (SIGKILL: no clean-up runs)
KILL_HALFWAY = """
import os, signal, sys
import habitus.resources.store.output as output

whole = output.Output._write_file

def half_then_die(self, src, key):
    if str(src).endswith("checkpoints/scenarios/churn/model.safetensors"):
        data = open(src, "rb").read()
        out = self.fs.open_output_stream(key)
        out.write(data[: len(data) // 2])
        out.flush()
        print(f"KILLED uploading {src} to {key}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return whole(self, src, key)

output.Output._write_file = half_then_die
from habitus.pipelines.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _project(folder: Path, workspace: str) -> Path:
    cfg = {
        "workspace": workspace, "entity": "customer_id", "output": f"s3://{BUCKET}/demo/",
        "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}},
        "sources": [
            {"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
             "timestamp": "ts", "columns": ["product_id", "store_id", "price"], "start": "2026-07-01",
             "end": "2026-12-01"},  # monthly partitions; nothing here depends on today's date
            {"name": "customers", "role": "entity_attributes", "connection": "warehouse", "table": "customers",
             "columns": ["age", "segment"]},
            {"name": "products", "role": "attributes", "connection": "warehouse", "table": "products",
             "key": "product_id", "columns": ["brand"]}],
        "foundation": {"horizon": "14d", "cutoff_every": "14d", "hidden": 16, "layers": 1, "epochs": 1},
        "scenarios": {"churn": {"task": "binary", "target": {"no_event": "purchases", "within": "14d"}, "epochs": 1},
                      "spend": {"task": "regression", "target": {"sum": "purchases.price", "within": "14d"},
                                "epochs": 1}},
        "predictions": {"start": "2026-10-01"},
        "executor": {"device": "cpu", "threads": 1},
    }
    path = folder / f"{workspace}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _append_day(path: Path) -> None:
    """30 purchases of the last day copied to 2026-11-01, one of them by a customer never seen before."""
    con = duckdb.connect(str(path))
    try:
        con.sql("CREATE TEMP TABLE d AS SELECT * FROM purchases WHERE ts >= TIMESTAMP '2026-10-31' ORDER BY ts LIMIT 30")
        con.sql("UPDATE d SET ts = ts + INTERVAL 1 DAY")
        con.sql("UPDATE d SET customer_id = 'C_NEW' WHERE ts = (SELECT min(ts) FROM d)")
        con.sql("INSERT INTO purchases SELECT * FROM d")
    finally:
        con.close()


@pytest.fixture
def s3(moto_s3):
    import boto3

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{moto_s3}"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    yield client, env
    keys = [o["Key"] for p in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET) for o in p.get("Contents", [])]
    for key in keys:
        client.delete_object(Bucket=BUCKET, Key=key)
    client.delete_bucket(Bucket=BUCKET)


def _habitus(folder: Path, env: dict, *args: str, script: str | None = None) -> subprocess.CompletedProcess:
    code = script or "import sys; from habitus.pipelines.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=folder, capture_output=True, text=True,
                          timeout=900, env={**os.environ, **env, "PYTHONPATH": str(ROOT), "HABITUS_FAILURE_FILE": "",
                                            "DAGSTER_HOME": ""})


def _ok(proc: subprocess.CompletedProcess) -> bool:
    """Finished: exit 0, or 1 where the only blocking checks that failed are models losing to a baseline
    (a tiny warehouse)."""
    if proc.returncode == 1:
        failed = re.findall(r"check failed: (\S+ \S+) \(error\)", proc.stdout + proc.stderr)
        return bool(failed) and all(f.endswith(" beats_baselines") for f in failed)
    return proc.returncode == 0


def _keys(client) -> list[str]:
    return [o["Key"] for p in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in p.get("Contents", [])]


def _object(client, key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_killed_upload_rerun_restore_and_score_the_next_day(tmp_path, s3):
    client, env = s3
    generate_demo_warehouse(tmp_path / "warehouse.duckdb", customers=400, products=60, stores=4,
                            start="2026-07-01", end="2026-10-31", seed=3)
    first = _project(tmp_path, "ws")

    killed = _habitus(tmp_path, env, "train", "--config", str(first), script=KILL_HALFWAY)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "KILLED uploading" in killed.stdout
    keys = _keys(client)
    assert "demo/manifests/foundation.json" in keys  # the foundation had finished and was uploaded
    assert "demo/manifests/scenario/churn.json" not in keys  # the killed upload was never committed

    before = json.loads(_object(client, "demo/manifests/foundation.json"))["files"]

    rerun = _habitus(tmp_path, env, "train", "--config", str(first))
    assert _ok(rerun), rerun.stdout[-3000:] + rerun.stderr[-3000:]
    # the re-run trains again; the cache version the foundation was trained on is the same bytes and was
    # uploaded whole before the kill: it is not sent again (its entries keep their first upload time)
    cache_files = [rel for rel in before if rel.startswith("cache/")]
    assert len(cache_files) >= 5
    after = json.loads(_object(client, "demo/manifests/foundation.json"))["files"]
    assert all(after[rel] == before[rel] for rel in cache_files)
    sent = re.findall(r"foundation: (\d+) file\(s\) uploaded .*?, (\d+) already there", rerun.stdout + rerun.stderr)
    assert sent and int(sent[-1][1]) >= len(cache_files), sent
    nothing = _habitus(tmp_path, env, "upload", "--config", str(first))
    assert _ok(nothing), nothing.stderr[-3000:]
    assert "foundation 0 sent" in nothing.stdout and "scenario/churn 0 sent" in nothing.stdout, nothing.stdout

    scored = _habitus(tmp_path, env, "score", "--config", str(first), "--date", "2026-10-31")
    assert _ok(scored), scored.stdout[-3000:] + scored.stderr[-3000:]

    # the bucket: every file a manifest names, once, with its size and SHA-256; nothing else
    keys = _keys(client)
    assert len(keys) == len(set(keys))
    manifests = sorted(k for k in keys if k.startswith("demo/manifests/"))
    assert manifests == ["demo/manifests/foundation.json", "demo/manifests/predictions/churn.json",
                         "demo/manifests/predictions/spend.json", "demo/manifests/scenario/churn.json",
                         "demo/manifests/scenario/spend.json"]
    named = set()
    for m in manifests:
        for rel, entry in json.loads(_object(client, m))["files"].items():
            data = _object(client, f"demo/{rel}")
            assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["size"], entry["sha256"]), rel
            assert data == (tmp_path / "ws" / rel).read_bytes(), rel
            named.add(f"demo/{rel}")
    # no temporary key of the killed upload is left; pyarrow's S3 client marks the prefix as a folder with
    # an empty "demo/" object when it deletes a temporary key there (a marker, not an artifact)
    assert set(keys) == named | set(manifests) | {"demo/"}
    assert _object(client, "demo/") == b""
    assert "demo/checkpoints/scenarios/churn/model.safetensors" in named
    assert "demo/predictions/churn/2026-10-31.parquet" in named

    # the next day, on the machine that trained and on a fresh one restored from the bucket
    _append_day(tmp_path / "warehouse.duckdb")
    day = _habitus(tmp_path, env, "score", "--config", str(first), "--date", "2026-11-01")
    assert _ok(day), day.stdout[-3000:] + day.stderr[-3000:]
    fresh = _project(tmp_path, "fresh")
    restored = _habitus(tmp_path, env, "restore", "--config", str(fresh))
    assert _ok(restored), restored.stdout[-3000:] + restored.stderr[-3000:]
    for rel in ("checkpoints/foundation/model.safetensors", "checkpoints/scenarios/churn/model.safetensors",
                "checkpoints/scenarios/spend/config.json"):
        assert (tmp_path / "fresh" / rel).read_bytes() == (tmp_path / "ws" / rel).read_bytes()
    assert not (tmp_path / "fresh" / "predictions").exists()  # checkpoints only, unless --all
    elsewhere = _habitus(tmp_path, env, "score", "--config", str(fresh), "--date", "2026-11-01")
    assert _ok(elsewhere), elsewhere.stdout[-3000:] + elsewhere.stderr[-3000:]
    for name in ("churn", "spend"):
        here = pq.read_table(tmp_path / "ws" / "predictions" / name / "2026-11-01.parquet")
        there = pq.read_table(tmp_path / "fresh" / "predictions" / name / "2026-11-01.parquet")
        assert here.num_rows > 300 and here.equals(there), name
    assert "C_NEW" in pq.read_table(tmp_path / "fresh" / "predictions" / "spend" / "2026-11-01.parquet") \
        .column("customer_id").to_pylist()
    # the fresh machine's predictions are the same bytes: its upload of the day sends nothing
    assert "predictions/churn: 0 file(s) uploaded (0.0 MB), 1 already there" in elsewhere.stdout + elsewhere.stderr
