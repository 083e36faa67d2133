"""Speed and peak memory of every stage, next to references measured in the same run.

    .venv/bin/python bench/speed.py --quick                       # 1M generated events only
    .venv/bin/python bench/speed.py --json speed.json             # 1M, 10M and Ta-Feng
    .venv/bin/python bench/speed.py --datasets tafeng --device cuda
    .venv/bin/python bench/speed.py --datasets 1m,10m,100m --json speed.json   # hours on 2 cores, ~12 GB of disk

Datasets: the demo generator (pipelines/demo/data.py) scaled by customers (17,500 customers give
about 1M purchases, 175,000 about 10M, with 20,000 products so that a 16,000-label propensity scenario
has its labels; 1.75M customers and 100,000 products about 100M, written a block of customers at a
time) and ../shared/data/tafeng (817k real events). At 100m the variants and references (LoRA,
LightGBM, the 16k scenario) run only with --full. Per stage, the JSON has the bytes it wrote and kept
on disk; the keys add the time per event and its growth per tenfold (bench/speed_scale.py), the
peak per size and the cache against its source. Each dataset gets a project config
(written next to its workspace) and goes through the library's own functions, stage by stage, the
way the assets run them: extraction (connector read -> canonical Parquet), cache build, foundation
training, fine-tuning (churn, and a propensity scenario over 16,000 products), inference
(predict, fp32 / int8 / bf16), embeddings export; LoRA fine-tuning of churn next to the full one.

References in the same run: DuckDB's own scan and group-by over the extracted events (the I/O
limit of the machine) and the LightGBM baseline (models/evaluate/baselines.py) fit and predict.

Every stage runs in a fresh process; "peak GB" is that process's maximum RSS (os.wait4), so stages
do not inherit each other's memory. Entities/s follows the product's reference profile: entities
in the cache divided by the wall time of the stage (all epochs); events/s likewise with the
cache's events. Never part of the test pass/fail.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from speed_scale import over_linear, peak_gb, scale_keys  # noqa: E402

from habitus.models.tasks import task as task_of  # noqa: E402

TAFENG = ROOT.parent / "shared" / "data" / "tafeng"
# customers, products -> ~1.03M / ~10.3M / ~103M purchases (measured); 100m written a block of customers at a time
GENERATED = {"1m": (17_500, 20_000), "10m": (175_000, 20_000), "100m": (1_750_000, 100_000)}
BIG = {"100m"}  # datasets whose variants and references run only with --full
PROCS_DATASET = "10m"  # where 1 against 2 inference processes is measured (inference_speedup_2proc)
SAMPLE_16K = 0.1  # at those, the 16k scenario trains on this share of the entities (10M's count at 100M)
LABELS = 16_000
# the speed targets on a 2-core CPU (the reference profile per GPU, per entity)
TARGETS = {"inference_entities_per_s": 2_718, "foundation_entities_per_s": 417, "foundation_events_per_s": 185_000,
           "finetune_16k_entities_per_s": 500, "cache_events_per_s": 1_000_000, "peak_rss_gb_10m": 4.0}

DEMO_CONFIG = """\
workspace: {workspace}
connections:
  warehouse: {{type: duckdb, path: "{warehouse}"}}
entity: customer_id
sources:
  - {{name: purchases, role: events, connection: warehouse, table: purchases, timestamp: ts,
     columns: [product_id, store_id, quantity, price], partition: monthly, start: 2026-03-01, end: 2026-11-01}}
  - {{name: customers, role: entity_attributes, connection: warehouse, table: customers,
     columns: [age, region, segment, signup_date]}}
  - {{name: products, role: attributes, connection: warehouse, table: products, key: product_id,
     columns: [category, brand, price_tier]}}
  - {{name: stores, role: attributes, connection: warehouse, table: stores, key: store_id, columns: [format]}}
foundation: {{horizon: 14d, cutoff_every: 7d, hidden: 256, layers: 2, epochs: 3}}
scenarios:
  churn: {{task: binary, target: {{no_event: purchases, within: 28d}}}}
  propensity_16k: {{task: multilabel, target: {{any_event: purchases, by: product_id, within: 28d, top: {labels}}}}}
"""

TAFENG_CONFIG = """\
workspace: {workspace}
connections:
  files: {{type: parquet, path: "{data}"}}
entity: customer_id
sources:
  - {{name: events, role: events, connection: files, table: events, timestamp: ts,
     columns: [product_id, quantity, sales_price], partition: monthly, start: 2000-11-01, end: 2001-03-01}}
  - {{name: customers, role: entity_attributes, connection: files, table: customers, columns: [age_group, pin_code]}}
  - {{name: products, role: attributes, connection: files, table: products, key: product_id,
     columns: [product_subclass], types: {{product_subclass: categorical}}}}
foundation: {{horizon: 14d, cutoff_every: 7d, epochs: 4}}
test_cutoff: 2001-02-14
scenarios:
  churn: {{task: binary, target: {{no_event: events, within: 14d, active_within: 90d}}}}
  propensity_16k: {{task: multilabel, target: {{any_event: events, by: product_id, within: 14d, top: {labels}}}}}
