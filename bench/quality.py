"""Model quality on a temporal hold-out: habitus next to its baselines, one table per dataset.

    python bench/quality.py --dataset tafeng [--json out.json]
    python bench/quality.py --dataset demo   [--customers 20000]

Same protocol as the scenario assets (models.evaluate): training cut-offs every window before a
validation cut-off, a later test cut-off; features before a cut-off, targets after it. The row
"habitus (no pretraining)" trains the same network and head from a random trunk, to show what the
foundation model is worth.
"""

import argparse
import calendar
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.baselines import lightgbm_scores  # noqa: E402
from models.cache import Cache, CacheSpec, TableInput, build_cache  # noqa: E402
from models.evaluate import evaluate, headline, protocol  # noqa: E402
from models.features import DAY, FeatureSpec  # noqa: E402
from models.targets import TargetSpec  # noqa: E402
from models.train import FinetuneConfig, FoundationConfig, TaskSpec, finetune, top_values, train_foundation  # noqa: E402

TAFENG = ROOT.parent / "shared" / "data" / "tafeng"


def tafeng_spec() -> tuple[CacheSpec, int, dict]:
    if not TAFENG.exists():
        sys.exit(f"{TAFENG} not found: the Ta-Feng data ships in the project's shared/ folder only")
    spec = CacheSpec(
        "customer_id",
        [TableInput("events", [str(TAFENG / "events.parquet")],
                    {"product_id": "categorical", "quantity": "numeric", "sales_price": "numeric"}, timestamp="ts")],
        [TableInput("customers", [str(TAFENG / "customers.parquet")],
                    {"age_group": "categorical", "pin_code": "categorical"})],
        [TableInput("products", [str(TAFENG / "products.parquet")], {"product_subclass": "categorical"},
                    key="product_id")])
    test_cutoff = calendar.timegm(dt.date(2001, 2, 14).timetuple())
    return spec, test_cutoff, {"window": 14, "label_column": "product_subclass", "items": "product_id",
                               "spend": "sales_price"}


def demo_spec(customers: int, folder: Path) -> tuple[CacheSpec, int, dict]:
    import duckdb
    from pipelines.demo_data import generate_demo_warehouse

    db = folder / "demo.duckdb"
    generate_demo_warehouse(db, customers=customers)
    con = duckdb.connect(str(db), read_only=True)
    for table in ("purchases", "customers", "products"):
        con.sql(f"COPY {table} TO '{folder / table}.parquet' (FORMAT parquet)")
    last = con.sql("SELECT max(ts) FROM purchases").fetchall()[0][0]
    con.close()
    spec = CacheSpec(
        "customer_id",
        [TableInput("purchases", [str(folder / "purchases.parquet")],
                    {"product_id": "categorical", "store_id": "categorical", "quantity": "numeric",
                     "price": "numeric"}, timestamp="ts")],
        [TableInput("customers", [str(folder / "customers.parquet")],
                    {"age": "numeric", "region": "categorical", "segment": "categorical", "signup_date": "timestamp"})],
        [TableInput("products", [str(folder / "products.parquet")],
                    {"category": "categorical", "brand": "categorical", "price_tier": "categorical"}, key="product_id")])
    window = 28
    test_cutoff = calendar.timegm((last.date() + dt.timedelta(days=1)).timetuple()) - window * DAY
    return spec, test_cutoff, {"window": window, "label_column": "brand", "items": "product_id", "spend": "price"}


def tasks(cache: Cache, test_cutoff: int, p: dict) -> dict[str, TaskSpec]:
    w = p["window"]
    items = tuple(range(1, cache.columns[p["items"]]["vocab_size"] + 1))
    return {
        "churn": TaskSpec("binary", TargetSpec("no_event", w, active_days=90)),
        "propensity": TaskSpec("multilabel", TargetSpec("any_event", w, p["label_column"],
                                                         top_values(cache, p["label_column"], test_cutoff, 50))),
        "spend": TaskSpec("regression", TargetSpec("sum", w, p["spend"])),
        "next_items": TaskSpec("recommendation", TargetSpec("items", 14, p["items"], items), k=10),
    }


