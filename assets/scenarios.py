"""scenario/<name>: a task model fine-tuned from the foundation checkpoint by the scenario recipe
(models/train/scenario.py), with its hold-out metrics next to the baselines computed on the same
entities in the same run. A scenario whose cache, foundation and settings are those of its serving
(or newest) version is not trained again: the asset says so and keeps what serves
(assets/serving.py's `unchanged`). One whose model loses to its best baseline, none having beaten
it before, serves that baseline (assets/serving.py's `serve_baseline`)."""

import dataclasses
import math

import dagster as dg

from habitus.assets.cache import current_cache
from habitus.assets.foundation import FOUNDATION_KEY, test_cutoff
from habitus.assets.plots import calibration_and_lift, loss_curves
from habitus.assets.serving import (baseline_left_unserved, keep_version, needs_baseline, serve_baseline,
                                    serving_note, trained_with, unchanged, versions)
from habitus.assets.tracking import check_installed, complete_scenario_record, track_scenario
from habitus.models.evaluate.baselines import baseline_predictions, save_lightgbm
from habitus.models.evaluate.holdout import headline, protocol
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.storage.files import combine, read_json
from habitus.models.tasks import task as task_of
from habitus.models.tasks.base import TargetError
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.config import LoraConfig, ScenarioConfig
from habitus.models.train.recipe import Training, fingerprint, scenario_job
from habitus.models.train.scenario import metrics_table, train_scenario
from habitus.resources.training.executor import TrainingExecutor
from habitus.resources.store.workspace import Workspace, locked


def scenario_key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["scenario", name])


def scenario_config(name: str, scenario, cache, cutoff: int, spill_dir: str | None = None) -> ScenarioConfig:
    """The project's scenario settings (pipelines/config/project.py) as the recipe takes them: the one translation.
    Its task type builds the target (models/tasks/); label sets are chosen from history before the hold-out."""
    try:
        target = task_of(scenario.task).target_spec(name, scenario.target, cache, cutoff)
    except TargetError as e:
        raise dg.Failure(str(e)) from e
    plan = protocol(cutoff, target.window_days, scenario.train_cutoffs, cache.time_range[0])
    return ScenarioConfig(name, TaskSpec(scenario.task, target, scenario.top_k), plan.train_cutoffs, plan.val_cutoff,
                          plan.test_cutoff, scenario.finetune_config(spill_dir=spill_dir),
                          lora=LoraConfig(**scenario.lora.model_dump()) if scenario.lora else None,
                          save_every_steps=scenario.save_every_steps, head=scenario.head, refit=scenario.refit)


