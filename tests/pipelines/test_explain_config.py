"""The `explain:` key of a scenario: parsed with its defaults, refused when out of range, and one
explanations/<scenario> asset per scenario that has it, partitioned like the predictions."""

import pytest
import yaml

from habitus.pipelines.config.project import ConfigError, load_project

PROJECT = {
    "workspace": "ws",
    "connections": {"warehouse": {"type": "duckdb", "path": "warehouse.duckdb"}},
    "entity": "customer_id",
    "sources": [{"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
                 "timestamp": "ts", "columns": ["product_id", "price"], "start": "2026-03-01", "end": "2026-09-01"}],
    "scenarios": {
        "churn": {"task": "binary", "target": {"no_event": "purchases", "within": "28d"}, "explain": {"top": 5}},
        "spend": {"task": "regression", "target": {"sum": "purchases.price", "within": "28d"}},
    },
    "predictions": {"start": "2026-08-01"},
}


def _load(tmp_path, **explain):
    project = yaml.safe_load(yaml.safe_dump(PROJECT))
    if explain:
        project["scenarios"]["churn"]["explain"] = explain
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(project))
    return load_project(tmp_path / "p.yaml")


def test_explain_defaults(tmp_path):
    p = _load(tmp_path)
    e = p.scenarios["churn"].explain
    assert (e.top, e.steps, e.select, e.share, e.labels, e.per_entity, e.write_back) == (5, 8, "top", 0.1, [], None,
                                                                                         False)
    assert p.scenarios["spend"].explain is None


@pytest.mark.parametrize("bad", [{"top": 0}, {"steps": 1}, {"per_entity": 0}, {"top": 3, "colour": "red"},
                                 {"select": "best"}, {"share": 0}, {"share": 1.5}])
def test_explain_out_of_range_is_refused(tmp_path, bad):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, **bad)
    assert "scenarios.churn.explain" in str(info.value)


def test_one_explanations_asset_per_explained_scenario(tmp_path):
    from habitus.pipelines.orchestration.build import build_assets

    p = _load(tmp_path)
    by_key = {a.key.to_user_string(): a for a in build_assets(p)}
    assert "explanations/churn" in by_key and "explanations/spend" not in by_key
    explained, predicted = by_key["explanations/churn"], by_key["predictions/churn"]
    assert explained.partitions_def == predicted.partitions_def
    assert explained.partitions_def.get_partition_keys()[-1] == "2026-08-31"  # `end:` fixes the days
    assert {k.to_user_string() for k in explained.dependency_keys} >= {"scenario/churn", "cache"}
