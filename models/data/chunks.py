"""How every reader walks a cache: entity chunks of each shard (training, the hold-out, the stacked
head's rows, predictions and explanations read the same plan), at cut-offs on day boundaries."""

from habitus.models.cache import Cache
from habitus.models.data.features import DAY


# entities a chunk holds. Training reads CHUNK_ENTITIES at a time (its batches are drawn within a chunk),
# and so do the hold-out and explanations; the scoring passes (predictions, embeddings, the stacked
# head's rows, LightGBM's rows) read SCORING_CHUNK_ENTITIES: fewer, larger reads where no gradient is kept
CHUNK_ENTITIES = 4096
SCORING_CHUNK_ENTITIES = 8192


def day_floor(ts: int) -> int:
    return int(ts) // DAY * DAY


def chunk_plan(cache: Cache, chunk_entities: int) -> list[tuple[int, int, int]]:
    """(shard, first entity position, end position) covering every entity of every shard."""
    plan = []
    for s, meta in enumerate(cache.manifest["shards"]):
        for lo in range(0, meta["entities"], chunk_entities):
            plan.append((s, lo, min(lo + chunk_entities, meta["entities"])))
    return plan
