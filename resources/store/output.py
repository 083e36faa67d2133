"""Artifacts uploaded after training: `output:` in the project config, an object store or a folder.

    output: s3://bucket/habitus/        (also gs://..., abfs://..., or a mounted folder /mnt/models/habitus)

Each stage uploads what it finished once it has finished (never while it trains), with the
workspace's own layout under the prefix, and a manifest per stage written last:

    <prefix>/checkpoints/foundation/model.safetensors ...   the workspace's paths, as in resources/store/workspace.py
    <prefix>/cache/<fingerprint16>/...                      the cache version the foundation was trained on
    <prefix>/manifests/<stage>.json                         {"files": {path: {size, sha256, ...}}, ...}
    <prefix>/.upload.<stage>.<token>.<n>                    a file being uploaded (temporary)

A file goes to a temporary key first and is moved to its real key once all of it arrived (its size
checked); the stage's manifest is then rewritten to name it. A file counts as uploaded only when the
manifest names it with its size and SHA-256, so what a killed upload left (a temporary key, or a real
key the manifest does not vouch for yet) is never taken for a finished upload; the next upload of the
stage removes the temporary keys and sends again what the manifest does not name as it is locally. A
file the manifest names with the same size and SHA-256 is never sent twice. `restore` reads the
manifests and brings every file back onto a local workspace, checking each one's size and SHA-256.

Nothing read back from the store is trusted: whoever can write to the bucket can write a manifest. Every
manifest entry must be a plain relative path (no `..`, no absolute path, no backslash, no empty, dot or
non-ASCII component) inside the folders its stage owns (`stage_units`), and stays inside the workspace once
resolved (a symlink planted in the workspace is refused, never followed); `cache_folder` must be a cache
fingerprint. Restore builds each of the stage's folders under a temporary name, under the stage's lock, and
swaps it in whole (models/storage/files.py atomic_path): a restore killed halfway leaves the previous
checkpoint as it was. Upload deletes only keys of its own previous manifest that pass the same checks. With
pins (the project's `output_pins:`), restore takes only a stage whose manifest fingerprint (`fingerprint`:
SHA-256 over its file list and their SHA-256) is the pinned one.

A folder as `output:` (local or mounted) is not trusted as a filesystem either: resources/store/stores.py
opens every folder below its root without following a link and refuses a link met anywhere, naming it, so
no upload, restore or clean-up writes, reads or deletes through a link planted there. Upload hashes every
file it sends from the bytes it sends (never trusting the store's manifest for a hash) and checks the
key's size after the move. Restore checks the free space first (the training preflight's check,
resources/store/space.py `ensure_space`), reads at most a file's declared size plus one byte (a longer
object is refused there), resumes a download cut by a store error where it stopped, and links rather than
downloads a file whose bytes it already verified (another unit or stage with the same SHA-256). A
manifest larger than 64 MB, nested deeper than 16 levels or holding an integer of more than 20 digits is
refused with an OutputError naming it (resources/store/manifests.py `parsed_manifest`).

Every remote operation is retried (exponential backoff) before the upload fails. Credentials come from
the store's usual variables (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*); an S3-compatible
endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, or `?endpoint_override=host:port&scheme=http`.
"""

import contextlib
import hashlib
import json
import os
import stat
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable

from habitus.models.storage.files import durable_replace, is_disk_full
from habitus.resources.store.redaction import redact_url
from habitus.resources.store.space import ensure_space
from habitus.resources.store.stores import open_regular, open_store
from habitus.resources.store.manifests import (MANIFESTS, MAX_MANIFEST_BYTES, STAGE_NAME, OutputError, checked_manifest,
                                        daily_stage, fingerprint, inside, parsed_manifest, sha256_of,
                                        stage_file, too_large)

UPLOADS = ".upload."  # temporary keys sit flat under the prefix: moving or deleting
# them never leaves an emptied "folder", for which pyarrow's S3 client would write a marker object
FORMAT = 1
CHUNK = 1 << 20  # bytes per write to the store


