"""`habitus.Project`: a project config driven from Python (a notebook, a script) through the code paths of
the command line. `materialize()` runs what `habitus materialize` runs; `predict()` and `embeddings()` read
the day's Parquet file that the assets write, scoring the day first as `habitus score` does when no file
from the serving model is there; `report()` is `habitus report` as a table.

    import habitus

    project = habitus.Project("examples/demo.yaml", device="cpu")
    project.materialize()                                   # sources, cache, models, the newest day's scores
    project.report().to_pandas()                            # hold-out metric vs the best baseline, per scenario
    scores = project.predict("churn", "2026-10-31")         # a pyarrow.Table
    vectors = project.embeddings("2026-10-31")
"""

import os
import warnings
from datetime import date
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq

from habitus.assets.serving import serving_checkpoint
from habitus.models.storage.files import read_json
from habitus.pipelines.config.file import ConfigError
from habitus.pipelines.config.operations import ExecutorSettings, with_executor
from habitus.pipelines.config.project import load_project
from habitus.pipelines.run.report import failed_checks_table, holdout_rows
from habitus.pipelines.run.runner import (StageFailed, Stopped, materialize_all, materialize_selected, score,
                                         scoring_days)
from habitus.resources.store.workspace import Workspace

__all__ = ["Project", "ProjectError"]


class ProjectError(RuntimeError):
    """The project cannot do what was asked yet (a run stopped, a model not trained); the message says what
    to do."""