def build_scenario_asset(project, name: str, scenario, op_tags: dict | None = None,
                         node_group=None) -> dg.AssetsDefinition:
    """`op_tags`: the training step's tags from the wiring (on Kubernetes its GPU pod, pipelines/orchestration/kubernetes.py);
    `node_group(what)`: TrainingExecutor.train's `group` on several nodes, or None (pipelines/orchestration/kubernetes_nodes.py)."""
    @dg.asset(key=scenario_key(name), deps=[FOUNDATION_KEY], group_name="scenarios", kinds={"pytorch", "safetensors"},
              op_tags=op_tags or {}, description=f"{scenario.task} scenario fine-tuned from the foundation model")
    @locked(f"scenario/{name}")
    def _scenario(context: dg.AssetExecutionContext, workspace: Workspace,
                  executor: TrainingExecutor) -> dg.MaterializeResult:
        check_installed(project.mlflow)
        cache = current_cache(workspace)
        device = executor.setup()
        state, foundation = load_checkpoint(workspace.foundation)
        if not cache.fits(foundation):
            raise dg.Failure("the cache was rebuilt with other settings since the foundation model was trained "
                             "(its ids differ); materialize foundation_model again before its scenarios")
        # features beyond the memory budget spill into the workspace (a real filesystem), by the resumable state
        spill = workspace.resume("scenarios", name)
        spill.mkdir(parents=True, exist_ok=True)
        cfg = scenario_config(name, scenario, cache, test_cutoff(project, cache), str(spill))
        trained_on = training_fingerprints(cfg, cache, foundation, executor.precision)
        path = workspace.scenario(name)

        def serve_best_baseline(checkpoint) -> None:
            """Serve the best baseline of the hold-out of `checkpoint` (a folder; serving.serve_baseline)."""
            fit = lambda folder: save_lightgbm(cache, spec_of(foundation), cfg.task, cfg.train_cutoffs,  # noqa: E731
                                               cfg.val_cutoff, cfg.test_cutoff, folder)
            probe = lambda config, folder: next(baseline_predictions(config, folder, cache, cfg.test_cutoff, k=1),  # noqa: E731
                                                 None)
            if serve_baseline(workspace, name, read_json(checkpoint / "config.json"), fit, project.versions.keep,
                              project.versions.keep_served, trained_on, probe) is None:
                context.log.warning(f"{name}: its best baseline cannot be served (no saved model, or no rule "
                                    f"of the task by that name); predictions use the {serving_note(workspace, name)}")

        same = unchanged(workspace, name, trained_on)
        if same is not None and (path / "config.json").exists():
            if baseline_left_unserved(workspace, name, same):  # a run killed before its best baseline served
                serve_best_baseline(versions(workspace, name).path(same))
            trained = trained_with(workspace, name, trained_on)  # (what serves may be its baseline: never registered)
            if trained is not None:
                complete_scenario_record(project.mlflow, workspace, name, scenario.model_dump(mode="json"), trained,
                                         context.log.warning)
            return not_trained(context, workspace, name, same)
        # the measured run and the refit, each in this process or under torchrun, resumable in spill/<mode>
        # several nodes: an indexed Job of pods on the workspace claim, from the wiring
        group = (lambda t: node_group(f"{name}-{t.mode}")) if node_group else None  # noqa: E731
        launch = lambda t: executor.train(  # noqa: E731
            scenario_job(cache, workspace.foundation, foundation["weights_sha256"], t, device), device,
            log=context.log.info, resume=(spill / t.mode, cfg.save_every_steps), group=group and group(t))
        run = train_scenario(cache, state, foundation, cfg, path=path, device=device, log=context.log.info,
                             resume_dir=spill, launch=launch)
        report, key, better = run.report, headline(cfg.task), run.checkpoint["beats_baselines"]
        # drawn before the version is kept: a kept version is not trained again, so its pictures must exist
        charts = {"loss_curves": dg.MetadataValue.md(loss_curves(run.trained.curves, path.parent / f"{name}_loss.png",
                                                                 f"scenario {name}"))}
        if task_of(cfg.task).one_probability:  # a picture of the hold-out; never a reason for the asset to fail
            try:
                charts["calibration_and_lift"] = dg.MetadataValue.md(calibration_and_lift(
                    run.holdout.y, run.holdout.scores, path.parent / f"{name}_lift.png",
                    f"scenario {name}: hold-out ({len(run.holdout.y):,} entities)"))
            except Exception as e:  # noqa: BLE001
                context.log.warning(f"{name}: no calibration/lift chart ({type(e).__name__}: {e})")
        fp, _ = keep_version(workspace, name, run.served_scores, project.versions.keep, project.versions.keep_served,
                             trained_on)
        track_scenario(project.mlflow, workspace, name, scenario.model_dump(mode="json"), fp, context.log.warning)
        if not better and needs_baseline(workspace, name):  # never beaten: its best baseline serves
            serve_best_baseline(path)
        if not better:  # kept as a version; what serves is the last version that beat them, else the baseline
            context.log.warning(f"{name}: the model does not beat its baselines on the hold-out; predictions use "
                                f"the {serving_note(workspace, name)}")
        info = run.trained.info  # (head_start: the task's own head, or the foundation's forecast: train/prior.py)
        return dg.MaterializeResult(metadata={
            **charts, **metric_metadata(key, report), **head_metadata(key, report),
            "fingerprint": run.digest[:16], "foundation_fingerprint": foundation["weights_sha256"][:16],
            key: dg.MetadataValue.float(report["model"].get(key, float("nan"))),
            "metrics": dg.MetadataValue.md(metrics_table(report)), "beats_baselines": dg.MetadataValue.bool(better),
            "serving": serving_note(workspace, name), "holdout_entities": dg.MetadataValue.int(report["entities"]),
            "test_cutoff": run.checkpoint["protocol"]["test_cutoff"], "best_epoch": dg.MetadataValue.int(info["best_epoch"]),
            "head_start": info.get("head_start", "baseline"), "seconds": dg.MetadataValue.float(info["seconds"]),
            # refit: the served weights were trained again through the test cut-off; the figures are the measured model's
            "refit": dg.MetadataValue.bool(run.refit is not None), "trained": dg.MetadataValue.bool(True),
            "path": dg.MetadataValue.path(str(path))})

    return _scenario


