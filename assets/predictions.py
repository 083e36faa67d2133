"""predictions/<name>: daily scores of every eligible entity, as of the end of the partition's day,
to `predictions/<name>/<day>.parquet` and, when a sink is configured, back to the warehouse.

Multilabel rows hold the top `predictions.top_k` labels, or every label with `predictions.format: all`;
`predictions.without_history: flag` adds a row (null scores, has_history false) for each entity of the
cache with no event before as_of. The README's "Outputs" section lists the columns."""

import contextlib
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from habitus.assets.cache import CACHE_KEY, current_cache
from habitus.assets.scenarios import scenario_key
from habitus.assets.serving import CHECKPOINT_NOTE, load_serving, serves_baseline, serving_checkpoint, serving_note
from habitus.assets.sources import connection_key
from habitus.models.cache import Cache
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
from habitus.models.serve.parts import Parts, Pool, Scorer, staging
from habitus.models.serve.predict import load_model, predict
from habitus.models.nn.quantize import for_inference
from habitus.models.storage.files import DiskFullError, combine, durable_replace, is_disk_full
from habitus.models.heads.stacked_head import load_head
from habitus.models.tasks import task as task_of
from habitus.resources.training.executor import TrainingExecutor
from habitus.resources.store.workspace import Workspace, locked


def scoring_asset(key: dg.AssetKey, name: str, partitions_def, sink, kinds: set[str], description: str):
    """The decorator of a daily asset computed from scenario `name`'s serving checkpoint (predictions,
    explanations): after the scenario and the cache, up to 31 days a run (a year: 12 runs), with the
    sink's connection when it writes back."""
    resource_keys = {"workspace", "executor"} | ({connection_key(sink.connection)} if sink else set())
    return dg.asset(key=key, deps=[scenario_key(name), CACHE_KEY], partitions_def=partitions_def,
                    required_resource_keys=resource_keys, group_name="predictions", kinds=kinds,
                    backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=31), description=description)


def scoring_inputs(context, name: str, doing: str) -> tuple[Workspace, TrainingExecutor, str, Cache, dict, dict, bool]:
    """What a scoring asset of scenario `name` starts from: the workspace, the executor, its device (set
    up), the cache in use, and the checkpoint serving the scenario: its state, its config and whether it
    passed its check (assets/serving.py; `doing` names the asset's work when the cache no longer fits)."""
    workspace: Workspace = context.resources.workspace
    executor: TrainingExecutor = context.resources.executor
    device, cache = executor.setup(), current_cache(workspace)
    return (workspace, executor, device, cache, *load_serving(workspace, cache, name, doing))


def as_of_time(day: str) -> datetime:
    """A daily partition scores as of the end of its day (the next midnight, UTC)."""
    return datetime.fromisoformat(day).replace(tzinfo=timezone.utc) + timedelta(days=1)


def write_entity_file(cache, batches, path: Path, entity_column: str, fingerprint: str, as_of: datetime) -> int:
    """Write (entity index, ...) batches as (<entity id>, ..., model_fingerprint, as_of) Parquet,
    whole or not at all. Returns the rows written (0 writes nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    rows, writer = 0, None
    try:
        for b in batches:
            cols = {entity_column: cache.entity_ids(b.column("entity_index").to_numpy())}
            cols.update({c: b.column(c) for c in b.schema.names if c != "entity_index"})
            cols["model_fingerprint"] = pa.array([fingerprint] * len(b))
            cols["as_of"] = pa.array([as_of.replace(tzinfo=None)] * len(b), pa.timestamp("s"))
            out = pa.record_batch(cols)
            writer = writer or pq.ParquetWriter(tmp, out.schema, compression="zstd",
                                                use_dictionary=dictionary_columns(out.schema))
            writer.write_batch(out)
            rows += len(out)
        if writer is not None:
            writer.close()
            durable_replace(tmp, path)  # write -> fsync -> rename -> fsync(folder): a commit (models/storage/files.py)
    except OSError as e:
        if is_disk_full(e):  # the partial copy goes (finally); the day's previous file, if any, is intact
            raise DiskFullError(path, tmp.stat().st_size if tmp.exists() else 0, None) from e
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    return rows


def dictionary_columns(schema: pa.Schema) -> list[str]:
    """The Parquet leaf columns worth a dictionary: all but floating-point ones (scores, embeddings),
    whose values hardly repeat, so that Parquet builds a dictionary only to fall back from it (3.5x
    the CPU time of writing 8,192 embeddings of 296 float16 for 4% more bytes, measured)."""
    out = []
    for f in schema:
        t, path = f.type, f.name
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            t, path = t.value_type, f"{f.name}.list.element"
        if not pa.types.is_floating(t):
            out.append(path)
    return out


def write_day(cache, batches, path: Path, name: str, entity_column: str, fingerprint: str, as_of: datetime,
              warehouse=None, table: str | None = None) -> tuple[int, int]:
    """A day of scenario `name` (scores or reasons) to `path` (write_entity_file) and, with a warehouse,
    to its `table`, that day's rows replaced. Returns (rows, rows written back); no eligible entity fails."""
    rows = write_entity_file(cache, batches, path, entity_column, fingerprint, as_of)
    if rows == 0:
        raise dg.Failure(f"no entity is eligible for scenario {name!r} as of {as_of.isoformat()}: the cache "
                         f"holds no history before that time")
    if warehouse is None:
        return rows, 0
    return rows, write_back(warehouse, table, path, as_of)


