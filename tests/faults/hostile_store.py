"""Hostile manifests for `restore` and `upload` (resources/store/output.py), on any pyarrow filesystem: a local
folder here (tests/faults/test_restore_trust.py) and moto S3 (tests/integration/test_output_trust_s3.py,
which loads this file by path).

A `Store` is a pyarrow filesystem, the root everything is snapshotted under (a folder, a bucket) and the
prefix the output uses. Each check plants victims outside the workspace and outside the prefix, writes a
manifest with one hostile entry (or cache folder), and asserts that restore and upload refuse it naming
the entry, with nothing written, read or deleted anywhere: the files outside the workspace and every key
of the store are byte for byte as before, and no file was downloaded."""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

# components that must never reach a path: traversal, empty, dot-named, backslashes, unicode dots and
# slashes (fullwidth, one- and two-dot leaders, division slash), control characters
HOSTILE_PARTS = ["..", ".", "", "\uff0e\uff0e", "\u2024\u2024", "\u2025", "..\\..", "a\\b", "\\", "\u2215",
                 ".hidden", "x\x00", "\n", "..%2f"]
PLAIN_PARTS = ["x", "checkpoints", "foundation", "cache", "victim.txt", "abababababababab"]
FIXED = ["../victim.txt", "../../victim.txt", "../../../victim.txt", "/tmp/victim.txt", "//victim.txt",
         "checkpoints/foundation/../../../victim.txt", "checkpoints\\foundation\\..\\..\\victim.txt",
         "checkpoints/foundation/\uff0e\uff0e/\uff0e\uff0e/victim.txt", "checkpoints//foundation/x",
         "checkpoints/foundation/./x", "checkpoints/foundation/", "checkpoints/foundation/.config.json.tmp-1",
         "checkpoints/scenarios/churn/model.safetensors", "manifests/foundation.json", "locks/foundation.lock",
         "cache/current.json", "cache/../../victim.txt", "victim.txt", "", "checkpoints/foundation"]
HOSTILE_CACHE_FOLDERS = ["../../victim", "..", "/tmp", "abababababababab/..", "ABABABABABABABAB",
                         "\uff10" * 16, "abababababababab/x", "ababababababababab", "", 7]


def hostile_keys():
    """Manifest keys that are not a plain path inside the foundation stage's folders."""
    composed = st.tuples(st.booleans(), st.lists(st.sampled_from(PLAIN_PARTS + HOSTILE_PARTS), min_size=1,
                                                 max_size=5)) \
        .filter(lambda t: t[0] or any(p in HOSTILE_PARTS for p in t[1])) \
        .map(lambda t: ("/" if t[0] else "") + "/".join(t[1]))
    return st.one_of(st.sampled_from(FIXED), composed)


@dataclass
class Store:
    fs: object  # a pyarrow FileSystem
    root: str   # what is snapshotted: a folder, a bucket
    url: str    # the output URL (its prefix is under root)

    def snapshot(self) -> dict[str, bytes]:
        from pyarrow.fs import FileSelector, FileType

        infos = self.fs.get_file_info(FileSelector(self.root, recursive=True, allow_not_found=True))
        out = {}
        for i in infos:
            if i.type == FileType.File:
                with self.fs.open_input_stream(i.path) as f:
                    out[i.path] = f.read()
        return out

    def put(self, key: str, data: bytes) -> None:
        self.fs.create_dir(key.rpartition("/")[0], recursive=True)
        with self.fs.open_output_stream(key) as f:
            f.write(data)


def foundation_workspace(ws: Path) -> Path:
    """A workspace holding a foundation checkpoint, its plot and its cache version (small files)."""
    (ws / "checkpoints" / "foundation").mkdir(parents=True)
    (ws / "checkpoints" / "foundation" / "model.safetensors").write_bytes(os.urandom(4096))
    (ws / "checkpoints" / "foundation" / "config.json").write_text(json.dumps({"cache_fingerprint": "ab" * 32}))
    (ws / "checkpoints" / "foundation_loss.png").write_bytes(b"png")
    (ws / "cache" / ("ab" * 8)).mkdir(parents=True)
    (ws / "cache" / ("ab" * 8) / "manifest.json").write_text("{}")
    return ws


