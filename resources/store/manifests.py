"""What `output:` holds, checked before anything read back from it is used: the keys a manifest may name
(plain relative paths inside the folders its stage owns), the stage's fingerprint that pins name, and the
workspace paths restore may write (never through a symlink). resources/store/output.py uploads and restores."""

import hashlib
import json
import re
from pathlib import Path

MANIFESTS = "manifests"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of 300,000 files is about 60 MB; a longer one is refused unread
MAX_DEPTH = 16  # habitus writes 3 levels ({files: {path: {size, sha256}}})
MAX_DIGITS = 20  # an integer of a manifest (a size) fits 64 bits


class OutputError(RuntimeError):
    """An upload or restore that failed; the message names the output, the key and what to do."""


# one component of a key: ASCII letters, digits and _ . = + @ , -, never starting with a dot (no `..`, no
# hidden or temporary name, no unicode look-alike of a dot or a slash)
_PART = re.compile(r"[A-Za-z0-9_=+@,-][A-Za-z0-9_.=+@,-]{0,254}")
_CACHE_FOLDER = re.compile(r"[0-9a-f]{16}")
STAGE_NAME = re.compile(r"[A-Za-z0-9_-]+(/[A-Za-z0-9_][A-Za-z0-9_-]*)?")


def has_user_info(url: str) -> bool:
    """Whether a scheme://... URL carries user info (`user:password@`, quoted or not) or a port that is not
    a number (the sign of a password holding an unquoted `/`, `?` or `#`)."""
    rest = url.partition("://")[2]
    host = re.split(r"[/?#]", rest, maxsplit=1)[0]
    port = host.rpartition(":")[2] if ":" in host and not host.endswith("]") else ""
    return "@" in rest or (port != "" and not port.isdigit()) or host.endswith(":")


def checked_key(rel, where: str) -> str:
    """`rel` when it is a plain relative path ('a/b/c.json'); OutputError naming it otherwise."""
    if not isinstance(rel, str) or not all(_PART.fullmatch(p) for p in rel.split("/")):
        raise OutputError(f"{where}: entry {rel!r} is not a plain relative path (letters, digits, _ . = + @ , -; no "
                          f"'..', absolute path, backslash or empty component); the manifest was not written by "
                          f"habitus: check who can write to the store, delete that manifest and upload the stage again")
    return rel


def stage_units(stage: str, cache_folder: str | None = None) -> list[str]:
    """The paths (relative to the workspace) that the stage `stage` owns: its upload holds files at or
    under them only, and restore swaps each in whole. The layout is resources/store/workspace.py's."""
    kind, _, item = stage.partition("/")
    if kind == "foundation":
        return ["checkpoints/foundation", "checkpoints/foundation_loss.png"] + (
            [f"cache/{cache_folder}"] if cache_folder else [])
    if kind == "scenario" and item:
        return [f"checkpoints/scenarios/{item}", f"checkpoints/scenarios/{item}_loss.png",
                f"checkpoints/scenarios/{item}_lift.png", f"checkpoints/passed/{item}"]
    if kind == "predictions" and item:
        return [f"predictions/{item}"]
    if kind == "embeddings":
        return ["embeddings"]
    return []


def daily_stage(stage: str) -> bool:
    """A stage of daily files (predictions, embeddings): earlier days stay, in the store and on restore."""
    return stage.partition("/")[0] in ("predictions", "embeddings")


