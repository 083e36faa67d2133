"""Foundation versions: every trained foundation checkpoint kept by fingerprint, the newest one serving.

    <workspace>/checkpoints/foundation/                          the foundation in use: what scenarios start
                                                                 from and embeddings are computed with
    <workspace>/checkpoints/foundation_versions/<fp>/            every trained checkpoint, copied once, with
                                                                 version.json (models/storage/versions.py)
    <workspace>/checkpoints/foundation_versions/serving.json     the pointer: the version in use, and who
                                                                 served when

The versions live in a folder of their own, next to `checkpoints/versions/` (the scenarios' versions,
one folder per scenario name) rather than inside it: no scenario name can ever reach it, whatever names
the config allows. `habitus versions foundation` and `habitus rollback foundation` name this store;
config validation refuses a scenario called `foundation` (pipelines/config/project.py), so that word is never
ambiguous on the command line or in the `rollback` job's config.

A foundation has no baseline, so there is no gate: each training keeps its checkpoint as a version and
moves the pointer to it. The newest `versions.keep` versions and (with `versions.keep_served`) every one
that served are kept; the serving one never goes. `rollback_foundation` copies a kept version (its
checkpoint, without version.json) into `checkpoints/foundation/` by one atomic exchange
(models/storage/files.py's atomic_path), then moves the pointer, all under the foundation stage lock:
a process killed at any point leaves `checkpoints/foundation/` holding one whole checkpoint, the old or
the chosen one, and running the same rollback again completes it. Scenarios trained afterwards start
from the rolled-back foundation, embeddings are computed with it; kept scenario versions carry their own
trunk and go on scoring unchanged.
"""

import shutil

from habitus.models.storage.files import atomic_path, read_json
from habitus.models.storage.versions import INFO, VersionStore

NAME = "foundation"  # what `habitus versions` / `habitus rollback` and the rollback job call this store


def foundation_versions(workspace) -> VersionStore:
    return VersionStore(workspace.foundation.parent / "foundation_versions")


def in_use(workspace) -> str | None:
    """The fingerprint of the checkpoint in `checkpoints/foundation/` (None when there is none)."""
    config = workspace.foundation / "config.json"
    return read_json(config)["weights_sha256"][:16] if config.exists() else None


def foundation_info(config: dict) -> dict:
    """What a version records about a foundation checkpoint's config.json: the data window it was trained
    on, its final losses, the cache version, how long it trained, and the settings that trained it."""
    curves, training = config.get("curves") or {}, config.get("training") or {}

    def last(key):
        values = curves.get(key) or []
        return float(values[-1]) if values else None

    return {"data": {**(config.get("data_window") or {}), "cache_fingerprint": config.get("cache_fingerprint")},
            "final_train_loss": last("train_loss"), "final_validation_loss": last("val_loss"),
            "training": {k: training.get(k) for k in ("seconds", "steps", "device")},
            "config": config.get("config") or {}}


def keep_foundation_version(workspace, keep: int = 5, keep_served: bool = True) -> str:
    """Keep the checkpoint in `checkpoints/foundation/` as a version, serve it (the newest trained one
    serves), prune. Under the foundation stage lock (the asset holds it already: the lock is reentrant).
    Returns its fingerprint."""
    store = foundation_versions(workspace)
    with workspace.lock(NAME):
        config = read_json(workspace.foundation / "config.json")
        fp = config["weights_sha256"][:16]
        store.add(workspace.foundation, fp, foundation_info(config))
        store.serve(fp, "trained")
        store.prune(keep, keep_served)
    return fp


def rollback_foundation(workspace, to: str | None = None, keep: int = 5, keep_served: bool = True) -> str:
    """Put version `to` (a fingerprint or its unique prefix), or the one that served before the serving
    one, back into `checkpoints/foundation/` and serve it. Returns its fingerprint."""
    store = foundation_versions(workspace)
    with workspace.lock(NAME, what="foundation rollback"):
        workspace.recover_stage(NAME)  # what a killed training or rollback left next to the checkpoint
        fp = store.resolve(to) if to else store.previous()
        before = store.serving()
        with atomic_path(workspace.foundation) as tmp:  # the old checkpoint or the chosen one, never a mix
            shutil.copytree(store.path(fp), tmp, ignore=shutil.ignore_patterns(INFO))
        store.serve(fp, f"rollback from {before}")
        store.prune(keep, keep_served)
    return fp


def foundation_table(store, current: str | None = None) -> str:
    """The kept foundation versions, oldest first: when trained, final losses, the data window, and from
    when to when each served (* serves now; `current`: the fingerprint in checkpoints/foundation/, marked
    `!` where a killed rollback left it differing from the pointer)."""
    pointer = store.pointer()
    spans: dict[str, list[str]] = {}
    for h in pointer["history"]:
        spans.setdefault(h["fingerprint"], []).append(f"{h['from'][:16]} .. {(h['to'] or 'now')[:16]}")

    def loss(v):
        return f"{v:.4f}" if isinstance(v, (int, float)) else "-"

    lines = [f"{'':2}{'version':<17} {'trained (UTC)':<17} {'train loss':>10} {'val loss':>10} "
             f"{'data (first cut-off .. last target)':<38} {'steps':>7} served"]
    for fp in store.fingerprints():
        v = store.info(fp)
        data, training = v.get("data") or {}, v.get("training") or {}
        window = f"{str(data.get('first_cutoff'))[:16]} .. {str(data.get('last_target_time'))[:16]}"
        mark = "*" if fp == pointer["serving"] else ("!" if fp == current else "")
        lines.append(f"{mark:2}{fp:<17} {v['added'][:16]:<17} {loss(v.get('final_train_loss')):>10} "
                     f"{loss(v.get('final_validation_loss')):>10} {window:<38} {str(training.get('steps') or '-'):>7} "
                     f"{', '.join(spans.get(fp, [])) or 'never'}")
    return "\n".join(lines)
