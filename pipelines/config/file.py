"""Reading a project config file: YAML with unique keys and no aliases, `${VAR}` substitution where a
secret or a location lives, relative paths and pydantic errors turned into lines that name the file and
the key.

`${VAR}` (or `${VAR:-default}`) expands in `connections`, `output` and `workspace` (secrets and
locations), in `mlflow` (a tracking URI may carry credentials), and in the deployment settings
`kubernetes`, `retries` and `schedules.sensor_interval`;
anywhere else it is an error naming the key (an `entity: ${DAGSTER_PG_PASSWORD}` would copy a secret into
table names and messages). A value holding a `${VAR}`, alone, mixed with text (`pw-${X}`,
`scheme://u:${X}@h`) or at any depth of a dict or list, is returned as `EnvValue`, a str that remembers
the text as written: a connection keeps that text in its resource (expanded where the driver takes it) and
it is masked wherever it is shown, whatever its key is called (pipelines/orchestration/build.py, pipelines/init/command.py,
resources/warehouses/masking.py).

The parser has limits: at most MAX_BYTES bytes, MAX_DEPTH levels of nesting and MAX_SCALAR characters in a
number; a file past them is a ConfigError naming it, never a RecursionError or a huge integer.
"""

import os
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

from habitus.pipelines.config.keys import nearest_key
from habitus.resources.warehouses.masking import ENV_REF as _ENV_REF, expand

CONFIG_ENV = "HABITUS_CONFIG"
# where ${VAR} may appear: the top-level key, or the dotted path of one setting
ENV_ALLOWED = ("connections", "output", "workspace", "kubernetes", "retries", "schedules.sensor_interval", "mlflow")
MAX_BYTES = 1 << 20  # a project config is a few KB; a bigger file is a mistake (or an attack on the parser)
MAX_DEPTH = 32  # levels of nested mappings and lists (a config uses six)
MAX_SCALAR = 100  # characters of a number (Python refuses ints past 4,300 digits with a ValueError)


class EnvValue(str):
    """A config value holding `${VAR}` references: the expanded text, with `.template` the text as written
    and `.var` the variable when the value is exactly one `${VAR}` that is set (else None)."""

    var: str | None
    template: str

    def __new__(cls, text: str, var: str | None = None, template: str | None = None):
        self = super().__new__(cls, text)
        self.var, self.template = var, template if template is not None else "${" + str(var) + "}"
        return self


def env_var(v) -> str | None:
    """The variable a config value came from when it was exactly `${VAR}`, or None."""
    return v.var if isinstance(v, EnvValue) else None


def env_template(v) -> str | None:
    """The text as written of a config value that holds `${VAR}` references (alone or mixed with text), or
    None for a value written in the file."""
    return v.template if isinstance(v, EnvValue) else None


def _env_allowed(where: str) -> bool:
    return any(where == a or where.startswith((a + ".", a + "[")) for a in ENV_ALLOWED)


class ConfigError(ValueError):
    """A project config that cannot be used; the message says where and what to do."""


def _line(text: str, reference: str):
    return next((i for i, ln in enumerate(text.splitlines(), 1)
                 if reference in ln and not ln.lstrip().startswith("#")), "?")


def substitute_env(node, path: Path, text: str, where: str = ""):
    """Replace ${VAR} / ${VAR:-default} in the parsed values (never in the YAML text: a value may hold
    ':' or ' #', and comments are not read)."""
    if isinstance(node, dict):
        return {k: substitute_env(v, path, text, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute_env(v, path, text, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str) or "${" not in node:
        return node
    if not _env_allowed(where) and (ref := _ENV_REF.search(node)):
        line = _line(text, ref.group(0))
        raise ConfigError(f"{path}:{line}: {where}: ${{...}} reads the environment only in {', '.join(ENV_ALLOWED)} "
                          f"(secrets and locations); write the value itself here")

    def unset(m: re.Match) -> str:
        name = m.group(1)
        raise ConfigError(f"{path}:{_line(text, m.group(0))}: {where}: environment variable {name} is not set "
                          f"(referenced as ${{{name}}}); export it or write ${{{name}:-default}}")

    if not _ENV_REF.search(node):
        return node
    whole = _ENV_REF.fullmatch(node)
    var = whole.group(1) if whole and whole.group(1) in os.environ else None
    return EnvValue(expand(node, unset), var, node)


def readable_loc(loc: tuple) -> str:
    """Drop the union tags pydantic puts in error locations (connection type, target kind)."""
    parts = list(loc)
    drop = set()
    if len(parts) > 2 and parts[0] == "connections":
        drop.add(2)
    drop |= {i + 1 for i, p in enumerate(parts) if p == "target" and i + 2 < len(parts)}
    text = ""
    for i, p in enumerate(parts):
        if i not in drop:
            text += f"[{p}]" if isinstance(p, int) else f".{p}"
    return text.lstrip(".")


def format_errors(path: Path, err: ValidationError, model=None) -> str:
    """One line per problem, naming the key; an unknown key of `model`'s schema gets the nearest allowed one."""
    lines = [f"{path}: invalid project config ({err.error_count()} problem(s)):"]
    for e in err.errors():
        loc = readable_loc(e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            near = nearest_key(model, tuple(e["loc"])) if model is not None else None
            msg = (f"unknown key; did you mean `{near}`? (every key: docs/reference/config.md)" if near else
                   "unknown key (check its spelling; every key: docs/reference/config.md)")
        elif e["type"] == "missing":
            msg = "required key is missing"
        lines.append(f"  - {loc}: {msg}")
    return "\n".join(lines)


def resolve_path(base: Path, p: str) -> str:
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", p) or os.path.isabs(p):
        return p
    return str((base / p).resolve())


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (plain YAML keeps the last one
    silently: `columns:` twice in a source would drop the first list) and every alias (`*name`): a config
    needs none, and nested aliases expand exponentially (a 400-byte file into millions of nodes)."""

    depth = 0

    def compose_node(self, parent, index):
        if self.depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep; a project "
                                              f"config needs a few", self.peek_event().start_mark)
        self.depth += 1
        try:
            return self._compose(parent, index)
        finally:
            self.depth -= 1

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_SCALAR:
            raise yaml.constructor.ConstructorError(None, None, f"a number of {len(node.value):,} characters; "
                                                    f"write at most {MAX_SCALAR}", node.start_mark)
        return super().construct_yaml_int(node)

    def _compose(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"found an alias (*{event.anchor}); project configs "
                                              f"take no anchors or aliases: write the value out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # left to the base class, which reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found the key {key!r} twice (first on line {seen[key] + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


def parse_yaml(text: str, where) -> object:
    """YAML text (a file's, or a command line's) within the limits above; ConfigError naming `where`."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{where}: {len(text):,} characters; a project config is a few KB")
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None


def read_yaml(path: Path) -> dict:
    """The file's mapping of keys with `${ENV}` substituted; ConfigError naming the file otherwise."""
    if not path.is_file():
        raise ConfigError(f"project config {path} not found (set {CONFIG_ENV} to your project's YAML file)")
    if path.stat().st_size > MAX_BYTES:
        raise ConfigError(f"{path}: {path.stat().st_size:,} bytes; a project config is a few KB (at most "
                          f"{MAX_BYTES:,} bytes are read)")
    text = path.read_text()
    raw = parse_yaml(text, path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (workspace, connections, entity, sources, ...)")
    return substitute_env(raw, path, text)
