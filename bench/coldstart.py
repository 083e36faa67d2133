"""New items before retraining: items hidden from training, ranked as new on the next daily run.

    python bench/coldstart.py --dataset tafeng [--json out.json]
    python bench/coldstart.py --dataset demo [--customers 5000]

Protocol (bench/quality.py's datasets, test cut-off and 14-day next-items window). The days before
the split (14 days before the test cut-off) are what a scenario is trained on; the split's days are
appended to the cache as a daily run appends them (models/cache/append.py), and the ranking is read
at the test cut-off. `--share` (10%) of the items that sell both before and after the split are
hidden: their events before the split are dropped, so to the trained model they are items that
started selling on the split day and got their ids on append (models/tasks/coldstart.py maps their
attributes to an embedding). Two worlds are trained the same way (foundation, then the
recommendation scenario with the product's defaults): "hidden" and "full" (nothing dropped: the
same items' trained embeddings, the upper reference).

Measured on the entities whose test window holds a hidden item, over the catalog of the hidden items
that sold between the split and the cut-off (new items' HR@10 / NDCG@10 among new items: which of
the new items the entity buys), for:
  (a) mapped       the hidden world's model, new items scored with the item map as served: the
                   attributes' embedding or, where validation chose it, the map's intercept alone
  (a0) mean        the same model, every new item given the map's intercept (no attributes)
  (b) popularity within category: the entity's decayed count in the item's category (the
                   category column of the dataset), 30-day popularity breaking ties
  (b0) popularity  30-day popularity alone
  (c) trained      the full world's model: the same items' trained embeddings
  (c') the full world's model with those items' embeddings replaced by its own item map's (fitted
                   on every item, the hidden ones included): what their history gives without
                   their trained embeddings
and, over the whole catalog, the share of those entities whose served top 10 holds a hidden item
they buy ("served HR@10"). Intervals: paired bootstrap over the entities (1,000 resamples) of each
arm's difference to (a).
"""

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from intervals import resample_counts  # noqa: E402
from quality import dataset_spec  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES  # noqa: E402
from habitus.models.tasks.coldstart import encode, item_profile  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec  # noqa: E402
from habitus.models.data.items import SparseRows, batch_history  # noqa: E402
from habitus.models.data.labels import item_popularity, recent_popularity  # noqa: E402
from habitus.models.data.targets import TargetSpec  # noqa: E402
from habitus.models.evaluate.holdout import holdout_chunks, protocol  # noqa: E402
from habitus.models.tasks import task as task_of  # noqa: E402
from habitus.models.tasks.recommendation import rank_items  # noqa: E402
from habitus.models.tasks.spec import TaskSpec  # noqa: E402
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig  # noqa: E402
from habitus.models.train.finetune import finetune  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402

CATEGORY = {"tafeng": "product_subclass", "demo": "category"}  # the popularity-within-category baseline's column
NEW_DAYS = 14  # the split: this many days before the test cut-off
K = 10
EPOCHS = 3  # as bench/quality.py's next-items row


def split_events(spec, folder: Path, split: int, hidden: set | None, items: str):
    """(events before the split, hidden items' rows dropped; events from the split on) as Parquet files."""
    source = spec.events[0]
    table = pq.read_table(source.files)
    ts = pc.cast(table.column(source.timestamp), pa.timestamp("s"))
    cut = pa.scalar(split, pa.timestamp("s")).cast(ts.type)
    early = pc.less(ts, cut)
    before = table.filter(early)
    if hidden:
        before = before.filter(pc.invert(pc.is_in(pc.cast(before.column(items), pa.string()),
                                                  pa.array(sorted(hidden), pa.string()))))
    paths = []
    for name, part in (("before", before), ("after", table.filter(pc.invert(early)))):
        paths.append(str(folder / f"{name}.parquet"))
        pq.write_table(part, paths[-1])
    return paths


