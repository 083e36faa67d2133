"""The task types: one module each (models/tasks/<name>.py, a `TASK` of habitus.models.tasks.base.Task),
listed here once. Config validation reads `TASKS` (the task names, and the config target keys each
accepts) without importing a task's module (torch); `task(name)` imports it on first use."""

import importlib
from dataclasses import dataclass


RANKING_K = 10  # k of the ranking metrics (recommendation) where a scenario does not set it (TaskSpec.k)


@dataclass(frozen=True)
class Entry:
    module: str  # the module that holds the task's TASK
    targets: tuple[str, ...]  # the config target keys (pipelines/config.py) that fit the task


TASKS: dict[str, Entry] = {
    "binary": Entry("habitus.models.tasks.binary", ("no_event", "function")),
    "regression": Entry("habitus.models.tasks.regression", ("sum", "function")),
    "multilabel": Entry("habitus.models.tasks.multilabel", ("any_event", "function")),
    "recommendation": Entry("habitus.models.tasks.recommendation", ("items", "function")),
    "multiclass": Entry("habitus.models.tasks.multiclass", ("any_event", "function")),
}


def task(name):
    """The Task of a task name (or of a TaskSpec: its `.task`)."""
    name = getattr(name, "task", name)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the tasks are {sorted(TASKS)}")
    return importlib.import_module(TASKS[name].module).TASK
