"""Tests for habitus.pipelines.config.project.load_project: loading, paths, ${ENV}, durations, errors, secrets."""

import copy
import json
import traceback
from pathlib import Path

import pytest
import yaml

from habitus.models.cache import DUCKDB_MEMORY, DUCKDB_THREADS, PART_EVENTS
from habitus.models.train.config import FinetuneConfig, FoundationConfig
from habitus.pipelines.config.project import CONFIG_ENV, ConfigError, load_project

REPO = Path(__file__).resolve().parents[2]

# A minimal valid project, modelled on examples/demo.yaml.
BASE = {
    "workspace": "ws",
    "connections": {"warehouse": {"type": "duckdb", "path": "data/warehouse.duckdb"}},
    "entity": "customer_id",
    "sources": [
        {"name": "purchases", "role": "events", "connection": "warehouse", "table": "purchases",
         "timestamp": "ts", "columns": ["product_id", "store_id", "quantity", "price"],
         "partition": "monthly", "start": "2026-03-01"},
        {"name": "customers", "role": "entity_attributes", "connection": "warehouse", "table": "customers",
         "columns": ["age", "region"]},
        {"name": "products", "role": "attributes", "connection": "warehouse", "table": "products",
         "key": "product_id", "columns": ["category", "brand"]},
    ],
    "foundation": {"horizon": "14d", "cutoff_every": "7d", "hidden": 64, "layers": 1, "epochs": 1},
    "scenarios": {
        "churn": {"task": "binary", "target": {"no_event": "purchases", "within": "28d"}},
        "brands": {"task": "multilabel", "target": {"any_event": "purchases", "by": "brand", "within": "2w"}},
        "spend": {"task": "regression", "target": {"sum": "purchases.price", "within": "28d"}},
        "next_products": {"task": "recommendation", "target": {"items": "purchases.product_id", "within": "14d"}},
    },
    "predictions": {"top_k": 20, "start": "2026-10-01"},
}

