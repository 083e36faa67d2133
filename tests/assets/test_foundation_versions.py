"""Foundation versions: every trained foundation checkpoint kept by fingerprint, the newest one serving,
rollback putting a kept version back into checkpoints/foundation/ (CLI and the `rollback` job), pruning
that keeps the serving one. Checkpoints are folders written as save_checkpoint writes them (no training)."""

import hashlib
import json

import pytest

from habitus.assets.foundation_versions import foundation_table, foundation_versions, in_use, \
    keep_foundation_version, rollback_foundation
from habitus.models.storage.files import atomic_path
from habitus.models.storage.versions import INFO, VersionError
from habitus.pipelines.cli import main
from habitus.pipelines.config.project import ConfigError, load_project
from habitus.resources.store.workspace import Workspace


def train(ws: Workspace, n: int, keep: int = 5, keep_served: bool = True) -> str:
    """A foundation checkpoint written whole into checkpoints/foundation/, then kept as the asset keeps it."""
    weights = bytes([n]) * 64
    with atomic_path(ws.foundation) as tmp:
        tmp.mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(weights)
        (tmp / "config.json").write_text(json.dumps({
            "kind": "foundation", "weights_sha256": hashlib.sha256(weights).hexdigest(), "cache_fingerprint": "c" * 64,
            "config": {"hidden": 32, "epochs": n},
            "data_window": {"first_cutoff": "2026-05-01T00:00:00Z", "last_cutoff": f"2026-06-{n:02d}T00:00:00Z",
                            "last_target_time": f"2026-07-{n:02d}T00:00:00Z"},
            "curves": {"train_loss": [2.0, 1.0 / n], "val_loss": [2.5, 1.5 / n]},
            "training": {"seconds": 1.5 * n, "steps": 10 * n, "device": "cpu"}}))
    return keep_foundation_version(ws, keep, keep_served)


@pytest.fixture
def ws(tmp_path):
    return Workspace(root=str(tmp_path / "ws"))


def test_each_training_is_a_version_and_serves(ws):
    fps = [train(ws, n) for n in (1, 2, 3)]
    store = foundation_versions(ws)
    assert store.fingerprints() == fps and store.serving() == fps[2] == in_use(ws)
    assert store.folder == ws.foundation.parent / "foundation_versions"  # beside, not among, scenario versions
    info = store.info(fps[0])
    assert info["data"] == {"first_cutoff": "2026-05-01T00:00:00Z", "last_cutoff": "2026-06-01T00:00:00Z",
                            "last_target_time": "2026-07-01T00:00:00Z", "cache_fingerprint": "c" * 64}
    assert (info["final_train_loss"], info["final_validation_loss"]) == (1.0, 1.5)
    assert info["training"] == {"seconds": 1.5, "steps": 10, "device": "cpu"} and info["config"]["epochs"] == 1
    assert sorted(p.name for p in store.path(fps[0]).iterdir()) == ["config.json", "model.safetensors", INFO]
    table = foundation_table(store, in_use(ws)).splitlines()
    assert len(table) == 4 and table[3].startswith(f"* {fps[2]}") and "0.3333" in table[3]
    assert "2026-05-01T00:00 .. 2026-07-01T00:00" in table[1] and "now" not in table[1]


def test_rollback_restores_the_bytes_of_the_chosen_version(ws):
    a, b, c = (train(ws, n) for n in (1, 2, 3))
    store = foundation_versions(ws)
    kept_config = (store.path(a) / "config.json").read_bytes()
    assert rollback_foundation(ws, to=a[:6]) == a
    assert (ws.foundation / "model.safetensors").read_bytes() == bytes([1]) * 64
    assert (ws.foundation / "config.json").read_bytes() == kept_config
    assert not (ws.foundation / INFO).exists()  # the checkpoint as training wrote it
    assert store.serving() == a == in_use(ws)
    assert rollback_foundation(ws) == c  # no --to: the one that served before
    assert (ws.foundation / "model.safetensors").read_bytes() == bytes([3]) * 64
    assert store.pointer()["history"][-2]["why"] == f"rollback from {c}"
    with pytest.raises(VersionError, match="names no version"):
        rollback_foundation(ws, to="nothing")
    assert train(ws, 4) == store.serving()  # a training moves the pointer again
    assert b in store.fingerprints()


