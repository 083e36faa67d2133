"""habitus: behavioral foundation models from a warehouse's events, as Dagster assets.

The installed packages are habitus.models (data, networks, training, scoring), habitus.resources
(warehouses, workspace, executor), habitus.assets (the Dagster assets) and habitus.pipelines (the
definitions, CLI and config). For notebooks, `habitus.Project` loads a project config and drives it.
"""

__all__ = ["Project"]


def __getattr__(name):
    # deferred: `import habitus` stays light (no torch or dagster until the API is used)
    if name == "Project":
        from habitus.pipelines.api import Project

        return Project
    raise AttributeError(f"module 'habitus' has no attribute {name!r}")
