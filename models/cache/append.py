"""Appending: the events of new source files encoded and added to the previous version's shards,
which are hard-linked, never copied or modified."""

import os
import shutil
from pathlib import Path

from habitus.models.cache.encode import _coverage, _encode
from habitus.models.cache.quarantine import finish
from habitus.models.cache.reader import Cache
from habitus.models.cache.spec import CacheSpec
from habitus.models.cache.stage import _stage_events
from habitus.models.cache.stored import _merge_shard_files
from habitus.models.cache.vocab import _write_entity_table

MAX_SHARD_FILES = 4  # an appended shard is merged back into one file when it has more pieces than this


def _append(con, spec: CacheSpec, prev: "Cache", files: dict[str, list[str]], out: Path, log, *,
            part_events: int) -> dict:
    """Encode only the events of new files and add them to `prev`'s shards, which are hard-linked
    (never copied, never modified): past events are not read, let alone re-encoded."""
    st = _stage_events(con, spec, files)
    pm = prev.manifest
    seq = pm.get("appends", 0) + 1
    n_shards = len(pm["shards"])
    # (no valid rows: nothing to write; the vocabularies and entity ids are those of `prev`)
    enc = _encode(con, spec, st, out, seed=prev, append=True, n_shards=n_shards,
                  name=lambda s: f"shard-{s:05d}-{seq:04d}.arrow", part_events=part_events)
    stats = finish(st.stats, enc["n_events"])
    delta = {s: (f, rows, enc["entities"].get(s, (0, 0))[1]) for s, (f, rows) in enc["written"].items()}
    shards = []
    for s, meta in enumerate(pm["shards"]):
        for f in meta["files"]:
            _link(prev.path / f, out / f)
        meta = {"files": list(meta["files"]), "rows": meta["rows"], "entities": meta["entities"]}
        if s in delta:
            f, rows, new_entities = delta[s]
            meta.update(files=meta["files"] + [f], rows=meta["rows"] + rows, entities=meta["entities"] + new_entities)
        if len(meta["files"]) > MAX_SHARD_FILES:
            merged = f"shard-{s:05d}-{seq:04d}-merged.arrow"
            _merge_shard_files([out / f for f in meta["files"]], out / merged)
            for f in meta["files"]:
                (out / f).unlink()
            meta["files"] = [merged]
        shards.append(meta)
    n_new = sum(r for _, r, _ in delta.values())
    log(f"appended {n_new:,} events from {sum(map(len, files.values()))} new file(s) to {n_shards} shard(s)")

    entity_columns = _write_entity_table(con, spec, out, prev)
    t_min, t_max = pm["time_range"]
    if n_new:
        lo, hi = enc["time_range"]
        t_min, t_max = min(t_min, int(lo)), max(t_max, int(hi))
    coverage = enc["coverage"]
    counts = {name: [a + b for a, b in zip(pm["join_counts"].get(name, [0, 0]), coverage.get(name, [0, 0]))]
              for name in set(pm["join_counts"]) | set(coverage)}
    return {
        **{k: pm[k] for k in ("entity", "entity_type")},
        "n_entities": enc["n_entities"],
        "n_events": pm["n_events"] + n_new,
        "time_range": [t_min, t_max],
        "columns": enc["columns"],
        "lookups": enc["lookups"],
        "entity_columns": entity_columns,
        "shards": shards,
        "appends": seq,
        "dropped": {"null_entity": pm["dropped"]["null_entity"] + stats["null_entity"],
                    "null_timestamp": pm["dropped"]["null_timestamp"] + stats["null_timestamp"]},
        "quarantine": _add_counts(pm.get("quarantine", {}), stats),
        "join_counts": counts,
        "join_coverage": _coverage(counts),
        "sources": {t.name: sorted(t.files) for t in spec.events + spec.entity_attributes + spec.attributes},
    }


def _add_counts(before: dict, now: dict) -> dict:
    """Quarantine counts of a version and its appended rows (duplicates are found within each)."""
    out = {k: before.get(k, 0) + v for k, v in now.items() if not k.endswith("_share")}
    rows = out.get("rows_in", 0)
    out["dropped_share"] = round((rows - out.get("rows_kept", 0)) / rows, 6) if rows else 0.0
    out["repaired_share"] = round(out.get("rows_repaired", 0) / rows, 6) if rows else 0.0
    return out


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: copy (still never modifies the previous version)
        shutil.copyfile(src, dst)
