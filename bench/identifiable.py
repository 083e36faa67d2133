"""What the demo's history identifies: how much of the oracle's room any model of the events could reach.

bench/oracle.py scores each task from the simulator's latent state (churn day, visit rate, brand
tastes...), which no model of the events sees. Part of that state shows in the history; the rest
(a churn day weeks ahead, tastes seen through a few dozen purchases) does not. This bench measures
the part that shows: a network fitted to the oracle's own probabilities (a target no product has)
from each customer's history before the training cut-offs, early-stopped on the validation cut-off,
then LightGBM on the practitioner's hand features with and without that fit, at the test cut-off.
"hand + fit - hand" bounds what a representation of the same history can add to the trees on the
demo, as far as the fit approaches the posterior mean of the latent probabilities; "fit corr" is its
correlation with the oracle at the test cut-off (median over the labels for propensity).

The fit's inputs: the hand features and the history (log1p counts of what happened before the cut-off):
- churn: visit days per week over the last WEEKS weeks and before them, all visit days, days since
  the first and the last visit;
- propensity: purchases per product, category and price tier (all-time and decayed at a 60-day
  half-life), per label brand, and days since the last purchase.

    python bench/identifiable.py [--customers 20000] [--tasks churn,propensity] [--seed 0]
"""

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oracle import demo_oracle, label_values, paired_interval  # noqa: E402

from habitus.models.data.features import DAY  # noqa: E402
from habitus.models.evaluate.baselines import LIGHTGBM_PARAMS, MULTILABEL_ROWS  # noqa: E402

WEEKS = 20  # the churn history's weekly bins; older visits share one bin (a training cut-off sees about 24 weeks)
HALF_LIFE_DAYS = 60.0


def _positions(ids: np.ndarray, event_ids: np.ndarray) -> np.ndarray:
    """Each event's row among `ids` (-1: not one of them)."""
    order = np.argsort(ids)
    at = np.searchsorted(ids[order], event_ids).clip(0, len(ids) - 1)
    return np.where(ids[order][at] == event_ids, order[at], -1)


