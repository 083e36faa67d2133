"""Names read from files that become paths: the `model_fingerprint` of a predictions file (realized/<name>,
the score drift check), the `serving` of a version pointer (serving.json), the `folder` of the cache pointer
(cache/current.json) and any fingerprint given to the version store must have the fingerprint form (16 hex
digits), and the cache folder must not be a link; anything else is an error naming the file, and nothing
outside the store is read."""

import json

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.assets.cache import cache_folder, current_cache
from habitus.assets.serving import scored_by, serving_checkpoint, versions
from habitus.models.cache import Cache
from habitus.models.storage.versions import INFO, POINTER, VersionError, checked_fingerprint
from habitus.pipelines.orchestration.schedules import cache_in_use
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


def _pointer(ws, folder) -> None:
    ws.cache_root.mkdir(parents=True, exist_ok=True)
    (ws.cache_root / "current.json").write_text(json.dumps({"folder": folder, "at": "2026-12-06T00:00:00+00:00"}))


@pytest.mark.parametrize("name", ["../../etc", "..", "/etc", "/abs", "a/b", "abababababababab/..", "", None, 7, "ABABABABABABABAB"])
def test_a_cache_pointer_naming_no_cache_folder_fails_naming_current_json(ws, tmp_path, name):
    outside = tmp_path / "abs"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")  # what the pointer would lead to: never read
    _pointer(ws, name.replace("/abs", str(outside)) if isinstance(name, str) else name)
    pointer = str(ws.cache_root / "current.json")
    for read in (current_cache, cache_in_use, cache_folder):  # the assets, the schedules and sensors, the cache asset
        with pytest.raises(dg.Failure) as e:
            read(ws)
        text = str(e.value.description)
        assert pointer in text and "not a cache fingerprint" in text and "build the cache again" in text, text


def test_a_cache_folder_that_is_a_link_fails_naming_current_json(ws, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "manifest.json").write_text("{}")
    ws.cache_root.mkdir(parents=True)
    (ws.cache_root / "0123456789abcdef").symlink_to(outside, target_is_directory=True)
    _pointer(ws, "0123456789abcdef")
    for read in (current_cache, cache_in_use, cache_folder):
        with pytest.raises(dg.Failure) as e:
            read(ws)
        assert str(ws.cache_root / "current.json") in str(e.value.description) and "is a link" in str(e.value.description)


@pytest.mark.parametrize("text", ["{torn", "[1, 2]"])
def test_a_cache_pointer_that_is_not_a_json_object_fails_naming_current_json(ws, text):
    ws.cache_root.mkdir(parents=True)
    (ws.cache_root / "current.json").write_text(text)
    with pytest.raises(dg.Failure) as e:
        current_cache(ws)
    assert str(ws.cache_root / "current.json") in str(e.value.description) and "build the cache again" in str(e.value.description)


def test_a_cache_pointer_naming_a_cache_folder_is_followed(ws):
    assert cache_folder(ws) is None and cache_in_use(ws) is None  # no cache yet
    with pytest.raises(dg.Failure, match="materialize `cache` first"):
        current_cache(ws)
    _pointer(ws, "0123456789abcdef")
    folder = ws.cache_root / "0123456789abcdef"
    assert cache_folder(ws) == folder and cache_in_use(ws) is None  # named, not built yet
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"fingerprint": "0123456789abcdef" * 4, "columns": {},
                                                       "entity_columns": {}, "n_entities": 0, "time_range": [0, 1]}))
    assert cache_folder(ws) == folder and current_cache(ws).path == folder == cache_in_use(ws).path
    assert isinstance(current_cache(ws), Cache)
