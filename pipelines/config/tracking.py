"""The project config's `mlflow:` section: an MLflow tracking server that every training logs a run to, and
whose model registry holds each scenario's versions (resources/training/mlflow_tracking.py). Part of the schema of
pipelines/config/project.py; `${VAR}` expands in it (a tracking URI may carry credentials)."""

from pydantic import Field

from habitus.pipelines.config.base import Strict


class MlflowSettings(Strict):
    """Log each training to MLflow and register each scenario checkpoint as a model version; the serving
    version carries `alias`, which follows promotion and rollback. Needs `pip install 'habitus[mlflow]'`.
    A server that cannot be reached is a warning: the checkpoint and its version stay in the workspace."""

    tracking_uri: str = Field(description="the tracking server, 'http://host:5000' (or "
                              "'https://${MLFLOW_USER}:${MLFLOW_PASSWORD}@host'; MLflow also reads "
                              "MLFLOW_TRACKING_USERNAME, _PASSWORD and _TOKEN from the environment)")
    experiment: str = Field("habitus", description="the experiment the runs go to (created when missing)")
    model_prefix: str = Field("habitus-", description="registered models are named <model_prefix><scenario>")
    alias: str = Field("serving", pattern=r"^[A-Za-z_][A-Za-z0-9_-]*$",
                       description="the alias on the registered version that serves predictions")
