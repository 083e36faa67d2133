"""The profile the `embeddings` asset writes: the trunk's leading principal components (unit variance)
and, where the population can carry them, the entity's standardized RFM / visit scalars.

Why compact: other teams read the profile with a default linear reader (standardized inputs, L2 at
C = 1). That reader over-fits the trunk's 256 floats: on MovieLens (471 entities) it read churn at
0.7326 from them against 0.8179 from the scalars alone, and on Ta-Feng a 16-32 component projection
read more than the 256 floats (0.7564 vs 0.7526; docs/journal/quality.md, "A compact embedding for a
default reader"). So the width follows the population: about ROWS_PER_COLUMN entities per column,
the scalars appended only where they leave room for MIN_COMPONENTS_WITH_SCALARS components.

The projection is fitted when the foundation trains (on the trunk's output at its last cut-off) and
saved in the checkpoint's config.json, so every export of one checkpoint writes the same columns."""

from dataclasses import dataclass

import numpy as np

ROWS_PER_COLUMN = 100
MAX_COMPONENTS = 32
MIN_COMPONENTS = 4
MIN_COMPONENTS_WITH_SCALARS = 8


def principal_axes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, singular values, right singular vectors) of `x` [rows, width], centred, in float64: the
    PCA this profile and the stacked head's tree inputs (habitus.models.heads.stacking.Reduction) read."""
    x = np.asarray(x, np.float64)
    mean = x.mean(0)
    _, s, vt = np.linalg.svd(x - mean, full_matrices=False)
    return mean, s, vt


def profile_shape(entities: float, hidden: int, scalar_width: int) -> tuple[int, bool]:
    """(trunk components, whether the scalars follow) for a population of `entities` with history."""
    budget = int(entities // ROWS_PER_COLUMN)
    scalars = budget >= MIN_COMPONENTS_WITH_SCALARS + scalar_width
    components = min(MAX_COMPONENTS, budget - scalar_width if scalars else budget)
    return max(MIN_COMPONENTS, min(components, hidden)), scalars


@dataclass(frozen=True)
class Profile:
    """mean [hidden] and components [k, hidden] (each row scaled so its score has unit variance on the
    fitted rows); both None: the whole trunk (a checkpoint saved before the projection existed)."""
    mean: np.ndarray | None
    components: np.ndarray | None
    scalars: bool
    entities: int = 0  # the population the width was chosen for

    @classmethod
    def fit(cls, h: np.ndarray, entities: float, scalar_width: int) -> "Profile":
        """PCA of the trunk's output `h` [rows, hidden]; `entities`: how many have history (>= rows
        when `h` is a sample)."""
        k, scalars = profile_shape(entities, h.shape[1], scalar_width)
        mean, s, vt = principal_axes(h)
        # no direction without variance (a layer-normalized trunk of width 16 spans at most 15): its
        # unit-variance scores would be rounding noise
        rank = int((s > s[0] * 1e-4).sum()) if s.size and s[0] > 0 else 1
        k = max(1, min(k, rank))
        vt = vt[:k]
        vt = vt * np.sign(vt[np.arange(k), np.abs(vt).argmax(1)])[:, None]  # a fixed sign: largest loading > 0
        std = np.maximum(s[:k] / np.sqrt(max(len(h) - 1, 1)), 1e-6)
        return cls(mean.astype(np.float32), (vt / std[:, None]).astype(np.float32), scalars, int(entities))

    @classmethod
    def whole(cls) -> "Profile":
        return cls(None, None, True)

    @classmethod
    def of(cls, config: dict) -> "Profile":
        """The profile a foundation checkpoint's config.json saved; the whole trunk + scalars if none."""
        p = config.get("profile")
        if not p:
            return cls.whole()
        return cls(np.asarray(p["mean"], np.float32), np.asarray(p["components"], np.float32), bool(p["scalars"]),
                   int(p["entities"]))

    def to_dict(self) -> dict:
        if self.components is None:
            return {}
        return {"mean": self.mean.tolist(), "components": self.components.tolist(), "scalars": self.scalars,
                "entities": self.entities}

    def trunk_width(self, hidden: int) -> int:
        return hidden if self.components is None else len(self.components)

    def width(self, hidden: int, scalar_width: int) -> int:
        return self.trunk_width(hidden) + (scalar_width if self.scalars else 0)

    def apply(self, h: np.ndarray, scaled_scalars: np.ndarray) -> np.ndarray:
        """[the trunk's part, then the standardized scalars if kept] for the trunk's output `h`."""
        part = h if self.components is None else (h - self.mean) @ self.components.T
        return np.concatenate([part, scaled_scalars], axis=1) if self.scalars else part


WHOLE = Profile.whole()  # what a foundation checkpoint saved without a profile exports
