"""SIGKILL a process that keeps new scenario versions, prunes and rolls back, over and over, at random
moments: after every kill the pointer names a whole version (its config, weights and version.json all
there, the weights the ones its fingerprint says), every version listed is whole, and the next process
carries on with no clean-up by hand. The same for the foundation's versions, whose rollback also puts the
chosen version back into checkpoints/foundation/: that folder holds one whole checkpoint after every kill."""

import hashlib
import json
import random
import signal
import subprocess
import sys
import time

import pytest

from habitus.assets.foundation_versions import foundation_versions, rollback_foundation
from habitus.assets.serving import serving_checkpoint, versions
from habitus.models.storage.versions import INFO
from habitus.resources.store.workspace import Workspace

pytestmark = pytest.mark.faults

KILLS = 12
WEIGHT_BYTES = 8 << 20  # big enough that copying and deleting a version takes a while

CHILD = r"""
import hashlib, itertools, json, sys, time
import habitus.assets.check_measures, habitus.models.evaluate.drift  # what keep_version imports, before the clock starts
from habitus.assets.serving import keep_version, rollback
from habitus.models.storage.files import atomic_path
from habitus.models.storage.versions import VersionError
from habitus.resources.store.workspace import Workspace

ws = Workspace(root=sys.argv[1])
print("ready", flush=True)
for n in itertools.count(time.time_ns()):  # a new checkpoint each time, whichever process writes it
    weights = n.to_bytes(8, "big") * (int(sys.argv[2]) // 8)
    with atomic_path(ws.scenario("churn")) as tmp:  # training writes its checkpoint whole
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(weights)
        (tmp / "config.json").write_text(json.dumps({
            "weights_sha256": hashlib.sha256(weights).hexdigest(), "headline": "auroc", "beats_baselines": n % 3 != 0,
            "metrics": {"model": {"auroc": 0.8}, "baselines": {"recency": {"auroc": 0.7}}}}))
    keep_version(ws, "churn", keep=2, keep_served=False)  # pruning on every call
    if n % 2:
        try:
            rollback(ws, "churn", keep=2, keep_served=False)
        except VersionError:  # the one that served before was pruned (keep_served off)
            pass
"""


def whole(store, fp: str) -> bool:
    folder = store.path(fp)
    try:
        config = json.loads((folder / "config.json").read_text())
        weights = (folder / "model.safetensors").read_bytes()
        json.loads((folder / INFO).read_text())
    except (OSError, ValueError):
        return False
    return config["weights_sha256"][:16] == fp == hashlib.sha256(weights).hexdigest()[:16]


def test_a_killed_rollback_or_prune_leaves_a_whole_serving_version(tmp_path):
    ws = Workspace(root=str(tmp_path / "ws"))
    store = versions(ws, "churn")
    rng = random.Random(20261203)
    served, interrupted = set(), 0
    for kill in range(KILLS):
        child = subprocess.Popen([sys.executable, "-c", CHILD, ws.root, str(WEIGHT_BYTES)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.2, 2.5))
        assert child.poll() is None, child.stderr.read()  # still at work when killed
        child.send_signal(signal.SIGKILL)
        child.wait()
        interrupted += any(e.name.startswith(".") for e in store.folder.iterdir()) if store.folder.exists() else 0
        fps = store.fingerprints()
        assert all(whole(store, fp) for fp in fps), f"kill {kill}: a listed version is not whole: {fps}"
        fp = store.serving()
        if fp is None:  # killed before the first version that beat its baselines was kept
            assert not store.pointer()["serving"]
            continue
        folder, _ = serving_checkpoint(ws, "churn")
        assert folder == store.path(fp) and whole(store, fp), f"kill {kill}: serving {fp} is not whole"
        served.add(fp)
    assert served  # the kills landed while versions were kept and rolled back (how often mid-copy: printed)
    print(f"{KILLS} kills, {interrupted} in the middle of copying or deleting a version, {len(served)} versions "
          f"served after a kill")
    store.prune(keep=2)  # the next prune clears what the killed ones left
    assert not [e.name for e in store.folder.iterdir() if e.name.startswith(".")]


FOUNDATION_CHILD = r"""
import hashlib, itertools, json, sys, time
from habitus.assets.foundation_versions import keep_foundation_version, rollback_foundation
from habitus.models.storage.files import atomic_path
from habitus.models.storage.versions import VersionError
from habitus.resources.store.workspace import Workspace

ws = Workspace(root=sys.argv[1])
print("ready", flush=True)
for n in itertools.count(time.time_ns()):
    weights = n.to_bytes(8, "big") * (int(sys.argv[2]) // 8)
    with atomic_path(ws.foundation) as tmp:  # training writes its checkpoint whole
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(weights)
        (tmp / "config.json").write_text(json.dumps({"kind": "foundation",
                                                     "weights_sha256": hashlib.sha256(weights).hexdigest()}))
    keep_foundation_version(ws, keep=2, keep_served=n % 2 == 0)
    try:  # a rollback after every training: the kills land in the copy back into checkpoints/foundation/ too
        rollback_foundation(ws, keep=2, keep_served=False)
    except VersionError:  # the one that served before was pruned (keep_served off)
        pass
"""


def whole_checkpoint(folder) -> bool:
    try:
        config = json.loads((folder / "config.json").read_text())
        weights = (folder / "model.safetensors").read_bytes()
    except (OSError, ValueError):
        return False
    return config["weights_sha256"] == hashlib.sha256(weights).hexdigest()


def test_a_killed_foundation_rollback_leaves_a_whole_foundation(tmp_path):
    ws = Workspace(root=str(tmp_path / "ws"))
    store = foundation_versions(ws)
    rng = random.Random(20261204)
    mid_copy = 0
    for kill in range(KILLS):
        child = subprocess.Popen([sys.executable, "-c", FOUNDATION_CHILD, ws.root, str(WEIGHT_BYTES)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        time.sleep(rng.uniform(0.2, 2.5))
        assert child.poll() is None, child.stderr.read()
        child.send_signal(signal.SIGKILL)
        child.wait()
        checkpoints = ws.foundation.parent
        mid_copy += checkpoints.is_dir() and any(e.name.startswith(".foundation.") for e in checkpoints.iterdir())
        ws.recover_stage("foundation")  # what the stage's lock holder does first (an old folder put back)
        if ws.foundation.exists():
            assert whole_checkpoint(ws.foundation), f"kill {kill}: checkpoints/foundation/ is not whole"
        fps = store.fingerprints()
        assert all(whole(store, fp) for fp in fps), f"kill {kill}: a listed version is not whole: {fps}"
        fp = store.serving()
        assert fp is None or whole(store, fp), f"kill {kill}: serving {fp} is not whole"
    print(f"{KILLS} kills, {mid_copy} in the middle of writing checkpoints/foundation/ (a training's or a rollback's)")
    rollback_foundation(ws, to=store.serving())  # the next process carries on: the pointer's version in place
    assert json.loads((ws.foundation / "config.json").read_text())["weights_sha256"][:16] == store.serving()
