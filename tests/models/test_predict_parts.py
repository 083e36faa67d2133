"""models/serve/parts.py: a day's predictions and embeddings from several processes, a part each, made
whole by the manifest. Two processes write the file one process writes, bit for bit (the scenario's
head chosen on validation, LightGBM included, scores in the child too); a killed process leaves the
day's previous file as it was, and the next run scores only the chunks no complete part holds."""

import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from habitus.assets.predictions import as_of_time, parts_of_day, write_entity_file
from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.evaluate.holdout import protocol
from habitus.models.data.chunks import chunk_plan
from habitus.models.serve.parts import Parts, PartsError, Pool, Scorer, staging
from habitus.models.serve.predict import embed, embedding_scorer, load_model, predict, scenario_scorer
from habitus.models.train.config import FinetuneConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.heads.stacking import StackConfig
from habitus.models.heads.stacked_head import fit_head, load_head, save_head
from habitus.models.nn.network import load_trunk
from habitus.models.data.targets import TargetSpec
from habitus.resources.training.executor import ExecutorError, TrainingExecutor

pytest.importorskip("lightgbm")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CHUNK = 32  # 240 entities over several shards: 9 chunks, so two processes share them
DAY = "2026-04-08"
QUIET = SimpleNamespace(log=SimpleNamespace(info=lambda *_: None))
HERE = "tests.models.test_predict_parts"


@pytest.fixture(scope="module")
def world(segment_foundation, tmp_path_factory):
    """(cache, cut-off, scenario checkpoint with a forced blend head, foundation checkpoint)."""
    from habitus.models.train.finetune import finetune

    cache, test_cutoff, foundation = segment_foundation
    root = tmp_path_factory.mktemp("parts")
    task = TaskSpec("binary", TargetSpec("no_event", 14, active_days=90))
    plan = protocol(test_cutoff, 14, 3, cache.time_range[0])
    tuned = finetune(cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                     plan.val_cutoff, FinetuneConfig(epochs=1, batch_size=64), log=lambda _: None, device="cpu")
    trunk = load_trunk(foundation.model.state_dict(), foundation.info["net"])
    head = fit_head(cache, _spec(foundation), task, trunk, tuned.model, plan.train_cutoffs, plan.val_cutoff,
                    cfg=StackConfig(n_estimators=20, weights=(0.5,)))
    assert head is not None and head.weight == 0.5  # the trees are read wherever the head scores
    scenario = root / "scenario"
    save_checkpoint(scenario, tuned.model, {"kind": "scenario", "task": task.to_dict(), "net": foundation.info["net"],
                                            "feature_spec": foundation.info["feature_spec"]},
                    extra=lambda f: {"stack": save_head(f, head)})
    found = root / "foundation"
    save_checkpoint(found, foundation.model, {"kind": "foundation", "net": foundation.info["net"],
                                              "feature_spec": foundation.info["feature_spec"],
                                              "profile": foundation.info["profile"]})
    assert len(chunk_plan(cache, CHUNK)) >= 6
    return cache, test_cutoff, scenario, found


def _spec(foundation):
    from habitus.models.data.features import FeatureSpec

    return FeatureSpec.from_dict(foundation.info["feature_spec"])


def _params(world, what: str, **extra) -> dict:
    cache, _, scenario, found = world
    path = scenario if what == "predict" else found
    p = {"cache": str(cache.path), "cache_fingerprint": cache.fingerprint, "checkpoint": str(path),
         "weights_sha256": load_checkpoint(path)[1]["weights_sha256"], "precision": "fp32", "chunk_entities": CHUNK,
         "what": what}
    return {**p, "k": 20, "label_names": None} if what == "predict" else p


def paced_scorer(p: dict):
    """The real scorer of `p["what"]`, paced so that both processes score chunks whatever the load:
    process 0 starts once the child has scored its first chunk, which then waits for process 0's
    first. With `p["die"]`, the child kills itself (SIGKILL) after its first chunk, before its part is
    complete. (A forked child runs process 0's scorer: it knows itself by its pid.)"""
    score = (scenario_scorer if p["what"] == "predict" else embedding_scorer)(p)
    one, zero = Path(p["flags"]) / "child-scored", Path(p["flags"]) / "parent-scored"
    builder = os.getpid()

    def wait(flag: Path):
        deadline = time.time() + 300
        while not flag.exists():
            if time.time() > deadline:
                raise TimeoutError(f"{flag} never appeared")
            time.sleep(0.02)

    def paced(cutoff, chunks):
        child = p["rank"] > 0 or os.getpid() != builder
        if not child:
            wait(one)
        for n, (c, batch) in enumerate(score(cutoff, chunks)):
            yield c, batch
            if n == 0 and not child:
                zero.touch()
            elif n == 0:
                one.touch()
                if p.get("die"):
                    os.kill(os.getpid(), signal.SIGKILL)
                wait(zero)

    return paced


