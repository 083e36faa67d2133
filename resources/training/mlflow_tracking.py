"""MLflow tracking and registry, when the project config has an `mlflow:` block (pipelines/config/tracking.py).

    foundation_model    a run in the experiment: the settings (params), the losses per epoch (metrics),
                        the fingerprint, cache and data window (tags)
    scenario/<name>     a run: the scenario's settings (params), every hold-out metric of the model and of
                        each baseline (metrics), the training data range and the foundation fingerprint
                        (tags); the kept version's folder logged as the artifact `checkpoint` and registered
                        as a version of the model <model_prefix><name>, tagged with its fingerprint
    serving pointer     the registered version whose fingerprint the pointer names carries the alias
                        (`serving`): set after each training and each rollback (assets/serving.py)

Nothing here imports mlflow unless the block is set (`require` checks that the client is installed before a
training starts). MLflow is a record, not the store: the checkpoint and its version are written to the
workspace first, and a tracking server that fails (down, refusing, timing out) is a warning naming its URI,
never a failed training or rollback. A version trained while the server was down has no registered version,
and the alias stays where it was until a version the server knows serves again; the next run of the asset
that finds nothing to train (the same cache, settings and cut-off) logs and registers what the server lacks
(the training the server missed, or one killed between keeping its checkpoint and logging it).
"""

import importlib.util
import math
import os
import re
import time
from pathlib import Path
from typing import Callable

from habitus.resources.store.redaction import redact_text, redact_url, url_secrets

INSTALL = "pip install 'habitus[mlflow]'"
# a server that hangs must not hold a training's end for minutes (MLflow's defaults: 7 retries, 120 s);
# variables set in the environment win
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
FINGERPRINT_TAG = "habitus.fingerprint"
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")  # what MLflow accepts in a metric name


class MlflowMissing(ValueError):
    """The `mlflow:` block is set and the MLflow client is not installed."""


def require(settings) -> None:
    """Fails when `settings` (the `mlflow:` block) is set and the client is not installed: before a training
    starts, never after it."""
    if settings is not None and importlib.util.find_spec("mlflow") is None:
        raise MlflowMissing(f"the project config sets mlflow: (tracking_uri {redact_url(settings.tracking_uri)}) but the "
                            f"MLflow client is not installed; {INSTALL}")


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and None as text."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def numbers(d: dict, prefix: str) -> dict[str, float]:
    """The finite numbers of a (nested) report as MLflow metric names: 'holdout.model.ndcg_10'."""
    out = {}
    for k, v in flatten(d).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[_METRIC_NAME.sub("_", f"{prefix}{k}")] = float(v)
    return out


