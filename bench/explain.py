"""Explanations: are they faithful, and what do they cost? One table per dataset.

    python bench/explain.py --dataset demo   [--customers 20000] [--entities 1000]
    python bench/explain.py --dataset tafeng [--json out.json]
    python bench/explain.py --dataset demo --customers 3000 --tasks churn --trees-weight 0.8

Trains a short model (by default foundation 2 epochs, fine-tuning 3, trunk 256 wide; fewer than
bench/quality.py, which this is not about; --customers samples Ta-Feng) for churn and propensity
(top-50 labels), then at the test cut-off:

- completeness: |score - baseline score - sum of attributions| per explained score;
- deletion: for each explained score, mask k of its groups (inputs at the "no history" baseline,
  history entries dropped: habitus.models.explain.Explainer.masked) chosen three ways: the k largest
  |attributions| (Integrated Gradients), k random groups among those the entity has (inputs off the
  baseline), and the entity's k groups ranked highest by a global permutation importance (mean
  |score change| when a group's inputs are shuffled across entities). The mean |score change| per
  k; a faithful attribution moves the score most;
- cost: explained scores per second by the number of integration steps, next to a scoring run's
  entities per second (habitus.models.serve.predict.predict, same entities), and every eligible entity of the
  dataset explained at the default steps (the daily asset's work).

Propensity explains each entity's 3 most probable labels (pairs), as the asset does by default.

With --stacked (the head chosen on validation, as a scenario fits it) or --trees-weight W (that head
with its trees' blend weight forced to W; the demo's churn serves 0.8), everything above is of the
served score (habitus.models.explain.ServedExplainer): the deletion masks a group's network inputs and the
trees' hand features of it (the representation group: the stranger's representation), and permutation
importance shuffles both.
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

from explain_setup import scenario, setup  # noqa: E402
from habitus.models.explain import DEFAULT_STEPS, Explainer, ServedExplainer, column_totals, input_groups, rendered  # noqa: E402
from habitus.models.explain.served import StackInputs  # noqa: E402
from habitus.models.data.features import chunk_at  # noqa: E402
from habitus.models.serve.predict import predict  # noqa: E402
from habitus.models.tasks import task as task_of  # noqa: E402
from habitus.models.tasks.multilabel import top_labels  # noqa: E402
from habitus.models.data.targets import eligible  # noqa: E402
from habitus.models.data.labels import task_inputs  # noqa: E402
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan  # noqa: E402
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


def sample(cache, spec, task, cutoff, n, rng, model=None, head=None):
    """Features of n random eligible entities at the cut-off (one chunk of all of them, then a draw);
    with a stacked `head`, the stack's rows of them too (StackInputs over the concatenated rows)."""
    import dataclasses

    entity_table = cache.entity_table()
    vs = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    xs, hs, chunks, stack = [], [], [], []
    for s, lo, hi in chunk_plan(cache, SCORING_CHUNK_ENTITIES):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = eligible(chunk, task.target)
        if chunk.n == 0 or not keep.any():
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vs)
        xs.append(x[keep])
        hs.append(None if h is None else h[keep])
        chunks.append((chunk, np.flatnonzero(keep)))
        if head is not None:
            stack.append(head.rows(chunk, np.flatnonzero(keep), x, spec, task, entity_table, vs,
                                   model=None if task_of(task).label_outputs else model))
    x = np.concatenate(xs)
    from habitus.models.data.items import SparseRows

    h = None if hs[0] is None else SparseRows.stack(hs, hs[0].n_cols, spec.channels)
    pick = np.sort(rng.choice(len(x), min(n, len(x)), replace=False))
    si = None
    if head is not None:
        cat = lambda k: None if getattr(stack[0], k) is None else np.concatenate([getattr(r, k) for r in stack])  # noqa: E731
        rows = dataclasses.replace(stack[0], **{k: cat(k) for k in ("entities", "hand", "embedding", "network")})
        si = StackInputs(rows, np.arange(len(x)))
    return x, h, pick, chunks, si


