"""Explanations: are they faithful, and what do they cost? One table per dataset.

    python bench/explain.py --dataset demo   [--customers 20000] [--entities 1000]
    python bench/explain.py --dataset tafeng [--json out.json]

Trains a short model (by default foundation 2 epochs, fine-tuning 3, trunk 256 wide; fewer than
bench/quality.py, which this is not about; --customers samples Ta-Feng) for churn and propensity
(top-50 labels), then at the test cut-off:

- completeness: |score - baseline score - sum of attributions| per explained score;
- deletion: for each explained score, mask k of its groups (inputs at the "no history" baseline,
  history entries dropped: models.explain.Explainer.masked) chosen three ways: the k largest
  |attributions| (Integrated Gradients), k random groups among those the entity has (inputs off the
  baseline), and the entity's k groups ranked highest by a global permutation importance (mean
  |score change| when a group's inputs are shuffled across entities). The mean |score change| per
  k; a faithful attribution moves the score most;
- cost: explained scores per second by the number of integration steps, next to a scoring run's
  entities per second (models.predict.predict, same entities), and every eligible entity of the
  dataset explained at the default steps (the daily asset's work).

Propensity explains each entity's 3 most probable labels (pairs), as the asset does by default.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from models.cache import Cache, build_cache  # noqa: E402
from models.evaluate import protocol  # noqa: E402
from models.explain import DEFAULT_STEPS, Explainer, column_totals, input_groups, rendered  # noqa: E402
from models.features import DAY, FeatureSpec, chunk_at  # noqa: E402
from models.predict import predict, top_labels  # noqa: E402
from models.targets import eligible  # noqa: E402
from models.finetune import finetune  # noqa: E402
from models.foundation_training import train_foundation  # noqa: E402
from models.labels import task_inputs  # noqa: E402
from models.loop import chunk_plan  # noqa: E402
from models.specs import FinetuneConfig, FoundationConfig  # noqa: E402
from quality import demo_spec, machine, tafeng_spec, tasks  # noqa: E402

KS = (1, 3, 5, 10)
STEPS = (4, 8, 16, 32, 64)
LABELS_PER_ENTITY = 3
FOUNDATION_EPOCHS, FINETUNE_EPOCHS, HIDDEN = 2, 3, 256


def subsample(cspec, customers: int, folder: Path):
    """The spec with its events and entity attribute tables cut to `customers` random customers."""
    import dataclasses

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    events = pq.read_table(cspec.events[0].files[0])
    ids = pc.unique(events.column(cspec.entity))
    keep = ids.take(np.sort(np.random.default_rng(0).choice(len(ids), min(customers, len(ids)), replace=False)))

    def cut(t, name):
        table = pq.read_table(t.files[0])
        path = folder / f"{name}.parquet"
        pq.write_table(table.filter(pc.is_in(table.column(cspec.entity), keep)), path)
        return dataclasses.replace(t, files=[str(path)])

    return dataclasses.replace(cspec, events=[cut(cspec.events[0], "events")],
                               entity_attributes=[cut(t, t.name) for t in cspec.entity_attributes])


def sample(cache, spec, task, cutoff, n, rng):
    """Features of n random eligible entities at the cut-off (one chunk of all of them, then a draw)."""
    entity_table = cache.entity_table()
    vs = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    xs, hs, chunks = [], [], []
    for s, lo, hi in chunk_plan(cache, 8192):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = eligible(chunk, task.target)
        if chunk.n == 0 or not keep.any():
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vs)
        xs.append(x[keep])
        hs.append(None if h is None else h[keep])
        chunks.append((chunk, np.flatnonzero(keep)))
    x = np.concatenate(xs)
    from models.items import SparseRows

    h = None if hs[0] is None else SparseRows.stack(hs, hs[0].n_cols, spec.channels)
    pick = np.sort(rng.choice(len(x), min(n, len(x)), replace=False))
    return x, h, pick, chunks


def pairs_of(model, task, x, h, rows):
    if task.task != "multilabel":
        return rows, None
    best, _ = top_labels(model, x[rows], h[rows], LABELS_PER_ENTITY)
    return np.repeat(rows, best.shape[1]), best.ravel()


def active_groups(explainer, x, h, rows):
    """bool [pairs, groups]: groups whose inputs are off the baseline for the entity (or that hold
    a history entry of the entity): what a random or permutation choice picks from."""
    g = explainer.groups
    diff = torch.from_numpy((x[rows] != g.baseline).astype(np.float32))
    act = torch.zeros((len(rows), len(g))).index_add_(1, torch.from_numpy(g.of_input), diff) > 0
    act = act.numpy()
    if h is not None:
        hm = h[rows]
        grp = explainer.label_group[hm.cols]
        ok = grp >= 0
        act[hm.rows[ok], grp[ok]] = True
    return act


def permutation_importance(explainer, x, h, rows, target, rng) -> np.ndarray:
    """[groups]: mean |score change| when one group's inputs (and history entries) are shuffled
    across the sampled entities; groups no sampled entity has stay at 0."""
    from models.items import SparseRows

    g = explainer.groups
    m = len(rows)
    base = explainer.score(x, h, rows, target)
    xs = x[rows]
    hs = None if h is None else h[rows]
    act = active_groups(explainer, x, h, rows).any(0)
    imp = np.zeros(len(g))
    for j in np.flatnonzero(act):
        perm = rng.permutation(m)
        xp = xs.copy()
        cols = np.flatnonzero(g.of_input == j)
        xp[:, cols] = xs[perm][:, cols]
        hp = hs
        if hs is not None:
            grp = explainer.label_group[hs.cols]
            sel = grp == j
            if sel.any():
                inv = np.argsort(perm)  # pair q's entries go to the pair p with perm[p] == q
                r = np.where(sel, inv[hs.rows], hs.rows)
                hp = SparseRows.from_pairs(r, hs.cols, hs.values, m, hs.n_cols)
        imp[j] = np.abs(explainer.score(xp, hp, np.arange(m), target) - base).mean()
    return imp


def deletion(explainer, ex, x, h, rng, perm_imp) -> dict:
    """Mean |score change| after masking k groups chosen by IG, at random, by permutation importance."""
    m, G = ex.dense.shape
    act = active_groups(explainer, x, h, ex.rows)
    by_ig = np.argsort(-np.abs(ex.dense), axis=1)
    noise = rng.random((m, G))
    by_random = np.argsort(np.where(act, noise, 2.0), axis=1)  # active groups first, in random order
    by_perm = np.argsort(-np.where(act, perm_imp[None, :] + 1e-12, -1.0), axis=1)
    out = {}
    for k in KS:
        row = {}
        for name, order in (("ig", by_ig), ("random", by_random), ("permutation", by_perm)):
            mask = np.zeros((m, G), bool)
            np.put_along_axis(mask, order[:, :k], True, axis=1)
            mask &= act | (name == "ig")  # (an entity with fewer than k groups masks what it has)
            xm, hm = explainer.masked(x, h, ex.rows, mask)
            moved = explainer.score(xm, hm, np.arange(m), ex.target)
            row[name] = float(np.abs(moved - ex.score).mean())
            if name == "ig":  # how often IG's choice moves the score more than the random one
                ig_moved = np.abs(moved - ex.score)
            elif name == "random":
                row["ig_beats_random_share"] = float((ig_moved > np.abs(moved - ex.score)).mean())
        out[k] = row
    return out


def cost(model, spec, task, groups, cache, cutoff, x, h, rows, pop=None) -> dict:
    """Explained scores per second by steps (the same pairs), and a scoring run's entities per second."""
    out = {}
    pr, pt = pairs_of(model, task, x, h, rows)
    for steps in STEPS:
        ex = Explainer(model, spec, task, groups, steps=steps, item_features=pop)
        t = time.time()
        e = ex.explain(x, h, pr, pt)
        dt = time.time() - t
        moved = np.abs(e.score - e.baseline)
        out[steps] = {"pairs_per_s": len(pr) / dt, "entities_per_s": len(rows) / dt,
                      "gap_mean": float(np.abs(e.gap).mean()), "gap_max": float(np.abs(e.gap).max()),
                      "relative_gap": float(np.abs(e.gap).mean() / max(moved.mean(), 1e-12))}
    return out


