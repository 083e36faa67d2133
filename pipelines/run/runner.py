"""The runner: every way in (`habitus materialize` and `demo`, `habitus.Project`, the managed jobs
`habitus train` / `score` / `embed`) materializes assets through it.

`Runner.run` materializes one selection of assets in one Dagster run (dg.materialize in this process,
$DAGSTER_HOME's instance when it is set, else an ephemeral one) with the asset checks of those assets,
and a range of partitions in one run (the range tags Dagster's single-run backfills set). Its stop rules:

- an asset that raises stops everything: StageFailed, with the asset and its own message (the CLI's
  exit code 3); Ctrl-C, which reaches a run as a failed step, is KeyboardInterrupt (exit code 130);
- a blocking check that fails with ERROR leaves out what depends on it in the same run (Dagster's rule)
  and the stages after it (`run` returns why); one on a scenario only stops that scenario: the others,
  and the scoring of every scenario from its serving version, go on (`only_scenarios_blocked`);
- a check that fails with WARN, or with ERROR but not blocking, is listed and stops nothing; a run
  with a failed blocking ERROR check ends with exit code 1 (`blocking_failures`), else 0.

The plans, stage by stage: `materialize_all` (every asset, then the days to score, a month of days
per run), `materialize_selected` (assets named as the UI names them), `train` and `score` (the managed
jobs' stages). Each returns the same summary (`Runner.summary`).
"""

import logging
import os
import re
import time
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
# private: dg.materialize takes one partition_key, and Dagster exports no name for the range tags that make one
# run of a partition range (its single-run backfills set them the same way)
from dagster._core.storage.tags import ASSET_PARTITION_RANGE_END_TAG, ASSET_PARTITION_RANGE_START_TAG

from habitus.assets.cache import current_cache
from habitus.assets.checks import build_checks
from habitus.assets.predictions import predictions_key
from habitus.assets.scenarios import scenario_key
from habitus.assets.sources import source_key, stale_partitions
from habitus.pipelines.config.file import ConfigError
from habitus.pipelines.config.operations import executor_settings
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.pipelines.orchestration.instance import dagster_instance
from habitus.pipelines.orchestration.partitions import predictions_partitions
from habitus.pipelines.run.progress import STAGE_TAG, PlainDisplay
from habitus.pipelines.run.report import failure_line
from habitus.resources.store.redaction import redact_url
from habitus.resources.store.workspace import Workspace
from habitus.resources.training.executor import TrainingExecutor

MAX_PARTITIONS_PER_RUN = 31  # the scoring assets' backfill policy: a month of days per run


class StageFailed(RuntimeError):
    """An asset raised: the run of a stage failed (the CLI's exit code 3)."""


class Stopped(RuntimeError):
    """A stage left assets out (a blocking check failed upstream) where the caller needs all of them."""


def is_blocking(failure: dict) -> bool:
    """A failed check that stops what depends on it and fails the run (exit code 1)."""
    return failure["blocking"] and failure["severity"] == "error"


def only_scenarios_blocked(failures: list[dict]) -> bool:
    """Whether every blocking failure is a scenario's: the other scenarios and the scoring go on."""
    return all(f["asset"].startswith("scenario/") for f in failures if is_blocking(f))


def blocking_failures(summary: dict) -> list[dict]:
    """The failed checks that fail the run (exit code 1 of `habitus materialize` and the managed jobs)."""
    return [f for f in summary["failures"] if is_blocking(f)]


