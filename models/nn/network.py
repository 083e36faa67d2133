"""The networks: a residual MLP trunk shared by every task, and small task heads on top.

The trunk maps an entity's feature vector to its representation (the entity embedding); the
foundation model trains it to predict the next window, scenario models fine-tune it with a head.
Heads over labels (brands, items) also see each label's own history for the entity through a
learned skip, so "buys what they bought before" never has to be squeezed through the trunk.
"""

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn

from habitus.models.nn.sequence import SequenceEncoder


@dataclass
class NetConfig:
    in_dim: int
    hidden: int = 256
    layers: int = 2
    dropout: float = 0.1
    # the leading `ple_columns` inputs (recency, frequency, visits, money) and the trailing `ple_tail`
    # ones (the entity's numbers and dates) also enter piecewise-linearly over `ple_bins` quantile
    # bins, which lets a thin MLP cut a scalar where a tree would
    ple_columns: int = 0
    ple_bins: int = 0
    ple_tail: int = 0
    # the sequence encoder over the last `seq_len` events (0: none), whose tokens follow the `in_dim`
    # aggregate columns of the input: categorical columns of `seq_vocab` values, `seq_numeric` numbers
    seq_len: int = 0
    seq_vocab: list[int] = field(default_factory=list)
    seq_numeric: int = 0
    seq_dim: int = 32
    seq_layers: int = 1
    seq_heads: int = 2

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "NetConfig":
        """The network a checkpoint's config records under "net"."""
        return cls(**d)


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
        if cfg.ple_bins:
            self.register_buffer("ple_edges", torch.zeros(cfg.ple_columns + cfg.ple_tail, cfg.ple_bins + 1))
            self.ple = nn.Linear((cfg.ple_columns + cfg.ple_tail) * cfg.ple_bins, cfg.hidden, bias=False)
        if cfg.seq_len:
            self.sequence = SequenceEncoder(cfg.seq_vocab, cfg.seq_numeric, cfg.seq_len, cfg.seq_dim, cfg.seq_layers,
                                            cfg.seq_heads, cfg.hidden, cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.hidden, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)

    def fit_input_scale(self, x: torch.Tensor, std_floor: float) -> None:
        """`std_floor`: inputs are divided by max(std, floor) (its default: FoundationConfig.std_floor).
        Only the aggregate columns are scaled: the sequence tokens carry ids."""
        x = x[:, : self.cfg.in_dim]
        self.in_mean.copy_(x.mean(0))
        self.in_std.copy_(x.std(0).clamp_min(std_floor))
        if self.cfg.ple_bins:
            z = self._scalars((x - self.in_mean) / self.in_std).double().cpu().numpy()
            edges = np.quantile(z, np.linspace(0, 1, self.cfg.ple_bins + 1), axis=0).T
            self.ple_edges.copy_(torch.from_numpy(edges))

    def _scalars(self, z: torch.Tensor) -> torch.Tensor:
        head, tail = self.cfg.ple_columns, self.cfg.ple_tail
        return torch.cat([z[:, :head], z[:, self.cfg.in_dim - tail:self.cfg.in_dim]], 1) if tail else z[:, :head]

    def piecewise(self, z: torch.Tensor) -> torch.Tensor:
        """[rows, (ple_columns + ple_tail) * ple_bins]: per column, 1 for the bins below the value, its
        position in its own bin, 0 above (Gorishniy et al. 2022, "On embeddings for numerical features")."""
        lo, hi = self.ple_edges[:, :-1], self.ple_edges[:, 1:]
        e = ((self._scalars(z)[:, :, None] - lo) / (hi - lo).clamp_min(1e-6)).clamp(0, 1)
        return e.flatten(1)

    def _aggregate(self, x: torch.Tensor) -> torch.Tensor:
        z = (x[:, : self.cfg.in_dim] - self.in_mean) / self.in_std
        h = self.inp(z)
        if self.cfg.ple_bins:
            h = h + self.ple(self.piecewise(z))
        return h

    def _blocks(self, h: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(h)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._aggregate(x)
        if self.cfg.seq_len:
            h = h + self.sequence(x[:, self.cfg.in_dim:])
        return self._blocks(h)

    def masked(self, x: torch.Tensor, rate: float):
        """forward() with a share `rate` of the sequence's events masked, and the encoder's states for
        the masked-event objective (models/nn/sequence.MaskedEvents)."""
        pooled, states = self.sequence.masked(x[:, self.cfg.in_dim:], rate)
        return self._blocks(self._aggregate(x) + pooled), states


class PairScorer(nn.Module):
    """One function of (entity, label, the entity's own history of that label) for every label: a small
    MLP over [the trunk's output, a learned label embedding, that label's history channels], scored only
    at the (entity, label) pairs the entity touched, so its cost grows with the touched entries, never
    with rows x labels (a 16,000-label head). What "own history predicts a repeat" means is learned once
    for all labels and may depend on the entity (a lapsing heavy buyer, a new one) and on the label;
    the per-label linear skip alone could only weigh history label by label. Its output layer starts
    at zero, so the head starts where it did without it. The first layer is split by input (entity,
    label, history), so the entity part is computed once per row and the label part is a lookup."""

    def __init__(self, hidden: int, labels: int, channels: int, width: int, layers: int = 2):
        super().__init__()
        self.entity = nn.Linear(hidden, width)
        self.label = nn.Embedding(labels, width)
        nn.init.normal_(self.label.weight, std=0.02)
        self.history = nn.Linear(channels, width, bias=False)
        self.mid = nn.ModuleList(nn.Linear(width, width) for _ in range(layers - 1))
        self.out = nn.Linear(width, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The term of each entry (row, label, values [entries, channels])."""
        z = nn.functional.gelu(self.entity(h)[rows] + self.label(cols) + self.history(values.to(h.dtype)))
        for layer in self.mid:
            z = nn.functional.gelu(layer(z))
        return self.out(z).squeeze(-1)


class Head(nn.Module):
    """Linear outputs, plus (for label heads) a learned weighting of each label's own history: one
    shared across labels (`skip`) plus a per-label correction (`label_skip`, starting at zero),
    because labels repeat differently (staples are bought again, treats are not). The per-label
    weights made Ta-Feng propensity clearly better (docs/journal/quality.md)."""

    def __init__(self, hidden: int, outputs: int, history_channels: int = 0, pair_width: int = 0,
                 pair_layers: int = 2):
        super().__init__()
        self.linear = nn.Linear(hidden, outputs)
        self.skip = nn.Linear(history_channels, 1, bias=False) if history_channels else None
        self.label_skip = nn.Parameter(torch.zeros(outputs, history_channels)) if history_channels else None
        self.sparse_rows = False  # sampled rows' gradients sparse (Head._rows)
        # the shared pairwise scorer of the touched (entity, label) pairs (PairScorer; 0: none)
        self.pair = (PairScorer(hidden, outputs, history_channels, pair_width, pair_layers)
                     if pair_width and history_channels else None)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        key = prefix + "label_skip"
        if self.label_skip is not None and key not in state_dict:  # saved before per-label weights
            state_dict[key] = torch.zeros_like(self.label_skip)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _skip_weights(self, labels: torch.Tensor | None = None) -> torch.Tensor:
        """[labels, channels] (or [entries, channels] for the given label positions)."""
        extra = self.label_skip if labels is None else self.label_skip[labels]
        return self.skip.weight[0] + extra

    def _terms(self, h: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """What each history entry (row, label, values) adds to its logit: the linear skip, plus the
        pairwise scorer's term where the head has one."""
        term = (values * self._skip_weights(cols)).sum(-1)
        if self.pair is not None:
            term = term + self.pair(h, rows, cols, values).to(term.dtype)
        return term

    def _linear(self, h: torch.Tensor) -> torch.Tensor:
        """The linear outputs. One output (churn, spend) is a row-wise sum, not a matrix-vector product:
        the CPU BLAS splits that product's sum by thread count, so one process of 2 threads and two of
        1 wrote scores 1 ulp apart (23 of 126,129 at 10M events); each row's sum here is one thread's.
        Scoring only (no gradients): training keeps the product, so its steps are what they were."""
        if not torch.is_grad_enabled() and isinstance(self.linear, nn.Linear) and self.linear.out_features == 1:
            return (h * self.linear.weight[0]).sum(-1, keepdim=True) + self.linear.bias
        return self.linear(h)

    def forward(self, h: torch.Tensor, history=None) -> torch.Tensor:
        """`history`: each label's own history, dense [rows, labels, channels] or sparse (row, label,
        values [entries, channels]) as items.batch_history gives it. A label the row never touched
        has zero history and adds nothing either way; the sparse form costs what the rows touched,
        not rows x labels x channels (a 16,000-label head)."""
        out = self._linear(h)
        if self.skip is None or history is None:
            return out
        if torch.is_tensor(history):
            out = out + (history * self._skip_weights()).sum(-1)
            if self.pair is None:
                return out
            rows, cols = (history != 0).any(-1).nonzero(as_tuple=True)  # the touched pairs, as sparse
            return out.index_put((rows, cols), self.pair(h, rows, cols, history[rows, cols]).to(out.dtype),
                                 accumulate=True)
        # in place: `out` is this call's own (the linear layer's backward does not read it); with no
        # entries the skip still takes part, with a zero gradient
        rows, cols, values = history
        return out.index_put_((rows, cols), self._terms(h, rows, cols, values).to(out.dtype), accumulate=True)

    def _rows(self, labels: torch.Tensor) -> torch.Tensor:
        """Rows `labels` of the linear weight. With `sparse_rows` (set by a training loop that keeps the
        weight's dense gradient between steps: habitus.models.train.loop.step's `kept`), their gradient
        is sparse and is added into that one, instead of a [16,000, 256] zero tensor allocated,
        page-faulted in and filled at every step (docs/journal/speed.md); otherwise the usual dense one."""
        sparse = self.sparse_rows and torch.is_grad_enabled() and self.linear.weight.requires_grad
        return nn.functional.embedding(labels, self.linear.weight, sparse=sparse)

    def sampled(self, h: torch.Tensor, history, cols: torch.Tensor, entry_rows: torch.Tensor,
                entry_cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training a wide head on a few labels (habitus.models.tasks.multilabel.sampled_multilabel_loss): the logits
        of labels `cols` (sorted, unique) for every row, [rows, len(cols)], and of the (row, label)
        `entries` (a batch's positives), [entries]. Only those rows of `linear` are read, so the cost
        grows with len(cols) + entries, never rows x labels; `history` is sparse (row, label, values)."""
        out = nn.functional.linear(h, self._rows(cols), self.linear.bias[cols])
        if len(entry_rows):
            z = (h[entry_rows] * self._rows(entry_cols)).sum(-1) + self.linear.bias[entry_cols]
        else:  # (training's sampled loss: no entries, and no empty gradients to add into the weight's)
            z = out.new_zeros(0)
        if self.skip is None or history is None:
            return out, z
        rows, hcols, values = history  # (with no entries the skip still takes part, as in forward)
        at = torch.searchsorted(cols, hcols).clamp_max(len(cols) - 1)  # history entries among the columns
        inside = cols[at] == hcols
        if not len(entry_rows):  # only the entries among the columns are scored (the pairwise term costs)
            rows, hcols, values, at = rows[inside], hcols[inside], values[inside], at[inside]
            inside = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
        term = self._terms(h, rows, hcols, values).to(out.dtype)
        out = out.index_put((rows[inside], at[inside]), term[inside], accumulate=True)
        if not len(rows) or not len(entry_rows):
            return out, z + term.sum() * 0.0
        n = int(self.linear.out_features)  # history entries at the positives: match (row, label) keys
        keys = rows * n + hcols  # sorted (sparse rows are by row, then label)
        want = entry_rows * n + entry_cols
        at = torch.searchsorted(keys, want).clamp_max(len(keys) - 1)
        found = keys[at] == want
        return out, z + torch.where(found, term[at], torch.zeros_like(z))


class ItemHead(nn.Module):
    """Recommendation over a catalog of any size: score(entity, item) = query(entity) . embedding(item)
    + a learned function of the item's popularity at the cut-off (recent counts, so a shift in what
    sells is seen at once, where a per-item bias learned on older cut-offs would go stale) + a
    learned weighting of the entity's own history of that item, adjusted per entity (some repeat,
    some explore). The history is sparse (row, item, channels): the cost grows with what entities
    touched, not with the catalog."""

    def __init__(self, hidden: int, items: int, history_channels: int, dim: int, item_channels: int):
        super().__init__()
        self.query = nn.Linear(hidden, dim)
        self.items = nn.Embedding(items, dim)
        nn.init.normal_(self.items.weight, std=dim ** -0.5)
        self.popularity = nn.Linear(item_channels, 1)  # its bias: the log-odds of any one item being bought
        self.skip = nn.Linear(history_channels, 1, bias=False)
        self.gate = nn.Linear(hidden, history_channels)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)

    @property
    def n_items(self) -> int:
        """The catalog ranked: the trained items, then those added at scoring (add_items)."""
        extra = getattr(self, "new_items", None)
        return self.items.num_embeddings + (0 if extra is None else len(extra))

    def item_weight(self) -> torch.Tensor:
        extra = getattr(self, "new_items", None)
        return self.items.weight if extra is None or not len(extra) else torch.cat([self.items.weight, extra])

    def item_block(self, lo: int, hi: int) -> torch.Tensor:
        """The embeddings of catalog positions lo..hi, without copying the catalog (item_weight does)."""
        n, extra = self.items.num_embeddings, getattr(self, "new_items", None)
        if hi <= n or extra is None:
            return self.items.weight[lo:hi]
        if lo >= n:
            return extra[lo - n:hi - n]
        return torch.cat([self.items.weight[lo:], extra[:hi - n]])

    def set_item_map(self, spec: str, weight: torch.Tensor) -> None:
        """The map from an item's attributes to an embedding (models/tasks/coldstart.py): its encoding (JSON)
        and its [features + 1, dim] weights, kept in the state so that a checkpoint carries them."""
        self.register_buffer("item_map_spec", torch.frombuffer(bytearray(spec.encode()), dtype=torch.uint8).clone())
        self.register_buffer("item_map", weight.detach().clone().float())

    @property
    def item_map_of(self) -> tuple[dict, torch.Tensor] | None:
        if getattr(self, "item_map_spec", None) is None:
            return None
        import json

        return json.loads(bytes(self.item_map_spec.cpu().numpy()).decode()), self.item_map

    def add_items(self, embeddings: torch.Tensor) -> None:
        """Rank `embeddings` [items, dim] after the trained items (items first seen after training, for the
        cache being scored); not saved with the state. Replaces those of an earlier call."""
        self.register_buffer("new_items", embeddings.to(self.items.weight), persistent=False)

    def set_reranker(self, text: str) -> None:
        """Trees that re-order the head's best items (models/tasks/rerank.py), kept in the state as the bytes of
        their text dump, so a checkpoint carries them."""
        self.register_buffer("reranker", torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8).clone())
        self._booster = None

    @property
    def booster(self):
        """The re-ranking trees (LightGBM), or None where the head ranks alone."""
        if getattr(self, "reranker", None) is None:
            return None
        if getattr(self, "_booster", None) is None:
            import lightgbm

            self._booster = lightgbm.Booster(model_str=bytes(self.reranker.cpu().numpy()).decode())
        return self._booster

    def _load_from_state_dict(self, state_dict, prefix, *args):
        text = state_dict.get(prefix + "reranker")
        if text is not None and getattr(self, "reranker", None) is None:  # (a head saved with its trees)
            self.set_reranker(bytes(text.cpu().numpy()).decode())
        spec = state_dict.get(prefix + "item_map_spec")
        if spec is not None and getattr(self, "item_map_spec", None) is None:  # (a head saved with its item map)
            self.set_item_map(bytes(spec.cpu().numpy()).decode(), state_dict[prefix + "item_map"])
        super()._load_from_state_dict(state_dict, prefix, *args)

    def dense(self, h: torch.Tensor, item_features: torch.Tensor, lo: int = 0, hi: int | None = None,
              cand: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, items] scores without the history term: items lo..hi, or the candidate positions.
        `item_features`: [catalog, item_channels] popularity of every item at the cut-off."""
        weight = self.item_block(lo, self.n_items if hi is None else hi) if cand is None else self.item_weight()[cand]
        feats = item_features[lo:hi] if cand is None else item_features[cand]
        return self.query(h) @ weight.T + self.popularity(feats).squeeze(-1)

    def scorer(self, h: torch.Tensor, item_features: torch.Tensor):
        """dense() by blocks, (row lo, row hi, item lo, item hi) -> scores, for a full-catalog ranking
        (habitus.models.data.items.top_k_items): the query and the popularity term are computed once, not per block."""
        query, bias = self.query(h), self.popularity(item_features).squeeze(-1)
        return lambda r0, r1, i0, i1: query[r0:r1] @ self.item_block(i0, i1).T + bias[i0:i1]

    def history_scores(self, h: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """The history term of each sparse entry (row, values)."""
        return (values * (self.skip.weight[0] + self.gate(h)[rows])).sum(-1)

    def forward(self, h: torch.Tensor, item_features: torch.Tensor, history=None,
                cand: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of every item (cand None) or of the candidates; `history` = (row, item, values)."""
        out = self.dense(h, item_features, cand=cand)
        if history is not None and len(history[0]):
            rows, cols, values = history
            if cand is not None:  # keep the history entries of items among the candidates
                pos = torch.searchsorted(cand, cols).clamp_max(len(cand) - 1)
                inside = cand[pos] == cols
                rows, cols, values = rows[inside], pos[inside], values[inside]
            out = out.index_put((rows, cols), self.history_scores(h, rows, values), accumulate=True)
        return out


class Model(nn.Module):
    """Trunk + one head: the foundation model and every scenario model have this shape.
    `item_dim` > 0 makes the head an ItemHead over `outputs` items (recommendation)."""

    def __init__(self, cfg: NetConfig, outputs: int, history_channels: int = 0, item_dim: int = 0,
                 item_channels: int = 0, pair_width: int = 0, pair_layers: int = 2):
        super().__init__()
        self.trunk = Trunk(cfg)
        self.head = (ItemHead(cfg.hidden, outputs, history_channels, item_dim, item_channels) if item_dim
                     else Head(cfg.hidden, outputs, history_channels, pair_width, pair_layers))

    def forward(self, x: torch.Tensor, history=None, cand: torch.Tensor | None = None,
                item_features: torch.Tensor | None = None, labels: tuple | None = None) -> torch.Tensor:
        """`labels` = (cols, entry_rows, entry_cols): a label head's sampled logits (Head.sampled)."""
        if isinstance(self.head, ItemHead):
            return self.head(self.trunk(x), item_features, history, cand)
        if labels is not None:
            return self.head.sampled(self.trunk(x), history, *labels)
        out = self.head(self.trunk(x), history)
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def load_trunk(state: dict[str, torch.Tensor], net: dict, prefix: str = "trunk.") -> Trunk:
    """The trunk of a checkpoint's weights (its `prefix` entries, as float32) and its config's "net", in
    eval mode: the foundation's representation for embeddings, stacked heads and explanations."""
    trunk = Trunk(NetConfig.from_dict(net))
    trunk.load_state_dict({k.removeprefix(prefix): v.float() for k, v in state.items() if k.startswith(prefix)})
    return trunk.eval()