class Tracker:
    """One project's MLflow server. `warn` receives one line per failure (a Dagster log, or stderr)."""

    def __init__(self, settings, warn: Callable[[str], None]):
        self.settings, self.warn = settings, warn
        self._client = None

    @property
    def uri(self) -> str:
        return redact_url(self.settings.tracking_uri)

    def _redact(self, text: str) -> str:
        """`text` (MLflow's own messages quote the URI it was given) without the URI's credentials, whether
        in a URL or alone, or the client's MLFLOW_TRACKING_PASSWORD / _TOKEN."""
        env = [os.environ.get(f"MLFLOW_TRACKING_{k}") for k in ("PASSWORD", "TOKEN")]
        return redact_text(text, [*url_secrets(self.settings.tracking_uri), *[v for v in env if v]])

    def client(self):
        if self._client is None:
            require(self.settings)
            for k, v in HTTP_DEFAULTS.items():
                os.environ.setdefault(k, v)
            from mlflow import MlflowClient

            self._client = MlflowClient(tracking_uri=self.settings.tracking_uri,
                                        registry_uri=self.settings.tracking_uri)
        return self._client

    def model_name(self, scenario: str) -> str:
        return f"{self.settings.model_prefix}{scenario}"

    def _guard(self, what: str, kept: str, fn):
        try:
            return fn()
        except MlflowMissing:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the server or the client is a warning
            text = self._redact(" ".join(str(e).split()))
            self.warn(f"MLflow at {self.uri}: {what} failed ({type(e).__name__}: {text[:300]}); {kept}")
            return None

    # ------------------------------------------------------------------ runs

    def _run(self, name: str, params: dict, metrics: dict[str, float], tags: dict, steps: dict | None = None,
             artifacts: Path | None = None) -> str:
        from mlflow.entities import Metric, Param

        c = self.client()
        exp = c.get_experiment_by_name(self.settings.experiment)
        exp_id = exp.experiment_id if exp else c.create_experiment(self.settings.experiment)
        tags = {k: str(v) for k, v in tags.items() if v is not None}
        run_id = c.create_run(exp_id, run_name=name, tags=tags).info.run_id
        now = int(time.time() * 1000)
        ms = [Metric(k, v, now, 0) for k, v in metrics.items()]
        for key, values in (steps or {}).items():  # one value per epoch
            ms += [Metric(key, float(v), now, i) for i, v in enumerate(values)
                   if isinstance(v, (int, float)) and math.isfinite(v)]
        ps = [Param(k, "" if v is None else self._redact(str(v))[:6000]) for k, v in params.items()]
        for i in range(0, max(len(ms), len(ps), 1), 100):  # log_batch takes 1000 metrics and 100 params at most
            c.log_batch(run_id, metrics=ms[i:i + 100], params=ps[i:i + 100])
        if artifacts is not None:
            c.log_artifacts(run_id, str(artifacts), "checkpoint")
        c.set_terminated(run_id)
        return run_id

    def log_foundation(self, config: dict, curves: dict, tags: dict) -> str | None:
        """A run of a foundation training: `config` its settings, `curves` its losses per epoch."""
        return self._guard("logging the foundation training", "the checkpoint is kept in the workspace",
                           lambda: self._run("foundation_model", flatten(config), {}, tags,
                                             steps={k: v for k, v in curves.items() if isinstance(v, list)}))

    def log_scenario(self, name: str, settings: dict, version: Path, fingerprint: str) -> str | None:
        """A run of scenario `name`'s training and a registered model version of its kept `version` folder
        (config.json: the hold-out report, protocol and foundation); the version's number, or None."""
        import json

        config = json.loads((version / "config.json").read_text())
        report = config.get("metrics", {})
        protocol = config.get("protocol", {})
        cutoffs = protocol.get("train_cutoffs") or [None]
        metrics = {**numbers(report.get("model", {}), "holdout.model."),
                   **numbers(report.get("baselines", {}), "holdout.baseline."),
                   **numbers(report.get("network", {}), "holdout.network.")}
        if isinstance(report.get("entities"), (int, float)):
            metrics["holdout.entities"] = float(report["entities"])
        tags = {"habitus.scenario": name, FINGERPRINT_TAG: fingerprint,
                "habitus.foundation_fingerprint": (config.get("foundation_sha256") or "")[:16],
                "habitus.cache_fingerprint": (config.get("cache_fingerprint") or "")[:16],
                "habitus.data.first_train_cutoff": cutoffs[0], "habitus.data.last_train_cutoff": cutoffs[-1],
                "habitus.data.val_cutoff": protocol.get("val_cutoff"),
                "habitus.data.test_cutoff": protocol.get("test_cutoff"),
                "habitus.headline": config.get("headline"), "habitus.beats_baselines": bool(config.get("beats_baselines"))}
        params = {**flatten(settings), **{f"finetune.{k}": v for k, v in flatten(config.get("finetune") or {}).items()}}

        def register():
            run_id = self._run(f"scenario/{name}", params, metrics, tags, artifacts=version)
            return self._register(name, run_id, fingerprint, bool(config.get("beats_baselines")))

        return self._guard(f"logging scenario {name}'s training", f"version {fingerprint} is kept in the workspace",
                           register)

    def foundation_logged(self, fingerprint: str) -> bool | None:
        """Whether the experiment holds a finished foundation run of `fingerprint` (its tag); None when the server
        does not answer (a warning)."""
        def find():
            c = self.client()
            exp = c.get_experiment_by_name(self.settings.experiment)
            return exp is not None and bool(c.search_runs(
                [exp.experiment_id], max_results=1,
                filter_string=f"tags.`{FINGERPRINT_TAG}` = '{fingerprint}' and attributes.run_name = 'foundation_model' "
                              "and attributes.status = 'FINISHED'"))

        return self._guard("looking up the foundation's run", "it is looked up again on the next run", find)

    # ------------------------------------------------------------------ registry

    def registered(self, scenario: str, fingerprint: str) -> bool | None:
        """Whether version `fingerprint` of `scenario` is a registered model version; None when the server does not
        answer (a warning)."""
        return self._guard(f"looking up version {fingerprint} of {self.model_name(scenario)}",
                           "it is looked up again on the next run", lambda: fingerprint in self._versions(scenario))


    def _versions(self, scenario: str) -> dict[str, str]:
        """{fingerprint: registered version number} of the scenario's registered model."""
        found = self.client().search_model_versions(f"name='{self.model_name(scenario)}'")
        return {v.tags.get(FINGERPRINT_TAG): v.version for v in found if v.tags.get(FINGERPRINT_TAG)}

    def _register(self, scenario: str, run_id: str, fingerprint: str, beats: bool) -> str:
        from mlflow.exceptions import MlflowException

        c, name = self.client(), self.model_name(scenario)
        try:
            c.create_registered_model(name, description=f"habitus scenario {scenario}")
        except MlflowException as e:
            if e.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        known = self._versions(scenario).get(fingerprint)
        if known:  # the same weights trained again: one version per fingerprint
            return known
        source = f"{c.get_run(run_id).info.artifact_uri}/checkpoint"
        return c.create_model_version(name, source, run_id=run_id, tags={
            FINGERPRINT_TAG: fingerprint, "habitus.beats_baselines": str(beats)}).version

    def follow_pointer(self, scenario: str, serving: str | None) -> str | None:
        """Put the alias on the registered version of fingerprint `serving` (the pointer's); the version
        number, or None (no pointer, or a version the server never registered: the alias stays)."""
        def move():
            if serving is None:
                return None
            number = self._versions(scenario).get(serving)
            if number is None:
                self.warn(f"MLflow at {self.uri}: version {serving} of {scenario} serves but is not registered (trained "
                          f"while the server was unreachable?); alias {self.settings.alias!r} left where it was")
                return None
            self.client().set_registered_model_alias(self.model_name(scenario), self.settings.alias, number)
            return number

        return self._guard(f"moving alias {self.settings.alias!r} of {self.model_name(scenario)}",
                           f"version {serving} serves all the same (the workspace's pointer)", move)
