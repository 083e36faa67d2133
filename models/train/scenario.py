"""A scenario's recipe, from the foundation checkpoint to a scored and saved model: fine-tune the
network (every weight, or LoRA adapters on the frozen trunk), choose the head on the validation
cut-off (the network, trees over [hand features + the foundation's representation], or their
blend), fit the LightGBM baseline on the same cut-offs, score all of them on the hold-out and save
the checkpoint with its report. The scenario assets, bench/quality.py and the explanation benches
run this one function."""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.features import FeatureSpec
from habitus.models.evaluate.baselines import lightgbm_scores
from habitus.models.evaluate.holdout import LOWER_IS_BETTER, Holdout, headline, score_holdout
from habitus.models.heads.stacked_head import HeadStack, fit_head, save_head
from habitus.models.heads.stacking import StackConfig
from habitus.models.nn.checkpoint import save_checkpoint
from habitus.models.nn.network import load_trunk
from habitus.models.tasks import task as task_of
from habitus.models.train.config import ScenarioConfig, config_dict
from habitus.models.train.distributed import autocast
from habitus.models.train.loop import Log, TrainResult, iso, resolve_device
from habitus.models.train.recipe import MODES, Training, fine_tune, fingerprint
from habitus.models.train.refit import Refit, refit, refit_skipped
from habitus.models.train.resume import Resumer


@dataclass
class ScenarioRun:
    """What the recipe made: the fine-tuned network (adapters merged), the head chosen on validation
    (None: the network alone), the hold-out, and where the checkpoint went."""
    trained: TrainResult
    head: HeadStack | None
    holdout: Holdout
    seconds: dict[str, float] = field(default_factory=dict)  # fine-tuning, head, baselines, hold-out
    checkpoint: dict | None = None  # the config.json written (None: not saved)
    digest: str | None = None  # the saved weights' SHA-256
    refit: Refit | None = None  # cfg.refit: the served model, trained again through the test cut-off
    # the served model's scores of the hold-out's entities (the refit's where there is one): what the
    # score drift check compares each day's scores with (not a measure of quality: the refit saw them)
    served_scores: np.ndarray | None = None

    @property
    def served(self) -> tuple:
        """(network, head) of the model served: the refit's, else the measured one's."""
        return (self.trained.model, self.head) if self.refit is None else (self.refit.trained.model, self.refit.head)

    @property
    def report(self) -> dict:
        """The hold-out metrics: "model" (the chosen head's), "baselines", "entities", and with a head
        "network" (the network alone) and "head" (the candidates' figures)."""
        return self.holdout.report


def train_scenario(cache: Cache, foundation_state: dict, foundation_info: dict, cfg: ScenarioConfig, *,
                   path: str | Path | None = None, device: str = "auto", log: Log = print, precision: str = "fp32",
                   resume_dir: str | Path | None = None, launch: Callable[[Training], TrainResult] | None = None,
                   train_cache: Cache | None = None, baselines: bool = True,
                   stack: StackConfig | None = None) -> ScenarioRun:
    """The scenario `cfg` fine-tuned from the foundation checkpoint (`foundation_state`, `foundation_info`
    as models/nn/checkpoint.load_checkpoint reads them), its head chosen on validation, scored on the
    hold-out at cfg.test_cutoff next to its baselines; with `path`, saved there as a checkpoint.

    `precision`: fp32, or bf16 (torch.autocast around the loop, fp32 master weights).
    `resume_dir`: a killed run continues from its last state saved there, a folder per training
    (scenario, refit; every cfg.save_every_steps steps; the same foundation, task, settings and
    cut-offs only); cleared once the checkpoint is written.
    `launch`: trains the network of a Training (the measured run, then the refit) and returns its
    result: resources/training/executor.py's TrainingExecutor.train, in this process or under torchrun, with its
    own precision and resume folder; None: in this process with `precision` and `resume_dir`. `train_cache`: the entities whose labels train the network, the
    head and the trees (default `cache`; the hold-out always scores every entity of `cache`).
    `baselines`: False leaves LightGBM out (the task's own simple baselines stay). `stack`: the candidates of the
    head chosen on validation (models/heads/stacking.py; default StackConfig()). `cfg.refit`: after the
    hold-out, the chosen recipe is trained again on cut-offs through cfg.test_cutoff and that model is
    saved and served (models/train/refit.py); the report stays the measured model's."""
    train = cache if train_cache is None else train_cache
    device = str(resolve_device(device))

    def in_process(t: Training) -> TrainResult:
        # a killed run continues from its last saved state (same foundation, task, config and cut-offs only)
        resume = None if resume_dir is None else Resumer(
            Path(resume_dir, t.mode), fingerprint(foundation_info["weights_sha256"], t, precision, 1),
            every_steps=cfg.save_every_steps, log=log)
        with autocast(precision, device):  # bf16: torch.autocast around the loop, fp32 master weights
            return fine_tune(train, foundation_state, foundation_info, t, device=device, log=log, resume=resume)

    launch = launch or in_process
    clock = Clock()
    trained = launch(Training(cfg))
    seconds = {"finetune": clock.lap()}
    spec = FeatureSpec.from_dict(foundation_info["feature_spec"])
    task = cfg.task
    head = None
    if task_of(task).stackable and cfg.head == "chosen":
        log(f"{cfg.name}: choosing the head on the validation cut-off (network, LightGBM over hand features + the "
            f"foundation's representation, or a blend)")
        head = fit_head(train, spec, task, load_trunk(foundation_state, foundation_info["net"]), trained.model,
                        cfg.train_cutoffs, cfg.val_cutoff, cfg=stack, device=device, log=log)
    seconds["head"] = clock.lap()
    extra = {}
    if baselines:
        log("fitting the LightGBM baseline on hand-made features (same cut-offs)")
        extra["lightgbm"] = lightgbm_scores(cache, spec, task, cfg.train_cutoffs, cfg.val_cutoff, cfg.test_cutoff)
    seconds["baselines"] = clock.lap()
    holdout = score_holdout(trained.model, cache, spec, task, cfg.test_cutoff,
                            constant=trained.info["val_target_mean"], extra=extra, device=device, head=head)
    seconds["holdout"] = clock.lap()
    served = None
    if cfg.refit and refit_skipped(train, cfg, trained.info):
        log(f"{cfg.name}: no refit ({refit_skipped(train, cfg, trained.info)}): the measured model is served")
    elif cfg.refit:  # the same recipe on cut-offs through the test cut-off; the hold-out stays the measured one's
        served = refit(train, foundation_state, foundation_info, cfg, trained, head, device=device, log=log,
                       launch=launch)
        seconds["refit"] = clock.lap()
    served_scores = holdout.scores if served is None else score_holdout(
        served.trained.model, cache, spec, task, cfg.test_cutoff, constant=trained.info["val_target_mean"],
        device=device, head=served.head).scores
    run = ScenarioRun(trained, head, holdout, {k: round(v, 2) for k, v in seconds.items()}, refit=served,
                      served_scores=served_scores)
    key = headline(task)
    log(f"{cfg.name}: {key} {run.report['model'].get(key, float('nan')):.4f} on {run.report['entities']:,} entities "
        f"({head_note(run.report, key)}); baselines "
        + ", ".join(f"{b} {m.get(key, float('nan')):.4f}" for b, m in run.report["baselines"].items()))
    if path is not None:
        save_scenario(run, cache, foundation_info, cfg, path)
        for mode in MODES if resume_dir is not None else ():
            Resumer(Path(resume_dir, mode), "").clear()
    return run


