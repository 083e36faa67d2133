"""bench/foundation_settings.py: an arm's 'name=value' becomes that FoundationConfig field,
typed as its default (a bool parsed, never bool('false') == True)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _settings():
    spec = importlib.util.spec_from_file_location("foundation_settings", BENCH / "foundation_settings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.settings


def test_an_arm_is_one_typed_foundation_field():
    settings = _settings()
    assert settings("default") == {}
    assert settings("cutoffs_per_chunk=4") == {"cutoffs_per_chunk": 4}
    assert settings("learning_rate=0.001") == {"learning_rate": 0.001}
    assert settings("related_buckets=false") == {"related_buckets": False}
    assert settings("related_buckets=True") == {"related_buckets": True}
    with pytest.raises(ValueError, match="no_such_field=1.*contrastive_weight"):  # names the fields there are
        settings("no_such_field=1")
    with pytest.raises(ValueError, match="name=value"):
        settings("cutoffs_per_chunk")
