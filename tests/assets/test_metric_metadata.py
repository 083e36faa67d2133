"""Scenario metrics as float metadata (Dagster plots numeric metadata across materializations)."""

import math

import dagster as dg

from habitus.assets.scenarios import metric_metadata


def test_every_model_metric_and_each_baselines_headline_is_a_float():
    report = {"model": {"auroc": 0.81, "average_precision": 0.4, "entities": 120, "note": "x", "brier": math.nan},
              "baselines": {"lightgbm": {"auroc": 0.83}, "recency": {"auroc": 0.7, "brier": 0.2},
                            "constant": {"brier": 0.3}},
              "entities": 120}
    meta = metric_metadata("auroc", report)
    assert set(meta) == {"model auroc", "model average_precision", "model entities", "lightgbm auroc", "recency auroc"}
    assert all(isinstance(v, dg.FloatMetadataValue) for v in meta.values())
    assert meta["lightgbm auroc"].value == 0.83
