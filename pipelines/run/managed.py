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
/opt/ml/output/failure when /opt/ml/output exists). Exit codes as `habitus materialize`: 0 done, 1 a
blocking check failed (not beats_baselines: a losing model is not promoted, the job did not fail), 2 bad usage
or config, 3 a stage failed. docs/managed-jobs.md shows the layout.

Several machines (`nodes`): each runs `habitus train`, on its own disk: it extracts and caches the same
data, and its trainings start torchrun as one node of N (its node rank, the first host's c10d
rendezvous), so every training runs on all machines' processes together; every node keeps the
result, and only the first uploads. A job with several instances (SageMaker: $SM_HOSTS and
$SM_CURRENT_HOST, or /opt/ml/input/config/resourceconfig.json) needs no flags; elsewhere (Slurm, plain
machines) --nnodes, --node-rank and --rdzv say it. docs/clusters.md.
"""

import argparse
import os
import sys
import time
import traceback
from datetime import date
from pathlib import Path

COMMANDS = ("train", "score", "embed", "upload", "restore")
RESOURCE_CONFIG = Path("/opt/ml/input/config/resourceconfig.json")  # SageMaker's hosts of a training job
RDZV_PORT = 29400  # the first host's c10d rendezvous port on a managed job ($HABITUS_RDZV_PORT)


def add_executor_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("executor (overrides the project's `executor:`)")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--processes", type=int, help="training processes (torchrun when > 1; 0: one per GPU)")
    g.add_argument("--threads", type=int, help="CPU threads per process")
    g.add_argument("--precision", choices=("fp32", "bf16"), help="training precision")
    g.add_argument("--inference-precision", choices=("fp32", "int8", "bf16"), help="predictions and embeddings")


def with_executor(project, args):
    """The project with the executor settings given on the command line put over its `executor:`."""
    from pydantic import ValidationError

    from habitus.pipelines.config.project import ConfigError, ExecutorSettings

    given = {k: getattr(args, k, None) for k in ExecutorSettings.model_fields}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return project
    base = project.executor.model_dump() if project.executor else {"processes": 0 if project.kubernetes else 1}
    try:
        settings = ExecutorSettings(**{**base, **given})
    except ValidationError as e:
        bad = "; ".join(f"--{str(x['loc'][0]).replace('_', '-')}: {x['msg']}" for x in e.errors())
        raise ConfigError(f"executor settings on the command line: {bad}") from None
    return project.model_copy(update={"executor": settings})


def nodes(args, resource_config: Path = RESOURCE_CONFIG) -> dict | None:
    """This machine's place among the job's (nnodes, node_rank, rdzv_endpoint, rdzv_id), from
    --nnodes/--node-rank/--rdzv, else from the platform's host list and current host ($SM_HOSTS, a
    JSON list, and $SM_CURRENT_HOST; or `resource_config`); None: one machine."""
    import json

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


class Runner:
    """dg.materialize of a selection with its own asset checks, as `habitus materialize` runs them."""

    def __init__(self, project, log=print, verbose: bool = False, dagster_log: bool = True):
        from habitus.pipelines.orchestration.instance import dagster_instance
        from habitus.pipelines.orchestration.build import build_assets, build_resources

        from habitus.assets.checks import build_checks

        self.project, self.log = project, log
        self.assets, self.resources = build_assets(project), build_resources(project)
        self.checks, self.instance = build_checks(project), dagster_instance()
        self.passed, self.failed, self.timings = 0, [], {}
        # a job's log (CloudWatch and the like): the assets' own lines (epochs, uploads, warnings), not
        # Dagster's DEBUG events, unless -v; `dagster_log` False (the Python API): only this runner's lines
        level = "INFO" if dagster_log else "CRITICAL"
        self.run_config = {} if verbose else {"loggers": {"console": {"config": {"log_level": level}}}}

    def run(self, keys, what: str, **kw) -> None:
        import dagster as dg

        started, keys = time.time(), list(keys)
        self.log(f"materializing {what} ...")
        own = [c for c in self.checks if any(k.asset_key in set(keys) for k in c.check_keys)]
        result = dg.materialize([*self.assets, *own], selection=keys, resources=self.resources,
                                instance=self.instance, raise_on_error=False, run_config=self.run_config, **kw)
        for e in result.get_asset_check_evaluations():
            if e.passed:
                self.passed += 1
            else:
                self.failed.append(f"{e.asset_key.to_user_string()} {e.check_name} ({e.severity.value.lower()}): "
                                   f"{e.description or ''}".strip())
                self.log(f"  check failed: {self.failed[-1]}")
        missing = set(keys) - {e.asset_key for e in result.get_asset_materialization_events()}
        if missing:
            errors = [str(e.event_specific_data.error.message).strip() for e in result.get_step_failure_events()
                      if e.event_specific_data and getattr(e.event_specific_data, "error", None)]
            raise RuntimeError(f"materializing {', '.join(sorted(k.to_user_string() for k in missing))} failed"
                               + (f": {errors[0]}" if errors else "; see the log above"))
        self.timings[what] = round(time.time() - started, 1)
        self.log(f"  done in {self.timings[what]}s")

    def partitions(self, source):
        from habitus.assets.sources import source_key

        return next(a for a in self.assets if a.key == source_key(source.name)).partitions_def

    def extract(self, upto: str | None = None, again: bool = True) -> None:
        """Every events partition missing from the workspace (all on a fresh disk) or extracted with other
        settings (assets/sources.py `stale_partitions`: another `where:`, `columns:` or table) up to the one
        holding `upto` (default: the last), that one extracted again (its day may have grown), and the
        attribute tables, which are small and extracted whole. `again` False: the last one is extracted again
        only where its file was written before its time window closed, and with nothing to extract the
        attribute tables are kept too (a day scored from what the workspace holds)."""
        # private: dg.materialize takes one partition_key, and the range tags of a one-run range have no public name
        from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

        from habitus.assets.sources import source_key, stale_partitions

        ws, extracted = self.resources["workspace"], again
        for s in self.project.events_sources:
            pdef = self.partitions(s)
            keys = pdef.get_partition_keys()
            if upto is not None:
                keys = [k for k in keys if pdef.time_window_for_partition_key(k).start.date().isoformat() <= upto]
            if not keys:
                raise RuntimeError(f"source/{s.name}: no partition starts on or before {upto} (its first is "
                                   f"{pdef.get_first_partition_key()})")
            stale = set(stale_partitions(s, ws.sources(s.name)))
            missing = [k for k in keys if k in stale or not (ws.sources(s.name) / f"{k}.parquet").exists()]
            if not again and not missing and _closed_when_written(pdef, keys[-1], ws.sources(s.name)):
                continue
            extracted = True
            first = missing[0] if missing else keys[-1]
            span = keys[keys.index(first):]
            self.run([source_key(s.name)], f"source/{s.name} ({len(span)} partitions, {span[0]} .. {span[-1]})",
                     tags={ASSET_PARTITION_RANGE_START_TAG: span[0], ASSET_PARTITION_RANGE_END_TAG: span[-1]})
        others = [source_key(s.name) for s in self.project.sources if s.role != "events"]
        if others and extracted:
            self.run(others, "the attribute tables")
        elif not extracted:
            self.log("the sources are extracted up to that day already")


def _closed_when_written(pdef, key: str, folder: Path) -> bool:
    """Whether partition `key`'s file was written after its time window ended: nothing newer to extract."""
    end = pdef.time_window_for_partition_key(key).end.timestamp()
    return (folder / f"{key}.parquet").stat().st_mtime > end


