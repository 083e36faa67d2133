"""Scheduled retraining and scoring; cron strings come from the project config's `schedules:`.

    foundation_schedule   (monthly)  job `train`: cache, foundation model and every scenario, when the
                                     extracted data differs from what the foundation model was trained on
    scenarios_schedule    (weekly)   job `train_scenarios`: the scenarios whose checkpoint was trained on
                                     other data or another foundation model than the current ones
    predictions_schedule  (daily)    job `score`: the previous day's predictions (from each scenario's
                                     serving checkpoint) and embeddings, for what fits the current cache

Nothing retrains when its inputs have not changed: "the data" is the cache fingerprint of the
extracted sources (what `cache` would build), compared with the `cache_fingerprint` recorded in the
checkpoints' config.json. A model fits a cache of its own lineage (new data appended to the cache
it was trained on keeps every id), so daily scoring goes on between retrainings. A skipped tick says
why in the UI.
"""

from datetime import timedelta

import dagster as dg

from habitus.assets.cache import CACHE_KEY, cache_folder, cache_spec
from habitus.assets.embeddings import EMBEDDINGS_KEY
from habitus.assets.predictions import predictions_key
from habitus.assets.scenarios import scenario_key
from habitus.assets.serving import serving_checkpoint
from habitus.models.cache import Cache
from habitus.models.storage.files import read_json


def checkpoint_config(folder) -> dict | None:
    f = folder / "config.json"
    return read_json(f) if f.exists() else None


def data_fingerprint(project, workspace) -> str:
    """The cache fingerprint of the extracted sources; dg.Failure names a source not extracted yet."""
    return cache_spec(project, workspace).fingerprint()


def cache_in_use(workspace) -> Cache | None:
    folder = cache_folder(workspace)  # checked: dg.Failure naming cache/current.json when tampered
    return Cache(folder) if folder is not None and (folder / "manifest.json").exists() else None


def data_or_skip(project, workspace) -> str | dg.SkipReason:
    """The data fingerprint, or why there is nothing to train on yet (a source not extracted)."""
    try:
        return data_fingerprint(project, workspace)
    except dg.Failure as e:
        return dg.SkipReason(f"nothing to train on yet: {e.description}")


def foundation_request(project, workspace) -> dg.RunRequest | dg.SkipReason:
    fp = data_or_skip(project, workspace)
    if isinstance(fp, dg.SkipReason):
        return fp
    cfg = checkpoint_config(workspace.foundation)
    if cfg is not None and cfg.get("cache_fingerprint") == fp:
        return dg.SkipReason(f"the foundation model was trained on the current data (cache fingerprint {fp[:16]}); "
                             f"nothing to retrain")
    why = "no foundation model yet" if cfg is None else "the extracted data changed since the foundation model was trained"
    return dg.RunRequest(run_key=f"train:{fp[:16]}", tags={"habitus/reason": why, "habitus/data": fp[:16]})


def scenarios_request(project, workspace) -> dg.RunRequest | dg.SkipReason:
    fp = data_or_skip(project, workspace)
    if isinstance(fp, dg.SkipReason):
        return fp
    foundation = checkpoint_config(workspace.foundation)
    if foundation is None:
        return dg.SkipReason("no foundation model yet: the foundation schedule (or materializing foundation_model) "
                             "trains it and its scenarios")
    cache = cache_in_use(workspace)
    if cache is None or not cache.fits(foundation):
        return dg.SkipReason("the cache was rebuilt with other settings since the foundation model was trained; the "
                             "foundation schedule retrains it and its scenarios together")
    stale = []
    for name in project.scenarios:
        cfg = checkpoint_config(workspace.scenario(name))
        if (cfg is None or cfg.get("cache_fingerprint") != fp
                or cfg.get("foundation_sha256") != foundation["weights_sha256"]):
            stale.append(name)
    if not stale:
        return dg.SkipReason("every scenario was trained on the current data and foundation model; nothing to retrain")
    return dg.RunRequest(run_key=f"train_scenarios:{fp[:16]}:{foundation['weights_sha256'][:16]}:{','.join(stale)}",
                         asset_selection=[CACHE_KEY] + [scenario_key(n) for n in stale],
                         tags={"habitus/reason": f"stale: {', '.join(stale)}"})


