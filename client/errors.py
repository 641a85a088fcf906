"""One typed error hierarchy for the broker and its clients, and its gRPC mapping.

The errors themselves are the routing core's (`GeofedError` and the
subclasses that carry a field name or a limit); this module adds the errors
only a client can meet (a broker that cannot be reached, a deadline, a
status with no geofed meaning) and maps both ways between them and gRPC:

* the broker answers a rejected request with `status_for(exc)` and
  `trailing_metadata(exc)`, which carries the error's class and fields;
* the client turns the `grpc.RpcError` it gets back into the same class with
  `from_rpc_error`, keeping the field name (``event.geofence``, ...).

Users catch `GeofedError` (everything) or a subclass; they never see a raw
`grpc.RpcError`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

from geofed.routing import (
    FederationMismatch,
    GeofedError,
    InvalidInput,
    NotFound,
    PermissionDenied,
    StorageFailed,
    TooLarge,
    Unauthenticated,
    WrongBroker,
)

ERROR_METADATA_KEY = "geofed-error"
"""Trailing-metadata key of a rejected request: the error as JSON (class and fields)."""


class Unavailable(GeofedError):
    """No broker answered (not running, unreachable, shutting down, or the link broke)."""

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(f"broker at {endpoint or '?'} unavailable: {reason}")
        self.endpoint = endpoint
        self.reason = reason


class DeadlineExceeded(GeofedError):
    """A request did not complete within its timeout (`ClientConfig.request_timeout_s`)."""

    def __init__(self, operation: str, timeout_s: float | None) -> None:
        limit = "" if timeout_s is None else f" within {timeout_s:g} s"
        super().__init__(f"{operation}: no answer{limit}")
        self.operation = operation
        self.timeout_s = timeout_s


class RequestFailed(GeofedError):
    """The broker ended a request with a status that has no geofed meaning (`code`)."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class ClientClosed(GeofedError):
    """The client (or the subscription) was closed; no more requests can be made."""


# The fields each class is rebuilt from, in constructor order.
_FIELDS: dict[type[GeofedError], tuple[str, ...]] = {
    InvalidInput: ("field", "reason"),
    TooLarge: ("field", "size", "limit"),
    NotFound: ("what", "key"),
    WrongBroker: ("field", "broker_id", "endpoint"),
    PermissionDenied: ("rule", "detail"),
    Unauthenticated: ("reason",),
    StorageFailed: ("reason",),
    Unavailable: ("endpoint", "reason"),
}
_BY_NAME: dict[str, type[GeofedError]] = {
    cls.__name__: cls for cls in (*_FIELDS, FederationMismatch, GeofedError)
}


def status_for(exc: GeofedError) -> grpc.StatusCode:
    """The gRPC status a client sees for a geofed error."""
    if isinstance(exc, InvalidInput):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, TooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, WrongBroker | FederationMismatch):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, PermissionDenied):
        return grpc.StatusCode.PERMISSION_DENIED
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(exc, Unavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, StorageFailed):
        # Retryable in principle (the store may recover), like a broker that is down.
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def details_for(exc: GeofedError) -> str:
    """The status details text: the error's message (with the endpoint of a redirect)."""
    if isinstance(exc, WrongBroker) and exc.endpoint:
        return f"{exc} (endpoint {exc.endpoint})"
    return str(exc)


def error_record(exc: GeofedError) -> dict[str, Any]:
    """The error as JSON-ready data: its class, message and fields (``field``, ``limit``...).

    What gRPC clients get in trailing metadata and HTTP clients as the body.
    """
    cls = next((c for c in _BY_NAME.values() if type(exc) is c), GeofedError)
    record: dict[str, Any] = {"type": cls.__name__, "message": str(exc)}
    for name in _FIELDS.get(cls, ()):
        record[name] = getattr(exc, name)
    return record


def error_json(exc: GeofedError) -> str:
    """`error_record` as JSON text: what `from_rpc_error` rebuilds `exc` from."""
    return json.dumps(error_record(exc))


def trailing_metadata(exc: GeofedError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata that lets `from_rpc_error` rebuild `exc` on the client."""
    return ((ERROR_METADATA_KEY, error_json(exc)),)


def _metadata_error(metadata: Sequence[tuple[str, Any]] | None) -> GeofedError | None:
    for key, value in metadata or ():
        if key != ERROR_METADATA_KEY:
            continue
        try:
            record = json.loads(value)
            cls = _BY_NAME[record["type"]]
            args = [record[name] for name in _FIELDS.get(cls, ())]
            return cls(*args) if args else cls(record["message"])
        except (ValueError, KeyError, TypeError):
            return None
    return None


def from_rpc_error(exc: grpc.RpcError, *, endpoint: str = "", operation: str = "") -> GeofedError:
    """The typed error a failed gRPC call stands for.

    A broker's rejection comes back as the class it raised, with its field
    name and limits (from the trailing metadata); transport failures become
    `Unavailable` or `DeadlineExceeded`; anything else `RequestFailed`.
    """
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    typed = _metadata_error(exc.trailing_metadata())
    if typed is not None:
        if details and details != str(typed):
            typed.args = (details,)  # the broker's fuller text (e.g. what a batch published)
        return typed
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(endpoint, details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(operation or "request", None)
    if code == grpc.StatusCode.CANCELLED:
        return ClientClosed(f"{operation or 'request'} cancelled: {details}")
    return RequestFailed(code.name, details)


__all__ = [
    "ERROR_METADATA_KEY",
    "ClientClosed",
    "DeadlineExceeded",
    "FederationMismatch",
    "GeofedError",
    "InvalidInput",
    "NotFound",
    "PermissionDenied",
    "RequestFailed",
    "StorageFailed",
    "TooLarge",
    "Unauthenticated",
    "Unavailable",
    "WrongBroker",
    "details_for",
    "error_json",
    "error_record",
    "from_rpc_error",
    "status_for",
    "trailing_metadata",
]
