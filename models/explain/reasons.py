"""Attributions summed by group into ranked reasons, with the values a person reads next to them."""

import numpy as np

from habitus.models.explain.inputs import Groups
from habitus.models.explain.integrated import Explained
from habitus.models.data.features import Chunk, FeatureSpec


def column_totals(groups: Groups, ex: Explained, label_column: str | None = None) -> tuple[list, np.ndarray]:
    """Each pair's attribution summed by (source, column): (the (source, column) list, [m, columns]).
    Rare labels' own history (`extra`) counts for the label column."""
    keys = list(dict.fromkeys(groups.columns()))
    index = {k: j for j, k in enumerate(keys)}
    of_group = np.array([index[k] for k in groups.columns()], np.int64)
    out = np.zeros((len(ex.rows), len(keys)), np.float64)
    np.add.at(out.T, of_group, ex.dense.T.astype(np.float64))
    if len(ex.extra[0]) and label_column is not None:
        j = next(index[k] for k in keys if k[1] == label_column)
        np.add.at(out[:, j], ex.extra[0], ex.extra[2])
    return keys, out


def top_reasons(ex: Explained, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The `top` largest |attributions| of each pair, largest first: (pair, group, label position of
    an `extra` or -1, contribution), pair-major. Groups outside the top are summed by the caller."""
    m, G = ex.dense.shape
    k = min(top, G)
    cand = np.argpartition(-np.abs(ex.dense), k - 1, axis=1)[:, :k]
    pair = np.repeat(np.arange(m), k)
    group = cand.ravel()
    label = np.full(len(group), -1, np.int64)
    value = ex.dense[pair, group]
    if len(ex.extra[0]):
        pair = np.r_[pair, ex.extra[0]]
        group = np.r_[group, np.full(len(ex.extra[0]), -1)]
        label = np.r_[label, ex.extra[1]]
        value = np.r_[value, ex.extra[2]]
    order = np.lexsort((-np.abs(value), pair))
    pair, group, label, value = pair[order], group[order], label[order], value[order]
    first = np.searchsorted(pair, pair, side="left")
    keep = (np.arange(len(pair)) - first) < top
    keep &= value != 0
    return pair[keep], group[keep], label[keep], value[keep]


def value_stats(chunk: Chunk, column: np.ndarray, rows: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each (entity row, key) asked: how many of the entity's events before the cut-off have
    `column` (per history event: a bucket or a value id) == key, and days since the last of them
    (NaN when none)."""
    n_keys = int(max(column.max(initial=0), keys.max(initial=0))) + 1
    ev = chunk.local.astype(np.int64) * n_keys + column
    order = np.lexsort((chunk.age_days, ev))  # by key, the most recent event of a key first
    ev, age = ev[order], chunk.age_days[order]
    want = rows.astype(np.int64) * n_keys + keys
    lo, hi = np.searchsorted(ev, want, "left"), np.searchsorted(ev, want, "right")
    count = hi - lo
    last = np.full(len(want), np.nan, np.float32)
    has = count > 0
    last[has] = age[lo[has]]
    return count.astype(np.int32), last


def rendered(spec: FeatureSpec, groups: Groups, ex: Explained, x: np.ndarray, chunk: Chunk, entity_table: dict,
             vocab, task, label_names, top: int) -> dict[str, np.ndarray]:
    """The `top` reasons of every pair as flat columns (one row per reason): what the explanations
    asset writes. `vocab(column)` as for input_groups; `label_names[l]`: the text of label position l."""
    pair, group, label, value = top_reasons(ex, top)
    rank = (np.arange(len(pair)) - np.searchsorted(pair, pair, side="left") + 1).astype(np.int16)
    is_extra = group < 0
    g = np.where(is_extra, 0, group)
    kind = np.asarray(groups.kind, object)[g]
    source = np.asarray(groups.source, object)[g]
    col = np.asarray(groups.column, object)[g]
    text = np.asarray(groups.value, object)[g].copy()
    tcol = task.target.column
    if is_extra.any():  # a rare label's own history: the label column's source, the label's own name
        j = groups.column.index(tcol) if tcol in groups.column else 0
        kind[is_extra], source[is_extra], col[is_extra] = "value", groups.source[j], tcol
        text[is_extra] = np.asarray(label_names, object)[label[is_extra]]
    ent_row = ex.rows[pair]
    count = np.full(len(pair), -1, np.int32)
    last = np.full(len(pair), np.nan, np.float32)
    raw = np.full(len(pair), np.nan, np.float32)
    for c in spec.categorical:  # the value's own counts and recency
        ids = chunk.shard.columns[c][chunk.rows]
        sel = (col == c) & (kind == "value")
        if not sel.any():
            continue
        b = sel & ~is_extra
        if b.any():
            count[b], last[b] = value_stats(chunk, spec.bucket(c, ids), ent_row[b],
                                            groups.value_id[g[b]])
        e = sel & is_extra
        if e.any():
            count[e], last[e] = value_stats(chunk, ids.astype(np.int64), ent_row[e],
                                            np.asarray(task.target.labels, np.int64)[label[e]])
    # the entity's own value of the scalar, in days / counts / amounts (a group only a served head's trees
    # read has no network input to read it from: models/explain/served.py)
    first_input = np.full(len(groups), -1, np.int64)
    present, first = np.unique(groups.of_input, return_index=True)
    first_input[present] = first
    scalars = ~np.isin(kind, ["value", "attribute", "representation", "sequence"]) & (first_input[g] >= 0)
    if scalars.any():
        v = x[ent_row[scalars], first_input[g[scalars]]]
        raw[scalars] = _raw_scalar(v, np.asarray(groups.value, object)[g[scalars]])
    attr = kind == "attribute"
    for c in set(col[attr]):  # the entity's own attribute value
        sel = attr & (col == c)
        vals = entity_table[c][chunk.entities[ent_row[sel]]]
        if c in spec.entity_categorical:
            names = vocab(f"entity.{c}")
            text[sel] = [names[int(i) - 1] if 0 < int(i) <= len(names) else "(unknown)" for i in vals]
        elif c in spec.entity_timestamp:
            years = (chunk.cutoff - vals.astype(np.float64)) / (365.0 * 86_400)
            text[sel] = [f"{y:.1f} years ago" if np.isfinite(y) else "(missing)" for y in years]
            raw[sel] = years
        else:
            text[sel] = [f"{float(v):g}" if np.isfinite(v) else "(missing)" for v in vals.astype(np.float64)]
            raw[sel] = vals.astype(np.float64)
    reason = [_sentence(*r) for r in zip(kind, col, text, count, last, raw, value)]
    gap = ex.gap
    total = ex.total
    top_sum = np.bincount(pair, value, minlength=len(ex.rows))
    return {"row": ent_row, "pair": pair, "rank": rank, "kind": kind.astype(str), "source": source.astype(str),
            "column": col.astype(str), "value": text.astype(str), "contribution": value.astype(np.float32),
            "count": count, "days_since_last": last, "entity_value": raw, "reason": np.asarray(reason, str),
            "others": (total - top_sum)[pair].astype(np.float32), "gap": gap[pair].astype(np.float32)}


def _raw_scalar(v: np.ndarray, names: np.ndarray) -> np.ndarray:
    """A scalar input back in its own units (features.py stores most as log1p, signed for sums)."""
    out = np.sign(v) * np.expm1(np.abs(v))
    keep = np.array([n.startswith("days since the last visit against") or n.startswith("visited on") for n in names])
    out[keep] = v[keep]
    return out


def _sentence(kind, column, value, count, last, raw, contribution) -> str:
    sign = f"{contribution:+.4g}"
    if kind == "value":
        seen = f"{count} events, last {last:.0f} days ago" if count > 0 else "never"
        return f"{column} = {value}: {seen}: {sign}"
    if kind == "attribute":
        return f"{column} = {value}: {sign}"
    if not np.isfinite(raw):  # the representation, or a scalar without a network input
        return f"{value}: {sign}"
    return f"{value}: {raw:.4g}: {sign}"
