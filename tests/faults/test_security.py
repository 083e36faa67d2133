"""No injection, no leaks, no escapes: hostile table and column names reach SQL only quoted (DuckDB, end
to end through the source asset and the cache), a planted secret appears nowhere a run writes, and
config names cannot lead outside the workspace."""

import re
from pathlib import Path

import dagster as dg
import duckdb
import pyarrow.parquet as pq
import pytest
import yaml

from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.orchestration.build import build_assets, build_resources
from habitus.resources.store.workspace import Workspace, WorkspaceError

ROOT = Path(__file__).resolve().parents[2]
HOSTILE_TABLE = 'x"; DROP TABLE y; --'
HOSTILE = {"customer": 'cust"; DROP TABLE y; --', "ts": "t'); DROP TABLE y; --",
           "product": 'x"; DROP TABLE y; --', "price": 'p"", 1); DELETE FROM y; --'}
SECRET = "s3cr3t-Planted-7f1c9a"

pytestmark = pytest.mark.filterwarnings("ignore::dagster.BetaWarning")


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def test_hostile_table_and_column_names_reach_sql_only_quoted(tmp_path):
    warehouse = tmp_path / "warehouse.duckdb"
    con = duckdb.connect(str(warehouse))
    con.sql("CREATE TABLE y AS SELECT 42 AS canary")
    c, t, p, v = (_quoted(HOSTILE[k]) for k in ("customer", "ts", "product", "price"))
    con.sql(f"CREATE TABLE {_quoted(HOSTILE_TABLE)} AS SELECT 'c' || (i % 50) AS {c}, "
            f"TIMESTAMP '2026-03-01' + to_seconds(i * 600) AS {t}, 'p' || (i % 7) AS {p}, i * 0.5 AS {v} "
            f"FROM range(2000) r(i)")
    con.close()
    config = {"workspace": "ws", "connections": {"w": {"type": "duckdb", "path": str(warehouse)}},
              "entity": HOSTILE["customer"],
              "sources": [{"name": "events", "role": "events", "connection": "w", "table": HOSTILE_TABLE,
                           "timestamp": HOSTILE["ts"], "columns": [HOSTILE["product"], HOSTILE["price"]],
                           "types": {HOSTILE["price"]: "numeric"}, "start": "2026-03-01", "end": "2026-04-01"}]}
    (tmp_path / "project.yaml").write_text(yaml.safe_dump(config))
    project = load_project(tmp_path / "project.yaml")
    assets = build_assets(project)
    result = dg.materialize(assets, selection=[dg.AssetKey(["source", "events"]), dg.AssetKey("cache")],
                            resources=build_resources(project), partition_key="2026-03-01")
    assert result.success
    files = sorted((tmp_path / "ws" / "sources" / "events").glob("*.parquet"))
    table = pq.read_table(files)
    assert table.num_rows == 2000 and set(table.column_names) == set(HOSTILE.values())
    manifest_dirs = [p for p in (tmp_path / "ws" / "cache").iterdir() if (p / "manifest.json").exists()]
    assert len(manifest_dirs) == 1
    import json

    manifest = json.loads((manifest_dirs[0] / "manifest.json").read_text())
    assert manifest["n_events"] == 2000 and manifest["n_entities"] == 50
    assert set(manifest["columns"]) == {HOSTILE["product"], HOSTILE["price"]}
    con = duckdb.connect(str(warehouse), read_only=True)
    assert con.sql("SELECT * FROM y").fetchall() == [(42,)]  # the canary survived every statement
    con.close()


def _scan(paths: list[Path], secret: str) -> list[str]:
    needle = secret.encode()
    found = []
    for root in paths:
        for f in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            if needle in f.read_bytes():
                found.append(str(f))
    return found


