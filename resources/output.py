"""Artifacts uploaded after training: `output:` in the project config, an object store or a folder.

    output: s3://bucket/habitus/        (also gs://..., abfs://..., or a mounted folder /mnt/models/habitus)

Each stage uploads what it finished once it has finished (never while it trains), with the
workspace's own layout under the prefix, and a manifest per stage written last:

    <prefix>/checkpoints/foundation/model.safetensors ...   the workspace's paths, as in resources/workspace.py
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

Every remote operation is retried (exponential backoff) before the upload fails. Credentials come from
the store's usual variables (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*); an S3-compatible
endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, or `?endpoint_override=host:port&scheme=http`.
"""

import contextlib
import hashlib
import json
import os
import re
import stat
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import parse_qs, urlsplit

from habitus.models.storage.files import durable_replace, fsync, fsync_tree, is_disk_full
from habitus.resources.manifests import (MANIFESTS, STAGE_NAME, OutputError, checked_manifest, daily_stage, fingerprint,
                                        inside, sha256_of, shown_url, stage_file)

UPLOADS = ".upload."  # temporary keys sit flat under the prefix: moving or deleting
# them never leaves an emptied "folder", for which pyarrow's S3 client would write a marker object
FORMAT = 1
CHUNK = 1 << 20  # bytes per write to the store


