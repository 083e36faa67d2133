"""Batch inference: score every eligible entity as of a cut-off, chunk by chunk (memory stays flat)."""

from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from habitus.models.cache import Cache
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
from habitus.models.serve.defaults import TOP_K
from habitus.models.data.features import FeatureSpec, chunk_at, featurize
from habitus.models.data.labels import task_inputs
from habitus.models.heads.stacked_head import load_head
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.nn.network import Model, NetConfig, load_trunk
from habitus.models.nn.profile import WHOLE, Profile
from habitus.models.nn.quantize import for_inference
from habitus.models.tasks import task as task_of
from habitus.models.tasks.scoring import build_model
from habitus.models.tasks.spec import TaskSpec


def load_model(state: dict, config: dict) -> tuple[Model, FeatureSpec, TaskSpec]:
    spec = FeatureSpec.from_dict(config["feature_spec"])
    task = TaskSpec.from_dict(config["task"])
    model = build_model(NetConfig.from_dict(config["net"]), task, spec)
    model.load_state_dict(state)
    model.eval()
    return model, spec, task


def predict(model: Model, cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, *, k: int = TOP_K,
            label_names: list | None = None, chunk_entities: int = SCORING_CHUNK_ENTITIES, device: str = "cpu",
            head=None) -> Iterator[pa.RecordBatch]:
    """Record batches of (entity index, score) or (entity index, top-k labels, top-k scores).
    `head`: the checkpoint's head chosen on validation (habitus.models.heads.stacked_head.load_head; None: the
    network alone, as a checkpoint without one scores)."""
    plan = chunk_plan(cache, chunk_entities)
    for _, batch in predict_chunks(model, cache, spec, task, cutoff, range(len(plan)), k=k, label_names=label_names,
                                   chunk_entities=chunk_entities, device=device, head=head):
        yield batch


def predict_chunks(model: Model, cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, chunks: Iterable[int],
                   *, k: int = TOP_K, label_names: list | None = None, chunk_entities: int = SCORING_CHUNK_ENTITIES, device: str = "cpu",
                   head=None) -> Iterator[tuple[int, pa.RecordBatch]]:
    """`predict` over the chunks `chunks` (positions in chunk_plan(cache, chunk_entities), taken one
    at a time: models/serve/parts.py deals them to several processes): (chunk, batch) for each chunk with
    an eligible entity."""
    if head is not None and head.weight == 0:  # the network was chosen: the trees are never read
        head = None
    plan = chunk_plan(cache, chunk_entities)
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    t = task_of(task)
    task = t.with_new_items(model, task, cache, cutoff)  # (recommendation: items first seen after training)
    names = t.label_names(cache, task, label_names)  # None: one score per entity
    extra = None
    for i in chunks:
        s, lo, hi = plan[i]
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = t.eligible(chunk, task.target)
        if chunk.n == 0 or not keep.any():
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        if extra is None:  # what the task's scores share at the cut-off (items: the catalog's popularity)
            extra = t.chunk_extra(cache, task.target, cutoff)
        chosen = None
        if head is not None:  # binary, regression: the chosen scores; labels: the top-k reads the blend
            rows = head.rows(chunk, keep, x, spec, task, entity_table, vocab_sizes,
                             model=None if names is not None else model, device=device)
            gbt = head.gbt(rows)
            chosen = head.adjust_logits(gbt) if names is not None else head.choose(rows.network, gbt)
        columns = t.predictions(model, x[keep], None if h is None else h[keep], k, names, extra, device, head=chosen)
        yield i, pa.record_batch({"entity_index": pa.array(chunk.entities[keep].astype(np.int64)), **columns})


def scenario_scorer(p: dict):
    """habitus.models.serve.parts' Scorer of a scenario's checkpoint: `p` = {cache, cache_fingerprint, checkpoint,
    weights_sha256, precision, device, k, label_names, chunk_entities}; the checkpoint's head chosen
    on validation included. The same model in every process: a checkpoint replaced since the caller
    read it is refused."""
    cache = _cache(p)
    state, config = _checkpoint(p)
    model, spec, task = load_model(state, config)
    model = for_inference(model.to(p["device"]), p["precision"])
    head = load_head(p["checkpoint"], config)
    return lambda cutoff, chunks: predict_chunks(
        model, cache, spec, task, cutoff, chunks, k=p["k"], label_names=p.get("label_names"),
        chunk_entities=p.get("chunk_entities", SCORING_CHUNK_ENTITIES), device=p["device"], head=head)