class Runner:
    """dg.materialize of one selection at a time, with its own asset checks, keeping the tally of a whole
    plan: checks passed and failed, timings per stage, the WARNING lines the assets logged.

    `display`: where stages show (pipelines/run/progress.py; default lines through `log`). `verbose`:
    Dagster's own log, and each failed check as it comes; else Dagster's log shows nothing but, with
    `job_log` (a managed job's log, CloudWatch and the like), the assets' own INFO lines, with each
    failed check as it comes."""

    def __init__(self, project, *, log=print, display=None, verbose: bool = False, job_log: bool = False):
        self.project, self.display = project, display or PlainDisplay(log)
        self.assets, self.resources = build_assets(project), build_resources(project)
        self.checks, self.instance = build_checks(project), dagster_instance()
        self.steps = {a.node_def.name: a.key.to_user_string() for a in self.assets}
        self.passed, self.failures, self.warnings, self.timings = 0, [], [], {}
        self.inline = verbose or job_log
        level = "INFO" if job_log else "CRITICAL"
        self.run_config = {} if verbose else {"loggers": {"console": {"config": {"log_level": level}}}}
        self.session = f"{os.getpid()}-{time.time_ns()}"

    def run(self, keys, what: str, total: int | None = None, *, partition_key: str | None = None,
            partition_range: tuple[str, str] | None = None) -> str | None:
        """Materialize `keys` (with one partition, or a range of partitions in one run); returns why the
        stages after it should not run (an asset left out, or a blocking check failed), else None."""
        missing, blocked = self._materialize(keys, what, total, partition_key, partition_range)
        return _left_out(what, missing, blocked) if missing or blocked else None

    def require(self, keys, what: str, total: int | None = None, *, partition_key: str | None = None,
                partition_range: tuple[str, str] | None = None) -> None:
        """`run`, for a caller that cannot go on without every asset of `keys`: Stopped when one was left
        out (a blocking check that failed on an asset that was written stops nothing here)."""
        missing, blocked = self._materialize(keys, what, total, partition_key, partition_range)
        if missing:
            raise Stopped(_left_out(what, missing, blocked))

    def _materialize(self, keys, what, total, partition_key, partition_range) -> tuple[set, list[dict]]:
        """One Dagster run: the assets left out, and the failed blocking checks."""
        started, keys = time.time(), list(keys)
        own = [c for c in self.checks if any(k.asset_key in set(keys) for k in c.check_keys)]
        tag = f"{self.session}-{len(self.timings)}"
        tags = {STAGE_TAG: tag}
        if partition_range is not None:
            tags.update({ASSET_PARTITION_RANGE_START_TAG: partition_range[0],
                         ASSET_PARTITION_RANGE_END_TAG: partition_range[1]})
        with self.display.stage(what, self.instance, tag, self.steps, total):
            result = dg.materialize([*self.assets, *own], selection=keys, resources=self.resources,
                                    instance=self.instance, raise_on_error=False, run_config=self.run_config,
                                    tags=tags, partition_key=partition_key)
            blocked = self._tally(result)
            # a failed blocking check fails its step (Dagster) but its asset was written: a missing
            # materialization is what a blocking check upstream left out
            missing = set(keys) - {e.asset_key for e in result.get_asset_materialization_events()}
        self.timings[what] = round(time.time() - started, 1)
        return missing, blocked

    def _tally(self, result) -> list[dict]:
        """Count the run's check results and warnings; raise for a step that failed. The failed blocking checks."""
        blocked = []
        for e in result.get_asset_check_evaluations():
            if e.passed:
                self.passed += 1
                continue
            f = {"asset": e.asset_key.to_user_string(), "check": e.check_name, "severity": e.severity.value.lower(),
                 "blocking": bool(e.blocking), "reason": (e.description or "").strip()}
            self.failures.append(f)
            blocked += [f] if is_blocking(f) else []
            if self.inline:
                self.display.line(f"  check failed: {failure_line(f)}")
        for entry in self.instance.all_logs(result.run_id):
            if entry.dagster_event is None and entry.level >= logging.WARNING and entry.user_message:
                line = f"{self.steps.get(entry.step_key, entry.step_key or 'run')}: {entry.user_message}"
                if line not in self.warnings:
                    self.warnings.append(line)
        failed = [ev for ev in result.all_events if ev.event_type_value == "STEP_FAILURE"]
        if any("DagsterExecutionInterruptedError" in _error_class(ev) for ev in failed):
            raise KeyboardInterrupt  # Ctrl-C reaches the run as a step failure: exit code 130, not 3
        errors = [f"{self.steps.get(ev.step_key, ev.step_key)}: {_error_text(ev)}" for ev in failed
                  if "DagsterAssetCheckFailedError" not in _error_class(ev)]
        if errors:
            raise StageFailed("; ".join(errors))
        return blocked

    def summary(self, prediction_days: list[str] | None = None, stopped: str | None = None) -> dict:
        """timings (seconds per stage), prediction_day(s), checks_passed, checks_failed ("<asset> <check>
        (<severity>): <reason>"), failures (the same as dicts), warnings (WARNING lines the assets
        logged), stopped (why a stage did not run, or None)."""
        days = list(prediction_days or [])
        return {"timings": self.timings, "prediction_day": days[-1] if days else None, "prediction_days": days,
                "checks_passed": self.passed, "checks_failed": [failure_line(f) for f in self.failures],
                "failures": self.failures, "warnings": self.warnings, "stopped": stopped}

    def partitions(self, source):
        return next(a for a in self.assets if a.key == source_key(source.name)).partitions_def

    def extract(self, upto: str | None = None, again: bool = True) -> None:
        """Every events partition missing from the workspace (all on a fresh disk) or extracted with other
        settings (assets/sources.py `stale_partitions`: another `where:`, `columns:` or table) up to the one
        holding `upto` (default: the last), that one extracted again (its day may have grown), and the
        attribute tables, which are small and extracted whole. `again` False: the last one is extracted again
        only where its file was written before its time window closed, and with nothing to extract the
        attribute tables are kept too (a day scored from what the workspace holds)."""
        ws, extracted = self.resources["workspace"], again
        for s in self.project.events_sources:
            pdef = self.partitions(s)
            keys = pdef.get_partition_keys()
            if upto is not None:
                keys = [k for k in keys if pdef.time_window_for_partition_key(k).start.date().isoformat() <= upto]
            if not keys:
                raise StageFailed(f"source/{s.name}: no partition starts on or before {upto} (its first is "
                                  f"{pdef.get_first_partition_key()})")
            stale = set(stale_partitions(s, ws.sources(s.name)))
            missing = [k for k in keys if k in stale or not (ws.sources(s.name) / f"{k}.parquet").exists()]
            if not again and not missing and _closed_when_written(pdef, keys[-1], ws.sources(s.name)):
                continue
            extracted = True
            span = keys[keys.index(missing[0] if missing else keys[-1]):]
            self.require([source_key(s.name)], f"source/{s.name} ({len(span)} partitions, {span[0]} .. {span[-1]})",
                         total=len(span), partition_range=(span[0], span[-1]))
        others = [source_key(s.name) for s in self.project.sources if s.role != "events"]
        if others and extracted:
            self.require(others, "the attribute tables")
        elif not extracted:
            self.display.line("the sources are extracted up to that day already")


