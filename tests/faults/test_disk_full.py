"""A disk that fills up: the cache build, a checkpoint save, a day of predictions and an upload to `output:`,
each on a small tmpfs made by the test. Each fails naming the path and the space needed, leaves nothing
half-written (and the previous version intact), and the next run, with space freed, gives the same result
as on a roomy disk."""

import contextlib
import os
import subprocess

import duckdb
import pyarrow.parquet as pq
import pytest
import torch

from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache
from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.storage.files import DiskFullError, folder_bytes
from habitus.pipelines.demo.data import generate_demo_warehouse
from habitus.resources.warehouses.canonical import PARQUET_OPTIONS

pytestmark = pytest.mark.faults


@contextlib.contextmanager
def small_disk(path, size: str):
    """A tmpfs of `size` at `path`; yields a function that resizes it (freeing space, as a user would)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): these tests need root and mount")
    try:
        yield lambda new: subprocess.run(["mount", "-o", f"remount,size={new}", str(path)], check=True)
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    root = tmp_path_factory.mktemp("disk_full_sources")
    generate_demo_warehouse(root / "w.duckdb", customers=2000, products=200, stores=6, seed=4,
                            start="2026-03-01", end="2026-04-30")
    con = duckdb.connect(str(root / "w.duckdb"), read_only=True)
    events = []
    for month in ("03", "04"):
        events.append(root / f"2026-{month}-01.parquet")
        pq.write_table(con.sql(f"SELECT customer_id, ts, product_id, store_id, price FROM purchases "
                               f"WHERE strftime(ts, '%m') = '{month}' ORDER BY ts").to_arrow_table(),
                       events[-1], **PARQUET_OPTIONS)
    pq.write_table(con.sql("SELECT product_id, brand FROM products").to_arrow_table(), root / "products.parquet")
    con.close()
    return CacheSpec(entity="customer_id",
                     events=[TableInput("purchases", [str(f) for f in events],
                                        {"product_id": "categorical", "store_id": "categorical", "price": "numeric"},
                                        timestamp="ts")],
                     attributes=[TableInput("products", [str(root / "products.parquet")], {"brand": "categorical"},
                                            key="product_id")])


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != "manifest.json"}


def test_a_cache_build_on_a_full_disk_names_the_path_and_succeeds_once_space_is_freed(spec, tmp_path):
    reference = build_cache(spec, tmp_path / "roomy", log=lambda _: None)
    size = folder_bytes(reference)
    with small_disk(tmp_path / "small", str(size // 3)) as resize:  # a third of what the cache takes
        root = tmp_path / "small" / "cache"
        with pytest.raises(DiskFullError) as failed:
            build_cache(spec, root, log=lambda _: None)
        message = str(failed.value)
        assert str(root) in message and "is full" in message and "needs about" in message, message
        assert os.listdir(root) == []  # the partial copy is gone; no folder without its manifest remains
        resize(str(4 * size + (1 << 20)))
        again = build_cache(spec, root, log=lambda _: None)
        assert again.name == reference.name and _files(again) == _files(reference)
        assert Cache(again).manifest["n_events"] == Cache(reference).manifest["n_events"]


def test_a_checkpoint_save_on_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    small, big = torch.nn.Linear(8, 8), torch.nn.Linear(1024, 1024)  # 4 MB of weights
    with small_disk(tmp_path / "disk", "1m") as resize:
        path = tmp_path / "disk" / "checkpoints" / "foundation"
        before = save_checkpoint(path, small, {"epochs": 1})
        with pytest.raises(DiskFullError) as failed:
            save_checkpoint(path, big, {"epochs": 2})
        message = str(failed.value)
        assert str(path.parent) in message and "needs about 4.2 MB" in message, message
        weights, config = load_checkpoint(path)  # the previous one, whole
        assert config["weights_sha256"] == before and weights["weight"].shape == (8, 8)
        assert sorted(os.listdir(path.parent)) == ["foundation"]
        resize("16m")
        after = save_checkpoint(path, big, {"epochs": 2})
        weights, config = load_checkpoint(path)
        assert config["weights_sha256"] == after and torch.equal(weights["weight"], big.weight.detach())


def _predictions(cache, n_columns: int = 24):
    """A day of scores for every entity of `cache`: `n_columns` float columns of seeded noise (incompressible,
    so the file is as large as a wide multilabel day)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(7)
    idx = np.arange(cache.n_entities, dtype=np.int64)
    for start in range(0, len(idx), 500):
        part = idx[start:start + 500]
        yield pa.record_batch({"entity_index": pa.array(part),
                               **{f"score_{j}": pa.array(rng.random(len(part))) for j in range(n_columns)}})


