"""habitus.models.storage.files: files and folders appear whole, and what a killed writer left is cleaned up or put
back, never what a running writer is still writing."""

import subprocess
import sys

import pytest

import habitus.models.storage.files as storage
from habitus.models.storage.files import atomic_path, recover, recover_tree, write_json


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_folder_is_replaced_whole(tmp_path):
    target = tmp_path / "ckpt"
    for version in ("old", "new"):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "a.txt").write_text(version)
            (tmp / version).write_text("")
            assert not (target / version).exists()  # not visible before the rename
    assert sorted(p.name for p in target.iterdir()) == ["a.txt", "new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the old one went, no temporary left


def test_a_failed_write_leaves_the_previous_version(tmp_path):
    write_json(tmp_path / "m.json", {"v": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "m.json") as tmp:
            tmp.write_text('{"v": 2, "half')
            raise RuntimeError("killed")
    assert (tmp_path / "m.json").read_text().replace(" ", "").replace("\n", "") == '{"v":1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_leftovers_of_a_dead_writer_are_removed_or_put_back(tmp_path):
    dead = _dead_pid()
    (tmp_path / f".part.parquet.tmp-{dead}").write_text("half")
    old = tmp_path / f".ckpt.old-{dead}"  # moved aside, the new folder never arrived
    old.mkdir()
    (old / "model.safetensors").write_text("weights")
    notes = recover(tmp_path / "ckpt") + recover(tmp_path / "part.parquet")
    assert (tmp_path / "ckpt" / "model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert len(notes) == 2 and any("restored" in n for n in notes)


def test_old_folder_is_dropped_when_the_new_one_arrived(tmp_path):
    dead = _dead_pid()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / f".ckpt.old-{dead}").mkdir()
    recover(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_the_tree_sweep_leaves_running_writers_alone(tmp_path, live_pid):
    dead = _dead_pid()
    nested = tmp_path / "sources" / "purchases"
    nested.mkdir(parents=True)
    (nested / f".2026-03-01.parquet.tmp-{dead}").write_text("half")
    (nested / f".2026-03-01.parquet.unsorted-{dead}").write_text("a sort's spill")
    (nested / f".2026-04-01.parquet.tmp-{live_pid}").write_text("being written")
    (nested / ".2026-03-01.parquet.sha256").write_text("a sidecar, not a leftover")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f".abc.tmp-{dead}").mkdir()
    (tmp_path / "cache" / f".abc.tmp-{dead}" / "shard-00000.arrow").write_text("half")
    notes = recover_tree(tmp_path)
    assert len(notes) == 3
    assert sorted(p.name for p in nested.iterdir()) == [".2026-03-01.parquet.sha256", f".2026-04-01.parquet.tmp-{live_pid}"]
    assert list((tmp_path / "cache").iterdir()) == []


class _Journal:
    """Records fsync and rename calls as (call, path), by resolving each fsync'd descriptor's path."""

    def __init__(self, monkeypatch):
        import os

        self.calls = []
        real_fsync, real_replace, real_exchange = os.fsync, os.replace, storage._exchange

        def fsync(fd):
            self.calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def replace(a, b):
            self.calls.append(("rename", str(a), str(b)))
            real_replace(a, b)

        def exchange(a, b):
            self.calls.append(("rename", str(a), str(b)))
            return real_exchange(a, b)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(storage, "_exchange", exchange)


def test_a_file_is_committed_write_fsync_rename_fsync_folder(tmp_path, monkeypatch):
    journal = _Journal(monkeypatch)
    write_json(tmp_path / "manifest.json", {"a": 1})
    (rename,) = [c for c in journal.calls if c[0] == "rename"]
    at = journal.calls.index(rename)
    tmp = rename[1]
    assert ("fsync", tmp) in journal.calls[:at]  # the bytes before the name
    assert journal.calls[at + 1:] == [("fsync", str(tmp_path))]  # the name before returning


def test_a_folder_is_committed_with_every_file_and_subfolder_flushed_first(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    journal = _Journal(monkeypatch)
    with atomic_path(target) as tmp:  # a second version: replaced by an exchange
        (tmp / "sub").mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(b"w" * 10)
        (tmp / "sub" / "part.arrow").write_bytes(b"p")
    renames = [i for i, c in enumerate(journal.calls) if c[0] == "rename"]
    flushed = {c[1] for c in journal.calls[:renames[0]]}
    assert {str(tmp / "model.safetensors"), str(tmp / "sub" / "part.arrow"), str(tmp / "sub"), str(tmp)} <= flushed
    assert journal.calls[-1] == ("fsync", str(tmp_path))
    assert (target / "model.safetensors").read_bytes() == b"w" * 10


def test_durable_replace_orders_the_same_way(tmp_path, monkeypatch):
    tmp, final = tmp_path / ".part.parquet.tmp-1", tmp_path / "part.parquet"
    tmp.write_bytes(b"rows")
    journal = _Journal(monkeypatch)
    storage.durable_replace(tmp, final)
    assert journal.calls == [("fsync", str(tmp)), ("rename", str(tmp), str(final)), ("fsync", str(tmp_path))]
    assert final.read_bytes() == b"rows"