"""


# --------------------------------------------------------------------------- the child: one stage


class Stage:
    """What a stage needs: the project, its workspace and the current cache (after `cache`)."""

    def __init__(self, config: str, device: str):
        from habitus.pipelines.config.project import load_project
        from habitus.resources.store.workspace import Workspace

        self.project = load_project(config)
        self.workspace = Workspace(root=self.project.workspace)
        self.device = device

    @property
    def cache(self):
        from habitus.assets.cache import current_cache
        return current_cache(self.workspace)

    def cutoff(self, cache) -> int:
        from habitus.assets.foundation import test_cutoff
        return test_cutoff(self.project, cache)

    def scenario(self, name: str, cache):
        """(TaskSpec, Protocol, FinetuneConfig) of a scenario, as assets/scenarios.py builds them."""
        from habitus.assets.scenarios import scenario_config
        from habitus.models.evaluate.holdout import Protocol

        spill = self.workspace.resume("scenarios", name)  # (where the asset spills its features too)
        spill.mkdir(parents=True, exist_ok=True)
        cfg = scenario_config(name, self.project.scenarios[name], cache, self.cutoff(cache), str(spill))
        return cfg.task, Protocol(cfg.test_cutoff, cfg.val_cutoff, cfg.train_cutoffs), cfg.finetune


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def stage_generate(st: Stage, customers: int, products: int) -> dict:
    from habitus.pipelines.demo.data import generate_demo_warehouse

    path = st.project.connections["warehouse"].path
    counts, seconds = _timed(lambda: generate_demo_warehouse(path, customers=customers, products=products))
    return {"seconds": seconds, **counts, "events_per_s": counts["purchases"] / seconds}


def stage_extract(st: Stage) -> dict:
    """Every source through its connector into canonical Parquet, partition by partition (as the
    source assets do)."""
    import pyarrow as pa

    from habitus.assets.sources import wanted_columns
    from habitus.pipelines.orchestration.build import connection_resource
    from habitus.pipelines.orchestration.partitions import events_partitions
    from habitus.resources.warehouses.canonical import write_canonical_parquet

    def extract():
        events = 0
        for source in st.project.sources:
            wh = connection_resource(source.connection, st.project.connections[source.connection])
            schema = wh.schema(source.table)
            columns = wanted_columns(source, st.project.entity, schema)
            out_schema = pa.schema([schema.field(c) for c in columns])
            first = [c for c in (st.project.entity if source.role != "attributes" else source.key,
                                 source.timestamp) if c]
            folder = st.workspace.sources(source.name)
            if source.role != "events":
                write_canonical_parquet(wh.read(source.table, columns), folder / "all.parquet", out_schema, first,
                                        source.table)
                continue
            parts = events_partitions(source)
            for key in parts.get_partition_keys():
                w = parts.time_window_for_partition_key(key)
                events += write_canonical_parquet(
                    wh.read(source.table, columns, source.timestamp, w.start.replace(tzinfo=None),
                            w.end.replace(tzinfo=None)), folder / f"{key}.parquet", out_schema, first, source.table)
        return events

    events, seconds = _timed(extract)
    return {"seconds": seconds, "events": events, "events_per_s": events / seconds}


def stage_duckdb(st: Stage) -> dict:
    """DuckDB's own scan and group-by over the extracted events files: what reading the data costs."""
    import duckdb

    from habitus.assets.cache import cache_spec
    from habitus.models.cache.sql import _files_sql

    t = cache_spec(st.project, st.workspace).events[0]
    numeric = next(c for c, kind in t.columns.items() if kind == "numeric")
    src = _files_sql(t.files)
    con = duckdb.connect()
    (n, _, _), scan = _timed(lambda: con.sql(f'SELECT count(*), sum("{numeric}"), max("{t.timestamp}") '
                                             f"FROM {src}").fetchall()[0])
    groups, group = _timed(lambda: con.sql(
        f'SELECT count(*) FROM (SELECT "{st.project.entity}", count(*), sum("{numeric}"), max("{t.timestamp}") '
        f"FROM {src} GROUP BY 1)").fetchall()[0][0])
    return {"events": n, "scan_seconds": scan, "scan_events_per_s": n / scan, "groupby_seconds": group,
            "groupby_events_per_s": n / group, "groups": groups}


def stage_cache(st: Stage) -> dict:
    """A fresh build_cache, as the cache asset runs it. With --threads, DuckDB runs that many threads too
    (overriding the project's cache.duckdb_threads; its default is one per core). cpu_seconds: the process's CPU time during
    the build, all threads (a busy machine stretches the wall time more than this)."""
    from habitus.assets.cache import cache_spec
    from habitus.models.cache import build_cache
    from habitus.models.storage.files import write_json

    options = st.project.cache.build_options()  # the project's settings, as the asset passes them
    if os.environ.get("HABITUS_BENCH_THREADS"):
        options["duckdb_threads"] = int(os.environ["HABITUS_BENCH_THREADS"])
    threads = options["duckdb_threads"]
    spec = cache_spec(st.project, st.workspace)
    shutil.rmtree(st.workspace.cache_root, ignore_errors=True)  # a fresh build, never the reused one
    cpu = time.process_time()
    folder, seconds = _timed(lambda: build_cache(spec, st.workspace.cache_root, log=lambda _: None, **options))
    cpu = time.process_time() - cpu
    write_json(st.workspace.cache_root / "current.json", {"folder": folder.name, "at": datetime.now().isoformat()})
    cache = st.cache
    n = cache.manifest["n_events"]
    from habitus.models.storage.files import folder_bytes
    source = sum(Path(f).stat().st_size for t in spec.events + spec.entity_attributes + spec.attributes for f in t.files)
    size = folder_bytes(folder)  # (as the cache asset counts them)
    return {"seconds": seconds, "events": n, "entities": cache.manifest["n_entities"], "events_per_s": n / seconds,
            "cache_bytes": size, "source_bytes": source, "cache_to_source_ratio": round(size / max(source, 1), 3),
            "cpu_seconds": cpu, "events_per_cpu_s": n / cpu, "shards": len(cache.manifest["shards"]),
            "duckdb_threads": threads or "default (one per core)"}