def visit_history(visits: dict, ids: np.ndarray, cutoff: int) -> np.ndarray:
    """[ids, WEEKS + 4] the churn inputs from `visits` (customer_id, day: unix seconds of a visit day)."""
    before = visits["day"] < cutoff
    row = _positions(ids, visits["customer_id"][before])
    ok = row >= 0
    row, age = row[ok], (cutoff - visits["day"][before][ok]) // DAY
    weeks = np.zeros((len(ids), WEEKS + 1), np.float32)
    np.add.at(weeks, (row, np.minimum(age // 7, WEEKS)), 1)
    first = np.zeros(len(ids), np.float32)
    np.maximum.at(first, row, age.astype(np.float32))
    last = np.full(len(ids), 1e4, np.float32)
    np.minimum.at(last, row, age.astype(np.float32))
    return np.column_stack([np.log1p(weeks), np.log1p(weeks.sum(axis=1)), np.log1p(first), np.log1p(last)])


def purchase_history(purchases: dict, ids: np.ndarray, cutoff: int, n_labels: int) -> np.ndarray:
    """[ids, inputs] the propensity inputs from `purchases` (customer_id, ts, and the integer codes
    product, category, tier, label: -1 where the brand is not a label)."""
    before = purchases["ts"] < cutoff
    row = _positions(ids, purchases["customer_id"][before])
    ok = row >= 0
    row, age = row[ok], (cutoff - purchases["ts"][before][ok]) / DAY
    parts = []
    for column in ("product", "category", "tier", "label"):
        code = purchases[column][before][ok]
        size = n_labels if column == "label" else int(purchases[column].max()) + 1
        keep = code >= 0
        for weight in (np.ones(len(age)), 0.5 ** (age / HALF_LIFE_DAYS)):
            counts = np.zeros((len(ids), size), np.float32)
            np.add.at(counts, (row[keep], code[keep]), weight[keep])
            parts.append(np.log1p(counts))
    last = np.full(len(ids), 1e4, np.float32)
    np.minimum.at(last, row, age.astype(np.float32))
    return np.concatenate(parts + [np.log1p(last)[:, None]], axis=1)


def fit_to_oracle(x_train, target_train, x_val, target_val, seed: int = 0, epochs: int = 60):
    """A two-layer network fitted to the oracle's probabilities (cross-entropy on soft targets),
    early-stopped on the validation cut-off; returns x -> fitted probabilities [n, targets]."""
    import torch

    torch.manual_seed(seed)
    mean, scale = x_train.mean(axis=0), x_train.std(axis=0) + 0.1  # a floor: inputs rare in training stay small
    z = lambda x: torch.from_numpy(((x - mean) / scale).astype(np.float32))  # noqa: E731
    as_2d = lambda t: torch.from_numpy(t.reshape(len(t), -1).astype(np.float32))  # noqa: E731
    xt, yt, xv, yv = z(x_train), as_2d(target_train), z(x_val), as_2d(target_val)
    width = 512 if xt.shape[1] > 256 else 256
    net = torch.nn.Sequential(torch.nn.Linear(xt.shape[1], width), torch.nn.GELU(), torch.nn.Dropout(0.2),
                              torch.nn.Linear(width, 256), torch.nn.GELU(), torch.nn.Linear(256, yt.shape[1]))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    loss = torch.nn.functional.binary_cross_entropy_with_logits
    best, best_state, waited = np.inf, None, 0
    for _ in range(epochs):
        net.train()
        order = torch.randperm(len(xt))
        for lo in range(0, len(order), 512):
            batch = order[lo:lo + 512]
            opt.zero_grad()
            loss(net(xt[batch]), yt[batch]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            val = loss(net(xv), yv).item()
        if val < best - 1e-5:
            best, best_state, waited = val, {k: v.clone() for k, v in net.state_dict().items()}, 0
        elif (waited := waited + 1) >= 5:
            break
    net.load_state_dict(best_state)
    net.eval()

    def predict(x):
        with torch.no_grad():
            out = torch.sigmoid(net(z(x))).numpy()
        return out if np.ndim(target_train) > 1 else out[:, 0]
    return predict


def _rows(cache, task, cutoffs):
    """Hand features, labels, customer ids and cut-offs of the hold-out's rows at `cutoffs`, one cut-off
    after the other in the order given."""
    from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan
    from habitus.models.data.features import FeatureSpec, chunk_at
    from habitus.models.evaluate.baselines import hand_features
    from habitus.models.tasks import task as task_of

    spec, entity_table = FeatureSpec.from_cache(cache), cache.entity_table()
    vocab = {c: m["vocab_size"] for c, m in cache.columns.items() if m["type"] == "categorical"}
    xs, ys, ids, cuts = [], [], [], []
    for cutoff in cutoffs:
        for s, lo, hi in chunk_plan(cache, SCORING_CHUNK_ENTITIES):
            chunk = chunk_at(cache.shard(s), lo, hi, int(cutoff))
            if chunk.n == 0:
                continue
            keep, y = task_of(task).labels(chunk, task.target, cache)
            xs.append(hand_features(chunk, spec, task, entity_table, vocab)[keep])
            ys.append(y.dense(0) if hasattr(y, "dense") else np.asarray(y))
            ids.append(np.asarray(cache.entity_ids(chunk.entities[keep])).astype(str))
            cuts.append(np.full(int(keep.sum()), int(cutoff)))
    return tuple(map(np.concatenate, (xs, ys, ids, cuts)))


def _events(folder: Path, labels: list[str]) -> tuple[dict, dict]:
    """(visit days, purchases with integer codes) of the demo's Parquet copies in `folder`."""
    import duckdb

    con = duckdb.connect()
    visits = con.sql(f"SELECT DISTINCT customer_id, epoch(date_trunc('day', ts))::BIGINT AS day "
                     f"FROM '{folder}/purchases.parquet'").fetchnumpy()
    rows = con.sql(f"SELECT customer_id, epoch(ts)::BIGINT AS ts, product_id, category, price_tier, brand "
                   f"FROM '{folder}/purchases.parquet' JOIN '{folder}/products.parquet' USING (product_id)").fetchnumpy()
    con.close()
    code = lambda column: np.unique(rows[column].astype(str), return_inverse=True)[1].ravel()  # noqa: E731
    label_of = {name: i for i, name in enumerate(labels)}
    purchases = dict(customer_id=rows["customer_id"].astype(str), ts=rows["ts"], product=code("product_id"),
                     category=code("category"), tier=code("price_tier"),
                     label=np.array([label_of.get(b, -1) for b in rows["brand"].astype(str).tolist()]))
    return dict(customer_id=visits["customer_id"].astype(str), day=visits["day"]), purchases


def identified(name: str, folder: Path, cache, task, plan, labels, seed: int = 0, draws: int = 200) -> dict:
    """The task's row: hand, hand + fit and the oracle at the test cut-off, the fit's correlation with
    the oracle, and hand + fit - hand with its 95% interval over a paired entity bootstrap."""
    import lightgbm as lgb

    from habitus.models.evaluate.holdout import headline
    from habitus.models.tasks import task as task_of

    warnings.filterwarnings("ignore", message=".*'eval_set' is deprecated")  # the spelling 4.0-4.6 know
    visits, purchases = _events(folder, labels or [])
    window = task.target.window_days
    sets = []
    for cutoffs in (plan.train_cutoffs, [plan.val_cutoff], [plan.test_cutoff]):
        x, y, ids, cuts = _rows(cache, task, cutoffs)  # the rows of each cut-off in turn, in `cutoffs`' order
        at = [(ids[cuts == c], int(c)) for c in cutoffs]
        oracle = np.concatenate([demo_oracle(folder, i, c, window, name, labels) for i, c in at]).astype(np.float32)
        history = np.concatenate([visit_history(visits, i, c) if name == "churn"
                                  else purchase_history(purchases, i, c, len(labels)) for i, c in at])
        h = np.concatenate([history, np.nan_to_num(x.astype(np.float32))], axis=1)  # what the trees see, and more
        sets.append(dict(x=x, y=y, oracle=oracle, h=h))
    train, val, test = sets
    predict = fit_to_oracle(train["h"], train["oracle"], val["h"], val["oracle"], seed)
    for s in sets:
        s["fit"] = predict(s["h"])

    def trees(column, with_fit):
        """LightGBM's test scores for the task (column None) or one label, with or without the fit."""
        def x(s):
            fit = s["fit"] if column is None else s["fit"][:, column]
            return np.column_stack([s["x"], fit]) if with_fit else s["x"]

        def y(s):
            return s["y"] if column is None else s["y"][:, column]

        # as the product's baseline: every row for one model, MULTILABEL_ROWS for each label's
        rows = (slice(None) if column is None
                else np.random.default_rng(seed).permutation(len(train["y"]))[:MULTILABEL_ROWS])
        model = lgb.LGBMClassifier(**dict(LIGHTGBM_PARAMS, random_state=seed))
        model.fit(x(train)[rows], y(train)[rows], eval_set=[(x(val), y(val))],
                  callbacks=[lgb.early_stopping(30, verbose=False)])
        return model.predict_proba(x(test))[:, 1]

    columns = [None] if name == "churn" else range(test["y"].shape[1])
    scores = {arm: np.column_stack([trees(c, arm == "hand + fit") for c in columns]) for arm in ("hand", "hand + fit")}
    if name == "churn":
        scores = {k: v[:, 0] for k, v in scores.items()}
    key = headline(task)
    metric = lambda y, s: task_of(task).metrics(y, s)[key]  # noqa: E731
    corr = [np.corrcoef(a, b)[0, 1] for a, b in zip(np.atleast_2d(test["fit"].T), np.atleast_2d(test["oracle"].T))]
    diff, lo, hi = paired_interval(test["y"], scores["hand + fit"], scores["hand"], metric, draws, seed)
    return dict(task=name, entities=len(test["y"]), hand=metric(test["y"], scores["hand"]),
                hand_fit=metric(test["y"], scores["hand + fit"]), fit=metric(test["y"], test["fit"]),
                oracle=metric(test["y"], test["oracle"]), corr=float(np.median(corr)), diff=diff, lo=lo, hi=hi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--customers", type=int, default=20_000, help="demo size (bench/quality.py's --customers)")
    parser.add_argument("--tasks", default="churn,propensity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draws", type=int, default=200, help="bootstrap draws of the intervals")
    args = parser.parse_args()
    from quality import demo_spec, tasks

    from habitus.models.cache import Cache, build_cache
    from habitus.models.evaluate.holdout import protocol
    from habitus.models.train.config import TRAIN_CUTOFFS

    with tempfile.TemporaryDirectory() as tmp:
        spec, test_cutoff, params = demo_spec(args.customers, Path(tmp))
        cache = Cache(build_cache(spec, Path(tmp) / "cache", log=lambda _: None))
        print(f"demo, {args.customers:,} customers, test cut-off {np.datetime64(test_cutoff, 's')}, seed {args.seed}; "
              f"95% intervals over {args.draws} paired entity bootstrap draws")
        print(f"{'task':<11} {'entities':>8} {'hand':>7} {'hand+fit':>8} {'fit':>7} {'oracle':>7} {'fit corr':>8}  "
              "hand + fit - hand")
        for name, task in tasks(cache, test_cutoff, params).items():
            if name not in args.tasks.split(","):
                continue
            plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
            labels = label_values(cache, params["label_column"], task.target.labels) if task.target.labels else None
            r = identified(name, Path(tmp), cache, task, plan, labels, args.seed, args.draws)
            print(f"{name:<11} {r['entities']:>8,} {r['hand']:>7.4f} {r['hand_fit']:>8.4f} {r['fit']:>7.4f} "
                  f"{r['oracle']:>7.4f} {r['corr']:>8.3f}  {r['diff']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]",
                  flush=True)


if __name__ == "__main__":
    main()
