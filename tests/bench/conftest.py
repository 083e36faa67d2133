"""The benches as modules: bench/ is not a package and its scripts import their siblings by name."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="session")
def bench():
    """bench("oracle") -> bench/oracle.py loaded as a module."""
    def load(name: str):
        sys.path.insert(0, str(BENCH))
        try:
            spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(BENCH))
        return module
    return load
