"""build_cache: build a cache version (fresh, rebuilt with a previous version's ids, or appended to
it), write its manifest last, and prune old versions."""

import fcntl
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import pyarrow.ipc as ipc

from habitus.models.cache.append import _append
from habitus.models.cache.encode import PART_EVENTS, _coverage, _encode
from habitus.models.cache.quarantine import finish, summary
from habitus.models.cache.reader import Cache
from habitus.models.cache.spec import CACHE_FORMAT, CacheError, CacheSpec
from habitus.models.cache.stage import _stage_events
from habitus.models.cache.stored import IPC_OPTIONS
from habitus.models.cache.vocab import _entity_arrow_type, _write_entity_table
from habitus.models.storage.files import atomic_path, read_json, write_json

# The DuckDB connection of a build. Memory: bounded, DuckDB spills to the workspace beyond this (a build
# needs far less: the sort runs over `part_events` events at a time). Threads: None is DuckDB's default,
# one per core; 1 is faster on a machine whose cores other work keeps busy.
DUCKDB_MEMORY = "2GB"
DUCKDB_THREADS: int | None = None


def build_cache(spec: CacheSpec, root: str | Path, *, previous: str | Path | None = None,
                log: Callable[[str], None] = print, keep: int = 2, duckdb_memory: str = DUCKDB_MEMORY,
                duckdb_threads: int | None = DUCKDB_THREADS, part_events: int = PART_EVENTS) -> Path:
    """Build (or reuse) the cache for `spec` under `root`; returns its folder.

    With `previous` (the cache in use) built with the same settings, ids stay stable: when the only
    change is new events files, their events are encoded and appended to the previous version's
    shards ("append"); any other change re-encodes everything with the previous vocabularies and
    entity ids as a seed ("rebuild"). Either way a value or entity keeps the id it had, and new
    ones get the next ids, so models trained on an earlier version keep working on the new one.

    `duckdb_memory` (DuckDB's memory_limit, e.g. "2GB"), `duckdb_threads` (None: one per core) and
    `part_events` (the events sorted at a time) change how the build runs, never what it writes: they
    are not part of the fingerprint."""
    import duckdb  # heavy import kept out of module import time

    root = Path(root)
    fp = spec.fingerprint()
    out = root / fp[:16]
    if (out / "manifest.json").exists() and read_json(out / "manifest.json").get("fingerprint") == fp:
        log(f"cache {out} is up to date (fingerprint {fp[:16]}); reusing it")
        return out
    started = time.time()
    for t in spec.events + spec.entity_attributes + spec.attributes:
        if not t.files:
            raise CacheError(f"source {t.name!r} has no extracted Parquet files; materialize source/{t.name} first")
    prev = _same_lineage(previous, spec, log)
    inputs = spec.file_prints()
    new_files = _new_events_files(prev, spec, inputs) if prev is not None else None
    mode = "fresh" if prev is None else ("append" if new_files else "rebuild")
    # the cache is no bigger than its sources (format 3); the estimate names what a full disk lacked
    needed = sum(os.path.getsize(f) for t in spec.events + spec.entity_attributes + spec.attributes for f in t.files)
    with atomic_path(out, needed_bytes=needed) as tmp:
        tmp.mkdir(parents=True)
        spill = tmp / "_spill"
        config = {"temp_directory": str(spill), "memory_limit": duckdb_memory}
        if duckdb_threads:
            config["threads"] = int(duckdb_threads)
        con = duckdb.connect(config=config)
        try:
            if mode == "append":
                manifest = _append(con, spec, prev, new_files, tmp, log, part_events=part_events)
            else:
                manifest = _build(con, spec, tmp, log, seed=prev, part_events=part_events)
        finally:
            con.close()
            shutil.rmtree(spill, ignore_errors=True)
        manifest.update(fingerprint=fp, format=CACHE_FORMAT, settings=spec.settings_fingerprint(), inputs=inputs,
                        mode=mode, lineage=prev.lineage if prev else fp, parent=prev.fingerprint if prev else None,
                        build_seconds=round(time.time() - started, 3))
        write_json(tmp / "manifest.json", manifest)
    _prune(root, keep=keep, current=out)
    log(f"cache {mode} in {time.time() - started:.1f}s: {manifest['n_events']:,} events, "
        f"{manifest['n_entities']:,} entities, {len(manifest['shards'])} shard(s) at {out}")
    return out


