"""foundation_model: the self-supervised model of behaviour, trained on the cache. The foundation in
use, trained on the same cache version with the same settings and cut-off, is not trained again."""

import calendar

import dagster as dg

from habitus.assets.cache import CACHE_KEY, current_cache
from habitus.assets.foundation_versions import foundation_versions, keep_foundation_version
from habitus.assets.plots import loss_curves
from habitus.assets.tracking import check_installed, complete_foundation_record, track_foundation
from habitus.models.nn.checkpoint import save_checkpoint
from habitus.models.train.recipe import foundation_job
from habitus.models.train.resume import Resumer
from habitus.models.storage.files import combine, read_json
from habitus.models.data.features import DAY
from habitus.models.train.loop import day_floor
from habitus.models.train.config import config_dict
from habitus.resources.training.executor import TrainingExecutor
from habitus.resources.store.workspace import Workspace, locked

FOUNDATION_KEY = dg.AssetKey("foundation_model")


def test_cutoff(project, cache) -> int:
    """The hold-out cut-off: the config's, or the latest one whose longest window still fits the data."""
    if project.test_cutoff is not None:
        return calendar.timegm(project.test_cutoff.timetuple())
    longest = max([project.foundation.horizon] + [sc.target.within for sc in project.scenarios.values()])
    return day_floor(cache.time_range[1]) + DAY - longest * DAY


def build_foundation_asset(project, op_tags: dict | None = None, node_group=None) -> dg.AssetsDefinition:
    """`op_tags`: the training step's tags from the wiring (on Kubernetes its GPU pod, pipelines/orchestration/kubernetes.py);
    `node_group(what)`: TrainingExecutor.train's `group` on several nodes, or None (pipelines/orchestration/kubernetes_nodes.py)."""
    @dg.asset(key=FOUNDATION_KEY, deps=[CACHE_KEY], group_name="training", kinds={"pytorch", "safetensors"},
              op_tags=op_tags or {},
              description="Self-supervised model: predicts each entity's next window from its history")
    @locked("foundation")
    def foundation_model(context: dg.AssetExecutionContext, workspace: Workspace,
                         executor: TrainingExecutor) -> dg.MaterializeResult:
        check_installed(project.mlflow)
        cache = current_cache(workspace)
        device = executor.setup()
        cfg = project.foundation.config()
        cutoff = test_cutoff(project, cache)
        last_cutoff = cutoff - cfg.horizon_days * DAY  # its targets end where the hold-out begins
        trained_on = combine(cache.fingerprint, config_dict(cfg), last_cutoff)
        in_use = workspace.foundation / "config.json"
        saved = read_json(in_use) if in_use.exists() else {}
        if saved.get("trained_on") == trained_on:
            fp = saved["weights_sha256"][:16]
            why = (f"foundation_model: not trained again: checkpoint {fp} was trained on the same cache version "
                   f"({cache.fingerprint[:16]}), settings and cut-off")
            context.log.info(why)
            if fp not in foundation_versions(workspace).fingerprints():
                # a run killed after saving the checkpoint, before keeping it as a version: keep it now
                keep_foundation_version(workspace, project.versions.keep, project.versions.keep_served)
            complete_foundation_record(project.mlflow, saved["weights_sha256"], saved, context.log.warning)
            return dg.MaterializeResult(metadata={"trained": dg.MetadataValue.bool(False), "skipped": why,
                                                  "fingerprint": fp, "cache_fingerprint": cache.fingerprint[:16]})
        # in this process or under torchrun (rank 0's result comes back); a killed run continues from its
        # last saved state (same cache, config, cut-off and processes only)
        folder = workspace.resume("foundation")
        group = node_group("foundation") if node_group else None  # several nodes: an indexed Job of pods
        result = executor.train(foundation_job(cache, cfg, last_cutoff, device), device, log=context.log.info,
                                resume=(folder, project.foundation.save_every_steps), group=group)
        info = result.info
        # drawn before the checkpoint is saved: a saved checkpoint is not trained again, so its picture must exist
        plot = loss_curves(result.curves, workspace.foundation.parent / "foundation_loss.png", "foundation model")
        digest = save_checkpoint(workspace.foundation, result.model, {
            "kind": "foundation", "config": config_dict(cfg), "cache_fingerprint": cache.fingerprint,
            "trained_on": trained_on,  # what a later run compares: the same is not trained again
            "cache_lineage": cache.lineage,
            "feature_spec": info["feature_spec"], "net": info["net"], "targets_width": info["targets_width"],
            "profile": info["profile"],  # the embeddings' projection (habitus.models.nn.profile)
            "data_window": {"first_cutoff": info["cutoffs"][0], "last_cutoff": info["cutoffs"][-1],
                            "last_target_time": info["last_target_time"]},
            "curves": result.curves, "training": {k: info[k] for k in ("events_seen", "entities_seen", "seconds",
                                                                        "steps", "device")},
        })
        Resumer(folder, "").clear()
        # kept as a version and served (no gate: a foundation has no baseline); `habitus rollback foundation`
        version = keep_foundation_version(workspace, project.versions.keep, project.versions.keep_served)
        track_foundation(project.mlflow, digest, read_json(workspace.foundation / "config.json"), context.log.warning)
        return dg.MaterializeResult(metadata={
            "fingerprint": digest[:16], "trained": dg.MetadataValue.bool(True),
            "version": f"checkpoints/foundation_versions/{version} (serving)",
            "cache_fingerprint": cache.fingerprint[:16],
            "final_train_loss": dg.MetadataValue.float(result.curves["train_loss"][-1]),
            "final_validation_loss": dg.MetadataValue.float(result.curves["val_loss"][-1]),
            "loss_curves": dg.MetadataValue.md(plot),
            "cutoffs": dg.MetadataValue.int(len(info["cutoffs"])),
            "data_window": f"{info['cutoffs'][0]} .. {info['last_target_time']}",
            "entities_per_second": dg.MetadataValue.float(round(info["entities_seen"] / max(info["seconds"], 1e-9), 1)),
            "events_per_second": dg.MetadataValue.float(round(info["events_seen"] / max(info["seconds"], 1e-9), 1)),
            "parameters": dg.MetadataValue.int(sum(p.numel() for p in result.model.parameters())),
            "device": info["device"],
            "seconds": dg.MetadataValue.float(info["seconds"]),
            "path": dg.MetadataValue.path(str(workspace.foundation)),
        })

    return foundation_model
