"""Files that appear whole or not at all, and content fingerprints.

Every artifact is written under a temporary name in its final folder and renamed into place, so a
killed run never leaves a half-written file under a real name.
"""

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator

_CHUNK = 1 << 22


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; on success rename it onto `path` (file or folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            # A folder cannot be renamed over a non-empty one: move the old aside first.
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)


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


def folder_bytes(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