class Project:
    """A habitus project, loaded from its YAML config as the `habitus` commands load it (`${ENV}`
    substituted, relative paths read from the file's folder, errors naming the file and the key).

    Args:
        config: the project YAML; default $HABITUS_CONFIG, else examples/demo.yaml.
        log: where progress lines go (print; `lambda line: None` for none).
        **executor: settings over the config's `executor:`, as the command line's flags: device ("cpu",
            "cuda", "cuda:1", "auto"), processes, threads, precision ("fp32", "bf16"), inference_precision
            ("fp32", "int8", "bf16"), inference_processes.

    Runs go to $DAGSTER_HOME's instance when it is set (they then show in `make ui`), else to an ephemeral
    one. Attributes: `config` (the validated project config, a ProjectConfig: pipelines/config/project.py)
    and `workspace`.
    """

    def __init__(self, config: str | os.PathLike | None = None, *, log=print, **executor):
        unknown = sorted(set(executor) - set(ExecutorSettings.model_fields))
        if unknown:
            raise TypeError(f"habitus.Project: unknown executor setting(s) {', '.join(unknown)}; known: "
                            f"{', '.join(ExecutorSettings.model_fields)}")
        self.config = with_executor(load_project(config), SimpleNamespace(**executor))
        self.workspace = Workspace(root=self.config.workspace)
        self.log = log

    def __repr__(self) -> str:
        return (f"habitus.Project(workspace={self.config.workspace!r}, scenarios={list(self.config.scenarios)}, "
                f"entity={self.config.entity!r})")

    def materialize(self, assets: list[str] | None = None, *, days: list[str] | None = None,
                    verbose: bool = False) -> dict:
        """Materialize assets with their asset checks, as `habitus materialize` runs them.

        Args:
            assets: None for every asset: each events source's partitions, the attribute tables, the cache,
                the foundation model, the scenarios, then the predictions, embeddings and explanations of
                `days`. Or asset keys as the UI writes them ("cache", "foundation_model", "scenario/churn",
                "predictions/churn", "embeddings", "source/purchases"), run from what the workspace holds;
                an events source extracts the partitions missing from the workspace and the newest one
                again (`habitus train`'s extraction).
            days: the days to score ("YYYY-MM-DD", each as of its end, D+1 00:00 UTC). Default with
                `assets=None`: the newest day of the data; the daily assets named in `assets` need them.
            verbose: Dagster's own log as well.

        Returns the run's summary (pipelines/run/runner.py): timings (seconds per stage), prediction_days,
        checks_passed, checks_failed (one line each; a scenario that loses to its baselines is listed
        there, not promoted, and is no error), failures (the same as dicts) and warnings.

        Raises ConfigError for an unknown asset or a day outside the predictions' range, ProjectError
        when a stage failed or a blocking check stopped the run (the message lists the failed checks).
        """
        days = [d for day in days or () for d in scoring_days(self.config, str(day))]
        with warnings.catch_warnings():
            if not verbose:
                warnings.filterwarnings("ignore", module=r"dagster(\..*)?$")  # preview/beta notices
            try:
                if assets is not None:  # this runner's lines, not Dagster's log
                    return materialize_selected(self.config, list(assets), days, log=self.log, verbose=verbose)
                result = materialize_all(self.config, log=self.log, days=days, verbose=verbose)
            except (StageFailed, Stopped) as e:  # Stopped: what a blocking check left out
                what = "a stage failed: " if isinstance(e, StageFailed) else ""
                raise ProjectError(f"{what}{e} (materialize(..., verbose=True) shows Dagster's log)") from None
        if result["stopped"]:
            raise ProjectError(f"stopped: {result['stopped']}\n{failed_checks_table(result['failures'])}")
        return result

    def report(self) -> pa.Table:
        """Each scenario's hold-out metric next to its closest baseline, from its newest checkpoint, as
        `habitus report` prints it: one row per scenario with scenario, task, metric, model, best_baseline
        (which baseline), baseline (its value on the same labels), lower_is_better, beats_baselines and
        entities (hold-out entities). A scenario not trained yet has nulls. `.to_pandas()` for a frame."""
        rows = holdout_rows(self.config)
        schema = pa.schema([("scenario", pa.string()), ("task", pa.string()), ("metric", pa.string()),
                            ("model", pa.float64()), ("best_baseline", pa.string()), ("baseline", pa.float64()),
                            ("lower_is_better", pa.bool_()), ("beats_baselines", pa.bool_()),
                            ("entities", pa.int64())])
        return pa.Table.from_pylist([{f: r[f] for f in schema.names} for r in rows], schema=schema)

    def predict(self, scenario: str, day: str | date, *, rescore: bool = False, verbose: bool = False) -> pa.Table:
        """Scenario `scenario`'s scores of every eligible entity as of the end of `day` (D+1 00:00 UTC):
        the file predictions/<scenario>/<day>.parquet of the workspace, with the columns the README's
        "Outputs" lists (the entity id, the score or the top labels with scores, model_fingerprint, as_of).

        When that file is missing, or was scored by another version than the one serving the scenario
        now (the newest that beat its baselines, else its best baseline), or `rescore` is set, the day is
        scored first by the predictions asset, as `habitus score --date D` does: the source partitions
        missing up to the day (one extracted before its window closed is extracted again), the cache,
        then the scenario's predictions partition; its progress goes to `log`, as materialize()'s does. The scenario must be trained (`materialize()`), or its
        checkpoints in the config's `output:`. `.to_pandas()` on the result gives a frame (pandas needed).
        """
        day = self._day(day)
        if scenario not in self.config.scenarios:
            raise ConfigError(f"no scenario {scenario!r} in the project config; its scenarios: "
                              f"{', '.join(self.config.scenarios) or 'none'}")
        if scenario not in self.config.prediction_scenarios:
            raise ConfigError(f"scenario {scenario!r} is not scored: add it to `predictions.scenarios` in the project "
                              f"config (now {', '.join(self.config.prediction_scenarios)})")
        checkpoint = serving_checkpoint(self.workspace, scenario)[0] / "config.json"
        path = self.workspace.predictions(scenario) / f"{day}.parquet"
        return self._scored_file(path, checkpoint, f"scenario {scenario!r}", day, rescore, verbose,
                                 predictions=True, scenarios=[scenario])

    def embeddings(self, day: str | date, *, rescore: bool = False, verbose: bool = False) -> pa.Table:
        """The foundation model's embedding of every entity with history as of the end of `day`: the file
        embeddings/<day>.parquet (the entity id, `embedding` as fixed-width float16, model_fingerprint,
        as_of; the embeddings asset's `columns` metadata names each position). Embedded first, as
        `habitus embed --date D` does, when the file is missing, from another foundation checkpoint, or
        `rescore` is set."""
        day = self._day(day)
        path = self.workspace.embeddings / f"{day}.parquet"
        return self._scored_file(path, self.workspace.foundation / "config.json", "the foundation model", day,
                                 rescore, verbose, predictions=False, embeddings=True)

    def _day(self, day: str | date) -> str:
        """`day` as YYYY-MM-DD, checked against the predictions' daily partitions (ConfigError naming the
        setting to change when it is outside them)."""
        return scoring_days(self.config, day.isoformat() if isinstance(day, date) else str(day))[0]

    def _scored_file(self, path: Path, checkpoint: Path, model: str, day: str, rescore: bool, verbose: bool,
                     **what) -> pa.Table:
        """The day's file at `path`, scored first (the runner's `score`) unless it is there and was written by
        the checkpoint whose config is `checkpoint`."""
        if not checkpoint.exists() and not self.config.output:
            raise ProjectError(f"{model} is not trained in the workspace {self.config.workspace} (no "
                               f"{checkpoint}); run materialize() first")
        current = checkpoint.exists() and _fingerprint(path) == read_json(checkpoint)["weights_sha256"][:16]
        if rescore or not current:
            with warnings.catch_warnings():
                if not verbose:
                    warnings.filterwarnings("ignore", module=r"dagster(\..*)?$")
                try:
                    score(self.config, day, log=self.log, verbose=verbose, job_log=False, extract_again=False, **what)
                except RuntimeError as e:
                    raise ProjectError(f"scoring {day} with {model} failed: {e}") from None
        return pq.read_table(path)


def _fingerprint(path: Path) -> str | None:
    """The model_fingerprint a predictions or embeddings file was written with (None: no file)."""
    if not path.exists():
        return None
    first = next(pq.ParquetFile(path).iter_batches(batch_size=1, columns=["model_fingerprint"]), None)
    return first.column(0)[0].as_py() if first is not None and len(first) else None
