"""Immutable checkpoint versions of one model, and the pointer that names the one serving.

    <folder>/<fingerprint>/            a checkpoint folder, copied once, never written again,
                                       with version.json: what the caller recorded about it
    <folder>/serving.json              {"serving": fingerprint, "history": [{fingerprint, from, to, why}]}

A version appears by one rename (models/storage/files.py's atomic_path), the pointer is rewritten
the same way, and a pruned version is renamed out of the listing before it is deleted: a process
killed at any point leaves the pointer naming a whole version. The pointer only moves to a version
that exists, and pruning never removes the serving one. Callers hold the model's stage lock
(models/storage/locks.py) around every change, so one writer at a time.
"""

import os
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path

from habitus.models.storage.files import atomic_path, fsync, read_json, recover, recover_tree, write_json

POINTER = "serving.json"
INFO = "version.json"
# versions whose best baseline was found unservable (no saved model, no rule of that name): not fitted again
UNSERVABLE = "unservable-baselines.json"
_TRASH = ".pruned-"  # a version being deleted: out of the listing already
# a version's name: the first 16 hex digits of its weights' SHA-256 (config.json weights_sha256), the same form
# as a cache folder's (resources/store/manifests.py); nothing else read from a file becomes a version's path
FINGERPRINT = re.compile(r"[0-9a-f]{16}")


class VersionError(ValueError):
    """A fingerprint that names no version, or names several, or is not a fingerprint."""


def checked_fingerprint(fp, where: str, kind: str = "version", fix: str = "retrain or restore") -> str:
    """`fp` when it has the fingerprint form (16 hex digits: never `..`, a slash or an absolute path);
    VersionError naming `where` (the file it was read from), the `kind` of name and what to do (`fix`) otherwise."""
    if not (isinstance(fp, str) and FINGERPRINT.fullmatch(fp)):
        raise VersionError(f"{where}: {str(fp)[:80]!r} is not a {kind} fingerprint (16 hex digits); the file was "
                           f"not written by habitus: check who can write to the workspace, then {fix}")
    return fp


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")  # orders versions added in one second


class VersionStore:
    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def path(self, fingerprint: str) -> Path:
        """The version's folder; VersionError when `fingerprint` is not one (never a path outside the store)."""
        return self.folder / checked_fingerprint(fingerprint, f"a version of {self.folder}")

    def fingerprints(self) -> list[str]:
        """Every whole version, oldest first (by the time it was added)."""
        if not self.folder.is_dir():
            return []
        found = [e.name for e in self.folder.iterdir() if FINGERPRINT.fullmatch(e.name) and e.is_dir()
                 and not e.is_symlink() and (e / INFO).exists()]
        return sorted(found, key=lambda fp: (self.info(fp).get("added", ""), fp))

    def info(self, fingerprint: str) -> dict:
        return read_json(self.path(fingerprint) / INFO)

    def add(self, checkpoint: str | os.PathLike, fingerprint: str, info: dict) -> bool:
        """Copy `checkpoint` in as version `fingerprint` with `info` (whole or not at all); False when that
        version is already kept (a checkpoint is never rewritten)."""
        dest = self.path(fingerprint)
        recover(dest)  # a copy a killed writer left half-made
        if (dest / INFO).exists():
            return False
        with atomic_path(dest) as tmp:
            shutil.copytree(checkpoint, tmp)
            write_json(tmp / INFO, {**info, "fingerprint": fingerprint, "added": now_iso()})
        return True

    def resolve(self, prefix: str) -> str:
        """The version whose fingerprint starts with `prefix`."""
        matches = [fp for fp in self.fingerprints() if fp.startswith(prefix)]
        if len(matches) != 1:
            known = ", ".join(self.fingerprints()) or "none"
            raise VersionError(f"{prefix!r} names {'no' if not matches else len(matches)} version(s) "
                               f"(kept: {known})")
        return matches[0]

    def pointer(self) -> dict:
        file = self.folder / POINTER
        recover(file)
        return read_json(file) if file.exists() else {"serving": None, "history": []}

    def serving(self) -> str | None:
        """The serving fingerprint, when the pointer names a whole version."""
        fp = self.pointer()["serving"]
        if fp is not None:
            checked_fingerprint(fp, f"{self.folder / POINTER}: serving")
        return fp if fp and (self.path(fp) / INFO).exists() else None

    def serve(self, fingerprint: str, why: str) -> dict:
        """Move the pointer to `fingerprint` (a kept version); the history says from when to when each
        version served and why it started."""
        if not (self.path(fingerprint) / INFO).exists():
            raise VersionError(f"version {fingerprint} is not kept in {self.folder}")
        pointer = self.pointer()
        if pointer["serving"] == fingerprint:
            return pointer
        at = now_iso()
        history = [dict(h, to=h.get("to") or at) for h in pointer["history"]]
        history.append({"fingerprint": fingerprint, "from": at, "to": None, "why": why})
        pointer = {"serving": fingerprint, "history": history}
        write_json(self.folder / POINTER, pointer)
        return pointer

    def unservable_baseline(self, fingerprint: str) -> str | None:
        """Why version `fingerprint`'s best baseline cannot serve, when that was found; None otherwise."""
        file = self.folder / UNSERVABLE
        return read_json(file).get(fingerprint) if file.exists() else None

    def mark_unservable_baseline(self, fingerprint: str, why: str) -> None:
        """Record that kept version `fingerprint`'s best baseline cannot serve (versions pruned since are dropped)."""
        file = self.folder / UNSERVABLE
        marks = {**(read_json(file) if file.exists() else {}), fingerprint: why}
        write_json(file, {fp: w for fp, w in marks.items()
                          if FINGERPRINT.fullmatch(fp) and (self.path(fp) / INFO).exists()})

    def served(self) -> set[str]:
        return {h["fingerprint"] for h in self.pointer()["history"]}

    def previous(self) -> str:
        """The version that served before the serving one (what a rollback without --to goes back to)."""
        pointer = self.pointer()
        current = pointer["serving"]
        for h in reversed(pointer["history"]):
            if h["fingerprint"] != current and (self.path(h["fingerprint"]) / INFO).exists():
                return h["fingerprint"]
        if current is None:
            raise VersionError(f"no version serves yet in {self.folder}, so there is none to go back to")
        raise VersionError(f"no version served before {current} among those kept in {self.folder}")

    def prune(self, keep: int, keep_served: bool = True) -> list[str]:
        """Delete all but the newest `keep` versions, never the serving one, nor (with `keep_served`) any
        that ever served. Returns the fingerprints deleted."""
        self._clean_up()
        fps = self.fingerprints()
        spared = set(fps[-keep:] if keep > 0 else []) | {self.pointer()["serving"]}
        if keep_served:
            spared |= self.served()
        gone = [fp for fp in fps if fp not in spared]
        for fp in gone:
            trash = self.folder / f"{_TRASH}{fp}"
            os.replace(self.path(fp), trash)  # out of the listing in one step, then deleted
            fsync(self.folder)
            shutil.rmtree(trash)
        return gone

    def _clean_up(self) -> None:
        """What killed writers left: versions half-deleted, copies half-made (their pid is gone)."""
        if self.folder.is_dir():
            for e in self.folder.iterdir():
                if e.name.startswith(_TRASH):
                    shutil.rmtree(e, ignore_errors=True)
            recover_tree(self.folder)