def local_files(folder: Path, skip: Path | None = None) -> dict[str, bytes]:
    """Every file under `folder` (links not followed) except those under `skip`."""
    out = {}
    for at, dirs, names in os.walk(folder):
        for n in names:
            p = Path(at) / n
            if skip is not None and p.is_relative_to(skip):
                continue
            out[str(p)] = p.read_bytes() if not p.is_symlink() else b"link:" + os.readlink(p).encode()
    return out


def tamper(store: Store, prefix_key: str, *, key=None, cache_folder=None, victim: bytes) -> None:
    """Rewrite the foundation's manifest with one hostile entry `key` (vouching for the victim's bytes,
    so a restore that followed it would find the hash right) or a hostile `cache_folder`."""
    manifest_key = f"{prefix_key}/manifests/foundation.json"
    with store.fs.open_input_stream(manifest_key) as f:
        manifest = json.loads(f.read())
    if key is not None:
        manifest["files"][key] = {"size": len(victim), "sha256": hashlib.sha256(victim).hexdigest()}
    if cache_folder is not None:
        manifest["cache_folder"] = cache_folder
    store.put(manifest_key, json.dumps(manifest).encode())


def check_refused(store: Store, prefix_key: str, home: Path, *, key=None, cache_folder=None) -> None:
    """Plant victims, tamper the committed foundation manifest, then restore into a fresh workspace and
    upload from the one that trained: both refused naming the entry, nothing changed anywhere."""
    import pytest

    from habitus.resources.store.output import Output, OutputError
    from habitus.resources.store.workspace import Workspace

    victim = b"victim " + os.urandom(8).hex().encode()
    (home / "victim.txt").write_bytes(victim)
    store.put(f"{store.root}/victim.txt", victim)
    store.put(f"{prefix_key}-other/victim.txt", victim)
    tamper(store, prefix_key, key=key, cache_folder=cache_folder, victim=victim)
    named = repr(key if key is not None else cache_folder)
    before_store, before_home = store.snapshot(), local_files(home)
    fetched = []
    whole = Output._fetch

    def recorded(self, rel, dest, entry):
        fetched.append(rel)
        return whole(self, rel, dest, entry)

    Output._fetch = recorded
    try:
        fresh = home / "fresh"
        with pytest.raises(OutputError) as restore_error:
            Workspace(root=str(fresh), output=store.url).restore(log=lambda _: None)
        assert named in str(restore_error.value), str(restore_error.value)
        with pytest.raises(OutputError) as upload_error:
            Workspace(root=str(home / "ws"), output=store.url).upload_stage("foundation", log=lambda _: None)
        assert named in str(upload_error.value), str(upload_error.value)
    finally:
        Output._fetch = whole
    assert fetched == []  # refused before any file was read from the store
    assert store.snapshot() == before_store  # nothing written or deleted in the store, in or out of the prefix
    assert local_files(home) == before_home  # nor outside (or inside) the workspaces
    assert not (home / "fresh").exists() or local_files(home / "fresh") == {}


class Counted:
    """A filesystem whose reads are counted (`read`: {key: bytes returned to the caller}, `opened`: keys
    opened for reading, in order)."""

    def __init__(self, fs):
        self._fs, self.read, self.opened = fs, {}, []

    def open_input_file(self, key):
        self.opened.append(key)
        return _CountedFile(self, key, self._fs.open_input_file(key))

    def __getattr__(self, name):
        return getattr(self._fs, name)


class _CountedFile:
    def __init__(self, owner, key, f):
        self._owner, self._key, self._f = owner, key, f

    def read(self, n=-1):
        block = self._f.read(n)
        self._owner.read[self._key] = self._owner.read.get(self._key, 0) + len(block)
        return block

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _json(store: Store, key: str) -> dict:
    with store.fs.open_input_stream(key) as f:
        return json.loads(f.read())


