"""The workspace: a POSIX folder holding extracted sources, the cache, checkpoints and predictions.

    <root>/sources/<name>/<partition>.parquet
    <root>/cache/<fingerprint16>/...          (see habitus.models.cache)   + cache/current.json
    <root>/checkpoints/foundation/             model.safetensors + config.json
    <root>/checkpoints/foundation_versions/    every trained foundation, kept (assets/foundation_versions.py)
    <root>/checkpoints/scenarios/<name>/
    <root>/predictions/<name>/<day>.parquet
    <root>/embeddings/<day>.parquet            the foundation model's entity representations
    <root>/resume/<stage>/latest/              resumable training state (habitus.models.train.resume)
    <root>/locks/<stage>.lock                  one lock per artifact/stage (habitus.models.storage.locks)

With `output` set (the project's `output:`), each stage uploads what it wrote once its body has
returned (resources/store/output.py): after training, never during it.
"""

import functools
import re
from pathlib import Path

import dagster as dg

from habitus.resources.store.space import HEADROOM, WorkspaceError, ensure_space  # noqa: F401 (both are imported from here)

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


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
                result = fn(context, *args, **kwargs)
                if workspace.output:  # what the stage finished goes to `output:` (resources/store/output.py)
                    try:
                        workspace.upload_stage(name, log=context.log.info)
                    except Exception as e:  # noqa: BLE001 (the store's errors come in many types)
                        from habitus.resources.store.redaction import redact_text, redact_url, url_secrets

                        raise dg.Failure(f"{name}: uploading to {redact_url(workspace.output)} failed: "
                                         f"{redact_text(e, url_secrets(workspace.output))}. What the stage "
                                         f"wrote is in the workspace {workspace.root}: `habitus upload` sends it "
                                         f"without running the stage again") from e
                return result
        return body
    return wrap


class Workspace(dg.ConfigurableResource):
    root: str
    output: str | None = None  # the project's `output:`: artifacts are uploaded there after each stage
    output_pins: dict[str, str] = {}  # the project's `output_pins:`: {stage: fingerprint} restore accepts
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

    def realized(self, name: str) -> Path:
        """realized/<name>/<day>.json: a day's predictions scored against what happened after it."""
        return self._child("realized", name)

    @property
    def embeddings(self) -> Path:
        return self._child("embeddings")

    def resume(self, *stage: str) -> Path:
        """Where a training stage keeps its resumable state: resume("foundation"), resume("scenarios", name)."""
        return self._child("resume", *stage)

    def lock(self, name: str, *, log=None, what: str = "", timeout_s: float | None = None):
        """An exclusive lock on one artifact/stage of this workspace (see habitus.models.storage.locks), for `with`:

            with workspace.lock("foundation", log=context.log.info, what=context.run_id):

        Waits up to `timeout_s` (default `lock_timeout_s`) for another run holding it, telling `log`
        who that is; a lock left by a killed process is taken over."""
        from habitus.models.storage.locks import ArtifactLock

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
        """Clean up after a killed run of the stage `name` (habitus.models.storage.files.recover): its temporary copies
        are removed, an old folder it moved aside is put back. Call it holding the stage's lock: then
        no other run writes there, whichever machine or container it runs in."""
        from habitus.models.storage.files import recover, recover_tree

        notes = []
        for path in self.stage_paths(name):
            notes += recover(path) + recover_tree(path)
        return notes

    def upload_files(self, name: str) -> tuple[list[Path], bool, dict]:
        """(files, replace, extra) the stage locked as `name` uploads to `output` once finished: what it
        owns (resources/store/output.py stage_units): the foundation checkpoint with the cache version it was
        trained on (a fresh machine scores with its ids), a scenario's checkpoint, its passed copy, its
        plots (its metrics are in config.json), predictions and embeddings (daily files: earlier days stay
        in the manifest, `replace` False)."""
        from habitus.models.storage.files import read_json
        from habitus.resources.store.manifests import daily_stage, stage_units

        extra = {}
        if name == "foundation" and (self.foundation / "config.json").exists():
            extra = {"cache_folder": read_json(self.foundation / "config.json")["cache_fingerprint"][:16]}
        units = stage_units(name, extra.get("cache_folder"))
        return _files([self._child(*u.split("/")) for u in units]), not daily_stage(name), extra

    def upload_stage(self, name: str, log=print) -> dict | None:
        """Upload what the stage `name` finished to `output` (resources/store/output.py); None for a stage that
        uploads nothing (sources, the cache on its own). Call it holding the stage's lock."""
        from habitus.resources.store.output import Output

        files, replace, extra = self.upload_files(name)
        if not self.output or not files:
            return None
        return Output(self.output, log=log).upload(name, self.path, files, replace=replace, extra=extra)

    def restore(self, stages: list[str] | None = None, log=print) -> dict:
        """Bring the stages uploaded to `output` (default: the foundation and every scenario, the
        checkpoints a scoring job starts from; with `output_pins`, the pinned stages) back into this
        workspace, each under its stage lock (the foundation's under the cache's too: it brings a cache
        version), nothing trusted that the store holds (resources/store/output.py). The cache version uploaded
        with the foundation becomes the cache in use (the next cache build starts from it: the same ids)."""
        import contextlib

        from habitus.models.storage.files import write_json
        from habitus.resources.store.output import Output, OutputError

        if not self.output:
            raise WorkspaceError("restore needs `output:` in the project config: the place artifacts were uploaded to")
        out = Output(self.output, log=log)
        if stages is None:
            found = out.stages()
            stages = [s for s in found if (s in self.output_pins if self.output_pins else
                                           s == "foundation" or s.startswith("scenario/"))]
            if "foundation" not in stages:
                raise OutputError(f"output {out.shown}: no foundation checkpoint was uploaded there "
                                  f"(uploaded stages: {found or 'none'})")

        @contextlib.contextmanager
        def stage_lock(stage: str):
            with contextlib.ExitStack() as held:
                for name in ([stage, "cache"] if stage == "foundation" else [stage]):
                    held.enter_context(self.lock(name, log=log, what="habitus restore"))
                for note in self.recover_stage(stage):
                    log(f"cleaned up after a killed run: {note}")
                yield

        done = out.restore(self.path, stages, pins=self.output_pins or None, lock=stage_lock)
        folder = done.get("foundation", {}).get("cache_folder")  # a fingerprint: checked by the restore
        if folder:
            with self.lock("cache", log=log, what="habitus restore"):
                write_json(self.cache_root / "current.json", {"folder": folder, "restored_from": out.shown})
        return done

    def _child(self, *parts: str) -> Path:
        for p in parts:  # names come from the config: keep them inside the workspace
            if p in ("", ".", "..") or "/" in p or "\\" in p:
                raise WorkspaceError(f"name {p!r} cannot be used as a workspace folder")
        return self.path.joinpath(*parts)

    def ensure_space(self, needed_bytes: int, what: str) -> dict:
        """Refuse to start when the free space is below what the step needs plus 20% headroom."""
        return ensure_space(self.path, needed_bytes, what)


def _files(paths: list[Path]) -> list[Path]:
    """The files at or under `paths`, without dot-names (a writer's temporary copy, a hash sidecar)."""
    import os

    found = []
    for p in paths:
        if p.is_file() and not p.name.startswith("."):
            found.append(p)
        elif p.is_dir():
            for folder, dirs, names in os.walk(p):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [Path(folder) / n for n in sorted(names) if not n.startswith(".")]
    return found