def run(dataset: str, customers: int, log=print) -> dict:
    quiet = lambda _: None  # noqa: E731
    t_run = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec, test_cutoff, params = tafeng_spec() if dataset == "tafeng" else demo_spec(customers, tmp)
        cache = Cache(build_cache(spec, tmp / "cache", log=quiet))
        started = time.time()
        fcfg = FoundationConfig()
        foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=quiet)
        foundation_s = time.time() - started
        fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
        state = foundation.model.state_dict()
        rows = []
        for name, task in tasks(cache, test_cutoff, params).items():
            plan = protocol(test_cutoff, task.target.window_days, 4, cache.time_range[0])
            # ranking the whole catalog is the slow part: 3 epochs for recommendation, on every dataset
            fcfg_task = FinetuneConfig(epochs=3) if task.task == "recommendation" else FinetuneConfig()
            t0 = time.time()
            tuned = finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff,
                             fcfg_task, log=quiet)
            tuned_s = time.time() - t0
            t0 = time.time()
            scratch = finetune(cache, state, foundation.info, task, list(plan.train_cutoffs), plan.val_cutoff,
                               fcfg_task, log=quiet, from_scratch=True)
            scratch_s = time.time() - t0
            lgbm = lightgbm_scores(cache, fspec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff)
            report = evaluate(tuned.model, cache, fspec, task, plan.test_cutoff,
                              constant=tuned.info["val_target_mean"], extra={"lightgbm": lgbm})
            no_pretrain = evaluate(scratch.model, cache, fspec, task, plan.test_cutoff)["model"]
            metrics = [f"hr@{task.k}", f"ndcg@{task.k}"] if task.task == "recommendation" else [headline(task)]
            for metric in metrics:
                baselines = {b: m[metric] for b, m in report["baselines"].items()}
                baselines["habitus (no pretraining)"] = no_pretrain[metric]
                rows.append({"task": name, "metric": metric, "habitus": report["model"][metric],
                             "baselines": baselines, "entities": report["entities"],
                             "finetune_s": round(tuned_s, 1), "no_pretraining_s": round(scratch_s, 1),
                             "soup_epochs": tuned.info["soup_epochs"],
                             "soup_epochs_no_pretraining": scratch.info["soup_epochs"],
                             "val_loss": tuned.curves["val_loss"],
                             "val_loss_no_pretraining": scratch.curves["val_loss"]})
            log(f"{name}: " + ", ".join(f"{m} {report['model'][m]:.4f}" for m in metrics)
                + f" (fine-tune {tuned_s:.0f}s, from scratch {scratch_s:.0f}s; {time.time() - t_run:.0f}s so far)")
    return {"dataset": dataset, "test_cutoff": dt.datetime.fromtimestamp(test_cutoff, dt.timezone.utc).isoformat(),
            "foundation_s": round(foundation_s, 1), "total_s": round(time.time() - t_run, 1),
            "machine": machine(), "rows": rows}


def machine() -> str:
    import os
    import platform

    import torch
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']}  (test cut-off {result['test_cutoff']}, foundation "
             f"{result['foundation_s']}s, whole run {result['total_s']}s on {result['machine']})",
             f"{'task':<12} {'metric':<12} {'habitus':>8}  {'baseline':<26} {'value':>8} {'habitus - baseline':>19}"]
    for r in result["rows"]:
        lower = r["metric"] in ("mae", "rmse")
        for i, (b, v) in enumerate(r["baselines"].items()):
            diff = (v - r["habitus"]) if lower else (r["habitus"] - v)
            head = f"{r['task']:<12} {r['metric']:<12} {r['habitus']:>8.4f}" if i == 0 else " " * 34
            lines.append(f"{head}  {b:<26} {v:>8.4f} {diff:>+19.4f}")
        lines.append(f"{'':<34}  fine-tune {r['finetune_s']}s (epochs averaged {r['soup_epochs']}); "
                     f"no pretraining {r['no_pretraining_s']}s ({r['soup_epochs_no_pretraining']})")
        if r.get("val_loss"):  # how fast each start learns: validation loss after each epoch
            lines.append(f"{'':<34}  validation loss by epoch: fine-tuned "
                         + " ".join(f"{v:.4f}" for v in r["val_loss"]) + "; no pretraining "
                         + " ".join(f"{v:.4f}" for v in r["val_loss_no_pretraining"]))
    lines.append("(habitus - baseline > 0 means habitus is better; for mae the sign is flipped)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=["tafeng", "demo"], default="tafeng")
    parser.add_argument("--customers", type=int, default=20_000, help="demo size")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    args = parser.parse_args()
    result = run(args.dataset, args.customers, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
