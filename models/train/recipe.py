"""Every training habitus runs, as one entry: a `Training` (the foundation's, a scenario's measured
fine-tuning, or its refit) is written as a job (a JSON dict) and trained by `run_training`, the same
function in the asset's own process, in every rank under torchrun, and on every node of a cluster
(resources/training/executor.py runs it; models/train/launch.py is what torchrun starts). One place, then, turns a
ScenarioConfig into `finetune`'s arguments, merges LoRA adapters, applies the precision (bf16:
torch.autocast around the loop, fp32 master weights) and resumes a killed run from its saved state.

    job = scenario_job(cache, foundation_path, sha256, Training(cfg), device)   # or Training(cfg, cutoffs, fixed)
    result = run_training(job, dist, log)                                      # any rank, any process count

A resumable run saves into job["resume"]["folder"] every job["resume"]["every_steps"] optimizer steps
(models/train/resume.py); the state is continued only by a run of the same job and the same number of
processes (both are in its fingerprint). Fine-tuning resumes in any number of processes; the
foundation's loop, which saves between chunks, in one only.
"""

from dataclasses import dataclass
from pathlib import Path

from habitus.models.cache import Cache
from habitus.models.nn.checkpoint import load_checkpoint
from habitus.models.nn.lora import merge_lora
from habitus.models.storage.files import combine
from habitus.models.tasks.spec import TaskSpec
from habitus.models.train.config import (FinetuneConfig, FoundationConfig, LoraConfig, ScenarioConfig,
                                         config_dict)
from habitus.models.train.distributed import Dist, autocast
from habitus.models.train.finetune import Fixed, finetune
from habitus.models.train.foundation import train_foundation
from habitus.models.train.loop import Log, TrainResult
from habitus.models.train.resume import Resumer


MODES = ("scenario", "refit")


@dataclass(frozen=True)
class Training:
    """A scenario's network as one training trains it: the measured run (`cutoffs` None: the
    protocol's, the epochs chosen on cfg.val_cutoff) or the refit (`cutoffs` moved forward and the
    recipe `fixed`: nothing chosen, models/train/refit.py)."""
    cfg: ScenarioConfig
    cutoffs: tuple[int, ...] | None = None
    fixed: Fixed | None = None

    @property
    def mode(self) -> str:
        return "scenario" if self.fixed is None else "refit"

    @property
    def train_cutoffs(self) -> list[int]:
        return list(self.cfg.train_cutoffs if self.cutoffs is None else self.cutoffs)

    @property
    def val_cutoff(self) -> int:
        # (the refit reads the newest training cut-off for the head's base rates only: a training target)
        return int(self.cfg.val_cutoff if self.cutoffs is None else max(self.cutoffs))


def fine_tune(cache: Cache, foundation_state: dict, foundation_info: dict, t: Training, *, device: str, log: Log,
              resume: Resumer | None = None, dist: Dist | None = None) -> TrainResult:
    """The scenario's network for `t`: LoRA adapters (merged into plain weights for scoring) or every weight."""
    cfg = t.cfg
    if cfg.lora is not None:
        log(f"{cfg.name}: LoRA rank {cfg.lora.rank}, alpha {cfg.lora.alpha}")
    result = finetune(cache, foundation_state, foundation_info, cfg.task, t.train_cutoffs, t.val_cutoff, cfg.finetune,
                      device=device, log=log, from_scratch=cfg.from_scratch, adapters=cfg.lora, resume=resume,
                      dist=dist, fixed=t.fixed)
    if cfg.lora is not None:
        result.model = merge_lora(result.model)
    return result


def fingerprint(foundation_sha256: str, t: Training, precision: str, world: int) -> str:
    """What a saved training state must match to be continued: the foundation, the scenario's
    settings, the cut-offs, the fixed recipe, the precision and the number of processes."""
    cfg = t.cfg
    return combine(foundation_sha256, cfg.task.to_dict(), config_dict(cfg.finetune),
                   config_dict(cfg.lora) if cfg.lora else None, cfg.from_scratch, t.train_cutoffs, t.val_cutoff,
                   config_dict(t.fixed) if t.fixed else None, precision, world)


# --------------------------------------------------------------------------- jobs: what every process reads


def foundation_job(cache, cfg: FoundationConfig, last_cutoff: int, device: str) -> dict:
    return {"kind": "foundation", "cache": str(cache.path), "cache_fingerprint": cache.fingerprint,
            "config": config_dict(cfg), "last_cutoff": int(last_cutoff), "device": device}


