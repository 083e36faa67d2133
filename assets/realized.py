"""realized/<name>: a scenario's quality as it actually served, one daily partition per scored day.

Partition D reads what predictions/<name> wrote for D (its scores and the `model_fingerprint` of the
version that scored them) and, once the cache holds every day of the scenario's target window after D
(its newest event day is D + window or later), scores them against the targets that window realized,
next to the task's baselines as of the end of D on the same entities (models/evaluate/realized.py).
Before that the partition is not materialized (the run succeeds, saying when it can be), and the
sensor `realized_after_cache` (pipelines/orchestration/monitoring.py) requests exactly the days whose window the
newest cache completes. It writes <workspace>/realized/<name>/<D>.json and float metadata that the UI
plots over the partitions: realized_<metric>, baseline_<name>, holdout_<metric>.

Label and ranking scenarios (multilabel, multiclass, recommendation) write top-k lists, not a score of
every label: their written lists are scored against the labels the window realized, by the task's list
metrics (models/tasks: NDCG@k and HR@k of next items, precision@k of propensity labels, accuracy of the
next category's top class), next to the hold-out's history baselines as top-k lists as of the day. The
hold-out value is the serving version's of the same metric (none for precision@k: the hold-out of a
multilabel scenario measures macro AUROC, and holds_holdout_realized then passes, saying so).

Checks (WARN / ERROR, never blocking; settings `realized:`):
    beats_baselines_realized   the realized metric is worse than the best baseline's on
                               realized.beaten_days of the last realized.days realized days (WARN)
    holds_holdout_realized     the day's realized metric is worse than the serving version's hold-out
                               metric by more than realized.max_holdout_shortfall of it (ERROR)
"""

from datetime import datetime, timezone
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from habitus.assets.cache import CACHE_KEY, current_cache
from habitus.assets.check_measures import baseline_margin
from habitus.assets.predictions import as_of_time, predictions_key
from habitus.assets.serving import scored_by, serving_checkpoint, versions
from habitus.models.data.features import FeatureSpec
from habitus.models.evaluate.realized import (best_baseline, realized, seconds, shortfall, window_complete,
                                              window_end, worse)
from habitus.models.storage.files import read_json, write_json
from habitus.models.tasks import task as task_of
from habitus.models.tasks.spec import TaskSpec

GROUP = "monitoring"


def realized_key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["realized", name])


def realized_scenarios(project) -> list[str]:
    return list(project.prediction_scenarios)


def holdout_value(cfg: dict, key: str) -> float:
    """The serving version's hold-out value of metric `key` (its headline: as the checks compare it)."""
    if key == cfg["headline"]:
        return baseline_margin(cfg)["model"]
    return float(cfg["metrics"]["model"].get(key, float("nan")))


def slug(name: str) -> str:
    """A baseline's name as a metadata key ('training mean' -> 'training_mean')."""
    return "".join(c if c.isalnum() else "_" for c in name.lower())


def version_config(workspace, name: str, fingerprint: str) -> dict:
    """config.json of the version that scored a day (kept by fingerprint, else the serving or newest
    checkpoint when it is that one)."""
    folder = versions(workspace, name).path(fingerprint)
    candidates = [folder, serving_checkpoint(workspace, name)[0], workspace.scenario(name)]
    for c in candidates:
        f = c / "config.json"
        if f.exists() and read_json(f)["weights_sha256"][:16] == fingerprint:
            return read_json(f)
    raise dg.Failure(f"version {fingerprint} of scenario {name!r}, which scored the day, is no longer kept "
                     f"(versions.keep, versions.keep_served): its hold-out and cut-offs are unknown")


def _iso(ts: int) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M")