def scoring_rate(model, cache, spec, task, cutoff) -> tuple[int, float]:
    t = time.time()
    n = sum(len(b) for b in predict(model, cache, spec, task, cutoff, k=20))
    return n, n / (time.time() - t)


def explain_all(model, cache, spec, task, groups, cutoff, steps) -> tuple[int, float]:
    """Every eligible entity explained, features included: what the daily asset does."""
    entity_table = cache.entity_table()
    vs = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    explainer = Explainer(model, spec, task, groups, steps=steps)
    t, n = time.time(), 0
    for s, lo, hi in chunk_plan(cache, 8192):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = np.flatnonzero(eligible(chunk, task.target))
        if chunk.n == 0 or not len(keep):
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vs)
        pr, pt = pairs_of(model, task, x, h, keep)
        explainer.explain(x, h, pr, pt)
        n += len(keep)
    return n, n / (time.time() - t)


def run(dataset: str, customers: int, entities: int, cost_entities: int = 500, log=print, save=None) -> dict:
    quiet = lambda _: None  # noqa: E731
    rng = np.random.default_rng(0)
    t_run = time.time()
    result = {"dataset": dataset, "machine": machine(), "default_steps": DEFAULT_STEPS, "tasks": {},
              "epochs": {"foundation": FOUNDATION_EPOCHS, "finetune": FINETUNE_EPOCHS}, "hidden": HIDDEN,
              "customers": customers, "load": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cspec, test_cutoff, params = tafeng_spec() if dataset == "tafeng" else demo_spec(customers, tmp)
        if dataset == "tafeng" and customers:  # a share of the customers, all of their events
            cspec = subsample(cspec, customers, tmp)
        cache = Cache(build_cache(cspec, tmp / "cache", log=quiet))
        sources = {c: t.name for t in cspec.events + cspec.entity_attributes + cspec.attributes for c in t.columns}
        sources["__events__"] = cspec.events[0].name
        fcfg = FoundationConfig(epochs=FOUNDATION_EPOCHS, hidden=HIDDEN)
        foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=quiet)
        log(f"foundation trained ({time.time() - t_run:.0f}s)")
        spec = FeatureSpec.from_dict(foundation.info["feature_spec"])
        vocab = lambda c: cache.vocab(c).column("value").to_pylist()  # noqa: E731
        all_tasks = tasks(cache, test_cutoff, params)
        for name in ("churn", "propensity"):
            task = all_tasks[name]
            plan = protocol(test_cutoff, task.target.window_days, 4, cache.time_range[0])
            tuned = finetune(cache, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                             plan.val_cutoff, FinetuneConfig(epochs=FINETUNE_EPOCHS), log=quiet)
            model = tuned.model.eval()
            groups = input_groups(spec, vocab, model.trunk, sources)
            x, h, pick, chunks = sample(cache, spec, task, test_cutoff, entities, rng)
            pr, pt = pairs_of(model, task, x, h, pick)
            explainer = Explainer(model, spec, task, groups, steps=DEFAULT_STEPS)
            ex = explainer.explain(x, h, pr, pt)
            moved = np.abs(ex.score - ex.baseline)
            half = len(pick) // 2  # permutation importance on one half of the sample, deletion on all
            pi_rows, pi_target = pairs_of(model, task, x, h, pick[:half])
            perm_imp = permutation_importance(explainer, x, h, pi_rows, pi_target, rng)
            row = {"entities": int(len(pick)), "pairs": int(len(pr)),
                   "baseline_score": float(np.median(ex.baseline)), "score_minus_baseline": float(moved.mean()),
                   "gap_mean": float(np.abs(ex.gap).mean()), "gap_max": float(np.abs(ex.gap).max()),
                   "gap_p99": float(np.quantile(np.abs(ex.gap), 0.99)),
                   "deletion": deletion(explainer, ex, x, h, rng, perm_imp)}
            keys, per_col = column_totals(groups, ex, task.target.column)
            imp = np.abs(per_col).mean(0)
            row["global"] = [(f"{s}.{c}", float(v)) for (s, c), v in sorted(zip(keys, imp), key=lambda t: -t[1])][:8]
            row["cost"] = cost(model, spec, task, groups, cache, test_cutoff, x, h, pick[:min(len(pick), cost_entities)])
            n, rate = scoring_rate(model, cache, spec, task, test_cutoff)
            row["scoring"] = {"entities": n, "entities_per_s": rate}
            if name == "churn":  # the demo's explained scenario: every eligible entity, features included
                n, rate = explain_all(model, cache, spec, task, groups, test_cutoff, DEFAULT_STEPS)
                row["explain_all"] = {"entities": n, "entities_per_s": rate}
            result["tasks"][name] = row
            try:
                row["example"] = example(spec, groups, ex, x, chunks, cache, vocab, task, pick)
            except Exception as e:  # noqa: BLE001 (the figures above matter more than the example)
                row["example"] = {"error": f"{type(e).__name__}: {e}"}
            result["tasks"][name] = row
            if save is not None:  # what is measured so far survives a later failure
                save(result)
            log(f"{name}: gap {row['gap_mean']:.2g}, deletion k=5 ig {row['deletion'][5]['ig']:.4f} random "
                f"{row['deletion'][5]['random']:.4f} permutation {row['deletion'][5]['permutation']:.4f}; "
                f"{time.time() - t_run:.0f}s so far")
    result["total_s"] = round(time.time() - t_run, 1)
    return result