def scenario_job(cache, foundation_path, foundation_sha256: str, t: Training, device: str) -> dict:
    cfg = t.cfg
    return {"kind": "scenario", "mode": t.mode, "cache": str(cache.path), "cache_fingerprint": cache.fingerprint,
            "foundation": str(foundation_path), "foundation_sha256": foundation_sha256,
            "scenario": {"name": cfg.name, "task": cfg.task.to_dict(), "train_cutoffs": [int(c) for c in cfg.train_cutoffs],
                         "val_cutoff": int(cfg.val_cutoff), "test_cutoff": int(cfg.test_cutoff),
                         "finetune": config_dict(cfg.finetune), "lora": config_dict(cfg.lora) if cfg.lora else None,
                         "from_scratch": cfg.from_scratch},
            "cutoffs": None if t.cutoffs is None else [int(c) for c in t.cutoffs],
            "fixed": None if t.fixed is None else {"start": t.fixed.start, "soup": list(t.fixed.soup)},
            "device": device}


def training_of(job: dict) -> Training:
    s = job["scenario"]
    cfg = ScenarioConfig(s["name"], TaskSpec.from_dict(s["task"]), tuple(s["train_cutoffs"]), s["val_cutoff"],
                         s["test_cutoff"], FinetuneConfig(**s["finetune"]),
                         LoraConfig(**s["lora"]) if s["lora"] else None, from_scratch=s["from_scratch"])
    fixed = job.get("fixed")
    return Training(cfg, None if job.get("cutoffs") is None else tuple(job["cutoffs"]),
                    None if fixed is None else Fixed(fixed["start"], tuple(fixed["soup"])))


def with_resume(job: dict, folder, every_steps: int) -> dict:
    """`job`, resumable: its state saved in `folder` every `every_steps` optimizer steps."""
    return {**job, "resume": {"folder": str(folder), "every_steps": int(every_steps)}}


def run_training(job: dict, dist: Dist, log: Log) -> tuple[TrainResult, dict]:
    """Every rank (or the one process): the job's training on its share of the data, under the job's
    precision, continued from its saved state when it has one; returns the result and the feature
    spec its model reads."""
    cache = Cache(job["cache"])
    if cache.fingerprint != job["cache_fingerprint"]:
        raise RuntimeError(f"the cache at {job['cache']} is not the version the asset chose "
                           f"({cache.fingerprint[:16]} != {job['cache_fingerprint'][:16]})")
    precision = job.get("precision", "fp32")
    if job["kind"] == "foundation":
        cfg = FoundationConfig(**{**job["config"], "half_lives": tuple(job["config"]["half_lives"])})
        resume = _resumer(job, combine(cache.fingerprint, config_dict(cfg), job["last_cutoff"], precision, dist.world),
                          dist, log)
        if resume is not None and dist.enabled:  # (its loop saves between chunks, where the ranks are not together)
            log("the foundation's training in several processes is not resumable: a killed run starts afresh")
            resume = None
        with autocast(precision, dist.device):
            result = train_foundation(cache, cfg, job["last_cutoff"], device=dist.device, log=log, dist=dist,
                                      resume=resume)
        spec = result.info["feature_spec"]
    else:
        state, foundation = load_checkpoint(job["foundation"])
        if foundation["weights_sha256"] != job["foundation_sha256"]:
            raise RuntimeError(f"the foundation checkpoint at {job['foundation']} changed after the asset read it; "
                               f"materialize the scenario again")
        t = training_of(job)
        resume = _resumer(job, fingerprint(job["foundation_sha256"], t, precision, dist.world), dist, log)
        with autocast(precision, dist.device):
            result = fine_tune(cache, state, foundation, t, device=dist.device, log=log, resume=resume, dist=dist)
        spec = foundation["feature_spec"]
    result.info["precision"] = precision
    return result, spec


def writes(job: dict, dist) -> bool:
    """Whether this rank writes the result and the resumable state: rank 0, and with "every_node" (nodes
    that each read their own job folder) the first process of every node."""
    return dist.is_writer or bool(job.get("every_node") and dist.local_rank == 0)


def _resumer(job: dict, fp: str, dist: Dist, log: Log) -> Resumer | None:
    r = job.get("resume")
    if r is None:
        return None
    return Resumer(Path(r["folder"]), fp, every_steps=r["every_steps"], log=log if dist.is_writer else (lambda _: None),
                   dist=dist, writes=writes(job, dist))
