"""Entry points for managed training jobs (SageMaker and similar), no Dagster instance needed.

    habitus train [--stage foundation|scenarios|all]   sources, cache, then the training assets
                  [--nnodes N --node-rank R --rdzv HOST:PORT]   one of N machines training together
    habitus score --date D                              the day's predictions (sources and cache first)
    habitus embed --date D                              the day's embeddings (sources and cache first)
    habitus upload                                      every finished stage to `output:` (nothing twice)
    habitus restore [--all]                             checkpoints (and their cache) back from `output:`

Each runs the same assets, with their asset checks, as the Dagster graph (dg.materialize in this
process, an ephemeral instance unless $DAGSTER_HOME is set) and prints the report `habitus demo` prints.
Executor settings come from the project's `executor:` and may be overridden here (--device,
--processes, --threads, --precision, --inference-precision). A job that fails writes its reason to
the failure file of the managed-job layout ($HABITUS_FAILURE_FILE, else $SM_OUTPUT_DIR/failure, else
/opt/ml/output/failure when /opt/ml/output exists). The stages are the runner's (pipelines/run/runner.py
`train` and `score`), with its stop rules and exit codes, as `habitus materialize`: 0 done, 1 a blocking
check failed with ERROR (not beats_baselines: a losing model is not promoted, the job did not fail), 2 bad
usage or config, 3 a stage failed, 130 interrupted. docs/managed-jobs.md shows the layout.

Several machines (`nodes`): each runs `habitus train`, on its own disk: it extracts and caches the same
data, and its trainings start torchrun as one node of N (its node rank, the first host's c10d
rendezvous), so every training runs on all machines' processes together; every node keeps the
result, and only the first uploads. A job with several instances (SageMaker: $SM_HOSTS and
$SM_CURRENT_HOST, or /opt/ml/input/config/resourceconfig.json) needs no flags; elsewhere (Slurm, plain
machines) --nnodes, --node-rank and --rdzv say it. docs/clusters.md.
"""

import argparse
import json
import os
import sys
import time
import traceback
from datetime import date
from pathlib import Path

from habitus.pipelines.config.file import ConfigError
from habitus.pipelines.config.operations import add_executor_arguments, with_executor
from habitus.pipelines.config.project import load_project
from habitus.pipelines.run.report import failure_line, report
from habitus.resources.store.redaction import redact_url
from habitus.resources.store.output import Output

COMMANDS = ("train", "score", "embed", "upload", "restore")
RESOURCE_CONFIG = Path("/opt/ml/input/config/resourceconfig.json")  # SageMaker's hosts of a training job
RDZV_PORT = 29400  # the first host's c10d rendezvous port on a managed job ($HABITUS_RDZV_PORT)


def nodes(args, resource_config: Path = RESOURCE_CONFIG) -> dict | None:
    """This machine's place among the job's (nnodes, node_rank, rdzv_endpoint, rdzv_id), from
    --nnodes/--node-rank/--rdzv, else from the platform's host list and current host ($SM_HOSTS, a
    JSON list, and $SM_CURRENT_HOST; or `resource_config`); None: one machine."""
    given = [getattr(args, k, None) for k in ("nnodes", "node_rank", "rdzv")]
    run_id = os.environ.get("TRAINING_JOB_NAME") or os.environ.get("SLURM_JOB_ID") or "habitus"
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise ValueError("several machines need all of --nnodes, --node-rank and --rdzv HOST:PORT (the first "
                             "node's address and a free port, the same on every node)")
        n, rank, rdzv = given
        if not 0 <= rank < n:
            raise ValueError(f"--node-rank {rank} is not one of 0..{n - 1} (--nnodes {n})")
        return None if n == 1 else {"nnodes": n, "node_rank": rank, "rdzv_endpoint": rdzv, "rdzv_id": run_id}
    if os.environ.get("SM_HOSTS"):
        hosts, current, where = json.loads(os.environ["SM_HOSTS"]), os.environ.get("SM_CURRENT_HOST"), "$SM_HOSTS"
    elif resource_config.exists():
        config = json.loads(resource_config.read_text())
        hosts, current, where = config.get("hosts", []), config.get("current_host"), str(resource_config)
    else:
        return None
    if len(hosts) <= 1:
        return None
    if current not in hosts:
        raise ValueError(f"the current host {current!r} is not one of the job's hosts {hosts} ({where})")
    port = os.environ.get("HABITUS_RDZV_PORT", str(RDZV_PORT))
    return {"nnodes": len(hosts), "node_rank": hosts.index(current), "rdzv_endpoint": f"{hosts[0]}:{port}",
            "rdzv_id": run_id}


def failure_file() -> Path | None:
    """Where a managed job writes why it failed (SageMaker reads /opt/ml/output/failure)."""
    if os.environ.get("HABITUS_FAILURE_FILE"):
        return Path(os.environ["HABITUS_FAILURE_FILE"])
    if os.environ.get("SM_OUTPUT_DIR"):
        return Path(os.environ["SM_OUTPUT_DIR"]) / "failure"
    return Path("/opt/ml/output/failure") if Path("/opt/ml/output").is_dir() else None


