"""Asset checks: the data before anything trains on it, the room to work, and the models.

    source/<name>    schema_matches_config  (blocking)  the extracted columns are the configured ones
                     keys_present           (blocking)  null or duplicate keys (in the run's partitions);
                                                        ERROR above 5% of the rows
                     timestamps_plausible   (events)    none in the future or before 1970 in the warehouse
                     volume_guidelines      (events)    10,000 entities, 100,000 events a month, 3 months (WARN)
    source/<name>    categorical_cardinality            categorical columns above quality.max_categories values (WARN)
    cache            join_coverage          (blocking)  share of event keys that find their attribute row (WARN
                                                        below 90%; ERROR below 5%, naming both key types: the
                                                        silent no-match join of `123` against `'P-123'`)
                     rows_quarantined       (blocking)  events dropped / repaired by the quarantine
                                                        (habitus.models.cache.quarantine), ERROR above quality.max_*_share
                     free_space_for_training (blocking) free >= (sources + checkpoints) * 1.2
    scenario/<name>  beats_baselines                    the hold-out metric beats every baseline's (WARN: a
                                                        model that loses never serves; assets/serving.py)
    predictions/<name> score_drift                      the day's scores against the serving version's hold-out
                                                        scores: population stability index over drift.max_psi (WARN)
                     unknown_values                     events with a categorical value the model never saw
                                                        over drift.max_unknown_share (WARN)
                     event_volume                       the day's events or entities outside drift.*_volume_ratio
                                                        of the trailing drift.trailing_days' mean (WARN)
    realized/<name>  beats_baselines_realized           worse than the best baseline on realized.beaten_days of
                                                        the last realized.days realized days (WARN; assets/realized.py)
                     holds_holdout_realized             the day's realized metric worse than the serving version's
                                                        hold-out by more than realized.max_holdout_shortfall (ERROR)

A blocking check that fails with ERROR stops the assets after it in the same run (no training on
broken data). A model that does not beat its baselines is kept as a version but never serves:
predictions use the newest version that beat them, or, where none has, the best baseline's own model
(habitus.assets.serving); the run goes on and exits 0. The checks read the extracted Parquet with DuckDB and the manifests
and checkpoints' config.json: they are fast and never load a table into memory.
"""

from datetime import datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from habitus.assets.cache import CACHE_KEY, guideline_warnings
from habitus.assets.check_measures import (MIN_JOIN_COVERAGE, MISMATCH_COVERAGE, SEVERE_SHARE, baseline_margin,
                                   categorical_cardinality, entity_coverage, extracted_files, key_counts,
                                   key_mismatch, keys_message, quarantine_counts, schema_problems, space_needed,
                                   volume)
from habitus.assets.realized import realized_checks, realized_scenarios
from habitus.assets.scenarios import scenario_key
from habitus.assets.serving import serving_note
from habitus.assets.sources import connection_key, source_key
from habitus.models.storage.files import read_json
from habitus.resources.store.workspace import HEADROOM, WorkspaceError

EPOCH = datetime(1970, 1, 1)

# a scenario that fails it is not promoted (WARN): the last version that passed, else the best baseline,
# serves; the run that trained it did not fail (the CLI exits 0)
PROMOTION_GATE = "beats_baselines"


def files_of_run(context, files: list[str]) -> tuple[list[str], str]:
    """The partitions this run extracted (a check after a daily extraction reads a day, not the history),
    or every file when the run names no partition. Returns (files, what they are)."""
    start = end = None
    if context.has_partition_key or context.has_partition_key_range:  # the run's partition, or its range
        start, end = context.partition_key_range.start, context.partition_key_range.end
    if start and end:
        picked = [f for f in files if start <= Path(f).stem <= end]
        if picked:
            return picked, f"partitions {start} .. {end}" if start != end else f"partition {start}"
    return files, f"all {len(files)} file(s)"


def _not_extracted(source) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                               description=f"source/{source.name} has no extracted Parquet; materialize it first")