def realized_metadata(report: dict, path: Path) -> dict:
    """A realized day's metadata (what the UI plots over the partitions): realized_<metric>,
    baseline_<name> per baseline and holdout_<metric> as floats, then the day's facts."""
    key = report["metric"]
    return {
        f"realized_{key}": dg.MetadataValue.float(float(report["model"].get(key, float("nan")))),
        **{f"baseline_{slug(b)}": dg.MetadataValue.float(float(m.get(key, float("nan"))))
           for b, m in report["baselines"].items()},
        **({f"holdout_{key}": dg.MetadataValue.float(float(report["holdout"]))} if report["holdout"] == report[
            "holdout"] else {}),
        "best_baseline": str(report["best_baseline"]),
        "model_fingerprint": report["model_fingerprint"],
        "entities": dg.MetadataValue.int(report["entities"]),
        "not_scored": dg.MetadataValue.int(report["not_scored"]),
        "window": f"{report['window'][0]} .. {report['window'][1]} UTC",
        "path": dg.MetadataValue.path(str(path)),
    }


def build_realized_asset(project, name: str, partitions_def) -> dg.AssetsDefinition:
    settings = project.realized

    @dg.asset(key=realized_key(name), deps=[predictions_key(name), CACHE_KEY], partitions_def=partitions_def,
              required_resource_keys={"workspace"}, group_name=GROUP, kinds={"json"}, output_required=False,
              description=f"Scenario {name!r}'s served scores of the day against the targets realized in its window "
                          f"after the day, next to its baselines as of the day (materialized once the window passed)")
    def _realized(context: dg.AssetExecutionContext):
        workspace, day = context.resources.workspace, context.partition_key
        path = workspace.predictions(name) / f"{day}.parquet"
        if not path.exists():
            raise dg.Failure(f"predictions/{name} has no file for {day} ({path}); materialize that partition first")
        cache = current_cache(workspace)
        table = pq.read_table(path)
        fingerprint = scored_by(table, path)
        cfg = version_config(workspace, name, fingerprint)
        task, features = TaskSpec.from_dict(cfg["task"]), FeatureSpec.from_dict(cfg["feature_spec"])
        cutoff = int(as_of_time(day).timestamp())
        window = task.target.window_days
        if not window_complete(cache.time_range[1], cutoff, window):
            context.log.warning(f"realized/{name} {day}: not materialized; its {window}-day target window ends "
                                f"{_iso(window_end(cutoff, window))} UTC and the cache's newest event is "
                                f"{_iso(cache.time_range[1])} UTC")
            return
        protocol = cfg["protocol"]
        lightgbm = ([seconds(c) for c in protocol["train_cutoffs"]], seconds(protocol["val_cutoff"])) \
            if settings.lightgbm and protocol.get("train_cutoffs") else None
        t = task_of(task)
        names = t.label_names(cache, task, cfg.get("label_values") or None)  # (label tasks: their lists)
        report = realized(cache, features, task, cutoff, table.column(project.entity).combine_chunks(),
                          table.column("score" if names is None else "labels").combine_chunks(),
                          constant=cfg.get("training", {}).get("val_target_mean"), lightgbm=lightgbm, names=names)
        key = report["metric"]
        holdout = holdout_value(cfg, key)
        best, best_value = best_baseline(report)
        report.update(day=day, model_fingerprint=fingerprint, cutoff=_iso(cutoff),
                      window=[_iso(cutoff), _iso(window_end(cutoff, window))], holdout=holdout,
                      best_baseline=best, best_baseline_value=best_value, cache_fingerprint=cache.fingerprint)
        out = workspace.realized(name) / f"{day}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(out, report)
        value = report["model"].get(key, float("nan"))
        context.log.info(f"realized/{name} {day}: {key} {value:.4f} on {report['entities']:,} entities (hold-out "
                         f"{holdout:.4f}; best baseline {best}: {best_value:.4f})")
        yield dg.MaterializeResult(metadata=realized_metadata(report, out))

    return _realized


def _days_up_to(context, folder: Path) -> list[Path]:
    """The realized days' files up to the run's partition (all of them without one), oldest first."""
    files = sorted(folder.glob("*.json")) if folder.exists() else []
    if context.has_partition_key or context.has_partition_key_range:
        end = context.partition_key_range.end
        files = [f for f in files if f.stem <= end]
    return files