class Output:
    """The `output:` location. `url`: s3://, gs://, abfs://, file:// or a local (mounted) folder."""

    def __init__(self, url: str, *, retries: int = 5, backoff_s: float = 0.5, log: Callable[[str], None] = print):
        self.url, self.retries, self.backoff_s, self.log = url, retries, backoff_s, log
        self.shown = shown_url(url)
        self.fs, self.base = _filesystem(url)
        self._local = type(self.fs).__name__ == "LocalFileSystem"

    # ------------------------------------------------------------------ remote primitives, retried

    def _key(self, rel: str) -> str:
        return f"{self.base}/{rel}" if self.base else rel

    def _retry(self, what: str, fn, needed: int | None = None, key: str | None = None):
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
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

    def _mkdir(self, key: str) -> None:
        if self._local:
            self.fs.create_dir(key.rpartition("/")[0], recursive=True)

    def _write_file(self, src: Path, key: str) -> None:
        self._mkdir(key)
        with open(src, "rb") as f, self.fs.open_output_stream(key) as out:
            while block := f.read(CHUNK):
                out.write(block)

    def _write_bytes(self, data: bytes, key: str) -> None:
        self._mkdir(key)
        with self.fs.open_output_stream(key) as out:
            out.write(data)

    def _size(self, key: str) -> int | None:
        from pyarrow.fs import FileType

        info = self.fs.get_file_info(key)
        return info.size if info.type == FileType.File else None

    def _read_json(self, rel: str) -> dict | None:
        key = self._key(rel)

        def read():
            if self._size(key) is None:
                return None
            with self.fs.open_input_stream(key) as f:
                return f.read()

        data = self._retry(f"reading {key}", read)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as e:
            raise OutputError(f"output {self.shown}: {key} is not valid JSON ({e}); delete it and upload again") from None

    def _tmp_prefix(self, stage: str) -> str:
        return f"{UPLOADS}{stage.replace('/', '+')}."

    def _put_atomic(self, write, rel: str, token: str, stage: str, size: int | None = None) -> None:
        """`write(key)` to a temporary key, then move it to `rel` (a rename on a folder, a copy on a store).
        `size`: the bytes it takes, named when the disk of a folder output fills up."""
        self._n = getattr(self, "_n", 0) + 1
        tmp, final = self._key(f"{self._tmp_prefix(stage)}{token}.{self._n}"), self._key(rel)
        try:
            self._retry(f"uploading {final}", lambda: write(tmp), needed=size, key=final)
        except OutputError:
            try:  # a partial temporary copy is never left behind (the next upload would remove it too)
                if self._size(tmp) is not None:
                    self.fs.delete_file(tmp)
            except OSError:
                pass
            raise
        self._mkdir(final)
        def move():
            # a folder: write -> fsync -> rename -> fsync(folder), a commit that outlives a power cut (as
            # models/storage/files.py durable_replace); a store's copy is durable once it returns
            if self._local:
                fsync_tree(tmp)
            self.fs.move(tmp, final)
            if self._local:
                fsync(final.rpartition("/")[0] or "/")

        self._retry(f"moving {tmp} to {final}", move, key=final)

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
        rels = sorted({Path(f).resolve().relative_to(root.resolve()).as_posix() for f in files})
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
            path = root / rel
            st = path.stat()
            prev = had.get(rel)
            # the file as it was when the manifest was committed (size and mtime): no need to hash it again
            if prev and prev.get("size") == st.st_size and prev.get("mtime_ns") == st.st_mtime_ns:
                sha = prev["sha256"]
            else:
                sha = sha256_of(path)
            entry = {"size": st.st_size, "sha256": sha, "mtime_ns": st.st_mtime_ns}
            if prev and prev.get("size") == st.st_size and prev.get("sha256") == sha \
                    and self._retry(f"checking {self._key(rel)}", lambda: self._size(self._key(rel))) == st.st_size:
                entries[rel] = {**prev, **entry}
                skipped += 1
                continue
            self._put_atomic(lambda key, p=path: self._write_file(p, key), rel, token, stage, size=st.st_size)
            got = self._retry(f"checking {self._key(rel)}", lambda: self._size(self._key(rel)))
            if got != st.st_size:
                raise OutputError(f"output {self.shown}: {self._key(rel)} holds {got} bytes after its upload, the "
                                  f"local file {path} {st.st_size}; upload again")
            entries[rel] = {**entry, "uploaded_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
            uploaded += 1
            sent += st.st_size
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
        must carry the pinned fingerprint: a checkpoint stage without a pin is refused then. Each unit of the stage (a
        checkpoint folder, a cache version, a plot) is built under a temporary name beside it, every file's
        size and SHA-256 checked, and swapped in whole, holding `lock(stage)` (the stage's workspace lock)
        meanwhile. A file already there with the same size and SHA-256 is linked, not downloaded. Returns
        {stage: manifest}."""
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
        done = {}
        for stage, (manifest, units) in checked.items():
            with lock(stage) if lock is not None else contextlib.nullcontext():
                fetched = sum(self._restore_unit(root, unit, entries, keep=daily_stage(stage))
                              for unit, entries in sorted(units.items()))
            self.log(f"output {self.shown}: {stage}: {fetched} file(s) restored, "
                     f"{len(manifest['files']) - fetched} already in {root}")
            done[stage] = manifest
        return done

    def _restore_unit(self, root: Path, unit: str, entries: dict[str, dict], keep: bool) -> int:
        """Bring one unit (`root/unit`, a file or a folder) to what `entries` name, swapped in whole; `keep`:
        files of the folder the manifest does not name stay (daily files). Returns the files downloaded."""
        from habitus.models.storage.files import atomic_path

        dest = inside(root, root / unit)
        local = _regular_files(dest)
        current = {rel: _same(dest / rel[len(unit) + 1:] if rel != unit else dest, e) for rel, e in entries.items()}
        if all(current.values()) and (keep or set(local) == {rel[len(unit) + 1:] for rel in entries if rel != unit}):
            return 0
        fetched = 0
        with atomic_path(dest) as tmp:
            if unit in entries:  # a single file (a plot)
                self._retry(f"downloading {self._key(unit)}", lambda: self._fetch(unit, tmp, entries[unit]))
                return 1
            tmp.mkdir(parents=True)
            for rel, entry in sorted(entries.items()):
                sub = rel[len(unit) + 1:]
                target = tmp / sub
                target.parent.mkdir(parents=True, exist_ok=True)
                if current[rel]:
                    _link_or_copy(dest / sub, target)
                    continue
                self._retry(f"downloading {self._key(rel)}", lambda r=rel, t=target, e=entry: self._fetch(r, t, e))
                fetched += 1
            if keep:
                named = {rel[len(unit) + 1:] for rel in entries}
                for sub in sorted(set(local) - named):
                    (tmp / sub).parent.mkdir(parents=True, exist_ok=True)
                    _link_or_copy(dest / sub, tmp / sub)
        return fetched

    def _fetch(self, rel: str, dest: Path, entry: dict) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        h = hashlib.sha256()
        try:
            with self.fs.open_input_stream(self._key(rel)) as src, open(tmp, "wb") as out:
                while block := src.read(CHUNK):
                    h.update(block)
                    out.write(block)
            size = tmp.stat().st_size
            if size != entry["size"] or h.hexdigest() != entry["sha256"]:
                raise OutputError(f"output {self.shown}: {self._key(rel)} is {size} bytes with SHA-256 "
                                  f"{h.hexdigest()[:16]}…, its manifest says {entry['size']} bytes, "
                                  f"{entry['sha256'][:16]}…: an upload of it did not finish; upload that stage again")
            durable_replace(tmp, dest)  # a power cut never leaves a restored file half there under its name
        finally:
            if tmp.exists():
                tmp.unlink()


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
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == entry["size"] and sha256_of(path) == entry["sha256"]


def _link_or_copy(src: Path, dst: Path) -> None:
    """A file kept from the previous version into the folder being built: a hard link (the old file is
    never written again, only replaced), a copy where links are not possible."""
    import shutil

    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _filesystem(url: str):
    """(pyarrow FileSystem, base path without a trailing '/') for an output URL or folder."""
    from pyarrow import fs as pafs

    if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", url):
        if not os.path.isabs(url):
            raise OutputError(f"output {shown_url(url)!r}: a folder must be an absolute path (the project loader resolves "
                              f"relative ones against the config file)")
        return pafs.LocalFileSystem(), url.rstrip("/") or "/"
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise OutputError(f"output {shown_url(url)!r}: credentials in the URL are not read (and would be logged); "
                          f"give them as the store's variables (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)")
    if parts.scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise OutputError(f"output {shown_url(url)!r}: name a bucket, s3://bucket/prefix/")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        endpoint = query.get("endpoint_override") or os.environ.get("AWS_ENDPOINT_URL_S3") or \
            os.environ.get("AWS_ENDPOINT_URL")
        region = query.get("region") or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region is None and not endpoint:  # AWS itself: the bucket's own region (one request)
            try:
                region = pafs.resolve_s3_region(parts.netloc)
            except (OSError, ValueError):
                region = None
        kw = {"region": region or "us-east-1", "connect_timeout": 10, "request_timeout": 60,
              "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3)}
        if endpoint:
            scheme, _, host = endpoint.rpartition("://")
            kw.update(endpoint_override=host.rstrip("/"), scheme=query.get("scheme") or scheme or "https")
        return pafs.S3FileSystem(**kw), f"{parts.netloc}/{parts.path.strip('/')}".rstrip("/")
    try:
        filesystem, path = pafs.FileSystem.from_uri(url)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise OutputError(f"output {shown_url(url)!r}: pyarrow cannot open it ({e}); use s3://, gs://, abfs:// or a folder") from None
    return filesystem, path.rstrip("/")
