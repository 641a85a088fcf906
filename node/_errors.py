"""Servicer decorators: a geofed error ends the call with its status and typed metadata."""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from geofed.errors import details_for, status_for, trailing_metadata
from geofed.routing import GeofedError

log = logging.getLogger("geofed.node")

T = TypeVar("T")


async def abort(
    context: grpc.aio.ServicerContext[Any, Any], exc: GeofedError, suffix: str = ""
) -> None:
    """End a call with the status of `exc`, its message and its typed form (raises)."""
    await context.abort(
        status_for(exc), details_for(exc) + suffix, trailing_metadata=trailing_metadata(exc)
    )


class Guarded:
    """Servicer base: `on_reject` is told each rejected request's status code."""

    def on_reject(self, code: grpc.StatusCode) -> None:
        """Count a rejection (overridden by servicers that keep metrics)."""


def rejected(servicer: Guarded, method: str, exc: GeofedError) -> grpc.StatusCode:
    """Count and log a request `method` of `servicer` refused with `exc`; its status."""
    code = status_for(exc)
    servicer.on_reject(code)
    log.info("rejected %s: %s: %s", method, code.name, exc)
    return code


def unary(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Decorate a unary servicer method: geofed errors abort with their status."""

    @functools.wraps(fn)
    async def run(self: Guarded, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> T:
        try:
            return await fn(self, request, context)
        except GeofedError as exc:
            rejected(self, fn.__name__, exc)
            await abort(context, exc)
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
            rejected(self, fn.__name__, exc)
            await abort(context, exc)

    return run