def choose_hidden(spec, split: int, items: str, share: float, seed: int) -> set:
    """`share` of the items sold both before and after the split (seeded)."""
    source = spec.events[0]
    table = pq.read_table(source.files, columns=[source.timestamp, items])
    ts = pc.cast(table.column(source.timestamp), pa.timestamp("s")).cast(pa.int64()).to_numpy()
    item = np.asarray(pc.cast(table.column(items), pa.string()).to_pylist(), dtype=object)
    both = sorted(set(item[ts < split]) & set(item[ts >= split]))
    rng = np.random.default_rng(seed)
    return set(rng.choice(np.asarray(both, dtype=object), int(round(share * len(both))), replace=False).tolist())


def train_world(spec, folder: Path, split: int, hidden: set | None, items: str, log) -> tuple:
    """(cache after the append, trained model, feature spec, task) of one world."""
    folder.mkdir(parents=True)
    before, after = split_events(spec, folder, split, hidden, items)
    events = spec.events[0]
    first = type(spec)(spec.entity, [type(events)(events.name, [before], events.columns, events.timestamp)],
                       spec.entity_attributes, spec.attributes)
    cache1 = Cache(build_cache(first, folder / "cache", log=lambda _: None))
    fcfg = FoundationConfig()
    t0 = time.time()
    foundation = train_foundation(cache1, fcfg, split - fcfg.horizon_days * DAY, log=lambda _: None)
    known = cache1.columns[items]["vocab_size"]
    task = TaskSpec("recommendation", TargetSpec("items", 14, items, tuple(range(1, known + 1))), k=K)
    plan = protocol(split, 14, TRAIN_CUTOFFS, cache1.time_range[0])
    result = finetune(cache1, foundation.model.state_dict(), foundation.info, task, list(plan.train_cutoffs),
                      plan.val_cutoff, FinetuneConfig(epochs=EPOCHS), log=lambda m: log(f"  {m}") if "new items" in m
                      or "re-ranking" in m else None)
    log(f"  trained in {time.time() - t0:.0f}s (soup of epochs {result.info['soup_epochs']}, 0: the start); "
        f"item map {result.info.get('new_items')}")
    grown = type(first)(spec.entity, [type(events)(events.name, [before, after], events.columns, events.timestamp)],
                        spec.entity_attributes, spec.attributes)
    cache2 = Cache(build_cache(grown, folder / "cache", previous=cache1.path, log=lambda _: None))
    assert cache2.manifest["mode"] == "append", cache2.manifest["mode"]
    return cache2, result.model.eval(), FeatureSpec.from_dict(foundation.info["feature_spec"]), task


def at_cutoff(cache: Cache, model, fspec, task, cutoff: int) -> dict:
    """The eligible entities at `cutoff`: their ids, features, label history, bought items, and the
    extended task (items first seen after training added)."""
    task = task_of(task).with_new_items(model, task, cache, cutoff)
    xs, hs, ys, ents = [], [], [], []
    for chunk, keep, x, h, y in holdout_chunks(cache, fspec, task, cutoff, SCORING_CHUNK_ENTITIES):
        xs.append(x[keep]), hs.append(h[keep]), ys.append(y), ents.append(chunk.entities[keep])
    n = len(task.target.labels)
    vocab = np.asarray(cache.vocab(task.target.column).column("value").to_pylist(), dtype=object)
    return {"task": task, "x": np.concatenate(xs), "h": SparseRows.stack(hs, n, hs[0].values.shape[1]),
            "y": SparseRows.stack(ys, n), "entities": np.asarray(cache.entity_ids(np.concatenate(ents)).cast(pa.string())
                                                                 .to_pylist(), dtype=object),
            "names": np.asarray([str(v) for v in vocab[np.asarray(task.target.labels) - 1]], dtype=object),
            "popularity": item_popularity(cache, task.target, cutoff),
            "recent": recent_popularity(cache, task.target, cutoff)}


