"""The task types: one module each (models/tasks/<name>.py, a `TASK` of habitus.models.tasks.base.Task),
registered here once. A new task type is its module plus one `register` line; every decision that
differs by task type lives in its module, so nothing else changes. Config validation reads `TASKS`
(the task names, and the config target keys each accepts) without importing a task's module (torch);
`task(name)` imports it on first use."""

import importlib
from dataclasses import dataclass


RANKING_K = 10  # k of the ranking metrics (recommendation) where a scenario does not set it (TaskSpec.k)


@dataclass(frozen=True)
class Entry:
    module: str  # the module that holds the task's TASK
    targets: tuple[str, ...]  # the config target keys (pipelines/config/project.py) that fit the task


TASKS: dict[str, Entry] = {}


def register(name: str, module: str, targets: tuple[str, ...]) -> None:
    """Add the task type `name`: `module` (imported by name, on first use) holds its TASK, whose `name` is
    `name`; `targets` are the config target keys (pipelines/config/project.py) that fit it. A name is registered
    once: registering it again with another module is refused."""
    entry = Entry(module, tuple(targets))
    if TASKS.get(name, entry) != entry:
        raise ValueError(f"task type {name!r} is registered already ({TASKS[name]})")
    TASKS[name] = entry


register("binary", "habitus.models.tasks.binary", ("no_event", "function"))
register("regression", "habitus.models.tasks.regression", ("sum", "function"))
register("multilabel", "habitus.models.tasks.multilabel", ("any_event", "function"))
register("recommendation", "habitus.models.tasks.recommendation", ("items", "function"))
register("multiclass", "habitus.models.tasks.multiclass", ("any_event", "function"))


def task(name):
    """The Task of a task name (or of a TaskSpec: its `.task`)."""
    name = getattr(name, "task", name)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the tasks are {sorted(TASKS)}")
    return importlib.import_module(TASKS[name].module).TASK