def realized_checks(project, name: str) -> list[dg.AssetChecksDefinition]:
    s = project.realized
    key = realized_key(name)

    def missing() -> dg.AssetCheckResult:
        return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description=f"realized/{name} has no realized day yet")

    @dg.asset_check(asset=key, name="beats_baselines_realized", required_resource_keys={"workspace"},
                    description=f"The realized metric is worse than the best baseline's on fewer than {s.beaten_days} "
                                f"of the last {s.days} realized days (realized.beaten_days, realized.days; WARN)")
    def beats_baselines_realized(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = _days_up_to(context, context.resources.workspace.realized(name))[-s.days:]
        if not files:
            return missing()
        lines, under, values = [], [], {}
        for f in files:
            r = read_json(f)
            key, lower = r["metric"], r["lower_is_better"]
            mine, (best, theirs) = r["model"].get(key, float("nan")), best_baseline(r)
            values[f.stem] = {"model": mine, "best_baseline": best, "baseline": theirs}
            if worse(mine, theirs, lower):
                under.append(f.stem)
                lines.append(f"{f.stem} {key} {mine:.4f} {'>' if lower else '<'} {best} {theirs:.4f}")
        fired = len(under) >= s.beaten_days
        head = (f"worse than its best baseline on {len(under)} of the last {len(files)} realized days "
                f"(warns at {s.beaten_days} of {s.days})")
        return dg.AssetCheckResult(
            passed=not fired, severity=dg.AssetCheckSeverity.WARN,
            description=head + (": " + "; ".join(lines) if lines else ""),
            metadata={"days_worse": dg.MetadataValue.int(len(under)), "days": dg.MetadataValue.int(len(files)),
                      "beaten_days": dg.MetadataValue.int(s.beaten_days), "values": dg.MetadataValue.json(values)})

    @dg.asset_check(asset=key, name="holds_holdout_realized", required_resource_keys={"workspace"},
                    description=f"The day's realized metric is at most {s.max_holdout_shortfall:.0%} worse than the "
                                f"serving version's hold-out metric (realized.max_holdout_shortfall; ERROR)")
    def holds_holdout_realized(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = _days_up_to(context, context.resources.workspace.realized(name))[-1:]
        if not files:
            return missing()
        r = read_json(files[0])
        key, lower = r["metric"], r["lower_is_better"]
        mine, holdout = r["model"].get(key, float("nan")), r["holdout"]
        gap = shortfall(mine, holdout, lower)
        fired = gap == gap and gap > s.max_holdout_shortfall
        if holdout != holdout:  # (precision@k of a multilabel scenario: its hold-out measured macro AUROC)
            return dg.AssetCheckResult(passed=True, severity=dg.AssetCheckSeverity.ERROR,
                                       description=f"{r['day']}: realized {key} {mine:.4f}; the hold-out of version "
                                                   f"{r['model_fingerprint']} has no {key} to compare it with",
                                       metadata={f"realized_{key}": dg.MetadataValue.float(float(mine))})
        return dg.AssetCheckResult(
            passed=not fired, severity=dg.AssetCheckSeverity.ERROR,
            description=(f"{r['day']}: realized {key} {mine:.4f} against the hold-out's {holdout:.4f} of version "
                         f"{r['model_fingerprint']} ({abs(gap):.1%} {'worse' if gap > 0 else 'better'}; limit "
                         f"{s.max_holdout_shortfall:.0%} worse, better "
                         f"is {'lower' if lower else 'higher'})"),
            metadata={f"realized_{key}": dg.MetadataValue.float(float(mine)),
                      f"holdout_{key}": dg.MetadataValue.float(float(holdout)),
                      "shortfall": dg.MetadataValue.float(round(float(gap), 6))})

    return [beats_baselines_realized, holds_holdout_realized]
