"""Nothing read back from `output:` is trusted (resources/store/output.py): hostile manifest entries and cache
folders (hypothesis), symlinks planted in the workspace, pinned fingerprints, and the output URL's
credentials kept out of logs, on a local folder as output. tests/integration/test_output_trust_s3.py
runs the same hostile manifests against moto S3."""

import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyarrow.fs import LocalFileSystem

from habitus.resources.store.output import Output, OutputError, fingerprint
from habitus.resources.store.redaction import redact_url
from habitus.resources.store.workspace import Workspace


def _helpers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hostile_store", Path(__file__).with_name("hostile_store.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_h = _helpers()
HOSTILE_CACHE_FOLDERS, Store, check_refused = _h.HOSTILE_CACHE_FOLDERS, _h.Store, _h.check_refused
foundation_workspace, hostile_keys, local_files = _h.foundation_workspace, _h.hostile_keys, _h.local_files

EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _local(home: Path) -> tuple[Store, str]:
    """A folder store under `home` and the key of its prefix; the foundation uploaded there."""
    root = home / "store"
    root.mkdir(parents=True)
    store = Store(LocalFileSystem(), str(root), str(root / "habitus"))
    Workspace(root=str(foundation_workspace(home / "ws")), output=store.url).upload_stage("foundation",
                                                                                       log=lambda _: None)
    return store, str(root / "habitus")


@EXAMPLES
@given(key=hostile_keys())
def test_a_hostile_manifest_entry_is_refused_by_restore_and_upload_naming_it(key):
    with tempfile.TemporaryDirectory() as tmp:
        store, prefix = _local(Path(tmp) / "home")
        check_refused(store, prefix, Path(tmp) / "home", key=key)


@settings(max_examples=len(HOSTILE_CACHE_FOLDERS), deadline=None)
@given(folder=st.sampled_from(HOSTILE_CACHE_FOLDERS))
def test_a_cache_folder_that_is_not_a_fingerprint_is_refused(folder):
    with tempfile.TemporaryDirectory() as tmp:
        store, prefix = _local(Path(tmp) / "home")
        check_refused(store, prefix, Path(tmp) / "home", cache_folder=folder)


LINKS = ["checkpoints", "checkpoints/foundation", "cache", "cache/abababababababab", "checkpoints/foundation_loss.png"]


@pytest.mark.parametrize("link", LINKS)
def test_restore_never_writes_through_a_symlink_planted_in_the_workspace(tmp_path, link):
    store, _ = _local(tmp_path / "home")
    outside = tmp_path / "outside"
    (outside / "foundation").mkdir(parents=True)
    (outside / "foundation" / "config.json").write_text("theirs")
    (outside / "abababababababab").mkdir()
    fresh = tmp_path / "home" / "fresh"
    target = fresh / link
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(outside / Path(link).name if link != "checkpoints" else outside)
    before = local_files(outside)
    with pytest.raises(OutputError, match="is a symbolic link"):
        Workspace(root=str(fresh), output=store.url).restore(log=lambda _: None)
    assert local_files(outside) == before
    assert target.is_symlink()


def test_a_file_symlink_inside_a_checkpoint_is_replaced_never_read(tmp_path, monkeypatch):
    """A link planted in place of a checkpoint file: the folder is rebuilt and swapped in, the link dropped,
    its target neither read (hashed) nor written."""
    import habitus.resources.store.output as output

    store, _ = _local(tmp_path / "home")
    secret = tmp_path / "outside" / "secret"
    secret.parent.mkdir()
    secret.write_bytes(b"not yours")
    fresh = tmp_path / "home" / "fresh"
    (fresh / "checkpoints" / "foundation").mkdir(parents=True)
    (fresh / "checkpoints" / "foundation" / "model.safetensors").symlink_to(secret)
    hashed = []
    whole = output.sha256_of
    monkeypatch.setattr(output, "sha256_of", lambda p: hashed.append(Path(p)) or whole(p))
    Workspace(root=str(fresh), output=store.url).restore(log=lambda _: None)
    restored = fresh / "checkpoints" / "foundation" / "model.safetensors"
    assert not restored.is_symlink()
    assert restored.read_bytes() == (tmp_path / "home" / "ws" / "checkpoints" / "foundation" /
                                     "model.safetensors").read_bytes()
    assert secret.read_bytes() == b"not yours"
    assert all(not p.resolve().is_relative_to(secret.parent) for p in hashed)


