"""Which warehouse errors are transient (retried by the source assets' RetryPolicy) and which are permanent
(fail at once), per driver, on the drivers' own exception classes and messages as they raise them; and the
RetryPolicy itself on a source asset: a refused connection is retried with backoff, a missing column is not.
What the real servers answer when killed in the middle of an extraction is in
tests/integration/test_network_faults.py."""

import socket
import time

import dagster as dg
import pytest
import yaml

from habitus.resources.warehouses.errors import WarehouseError, network_error

TRANSIENT, PERMANENT = True, False


def _snowflake_cases():
    errors = pytest.importorskip("snowflake.connector.errors")
    return [
        (errors.OperationalError(msg="Could not connect to Snowflake backend after 2 attempt(s).Aborting",
                                 errno=250001), TRANSIENT),
        (errors.OperationalError(msg="Failed to execute request: HTTPSConnectionPool: Read timed out", errno=250003),
         TRANSIENT),
        (errors.ServiceUnavailableError(msg="503 Service Unavailable"), TRANSIENT),
        (errors.TooManyRequests(msg="429 Too Many Requests"), TRANSIENT),
        (errors.DatabaseError(msg="Session no longer exists.  New login required to access the service.",
                              errno=390111), TRANSIENT),
        # fakesnow and Snowflake after a restart: the session token is unknown on a query request
        (errors.DatabaseError(msg="401 Unauthorized: post 127.0.0.1:8765/queries/v1/query-request", errno=290401),
         TRANSIENT),
        (errors.DatabaseError(msg="401 Unauthorized: post acme.snowflakecomputing.com/session/v1/login-request",
                              errno=290401), PERMANENT),
        (errors.DatabaseError(msg="Failed to connect to DB: acme.snowflakecomputing.com:443. Incorrect username or "
                                  "password was specified.", errno=250001), PERMANENT),
        (errors.DatabaseError(msg="Incorrect username or password was specified.", errno=390100), PERMANENT),
        (errors.ProgrammingError(msg="SQL compilation error: Object 'EVENTS' does not exist or not authorized.",
                                 errno=2003), PERMANENT),
        (errors.ProgrammingError(msg="SQL compilation error: syntax error line 1 at position 0 unexpected 'SELEC'.",
                                 errno=1003), PERMANENT),
    ]


def test_snowflake_errors_are_classified():
    from habitus.resources.warehouses.snowflake import transient

    for exc, want in _snowflake_cases():
        assert transient(exc) is want, (type(exc).__name__, str(exc))


def test_hive_errors_are_classified():
    pytest.importorskip("pyhive")
    from pyhive.exc import OperationalError
    from TCLIService.ttypes import TStatus
    from thrift.transport.TTransport import TTransportException

    from habitus.resources.warehouses.hive import transient

    cases = [
        (TTransportException(TTransportException.NOT_OPEN, "Could not connect to any of [('127.0.0.1', 10000)]"),
         TRANSIENT),
        (TTransportException(TTransportException.END_OF_FILE, "TSocket read 0 bytes"), TRANSIENT),
        (TTransportException(TTransportException.TIMED_OUT, "timed out"), TRANSIENT),
        (ConnectionResetError(104, "Connection reset by peer"), TRANSIENT),
        (TTransportException(TTransportException.UNKNOWN, "Error validating the login"), PERMANENT),
        (TTransportException(TTransportException.END_OF_FILE, "Bad status: 3 (b'Error validating the login')"),
         PERMANENT),
        (OperationalError(TStatus(errorMessage="[TABLE_OR_VIEW_NOT_FOUND] The table or view `x` cannot be found.")),
         PERMANENT),
        (OperationalError(TStatus(errorMessage="[PARSE_SYNTAX_ERROR] Syntax error at or near 'SELEC'.")), PERMANENT),
    ]
    for exc, want in cases:
        assert transient(exc) is want, (type(exc).__name__, str(exc))


