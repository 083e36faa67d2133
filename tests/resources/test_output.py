"""Uploads to `output:` (resources/store/output.py) against a local folder: what a stage uploads, what a
re-run skips, what a killed upload leaves and how the next one recovers, and restore's checks."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from habitus.resources.store.output import UPLOADS, Output, OutputError
from habitus.resources.store.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]


def _workspace(tmp_path) -> Path:
    ws = tmp_path / "ws"
    (ws / "checkpoints" / "foundation").mkdir(parents=True)
    (ws / "checkpoints" / "foundation" / "model.safetensors").write_bytes(os.urandom(3 * (1 << 20) + 17))
    (ws / "checkpoints" / "foundation" / "config.json").write_text(json.dumps({"cache_fingerprint": "ab" * 32}))
    (ws / "checkpoints" / "foundation" / ".config.json.tmp-1").write_text("half")  # a writer's leftover: not uploaded
    (ws / "checkpoints" / "foundation_loss.png").write_bytes(b"png")
    cache = ws / "cache" / ("ab" * 8)
    (cache / "vocab").mkdir(parents=True)
    (cache / "manifest.json").write_text("{}")
    (cache / "vocab" / "brand.parquet").write_bytes(b"vocab")
    (cache / "shard-00000.arrow").write_bytes(os.urandom(1000))
    return ws


def _remote_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_stage_uploads_its_files_and_a_manifest_and_a_rerun_sends_nothing(tmp_path):
    ws, out = _workspace(tmp_path), tmp_path / "bucket" / "prefix"
    w = Workspace(root=str(ws), output=str(out))
    logs = []
    first = w.upload_stage("foundation", log=logs.append)
    assert first == {"uploaded": 6, "skipped": 0, "bytes": first["bytes"], "removed": 0, "cleaned": 0}
    remote = _remote_files(out)
    expected = {"checkpoints/foundation/model.safetensors", "checkpoints/foundation/config.json",
                "checkpoints/foundation_loss.png", "cache/abababababababab/manifest.json",
                "cache/abababababababab/vocab/brand.parquet", "cache/abababababababab/shard-00000.arrow",
                "manifests/foundation.json"}
    assert set(remote) == expected  # no temporary key, no leftover of a writer
    manifest = json.loads(remote["manifests/foundation.json"])
    assert manifest["stage"] == "foundation" and manifest["cache_folder"] == "abababababababab"
    for rel, entry in manifest["files"].items():
        assert entry["size"] == len(remote[rel]) and entry["sha256"] == _sha(remote[rel]), rel
        assert remote[rel] == (ws / rel).read_bytes()
    assert first["bytes"] == sum(len(remote[r]) for r in manifest["files"])
    again = w.upload_stage("foundation", log=logs.append)
    assert (again["uploaded"], again["skipped"]) == (0, 6)
    assert "0 file(s) uploaded (0.0 MB), 6 already there" in logs[-1]
    # a restored file (other mtime, same bytes) is hashed again and still not sent
    f = ws / "checkpoints" / "foundation" / "model.safetensors"
    os.utime(f, ns=(1, 1))
    assert w.upload_stage("foundation")["uploaded"] == 0


def test_a_changed_checkpoint_replaces_the_stage_and_daily_files_accumulate(tmp_path):
    ws, out = _workspace(tmp_path), tmp_path / "out"
    w = Workspace(root=str(ws), output=str(out))
    w.upload_stage("foundation")
    (ws / "checkpoints" / "foundation_loss.png").unlink()
    (ws / "checkpoints" / "foundation" / "config.json").write_text(json.dumps({"cache_fingerprint": "ab" * 32,
                                                                              "retrained": True}))
    second = w.upload_stage("foundation")
    assert (second["uploaded"], second["skipped"], second["removed"]) == (1, 4, 1)
    assert not (out / "checkpoints" / "foundation_loss.png").exists()
    assert json.loads((out / "checkpoints" / "foundation" / "config.json").read_text())["retrained"] is True
    # predictions: a scoring machine with only today's file keeps the earlier days in the manifest
    days = ws / "predictions" / "churn"
    days.mkdir(parents=True)
    (days / "2026-10-30.parquet").write_bytes(b"day30")
    w.upload_stage("predictions/churn")
    (days / "2026-10-30.parquet").unlink()
    (days / "2026-10-31.parquet").write_bytes(b"day31")
    assert w.upload_stage("predictions/churn")["uploaded"] == 1
    files = json.loads((out / "manifests" / "predictions" / "churn.json").read_text())["files"]
    assert sorted(files) == ["predictions/churn/2026-10-30.parquet", "predictions/churn/2026-10-31.parquet"]


KILLED = """
import os, signal, sys
from pathlib import Path
from habitus.resources.store.output import Output
from habitus.resources.store.workspace import Workspace

