"""A scenario's task as training and scoring take it: the task type's name, its target and its widths."""

from dataclasses import dataclass

from habitus.models.data.targets import TargetSpec
from habitus.models.tasks import RANKING_K, task

PAIR_WIDTH = 128
PAIR_LAYERS = 2
# heads wider than this (sampled negatives) leave the pairwise scorer out: on the 16,000-label scenario
# it made the fine-tuning slower and the model no better (docs/journal/speed.md, "Where the 16k fine-tuning's
# speed went")
PAIR_MAX_LABELS = 2048


@dataclass
class TaskSpec:
    task: str  # a task type's name (habitus.models.tasks.TASKS)
    target: TargetSpec
    k: int = RANKING_K
    item_dim: int = 64  # recommendation: width of the item embeddings
    # multilabel: width and depth of the shared pairwise scorer of (entity, label, its own history of
    # that label) (network.PairScorer; 0: the per-label linear head alone, as checkpoints before it):
    # propensity a little better than the linear head's on the demo, the same on Ta-Feng (docs/journal/quality.md,
    # "A shared pairwise label scorer").
    # None: PAIR_WIDTH for heads of up to PAIR_MAX_LABELS labels, 0 above (what is saved is the number)
    pair_width: int | None = None
    pair_layers: int = PAIR_LAYERS

    def __post_init__(self):
        if self.pair_width is None:
            self.pair_width = PAIR_WIDTH if self.outputs <= PAIR_MAX_LABELS else 0

    @property
    def outputs(self) -> int:
        return task(self.task).outputs(self)

    @property
    def uses_label_history(self) -> bool:
        return task(self.task).uses_label_history

    def to_dict(self) -> dict:
        return {"task": self.task, "target": self.target.to_dict(), "k": self.k, "item_dim": self.item_dim,
                "pair_width": self.pair_width, "pair_layers": self.pair_layers}

    @classmethod
    def from_dict(cls, d: dict) -> "TaskSpec":
        # (saved before the pairwise scorer: the linear head alone)
        return cls(d["task"], TargetSpec.from_dict(d["target"]), d["k"], d.get("item_dim", 64), d.get("pair_width", 0),
                   d.get("pair_layers", PAIR_LAYERS))