def write_back(warehouse, table: str, path: Path, as_of: datetime, shape=None) -> int:
    """The day's file at `path` to the warehouse's `table` (the connector's `write`), the rows of that
    `as_of` replaced: a re-run replaces, never duplicates. `shape` turns the file's Arrow table into
    the rows written (embeddings: assets/embeddings.py `warehouse_rows`). Returns the rows written."""
    written = pq.read_table(path)
    if shape is not None:
        written = shape(written)
    return warehouse.write(table, written.to_batches(), written.schema, replace=("as_of", as_of.replace(tzinfo=None)))


def write_days(context, asset: str, name: str, folder: Path, batches_of, cache, entity_column: str, fingerprint: str,
               sink=None, table: str | None = None, unit: str = "rows", written=None) -> tuple[int, int, list[Path]]:
    """Each day of the run's partitions (a backfill: up to 31 in one run): `batches_of(day, as_of)` of
    scenario `name` written by write_day to `folder`/<day>.parquet and, with a sink, to the `table` of its
    connection; logged as `<asset>/<name> <day>: <rows> <unit>`; then `written(day)`, if given (the day's
    parts go once its file is in place). Returns (rows, rows written back, files)."""
    warehouse = getattr(context.resources, connection_key(sink.connection)) if sink is not None else None
    rows, written_back, files = 0, 0, []
    for day in context.partition_keys:
        as_of = as_of_time(day)
        path = folder / f"{day}.parquet"
        day_rows, day_written = write_day(cache, batches_of(day, as_of), path, name, entity_column, fingerprint, as_of,
                                          warehouse, table)
        context.log.info(f"{asset}/{name} {day}: {day_rows:,} {unit}")
        if written is not None:
            written(day)
        rows, written_back = rows + day_rows, written_back + day_written
        files.append(path)
    return rows, written_back, files


@contextlib.contextmanager
def scoring_pool(context, executor: TrainingExecutor, device: str, scorer: Scorer, cache):
    """The run's scoring processes (models/serve/parts.py), as many as the executor gives `device` for the
    cache's chunks (inference_processes; by default one per GPU or core, a small cache one); None when
    that is one: this process scores alone, nothing is staged."""
    devices, threads = executor.inference_plan(device, len(chunk_plan(cache, CHUNK_ENTITIES)))
    if len(devices) == 1:
        yield None
        return
    context.log.info(f"scoring in {len(devices)} processes ({', '.join(devices)}), {threads} torch thread(s) each")
    with Pool(scorer, len(devices), devices, threads, log=context.log.info) as pool:
        yield pool


