"""scenario/<name>: a task model fine-tuned from the foundation checkpoint, with its hold-out
metrics next to the baselines computed on the same entities in the same run."""

import math

import dagster as dg
import numpy as np

from habitus.assets.cache import current_cache
from habitus.assets.foundation import FOUNDATION_KEY, test_cutoff
from habitus.assets.plots import calibration_and_lift, loss_curves
from habitus.assets.serving import promote, serving_note
from habitus.models.evaluate.baselines import lightgbm_scores
from habitus.models.nn.checkpoint import load_checkpoint, save_checkpoint
from habitus.models.train.launch import scenario_job
from habitus.models.train.resume import Resumer
from habitus.models.storage.files import combine
from habitus.models.evaluate.holdout import LOWER_IS_BETTER, headline, protocol, score_holdout
from habitus.models.data.features import FeatureSpec
from habitus.models.train.finetune import finetune
from habitus.models.train.config import config_dict
from habitus.models.tasks.spec import TaskSpec
from habitus.models.heads.stacked_head import fit_head, save_head, trunk_of
from habitus.models.tasks import task as task_of
from habitus.models.tasks.base import TargetError
from habitus.resources.executor import TrainingExecutor
from habitus.resources.workspace import Workspace, locked


def scenario_key(name: str) -> dg.AssetKey:
    return dg.AssetKey(["scenario", name])


def task_spec(name: str, scenario, cache, cutoff: int) -> TaskSpec:
    """The scenario's config -> a TaskSpec (its task type builds the target, models/tasks/); label sets
    are chosen from history before the hold-out."""
    try:
        target = task_of(scenario.task).target_spec(name, scenario.target, cache, cutoff)
    except TargetError as e:
        raise dg.Failure(str(e)) from e
    return TaskSpec(scenario.task, target, scenario.top_k)


def metrics_markdown(task: TaskSpec, report: dict) -> str:
    rows = [("model", report["model"])] + list(report["baselines"].items())
    keys = list(report["model"])
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m.get(k, float('nan')):.4f}" for k in keys) + " |" for name, m in rows]
    for name, m in report["baselines"].items():  # a baseline of some labels only: the model on the same labels
        if any(k.startswith("model_") for k in m):
            lines.append(f"| model, on the labels of {name} | "
                         + " | ".join(f"{m.get(f'model_{k}', float('nan')):.4f}" for k in keys) + " |")
    return "\n".join(lines)


def beats_baselines(task: TaskSpec, report: dict) -> bool:
    key = headline(task)
    model = report["model"].get(key, float("nan"))
    # a baseline scored on a subset of the labels (LightGBM on a wide head) carries the model's value there
    pairs = [(m.get(f"model_{key}", model), m.get(key, float("nan"))) for m in report["baselines"].values()]
    pairs = [(mine, other) for mine, other in pairs if not math.isnan(other)]
    if math.isnan(model) or not pairs:
        return False
    return all(mine < other if key in LOWER_IS_BETTER else mine > other for mine, other in pairs)


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


