"""Model quality on a temporal hold-out: habitus next to its baselines, one table per dataset.

    python bench/quality.py --dataset tafeng    [--json out.json]
    python bench/quality.py --dataset demo      [--customers 20000]
    python bench/quality.py --dataset movielens [--tasks churn_10pct,embedding_probe] [--label-share 0.1]

Same protocol as the scenario assets (habitus.models.evaluate.holdout): training cut-offs every window before a
validation cut-off, a later test cut-off; features before a cut-off, targets after it. "habitus"
is the product's head: the one chosen on the validation cut-off among the fine-tuned network,
LightGBM over [hand features + the foundation trunk's PCA] and their blend, as the scenario asset
chooses it (models/heads/stacked_head.py); the row "habitus (network alone)" is the fine-tuned network
by itself. The row "habitus (no pretraining)" trains the same network and head from a random trunk
(the network alone), to show what the foundation model is worth; the row "served head, no foundation"
runs the whole served recipe (network, trees, head chosen on validation) from a random trunk with no
foundation representation in the trees: what the served head owes the foundation model. Rows `churn_10pct` / `propensity_10pct` (`--label-share`, 0.1 by
default, 0 to skip) train the scenario, the network from scratch and LightGBM on the labels of 10%
of the entities only (bench/label_share.py); the row `embedding_probe` reads churn at the test
cut-off with a logistic regression from what the `embeddings` asset writes and from plain RFM
scalars (bench/probe.py). MovieLens-100k is read from the recbole wheel (bench/movielens.py).
"""

import argparse
import calendar
import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arm_scores import captured, seeded_lightgbm  # noqa: E402
from label_share import EntitySubset, labeled_entities, lightgbm_trained_on  # noqa: E402
from movielens import movielens_spec  # noqa: E402
from probe import embedding_probe  # noqa: E402

from habitus.models.cache import Cache, CacheSpec, TableInput, build_cache  # noqa: E402
from habitus.models.evaluate.holdout import protocol  # noqa: E402
from habitus.models.data.features import DAY, FeatureSpec  # noqa: E402
from habitus.models.nn.profile import Profile  # noqa: E402
from habitus.models.nn.quantize import for_inference  # noqa: E402
from habitus.models.data.targets import TargetSpec  # noqa: E402
from habitus.models.train.foundation import train_foundation  # noqa: E402
from habitus.models.data.labels import top_values  # noqa: E402
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig  # noqa: E402
from habitus.models.train.scenario import train_scenario  # noqa: E402
from habitus.models.heads.stacking import StackConfig  # noqa: E402
from habitus.models.tasks.spec import TaskSpec  # noqa: E402
from habitus.models.tasks import task as task_of  # noqa: E402

TAFENG = Path(os.environ.get("HABITUS_TAFENG", ROOT.parent / "shared" / "data" / "tafeng"))  # a worktree: set it
DATASETS = ("tafeng", "demo", "movielens")
TASKS = ("churn", "propensity", "spend", "next_items", "embedding_probe")
LABEL_SHARE_TASKS = ("churn", "propensity")  # the rows `<task>_<share>pct` of --label-share
# fine-tuning epochs of the rows where the default does not fit: ranking the whole catalog is the slow part
EPOCHS = {"next_items": 3}
WITHOUT_FOUNDATION = "served head, no foundation"  # the same recipe, random trunk, trees without its representation


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


def demo_spec(customers: int, folder: Path, products: int = 2_000) -> tuple[CacheSpec, int, dict]:
    import duckdb
    from habitus.pipelines.demo.data import generate_demo_warehouse

    db = folder / "demo.duckdb"
    generate_demo_warehouse(db, customers=customers, products=products)
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


def dataset_spec(dataset: str, customers: int, folder: Path) -> tuple[CacheSpec, int, dict]:
    """The sources, the test cut-off and the protocol's parameters of a dataset."""
    if dataset == "tafeng":
        return tafeng_spec()
    if dataset == "demo":
        return demo_spec(customers, folder)
    if dataset == "movielens":
        return movielens_spec(folder)
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {DATASETS}")


def tasks(cache: Cache, test_cutoff: int, p: dict) -> dict[str, TaskSpec]:
    """The dataset's scenarios: churn, propensity over the `labels` (50 by default) most frequent
    values of its label column, spend (where it has money) and next items."""
    w = p["window"]
    items = tuple(range(1, cache.columns[p["items"]]["vocab_size"] + 1))
    out = {
        "churn": TaskSpec("binary", TargetSpec("no_event", w, active_days=90)),
        "propensity": TaskSpec("multilabel", TargetSpec("any_event", w, p["label_column"],
                                                         top_values(cache, p["label_column"], test_cutoff,
                                                                    p.get("labels", 50)))),
    }
    if p.get("spend"):
        out["spend"] = TaskSpec("regression", TargetSpec("sum", w, p["spend"]))
    out["next_items"] = TaskSpec("recommendation", TargetSpec("items", 14, p["items"], items))
    return out


