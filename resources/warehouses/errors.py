"""The one error every connector raises: a warehouse problem told in words a user can act on
(which connection, which table or column, what to change), never a driver's stack trace or a secret.

A `WarehouseError` is either **transient** (the connection dropped, the server was restarting,
unreachable for a moment, busy or throttling: the same call may succeed a little later, and the
extraction assets' RetryPolicy retries it, resources/warehouses/retries.py) or **permanent** (authentication,
a missing table or column, bad SQL, a value that does not fit: running again changes nothing, so
it fails at once). Each connector decides which for its driver's errors (`transient` in its
module); `network_error` is what they share: the exception chain holds a socket, HTTP, Thrift or
gRPC failure of the transport rather than an answer from the server.
"""

import contextvars
import re


class WarehouseError(ValueError):
    """`transient`: the same call may succeed later (retried); otherwise it is permanent (not retried)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


# Words of an authentication or authorization failure: permanent whatever the transport said.
AUTH = re.compile(r"auth|login|password|credential|unauthori[sz]ed|forbidden|access.?denied|permission|"
                  r"invalid.?access.?key|signature.?does.?not.?match|\b40[13]\b", re.IGNORECASE)

_REQUESTS = {"ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "ChunkedEncodingError"}
_URLLIB3 = {"ProtocolError", "NewConnectionError", "MaxRetryError", "ReadTimeoutError", "ConnectTimeoutError"}
_GRPC_TRANSIENT = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED"}
# thrift's TTransportException types: NOT_OPEN, TIMED_OUT, END_OF_FILE (the peer went away)
_THRIFT_TRANSIENT = {1, 3, 4}


# set while a listing for a missing table's message runs: an error of the listing itself lists nothing
_LISTING = contextvars.ContextVar("habitus_listing_tables", default=False)


def tables_there(list_tables, limit: int = 30) -> str:
    """"; the tables there: a, b, c" from a connector's `tables()`, for the message of a missing table; "" when
    the listing itself fails (the missing table is the error to report, not the listing), and inside a listing
    (a connector whose `tables()` fails on a missing schema does not list again)."""
    if _LISTING.get():
        return ""
    token = _LISTING.set(True)
    try:
        names = list(list_tables())
    except Exception:  # noqa: BLE001 - any failure of the listing leaves the message as it was
        return ""
    finally:
        _LISTING.reset(token)
    if not names:
        return "; there are no tables there"
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return f"; the tables there: {shown}"


def qualified_names(rows) -> list[str]:
    """(schema, table, current schema) rows of an INFORMATION_SCHEMA listing as table names: the session's
    schema's first, then `schema.table` of the others, each sorted."""
    rows = sorted(rows, key=lambda r: (r[0] != r[2], r[0], r[1]))
    return [t if s == current else f"{s}.{t}" for s, t, current in rows]


def chain(exc: BaseException | None):
    """`exc`, then its causes and contexts (each once)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def network_error(exc: BaseException) -> bool:
    """True when the exception chain holds a failure of the transport (refused, reset, closed or timed-out
    connection; requests/urllib3, http.client, Thrift or gRPC saying the peer is unavailable) and no
    authentication failure. A name that does not resolve (socket.gaierror) is not one: a typo in a host
    stays wrong however often it is retried."""
    import http.client
    import socket

    found = False
    for e in chain(exc):
        if AUTH.search(str(e)):
            return False
        name, module = type(e).__name__, type(e).__module__
        if isinstance(e, socket.gaierror):
            return False
        if isinstance(e, (ConnectionError, TimeoutError, EOFError, http.client.RemoteDisconnected,
                          http.client.IncompleteRead)):
            found = True
        elif module.startswith("requests") and name in _REQUESTS:
            found = True
        elif module.startswith("urllib3") and name in _URLLIB3:
            found = True
        elif name == "TTransportException" and getattr(e, "type", None) in _THRIFT_TRANSIENT:
            found = True
        elif module.startswith("grpc") and callable(getattr(e, "code", None)):
            try:
                found = found or e.code().name in _GRPC_TRANSIENT
            except Exception:  # noqa: BLE001 - a gRPC error without a status code
                pass
    return found