def test_a_planted_secret_appears_in_no_output_of_a_run(faults, tmp_path):
    """A whole run (every asset and check) with a connection whose password comes from the environment:
    the secret is in none of the workspace files, the Dagster storage (event logs, run records) or the
    console output; nor in the error of a run that uses that connection and fails."""
    # and nine more keys of other spellings, one of them a secret by origin only (TEN_KEYS, below)
    # and values that mix a secret with text or nest it (tests/faults/test_secret_origins.py)
    vault = {"type": "snowflake", "account": "acme", "user": "svc", "password": "${HABITUS_TEST_PASSWORD}",
             **{k: f"${{HABITUS_T_S{i}}}" for i, k in enumerate(TEN_KEYS) if i},
             "dsn": "snowflake://svc:${HABITUS_TEST_PASSWORD}@acme/db", "token_note": "pw-${HABITUS_TEST_PASSWORD}",
             "session_parameters": {"a": {"b": "${HABITUS_TEST_PASSWORD}", "c": ["x-${HABITUS_TEST_PASSWORD}"]}}}
    config = {**faults.config, "connections": {**faults.config["connections"], "vault": vault}}
    folder = faults.project(tmp_path / "run", config)
    env = {"HABITUS_TEST_PASSWORD": SECRET, **{f"HABITUS_T_S{i}": f"v{i}-{SECRET}" for i in range(1, len(TEN_KEYS))}}
    rc, out, _ = faults.run(folder, env=env)
    assert rc == 0, out[-3000:]
    assert "all assets materialized" in out
    assert SECRET not in out
    assert _scan([folder / "ws", folder / "dagster"], SECRET) == []

    # the same connection used by a source: the run fails, and its error names no secret
    events, *attributes = config["sources"]
    failing = faults.project(tmp_path / "fail", {**config, "sources": [{**events, "connection": "vault"}, *attributes]})
    rc, out, _ = faults.run(failing, env=env)
    assert rc != 0 and "purchases" in out
    assert SECRET not in out
    assert _scan([failing / "dagster"] + ([failing / "ws"] if (failing / "ws").exists() else []), SECRET) == []


def test_config_errors_never_echo_a_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_TEST_PASSWORD", SECRET)
    path = tmp_path / "project.yaml"
    path.write_text("workspace: ws\nconnections: {w: {type: duckdb, path: x.duckdb}}\nentity: c\n"
                    "sources: [{name: e, role: events, connection: w, table: t, timestamp: ts, start: 2026-01-01}]\n"
                    "foundation: {hidden: '${HABITUS_TEST_PASSWORD}', epochs: '${HABITUS_TEST_PASSWORD}'}\n")
    with pytest.raises(ConfigError) as info:
        load_project(path)
    assert "foundation.hidden" in str(info.value) and SECRET not in str(info.value)


@pytest.mark.parametrize("name", ["..", "../../etc", "a/b", "", ".", "x\\y"])
def test_workspace_paths_cannot_escape_the_root(tmp_path, name):
    ws = Workspace(root=str(tmp_path))
    for make in (ws.sources, ws.scenario, ws.predictions, lambda n: ws.resume("scenarios", n)):
        with pytest.raises(WorkspaceError, match="cannot be used as a workspace folder"):
            make(name)


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", "churn\n"])
def test_config_refuses_names_that_would_be_paths(tmp_path, name):
    path = tmp_path / "project.yaml"
    cfg = {"workspace": "ws", "connections": {"w": {"type": "duckdb", "path": "x.duckdb"}}, "entity": "c",
           "sources": [{"name": "e", "role": "events", "connection": "w", "table": "t", "timestamp": "ts",
                        "start": "2026-01-01"}],
           "scenarios": {name: {"task": "binary", "target": {"no_event": "e", "within": "14d"}}}}
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match="scenario name"):
        load_project(path)
    cfg["scenarios"] = {}
    cfg["sources"][0]["name"] = name
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError, match=r"sources\[0\]\.name"):
        load_project(path)


def test_ui_binds_to_localhost_and_the_image_runs_as_a_user():
    make = (ROOT / "Makefile").read_text()
    ui = re.search(r"^ui:.*\n\t(.+)$", make, re.M).group(1)
    assert "-h 127.0.0.1" in ui
    docker = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", docker, re.M)
    assert users and users[-1] not in ("root", "0")