def training_fingerprints(cfg: ScenarioConfig, cache, foundation: dict, precision: str) -> dict:
    """What a training of the scenario depends on: the cache version, the foundation checkpoint, and the
    settings (the recipe as it trains: task, fine-tuning, LoRA, cut-offs, head, refit, precision)."""
    # (one process: how many train it does not change what is asked of the training)
    # (where features spill is not what is trained: a workspace moved or restored elsewhere trains nothing again)
    same = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, spill_dir=None))
    settings = combine(fingerprint(foundation["weights_sha256"], Training(same), precision, 1), cfg.test_cutoff,
                       cfg.head, cfg.refit)
    return {"cache": cache.fingerprint[:16], "foundation": foundation["weights_sha256"][:16], "settings": settings[:16]}


def not_trained(context, workspace, name: str, version: str) -> dg.MaterializeResult:
    """The scenario's result when nothing it is trained on changed since `version`: no training."""
    why = (f"{name}: not trained again: the cache, foundation and settings are those of version {version}; "
           f"predictions use the {serving_note(workspace, name)}")
    context.log.info(why)
    config = read_json(workspace.scenario(name) / "config.json")
    key = config["headline"]
    return dg.MaterializeResult(metadata={
        "trained": dg.MetadataValue.bool(False), "skipped": why, "fingerprint": version,
        key: dg.MetadataValue.float(float(config["metrics"]["model"].get(key, float("nan")))),
        "beats_baselines": dg.MetadataValue.bool(bool(config["beats_baselines"])),
        "serving": serving_note(workspace, name), "path": dg.MetadataValue.path(str(workspace.scenario(name)))})


def spec_of(foundation: dict):
    from habitus.models.data.features import FeatureSpec

    return FeatureSpec.from_dict(foundation["feature_spec"])


def metric_metadata(key: str, report: dict) -> dict:
    """Every hold-out metric of the model, and each baseline's headline metric, as float metadata
    ("model <metric>", "<baseline> <metric>"): Dagster plots them across materializations."""
    out = {}
    for metric, value in report["model"].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"model {metric}"] = dg.MetadataValue.float(float(value))
    for name, metrics in report["baselines"].items():
        value = metrics.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[f"{name} {key}"] = dg.MetadataValue.float(float(value))
    return out


def head_metadata(key: str, report: dict) -> dict:
    """The head chosen on validation (models/heads/stacked_head.py) and the network's own headline figure."""
    h = report.get("head")
    if not h:
        return {"head": "network"}
    out = {"head": h["chosen"], "head_weight": dg.MetadataValue.float(float(h["weight"])),
           "head_candidates": dg.MetadataValue.json({k: m.get(key) for k, m in h["candidates"].items()}),
           "head_validation": dg.MetadataValue.json(h["validation"])}
    value = report["network"].get(key)
    if isinstance(value, float) and math.isfinite(value):
        out[f"network {key}"] = dg.MetadataValue.float(value)
    return out
