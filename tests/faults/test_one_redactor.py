"""One redactor: every message that shows a URL or may quote a secret goes through resources/store/redaction.py
(`redact_url`, `redact_text`), which cuts the union of what the `output:` store's logs and the connectors'
errors each cut before: user info (`user:password@`, a token as the user, a password holding `/ ? # @`),
every query value (S3 presigned `X-Amz-Signature`, Azure SAS `sig=`, `token=`, endpoints), the fragment, a
port that is not a number, and each secret passed in (as written, URL-quoted, from an EnvVar)."""

import types

import dagster as dg
import pytest

from habitus.pipelines.run import managed, runner
from habitus.resources.store.manifests import OutputError
from habitus.resources.store.output import Output
from habitus.resources.store.redaction import redact_text, redact_url, url_secrets
from habitus.resources.store.stores import open_store
from habitus.resources.store.workspace import Workspace, locked
from habitus.resources.warehouses.remote import connect_error, query_error

SECRET = "Zq9s3cr3tWk"
# an S3 presigned URL, an Azure SAS URL and a local S3 endpoint: tokens in the query, nothing in user info
PRESIGNED = (f"s3://bucket/prefix?endpoint_override=127.0.0.1:9&scheme=http&X-Amz-Credential=AKIA{SECRET}"
             f"&X-Amz-Signature={SECRET}&X-Amz-Security-Token={SECRET}")
SAS = f"abfs://container@account.dfs.core.windows.net/p?sv=2024-01-01&sp=rl&sig={SECRET}%2B"
URLS = {
    f"s3://AKIAUSER:{SECRET}@bucket/prefix/?endpoint_override=h:9000&token={SECRET}":
        "s3://***@bucket/prefix/?endpoint_override=***&token=***",
    f"abfs://user:pw{SECRET}@account.dfs.core.windows.net/c/p?sig={SECRET}": "abfs://***@account.dfs.core.windows.net/c/p?sig=***",
    f"https://{SECRET}@mlflow.example.com/x": "https://***@mlflow.example.com/x",  # a token as the user
    f"s3://AKIAUSER:Zq@{SECRET}/a@bucket/prefix": "s3://***@bucket/prefix",  # `@` and `/` in the password
    f"https://u:pa/{SECRET}?w@h:5000/api?run=1#access_token={SECRET}": "https://***@h:5000/api?run=***#***",
    f"s3://AKIAUSER:{SECRET}/prefix": "s3://AKIAUSER:***/prefix",  # `user:pass/..` without `@`: not a port
    PRESIGNED: "s3://bucket/prefix?endpoint_override=***&scheme=***&X-Amz-Credential=***&X-Amz-Signature=***"
               "&X-Amz-Security-Token=***",
    SAS: "abfs://***@account.dfs.core.windows.net/p?sv=***&sp=***&sig=***",
    f"/mnt/store?sig={SECRET}": "/mnt/store?sig=***",  # not a URL: its query values still go
    "http://127.0.0.1:5000/x": "http://127.0.0.1:5000/x", "http://[::1]:80/x": "http://[::1]:80/x",
    "/mnt/models/habitus": "/mnt/models/habitus", "databricks": "databricks",
}


@pytest.mark.parametrize("url", URLS)
def test_redact_url_cuts_what_the_store_and_the_connectors_each_cut(url):
    assert redact_url(url) == URLS[url]
    assert SECRET not in redact_url(url)
    if "://" in url:  # inside a message: every URL is found and cut
        assert redact_text(f"failed: {url} (retrying)") == f"failed: {URLS[url]} (retrying)"


def test_secrets_passed_in_are_cut_as_written_quoted_and_from_the_environment(monkeypatch):
    monkeypatch.setenv("HABITUS_T_PW", "env-p@ss/word")
    text = f"user bob password {SECRET} quoted p%40ss%2Fword and env-p@ss/word, env-p%40ss%2Fword; ab stays"
    out = redact_text(text, [SECRET, "p@ss/word", dg.EnvVar("HABITUS_T_PW"), {"env": "HABITUS_T_UNSET"}, "ab", None, 7])
    assert out == "user bob password *** quoted *** and ***, ***; ab stays"
    monkeypatch.setenv("HABITUS_T_PW", SECRET)
    assert redact_text(f"pw {SECRET}", [{"env": "HABITUS_T_PW"}]) == "pw ***"
    assert sorted(url_secrets(f"https://bob:{SECRET}@h/x")) == [SECRET, f"bob:{SECRET}"]


