"""Which scenario checkpoint serves predictions: the newest one that beat its baselines.

    <workspace>/checkpoints/scenarios/<name>/   the newest trained checkpoint, better or worse
    <workspace>/checkpoints/passed/<name>/      a copy of the newest one that beat its baselines on the
                                                hold-out (the `beats_baselines` check's condition)

A retrained scenario that loses to its baselines leaves the passed copy alone, so the previous good
model keeps serving. A scenario that has never passed is served from its newest checkpoint, and the
predictions say so in their metadata (its blocking check fails in every run that trains it).
"""

import shutil
from pathlib import Path

import dagster as dg

from habitus.models.storage.files import atomic_path, read_json

# the metadata line of a predictions or explanations run: which checkpoint scored
CHECKPOINT_NOTE = {True: "passed its check (beats_baselines)",
                   False: "newest: no checkpoint has beaten its baselines yet"}


def passed_path(workspace, name: str) -> Path:
    return workspace.scenario(name).parent.parent / "passed" / name


def promote(workspace, name: str) -> Path:
    """Copy the newest checkpoint of `name` to the passed folder (whole or not at all)."""
    dest = passed_path(workspace, name)
    with atomic_path(dest) as tmp:
        shutil.copytree(workspace.scenario(name), tmp)
    return dest


def serving_checkpoint(workspace, name: str) -> tuple[Path, bool]:
    """(folder, passed): the passed copy when there is one, else the newest checkpoint."""
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
