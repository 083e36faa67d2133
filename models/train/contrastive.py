"""A contrastive objective beside the foundation's forecast (CoLES-style: parts of one entity's history
are positives, other entities of the batch negatives).

The second view of an entity is its history at the same cut-off with each event kept at random
(`thinned`, a share `keep`); the trunk's representation of the full history and of the thinned one go
through a small projection (discarded after pretraining) and an InfoNCE loss over the batch, both
ways. What it asks of the trunk is what the forecast does not: to say *who* the entity is from a
sample of its behaviour, not only what it does next.
"""

import numpy as np
import torch
from torch import nn

from habitus.models.data.features import Chunk

TEMPERATURE = 0.1
PROJECTION = 64


def thinned(chunk: Chunk, keep: float, rng: np.random.Generator) -> Chunk:
    """The same entities (rows in the same order) with each history event kept with probability `keep`,
    and each entity's latest event always (every entity of a chunk has history: features need it)."""
    if not len(chunk.rows):
        return chunk
    mask = rng.random(len(chunk.rows)) < keep
    mask[np.r_[np.flatnonzero(np.diff(chunk.local)), len(chunk.local) - 1]] = True  # (entity, time) order
    return Chunk(chunk.entities, chunk.local[mask], chunk.age_days[mask], chunk.rows[mask], chunk.cutoff,
                 chunk.shard, chunk.lo, chunk.hi)


class Projection(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, PROJECTION))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(h.float()), dim=-1)


def info_nce(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    """Row i of `z1` against every row of `z2` (its own the positive) and the other way round."""
    logits = z1 @ z2.T / TEMPERATURE
    target = torch.arange(len(z1), device=z1.device)
    return 0.5 * (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.T, target))
