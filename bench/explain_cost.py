"""What a daily explanations run costs next to a scoring run, on every entity of the demo.

    OMP_NUM_THREADS=1 python bench/explain_cost.py [--customers 20000] [--steps 4 6 8 16] [--json out.json]
    OMP_NUM_THREADS=1 python bench/explain_cost.py --tasks churn --trees-weight 0.8

Generates the demo warehouse (20,000 customers by default, as `make demo`), trains a short
foundation model and fine-tunes churn (binary) and brand propensity (multilabel, top-50 brands) on it
(this is about cost, not quality: 1 epoch each by default, the demo's 256-wide trunk), then at the
test cut-off, every eligible entity of the cache:

- a scoring run: habitus.models.serve.predict.predict (features and a forward pass, fp32), twice; the faster
  counts (the machine is shared);
- explanations of every entity (explain_cutoff, `select: all`, what the asset does: features, the
  scores, Integrated Gradients, the rendered reasons) at each fixed number of integration steps,
  then at DEFAULT_STEPS with the pairs over the tolerance integrated again (up to MAX_STEPS, the
  default): entities per second, the time against the scoring run's, the mean steps per explained
  score, the completeness gap (mean |gap|, and over mean |score - baseline|) and the share of scores
  whose gap is over the tolerance (1% of |score - baseline| + 1e-4);
- the default (habitus.models.explain: `select: top`, `share: 0.1`, DEFAULT_STEPS): the same figures for a
  daily run as the asset runs it, and `select: sample` at the same share.

Propensity explains each entity's 3 most probable brands (the default for label heads). With --stacked or
--trees-weight W (the head chosen on validation, its trees' weight forced to W: the demo's churn serves
0.8), the scoring run is predictions' with that head and the explanations are of the served score.
Setup shared with bench/explain.py: bench/explain_setup.py.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from explain_setup import scenario, setup  # noqa: E402
from habitus.models.explain import (DEFAULT_SELECT, DEFAULT_SHARE, DEFAULT_STEPS, Summary, explain_cutoff,  # noqa: E402
                            input_groups)
from habitus.models.explain.integrated import MAX_STEPS  # noqa: E402
from habitus.models.serve.predict import predict  # noqa: E402
from quality import demo_spec, machine, tasks  # noqa: E402
from tables import text_table  # noqa: E402


def scoring(model, cache, spec, task, cutoff, repeat: int = 2, head=None) -> dict:
    best = None
    for _ in range(repeat):
        t = time.perf_counter()
        n = sum(len(b) for b in predict(model, cache, spec, task, cutoff, k=20, head=head))
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return {"entities": n, "seconds": best, "entities_per_s": n / best}


def explaining(model, cache, spec, task, cutoff, groups, steps: int, select: str, share: float,
               max_steps: int = MAX_STEPS, head=None) -> dict:
    summary = Summary.of(groups)
    t = time.perf_counter()
    rows = sum(len(b) for b in explain_cutoff(model, cache, spec, task, cutoff, groups, steps=steps, select=select,
                                              share=share, max_steps=max_steps, summary=summary, head=head))
    dt = time.perf_counter() - t
    return {"steps": steps, "max_steps": max_steps, "select": select, "share": share, "seconds": dt, "rows": rows,
            "entities": summary.entities, "eligible": summary.eligible, "scores": summary.pairs,
            "entities_per_s": summary.entities / dt, "eligible_per_s": summary.eligible / dt,
            "gap_mean": summary.gap_mean, "gap_max": summary.gap_max, "relative_gap": summary.relative_gap,
            "steps_mean": summary.steps_mean, "over_tolerance": summary.over_tolerance / max(summary.pairs, 1)}


def split(model, head, cache, spec, task, cutoff, groups, n: int) -> dict:
    """Seconds of each part of a served explanation of the first block's first `n` eligible entities, at
    DEFAULT_STEPS: the stack's rows, the trees' pred_contrib, the network's and the trunk's integrations."""
    from habitus.models.explain import ServedExplainer
    from habitus.models.data.features import chunk_at
    from habitus.models.data.labels import task_inputs
    from habitus.models.tasks import task as task_of

    e = ServedExplainer(model, head, spec, task, groups, steps=DEFAULT_STEPS)
    table = cache.entity_table()
    vs = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    chunk = chunk_at(cache.shard(0), 0, len(cache.shard(0).entities), cutoff)
    keep = np.flatnonzero(task_of(task).eligible(chunk, task.target))[:n]
    x, h = task_inputs(chunk, spec, task, table, vs)
    col = np.zeros(len(keep), np.int64)
    out = {"entities": int(len(keep))}

    def timed(name, fn):
        t = time.perf_counter()
        v = fn()
        out[name] = time.perf_counter() - t
        return v

    si = timed("stack_rows", lambda: e.inputs(model, chunk, keep, x, table, vs))
    pos = si.position[keep]
    _, _, c = timed("trees", lambda: e.trees(si.rows.hand[pos], si.rows.embedding[pos], col))
    timed("network_ig", lambda: e.net.explain(x, h, keep, None, steps=DEFAULT_STEPS))
    H = si.rows.hand.shape[1]
    timed("trunk_ig", lambda: e.representation(x[keep], si.rows.embedding[pos], c[:, H:], col, DEFAULT_STEPS))
    timed("explain", lambda: e.explain(x, h, keep, None, si))
    out["trees_in_stack"] = head.stack.info.get("trees")
    return out


def run(customers: int, steps: list[int], foundation_epochs: int, epochs: int, hidden: int, names: list[str],
        log=print, stacked: bool = False, trees_weight: float | None = None, split_entities: int = 0) -> dict:
    t_run = time.time()
    import os

    result = {"machine": machine(), "customers": customers, "load": os.getloadavg(), "hidden": hidden,
              "epochs": {"foundation": foundation_epochs, "finetune": epochs},
              "default": {"steps": DEFAULT_STEPS, "select": DEFAULT_SELECT, "share": DEFAULT_SHARE}, "tasks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cspec, test_cutoff, params = demo_spec(customers, tmp)
        s = setup(cspec, test_cutoff, tmp, foundation_epochs, hidden)
        log(f"foundation trained ({time.time() - t_run:.0f}s)")
        cache, spec = s.cache, s.spec
        all_tasks = tasks(cache, test_cutoff, params)
        for name in names:
            task = all_tasks[name]
            model, head = scenario(s, task, test_cutoff, epochs, trees_weight, stacked)
            groups = input_groups(spec, s.vocab, model.trunk, s.sources)
            served = "network" if head is None or head.weight == 0 else f"{head.chosen} (trees weighted {head.weight:.2f})"
            log(f"{name}: serving head {served}")
            if split_entities and head is not None and head.weight > 0:  # where a served explanation's time goes
                result["tasks"][name] = {"head": served, "split": split(model, head, cache, spec, task, test_cutoff,
                                                                         groups, split_entities)}
                log(f"{name}: {result['tasks'][name]['split']}")
                continue
            row = {"head": served, "scoring": scoring(model, cache, spec, task, test_cutoff, head=head)}
            log(f"{name}: scoring {row['scoring']['entities_per_s']:.0f} entities/s")
            row["all"] = []
            for n in steps:  # a fixed number of steps (no second pass), then the default's refinement
                row["all"].append(explaining(model, cache, spec, task, test_cutoff, groups, n, "all", 1.0, n, head))
                log(f"{name}: all at {n} steps {row['all'][-1]['entities_per_s']:.1f} entities/s "
                    f"({time.time() - t_run:.0f}s so far)")
            row["all"].append(explaining(model, cache, spec, task, test_cutoff, groups, DEFAULT_STEPS, "all", 1.0,
                                         head=head))
            row["default"] = explaining(model, cache, spec, task, test_cutoff, groups, DEFAULT_STEPS, DEFAULT_SELECT,
                                        DEFAULT_SHARE, head=head)
            row["sample"] = explaining(model, cache, spec, task, test_cutoff, groups, DEFAULT_STEPS, "sample",
                                       DEFAULT_SHARE, head=head)
            row["scoring_after"] = scoring(model, cache, spec, task, test_cutoff, repeat=1, head=head)
            result["tasks"][name] = row
    result["total_s"] = round(time.time() - t_run, 1)
    return result


def table(result: dict) -> str:
    d = result["default"]
    out = [f"demo, {result['customers']:,} customers; {result['machine']}; load average at the start "
           f"{result['load'][0]:.1f}; trunk {result['hidden']} wide, foundation {result['epochs']['foundation']} "
           f"epoch(s), fine-tuning {result['epochs']['finetune']}; default: select {d['select']}, share "
           f"{d['share']}, {d['steps']} steps; whole run {result['total_s']}s"]
    for name, r in result["tasks"].items():
        if "split" in r:
            sp = r["split"]
            out.append(f"\n{name} (serving head: {r['head']}, {sp['trees_in_stack']} trees): {sp['entities']} entities, "
                       + ", ".join(f"{k} {sp[k]:.2f}s" for k in ("stack_rows", "trees", "network_ig", "trunk_ig",
                                                                   "explain")))
            continue
        sc = r["scoring"]
        out.append(f"\n{name} (serving head: {r['head']}): scoring run {sc['entities']:,} entities in {sc['seconds']:.1f}s = "
                   f"{sc['entities_per_s']:,.0f} entities/s (again after the explanations: "
                   f"{r['scoring_after']['entities_per_s']:,.0f}/s)")
        rows = [{**e, "what": "all" if e["select"] == "all" else f"{e['select']} {e['share']:.0%}",
                 "ratio": e["seconds"] / sc["seconds"],
                 "how": f"{e['steps']}" if e["max_steps"] == e["steps"] else f"{e['steps']}..{e['max_steps']}"} for e in r["all"] + [r["default"], r["sample"]]]
        out.append(text_table(rows, [("entities", "what", ""), ("steps", "how", ""), ("explained", "entities", ","),
                                     ("scores", "scores", ","), ("seconds", "seconds", ".1f"),
                                     ("explained/s", "entities_per_s", ",.1f"), ("scored/s", "eligible_per_s", ",.0f"),
                                     ("time vs scoring", "ratio", ".1fx"), ("mean steps", "steps_mean", ".1f"),
                                     ("mean |gap|", "gap_mean", ".1e"), ("gap / |moved|", "relative_gap", ".1e"),
                                     ("over tol.", "over_tolerance", ".1%")]))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--customers", type=int, default=20_000)
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 6, 8, 16])
    parser.add_argument("--tasks", nargs="+", default=["churn", "propensity"], choices=["churn", "propensity"])
    parser.add_argument("--foundation-epochs", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1, help="fine-tuning epochs")
    parser.add_argument("--hidden", type=int, default=256, help="trunk width (the demo's: 256)")
    parser.add_argument("--stacked", action="store_true", help="the head chosen on validation, as a scenario "
                        "fits it: scored and explained as served")
    parser.add_argument("--trees-weight", type=float, help="a stacked head with this blend weight of the trees "
                        "(the demo's churn serves 0.8)")
    parser.add_argument("--split", type=int, default=0, help="with a stacked head: only time the parts of a served "
                        "explanation of this many entities (rows, trees, network, trunk)")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = run(args.customers, args.steps, args.foundation_epochs, args.epochs, args.hidden, args.tasks,
                 log=lambda m: print(m, file=sys.stderr, flush=True), stacked=args.stacked,
                 trees_weight=args.trees_weight, split_entities=args.split)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
