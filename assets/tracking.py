"""The hooks of the `mlflow:` block (resources/training/mlflow_tracking.py) in the assets and the rollback: each a no-op
when the block is not set. Training checks the client is installed before it starts, logs after the checkpoint
and its version are written (a run that finds nothing to train logs what the server lacks); the alias follows the
serving pointer after each training and rollback."""

import dagster as dg

from habitus.assets.serving import rollback, versions
from habitus.resources.training.mlflow_tracking import MlflowMissing, Tracker, require


def check_installed(settings) -> None:
    """Before a training starts: the `mlflow:` block set and its client missing fails the asset."""
    try:
        require(settings)
    except MlflowMissing as e:
        raise dg.Failure(str(e)) from None


def track_foundation(settings, digest: str, checkpoint: dict, warn) -> None:
    """A run of the foundation training saved with `checkpoint` (its config.json) and fingerprint `digest`."""
    if settings is None:
        return
    window, training = checkpoint.get("data_window", {}), checkpoint.get("training", {})
    tags = {"habitus.fingerprint": digest[:16], "habitus.cache_fingerprint": checkpoint.get("cache_fingerprint", "")[:16],
            **{f"habitus.data.{k}": v for k, v in window.items()},
            **{f"habitus.training.{k}": v for k, v in training.items()}}
    Tracker(settings, warn).log_foundation(checkpoint.get("config", {}), checkpoint.get("curves", {}), tags)


def complete_foundation_record(settings, digest: str, checkpoint: dict, warn) -> None:
    """A foundation not trained again: its run logged when the server has none (the server unreachable when it was
    trained, or a run killed between saving the checkpoint and logging it)."""
    if settings is not None and Tracker(settings, warn).foundation_logged(digest[:16]) is False:
        track_foundation(settings, digest, checkpoint, warn)


def track_scenario(settings, workspace, name: str, scenario_settings: dict, fingerprint: str, warn) -> None:
    """A run of scenario `name`'s training, its kept version registered, and the alias on the serving one."""
    if settings is None:
        return
    store = versions(workspace, name)
    tracker = Tracker(settings, warn)
    tracker.log_scenario(name, scenario_settings, store.path(fingerprint), fingerprint)
    tracker.follow_pointer(name, store.serving())


def complete_scenario_record(settings, workspace, name: str, scenario_settings: dict, fingerprint: str,
                             warn) -> None:
    """A scenario not trained again: its version `fingerprint` logged and registered, and the alias moved, when
    the server lacks it (as complete_foundation_record)."""
    if settings is not None and Tracker(settings, warn).registered(name, fingerprint) is False:
        track_scenario(settings, workspace, name, scenario_settings, fingerprint, warn)


def tracked_rollback(settings, workspace, name: str, to: str | None, keep: int, keep_served: bool, warn) -> str:
    """assets/serving.py's rollback; with the `mlflow:` block set, the alias follows the pointer (the client
    checked first: a missing one fails before the pointer moves)."""
    require(settings)
    fp = rollback(workspace, name, to, keep, keep_served)
    if settings is not None:
        Tracker(settings, warn).follow_pointer(name, versions(workspace, name).serving())
    return fp
