"""One lock per artifact or stage of a workspace, so two runs never write the same thing at once.

    with ArtifactLock(root / "locks", "foundation", timeout_s=3600, log=print):
        ...  # train and save the foundation checkpoint

A lock is an `fcntl.flock` on `<folder>/<name>.lock`. The kernel releases it when its holder exits,
however it exits (SIGKILL included), so a lock left by a dead process is simply taken over; the file
also records who holds it (pid, host, start time, what for), which is what the one that waits is
told. Locks are re-entrant within a process (a stage may lock what a helper it calls locks too).
flock works across processes of one machine and on NFSv4 / Lustre / GPFS mounts that support it.
"""

import fcntl
import json
import os
import re
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from habitus.models.storage.files import pid_alive

_NAME = re.compile(r"[^A-Za-z0-9_.=-]+")
_held: dict[str, list] = {}  # lock file -> [fd, depth] for the locks this process holds
_guard = threading.Lock()


class LockTimeout(TimeoutError):
    """Another run held the lock for longer than this one was willing to wait."""


def lock_file_name(name: str) -> str:
    """'scenario/churn' -> 'scenario.churn.lock'; names cannot leave the lock folder."""
    safe = _NAME.sub("_", name.replace("/", ".")).strip(".")
    if not safe:
        raise ValueError(f"cannot make a lock file name from {name!r}")
    return f"{safe}.lock"


def holder(path: str | os.PathLike) -> dict | None:
    """Who holds the lock at `path` (or died holding it), as recorded in the file; None when unknown."""
    try:
        return json.loads(Path(path).read_text() or "null")
    except (OSError, ValueError):
        return None


def describe(info: dict | None) -> str:
    if not info:
        return "another process (no holder recorded)"
    age = ""
    if isinstance(info.get("started_unix"), (int, float)):
        age = f", {time.time() - info['started_unix']:.0f}s ago"
    return (f"pid {info.get('pid')} on host {info.get('host')} (since {info.get('started')}{age}"
            f"{', ' + info['what'] if info.get('what') else ''})")


class ArtifactLock:
    """An exclusive lock on one artifact/stage name inside `folder`; use it as a context manager.

    `timeout_s`: how long to wait for another holder (0: fail at once); `what`: recorded for the
    others to read (e.g. the Dagster run id); `log`: where the waiting / taking-over notes go.
    """

    def __init__(self, folder: str | os.PathLike, name: str, *, timeout_s: float = 3600.0, what: str = "",
                 log: Callable[[str], None] = print, poll_s: float = 0.2):
        self.folder = Path(folder)
        self.name = name
        self.path = self.folder / lock_file_name(name)
        self.timeout_s = timeout_s
        self.what = what
        self.log = log
        self.poll_s = poll_s

    def __enter__(self) -> "ArtifactLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        key = os.path.abspath(self.path)
        with _guard:
            if key in _held:
                _held[key][1] += 1
                return
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._wait(fd)
        except BaseException:
            os.close(fd)
            raise
        previous = holder(self.path)
        if previous and previous.get("host") == socket.gethostname() and isinstance(previous.get("pid"), int) \
                and previous["pid"] != os.getpid() and not pid_alive(previous["pid"]):
            self.log(f"lock {self.name!r}: taking over from {describe(previous)}, which is no longer running "
                     f"(its work is redone; nothing it left half-written is visible)")
        now = datetime.now(timezone.utc)
        record = {"name": self.name, "pid": os.getpid(), "host": socket.gethostname(),
                  "started": now.isoformat(timespec="seconds"), "started_unix": now.timestamp(), "what": self.what}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        with _guard:
            _held[key] = [fd, 1]

    def _wait(self, fd: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if told:
                    self.log(f"lock {self.name!r}: acquired after waiting")
                return
            except BlockingIOError:
                pass
            info = describe(holder(self.path))
            if time.monotonic() >= deadline:
                raise LockTimeout(
                    f"{self.name} in {self.folder.parent} is in use by {info}; gave up after {self.timeout_s:.0f}s. "
                    f"Let that run finish (or stop it) and run this again; the lock file is {self.path}")
            if not told:
                self.log(f"lock {self.name!r}: in use by {info}; waiting up to {self.timeout_s:.0f}s")
                told = True
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0.0)))

    def release(self) -> None:
        key = os.path.abspath(self.path)
        with _guard:
            entry = _held.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del _held[key]
        fd = entry[0]
        try:
            os.ftruncate(fd, 0)  # released cleanly: a record left in the file means its holder died
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
