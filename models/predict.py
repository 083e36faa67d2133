"""Batch inference: score every eligible entity as of a cut-off, chunk by chunk (memory stays flat)."""

from typing import Iterator

import numpy as np
import pyarrow as pa
import torch

from models.cache import Cache
from models.features import FeatureSpec, chunk_at, featurize
from models.metrics import top_k
from models.network import Model
from models.targets import eligible
from models.train import TaskSpec, build_model, chunk_plan, item_popularity, rank_items, scores, task_inputs


def load_model(state: dict, config: dict) -> tuple[Model, FeatureSpec, TaskSpec]:
    from models.network import NetConfig

    spec = FeatureSpec.from_dict(config["feature_spec"])
    task = TaskSpec.from_dict(config["task"])
    model = build_model(NetConfig(**config["net"]), task, spec)
    model.load_state_dict(state)
    model.eval()
    return model, spec, task


def predict(model: Model, cache: Cache, spec: FeatureSpec, task: TaskSpec, cutoff: int, *, k: int = 20,
            label_names: list | None = None, chunk_entities: int = 8192, device: str = "cpu") -> Iterator[pa.RecordBatch]:
    """Record batches of (entity index, score) or (entity index, top-k labels, top-k scores)."""
    entity_table = cache.entity_table()
    vocab_sizes = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    names = None
    if task.uses_label_history:
        if label_names is None:  # items: the column's own vocabulary, in label order
            vocab = cache.vocab(task.target.column).column("value").to_numpy(zero_copy_only=False)
            label_names = [vocab[i - 1] for i in task.target.labels]
        names = np.asarray(label_names, dtype=object)
    item_pop = None
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = eligible(chunk, task.target)
        if chunk.n == 0 or not keep.any():
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vocab_sizes)
        ents = pa.array(chunk.entities[keep].astype(np.int64))
        if task.task == "recommendation":  # full-catalog ranking, a block of items at a time
            if item_pop is None:
                item_pop = item_popularity(cache, task.target, cutoff)
            best, best_scores = rank_items(model, x[keep], h[keep], item_pop, k, device=device)
        else:
            out = scores(model, task.task, x[keep], None if h is None else h[keep], device=device)
        if names is None:
            yield pa.record_batch({"entity_index": ents, "score": pa.array(out.astype(np.float32))})
        else:
            if task.task != "recommendation":
                best = top_k(out, k)
                best_scores = np.take_along_axis(out, best, 1)
            n, kk = best.shape
            offsets = pa.array(np.arange(0, n * kk + 1, kk, dtype=np.int32))
            labels = pa.ListArray.from_arrays(offsets, pa.array(names[best.ravel()].astype(str)))
            values = pa.ListArray.from_arrays(offsets, pa.array(best_scores.ravel().astype(np.float32)))
            yield pa.record_batch({"entity_index": ents, "labels": labels, "scores": values})


@torch.no_grad()
def embed(trunk, cache: Cache, spec: FeatureSpec, cutoff: int, *, dtype=np.float16, chunk_entities: int = 8192,
          device: str = "cpu") -> Iterator[pa.RecordBatch]:
    """The foundation model's representation of every entity with history at `cutoff`:
    record batches of (entity index, fixed-size list of `hidden` floats)."""
    entity_table = cache.entity_table()
    dev = torch.device(device)
    arrow_type = pa.float16() if dtype == np.float16 else pa.float32()
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n == 0:
            continue
        x = torch.from_numpy(featurize(chunk, spec, entity_table)).to(dev)
        h = trunk(x).float().cpu().numpy().astype(dtype)
        values = pa.array(h.ravel(), arrow_type)
        yield pa.record_batch({"entity_index": pa.array(chunk.entities.astype(np.int64)),
                               "embedding": pa.FixedSizeListArray.from_arrays(values, h.shape[1])})