def source_checks(project, source) -> list[dg.AssetChecksDefinition]:
    key = source_key(source.name)
    conn_key = connection_key(source.connection)
    checks = []

    @dg.asset_check(asset=key, name="schema_matches_config", blocking=True, required_resource_keys={"workspace"},
                    description="The extracted columns are the configured ones, with types the config can use")
    def schema_matches_config(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        schemas = {f: pq.read_schema(f) for f in files}
        problems = schema_problems(project, source, schemas)
        schema = next(iter(schemas.values()))
        return dg.AssetCheckResult(
            passed=not problems, severity=dg.AssetCheckSeverity.ERROR,
            description="; ".join(problems) or f"{len(files)} file(s) with the configured columns",
            metadata={"columns": dg.MetadataValue.json(dict(zip(schema.names, map(str, schema.types)))),
                      "files": dg.MetadataValue.int(len(files))})

    checks.append(schema_matches_config)

    key_name = {"events": project.entity, "entity_attributes": project.entity}.get(source.role, source.key)

    @dg.asset_check(asset=key, name="keys_present", blocking=True, required_resource_keys={"workspace"},
                    description=f"Rows without {key_name!r} or repeated "
                                f"{'rows' if source.role == 'events' else repr(key_name) + ' values'}; "
                                f"ERROR (blocking) above {SEVERE_SHARE:.0%} of the rows")
    def keys_present(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        files, scope = files_of_run(context, files)
        n = key_counts(project, source, files)
        # repeated events can be real (two identical items in one basket): they only warn
        bad = n["null_keys"] + (0 if source.role == "events" else n["duplicates"])
        share = bad / n["rows"] if n["rows"] else 0.0
        return dg.AssetCheckResult(
            passed=n["null_keys"] == 0 and n["duplicates"] == 0,
            severity=dg.AssetCheckSeverity.ERROR if share > SEVERE_SHARE else dg.AssetCheckSeverity.WARN,
            description=keys_message(n, key_name, source.role, scope),
            metadata={**{k: dg.MetadataValue.int(v) for k, v in n.items()},
                      "bad_share": dg.MetadataValue.float(round(share, 6)), "scope": scope})

    checks.append(keys_present)
    limit = project.quality.max_categories

    @dg.asset_check(asset=key, name="categorical_cardinality", required_resource_keys={"workspace"},
                    description=f"No categorical column has more than {limit:,} distinct values (quality.max_categories): "
                                f"an id or free text used as a category makes a vocabulary the model cannot learn")
    def categorical_cardinality_check(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        counts = categorical_cardinality(project, source, files)
        wide = {c: n for c, n in counts.items() if n > limit}
        return dg.AssetCheckResult(
            passed=not wide, severity=dg.AssetCheckSeverity.WARN,
            description=("; ".join(f"{c}: about {n:,} distinct values (limit {limit:,}); leave it out of `columns`, "
                                   f"declare it `types: {{{c}: numeric}}` if it is a number, or raise "
                                   f"quality.max_categories" for c, n in wide.items())
                         or f"{len(counts)} categorical column(s), at most {max(counts.values(), default=0):,} values"),
            metadata={"distinct_values": dg.MetadataValue.json(counts)})

    checks.append(categorical_cardinality_check)
    if source.role != "events":
        return checks

    @dg.asset_check(asset=key, name="timestamps_plausible", required_resource_keys={conn_key},
                    description=f"No row of table {source.table!r} is dated in the future or before 1970 (such rows "
                                f"fall outside every partition and are never extracted)")
    def timestamps_plausible(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from habitus.resources.warehouses.sql import utc_naive

        first, last = (utc_naive(t) for t in getattr(context.resources, conn_key).time_range(source.table,
                                                                                              source.timestamp))
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        problems = []
        if last is not None and last > now + timedelta(hours=1):
            problems.append(f"newest {source.timestamp} {last.isoformat()} is in the future (now {now:%Y-%m-%dT%H:%M})")
        if first is not None and first < EPOCH:
            problems.append(f"oldest {source.timestamp} {first.isoformat()} is before 1970 (a default or a unit error?)")
        return dg.AssetCheckResult(
            passed=not problems, severity=dg.AssetCheckSeverity.ERROR,
            description="; ".join(problems) or f"{first} .. {last}",
            metadata={"oldest": str(first), "newest": str(last)})

    @dg.asset_check(asset=key, name="volume_guidelines", required_resource_keys={"workspace"},
                    description="At least 10,000 entities, 100,000 events a month and 3 months of history "
                                "(below that models are unreliable; a warning)")
    def volume_guidelines(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        files = extracted_files(context.resources.workspace, source)
        if not files:
            return _not_extracted(source)
        v = volume(project, source, files)
        notes = guideline_warnings(v) if v["n_events"] else ["no events extracted"]
        days = (v["time_range"][1] - v["time_range"][0]) / 86_400
        return dg.AssetCheckResult(
            passed=not notes, severity=dg.AssetCheckSeverity.WARN,
            description="; ".join(notes) or "within the data guidelines",
            metadata={"entities": dg.MetadataValue.int(v["n_entities"]),
                      "events": dg.MetadataValue.int(v["n_events"]),
                      "events_per_month": dg.MetadataValue.float(round(v["n_events"] / max(days / 30.44, 1e-9), 1)),
                      "days_of_history": dg.MetadataValue.float(round(days, 1))})

    return checks + [timestamps_plausible, volume_guidelines]


def cache_checks(project) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(asset=CACHE_KEY, name="join_coverage", required_resource_keys={"workspace"}, blocking=True,
                    description=f"Share of event keys that find their attribute row (warns below "
                                f"{MIN_JOIN_COVERAGE:.0%}): unmatched events get no attributes; below "
                                f"{MISMATCH_COVERAGE:.0%} the key's type or format differs (ERROR, blocking)")
    def join_coverage(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from habitus.assets.cache import current_cache

        workspace = context.resources.workspace
        cache = current_cache(workspace)
        coverage = dict(cache.manifest.get("join_coverage", {}))
        events = [f for s in project.events_sources for f in extracted_files(workspace, s)]
        for s in project.sources:
            if s.role == "entity_attributes" and events and extracted_files(workspace, s):
                coverage[s.name] = entity_coverage(project, events, extracted_files(workspace, s))
        low = {k: v for k, v in coverage.items() if v < MIN_JOIN_COVERAGE}
        mismatched = [_mismatch_note(project, workspace, k, v) for k, v in coverage.items() if v < MISMATCH_COVERAGE]
        if mismatched:
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                                       description="; ".join(mismatched),
                                       metadata={"coverage": dg.MetadataValue.json(coverage)})
        return dg.AssetCheckResult(
            passed=not low, severity=dg.AssetCheckSeverity.WARN,
            description=(", ".join(f"{k}: {v:.1%} of event keys found" for k, v in low.items()) + " (check `key` "
                         "and that the attribute table is complete)") if low else
                        ("every attribute table covers at least " f"{MIN_JOIN_COVERAGE:.0%}" if coverage
                         else "no attribute tables"),
            metadata={"coverage": dg.MetadataValue.json(coverage)})

    @dg.asset_check(asset=CACHE_KEY, name="rows_quarantined", required_resource_keys={"workspace"}, blocking=True,
                    description=f"Events dropped (null or blank ids, impossible times, duplicates) at most "
                                f"{project.quality.max_dropped_share:.1%} and repaired (inf, NaN, not a number) at most "
                                f"{project.quality.max_repaired_share:.1%} of all events (quality.max_*_share)")
    def rows_quarantined(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from habitus.assets.cache import current_cache
        from habitus.models.cache.quarantine import summary

        counts = quarantine_counts(current_cache(context.resources.workspace).manifest)
        q = project.quality
        over = []
        if counts.get("dropped_share", 0.0) > q.max_dropped_share:
            over.append(f"{counts['dropped_share']:.2%} of the events dropped (quality.max_dropped_share "
                        f"{q.max_dropped_share:.2%})")
        if counts.get("repaired_share", 0.0) > q.max_repaired_share:
            over.append(f"{counts['repaired_share']:.2%} of the events repaired (quality.max_repaired_share "
                        f"{q.max_repaired_share:.2%})")
        return dg.AssetCheckResult(
            passed=not over, severity=dg.AssetCheckSeverity.ERROR,
            description=("; ".join(over) + f". {summary(counts)}. Fix the source data, or raise the limit in the "
                         f"project config if these rows are expected") if over else summary(counts),
            metadata={k: (dg.MetadataValue.float(float(v)) if isinstance(v, float) else dg.MetadataValue.int(int(v)))
                      for k, v in counts.items() if isinstance(v, (int, float))})

    @dg.asset_check(asset=CACHE_KEY, name="free_space_for_training", blocking=True,
                    required_resource_keys={"workspace"},
                    description="Free space in the workspace >= (extracted sources + checkpoints) + 20% before "
                                "training starts")
    def free_space_for_training(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        workspace = context.resources.workspace
        need = space_needed(workspace, project)
        total = need["source_bytes"] + need["checkpoint_bytes"]
        meta = {k: dg.MetadataValue.int(v) for k, v in need.items()}
        try:
            space = workspace.ensure_space(total, "training")
        except WorkspaceError as e:
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR, description=str(e),
                                       metadata=meta)
        return dg.AssetCheckResult(
            passed=True, description=f"{space['free_gb']} GB free, {space['needed_gb']} GB needed "
                                     f"(sources + checkpoints + {HEADROOM - 1:.0%})",
            metadata={**meta, "free_gb": dg.MetadataValue.float(space["free_gb"])})

    return [join_coverage, rows_quarantined, free_space_for_training]


def _mismatch_note(project, workspace, name: str, coverage: float) -> str:
    source = project.source(name)
    key = project.entity if source.role == "entity_attributes" else source.key
    events = next((files for s in project.events_sources if (files := extracted_files(workspace, s))
                   and key in pq.read_schema(files[0]).names), [])
    attr = extracted_files(workspace, source)
    head = f"{name}: {coverage:.1%} of event keys found"
    if not events or not attr:
        return head
    return f"{head}; {key_mismatch(events, key, name, attr, key)}"


def scenario_check(project, name: str) -> dg.AssetChecksDefinition:
    @dg.asset_check(asset=scenario_key(name), name=PROMOTION_GATE, required_resource_keys={"workspace"},
                    description="The model beats every baseline on the hold-out; a worse model fails (WARN) and never "
                                "serves: the last version that passed, else the best baseline, serves predictions")
    def beats_baselines(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        workspace = context.resources.workspace
        cfg_file = workspace.scenario(name) / "config.json"
        if not cfg_file.exists():
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.ERROR,
                                       description=f"scenario {name!r} has no checkpoint; materialize it first")
        cfg = read_json(cfg_file)
        m = baseline_margin(cfg)
        word = "below" if m["lower_is_better"] else "above"
        verdict = "beats" if cfg["beats_baselines"] else "does not beat"
        return dg.AssetCheckResult(
            passed=bool(cfg["beats_baselines"]), severity=dg.AssetCheckSeverity.WARN,
            description=f"{m['metric']} {m['model']:.4f} {verdict} the best baseline ({m['best_baseline']}: "
                        f"{m['baseline']:.4f}; better is {word}); predictions use the {serving_note(workspace, name)}",
            metadata={m["metric"]: dg.MetadataValue.float(float(m["model"])),
                      "best_baseline": str(m["best_baseline"]),
                      "baseline_value": dg.MetadataValue.float(float(m["baseline"])),
                      "checkpoint": cfg["weights_sha256"][:16],
                      "holdout_entities": dg.MetadataValue.int(cfg["metrics"].get("entities", 0))})

    return beats_baselines


def _scored_days(context, workspace, name: str) -> list[str]:
    """The days this run scored (their files), else the newest scored day."""
    files = sorted(str(f) for f in workspace.predictions(name).glob("*.parquet"))
    if not files:
        return []
    picked, scope = files_of_run(context, files)
    return [Path(f).stem for f in (picked if scope.startswith("partition") else files[-1:])]


def drift_checks(project, name: str) -> list[dg.AssetChecksDefinition]:
    """Each scored day of predictions/<name> against what the serving version was trained and checked on
    (models/evaluate/drift.py); WARN, never blocking: drift is a reason to look, maybe to retrain."""
    from habitus.assets.predictions import predictions_key

    key, d = predictions_key(name), project.drift

    def days_and_model(context):
        from habitus.assets.cache import current_cache
        from habitus.assets.serving import serving_checkpoint

        workspace = context.resources.workspace
        folder, _ = serving_checkpoint(workspace, name)
        return _scored_days(context, workspace, name), folder, current_cache(workspace)

    def result(days: list[str], notes: dict[str, str], fired: dict[str, str], metadata: dict) -> dg.AssetCheckResult:
        if not days:
            return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN,
                                       description=f"predictions/{name} has no scored day; materialize it first")
        return dg.AssetCheckResult(passed=not fired, severity=dg.AssetCheckSeverity.WARN,
                                   description="; ".join(f"{day}: {text}" for day, text in (fired or notes).items()),
                                   metadata=metadata)

    @dg.asset_check(asset=key, name="score_drift", required_resource_keys={"workspace"},
                    description=f"Population stability index of the day's scores against the serving version's "
                                f"hold-out scores at most {d.max_psi} (drift.max_psi; WARN)")
    def score_drift(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from habitus.models.evaluate.drift import psi
        from habitus.models.storage.versions import INFO

        from habitus.assets.serving import scored_by, versions

        workspace, store = context.resources.workspace, versions(context.resources.workspace, name)
        days, notes, fired, values = _scored_days(context, workspace, name), {}, {}, {}
        for day in days:
            path = workspace.predictions(name) / f"{day}.parquet"
            table = pq.read_table(path)
            fp = scored_by(table, path)  # the version that scored the day
            kept = (store.path(fp) / INFO).exists()
            reference = store.info(fp).get("scores") if kept else None
            if reference is None or "score" not in table.column_names:
                notes[day] = (f"no hold-out score distribution is stored for version {fp} (kept with versions of "
                              f"models with one score per entity)")
                continue
            scores = table.column("score").drop_null().to_numpy()
            values[day] = round(psi(reference, scores), 4)
            text = (f"score PSI {values[day]:.3f} against the hold-out of version {fp} "
                    f"({len(scores):,} scores vs {reference['n']:,}; limit {d.max_psi})")
            (fired if values[day] > d.max_psi else notes)[day] = text
        return result(days, notes, fired, {"psi": dg.MetadataValue.json(values)})

    def measured(context):
        from habitus.models.evaluate.drift import DAY, day_events

        days, folder, cache = days_and_model(context)
        vocab = read_json(folder / "config.json")["feature_spec"].get("categorical", {}) if days else {}
        out = {}
        for day in days:
            end = int(datetime.fromisoformat(day).replace(tzinfo=timezone.utc).timestamp())
            out[day] = day_events(cache, end - d.trailing_days * DAY, d.trailing_days + 1, vocab)
        return days, out

    @dg.asset_check(asset=key, name="unknown_values", required_resource_keys={"workspace"},
                    description=f"Share of the day's events with a categorical value the serving model never saw at "
                                f"most {d.max_unknown_share:.1%} (drift.max_unknown_share; WARN)")
    def unknown_values(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        days, counts = measured(context)
        notes, fired, shares = {}, {}, {}
        for day, c in counts.items():
            events, unknown = int(c["events"][-1]), int(c["unknown"][-1])
            shares[day] = round(unknown / events, 6) if events else 0.0
            columns = ", ".join(f"{col} {int(n[-1]):,}" for col, n in c["unknown_by_column"].items() if n[-1])
            text = (f"{unknown:,} of {events:,} events ({shares[day]:.2%}) have a value the model never saw"
                    + (f" ({columns})" if columns else "") + f"; limit {d.max_unknown_share:.1%}")
            (fired if shares[day] > d.max_unknown_share else notes)[day] = text
        return result(days, notes, fired, {"unknown_share": dg.MetadataValue.json(shares)})

    @dg.asset_check(asset=key, name="event_volume", required_resource_keys={"workspace"},
                    description=f"The day's events and distinct entities between {d.min_volume_ratio}x and "
                                f"{d.max_volume_ratio}x the mean of the {d.trailing_days} days before "
                                f"(drift.*_volume_ratio; WARN)")
    def event_volume(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        from habitus.models.evaluate.drift import volume_ratio

        days, counts = measured(context)
        notes, fired, ratios = {}, {}, {}
        for day, c in counts.items():
            parts, off = [], False
            for what in ("events", "entities"):
                today, mean, ratio = volume_ratio(c[what])
                ratios[f"{day} {what}"] = round(ratio, 4)
                parts.append(f"{today:,} {what} against a mean of {mean:,.1f} over the {d.trailing_days} days before "
                             f"({ratio:.2f}x)")
                off |= ratio == ratio and not d.min_volume_ratio <= ratio <= d.max_volume_ratio  # nan: no history
            text = "; ".join(parts) + f"; allowed {d.min_volume_ratio}x .. {d.max_volume_ratio}x"
            (fired if off else notes)[day] = text
        return result(days, notes, fired, {"ratio": dg.MetadataValue.json(ratios)})

    return [score_drift, unknown_values, event_volume]


def build_checks(project) -> list[dg.AssetChecksDefinition]:
    checks = [c for s in project.sources for c in source_checks(project, s)]
    checks += cache_checks(project)
    checks += [scenario_check(project, name) for name in project.scenarios]
    checks += [c for name in project.prediction_scenarios for c in drift_checks(project, name)]
    checks += [c for name in realized_scenarios(project) for c in realized_checks(project, name)]
    return checks
