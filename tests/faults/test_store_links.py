"""A folder `output:` is not trusted as a filesystem (resources/store/stores.py FolderStore): links planted in the
store (folder links, file links, links to /dev/zero, to a copy of the genuine bytes, dangling) under
every operation (upload, re-upload with deletes, restore, listing the stages, reading a manifest): nothing
outside the store or the workspace is written, read or deleted, and the error names the entry."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from habitus.resources.store.output import Output, OutputError
from habitus.resources.store.workspace import Workspace

# entries of a store holding the foundation and scenario/churn that a link may replace
ENTRIES = ["checkpoints", "checkpoints/foundation", "checkpoints/foundation/model.safetensors",
           "checkpoints/foundation_loss.png", "checkpoints/scenarios", "checkpoints/scenarios/churn",
           "checkpoints/scenarios/churn/config.json", "checkpoints/passed/churn", "cache", "cache/abababababababab",
           "manifests", "manifests/foundation.json", "manifests/scenario", "manifests/scenario/churn.json"]
# what the link points to: the genuine bytes copied outside (a restore that followed it would succeed),
# a victim's file or folder, /dev/zero (a read that followed it would never end), nothing
TARGETS = ["copy", "victim", "zero", "dangling"]


def _workspace(ws: Path) -> Path:
    """tests/faults/hostile_store.py's foundation workspace, with a scenario checkpoint and its passed copy."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hostile_store", Path(__file__).with_name("hostile_store.py"))
    hostile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hostile)
    hostile.foundation_workspace(ws)
    for folder in ("scenarios", "passed"):
        (ws / "checkpoints" / folder / "churn").mkdir(parents=True)
        (ws / "checkpoints" / folder / "churn" / "config.json").write_text('{"task": "churn"}')
        (ws / "checkpoints" / folder / "churn" / "model.safetensors").write_bytes(b"w" * 300)
    return ws


def _files(folder: Path) -> dict[str, bytes]:
    """Every entry under `folder`, links not followed (a link as its target's name)."""
    out = {}
    for at, dirs, names in os.walk(folder):
        for n in dirs + names:
            p = Path(at) / n
            if p.is_symlink():
                out[str(p)] = b"link:" + os.readlink(p).encode()
            elif p.is_file():
                out[str(p)] = p.read_bytes()
    return out


def _plant(store: Path, entry: str, target: str, outside: Path) -> Path:
    """Replace `entry` of the store by a link to `target`; returns the link."""
    link = store / entry
    real = link.is_dir()
    copy = outside / "copy" / entry.replace("/", "+")
    if real:
        shutil.copytree(link, copy)
        shutil.rmtree(link)
    else:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(link, copy)
        link.unlink()
    to = {"copy": copy, "victim": outside / "victim" / ("folder" if real else "id_rsa"), "zero": Path("/dev/zero"),
          "dangling": outside / "nothing-here"}[target]
    link.symlink_to(to, target_is_directory=real)
    return link


def _operations(ws: Path, store: Path, fresh: Path):
    """Every operation of the store: (name, call)."""
    def upload(stage):
        return lambda: Workspace(root=str(ws), output=str(store)).upload_stage(stage, log=lambda _: None)

    def restore(stage):
        return lambda: Workspace(root=str(fresh), output=str(store)).restore([stage], log=lambda _: None)

    return [("upload foundation", upload("foundation")), ("upload scenario", upload("scenario/churn")),
            ("restore foundation", restore("foundation")), ("restore scenario", restore("scenario/churn")),
            ("list stages", lambda: Output(str(store), log=lambda _: None).stages())]


def check_links(home: Path, entry: str, target: str) -> None:
    ws, store, outside, fresh = _workspace(home / "ws"), home / "store", home / "outside", home / "fresh"
    for stage in ("foundation", "scenario/churn"):
        Workspace(root=str(ws), output=str(store)).upload_stage(stage, log=lambda _: None)
    genuine = {Path(k).relative_to(ws).as_posix(): v for k, v in _files(ws).items()}
    (outside / "victim" / "folder").mkdir(parents=True)
    (outside / "victim" / "folder" / "id_rsa").write_bytes(b"private key")
    (outside / "victim" / "id_rsa").write_bytes(b"private key")
    # the retrained scenario: its re-upload writes config.json and deletes a file of the previous manifest
    (ws / "checkpoints" / "scenarios" / "churn" / "config.json").write_text('{"task": "churn", "again": 1}')
    (ws / "checkpoints" / "scenarios" / "churn" / "model.safetensors").unlink()
    link = _plant(store, entry, target, outside)
    before_outside, before_ws = _files(outside), _files(ws)
    refused = []
    for name, call in _operations(ws, store, fresh):
        try:
            call()
        except OutputError as e:
            assert f"{link} is a symbolic link" in str(e), f"{name}: {e}"
            refused.append(name)
    assert refused, "no operation met the link"
    assert _files(outside) == before_outside  # nothing outside written, deleted (or, for a copy, replaced)
    assert link.is_symlink()
    assert _files(ws) == before_ws  # the workspace that uploads is only read
    for path, data in _files(fresh).items():  # whatever was restored is uploaded bytes, never a link's
        rel = Path(path).relative_to(fresh).as_posix()
        if rel.startswith(("checkpoints/", "cache/abababababababab/")):
            now = ws / rel  # the first upload's bytes, or the re-uploaded scenario's
            assert not Path(path).is_symlink() and data in (genuine[rel], now.exists() and now.read_bytes()), rel


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entry=st.sampled_from(ENTRIES), target=st.sampled_from(TARGETS))
def test_a_link_planted_in_a_folder_store_is_never_passed_through_and_is_named(entry, target):
    with tempfile.TemporaryDirectory() as tmp:
        check_links(Path(tmp), entry, target)