def _same_lineage(previous, spec: CacheSpec, log) -> "Cache | None":
    if previous is None or not (Path(previous) / "manifest.json").exists():
        return None
    prev = Cache(previous)
    if prev.manifest.get("format") != CACHE_FORMAT or prev.manifest.get("settings") != spec.settings_fingerprint():
        log(f"the cache settings or format changed since {prev.path.name}: encoding from scratch (new ids; models "
            f"trained on the old cache must be retrained)")
        return None
    return prev


def _new_events_files(prev: "Cache", spec: CacheSpec, inputs: dict) -> dict[str, list[str]] | None:
    """The events files added since `prev`, per source, when nothing `prev` read changed; else None."""
    before = prev.manifest["inputs"]
    added: dict[str, list[str]] = {}
    for t in spec.events:
        old, now = before.get(t.name, {}), inputs[t.name]
        if any(now.get(f) != h for f, h in old.items()):
            return None  # a file was re-extracted (late rows) or removed: re-encode
        added[t.name] = sorted(set(now) - set(old))
    return added if any(added.values()) else None


def _prune(root: Path, keep: int, current: Path) -> None:
    """Delete all but the `keep` newest versions, except those a reader has open (a training run
    started on an older version keeps reading it while new data is appended)."""
    versions = sorted((p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").exists()),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in versions[keep:]:
        if old == current:
            continue
        with open(old / "manifest.json", "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use: the next build prunes it
            (old / "manifest.json").unlink()  # first: a folder without a manifest is never read again
            shutil.rmtree(old, ignore_errors=True)


def _build(con, spec: CacheSpec, out: Path, log, seed: "Cache | None", part_events: int) -> dict:
    st = _stage_events(con, spec, {t.name: t.files for t in spec.events})
    if st.stats["rows_in"] == 0:
        raise CacheError("the events sources hold no rows: nothing to train on; extract source partitions with data")
    if st.stats["rows_valid"] == 0:
        raise CacheError(f"every event row was quarantined ({summary(finish(st.stats, 0))}); fix the source data or "
                         f"the config")
    enc = _encode(con, spec, st, out, seed=seed, append=False, part_events=part_events)
    stats = finish(st.stats, enc["n_events"])
    n_shards = enc["n_shards"]
    shards = []
    for s in range(n_shards):  # every shard gets a file, so shard i is always manifest["shards"][i]
        if s not in enc["written"]:
            with ipc.new_file(str(out / f"shard-{s:05d}.arrow"), enc["schema"], options=IPC_OPTIONS):
                pass
        f, rows = enc["written"].get(s, (f"shard-{s:05d}.arrow", 0))
        shards.append({"files": [f], "rows": rows, "entities": enc["entities"].get(s, (0, 0))[0]})
    log(f"encoded {enc['n_events']:,} events into {n_shards} shard(s)")

    entity_columns = _write_entity_table(con, spec, out, seed)
    t_min, t_max = enc["time_range"]
    return {
        "entity": spec.entity,
        "entity_type": str(_entity_arrow_type(spec)),
        "n_entities": enc["n_entities"],
        "n_events": enc["n_events"],
        "time_range": [int(t_min), int(t_max)],
        "columns": enc["columns"],
        "lookups": enc["lookups"],
        "entity_columns": entity_columns,
        "shards": shards,
        "appends": 0,
        "dropped": {"null_entity": stats["null_entity"], "null_timestamp": stats["null_timestamp"]},
        "quarantine": stats,
        "join_counts": enc["coverage"],
        "join_coverage": _coverage(enc["coverage"]),
        "sources": {t.name: sorted(t.files) for t in spec.events + spec.entity_attributes + spec.attributes},
    }
