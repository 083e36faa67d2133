"""The sequence encoder of the foundation trunk: a small pre-norm transformer over an entity's last
events (models/data/features.last_events), pooled into one vector the trunk adds to its aggregate
input. The aggregate features count what an entity did; the encoder sees the order of events, the
gaps between them and which values follow which.

A token is the sum of one learned embedding per categorical column (id 0 pads, the last id masks),
a linear map of its numbers, log age and log gap, and a learned position (0: the most recent
event). Built from Linear and LayerNorm layers only, so int8 and bf16 inference and LoRA adapters
treat it like the rest of the trunk.

Self-supervised objective (`masked` + MaskedEvents): a share of the events is masked (categorical ids
replaced by the mask id, numbers zeroed, their time kept), and the encoder predicts each masked
event's values from the others."""

import torch
from torch import nn
from torch.nn import functional as F


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """`t` [n, length, dim]; `keep` [n, length] bool: the positions that are events."""
        n, length, dim = t.shape
        q, k, v = self.qkv(self.norm1(t)).view(n, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        t = t + self.drop(self.proj(a.transpose(1, 2).reshape(n, length, dim)))
        return t + self.drop(self.down(F.gelu(self.up(self.norm2(t)))))


class SequenceEncoder(nn.Module):
    def __init__(self, vocab: list[int], numeric: int, length: int, dim: int, layers: int, heads: int,
                 out: int, dropout: float):
        super().__init__()
        self.vocab, self.numeric, self.length = list(vocab), numeric, length
        # ids: 0 pads, 1..v are values (bucket + 1), v + 1 masks
        self.embed = nn.ModuleList(nn.Embedding(v + 2, dim, padding_idx=0) for v in self.vocab)
        self.values = nn.Linear(numeric + 3, dim)
        self.position = nn.Parameter(torch.zeros(length, dim))
        nn.init.normal_(self.position, std=0.02)
        self.layers = nn.ModuleList(Layer(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(2 * dim, out)
        # it starts adding nothing, so the trunk starts where the aggregate trunk does
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @property
    def width(self) -> int:
        return self.length * (len(self.vocab) + self.numeric + 3)

    def split(self, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, width] -> ids [n, length, columns] (long), numbers [n, length, numeric + 3], keep [n, length]."""
        s = seq.reshape(len(seq), self.length, -1)
        k = len(self.vocab)
        ids, rest = s[..., :k].long(), s[..., k:]
        keep = rest[..., self.numeric] > 0.5
        keep = keep.clone()
        keep[:, 0] = True  # every row attends somewhere (a row of padding reads its first position)
        return ids, rest, keep

    def states(self, ids: torch.Tensor, rest: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        t = self.values(rest) + self.position
        for j, embed in enumerate(self.embed):
            t = t + embed(ids[..., j]).to(t.dtype)
        for layer in self.layers:
            t = layer(t, keep)
        return self.norm(t)

    def pool(self, t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """[n, out]: the mean over the events and the most recent event's state."""
        w = keep.to(t.dtype)[..., None]
        mean = (t * w).sum(1) / w.sum(1)
        return self.out(torch.cat([mean, t[:, 0]], 1))

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        ids, rest, keep = self.split(seq)
        return self.pool(self.states(ids, rest, keep), keep)

    def masked(self, seq: torch.Tensor, rate: float):
        """The pooled vector of `seq` with a share `rate` of its events masked (ids -> the mask id,
        numbers zeroed, time kept), and what MaskedEvents.loss reads: the states, the masked
        positions and the original ids and numbers."""
        ids, rest, keep = self.split(seq)
        masked = (rest[..., self.numeric] > 0.5) & (torch.rand(keep.shape, device=seq.device) < rate)
        mask_ids = torch.tensor([v + 1 for v in self.vocab], device=seq.device, dtype=ids.dtype)
        ids_in = torch.where(masked[..., None], mask_ids, ids)
        rest_in = torch.cat([torch.where(masked[..., None], 0.0, rest[..., : self.numeric]),
                             rest[..., self.numeric:]], -1)
        t = self.states(ids_in, rest_in, keep)
        return self.pool(t, keep), (t, masked, ids, rest[..., : self.numeric])


class MaskedEvents(nn.Module):
    """The pretraining heads of the masked-event objective: each masked event's categorical values
    (cross-entropy per column) and numbers (squared error) from its position's state. They train with
    the foundation model and are not kept: the trunk is the product."""

    def __init__(self, vocab: list[int], numeric: int, dim: int):
        super().__init__()
        self.ids = nn.ModuleList(nn.Linear(dim, v + 2) for v in vocab)
        self.numbers = nn.Linear(dim, numeric) if numeric else None

    def loss(self, states: torch.Tensor, masked: torch.Tensor, ids: torch.Tensor, numbers: torch.Tensor) -> torch.Tensor:
        at = states[masked]
        terms = [F.cross_entropy(head(at), ids[..., j][masked]) for j, head in enumerate(self.ids)]
        if self.numbers is not None:
            terms.append(F.mse_loss(self.numbers(at), numbers[masked]))
        if not len(at) or not terms:  # (no event drawn: every head still takes part, with a zero gradient)
            return sum(p.sum() for p in self.parameters()) * 0.0 + states.sum() * 0.0
        return sum(terms)
