"""embeddings: the foundation model's profile of every entity as of the end of a day, written like
predictions (Parquet, fixed width) so other teams can train their own models on it.

Each vector is the trunk's leading principal components (at most 32, unit variance), followed, where
the population carries them, by the entity's recency / frequency / monetary / visit scalars
(`FeatureSpec.scalar_width` floats, named by `scalar_column_names`) standardized by the foundation's
own input scaling: a default linear reader gets both the learned profile and the plain RFM figures
without over-fitting a wide vector (habitus.models.nn.profile chooses the width). The asset's
`columns` metadata names every position.

With `predictions.sink`, each day is also written to the warehouse table `<sink.table>_embeddings`,
that day's rows replaced: the vector as one fixed-size float32 array column where the connector
writes arrays (DuckDB FLOAT[n], Parquet), one float32 column per position elsewhere
(`warehouse_rows`; docs/guide/outputs.md)."""

import time
from datetime import datetime, timezone
from functools import partial

import dagster as dg
import numpy as np
import pyarrow as pa

from habitus.assets.cache import CACHE_KEY, current_cache
from habitus.assets.foundation import FOUNDATION_KEY
from habitus.assets.predictions import (CHUNK_ENTITIES, as_of_time, parts_of_day, scoring_pool, write_back,
                                        write_entity_file)
from habitus.assets.sources import connection_key
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.data.features import WINDOWS, FeatureSpec
from habitus.models.nn.network import load_trunk
from habitus.models.nn.profile import WHOLE, Profile
from habitus.models.serve.parts import Scorer
from habitus.models.serve.predict import embed, embedding_width
from habitus.models.nn.quantize import for_inference
from habitus.models.storage.files import combine
from habitus.resources.store.workspace import Workspace, locked

EMBEDDINGS_KEY = dg.AssetKey("embeddings")


def scalar_column_names(spec: FeatureSpec) -> list[str]:
    """Names of the scalars after the trunk's columns, in the order of habitus.models.data.features'
    scalar_features then visit_features (all log1p of the figure unless said; ages in days)."""
    h = [f"{x:g}d" for x in spec.half_lives]
    names = ["events", "days_since_last_event", "days_since_first_event"]
    names += [f"events_{w}d" for w in WINDOWS] + [f"events_decayed_{x}" for x in h]
    for c in spec.numeric:
        names += [f"{c}_sum_decayed_{x}" for x in h] + [f"{c}_mean_per_event"]
    if spec.visits:
        names += ["visits"] + [f"visits_{w}d" for w in WINDOWS] + [f"visits_decayed_{x}" for x in h]
        names += ["mean_days_between_visits", "days_since_last_visit_vs_mean_gap (difference of logs)",
                  "has_two_visits (0/1)", "events_per_visit"]
    return names


def embedding_columns(spec: FeatureSpec, hidden: int, profile: Profile = WHOLE) -> dict[str, str]:
    """What each range of an embedding's positions holds: the asset's `columns` metadata."""
    k = profile.trunk_width(hidden)
    out = ({f"0-{k - 1}": "the foundation trunk's representation (layer-normalized)"} if profile.components is None else
           {f"0-{k - 1}": f"the foundation trunk's {k} leading principal components (unit variance on the rows "
                          f"they were fitted on, the trunk's output at the foundation's last training cut-off)"})
    if not profile.scalars:
        return out
    scaled = "standardized as the trunk reads it: (value - in_mean) / in_std, fitted on the foundation's training rows"
    for i, name in enumerate(scalar_column_names(spec), k):
        out[str(i)] = f"{name}, {scaled}"
    return out


# the connectors whose `write` takes a fixed-size list column; the others get one column per position
ARRAY_CONNECTORS = {"duckdb", "parquet"}


def embeddings_table(sink) -> str:
    return f"{sink.table}_embeddings"


def warehouse_rows(table: pa.Table, layout: str) -> pa.Table:
    """An embeddings file's rows as the warehouse table holds them: `embedding` as a fixed-size list of
    float32 ('array'), or as float32 columns embedding_0 .. embedding_<n-1> in its place ('columns');
    the other columns as they are. float32: no warehouse has a half-precision type."""
    column = table.column("embedding")
    width = column.type.list_size
    vectors = column.cast(pa.list_(pa.float32(), width))
    at = table.schema.get_field_index("embedding")
    if layout == "array":
        return table.set_column(at, "embedding", vectors)
    flat = [c.flatten().to_numpy(zero_copy_only=False) for c in vectors.chunks]
    matrix = (np.concatenate(flat) if flat else np.zeros(0, np.float32)).reshape(-1, width)
    out = table.remove_column(at)
    for i in range(width):
        out = out.add_column(at + i, pa.field(f"embedding_{i}", pa.float32()), pa.array(matrix[:, i]))
    return out


