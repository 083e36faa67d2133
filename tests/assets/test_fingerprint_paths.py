"""Names read from files that become paths: the `model_fingerprint` of a predictions file (realized/<name>,
the score drift check), the `serving` of a version pointer (serving.json) and any fingerprint given to the
version store must have the fingerprint form (16 hex digits); anything else is an error naming the file,
and nothing outside the store is read."""

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.assets.serving import scored_by, serving_checkpoint, versions
from habitus.models.storage.versions import INFO, POINTER, VersionError, checked_fingerprint
from habitus.resources.store.workspace import Workspace

HOSTILE = ["../../../etc", "/etc", "/abs", "..", "", "a/b", "0123456789abcdeF", "0123456789abcdef0",
           "0123456789abcde\n", "０１２３４５６７８９ａｂｃｄｅｆ", None, 7]


@pytest.fixture
def ws(tmp_path):
    return Workspace(root=str(tmp_path / "ws"))


@pytest.mark.parametrize("name", HOSTILE)
def test_the_version_store_makes_no_path_of_a_name_that_is_not_a_fingerprint(ws, name):
    store = versions(ws, "churn")
    with pytest.raises(VersionError, match="not a version fingerprint"):
        store.path(name)
    assert store.path("0123456789abcdef") == store.folder / "0123456789abcdef"
    assert checked_fingerprint("0123456789abcdef", "x") == "0123456789abcdef"


@pytest.mark.parametrize("name", ["/abs", "../../../etc", "a/b", 12])
def test_a_predictions_file_naming_no_fingerprint_fails_naming_the_file(ws, name):
    path = ws.predictions("churn") / "2026-10-24.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.table({"customer_id": ["c1"], "score": [0.5], "model_fingerprint": [name]}), path)
    with pytest.raises(dg.Failure) as e:
        scored_by(pq.read_table(path), path)  # what realized/<name> and the score_drift check read
    assert str(path) in str(e.value) and "model_fingerprint" in str(e.value)
    good = pa.table({"customer_id": ["c1"], "model_fingerprint": ["0123456789abcdef"]})
    assert scored_by(good, path) == "0123456789abcdef"


@pytest.mark.parametrize("name", ["/abs", "../../..", "../passed/churn"])
def test_a_pointer_naming_no_fingerprint_fails_naming_serving_json(ws, tmp_path, name):
    outside = tmp_path / "abs"
    outside.mkdir()
    (outside / INFO).write_text("{}")  # what the pointer would lead to: never read
    store = versions(ws, "churn")
    store.folder.mkdir(parents=True)
    (store.folder / POINTER).write_text(json.dumps({"serving": name.replace("/abs", str(outside)), "history": []}))
    with pytest.raises(dg.Failure) as e:
        serving_checkpoint(ws, "churn")
    assert str(store.folder / POINTER) in str(e.value) and "not a version fingerprint" in str(e.value)


def test_folders_that_are_not_fingerprints_or_are_links_are_not_versions(ws, tmp_path):
    store = versions(ws, "churn")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / INFO).write_text(json.dumps({"added": "x"}))
    store.folder.mkdir(parents=True)
    (store.folder / "planted").mkdir()
    (store.folder / "planted" / INFO).write_text("{}")
    (store.folder / "0123456789abcdef").symlink_to(outside, target_is_directory=True)
    assert store.fingerprints() == []
