"""The self-supervised foundation model: from the history before many sampled cut-offs, predict
the next window. One straight loop: work is cut into chunks of entities of one shard at one cut-off;
a chunk's features are computed (vectorized) and fed in shuffled mini-batches. Cut-offs fall on
midnights (UTC); features read events at or before the cut-off, targets the window after it."""

import math
import time

import numpy as np
import torch
from torch import nn

from habitus.models.cache import Cache
from habitus.models.train.distributed import Dist, Lockstep, from_rank0, shard, sum_over_ranks, wrap
from habitus.models.data.features import DAY, FeatureSpec, chunk_at, encode_tail, featurize
from habitus.models.data.related import related_tails
from habitus.models.train.loop import (Log, TrainResult, batches, by_shard, chunk_plan, cutoff_grid, days, epoch_loss, iso, processes,
                         processes_info, seeded, step)
from habitus.models.nn.network import Model, NetConfig
from habitus.models.nn.profile import Profile
from habitus.models.nn.sequence import MaskedEvents
from habitus.models.train.contrastive import Projection, info_nce, thinned
from habitus.models.train.resume import Resumer
from habitus.models.train.config import FoundationConfig
from habitus.models.data.targets import foundation_target

PROBE_CHUNKS = 4  # (a quarter of the plan: 2 chunks at 1M events, 11 at 10M, 107 at 100M)


def foundation_loss(out: torch.Tensor, y: torch.Tensor, n_columns: int) -> torch.Tensor:
    bce = nn.functional.binary_cross_entropy_with_logits
    loss = bce(out[:, 0], y[:, 0]) + nn.functional.mse_loss(out[:, 1], y[:, 1])
    if out.shape[1] > 2:
        loss = loss + n_columns * bce(out[:, 2:], y[:, 2:])
    return loss


