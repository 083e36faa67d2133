"""What bench/explain.py and bench/explain_cost.py both start from: the cache of a generated or
downloaded warehouse, a short foundation model, and each task fine-tuned on it, with the head chosen
on validation when asked (models/heads/stacked_head.py, as a scenario fits it)."""

from dataclasses import dataclass
from pathlib import Path

from habitus.models.cache import Cache, build_cache
from habitus.models.evaluate.holdout import protocol
from habitus.models.data.features import DAY, FeatureSpec
from habitus.models.heads.stacking import StackConfig
from habitus.models.train.config import TRAIN_CUTOFFS, FinetuneConfig, FoundationConfig, ScenarioConfig
from habitus.models.train.foundation import train_foundation
from habitus.models.train.scenario import train_scenario


@dataclass
class Setup:
    cache: Cache
    sources: dict  # column -> source name, as habitus.models.explain.column_sources gives a project's
    foundation: object  # TrainResult
    spec: FeatureSpec

    def vocab(self, column: str) -> list:
        return self.cache.vocab(column).column("value").to_pylist()


def setup(cspec, test_cutoff: int, folder: Path, foundation_epochs: int, hidden: int) -> Setup:
    """The cache of `cspec` under `folder` and a foundation model of `foundation_epochs` epochs, `hidden` wide,
    whose targets end before the test cut-off."""
    quiet = lambda _: None  # noqa: E731
    cache = Cache(build_cache(cspec, folder / "cache", log=quiet))
    sources = {c: t.name for t in cspec.events + cspec.entity_attributes + cspec.attributes for c in t.columns}
    sources["__events__"] = cspec.events[0].name
    fcfg = FoundationConfig(epochs=foundation_epochs, hidden=hidden)
    foundation = train_foundation(cache, fcfg, test_cutoff - fcfg.horizon_days * DAY, log=quiet)
    return Setup(cache, sources, foundation, FeatureSpec.from_dict(foundation.info["feature_spec"]))


def scenario(s: Setup, task, test_cutoff: int, epochs: int, trees_weight: float | None = None,
             stacked: bool = False):
    """(the fine-tuned network in eval mode, the head chosen on validation or None), trained by the scenario
    recipe (models/train/scenario.py) without its LightGBM baseline: with `stacked`, the head as a scenario
    chooses it; `trees_weight` forces its blend weight (the demo's churn serves trees weighted 0.8), else
    the choice is the validation cut-off's."""
    plan = protocol(test_cutoff, task.target.window_days, TRAIN_CUTOFFS, s.cache.time_range[0])
    head = "chosen" if stacked or trees_weight is not None else "network"
    cfg = ScenarioConfig("bench", task, plan.train_cutoffs, plan.val_cutoff, plan.test_cutoff,
                         FinetuneConfig(epochs=epochs), head=head, refit=False)
    stack = None if trees_weight is None else StackConfig(weights=(float(trees_weight),))
    run = train_scenario(s.cache, s.foundation.model.state_dict(), s.foundation.info, cfg, log=lambda _: None,
                         baselines=False, stack=stack)
    return run.trained.model.eval(), run.head
