"""Inference speed of churn with and without the head chosen on validation (models/heads/stacked_head.py).

    OMP_NUM_THREADS=1 .venv/bin/python bench/stack_speed.py [--dataset 1m] [--work DIR] [--rounds 2]

bench/speed.py's generated dataset and stages up to the fine-tuned churn checkpoint (the network
alone, as speed.py writes it); then, in this process, the head is fitted on that checkpoint's
training and validation cut-offs as the scenario asset fits it, saved as a second checkpoint
(stack.json + stack_trunk.safetensors), and both checkpoints score every entity at the test cut-off
through habitus.models.serve.predict into Parquet (habitus.assets.predictions.write_entity_file), fp32, the two timed in
alternation `--rounds` times (a loaded machine: the best round of each). Entities/s are the rows
written over the wall time, as bench/speed.py's inference stage counts them.
"""

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import speed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="1m", choices=sorted(speed.GENERATED))
    ap.add_argument("--work", help="folder kept between runs (default: a temporary one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        config = speed.prepare(args.dataset, work)
        log = work / f"{args.dataset}.log"
        stages = [("extract", {}), ("duckdb", {}), ("cache", {}), ("foundation", {}),
                  ("finetune", {"name": "churn", "method": "full", "epochs": None, "holdout": False})]
        if not (work / args.dataset / "warehouse.duckdb").exists():
            stages.insert(0, ("generate", {"customers": speed.GENERATED[args.dataset]}))
        for stage, params in stages:
            if stage != "generate" and (work / args.dataset / "ws" / "checkpoints" / "scenarios" / "churn"
                                        / "config.json").exists():
                break  # (a kept --work folder: the checkpoint is there)
            r = speed.run_stage(stage, config, "cpu", log, **params)
            say(f"{stage}: " + (r["error"] if "error" in r else f"{r['wall_seconds']:.0f}s"))
            if "error" in r:
                sys.exit(1)
        out = measure(config, args.rounds, say)
        print(json.dumps(out, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))


def measure(config: Path, rounds: int, say) -> dict:
    from habitus.assets.predictions import write_entity_file
    from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
    from habitus.models.serve.predict import load_model, predict
    from habitus.models.heads.stacked_head import fit_head, load_head, save_head
    from habitus.models.nn.network import load_trunk

    st = speed.Stage(str(config), "cpu")
    cache = st.cache
    fstate, foundation = load_checkpoint(st.workspace.foundation)
    task, plan, _ = st.scenario("churn", cache)
    state, cfg = load_checkpoint(st.workspace.scenario("churn"))
    model, spec, task = load_model(state, cfg)
    t0 = time.perf_counter()
    head = fit_head(cache, spec, task, load_trunk(fstate, foundation["net"]), model, plan.train_cutoffs, plan.val_cutoff,
                    log=say)
    fit_s = time.perf_counter() - t0
    stacked = st.workspace.scenario("churn_stacked")
    save_checkpoint(stacked, model, cfg, extra=lambda folder: {"stack": save_head(folder, head)})
    state2, cfg2 = load_checkpoint(stacked)
    model2, _, _ = load_model(state2, cfg2)
    loaded = load_head(stacked, cfg2)
    cutoff = st.cutoff(cache)
    as_of = datetime.fromtimestamp(cutoff, timezone.utc)
    best = {"network": float("inf"), "stacked": float("inf")}
    rows = {}
    for _ in range(rounds):
        for name, m, h in (("network", model, None), ("stacked", model2, loaded)):
            path = st.workspace.predictions("churn") / f"bench-{name}.parquet"
            t0 = time.perf_counter()
            rows[name] = write_entity_file(cache, predict(m, cache, spec, task, cutoff, head=h), path,
                                           st.project.entity, "bench", as_of)
            best[name] = min(best[name], time.perf_counter() - t0)
            say(f"{name}: {rows[name]} rows in {time.perf_counter() - t0:.2f}s")
    out = {"entities": rows["network"], "head": loaded.chosen, "head_weight": loaded.weight, "fit_head_s": round(fit_s, 1),
           "network_entities_per_s": round(rows["network"] / best["network"]),
           "stacked_entities_per_s": round(rows["stacked"] / best["stacked"]),
           "ratio_stacked_over_network": round(best["network"] / best["stacked"], 3),
           "events": cache.manifest["n_events"]}
    return out


if __name__ == "__main__":
    main()