def stage_foundation(st: Stage, profile: str | None = None) -> dict:
    """train_foundation + the checkpoint, as the foundation asset runs them."""
    from habitus.models.nn.checkpoint import save_checkpoint
    from habitus.models.data.features import DAY
    from habitus.models.train.foundation import train_foundation
    from habitus.models.train.config import config_dict

    cache = st.cache
    cfg = st.project.foundation.config()
    last_cutoff = st.cutoff(cache) - cfg.horizon_days * DAY
    epochs: list[float] = []
    started = time.perf_counter()

    def log(_msg):
        epochs.append(time.perf_counter() - started)

    def run():
        result = train_foundation(cache, cfg, last_cutoff, device=st.device, log=log)
        save_checkpoint(st.workspace.foundation, result.model, {
            "kind": "foundation", "config": config_dict(cfg), "cache_fingerprint": cache.fingerprint,
            "cache_lineage": cache.lineage, "feature_spec": result.info["feature_spec"], "net": result.info["net"],
            "targets_width": result.info["targets_width"], "curves": result.curves})
        return result

    result, seconds = _profiled(run, profile)
    n_ent, n_ev = cache.manifest["n_entities"], cache.manifest["n_events"]
    per_epoch = [b - a for a, b in zip([0.0] + epochs[:-1], epochs)]
    return {"seconds": seconds, "epochs": cfg.epochs, "epoch_seconds": per_epoch,
            "entities_per_s": n_ent / seconds, "events_per_s": n_ev / seconds,
            "events_consumed_per_s": result.info["events_seen"] / seconds,
            "entities_consumed_per_s": result.info["entities_seen"] / seconds,
            "val_loss": result.curves["val_loss"][-1], "input_width": result.info["net"]["in_dim"]}


def stage_finetune(st: Stage, name: str, method: str, epochs: int | None, profile: str | None = None,
                   sampled_negatives: int | None = None, holdout: bool = True, entity_share: float | None = None) -> dict:
    """finetune (method full) or LoRA adapters on the frozen trunk (method lora), then the hold-out
    metric (not timed): churn AUROC, or the macro AUROC of a multilabel scenario (habitus.models.evaluate.holdout scores
    a wide head a block of labels at a time).
    `sampled_negatives`: FinetuneConfig's (0: the full loss even for a wide head; None: the default).
    `entity_share`: train and score on that seeded share of the entities only (bench/label_share.py's
    EntitySubset; entities/s counts those entities): the 16k scenario's cost per entity at 100M events."""
    from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
    from habitus.models.train.config import LoraConfig
    from habitus.models.train.finetune import finetune

    cache = st.cache
    if entity_share:
        from label_share import EntitySubset, labeled_entities
        cache = EntitySubset(cache, labeled_entities(cache, entity_share))
    state, foundation = load_checkpoint(st.workspace.foundation)
    task, plan, cfg = st.scenario(name, cache)
    if epochs:
        cfg.epochs = epochs
    if sampled_negatives is not None:
        cfg.sampled_negatives = sampled_negatives
    marks = []  # when each epoch's log line came (its validation included)

    def log(msg):
        if " epoch " in msg and "criterion" not in msg:
            marks.append(time.perf_counter())

    def run():
        marks.append(time.perf_counter())
        if method == "lora":  # adapters of LoraConfig's default rank on the frozen trunk
            return finetune(cache, state, foundation, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                            device=st.device, log=lambda _: None, adapters=LoraConfig())
        return finetune(cache, state, foundation, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                        device=st.device, log=log)

    result, seconds = _profiled(run, profile)
    import resource
    out = {"seconds": seconds, "epochs": cfg.epochs, "labels": task.outputs, "best_epoch": result.info["best_epoch"],
           # the process's peak before the hold-out metric (which may take more; peak_rss_gb is the whole stage's)
           "train_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
           "soup_epochs": result.info["soup_epochs"], "sampled_negatives": result.info.get("sampled_negatives", 0),
           "epoch_marks_seconds": [round(b - a, 2) for a, b in zip(marks, marks[1:])],
           "entities_per_s": cache.n_entities / seconds, "entities": cache.n_entities,
           "rows_seen": result.info["rows_seen"]}
    if not entity_share:
        out["events_per_s"] = cache.manifest["n_events"] / seconds
    else:
        out["entity_share"] = entity_share
    path = st.workspace.scenario(name if method == "full" else f"{name}_{method}")
    if method == "lora":
        from habitus.models.nn.lora import save_adapters
        out["adapter_bytes"] = save_adapters(result.model, path / "adapters.safetensors")
    save_checkpoint(path, result.model if method == "full" else _merged(result.model), {
        "kind": "scenario", "scenario": name, "task": task.to_dict(), "feature_spec": foundation["feature_spec"],
        "net": foundation["net"], "foundation_sha256": foundation["weights_sha256"]})
    out["checkpoint_bytes"] = (path / "model.safetensors").stat().st_size
    if task_of(task).headline in ("auroc", "macro_auroc") and holdout:  # churn, the multilabel scenarios
        out.update(_holdout(st, result.model, cache, task, plan.test_cutoff, "fp32"))
    return out