def _restore_if_missing(project, log) -> None:
    """A fresh disk of a job that starts from trained checkpoints: bring them back from `output:`."""
    from habitus.resources.store.manifests import shown_url
    from habitus.resources.store.workspace import Workspace

    ws = Workspace(root=project.workspace, output=project.output, output_pins=project.output_pins)
    if (ws.foundation / "config.json").exists():
        return
    if not project.output:
        raise RuntimeError(f"no foundation checkpoint in the workspace {project.workspace} and no `output:` to "
                           f"restore one from; run `habitus train` first")
    log(f"no checkpoints in {project.workspace}: restoring them from {shown_url(project.output)}")
    ws.restore(log=log)


def train(project, stage: str = "all", log=print, verbose: bool = False, cluster: dict | None = None) -> dict:
    """The training stages; `cluster` (`nodes`): this machine is one of several that train together."""
    import dagster as dg

    from habitus.assets.scenarios import scenario_key

    if stage == "scenarios":  # (every node restores from `output:`, which only the first writes to)
        _restore_if_missing(project, log)
    if cluster is not None and cluster["node_rank"] > 0:  # the first node uploads; the others keep their copy
        log(f"node {cluster['node_rank']} of {cluster['nnodes']}: training with the others at "
            f"{cluster['rdzv_endpoint']}; the first node uploads")
        project = project.model_copy(update={"output": None})
    r = Runner(project, log, verbose)
    if cluster is not None:
        from habitus.resources.training.executor import TrainingExecutor

        settings = project.executor.model_dump() if project.executor else {"processes": 0 if project.kubernetes else 1}
        r.resources["executor"] = TrainingExecutor(**settings, **cluster,
                                                   job_dir=str(Path(project.workspace) / "jobs"))
    r.extract()
    keys = [dg.AssetKey("cache")] + ([dg.AssetKey("foundation_model")] if stage in ("foundation", "all") else [])
    keys += [scenario_key(n) for n in project.scenarios] if stage in ("scenarios", "all") else []
    r.run(keys, {"foundation": "cache and foundation model", "scenarios": "cache and scenarios",
                 "all": "cache, foundation model and scenarios"}[stage])
    return {"timings": r.timings, "checks_passed": r.passed, "checks_failed": r.failed, "prediction_day": None}


