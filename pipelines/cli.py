"""`habitus`: the command line.

    habitus demo          generate the demo warehouse (if missing) and materialize every asset
    habitus materialize   materialize every asset of the project ($HABITUS_CONFIG or --config)
    habitus report        print each scenario's hold-out metrics next to its baselines
    habitus versions [S]  what serves each scenario and why; with S, its kept versions: trained when, metric
                          vs baseline, served when (S = foundation: its versions, losses and data window)
    habitus rollback S [--to FP]   serve another kept version of S (default: the one that served before);
                          foundation: put that version back into checkpoints/foundation/
    habitus demo-data     write the generated retail warehouse into a DuckDB file
    habitus init          look at a connection's tables and print a suggested project config
    habitus train | score --date D | embed --date D | upload | restore
                          managed-job entry points, no Dagster instance needed (pipelines/run/managed.py)

`materialize` and `demo` score the newest day of the data, or `--date D`, or every day of
`--from D1 --to D2` (a backfill). A day D scores as of the end of D: events up to D+1 00:00 UTC.
They show a progress display and a report; `-v` shows Dagster's own log instead.

Exit codes:
    0    every asset materialized; no blocking check failed (failed WARN checks are listed)
    1    a blocking check failed with ERROR (listed at the end); what it guards may not have run.
         A scenario that does not beat its baselines (beats_baselines, WARN) is listed and not promoted
         (the last promoted model, else the best baseline, scores) but is not a failed run
    2    bad usage or config (a flag, the project YAML, a date outside the predictions' range)
    3    a stage failed (an asset raised an error; its message is printed)
    130  interrupted (Ctrl-C)
"""

import argparse
import logging
import os
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.orchestration.instance import dagster_instance
from habitus.pipelines.run.report import failed_checks_table, failure_line, report


EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_STAGE_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}  # Dagster's console log off
MAX_PARTITIONS_PER_RUN = 31  # the scoring assets' backfill policy: a month of days per run


class StageFailed(RuntimeError):
    """An asset raised: the run of a stage failed (exit code 3)."""


def scoring_days(project, day: str | None = None, first: str | None = None, last: str | None = None) -> list[str]:
    """The days asked for (--date, or --from/--to inclusive), checked against the predictions'
    daily partitions: a day before `predictions.start` or after the events' `end` is a usage error
    that names the setting. [] means the newest day of the data (decided once the cache exists)."""
    from datetime import date, timedelta

    from habitus.pipelines.orchestration.partitions import predictions_partitions

    if day and (first or last):
        raise ConfigError("--date and --from/--to: give one day or one range")
    if (first is None) != (last is None):
        raise ConfigError("--from and --to go together (both days inclusive)")
    if not (day or first):
        return []
    def parse(flag, text):
        try:
            return date.fromisoformat(text)
        except ValueError as e:
            raise ConfigError(f"{flag} {text}: a day is written YYYY-MM-DD ({e})") from None

    lo, hi = (parse("--date", day),) * 2 if day else (parse("--from", first), parse("--to", last))
    if hi < lo:
        raise ConfigError(f"--to {hi} is before --from {lo}")
    parts = predictions_partitions(project)
    start = parts.start.date()
    if lo < start:
        setting = ("predictions.start" if project.predictions.start else
                   f"predictions.start, unset: the start of events source {project.events_sources[0].name!r}")
        raise ConfigError(f"{lo} is before the first day that can be scored, {start} ({setting}); set "
                          f"predictions.start to {lo} or earlier in the project config to score it")
    end = parts.end.date() if parts.end else None
    if end is not None and hi >= end:
        raise ConfigError(f"{hi} is after the last day that can be scored, {end - timedelta(days=1)} (the events' "
                          f"`end`, {end}, exclusive); raise `end` of the events sources to score it")
    return [(lo + timedelta(days=i)).isoformat() for i in range((hi - lo).days + 1)]


