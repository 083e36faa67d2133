"""The training cache: source Parquet encoded for the model, sharded, memory-mapped.

Layout of one cache version, `<root>/<fingerprint[:16]>/`:

    manifest.json          written last; a folder without it is not a cache
    entities.arrow         one row per entity id (0..N-1): encoded entity attributes
    vocab/<column>.parquet value -> id (1..n, most frequent first at the first build; 0 = null / unseen)
    shard-00000.arrow ...  events sorted by (entity, ts) (within one second by a hash of the row, so
                           that the same inputs give the same bytes), split by a stable hash of the
                           entity id, in record batches of 65,536 rows; appended events add pieces
                           (shard-00000-0001.arrow ...) that readers merge

Versions of one lineage (same settings, built from one another) give every value and entity the
same id forever: new data appends ids, it never renumbers, so a trained model keeps working.

Event columns, as readers get them: `entity` int32, `ts` int64 seconds, one int32 per categorical
column (item attributes joined in through their key), one float32 per numeric column. On disk the
ids are in the narrowest unsigned type that holds them and `ts` is uint32 seconds after a base kept
in the file's schema metadata (habitus.models.cache.stored). Arrow IPC buffers are zstd-compressed, so that
the cache is no bigger than its source Parquet (the cache promise is 1:1; uncompressed it was 3-4x):
a shard is read whole into memory anyway (one at a time), and decompressing it measured as fast as
copying it out of a memory map (bench/cache_size.py).

The fingerprint covers the inputs' content and the encoding settings: same inputs, same cache
(within a lineage; a fresh build numbers values by frequency).

The modules, in the order a build runs them:

    spec     TableInput, CacheSpec and their fingerprints, infer_column_type, CacheError
    build    build_cache: fresh / rebuild / append, the manifest, pruning old versions
    stage    the first passes: the quarantine's screen, counts, numeric statistics
    vocab    vocabularies, entity ids and the entity table (seeded by the previous version)
    encode   lookup tables and the encoded, sorted events, in ranges of entities
    shards   the shard writer (fixed-size record batches, so the bytes never depend on chunking)
    append   new files' events added to the previous version's shards
    stored   the narrow on-disk format and reading it back
    sql      SQL text helpers
    reader   Cache and Shard: reading a built version
"""

from habitus.models.cache.append import MAX_SHARD_FILES
from habitus.models.cache.build import DUCKDB_MEMORY, DUCKDB_THREADS, build_cache
from habitus.models.cache.encode import PART_EVENTS
from habitus.models.cache.reader import Cache, Shard
from habitus.models.cache.spec import CACHE_FORMAT, ENTITY, TS, CacheError, CacheSpec, TableInput, infer_column_type
from habitus.models.cache.stored import BATCH_ROWS, IPC_OPTIONS

__all__ = ["BATCH_ROWS", "CACHE_FORMAT", "DUCKDB_MEMORY", "DUCKDB_THREADS", "ENTITY", "IPC_OPTIONS", "MAX_SHARD_FILES",
           "PART_EVENTS", "TS", "Cache", "CacheError", "CacheSpec", "Shard", "TableInput", "build_cache",
           "infer_column_type"]
