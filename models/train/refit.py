"""The refit (ScenarioConfig.refit): after the recipe has chosen its epochs and its head on the
validation cut-off and the hold-out has measured them, the same recipe trained again on cut-offs
moved forward so that the newest training window is the newest complete one (the test window), and
served in place of the measured model.

Nothing is chosen again: the refit trains the recorded start and the recorded epochs (the greedy
soup's), averages those epochs' weights, and retrains the head's trees with the measured rounds and
blend weight. No target is read past the test window's end, which is the data's newest complete
window. The hold-out figures stay the measured model's: the served model is not the one measured,
and its checkpoint says so (config.json "refit").
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.chunks import day_floor
from habitus.models.data.features import DAY, FeatureSpec
from habitus.models.heads.stacked_head import HeadStack
from habitus.models.heads.stacked_rows import Rows, collect
from habitus.models.heads.stacking import refit_stack
from habitus.models.train.config import ScenarioConfig
from habitus.models.train.finetune import Fixed
from habitus.models.train.loop import Log, TrainResult, iso
from habitus.models.train.recipe import Training, fine_tune


@dataclass
class Refit:
    """The served model: the network trained again on `cutoffs` and its head (None: the network alone)."""
    trained: TrainResult
    head: HeadStack | None
    cutoffs: tuple[int, ...]

    def record(self) -> dict:
        """config.json's "refit": what was trained again and on which cut-offs."""
        info = self.trained.info
        return {"refit": True, "train_cutoffs": [iso(c) for c in self.cutoffs], "epochs": info["epochs"],
                "processes": info.get("processes", 1), "precision": info.get("precision", "fp32"),
                "soup_epochs": info["soup_epochs"], "head_start": info["head_start"],
                "head": ({"chosen": "network", "weight": 0.0} if self.head is None
                         else {"chosen": self.head.chosen, "weight": self.head.weight}),
                "holdout": "the measured model's (trained on the protocol's cut-offs), not this one's"}


def refit_cutoffs(cfg: ScenarioConfig) -> tuple[int, ...]:
    """The training cut-offs moved forward so that the newest is the test cut-off: its window, the
    test window, is the newest complete one. As many cut-offs as the recipe's, as far apart."""
    shift = cfg.test_cutoff - max(cfg.train_cutoffs)
    return tuple(c + shift for c in cfg.train_cutoffs)


def data_end(cache: Cache) -> int:
    """The end of the newest complete day of the data: no target window may end after it."""
    return day_floor(cache.time_range[1]) + DAY


def refit_skipped(cache: Cache, cfg: ScenarioConfig, info: dict) -> str | None:
    """Why a measured run is not trained again (None: it is): a second stage chosen on validation, or a
    test window (a `test_cutoff:` of the config's) that ends after the data's newest complete day."""
    if info.get("second_stage"):
        return "its second stage (re-ranking trees) is chosen on validation"
    if cfg.test_cutoff + cfg.task.target.window_days * DAY > data_end(cache):
        return "the test window ends after the data's newest complete day"
    return None


def refit(cache: Cache, foundation_state: dict, foundation_info: dict, cfg: ScenarioConfig, measured: TrainResult,
          head: HeadStack | None, *, device: str, log: Log = print,
          launch: Callable[[Training], TrainResult] | None = None) -> Refit:
    """The recipe of `measured` (its start, its soup's epochs) and of `head` (its trees' rounds and
    weight) trained again on refit_cutoffs(cfg); nothing chosen, nothing scored on validation.
    `launch`: what trained the measured network (the executor: the same processes, precision and
    resume); None: in this process."""
    cutoffs = refit_cutoffs(cfg)
    window = cfg.task.target.window_days * DAY
    if max(cutoffs) + window > data_end(cache):
        raise ValueError(f"{cfg.name}: the refit's newest window ends {np.datetime64(max(cutoffs) + window, 's')}, "
                         f"after the data's newest complete day ({np.datetime64(data_end(cache), 's')})")
    info = measured.info
    fixed = Fixed(info.get("head_start", "baseline"), tuple(info["soup_epochs"]))
    log(f"{cfg.name}: refit on the cut-offs {', '.join(iso(c)[:10] for c in cutoffs)} (start {fixed.start}, "
        f"epochs averaged {list(fixed.soup)}; nothing chosen on validation)")
    t = Training(cfg, cutoffs, fixed)
    trained = launch(t) if launch is not None else fine_tune(cache, foundation_state, foundation_info, t,
                                                             device=device, log=log)
    served = None
    if head is not None and head.weight == 0:  # the network alone serves: the trees are never read
        served = head
    elif head is not None:
        spec = FeatureSpec.from_dict(foundation_info["feature_spec"])
        dev = "cpu" if device == "auto" else device
        parts = [collect(cache, spec, cfg.task, head.trunk, c, labels=head.labels, device=dev) for c in cutoffs]
        rows = Rows(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("entities", "hand", "embedding", "y")))
        served = HeadStack(refit_stack(head.stack, rows), head.trunk)
        log(f"{cfg.name}: refit head {served.chosen} (trees' weight {served.weight}) on {len(rows):,} rows")
    return Refit(trained, served, cutoffs)
