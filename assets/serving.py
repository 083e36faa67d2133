"""Which scenario checkpoint serves predictions: a version named by the scenario's pointer.

    <workspace>/checkpoints/scenarios/<name>/               the newest trained checkpoint, better or worse
    <workspace>/checkpoints/versions/<name>/<fp>/           every trained checkpoint, kept by fingerprint with
                                                            version.json (models/storage/versions.py), and
                                                            the baseline versions (kind "baseline")
    <workspace>/checkpoints/versions/<name>/serving.json    the pointer: the serving version and who served when
    <workspace>/checkpoints/versions/<name>/unservable-baselines.json    versions whose best baseline cannot serve

Each trained checkpoint becomes a version (`keep_version`) with its hold-out metric, best baseline, data
range, the foundation it was built on, the fingerprints of what trained it (cache, foundation, settings:
an unchanged scenario is not trained again) and its hold-out score distribution (what the score drift
check compares a day's scores with). One that beats its baselines (the `beats_baselines` check's
condition) moves the pointer; one that loses leaves it on the last version that beat them. A scenario
whose model has never beaten its best baseline serves that baseline (`serve_baseline`): LightGBM's
model fitted on the same cut-offs, or the rule that scored best (models/evaluate/baselines.py), kept as
a version of kind "baseline", so predictions are never worse than the best baseline measured.
`rollback` moves the pointer to any kept version. The newest `versions.keep` versions and every one
that served are kept (`versions.keep_served`); the serving one never goes. Each move also copies the
serving version to `checkpoints/passed/<name>/`, which uploads carry to machines that only score
(resources/store/output.py). A scenario with no pointer is served from that copy (a restored or older
workspace), else from its newest checkpoint, and the predictions say so.
"""

import shutil
from pathlib import Path

import dagster as dg

from habitus.models.storage.files import atomic_path, read_json
from habitus.models.storage.versions import VersionError, VersionStore

# the metadata line of a predictions or explanations run: which checkpoint scored
CHECKPOINT_NOTE = {True: "passed its check (beats_baselines)",
                   False: "has not beaten its baselines (chosen by a rollback, or the newest where none has and no "
                          "baseline model can serve)"}
BASELINE = "baseline"  # the kind of a version that serves a scenario's best baseline
NO_CHECKPOINT = "no checkpoint yet"


def is_baseline(config: dict) -> bool:
    """Whether a version's config.json is a baseline's (serve_baseline), not a trained network's."""
    return config.get("kind") == BASELINE


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


def version_info(config: dict, holdout_scores=None, trained_on: dict | None = None) -> dict:
    """What a version records about a checkpoint's config.json: the hold-out metric against the best
    baseline, the data it was trained on, its foundation, its hold-out score distribution, and
    `trained_on`: the fingerprints of what trained it ({cache, foundation, settings})."""
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
            "scores": reference_distribution(holdout_scores), "kind": config.get("kind") or "scenario",
            "trained_on": trained_on}


def keep_version(workspace, name: str, holdout_scores=None, keep: int = 5, keep_served: bool = True,
                 trained_on: dict | None = None) -> tuple[str, bool]:
    """Keep the newest checkpoint of `name` as a version; serve it when it beat its baselines; prune.
    Under the scenario's stage lock. Returns (fingerprint, whether it now serves)."""
    checkpoint = workspace.scenario(name)
    config = read_json(checkpoint / "config.json")
    fp = config["weights_sha256"][:16]
    store = versions(workspace, name)
    with workspace.lock(f"scenario/{name}"):
        store.add(checkpoint, fp, version_info(config, holdout_scores, trained_on))
        if config.get("beats_baselines"):
            _serve(workspace, name, fp, "beat its baselines")
        store.prune(keep, keep_served)
    return fp, store.serving() == fp


def _serve(workspace, name: str, fp: str, why: str) -> None:
    """Move the pointer, then mirror the serving version into the passed folder: what an upload carries to
    a machine that only scores (resources/store/output.py), where no pointer is (serving_checkpoint falls back
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
    """One line for the scenario's metadata: which checkpoint predictions use now, and why."""
    path, passed = serving_checkpoint(workspace, name)
    if not (path / "config.json").exists():
        return NO_CHECKPOINT
    config = read_json(path / "config.json")
    sha = config["weights_sha256"][:16]
    if is_baseline(config):
        return f"baseline version {sha} ({config['baseline']}, which no trained model has beaten)"
    if path.parent.parent.name == "versions":
        return f"version {sha}" + ("" if passed else " (it has not beaten its baselines)")
    return f"passed checkpoint {sha}" if passed else f"newest checkpoint {sha} (none has beaten its baselines yet)"


