"""Reading a project config file: YAML with unique keys, `${VAR}` substitution, relative paths and
pydantic errors turned into lines that name the file and the key."""

import os
import re
from pathlib import Path

import yaml
from pydantic import ValidationError

CONFIG_ENV = "HABITUS_CONFIG"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class ConfigError(ValueError):
    """A project config that cannot be used; the message says where and what to do."""


def substitute_env(node, path: Path, text: str, where: str = ""):
    """Replace ${VAR} / ${VAR:-default} in the parsed values (never in the YAML text: a value may hold
    ':' or ' #', and comments are not read)."""
    if isinstance(node, dict):
        return {k: substitute_env(v, path, text, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [substitute_env(v, path, text, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def repl(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        line = next((i for i, ln in enumerate(text.splitlines(), 1)
                     if m.group(0) in ln and not ln.lstrip().startswith("#")), "?")
        raise ConfigError(f"{path}:{line}: {where}: environment variable {name} is not set (referenced as "
                          f"${{{name}}}); export it or write ${{{name}:-default}}")

    return _ENV_REF.sub(repl, node)


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


def format_errors(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid project config ({err.error_count()} problem(s)):"]
    for e in err.errors():
        loc = readable_loc(e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling; every key: docs/reference/config.md)"
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
    silently: `columns:` twice in a source would drop the first list)."""

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


def read_yaml(path: Path) -> dict:
    """The file's mapping of keys with `${ENV}` substituted; ConfigError naming the file otherwise."""
    if not path.is_file():
        raise ConfigError(f"project config {path} not found (set {CONFIG_ENV} to your project's YAML file)")
    text = path.read_text()
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of keys (workspace, connections, entity, sources, ...)")
    return substitute_env(raw, path, text)
