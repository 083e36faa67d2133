"""embeddings: the foundation model's representation of every entity as of the end of a day,
written like predictions (Parquet, fixed width) so other teams can train their own models on it."""

import time

import dagster as dg
import numpy as np

from assets.cache import CACHE_KEY, current_cache
from assets.foundation import FOUNDATION_KEY
from assets.predictions import as_of_time, write_entity_file
from models.checkpoint import load_checkpoint
from models.features import FeatureSpec
from models.network import NetConfig, Trunk
from models.predict import embed
from models.quantize import for_inference
from resources.workspace import Workspace, locked

EMBEDDINGS_KEY = dg.AssetKey("embeddings")


def build_embeddings_asset(project, partitions_def) -> dg.AssetsDefinition:
    @dg.asset(key=EMBEDDINGS_KEY, deps=[FOUNDATION_KEY, CACHE_KEY], partitions_def=partitions_def, group_name="predictions",
              kinds={"parquet"}, backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=31),
              required_resource_keys={"workspace", "executor"},
              description="Entity embeddings from the foundation model (float16, fixed width)")
    @locked("embeddings")
    def embeddings(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        started = time.time()
        workspace: Workspace = context.resources.workspace
        device = context.resources.executor.setup()
        cache = current_cache(workspace)
        state, config = load_checkpoint(workspace.foundation)
        if not cache.fits(config):
            raise dg.Failure("the cache was rebuilt with other settings since the foundation model was trained (its "
                             "ids differ); materialize foundation_model again before exporting embeddings")
        trunk = Trunk(NetConfig(**config["net"]))
        trunk.load_state_dict({k.removeprefix("trunk."): v for k, v in state.items() if k.startswith("trunk.")})
        trunk = for_inference(trunk, context.resources.executor.inference_precision).to(device)
        rows, files = 0, []
        for day in context.partition_keys:  # a backfill embeds up to 31 days in one run
            as_of = as_of_time(day)
            batches = embed(trunk, cache, FeatureSpec.from_dict(config["feature_spec"]), int(as_of.timestamp()),
                            dtype=np.float16, device=device)
            path = workspace.embeddings / f"{day}.parquet"
            day_rows = write_entity_file(cache, batches, path, project.entity, config["weights_sha256"][:16], as_of)
            if day_rows == 0:
                raise dg.Failure(f"no entity has history before {as_of.isoformat()}: nothing to embed")
            rows += day_rows
            files.append(path)
        seconds = time.time() - started
        return dg.MaterializeResult(metadata={
            "rows": dg.MetadataValue.int(rows), "width": dg.MetadataValue.int(config["net"]["hidden"]),
            "dtype": "float16", "as_of": as_of.isoformat(),
            "bytes": dg.MetadataValue.int(sum(f.stat().st_size for f in files)),
            "entities_per_second": dg.MetadataValue.float(round(rows / max(seconds, 1e-9), 1)),
            "path": dg.MetadataValue.path(str(path)),
        })

    return embeddings
