"""What `habitus materialize` shows while it runs: one line per finished asset, and (on a terminal) a
live progress display of the running stage: partitions extracted, epochs trained, with rates and an
estimate of the time left.

The display reads the run's own event log (the one the UI shows) from a thread, so the assets and
the training loop report nothing extra: extraction logs "<source> partition <key>: <n> rows", the
training loop logs "<task> epoch <i>/<n>: train loss ...", predictions log "<asset> <day>: <n> rows".
"""

import logging
import re
import threading
import time
from contextlib import contextmanager

EPOCH = re.compile(r"^(\w+) epoch (\d+)/(\d+): (.*)$")
PARTITION = re.compile(r"^\S+ partition (\S+): ([\d,]+) rows")
SCORED = re.compile(r"^(?:predictions/\S+|embeddings) (\S+): ([\d,]+) rows")
STAGE_TAG = "habitus/stage"


def _seconds(s: float) -> str:
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s"


class PlainDisplay:
    """Lines through `log` (print, or nothing in tests): a stage when it starts and when it is done."""

    def __init__(self, log=print):
        self.log = log

    def line(self, text: str) -> None:
        self.log(text)

    @contextmanager
    def stage(self, what: str, instance, tag: str, steps: dict[str, str], total: int | None = None):
        started = time.time()
        self.log(f"materializing {what} ...")
        yield
        self.log(f"  done in {round(time.time() - started, 1)}s")

    def close(self) -> None:
        pass


def _eta_column():
    """Time left from the average pace so far (rich's own estimate needs several updates: an epoch
    bar has only a handful)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Eta(ProgressColumn):
        def render(self, task) -> Text:
            if not task.total or not task.completed or task.elapsed is None:
                return Text("left -:--", style="progress.remaining")
            left = task.elapsed * (task.total - task.completed) / task.completed
            return Text(f"left {int(left // 60)}:{int(left % 60):02d}", style="progress.remaining")

    return Eta()


class RichDisplay:
    """A rich progress display on stderr (live on a terminal; elsewhere only the finished lines)."""

    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                                   TimeElapsedColumn)

        self.console = console or Console(stderr=True, highlight=False)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=16),
                                 MofNCompleteColumn(), TimeElapsedColumn(), _eta_column(),
                                 TextColumn("{task.fields[info]}"),
                                 console=self.console, transient=True)
        self._started = False

    def line(self, text: str) -> None:
        self.console.print(text, markup=False)

    @contextmanager
    def stage(self, what: str, instance, tag: str, steps: dict[str, str], total: int | None = None):
        if not self._started:
            self.progress.start()
            self._started = True
        self.console.print(f"[bold]{what}[/bold]")
        task = self.progress.add_task(what, total=total, info="")
        watcher = _RunWatcher(self, instance, tag, steps, task, total)
        watcher.start()
        try:
            yield
        finally:
            watcher.stop()
            self.progress.remove_task(task)

    def close(self) -> None:
        if self._started:
            self.progress.stop()
            self._started = False


class _RunWatcher(threading.Thread):
    """Follows one run's event log (found by its stage tag) and moves the display's bars."""

    def __init__(self, display: RichDisplay, instance, tag: str, steps: dict[str, str], task, total):
        super().__init__(daemon=True)
        self.display, self.instance, self.tag, self.steps, self.task = display, instance, tag, steps, task
        self.total, self.done_parts, self.rows = total, 0, 0
        self.step_tasks: dict[str, object] = {}
        self.step_started: dict[str, float] = {}
        self.run_id, self.cursor = None, None
        self._halt = threading.Event()
        self.started = time.time()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self.poll()  # what happened after the last tick

    def run(self) -> None:
        while not self._halt.wait(0.5):
            try:
                self.poll()
            except Exception as e:  # the display must never break a run
                logging.getLogger(__name__).debug("progress: %s", e)

    def poll(self) -> None:
        import dagster as dg

        if self.run_id is None:
            runs = self.instance.get_runs(filters=dg.RunsFilter(tags={STAGE_TAG: self.tag}), limit=1)
            if not runs:
                return
            self.run_id = runs[0].run_id
        while True:
            conn = self.instance.get_records_for_run(self.run_id, cursor=self.cursor, limit=500)
            for record in conn.records:
                self.on_entry(record.event_log_entry)
            self.cursor = conn.cursor
            if not conn.has_more:
                break

    def on_entry(self, entry) -> None:
        p = self.display.progress
        event = entry.dagster_event
        step = entry.step_key
        label = self.steps.get(step) if step else None
        if event is not None:
            kind = event.event_type_value
            if label is None:
                return
            if kind == "STEP_START":
                self.step_started[step] = entry.timestamp
                self.step_tasks[step] = p.add_task(f"  {label}", total=None, info="")
            elif kind in ("STEP_SUCCESS", "STEP_FAILURE"):
                t = self.step_tasks.pop(step, None)
                if t is not None:
                    p.remove_task(t)
                took = entry.timestamp - self.step_started.get(step, entry.timestamp)
                mark = "✓" if kind == "STEP_SUCCESS" else "✗"
                self.display.console.print(f"  {mark} {label} [dim]{_seconds(took)}[/dim]")
            return
        msg = entry.user_message or ""
        m = EPOCH.match(msg)
        if m and step in self.step_tasks:
            i, n, rest = int(m.group(2)), int(m.group(3)), m.group(4)
            loss = re.search(r"train loss ([\d.]+)", rest)
            p.update(self.step_tasks[step], total=n, completed=i,
                     info=f"epoch {i}/{n}" + (f", loss {loss.group(1)}" if loss else ""))
            return
        m = PARTITION.match(msg) or SCORED.match(msg)
        if m:
            self.done_parts += 1
            self.rows += int(m.group(2).replace(",", ""))
            rate = self.rows / max(time.time() - self.started, 1e-9)
            p.update(self.task, completed=self.done_parts, info=f"{m.group(1)}, {rate:,.0f} rows/s")
