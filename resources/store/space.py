"""Free space before work starts: what a step needs plus 20% headroom, or a clear refusal. Training,
the cache build and a restore from the output store (resources/store/output.py) ask the same question."""

import shutil
from pathlib import Path

HEADROOM = 1.2


class WorkspaceError(ValueError):
    pass


def ensure_space(path: Path, needed_bytes: int, what: str) -> dict:
    """Refuse to start when the free space at `path` is below what the step needs plus 20% headroom."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    need = int(needed_bytes * HEADROOM)
    if free < need:
        raise WorkspaceError(f"not enough free space in the workspace {path} for {what}: "
                             f"{free / 1e9:.2f} GB free, {need / 1e9:.2f} GB needed "
                             f"({needed_bytes / 1e9:.2f} GB + 20% headroom); free space or move the workspace")
    return {"free_gb": round(free / 1e9, 3), "needed_gb": round(need / 1e9, 3)}
