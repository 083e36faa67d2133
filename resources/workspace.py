"""The workspace: a POSIX folder holding extracted sources, the cache, checkpoints and predictions.

    <root>/sources/<name>/<partition>.parquet
    <root>/cache/<fingerprint16>/...          (see models.cache)   + cache/current.json
    <root>/checkpoints/foundation/             model.safetensors + config.json
    <root>/checkpoints/scenarios/<name>/
    <root>/predictions/<name>/<day>.parquet
    <root>/embeddings/<day>.parquet            the foundation model's entity representations
    <root>/resume/<stage>/latest/              resumable training state (models.resume)
    <root>/locks/<stage>.lock                  one lock per artifact/stage (models.locks)
"""

import functools
import re
import shutil
from pathlib import Path

import dagster as dg

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
HEADROOM = 1.2


class WorkspaceError(ValueError):
    pass


def locked(name: str):
    """Decorator for an asset's body: hold `workspace.lock(name)` while it runs, so a second run that
    reaches the same stage (a sensor's run during a backfill) waits and is told who holds it.

        @dg.asset(...)
        @locked("foundation")
        def foundation_model(context, workspace: Workspace, ...): ...
    """
    def wrap(fn):
        @functools.wraps(fn)  # Dagster reads the wrapped function's signature (context, resources)
        def body(context, *args, **kwargs):
            workspace = kwargs.get("workspace") or context.resources.workspace
            with workspace.lock(name, log=context.log.info, what=f"dagster run {context.run_id}"):
                # what a killed run of this stage left behind goes before anything new is written
                for note in workspace.recover_stage(name):
                    context.log.info(f"cleaned up after a killed run: {note}")
                return fn(context, *args, **kwargs)
        return body
    return wrap


class Workspace(dg.ConfigurableResource):
    root: str
    lock_timeout_s: float = 6 * 3600.0  # how long a run waits for another run holding the same stage

    @property
    def path(self) -> Path:
        if _URL.match(self.root):
            raise WorkspaceError(f"workspace {self.root!r} is object storage; the workspace must be a POSIX path on "
                                 f"a real filesystem (the cache is memory-mapped, checkpoints are renamed into place)")
        return Path(self.root)

    def sources(self, name: str) -> Path:
        return self._child("sources", name)

    @property
    def cache_root(self) -> Path:
        return self._child("cache")

    @property
    def foundation(self) -> Path:
        return self._child("checkpoints", "foundation")

    def scenario(self, name: str) -> Path:
        return self._child("checkpoints", "scenarios", name)

    def predictions(self, name: str) -> Path:
        return self._child("predictions", name)

    @property
    def embeddings(self) -> Path:
        return self._child("embeddings")

    def resume(self, *stage: str) -> Path:
        """Where a training stage keeps its resumable state: resume("foundation"), resume("scenarios", name)."""
        return self._child("resume", *stage)

    def lock(self, name: str, *, log=None, what: str = "", timeout_s: float | None = None):
        """An exclusive lock on one artifact/stage of this workspace (see models.locks), for `with`:

            with workspace.lock("foundation", log=context.log.info, what=context.run_id):

        Waits up to `timeout_s` (default `lock_timeout_s`) for another run holding it, telling `log`
        who that is; a lock left by a killed process is taken over."""
        from models.locks import ArtifactLock

        return ArtifactLock(self._child("locks"), name, timeout_s=self.lock_timeout_s if timeout_s is None else timeout_s,
                            what=what, log=log or (lambda _: None))

    def stage_paths(self, name: str) -> list[Path]:
        """What the stage locked as `name` writes (its lock keeps every other writer out of these)."""
        kind, _, item = name.partition("/")
        checkpoints = self._child("checkpoints")
        if kind == "source" and item:
            return [self.sources(item)]
        if kind == "cache":
            return [self.cache_root]
        if kind == "foundation":
            return [self.foundation, checkpoints / "foundation_loss.png", self.resume("foundation")]
        if kind == "scenario" and item:
            folder = self.scenario(item)
            return [folder, folder.parent / f"{item}_loss.png", folder.parent / f"{item}_lift.png",
                    checkpoints / "passed" / item, self.resume("scenarios", item)]
        if kind == "predictions" and item:
            return [self.predictions(item)]
        if kind == "embeddings":
            return [self.embeddings]
        return []

    def recover_stage(self, name: str) -> list[str]:
        """Clean up after a killed run of the stage `name` (models.storage.recover): its temporary copies
        are removed, an old folder it moved aside is put back. Call it holding the stage's lock: then
        no other run writes there, whichever machine or container it runs in."""
        from models.storage import recover, recover_tree

        notes = []
        for path in self.stage_paths(name):
            notes += recover(path) + recover_tree(path)
        return notes

    def _child(self, *parts: str) -> Path:
        for p in parts:  # names come from the config: keep them inside the workspace
            if p in ("", ".", "..") or "/" in p or "\\" in p:
                raise WorkspaceError(f"name {p!r} cannot be used as a workspace folder")
        return self.path.joinpath(*parts)

    def ensure_space(self, needed_bytes: int, what: str) -> dict:
        """Refuse to start when the free space is below what the step needs plus 20% headroom."""
        self.path.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.path).free
        need = int(needed_bytes * HEADROOM)
        if free < need:
            raise WorkspaceError(f"not enough free space in the workspace {self.path} for {what}: "
                                 f"{free / 1e9:.2f} GB free, {need / 1e9:.2f} GB needed "
                                 f"({needed_bytes / 1e9:.2f} GB + 20% headroom); free space or move the workspace")
        return {"free_gb": round(free / 1e9, 3), "needed_gb": round(need / 1e9, 3)}
