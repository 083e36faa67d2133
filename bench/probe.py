"""The embedding probe: how much churn a linear reader gets out of what the `embeddings` asset writes.

A 5-fold cross-validated logistic regression (sklearn, standardized inputs, L2) predicts churn at
the test cut-off among the entities the churn scenario scores, once from the embeddings
(habitus.models.serve.predict.embed, the function the asset calls, in float16 as the asset writes them, with
the foundation's profile: habitus.models.nn.profile), once from what the asset wrote before that
profile (the trunk's 256 floats + the scalars), and once from the plain recency / frequency / monetary / visit scalars
(habitus.models.data.features.scalar_features + visit_features, the leading columns of the network's input).
Out-of-fold scores, one AUROC each. Two readers: the headline one chooses its L2 strength C
within each training fold (LogisticRegressionCV, C in 0.001-1, inner 3-fold AUROC), as a
practitioner would; the other keeps sklearn's default C = 1, which a wide input on few entities
(MovieLens: 277 columns, 377 training rows per fold) over-fits.
"""

import warnings

import numpy as np

from habitus.models.cache import Cache
from habitus.models.data.features import FeatureSpec, chunk_at, scalar_features, visit_features
from habitus.models.tasks.metrics import auroc
from habitus.models.nn.network import Trunk
from habitus.models.nn.profile import Profile
from habitus.models.serve.predict import embed
from habitus.models.data.targets import TargetSpec, compute_target, eligible
from habitus.models.data.chunks import SCORING_CHUNK_ENTITIES, chunk_plan

FOLDS = 5


def rfm_scalars(cache: Cache, spec: FeatureSpec, target: TargetSpec, cutoff: int,
                chunk_entities: int = SCORING_CHUNK_ENTITIES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(entity indices, RFM scalars [n, spec.scalar_width], churn labels) of the eligible entities."""
    ents, xs, ys = [], [], []
    for s, lo, hi in chunk_plan(cache, chunk_entities):
        chunk = chunk_at(cache.shard(s), lo, hi, cutoff)
        if chunk.n == 0:
            continue
        keep = eligible(chunk, target)
        parts = [scalar_features(chunk, spec)] + ([visit_features(chunk, spec)] if spec.visits else [])
        ents.append(chunk.entities[keep].astype(np.int64))
        xs.append(np.concatenate(parts, axis=1)[keep])
        ys.append(compute_target(chunk, target, None, cache)[keep])
    return np.concatenate(ents), np.concatenate(xs), np.concatenate(ys)


CS = (1e-3, 1e-2, 1e-1, 1.0)


def cross_validated_auroc(x: np.ndarray, y: np.ndarray, tuned: bool = True, seed: int = 0) -> float:
    from sklearn.linear_model import LogisticRegression, LogisticRegressionCV
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    out = np.zeros(len(y), np.float64)
    for train, test in StratifiedKFold(FOLDS, shuffle=True, random_state=seed).split(x, y):
        linear = (LogisticRegressionCV(Cs=list(CS), cv=3, scoring="roc_auc", max_iter=2000) if tuned
                  else LogisticRegression(C=1.0, max_iter=2000))
        reader = make_pipeline(StandardScaler(), linear)
        with warnings.catch_warnings():  # sklearn 1.8 announces new defaults of LogisticRegressionCV (same fit)
            warnings.simplefilter("ignore", FutureWarning)
            reader.fit(x[train], y[train])
        out[test] = reader.predict_proba(x[test])[:, 1]
    return float(auroc(y, out))


def _vectors(trunk: Trunk, cache: Cache, spec: FeatureSpec, cutoff: int, ents: np.ndarray,
             profile: Profile) -> np.ndarray:
    """The embeddings of `ents` as the asset writes them (float16), in that order."""
    index, vectors = [], []
    for batch in embed(trunk, cache, spec, cutoff, dtype=np.float16, profile=profile):
        index.append(batch.column("entity_index").to_numpy())
        vectors.append(batch.column("embedding").flatten().to_numpy(zero_copy_only=False)
                       .reshape(batch.num_rows, -1))
    index, vectors = np.concatenate(index), np.concatenate(vectors).astype(np.float32)
    position = np.full(max(index.max(initial=0), ents.max(initial=0)) + 1, -1, np.int64)
    position[index] = np.arange(len(index))
    return vectors[position[ents]]  # every eligible entity has history, so an embedding


def embedding_probe(trunk: Trunk, cache: Cache, spec: FeatureSpec, target: TargetSpec, cutoff: int,
                    profile: Profile) -> dict:
    """Churn AUROC of the probe on the embeddings (`profile`: the foundation's, habitus.models.nn.profile),
    on what they were before the profile (the whole trunk + the scalars) and on the RFM scalars."""
    ents, rfm, y = rfm_scalars(cache, spec, target, cutoff)
    emb = _vectors(trunk, cache, spec, cutoff, ents, profile)
    y = y.astype(np.int64)
    sets = {"embeddings": emb, "whole trunk + scalars (before)": _vectors(trunk, cache, spec, cutoff, ents,
                                                                          Profile.whole()), "rfm scalars": rfm}
    out = {"entities": int(len(y)), "churn_rate": round(float(y.mean()), 4), "width": int(emb.shape[1]),
           "rfm width": int(rfm.shape[1])}
    out.update({name: cross_validated_auroc(x, y) for name, x in sets.items()})
    out["c=1"] = {name: cross_validated_auroc(x, y, tuned=False) for name, x in sets.items()}
    return out