def _merged(model):
    from habitus.models.nn.lora import merge_lora
    return merge_lora(model)


def _holdout(st: Stage, model, cache, task, cutoff: int, precision: str) -> dict:
    from habitus.models.evaluate.holdout import evaluate, headline
    from habitus.models.data.features import FeatureSpec
    from habitus.models.nn.quantize import precision_context

    spec = FeatureSpec.from_dict(json.loads((st.workspace.foundation / "config.json").read_text())["feature_spec"])
    with precision_context(precision, st.device):
        report = evaluate(model, cache, spec, task, cutoff, device=st.device)
    key = headline(task)
    out = {"metric": key, "metric_value": report["model"][key], "holdout_entities": report["entities"],
           # the baselines of the same hold-out (past frequency, popularity): the metric means little alone
           "baseline_values": {name: m[key] for name, m in report.get("baselines", {}).items() if key in m}}
    if "labels_measured" in report:
        out["labels_measured"] = report["labels_measured"]
    return out


def stage_predict(st: Stage, name: str, precision: str, profile: str | None = None) -> dict:
    """predict() of a scenario checkpoint over the cache at the hold-out cut-off into Parquet, at a
    precision (models/nn/quantize.py); then, for churn, the hold-out metric at that precision."""
    from habitus.assets.predictions import write_entity_file
    from habitus.models.nn.checkpoint import load_checkpoint
    from habitus.models.serve.predict import load_model, predict
    from habitus.models.nn.quantize import for_inference, precision_context

    cache = st.cache
    state, config = load_checkpoint(st.workspace.scenario(name))
    model, spec, task = load_model(state, config)
    model = for_inference(model.to(st.device), precision)
    cutoff = st.cutoff(cache)
    path = st.workspace.predictions(name) / f"bench-{precision}.parquet"

    def run():
        with precision_context(precision, st.device):
            return write_entity_file(cache, predict(model, cache, spec, task, cutoff, device=st.device), path,
                                     st.project.entity, "bench", datetime.fromtimestamp(cutoff, timezone.utc))

    rows, seconds = _profiled(run, profile)
    out = {"seconds": seconds, "rows": rows, "entities_per_s": rows / seconds,
           "events_per_s": cache.manifest["n_events"] / seconds}
    if task_of(task).one_probability:  # churn
        out.update(_holdout(st, model, cache, task, cutoff, precision))
    return out


def stage_embed(st: Stage) -> dict:
    import numpy as np

    from habitus.assets.predictions import write_entity_file
    from habitus.models.nn.checkpoint import load_checkpoint
    from habitus.models.data.features import FeatureSpec
    from habitus.models.nn.network import load_trunk
    from habitus.models.nn.profile import Profile
    from habitus.models.serve.predict import embed

    cache = st.cache
    state, config = load_checkpoint(st.workspace.foundation)
    trunk = load_trunk(state, config["net"]).to(st.device)
    cutoff = st.cutoff(cache)
    rows, seconds = _timed(lambda: write_entity_file(
        cache, embed(trunk, cache, FeatureSpec.from_dict(config["feature_spec"]), cutoff, dtype=np.float16,
                     device=st.device, profile=Profile.of(config)), st.workspace.embeddings / "bench.parquet", st.project.entity, "bench",
        datetime.fromtimestamp(cutoff, timezone.utc)))
    return {"seconds": seconds, "rows": rows, "entities_per_s": rows / seconds,
            "events_per_s": cache.manifest["n_events"] / seconds}


def stage_lightgbm(st: Stage, name: str) -> dict:
    """The LightGBM baseline of models/evaluate/baselines.py as the scenario asset runs it; its fit and
    predict calls are timed from inside (the rest is building the hand features)."""
    import lightgbm as lgb

    from habitus.models.evaluate.baselines import lightgbm_scores
    from habitus.models.nn.checkpoint import load_checkpoint
    from habitus.models.data.features import FeatureSpec

    timings = {"fit": 0.0, "predict": 0.0, "predicted": 0}

    def timing(method, key):
        def wrapper(self, x, *a, **k):
            started = time.perf_counter()
            try:
                return method(self, x, *a, **k)
            finally:
                timings[key] += time.perf_counter() - started
                if key == "predict":
                    timings["predicted"] += len(x)
        return wrapper

    for cls in (lgb.LGBMClassifier, lgb.LGBMRegressor):
        cls.fit = timing(cls.fit, "fit")
    lgb.LGBMClassifier.predict_proba = timing(lgb.LGBMClassifier.predict_proba, "predict")
    lgb.LGBMRegressor.predict = timing(lgb.LGBMRegressor.predict, "predict")
    cache = st.cache
    _, foundation = load_checkpoint(st.workspace.foundation)
    task, plan, _ = st.scenario(name, cache)
    spec = FeatureSpec.from_dict(foundation["feature_spec"])
    scores, seconds = _timed(lambda: lightgbm_scores(cache, spec, task, plan.train_cutoffs, plan.val_cutoff,
                                                     plan.test_cutoff))
    return {"seconds": seconds, "fit_seconds": timings["fit"], "predict_seconds": timings["predict"],
            "predicted": timings["predicted"], "predict_entities_per_s": timings["predicted"] / max(timings["predict"], 1e-9),
            "fit_entities_per_s": cache.manifest["n_entities"] / max(timings["fit"], 1e-9),
            "entities_per_s": cache.manifest["n_entities"] / seconds}