def test_bigquery_errors_are_classified():
    pytest.importorskip("google.cloud.bigquery")
    import requests
    from google.api_core import exceptions as gexc

    from habitus.resources.warehouses.bigquery import transient

    cases = [
        (gexc.ServiceUnavailable("backend unavailable"), TRANSIENT),
        (gexc.InternalServerError("internal error"), TRANSIENT),
        (gexc.TooManyRequests("slow down"), TRANSIENT),
        (gexc.GatewayTimeout("timeout"), TRANSIENT),
        (gexc.Forbidden("Exceeded rate limits", errors=[{"reason": "rateLimitExceeded"}]), TRANSIENT),
        (gexc.RetryError("Deadline of 10.0s exceeded", cause=requests.exceptions.ConnectionError("refused")),
         TRANSIENT),
        (requests.exceptions.ConnectionError("Connection refused"), TRANSIENT),
        (gexc.BadRequest("Syntax error: Unexpected identifier \"SELEC\" at [1:1]"), PERMANENT),
        (gexc.NotFound("Not found: Table habitus:shop.no_such_table"), PERMANENT),
        (gexc.Unauthorized("Request had invalid authentication credentials"), PERMANENT),
        (gexc.Forbidden("Access Denied: Table shop.events", errors=[{"reason": "accessDenied"}]), PERMANENT),
        (gexc.Conflict("Already Exists: Table shop.events"), PERMANENT),
    ]
    for exc, want in cases:
        assert transient(exc) is want, (type(exc).__name__, str(exc))


def test_s3_errors_are_classified():
    from habitus.resources.warehouses.parquet import transient

    cases = [
        (OSError("When reading information for key 'shop/events.parquet' in bucket 'lake': AWS Error "
                 "NETWORK_CONNECTION during HeadObject operation: curlCode: 7, Could not connect to server"), TRANSIENT),
        (OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data "
                 "from the peer"), TRANSIENT),
        (OSError("AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."), TRANSIENT),
        (OSError("AWS Error SERVICE_UNAVAILABLE during GetObject operation"), TRANSIENT),
        (OSError("When getting information for key 'shop/events.parquet' in bucket 'lake': AWS Error ACCESS_DENIED "
                 "during HeadObject operation: No response body."), PERMANENT),
        (OSError("AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2 operation: The AWS Access Key Id you provided "
                 "does not exist in our records."), PERMANENT),
        (OSError("Bucket 'nope' not found: AWS Error NO_SUCH_BUCKET"), PERMANENT),
    ]
    for exc, want in cases:
        assert transient(exc) is want, str(exc)


