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
import os
import sys
import time
import warnings
from pathlib import Path

from habitus.pipelines.config.file import ConfigError
from habitus.pipelines.config.operations import add_executor_arguments, with_executor
from habitus.pipelines.config.project import load_project
from habitus.pipelines.run.managed import COMMANDS as MANAGED
from habitus.pipelines.run.managed import main as managed
from habitus.pipelines.run.progress import RichDisplay
from habitus.pipelines.run.report import failed_checks_table, report

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_STAGE_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _project_args(p: argparse.ArgumentParser, *, scoring: bool = False) -> None:
    p.add_argument("--config", help="project YAML (default: $HABITUS_CONFIG or examples/demo.yaml)")
    p.add_argument("-v", "--verbose", action="store_true", help="Dagster's full log instead of the progress display")
    if scoring:
        p.add_argument("--date", metavar="D", help="score day D (YYYY-MM-DD) as of its end, D+1 00:00 UTC; "
                       "default: the newest day of the data")
        p.add_argument("--from", dest="date_from", metavar="D1", help="score every day from D1 ... (with --to)")
        p.add_argument("--to", dest="date_to", metavar="D2", help="... to D2, inclusive (a backfill)")


def _materialize_command(args, project) -> int:
    """demo and materialize: every asset (pipelines/run/runner.py), then the report, the failed checks and
    the exit code."""
    # the runner loads dagster and the assets: the other commands and `--help` stay quick without them
    from habitus.pipelines.run.runner import StageFailed, blocking_failures, materialize_all, scoring_days

    days = scoring_days(project, args.date, args.date_from, args.date_to)  # a bad day fails before any work
    if args.command == "demo":
        from habitus.pipelines.demo.data import generate_demo_warehouse  # numpy and duckdb: demo only

        path = Path(project.connections["warehouse"].path)
        if args.regenerate or not path.exists():
            started = time.time()
            counts = generate_demo_warehouse(path, customers=args.customers)
            print(f"demo warehouse {path}: {counts} in {time.time() - started:.1f}s")
    display = None
    if not args.verbose:
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
    failures, blocking = result["failures"], blocking_failures(result)
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
        if name != "report":  # --device, --processes, ... over the project's `executor:`
            add_executor_arguments(p)
        if name == "demo":
            p.add_argument("--customers", type=int, default=20_000)
            p.add_argument("--regenerate", action="store_true", help="write the demo warehouse again")
    sub.add_parser("demo-data", add_help=False)
    sub.add_parser("init", add_help=False, help="suggest a project config from a connection's tables")
    for name in MANAGED:
        sub.add_parser(name, add_help=False, help="managed-job entry point (habitus NAME --help)")
    args, rest = parser.parse_known_args(argv)
    if args.command in MANAGED:
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