def ddp_foundation(config: str, device: str, precision: str) -> None:
    """One epoch of foundation training steps in every process of a torchrun launch (DDP over
    models/train/distributed.py): each rank featurizes its share of the entity chunks and steps the
    shared model. Rank 0 prints entities/s and events/s per process. What train_foundation gains
    once it takes the distributed hooks (docs/journal/speed.md), measured before that."""
    import numpy as np
    import torch

    from habitus.models.train.distributed import autocast, close, from_env, mean_over_ranks, shard, uneven, wrap
    from habitus.models.data.features import DAY, FeatureSpec, chunk_at, featurize
    from habitus.models.nn.network import Model, NetConfig
    from habitus.models.data.targets import foundation_target
    from habitus.models.train.foundation import foundation_loss
    from habitus.models.train.loop import chunk_plan, cutoff_grid

    dist = from_env(device)
    st = Stage(config, dist.device)
    cache, cfg = st.cache, st.project.foundation.config()
    spec = FeatureSpec.from_cache(cache, cfg.buckets)
    cutoffs = cutoff_grid(cache.time_range[0], st.cutoff(cache) - cfg.horizon_days * DAY, cfg.cutoff_every_days,
                          cfg.min_history_days)
    plan, table = shard(chunk_plan(cache, cfg.chunk_entities), dist), cache.entity_table()
    rng = np.random.default_rng(dist.rank)

    def data(s, lo, hi, cutoff):
        chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
        return chunk, featurize(chunk, spec, table), foundation_target(chunk, cfg.horizon_days, spec)

    _, x0, y0 = data(*plan[0], cutoffs[-1])
    torch.manual_seed(cfg.seed)
    model = Model(NetConfig(spec.width, cfg.hidden, cfg.layers, cfg.dropout), y0.shape[1]).to(dist.device)
    model.trunk.fit_input_scale(torch.from_numpy(x0).to(dist.device), cfg.std_floor)
    net = wrap(model, dist)
    opt = torch.optim.AdamW(net.parameters(), lr=cfg.learning_rate, weight_decay=1e-4)
    work = [(s, lo, hi, c) for s, lo, hi in plan for c in rng.choice(cutoffs, min(cfg.cutoffs_per_chunk, len(cutoffs)),
                                                                      replace=False)]
    events = rows = 0
    started = time.perf_counter()
    with uneven(net):
        for s, lo, hi, cutoff in work:
            chunk, x, y = data(s, lo, hi, cutoff)
            events, rows = events + len(chunk.rows), rows + chunk.n
            xt, yt = torch.from_numpy(x).to(dist.device), torch.from_numpy(y).to(dist.device)
            for b in torch.randperm(len(xt), device=dist.device).split(cfg.batch_size):
                with autocast(precision, dist.device):
                    loss = foundation_loss(net(xt[b]), yt[b], len(spec.categorical))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    if dist.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    per_process = {"rows_per_s": mean_over_ranks(rows / seconds, dist),
                   "events_per_s": mean_over_ranks(events / seconds, dist),
                   "entities_per_s": mean_over_ranks(cache.manifest["n_entities"] / dist.world / seconds, dist)}
    if dist.is_writer:
        print("RESULT " + json.dumps({"processes": dist.world, "device": device, "precision": precision,
                                      "epoch_seconds": seconds, **per_process}), flush=True)
        print(f"{dist.world} process(es) on {device} ({precision}): per process {per_process['entities_per_s']:,.0f} "
              f"entities/s (cache entities / epoch time), {per_process['events_per_s']:,.0f} events/s consumed, "
              f"{per_process['rows_per_s']:,.0f} training rows/s", flush=True)
    close(dist)


def _profiled(fn, profile: str | None):
    """Run fn, timed; with `profile`, under cProfile with the stats written there."""
    if not profile:
        return _timed(fn)
    import cProfile

    prof = cProfile.Profile()
    started = time.perf_counter()
    out = prof.runcall(fn)
    seconds = time.perf_counter() - started
    prof.dump_stats(profile)
    return out, seconds


STAGES = {"generate": stage_generate, "extract": stage_extract, "duckdb": stage_duckdb, "cache": stage_cache,
          "foundation": stage_foundation, "finetune": stage_finetune, "predict": stage_predict, "embed": stage_embed,
          "lightgbm": stage_lightgbm}


def _written_bytes() -> int | None:
    """Bytes this process sent to storage (/proc/self/io write_bytes, less what was deleted before it was
    written back: the spilled features, DuckDB's sort runs); None where the kernel does not say."""
    try:
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return None
    return int(io["write_bytes"]) - int(io.get("cancelled_write_bytes", 0))


def child(argv: list[str]) -> int:
    stage, config, device, params = argv[0], argv[1], argv[2], json.loads(argv[3])
    if os.environ.get("HABITUS_BENCH_THREADS"):
        import torch
        torch.set_num_threads(int(os.environ["HABITUS_BENCH_THREADS"]))
    out = STAGES[stage](Stage(config, device), **params)
    out["disk_written_bytes"] = _written_bytes()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# --------------------------------------------------------------------------- the parent


def run_stage(stage: str, config: Path, device: str, log: Path, **params) -> dict:
    """One stage in a fresh process; its result plus its wall time and peak RSS (GB)."""
    cmd = [sys.executable, __file__, "--child", stage, str(config), device, json.dumps(params)]
    started = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, cwd=ROOT)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        f.write(stdout)
    wall = time.perf_counter() - started
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = Path(log).read_text().strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "wall_seconds": wall,
                "peak_rss_gb": usage.ru_maxrss / 2**20}
    return {**json.loads(lines[-1][7:]), "wall_seconds": wall, "peak_rss_gb": usage.ru_maxrss / 2**20}