def share_name(task: str, label_share: float) -> str:
    """The row of `task` trained on `label_share` of the labels: churn_10pct for 0.1."""
    return f"{task}_{round(label_share * 100)}pct"


def row_names(label_share: float) -> tuple[str, ...]:
    """Every row a run can hold, in the order of the table: what --tasks chooses from."""
    shares = tuple(share_name(t, label_share) for t in LABEL_SHARE_TASKS) if label_share else ()
    return TASKS[:-1] + shares + TASKS[-1:]


def run(dataset: str, customers: int, log=print, only: tuple[str, ...] | None = None, label_share: float = 0.1,
        foundation_settings: dict | None = None) -> dict:
    """The dataset's table; `only`: the rows to run (names of row_names; default all);
    `foundation_settings`: FoundationConfig fields other than the defaults."""
    only = row_names(label_share) if only is None else only
    quiet = lambda msg: print(f"  {name}: {msg}", file=sys.stderr) if " start" in msg or "re-ranking" in msg else None  # noqa: E731
    t_run = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec, test_cutoff, params = dataset_spec(dataset, customers, tmp)
        cache = Cache(build_cache(spec, tmp / "cache", log=quiet))
        started = time.time()
        fcfg = FoundationConfig(**(foundation_settings or {}))
        foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=quiet)
        foundation_s = time.time() - started
        fspec = FeatureSpec.from_dict(foundation.info["feature_spec"])
        state = foundation.model.state_dict()
        rows = []
        subset = None
        if label_share and any(share_name(t, label_share) in only for t in LABEL_SHARE_TASKS):
            subset = EntitySubset(cache, labeled_entities(cache, label_share))
            log(f"label share {label_share}: {subset.n_entities} of {cache.n_entities} entities keep their labels")
        for name, task in tasks(cache, test_cutoff, params).items():
            shares = [(name, None)] + ([(share_name(name, label_share), subset)] if subset is not None else [])
            plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, cache.time_range[0])
            for row_name, train_cache in [(n, c) for n, c in shares if n in only]:
                new = score_task(cache, state, foundation.info, task, plan, row_name, train_cache)
                rows += new
                log(f"{row_name}: " + ", ".join(f"{r['metric']} {r['habitus']:.4f}" for r in new)
                    + f" (fine-tune {new[0]['finetune_s']:.0f}s, from scratch {new[0]['no_pretraining_s']:.0f}s; "
                    f"{time.time() - t_run:.0f}s so far)")
        if "embedding_probe" in only:
            # the trunk as the embeddings asset reads it: the foundation's trunk, copied for inference
            trunk = for_inference(foundation.model.trunk, "fp32")
            t0 = time.time()
            probe = embedding_probe(trunk, cache, fspec, tasks(cache, test_cutoff, params)["churn"].target, test_cutoff,
                                    Profile.of(foundation.info))
            before = "whole trunk + scalars (before)"
            rows.append({"task": "embedding_probe", "metric": "auroc", "habitus": probe["embeddings"],
                         "baselines": {before: probe[before], "rfm scalars": probe["rfm scalars"]},
                         "entities": probe["entities"], "churn_rate": probe["churn_rate"], "width": probe["width"],
                         "rfm_width": probe["rfm width"], "c=1": probe["c=1"], "probe_s": round(time.time() - t0, 1)})
            log(f"embedding_probe: embeddings {probe['embeddings']:.4f} (width {probe['width']}), before "
                f"{probe[before]:.4f}, rfm scalars {probe['rfm scalars']:.4f} ({probe['rfm width']}); C = 1: "
                + ", ".join(f"{k} {v:.4f}" for k, v in probe["c=1"].items()))
    return {"dataset": dataset, "foundation_settings": foundation_settings or {}, "test_cutoff": dt.datetime.fromtimestamp(test_cutoff, dt.timezone.utc).isoformat(),
            "label_share": label_share, "foundation_s": round(foundation_s, 1),
            "total_s": round(time.time() - t_run, 1),
            "machine": machine(), "rows": rows}