def fingerprint(manifest: dict) -> str:
    """The SHA-256 a pin names: over the stage's files (path and SHA-256) and its cache folder."""
    body = {"cache_folder": manifest.get("cache_folder"),
            "files": {rel: e.get("sha256") for rel, e in sorted(manifest.get("files", {}).items())}}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def checked_manifest(manifest, stage: str, where: str) -> dict[str, dict[str, dict]]:
    """The manifest's entries grouped by the unit of `stage_units` each lies in ({unit: {rel: entry}});
    OutputError naming the entry for a key that is not a plain relative path inside the stage's units,
    an entry without an integer size and a hex SHA-256, or a `cache_folder` that is not a fingerprint."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise OutputError(f"{where}: not a manifest (no `files` mapping); delete it and upload the stage again")
    folder = manifest.get("cache_folder")
    if folder is not None and not (isinstance(folder, str) and _CACHE_FOLDER.fullmatch(folder)):
        raise OutputError(f"{where}: cache_folder {folder!r} is not a cache fingerprint (16 hex digits); the "
                          f"manifest was not written by habitus: check who can write to the store")
    units = stage_units(stage, folder)
    grouped: dict[str, dict[str, dict]] = {}
    for rel, entry in manifest["files"].items():
        checked_key(rel, where)
        unit = next((u for u in units if rel == u or rel.startswith(u + "/")), None)
        if unit is None:
            raise OutputError(f"{where}: entry {rel!r} lies outside what the stage {stage!r} writes "
                              f"({', '.join(units) or 'nothing'}); check who can write to the store")
        if not (isinstance(entry, dict) and type(entry.get("size")) is int and entry["size"] >= 0
                and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
            raise OutputError(f"{where}: entry {rel!r} has no integer size and SHA-256")
        grouped.setdefault(unit, {})[rel] = entry
    for unit, entries in grouped.items():
        if unit in entries and len(entries) > 1:
            raise OutputError(f"{where}: entry {unit!r} is a file and a folder at once")
    return grouped


def inside(root: Path, dest: Path) -> Path:
    """`dest` (under `root`) when no component between them is a symlink and it resolves inside `root`;
    OutputError otherwise: nothing is read (uploaded) or written (restored) through a link in the workspace."""
    base = root.resolve()
    rel = dest.relative_to(root)
    at = base
    for part in rel.parts:
        at = at / part
        if at.is_symlink():
            raise OutputError(f"{at} is a symbolic link; restore and upload never read or write through a link in "
                              f"the workspace (remove it, or use a workspace without links)")
    if not at.resolve().is_relative_to(base):
        raise OutputError(f"{dest} resolves outside the workspace {base}")
    return at


def parsed_manifest(data: bytes, where: str):
    """The JSON document `data` (a manifest read back from the store, at most MAX_MANIFEST_BYTES), or
    OutputError naming `where` for what is not JSON, nests deeper than MAX_DEPTH or holds an integer longer
    than MAX_DIGITS: a bomb ends in the project's error, never in a RecursionError or a ValueError."""
    def integer(text: str) -> int:
        if len(text.lstrip("-")) > MAX_DIGITS:
            raise OutputError(f"{where}: an integer of {len(text)} digits; a manifest holds sizes of at most "
                              f"{MAX_DIGITS} digits. It was not written by habitus: check who can write to the "
                              f"store, delete it and upload the stage again")
        return int(text)

    if len(data) > MAX_MANIFEST_BYTES:
        raise too_large(where)
    try:
        doc, deep = json.loads(data, parse_int=integer), False
    except RecursionError:
        doc, deep = None, True
    except ValueError as e:  # JSONDecodeError, invalid UTF-8
        raise OutputError(f"{where} is not valid JSON ({str(e)[:200]}); delete it and upload the stage again") from None
    if deep or _depth(doc) > MAX_DEPTH:
        raise OutputError(f"{where}: JSON nested deeper than {MAX_DEPTH} levels; a manifest has 3. It was not "
                          f"written by habitus: check who can write to the store, delete it and upload the stage again")
    return doc


def too_large(where: str) -> OutputError:
    return OutputError(f"{where}: more than {MAX_MANIFEST_BYTES >> 20} MB, larger than any manifest habitus writes; "
                       f"not read. Check who can write to the store, delete it and upload the stage again")


def _depth(doc) -> int:
    """How deep `doc` nests (a scalar: 0), counted without recursion."""
    deepest, todo = 0, [(doc, 1)]
    while todo:
        node, level = todo.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        if level < MAX_DEPTH + 1:
            todo += [(c, level + 1) for c in children if isinstance(c, (dict, list))]
    return deepest


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def stage_file(stage: str) -> str:
    """The manifest key of a stage, relative to the prefix: 'scenario/churn' -> manifests/scenario/churn.json."""
    if not isinstance(stage, str) or not STAGE_NAME.fullmatch(stage):
        raise OutputError(f"stage name {stage!r} cannot name a manifest")
    return f"{MANIFESTS}/{stage}.json"
