"""The peer port's TLS, terminated in Python so that every refused handshake is seen.

Why: gRPC's C core does a secure port's handshake before any Python code
runs, and tells nobody when it fails (no callback, no per-connection event;
at most an INFO line on stderr without the caller's address). A rogue
broker dialling the peer port in plaintext, without a certificate, with one
from another CA or an expired one would go unnoticed by the broker it
dials, which is the one an operator watches (issue #12).

So with ``tls_dir`` the peer port is this front: a TCP listener that does
the TLS handshake itself (`ssl`, mutual: a certificate from the federation's
CA is required, TLS 1.2 or newer, ALPN ``h2``) and then copies bytes both
ways to the gRPC peer server, which listens in plaintext on a loopback-only
ephemeral port. A refused handshake is logged with the caller's address and
the reason, and counted in ``geofed_peer_refused_total{reason}``:

* ``plaintext``: the caller did not speak TLS;
* ``no_certificate``: TLS without a client certificate;
* ``unknown_ca``: a certificate that does not chain to the federation's CA;
* ``expired``: a certificate past its ``not_after`` (or before ``not_before``);
* ``bad_certificate``: any other certificate the CA check refuses;
* ``handshake``: the handshake failed otherwise (an alert from the caller, no
  common protocol version or cipher, not done within the handshake timeout).

A caller that just closes the connection before the handshake is done (a
TCP probe, a port scan) is logged at INFO and not counted.

**Who is calling.** The front opens one loopback connection to the gRPC
server per accepted connection and, before forwarding a byte, records the
verified certificate's names under that connection's address as gRPC
reports it (``context.peer()``, ``ipv4:127.0.0.1:<port>``); the entry goes
when the connection closes. The hello check (`Security.check_peer`) reads
the names from here (`identities`), as it would read gRPC's auth context.
A call on the loopback port that did not come through the front (a local
process going around it) has no entry and is refused by the interceptor
(`interceptor`, UNAUTHENTICATED, logged, ``reason="unauthenticated"``), so
every RPC on the peer server, health and reflection included, answers
only callers that passed the TLS handshake.

**Rotation.** The SSL context follows the certificate files as the other
listeners beside gRPC do (`Security._following`): each handshake takes the
files as they are now.

The handshake must be done within ``peer_timeout_s`` (60 s when that is 0).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from geofed.routing import InvalidInput

from ._metrics import NodeMetrics
from ._tls_accept import RefusalLog, address

log = logging.getLogger("geofed.node.peer_tls")

INNER_HOST = "127.0.0.1"
"""Where the gRPC peer server listens behind the front (loopback only)."""

_CHUNK = 1 << 16  # bytes a side holds before it is joined to the other; then it pauses reading
_WILDCARD = {"", "::", "[::]", "*"}  # gRPC's "all interfaces, both families"


class PeerFront:
    """The TLS front of the peer port (see the module docs).

    Args:
        context: the server-side SSL context (mutual TLS, ALPN ``h2``).
        metrics: where refusals are counted (``peer_refused``).
        names: the verified certificate's names of a TLS connection
            (`geofed.node._auth.certificate_names`).
        handshake_timeout_s: a caller that has not finished the handshake by
            then is dropped (reason ``handshake``).
    """

    def __init__(
        self,
        context: ssl.SSLContext,
        metrics: NodeMetrics,
        names: Callable[[Any], list[str]],
        handshake_timeout_s: float,
    ) -> None:
        self._context = context
        self._metrics = metrics
        self._names = names
        self._timeout = handshake_timeout_s
        self._log = RefusalLog(log, logging.ERROR)
        self._server: asyncio.Server | None = None
        self.inner_port = 0
        """The loopback port of the gRPC peer server behind the front (0 before `start`)."""
        self._callers: dict[str, list[str]] = {}
        self._open: dict[asyncio.Task[None], list[asyncio.Transport]] = {}  # by connection

    # -- serving -------------------------------------------------------------

    async def start(self, listen: str, inner_port: int) -> int:
        """Listen on `listen` and forward to the gRPC server on ``INNER_HOST:inner_port``.

        Raises:
            InvalidInput: naming ``peer_listen`` when `listen` cannot be bound.
        """
        self.inner_port = inner_port
        loop = asyncio.get_running_loop()
        host, _, port = listen.rpartition(":")
        try:
            if host in _WILDCARD and socket.has_dualstack_ipv6():
                # One socket for both families, as gRPC binds "[::]" (asyncio would
                # bind two, on two ports when the port is 0).
                sock = socket.create_server(
                    ("", int(port)), family=socket.AF_INET6, dualstack_ipv6=True
                )
                self._server = await loop.create_server(self._connection, sock=sock)
            else:
                bind = None if host in _WILDCARD else host.strip("[]")
                self._server = await loop.create_server(self._connection, bind, int(port))
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise InvalidInput("peer_listen", f"cannot listen on {listen}: {why}") from None
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        """Stop listening and close every forwarded connection (idempotent)."""
        if self._server is not None:
            self._server.close()
        for transports in self._open.values():
            for transport in transports:
                transport.abort()
        if self._open:
            await asyncio.wait(list(self._open))
        self._server = None

    def identities(self, peer: str) -> list[str] | None:
        """The certificate names of the caller behind gRPC's `peer` (``context.peer()``);
        None when that connection did not come through the front."""
        return self._callers.get(peer)

    def _connection(self) -> _Pipe:
        return _Pipe(made=self._accept)

    def _accept(self, outer: _Pipe, raw: asyncio.Transport) -> None:
        # A task per connection; its transports are kept for stop().
        transports: list[asyncio.Transport] = [raw]
        task = asyncio.get_running_loop().create_task(self._serve(outer, raw, transports))
        self._open[task] = transports
        task.add_done_callback(self._open.pop)

    async def _serve(
        self, outer: _Pipe, raw: asyncio.Transport, transports: list[asyncio.Transport]
    ) -> None:
        caller = address(raw.get_extra_info("peername"))
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(
                raw, outer, self._context, server_side=True, ssl_handshake_timeout=self._timeout
            )
        except (OSError, TimeoutError) as exc:
            self._refused(caller, exc)
            raw.abort()
            return
        if tls is None:  # closed meanwhile
            return
        outer.transport = tls
        transports.append(tls)
        names = self._names(tls.get_extra_info("ssl_object"))
        try:
            inner_transport, inner = await loop.create_connection(
                _Pipe, INNER_HOST, self.inner_port
            )
        except OSError as exc:
            log.error("peer connection from %s: cannot reach the peer server: %s", caller, exc)
            tls.abort()
            return
        transports.append(inner_transport)
        host, port = inner_transport.get_extra_info("sockname")[:2]
        key = f"ipv4:{host}:{port}"
        self._callers[key] = names  # before any byte goes in: the hello check finds it
        log.debug("peer connection from %s (%s) via %s", caller, ", ".join(names), key)
        try:
            outer.join(inner)
            await asyncio.wait([outer.closed, inner.closed])
        finally:
            del self._callers[key]

    def _refused(self, caller: str, exc: BaseException) -> None:
        reason = self._log.handshake_failed("peer", caller, exc)
        if reason is not None:
            self._metrics.peer_refused.labels(reason=reason).inc()

    # -- the loopback port ------------------------------------------------------

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """For the gRPC peer server: refuse calls that did not come through the front."""
        return _ThroughFront(self)

    async def _guard(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        peer = context.peer()
        if peer in self._callers:
            return
        self._metrics.peer_refused.labels(reason="unauthenticated").inc()
        log.error(
            "refusing peer call from %s: it did not come through the TLS front of the peer"
            " port (no certificate)",
            peer,
        )
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, "peer calls must come through the TLS peer port"
        )


class _Pipe(asyncio.Protocol):
    """One side of a forwarded connection: what it receives, the other side sends.

    Flow control both ways: a side whose transport's write buffer fills
    pauses reading on the other side. Until the other side is joined
    (`join`), received bytes wait here (a little: the caller's HTTP/2 flow
    control window), reading paused past `_CHUNK`. When one side closes, the
    other closes after sending what it has.
    """

    def __init__(self, made: Callable[[_Pipe, asyncio.Transport], None] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.other: _Pipe | None = None
        self.made = made
        """Called with the caller's plain TCP transport (the front's side, before TLS)."""
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        if self.made is not None:
            self.made(self, transport)
        else:
            self.transport = transport

    def join(self, other: _Pipe) -> None:
        self.other, other.other = other, self
        assert other.transport is not None and self.transport is not None
        for data in self._pending:
            other.transport.write(data)
        self._pending.clear()
        if self.closed.done():  # closed while the other side was being connected
            other.transport.close()
        else:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.write(data)
            return
        self._pending.append(data)
        if self.transport is not None and sum(map(len, self._pending)) > _CHUNK:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # close

    def pause_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.other is not None and self.other.transport is not None:
            self.other.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)
        if self.other is not None and self.other.transport is not None:
            self.other.transport.close()


Behaviour = Callable[..., Any]


class _ThroughFront(grpc.aio.ServerInterceptor):
    def __init__(self, front: PeerFront) -> None:
        self._front = front

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        guard = self._front._guard
        for kind, make in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        ):
            behaviour = getattr(handler, kind)
            if behaviour is not None:
                return make(
                    _guarded(behaviour, guard),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


def _guarded(behaviour: Behaviour, guard: Callable[[Any], Awaitable[None]]) -> Behaviour:
    """`behaviour` (a coroutine or an async generator function), run after `guard`."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: Any) -> Any:
            await guard(context)
            async for response in behaviour(request, context):
                yield response

        return stream

    async def call(request: Any, context: Any) -> Any:
        await guard(context)
        return await behaviour(request, context)

    return call
