"""Inference in 1 process against N processes (models/serve/parts.py), on the demo data, the way the
predictions and embeddings assets run it: churn scores and embeddings of every entity of the cache,
written to the day's Parquet file. Entities/s, the ratio, and whether the two files are identical.

    .venv/bin/python bench/inference_procs.py                        # 175,000 customers (~10M events), 1 vs 2
    .venv/bin/python bench/inference_procs.py --repeats 5 --json out.json
    .venv/bin/python bench/inference_procs.py --device cuda --processes 1,8   # bench/gpu.sh: 1 GPU vs all

The dataset is bench/speed.py's (its generator, extraction and cache stages, in --work). The models
have the demo's shape (foundation hidden 256, 2 layers; a churn head) with weights drawn at random
(seed 0) unless --scenario / --foundation name trained checkpoints: the time to score does not
depend on the weights' values, and training them at this size takes hours here. Every run is a
fresh process; the timed span is what the asset does after loading: building the scorers (N > 1:
starting the other processes, which import torch), scoring every chunk, writing the day's file.
Runs alternate 1, N, 1, N...; the ratio of each repetition is N's entities/s over 1's, the median
is reported with the load average (`os.getloadavg`) at each run, since the machine is shared.
`inference_speedup` is what bench/speed.py puts in its JSON (`inference_speedup_2proc`), running this
script with --scenario, --foundation and --json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))  # bench/speed.py's dataset and stages

BUILD = {"predict": "habitus.models.serve.predict:scenario_scorer", "embed": "habitus.models.serve.predict:embedding_scorer"}
CUSTOMERS, PRODUCTS = 175_000, 20_000


# --------------------------------------------------------------------------- the child: one timed run


def run_once(what: str, processes: int, cache_path: str, checkpoint: str, out: str, device: str = "cpu") -> dict:
    """Score every chunk of the cache as of its newest event with `processes` processes and write the
    day's file to `out`, as the assets do. Returns seconds, rows and where the time went."""
    from datetime import datetime, timezone

    from habitus.assets.predictions import write_entity_file
    from habitus.models.cache import Cache
    from habitus.models.nn.checkpoint import load_checkpoint
    from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
    from habitus.models.serve.parts import Parts, Pool, Scorer, staging
    from habitus.models.storage.files import combine
    from habitus.resources.training.executor import TrainingExecutor

    cache = Cache(cache_path)
    config = load_checkpoint(checkpoint)[1]
    cutoff = int(cache.time_range[1])
    params = {"cache": str(cache.path), "cache_fingerprint": cache.fingerprint, "checkpoint": checkpoint,
              "weights_sha256": config["weights_sha256"], "precision": "fp32", "chunk_entities": 8192}
    if what == "predict":
        params.update({"k": 20, "label_names": None})
    scorer = Scorer(BUILD[what], params)
    plan = chunk_plan(cache, SCORING_CHUNK_ENTITIES)
    as_of = datetime.fromtimestamp(cutoff, timezone.utc)
    out = Path(out)
    import resource

    import torch

    def cpu() -> float:  # this process and its scoring processes (waited for by Pool's exit)
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    started, cpu_started = time.perf_counter(), cpu()
    if processes == 1:  # the assets' single-process path: this process, its default threads
        threads = torch.get_num_threads()
        score = scorer.make(device)
        rows = write_entity_file(cache, (b for _, b in score(cutoff, range(len(plan)))), out, "customer_id",
                                 "bench", as_of)
        scored = None  # scoring and writing interleave: one span
        done = [{"rank": 0, "rows": rows, "chunks": len(plan)}]
    else:
        devices, threads = TrainingExecutor(device=device, inference_processes=processes).inference_plan(
            "cuda" if device.startswith("cuda") else device, len(plan))
        with Pool(scorer, processes, devices, threads, log=lambda _: None) as pool:
            parts = Parts(staging(out.parent, out.stem), combine("bench", params, cutoff), len(plan))
            done = pool.day(parts, cutoff)
            scored = time.perf_counter()
            rows = write_entity_file(cache, parts.batches(), out, "customer_id", "bench", as_of)
            parts.remove()
    seconds = time.perf_counter() - started
    cpu_seconds = cpu() - cpu_started
    return {"what": what, "processes": processes, "threads": threads, "seconds": seconds, "rows": rows,
            "cpu_seconds": cpu_seconds, "cores_busy": cpu_seconds / seconds,
            "scoring_seconds": None if scored is None else scored - started,
            "write_seconds": None if scored is None else seconds - (scored - started),
            "entities_per_s": rows / seconds, "per_process": done, "load_average": os.getloadavg()[0]}


