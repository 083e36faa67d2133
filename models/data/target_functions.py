"""User-defined targets: a Python function over an entity's history, its future window and its
attributes, named in the config as `target: {function: "package.module:func", within: 28d}`.

The function is called once per chunk of entities with three Arrow tables and returns one item per
entity: 0/1 for binary scenarios, an amount for regression; for label tasks (the config names the
label column as `by:`) a value of that column or None (multiclass: None is not eligible), or a list
of values (multilabel, recommendation):

    def high_value(history: pa.Table, future: pa.Table, entities: pa.Table) -> Sequence[float]

- `entities`: one row per entity scored at the cut-off: `row` (0..n-1), `entity_id` (as the
  warehouse wrote it), `cutoff` (timestamp), then the entity attribute columns.
- `history`: the entities' events at or before the cut-off; `future`: those in (cutoff, cutoff +
  within]. Both have `row` (the entity's row in `entities`), `ts` (timestamp) and every event column
  (categories as their original text, numbers as floats).

Only the module the config names is imported, once; errors name the scenario and the function.
"""

import functools
import importlib
import re
from typing import Callable

import numpy as np
import pyarrow as pa

FUNCTION_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


@functools.lru_cache(maxsize=64)
def resolve(ref: str, scenario: str = "") -> Callable:
    """`package.module:func` -> the function; a clear error when it cannot be found."""
    where = f"scenario {scenario!r}: target function {ref!r}"
    if not FUNCTION_REF.match(ref or ""):
        raise ValueError(f"{where}: write it as 'package.module:function'")
    module_name, func_name = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import module {module_name!r} ({e}); install it in the environment "
                         f"that runs habitus or put it on PYTHONPATH") from e
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"{where}: module {module_name!r} has no function {func_name!r}")
    return func


@functools.lru_cache(maxsize=32)
def _values(cache_path: str, vocab_name: str, loader) -> pa.Array:
    """Vocabulary id -> original value (id 0, the missing value, -> null)."""
    values = loader(vocab_name).column("value").combine_chunks()
    return pa.concat_arrays([pa.nulls(1, values.type), values])


def _decode(cache, vocab_name: str, ids: np.ndarray) -> pa.Array:
    values = _values(str(cache.path), vocab_name, cache.vocab)
    return values.take(pa.array(np.clip(ids.astype(np.int64), 0, len(values) - 1)))


def _events(cache, shard, rows: np.ndarray, local: np.ndarray) -> pa.Table:
    cols = {"row": pa.array(local.astype(np.int64)), "ts": pa.array(shard.ts[rows].astype("datetime64[s]"))}
    for c, meta in cache.columns.items():
        v = shard.columns[c][rows]
        cols[c] = _decode(cache, c, v) if meta["type"] == "categorical" else pa.array(v.astype(np.float64))
    return pa.table(cols)


def _entities(cache, chunk) -> pa.Table:
    table = cache.entity_table()
    ids = chunk.entities
    cols = {"row": pa.array(np.arange(chunk.n, dtype=np.int64)), "entity_id": cache.entity_ids(ids),
            "cutoff": pa.array(np.full(chunk.n, chunk.cutoff).astype("datetime64[s]"))}
    for c, meta in cache.entity_columns.items():
        if c not in table:
            continue
        v = table[c][ids]
        if meta["type"] == "categorical":
            cols[c] = _decode(cache, f"entity.{c}", v)
        elif meta["type"] == "timestamp":
            ok = np.isfinite(v.astype(np.float64))
            cols[c] = pa.array(np.where(ok, v, 0).astype(np.int64).astype("datetime64[s]"), mask=~ok)
        else:
            cols[c] = pa.array(v.astype(np.float64))
    return pa.table(cols)


def _call(chunk, spec, cache, future_local: np.ndarray, future_rows: np.ndarray):
    func = resolve(spec.function, spec.scenario)
    history = _events(cache, chunk.shard, chunk.rows, chunk.local)
    future = _events(cache, chunk.shard, future_rows, future_local)
    try:
        return func(history, future, _entities(cache, chunk))
    except Exception as e:
        raise ValueError(f"{_where(spec)} raised {type(e).__name__}: {e}") from e


def _where(spec) -> str:
    return f"scenario {spec.scenario!r}: target function {spec.function!r}"


def function_labels(chunk, spec, cache, future_local: np.ndarray, future_rows: np.ndarray) -> list[list[int]]:
    """Label tasks: the user function returns, per entity, a value of the target's column (multiclass),
    a list of them (multilabel, recommendation) or None; -> each entity's label positions (values
    that are not labels dropped)."""
    out = _call(chunk, spec, cache, future_local, future_rows)
    out = out.to_pylist() if hasattr(out, "to_pylist") else list(out)
    if len(out) != chunk.n:
        raise ValueError(f"{_where(spec)} returned {len(out)} values for {chunk.n} entities (one per row of `entities`)")
    position = _label_index(str(cache.path), spec.column, cache.vocab, tuple(spec.labels))
    return [[position[v] for v in (v if isinstance(v, (list, tuple, set, np.ndarray)) else [v])
             if v is not None and v in position] for v in out]


@functools.lru_cache(maxsize=32)
def _label_index(cache_path: str, column: str, loader, labels: tuple) -> dict:
    """Original value -> label position, for the values that are labels."""
    values = loader(column).column("value").to_pylist()
    return {values[i - 1]: j for j, i in enumerate(labels) if 0 < i <= len(values)}


def function_target(chunk, spec, cache, future_local: np.ndarray, future_rows: np.ndarray) -> np.ndarray:
    """The user function's value for every row of the chunk, checked: one finite number per entity."""
    where = _where(spec)
    out = _call(chunk, spec, cache, future_local, future_rows)
    try:
        out = np.asarray(out, np.float64).reshape(-1)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where} must return one number per entity ({e})") from e
    if len(out) != chunk.n:
        raise ValueError(f"{where} returned {len(out)} values for {chunk.n} entities (one per row of `entities`)")
    if not np.isfinite(out).all():
        raise ValueError(f"{where} returned NaN or infinite values (rows {np.flatnonzero(~np.isfinite(out))[:5].tolist()})")
    return out.astype(np.float32)