def materialize_all(project, *, log=print, days: list[str] | None = None, display=None, verbose: bool = True) -> dict:
    """Extract every partition, build the cache, train, fine-tune, and score the newest day (or `days`),
    running the asset checks of each stage with it (as the jobs do in the UI). The summary's `stopped`
    says why a stage did not run (a blocking check failed before it)."""
    r = Runner(project, log=log, display=display, verbose=verbose)
    for s in project.events_sources:
        keys = r.partitions(s).get_partition_keys()
        stopped = r.run([source_key(s.name)], f"source/{s.name} ({len(keys)} partitions)", total=len(keys),
                        partition_range=(keys[0], keys[-1]))
        if stopped:
            return r.summary([], stopped)
    unpartitioned = [source_key(s.name) for s in project.sources if s.role != "events"]
    unpartitioned += [dg.AssetKey("cache"), dg.AssetKey("foundation_model")]
    unpartitioned += [scenario_key(n) for n in project.scenarios]
    stopped = r.run(unpartitioned, "cache, foundation model and scenarios")
    if stopped and not only_scenarios_blocked(r.failures):
        return r.summary([], stopped)
    # a scenario that loses to a baseline still scores from its serving version
    newest = datetime.fromtimestamp(current_cache(r.resources["workspace"]).time_range[1], timezone.utc)
    newest = newest.date().isoformat()
    days = list(days or [newest])
    late = [d for d in days if d > newest]
    if late:
        r.warnings.append(f"scoring {late[0]}{' .. ' + late[-1] if len(late) > 1 else ''}: after the newest event "
                          f"in the data ({newest}); those days score as of their end with no newer events (extract "
                          f"newer partitions for fresh scores)")
    selection = [predictions_key(n) for n in project.prediction_scenarios] + [dg.AssetKey("embeddings")]
    selection += [dg.AssetKey(["explanations", n]) for n, sc in project.scenarios.items() if sc.explain]
    for i in range(0, len(days), MAX_PARTITIONS_PER_RUN):
        chunk = days[i:i + MAX_PARTITIONS_PER_RUN]
        what = f"predictions and embeddings for {chunk[0]}" + (f" .. {chunk[-1]}" if len(chunk) > 1 else "")
        stopped = r.run(selection, what, total=len(chunk) * len(project.prediction_scenarios) or None,
                        **({"partition_key": chunk[0]} if len(chunk) == 1 else {"partition_range": (chunk[0], chunk[-1])}))
        if stopped:
            break
    return r.summary(days, stopped)


def materialize_selected(project, names: list[str], days: list[str], *, log=print, verbose: bool = False) -> dict:
    """Assets named as the UI writes them ("cache", "scenario/churn", "predictions/churn", "source/purchases"),
    run from what the workspace holds: an events source extracts what `Runner.extract` does; the daily
    assets run once per day of `days`. ConfigError for an unknown asset or daily assets without days."""
    r = Runner(project, log=log, verbose=verbose)
    by_name = {a.key.to_user_string(): a for a in r.assets}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"no asset named {', '.join(map(repr, unknown))} in project {project.workspace}; "
                          f"the assets are: {', '.join(by_name)}")
    events = {f"source/{s.name}" for s in project.events_sources}
    daily = [n for n in names if n not in events and by_name[n].partitions_def is not None]
    if daily and not days:
        raise ConfigError(f"{', '.join(daily)}: daily assets; give the days to score, e.g. days=['YYYY-MM-DD']")
    if events & set(names):
        r.extract()
    plain = [n for n in names if n not in events and n not in daily]
    if plain:
        r.require([dg.AssetKey.from_user_string(n) for n in plain], ", ".join(plain))
    for day in days if daily else ():
        r.require([dg.AssetKey.from_user_string(n) for n in daily], f"{', '.join(daily)} for {day}", partition_key=day)
    return r.summary(days if daily else [])


