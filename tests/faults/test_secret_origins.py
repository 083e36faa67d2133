"""Secrets by origin when `${VAR}` is mixed with text (`pw-${X}`, `scheme://u:${X}@h`) or nested
(`options: {a: {b: ${X}}}`): under ten key spellings, no secret is in `habitus init`'s output, the resource
config the Dagster UI shows (the repository snapshot), the connector's errors or MLflow's params and
warnings, while the driver still gets every value expanded. MLflow down with a password in its URI
warns without the password."""

import json
import os
import socket

import dagster as dg
import pytest
import yaml

from habitus.pipelines.config.project import load_project
from habitus.resources.store.redaction import redact_text, redact_url
from habitus.resources.warehouses.masking import secret_values, value

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")

SECRET = "Zq9-planted-secret-4e1b"
TEN_KEYS = ["password", "Password", "private_key_file_pwd", "oauth_client_secret", "accessToken", "API_KEY",
            "sasl_Passcode", "Credentials_JSON", "accountKey", "http_header_x"]
PROJECT = ("workspace: ws\nentity: c\nconnections: {{w: {{type: duckdb, path: x.duckdb}}, vault: {vault}}}\n"
           "sources: [{{name: e, role: events, connection: w, table: t, timestamp: ts, start: 2026-01-01}}]\n")
# the three forms a value takes: mixed with text, inside a URL, nested in a dict and a list
FORMS = [lambda var: f"pw-${{{var}}}", lambda var: f"scheme://u:${{{var}}}@h:1/db",
         lambda var: {"a": {"b": f"${{{var}}}", "c": [f"x-${{{var}}}"]}}]


def _vault(tmp_path, monkeypatch):
    """A Hive connection to a closed port with ten secrets, one per key spelling, in the three forms, and
    `options: {a: {b: ${X}}}`; returns the config file and every secret value as the environment holds it."""
    values = {f"HABITUS_T_M{i}": f"m{i}-{SECRET}" for i in range(len(TEN_KEYS) + 1)}
    for var, v in values.items():
        monkeypatch.setenv(var, v)
    vault = {"type": "hive", "host": "127.0.0.1", "port": 1, "connect_timeout": 1, "auth": "NOSASL",
             **{k: FORMS[i % 3](f"HABITUS_T_M{i}") for i, k in enumerate(TEN_KEYS)},
             "options": {"a": {"b": f"${{HABITUS_T_M{len(TEN_KEYS)}}}"}}}
    path = tmp_path / "project.yaml"
    path.write_text(PROJECT.format(vault=json.dumps(vault)))
    return path, values


def _assert_clean(texts: list[str], values: dict):
    for text in texts:
        assert SECRET not in text and "planted-secret" not in text, text[:800]  # not even a cut of one
        for v in values.values():
            assert v not in text, text[:800]


