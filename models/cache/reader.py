"""Reading a built cache: `Cache` (the manifest, vocabularies, entity table) and its shards as numpy."""

import fcntl
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from habitus.models.cache.spec import CacheError
from habitus.models.cache.stored import _read_sorted, _values
from habitus.models.storage.heap import bound_heap
from habitus.models.storage.files import read_json


@dataclass
class Shard:
    """One shard's events as numpy views over the memory-mapped file."""

    entity: np.ndarray  # int32, sorted
    ts: np.ndarray  # int64 seconds, sorted within an entity
    columns: dict[str, np.ndarray]
    entities: np.ndarray  # distinct entity ids in this shard
    starts: np.ndarray  # row where each of `entities` begins; starts[-1] == len(ts)


class Cache:
    """A built cache, opened read-only through its manifest."""

    def __init__(self, path: str | Path):
        bound_heap()  # a process that reads a cache allocates and frees chunk-sized arrays (models/storage/heap.py)
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.exists():
            raise CacheError(f"{self.path} has no manifest.json: it is not a finished cache; materialize `cache`")
        # a shared lock on the manifest while this object lives: the version is not pruned under it
        self._reader = open(mf, "rb")
        fcntl.flock(self._reader, fcntl.LOCK_SH)
        self.manifest = read_json(mf)
        self.fingerprint: str = self.manifest["fingerprint"]
        self.columns: dict[str, dict] = self.manifest["columns"]
        self.entity_columns: dict[str, dict] = self.manifest["entity_columns"]
        self.n_entities: int = self.manifest["n_entities"]
        self.time_range: tuple[int, int] = tuple(self.manifest["time_range"])
        # versions of one lineage share ids (see build_cache); a model trained on any of them fits all
        self.lineage: str = self.manifest.get("lineage", self.fingerprint)
        self._last: tuple[int, Shard] | None = None
        self._lookups: dict[str, dict[str, np.ndarray]] = {}

    def fits(self, checkpoint_config: dict) -> bool:
        """Whether a model trained on the cache recorded in `checkpoint_config` can read this one."""
        return (checkpoint_config.get("cache_fingerprint") == self.fingerprint
                or checkpoint_config.get("cache_lineage") == self.lineage)

    def __del__(self):
        reader = getattr(self, "_reader", None)
        if reader is not None:
            reader.close()  # releases the shared lock: the version may be pruned from now on

    @property
    def shard_count(self) -> int:
        return len(self.manifest["shards"])

    def shard(self, i: int) -> Shard:
        """Shard `i`; the last one asked for is kept, since training and scoring read one shard chunk
        by chunk (an appended shard is merged and sorted once, not once per chunk)."""
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        self._last = None  # (let the previous shard go before the next is read: one in memory at a time)
        shard = self._read_shard(i)
        self._last = (i, shard)
        return shard

    def _read_shard(self, i: int) -> Shard:
        table = _read_sorted([self.path / f for f in self.manifest["shards"][i]["files"]])
        cols = {c: table.column(c).to_numpy() for c in table.column_names if c in self.columns}
        for lookup in self.manifest["lookups"]:  # attributes through their key's id
            for c, values in self._lookup(lookup["file"]).items():
                cols[c] = values[cols[lookup["key"]]]
        cols = {c: cols[c] for c in self.columns}
        entity = table.column("entity").to_numpy()
        cut = np.flatnonzero(np.diff(entity)) + 1
        starts = np.r_[0, cut, len(entity)].astype(np.int64)
        return Shard(entity=entity, ts=table.column("ts").to_numpy(), columns=cols,
                     entities=entity[starts[:-1]] if len(entity) else entity[:0], starts=starts)

    def _lookup(self, file: str) -> dict[str, np.ndarray]:
        """One key's attribute table (small: a row per key value), read once while the cache is open."""
        if file not in self._lookups:
            table = ipc.open_file(pa.memory_map(str(self.path / file))).read_all()
            self._lookups[file] = {c: table.column(c).to_numpy() for c in table.column_names}
        return self._lookups[file]

    def entity_table(self) -> dict[str, np.ndarray]:
        """One array per entity attribute, indexed by entity id: views of the memory-mapped file (a cache
        built before entities.arrow was stored uncompressed decompresses it into memory instead)."""
        table = ipc.open_file(pa.memory_map(str(self.path / "entities.arrow"))).read_all()
        return {c: _values(table.column(c)) for c in table.column_names}

    def vocab(self, column: str) -> pa.Table:
        return pq.read_table(self.path / "vocab" / f"{column}.parquet")

    @functools.cached_property
    def _entity_values(self) -> pa.Array:
        # (the ids only: 12 of the file's 24 bytes an entity; 216 MB at 18M entities, read to write results)
        return pq.read_table(self.path / "vocab" / "__entity.parquet", columns=["value"]).column("value").combine_chunks()

    def entity_ids(self, ids: np.ndarray) -> pa.Array:
        """Entity index -> the entity id as the warehouse wrote it."""
        out = self._entity_values.take(pa.array(ids))
        target = _parse_type(self.manifest["entity_type"])
        return out.cast(target) if target is not None else out


def _parse_type(name: str) -> pa.DataType | None:
    try:
        return pa.type_for_alias(name.split("[")[0])
    except ValueError:  # an id type Arrow cannot name back: keep the text form
        return None