def score(project, day: str, *, embeddings: bool = False, predictions: bool = True, log=print,
          verbose: bool = False, scenarios: list[str] | None = None, dagster_log: bool = True,
          extract_again: bool = True) -> dict:
    """Day `day`'s predictions (of `scenarios`, default every prediction scenario) and/or embeddings, after
    the sources up to that day and the cache (Runner.extract's `again`: `extract_again`)."""
    import dagster as dg

    from habitus.assets.predictions import predictions_key
    from habitus.pipelines.orchestration.partitions import predictions_partitions

    pdef = predictions_partitions(project)
    if not pdef.has_partition_key(day):
        first = pdef.get_first_partition_key()
        raise RuntimeError(f"--date {day}: not a day of the predictions' partitions (from {first}, "
                           f"`predictions.start`, to the data's end or today)")
    _restore_if_missing(project, log)
    r = Runner(project, log, verbose, dagster_log)
    r.extract(upto=day, again=extract_again)
    r.run([dg.AssetKey("cache")], "cache")
    keys = [predictions_key(n) for n in scenarios or project.prediction_scenarios] if predictions else []
    keys += [dg.AssetKey("embeddings")] if embeddings else []
    r.run(keys, f"{'predictions' if predictions else 'embeddings'} for {day}", partition_key=day)
    return {"timings": r.timings, "checks_passed": r.passed, "checks_failed": r.failed, "prediction_day": day}


def upload(project, log=print) -> dict:
    """Every stage the workspace holds, to `output:` (what the manifests already name is skipped)."""
    from habitus.resources.store.workspace import Workspace

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
    from habitus.pipelines.run.report import report
    from habitus.pipelines.config.project import ConfigError, load_project
    from habitus.resources.store.manifests import shown_url

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
        if command == "train":
            result = train(project, args.stage, verbose=args.verbose, cluster=cluster)
        elif command in ("score", "embed"):
            result = score(project, args.date, embeddings=command == "embed", predictions=command == "score",
                           verbose=args.verbose)
        elif command == "upload":
            done = upload(project)
            print(f"uploaded to {shown_url(project.output)}: " + ", ".join(
                f"{s} {r['uploaded']} sent / {r['skipped']} already there" for s, r in done.items()))
            return 0
        else:
            from habitus.resources.store.output import Output
            from habitus.resources.store.workspace import Workspace

            source = str(Path(args.source).resolve()) if args.source and "://" not in args.source else args.source
            ws = Workspace(root=project.workspace, output=source or project.output, output_pins=project.output_pins)
            done = ws.restore(Output(ws.output).stages() if args.all and ws.output else None)
            print(f"restored {', '.join(done)} from {shown_url(ws.output)} into {project.workspace}")
            return 0
    except Exception as e:  # noqa: BLE001 (a managed job reports any failure through its failure file)
        _fail(f"habitus {command} failed: {type(e).__name__}: {e}", traceback.format_exc())
        return 3
    print(f"\nhabitus {command} finished in {time.time() - started:.0f}s; asset checks: {result['checks_passed']} "
          f"passed, {len(result['checks_failed'])} failed\n")
    print(report(project, result["prediction_day"]))
    # as in `habitus materialize`: error checks fail the job; beats_baselines is a warning (the baseline serves)
    blocking = [f for f in result["checks_failed"] if "(error)" in f]
    if blocking:
        _fail(f"habitus {command}: {len(blocking)} blocking check(s) failed: " + "; ".join(blocking), "")
        return 1
    return 0


def _fail(reason: str, trace: str) -> None:
    print(f"error: {reason}", file=sys.stderr)
    where = failure_file()
    if where is not None:
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(reason[:1000] + ("\n\n" + trace[-2000:] if trace else "") + "\n")
        print(f"(written to the failure file {where})", file=sys.stderr)