def _store_manifest(store: Store, prefix_key: str, manifest: dict) -> None:
    from habitus.resources.store.manifests import fingerprint

    manifest["fingerprint"] = fingerprint(manifest)
    store.put(f"{prefix_key}/manifests/foundation.json", json.dumps(manifest).encode())


def check_tampered_reupload(store: Store, prefix_key: str, home: Path) -> None:
    """Same-size bytes swapped into the store with their hash in the manifest (the local file's size and mtime
    kept there): the next upload hashes the local file, sends it again and logs the genuine fingerprint; a
    restore pinned to it returns the genuine bytes, and refuses the swapped bytes once they come back."""
    import pytest

    from habitus.resources.store.output import OutputError
    from habitus.resources.store.workspace import Workspace

    ws, weights = home / "ws", "checkpoints/foundation/model.safetensors"
    genuine = (ws / weights).read_bytes()
    manifest = _json(store, f"{prefix_key}/manifests/foundation.json")
    pin = manifest["fingerprint"]
    swapped = os.urandom(len(genuine))
    store.put(f"{prefix_key}/{weights}", swapped)
    manifest["files"][weights].update(sha256=hashlib.sha256(swapped).hexdigest(),
                                      mtime_ns=(ws / weights).stat().st_mtime_ns)
    _store_manifest(store, prefix_key, manifest)
    logs = []
    assert Workspace(root=str(ws), output=store.url).upload_stage("foundation", log=logs.append)["uploaded"] == 1
    assert logs[-1].endswith(f"fingerprint {pin}"), logs[-1]
    with store.fs.open_input_stream(f"{prefix_key}/{weights}") as f:
        assert f.read() == genuine
    Workspace(root=str(home / "a"), output=store.url, output_pins={"foundation": pin}).restore(log=lambda _: None)
    assert (home / "a" / weights).read_bytes() == genuine
    store.put(f"{prefix_key}/{weights}", swapped)  # the bytes swapped again, the manifest left as uploaded
    with pytest.raises(OutputError, match=r"model.safetensors is \d+ bytes with SHA-256 .* manifest says"):
        Workspace(root=str(home / "b"), output=store.url, output_pins={"foundation": pin}).restore(log=lambda _: None)
    _store_manifest(store, prefix_key, manifest)  # and their hash in the manifest again
    with pytest.raises(OutputError, match=f"is not the pinned {pin}"):
        Workspace(root=str(home / "b"), output=store.url, output_pins={"foundation": pin}).restore(log=lambda _: None)
    assert not (home / "b" / weights).exists()


def check_lying_size(store: Store, prefix_key: str, home: Path) -> int:
    """An 8 MB object whose manifest entry declares 10 bytes (and the SHA-256 of its first 10): restore
    refuses it after at most the declared size plus one chunk read, nothing left behind. Returns the bytes
    read."""
    import pytest

    from habitus.resources.store.output import CHUNK, Output, OutputError
    from habitus.resources.store.workspace import Workspace

    plot = "checkpoints/foundation_loss.png"
    big = os.urandom(8 << 20)
    store.put(f"{prefix_key}/{plot}", big)
    manifest = _json(store, f"{prefix_key}/manifests/foundation.json")
    manifest["files"][plot] = {"size": 10, "sha256": hashlib.sha256(big[:10]).hexdigest()}
    _store_manifest(store, prefix_key, manifest)
    counted, opened = [], Output.__init__

    def counting(self, *args, **kw):
        opened(self, *args, **kw)
        self.fs = Counted(self.fs)
        counted.append(self.fs)

    Output.__init__ = counting
    try:
        with pytest.raises(OutputError, match=f"{plot} holds more than the 10 bytes its manifest declares"):
            Workspace(root=str(home / "fresh"), output=store.url).restore(log=lambda _: None)
    finally:
        Output.__init__ = opened
    read = sum(fs.read.get(f"{prefix_key}/{plot}", 0) for fs in counted)
    assert sum(fs.opened.count(f"{prefix_key}/{plot}") for fs in counted) == 1  # not retried: the same each time
    assert read <= 10 + CHUNK, read
    assert not (home / "fresh" / plot).exists() and not [p for p in home.rglob(".*") if ".tmp-" in p.name]
    return read