def test_restore_takes_only_the_pinned_fingerprint(tmp_path):
    store, prefix = _local(tmp_path / "home")
    manifest = json.loads((Path(prefix) / "manifests" / "foundation.json").read_text())
    pin = fingerprint(manifest)
    assert manifest["fingerprint"] == pin
    fresh = Workspace(root=str(tmp_path / "a"), output=store.url, output_pins={"foundation": pin})
    assert list(fresh.restore(log=lambda _: None)) == ["foundation"]
    other = Workspace(root=str(tmp_path / "b"), output=store.url, output_pins={"foundation": "0" * 64})
    with pytest.raises(OutputError, match=f"fingerprint {pin} is not the pinned {'0' * 64}"):
        other.restore(log=lambda _: None)
    assert not (tmp_path / "b").exists()
    # a whole other checkpoint uploaded over it (consistent manifest, hashes right): refused under the pin
    ws = tmp_path / "home" / "ws"
    (ws / "checkpoints" / "foundation" / "model.safetensors").write_bytes(os.urandom(4096))
    Workspace(root=str(ws), output=store.url).upload_stage("foundation", log=lambda _: None)
    with pytest.raises(OutputError, match="is not the pinned"):
        Workspace(root=str(tmp_path / "c"), output=store.url, output_pins={"foundation": pin}).restore(
            log=lambda _: None)
    # with pins set, a checkpoint stage without one is refused
    with pytest.raises(OutputError, match="has no pin"):
        Output(store.url, log=lambda _: None).restore(tmp_path / "d", ["foundation"], pins={"scenario/x": pin})


def test_a_restore_over_a_whole_checkpoint_swaps_it_and_drops_files_the_manifest_does_not_name(tmp_path):
    store, _ = _local(tmp_path / "home")
    fresh = tmp_path / "fresh"
    (fresh / "checkpoints" / "foundation").mkdir(parents=True)
    (fresh / "checkpoints" / "foundation" / "stale.bin").write_bytes(b"old")
    Workspace(root=str(fresh), output=store.url).restore(log=lambda _: None)
    assert sorted(p.name for p in (fresh / "checkpoints" / "foundation").iterdir()) == ["config.json",
                                                                                       "model.safetensors"]
    assert json.loads((fresh / "cache" / "current.json").read_text())["folder"] == "ab" * 8
    assert not [p for p in fresh.rglob(".*") if ".tmp-" in p.name]


def test_output_urls_are_logged_without_credentials_or_query(tmp_path):
    assert redact_url("s3://AKIA:s3cr3t@bucket/prefix/?endpoint_override=h:9000&token=abc") == \
        "s3://***@bucket/prefix/?endpoint_override=***&token=***"
    assert redact_url("abfs://user:pw@account.dfs.core.windows.net/c/p?sig=xyz") == \
        "abfs://***@account.dfs.core.windows.net/c/p?sig=***"
    assert redact_url("/mnt/models/habitus") == "/mnt/models/habitus"
    with pytest.raises(OutputError, match="credentials in the URL are not read") as e:
        Output("s3://AKIA:s3cr3t@bucket/p")
    assert "s3cr3t" not in str(e.value) and "AKIA" not in str(e.value)
    logs = []  # a store that does not answer: every retry and the error show the URL without its query values
    with pytest.raises(OutputError) as e:
        Output("s3://bucket/p?endpoint_override=127.0.0.1:9&scheme=http&token=zz", retries=2, backoff_s=0.01,
               log=logs.append).stages()
    assert logs and all("token=zz" not in line and "s3://bucket/p" in line for line in logs)
    assert "token=zz" not in str(e.value)


def test_a_tampered_reupload_is_hashed_again_and_the_pinned_restore_refuses_the_swapped_bytes(tmp_path):
    store, prefix = _local(tmp_path / "home")
    _h.check_tampered_reupload(store, prefix, tmp_path / "home")


def test_an_object_longer_than_its_declared_size_is_refused_after_one_chunk_at_most(tmp_path):
    store, prefix = _local(tmp_path / "home")
    assert _h.check_lying_size(store, prefix, tmp_path / "home") <= 11  # the declared 10 bytes and one more