def load_serving(workspace, cache, name: str, doing: str) -> tuple[dict, dict, bool]:
    """(state, config, passed) of the checkpoint serving scenario `name`; fails when the cache was
    rebuilt with other settings since it was trained (`doing`: what the caller is about to do)."""
    from habitus.models.nn.checkpoint import load_checkpoint

    checkpoint, passed = serving_checkpoint(workspace, name)
    if (checkpoint / "config.json").exists() and is_baseline(read_json(checkpoint / "config.json")):
        raise dg.Failure(f"scenario {name!r} is served by its best baseline ({serving_note(workspace, name)}), "
                         f"which has no network for {doing}; it serves until a trained model beats it (or "
                         f"`habitus rollback {name} --to <version>`)")
    state, config = load_checkpoint(checkpoint)
    if not cache.fits(config):
        raise dg.Failure(f"the cache was rebuilt with other settings since scenario {name!r} was trained (its ids "
                         f"differ); materialize foundation_model and scenario/{name} again before {doing}")
    return state, config, passed


def serves_baseline(workspace, name: str) -> dict | None:
    """The config.json of the baseline version serving scenario `name`; None when a network serves."""
    path, _ = serving_checkpoint(workspace, name)
    config = read_json(path / "config.json") if (path / "config.json").exists() else {}
    return config if is_baseline(config) else None


def needs_baseline(workspace, name: str) -> bool:
    """Whether the scenario should serve its best baseline: no version that beat its baselines has the
    pointer (none serves, or a baseline does). A version a rollback chose stays where it is."""
    store = versions(workspace, name)
    fp = store.serving()
    return fp is None or store.info(fp).get("kind") == BASELINE


def baseline_left_unserved(workspace, name: str, fingerprint: str) -> bool:
    """Whether kept version `fingerprint` lost to its baselines, no beaten version serves, and it was kept
    after the pointer last moved (or none has served): what a run killed between keeping that version
    and serving its best baseline leaves. A rollback since then moved the pointer later, and stays."""
    store = versions(workspace, name)
    info, history = store.info(fingerprint), store.pointer()["history"]
    kept_since = not history or info.get("added", "") > history[-1]["from"]
    return (kept_since and not info.get("beats_baselines") and needs_baseline(workspace, name)
            and store.unservable_baseline(fingerprint) is None)  # (found unservable: not fitted again each run)


def serve_baseline(workspace, name: str, checkpoint_config: dict, fit, keep: int = 5, keep_served: bool = True,
                   trained_on: dict | None = None, probe=None) -> str | None:
    """Keep the best baseline of the checkpoint's hold-out (`checkpoint_config`: the config.json of the
    scenario's newest checkpoint) as a version of kind "baseline" and serve it. `fit(folder)` saves the
    LightGBM baseline into `folder` (models/evaluate/baselines.save_lightgbm) and returns what the config
    records of it, None where no model can be saved. `probe(config, folder)`: scores a little with
    the version before it serves, raising KeyError where the task has no such rule to serve. Returns the
    version's fingerprint, or None when the best baseline cannot be served: nothing serves differently,
    and the checkpoint's version records why, so a run that trains nothing does not fit it again."""
    import tempfile

    from habitus.assets.check_measures import baseline_margin
    from habitus.models.storage.files import combine, write_json

    m = baseline_margin(checkpoint_config)
    best = m["best_baseline"]
    if best is None:
        return None
    keys = ("scenario", "task", "label_values", "feature_spec", "foundation_sha256", "cache_fingerprint",
            "cache_lineage", "protocol", "metrics", "headline")
    config = {**{k: checkpoint_config.get(k) for k in keys}, "kind": BASELINE, "baseline": best,
              "beats_baselines": False, "constant": (checkpoint_config.get("training") or {}).get("val_target_mean")}
    report = checkpoint_config["metrics"]  # what serves is the baseline: its hold-out figures are the "model"'s
    config["metrics"] = {**{k: v for k, v in report.items() if k not in ("head", "network")},
                         "model": report["baselines"][best], "trained_model": report["model"]}
    store, staging = versions(workspace, name), workspace.scenario(name).parent
    staging.mkdir(parents=True, exist_ok=True)

    def unservable(why: str) -> None:
        with workspace.lock(f"scenario/{name}"):
            store.mark_unservable_baseline(checkpoint_config["weights_sha256"][:16], why)

    with tempfile.TemporaryDirectory(dir=staging, prefix=f".baseline-{name}-") as tmp:
        if best == "lightgbm":
            saved = fit(Path(tmp))
            if saved is None:
                unservable("lightgbm: no model could be saved")
                return None
            config["lightgbm"] = saved
            config["weights_sha256"] = saved["sha256"]
        else:  # a rule: what it is and what it reads
            config["weights_sha256"] = combine(BASELINE, best, config["task"], config["constant"],
                                               config["cache_fingerprint"])
        write_json(Path(tmp) / "config.json", config)
        try:
            if probe is not None:
                probe(config, Path(tmp))
        except KeyError:  # a baseline of the hold-out that is no servable rule (LightGBM on some labels only)
            unservable(f"{best}: no rule of the task serves it")
            return None
        fp = config["weights_sha256"][:16]
        info = version_info(config, None, trained_on)
        with workspace.lock(f"scenario/{name}"):
            store.add(tmp, fp, info)  # the same baseline fitted again: the version kept already
            _serve(workspace, name, fp, f"the model has not beaten its best baseline ({best}): the baseline serves")
            store.prune(keep, keep_served)
    return fp


