"""habitus.models.storage.locks with real processes: the second writer waits or stops with a message naming the
holder, a lock left by a killed process is taken over, and lock names cannot leave their folder."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from habitus.models.storage.locks import ArtifactLock, LockTimeout, holder, lock_file_name
from habitus.resources.store.workspace import Workspace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _holder_process(folder, name, then: str) -> subprocess.Popen:
    """A process that takes the lock, prints 'held', then `then` ('sleep' for 30 s, or 'die': SIGKILL itself)."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path.insert(0, {ROOT!r})
        from habitus.models.storage.locks import ArtifactLock
        lock = ArtifactLock({str(folder)!r}, {name!r}, what="backfill run 42", log=lambda m: None)
        lock.acquire()
        print("held", flush=True)
        if {then!r} == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_stops_with_the_holder_named(tmp_path):
    proc = _holder_process(tmp_path, "foundation", "sleep")
    try:
        with pytest.raises(LockTimeout) as info:
            ArtifactLock(tmp_path, "foundation", timeout_s=0, log=lambda _: None).acquire()
        message = str(info.value)
        assert f"pid {proc.pid}" in message and socket.gethostname() in message and "backfill run 42" in message
        assert "foundation" in message and "run this again" in message
    finally:
        proc.kill()
        proc.wait()


def test_waiter_is_told_and_proceeds_when_the_holder_ends(tmp_path):
    proc = _holder_process(tmp_path, "scenario/churn", "sleep")
    notes = []
    try:
        killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(1.0); os.kill({proc.pid}, 9)"])
        started = time.monotonic()
        with ArtifactLock(tmp_path, "scenario/churn", timeout_s=20, log=notes.append, poll_s=0.05):
            waited = time.monotonic() - started
            assert holder(tmp_path / "scenario.churn.lock")["pid"] == os.getpid()
        killer.wait()
    finally:
        proc.kill()
        proc.wait()
    assert waited > 0.5
    assert notes[0].startswith("lock 'scenario/churn': in use by pid") and "waiting up to 20s" in notes[0]
    assert notes[-1].endswith("acquired after waiting")


def test_lock_of_a_killed_process_is_taken_over(tmp_path):
    proc = _holder_process(tmp_path, "source/purchases", "die")
    assert proc.wait() == -signal.SIGKILL
    left = json.loads((tmp_path / "source.purchases.lock").read_text())
    assert left["pid"] == proc.pid  # the record of the dead holder is still there
    notes = []
    with ArtifactLock(tmp_path, "source/purchases", timeout_s=0, log=notes.append):
        pass
    assert len(notes) == 1 and f"taking over from pid {proc.pid}" in notes[0] and "no longer running" in notes[0]
    # released cleanly: the next one takes it without a word
    notes.clear()
    with ArtifactLock(tmp_path, "source/purchases", timeout_s=0, log=notes.append):
        pass
    assert notes == []


def test_reentrant_in_one_process_and_exclusive_across_processes(tmp_path):
    outer = ArtifactLock(tmp_path, "cache", timeout_s=0, log=lambda _: None)
    with outer:
        with ArtifactLock(tmp_path, "cache", timeout_s=0, log=lambda _: None):
            pass
        # still held after the inner release: another process cannot take it
        probe = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import sys; sys.path.insert(0, {ROOT!r})
            from habitus.models.storage.locks import ArtifactLock, LockTimeout
            try:
                ArtifactLock({str(tmp_path)!r}, "cache", timeout_s=0, log=lambda m: None).acquire()
                print("acquired")
            except LockTimeout:
                print("refused")
        """)], capture_output=True, text=True, check=True)
        assert probe.stdout.strip() == "refused"


@pytest.mark.parametrize("name", ["../../etc/passwd", "a/../../b", "x\"; DROP TABLE y; --", "/abs/path"])
def test_lock_names_stay_in_the_lock_folder(tmp_path, name):
    file = lock_file_name(name)
    assert "/" not in file and not file.startswith(".") and file.endswith(".lock")
    with ArtifactLock(tmp_path, name, timeout_s=0, log=lambda _: None) as lock:
        assert lock.path.parent == tmp_path


def test_workspace_lock_lives_in_the_workspace(tmp_path):
    ws = Workspace(root=str(tmp_path), lock_timeout_s=0)
    with ws.lock("foundation") as lock:
        assert lock.path == tmp_path / "locks" / "foundation.lock"
        assert lock.timeout_s == 0
    assert ws.resume("scenarios", "churn") == tmp_path / "resume" / "scenarios" / "churn"


def test_a_stage_cleans_up_only_its_own_leftovers(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    ws = Workspace(root=str(tmp_path))
    for name in ("a", "b"):
        ws.sources(name).mkdir(parents=True)
        (ws.sources(name) / f".2026-03-01.parquet.tmp-{dead.pid}").write_text("half")
    ws.foundation.parent.mkdir(parents=True)
    (ws.foundation.parent / f".foundation.tmp-{dead.pid}").mkdir()
    (ws.foundation.parent / f".foundation_loss.png.tmp-{dead.pid}").write_text("half")
    assert len(ws.recover_stage("source/a")) == 1
    assert list(ws.sources("a").iterdir()) == [] and len(list(ws.sources("b").iterdir())) == 1
    assert len(ws.recover_stage("foundation")) == 2
    assert list(ws.foundation.parent.iterdir()) == []
    assert ws.recover_stage("something/else") == []