def test_mixed_and_nested_secrets_under_ten_spellings_are_masked_everywhere(tmp_path, monkeypatch, capsys):
    import warnings

    from dagster._core.remote_representation.external_data import RepositorySnap
    from dagster._serdes import serialize_value

    from habitus.pipelines.definitions import build_definitions
    from habitus.pipelines.init.command import _hide_secrets, main as init_main
    from habitus.resources.warehouses.remote import connect_error, query_error

    path, values = _vault(tmp_path, monkeypatch)
    project = load_project(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing here is written literally: no warning either
        warnings.simplefilter("ignore", dg.BetaWarning)
        defs = build_definitions(project)
    vault = next(r for r in defs.resources.values() if type(r).__name__ == "HiveWarehouse")

    # what the driver gets: every value expanded, at every depth
    kw = vault.connect_kwargs()
    assert kw["password"] == f"pw-{values['HABITUS_T_M0']}"
    assert kw["Password"] == f"scheme://u:{values['HABITUS_T_M1']}@h:1/db"
    assert kw["private_key_file_pwd"] == {"a": {"b": values["HABITUS_T_M2"], "c": [f"x-{values['HABITUS_T_M2']}"]}}
    assert kw["a"] == {"b": values["HABITUS_T_M10"]}

    # what the UI shows: the resource's config values in the repository snapshot, and the resource itself
    snapshot = serialize_value(RepositorySnap.from_def(defs.get_repository_def()))
    shown = [snapshot, repr(vault), json.dumps(vault.model_dump(), default=repr)]
    assert "pw-${HABITUS_T_M0}" in snapshot and "HABITUS_T_M10" in snapshot  # the templates, as written
    # init's printed connection
    printed = _hide_secrets("vault", project.connections["vault"].model_dump())
    assert printed["password"] == "pw-${HABITUS_T_M0}" and printed["options"] == {"a": {"b": "${HABITUS_T_M10}"}}
    shown.append(json.dumps(printed))
    # a driver error quoting every value, whole and as the URL-quoted form, as the connector reports it
    leak = RuntimeError("login failed: " + ", ".join(f"{v} pw-{v} scheme://u:{v}@h:1/db" for v in values.values()))
    assert len(secret_values(vault)) >= 2 * len(values)
    shown += [str(connect_error("hive", "vault", "127.0.0.1:1", leak, vault._secrets())),
              str(query_error("hive", "vault", "t", leak, vault._secrets(), where="127.0.0.1:1"))]
    # init against the closed port: what it prints, out and err
    assert init_main(["--config", str(path), "--use", "vault", "--tables", "t"]) == 2
    captured = capsys.readouterr()
    assert "cannot connect" in captured.err
    shown += [captured.out, captured.err]
    # init given the connection on the command line, with a key the schema refuses: its error quotes the input
    text = yaml.safe_dump({"type": "nope", "password": "pw-${HABITUS_T_M0}", "x": {"y": "${HABITUS_T_M1}"}})
    assert init_main(["--connection", text]) == 2
    captured = capsys.readouterr()
    assert "--connection: invalid project config" in captured.err and "'nope'" in captured.err
    shown += [captured.out, captured.err]
    _assert_clean(shown, values)


def test_a_run_hands_the_driver_the_values_and_records_only_the_templates(tmp_path, monkeypatch):
    """In a Dagster run the resource is rebuilt from its config: the templates arrive as written, the driver's
    arguments hold the values, and the run's records (config, logs, metadata, the failure) hold none."""
    from dagster._serdes import serialize_value

    from habitus.pipelines.orchestration.build import build_resources

    path, values = _vault(tmp_path, monkeypatch)
    vault = build_resources(load_project(path))["connection_vault"]

    @dg.asset(required_resource_keys={"vault"})
    def uses_vault(context):
        kw = context.resources.vault.connect_kwargs()
        assert kw["password"] == f"pw-{values['HABITUS_T_M0']}" and kw["a"] == {"b": values["HABITUS_T_M10"]}
        context.log.info(f"connecting to {context.resources.vault._where()} as {context.resources.vault.password}")
        return dg.MaterializeResult(metadata={"where": context.resources.vault._where(),
                                              "options": dg.MetadataValue.json(context.resources.vault.options)})

    @dg.asset(required_resource_keys={"vault"})
    def fails(context):  # a driver error quoting every value, as the connector raises it inside a run
        from habitus.resources.warehouses.remote import connect_error

        wh = context.resources.vault
        raise connect_error("hive", "vault", wh._where(), RuntimeError(", ".join(values.values())), wh._secrets())

    instance = dg.DagsterInstance.ephemeral()
    assert dg.materialize([uses_vault], resources={"vault": vault}, instance=instance).success
    assert not dg.materialize([fails], resources={"vault": vault}, instance=instance, raise_on_error=False).success
    runs = instance.get_runs()  # both runs with their config, and every event of each
    shown = [serialize_value(r) for r in runs]
    for run in runs:
        shown += [serialize_value(e.event_log_entry) for e in instance.get_records_for_run(run.run_id).records]
    assert any("pw-${HABITUS_T_M0}" in text for text in shown)  # the template is what the records keep
    assert any("cannot connect" in text and "***" in text for text in shown)  # the failure, its values cut out
    _assert_clean(shown, values)


class _DownClient:
    """An MLflow client whose server is down: each call fails with MLflow's kind of message, which quotes
    the URI it was given (credentials included) and the request's parameters."""

    def __init__(self, uri: str):
        self.uri, self.params = uri, []

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            self.params += [p.value for p in kwargs.get("params", [])]
            raise ConnectionError(f"API request to endpoint {self.uri}/api/2.0/mlflow/{name} failed with exception "
                                  f"HTTPConnectionPool(host='127.0.0.1'): Max retries exceeded ({self.uri}); "
                                  f"Authorization: Bearer {os.environ.get('MLFLOW_TRACKING_TOKEN')}")
        return fail


def test_mlflow_warnings_and_params_carry_no_credentials(monkeypatch):
    pytest.importorskip("mlflow", reason="the MLflow client is not installed: pip install -e '.[mlflow]'")
    from habitus.resources.training.mlflow_tracking import Tracker

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-planted-secret-55")
    settings = type("S", (), {"tracking_uri": f"https://bob:{SECRET}@mlflow.example.com", "experiment": "e",
                              "model_prefix": "habitus-", "alias": "serving"})()
    warned, client = [], _DownClient(settings.tracking_uri)
    tracker = Tracker(settings, warned.append)
    tracker._client = client
    assert tracker.log_foundation({"hidden": 16}, {"loss": [1.0]}, {}) is None
    assert tracker.follow_pointer("churn", "a" * 16) is None
    assert len(warned) == 2 and all(w.startswith("MLflow at https://***@mlflow.example.com: ") for w in warned)
    assert all("/api/2.0/mlflow/" in w for w in warned)  # MLflow's own text is kept, its credentials are not
    _assert_clean(warned, {"pw": SECRET, "token": "tok-planted-secret-55"})
    assert "bob" not in " ".join(warned) and "Bearer ***" in warned[0]

    # params: a URL with credentials in a setting is logged without them
    logged = []

    class Logging:
        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name):
            return "1"

        def create_run(self, *a, **k):
            return type("R", (), {"info": type("I", (), {"run_id": "r"})()})()

        def log_batch(self, run_id, metrics=(), params=()):
            logged.extend(p.value for p in params)

        def set_terminated(self, run_id):
            pass

    tracker._client = Logging()
    assert tracker.log_foundation({"source": f"clickhouse://default:{SECRET}@h/db", "hidden": 16}, {}, {}) == "r"
    assert "clickhouse://***@h/db" in logged and "16" in logged
    _assert_clean(logged, {"pw": SECRET})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mlflow_down_with_a_password_uri_logs_no_password(tmp_path, small_project, monkeypatch):
    """The config reference's form, `https://${MLFLOW_USER}:${MLFLOW_PASSWORD}@host`, with nothing listening:
    MLflow's own exception text quotes the URI; the warning does not."""
    pytest.importorskip("mlflow", reason="the MLflow client is not installed: pip install -e '.[mlflow]'")
    from habitus.resources.training.mlflow_tracking import Tracker

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_USER", "tok-user-9f3a")
    monkeypatch.setenv("MLFLOW_PASSWORD", SECRET)
    port = _closed_port()
    config = small_project.config(mlflow={"tracking_uri": f"http://${{MLFLOW_USER}}:${{MLFLOW_PASSWORD}}@127.0.0.1:{port}"})
    project = load_project(small_project.write(tmp_path, config))
    warned = []
    tracker = Tracker(project.mlflow, warned.append)
    assert tracker.log_foundation({"hidden": 16}, {"train_loss": [1.0]}, {}) is None
    assert tracker.follow_pointer("churn", "a" * 16) is None
    assert len(warned) == 2 and all(w.startswith(f"MLflow at http://***@127.0.0.1:{port}: ") for w in warned), warned
    _assert_clean(warned, {"pw": SECRET, "user": "tok-user-9f3a"})


