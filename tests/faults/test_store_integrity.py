"""What restore and upload do with what the store says (resources/store/output.py, resources/store/manifests.py): a download
cut by a store error goes on from where it stopped, bytes already verified are never downloaded again, a
mismatch is not retried, the free space is checked first, manifest bombs end in the project's error naming
the file, and an output URL whose password holds `/`, `?`, `#` or `@` is refused without a piece of it."""

import json
import os
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import habitus.resources.store.space as space_module
from habitus.resources.store.manifests import MAX_DEPTH, MAX_MANIFEST_BYTES
from habitus.resources.store.redaction import redact_url
from habitus.resources.store.output import CHUNK, Output, OutputError
from habitus.resources.store.workspace import Workspace, WorkspaceError


def _helpers():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hostile_store", Path(__file__).with_name("hostile_store.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Counted = _helpers().Counted


def _scenario(ws: Path) -> Path:
    """A scenario checkpoint and its passed copy (the same bytes in two units), 3 chunks of weights."""
    for folder in ("scenarios", "passed"):
        (ws / "checkpoints" / folder / "churn").mkdir(parents=True)
        (ws / "checkpoints" / folder / "churn" / "config.json").write_text('{"task": "churn"}')
    weights = os.urandom(3 * CHUNK + 5)
    for folder in ("scenarios", "passed"):
        (ws / "checkpoints" / folder / "churn" / "model.safetensors").write_bytes(weights)
    return ws


def _uploaded(tmp_path: Path) -> tuple[Path, Path]:
    ws, store = _scenario(tmp_path / "ws"), tmp_path / "store"
    Workspace(root=str(ws), output=str(store)).upload_stage("scenario/churn", log=lambda _: None)
    return ws, store


class _Cut(Counted):
    """Reads of `key` fail once, after `after` bytes (a connection reset by the store)."""

    def __init__(self, fs, key: str, after: int):
        super().__init__(fs)
        self.key, self.after = key, after

    def open_input_file(self, key):
        f = super().open_input_file(key)
        if key == self.key and self.after is not None:
            whole, left = f.read, [self.after]

            def read(n=-1):
                if left[0] <= 0:
                    self.after = None
                    raise OSError("connection reset by peer")
                block = whole(min(n, left[0]))
                left[0] -= len(block)
                return block

            f.read = read
        return f


def test_a_cut_download_goes_on_from_where_it_stopped_and_verified_bytes_are_not_downloaded_again(tmp_path):
    ws, store = _uploaded(tmp_path)
    out = Output(str(store), backoff_s=0.01, log=lambda _: None)
    weights = f"{store}/checkpoints/passed/churn/model.safetensors"
    out.fs = _Cut(out.fs, weights, after=CHUNK + 100)
    done = out.restore(tmp_path / "fresh", ["scenario/churn"])
    for rel in done["scenario/churn"]["files"]:
        assert (tmp_path / "fresh" / rel).read_bytes() == (ws / rel).read_bytes()
    size = (ws / "checkpoints" / "passed" / "churn" / "model.safetensors").stat().st_size
    # the cut download was opened twice and read once in all; the scenario's copy (the same bytes) was linked
    assert out.fs.opened.count(weights) == 2 and out.fs.read[weights] == size
    assert f"{store}/checkpoints/scenarios/churn/model.safetensors" not in out.fs.opened
    config = f"{store}/checkpoints/scenarios/churn/config.json"  # the same bytes as the passed copy's
    assert (config in out.fs.opened) != (config.replace("scenarios", "passed") in out.fs.opened)


def test_a_mismatch_is_not_retried_and_a_second_restore_downloads_nothing(tmp_path):
    ws, store = _uploaded(tmp_path)
    out = Output(str(store), backoff_s=0.01, log=lambda _: None)
    out.restore(tmp_path / "fresh", ["scenario/churn"])
    out.fs = Counted(out.fs)
    out.restore(tmp_path / "fresh", ["scenario/churn"])  # everything there already, verified by its hash
    assert out.fs.opened == []
    key = store / "checkpoints" / "passed" / "churn" / "config.json"  # the first of the stage's downloads
    key.write_text('{"task": "other"}')  # other bytes than the manifest's
    with pytest.raises(OutputError, match="config.json is 17 bytes with SHA-256"):
        out.restore(tmp_path / "other", ["scenario/churn"])
    assert out.fs.opened.count(str(key)) == 1


