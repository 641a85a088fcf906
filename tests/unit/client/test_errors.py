"""Typed errors both ways: broker-side status and metadata, client-side reconstruction."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

import geofed
from geofed import routing
from geofed.errors import (
    ClientClosed,
    DeadlineExceeded,
    FederationMismatch,
    GeofedError,
    InvalidInput,
    NotFound,
    PermissionDenied,
    RequestFailed,
    StorageFailed,
    TooLarge,
    Unauthenticated,
    Unavailable,
    WrongBroker,
    details_for,
    from_rpc_error,
    status_for,
    trailing_metadata,
)

SERVER_ERRORS = [
    (InvalidInput("event.geofence.wkt", "not WKT"), grpc.StatusCode.INVALID_ARGUMENT),
    (TooLarge("event.payload", 2048, 1024), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound("subscription", "s1"), grpc.StatusCode.NOT_FOUND),
    (WrongBroker("location", "us", "10.0.0.2:7400"), grpc.StatusCode.FAILED_PRECONDITION),
    (FederationMismatch("strategy mismatch"), grpc.StatusCode.FAILED_PRECONDITION),
    (
        PermissionDenied("publish", "no rule grants 'a/b' to 'alice'"),
        grpc.StatusCode.PERMISSION_DENIED,
    ),
    (PermissionDenied("location", "outside the area"), grpc.StatusCode.PERMISSION_DENIED),
    (Unauthenticated("token expired"), grpc.StatusCode.UNAUTHENTICATED),
    (StorageFailed("disk full"), grpc.StatusCode.UNAVAILABLE),
    # Raised by a broker that cannot do it now: retried by the client like a broker that is down.
    (Unavailable("eu", "a strategy change needs every broker"), grpc.StatusCode.UNAVAILABLE),
    (GeofedError("unexpected"), grpc.StatusCode.INTERNAL),
]


@dataclass
class FakeRpcError:
    """What a failed call looks like to the client: code, details, trailing metadata."""

    status: grpc.StatusCode
    text: str
    metadata: Any = ()

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return self.text

    def trailing_metadata(self) -> Any:
        return self.metadata


@pytest.mark.parametrize(("exc", "code"), SERVER_ERRORS)
def test_status_mapping(exc: GeofedError, code: grpc.StatusCode) -> None:
    assert status_for(exc) == code


@pytest.mark.parametrize(("exc", "code"), SERVER_ERRORS)
def test_a_rejection_comes_back_as_the_same_error_with_its_fields(
    exc: GeofedError, code: grpc.StatusCode
) -> None:
    wire = FakeRpcError(status_for(exc), details_for(exc), trailing_metadata(exc))
    back = from_rpc_error(wire)  # type: ignore[arg-type]
    assert type(back) is type(exc)
    assert str(back) == details_for(exc)  # the broker's text, fields rebuilt
    assert vars(back) == vars(exc)


def test_statuses_without_geofed_metadata_become_transport_or_generic_errors() -> None:
    def back(code: grpc.StatusCode, text: str = "x") -> GeofedError:
        return from_rpc_error(FakeRpcError(code, text), endpoint="h:1", operation="publish")  # type: ignore[arg-type]

    unavailable = back(grpc.StatusCode.UNAVAILABLE, "connection refused")
    assert isinstance(unavailable, Unavailable) and unavailable.endpoint == "h:1"
    assert isinstance(back(grpc.StatusCode.DEADLINE_EXCEEDED), DeadlineExceeded)
    assert isinstance(back(grpc.StatusCode.CANCELLED), ClientClosed)
    other = back(grpc.StatusCode.PERMISSION_DENIED, "no")
    assert isinstance(other, RequestFailed) and other.code == "PERMISSION_DENIED"
    # Metadata that is not ours (or broken) does not hide the status.
    odd = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "down", (("geofed-error", "{not json"),))
    assert isinstance(from_rpc_error(odd), Unavailable)  # type: ignore[arg-type]


def test_every_error_is_a_geofed_error_and_invalid_input_a_value_error() -> None:
    for cls in (
        Unavailable,
        DeadlineExceeded,
        RequestFailed,
        ClientClosed,
        PermissionDenied,
        Unauthenticated,
        StorageFailed,
    ):
        assert issubclass(cls, GeofedError)
    assert issubclass(InvalidInput, ValueError)


def test_security_and_storage_errors_keep_their_fields_and_messages() -> None:
    denied = PermissionDenied("subscribe", "no rule grants 'a/#' to 'alice'")
    assert (denied.rule, denied.detail) == ("subscribe", "no rule grants 'a/#' to 'alice'")
    assert str(denied) == "subscribe denied: no rule grants 'a/#' to 'alice'"
    assert str(Unauthenticated("no client certificate")) == "unauthenticated: no client certificate"
    assert StorageFailed("disk full").reason == "disk full"
    # A StorageFailed is told apart from a broker that is down: the call reached it.
    wire = FakeRpcError(grpc.StatusCode.UNAVAILABLE, "storage failed: disk full")
    wire.metadata = trailing_metadata(StorageFailed("disk full"))
    assert type(from_rpc_error(wire)) is StorageFailed  # type: ignore[arg-type]
    assert not isinstance(from_rpc_error(wire), Unavailable)  # type: ignore[arg-type]


def test_errors_pickle_by_their_fields() -> None:
    for exc in (PermissionDenied("identity", "x"), Unauthenticated("y"), StorageFailed("z")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and vars(back) == vars(exc) and str(back) == str(exc)


def test_the_package_exports_the_security_errors() -> None:
    for name in ("PermissionDenied", "Unauthenticated", "StorageFailed"):
        assert getattr(geofed, name) is getattr(routing, name)
        assert name in geofed.__all__ and name in routing.__all__
