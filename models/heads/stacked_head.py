"""The head chosen on validation (models/heads/stacking.py) as a scenario uses it: fitted after fine-tuning,
saved with the checkpoint, loaded with it, and scored chunk by chunk by habitus.models.evaluate.holdout and
habitus.models.serve.predict.

A `HeadStack` is the Stack (the trees, the reduction, the chosen weight) plus the *foundation's*
trunk whose representation the trees read (the fine-tuned network's trunk has moved away from it).
The checkpoint gets two more files, both plain values, never pickle:

    stack.json                the Stack's state: LightGBM boosters as text dumps, the PCA as lists,
                              the choice and every candidate's validation score
    stack_trunk.safetensors   the foundation trunk's weights (safetensors)

and config.json a `stack` entry: their SHA-256 (a file changed after training is refused on load),
the chosen candidate ("network", "gbt", "blend") and its weight. A checkpoint without that entry
(written before the head was chosen on validation) loads and scores with the network alone.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from habitus.models.evaluate.baselines import most_frequent_labels
from habitus.models.heads.stacked_rows import Rows, chunk_rows, collect
from habitus.models.heads.stacking import Stack, StackConfig, _logit, blend, fit_stack
from habitus.models.nn.checkpoint import CheckpointError
from habitus.models.nn.network import Trunk, load_trunk
from habitus.models.storage.files import file_sha256
from habitus.models.tasks import task as task_of

STACK_FILE, TRUNK_FILE = "stack.json", "stack_trunk.safetensors"


@dataclass
class HeadStack:
    stack: Stack
    trunk: Trunk  # the foundation's trunk (fp32, eval mode)

    @property
    def labels(self) -> np.ndarray | None:
        """Multilabel: the label positions the trees cover (sorted; None: all); the others keep the network's."""
        return self.stack.labels

    @property
    def chosen(self) -> str:
        return self.stack.chosen

    @property
    def weight(self) -> float:
        return self.stack.weight

    def rows(self, chunk, keep: np.ndarray, x: np.ndarray, spec, task, entity_table, vocab_sizes: dict, *,
             model=None, device: str = "cpu") -> Rows:
        """The stack's rows of a chunk's `keep` rows (`x`: the chunk's network inputs); with `model`,
        the network's scores of the covered labels too."""
        return chunk_rows(chunk, keep, spec, task, self.trunk, entity_table, vocab_sizes, labels=self.labels,
                          model=model, x=x, device=device)

    def gbt(self, rows: Rows) -> np.ndarray | None:
        """The trees' scores (None where the network alone was chosen)."""
        return None if self.stack.weight == 0 else self.stack.gbt_scores(rows)

    def choose(self, network: np.ndarray, gbt: np.ndarray | None, weight: float | None = None) -> np.ndarray:
        """The chosen candidate's scores from the network's and the trees' (`weight`: another blend's)."""
        w = self.weight if weight is None else weight
        return np.asarray(network, np.float32) if gbt is None else blend(self.stack.task, network, gbt, w)

    def adjust_logits(self, gbt: np.ndarray | None):
        """Multilabel predictions: `fn(rows, logits) -> logits` that puts the chosen blend into the network's
        [rows, labels] logits at the covered labels (w logit(trees) + (1 - w) logit(network)), so the
        top-k runs over every label as before."""
        if gbt is None:
            return None
        w = self.weight
        cols = None if self.labels is None else torch.from_numpy(np.asarray(self.labels, np.int64))
        trees = torch.from_numpy(_logit(gbt).astype(np.float32))

        def fn(rows: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
            t = trees[torch.from_numpy(np.asarray(rows, np.int64))].to(logits.device)
            logits = logits.clone()
            c = slice(None) if cols is None else cols.to(logits.device)
            logits[:, c] = w * t + (1 - w) * logits[:, c] if w < 1 else t
            return logits
        return fn

    def summary(self) -> dict:
        return self.stack.summary()


def fit_head(cache, spec, task, trunk: Trunk, model, train_cutoffs, val_cutoff: int, *, cfg: StackConfig | None = None,
             device: str = "cpu", log=lambda _: None) -> HeadStack | None:
    """The head chosen on the validation cut-off for the fine-tuned `model` (models/heads/stacking.py), or None
    where the task has no stack (multiclass, recommendation) or LightGBM is not installed. The trees
    train on `train_cutoffs`; the choice reads `val_cutoff` only, never the test cut-off. Multilabel: the
    `cfg.max_labels` labels with the most training positives get trees; the rest keep the network's score."""
    rule = task_of(task).stacking
    if rule is None:
        return None
    try:
        import lightgbm  # noqa: F401
    except ImportError:
        log("LightGBM is not installed: the network alone scores (no head chosen on validation)")
        return None
    cfg = cfg or StackConfig()
    dev = "cpu" if device == "auto" else device
    labels = most_frequent_labels(cache, task, train_cutoffs, cfg.max_labels) if rule.per_label else None
    trunk = trunk.float().eval()
    parts = [collect(cache, spec, task, trunk, c, labels=labels, device=dev) for c in train_cutoffs]
    train = Rows(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("entities", "hand", "embedding", "y")))
    val = collect(cache, spec, task, trunk, val_cutoff, labels=labels, model=model, device=dev)
    if len(train) == 0 or len(val) < 2:
        log(f"no head chosen on validation ({len(train)} training rows, {len(val)} validation rows): the network alone")
        return None
    return HeadStack(fit_stack(task.task, train, val, cfg, labels=labels, log=log), trunk)


def save_head(folder: str | Path, head: HeadStack) -> dict:
    """Write stack.json and stack_trunk.safetensors into the checkpoint folder being written; returns
    config.json's `stack` entry (their fingerprints, the choice)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    (folder / STACK_FILE).write_text(json.dumps(head.stack.state()))
    save_file({k: v.detach().to("cpu").float().contiguous() for k, v in head.trunk.state_dict().items()},
              str(folder / TRUNK_FILE))
    return {"files": {name: file_sha256(folder / name) for name in (STACK_FILE, TRUNK_FILE)}, **head.summary(),
            "seconds": head.stack.seconds}


def load_head(folder: str | Path, config: dict) -> HeadStack | None:
    """The HeadStack saved with a scenario checkpoint, or None for one without (the network alone)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    entry = config.get("stack")
    if not entry:
        return None
    folder = Path(folder)
    for name in (STACK_FILE, TRUNK_FILE):
        if not (folder / name).exists():
            raise CheckpointError(f"{folder / name} is missing: config.json records a head chosen on validation "
                                  f"({entry.get('chosen')}); re-materialize the scenario")
    for name in (STACK_FILE, TRUNK_FILE):
        path = folder / name
        if file_sha256(path) != entry.get("files", {}).get(name):
            raise CheckpointError(f"{path}: its SHA-256 does not match the one recorded in config.json; the file "
                                  f"was changed after training. Re-materialize the scenario")
    try:
        stack = Stack.from_state(json.loads((folder / STACK_FILE).read_text()))
        trunk = load_trunk(load_file(str(folder / TRUNK_FILE)), config["net"], prefix="")
    except (ValueError, KeyError, SafetensorError) as e:
        raise CheckpointError(f"{folder}: the head chosen on validation does not load ({type(e).__name__}: {e}); "
                              f"re-materialize the scenario") from None
    return HeadStack(stack, trunk)