def test_transport_failures_and_only_they_are_network_errors():
    """A real refused connection is one; a name that does not resolve, a bug and an auth failure are not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError) as refused:
        socket.create_connection(("127.0.0.1", port), timeout=2)
    assert network_error(refused.value)
    try:
        raise RuntimeError("wrapped") from refused.value
    except RuntimeError as wrapped:
        assert network_error(wrapped)  # found through the cause
    assert not network_error(socket.gaierror(-2, "Name or service not known"))
    assert not network_error(ValueError("a bug"))
    assert not network_error(ConnectionError("401 Unauthorized"))


# --------------------------------------------------------------------------- the RetryPolicy on a source asset


def _source_run(tmp_path, connection: dict, columns, retries=2, delay=0.5):
    from habitus.assets.sources import build_source_asset
    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.build import build_resources
    from habitus.pipelines.orchestration.partitions import events_partitions

    cfg = {"workspace": "ws", "connections": {"wh": connection}, "entity": "customer_id",
           "sources": [{"name": "events", "role": "events", "connection": "wh", "table": "events", "timestamp": "ts",
                        "columns": columns, "start": "2026-03-01", "end": "2026-04-01"}],
           "retries": {"max_retries": retries, "delay_s": delay}}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    project = load_project(tmp_path / "project.yaml")
    asset = build_source_asset(project, project.source("events"), events_partitions(project.source("events")))
    started = time.monotonic()
    result = dg.materialize([asset], resources=build_resources(project), partition_key="2026-03-01",
                            raise_on_error=False)
    return result, time.monotonic() - started


def _kinds(result, kind):
    return [e for e in result.all_events if e.event_type_value == kind]


@pytest.mark.faults
def test_a_refused_connection_is_retried_with_backoff_then_fails_naming_the_host(tmp_path):
    pytest.importorskip("snowflake.connector")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens
    connection = {"type": "snowflake", "account": "acme", "user": "u", "password": "p", "host": "127.0.0.1",
                  "port": port, "protocol": "http", "login_timeout": 2, "network_timeout": 2}
    result, seconds = _source_run(tmp_path, connection, ["price"], retries=2, delay=0.5)
    assert not result.success
    retries = _kinds(result, "STEP_UP_FOR_RETRY")
    assert len(retries) == 2  # both retries spent, then the step failed
    waits = [e.event_specific_data.seconds_to_wait for e in retries]
    # exponential backoff, (2**n - 1) x 0.5 s: 0.5 s, then 1.5 s, each +- 0.5 s of jitter
    assert 0 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 2.0, waits
    failure = _kinds(result, "STEP_FAILURE")[-1].event_specific_data.error
    text = failure.message + (failure.cause.message if failure.cause else "")
    assert f"127.0.0.1:{port}" in text and "connection 'wh'" in text and "attempt 3" in text, text


@pytest.mark.faults
def test_a_missing_column_fails_at_once_without_spending_retries(tmp_path, duckdb_sql):
    duckdb_sql(tmp_path / "w.duckdb", "CREATE TABLE events AS SELECT 'C1' AS customer_id, "
                                      "TIMESTAMP '2026-03-02' AS ts, 1.5 AS price")
    result, seconds = _source_run(tmp_path, {"type": "duckdb", "path": "w.duckdb"}, ["price", "no_such_column"],
                                  retries=3, delay=30)
    assert not result.success and _kinds(result, "STEP_UP_FOR_RETRY") == []
    assert seconds < 30  # no retry was waited for
    message = _kinds(result, "STEP_FAILURE")[-1].event_specific_data.error.message
    assert "no_such_column" in message, message


def test_every_warehouse_error_says_whether_it_is_transient():
    assert WarehouseError("x").transient is False and WarehouseError("x", transient=True).transient is True


def test_the_retry_policy_is_the_configs_retries_top_level_then_per_source_key_by_key(tmp_path, recwarn):
    from habitus.pipelines.config.project import load_project
    from habitus.pipelines.orchestration.build import build_assets

    source = lambda name, **kw: {"name": name, "role": "events", "connection": "wh", "table": name, "timestamp": "ts",
                                 "start": "2026-03-01", **kw}
    cfg = {"workspace": "ws", "connections": {"wh": {"type": "duckdb", "path": "w.duckdb"}}, "entity": "customer_id",
           "sources": [source("default"), source("own", retries={"max_retries": 0}),
                       source("slow", retries={"delay_s": 45, "max_retries": 6})]}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))

    def policies():
        assets = build_assets(load_project(tmp_path / "project.yaml"))
        return {a.key.path[-1]: (a.op.retry_policy.max_retries, a.op.retry_policy.delay)
                for a in assets if a.key.path[0] == "source"}

    assert policies() == {"default": (3, 10.0), "own": (0, 10.0), "slow": (6, 45.0)}  # the defaults: 3 after 10 s
    cfg["retries"] = {"max_retries": 5, "delay_s": 2}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    assert policies() == {"default": (5, 2.0), "own": (0, 2.0), "slow": (6, 45.0)}
    policy = build_assets(load_project(tmp_path / "project.yaml"))[0].op.retry_policy
    assert policy.backoff == dg.Backoff.EXPONENTIAL and policy.jitter == dg.Jitter.PLUS_MINUS
    assert not [w for w in recwarn if "no longer read" in str(w.message)]


def test_the_retired_retry_variables_are_not_read_and_say_where_the_setting_went(tmp_path, monkeypatch):
    from habitus.pipelines.config.project import load_project

    cfg = {"workspace": "ws", "connections": {"wh": {"type": "duckdb", "path": "w.duckdb"}}, "entity": "customer_id",
           "sources": [{"name": "e", "role": "events", "connection": "wh", "table": "e", "timestamp": "ts",
                        "start": "2026-03-01"}]}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("HABITUS_EXTRACT_RETRIES", "9")
    with pytest.warns(UserWarning, match=r"HABITUS_EXTRACT_RETRIES is set but no longer read: write `retries: "
                                         r"\{max_retries: \.\.\.\}`"):
        project = load_project(tmp_path / "project.yaml")
    assert project.extraction_retries(project.source("e")).max_retries == 3
    # the config can still read a variable, explicitly
    monkeypatch.delenv("HABITUS_EXTRACT_RETRIES")
    monkeypatch.setenv("MY_RETRIES", "9")
    cfg["retries"] = {"max_retries": "${MY_RETRIES:-3}"}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(cfg))
    project = load_project(tmp_path / "project.yaml")
    assert project.extraction_retries(project.source("e")).max_retries == 9