# Env vars the tests use; always removed first so the machine's environment cannot leak in.
ENV_NAMES = ["HABITUS_T_WS", "HABITUS_T_MISSING", "HABITUS_T_SECRET", "HABITUS_T_OTHER", CONFIG_ENV,
             "HABITUS_WORKSPACE", "HABITUS_DEMO_WAREHOUSE"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def base() -> dict:
    return copy.deepcopy(BASE)


def write(tmp_path: Path, content, name: str = "project.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def config_error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_project(path)
    return str(info.value)


# --------------------------------------------------------------------------- loading


def test_demo_config_loads():
    project = load_project(REPO / "examples" / "demo.yaml")
    examples = REPO / "examples"
    assert project.workspace == str((examples / "../.habitus/demo").resolve())
    assert project.connections["warehouse"].type == "duckdb"
    assert project.connections["warehouse"].path == str((examples / "../.habitus/demo_warehouse.duckdb").resolve())
    assert [s.name for s in project.sources] == ["purchases", "customers", "products", "stores"]
    assert [s.name for s in project.events_sources] == ["purchases"]
    assert project.foundation.horizon == 14
    assert project.scenarios["churn"].target.within == 28
    assert project.prediction_scenarios == ["churn", "brand_propensity", "spend", "next_products", "next_category"]


def test_minimal_config_loads(tmp_path):
    project = load_project(write(tmp_path, base()))
    assert project.entity == "customer_id"
    assert project.source("purchases").columns == ["product_id", "store_id", "quantity", "price"]
    assert project.source("products").key == "product_id"
    assert str(project.source("purchases").start) == "2026-03-01"
    assert set(project.scenarios) == {"churn", "brands", "spend", "next_products"}
    assert {sc.head for sc in project.scenarios.values()} == {"chosen"}  # the head is chosen on validation


def test_the_config_translates_once_into_the_models_settings(tmp_path):
    """The YAML's defaults are models/train/config.py's (declared once); what a user sets reaches the models."""
    cfg = base()
    del cfg["foundation"]
    project = load_project(write(tmp_path, cfg))
    assert project.foundation.config() == FoundationConfig()
    assert project.scenarios["churn"].finetune_config() == FinetuneConfig()
    set_by_user = load_project(write(tmp_path, base()))
    f = set_by_user.foundation.config()
    assert (f.hidden, f.layers, f.epochs, f.horizon_days, f.cutoff_every_days) == (64, 1, 1, 14, 7)
    assert set_by_user.scenarios["spend"].finetune_config(spill_dir="/spill").spill_dir == "/spill"
    assert project.cache.build_options() == {"duckdb_memory": DUCKDB_MEMORY, "duckdb_threads": DUCKDB_THREADS,
                                             "part_events": PART_EVENTS}


def test_cache_settings_are_checked(tmp_path):
    cfg = {**base(), "cache": {"duckdb_memory": "lots", "duckdb_threads": 0}}
    message = config_error(write(tmp_path, cfg))
    assert "cache.duckdb_memory" in message and "cache.duckdb_threads" in message
    cfg["cache"] = {"duckdb_memory": "512MB", "duckdb_threads": 2}
    assert load_project(write(tmp_path, cfg)).cache.build_options()["duckdb_memory"] == "512MB"


def test_relative_paths_resolve_against_config_folder(tmp_path, monkeypatch):
    cfg = base()
    cfg["output"] = "out/artifacts"
    cfg["connections"]["files"] = {"type": "parquet", "path": "../lake"}
    cfg["connections"]["abs"] = {"type": "duckdb", "path": str(tmp_path / "abs.duckdb")}
    path = write(tmp_path, cfg, "project/habitus.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the cwd must not matter
    project = load_project(path)
    folder = (tmp_path / "project").resolve()
    assert project.workspace == str(folder / "ws")
    assert project.workspace_path == folder / "ws"
    assert project.output == str(folder / "out" / "artifacts")
    assert project.connections["warehouse"].path == str(folder / "data" / "warehouse.duckdb")
    assert project.connections["files"].path == str(tmp_path.resolve() / "lake")
    assert project.connections["abs"].path == str(tmp_path / "abs.duckdb")


def test_object_storage_output_is_kept_as_is(tmp_path):
    cfg = base()
    cfg["output"] = "s3://bucket/habitus/"
    assert load_project(write(tmp_path, cfg)).output == "s3://bucket/habitus/"


def test_habitus_config_env_chooses_the_file(tmp_path, monkeypatch):
    cfg = base()
    cfg["entity"] = "member_id"
    path = write(tmp_path, cfg, "chosen.yaml")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert load_project().entity == "member_id"
    # an explicit path still wins over the variable
    other = base()
    other["entity"] = "account_id"
    assert load_project(write(tmp_path, other, "explicit.yaml")).entity == "account_id"


def test_default_path_missing_names_the_env_var(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no examples/demo.yaml here
    message = str(pytest.raises(ConfigError, load_project).value)
    assert "examples/demo.yaml" in message and CONFIG_ENV in message


# --------------------------------------------------------------------------- ${ENV}


def test_env_substitution_and_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_WS", str(tmp_path / "from_env"))
    text = yaml.safe_dump(base(), sort_keys=False)
    text = text.replace("workspace: ws", "workspace: ${HABITUS_T_WS}")
    text += "output: ${HABITUS_T_OTHER:-/mnt/out}\n"
    project = load_project(write(tmp_path, text))
    assert project.workspace == str(tmp_path / "from_env")
    assert project.output == "/mnt/out"


def test_env_reference_outside_secrets_and_locations_is_an_error_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_OTHER", "member_id")
    for old, new, key in (("entity: customer_id", "entity: ${HABITUS_T_OTHER}", "entity"),
                          ("table: products", "table: ${HABITUS_T_OTHER:-}products", "sources[2].table")):
        text = yaml.safe_dump(base(), sort_keys=False).replace(old, new)
        message = config_error(write(tmp_path, text))
        assert f"{key}: ${{...}} reads the environment only in connections" in message, message
        assert "member_id" not in message


def test_env_set_value_wins_over_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_OTHER", str(tmp_path / "member"))
    text = yaml.safe_dump(base(), sort_keys=False).replace("workspace: ws", "workspace: ${HABITUS_T_OTHER:-ws}")
    assert load_project(write(tmp_path, text)).workspace == str(tmp_path / "member")


def test_missing_env_var_names_file_line_and_variable(tmp_path):
    lines = yaml.safe_dump(base(), sort_keys=False).splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("workspace:"))
    lines[index] = "workspace: ${HABITUS_T_MISSING}"
    path = write(tmp_path, "\n".join(lines) + "\n")
    message = config_error(path)
    assert f"{path}:{index + 1}" in message
    assert "HABITUS_T_MISSING" in message


# --------------------------------------------------------------------------- durations


def test_durations_become_days(tmp_path):
    cfg = base()
    cfg["foundation"].update(horizon="2w", cutoff_every="3d")
    project = load_project(write(tmp_path, cfg))
    assert project.foundation.horizon == 14
    assert project.foundation.cutoff_every == 3
    assert project.scenarios["churn"].target.within == 28
    assert project.scenarios["churn"].target.active_within == 90
    assert project.scenarios["brands"].target.within == 14
    assert isinstance(project.scenarios["spend"].target.within, int)


@pytest.mark.parametrize("bad", ["28x", "0d", "d", "-1d", 0])
def test_bad_duration_names_key(tmp_path, bad):
    cfg = base()
    cfg["scenarios"]["churn"]["target"]["within"] = bad
    path = write(tmp_path, cfg)
    message = config_error(path)
    assert str(path) in message
    assert "scenarios.churn.target.within" in message
    assert "duration" in message


# --------------------------------------------------------------------------- errors


def _src(cfg, **changes):
    cfg["sources"][0].update(changes)
    return cfg


def _without(cfg, *keys):
    cfg = copy.deepcopy(cfg)
    node = cfg
    for k in keys[:-1]:
        node = node[k]
    del node[keys[-1]]
    return cfg


def _rename(cfg, old, new):
    cfg["sources"][0][new] = cfg["sources"][0].pop(old)
    return cfg


def _dup_column(cfg):
    cfg["sources"][0]["columns"] = ["product_id", "price", "product_id"]
    return cfg


def _set(path, value):
    def change(cfg):
        node = cfg
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
        return cfg
    return change


BAD_CONFIGS = {
    "unknown_key": (lambda c: _rename(c, "columns", "colums"), ["sources[0].colums", "unknown key"]),
    "unknown_top_key": (_set(["sauces"], []), ["sauces", "unknown key"]),
    "missing_entity": (lambda c: _without(c, "entity"), ["entity", "required key is missing"]),
    "missing_table": (lambda c: _without(c, "sources", 1, "table"), ["sources[1].table", "required key is missing"]),
    "s3_workspace": (_set(["workspace"], "s3://bucket/x"), ["workspace", "POSIX", "real filesystem", "s3://bucket/x"]),
    "undefined_connection": (lambda c: _src(c, connection="nope"),
                             ["sources[0]", "'nope'", "connections", "warehouse"]),
    "events_without_timestamp": (lambda c: _without(c, "sources", 0, "timestamp"), ["sources[0]", "timestamp"]),
    "column_listed_twice": (_dup_column, ["sources[0]", "product_id", "more than once"]),
    "target_does_not_fit_task": (_set(["scenarios", "churn", "task"], "regression"),
                                 ["scenarios.churn", "'regression'", "sum"]),
    "unknown_target_kind": (_set(["scenarios", "churn", "target"], {"nothing": "purchases", "within": "7d"}),
                            ["scenarios.churn.target", "no_event", "any_event", "sum", "items"]),
    "target_on_non_events_source": (_set(["scenarios", "churn", "target", "no_event"], "customers"),
                                    ["scenarios.churn.target", "'customers'", "not an events source", "purchases"]),
    "predictions_unknown_scenario": (_set(["predictions", "scenarios"], ["churn", "attrition"]),
                                     ["predictions.scenarios", "'attrition'", "not a scenario"]),
    "unknown_connection_type": (_set(["connections", "warehouse", "type"], "oracle"),
                                ["connections.warehouse", "'oracle'", "duckdb", "snowflake"]),
    "bad_role": (lambda c: _src(c, role="facts"), ["sources[0].role", "events"]),
    "bad_source_name": (lambda c: _src(c, name="my-purchases"), ["sources[0].name"]),
    "no_sources": (_set(["sources"], []), ["sources", "at least 1"]),
    "scenario_name_is_a_path": (lambda c: {**c, "scenarios": {"../x": c["scenarios"]["churn"]}},
                                ["scenarios", "scenario name '../x'", "letters, digits"]),
    "share_above_one": (lambda c: {**c, "quality": {"max_dropped_share": 1.5}}, ["quality.max_dropped_share", "less than or equal to 1"]),
    "unknown_head": (_set(["scenarios", "churn", "head"], "trees"), ["scenarios.churn.head", "'chosen'", "'network'"]),
    "save_every_zero": (_set(["foundation", "save_every_steps"], 0), ["foundation.save_every_steps", "greater than or equal to 1"]),
    "negative_retries": (_set(["retries"], {"max_retries": -1}), ["retries.max_retries", "greater than or equal to 0"]),
    "retry_delay_not_a_number": (_set(["retries"], {"delay_s": "10s"}), ["retries.delay_s", "a valid number"]),
    "source_retries_unknown_key": (lambda c: _src(c, retries={"attempts": 4}),
                                   ["sources[0].retries.attempts", "unknown key"]),
    "source_retry_delay_too_long": (lambda c: _src(c, retries={"delay_s": 7200}),
                                    ["sources[0].retries.delay_s", "less than or equal to 3600"]),
}


def test_a_key_written_twice_is_refused_with_both_lines(tmp_path):
    """Plain YAML keeps the last of two equal keys silently: a second `columns:` would drop the first."""
    text = yaml.safe_dump(base(), sort_keys=False).replace(
        "  columns:\n  - product_id\n", "  columns: [price]\n  columns:\n  - product_id\n", 1)
    assert text.count("columns: [price]") == 1
    message = config_error(write(tmp_path, text))
    assert "not valid YAML" in message and "found the key 'columns' twice (first on line" in message
    assert "keep one" in message


def test_a_scenario_written_twice_is_refused(tmp_path):
    text = yaml.safe_dump(base(), sort_keys=False).replace(
        "predictions:", "  churn: {task: binary, target: {no_event: purchases, within: 7d}}\npredictions:")
    assert "found the key 'churn' twice" in config_error(write(tmp_path, text))


def test_quality_limits_default_and_can_be_set(tmp_path):
    assert load_project(write(tmp_path, base())).quality.max_dropped_share == 0.01
    cfg = base()
    cfg["quality"] = {"max_dropped_share": 0.2, "max_repaired_share": 0.0, "max_categories": 10}
    q = load_project(write(tmp_path, cfg)).quality
    assert (q.max_dropped_share, q.max_repaired_share, q.max_categories) == (0.2, 0.0, 10)


def test_retries_default_can_be_set_and_a_source_overrides_them_key_by_key(tmp_path):
    project = load_project(write(tmp_path, base()))
    r = project.extraction_retries(project.source("purchases"))
    assert (r.max_retries, r.delay_s) == (3, 10.0) and project.source("purchases").retries is None
    cfg = base()
    cfg["retries"] = {"max_retries": 5, "delay_s": 2.5}
    cfg["sources"][0]["retries"] = {"delay_s": 60}
    cfg["sources"][1]["retries"] = {"max_retries": 0}
    project = load_project(write(tmp_path, cfg))
    got = {s.name: project.extraction_retries(s) for s in project.sources}
    assert {n: (r.max_retries, r.delay_s) for n, r in got.items()} == {
        "purchases": (5, 60.0), "customers": (0, 2.5), "products": (5, 2.5)}
    assert project.public_dict()["retries"] == {"max_retries": 5, "delay_s": 2.5}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_names_file_key_and_expectation(tmp_path, case):
    change, expected = BAD_CONFIGS[case]
    path = write(tmp_path, change(base()))
    message = config_error(path)
    assert str(path) in message
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


def test_only_events_sources_fails(tmp_path):
    cfg = base()
    cfg["sources"] = cfg["sources"][1:]
    cfg["scenarios"] = {}
    message = config_error(write(tmp_path, cfg))
    assert "role: events" in message


def test_every_problem_is_reported(tmp_path):
    cfg = _rename(base(), "columns", "colums")
    del cfg["entity"]
    message = config_error(write(tmp_path, cfg))
    assert "2 problem(s)" in message
    assert "sources[0].colums" in message and "entity" in message


def test_invalid_yaml(tmp_path):
    path = write(tmp_path, yaml.safe_dump(base(), sort_keys=False) + "broken: [1, 2\n")
    message = config_error(path)
    assert str(path) in message and "not valid YAML" in message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", ""])
def test_non_mapping_file(tmp_path, text):
    path = write(tmp_path, text)
    message = config_error(path)
    assert str(path) in message and "mapping" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    message = config_error(path)
    assert str(path) in message and "not found" in message


def test_directory_is_not_a_config(tmp_path):
    message = config_error(tmp_path)
    assert "not found" in message


# --------------------------------------------------------------------------- secrets

SECRET = "S3cr3t-Pa55word-9f8e7d"


def _with_snowflake(cfg: dict) -> str:
    cfg["connections"]["sf"] = {"type": "snowflake", "account": "acme", "user": "loader",
                                "password": "__SECRET__", "warehouse": "X"}
    return yaml.safe_dump(cfg, sort_keys=False).replace("__SECRET__", "${HABITUS_T_SECRET}")


def test_public_dict_has_no_connection_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_SECRET", SECRET)
    project = load_project(write(tmp_path, _with_snowflake(base())))
    assert project.connections["sf"].password == SECRET  # the driver gets it
    public = project.public_dict()
    assert public["connections"] == {"warehouse": {"type": "duckdb"}, "sf": {"type": "snowflake"}}
    text = json.dumps(public)
    assert SECRET not in text
    assert "acme" not in text and "loader" not in text
    assert public["entity"] == "customer_id" and public["sources"][0]["name"] == "purchases"


UNRELATED_ERRORS = {
    "unknown_key": lambda c: _rename(c, "columns", "colums"),
    "undefined_connection": lambda c: _src(c, connection="nope"),
    "predictions_unknown_scenario": _set(["predictions", "scenarios"], ["attrition"]),
    "target_on_non_events_source": _set(["scenarios", "churn", "target", "no_event"], "customers"),
    "s3_workspace": _set(["workspace"], "s3://bucket/x"),
    "no_events_source": lambda c: {**c, "sources": c["sources"][1:], "scenarios": {}},
}


@pytest.mark.parametrize("case", sorted(UNRELATED_ERRORS))
def test_secret_never_in_error_messages(tmp_path, monkeypatch, case):
    monkeypatch.setenv("HABITUS_T_SECRET", SECRET)
    path = write(tmp_path, _with_snowflake(UNRELATED_ERRORS[case](base())))
    with pytest.raises(ConfigError) as info:
        load_project(path)
    assert SECRET not in str(info.value)
    assert SECRET not in "".join(traceback.format_exception(info.value))


def test_secret_not_in_yaml_error_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_SECRET", SECRET)
    path = write(tmp_path, _with_snowflake(base()) + "broken: [1, 2\n")
    message = config_error(path)
    assert "not valid YAML" in message and SECRET not in message


def test_secret_not_in_missing_variable_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_SECRET", SECRET)
    text = _with_snowflake(base()).replace("workspace: ws", "workspace: ${HABITUS_T_MISSING}")
    message = config_error(write(tmp_path, text))
    assert "HABITUS_T_MISSING" in message and SECRET not in message


# --------------------------------------------------------------------------- known bugs


def test_secret_with_yaml_syntax_never_leaks(tmp_path, monkeypatch):
    secret = "hunter2: Zq9-leak"
    monkeypatch.setenv("HABITUS_T_SECRET", secret)
    path = write(tmp_path, _with_snowflake(base()))
    try:
        project = load_project(path)
    except ConfigError as e:
        assert secret not in str(e)
        assert "Zq9-leak" not in str(e)
    else:
        assert project.connections["sf"].password == secret


def test_env_value_is_substituted_verbatim(tmp_path, monkeypatch):
    monkeypatch.setenv("HABITUS_T_SECRET", "abc #def")
    project = load_project(write(tmp_path, _with_snowflake(base())))
    assert project.connections["sf"].password == "abc #def"


def test_env_reference_in_comment_is_ignored(tmp_path):
    text = "# old setup, kept for reference: ${HABITUS_T_MISSING}\n" + yaml.safe_dump(base(), sort_keys=False)
    assert load_project(write(tmp_path, text)).entity == "customer_id"