class Subject:
    """What the deletion test reads of the explained scores: the network's (Explainer), or the served ones
    of a stacked head (ServedExplainer, over the sample's StackInputs `si`)."""

    def __init__(self, explainer, si=None, head=None):
        self.e, self.si, self.head = explainer, si, head
        self.more = () if si is None else (si,)
        self.groups, self.label_group = explainer.groups, explainer.label_group

    def explain(self, x, h, rows, target):
        return self.e.explain(x, h, rows, target, *self.more)

    def score(self, x, h, rows, target):
        return self.e.score(x, h, rows, target, *self.more)

    def masked_score(self, x, h, rows, target, mask):
        if self.si is None:
            xm, hm = self.e.masked(x, h, rows, mask)
            return self.e.score(xm, hm, np.arange(len(rows)), target)
        return self.e.scores_of(*self.e.masked(x, h, rows, mask, self.si), target)

    def shuffled_score(self, xp, hp, rows, target, j, perm):
        """The score with group j's network inputs already shuffled in (xp, hp) and, served, its hand
        features (or, for the representation group, the representation itself) shuffled the same way."""
        if self.si is None:
            return self.e.score(xp, hp, np.arange(len(rows)), target)
        pos = self.si.position[rows]
        hand = np.array(self.si.rows.hand[pos], copy=True)
        cols = np.flatnonzero(self.e.hand.group == j)
        hand[:, cols] = hand[perm][:, cols]
        emb = self.si.rows.embedding[pos][perm] if j == self.e.rep_group else None  # None: the trunk's of xp
        return self.e.scores_of(xp, hp, hand, emb, target)

    def pairs(self, model, task, x, h, rows):
        if not task_of(task).label_outputs:
            return rows, None
        adjust = None
        if self.si is not None:  # the served top labels: the blend's
            import dataclasses

            r, pos = self.si.rows, self.si.position[rows]
            adjust = self.head.adjust_logits(self.head.gbt(dataclasses.replace(
                r, entities=r.entities[pos], hand=r.hand[pos], embedding=r.embedding[pos])))
        best, _ = top_labels(model, x[rows], h[rows], LABELS_PER_ENTITY, adjust=adjust)
        return np.repeat(rows, best.shape[1]), best.ravel()


def active_groups(subject, x, h, rows):
    """bool [pairs, groups]: groups whose inputs are off the baseline for the entity (or that hold
    a history entry of the entity; served: hand features off the stranger's, the representation):
    what a random or permutation choice picks from."""
    g = subject.groups
    diff = torch.from_numpy((x[rows] != g.baseline).astype(np.float32))
    act = torch.zeros((len(rows), len(g))).index_add_(1, torch.from_numpy(g.of_input), diff) > 0
    act = act.numpy()
    if h is not None:
        hm = h[rows]
        grp = subject.label_group[hm.cols]
        ok = grp >= 0
        act[hm.rows[ok], grp[ok]] = True
    if subject.si is not None:
        hand = subject.si.rows.hand[subject.si.position[rows]]
        off = hand != subject.e.hand.baseline
        own = np.flatnonzero(subject.e.hand.group >= 0)
        for c in own[off[:, own].any(0)]:
            act[off[:, c], subject.e.hand.group[c]] = True
        act[:, subject.e.rep_group] = True
    return act


def permutation_importance(subject, x, h, rows, target, rng) -> np.ndarray:
    """[groups]: mean |score change| when one group's inputs (and history entries; served: hand features)
    are shuffled across the sampled entities; groups no sampled entity has stay at 0."""
    from habitus.models.data.items import SparseRows

    g = subject.groups
    m = len(rows)
    base = subject.score(x, h, rows, target)
    xs = x[rows]
    hs = None if h is None else h[rows]
    act = active_groups(subject, x, h, rows).any(0)
    imp = np.zeros(len(g))
    for j in np.flatnonzero(act):
        perm = rng.permutation(m)
        xp = xs.copy()
        cols = np.flatnonzero(g.of_input == j)
        xp[:, cols] = xs[perm][:, cols]
        hp = hs
        if hs is not None:
            grp = subject.label_group[hs.cols]
            sel = grp == j
            if sel.any():
                inv = np.argsort(perm)  # pair q's entries go to the pair p with perm[p] == q
                r = np.where(sel, inv[hs.rows], hs.rows)
                hp = SparseRows.from_pairs(r, hs.cols, hs.values, m, hs.n_cols)
        imp[j] = np.abs(subject.shuffled_score(xp, hp, rows, target, j, perm) - base).mean()
    return imp