def _one_process(world, what: str, path: Path, cutoff: int) -> int:
    cache, _, scenario, found = world
    state, config = load_checkpoint(scenario if what == "predict" else found)
    if what == "predict":
        model, spec, task = load_model(state, config)
        batches = predict(model, cache, spec, task, cutoff, chunk_entities=CHUNK, head=load_head(scenario, config))
    else:
        from habitus.models.data.features import FeatureSpec

        from habitus.models.nn.profile import Profile

        assert Profile.of(config).components is not None  # the embeddings' projection, as the asset writes them
        batches = embed(load_trunk(state, config["net"]), cache, FeatureSpec.from_dict(config["feature_spec"]), cutoff,
                        chunk_entities=CHUNK, profile=Profile.of(config))
    return write_entity_file(cache, batches, path, "customer_id", "f" * 16, as_of_time(DAY))


def _two_processes(world, pool: Pool, folder: Path, path: Path, cutoff: int, key: str) -> tuple[int, list[dict]]:
    """What the assets do with a day (assets/predictions.py's parts_of_day, then the day's file)."""
    cache = world[0]
    parts = Parts(staging(folder, DAY), key, len(chunk_plan(cache, CHUNK)))
    done = pool.day(parts, cutoff)
    rows = write_entity_file(cache, parts.batches(), path, "customer_id", "f" * 16, as_of_time(DAY))
    return rows, done


@pytest.mark.parametrize("what, start", [("predict", "auto"), ("embed", "auto"), ("predict", "spawn")])
def test_two_processes_write_the_file_one_process_writes(world, tmp_path, what, start, monkeypatch):
    import habitus.assets.predictions as ap

    monkeypatch.setattr(ap, "CHUNK_ENTITIES", CHUNK)  # the asset's day, on this cache's small chunks
    cache, cutoff = world[0], world[1]
    one = tmp_path / "one.parquet"
    rows = _one_process(world, what, one, cutoff)
    (tmp_path / "flags").mkdir()
    scorer = Scorer(f"{HERE}:paced_scorer", {**_params(world, what), "flags": str(tmp_path / "flags")})
    folder = tmp_path / "out"
    with Pool(scorer, 2, ["cpu", "cpu"], 1, start=start) as pool:  # auto: forked (one thread each)
        parts = parts_of_day(QUIET, pool, folder, DAY, f"key-{what}", cache, cutoff)
        records = parts.complete()
        two = folder / f"{DAY}.parquet"
        assert write_entity_file(cache, parts.batches(), two, "customer_id", "f" * 16, as_of_time(DAY)) == rows
    assert len(records) == 2 and all(r["rows"] > 0 for r in records)  # both processes scored chunks
    assert sorted(c for r in records for c in r["chunks"]) == list(range(len(chunk_plan(cache, CHUNK))))
    a, b = pq.read_table(one), pq.read_table(two)
    assert a.num_rows == rows > 0 and a.equals(b)  # same rows, same order, every score bit for bit
    assert pq.ParquetFile(one).schema_arrow.equals(pq.ParquetFile(two).schema_arrow)


