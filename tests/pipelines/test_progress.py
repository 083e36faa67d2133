"""The progress display reads the run's event log: epochs move a step's bar, extracted partitions
and scored days the stage's, and a finished step prints one line."""

import io
from types import SimpleNamespace

from rich.console import Console

from habitus.pipelines.run.progress import RichDisplay, _RunWatcher


def _entry(step, message="", event=None, timestamp=100.0):
    return SimpleNamespace(step_key=step, user_message=message, timestamp=timestamp,
                           dagster_event=None if event is None else SimpleNamespace(event_type_value=event))


def test_epochs_partitions_and_finished_steps():
    out = io.StringIO()
    display = RichDisplay(Console(file=out, force_terminal=False, width=120))
    stage = display.progress.add_task("source/purchases (3 partitions)", total=3, info="")
    w = _RunWatcher(display, None, "tag", {"scenario__churn": "scenario/churn"}, stage, 3)
    w.on_entry(_entry("scenario__churn", event="STEP_START", timestamp=100.0))
    step = w.step_tasks["scenario__churn"]
    w.on_entry(_entry("scenario__churn", "binary epoch 2/6: train loss 0.5123, validation loss 0.6"))
    task = next(t for t in display.progress.tasks if t.id == step)
    assert (task.completed, task.total, task.fields["info"]) == (2, 6, "epoch 2/6, loss 0.5123")
    w.on_entry(_entry("source__purchases", "purchases partition 2026-03-01: 1,200 rows"))
    w.on_entry(_entry("source__purchases", "purchases partition 2026-04-01: 800 rows"))
    assert (w.done_parts, w.rows) == (2, 2000)
    assert next(t for t in display.progress.tasks if t.id == stage).completed == 2
    w.on_entry(_entry("scenario__churn", event="STEP_SUCCESS", timestamp=161.5))
    assert "scenario__churn" not in w.step_tasks
    assert "  ✓ scenario/churn 1m01s" in out.getvalue()
    w.on_entry(_entry("churn_check", event="STEP_START"))  # a check's step: no line, no bar
    assert "churn_check" not in w.step_tasks
