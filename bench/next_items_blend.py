"""Next items: can a learned scorer over an entity's own history of each item beat the head's
hand-set starting blend (5 x log(1 + 60-day decayed count) + 0.2 x log(1 + 30-day popularity))?

    python bench/next_items_blend.py --dataset tafeng [--json out.json]
    python bench/next_items_blend.py --dataset demo --variants linear,inter,linear/fixed

bench/quality.py's next-items protocol (the same cache, cut-offs, targets, eligible entities and
metrics), without the network: score(entity, item) = w_item . item_stats(item) + [item in the
entity's history] x (w_hist . channels + channels' W item_stats), where channels are the entity's
history of that item as the head reads it (log decayed counts at 14 and 60 days, decayed recency)
and item_stats are read at the cut-off from history only (log(1 + buyers in the last 7 / 30 days
of events), log(1 + entities holding the item in their history), their mean 60-day channel: how
habitually the item is rebought). Variants: `linear` (W = 0), `inter` (W learned), `/fixed` (w_item
kept at the hand blend's 0.2 x 30-day popularity: only the history part is learned).

Fitted on the four training cut-offs by the exact softmax over the whole catalog (an item outside
an entity's history scores the same for everyone, so the normalizer is one sum over the catalog plus
one correction per history entry: O(history + catalog), no [entities, catalog] matrix), each
entity's bought items sharing its probability mass as in habitus.models.data.items.sampled_softmax_loss. Ranked
with habitus.models.data.items.top_k_items (blockwise, so 1M items work) and scored at the validation and the
test cut-off; the validation cut-off is what the product would choose on.
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from quality import dataset_parser, dataset_spec, machine, tasks  # noqa: E402

from habitus.models.cache import Cache, build_cache  # noqa: E402
from habitus.models.evaluate.holdout import protocol  # noqa: E402
from habitus.models.data.features import HALF_LIVES, chunk_at  # noqa: E402
from habitus.models.data.items import SparseRows, top_k_items  # noqa: E402
from habitus.models.data.labels import item_popularity, label_history  # noqa: E402
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan  # noqa: E402
from habitus.models.tasks.metrics import ranking_metrics_at  # noqa: E402
from habitus.models.tasks import task as task_of  # noqa: E402

HAND = {"w_hist": (0.0, 5.0, 0.0), "w_item": (0.0, 0.2, 0.0, 0.0)}  # the head's start (recommendation.init_head)
PAST_FREQUENCY = {"w_hist": (0.0, 1.0, 0.0), "w_item": (0.0, 1e-4, 0.0, 0.0)}  # popularity breaks ties


def cutoff_arrays(cache: Cache, task, cutoff: int) -> tuple[SparseRows, SparseRows, np.ndarray]:
    """(history [n, items] of 3 channels, bought items [n, items], item popularity) of the eligible
    entities at `cutoff`, as finetune and evaluate build them."""
    t, vocab = task_of(task), cache.columns[task.target.column]["vocab_size"]
    hs, ys = [], []
    for s, lo, hi in chunk_plan(cache, SCORING_CHUNK_ENTITIES):
        chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
        if chunk.n == 0:
            continue
        keep, y = t.labels(chunk, task.target, cache)
        hs.append(label_history(chunk, task.target, vocab, HALF_LIVES)[keep])
        ys.append(y)
    n_items = len(task.target.labels)
    return (SparseRows.stack(hs, n_items, len(HALF_LIVES) + 1), SparseRows.stack(ys, n_items),
            item_popularity(cache, task.target, int(cutoff)))


def item_stats(hist: SparseRows, popularity: np.ndarray) -> np.ndarray:
    """[items, 4] at a cut-off, from history only: 7- and 30-day popularity, log(1 + holders), mean 60-day channel."""
    holders = np.bincount(hist.cols, minlength=hist.n_cols)
    habitual = np.bincount(hist.cols, hist.values[:, 1], minlength=hist.n_cols) / np.maximum(holders, 1)
    return np.stack([popularity[:, 0], popularity[:, 1], np.log1p(holders), habitual], 1).astype(np.float32)


class Scorer(torch.nn.Module):
    def __init__(self, w_hist=HAND["w_hist"], w_item=HAND["w_item"]):
        super().__init__()
        self.w_hist = torch.nn.Parameter(torch.tensor(w_hist, dtype=torch.float32))
        self.w_item = torch.nn.Parameter(torch.tensor(w_item, dtype=torch.float32))
        self.w_cross = torch.nn.Parameter(torch.zeros(len(w_hist), len(w_item)))

    def item(self, stats: torch.Tensor) -> torch.Tensor:
        return stats @ self.w_item

    def history(self, values: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
        """The score added to each history entry (its channels, its item's stats)."""
        return values @ self.w_hist + torch.einsum("nc,ns,cs->n", values, stats, self.w_cross)


def softmax_rows(hist: SparseRows, y: SparseRows, popularity: np.ndarray) -> dict:
    """The tensors of the exact softmax over the catalog, for the entities that bought something."""
    keep = np.flatnonzero(np.diff(y.indptr) > 0)
    h, y = hist[keep], y[keep]
    hkey, ykey = h.rows * np.int64(h.n_cols) + h.cols, y.rows * np.int64(h.n_cols) + y.cols
    at = np.searchsorted(hkey, ykey).clip(max=max(len(hkey) - 1, 0))
    inside = hkey[at] == ykey if len(hkey) else np.zeros(len(ykey), bool)
    per_row = np.bincount(y.rows, minlength=len(y)).astype(np.float64)
    t = torch.from_numpy
    return {"n": len(y), "stats": t(item_stats(hist, popularity)), "h_row": t(h.rows), "h_col": t(h.cols),
            "h_values": t(h.values), "y_row": t(y.rows), "y_col": t(y.cols), "y_at": t(at[inside]),
            "y_inside": t(inside), "y_weight": t(1 / per_row[y.rows]), "rows": float((per_row > 0).sum())}


def nll(scorer: Scorer, d: dict) -> torch.Tensor:
    """Z(entity) = sum over the catalog of exp(item score) + per history entry exp(item + history) - exp(item)."""
    item = scorer.item(d["stats"]).double()
    hist = scorer.history(d["h_values"], d["stats"][d["h_col"]]).double()
    shift = item.max().detach()
    at_hist = item[d["h_col"]]
    delta = torch.exp(at_hist + hist - shift) - torch.exp(at_hist - shift)
    z = torch.exp(item - shift).sum() + torch.zeros(d["n"], dtype=torch.float64).index_add(0, d["h_row"], delta)
    logit = item[d["y_col"]].clone()
    logit[d["y_inside"]] = logit[d["y_inside"]] + hist[d["y_at"]]
    return -((logit - shift - torch.log(z[d["y_row"]])) * d["y_weight"]).sum() / d["rows"]


def fit(train: list[dict], variant: str) -> Scorer:
    scorer = Scorer()
    kind, _, fixed = variant.partition("/")
    params = [scorer.w_hist] + ([] if fixed == "fixed" else [scorer.w_item]) + ([scorer.w_cross] if kind == "inter" else [])
    opt = torch.optim.LBFGS(params, lr=1, max_iter=100, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = sum(nll(scorer, d) for d in train) / len(train)
        loss.backward()
        return loss

    opt.step(closure)
    return scorer


@torch.no_grad()
def ranked(scorer: Scorer, hist: SparseRows, y: SparseRows, popularity: np.ndarray, k: int = 10) -> dict:
    stats = torch.from_numpy(item_stats(hist, popularity))
    item = scorer.item(stats).float()
    extra = scorer.history(torch.from_numpy(hist.values), stats[torch.from_numpy(hist.cols)]).float().numpy()
    top, _ = top_k_items(len(hist), hist.n_cols, k, lambda r0, r1, i0, i1: item[i0:i1].expand(r1 - r0, -1),
                         SparseRows(hist.indptr, hist.cols, extra[:, None], hist.n_cols))
    keep = np.diff(y.indptr) > 0
    return ranking_metrics_at(top[keep], y[keep].rows, y[keep].cols, k)


def run(dataset: str, customers: int, variants: tuple[str, ...], log=print) -> dict:
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, params = dataset_spec(dataset, customers, Path(tmp))
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=lambda _: None))
        task = tasks(cache, test_cutoff, params)["next_items"]
        plan = protocol(test_cutoff, task.target.window_days, 4, cache.time_range[0])
        arrays = {c: cutoff_arrays(cache, task, c) for c in (*plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff)}
    train = [softmax_rows(*arrays[c]) for c in plan.train_cutoffs]
    held = {"validation": arrays[plan.val_cutoff], "test": arrays[plan.test_cutoff]}
    rows = []
    for name, scorer in [("past frequency", Scorer(**PAST_FREQUENCY)), ("hand blend (the head's start)", Scorer())]:
        rows.append({"model": name, **{c: ranked(scorer, *a) for c, a in held.items()}})
    for variant in variants:
        t0 = time.time()
        scorer = fit(train, variant)
        rows.append({"model": f"learned {variant}", "fit_s": round(time.time() - t0, 1),
                     "w_hist": scorer.w_hist.tolist(), "w_item": scorer.w_item.tolist(), "w_cross": scorer.w_cross.tolist(),
                     **{c: ranked(scorer, *a) for c, a in held.items()}})
        log(f"{rows[-1]['model']}: fitted in {rows[-1]['fit_s']}s")
    return {"dataset": dataset, "rows": rows, "total_s": round(time.time() - started, 1), "machine": machine()}


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']} (whole run {result['total_s']}s on {result['machine']})",
             f"{'model':<32} {'val hr@10':>10} {'val ndcg@10':>12} {'test hr@10':>11} {'test ndcg@10':>13}"]
    for r in result["rows"]:
        v, t = r["validation"], r["test"]
        lines.append(f"{r['model']:<32} {v['hr@10']:>10.4f} {v['ndcg@10']:>12.4f} {t['hr@10']:>11.4f} {t['ndcg@10']:>13.4f}")
    return "\n".join(lines)


def main() -> None:
    parser = dataset_parser(__doc__)
    parser.add_argument("--variants", default="linear,inter,linear/fixed,inter/fixed")
    args = parser.parse_args()
    torch.manual_seed(0)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    result = run(args.dataset, args.customers, variants, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