# secrets under ten key names of different spellings, nine of them secret-named and one not (a secret by
# origin only: it came from ${VAR})
TEN_KEYS = ["password", "Password", "private_key_file_pwd", "oauth_client_secret", "accessToken", "API_KEY",
            "sasl_Passcode", "Credentials_JSON", "accountKey", "http_header_x"]


def _ten_secrets(tmp_path, monkeypatch) -> tuple[Path, dict[str, str]]:
    values = {f"HABITUS_T_S{i}": f"v{i}-{SECRET}" for i in range(len(TEN_KEYS))}
    for var, v in values.items():
        monkeypatch.setenv(var, v)
    vault = {"type": "hive", "host": "127.0.0.1", "port": 1, "connect_timeout": 1,
             **{k: f"${{HABITUS_T_S{i}}}" for i, k in enumerate(TEN_KEYS)}}
    path = tmp_path / "project.yaml"
    path.write_text(yaml.safe_dump({
        "workspace": "ws", "entity": "c", "connections": {"w": {"type": "duckdb", "path": "x.duckdb"}, "vault": vault},
        "sources": [{"name": "e", "role": "events", "connection": "w", "table": "t", "timestamp": "ts",
                     "start": "2026-01-01"}]}))
    return path, values


def test_secrets_by_origin_under_ten_spellings_are_masked_everywhere(tmp_path, monkeypatch, capsys):
    import json
    import warnings

    from habitus.pipelines.definitions import build_definitions
    from habitus.pipelines.init.command import _hide_secrets, main as init_main
    from habitus.resources.warehouses.remote import connect_error, query_error

    path, values = _ten_secrets(tmp_path, monkeypatch)
    project = load_project(path)
    assert sorted(project.connections["vault"].model_dump()[k] for k in TEN_KEYS) == sorted(values.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no secret here is written literally: no warning either
        warnings.simplefilter("ignore", dg.BetaWarning)
        defs = build_definitions(project)
    vault = defs.resources["warehouse_vault"] if "warehouse_vault" in defs.resources else next(
        r for r in defs.resources.values() if type(r).__name__ == "HiveWarehouse")
    shown = [repr(vault), json.dumps(vault.model_dump(), default=repr)]
    # init's printed connection
    shown.append(json.dumps(_hide_secrets("vault", project.connections["vault"].model_dump())))
    # a driver error quoting every value, as the connector reports it
    leak = RuntimeError("login failed: " + ", ".join(values.values()))
    shown += [str(connect_error("hive", "vault", "127.0.0.1:1", leak, vault._secrets())),
              str(query_error("hive", "vault", "t", leak, vault._secrets(), where="127.0.0.1:1"))]
    # init against the unreachable server: what it prints, out and err
    assert init_main(["--config", str(path), "--use", "vault", "--tables", "t"]) == 2
    captured = capsys.readouterr()
    shown += [captured.out, captured.err]
    assert "cannot connect" in captured.err
    for text in shown:
        for v in values.values():
            assert v not in text and SECRET not in text, text[:500]
    # every one of them reaches the resource as its reference, as written, and the driver as its value
    assert {vault.password, *vault.options.values()} >= {f"${{{var}}}" for var in values}
    assert sorted(vault.connect_kwargs()[k] for k in TEN_KEYS) == sorted(values.values())


def test_a_yaml_alias_bomb_is_refused_at_once_naming_the_file(tmp_path):
    import time

    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    text = "\n".join(lines) + "\n"
    assert len(text.encode()) <= 400  # 9^9 (387 million) strings once expanded
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_project(path)
    assert time.monotonic() - started < 1.0
    assert str(path) in str(info.value) and "alias" in str(info.value)


def test_a_checkpoint_is_hashed_and_parsed_from_the_same_bytes(tmp_path, monkeypatch):
    """Weights promoted between the hash check and the parse (another run swapping the folder in) are
    never paired with this config.json: what was hashed is what is returned."""
    import hashlib

    import torch

    import habitus.models.nn.checkpoint as checkpoint

    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    checkpoint.save_checkpoint(tmp_path / "a", first, {})
    checkpoint.save_checkpoint(tmp_path / "b", second, {})
    real = hashlib.sha256

    def hash_then_promote(data=b""):
        h = real(data)
        (tmp_path / "b" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
        return h

    monkeypatch.setattr(checkpoint.hashlib, "sha256", hash_then_promote)
    weights, _ = checkpoint.load_checkpoint(tmp_path / "a")
    monkeypatch.undo()
    assert torch.equal(weights["weight"], first.state_dict()["weight"])
    assert not torch.equal(weights["weight"], second.state_dict()["weight"])


@pytest.mark.parametrize("table", ["../x", "/etc/passwd", "a/../../x", "a\\..\\x", "", ".", "a//b"])
def test_parquet_tables_stay_inside_the_connection_folder(tmp_path, table):
    import pyarrow as pa

    from habitus.resources.warehouses.errors import WarehouseError
    from habitus.resources.warehouses.parquet import ParquetWarehouse

    wh = ParquetWarehouse(path=str(tmp_path / "lake"))
    schema = pa.schema([("a", pa.int64())])
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(WarehouseError, match="not a name inside the parquet connection's folder"):
        wh.write(table, iter([pa.record_batch([pa.array([1])], schema=schema)]), schema)
    with pytest.raises(WarehouseError, match="not a name inside"):
        wh.schema(table)
    assert sorted(p for p in tmp_path.rglob("*")) == before


def _selects(selector: dict, labels: dict) -> bool:
    """Whether a Kubernetes label selector (matchLabels, matchExpressions with In/Exists) selects `labels`."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "Exists" and e["key"] not in labels:
            return False
    return True


def test_the_network_policy_lets_only_dagster_reach_the_code_server_and_training_pods_reach_each_other():
    policies = {d["metadata"]["name"]: d["spec"] for d in
                yaml.safe_load_all((ROOT / "deploy" / "k8s" / "network-policy.yaml").read_text())}
    training = [d["spec"]["template"]["metadata"]["labels"] for d in
                yaml.safe_load_all((ROOT / "deploy" / "k8s" / "foundation-2-nodes.yaml").read_text()) if d["kind"] == "Job"]
    code_server, webserver, stranger = ({"component": "user-deployments", "app.kubernetes.io/name": "habitus"},
                                        {"component": "dagster-webserver"}, {"app": "anything-else"})

    def allowed(to: dict, source: dict, port: int) -> bool:
        for spec in policies.values():
            if _selects(spec["podSelector"], to):
                for rule in spec.get("ingress") or []:
                    ports = [p["port"] for p in rule.get("ports") or []]
                    if (not ports or port in ports) and any(_selects(f["podSelector"], source) for f in rule["from"]):
                        return True
        return False

    assert all(_selects(policies["habitus-deny-ingress"]["podSelector"], labels) for labels in training)
    assert policies["habitus-deny-ingress"].get("ingress") is None  # the default: nothing comes in
    assert allowed(code_server, webserver, 4000) and allowed(code_server, {"component": "dagster-daemon"}, 4000)
    assert not allowed(code_server, stranger, 4000) and not allowed(code_server, webserver, 22)
    assert not allowed(code_server, training[0], 4000)
    assert training and allowed(training[0], training[0], 29400) and not allowed(training[0], stranger, 29400)


def test_the_image_serves_the_code_location_on_a_configurable_host_documented_as_private():
    docker = (ROOT / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (.+)$", docker, re.M).group(1)
    assert '-h \\"$HABITUS_GRPC_HOST\\"' in cmd and "ENV HABITUS_GRPC_HOST=" in docker
    doc = (ROOT / "docs" / "guide" / "deploying.md").read_text()
    assert "## The code server" in doc and "127.0.0.1:4000:4000" in doc and "network-policy.yaml" in doc
