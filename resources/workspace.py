"""The workspace: a POSIX folder holding extracted sources, the cache, checkpoints and predictions.

    <root>/sources/<name>/<partition>.parquet
    <root>/cache/<fingerprint16>/...          (see models.cache)   + cache/current.json
    <root>/checkpoints/foundation/             model.safetensors + config.json
    <root>/checkpoints/scenarios/<name>/
    <root>/predictions/<name>/<day>.parquet
    <root>/embeddings/<day>.parquet            the foundation model's entity representations
"""

import re
import shutil
from pathlib import Path

import dagster as dg

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
HEADROOM = 1.2


class WorkspaceError(ValueError):
    pass


class Workspace(dg.ConfigurableResource):
    root: str

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