def prepare(name: str, work: Path) -> Path:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "project.yaml"
    if name == "tafeng":
        text = TAFENG_CONFIG.format(workspace=folder / "ws", data=TAFENG, labels=LABELS)
    else:
        text = DEMO_CONFIG.format(workspace=folder / "ws", warehouse=folder / "warehouse.duckdb", labels=LABELS)
    config.write_text(text)
    return config


def bench_dataset(name: str, work: Path, args, say) -> dict:
    from habitus.models.storage.files import folder_bytes

    config = prepare(name, work)
    log = work / f"{name}.log"
    r: dict = {}

    def step(key, stage, **params):
        say(f"  {name}: {key} ...")
        before = folder_bytes(work / name)
        r[key] = run_stage(stage, config, args.device, log, **params)
        after = folder_bytes(work / name)
        r[key].update(disk_kept_bytes=after - before, disk_folder_bytes=after)
        say(f"  {name}: {key}: " + ("FAILED " + r[key]["error"] if "error" in r[key] else
                                    f"{r[key]['wall_seconds']:.1f}s, peak {r[key]['peak_rss_gb']:.2f} GB, "
                                    f"{r[key]['disk_kept_bytes'] / 1e9:+.2f} GB on disk"))
        return "error" not in r[key]

    # at 100M the references and the variants (LoRA, LightGBM, the 16k scenario) wait for --full: the
    # stages are extraction, cache, foundation, churn fine-tuning, inference and embeddings
    lora, lightgbm, skip_16k = args.lora, True, args.skip_16k
    if name in BIG and not args.full:
        lora, lightgbm, skip_16k = False, False, True

    made = work / name / "generate.json"  # what generating a reused warehouse took, when this script made it
    if name in GENERATED and not (work / name / "warehouse.duckdb").exists():
        customers, products = GENERATED[name]
        if step("generate", "generate", customers=customers, products=products):
            made.write_text(json.dumps(r["generate"]))
    elif made.exists():
        r["generate"] = {**json.loads(made.read_text()), "reused": True}
    ok = step("extract", "extract") and step("duckdb", "duckdb") and step("cache", "cache")
    if ok and step("foundation", "foundation", profile=_prof(args, name, "foundation")):
        step("embed", "embed")
        if step("finetune_churn", "finetune", name="churn", method="full", epochs=None,
                profile=_prof(args, name, "finetune_churn")):
            for precision in args.precisions:
                step(f"predict_churn_{precision}", "predict", name="churn", precision=precision,
                     profile=_prof(args, name, f"predict_churn_{precision}") if precision == "fp32" else None)
            if name == PROCS_DATASET and args.procs and "error" not in r.get("predict_churn_fp32", {"error": 1}):
                r["inference_procs"] = inference_procs(config, work / name, say)
        if lora:
            step("finetune_churn_lora", "finetune", name="churn", method="lora", epochs=None)
        if lightgbm:
            step("lightgbm_churn", "lightgbm", name="churn")
        if not skip_16k and step("finetune_16k", "finetune", name="propensity_16k", method="full",
                                      epochs=args.finetune_16k_epochs, profile=_prof(args, name, "finetune_16k")):
            for precision in args.precisions:
                step(f"predict_16k_{precision}", "predict", name="propensity_16k", precision=precision)
        elif skip_16k and not args.skip_16k and step(  # 100M without --full: trained on a sample, scored on all
                "finetune_16k_sample", "finetune", name="propensity_16k", method="full",
                epochs=args.finetune_16k_epochs, entity_share=SAMPLE_16K):
            step("predict_16k_fp32", "predict", name="propensity_16k", precision="fp32")
    return r


def inference_procs(config: Path, folder: Path, say) -> dict:
    """1 against 2 inference processes on this dataset's trained checkpoints: bench/inference_procs.py
    run as a command (it reads this module; importing it here would tie the two in a circle), 3
    repetitions of predictions and embeddings, the median ratio and whether the files are identical."""
    say(f"  {folder.name}: inference 1 vs 2 processes ...")
    st = Stage(str(config), "cpu")
    out = folder / "procs" / "procs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "inference_procs.py"), "--work", str(folder.parent),
                           "--customers", str(GENERATED[folder.name][0]), "--scenario",
                           str(st.workspace.scenario("churn")), "--foundation", str(st.workspace.foundation),
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        return {"error": proc.stderr[-500:]}
    r = json.loads(out.read_text())
    keys = {"inference_speedup_2proc": r["inference_speedup"], "inference_2proc_identical": r["identical"],
            "inference_2proc_runs": r["runs"]}
    say(f"  {folder.name}: inference 2 processes / 1: {keys['inference_speedup_2proc']:.2f}x, "
        f"identical {keys['inference_2proc_identical']}")
    return keys


def _prof(args, dataset: str, stage: str) -> str | None:
    if not args.profile or dataset != "1m":
        return None
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    return str(Path(args.profile) / f"{stage}.prof")


def _get(r: dict, stage: str, key: str):
    v = r.get(stage, {}).get(key)
    return v