def deletion(subject, ex, x, h, rng, perm_imp) -> dict:
    """Mean |score change| after masking k groups chosen by IG, at random, by permutation importance."""
    m, G = ex.dense.shape
    act = active_groups(subject, x, h, ex.rows)
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
            moved = subject.masked_score(x, h, ex.rows, ex.target, mask)
            row[name] = float(np.abs(moved - ex.score).mean())
            if name == "ig":  # how often IG's choice moves the score more than the random one
                ig_moved = np.abs(moved - ex.score)
            elif name == "random":
                row["ig_beats_random_share"] = float((ig_moved > np.abs(moved - ex.score)).mean())
        out[k] = row
    return out


def make_explainer(model, spec, task, groups, steps, head=None, pop=None):
    if head is not None and head.weight > 0:
        return ServedExplainer(model, head, spec, task, groups, steps=steps)
    return Explainer(model, spec, task, groups, steps=steps, item_features=pop)


def cost(model, spec, task, groups, x, h, rows, subject, head=None) -> dict:
    """Explained scores per second by steps (the same pairs), and a scoring run's entities per second."""
    out = {}
    pr, pt = subject.pairs(model, task, x, h, rows)
    for steps in STEPS:
        ex = Subject(make_explainer(model, spec, task, groups, steps, head), subject.si, head)
        t = time.time()
        e = ex.explain(x, h, pr, pt)
        dt = time.time() - t
        moved = np.abs(e.score - e.baseline)
        out[steps] = {"pairs_per_s": len(pr) / dt, "entities_per_s": len(rows) / dt,
                      "gap_mean": float(np.abs(e.gap).mean()), "gap_max": float(np.abs(e.gap).max()),
                      "relative_gap": float(np.abs(e.gap).mean() / max(moved.mean(), 1e-12))}
    return out


def scoring_rate(model, cache, spec, task, cutoff, head=None) -> tuple[int, float]:
    t = time.time()
    n = sum(len(b) for b in predict(model, cache, spec, task, cutoff, k=20, head=head))
    return n, n / (time.time() - t)


def explain_all(model, cache, spec, task, groups, cutoff, steps, head=None) -> tuple[int, float]:
    """Every eligible entity explained, features included: what the daily asset does."""
    entity_table = cache.entity_table()
    vs = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    explainer = make_explainer(model, spec, task, groups, steps, head)
    served = isinstance(explainer, ServedExplainer)
    t, n = time.time(), 0
    for s, lo, hi in chunk_plan(cache, SCORING_CHUNK_ENTITIES):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        keep = np.flatnonzero(eligible(chunk, task.target))
        if chunk.n == 0 or not len(keep):
            continue
        x, h = task_inputs(chunk, spec, task, entity_table, vs)
        si = explainer.inputs(model, chunk, keep, x, entity_table, vs) if served else None
        pr, pt = Subject(explainer, si, head).pairs(model, task, x, h, keep)
        explainer.explain(x, h, pr, pt, *(() if si is None else (si,)))
        n += len(keep)
    return n, n / (time.time() - t)