# --------------------------------------------------------------------------- the parent


def timed(what: str, processes: int, cache_path: str, checkpoint: str, out: Path, device: str) -> dict:
    """run_once in a fresh process (a cold start, as the asset's run gets)."""
    job = json.dumps({"what": what, "processes": processes, "cache_path": cache_path, "checkpoint": checkpoint,
                      "out": str(out), "device": device})
    before = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, __file__, "--child", job], capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{what} with {processes} process(es) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(lines[-1][7:]), "load_average_before": before}


def measure(cache_path: str, scenario: str, foundation: str, work: Path, *, repeats: int = 3,
            processes: tuple[int, int] = (1, 2), device: str = "cpu", what=("predict", "embed"), say=print) -> dict:
    """1 against N processes, `repeats` times each, alternating; the median ratio per task and over
    both (`inference_speedup`), and whether every N-process file equals the 1-process one."""
    import pyarrow.parquet as pq

    from habitus.models.storage.files import file_sha256

    work.mkdir(parents=True, exist_ok=True)
    runs, summary = [], {}
    for task in what:
        checkpoint = scenario if task == "predict" else foundation
        ratios, identical = [], True
        for r in range(repeats):
            pair = {}
            for n in processes:
                out = work / f"{task}-{n}.parquet"
                run = timed(task, n, cache_path, checkpoint, out, device)
                run["repeat"] = r
                run["sha256"] = file_sha256(out)
                pair[n] = run
                runs.append(run)
                say(f"  {task} {n} process(es) x {run['threads']} thread(s): {run['seconds']:.1f} s, "
                    f"{run['entities_per_s']:,.0f} entities/s (load {run['load_average_before']:.1f})")
            one, many = (work / f"{task}-{n}.parquet" for n in processes)
            same = pq.read_table(one).equals(pq.read_table(many))
            identical &= same and pair[processes[0]]["sha256"] == pair[processes[1]]["sha256"]
            ratios.append(pair[processes[1]]["entities_per_s"] / pair[processes[0]]["entities_per_s"])
        summary[task] = {"ratios": ratios, "median_ratio": statistics.median(ratios), "identical": identical}
    every = [x for t in summary.values() for x in t["ratios"]]
    return {"processes": list(processes), "device": device, "runs": runs, "tasks": summary,
            "inference_speedup": statistics.median(every),
            "identical": all(t["identical"] for t in summary.values())}


def table(result: dict) -> str:
    n1, n2 = result["processes"]
    lines = [f"{'task':8} {'rep':>3} {'procs':>5} {'threads':>7} {'seconds':>8} {'scoring s':>9} {'write s':>7} "
             f"{'cores busy':>10} {'entities/s':>11} {'ratio':>6} {'load':>5}"]
    base = {}
    for r in result["runs"]:
        if r["processes"] == n1:
            base[(r["what"], r["repeat"])] = r["entities_per_s"]
        ratio = r["entities_per_s"] / base[(r["what"], r["repeat"])]
        lines.append(f"{r['what']:8} {r['repeat']:>3} {r['processes']:>5} {r['threads']:>7} {r['seconds']:>8.1f} "
                     f"{_s(r['scoring_seconds']):>9} {_s(r['write_seconds']):>7} {_s(r.get('cores_busy'), 2):>10} "
                     f"{r['entities_per_s']:>11,.0f} "
                     f"{ratio:>6.2f} {r['load_average_before']:>5.1f}")
    for task, t in result["tasks"].items():
        lines.append(f"{task}: median ratio {n2} vs {n1} processes {t['median_ratio']:.2f} "
                     f"({', '.join(f'{x:.2f}' for x in t['ratios'])}); outputs identical: {t['identical']}")
    lines.append(f"inference_speedup ({n2} vs {n1}, median over both tasks): {result['inference_speedup']:.2f}")
    return "\n".join(lines)


