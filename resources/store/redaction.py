"""Messages without credentials: the one place a URL loses its user, password, query values and fragment
(`redact_url`), and a message its secrets and every URL's credentials (`redact_text`). Every message that
shows a URL or may quote a secret goes through them: the `output:` store's logs and errors
(resources/store/output.py, stores.py, workspace.py, `habitus upload` and `restore`), the connectors'
errors (resources/warehouses/remote.py, hive.py), MLflow's warnings and params
(resources/training/mlflow_tracking.py), the public config and `habitus init`. It sits in the lowest room
of resources/ (store < warehouses < training) so that each of them can import it; which values are secrets
is resources/warehouses/masking.py's."""

import os
import re
from typing import Iterable

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def _userinfo(rest: str) -> str:
    """The credentials part of a URL after its `scheme://` ('' when none). With an `@` in the authority they end
    at the last `@` of the URL, so a password holding an unquoted `/`, `?`, `#` or `@` is cut out whole (an
    `@` later in the path or query then takes the host with it: shown as less, never as more); without one,
    `user:pa/ss@host` (a colon before the first `/` that is not a port) ends at the last `@` too."""
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority or ("@" in rest and re.search(r":(?!\d*$)", authority)):
        return rest[:rest.rindex("@")]
    return ""


def _query(query: str) -> str:
    """Every query value as *** (`?X-Amz-Signature=***&sig=***&endpoint_override=***`), the keys kept."""
    return "&".join(f"{k}=***" if eq else k for k, eq, _ in (item.partition("=") for item in query.split("&")))


def redact_url(uri: str) -> str:
    """The URL without its credentials: `https://user:pw@host` and `https://token@host` -> `https://***@host`,
    every query value as *** (`?token=***&sig=***&X-Amz-Signature=***`: S3 presigned URLs, Azure SAS tokens,
    endpoints), the fragment as `#***`, a port that is not a number (the rest of a password holding a `/`)
    as `host:***`. Text that is not a URL keeps all but its query values. Never raises."""
    text = str(uri)
    scheme, sep, rest = text.partition("://")
    if not sep or not _SCHEME.fullmatch(scheme):
        head, q, query = text.partition("?")
        return f"{head}?{_query(query)}" if q else text
    userinfo = _userinfo(rest)
    if userinfo:
        rest = rest[len(userinfo) + 1:]
    end = re.search(r"[/?#]", rest)
    authority, tail = (rest[:end.start()], rest[end.start():]) if end else (rest, "")
    host, colon, port = authority.rpartition(":") if not authority.endswith("]") else ("", "", "")
    if colon and port and not port.isdigit():
        authority = f"{host}:***"
    tail, h, fragment = tail.partition("#")
    path, q, query = tail.partition("?")
    return (f"{scheme}://{'***@' if userinfo else ''}{authority}{path}{'?' + _query(query) if q else ''}"
            f"{'#***' if fragment else h}")


def url_secrets(uri: str) -> list[str]:
    """The credentials a URL carries, as written and unquoted, for `redact_text`: the password, or the user
    when it is alone (a token given as the user name)."""
    from urllib.parse import unquote

    userinfo = _userinfo(str(uri).partition("://")[2]) if "://" in str(uri) else ""
    found = [userinfo, userinfo.split(":", 1)[-1]] if userinfo else []
    return [s for s in {*found, *map(unquote, found)} if len(s) >= 3]


def _secret(s) -> str | None:
    """A secret as text: a Dagster `EnvVar` (a str holding the variable's name) or {"env": NAME} read from
    the environment (None when unset: nothing to hide), any other string as it is."""
    name = getattr(s, "env_var_name", None)
    if name is None and isinstance(s, dict) and set(s) == {"env"} and isinstance(s["env"], str):
        name = s["env"]
    if name is not None:
        return os.environ.get(name)
    return s if isinstance(s, str) else None


def redact_text(text: str, secrets: Iterable = ()) -> str:
    """`text` with every secret of three characters or more (as written and URL-quoted) as *** and every URL in
    it through `redact_url`."""
    from urllib.parse import quote

    text = str(text)
    forms = {form for s in map(_secret, secrets or ()) if s is not None and len(s) >= 3
             for form in (s, quote(s, safe=""), quote(s))}
    for form in sorted(forms, key=len, reverse=True):  # the longest first: a secret holding another goes whole
        text = text.replace(form, "***")
    return _URL.sub(lambda m: redact_url(m.group(0)), text)