@pytest.mark.parametrize("start", ["auto", "spawn"])
def test_a_killed_process_leaves_the_previous_day_whole_and_a_rerun_finishes_it(world, tmp_path, start):
    cache, cutoff = world[0], world[1]
    folder = tmp_path / "out"
    path = folder / f"{DAY}.parquet"
    _one_process(world, "predict", path, cutoff - 7 * 86_400)  # the day's previous output (another cut-off)
    before = path.read_bytes()
    (tmp_path / "flags").mkdir()
    params = {**_params(world, "predict"), "flags": str(tmp_path / "flags")}
    with pytest.raises(PartsError, match=r"scoring process 1 \(pid \d+\) exited with status -9"):
        with Pool(Scorer(f"{HERE}:paced_scorer", {**params, "die": True}), 2, ["cpu", "cpu"], 1, start=start) as pool:
            _two_processes(world, pool, folder, path, cutoff, "key")
    assert path.read_bytes() == before  # not replaced, not touched
    assert sorted(p.name for p in folder.iterdir()) == [f".{DAY}.parts", f"{DAY}.parquet"]
    parts = Parts(staging(folder, DAY), "key", len(chunk_plan(cache, CHUNK)))
    kept = parts.complete()
    assert len(kept) == 1 and 0 < len(parts.todo()) < parts.chunks  # process 0's part; the child's chunk is missing
    with pytest.raises(PartsError, match="in no complete part"):
        next(parts.batches())
    assert not list(parts.path.glob(".*tmp-*"))  # the child's unfinished part was removed

    # the re-run: the same key keeps the complete part and scores only the missing chunks
    missing = parts.todo()
    with Pool(Scorer("habitus.models.serve.predict:scenario_scorer", _params(world, "predict")), 2, ["cpu", "cpu"], 1,
              start=start) as pool:
        rows, done = _two_processes(world, pool, folder, path, cutoff, "key")
    assert sum(d["chunks"] for d in done) == len(missing)
    one = tmp_path / "one.parquet"
    assert _one_process(world, "predict", one, cutoff) == rows
    assert pq.read_table(one).equals(pq.read_table(path))


def test_parts_of_another_job_are_dropped_and_a_partial_day_is_refused(tmp_path):
    parts = Parts(tmp_path / "p", "a", 3)
    batch = pa.record_batch({"entity_index": pa.array([1, 2], pa.int64())})
    parts.deal([0, 1])
    parts.write(lambda chunks: ((c, batch) for c in chunks), parts.taken())
    assert parts.todo() == [2]
    with pytest.raises(PartsError, match=r"chunks \[2\] \(1 of 3\)"):
        list(parts.batches())
    (tmp_path / "p" / "orphan.arrow").write_bytes(b"a part whose process died before its .part.json")
    assert Parts(tmp_path / "p", "a", 3).todo() == [2]  # the same job: kept
    assert not (tmp_path / "p" / "orphan.arrow").exists()
    assert Parts(tmp_path / "p", "b", 3).todo() == [0, 1, 2]  # another: started afresh
    with pytest.raises(PartsError, match="manifest is not this job's"):
        Parts.existing(tmp_path / "p", "a", 3)

    # a part whose bytes never reached the disk (renamed unsynced, then a power cut): scored again
    parts = Parts(tmp_path / "q", "a", 2)
    parts.deal([0, 1])
    record = parts.write(lambda chunks: ((c, batch) for c in chunks), parts.taken())
    assert parts.todo() == []
    (parts.path / record["file"]).write_bytes(b"")
    assert Parts(tmp_path / "q", "a", 2).todo() == [0, 1]


def test_the_executor_splits_the_cores_among_the_scoring_processes(monkeypatch):
    import habitus.resources.training.executor as ex

    plan = TrainingExecutor.inference_plan
    monkeypatch.setattr(ex, "cpu_cores", lambda: 16)
    assert plan(TrainingExecutor(device="cpu", inference_processes=4), "cpu", 9) == (["cpu"] * 4, 4)
    assert plan(TrainingExecutor(device="cpu", threads=1, inference_processes=3), "cpu", 9) == (["cpu"] * 3, 1)
    # by default one per 2 cores, while each gets two chunks: a small cache scores alone
    assert plan(TrainingExecutor(device="cpu"), "cpu", 40) == (["cpu"] * 8, 2)
    assert plan(TrainingExecutor(device="cpu"), "cpu", 5) == (["cpu"] * 2, 8)
    assert plan(TrainingExecutor(device="cpu"), "cpu", 1) == (["cpu"], 16)
    monkeypatch.setattr(ex, "cpu_cores", lambda: 2)
    assert plan(TrainingExecutor(device="cpu"), "cpu", 40) == (["cpu"], 2)  # this machine: one process
    import torch

    if torch.cuda.device_count() < 2:
        with pytest.raises(ExecutorError, match="GPU"):
            TrainingExecutor(device="cuda", inference_processes=2).inference_plan("cuda", 9)
