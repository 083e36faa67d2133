"""The keys the project config's schema allows at a place, for "did you mean" on a misspelled key: the
pydantic models (pipelines/config/project.py and its sections) walked along the error's location."""

import difflib
import typing

from pydantic import BaseModel


def _members(annotation) -> list:
    """The shapes an annotation allows: Annotated and Optional/Union unwrapped, with each one's Tag (or None)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        tag = next((getattr(m, "tag") for m in args[1:] if type(m).__name__ == "Tag"), None)
        return [(a, tag or t) for a, t in _members(args[0])]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType")):
        return [m for a in args if a is not type(None) for m in _members(a)]
    return [(annotation, None)]


def _type_values(annotation) -> tuple:
    """The values of a section's `type:` literal (the discriminator of the connections)."""
    field = annotation.model_fields.get("type") if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
        else None
    return typing.get_args(field.annotation) if field is not None and typing.get_origin(field.annotation) is \
        typing.Literal else ()


def _step(annotation, part) -> list:
    """The annotations one step down `part` (a key, a list index, a map's name or a union's tag)."""
    members = _members(annotation)
    tagged = [a for a, tag in members if tag is not None and tag == part or part in _type_values(a)]
    if tagged:  # pydantic puts the chosen shape's tag (or its `type:` value) in the location
        return tagged
    out = []
    for a, _ in members:
        origin, args = typing.get_origin(a), typing.get_args(a)
        if isinstance(a, type) and issubclass(a, BaseModel):
            field = a.model_fields.get(part) if isinstance(part, str) else None
            if field is not None:
                out.append(field.annotation)
        elif origin is list and isinstance(part, int):
            out.append(args[0])
        elif origin is dict and isinstance(part, str):
            out.append(args[1])
    return out


def keys_at(root: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed in the mapping at `loc` (the location of a key inside it, as pydantic gives it)."""
    current = [root]
    for part in loc[:-1]:
        current = [a for c in current for a in _step(c, part)]
    keys = []
    for c in current:
        for a, _ in _members(c):
            if isinstance(a, type) and issubclass(a, BaseModel):
                keys += [k for k in a.model_fields if k not in keys]
    return keys


def nearest_key(root: type[BaseModel], loc: tuple) -> str | None:
    """The allowed key closest to the unknown one at `loc` (difflib), or None when none is close."""
    unknown = loc[-1] if loc else None
    if not isinstance(unknown, str):
        return None
    keys = keys_at(root, loc)
    close = difflib.get_close_matches(unknown, keys, n=1, cutoff=0.6)
    if not close:  # a case or separator slip: TimeStamp, time-stamp
        folded = {k.replace("_", "").lower(): k for k in keys}
        close = [folded[f] for f in [unknown.replace("-", "").replace("_", "").lower()] if f in folded]
    return close[0] if close else None