def train(project, stage: str = "all", log=print, verbose: bool = False, cluster: dict | None = None) -> dict:
    """The training stages (`habitus train`): the sources, the cache, then the foundation model and/or the
    scenarios. `cluster` (`nodes`): this machine is one of several that train together; the first
    uploads to `output:`, the others keep their copy."""
    if stage == "scenarios":  # (every node restores from `output:`, which only the first writes to)
        restore_if_missing(project, log)
    if cluster is not None and cluster["node_rank"] > 0:
        log(f"node {cluster['node_rank']} of {cluster['nnodes']}: training with the others at "
            f"{cluster['rdzv_endpoint']}; the first node uploads")
        project = project.model_copy(update={"output": None})
    r = Runner(project, log=log, verbose=verbose, job_log=True)
    if cluster is not None:
        r.resources["executor"] = TrainingExecutor(**executor_settings(project), **cluster,
                                                   job_dir=str(Path(project.workspace) / "jobs"))
    r.extract()
    keys = [dg.AssetKey("cache")] + ([dg.AssetKey("foundation_model")] if stage in ("foundation", "all") else [])
    keys += [scenario_key(n) for n in project.scenarios] if stage in ("scenarios", "all") else []
    r.require(keys, {"foundation": "cache and foundation model", "scenarios": "cache and scenarios",
                     "all": "cache, foundation model and scenarios"}[stage])
    return r.summary()


def score(project, day: str, *, embeddings: bool = False, predictions: bool = True, log=print,
          verbose: bool = False, scenarios: list[str] | None = None, job_log: bool = True,
          extract_again: bool = True) -> dict:
    """Day `day`'s predictions (of `scenarios`, default every prediction scenario) and/or embeddings, after
    the sources up to that day and the cache (Runner.extract's `again`: `extract_again`)."""
    pdef = predictions_partitions(project)
    if not pdef.has_partition_key(day):
        raise RuntimeError(f"--date {day}: not a day of the predictions' partitions (from "
                          f"{pdef.get_first_partition_key()}, `predictions.start`, to the data's end or today)")
    restore_if_missing(project, log)
    r = Runner(project, log=log, verbose=verbose, job_log=job_log)
    r.extract(upto=day, again=extract_again)
    r.require([dg.AssetKey("cache")], "cache")
    keys = [predictions_key(n) for n in scenarios or project.prediction_scenarios] if predictions else []
    keys += [dg.AssetKey("embeddings")] if embeddings else []
    r.require(keys, f"{'predictions' if predictions else 'embeddings'} for {day}", partition_key=day)
    return r.summary([day])


def restore_if_missing(project, log) -> None:
    """A fresh disk of a job that starts from trained checkpoints: bring them back from `output:`."""
    ws = Workspace(root=project.workspace, output=project.output, output_pins=project.output_pins)
    if (ws.foundation / "config.json").exists():
        return
    if not project.output:
        raise RuntimeError(f"no foundation checkpoint in the workspace {project.workspace} and no `output:` to "
                          f"restore one from; run `habitus train` first")
    log(f"no checkpoints in {project.workspace}: restoring them from {redact_url(project.output)}")
    ws.restore(log=log)


def scoring_days(project, day: str | None = None, first: str | None = None, last: str | None = None) -> list[str]:
    """The days asked for (--date, or --from/--to inclusive), checked against the predictions'
    daily partitions: a day before `predictions.start` or after the events' `end` is a usage error
    that names the setting. [] means the newest day of the data (decided once the cache exists)."""
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


def _left_out(what: str, missing: set, blocked: list[dict]) -> str:
    names = ", ".join(sorted(k.to_user_string() for k in missing)) or "nothing"
    return f"{what}: not materialized: {names}" + (f" (blocking check(s) failed: "
           f"{', '.join(b['asset'] + ' ' + b['check'] for b in blocked)})" if blocked else "")


def _closed_when_written(pdef, key: str, folder: Path) -> bool:
    """Whether partition `key`'s file was written after its time window ended: nothing newer to extract."""
    end = pdef.time_window_for_partition_key(key).end.timestamp()
    return (folder / f"{key}.parquet").stat().st_mtime > end


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