def example(spec, groups, ex, x, chunks, cache, vocab, task, pick) -> dict:
    """The reasons of the sampled entity with the highest score, as the asset writes them."""
    # the sample's rows index the concatenated eligible rows of every chunk: find the entity's chunk
    sizes = np.cumsum([0] + [len(k) for _, k in chunks])
    p = int(np.argmax(ex.score))
    r = int(ex.rows[p])
    c = int(np.searchsorted(sizes, r, side="right") - 1)
    chunk, keep = chunks[c]
    local = keep[r - sizes[c]]
    one = type(ex)(np.array([local]), ex.target[p:p + 1], ex.score[p:p + 1], ex.baseline[p:p + 1],
                   ex.dense[p:p + 1], tuple(a[:0] for a in ex.extra))
    xx = np.zeros((chunk.n, x.shape[1]), np.float32)
    xx[local] = x[r]
    names = [str(v) for v in vocab(task.target.column)] if task.target.column else []
    label_names = [names[i - 1] for i in task.target.labels] if task.target.labels else []
    out = rendered(spec, groups, one, xx, chunk, cache.entity_table(), vocab, task, label_names, 5)
    entity = cache.entity_ids(np.array([chunk.entities[local]])).to_pylist()[0]
    label = label_names[int(ex.target[p])] if ex.target[p] >= 0 else None
    return {"entity": str(entity), "label": label, "score": float(ex.score[p]), "baseline": float(ex.baseline[p]),
            "reasons": list(out["reason"]), "others": float(out["others"][0]), "gap": float(out["gap"][0])}


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']} on {result['machine']} (load average at the start "
             f"{result['load'][0]:.1f}); foundation {result['epochs']['foundation']} epochs, fine-tuning "
             f"{result['epochs']['finetune']}; default steps {result['default_steps']}; whole run {result['total_s']}s"]
    for name, r in result["tasks"].items():
        lines.append(f"\n{name}: {r['entities']} entities, {r['pairs']} explained scores; baseline score "
                     f"{r['baseline_score']:.4f}; mean |score - baseline| {r['score_minus_baseline']:.4f}")
        lines.append(f"  completeness gap at {result['default_steps']} steps: mean {r['gap_mean']:.2e}, p99 "
                     f"{r['gap_p99']:.2e}, max {r['gap_max']:.2e}")
        lines.append(f"  {'k':>3} {'IG':>9} {'random':>9} {'permutation':>12} {'IG > random':>12}   (mean |score change| "
                     f"when masking k groups)")
        for k, d in r["deletion"].items():
            lines.append(f"  {k:>3} {d['ig']:>9.4f} {d['random']:>9.4f} {d['permutation']:>12.4f} "
                         f"{d['ig_beats_random_share']:>11.0%}")
        lines.append(f"  {'steps':>5} {'scores/s':>9} {'entities/s':>11} {'gap mean':>9} {'relative':>9}")
        for s, c in r["cost"].items():
            lines.append(f"  {s:>5} {c['pairs_per_s']:>9.0f} {c['entities_per_s']:>11.0f} {c['gap_mean']:>9.1e} "
                         f"{c['relative_gap']:>9.1e}")
        line = f"  scoring run: {r['scoring']['entities']} entities at {r['scoring']['entities_per_s']:.0f}/s"
        if "explain_all" in r:
            line += (f"; explaining all {r['explain_all']['entities']} at {r['explain_all']['entities_per_s']:.0f}/s "
                     f"({r['scoring']['entities_per_s'] / r['explain_all']['entities_per_s']:.1f}x the scoring time)")
        lines.append(line)
        lines.append("  global: " + ", ".join(f"{k} {v:.4f}" for k, v in r["global"]))
        e = r["example"]
        if "error" in e:
            lines.append(f"  example: {e['error']}")
            continue
        lines.append(f"  example {e['entity']} {e['label'] or ''} score {e['score']:.4f} (baseline {e['baseline']:.4f}):")
        lines += [f"    {t}" for t in e["reasons"]]
        lines.append(f"    others {e['others']:+.4f}, gap {e['gap']:+.1e}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["tafeng", "demo"], default="demo")
    parser.add_argument("--customers", type=int, default=0, help="demo size (default 20,000); Ta-Feng: a random "
                        "sample of this many customers (default all)")
    parser.add_argument("--entities", type=int, default=1_000, help="entities sampled for the faithfulness test")
    parser.add_argument("--cost-entities", type=int, default=500, help="entities of the cost-by-steps rows")
    parser.add_argument("--foundation-epochs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs")
    parser.add_argument("--hidden", type=int, default=256, help="trunk width")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    global FOUNDATION_EPOCHS, FINETUNE_EPOCHS, HIDDEN
    FOUNDATION_EPOCHS, FINETUNE_EPOCHS, HIDDEN = args.foundation_epochs, args.epochs, args.hidden
    if args.dataset == "demo" and not args.customers:
        args.customers = 20_000
    save = (lambda r: Path(args.json).write_text(json.dumps(r, indent=2, default=str))) if args.json else None
    result = run(args.dataset, args.customers, args.entities, args.cost_entities,
                 log=lambda m: print(m, file=sys.stderr, flush=True), save=save)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