@torch.no_grad()
def model_scores(model, d: dict, rows: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """[rows, cand] the network's scores (history included) of the candidate positions (sorted)."""
    out = []
    pop = torch.from_numpy(d["popularity"])
    c = torch.from_numpy(cand)
    for i in range(0, len(rows), 2048):
        b = rows[i:i + 2048]
        out.append(model(torch.from_numpy(d["x"][b]), batch_history(d["h"][b], "cpu"), c, pop).float().numpy())
    return np.concatenate(out)


def metrics_at(scores: np.ndarray, relevant: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row HR@K and NDCG@K of [rows, cand] scores against [rows, cand] relevance."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    hit = np.take_along_axis(relevant, top, 1)
    gains = (hit / np.log2(np.arange(2, K + 2))).sum(1)
    ideal = np.array([(1 / np.log2(np.arange(2, min(r, K) + 2))).sum() for r in relevant.sum(1)])
    return hit.any(1).astype(np.float64), gains / np.maximum(ideal, 1e-12)


def run(dataset: str, customers: int, share: float, seed: int, log=print) -> dict:
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec, test_cutoff, params = dataset_spec(dataset, customers, tmp)
        items, split = params["items"], test_cutoff - NEW_DAYS * DAY
        hidden = choose_hidden(spec, split, items, share, seed)
        log(f"{dataset}: {len(hidden)} items hidden before {dt.date.fromtimestamp(split)}")
        worlds = {}
        for name, drop in (("hidden", hidden), ("full", None)):
            log(f"world {name}")
            cache, model, fspec, task = train_world(spec, tmp / name, split, drop, items, log)
            worlds[name] = (cache, model, at_cutoff(cache, model, fspec, task, test_cutoff))
        cache, model, d = worlds["hidden"]
        _, full_model, f = worlds["full"]
        # the new-item catalog: hidden items the hidden world ranks (sold by the cut-off), in both worlds
        pos_h = {v: i for i, v in enumerate(d["names"])}
        pos_f = {v: i for i, v in enumerate(f["names"])}
        new = sorted(v for v in hidden if v in pos_h and v in pos_f)
        cand_h = np.array(sorted(pos_h[v] for v in new))
        names = d["names"][cand_h]
        cand_f = np.array([pos_f[v] for v in names])
        order_f = np.argsort(cand_f)
        # entities (by id) in both worlds whose window holds one of them
        ys = d["y"]
        relevant = ys.dense(cols=cand_h) > 0
        rows_h = np.flatnonzero(relevant.any(1))
        index_f = {e: i for i, e in enumerate(f["entities"])}
        rows_h = np.array([r for r in rows_h if d["entities"][r] in index_f])
        rows_f = np.array([index_f[e] for e in d["entities"][rows_h]])
        relevant = relevant[rows_h]
        log(f"{len(new)} new items sold by the cut-off; {len(rows_h)} entities buy one in the window")
        arms = {"(a) mapped": model_scores(model, d, rows_h, cand_h)}
        spec_, weight = model.head.item_map_of
        n_known = model.head.items.num_embeddings
        mapped = model.head.new_items.clone()
        model.head.add_items(weight[-1].expand_as(mapped).clone())
        arms["(a0) mean embedding"] = model_scores(model, d, rows_h, cand_h)
        model.head.add_items(mapped)
        cat = CATEGORY[dataset]
        ids = np.asarray(d["task"].target.labels, np.int64)
        order = np.argsort(ids)
        prof = item_profile(cache, items, ids[order], test_cutoff)["modes"][cat][0]
        item_cat = np.empty(len(ids), np.int64)
        item_cat[order] = prof
        h = d["h"][rows_h]
        width = int(item_cat.max()) + 1
        per_cat = np.zeros((len(rows_h), width))
        np.add.at(per_cat, (h.rows, item_cat[h.cols]), np.expm1(h.values[:, 1]))
        recent = d["recent"][cand_h] / max(float(d["recent"].max()), 1.0)
        arms["(b) popularity within category"] = np.log1p(per_cat[:, item_cat[cand_h]]) + 1e-3 * recent
        arms["(b0) popularity"] = np.broadcast_to(recent, relevant.shape)
        trained = model_scores(full_model, f, rows_f, cand_f[order_f])
        back = np.empty_like(order_f)
        back[order_f] = np.arange(len(order_f))
        arms["(c) trained embeddings (no hiding)"] = trained[:, back]
        # the full world with the hidden items' embeddings replaced by its own map's: what history alone gives
        full_cache = worlds["full"][0]
        fspec_, fweight = full_model.head.item_map_of
        ids_f = np.asarray(f["task"].target.labels, np.int64)[cand_f[order_f]]
        prof_f = item_profile(full_cache, items, ids_f, test_cutoff)
        x_f = encode(full_cache, fspec_, ids_f, prof_f)
        weight = full_model.head.items.weight
        kept = weight.data[torch.from_numpy(cand_f[order_f])].clone()
        weight.data[torch.from_numpy(cand_f[order_f])] = torch.from_numpy(x_f @ fweight[:-1].numpy() + fweight[-1].numpy())
        arms["(c') no hiding, mapped embeddings"] = model_scores(full_model, f, rows_f, cand_f[order_f])[:, back]
        weight.data[torch.from_numpy(cand_f[order_f])] = kept
        per_arm = {a: metrics_at(s, relevant) for a, s in arms.items()}
        # the served ranking over the whole catalog: a hidden item bought in the entity's top 10
        served = {}
        for a, (m, dd, rows, names_all) in {"(a) mapped": (model, d, rows_h, d["names"]),
                                            "(c) trained embeddings (no hiding)": (full_model, f, rows_f, f["names"])
                                            }.items():
            top, _ = rank_items(m, dd["x"][rows], dd["h"][rows], dd["popularity"], K)
            bought = dd["y"][rows]
            keys = set(zip(bought.rows.tolist(), names_all[bought.cols].tolist()))
            served[a] = np.array([any((r, names_all[j]) in keys and names_all[j] in hidden for j in top[r])
                                  for r in range(len(rows))], np.float64)
        table = summarize(per_arm, served)
    return {"dataset": dataset, "test_cutoff": dt.datetime.fromtimestamp(test_cutoff, dt.timezone.utc).isoformat(),
            "hidden_items": len(hidden), "new_items_ranked": len(new), "entities": int(len(rows_h)), "share": share,
            "seed": seed, "item_map": {k: sorted(v) for k, v in model.head.item_map_of[0].items() if k != "column"},
            "rows": table,
            "seconds": round(time.time() - started)}


def summarize(per_arm: dict, served: dict, draws: int = 1000) -> list[dict]:
    n = len(next(iter(per_arm.values()))[0])
    counts = resample_counts(np.zeros(n), draws, np.random.default_rng(0)).astype(np.float64) / n
    rows = []
    base = per_arm["(a) mapped"]
    for arm, (hr, ndcg) in per_arm.items():
        row = {"arm": arm, "hr@10": float(hr.mean()), "ndcg@10": float(ndcg.mean())}
        for name, v, b in (("hr@10", hr, base[0]), ("ndcg@10", ndcg, base[1])):
            diff = counts @ (v - b)
            row[f"{name} - (a)"] = [float((v - b).mean()), float(np.quantile(diff, 0.025)),
                                     float(np.quantile(diff, 0.975))]
        if arm in served:
            row["served hr@10"] = float(served[arm].mean())
        rows.append(row)
    return rows


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']} (test cut-off {result['test_cutoff'][:10]}; {result['hidden_items']} items "
             f"hidden, {result['new_items_ranked']} ranked as new; {result['entities']} entities)",
             f"{'arm':38s} {'HR@10':>7s} {'NDCG@10':>8s}  {'NDCG@10 - (a) [95%]':>26s}  {'served HR@10':>12s}"]
    for r in result["rows"]:
        d = r["ndcg@10 - (a)"]
        lines.append(f"{r['arm']:38s} {r['hr@10']:7.4f} {r['ndcg@10']:8.4f}  {d[0]:+8.4f} [{d[1]:+.4f}, {d[2]:+.4f}]  "
                     f"{r.get('served hr@10', float('nan')):12.4f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(CATEGORY), required=True)
    parser.add_argument("--customers", type=int, default=5000)
    parser.add_argument("--share", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    a = parser.parse_args()
    torch.manual_seed(0)
    result = run(a.dataset, a.customers, a.share, a.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