def trained_with(workspace, name: str, trained_on: dict) -> str | None:
    """The newest trained version (not a baseline) whose cache, foundation and settings fingerprints are
    `trained_on`, or None."""
    store = versions(workspace, name)
    for fp in reversed(store.fingerprints()):
        info = store.info(fp)  # (one read of the version's record)
        if info.get("kind") != BASELINE and info.get("trained_on") == trained_on:
            return fp
    return None


def unchanged(workspace, name: str, trained_on: dict) -> str | None:
    """The version (the serving one, else the newest trained) whose cache, foundation and settings
    fingerprints are `trained_on`: training again would make the same model. None: train."""
    store = versions(workspace, name)
    trained = [fp for fp in store.fingerprints() if store.info(fp).get("kind") != BASELINE]
    for fp in [store.serving()] + trained[-1:]:
        if fp and store.info(fp).get("trained_on") == trained_on:
            return fp
    return None


def versions_table(store) -> str:
    """The kept versions of a scenario, oldest first: when trained (or fitted, for a baseline), what it is
    (a trained model, or a baseline: which), the hold-out metric against the best baseline, the foundation
    it was built on, and from when to when it served (* serves now)."""
    pointer = store.pointer()
    spans: dict[str, list[str]] = {}
    for h in pointer["history"]:
        spans.setdefault(h["fingerprint"], []).append(f"{h['from'][:16]} .. {(h['to'] or 'now')[:16]}")
    lines = [f"{'':2}{'version':<17} {'trained (UTC)':<17} {'kind':<20} {'metric':<12} {'value':>9} "
             f"{'best baseline':>24} {'beats':<6}{'foundation':<17} served"]
    for fp in store.fingerprints():
        v = store.info(fp)
        baseline = f"{v.get('best_baseline')}: {v['baseline']:.4f}" if v.get("best_baseline") else "-"
        kind = f"baseline {v['best_baseline']}" if v.get("kind") == BASELINE else "model"
        beats = "-" if v.get("kind") == BASELINE else "yes" if v["beats_baselines"] else "no"
        lines.append(f"{'*' if fp == pointer['serving'] else '':2}{fp:<17} {v['added'][:16]:<17} {kind[:20]:<20} "
                     f"{v['metric']:<12} {v['model']:>9.4f} {baseline:>24} {beats:<6}"
                     f"{v.get('foundation') or '-':<17} {', '.join(spans.get(fp, [])) or 'never'}")
    return "\n".join(lines)


def serving_line(workspace, name: str) -> str:
    """What serves scenario `name` and why: `<name>: serving <what> (<why>); <n> version(s) kept`."""
    store = versions(workspace, name)
    history = store.pointer()["history"]
    baseline = store.serving() and store.info(store.serving()).get("kind") == BASELINE  # its note says why
    why = f" ({history[-1]['why']})" if store.serving() and history and not baseline else ""
    kept, note = len(store.fingerprints()), serving_note(workspace, name)
    if note == NO_CHECKPOINT:
        return f"{name}: not trained yet (materialize scenario/{name})"
    return f"{name}: serving the {note}{why}; {kept} version(s) kept"


def rollback_hint(workspace, name: str) -> str:
    """What a rollback without --to that has nothing to go back to should say: the versions --to takes."""
    store = versions(workspace, name)
    others = [fp for fp in store.fingerprints() if fp != store.serving()]
    if not others:
        return f"; no other version is kept (materialize scenario/{name} to train one)"
    return (f"; pass the version to serve with --to, e.g. `habitus rollback {name} --to {others[-1]}` (kept: "
            f"{', '.join(others)}; `habitus versions {name}` lists them)")
