"""`habitus`: the command line.

    habitus demo          generate the demo warehouse (if missing) and materialize every asset
    habitus materialize   materialize every asset of the project ($HABITUS_CONFIG or --config)
    habitus report        print each scenario's hold-out metrics next to its baselines
    habitus demo-data     write the generated retail warehouse into a DuckDB file
    habitus init          look at a connection's tables and print a suggested project config
    habitus train | score --date D | embed --date D | upload | restore
                          managed-job entry points, no Dagster instance needed (pipelines/managed.py)
"""

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from pipelines.config import ConfigError, load_project


def _instance():
    import dagster as dg

    home = os.environ.get("DAGSTER_HOME")
    if home:
        Path(home).mkdir(parents=True, exist_ok=True)
        return dg.DagsterInstance.get()
    return dg.DagsterInstance.ephemeral()


def materialize_all(project, *, log=print) -> dict:
    """Extract every partition, build the cache, train, fine-tune, and score the newest day, running
    the asset checks of each stage with it (as the jobs do in the UI). Failed checks are logged and
    returned; a failed blocking check stops what depends on it, as in Dagster."""
    import dagster as dg
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from assets.cache import current_cache
    from assets.checks import build_checks
    from assets.predictions import predictions_key
    from assets.sources import source_key
    from pipelines.definitions import build_assets, build_resources

    assets, resources, instance = build_assets(project), build_resources(project), _instance()
    checks = build_checks(project)
    timings, failed, passed = {}, [], 0

    def run(selection, what, **kw):
        nonlocal passed
        started = time.time()
        log(f"materializing {what} ...")
        keys = set(selection)
        own_checks = [c for c in checks if any(k.asset_key in keys for k in c.check_keys)]
        result = dg.materialize([*assets, *own_checks], selection=selection, resources=resources, instance=instance,
                                raise_on_error=False, **kw)
        for e in result.get_asset_check_evaluations():
            if e.passed:
                passed += 1
            else:
                failed.append(f"{e.asset_key.to_user_string()} {e.check_name} ({e.severity.value.lower()}): "
                              f"{e.description or ''}".strip())
                log(f"  check failed: {failed[-1]}")
        # a failed blocking check fails its step (Dagster) but the asset itself was written: only a
        # missing materialization is a failure of the run
        missing = keys - {e.asset_key for e in result.get_asset_materialization_events()}
        if missing:
            raise RuntimeError(f"materializing {', '.join(sorted(k.to_user_string() for k in missing))} failed; "
                               f"see the log above")
        timings[what] = round(time.time() - started, 1)
        log(f"  done in {timings[what]}s")

    for s in project.events_sources:
        keys = next(a for a in assets if a.key == source_key(s.name)).partitions_def.get_partition_keys()
        run([source_key(s.name)], f"source/{s.name} ({len(keys)} partitions)",
            tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
    unpartitioned = [source_key(s.name) for s in project.sources if s.role != "events"]
    unpartitioned += [dg.AssetKey("cache"), dg.AssetKey("foundation_model")]
    unpartitioned += [dg.AssetKey(["scenario", n]) for n in project.scenarios]
    run(unpartitioned, "cache, foundation model and scenarios")
    cache = current_cache(resources["workspace"])
    day = datetime.fromtimestamp(cache.time_range[1], timezone.utc).date().isoformat()
    run([predictions_key(n) for n in project.prediction_scenarios] + [dg.AssetKey("embeddings")],
        f"predictions and embeddings for {day}", partition_key=day)
    return {"timings": timings, "prediction_day": day, "checks_passed": passed, "checks_failed": failed}


def report(project, prediction_day: str | None = None) -> str:
    """The table a person reads first: each scenario's hold-out metric next to its baselines."""
    from assets.checks import baseline_margin
    from resources.workspace import Workspace

    ws = Workspace(root=project.workspace)
    lines = [f"{'scenario':<18} {'task':<15} {'metric':<12} {'model':>8} {'best baseline':>14}  {'(which)':<18} "
             f"{'beats':<6} {'entities':>9}"]
    for name in project.scenarios:
        cfg_file = ws.scenario(name) / "config.json"
        if not cfg_file.exists():
            lines.append(f"{name:<18} (not trained yet)")
            continue
        cfg = json.loads(cfg_file.read_text())
        margin = baseline_margin(cfg)
        lines.append(f"{name:<18} {cfg['task']['task']:<15} {margin['metric']:<12} {margin['model']:>8.4f} "
                     f"{margin['baseline']:>14.4f}  {margin['best_baseline'] or '-':<18} "
                     f"{'yes' if cfg['beats_baselines'] else 'no':<6} {cfg['metrics']['entities']:>9,}")
    lines.append(f"\nhold-out: test cut-off {_first_protocol(ws, project)}; features before it, targets after it")
    for name in project.prediction_scenarios:
        folder = ws.predictions(name)
        files = sorted(folder.glob("*.parquet")) if folder.exists() else []
        chosen = [f for f in files if prediction_day and f.stem == prediction_day] or files[-1:]
        if chosen:
            import pyarrow.parquet as pq

            lines.append(f"predictions/{name}: {chosen[0]} ({pq.read_metadata(chosen[0]).num_rows:,} rows)")
    emb = sorted(ws.embeddings.glob("*.parquet")) if ws.embeddings.exists() else []
    if emb:
        import pyarrow.parquet as pq

        lines.append(f"embeddings: {emb[-1]} ({pq.read_metadata(emb[-1]).num_rows:,} rows)")
    return "\n".join(lines)


def _first_protocol(ws, project) -> str:
    for name in project.scenarios:
        f = ws.scenario(name) / "config.json"
        if f.exists():
            return json.loads(f.read_text())["protocol"]["test_cutoff"]
    return "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="habitus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("demo", "materialize", "report"):
        p = sub.add_parser(name)
        p.add_argument("--config", help="project YAML (default: $HABITUS_CONFIG or examples/demo.yaml)")
        if name != "report":  # --device, --processes, ... over the project's `executor:`
            from pipelines.managed import add_executor_arguments

            add_executor_arguments(p)
        if name == "demo":
            p.add_argument("--customers", type=int, default=20_000)
            p.add_argument("--regenerate", action="store_true", help="write the demo warehouse again")
    sub.add_parser("demo-data", add_help=False)
    sub.add_parser("init", add_help=False, help="suggest a project config from a connection's tables")
    from pipelines.managed import COMMANDS as MANAGED

    for name in MANAGED:
        sub.add_parser(name, add_help=False, help="managed-job entry point (habitus NAME --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command in MANAGED:
        from pipelines.managed import main as managed

        return managed(args.command, rest)
    if args.command == "demo-data":
        from pipelines.demo_data import main as demo_data

        return demo_data(rest) or 0
    if args.command == "init":
        from pipelines.init import main as init

        return init(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.config:  # the code location (pipelines.definitions) reads the same file
        os.environ["HABITUS_CONFIG"] = str(Path(args.config).resolve())
    try:
        from pipelines.managed import with_executor

        project = with_executor(load_project(args.config), args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.command == "report":
        print(report(project))
        return 0
    if args.command == "demo":
        from pipelines.demo_data import generate_demo_warehouse

        path = Path(project.connections["warehouse"].path)
        if args.regenerate or not path.exists():
            started = time.time()
            counts = generate_demo_warehouse(path, customers=args.customers)
            print(f"demo warehouse {path}: {counts} in {time.time() - started:.1f}s")
    started = time.time()
    result = materialize_all(project)
    print(f"\nall assets materialized in {time.time() - started:.0f}s; asset checks: {result['checks_passed']} passed, "
          f"{len(result['checks_failed'])} failed\n")
    print(report(project, result["prediction_day"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