def parts_of_day(context, pool: Pool, folder: Path, day: str, key: str, cache, cutoff: int) -> Parts:
    """The day's parts, every chunk scored by one of the pool's processes (those a killed run left
    complete are kept): whole, ready to be read in order."""
    parts = Parts(staging(folder, day), key, len(chunk_plan(cache, CHUNK_ENTITIES)))
    kept = parts.chunks - len(parts.todo())
    done = pool.day(parts, cutoff)
    context.log.info(f"{folder.name} {day}: " + ", ".join(f"process {d['rank']} {d['rows']:,} rows in {d['chunks']} chunks"
                                                          for d in done)
                     + (f"; {kept} chunks kept from an earlier run" if kept else ""))
    return parts


CHUNK_ENTITIES = SCORING_CHUNK_ENTITIES  # habitus.models.serve.predict's chunk: the same chunks whatever the number of processes


def without_history(cache, cutoff: int) -> np.ndarray:
    """Entity indices of the cache with no event at or before `cutoff` (entities known only from an
    entity attributes table, or whose first event is later)."""
    seen = np.zeros(cache.n_entities, bool)
    for i in range(cache.shard_count):
        shard = cache.shard(i)
        if len(shard.entities):
            seen[shard.entities[shard.ts[shard.starts[:-1]] <= cutoff]] = True  # times sorted within an entity
    return np.flatnonzero(~seen)


def flag_without_history(batches, cache, cutoff: int, block: int = 65_536):
    """The scored batches with has_history = true, then one row per entity without history: null
    scores (labels), has_history = false (predictions.without_history: flag)."""
    schema = None
    for b in batches:
        schema = b.schema
        yield b.append_column("has_history", pa.array(np.ones(len(b), bool)))
    if schema is None:  # nothing scored: the asset fails on that, not on the flagged rows
        return
    missing = without_history(cache, cutoff)
    for i in range(0, len(missing), block):
        idx = missing[i:i + block]
        cols = {"entity_index": pa.array(idx.astype(np.int64))}
        cols.update({f.name: pa.nulls(len(idx), f.type) for f in schema if f.name != "entity_index"})
        cols["has_history"] = pa.array(np.zeros(len(idx), bool))
        yield pa.record_batch(cols)


def predictions_key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["predictions", name])


