"""Parser limits of project configs: a 5,000-digit integer, nesting thousands deep (flow and block style,
and 200,000 deep) and a file past the size limit each end in the project's ConfigError naming the file,
never a RecursionError or ValueError traceback. A Hive server that refuses to switch variable
substitution off is a connection error, not ignored."""

import sys
import types

import pytest
import yaml

from habitus.pipelines.config.project import ConfigError, load_project
from habitus.pipelines.config.file import MAX_BYTES, MAX_DEPTH

BASE = ("workspace: ws\nconnections: {w: {type: duckdb, path: x.duckdb}}\nentity: c\n"
        "sources: [{name: e, role: events, connection: w, table: t, timestamp: ts, start: 2026-01-01}]\n")

BOMBS = {
    "int_5000": "foundation: {epochs: " + "1" * 5000 + "}\n",
    "hex_5000": "foundation: {epochs: 0x" + "f" * 5000 + "}\n",
    "sexagesimal": "foundation: {epochs: " + ":".join(["59"] * 3000) + "}\n",
    "flow_lists_200000": "x: " + "[" * 200_000 + "]" * 200_000 + "\n",
    "flow_maps_5000": "x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
    "block_maps_400": "".join("  " * i + f"k{i}:\n" for i in range(400)) + "  " * 400 + "v: 1\n",
    "block_lists_400": "x:\n" + "".join("  " * i + "-\n" for i in range(1, 400)) + "  " * 400 + "- 1\n",
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_config_bombs_are_the_projects_error_naming_the_file(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(BASE + BOMBS[name])
    with pytest.raises(ConfigError) as e:
        load_project(path)
    assert str(path) in str(e.value)
    assert "number of" in str(e.value) or f"more than {MAX_DEPTH} levels" in str(e.value)


def test_init_takes_a_connection_on_the_command_line_within_the_same_limits(capsys):
    from habitus.pipelines.init.command import main as init_main

    for text in ("{type: hive, port: " + "1" * 5000 + "}", "{type: hive, x: " + "[" * 100_000 + "]" * 100_000 + "}"):
        assert init_main(["--connection", text]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --connection: not valid YAML") and "Traceback" not in err


def test_an_integer_from_the_environment_is_bounded_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_BIG", "9" * 5000)
    path = tmp_path / "project.yaml"
    path.write_text(BASE + "retries: {max_retries: '${HABITUS_T_BIG}'}\n")
    with pytest.raises(ConfigError) as e:
        load_project(path)
    assert str(path) in str(e.value) and "retries.max_retries" in str(e.value) and "9" * 50 not in str(e.value)


def test_a_file_past_the_size_limit_and_the_limits_a_config_stays_within(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(BASE + "# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(ConfigError, match="bytes") as e:
        load_project(path)
    assert str(path) in str(e.value)
    ok = tmp_path / "ok.yaml"  # nesting under the limit and a long (but sane) integer are read
    ok.write_text(BASE + "foundation: {epochs: 3}\nx: " + "[" * (MAX_DEPTH - 3) + "]" * (MAX_DEPTH - 3) + "\n")
    with pytest.raises(ConfigError, match="x: unknown key"):  # parsed: only the schema refuses it
        load_project(ok)
    assert yaml.safe_load(BASE)  # the base itself is plain YAML
    ok.write_text(BASE + "foundation: {epochs: 3}\n")
    assert load_project(ok).foundation.epochs == 3


class _Cursor:
    def __init__(self, refused: set[str]):
        self.refused = refused

    def execute(self, sql):
        if any(s in sql for s in self.refused):
            raise RuntimeError("Error while processing statement: Cannot modify hive.variable.substitute at "
                               "runtime. It is in the list of parameters that can't be modified at runtime")


class _Con:
    def __init__(self, refused):
        self.refused, self.closed = refused, False

    def cursor(self):
        return _Cursor(self.refused)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("refused", [{"hive.variable.substitute"}, {"spark.sql.variable.substitute"}, set()])
def test_a_hive_server_that_keeps_substitution_on_is_an_error(monkeypatch, refused):
    from habitus.resources.warehouses.errors import WarehouseError
    from habitus.resources.warehouses.hive import SUBSTITUTION_OFF, HiveWarehouse

    made = []

    def connection(**kw):
        made.append(_Con(refused))
        return made[-1]

    pyhive = types.ModuleType("pyhive")
    pyhive.hive = types.SimpleNamespace(Connection=connection)
    monkeypatch.setitem(sys.modules, "pyhive", pyhive)
    monkeypatch.setitem(sys.modules, "pyhive.hive", pyhive.hive)
    monkeypatch.setenv("HABITUS_T_HIVE_PW", "hive-pw-planted-7c2")
    wh = HiveWarehouse(name="lake", host="hive.internal", port=10000, auth="KERBEROS", password="${HABITUS_T_HIVE_PW}")
    assert set(SUBSTITUTION_OFF) == {"hive.variable.substitute", "spark.sql.variable.substitute"}
    if not refused:
        assert wh._connect() is made[-1] and not made[-1].closed
        return
    with pytest.raises(WarehouseError) as e:
        wh._connect()
    text = str(e.value)
    assert "'lake'" in text and "hive.internal:10000" in text and f"SET {next(iter(refused))}=false" in text
    assert "hive.conf.restricted.list" in text and "hive-pw-planted" not in text
    assert made[-1].closed and not e.value.transient