def embedding_scorer(p: dict):
    """habitus.models.serve.parts' Scorer of the foundation's embeddings: `p` = {cache, cache_fingerprint, checkpoint,
    weights_sha256, precision, device, chunk_entities}."""
    cache = _cache(p)
    state, config = _checkpoint(p)
    trunk = for_inference(load_trunk(state, config["net"]), p["precision"]).to(p["device"])
    spec = FeatureSpec.from_dict(config["feature_spec"])
    return lambda cutoff, chunks: embed_chunks(trunk, cache, spec, cutoff, chunks, dtype=np.float16,
                                               chunk_entities=p.get("chunk_entities", SCORING_CHUNK_ENTITIES), device=p["device"],
                                               profile=Profile.of(config))


def _cache(p: dict) -> Cache:
    cache = Cache(p["cache"])
    if cache.fingerprint != p["cache_fingerprint"]:
        raise RuntimeError(f"the cache at {p['cache']} is not the version the asset chose "
                           f"({cache.fingerprint[:16]} != {p['cache_fingerprint'][:16]})")
    return cache


def _checkpoint(p: dict) -> tuple[dict, dict]:
    state, config = load_checkpoint(p["checkpoint"])
    if config["weights_sha256"] != p["weights_sha256"]:
        raise RuntimeError(f"the checkpoint at {p['checkpoint']} changed after the asset read it "
                           f"({config['weights_sha256'][:16]} != {p['weights_sha256'][:16]}); run the asset again")
    return state, config


def embed(trunk, cache: Cache, spec: FeatureSpec, cutoff: int, *, dtype=np.float16, chunk_entities: int = SCORING_CHUNK_ENTITIES,
          device: str = "cpu", profile: Profile = WHOLE) -> Iterator[pa.RecordBatch]:
    """The foundation model's profile of every entity with history at `cutoff`: record batches of
    (entity index, fixed-size list of `embedding_width(trunk, spec, profile)` floats). `profile`
    (habitus.models.nn.profile, saved with the checkpoint; by default the whole trunk) chooses the columns:
    the trunk's leading principal components, then, where the population carries them, the entity's
    `spec.scalar_width` recency / frequency / monetary / visit scalars (the network's leading inputs,
    habitus.models.data.features) standardized by the foundation's own input scaling, so a linear reader
    gets them without the trunk's nonlinearity in between."""
    plan = chunk_plan(cache, chunk_entities)
    for _, batch in embed_chunks(trunk, cache, spec, cutoff, range(len(plan)), dtype=dtype,
                                 chunk_entities=chunk_entities, device=device, profile=profile):
        yield batch


@torch.no_grad()
def embed_chunks(trunk, cache: Cache, spec: FeatureSpec, cutoff: int, chunks: Iterable[int], *, dtype=np.float16,
                 chunk_entities: int = SCORING_CHUNK_ENTITIES, device: str = "cpu", profile: Profile = WHOLE
                 ) -> Iterator[tuple[int, pa.RecordBatch]]:
    """`embed` over the chunks `chunks` (positions in chunk_plan(cache, chunk_entities)): (chunk,
    batch) for each chunk with history."""
    plan = chunk_plan(cache, chunk_entities)
    entity_table = cache.entity_table()
    dev = torch.device(device)
    arrow_type = pa.float16() if dtype == np.float16 else pa.float32()
    w = spec.scalar_width if profile.scalars else 0
    mean, std = trunk.in_mean[:w].float().cpu().numpy(), trunk.in_std[:w].float().cpu().numpy()
    for i in chunks:
        s, lo, hi = plan[i]
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n == 0:
            continue
        x = featurize(chunk, spec, entity_table)
        h = trunk(torch.from_numpy(x).to(dev)).float().cpu().numpy()
        h = profile.apply(h, (x[:, :w] - mean) / std).astype(dtype)
        values = pa.array(h.ravel(), arrow_type)
        yield i, pa.record_batch({"entity_index": pa.array(chunk.entities.astype(np.int64)),
                                  "embedding": pa.FixedSizeListArray.from_arrays(values, h.shape[1])})


def embedding_width(trunk, spec: FeatureSpec, profile: Profile = WHOLE) -> int:
    """How many floats `embed` writes per entity."""
    return profile.width(trunk.cfg.hidden, spec.scalar_width)