def build_scenario_asset(project, name: str, scenario, op_tags: dict | None = None) -> dg.AssetsDefinition:
    """`op_tags`: the training step's tags from the wiring (on Kubernetes its GPU pod, pipelines/kubernetes.py)."""
    @dg.asset(key=scenario_key(name), deps=[FOUNDATION_KEY], group_name="scenarios", kinds={"pytorch", "safetensors"},
              op_tags=op_tags or {},
              description=f"{scenario.task} scenario fine-tuned from the foundation model")
    @locked(f"scenario/{name}")
    def _scenario(context: dg.AssetExecutionContext, workspace: Workspace,
                  executor: TrainingExecutor) -> dg.MaterializeResult:
        cache = current_cache(workspace)
        device = executor.setup()
        state, foundation = load_checkpoint(workspace.foundation)
        if not cache.fits(foundation):
            raise dg.Failure("the cache was rebuilt with other settings since the foundation model was trained "
                             "(its ids differ); materialize foundation_model again before its scenarios")
        cutoff = test_cutoff(project, cache)
        task = task_spec(name, scenario, cache, cutoff)
        plan = protocol(cutoff, task.target.window_days, scenario.train_cutoffs, cache.time_range[0])
        # features beyond the memory budget spill into the workspace (a real filesystem with its space checked)
        spill = workspace.resume("scenarios", name)
        spill.mkdir(parents=True, exist_ok=True)
        cfg = scenario.finetune_config(spill_dir=str(spill))
        # a killed run continues from its last saved state (same foundation, task, config and cut-offs only)
        lora = scenario.lora.model_dump() if scenario.lora else None
        resume = Resumer(workspace.resume("scenarios", name),
                         combine(foundation["weights_sha256"], task.to_dict(), config_dict(cfg), list(plan.train_cutoffs),
                                 plan.val_cutoff, *([lora] if lora else [])),
                         every_steps=scenario.save_every_steps, log=context.log.info)
        if lora:  # adapters on the frozen trunk (models/nn/lora.py), merged into plain weights for scoring
            from habitus.models.nn.lora import finetune_lora, merge_lora

            if executor.distributed:
                context.log.warning(f"{name}: LoRA fine-tuning runs in this one process (processes > 1 is for full "
                                    f"fine-tuning)")
            context.log.info(f"{name}: LoRA rank {lora['rank']}, alpha {lora['alpha']}")
            with executor.autocast(device):
                result = finetune_lora(cache, state, foundation, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                                       rank=lora["rank"], alpha=lora["alpha"], device=device, log=context.log.info,
                                       resume=resume)
            result.model = merge_lora(result.model)
        elif executor.distributed:  # N processes under torchrun; rank 0's result comes back here
            context.log.info(f"fine-tuning in {executor.process_count} processes under torchrun (DDP, entity chunks "
                             f"sharded by rank); a killed run starts afresh (resumable saves need processes: 1)")
            result = executor.train(scenario_job(cache, workspace.foundation, foundation["weights_sha256"], task,
                                                 plan.train_cutoffs, plan.val_cutoff, cfg, device), device,
                                    log=context.log.info)
        else:
            with executor.autocast(device):  # bf16: torch.autocast around the loop, fp32 master weights
                result = finetune(cache, state, foundation, task, list(plan.train_cutoffs), plan.val_cutoff, cfg,
                                  device=device, log=context.log.info, resume=resume)
        spec = FeatureSpec.from_dict(foundation["feature_spec"])
        head = None
        if task_of(task).stackable and scenario.head == "chosen":  # the network, trees over [hand features + foundation PCA], or a blend
            context.log.info(f"{name}: choosing the head on the validation cut-off (network, LightGBM over hand "
                             f"features + the foundation's representation, or a blend)")
            head = fit_head(cache, spec, task, trunk_of(state, foundation["net"]), result.model, plan.train_cutoffs,
                            plan.val_cutoff, device=device, log=context.log.info)
        context.log.info("fitting the LightGBM baseline on hand-made features (same cut-offs)")
        lgbm = lightgbm_scores(cache, spec, task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff)
        holdout = score_holdout(result.model, cache, spec, task, plan.test_cutoff,
                                constant=result.info["val_target_mean"], extra={"lightgbm": lgbm}, device=device,
                                head=head)
        report = holdout.report
        key = headline(task)
        better = beats_baselines(task, report)
        context.log.info(f"{name}: {key} {report['model'].get(key, float('nan')):.4f} on {report['entities']:,} "
                         f"entities ({head_note(report, key)}); baselines "
                         + ", ".join(f"{b} {m.get(key, float('nan')):.4f}" for b, m in report["baselines"].items()))
        label_values = task_of(task).label_values(cache, task)
        path = workspace.scenario(name)
        digest = save_checkpoint(path, result.model, {
            "kind": "scenario", "scenario": name, "task": task.to_dict(), "label_values": label_values,
            "feature_spec": foundation["feature_spec"], "net": foundation["net"],
            "foundation_sha256": foundation["weights_sha256"], "cache_fingerprint": cache.fingerprint,
            "cache_lineage": cache.lineage,
            "protocol": {"test_cutoff": _iso(plan.test_cutoff), "val_cutoff": result.info["val_cutoff"],
                         "train_cutoffs": result.info["train_cutoffs"]},
            "metrics": report, "headline": key, "beats_baselines": better, "finetune": config_dict(cfg), "lora": lora,
            "curves": result.curves, "training": result.info,
            "head": {"chosen": "network", "weight": 0.0} if head is None else {"chosen": head.chosen,
                                                                                 "weight": head.weight},
        }, extra=None if head is None else lambda folder: {"stack": save_head(folder, head)})
        resume.clear()
        if better:  # predictions use the newest checkpoint that beat its baselines (habitus.assets.serving)
            promote(workspace, name)
        else:
            context.log.warning(f"{name}: the model does not beat its baselines on the hold-out; predictions keep "
                                f"using the {serving_note(workspace, name)}")
        plot = loss_curves(result.curves, path.parent / f"{name}_loss.png", f"scenario {name}")
        charts = {}
        if task_of(task).one_probability:  # a picture of the hold-out; never a reason for the asset to fail
            try:
                charts["calibration_and_lift"] = dg.MetadataValue.md(calibration_and_lift(
                    holdout.y, holdout.scores, path.parent / f"{name}_lift.png",
                    f"scenario {name}: hold-out ({len(holdout.y):,} entities)"))
            except Exception as e:  # noqa: BLE001
                context.log.warning(f"{name}: no calibration/lift chart ({type(e).__name__}: {e})")
        return dg.MaterializeResult(metadata={
            **charts,
            **metric_metadata(key, report),
            "fingerprint": digest[:16],
            "foundation_fingerprint": foundation["weights_sha256"][:16],
            key: dg.MetadataValue.float(report["model"].get(key, float("nan"))),
            "metrics": dg.MetadataValue.md(metrics_markdown(task, report)),
            "beats_baselines": dg.MetadataValue.bool(better),
            **head_metadata(key, report),
            "serving": serving_note(workspace, name),
            "holdout_entities": dg.MetadataValue.int(report["entities"]),
            "test_cutoff": _iso(plan.test_cutoff),
            "loss_curves": dg.MetadataValue.md(plot),
            "best_epoch": dg.MetadataValue.int(result.info["best_epoch"]),
            # where fine-tuning started: the task's own head, or the foundation's forecast (models/train/prior.py)
            "head_start": result.info.get("head_start", "baseline"),
            "seconds": dg.MetadataValue.float(result.info["seconds"]),
            "path": dg.MetadataValue.path(str(path)),
        })

    return _scenario


def head_note(report: dict, key: str) -> str:
    """Which head scored: "network alone", or the choice on validation and the network's own figure."""
    h = report.get("head")
    if not h:
        return "network alone"
    return f"head chosen on validation: {h['chosen']} (trees' weight {h['weight']}); network alone " \
           f"{report['network'].get(key, float('nan')):.4f}"


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


def _iso(ts: int) -> str:
    return np.datetime_as_string(np.datetime64(int(ts), "s")) + "Z"