def _s(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def random_checkpoints(config: Path, work: Path) -> tuple[str, str]:
    """A churn scenario and a foundation checkpoint of the demo's shape, weights drawn with seed 0 and
    the input scaling fitted on the first chunk (what the scores' cost depends on: the shapes)."""
    import numpy as np
    import torch

    import speed
    from habitus.models.nn.checkpoint import save_checkpoint
    from habitus.models.data.features import FeatureSpec, chunk_at, featurize
    from habitus.models.nn.network import NetConfig
    from habitus.models.tasks.scoring import build_model
    from habitus.models.train.config import FoundationConfig

    scenario, foundation = work / "random-churn", work / "random-foundation"
    if (scenario / "config.json").exists() and (foundation / "config.json").exists():
        return str(scenario), str(foundation)
    st = speed.Stage(str(config), "cpu")
    cache = st.cache
    task = st.scenario("churn", cache)[0]
    cfg = FoundationConfig(hidden=256, layers=2)  # bench/speed.py's demo foundation
    spec = FeatureSpec.from_cache(cache, cfg.buckets, cfg.half_lives)
    net = NetConfig(spec.width, cfg.hidden, cfg.layers, cfg.dropout, spec.scalar_width if cfg.ple_bins else 0,
                    cfg.ple_bins, spec.entity_scalar_width if cfg.ple_bins else 0)
    torch.manual_seed(0)
    model = build_model(net, task, spec)
    x = featurize(chunk_at(cache.shard(0), 0, min(8192, cache.manifest["shards"][0]["entities"]),
                           int(cache.time_range[1])), spec, cache.entity_table())
    model.trunk.fit_input_scale(torch.from_numpy(np.asarray(x)), cfg.std_floor)
    common = {"net": net.to_dict(), "feature_spec": spec.to_dict(), "cache_fingerprint": cache.fingerprint}
    save_checkpoint(scenario, model.eval(), {**common, "kind": "scenario", "task": task.to_dict()})
    save_checkpoint(foundation, model.eval(), {**common, "kind": "foundation"})
    return str(scenario), str(foundation)


def dataset(work: Path, customers: int, say) -> tuple[Path, str]:
    """bench/speed.py's demo dataset of `customers` in `work` (generated, extracted, cached once; named
    as bench/speed.py names it: 175,000 customers are its "10m")."""
    import speed

    name = next((k for k, v in speed.GENERATED.items() if v[0] == customers), f"demo{customers}")
    config = speed.prepare(name, work)
    log = work / f"{name}.log"
    try:
        return config, str(speed.Stage(str(config), "cpu").cache.path)
    except Exception:  # no cache yet (habitus.assets.cache.current_cache: none built)
        stages = [("extract", {}), ("cache", {})]
        if not (work / name / "warehouse.duckdb").exists():
            stages.insert(0, ("generate", {"customers": customers, "products": PRODUCTS}))
        for stage, params in stages:
            say(f"  {name}: {stage} ...")
            r = speed.run_stage(stage, config, "cpu", log, **params)
            if "error" in r:
                raise RuntimeError(f"{stage}: {r['error']} (log: {log})")
    return config, str(speed.Stage(str(config), "cpu").cache.path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "habitus-inference-procs")
    ap.add_argument("--customers", type=int, default=CUSTOMERS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--processes", default="1,2", help="the two process counts compared (default 1,2)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: one process per GPU")
    ap.add_argument("--tasks", default="predict,embed")
    ap.add_argument("--scenario", help="a trained churn checkpoint folder (default: random weights)")
    ap.add_argument("--foundation", help="a trained foundation checkpoint folder (default: random weights)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_once(**json.loads(args.child))), flush=True)
        return 0
    processes = tuple(int(x) for x in args.processes.split(","))
    if len(processes) != 2 or min(processes) < 1:
        ap.error(f"--processes takes two counts, like 1,2; got {args.processes!r}")
    say = lambda s: print(s, flush=True)  # noqa: E731
    config, cache_path = dataset(args.work, args.customers, say)
    scenario, foundation = args.scenario, args.foundation
    if not (scenario and foundation):
        rs, rf = random_checkpoints(config, args.work)
        scenario, foundation = scenario or rs, foundation or rf
    say(f"cache {cache_path}; {os.cpu_count()} cores; load average {os.getloadavg()}")
    result = measure(cache_path, scenario, foundation, args.work / "out", repeats=args.repeats, processes=processes,
                     device=args.device, what=tuple(args.tasks.split(",")), say=say)
    result["machine"] = {"cores": os.cpu_count(), "load_average_end": os.getloadavg(),
                         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