def test_redact_text_cuts_credentials_out_of_every_url_in_a_message():
    text = (f"failed https://u:{SECRET}@h/x and s3://AKIA:{SECRET}@bucket/k?X-Amz-Signature={SECRET}, "
            f"then https://{SECRET}@h2 (a token as the user)")
    out = redact_text(text)
    assert SECRET not in out and out.count("***") == 4 and "https://***@h/x" in out
    assert redact_url("https://u:a/b?c@h:5/p") == "https://***@h:5/p"  # `/` and `?` in the password: no ValueError


def test_values_expand_at_use_and_only_templates_do(monkeypatch):
    """A value is expanded where the driver takes it, at any depth; an expanded value that itself holds `${`
    (a password with those characters, given as EnvVar) is passed on as it is."""
    monkeypatch.setenv("HABITUS_T_X", "a${HABITUS_T_Y}b")
    monkeypatch.setenv("HABITUS_T_Y", "no")
    assert value({"a": ["pw-${HABITUS_T_X}", {"b": "${HABITUS_T_Z:-dflt}"}], "n": 3}) == {
        "a": ["pw-a${HABITUS_T_Y}b", {"b": "dflt"}], "n": 3}
    assert value(dg.EnvVar("HABITUS_T_X")) == "a${HABITUS_T_Y}b"
    assert value({"env": "HABITUS_T_X"}) == "a${HABITUS_T_Y}b"
    assert value("${hiveconf:x}") == "${hiveconf:x}"  # not a reference the config expands: left to the server
    monkeypatch.setenv("HABITUS_T_PORT", "10001")
    assert value(dg.EnvVar.int("HABITUS_T_PORT")) == 10001  # an integer field's ${VAR} used outside a run