def materialize_all(project, *, log=print, days: list[str] | None = None, display=None, verbose: bool = True) -> dict:
    """Extract every partition, build the cache, train, fine-tune, and score the newest day (or
    `days`), running the asset checks of each stage with it (as the jobs do in the UI). Failed checks
    are returned; a failed blocking check stops what depends on it, as in Dagster, and (across the
    CLI's runs) a failed blocking data check stops the stages after it.

    Returns timings, prediction_day(s), checks_passed, checks_failed ("<asset> <check> (<severity>):
    <reason>"), failures (the same as dicts), warnings (WARNING lines the assets logged), stopped
    (why a stage did not run, or None)."""
    import dagster as dg
    # private: dg.materialize takes one partition_key, and Dagster exports no name for the range tags that
    # make one run of a partition range (its single-run backfills set them the same way)
    from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

    from habitus.assets.cache import current_cache
    from habitus.assets.checks import build_checks
    from habitus.assets.predictions import predictions_key
    from habitus.assets.sources import source_key
    from habitus.pipelines.orchestration.build import build_assets, build_resources
    from habitus.pipelines.run.progress import STAGE_TAG, PlainDisplay

    display = display or PlainDisplay(log)
    assets, resources, instance = build_assets(project), build_resources(project), dagster_instance()
    checks = build_checks(project)
    steps = {a.node_def.name: a.key.to_user_string() for a in assets}
    timings, failures, warnings, passed = {}, [], [], 0
    stopped = None
    session = f"{os.getpid()}-{time.time_ns()}"

    def run(selection, what, total=None, **kw):
        nonlocal passed
        started = time.time()
        keys = set(selection)
        own_checks = [c for c in checks if any(k.asset_key in keys for k in c.check_keys)]
        tag = f"{session}-{len(timings)}"
        kw["tags"] = {**kw.get("tags", {}), STAGE_TAG: tag}
        with display.stage(what, instance, tag, steps, total):
            result = dg.materialize([*assets, *own_checks], selection=selection, resources=resources,
                                    instance=instance, raise_on_error=False,
                                    run_config=None if verbose else QUIET_LOGS, **kw)
            blocked = []
            for e in result.get_asset_check_evaluations():
                if e.passed:
                    passed += 1
                    continue
                f = {"asset": e.asset_key.to_user_string(), "check": e.check_name,
                     "severity": e.severity.value.lower(), "blocking": bool(e.blocking),
                     "reason": (e.description or "").strip()}
                failures.append(f)
                if f["blocking"] and f["severity"] == "error":
                    blocked.append(f)
                if verbose:
                    display.line(f"  check failed: {failure_line(f)}")
            for entry in instance.all_logs(result.run_id):
                if entry.dagster_event is None and entry.level >= logging.WARNING and entry.user_message:
                    line = f"{steps.get(entry.step_key, entry.step_key or 'run')}: {entry.user_message}"
                    if line not in warnings:
                        warnings.append(line)
            errors = [f"{steps.get(ev.step_key, ev.step_key)}: {_error_text(ev)}" for ev in result.all_events
                      if ev.event_type_value == "STEP_FAILURE"
                      and "DagsterAssetCheckFailedError" not in _error_class(ev)]
            if any("DagsterExecutionInterruptedError" in _error_class(ev) for ev in result.all_events
                   if ev.event_type_value == "STEP_FAILURE"):
                raise KeyboardInterrupt  # Ctrl-C reaches the run as a step failure: exit code 130, not 3
            if errors:
                raise StageFailed("; ".join(errors))
            # a failed blocking check fails its step (Dagster) but the asset itself was written: a missing
            # materialization is what a blocking check upstream left out
            missing = keys - {e.asset_key for e in result.get_asset_materialization_events()}
        timings[what] = round(time.time() - started, 1)
        if missing or blocked:
            names = ", ".join(sorted(k.to_user_string() for k in missing)) or "nothing"
            return f"{what}: not materialized: {names}" + (f" (blocking check(s) failed: "
                   f"{', '.join(b['asset'] + ' ' + b['check'] for b in blocked)})" if blocked else "")
        return None

    def done(prediction_days):
        return {"timings": timings, "prediction_day": prediction_days[-1] if prediction_days else None,
                "prediction_days": prediction_days, "checks_passed": passed,
                "checks_failed": [failure_line(f) for f in failures], "failures": failures,
                "warnings": warnings, "stopped": stopped}

    for s in project.events_sources:
        keys = next(a for a in assets if a.key == source_key(s.name)).partitions_def.get_partition_keys()
        stopped = run([source_key(s.name)], f"source/{s.name} ({len(keys)} partitions)", total=len(keys),
                      tags={ASSET_PARTITION_RANGE_START_TAG: keys[0], ASSET_PARTITION_RANGE_END_TAG: keys[-1]})
        if stopped:
            return done([])
    unpartitioned = [source_key(s.name) for s in project.sources if s.role != "events"]
    unpartitioned += [dg.AssetKey("cache"), dg.AssetKey("foundation_model")]
    unpartitioned += [dg.AssetKey(["scenario", n]) for n in project.scenarios]
    stopped = run(unpartitioned, "cache, foundation model and scenarios")
    if stopped and not _only_scenarios_blocked(failures):
        return done([])
    stopped = None  # a scenario that loses to a baseline still scores from its serving checkpoint
    cache = current_cache(resources["workspace"])
    newest = datetime.fromtimestamp(cache.time_range[1], timezone.utc).date().isoformat()
    days = list(days or [newest])
    late = [d for d in days if d > newest]
    if late:
        warnings.append(f"scoring {late[0]}{' .. ' + late[-1] if len(late) > 1 else ''}: after the newest event in "
                        f"the data ({newest}); those days score as of their end with no newer events (extract newer "
                        f"partitions for fresh scores)")
    selection = [predictions_key(n) for n in project.prediction_scenarios] + [dg.AssetKey("embeddings")]
    selection += [dg.AssetKey(["explanations", n]) for n, sc in project.scenarios.items() if sc.explain]
    for i in range(0, len(days), MAX_PARTITIONS_PER_RUN):
        chunk = days[i:i + MAX_PARTITIONS_PER_RUN]
        what = f"predictions and embeddings for {chunk[0]}" + (f" .. {chunk[-1]}" if len(chunk) > 1 else "")
        kw = ({"partition_key": chunk[0]} if len(chunk) == 1 else
              {"tags": {ASSET_PARTITION_RANGE_START_TAG: chunk[0], ASSET_PARTITION_RANGE_END_TAG: chunk[-1]}})
        stopped = run(selection, what, total=len(chunk) * len(project.prediction_scenarios) or None, **kw)
        if stopped:
            break
    return done(days)


