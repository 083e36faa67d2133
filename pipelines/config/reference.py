"""The config reference (docs/reference/config.md), generated from the project config's pydantic schema
(pipelines/config/project.py, sources.py, operations.py): every key with its type, default, allowed values and
description, one table per section.

    python -m habitus.pipelines.config.reference            # print it
    python -m habitus.pipelines.config.reference --write    # rewrite docs/reference/config.md

tests/pipelines/test_config_reference.py fails when the committed file differs from what the schema
generates, so a default or a description changed in the code must be regenerated here."""

import argparse
import datetime
import sys
import typing
from pathlib import Path

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from habitus.pipelines.config.project import ProjectConfig

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"

HEADER = """# Config reference

Every key of the project config (the YAML file named by `HABITUS_CONFIG`, default `examples/demo.yaml`),
generated from its schema (`pipelines/config/project.py`, `sources.py`, `operations.py`) by
`python -m habitus.pipelines.config.reference --write`; a test fails when this page and the schema differ. How the keys fit together, with an example:
[the project config](../guide/config.md).

Durations are written `14d` or `2w` (or a number of days); dates as `2026-10-01`. `${VAR}` and
`${VAR:-default}` read the environment (where the config allows it: [the project config](../guide/config.md)).
A key not listed here is refused, naming it (a warehouse connection passes its other keys to the driver).
"""


def _anchor(key: str) -> str:
    """The section's id (set explicitly: a heading with `<name>` would slug differently per renderer)."""
    return "-".join("".join(c if c.isalnum() or c == "_" else " " for c in key.lower()).split()) or "project"


def _models(annotation) -> list[type[BaseModel]]:
    """The config sections (pydantic models) an annotation holds, in order."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out = []
    for arg in typing.get_args(annotation):
        for m in _models(arg):
            if m not in out:
                out.append(m)
    return out


# fields whose validator reads a text form: shown by that form, not by the type they are held as
_READ_AS = {"_to_days": "duration", "_cron": "cron string", "_timezone": "time zone (IANA name)"}


def _read_as(info: FieldInfo) -> str | None:
    return next((_READ_AS[m.func.__name__] for m in info.metadata
                 if getattr(getattr(m, "func", None), "__name__", None) in _READ_AS), None)


def _type(annotation) -> str:
    """A short, readable name of a field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return "string" if all(isinstance(a, str) for a in args) else "value"
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        names = [_type(a) for a in args if a is not type(None)]
        return " or ".join(dict.fromkeys(names)) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return f"map of {_type(args[0])} to {_type(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return {str: "string", int: "integer", float: "number", bool: "boolean", datetime.date: "date"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def _literals(annotation) -> list:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return list(args)
    return [v for a in args for v in _literals(a)] if origin is not None else []


def _allowed(info: FieldInfo) -> str:
    values = _literals(info.annotation)
    parts = [", ".join(f"`{v}`" for v in values)] if values else []
    for m in info.metadata:
        for kind, sign in ((Ge, ">="), (Gt, ">"), (Le, "<="), (Lt, "<")):
            if isinstance(m, kind):
                parts.append(f"{sign} {getattr(m, kind.__name__.lower())}")
        if isinstance(m, MinLen):
            parts.append(f"at least {m.min_length} item(s)")
        if isinstance(m, MaxLen):
            parts.append(f"at most {m.max_length} item(s)")
        pattern = getattr(m, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return "; ".join(parts)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default is PydanticUndefined else info.default
    if isinstance(value, BaseModel):
        return "see below"
    if value is None:
        return "none"
    if value in ([], {}):
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if _read_as(info) == "duration":
        return f"`{value}d`"
    return f"`{value}`"


def _cell(text: str) -> str:
    """One table cell: one line, and `<`, `>` outside code spans shown as written (not read as HTML)."""
    parts = " ".join(str(text).split()).split("`")  # the table reads a `|` inside a code span as text
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
                    for i, p in enumerate(parts))


def _key(name: str) -> str:
    """A key's cell: code that the manual's stylesheet keeps on one line (docs/stylesheets/extra.css, `code.key`),
    where the theme would break `inference_processes` anywhere to fit a narrow column."""
    return f'<code class="key">{name}</code>'


def _sections(root: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel], list[str]]]:
    """(key path, model, other key paths of the same section) for the root and every section below it,
    depth first in field order."""
    out, seen = [(path, root, [])], {root: []}

    def walk(model, prefix):
        for name, info in model.model_fields.items():
            annotation = info.annotation
            origin = typing.get_origin(annotation)
            suffix = "[]" if origin is list else ".<name>" if origin is dict else ""
            for sub in _models(annotation):
                key = f"{prefix}{name}{suffix}"
                if len(_models(annotation)) > 1:  # a choice of shapes (connections, targets): one section each
                    tag = _tag(sub)
                    key = f"{key} ({tag})" if tag else key
                if sub in seen:
                    seen[sub].append(key)
                    continue
                seen[sub] = []
                out.append((key, sub, seen[sub]))
                walk(sub, f"{key.split(' (')[0]}.")

    walk(root, "" if path == "project" else f"{path}.")
    return out


def _tag(model: type[BaseModel]) -> str:
    """What tells this shape from its siblings: a `type` literal, or its first required key."""
    kind = model.model_fields.get("type")
    if kind is not None and _literals(kind.annotation):
        return "type: " + ", ".join(str(v) for v in _literals(kind.annotation))
    first = next((n for n, i in model.model_fields.items() if i.is_required()), None)
    return f"{first}:" if first else ""


def _doc(model: type[BaseModel]) -> str:
    doc = model.__doc__ or ""
    if doc.startswith(BaseModel.__doc__ or "\0") or doc.startswith("Usage docs:"):
        return ""
    return " ".join(doc.split())


def generate() -> str:
    lines = [HEADER]
    sections = _sections(ProjectConfig, "project")
    lines.append("Sections: " + ", ".join(f"[`{key}`](#{_anchor(key)})" for key, _, _ in sections) + ".\n")
    for key, model, aliases in sections:
        path, _, shape = key.partition(" (")
        title = f"`{path}`" + (f" ({shape}" if shape else "")
        lines.append(f"## {title} {{ #{_anchor(key)} }}\n")
        about = " ".join(filter(None, [_doc(model), "Also at " + ", ".join(f"`{a}`" for a in aliases) + "."
                                        if aliases else ""]))
        if about:
            lines.append(_cell(about) + "\n")
        extra = model.model_config.get("extra")
        lines.append("| key | type | default | allowed | description |")
        lines.append("|---|---|---|---|---|")
        for name, info in model.model_fields.items():
            subs = _models(info.annotation)
            described = _cell(info.description or "")
            if subs:
                link = ", ".join(f"[{_cell(k) if len(subs) == 1 else _tag(s)}](#{_anchor(k)})" for s in subs
                                 for k, m, _ in sections if m is s)
                described = f"{described} ({link})" if described else link
            lines.append(f"| {_key(name)} | {_cell(_read_as(info) or _type(info.annotation))} | {_cell(_default(info))} | "
                         f"{_cell(_allowed(info))} | {described} |")
        if extra == "allow":
            lines.append("| *other keys* | any | | | passed to the driver as given (`account`, `host`, `password`, ...) |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m habitus.pipelines.config.reference", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE.relative_to(REFERENCE.parents[2])}")
    args = ap.parse_args(argv)
    text = generate()
    if args.write:
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(text)
        print(f"wrote {REFERENCE}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