def predictions_request(project, workspace, day: str, partitions_def, with_embeddings: bool,
                        run_key: str | None = None) -> dg.RunRequest | dg.SkipReason:
    if not partitions_def.has_partition_key(day):
        return dg.SkipReason(f"{day} is not a predictions partition ({partitions_def})")
    cache = cache_in_use(workspace)
    if cache is None:
        return dg.SkipReason("no cache yet: materialize the sources and `cache`, then train")
    keys, left_out = [], []
    for name in project.prediction_scenarios:
        folder, _ = serving_checkpoint(workspace, name)
        cfg = checkpoint_config(folder)
        if cfg is None:
            left_out.append(f"{name}: not trained yet")
        elif not cache.fits(cfg):
            left_out.append(f"{name}: its serving checkpoint was trained on a cache with other settings (it scores "
                            f"again after retraining)")
        else:
            keys.append(predictions_key(name))
    if with_embeddings:
        foundation = checkpoint_config(workspace.foundation)
        if foundation is not None and cache.fits(foundation):
            keys.append(EMBEDDINGS_KEY)
        else:
            left_out.append("embeddings: the foundation model was trained on a cache with other settings or not at all")
    if not keys:
        return dg.SkipReason(f"nothing to score for {day}: " + "; ".join(left_out))
    return dg.RunRequest(run_key=run_key or f"score:{day}", partition_key=day, asset_selection=keys,
                         tags={"habitus/left_out": "; ".join(left_out)[:1000]} if left_out else {})


def build_schedules(project, jobs: dict, assets: list[dg.AssetsDefinition]) -> list[dg.ScheduleDefinition]:
    s = project.schedules
    status = dg.DefaultScheduleStatus.RUNNING if s.running else dg.DefaultScheduleStatus.STOPPED
    common = dict(execution_timezone=s.timezone, default_status=status, required_resource_keys={"workspace"})
    schedules = []

    @dg.schedule(cron_schedule=s.foundation, job=jobs["train"], name="foundation_schedule",
                 description="Retrain the foundation model and its scenarios when the extracted data changed", **common)
    def foundation_schedule(context: dg.ScheduleEvaluationContext):
        return foundation_request(project, context.resources.workspace)

    schedules.append(foundation_schedule)
    if "train_scenarios" in jobs:
        @dg.schedule(cron_schedule=s.scenarios, job=jobs["train_scenarios"], name="scenarios_schedule",
                     description="Retrain the scenarios whose data or foundation model changed", **common)
        def scenarios_schedule(context: dg.ScheduleEvaluationContext):
            return scenarios_request(project, context.resources.workspace)

        schedules.append(scenarios_schedule)

    by_key = {k: a for a in assets for k in a.keys}
    scored = [by_key[predictions_key(n)] for n in project.prediction_scenarios] + (
        [by_key[EMBEDDINGS_KEY]] if EMBEDDINGS_KEY in by_key else [])
    if scored:
        partitions_def = scored[0].partitions_def

        @dg.schedule(cron_schedule=s.predictions, job=jobs["score"], name="predictions_schedule",
                     description="Score the previous day with each scenario's serving checkpoint", **common)
        def predictions_schedule(context: dg.ScheduleEvaluationContext):
            day = (context.scheduled_execution_time.date() - timedelta(days=1)).isoformat()
            return predictions_request(project, context.resources.workspace, day, partitions_def,
                                       EMBEDDINGS_KEY in by_key)

        schedules.append(predictions_schedule)
    return schedules