def upload(project, log=print) -> dict:
    """Every stage the workspace holds, to `output:` (what the manifests already name is skipped)."""
    from habitus.resources.store.workspace import Workspace  # imports dagster: `habitus --help` stays quick

    if not project.output:
        raise RuntimeError("habitus upload needs `output:` in the project config")
    ws = Workspace(root=project.workspace, output=project.output)
    stages = ["foundation"] + [f"scenario/{n}" for n in project.scenarios]
    stages += [f"predictions/{n}" for n in project.prediction_scenarios] + ["embeddings"]
    done = {}
    for stage in stages:
        with ws.lock(stage, log=log, what="habitus upload"):
            result = ws.upload_stage(stage, log=log)
        if result is not None:
            done[stage] = result
    return done


def _day(text: str) -> str:
    try:
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a day as YYYY-MM-DD, got {text!r}") from None


def main(command: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"habitus {command}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="project YAML (default: $HABITUS_CONFIG or examples/demo.yaml)")
    if command == "train":
        p.add_argument("--stage", choices=("foundation", "scenarios", "all"), default="all")
    if command in ("score", "embed"):
        p.add_argument("--date", type=_day, required=True, help="the day to score, YYYY-MM-DD (as of its end)")
    if command == "restore":
        p.add_argument("--all", action="store_true", help="predictions and embeddings too, not only checkpoints")
        p.add_argument("--from", dest="source", help="where to restore from (default: `output:`), e.g. the model "
                                                     "channel of a scoring job: $SM_CHANNEL_MODEL")
    if command == "train":
        g = p.add_argument_group("several machines (default: $SM_HOSTS / $SM_CURRENT_HOST of a managed job, else one)")
        g.add_argument("--nnodes", type=int, help="how many machines train together")
        g.add_argument("--node-rank", type=int, help="this machine's place, 0..nnodes-1 (0 uploads)")
        g.add_argument("--rdzv", help="HOST:PORT of the first machine's rendezvous, the same on every machine")
    if command in ("train", "score", "embed"):
        p.add_argument("-v", "--verbose", action="store_true", help="Dagster's DEBUG log as well")
        add_executor_arguments(p)
    args = p.parse_args(argv)
    if args.config:  # the code location (habitus.pipelines.definitions) reads the same file
        os.environ["HABITUS_CONFIG"] = str(Path(args.config).resolve())
    try:
        project = with_executor(load_project(args.config), args)
        cluster = nodes(args) if command == "train" else None
    except (ConfigError, ValueError) as e:
        _fail(str(e), "")
        return 2
    started = time.time()
    try:
        # the runner loads dagster and the assets: `habitus --help` and `habitus upload` stay quick without them
        from habitus.pipelines.run.runner import blocking_failures, score, train

        if command == "train":
            result = train(project, args.stage, verbose=args.verbose, cluster=cluster)
        elif command in ("score", "embed"):
            result = score(project, args.date, embeddings=command == "embed", predictions=command == "score",
                           verbose=args.verbose)
        elif command == "upload":
            done = upload(project)
            print(f"uploaded to {redact_url(project.output)}: " + ", ".join(
                f"{s} {r['uploaded']} sent / {r['skipped']} already there" for s, r in done.items()))
            return 0
        else:
            from habitus.resources.store.workspace import Workspace  # imports dagster

            source = str(Path(args.source).resolve()) if args.source and "://" not in args.source else args.source
            ws = Workspace(root=project.workspace, output=source or project.output, output_pins=project.output_pins)
            done = ws.restore(Output(ws.output).stages() if args.all and ws.output else None)
            print(f"restored {', '.join(done)} from {redact_url(ws.output)} into {project.workspace}")
            return 0
    except KeyboardInterrupt:
        _fail(f"habitus {command}: interrupted", "")
        return 130
    except Exception as e:  # noqa: BLE001 (a managed job reports any failure through its failure file)
        _fail(f"habitus {command} failed: {type(e).__name__}: {e}", traceback.format_exc())
        return 3
    print(f"\nhabitus {command} finished in {time.time() - started:.0f}s; asset checks: {result['checks_passed']} "
          f"passed, {len(result['checks_failed'])} failed\n")
    print(report(project, result["prediction_day"]))
    blocking = blocking_failures(result)  # as in `habitus materialize`: a blocking ERROR check fails the job
    if blocking:
        _fail(f"habitus {command}: {len(blocking)} blocking check(s) failed: "
              + "; ".join(map(failure_line, blocking)), "")
        return 1
    return 0


def _fail(reason: str, trace: str) -> None:
    print(f"error: {reason}", file=sys.stderr)
    where = failure_file()
    if where is not None:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(reason[:1000] + ("\n\n" + trace[-2000:] if trace else "") + "\n")
        print(f"(written to the failure file {where})", file=sys.stderr)
