"""The settings of training, declared once: the foundation model's (FoundationConfig), a scenario's
fine-tuning (FinetuneConfig), its LoRA adapters (LoraConfig) and the whole scenario as its recipe
takes it (ScenarioConfig, models/train/scenario.py). Their defaults live here only; pipelines/config/project.py
reads them without torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

from habitus.models.data.chunks import CHUNK_ENTITIES
from habitus.models.data.features import HALF_LIVES

if TYPE_CHECKING:  # (the task's module imports torch; the settings are read without it)
    from habitus.models.tasks.spec import TaskSpec

SAVE_EVERY_STEPS = 200  # optimizer steps between two saves of a resumable training state (models/train/resume.py)
# serve the recipe trained again on cut-offs through the test cut-off (models/train/refit.py), not the
# measured model: better on the next window for propensity (three datasets) and spend (two), churn level
# (bench/refit_backtest.py; docs/results/quality.md, "Refit or not")
REFIT = True
TRAIN_CUTOFFS = 4  # a scenario's training cut-offs before its validation cut-off (models/evaluate/holdout.protocol)


@dataclass
class FoundationConfig:
    horizon_days: int = 14
    cutoff_every_days: int = 7
    hidden: int = 256
    layers: int = 2
    epochs: int = 3
    batch_size: int = 512
    learning_rate: float = 2e-3
    buckets: int = 256
    # a long tail's buckets group related values (co-occurrence clusters, models/data/related.py)
    # instead of hashing them by id: what the trunk reads and forecasts of rare products
    related_buckets: bool = True
    seed: int = 0
    cutoffs_per_chunk: int = 2  # cut-offs sampled for each chunk of entities in each epoch
    chunk_entities: int = CHUNK_ENTITIES
    min_history_days: int = 28
    # inputs are divided by max(std, floor): a small floor blows rare histogram buckets up to huge
    # values and the model overfits them (Ta-Feng churn: docs/results/quality.md, "Defaults")
    std_floor: float = 1.0
    dropout: float = 0.1
    half_lives: tuple[float, ...] = HALF_LIVES  # days: decayed counts per value at each of these
    # quantile bins of the piecewise-linear scalar inputs (network.NetConfig.ple_bins; 0: off): a little
    # better churn and propensity on Ta-Feng and the demo (docs/results/quality.md, "Defaults")
    ple_bins: int = 16
    # the sequence encoder (models/nn/sequence.py) over each entity's last `sequence_events` events
    # (0: the aggregate trunk alone), pretrained with the next-window forecast plus, at weight
    # `masked_events_weight`, the masked-event objective on a share `masked_events` of them (0: off)
    sequence_events: int = 0
    sequence_dim: int = 32
    sequence_layers: int = 1
    masked_events: float = 0.15
    masked_events_weight: float = 0.1
    # a contrastive objective beside the forecast (models/train/contrastive.py), at this weight (0: off):
    # each entity's full history against a view keeping a share `contrastive_keep` of its events. The
    # demo's weak foundation seed stops being weak, the embeddings gain on Ta-Feng and the demo; the
    # foundation takes 1.7x as long (docs/journal/quality.md, "Telling entities apart")
    contrastive_weight: float = 0.1
    contrastive_keep: float = 0.5


@dataclass
class FinetuneConfig:
    epochs: int = 6
    learning_rate: float = 1e-3
    batch_size: int = 512
    chunk_entities: int = CHUNK_ENTITIES
    weight_decay: float = 1e-4
    seed: int = 0
    # the features of every (chunk, cut-off) are computed once: kept in memory up to
    # `memory_budget_bytes` (validation's first), then written to files in `spill_dir` (None: the
    # system's temporary folder) up to `spill_budget_bytes` and read back at each epoch, then computed
    # again at each use. A larger memory budget made the peak grow with the data; a file costs a read
    # from the page cache (docs/results/speed.md, "Defaults").
    memory_budget_bytes: int = 512 << 20
    spill_budget_bytes: int = 16 << 30
    spill_dir: str | None = None
    soup: bool = True  # average the weights of the epochs that help on validation (greedy soup)
    # the learning rate of the per-label history weights, relative to the head's: they must travel far
    # in a few hundred steps (propensity on Ta-Feng and the demo, 1x / 10x / 30x: docs/journal/quality.md)
    label_skip_lr_scale: float = 30.0
    # the learning rate of the pairwise scorer's label embeddings, relative to the head's
    pair_label_lr_scale: float = 1.0
    # the pretrained trunk's learning rate, relative to the head's (demo churn over three seeds: no
    # difference beyond the seeds' between 0.1 and 1.0; docs/journal/quality.md)
    trunk_lr_scale: float = 0.3
    # multilabel heads wider than `sampled_above_labels` train on the labels of each batch's positives
    # plus `sampled_negatives` other labels drawn uniformly per batch (sampled_multilabel_loss): the
    # head's matrix products shrink by labels / columns (docs/results/speed.md, "Defaults"); narrow
    # heads (Ta-Feng's 50 brands) keep the full loss. Validation samples `val_sampled_negatives` per
    # batch with a fixed seed (the same labels at every epoch). 0 negatives: the full loss everywhere.
    sampled_negatives: int = 1024
    sampled_above_labels: int = 2048
    val_sampled_negatives: int = 2048
    val_sampled_rows: int = 32768  # sampled heads: about this many validation rows pick the epochs
    # sampled heads train and validate with their matrix products in bfloat16 (torch.autocast; the
    # weights, their updates and the losses stay float32) where the hardware multiplies bf16 natively
    # (CUDA with bf16, CPUs with AVX-512 BF16 or AMX): about half the CPU time of the 16k fine-tuning,
    # the same epochs chosen and the same macro AUROC to the fourth decimal (docs/journal/speed.md)
    sampled_bf16: bool = True
    # a second starting point for heads the foundation already forecasts (churn, propensity over a
    # categorical column): its own forecast, recalibrated (models/train/prior.py); validation chooses
    foundation_start: bool = True
    # recommendation: re-ranking trees over the network's best items, kept where they win on validation
    # (models/tasks/rerank.py; LightGBM)
    second_stage: bool = True


@dataclass
class LoraConfig:
    """Low-rank adapters on the frozen foundation trunk (models/nn/lora.py): rank r adds r * (in + out)
    numbers per Linear layer, scaled by alpha / r."""
    rank: int = 8
    alpha: float = 16.0


@dataclass
class ScenarioConfig:
    """One scenario as its recipe (models/train/scenario.py) trains it: the task, the cut-offs of the
    protocol (models/evaluate/holdout.py), the fine-tuning settings and the choices around them."""
    name: str
    task: TaskSpec
    train_cutoffs: tuple[int, ...]  # the labels that train the network and the trees, oldest first
    val_cutoff: int  # what picks the epochs, the soup and the head
    test_cutoff: int  # the hold-out: read by the report only
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    lora: LoraConfig | None = None  # None: every weight fine-tuned
    save_every_steps: int = SAVE_EVERY_STEPS
    # chosen: the network, trees over [hand features + the foundation's representation] or their blend,
    # whichever scores best on validation (tasks with a stack); network: the network alone
    head: Literal["chosen", "network"] = "chosen"
    from_scratch: bool = False  # a random trunk (the foundation's input scaling kept): what pretraining is worth
    # after the hold-out, train the chosen recipe again on cut-offs through test_cutoff and serve that
    # (models/train/refit.py); the hold-out stays the measured model's
    refit: bool = REFIT


def config_dict(cfg) -> dict:
    return asdict(cfg)