class Clock:
    """Seconds between laps."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds


def save_scenario(run: ScenarioRun, cache: Cache, foundation_info: dict, cfg: ScenarioConfig, path) -> None:
    """The checkpoint folder (models/nn/checkpoint.py): the weights, the head chosen on validation and a
    config.json that says what the model is, what it was trained on and how it scored."""
    task, info = cfg.task, run.trained.info
    model, head = run.served
    key = headline(task)
    config = {
        "kind": "scenario", "scenario": cfg.name, "task": task.to_dict(),
        "label_values": task_of(task).label_values(cache, task),
        "feature_spec": foundation_info["feature_spec"], "net": foundation_info["net"],
        "foundation_sha256": foundation_info["weights_sha256"], "cache_fingerprint": cache.fingerprint,
        "cache_lineage": cache.lineage,
        "protocol": {"test_cutoff": iso(cfg.test_cutoff), "val_cutoff": info["val_cutoff"],
                     "train_cutoffs": info["train_cutoffs"]},
        "metrics": run.report, "headline": key, "beats_baselines": beats_baselines(task, run.report),
        "finetune": config_dict(cfg.finetune), "lora": config_dict(cfg.lora) if cfg.lora else None,
        "curves": run.trained.curves, "training": info,
        "head": ({"chosen": "network", "weight": 0.0} if run.head is None
                 else {"chosen": run.head.chosen, "weight": run.head.weight}),
        # the weights saved are the refit's: "metrics" and "head" above are the measured model's
        **({"refit": run.refit.record()} if run.refit is not None else {}),
    }
    run.digest = save_checkpoint(path, model, config,
                                 extra=None if head is None else lambda folder: {"stack": save_head(folder, head)})
    run.checkpoint = config


def beats_baselines(task, report: dict) -> bool:
    """Whether the model beats every baseline on the task's headline metric at the hold-out."""
    key = headline(task)
    model = report["model"].get(key, float("nan"))
    # a baseline scored on a subset of the labels (LightGBM on a wide head) carries the model's value there
    pairs = [(m.get(f"model_{key}", model), m.get(key, float("nan"))) for m in report["baselines"].values()]
    pairs = [(mine, other) for mine, other in pairs if not math.isnan(other)]
    if math.isnan(model) or not pairs:
        return False
    return all(mine < other if key in LOWER_IS_BETTER else mine > other for mine, other in pairs)


def head_note(report: dict, key: str) -> str:
    """Which head scored: "network alone", or the choice on validation and the network's own figure."""
    h = report.get("head")
    if not h:
        return "network alone"
    return f"head chosen on validation: {h['chosen']} (trees' weight {h['weight']}); network alone " \
           f"{report['network'].get(key, float('nan')):.4f}"


def metrics_table(report: dict) -> str:
    """The hold-out metrics of the model and of each baseline as a Markdown table."""
    rows = [("model", report["model"])] + list(report["baselines"].items())
    keys = list(report["model"])
    lines = ["| | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{m.get(k, float('nan')):.4f}" for k in keys) + " |" for name, m in rows]
    for name, m in report["baselines"].items():  # a baseline of some labels only: the model on the same labels
        if any(k.startswith("model_") for k in m):
            lines.append(f"| model, on the labels of {name} | "
                         + " | ".join(f"{m.get(f'model_{k}', float('nan')):.4f}" for k in keys) + " |")
    return "\n".join(lines)