def _only_scenarios_blocked(failures: list[dict]) -> bool:
    return all(f["asset"].startswith("scenario/") for f in failures if f["blocking"] and f["severity"] == "error")


def _error_class(ev) -> str:
    err = getattr(ev.event_specific_data, "error", None)
    return getattr(err, "cls_name", "") or ""


def _error_text(ev) -> str:
    err = getattr(ev.event_specific_data, "error", None)
    if err is None:
        return ev.message or "failed"
    # a dagster.Failure's own description, else the innermost cause's message
    while getattr(err, "cause", None) is not None and err.cls_name in ("DagsterExecutionStepExecutionError",):
        err = err.cause
    text = re.sub(r"^[\w.]+(Error|Exception|Failure)\w*: ", "", err.message.strip())  # "pkg.Class: message"
    return text if err.cls_name == "Failure" else f"{err.cls_name}: {text}"


def _project_args(p: argparse.ArgumentParser, *, scoring: bool = False) -> None:
    p.add_argument("--config", help="project YAML (default: $HABITUS_CONFIG or examples/demo.yaml)")
    p.add_argument("-v", "--verbose", action="store_true", help="Dagster's full log instead of the progress display")
    if scoring:
        p.add_argument("--date", metavar="D", help="score day D (YYYY-MM-DD) as of its end, D+1 00:00 UTC; "
                       "default: the newest day of the data")
        p.add_argument("--from", dest="date_from", metavar="D1", help="score every day from D1 ... (with --to)")
        p.add_argument("--to", dest="date_to", metavar="D2", help="... to D2, inclusive (a backfill)")


