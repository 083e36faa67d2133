"""`habitus restore` SIGKILLed halfway (after its first, second, ... file downloaded) over a workspace that holds
an older checkpoint: every unit (the checkpoint folder, the cache version, the plot) is either the old one
whole or the new one whole, nothing half-written is visible, and the next restore ends with the new one
and no leftovers (resources/store/output.py: each unit built under a temporary name and swapped in whole)."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from habitus.models.nn.checkpoint import save_checkpoint
from habitus.resources.store.workspace import Workspace

pytestmark = pytest.mark.faults

# loaded by every Python process through PYTHONPATH: the restore dies (SIGKILL, no clean-up) right after
# its HABITUS_TEST_KILL_AFTER-th file reached its temporary folder
KILL_HOOK = """
import os, signal
if os.environ.get("HABITUS_TEST_KILL_AFTER"):
    import habitus.resources.store.output as output
    whole, left = output.Output._fetch, [int(os.environ["HABITUS_TEST_KILL_AFTER"])]
    def fetch_then_die(self, rel, dest, entry):
        whole(self, rel, dest, entry)
        left[0] -= 1
        if left[0] == 0:
            print(f"KILLED after restoring {rel}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    output.Output._fetch = fetch_then_die
"""


def _checkpoint(ws: Path, seed: int, fingerprint: str) -> None:
    """A foundation checkpoint (real safetensors, its SHA-256 in config.json), its plot and cache version."""
    torch.manual_seed(seed)
    save_checkpoint(ws / "checkpoints" / "foundation", torch.nn.Linear(64, 64), {"cache_fingerprint": fingerprint})
    (ws / "checkpoints" / "foundation_loss.png").write_bytes(b"\x89PNG" + os.urandom(64) + b"IEND\xaeB`\x82")
    cache = ws / "cache" / fingerprint[:16]
    cache.mkdir(parents=True)
    (cache / "manifest.json").write_text(json.dumps({"seed": seed}))
    (cache / "vocab.json").write_text(json.dumps({"v": list(range(seed))}))


def _units(ws: Path, fingerprint: str) -> dict[str, dict[str, bytes]]:
    out = {}
    for unit in ("checkpoints/foundation", "checkpoints/foundation_loss.png", f"cache/{fingerprint[:16]}"):
        p = ws / unit
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else []
        out[unit] = {str(q.relative_to(ws)): q.read_bytes() for q in files}
    return out


def test_a_restore_killed_after_each_file_leaves_every_unit_old_or_new_and_whole(faults, tmp_path):
    old_fp, new_fp = "aa" * 32, "bb" * 32
    out = tmp_path / "output"
    trained = tmp_path / "trained"
    _checkpoint(trained, 7, new_fp)
    Workspace(root=str(trained), output=str(out)).upload_stage("foundation", log=lambda _: None)
    new = _units(trained, new_fp)
    n_files = sum(len(files) for files in new.values())

    folder = faults.project(tmp_path / "job", {**faults.config, "output": str(out)})
    ws = folder / "ws"
    _checkpoint(ws, 3, old_fp)
    # the older checkpoint's cache version has another name; the new one's is absent before the restore
    old = {**_units(ws, old_fp), **{f"cache/{new_fp[:16]}": {}}}
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    args = ("restore", "--config", str(folder / "project.yaml"))
    pristine = tmp_path / "pristine"
    shutil.copytree(ws, pristine)
    kills = 0
    for after in range(1, n_files):  # each kill point from the older checkpoint, as a job that died there
        shutil.rmtree(ws)
        shutil.copytree(pristine, ws)
        rc, output, _ = faults.run(folder, *args, env={"PYTHONPATH": str(hook), "HABITUS_TEST_KILL_AFTER": str(after)})
        assert rc == -signal.SIGKILL and "KILLED after restoring" in output, output[-3000:]
        kills += 1
        now = _units(ws, new_fp)
        for unit, files in now.items():
            was = old.get(unit, {}) if unit != "checkpoints/foundation_loss.png" else old[unit]
            assert files in (was, new[unit]), f"after kill {after}: {unit} is neither the old nor the new one"
        assert _units(ws, old_fp)["checkpoints/foundation"] in (old["checkpoints/foundation"],
                                                                 new["checkpoints/foundation"])
        assert faults.half_written(ws) == [], f"after kill {after}"
    rc, output, _ = faults.run(folder, *args)
    assert rc == 0, output[-3000:]
    assert _units(ws, new_fp) == new
    assert json.loads((ws / "cache" / "current.json").read_text())["folder"] == new_fp[:16]
    assert faults.leftovers(ws) == [] and not [p for p in ws.rglob(".*") if ".tmp-" in p.name]
    assert kills == n_files - 1 >= 4
    print(f"\nfaults: restore SIGKILLed after each of its first {kills} of {n_files} files: every unit old or "
          f"new and whole after each kill; the next restore finished with no leftovers")