def finetune_config(row: str) -> FinetuneConfig:
    """The fine-tuning settings of a row: the product's defaults, the epochs of EPOCHS where set."""
    return FinetuneConfig(epochs=EPOCHS.get(row, FinetuneConfig.epochs))


@dataclasses.dataclass
class Arms:
    """A row's three recipe runs (models/train/scenario.py's ScenarioRun): the served recipe (with
    LightGBM), the network from scratch and the served recipe without the foundation; `records`: what
    each hold-out scored, entity by entity ({"run", "scratch", "bare"}: bench/arm_scores.py's records)."""
    run: object
    scratch: object
    bare: object
    records: list


def train_arms(cache: Cache, state: dict, foundation_info: dict, task: TaskSpec, plan, name: str,
               train_cache: Cache | None = None, seed: int = 0) -> Arms:
    """The scenario as its asset trains it (models/train/scenario.py: the fine-tuned network, the head
    chosen on validation, LightGBM), the same network from scratch and the served recipe from a random
    trunk, trained on `train_cache` (default: the whole cache; an EntitySubset for the few-labels
    rows), all scored at the test cut-off on every eligible entity of `cache`. `seed` seeds the
    fine-tuning, the head's trees and LightGBM."""
    quiet = lambda msg: print(f"  {name}: {msg}", file=sys.stderr) if " start" in msg or "re-ranking" in msg else None  # noqa: E731
    cfg = ScenarioConfig(name, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                         dataclasses.replace(finetune_config(name), seed=seed),
                         refit=False)  # (the hold-out is the measured model's either way)
    stack = StackConfig(seed=seed)
    records = {}
    with captured() as records["run"], seeded_lightgbm(seed):
        # LightGBM of the few-labels rows: fitted on the labeled entities, scored on all of them
        with lightgbm_trained_on(train_cache, plan.test_cutoff) if train_cache is not None else contextlib.nullcontext():
            run = train_scenario(cache, state, foundation_info, cfg, log=quiet, train_cache=train_cache, stack=stack)
    with captured() as records["scratch"]:
        scratch = train_scenario(cache, state, foundation_info, dataclasses.replace(cfg, from_scratch=True, head="network"),
                                 log=quiet, train_cache=train_cache, baselines=False, stack=stack)
    with captured() as records["bare"]:
        # the served recipe without the foundation model: a random trunk, and no representation in the trees
        bare = train_scenario(cache, state, foundation_info, dataclasses.replace(cfg, from_scratch=True), log=quiet,
                              train_cache=train_cache, baselines=False,
                              stack=dataclasses.replace(stack, components=0))
    return Arms(run, scratch, bare, records)


def score_task(cache: Cache, state: dict, foundation_info: dict, task: TaskSpec, plan, name: str,
               train_cache: Cache | None = None) -> list[dict]:
    """The rows of train_arms's runs, metric by metric."""
    arms = train_arms(cache, state, foundation_info, task, plan, name, train_cache)
    run, scratch, bare = arms.run, arms.scratch, arms.bare
    report, no_pretrain, tuned, head = run.report, scratch.report["model"], run.trained, run.head
    metrics = task_of(task).report_metrics(task)
    rows = []
    for metric in metrics:
        baselines = {b: m[metric] for b, m in report["baselines"].items()}
        if "network" in report:  # the network alone, what "habitus" was before the head was chosen on validation
            baselines["habitus (network alone)"] = report["network"][metric]
        baselines["habitus (no pretraining)"] = no_pretrain[metric]
        baselines[WITHOUT_FOUNDATION] = bare.report["model"][metric]
        rows.append({"task": name, "metric": metric, "habitus": report["model"][metric],
                     "baselines": baselines, "entities": report["entities"],
                     "head": "network" if head is None else head.chosen,
                     "head_weight": 0.0 if head is None else head.weight, "head_s": round(run.seconds["head"], 1),
                     **({"head_report": report["head"]} if "head" in report else {}),
                     **({} if train_cache is None else {"labeled_entities": train_cache.n_entities,
                                                        "val_rows": tuned.info["val_rows"]}),
                     "finetune_s": round(run.seconds["finetune"], 1),
                     "no_pretraining_s": round(scratch.seconds["finetune"], 1),
                     "soup_epochs": tuned.info["soup_epochs"], "head_start": tuned.info.get("head_start"),
                     "second_stage": tuned.info.get("second_stage"),
                     "soup_epochs_no_pretraining": scratch.trained.info["soup_epochs"],
                     "val_loss": tuned.curves["val_loss"],
                     "val_loss_no_pretraining": scratch.trained.curves["val_loss"]})
    return rows