def test_the_connectors_errors_cut_secrets_and_every_url_in_the_drivers_message():
    cause = RuntimeError(f"login failed with password {SECRET} at https://bob:hunter22@acme.example.com/db "
                         f"(presigned {PRESIGNED})")
    for err in (connect_error("snowflake", "prod", "acme.example.com", cause, [SECRET]),
                query_error("hive", "prod", "sales", cause, [SECRET], where="acme.example.com", transient=True)):
        text = str(err)
        assert "prod" in text and "acme.example.com" in text and "***" in text
        assert SECRET not in text and "hunter22" not in text and "https://***@acme.example.com/db" in text, text
        assert redact_url(PRESIGNED) in text


def test_the_output_stores_logs_and_errors_show_the_url_through_redact_url(tmp_path):
    logs = []
    out = Output(PRESIGNED, retries=1, backoff_s=0.01, log=logs.append)
    assert out.shown == redact_url(PRESIGNED) and SECRET not in out.shown
    with pytest.raises(OutputError) as e:
        out.stages()  # nothing answers at 127.0.0.1:9
    assert SECRET not in str(e.value) and all(SECRET not in line for line in logs)
    for url, why in [(f"relative/store?sig={SECRET}", "a folder must be an absolute path"),
                     (f"s3://AKIAUSER:{SECRET}@bucket/p", "credentials in the URL are not read"),
                     (f"s3://?sig={SECRET}", "name a bucket"),
                     (f"foo://bucket/p?sig={SECRET}", "pyarrow cannot open it")]:  # pyarrow's own error quotes the URL
        with pytest.raises(OutputError, match=why) as e:
            open_store(url)
        assert SECRET not in str(e.value) and redact_url(url) in str(e.value), str(e.value)


def test_a_failed_upload_of_a_stage_shows_the_output_without_its_tokens(tmp_path, monkeypatch):
    def refuse(self, name, log=print):  # a store client whose error quotes the URL it was given
        raise OSError(f"AWS error 403 for {self.output}: access denied")

    monkeypatch.setattr(Workspace, "upload_stage", refuse)

    @dg.asset(name="embeddings")
    @locked("embeddings")
    def embeddings(context, workspace: Workspace) -> None:
        return None

    ws = Workspace(root=str(tmp_path / "ws"), output=PRESIGNED)
    result = dg.materialize([embeddings], resources={"workspace": ws}, raise_on_error=False)
    message = result.get_step_failure_events()[0].event_specific_data.error.message
    assert f"embeddings: uploading to {redact_url(PRESIGNED)} failed: AWS error 403 for {redact_url(PRESIGNED)}" in message
    assert SECRET not in message


def test_habitus_restore_and_upload_print_the_output_through_redact_url(tmp_path, monkeypatch, capsys):
    project = types.SimpleNamespace(workspace=str(tmp_path / "ws"), output=SAS, output_pins={}, scenarios=[])
    monkeypatch.setattr(managed, "load_project", lambda path: project)
    monkeypatch.setattr(managed, "with_executor", lambda p, args: p)
    monkeypatch.setattr(managed, "upload", lambda p: {"foundation": {"uploaded": 2, "skipped": 0}})
    monkeypatch.setattr(Workspace, "restore", lambda self, stages=None, log=print: ["foundation"])
    assert managed.main("upload", []) == 0
    assert managed.main("restore", ["--from", PRESIGNED]) == 0
    printed = capsys.readouterr().out
    assert f"uploaded to {redact_url(SAS)}: foundation 2 sent" in printed
    assert f"restored foundation from {redact_url(PRESIGNED)} into" in printed and SECRET not in printed
    logged = []  # a job on a fresh disk restores its checkpoints first, and says from where
    runner.restore_if_missing(project, logged.append)
    assert logged == [f"no checkpoints in {project.workspace}: restoring them from {redact_url(SAS)}"]
