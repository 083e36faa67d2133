"""Files that appear whole or not at all, and content fingerprints.

Every artifact is written under a temporary name in its final folder and renamed into place, so a
killed run never leaves a half-written file under a real name. A rename is a commit only once the
bytes it names are on the disk: write -> fsync(file) -> rename -> fsync(folder), so that a machine
that loses power right after a rename comes back with the old file or the whole new one.
"""

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

_CHUNK = 1 << 22


class DiskFullError(OSError):
    """The disk filled while an artifact was being written; nothing was replaced."""

    def __init__(self, path: Path, written: int, needed: int | None):
        free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
        want = f"about {needed / 1e6:,.1f} MB" if needed else f"more than the {written / 1e6:,.1f} MB written"
        super().__init__(errno.ENOSPC, f"the disk holding {path.parent} is full: writing {path.name} stopped after "
                                       f"{written / 1e6:,.1f} MB with {free / 1e6:,.1f} MB free, and it needs {want} "
                                       f"(+20% headroom). Nothing was replaced: the previous version, if any, is "
                                       f"intact and the partial copy was removed. Free space or move the workspace "
                                       f"to a larger disk, then run again")
        self.path, self.written, self.needed = path, written, needed


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC from Python, pyarrow (an OSError without errno) or DuckDB (its own IOException)."""
    return getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; on success rename it onto `path` (file or folder). A full
    disk while writing raises DiskFullError naming the path and the space needed (`needed_bytes`,
    where the caller knows it).

    A folder replaces an existing one by an atomic exchange (Linux renameat2), so readers always see
    either the old or the new folder. Leftovers of a writer that was killed (its temporary copy, or
    the old folder moved aside where the exchange is not supported) are cleaned up or put back first.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = path.with_name(f"{_tmp_prefix(path)}{os.getpid()}")
    _remove(tmp)
    try:
        try:
            yield tmp
            fsync_tree(tmp)
        except Exception as e:
            if is_disk_full(e) and not (isinstance(e, DiskFullError) and needed_bytes is None):
                raise DiskFullError(path, folder_bytes(tmp) if tmp.is_dir() else _size(tmp), needed_bytes) from e
            raise
        if path.is_dir() and tmp.is_dir():
            if not _exchange(tmp, path):
                # no atomic exchange on this filesystem: move the old aside; `recover` puts it back
                # if the process dies before the new one is in place
                old = path.with_name(f"{_old_prefix(path)}{os.getpid()}")
                os.replace(path, old)
                os.replace(tmp, path)
                _remove(old)
        else:
            os.replace(tmp, path)
        fsync(path.parent)
    finally:
        _remove(tmp)


def durable_replace(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """os.replace(tmp, path) as a commit: tmp's bytes reach the disk before its new name does, and the
    name before this returns."""
    fsync_tree(tmp)
    os.replace(tmp, path)
    fsync(Path(path).parent)


def fsync(path: str | os.PathLike) -> None:
    """Flush one file's data, or one folder's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsync a file, or every file and folder under a folder (a checkpoint, a cache version)."""
    path = Path(path)
    if not path.is_dir():
        fsync(path)
        return
    for folder, _, files in os.walk(path):
        for name in files:
            fsync(Path(folder) / name)
        fsync(folder)


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def _old_prefix(path: Path) -> str:
    return f".{path.name}.old-"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def recover(path: str | os.PathLike) -> list[str]:
    """Clean up after writers of `path` that died: remove their temporary copies, and put an old
    folder moved aside back in place when the new one never arrived. Returns what was done."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    mine = [e for e in sorted(os.listdir(path.parent)) if (m := _LEFTOVER.match(e)) and m["name"] == path.name]
    return _recover_entries(path.parent, mine)


def _recover_entries(folder: Path, entries: list[str]) -> list[str]:
    done = []
    # old folders first: one is put back only where the new one never arrived
    for entry in sorted(entries, key=lambda e: _LEFTOVER.match(e)["kind"] != "old"):
        m = _LEFTOVER.match(entry)
        if not m or int(m["pid"]) == os.getpid() or pid_alive(int(m["pid"])):
            continue
        leftover, target = folder / entry, folder / m["name"]
        if m["kind"] == "old" and not target.exists():
            os.replace(leftover, target)
            done.append(f"restored {target} from {entry}")
        else:
            _remove(leftover)
            done.append(f"removed {leftover}")
    return done


# `.<name>.<kind>-<pid>`: tmp (being written), old (moved aside), unsorted (resources/warehouses/canonical.py's spill)
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|unsorted)-(?P<pid>\d+)$")


def recover_tree(root: str | os.PathLike) -> list[str]:
    """`recover` for every leftover under `root`: temporary copies of writers that died are removed, old
    folders moved aside by them are put back where the new one never arrived. Writers still running
    are left alone (their pid is alive on this machine). Returns what was done."""
    root = Path(root)
    done = []
    if not root.is_dir():
        return done
    for folder, dirs, files in os.walk(root):
        done += _recover_entries(Path(folder), [e for e in dirs + files if _LEFTOVER.match(e)])
        dirs[:] = [d for d in dirs if not _LEFTOVER.match(d) and (Path(folder) / d).is_dir()]
    return done


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        return False
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def write_json(path: str | os.PathLike, data) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))


def read_json(path: str | os.PathLike):
    return json.loads(Path(path).read_text())


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def file_fingerprint(path: str | os.PathLike) -> str:
    """Content hash of a file, remembered in a `.sha256` sidecar keyed by size and mtime.

    Hashing the bytes (not the mtime) makes a re-extracted but identical partition keep its
    fingerprint, so the cache built from it is reused.
    """
    path = Path(path)
    st = path.stat()
    stamp = f"{st.st_size}:{st.st_mtime_ns}"
    side = path.with_name(f".{path.name}.sha256")
    if side.exists():
        recorded = side.read_text().split()
        if len(recorded) == 2 and recorded[0] == stamp:
            return recorded[1]
    digest = file_sha256(path)
    with contextlib.suppress(OSError):  # a read-only input folder only costs a re-hash next time
        with atomic_path(side) as tmp:
            tmp.write_text(f"{stamp} {digest}\n")
    return digest


def combine(*parts) -> str:
    """Fingerprint of several fingerprints / JSON-able values, order-sensitive."""
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def folder_bytes(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
