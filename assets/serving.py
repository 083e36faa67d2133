"""Which scenario checkpoint serves predictions: a version named by the scenario's pointer.

    <workspace>/checkpoints/scenarios/<name>/               the newest trained checkpoint, better or worse
    <workspace>/checkpoints/versions/<name>/<fp>/           every trained checkpoint, kept by fingerprint with
                                                            version.json (models/storage/versions.py)
    <workspace>/checkpoints/versions/<name>/serving.json    the pointer: the serving version and who served when

Each trained checkpoint becomes a version (`keep_version`) with its hold-out metric, best baseline, data
range, the foundation it was built on, and its hold-out score distribution (what the score drift check
compares a day's scores with). One that beats its baselines (the `beats_baselines` check's condition)
moves the pointer; one that loses leaves it, so the previous good model keeps serving. `rollback` moves
the pointer to any kept version. The newest `versions.keep` versions and every one that served are
kept (`versions.keep_served`); the serving one never goes. Each move also copies the serving version to
`checkpoints/passed/<name>/`, which uploads carry to machines that only score (resources/output.py). A
scenario with no pointer is served from that copy (a restored or older workspace), else from its newest
checkpoint, and the predictions say so.
"""

import shutil
from pathlib import Path

import dagster as dg

from habitus.models.storage.files import atomic_path, read_json
from habitus.models.storage.versions import VersionError, VersionStore

# the metadata line of a predictions or explanations run: which checkpoint scored
CHECKPOINT_NOTE = {True: "passed its check (beats_baselines)",
                   False: "has not beaten its baselines (the newest, none having passed, or chosen by a rollback)"}


def passed_path(workspace, name: str) -> Path:
    """A copy of the serving version (what an upload carries; served where no pointer is)."""
    return workspace.scenario(name).parent.parent / "passed" / name


def versions(workspace, name: str) -> VersionStore:
    return VersionStore(workspace.scenario(name).parent.parent / "versions" / name)


def scored_by(table, path: Path) -> str:
    """The fingerprint of the version that scored a predictions file (its `model_fingerprint` column), checked
    before it names a folder (models/storage/versions.py checked_fingerprint); dg.Failure naming the file."""
    from habitus.models.storage.versions import VersionError, checked_fingerprint

    fp = table.column("model_fingerprint")[0].as_py() if table.num_rows else None
    try:
        return checked_fingerprint(fp, f"{path}: model_fingerprint")
    except VersionError as e:
        raise dg.Failure(str(e)) from None


def version_info(config: dict, holdout_scores=None) -> dict:
    """What a version records about a checkpoint's config.json: the hold-out metric against the best
    baseline, the data it was trained on, its foundation, and its hold-out score distribution."""
    from habitus.assets.check_measures import baseline_margin
    from habitus.models.evaluate.drift import reference_distribution

    m = baseline_margin(config)
    protocol = config.get("protocol", {})
    cutoffs = protocol.get("train_cutoffs") or []
    return {"metric": m["metric"], "model": m["model"], "best_baseline": m["best_baseline"],
            "baseline": m["baseline"], "lower_is_better": m["lower_is_better"],
            "beats_baselines": bool(config.get("beats_baselines")),
            "data": {"first_train_cutoff": cutoffs[0] if cutoffs else None, "val_cutoff": protocol.get("val_cutoff"),
                     "test_cutoff": protocol.get("test_cutoff"), "cache_fingerprint": config.get("cache_fingerprint")},
            "foundation": (config.get("foundation_sha256") or "")[:16],
            "scores": reference_distribution(holdout_scores)}


def keep_version(workspace, name: str, holdout_scores=None, keep: int = 5, keep_served: bool = True) -> tuple[str, bool]:
    """Keep the newest checkpoint of `name` as a version; serve it when it beat its baselines; prune.
    Under the scenario's stage lock. Returns (fingerprint, whether it now serves)."""
    checkpoint = workspace.scenario(name)
    config = read_json(checkpoint / "config.json")
    fp = config["weights_sha256"][:16]
    store = versions(workspace, name)
    with workspace.lock(f"scenario/{name}"):
        store.add(checkpoint, fp, version_info(config, holdout_scores))
        if config.get("beats_baselines"):
            _serve(workspace, name, fp, "beat its baselines")
        store.prune(keep, keep_served)
    return fp, store.serving() == fp


def _serve(workspace, name: str, fp: str, why: str) -> None:
    """Move the pointer, then mirror the serving version into the passed folder: what an upload carries to
    a machine that only scores (resources/output.py), where no pointer is (serving_checkpoint falls back
    to it). Killed in between, the pointer already names the version; the next move mirrors again."""
    store = versions(workspace, name)
    store.serve(fp, why)
    with atomic_path(passed_path(workspace, name)) as tmp:
        shutil.copytree(store.path(fp), tmp)


def rollback(workspace, name: str, to: str | None = None, keep: int = 5, keep_served: bool = True) -> str:
    """Serve version `to` (a fingerprint or its unique prefix), or the one that served before the serving
    one. Returns the fingerprint now serving."""
    store = versions(workspace, name)
    with workspace.lock(f"scenario/{name}"):
        fp = store.resolve(to) if to else store.previous()
        _serve(workspace, name, fp, f"rollback from {store.serving()}")
        store.prune(keep, keep_served)
    return fp


def serving_checkpoint(workspace, name: str) -> tuple[Path, bool]:
    """(folder, passed): the version the pointer names; else the passed copy of an older workspace;
    else the newest checkpoint."""
    store = versions(workspace, name)
    try:
        fp = store.serving()
    except VersionError as e:
        raise dg.Failure(str(e)) from None
    if fp:
        return store.path(fp), bool(store.info(fp).get("beats_baselines"))
    passed = passed_path(workspace, name)
    if (passed / "config.json").exists():
        return passed, True
    return workspace.scenario(name), False


def serving_note(workspace, name: str) -> str:
    """One line for the scenario's metadata: which checkpoint predictions use now."""
    path, passed = serving_checkpoint(workspace, name)
    if not (path / "config.json").exists():
        return "no checkpoint yet"
    sha = read_json(path / "config.json")["weights_sha256"][:16]
    if path.parent.parent.name == "versions":
        return f"version {sha}" + ("" if passed else " (it has not beaten its baselines)")
    return f"passed checkpoint {sha}" if passed else f"newest checkpoint {sha} (none has beaten its baselines yet)"


def load_serving(workspace, cache, name: str, doing: str) -> tuple[dict, dict, bool]:
    """(state, config, passed) of the checkpoint serving scenario `name`; fails when the cache was
    rebuilt with other settings since it was trained (`doing`: what the caller is about to do)."""
    from habitus.models.nn.checkpoint import load_checkpoint

    checkpoint, passed = serving_checkpoint(workspace, name)
    state, config = load_checkpoint(checkpoint)
    if not cache.fits(config):
        raise dg.Failure(f"the cache was rebuilt with other settings since scenario {name!r} was trained (its ids "
                         f"differ); materialize foundation_model and scenario/{name} again before {doing}")
    return state, config, passed