class Pretraining(nn.Module):
    """The foundation model as it trains: its forecast of the next window and the auxiliary losses,
    weighted: with a sequence encoder and `rate` > 0, the masked-event loss from the heads of
    MaskedEvents; with `contrastive` > 0, the InfoNCE of each entity's full history against a thinned
    view of it (models/train/contrastive.py). Their heads are not kept."""

    def __init__(self, model: Model, spec: FeatureSpec, rate: float, masked_weight: float = 0.0,
                 contrastive: float = 0.0):
        super().__init__()
        self.model, self.rate, self.masked_weight, self.contrastive = model, rate, masked_weight, contrastive
        cfg = model.trunk.cfg
        self.events = MaskedEvents(cfg.seq_vocab, cfg.seq_numeric, cfg.seq_dim) if cfg.seq_len and rate else None
        self.project = Projection(cfg.hidden) if contrastive else None

    def forward(self, x: torch.Tensor, view: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        extra = torch.zeros((), device=x.device)
        if self.events is None:
            h = self.model.trunk(x)
        else:
            h, states = self.model.trunk.masked(x, self.rate)
            extra = extra + self.masked_weight * self.events.loss(*states)
        if self.project is not None and view is not None:
            extra = extra + self.contrastive * info_nce(self.project(h), self.project(self.model.trunk(view)))
        return self.model.head(h), extra


def train_foundation(cache: Cache, cfg: FoundationConfig, last_cutoff: int, *, device: str = "auto",
                     log: Log = print, resume: Resumer | None = None, dist: Dist | None = None) -> TrainResult:
    """Self-supervised training: from the history before many sampled cut-offs, predict the next
    `horizon_days` (whether the entity acts, how much, and which values of every categorical column).
    `last_cutoff + horizon` is the latest time any target may read.
    Under torchrun (`dist`, by default read from its variables) each rank trains on its share of the
    entity chunks with DDP in lockstep (habitus.models.train.distributed); only rank 0 logs."""
    started = time.time()
    dist, dev, log = processes(dist, device, log, resume)
    order, rng = seeded(cfg.seed, dist)
    spec = FeatureSpec.from_cache(cache, cfg.buckets, cfg.half_lives, cfg.sequence_events)
    if cfg.related_buckets:  # from events at or before the last cut-off (the latest features' past); a resumed
        # run reads the groups it trained on: a fit again may group otherwise (its float sums vary by machine)
        def fit() -> dict[str, str]:
            saved = resume.saved("tails") if resume is not None else None
            return saved if saved is not None else {
                c: encode_tail(t) for c, t in related_tails(cache, last_cutoff, cfg.buckets, cfg.seed).items()}
        spec.tails = from_rank0(fit, dist)
    cutoffs = cutoff_grid(cache.time_range[0], last_cutoff, cfg.cutoff_every_days, cfg.min_history_days)
    if not cutoffs:
        raise ValueError(f"no foundation cut-off fits: the data spans {days(cache.time_range)} days, which leaves no "
                         f"{cfg.min_history_days} days of history before {iso(last_cutoff)}; more history is needed")
    entity_table = cache.entity_table()
    plan = chunk_plan(cache, cfg.chunk_entities)

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)  # (the cache keeps the last shard read)
        x = featurize(chunk, spec, entity_table)
        y = foundation_target(chunk, cfg.horizon_days, spec)
        return chunk, x, y

    # hold out a tenth of the entities (by id) to watch generalization, at the latest cut-off: the
    # features of a quarter of the chunks, at most PROBE_CHUNKS of them (a quarter of every chunk, held
    # for the whole run, grew with the entities: docs/results/speed.md, "The foundation's validation probe")
    probe = [data(s, lo, hi, cutoffs[-1]) for s, lo, hi in plan[: min(PROBE_CHUNKS, max(1, math.ceil(len(plan) / 4)))]]
    val_rows = [np.flatnonzero(c.entities % 10 == 0) for c, _, _ in probe]
    targets_width = probe[0][2].shape[1]
    net = NetConfig(spec.width, cfg.hidden, cfg.layers, cfg.dropout, spec.scalar_width if cfg.ple_bins else 0,
                    cfg.ple_bins, spec.entity_scalar_width if cfg.ple_bins else 0, spec.sequence, spec.token_vocab,
                    len(spec.numeric), cfg.sequence_dim, cfg.sequence_layers)
    model = Model(net, targets_width).to(dev)
    model.trunk.fit_input_scale(torch.from_numpy(np.concatenate([x for _, x, _ in probe])).to(dev), cfg.std_floor)
    trainer = Pretraining(model, spec, cfg.masked_events, cfg.masked_events_weight, cfg.contrastive_weight).to(dev)
    opt = torch.optim.AdamW(trainer.parameters(), lr=cfg.learning_rate, weight_decay=1e-4)
    steps_total = cfg.epochs * math.ceil(len(plan) / dist.world) * min(cfg.cutoffs_per_chunk, len(cutoffs)) * math.ceil(
        cfg.chunk_entities / cfg.batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, cfg.learning_rate, total_steps=max(steps_total, 1), pct_start=0.1)
    n_cols = len(spec.categorical)
    curves: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    events_seen = entities_seen = steps = 0
    # >>> resume hook (models/train/resume.py): continue a killed run from its last saved state
    modules = {"model": model, "opt": opt, "sched": sched, **({"events": trainer.events} if trainer.events else {}),
               **({"projection": trainer.project} if trainer.project else {})}
    at = resume.restore(modules, rng) if resume is not None else None
    if at:
        curves, (events_seen, entities_seen, steps) = at["curves"], at["counters"]
    # <<< resume hook
    net, mine, lock = wrap(trainer, dist), set(shard(plan, dist)), Lockstep(dist)  # one process: model, plan, no-op
    pad = (torch.zeros(1, spec.input_width, device=dev), torch.zeros(1, targets_width, device=dev),
           torch.zeros(1, spec.input_width, device=dev) if trainer.project else None)

    def loss_of(x, y, view=None):
        out, extra = net(x, view)
        return foundation_loss(out, y, n_cols) + extra

    for epoch in range(at["epoch"] if at else 0, cfg.epochs):
        net.train()
        if at and epoch == at["epoch"]:  # resume hook: the saved epoch's data order and losses so far
            work, losses, first = at["work"], at["losses"], at["next"]
        else:
            work = [(s, lo, hi, c) for s, lo, hi in plan
                    for c in order.choice(cutoffs, min(cfg.cutoffs_per_chunk, len(cutoffs)), replace=False)]
            work = by_shard(work, order)
            if dist.enabled:  # this rank's entity chunks
                work = [w for w in work if tuple(w[:3]) in mine]
            losses, first = [], 0
        for i, (s, lo, hi, cutoff) in enumerate(work[first:], first):
            chunk, x, y = data(s, lo, hi, int(cutoff))
            train = np.flatnonzero(chunk.entities % 10 != 0)
            events_seen += len(chunk.rows)
            entities_seen += len(train)
            xt, yt = torch.from_numpy(x[train]).to(dev), torch.from_numpy(y[train]).to(dev)
            vt = (torch.from_numpy(featurize(thinned(chunk, cfg.contrastive_keep, rng), spec, entity_table)[train]).to(dev)
                  if trainer.project else None)
            for b in batches(len(train), cfg.batch_size, rng):
                lock.real()
                loss = loss_of(xt[b], yt[b], None if vt is None else vt[b])
                step(model, opt, loss)
                if steps < steps_total:
                    sched.step()
                steps += 1
                losses.append(loss.item())
            if resume is not None:  # resume hook: save between chunks every N steps
                resume.after_chunk(math.ceil(len(train) / cfg.batch_size), modules, rng, lambda: {
                    "epoch": epoch, "next": i + 1, "work": work, "losses": losses, "curves": curves,
                    "counters": [events_seen, entities_seen, steps], "tails": spec.tails})
        for _ in lock.padding():  # several processes: this rank's share is spent, the others' is not
            loss = loss_of(*pad) * 0.0
            step(model, opt, loss)
            if steps < steps_total:
                sched.step()
            steps += 1
        curves["train_loss"].append(epoch_loss(losses, dist))
        curves["val_loss"].append(_foundation_val(model, probe, val_rows, n_cols, dev))
        log(f"foundation epoch {epoch + 1}/{cfg.epochs}: train loss {curves['train_loss'][-1]:.4f}, "
            f"validation loss {curves['val_loss'][-1]:.4f} ({time.time() - started:.0f}s)")
    model.eval()
    profile = _profile(model, probe, len(plan), spec.scalar_width, dev)
    if dist.enabled:  # what every rank saw
        events_seen, entities_seen = (int(v) for v in sum_over_ranks([events_seen, entities_seen], dist))
    seconds = time.time() - started
    info = {"cutoffs": [iso(c) for c in cutoffs], "last_target_time": iso(last_cutoff + cfg.horizon_days * DAY),
            "events_seen": events_seen, "entities_seen": entities_seen, "seconds": round(seconds, 2),
            "steps": steps, "feature_spec": spec.to_dict(), "net": model.trunk.cfg.to_dict(),
            "targets_width": targets_width, "profile": profile.to_dict(), "device": str(dev), **processes_info(dist)}
    return TrainResult(model, curves, info)


@torch.no_grad()
def _profile(model, probe, plan_chunks: int, scalar_width: int, dev) -> Profile:
    """The embeddings' projection (habitus.models.nn.profile), fitted on the trunk's output at the last
    cut-off (the probe's chunks: every rank holds the same); the population is estimated from them."""
    xs = [x[i:i + 8192] for _, x, _ in probe for i in range(0, len(x), 8192)]
    if sum(len(x) for x in xs) < 2:
        return Profile.whole()
    h = np.concatenate([model.trunk(torch.from_numpy(x).to(dev)).float().cpu().numpy() for x in xs])
    return Profile.fit(h, len(h) * plan_chunks / len(probe), scalar_width)


@torch.no_grad()
def _foundation_val(model, probe, val_rows, n_cols, dev) -> float:
    model.eval()
    xs = np.concatenate([x[r] for (_, x, _), r in zip(probe, val_rows)])
    ys = np.concatenate([y[r] for (_, _, y), r in zip(probe, val_rows)])
    if len(xs) == 0:
        return float("nan")
    return float(foundation_loss(model(torch.from_numpy(xs).to(dev)), torch.from_numpy(ys).to(dev), n_cols))