def run(dataset: str, customers: int, entities: int, cost_entities: int = 500, log=print, save=None,
        names=("churn", "propensity"), trees_weight: float | None = None, stacked: bool = False) -> dict:
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
        st = setup(cspec, test_cutoff, tmp, FOUNDATION_EPOCHS, HIDDEN)
        log(f"foundation trained ({time.time() - t_run:.0f}s)")
        cache, spec, vocab = st.cache, st.spec, st.vocab
        all_tasks = tasks(cache, test_cutoff, params)
        for name in names:
            task = all_tasks[name]
            model, head = scenario(st, task, test_cutoff, FINETUNE_EPOCHS, trees_weight, stacked)
            head = None if head is None or head.weight == 0 else head
            groups = input_groups(spec, vocab, model.trunk, st.sources)
            x, h, pick, chunks, si = sample(cache, spec, task, test_cutoff, entities, rng, model, head)
            subject = Subject(make_explainer(model, spec, task, groups, DEFAULT_STEPS, head), si, head)
            pr, pt = subject.pairs(model, task, x, h, pick)
            ex = subject.explain(x, h, pr, pt)
            moved = np.abs(ex.score - ex.baseline)
            half = len(pick) // 2  # permutation importance on one half of the sample, deletion on all
            pi_rows, pi_target = subject.pairs(model, task, x, h, pick[:half])
            perm_imp = permutation_importance(subject, x, h, pi_rows, pi_target, rng)
            row = {"entities": int(len(pick)), "pairs": int(len(pr)),
                   "head": "network" if head is None else f"{head.chosen} (trees weighted {head.weight:.2f})",
                   "baseline_score": float(np.median(ex.baseline)), "score_minus_baseline": float(moved.mean()),
                   "gap_mean": float(np.abs(ex.gap).mean()), "gap_max": float(np.abs(ex.gap).max()),
                   "gap_p99": float(np.quantile(np.abs(ex.gap), 0.99)),
                   "deletion": deletion(subject, ex, x, h, rng, perm_imp)}
            if si is not None:  # what stayed in the representation group (components the entity barely moves)
                row["representation_share"] = float(np.abs(ex.dense[:, subject.e.rep_group]).sum()
                                                    / max(np.abs(ex.dense).sum(), 1e-12))
            keys, per_col = column_totals(subject.groups, ex, task.target.column)
            imp = np.abs(per_col).mean(0)
            row["global"] = [(f"{s}.{c}", float(v)) for (s, c), v in sorted(zip(keys, imp), key=lambda t: -t[1])][:8]
            row["cost"] = cost(model, spec, task, groups, x, h, pick[:min(len(pick), cost_entities)], subject, head)
            n, rate = scoring_rate(model, cache, spec, task, test_cutoff, head)
            row["scoring"] = {"entities": n, "entities_per_s": rate}
            if name == "churn":  # the demo's explained scenario: every eligible entity, features included
                n, rate = explain_all(model, cache, spec, task, groups, test_cutoff, DEFAULT_STEPS, head)
                row["explain_all"] = {"entities": n, "entities_per_s": rate}
            result["tasks"][name] = row
            try:
                row["example"] = example(spec, subject.groups, ex, x, chunks, cache, vocab, task, pick)
            except Exception as e:  # noqa: BLE001 (the figures above matter more than the example)
                row["example"] = {"error": f"{type(e).__name__}: {e}"}
            result["tasks"][name] = row
            if save is not None:  # what is measured so far survives a later failure
                save(result)
            log(f"{name} ({row['head']}): gap {row['gap_mean']:.2g}, deletion k=5 ig {row['deletion'][5]['ig']:.4f} "
                f"random {row['deletion'][5]['random']:.4f} permutation {row['deletion'][5]['permutation']:.4f}; "
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
        lines.append(f"\n{name} (serving head: {r.get('head', 'network')}): {r['entities']} entities, {r['pairs']} explained scores; baseline score "
                     f"{r['baseline_score']:.4f}; mean |score - baseline| {r['score_minus_baseline']:.4f}")
        lines.append(f"  completeness gap at {result['default_steps']} steps: mean {r['gap_mean']:.2e}, p99 "
                     f"{r['gap_p99']:.2e}, max {r['gap_max']:.2e}")
        if "representation_share" in r:
            lines.append(f"  share of |attribution| left in the representation group: {r['representation_share']:.2%}")
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
    parser.add_argument("--tasks", nargs="+", default=["churn", "propensity"], choices=["churn", "propensity"])
    parser.add_argument("--stacked", action="store_true", help="the head chosen on validation, as a scenario "
                        "fits it: the served score explained, masked and scored")
    parser.add_argument("--trees-weight", type=float, help="a stacked head with this blend weight of the trees "
                        "(the demo's churn serves 0.8)")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    global FOUNDATION_EPOCHS, FINETUNE_EPOCHS, HIDDEN
    FOUNDATION_EPOCHS, FINETUNE_EPOCHS, HIDDEN = args.foundation_epochs, args.epochs, args.hidden
    if args.dataset == "demo" and not args.customers:
        args.customers = 20_000
    save = (lambda r: Path(args.json).write_text(json.dumps(r, indent=2, default=str))) if args.json else None
    result = run(args.dataset, args.customers, args.entities, args.cost_entities,
                 log=lambda m: print(m, file=sys.stderr, flush=True), save=save, names=args.tasks,
                 trees_weight=args.trees_weight, stacked=args.stacked)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