def machine() -> str:
    import os
    import platform

    import torch
    return f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def table(result: dict) -> str:
    lines = [f"dataset {result['dataset']}  (test cut-off {result['test_cutoff']}, foundation "
             f"{result['foundation_s']}s, whole run {result['total_s']}s on {result['machine']})",
             f"{'task':<16} {'metric':<12} {'habitus':>8}  {'baseline':<26} {'value':>8} {'habitus - baseline':>19}"]
    for r in result["rows"]:
        lower = r["metric"] in ("mae", "rmse")
        for i, (b, v) in enumerate(r["baselines"].items()):
            diff = (v - r["habitus"]) if lower else (r["habitus"] - v)
            head = f"{r['task']:<16} {r['metric']:<12} {r['habitus']:>8.4f}" if i == 0 else " " * 38
            lines.append(f"{head}  {b:<26} {v:>8.4f} {diff:>+19.4f}")
        if r["task"] == "embedding_probe":
            lines.append(f"{'':<38}  5-fold logistic regression (C chosen per fold), churn at the test cut-off, "
                         f"{r['entities']} entities; embeddings {r['width']} wide, rfm scalars {r['rfm_width']}")
            lines.append(f"{'':<38}  with C = 1: " + ", ".join(f"{k} {v:.4f}" for k, v in r["c=1"].items()))
            continue
        if "labeled_entities" in r:
            lines.append(f"{'':<38}  labels of {r['labeled_entities']} entities only "
                         f"({r['val_rows']} validation rows); scored on all {r['entities']}")
        if r.get("second_stage"):  # recommendation: re-ranking trees, chosen on validation (models/tasks/rerank.py)
            st = r["second_stage"]
            figures = ", ".join(f"{k.removeprefix('val_')} {v:.4f}" for k, v in st.items() if k.startswith("val_"))
            lines.append(f"{'':<38}  re-ranking on validation: {st['chosen']} ({figures or st.get('reason', '')})")
        if r.get("head") is not None and not r.get("second_stage"):
            lines.append(f"{'':<38}  head chosen on validation: {r['head']} (trees' weight {r['head_weight']}; "
                         f"fitting it {r.get('head_s')}s); network alone and no pretraining: the network's own")
        lines.append(f"{'':<38}  fine-tune {r['finetune_s']}s (epochs averaged {r['soup_epochs']}); "
                     f"no pretraining {r['no_pretraining_s']}s ({r['soup_epochs_no_pretraining']})")
        if r.get("val_loss"):  # how fast each start learns: validation loss after each epoch
            lines.append(f"{'':<38}  validation loss by epoch: fine-tuned "
                         + " ".join(f"{v:.4f}" for v in r["val_loss"]) + "; no pretraining "
                         + " ".join(f"{v:.4f}" for v in r["val_loss_no_pretraining"]))
    lines.append("(habitus - baseline > 0 means habitus is better; for mae the sign is flipped)")
    return "\n".join(lines)


def dataset_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark over these datasets shares (bench/stacking.py too): --dataset,
    --customers (the demo's size) and --json."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="tafeng")
    parser.add_argument("--customers", type=int, default=20_000, help="demo size")
    parser.add_argument("--json", help="also write the figures as JSON to this path")
    return parser


def main() -> None:
    parser = dataset_parser(__doc__)
    parser.add_argument("--tasks", help=f"comma-separated rows to run (default all: {','.join(row_names(0.1))})")
    parser.add_argument("--label-share", type=float, default=0.1,
                        help="also train churn and propensity on the labels of this share of the entities (0: skip)")
    parser.add_argument("--foundation", action="append", default=[], metavar="KEY=VALUE",
                        help="a FoundationConfig setting other than its default (repeatable), e.g. sequence_events=32")
    args = parser.parse_args()
    settings = {}
    for item in args.foundation:
        key, _, value = item.partition("=")
        if key not in {f.name for f in dataclasses.fields(FoundationConfig)} or not value:
            parser.error(f"--foundation {item}: expected KEY=VALUE with KEY a FoundationConfig field")
        settings[key] = json.loads(value)
    if not 0 <= args.label_share <= 1:
        parser.error(f"--label-share must be in [0, 1], got {args.label_share}")
    only = None if args.tasks is None else tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    unknown = sorted(set(only or ()) - set(row_names(args.label_share)))
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}; choose among {', '.join(row_names(args.label_share))}")
    result = run(args.dataset, args.customers, log=lambda m: print(m, file=sys.stderr, flush=True), only=only,
                 label_share=args.label_share, foundation_settings=settings)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