def build_embeddings_asset(project, partitions_def) -> dg.AssetsDefinition:
    sink = project.predictions.sink
    kind = project.connections[sink.connection].type if sink else None

    @dg.asset(key=EMBEDDINGS_KEY, deps=[FOUNDATION_KEY, CACHE_KEY], partitions_def=partitions_def, group_name="predictions",
              kinds={"parquet"} | ({kind} if kind else set()),
              backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=31),
              required_resource_keys={"workspace", "executor"} | ({connection_key(sink.connection)} if sink else set()),
              description="Entity embeddings from the foundation model (float16, fixed width)"
                          + (f", also to the warehouse table {embeddings_table(sink)!r}" if sink else ""))
    @locked("embeddings")
    def embeddings(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        started = time.time()
        workspace: Workspace = context.resources.workspace
        executor = context.resources.executor
        device = executor.setup()
        cache = current_cache(workspace)
        state, config = load_checkpoint(workspace.foundation)
        if not cache.fits(config):
            raise dg.Failure("the cache was rebuilt with other settings since the foundation model was trained (its "
                             "ids differ); materialize foundation_model again before exporting embeddings")
        trunk = for_inference(load_trunk(state, config["net"]), executor.inference_precision).to(device)
        spec = FeatureSpec.from_dict(config["feature_spec"])
        params = {"cache": str(cache.path), "cache_fingerprint": cache.fingerprint,
                  "checkpoint": str(workspace.foundation), "weights_sha256": config["weights_sha256"],
                  "precision": executor.inference_precision, "chunk_entities": CHUNK_ENTITIES}
        profile = Profile.of(config)
        warehouse = getattr(context.resources, connection_key(sink.connection)) if sink else None
        shape = partial(warehouse_rows, layout="array" if kind in ARRAY_CONNECTORS else "columns")
        rows, written_back, files = 0, 0, []
        with scoring_pool(context, executor, device, Scorer("habitus.models.serve.predict:embedding_scorer", params),
                          cache) as pool:
            for day in context.partition_keys:  # a backfill embeds up to 31 days in one run
                as_of = as_of_time(day)
                cutoff = int(as_of.timestamp())
                if cutoff > cache.time_range[1] + 86_400:
                    context.log.warning(f"embedding as of {as_of.isoformat()}, after the newest event in the cache "
                                        f"({datetime.fromtimestamp(cache.time_range[1], timezone.utc).isoformat()}): "
                                        f"extract newer partitions for fresh embeddings")
                parts = None
                if pool is None:
                    batches = embed(trunk, cache, spec, cutoff, dtype=np.float16, device=device,
                                    chunk_entities=CHUNK_ENTITIES, profile=profile)
                else:  # several processes, a part each, read back in chunk order
                    parts = parts_of_day(context, pool, workspace.embeddings, day,
                                         combine("embeddings", params, cutoff), cache, cutoff)
                    batches = parts.batches()
                path = workspace.embeddings / f"{day}.parquet"
                day_rows = write_entity_file(cache, batches, path, project.entity, config["weights_sha256"][:16], as_of)
                if day_rows == 0:
                    raise dg.Failure(f"no entity has history before {as_of.isoformat()}: nothing to embed")
                if parts is not None:
                    parts.remove()
                if warehouse is not None:
                    written_back += write_back(warehouse, embeddings_table(sink), path, as_of, shape)
                rows += day_rows
                files.append(path)
        seconds = time.time() - started
        return dg.MaterializeResult(metadata={
            "rows": dg.MetadataValue.int(rows), "width": dg.MetadataValue.int(embedding_width(trunk, spec, profile)),
            "trunk_width": dg.MetadataValue.int(profile.trunk_width(config["net"]["hidden"])),
            "columns": dg.MetadataValue.json(embedding_columns(spec, config["net"]["hidden"], profile)),
            "dtype": "float16", "as_of": as_of.isoformat(),
            "bytes": dg.MetadataValue.int(sum(f.stat().st_size for f in files)),
            "entities_per_second": dg.MetadataValue.float(round(rows / max(seconds, 1e-9), 1)),
            "path": dg.MetadataValue.path(str(path)),
            **({"written_to_warehouse": dg.MetadataValue.int(written_back)} if sink else {}),
        })

    return embeddings
