"""Tests for habitus.resources.store.workspace.Workspace: POSIX roots only, safe names, free-space checks."""

import re

import pytest

from habitus.resources.store.workspace import HEADROOM, Workspace, WorkspaceError


@pytest.mark.parametrize("root", ["s3://bucket/habitus", "gs://b/x", "abfss://c@acct.dfs.core.windows.net/x"])
def test_object_storage_root_refused(root):
    ws = Workspace(root=root)
    with pytest.raises(WorkspaceError) as info:
        ws.sources("purchases")
    message = str(info.value)
    assert root in message and "POSIX" in message and "real filesystem" in message
    with pytest.raises(WorkspaceError):
        ws.ensure_space(1, "the cache")


def test_layout(tmp_path):
    ws = Workspace(root=str(tmp_path))
    assert ws.path == tmp_path
    assert ws.sources("purchases") == tmp_path / "sources" / "purchases"
    assert ws.cache_root == tmp_path / "cache"
    assert ws.foundation == tmp_path / "checkpoints" / "foundation"
    assert ws.scenario("churn") == tmp_path / "checkpoints" / "scenarios" / "churn"
    assert ws.predictions("churn") == tmp_path / "predictions" / "churn"


@pytest.mark.parametrize("name", ["..", ".", "", "../etc", "a/b", "/abs", "a\\b", "x/../../y"])
@pytest.mark.parametrize("method", ["sources", "scenario", "predictions"])
def test_unsafe_names_refused(tmp_path, name, method):
    with pytest.raises(WorkspaceError, match="cannot be used as a workspace folder"):
        getattr(Workspace(root=str(tmp_path)), method)(name)


def test_names_with_dots_inside_are_fine(tmp_path):
    assert Workspace(root=str(tmp_path)).sources("v1.2").name == "v1.2"


def test_ensure_space_refuses_absurd_need(tmp_path):
    root = tmp_path / "ws"
    with pytest.raises(WorkspaceError) as info:
        Workspace(root=str(root)).ensure_space(10**18, "the cache")  # an exabyte
    message = str(info.value)
    assert "the cache" in message and str(root) in message
    numbers = [float(x) for x in re.findall(r"(\d+(?:\.\d+)?) GB", message)]
    assert len(numbers) == 3  # free, needed with headroom, needed
    free, need, raw = numbers
    assert raw == pytest.approx(1e9, rel=1e-3)
    assert need == pytest.approx(1e9 * HEADROOM, rel=1e-3)
    assert free < need


def test_ensure_space_returns_free_and_needed(tmp_path):
    root = tmp_path / "new" / "ws"
    result = Workspace(root=str(root)).ensure_space(10**6, "a partition")
    assert root.is_dir()  # created on the way
    assert set(result) == {"free_gb", "needed_gb"}
    assert result["needed_gb"] == pytest.approx(1e6 * HEADROOM / 1e9, abs=1e-3)
    assert result["free_gb"] > result["needed_gb"]