def test_predictions_on_a_full_disk_keep_the_previous_day_and_succeed_once_space_is_freed(spec, tmp_path):
    """A day's predictions file (assets/predictions.py write_entity_file) on a disk that fills: DiskFullError
    naming the path and the MB written; no partial file, the day's previous file whole; with space freed the
    same bytes as on a roomy disk."""
    from datetime import datetime, timezone

    from habitus.assets.predictions import write_entity_file

    cache = Cache(build_cache(spec, tmp_path / "cache", log=lambda _: None))
    as_of = datetime(2026, 5, 1, tzinfo=timezone.utc)
    roomy = tmp_path / "roomy" / "2026-04-30.parquet"
    rows = write_entity_file(cache, _predictions(cache), roomy, "customer_id", "f" * 16, as_of)
    size = roomy.stat().st_size
    with small_disk(tmp_path / "small", str(size // 2)) as resize:
        path = tmp_path / "small" / "predictions" / "churn" / "2026-04-30.parquet"
        previous = write_entity_file(cache, _predictions(cache, n_columns=1), path, "customer_id", "e" * 16, as_of)
        before = path.read_bytes()
        with pytest.raises(DiskFullError) as failed:
            write_entity_file(cache, _predictions(cache), path, "customer_id", "f" * 16, as_of)
        message = str(failed.value)
        assert str(path.parent) in message and "is full" in message and "needs more than" in message, message
        assert sorted(os.listdir(path.parent)) == [path.name] and path.read_bytes() == before  # the old day, whole
        assert pq.read_table(path).num_rows == previous
        resize(str(4 * size + (1 << 20)))
        assert write_entity_file(cache, _predictions(cache), path, "customer_id", "f" * 16, as_of) == rows
        assert path.read_bytes() == roomy.read_bytes()


def test_an_upload_to_a_full_output_disk_names_the_key_and_resumes_once_space_is_freed(tmp_path):
    """`output:` a mounted folder that fills during a stage's upload (resources/store/output.py): OutputError naming
    the folder and the MB the file needs, at once (a full disk is not retried); no temporary key left, the
    stage's manifest still the previous one; with space freed the upload completes and restores byte for byte."""
    from habitus.resources.store.output import Output, OutputError

    root = tmp_path / "ws"
    files = []
    for name, mb in (("checkpoints/foundation/config.json", 0), ("checkpoints/foundation/model.safetensors", 3)):
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(os.urandom(mb << 20) if mb else b'{"epochs": 1}')
        files.append(p)
    with small_disk(tmp_path / "disk", "2m") as resize:
        out = Output(str(tmp_path / "disk" / "habitus"), log=lambda _: None, backoff_s=5)
        first = out.upload("foundation", root, files[:1])  # the small file: a committed manifest
        assert first["uploaded"] == 1
        import time

        started = time.monotonic()
        with pytest.raises(OutputError) as failed:
            out.upload("foundation", root, files)
        assert time.monotonic() - started < 5, "a full disk was retried"
        message = str(failed.value)
        assert "is full" in message and "needs 3.1 MB" in message and "model.safetensors" in message, message
        leftovers = [str(p.relative_to(tmp_path / "disk")) for p in (tmp_path / "disk").rglob("*")
                     if p.is_file() and p.name.startswith(".upload.")]
        assert leftovers == []
        assert sorted(out.manifest("foundation")["files"]) == ["checkpoints/foundation/config.json"]
        resize("16m")
        again = out.upload("foundation", root, files)
        assert again == {"uploaded": 1, "skipped": 1, "bytes": 3 << 20, "removed": 0, "cleaned": 0}
        back = tmp_path / "restored"
        out.restore(back, ["foundation"])
        assert all((back / p.relative_to(root)).read_bytes() == p.read_bytes() for p in files)
