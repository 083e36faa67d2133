"""Secrets by origin.

A config value that holds a `${VAR}` reference, alone (`${PW}`), mixed with text (`pw-${PW}`,
`clickhouse://u:${PW}@h/db`) or nested in a dict or a list (`options: {a: {b: ${PW}}}`), is a secret as a
whole. A connection's resource keeps such a value as its template, the text written in the file
(pipelines/orchestration/build.py): the Dagster UI, the run records and every copy of the resource's config show
`pw-${PW}`, never the password; `value()` expands it where the connector hands it to its driver.
`secret_values()` lists what errors must leave out (the expanded templates and each variable's value, at
any depth, beside the fields whose key names a secret); resources/store/redaction.py `redact_text` leaves
them out, and `redact_url` is the one place a URL loses its credentials.
"""

import os
import re
from typing import Callable, Iterable

from habitus.resources.warehouses.errors import WarehouseError

# `${VAR}` or `${VAR:-default}`: the references the project config expands (pipelines/config/file.py)
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def is_template(v) -> bool:
    """Whether `v` is a string holding a `${VAR}` reference (a connection value kept as written)."""
    return isinstance(v, str) and ENV_REF.search(v) is not None


def _unset(m: re.Match) -> str:
    raise WarehouseError(f"environment variable {m.group(1)} is not set (a connection parameter reads it as "
                         f"{m.group(0)}); export it where the pipeline runs")


def expand(template: str, missing: Callable[[re.Match], str] = _unset) -> str:
    """The template with each `${VAR}` read from the environment now (`${VAR:-default}`: the default when
    VAR is unset); an unset VAR without default is `missing(match)`'s (by default WarehouseError naming it)."""
    def repl(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        return default if default is not None else missing(m)

    return ENV_REF.sub(repl, template)


def value(v):
    """A resource value as its driver takes it: templates expanded, `EnvVar` and {"env": NAME} read from the
    environment (resources/warehouses/remote.py `value`), inside dicts and lists too."""
    import dagster as dg

    from habitus.resources.warehouses import remote

    if isinstance(v, str) and not isinstance(v, dg.EnvVar):
        return expand(v) if is_template(v) else v
    if isinstance(v, dict) and not (set(v) == {"env"} and isinstance(v["env"], str)):
        return {k: value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(value(x) for x in v)
    if isinstance(v, int) and hasattr(v, "env_var_name"):  # EnvVar.int (an integer field's ${VAR}), outside a run
        text = remote.value(dg.EnvVar(v.env_var_name))
        return int(text) if text else None
    return remote.value(v)


def _leaves(v, secret: bool = False) -> Iterable:
    """Every value under `v` that errors must leave out: each template (expanded, and each variable's value)
    and, under a secret-named key (`secret`), every string."""
    from habitus.resources.warehouses.remote import SECRET_KEYS

    if isinstance(v, dict):
        if set(v) == {"env"} and isinstance(v["env"], str):
            yield os.environ.get(v["env"])
            return
        for k, x in v.items():
            yield from _leaves(x, secret or k in SECRET_KEYS)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _leaves(x, secret)
    elif is_template(v):
        yield expand(v, missing=lambda m: m.group(0))
        yield from (os.environ[m.group(1)] for m in ENV_REF.finditer(v) if m.group(1) in os.environ)
    elif secret and v is not None:
        yield v


def secret_values(resource) -> list:
    """What errors of `resource` must never show: resources/warehouses/remote.py `secret_values` (secret-named fields
    and options, `EnvVar`s), and every template's value and variable at any depth of any field."""
    from habitus.resources.warehouses import remote

    found = list(remote.secret_values(resource))
    for name in type(resource).model_fields:
        found += list(_leaves(getattr(resource, name, None)))
    return [v for v in found if v is not None and v != ""]


def template_secrets(node) -> list[str]:
    """The values of the config's `${VAR}`-bearing strings under `node` (pipelines/config/file.py EnvValue
    keeps what was written; here: what it became, and each variable's value)."""
    out: list[str] = []
    if isinstance(node, dict):
        for x in node.values():
            out += template_secrets(x)
    elif isinstance(node, (list, tuple)):
        for x in node:
            out += template_secrets(x)
    elif isinstance(node, str) and getattr(node, "template", None):
        out.append(str(node))
        out += [os.environ[m.group(1)] for m in ENV_REF.finditer(node.template) if m.group(1) in os.environ]
    return out