def test_restore_checks_the_free_space_first_with_the_training_preflight(tmp_path, monkeypatch):
    ws, store = _uploaded(tmp_path)
    size = sum(p.stat().st_size for p in ws.rglob("*") if p.is_file())
    real = space_module.shutil.disk_usage

    def small(path):
        return real(path)._replace(free=size)  # less than the stage needs with its 20% headroom

    monkeypatch.setattr(space_module.shutil, "disk_usage", small)
    out = Output(str(store), log=lambda _: None)
    out.fs = Counted(out.fs)
    with pytest.raises(WorkspaceError, match=r"not enough free space in the workspace .* for restoring scenario/churn"):
        out.restore(tmp_path / "fresh", ["scenario/churn"])
    assert out.fs.opened == []  # no file downloaded (the manifest is read, its files are not)
    assert not (tmp_path / "fresh" / "checkpoints").exists()


BOMBS = {
    "nested 200,000 deep": lambda: b"[" * 200_000 + b"]" * 200_000,
    f"nested {MAX_DEPTH + 1} deep": lambda: json.dumps({"files": {}, "x": json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)}).encode(),
    "a 5,000-digit integer": lambda: b'{"files": {"checkpoints/foundation/x": {"size": ' + b"9" * 5000 + b"}}}",
    "a 21-digit size": lambda: b'{"files": {"checkpoints/foundation/x": {"size": ' + b"1" * 21 + b"}}}",
    "not JSON": lambda: b"\xff\xfe{",
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_manifest_bomb_ends_in_a_clean_error_naming_the_file(tmp_path, bomb):
    ws, store = tmp_path / "ws", tmp_path / "store"
    (ws / "checkpoints" / "foundation").mkdir(parents=True)
    (ws / "checkpoints" / "foundation_loss.png").write_bytes(b"png")
    manifest = store / "manifests" / "foundation.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_bytes(BOMBS[bomb]())
    for call in (lambda: Workspace(root=str(tmp_path / "fresh"), output=str(store)).restore(log=lambda _: None),
                 lambda: Workspace(root=str(ws), output=str(store)).upload_stage("foundation", log=lambda _: None)):
        with pytest.raises(OutputError) as e:
            call()
        assert f"{manifest}" in str(e.value) and len(str(e.value)) < 600, str(e.value)[:600]
    assert manifest.read_bytes() == BOMBS[bomb]()  # nothing replaced it


def test_a_manifest_larger_than_the_limit_is_refused_unread(tmp_path):
    manifest = tmp_path / "store" / "manifests" / "foundation.json"
    manifest.parent.mkdir(parents=True)
    with open(manifest, "wb") as f:  # sparse: no disk taken
        f.truncate(MAX_MANIFEST_BYTES + 1)
    out = Output(str(tmp_path / "store"), log=lambda _: None)
    out.fs = Counted(out.fs)
    with pytest.raises(OutputError, match=f"{manifest}: more than 64 MB"):
        out.restore(tmp_path / "fresh", ["foundation"])
    assert out.fs.opened == []


SEPARATORS = "/?#@:%"


@settings(max_examples=80, deadline=None)
@given(head=st.text(string.ascii_letters + string.digits, min_size=4, max_size=12),
       tail=st.text(string.ascii_letters + string.digits + SEPARATORS, min_size=1, max_size=12),
       sep=st.sampled_from(SEPARATORS), scheme=st.sampled_from(["s3", "gs", "abfs"]))
def test_an_output_url_whose_password_holds_a_separator_is_refused_without_a_piece_of_it(head, tail, sep, scheme):
    secret_head, secret_tail = f"Zq{head}", f"Wk{tail.strip(SEPARATORS)}x"
    url = f"{scheme}://AKIAUSER:{secret_head}{sep}{secret_tail}@bucket/prefix"
    with pytest.raises(OutputError, match="credentials in the URL are not read") as e:
        Output(url)
    for shown in (str(e.value), redact_url(url)):
        assert secret_head not in shown and secret_tail not in shown and "AKIAUSER" not in shown, shown
