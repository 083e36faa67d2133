"""Fixtures shared by every test package."""

import contextlib
import gc

import dagster as dg
import pytest


@contextlib.contextmanager
def clean_instance_for_test():
    """dg.instance_for_test(), restoring Dagster's current defs-state storage afterwards. In 1.13.27 an
    instance entered while another is current can leave a context manager behind that, when garbage
    collected later, sets the storage of a disposed instance as current; the next Definitions load in
    this process then fails with 'undefined DagsterInstance weakref'. Collect those here and reset."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(None):
        with dg.instance_for_test() as instance:
            yield instance
        gc.collect()


@pytest.fixture
def instance():
    """A temporary Dagster instance (runs, materializations, sensor state)."""
    with clean_instance_for_test() as inst:
        yield inst