def _materialize_command(args, project) -> int:
    """demo and materialize: every asset, then the report, the failed checks and the exit code."""
    days = scoring_days(project, args.date, args.date_from, args.date_to)  # a bad day fails before any work
    if args.command == "demo":
        from habitus.pipelines.demo.data import generate_demo_warehouse

        path = Path(project.connections["warehouse"].path)
        if args.regenerate or not path.exists():
            started = time.time()
            counts = generate_demo_warehouse(path, customers=args.customers)
            print(f"demo warehouse {path}: {counts} in {time.time() - started:.1f}s")
    display = None
    if not args.verbose:
        import warnings

        from habitus.pipelines.run.progress import RichDisplay

        warnings.filterwarnings("ignore", module=r"dagster(\..*)?$")  # preview/beta notices: -v shows them
        display = RichDisplay()
    started = time.time()
    try:
        result = materialize_all(project, days=days, display=display, verbose=args.verbose)
    except StageFailed as e:
        print(f"\nerror: a stage failed: {e}", file=sys.stderr)
        print("(run again with -v for Dagster's full log)", file=sys.stderr)
        return EXIT_STAGE_FAILED
    finally:
        if display is not None:
            display.close()
    failures = result["failures"]
    blocking = [f for f in failures if f["blocking"] and f["severity"] == "error"]
    print(f"{chr(10) if args.verbose else ''}{'stopped' if result['stopped'] else 'all assets materialized'} in {time.time() - started:.0f}s; "
          f"asset checks: {result['checks_passed']} passed, {len(failures)} failed"
          + (f" ({len(blocking)} blocking)" if blocking else "") + "\n")
    if result["stopped"]:
        print(f"stopped: {result['stopped']}\n")
    else:
        print(report(project, result["prediction_day"]))
    if result["warnings"] and not args.verbose:
        shown = result["warnings"][:8]
        print("\nwarnings:")
        print("\n".join(f"  {w}" for w in shown))
        if len(result["warnings"]) > len(shown):
            print(f"  ... and {len(result['warnings']) - len(shown)} more (-v shows the full log)")
    if failures:
        print("\n" + failed_checks_table(failures))
    return EXIT_CHECK_FAILED if blocking else EXIT_OK


def _report_command(args, project) -> int:
    print(report(project))
    return EXIT_OK


def _scenario_named(project, name: str) -> str:
    if name not in project.scenarios:
        raise ConfigError(f"no scenario {name!r} in the project (scenarios: {', '.join(project.scenarios) or 'none'})")
    return name


def _versions_command(args, project) -> int:
    from habitus.assets.foundation_versions import NAME, foundation_table, foundation_versions, in_use
    from habitus.assets.serving import serving_line, versions, versions_table
    from habitus.resources.store.workspace import Workspace

    ws = Workspace(root=project.workspace)
    if args.scenario is None:  # every scenario: what serves and why
        for name in project.scenarios:
            print(serving_line(ws, name))
        print(f"{NAME}: serving {foundation_versions(ws).serving() or in_use(ws) or 'none (not trained yet)'}")
        return EXIT_OK
    if args.scenario == NAME:  # config validation keeps scenarios from taking this name
        store = foundation_versions(ws)
        if not store.fingerprints():
            print("foundation: no version kept yet (materialize foundation_model)")
            return EXIT_OK
        print(f"foundation: {len(store.fingerprints())} version(s) kept, serving {store.serving() or 'none'}")
        print(foundation_table(store, in_use(ws)))
        return EXIT_OK
    store = versions(ws, _scenario_named(project, args.scenario))
    print(serving_line(ws, args.scenario))
    if not store.fingerprints():
        print(f"(no version kept yet: materialize scenario/{args.scenario})")
        return EXIT_OK
    print(versions_table(store))
    return EXIT_OK