def build_predictions_asset(project, name: str, partitions_def) -> dg.AssetsDefinition:
    sink = project.predictions.sink

    @scoring_asset(predictions_key(name), name, partitions_def, sink, {"parquet"},
                   f"Daily scores of scenario {name!r} from its newest version that beat its baselines, else "
                   f"from its best baseline")
    @locked(f"predictions/{name}")
    def _predictions(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        started = time.time()
        baseline = serves_baseline(context.resources.workspace, name)
        if baseline is not None:
            return baseline_days(context, project, name, baseline, started)
        workspace, executor, device, cache, state, config, passed = scoring_inputs(context, name, "predicting")
        if not passed:
            context.log.warning(f"scenario {name!r}: predictions use the {serving_note(workspace, name)}")
        model, spec, task = load_model(state, config)
        precision = project.scenarios[name].inference_precision or executor.inference_precision
        if precision == "int8" and not device.startswith("cpu"):
            raise dg.Failure(f"scenarios.{name}.inference_precision int8 runs on the CPU only (device {device}); "
                             f"use bf16 on GPUs")
        # fp32, int8 (CPU) or bf16: the scenario's, else the executor's
        model = for_inference(model.to(device), precision)
        # the head chosen on validation, saved with the checkpoint (None: an older one, the network alone)
        checkpoint = serving_checkpoint(workspace, name)[0]
        head = load_head(checkpoint, config)
        fingerprint = config["weights_sha256"][:16]
        settings = project.predictions
        k = settings.top_k
        if settings.format == "all" and task_of(task).writes_every_label:  # every label, best first
            k = len(config.get("label_values") or ()) or model.head.linear.out_features

        label_names = config.get("label_values") or None
        params = {"cache": str(cache.path), "cache_fingerprint": cache.fingerprint, "checkpoint": str(checkpoint),
                  "weights_sha256": config["weights_sha256"], "precision": precision, "k": k,
                  "label_names": label_names, "chunk_entities": CHUNK_ENTITIES}
        folder, staged = workspace.predictions(name), {}

        def batches_of(day: str, as_of: datetime):
            cutoff = int(as_of.timestamp())
            if cutoff > cache.time_range[1] + 86_400:
                context.log.warning(f"scoring as of {as_of.isoformat()}, after the newest event in the cache "
                                    f"({datetime.fromtimestamp(cache.time_range[1], timezone.utc).isoformat()}): "
                                    f"extract newer partitions for fresh scores")
            if pool is None:
                batches = predict(model, cache, spec, task, cutoff, k=k, label_names=label_names, device=device,
                                  head=head, chunk_entities=CHUNK_ENTITIES)
            else:  # several processes, a part each; read back in chunk order: what one process yields
                key = combine("predictions", params, config.get("stack"), cutoff)
                staged[day] = parts_of_day(context, pool, folder, day, key, cache, cutoff)
                batches = staged[day].batches()
            return flag_without_history(batches, cache, cutoff) if settings.without_history == "flag" else batches

        with scoring_pool(context, executor, device, Scorer("habitus.models.serve.predict:scenario_scorer", params),
                          cache) as pool:
            rows, written_back, files = write_days(context, "predictions", name, folder, batches_of, cache,
                                                   project.entity, fingerprint, sink,
                                                   f"{sink.table}_{name}" if sink else None,
                                                   written=lambda day: staged.pop(day).remove() if day in staged else None)
        seconds = time.time() - started
        return dg.MaterializeResult(metadata={
            "rows": dg.MetadataValue.int(rows),
            "days": dg.MetadataValue.int(len(files)),
            "as_of": as_of_time(context.partition_keys[-1]).isoformat(),
            "model_fingerprint": fingerprint,
            "checkpoint": CHECKPOINT_NOTE[passed],
            "bytes": dg.MetadataValue.int(sum(f.stat().st_size for f in files)),
            "entities_per_second": dg.MetadataValue.float(round(rows / max(seconds, 1e-9), 1)),
            "written_to_warehouse": dg.MetadataValue.int(written_back),
            "seconds": dg.MetadataValue.float(round(seconds, 3)),
            "path": dg.MetadataValue.path(str(files[-1])),
        })

    return _predictions


def baseline_days(context, project, name: str, config: dict, started: float) -> dg.MaterializeResult:
    """The run's days of scenario `name` scored by the baseline version serving it (`config`: its
    config.json; models/evaluate/baselines.py), in the columns and files a network's scores take."""
    from habitus.models.evaluate.baselines import baseline_predictions

    workspace: Workspace = context.resources.workspace
    cache = current_cache(workspace)
    if not cache.fits(config):
        raise dg.Failure(f"the cache was rebuilt with other settings since scenario {name!r}'s baseline was fitted; "
                         f"materialize foundation_model and scenario/{name} again before predicting")
    folder, _ = serving_checkpoint(workspace, name)
    settings, fingerprint, sink = project.predictions, config["weights_sha256"][:16], project.predictions.sink
    k = settings.top_k
    if settings.format == "all" and task_of(config["task"]["task"]).writes_every_label:
        k = len(config.get("label_values") or ()) or k
    note = serving_note(workspace, name)
    context.log.info(f"predictions/{name}: scored by the {note}")

    def batches_of(day: str, as_of: datetime):
        cutoff = int(as_of.timestamp())
        batches = baseline_predictions(config, folder, cache, cutoff, k=k, chunk_entities=CHUNK_ENTITIES)
        return flag_without_history(batches, cache, cutoff) if settings.without_history == "flag" else batches

    rows, written_back, files = write_days(context, "predictions", name, workspace.predictions(name), batches_of, cache,
                                           project.entity, fingerprint, sink, f"{sink.table}_{name}" if sink else None)
    seconds = time.time() - started
    return dg.MaterializeResult(metadata={
        "rows": dg.MetadataValue.int(rows), "days": dg.MetadataValue.int(len(files)),
        "as_of": as_of_time(context.partition_keys[-1]).isoformat(), "model_fingerprint": fingerprint,
        "checkpoint": note, "bytes": dg.MetadataValue.int(sum(f.stat().st_size for f in files)),
        "entities_per_second": dg.MetadataValue.float(round(rows / max(seconds, 1e-9), 1)),
        "written_to_warehouse": dg.MetadataValue.int(written_back), "seconds": dg.MetadataValue.float(round(seconds, 3)),
        "path": dg.MetadataValue.path(str(files[-1]))})