class Output:
    """The `output:` location. `url`: s3://, gs://, abfs://, file:// or a local (mounted) folder."""

    def __init__(self, url: str, *, retries: int = 5, backoff_s: float = 0.5, log: Callable[[str], None] = print):
        self.url, self.retries, self.backoff_s, self.log = url, retries, backoff_s, log
        self.shown = redact_url(url)
        self.fs, self.base = open_store(url)

    # ------------------------------------------------------------------ remote primitives, retried

    def _key(self, rel: str) -> str:
        return f"{self.base}/{rel}" if self.base else rel

    def _retry(self, what: str, fn, needed: int | None = None, key: str | None = None):
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except OutputError:  # a link, a size or hash that differs: the same on every attempt
                raise
            except (OSError, RuntimeError) as e:  # pyarrow raises OSError for network/store errors
                if is_disk_full(e):  # a full disk (a mounted folder as output) stays full: no retry
                    raise OutputError(self._full(what, key, needed)) from e
                if attempt == self.retries:
                    raise OutputError(f"output {self.shown}: {what} failed after {attempt} attempts: {e}") from e
                self.log(f"output {self.shown}: {what} failed ({type(e).__name__}: {str(e)[:200]}); retrying in "
                         f"{delay:.1f}s (attempt {attempt + 1} of {self.retries})")
                time.sleep(delay)
                delay *= 2

    def _full(self, what: str, key: str | None, needed: int | None) -> str:
        import shutil

        folder = (key or self.base).rpartition("/")[0] or self.base
        try:
            free = f"{shutil.disk_usage(folder).free / 1e6:,.1f} MB free"
        except OSError:
            free = "free space unknown"
        want = f"; it needs {needed / 1e6:,.1f} MB (+20% headroom)" if needed is not None else ""
        return (f"output {self.shown}: {what} failed: the disk holding {folder} is full ({free}{want}). Nothing "
                f"was committed: the stage's manifest still names its previous files, the partial copy was "
                f"removed. Free space there and run the stage again: files already uploaded are not sent twice")

    def _write_file(self, src: Path, key: str) -> tuple[str, int]:
        """Send the workspace file `src` (opened without following a link) to `key`; (SHA-256, size) of the
        bytes sent."""
        h, n = hashlib.sha256(), 0
        with open_regular(src) as f, self.fs.open_output_stream(key) as out:
            while block := f.read(CHUNK):
                out.write(block)
                h.update(block)
                n += len(block)
        return h.hexdigest(), n

    def _write_bytes(self, data: bytes, key: str) -> None:
        with self.fs.open_output_stream(key) as out:
            out.write(data)

    def _size(self, key: str) -> int | None:
        from pyarrow.fs import FileType

        info = self.fs.get_file_info(key)
        return info.size if info.type == FileType.File else None

    def _read_json(self, rel: str) -> dict | None:
        """The manifest at `rel`, parsed within resources/store/manifests.py's limits; None when there is none."""
        key = self._key(rel)

        def read():
            size = self._size(key)
            if size is None:
                return None
            if size > MAX_MANIFEST_BYTES:
                raise too_large(f"output {self.shown}: {key}")
            with self.fs.open_input_stream(key) as f:
                return f.read(MAX_MANIFEST_BYTES + 1)  # never more than the limit, whatever the store says

        data = self._retry(f"reading {key}", read)
        return None if data is None else parsed_manifest(data, f"output {self.shown}: {key}")

    def _tmp_prefix(self, stage: str) -> str:
        return f"{UPLOADS}{stage.replace('/', '+')}."

    def _put_atomic(self, write, rel: str, token: str, stage: str, size: int | None = None):
        """`write(key)` to a temporary key, then move it to `rel` (a rename on a folder, durable as
        models/storage/files.py durable_replace; a copy on a store, durable once it returns). `size`: the
        bytes it takes, named when the disk of a folder output fills up. Returns what `write` returned."""
        self._n = getattr(self, "_n", 0) + 1
        tmp, final = self._key(f"{self._tmp_prefix(stage)}{token}.{self._n}"), self._key(rel)
        try:
            wrote = self._retry(f"uploading {final}", lambda: write(tmp), needed=size, key=final)
        except OutputError:
            try:  # a partial temporary copy is never left behind (the next upload would remove it too)
                if self._size(tmp) is not None:
                    self.fs.delete_file(tmp)
            except (OSError, OutputError):
                pass
            raise
        self._retry(f"moving {tmp} to {final}", lambda: self.fs.move(tmp, final), key=final)
        return wrote

    def _clear_uploads(self, stage: str) -> int:
        """Remove the temporary keys a killed upload of `stage` left; returns how many there were."""
        from pyarrow.fs import FileSelector, FileType

        infos = self._retry(f"listing {self.shown}", lambda: self.fs.get_file_info(
            FileSelector(self.base, recursive=False, allow_not_found=True)))
        mine = self._key(self._tmp_prefix(stage))
        files = [i.path for i in infos if i.type == FileType.File and i.path.startswith(mine)]
        for path in files:
            self._retry(f"deleting {path}", lambda p=path: self.fs.delete_file(p))
        return len(files)

    # ------------------------------------------------------------------ upload and restore

    def manifest(self, stage: str) -> dict | None:
        """The committed manifest of `stage`, or None when it was never uploaded."""
        return self._read_json(stage_file(stage))

    def stages(self) -> list[str]:
        from pyarrow.fs import FileSelector, FileType

        folder = self._key(MANIFESTS)
        infos = self._retry(f"listing {folder}", lambda: self.fs.get_file_info(
            FileSelector(folder, recursive=True, allow_not_found=True)))
        names = [i.path[len(folder) + 1:] for i in infos if i.type == FileType.File and i.path.endswith(".json")]
        return sorted(n for n in (n.removesuffix(".json") for n in names) if STAGE_NAME.fullmatch(n))

    def upload(self, stage: str, root: Path, files: Iterable[Path], *, replace: bool = True,
               extra: dict | None = None) -> dict:
        """Upload `files` (under the workspace `root`) as `stage`, then commit its manifest.

        `replace`: the files are the whole stage (a checkpoint): entries of files no longer among them
        leave the manifest and their keys are deleted after the commit. Otherwise (daily predictions)
        earlier entries stay. Returns {uploaded, skipped, bytes, removed, cleaned}."""
        root = Path(root)
        rels = sorted({_relative(root, Path(f)) for f in files})
        old = self.manifest(stage)
        if old is not None:  # its entries are deleted below: each must be a key this stage wrote
            checked_manifest(old, stage, f"output {self.shown}: {self._key(stage_file(stage))}")
        had = (old or {}).get("files", {})
        cleaned = self._clear_uploads(stage)
        if cleaned:
            self.log(f"output {self.shown}: removed {cleaned} temporary key(s) of an upload of {stage} that did not finish")
        token = f"{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        entries, uploaded, skipped, sent = ({} if replace else dict(had)), 0, 0, 0
        for rel in rels:
            path = inside(root, root / rel)  # read through no link between the workspace and the file
            with open_regular(path) as f:  # hashed every time: the store's manifest never vouches for it
                sha, size = _hash(f)
            prev, key = had.get(rel), self._key(rel)
            entry = {"size": size, "sha256": sha}
            if prev and prev.get("size") == size and prev.get("sha256") == sha \
                    and self._retry(f"checking {key}", lambda: self._size(key)) == size:
                entries[rel] = {**{k: v for k, v in prev.items() if k != "mtime_ns"}, **entry}
                skipped += 1
                continue
            wrote = self._put_atomic(lambda k, p=path: self._write_file(p, k), rel, token, stage, size=size)
            if wrote != (sha, size):
                raise OutputError(f"output {self.shown}: {path} changed while it was uploaded to {key} (it is written "
                                  f"by another run?); nothing was committed: upload the stage again once it is done")
            got = self._retry(f"checking {key}", lambda: self._size(key))
            if got != size:
                raise OutputError(f"output {self.shown}: {key} holds {got} bytes after its upload, the "
                                  f"local file {path} {size}; upload again")
            entries[rel] = {**entry, "uploaded_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            uploaded += 1
            sent += size
        manifest = {"format": FORMAT, "stage": stage, "committed_at": datetime.now(timezone.utc).isoformat(),
                    **(extra or {}), "files": entries}
        checked_manifest(manifest, stage, f"upload of {stage}")  # a file outside the stage's units is a bug here
        manifest["fingerprint"] = fingerprint(manifest)
        body = json.dumps(manifest, indent=2, sort_keys=True).encode()
        self._put_atomic(lambda key: self._write_bytes(body, key), stage_file(stage), token, stage, size=len(body))
        removed = [rel for rel in had if rel not in entries]
        for rel in removed:  # after the commit: the manifest no longer names them
            key = self._key(rel)
            self._retry(f"deleting {key}", lambda k=key: self.fs.delete_file(k) if self._size(k) is not None else None)
        self._clear_uploads(stage)
        self.log(f"output {self.shown}: {stage}: {uploaded} file(s) uploaded ({sent / 1e6:.1f} MB), {skipped} already "
                 f"there" + (f", {len(removed)} removed" if removed else "") + f"; fingerprint {manifest['fingerprint']}")
        return {"uploaded": uploaded, "skipped": skipped, "bytes": sent, "removed": len(removed), "cleaned": cleaned}

    def restore(self, root: Path, stages: Iterable[str] | None = None, *, pins: dict[str, str] | None = None,
                lock: Callable[[str], contextlib.AbstractContextManager] | None = None) -> dict:
        """Download every file the manifests of `stages` (default: all) name into the workspace `root`.
        Each manifest is checked first (`checked_manifest`, `inside`) and, with `pins` ({stage: fingerprint}),
        must carry the pinned fingerprint: a checkpoint stage without a pin is refused then. The workspace's
        free space is checked next (resources/store/space.py `ensure_space`: what is not already there, +20%).
        Each unit of the stage (a checkpoint folder, a cache version, a plot) is built under a temporary name
        beside it, every file's size and SHA-256 checked, and swapped in whole, holding `lock(stage)` (the
        stage's workspace lock) meanwhile. A file already there, or already verified by this restore, with
        the same size and SHA-256 is linked, not downloaded. Returns {stage: manifest}."""
        root = Path(root)
        chosen = list(stages) if stages is not None else self.stages()
        if not chosen:
            raise OutputError(f"output {self.shown}: no manifests under {self._key(MANIFESTS)}; nothing was uploaded "
                              f"there yet (train with this `output:` first)")
        checked = {}
        for stage in chosen:  # every manifest checked before anything is written
            manifest = self.manifest(stage)
            where = f"output {self.shown}: {self._key(stage_file(stage))}"
            if manifest is None:
                raise OutputError(f"output {self.shown}: stage {stage!r} has no manifest ({self._key(stage_file(stage))}); "
                                  f"uploaded stages: {self.stages()}")
            units = checked_manifest(manifest, stage, where)
            if pins and not daily_stage(stage):  # checkpoints are pinned; daily files are data, not models
                got = fingerprint(manifest)
                if stage not in pins:
                    raise OutputError(f"{where}: the stage {stage!r} has no pin in `output_pins:`; with pins set, "
                                      f"restore takes pinned stages only (pinned: {sorted(pins)})")
                if got != pins[stage]:
                    raise OutputError(f"{where}: fingerprint {got} is not the pinned {pins[stage]}; the store "
                                      f"holds another version than the one pinned in `output_pins:` (its upload "
                                      f"logged the fingerprint): nothing was restored")
            for unit in units:
                inside(root, root / unit)
            checked[stage] = (manifest, units)
        needed = sum(e["size"] for _, units in checked.values() for entries in units.values()
                     for rel, e in entries.items() if _size_of(root / rel) != e["size"])
        ensure_space(root, needed, f"restoring {', '.join(checked)} from {self.shown}")
        done, verified = {}, {}
        for stage, (manifest, units) in checked.items():
            with lock(stage) if lock is not None else contextlib.nullcontext():
                fetched = sum(self._restore_unit(root, unit, entries, daily_stage(stage), verified)
                              for unit, entries in sorted(units.items()))
            self.log(f"output {self.shown}: {stage}: {fetched} file(s) downloaded, "
                     f"{len(manifest['files']) - fetched} already in {root} or linked from a verified copy")
            done[stage] = manifest
        return done

    def _restore_unit(self, root: Path, unit: str, entries: dict[str, dict], keep: bool,
                      verified: dict[str, Path]) -> int:
        """Bring one unit (`root/unit`, a file or a folder) to what `entries` name, swapped in whole; `keep`:
        files of the folder the manifest does not name stay (daily files). `verified`: {SHA-256: a file of
        this restore with those bytes}, updated. Returns the files downloaded."""
        from habitus.models.storage.files import atomic_path

        dest = inside(root, root / unit)
        local = _regular_files(dest)
        current = {rel: _same(dest / rel[len(unit) + 1:] if rel != unit else dest, e) for rel, e in entries.items()}
        fetched = 0
        if not (all(current.values()) and (keep or set(local) == {rel[len(unit) + 1:] for rel in entries
                                                                   if rel != unit})):
            with atomic_path(dest) as tmp:
                if unit in entries:  # a single file (a plot)
                    fetched = self._bring(unit, tmp, entries[unit], verified)
                else:
                    tmp.mkdir(parents=True)
                    for rel, entry in sorted(entries.items()):
                        sub = rel[len(unit) + 1:]
                        target = tmp / sub
                        target.parent.mkdir(parents=True, exist_ok=True)
                        if current[rel]:
                            _link_or_copy(dest / sub, target)
                        else:
                            fetched += self._bring(rel, target, entry, verified)
                    if keep:
                        named = {rel[len(unit) + 1:] for rel in entries}
                        for sub in sorted(set(local) - named):
                            (tmp / sub).parent.mkdir(parents=True, exist_ok=True)
                            _link_or_copy(dest / sub, tmp / sub)
        verified.update({e["sha256"]: root / rel for rel, e in entries.items()})  # where they are now
        return fetched

    def _bring(self, rel: str, target: Path, entry: dict, verified: dict[str, Path]) -> int:
        """`target` with the bytes of `entry`: linked from a file this restore already verified, or downloaded
        (1)."""
        copy = verified.get(entry["sha256"])
        if copy is not None and _size_of(copy) == entry["size"]:
            _link_or_copy(copy, target)
            return 0
        self._fetch(rel, target, entry)
        verified[entry["sha256"]] = target
        return 1

    def _fetch(self, rel: str, dest: Path, entry: dict) -> None:
        """Download `rel` to `dest`, retried; a retry goes on from the last byte received. At most the declared
        size plus one byte is read: a longer object is refused there, a shorter one or other bytes at the end."""
        key, size = self._key(rel), entry["size"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        h, got = hashlib.sha256(), [0]
        try:
            with open(tmp, "wb") as out:
                def attempt():
                    out.seek(got[0])
                    out.truncate()
                    with self.fs.open_input_file(key) as src:
                        if got[0]:
                            src.seek(got[0])
                        while block := src.read(min(CHUNK, size - got[0] + 1)):
                            if got[0] + len(block) > size:
                                raise OutputError(f"output {self.shown}: {key} holds more than the {size} bytes its "
                                                  f"manifest declares (refused after {got[0] + len(block)} bytes read); "
                                                  f"check who can write to the store and upload that stage again")
                            out.write(block)
                            h.update(block)
                            got[0] += len(block)

                self._retry(f"downloading {key}", attempt)
            if got[0] != size or h.hexdigest() != entry["sha256"]:
                raise OutputError(f"output {self.shown}: {key} is {got[0]} bytes with SHA-256 "
                                  f"{h.hexdigest()[:16]}…, its manifest says {size} bytes, "
                                  f"{entry['sha256'][:16]}…: an upload of it did not finish; upload that stage again")
            durable_replace(tmp, dest)  # a power cut never leaves a restored file half there under its name
        finally:
            if tmp.exists():
                tmp.unlink()


def _relative(root: Path, path: Path) -> str:
    """`path` relative to the workspace `root`, as a key ('checkpoints/foundation/config.json')."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel.startswith("..") or os.path.isabs(rel):
        raise OutputError(f"{path} is not inside the workspace {root}; only workspace files are uploaded")
    return Path(rel).as_posix()


def _hash(f) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    while block := f.read(CHUNK):
        h.update(block)
        n += len(block)
    return h.hexdigest(), n


def _size_of(path: Path) -> int | None:
    """The size of the regular file (not a link) at `path`, or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _regular_files(folder: Path) -> list[str]:
    """Paths (relative to `folder`) of the regular, visible files under it; symlinks are neither followed
    nor listed (a link planted there is dropped by the swap, never read)."""
    if folder.is_symlink() or not folder.is_dir():
        return []
    found = []
    for at, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not os.path.islink(os.path.join(at, d))]
        found += [os.path.relpath(os.path.join(at, n), folder) for n in names if not n.startswith(".")
                  and stat.S_ISREG(os.lstat(os.path.join(at, n)).st_mode)]
    return sorted(found)


def _same(path: Path, entry: dict) -> bool:
    """Whether `path` is a regular file (not a link) with the entry's size and SHA-256."""
    return _size_of(path) == entry["size"] and sha256_of(path) == entry["sha256"]


def _link_or_copy(src: Path, dst: Path) -> None:
    """A file kept from the previous version into the folder being built: a hard link (the old file is
    never written again, only replaced), a copy where links are not possible."""
    import shutil

    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