def _rollback_command(args, project) -> int:
    from habitus.assets.tracking import tracked_rollback
    from habitus.models.storage.versions import VersionError
    from habitus.resources.training.mlflow_tracking import MlflowMissing
    from habitus.resources.store.workspace import Workspace

    if args.scenario == "foundation":
        from habitus.assets.foundation_versions import rollback_foundation

        try:
            fp = rollback_foundation(Workspace(root=project.workspace), args.to, project.versions.keep,
                                     project.versions.keep_served)
        except VersionError as e:
            raise ConfigError(f"foundation: {e}") from None
        print(f"foundation: version {fp} is in checkpoints/foundation/ from now on (scenarios trained from now on "
              f"start from it; embeddings are computed with it; served scenario versions are unchanged)")
        return EXIT_OK
    name = _scenario_named(project, args.scenario)
    try:  # with `mlflow:` set, the registry's alias follows (a warning when the server fails)
        fp = tracked_rollback(project.mlflow, Workspace(root=project.workspace), name, args.to, project.versions.keep,
                              project.versions.keep_served, lambda m: print(f"warning: {m}", file=sys.stderr))
    except VersionError as e:
        from habitus.assets.serving import rollback_hint

        raise ConfigError(f"{name}: {e}" + ("" if args.to else rollback_hint(Workspace(root=project.workspace), name))
                          ) from None
    except MlflowMissing as e:
        raise ConfigError(f"{name}: {e}") from None
    print(f"{name}: version {fp} serves from now on (the next predictions carry model_fingerprint {fp})")
    return EXIT_OK


# the subcommands that take a project config: name -> (handler, takes scoring days)
PROJECT_COMMANDS = {
    "demo": (_materialize_command, True),
    "materialize": (_materialize_command, True),
    "report": (_report_command, False),
    "versions": (_versions_command, False),
    "rollback": (_rollback_command, False),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="habitus", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, scoring) in PROJECT_COMMANDS.items():
        p = sub.add_parser(name)
        _project_args(p, scoring=scoring)
        if name in ("versions", "rollback"):
            p.add_argument("scenario", nargs="?" if name == "versions" else None,
                           help="a scenario of the project, or foundation (the foundation model)"
                                + ("; none: what serves every scenario" if name == "versions" else ""))
            if name == "rollback":
                p.add_argument("--to", metavar="FINGERPRINT", help="the version to serve (a unique prefix will do; "
                               "default: the one that served before the serving one)")
            continue
        if name != "report":  # --device, --processes, ... over the project's `executor:` (pipelines/run/managed.py)
            from habitus.pipelines.run.managed import add_executor_arguments

            add_executor_arguments(p)
        if name == "demo":
            p.add_argument("--customers", type=int, default=20_000)
            p.add_argument("--regenerate", action="store_true", help="write the demo warehouse again")
    sub.add_parser("demo-data", add_help=False)
    sub.add_parser("init", add_help=False, help="suggest a project config from a connection's tables")
    from habitus.pipelines.run.managed import COMMANDS as MANAGED

    for name in MANAGED:
        sub.add_parser(name, add_help=False, help="managed-job entry point (habitus NAME --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command in MANAGED:
        from habitus.pipelines.run.managed import main as managed

        return managed(args.command, rest)
    if args.command == "demo-data":
        from habitus.pipelines.demo.data import main as demo_data

        return demo_data(rest) or 0
    if args.command == "init":
        from habitus.pipelines.init.command import main as init

        return init(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.config:  # the code location (habitus.pipelines.definitions) reads the same file
        os.environ["HABITUS_CONFIG"] = str(Path(args.config).resolve())
    try:
        from habitus.pipelines.run.managed import with_executor

        project = with_executor(load_project(args.config), args)
        return PROJECT_COMMANDS[args.command][0](args, project)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
