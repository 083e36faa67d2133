"""A scenario network: built for its task, and its outputs in the task's own units."""

import numpy as np

from habitus.models.data.features import FeatureSpec
from habitus.models.data.items import SparseRows
from habitus.models.nn.network import Model, NetConfig
from habitus.models.tasks.spec import TaskSpec
from habitus.models.tasks import task as task_of


def build_model(net: NetConfig, task: TaskSpec, spec: FeatureSpec) -> Model:
    """The scenario network of a task: the trunk plus the task's head."""
    return task_of(task).build_model(net, task, spec)


def scores(model: Model, task: str | TaskSpec, x: np.ndarray, h: np.ndarray | SparseRows | None, *, device: str = "cpu",
           batch: int = 8192) -> np.ndarray:
    """Model outputs in the task's own units: probabilities or amounts (Task.scores)."""
    return task_of(task).scores(model, x, h, device=device, batch=batch)
