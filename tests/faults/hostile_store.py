"""Hostile manifests for `restore` and `upload` (resources/output.py), on any pyarrow filesystem: a local
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

    from habitus.resources.output import Output, OutputError
    from habitus.resources.workspace import Workspace

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