def summary(results: dict) -> dict:
    """The summary keys: each from the largest generated dataset that measured it (10m before 1m;
    `measured_on` says which), peaks per dataset."""
    order = [d for d in ("100m", "10m", "1m") if d in results] or list(results)

    def pick(stage: str, key: str):
        for d in order:
            v = _get(results[d], stage, key)
            if v is not None:
                return v, d
        return None, None


    keys = {
        "inference_entities_per_s": ("predict_churn_fp32", "entities_per_s"),
        "inference_16k_entities_per_s": ("predict_16k_fp32", "entities_per_s"),
        "inference_bf16_entities_per_s": ("predict_churn_bf16", "entities_per_s"),
        "inference_int8_entities_per_s": ("predict_churn_int8", "entities_per_s"),
        "foundation_entities_per_s": ("foundation", "entities_per_s"),
        "foundation_events_per_s": ("foundation", "events_per_s"),
        "finetune_churn_entities_per_s": ("finetune_churn", "entities_per_s"),
        "finetune_16k_entities_per_s": ("finetune_16k", "entities_per_s"),
        "finetune_16k_sample_entities_per_s": ("finetune_16k_sample", "entities_per_s"),
        "cache_events_per_s": ("cache", "events_per_s"),
        "extract_events_per_s": ("extract", "events_per_s"),
        "embeddings_entities_per_s": ("embed", "entities_per_s"),
        "duckdb_scan_events_per_s": ("duckdb", "scan_events_per_s"),
        "duckdb_groupby_events_per_s": ("duckdb", "groupby_events_per_s"),
        "lightgbm_predict_entities_per_s": ("lightgbm_churn", "predict_entities_per_s"),
        "lightgbm_fit_seconds": ("lightgbm_churn", "fit_seconds"),
    }
    out, measured_on = {}, {}
    for name, (stage, key) in keys.items():
        out[name], measured_on[name] = pick(stage, key)
    procs = next((results[d]["inference_procs"] for d in order if "inference_speedup_2proc" in
                  results[d].get("inference_procs", {})), {})
    out["inference_speedup_2proc"] = procs.get("inference_speedup_2proc")
    out["inference_2proc_identical"] = procs.get("inference_2proc_identical")
    out["peak_rss_gb_1m"], out["peak_rss_gb_10m"] = peak_gb(results.get("1m")), peak_gb(results.get("10m"))
    out.update(scale_keys(results))
    out["measured_on"] = measured_on
    return out


ROWS = [  # (stage, label, rate key, unit, events-rate key, target key)
    ("generate", "ref: generate (bench data)", "events_per_s", "events/s", None, None),
    ("extract", "extraction", "events_per_s", "events/s", None, None),
    ("duckdb", "ref: DuckDB scan", "scan_events_per_s", "events/s", None, None),
    ("duckdb", "ref: DuckDB group-by", "groupby_events_per_s", "events/s", None, None),
    ("cache", "cache build", "events_per_s", "events/s", None, "cache_events_per_s"),
    ("foundation", "foundation (all epochs)", "entities_per_s", "entities/s", "events_per_s", "foundation_entities_per_s"),
    ("finetune_churn", "fine-tune churn", "entities_per_s", "entities/s", "events_per_s", None),
    ("finetune_churn_lora", "fine-tune churn, LoRA", "entities_per_s", "entities/s", "events_per_s", None),
    ("finetune_16k", "fine-tune 16k propensity", "entities_per_s", "entities/s", "events_per_s", "finetune_16k_entities_per_s"),
    ("finetune_16k_sample", "fine-tune 16k, 10% entities", "entities_per_s", "entities/s", None, "finetune_16k_entities_per_s"),
    ("lightgbm_churn", "ref: LightGBM churn, all", "entities_per_s", "entities/s", None, None),
    ("lightgbm_churn", "ref: LightGBM predict", "predict_entities_per_s", "entities/s", None, None),
    ("predict_churn_fp32", "inference churn fp32", "entities_per_s", "entities/s", "events_per_s", None),
    ("predict_churn_int8", "inference churn int8", "entities_per_s", "entities/s", "events_per_s", None),
    ("predict_churn_bf16", "inference churn bf16", "entities_per_s", "entities/s", "events_per_s", None),
    ("predict_16k_fp32", "inference 16k fp32", "entities_per_s", "entities/s", "events_per_s", "inference_entities_per_s"),
    ("predict_16k_int8", "inference 16k int8", "entities_per_s", "entities/s", "events_per_s", None),
    ("predict_16k_bf16", "inference 16k bf16", "entities_per_s", "entities/s", "events_per_s", None),
    ("embed", "embeddings export", "entities_per_s", "entities/s", "events_per_s", None),
]