def test_pruning_keeps_the_serving_one(ws):
    a, b, c = (train(ws, n, keep=2, keep_served=False) for n in (1, 2, 3))
    store = foundation_versions(ws)
    assert store.fingerprints() == [b, c]  # the newest two
    assert rollback_foundation(ws, to=b, keep=1, keep_served=False) == b
    assert store.fingerprints() == [b, c] and store.serving() == b  # the newest one, and the serving one
    d = train(ws, 4, keep=1)  # keep_served: every one that served stays (each training served)
    assert store.fingerprints() == [b, c, d]
    e = train(ws, 5, keep=1, keep_served=False)
    assert store.fingerprints() == [e] and in_use(ws) == e
    assert a not in store.fingerprints()


def test_the_cli_and_the_job_roll_the_foundation_back(ws, tmp_path, small_project, capsys, monkeypatch, instance):
    from habitus.pipelines.definitions import build_definitions

    config = small_project.write(tmp_path, small_project.config(scenarios={"churn": small_project.churn()}))
    monkeypatch.setenv("HABITUS_CONFIG", str(config))
    a, b = train(ws, 1), train(ws, 2)
    assert main(["versions", "foundation", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert f"foundation: 2 version(s) kept, serving {b}" in out and a in out
    assert main(["rollback", "foundation", "--config", str(config)]) == 0
    assert f"version {a} is in checkpoints/foundation/" in capsys.readouterr().out
    assert in_use(ws) == a
    assert main(["rollback", "foundation", "--to", "ffff", "--config", str(config)]) == 2
    job = build_definitions(load_project(config)).resolve_job_def("rollback")
    run = {"ops": {"move_serving_pointer": {"config": {"scenario": "foundation", "to": b}}}}
    result = job.execute_in_process(run_config=run, instance=instance)
    assert result.success and result.output_for_node("move_serving_pointer") == b
    assert in_use(ws) == b == foundation_versions(ws).serving()


def test_a_scenario_cannot_be_named_foundation(tmp_path, small_project):
    with pytest.raises(ConfigError, match="and not 'foundation'"):
        load_project(small_project.write(tmp_path, small_project.config(scenarios={"foundation": small_project.churn()})))


def test_the_asset_keeps_each_training_and_a_rollback_puts_it_back(tmp_path, small_project, instance):
    """Two trainings of foundation_model (other epochs: other weights) on a small warehouse."""
    import dagster as dg
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from habitus.models.storage.files import file_sha256
    from habitus.pipelines.orchestration.build import build_assets, build_resources

    config = small_project.write(tmp_path, small_project.config(), customers=300, products=30, stores=2,
                                 start="2026-07-01", end="2026-09-30", seed=5)
    fps, kept = [], []
    for epochs in (1, 2):
        project = load_project(config)
        project = project.model_copy(update={"foundation": project.foundation.model_copy(update={"epochs": epochs})})
        assets, resources = build_assets(project), build_resources(project)
        selection = [dg.AssetKey("foundation_model")]
        if not fps:  # the sources (every partition of the events in one run) and the cache, once
            purchases = dg.AssetKey(["source", "purchases"])
            keys = next(a for a in assets if a.key == purchases).partitions_def.get_partition_keys()
            assert dg.materialize(assets, selection=[purchases], resources=resources, instance=instance, tags={
                ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]}).success
            selection += [dg.AssetKey(["source", n]) for n in ("customers", "products")] + [dg.AssetKey("cache")]
        result = dg.materialize(assets, selection=selection, resources=resources, instance=instance)
        assert result.success
        ws = resources["workspace"]
        fps.append(in_use(ws))
        kept.append(file_sha256(ws.foundation / "model.safetensors"))
    store = foundation_versions(ws)
    assert store.fingerprints() == fps and store.serving() == fps[1] and fps[0] != fps[1]
    info = store.info(fps[0])
    assert info["config"]["epochs"] == 1 and info["final_validation_loss"] > 0 and info["training"]["steps"] > 0
    assert info["data"]["last_target_time"] and info["data"]["cache_fingerprint"]
    assert rollback_foundation(ws) == fps[0]
    assert file_sha256(ws.foundation / "model.safetensors") == kept[0]
