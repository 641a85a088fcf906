"""One mapping from geofed errors to gRPC status codes."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from geofed.routing import (
    FederationMismatch,
    GeofedError,
    InvalidInput,
    NotFound,
    TooLarge,
    WrongBroker,
)

log = logging.getLogger("geofed.node")

T = TypeVar("T")


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
    return grpc.StatusCode.INTERNAL


def _details(exc: GeofedError) -> str:
    if isinstance(exc, WrongBroker) and exc.endpoint:
        return f"{exc} (endpoint {exc.endpoint})"
    return str(exc)


class Guarded:
    """Servicer base: `on_reject` is told each rejected request's status code."""

    def on_reject(self, code: grpc.StatusCode) -> None:
        """Count a rejection (overridden by servicers that keep metrics)."""


def unary(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary servicer method: geofed errors abort with their status."""

    @functools.wraps(fn)
    async def run(self: Guarded, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> T:
        try:
            return await fn(self, request, context)
        except GeofedError as exc:
            code = status_for(exc)
            self.on_reject(code)
            log.info("rejected %s: %s: %s", fn.__name__, code.name, exc)
            await context.abort(code, _details(exc))
            raise  # unreachable: abort raises

    return run


def streaming(fn: Callable[..., AsyncIterator[T]]) -> Callable[..., AsyncIterator[T]]:
    """Decorate a server-streaming servicer method (an async generator)."""

    @functools.wraps(fn)
    async def run(
        self: Guarded, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[T]:
        try:
            async for item in fn(self, request, context):
                yield item
        except GeofedError as exc:
            code = status_for(exc)
            self.on_reject(code)
            log.info("rejected %s: %s: %s", fn.__name__, code.name, exc)
            await context.abort(code, _details(exc))

    return run