def table(results: dict) -> str:
    lines = [f"{'dataset':<7} {'stage':<26} {'seconds':>8} {'rate':>12} {'unit':<10} {'events/s':>11} "
             f"{'peak GB':>7} {'disk MB':>8} {'target':>9} {'x target':>8} {'x DuckDB':>8}  metric"]
    for ds, r in results.items():
        scan = _get(r, "duckdb", "scan_events_per_s")
        for stage, label, key, unit, ev_key, target in ROWS:
            s = r.get(stage)
            if s is None:
                continue
            if "error" in s:
                lines.append(f"{ds:<7} {label:<26} failed: {s['error'][:150]}")
                continue
            rate = s.get(key)
            seconds = s.get("seconds", s.get("scan_seconds") if "scan" in key else s.get("groupby_seconds"))
            ev = s.get(ev_key) if ev_key else (rate if unit == "events/s" else None)
            goal = TARGETS.get(target) if target and not (target == "inference_entities_per_s" and ds != "10m") else None
            if target in ("cache_events_per_s", "foundation_entities_per_s", "finetune_16k_entities_per_s"):
                goal = TARGETS[target]
            metric = f"{s['metric']} {s['metric_value']:.4f}" if "metric" in s else ""
            disk = f"{s['disk_kept_bytes'] / 1e6:,.0f}" if "disk_kept_bytes" in s else ""
            if "epochs" in s:
                metric = f"{s['epochs']} epoch(s); " + metric
            lines.append(
                f"{ds:<7} {label:<26} {seconds or 0:>8.1f} {rate or 0:>12,.0f} {unit:<10} "
                f"{'' if ev is None else f'{ev:,.0f}':>11} {s['peak_rss_gb']:>7.2f} "
                f"{disk:>8} "
                f"{'' if goal is None else f'{goal:,}':>9} {'' if goal is None else f'{rate / goal:.2f}':>8} "
                f"{'' if not (ev and scan) else f'{ev / scan:.3f}':>8}  {metric}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the 1M-event dataset only")
    ap.add_argument("--datasets", default=None,
                    help="comma list of 1m, 10m, 100m, tafeng (default: 1m,10m,tafeng; --quick: 1m)")
    ap.add_argument("--work", default=None, help="folder for data and workspaces (default: a new temporary one; "
                                                   "generated warehouses found there are reused)")
    ap.add_argument("--json", default=None, help="write the table and the summary keys as JSON here")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--precisions", default="fp32,int8,bf16", help="inference precisions to measure")
    ap.add_argument("--no-lora", dest="lora", action="store_false", help="leave out LoRA fine-tuning")
    ap.add_argument("--no-procs", dest="procs", action="store_false",
                    help=f"leave out 1 against 2 inference processes at {PROCS_DATASET} (inference_speedup_2proc)")
    ap.add_argument("--skip-16k", action="store_true", help="leave out the 16,000-label propensity scenario")
    ap.add_argument("--full", action="store_true",
                    help="at 100m too: LoRA, LightGBM and the 16k scenario (hours on 2 cores; left out by default)")
    ap.add_argument("--finetune-16k-epochs", type=int, default=None,
                    help="epochs of the 16k fine-tuning (default: the scenario's 6); the table says how many ran")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads in every stage (default: torch's, one per core). On a machine shared with "
                         "other work, 1 thread avoids OpenMP threads waiting on each other (measured 5x faster "
                         "train steps at a load of 10 on 2 cores)")
    ap.add_argument("--profile", default=None, help="folder: cProfile stats of the 1M training/inference stages")
    ap.add_argument("--ddp", metavar="CONFIG", default=None,
                    help="under torchrun: one epoch of data-parallel foundation steps on the project CONFIG (a "
                         "project.yaml this script wrote, with its cache built); prints the figures per process")
    ap.add_argument("--precision", default="fp32", help="with --ddp: fp32 or bf16 (GPUs)")
    ap.add_argument("--include", default=None, metavar="JSON",
                    help="a --json file of an earlier run: its datasets not measured now join the table and keys")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)
    if args.ddp:
        ddp_foundation(args.ddp, args.device, args.precision)
        return 0
    args.precisions = args.precisions.split(",")
    names = (args.datasets or ("1m" if args.quick else "1m,10m,tafeng")).split(",")
    if "tafeng" in names and not TAFENG.exists():
        print(f"left out: tafeng ({TAFENG} not found)")
        names.remove("tafeng")
    if args.threads:
        os.environ["HABITUS_BENCH_THREADS"] = str(args.threads)
    work = Path(args.work or tempfile.mkdtemp(prefix="habitus-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    say = lambda m: print(m, file=sys.stderr, flush=True)
    say(f"work folder {work}; logs {work}/<dataset>.log")
    started = time.time()
    results = {}
    if args.include:
        earlier = json.loads(Path(args.include).read_text())["stages"]
        results.update({k: v for k, v in earlier.items() if k not in names})
    for name in names:
        results[name] = bench_dataset(name, work, args, say)
    import platform
    import torch
    machine = {"date": datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
               "platform": platform.platform(), "torch": torch.__version__, "device": args.device,
               "threads": args.threads or torch.get_num_threads(), "seconds": round(time.time() - started, 1)}
    text = table(results)
    print(f"habitus speed, {machine['date']}, {machine['cpus']} CPUs, device {args.device}, torch {machine['torch']}")
    print(text)
    keys = summary(results)
    print("\n" + "\n".join(f"{k:<34} {v if not isinstance(v, float) else f'{v:,.2f}'}  ({keys['measured_on'].get(k) or ''})"
                            for k, v in keys.items() if k != "measured_on" and not isinstance(v, dict)))
    print("\nseconds per event, growth per tenfold (linear: <= 1.2):")
    for stage, by in keys["seconds_per_event_growth"].items():
        print(f"  {stage:<24} " + "  ".join(f"{step} {g:.2f}x" for step, g in by.items()))
    print("over linear: " + (", ".join(over_linear(keys["seconds_per_event_growth"])) or "none"))
    print("cache / source: " + ", ".join(f"{d} {v:.3f}" for d, v in keys["cache_to_source_ratio_by_dataset"].items()))
    print("disk (GB, the dataset's folder at the end): " + ", ".join(
        f"{d} {v['total'] / 1e9:.2f}" for d, v in keys["disk_bytes"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({**keys, "machine": machine, "targets": TARGETS, "stages": results,
                                               "table": text}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
