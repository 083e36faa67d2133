"""The networks: a residual MLP trunk shared by every task, and small task heads on top.

The trunk maps an entity's feature vector to its representation (the entity embedding); the
foundation model trains it to predict the next window, scenario models fine-tune it with a head.
Heads over labels (brands, items) also see each label's own history for the entity through a
learned skip, so "buys what they bought before" never has to be squeezed through the trunk.
"""

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class NetConfig:
    in_dim: int
    hidden: int = 256
    layers: int = 2
    dropout: float = 0.1

    def to_dict(self) -> dict:
        return asdict(self)


class Block(nn.Module):
    def __init__(self, hidden: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(nn.functional.gelu(self.up(self.norm(h)))))


class Trunk(nn.Module):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.cfg = cfg
        # input standardization, fitted once on foundation training data and saved with the weights
        self.register_buffer("in_mean", torch.zeros(cfg.in_dim))
        self.register_buffer("in_std", torch.ones(cfg.in_dim))
        self.inp = nn.Linear(cfg.in_dim, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg.hidden, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)

    def fit_input_scale(self, x: torch.Tensor, std_floor: float = 1e-3) -> None:
        self.in_mean.copy_(x.mean(0))
        self.in_std.copy_(x.std(0).clamp_min(std_floor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.inp((x - self.in_mean) / self.in_std))
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


class Head(nn.Module):
    """Linear outputs, plus (for label heads) a learned weighting of each label's own history."""

    def __init__(self, hidden: int, outputs: int, history_channels: int = 0):
        super().__init__()
        self.linear = nn.Linear(hidden, outputs)
        self.skip = nn.Linear(history_channels, 1, bias=False) if history_channels else None

    def forward(self, h: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        out = self.linear(h)
        if self.skip is not None and history is not None:
            out = out + self.skip(history).squeeze(-1)
        return out


class Model(nn.Module):
    """Trunk + one head: the foundation model and every scenario model have this shape."""

    def __init__(self, cfg: NetConfig, outputs: int, history_channels: int = 0):
        super().__init__()
        self.trunk = Trunk(cfg)
        self.head = Head(cfg.hidden, outputs, history_channels)

    def forward(self, x: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        out = self.head(self.trunk(x), history)
        return out.squeeze(-1) if out.shape[-1] == 1 else out
