"""The hostile manifests of tests/faults/test_restore_trust.py against a real S3 server (moto): restore and
upload refuse every key that is not a plain path inside the stage's folders, naming it, and no key of the
bucket (inside or outside the output prefix) nor any local file changes; nothing is downloaded."""

import importlib.util
import tempfile
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from habitus.resources.store.workspace import Workspace

pytestmark = pytest.mark.integration

BUCKET = "habitus-trust"


def _helpers():
    path = Path(__file__).resolve().parents[1] / "faults" / "hostile_store.py"
    spec = importlib.util.spec_from_file_location("hostile_store", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _helpers()


@pytest.fixture(scope="module")
def s3(moto_s3):
    from pyarrow.fs import S3FileSystem

    fs = S3FileSystem(endpoint_override=moto_s3, scheme="http", region="us-east-1", access_key="test",
                      secret_key="test", allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    return fs, moto_s3


@pytest.fixture(autouse=True)
def credentials(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)


def _store(s3, home: Path):
    """A fresh prefix in the bucket with the foundation uploaded; (Store, prefix key)."""
    fs, endpoint = s3
    prefix = f"p{uuid.uuid4().hex[:10]}"
    url = f"s3://{BUCKET}/{prefix}/?endpoint_override={endpoint}&scheme=http"
    store = H.Store(fs, BUCKET, url)
    Workspace(root=str(H.foundation_workspace(home / "ws")), output=url).upload_stage("foundation", log=lambda _: None)
    return store, f"{BUCKET}/{prefix}"


EXAMPLES = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@EXAMPLES
@given(key=H.hostile_keys())
def test_a_hostile_manifest_entry_on_s3_is_refused_by_restore_and_upload(s3, key):
    with tempfile.TemporaryDirectory() as tmp:
        store, prefix = _store(s3, Path(tmp) / "home")
        H.check_refused(store, prefix, Path(tmp) / "home", key=key)


@settings(max_examples=len(H.HOSTILE_CACHE_FOLDERS), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(folder=st.sampled_from(H.HOSTILE_CACHE_FOLDERS))
def test_a_hostile_cache_folder_on_s3_is_refused(s3, folder):
    with tempfile.TemporaryDirectory() as tmp:
        store, prefix = _store(s3, Path(tmp) / "home")
        H.check_refused(store, prefix, Path(tmp) / "home", cache_folder=folder)


def test_a_clean_manifest_on_s3_restores_byte_for_byte(s3, tmp_path):
    store, _ = _store(s3, tmp_path / "home")
    fresh = tmp_path / "fresh"
    done = Workspace(root=str(fresh), output=store.url).restore(log=lambda _: None)
    for rel in done["foundation"]["files"]:
        assert (fresh / rel).read_bytes() == (tmp_path / "home" / "ws" / rel).read_bytes()


def test_a_tampered_reupload_on_s3_is_hashed_again_and_the_pinned_restore_refuses_the_swapped_bytes(s3, tmp_path):
    store, prefix = _store(s3, tmp_path / "home")
    H.check_tampered_reupload(store, prefix, tmp_path / "home")


def test_an_s3_object_longer_than_its_declared_size_is_refused_after_one_chunk_at_most(s3, tmp_path):
    store, prefix = _store(s3, tmp_path / "home")
    H.check_lying_size(store, prefix, tmp_path / "home")