def half_then_die(self, src, key):  # the process dies with half of one file sent
    data = Path(src).read_bytes()
    out = self.fs.open_output_stream(key)
    out.write(data[: len(data) // 2])
    out.flush()
    if src.endswith("model.safetensors"):
        os.kill(os.getpid(), signal.SIGKILL)
    out.write(data[len(data) // 2:])
    out.close()

Output._write_file = lambda self, src, key: half_then_die(self, str(src), key)
Workspace(root=sys.argv[1], output=sys.argv[2]).upload_stage("foundation")
"""


def test_a_killed_upload_is_never_taken_for_a_finished_one(tmp_path):
    ws, out = _workspace(tmp_path), tmp_path / "out"
    w = Workspace(root=str(ws), output=str(out))
    w.upload_stage("foundation")
    committed = _remote_files(out)
    weights = ws / "checkpoints" / "foundation" / "model.safetensors"
    weights.write_bytes(os.urandom(2 * (1 << 20)))  # retrained: new weights, then the upload is killed
    proc = subprocess.run([sys.executable, "-c", KILLED, str(ws), str(out)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    left = {k: v for k, v in _remote_files(out).items() if k.startswith(UPLOADS)}
    assert len(left) == 1 and len(next(iter(left.values()))) == (1 << 20)  # half of it, at a temporary key
    # the committed stage is untouched: the manifest and the real key still hold the previous weights
    assert _remote_files(out)["checkpoints/foundation/model.safetensors"] == committed[
        "checkpoints/foundation/model.safetensors"]
    assert _remote_files(out)["manifests/foundation.json"] == committed["manifests/foundation.json"]
    fresh = tmp_path / "fresh"
    Workspace(root=str(fresh), output=str(out)).restore(["foundation"], log=lambda _: None)
    assert (fresh / "checkpoints" / "foundation" / "model.safetensors").read_bytes() == committed[
        "checkpoints/foundation/model.safetensors"]
    # the re-run removes the temporary key and sends the new weights once; the rest is not sent again
    logs = []
    rerun = w.upload_stage("foundation", log=logs.append)
    assert (rerun["uploaded"], rerun["skipped"], rerun["cleaned"]) == (1, 5, 1)
    assert any("removed 1 temporary key(s)" in line for line in logs)
    remote = _remote_files(out)
    assert not [k for k in remote if k.startswith(UPLOADS)]
    assert remote["checkpoints/foundation/model.safetensors"] == weights.read_bytes()
    manifest = json.loads(remote["manifests/foundation.json"])
    assert manifest["files"]["checkpoints/foundation/model.safetensors"]["sha256"] == _sha(weights.read_bytes())


def test_restore_checks_every_file_against_its_manifest(tmp_path):
    ws, out = _workspace(tmp_path), tmp_path / "out"
    Workspace(root=str(ws), output=str(out)).upload_stage("foundation")
    fresh = Workspace(root=str(tmp_path / "fresh"), output=str(out))
    done = fresh.restore(log=lambda _: None)
    assert list(done) == ["foundation"]
    for rel in done["foundation"]["files"]:
        assert (tmp_path / "fresh" / rel).read_bytes() == (ws / rel).read_bytes()
    # the cache version uploaded with the foundation becomes the cache in use of the fresh workspace
    assert json.loads((tmp_path / "fresh" / "cache" / "current.json").read_text())["folder"] == "abababababababab"
    # a key changed after its manifest was committed is refused, naming it; nothing half-written is left
    (out / "checkpoints" / "foundation" / "config.json").write_text("{}")
    other = tmp_path / "other"
    with pytest.raises(OutputError, match=r"checkpoints/foundation/config.json is 2 bytes .* manifest says"):
        Workspace(root=str(other), output=str(out)).restore(log=lambda _: None)
    assert not list(other.rglob(".*tmp-*"))
    with pytest.raises(OutputError, match=r"no foundation checkpoint was uploaded there \(uploaded stages: none\)"):
        Workspace(root=str(other), output=str(tmp_path / "empty")).restore(log=lambda _: None)


class _Flaky:
    """A filesystem whose first two moves fail, as a store that drops connections does."""

    def __init__(self, fs):
        self._fs, self.failures = fs, 2

    def move(self, a, b):
        if self.failures:
            self.failures -= 1
            raise OSError("connection reset by peer")
        return self._fs.move(a, b)

    def __getattr__(self, name):
        return getattr(self._fs, name)


def test_store_errors_are_retried_then_reported_with_the_key(tmp_path):
    ws, logs = _workspace(tmp_path), []
    out = Output(str(tmp_path / "out"), backoff_s=0.01, log=logs.append)
    out.fs = _Flaky(out.fs)
    files = [ws / "checkpoints" / "foundation_loss.png"]
    assert out.upload("foundation", ws, files)["uploaded"] == 1
    assert sum("connection reset by peer" in line and "retrying" in line for line in logs) == 2
    out = Output(str(tmp_path / "out2"), retries=2, backoff_s=0.01, log=logs.append)
    out.fs = _Flaky(out.fs)
    with pytest.raises(OutputError, match=r"moving .*foundation_loss.png failed after 2 attempts"):
        out.upload("foundation", ws, files)


def test_bad_outputs_are_named():
    with pytest.raises(OutputError, match="must be an absolute path"):
        Output("models/out")
    with pytest.raises(OutputError, match="name a bucket"):
        Output("s3:///prefix")
    with pytest.raises(OutputError, match="pyarrow cannot open it"):
        Output("ftp://host/x")


def _embeddings_asset(seen: list):
    import dagster as dg

    from habitus.resources.store.workspace import locked

    @dg.asset(key="embeddings")
    @locked("embeddings")
    def embeddings(context, workspace: Workspace) -> None:
        (workspace.embeddings).mkdir(parents=True, exist_ok=True)
        (workspace.embeddings / "2026-10-31.parquet").write_bytes(b"rows")
        seen.append(sorted(p.name for p in Path(workspace.output).rglob("*")) if Path(workspace.output).exists()
                    else [])

    return embeddings


def test_an_asset_uploads_after_its_body_and_a_failed_upload_says_how_to_retry(tmp_path):
    import dagster as dg

    seen = []
    out = tmp_path / "out"
    ws = Workspace(root=str(tmp_path / "ws"), output=str(out))
    assert dg.materialize([_embeddings_asset(seen)], resources={"workspace": ws}).success
    assert seen == [[]]  # nothing in the output while the body ran
    assert (out / "embeddings" / "2026-10-31.parquet").read_bytes() == b"rows"
    assert json.loads((out / "manifests" / "embeddings.json").read_text())["files"]
    (tmp_path / "not-a-folder").write_text("")  # an output that cannot be written
    bad = Workspace(root=str(tmp_path / "ws"), output=str(tmp_path / "not-a-folder" / "out"))
    result = dg.materialize([_embeddings_asset(seen)], resources={"workspace": bad}, raise_on_error=False)
    assert not result.success
    message = result.get_step_failure_events()[0].event_specific_data.error.message
    assert "embeddings: uploading to" in message and "`habitus upload` sends it without running the stage" in message
    assert (tmp_path / "ws" / "embeddings" / "2026-10-31.parquet").exists()  # the stage's work is kept