def test_the_reported_case_a_scenario_folder_linked_to_a_users_folder(tmp_path):
    """`checkpoints/scenarios/churn` linked to the uploading user's ~/.ssh and a manifest naming `id_rsa`
    there: the re-upload neither deletes id_rsa nor writes config.json there; the error names the link."""
    ws, store = _workspace(tmp_path / "ws"), tmp_path / "store"
    Workspace(root=str(ws), output=str(store)).upload_stage("scenario/churn", log=lambda _: None)
    ssh = tmp_path / "home" / ".ssh"
    ssh.mkdir(parents=True)
    (ssh / "id_rsa").write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    shutil.rmtree(store / "checkpoints" / "scenarios" / "churn")
    (store / "checkpoints" / "scenarios" / "churn").symlink_to(ssh, target_is_directory=True)
    manifest = json.loads((store / "manifests" / "scenario" / "churn.json").read_text())
    manifest["files"]["checkpoints/scenarios/churn/id_rsa"] = manifest["files"].pop(
        "checkpoints/scenarios/churn/model.safetensors")
    (store / "manifests" / "scenario" / "churn.json").write_text(json.dumps(manifest))
    with pytest.raises(OutputError, match=f"{store}/checkpoints/scenarios/churn is a symbolic link"):
        Workspace(root=str(ws), output=str(store)).upload_stage("scenario/churn", log=lambda _: None)
    assert sorted(os.listdir(ssh)) == ["id_rsa"] and (ssh / "id_rsa").read_bytes().startswith(b"-----BEGIN")


def test_a_link_among_the_temporary_keys_is_neither_followed_nor_deleted(tmp_path):
    ws, store = _workspace(tmp_path / "ws"), tmp_path / "store"
    Workspace(root=str(ws), output=str(store)).upload_stage("foundation", log=lambda _: None)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    planted = store / ".upload.foundation.20260101T000000-deadbeef.1"
    planted.symlink_to(victim)
    (ws / "checkpoints" / "foundation_loss.png").write_bytes(b"png2")
    assert Workspace(root=str(ws), output=str(store)).upload_stage("foundation", log=lambda _: None)["uploaded"] == 1
    assert planted.is_symlink() and victim.read_bytes() == b"mine"


def test_a_fifo_or_a_root_swapped_for_a_link_is_refused(tmp_path):
    ws, store = _workspace(tmp_path / "ws"), tmp_path / "store"
    Workspace(root=str(ws), output=str(store)).upload_stage("foundation", log=lambda _: None)
    weights = store / "checkpoints" / "foundation" / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)  # opening it for reading would block forever
    with pytest.raises(OutputError, match=f"{weights} is not a regular file"):
        Workspace(root=str(tmp_path / "fresh"), output=str(store)).restore(["foundation"], log=lambda _: None)
    out = Output(str(store), log=lambda _: None)  # the root resolved when the output was opened
    store.rename(tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    store.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(OutputError, match=f"{store} is a symbolic link"):
        out.stages()
    assert os.listdir(tmp_path / "elsewhere") == []


def test_links_in_the_configured_path_itself_are_the_users_layout(tmp_path):
    """`output: /mnt/models` with /mnt/models -> /data/models: the configured path is resolved once."""
    ws, real = _workspace(tmp_path / "ws"), tmp_path / "data" / "models"
    real.mkdir(parents=True)
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "models").symlink_to(real, target_is_directory=True)
    Workspace(root=str(ws), output=str(tmp_path / "mnt" / "models")).upload_stage("foundation", log=lambda _: None)
    assert (real / "manifests" / "foundation.json").is_file()
    done = Workspace(root=str(tmp_path / "fresh"), output=str(tmp_path / "mnt" / "models")).restore(
        log=lambda _: None)
    assert list(done) == ["foundation"]


def test_a_link_in_a_mounted_folder_store_is_refused_too(tmp_path):
    """The same refusal on a mounted filesystem (a tmpfs here, as an NFS or SMB share would be)."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): needs root and mount")
    try:
        (tmp_path / "home").mkdir()
        ws = _workspace(tmp_path / "home" / "ws")
        Workspace(root=str(ws), output=str(mount / "habitus")).upload_stage("scenario/churn", log=lambda _: None)
        victim = tmp_path / "home" / "victim"
        victim.mkdir()
        shutil.rmtree(mount / "habitus" / "checkpoints" / "passed" / "churn")
        (mount / "habitus" / "checkpoints" / "passed" / "churn").symlink_to(victim, target_is_directory=True)
        (ws / "checkpoints" / "passed" / "churn" / "config.json").write_text("{}")
        with pytest.raises(OutputError, match=f"{mount}/habitus/checkpoints/passed/churn is a symbolic link"):
            Workspace(root=str(ws), output=str(mount / "habitus")).upload_stage("scenario/churn", log=lambda _: None)
        assert os.listdir(victim) == []
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_upload_reads_no_file_through_a_link_in_the_workspace(tmp_path):
    ws, store = _workspace(tmp_path / "ws"), tmp_path / "store"
    secret = tmp_path / "outside" / "id_rsa"
    secret.parent.mkdir()
    secret.write_bytes(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    weights = ws / "checkpoints" / "foundation" / "model.safetensors"
    weights.unlink()
    weights.symlink_to(secret)
    with pytest.raises(OutputError, match=f"{weights} is a symbolic link"):
        Workspace(root=str(ws), output=str(store)).upload_stage("foundation", log=lambda _: None)
    assert not any(b"PRIVATE KEY" in data for data in _files(store).values())
