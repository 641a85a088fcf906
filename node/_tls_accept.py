"""Server-side TLS done by the node itself, so that every refused handshake is seen.

asyncio's own TLS servers (``create_server(ssl=...)``, which aiohttp uses
too) drop a connection whose handshake fails without telling anyone: the
error is an `OSError`, and asyncio reports those only in debug mode. A
client dialling the MQTT or HTTP port in plaintext, without the certificate
``client_auth cert`` asks for, or with one from another CA would fail and
leave no trace at the broker an operator watches.

So a TLS listener here accepts plain TCP and does the handshake itself
(`TlsAcceptor`: ``loop.start_tls``), then hands the TLS transport to the
listener's own protocol (the MQTT stream reader, aiohttp's request
handler), which never sees the difference. A refused handshake is logged at
WARNING with the caller's address and the reason, and counted in
``geofed_tls_refused_total{listener,reason}``; the reasons are those of the
peer port (`refusal_reason`):

* ``plaintext``: the caller did not speak TLS;
* ``no_certificate``: TLS without a client certificate where one is required;
* ``unknown_ca``: a certificate that does not chain to the federation's CA;
* ``expired``: a certificate past its ``not_after`` (or before ``not_before``);
* ``bad_certificate``: any other certificate the CA check refuses;
* ``handshake``: the handshake failed otherwise (an alert from the caller, no
  common protocol version or cipher, not done within the handshake timeout).

A caller that just closes the connection before the handshake is done (a
TCP probe, a port scan) is logged at INFO and not counted.

The log lines of a listener's refusals are limited (`RefusalLog`): at most
`LOG_BURST` per reason per `LOG_WINDOW_S` seconds, then one line saying how
many more were refused, so a scanner cannot fill the disk; the counter counts
them all.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

from ._metrics import NodeMetrics

log = logging.getLogger("geofed.node.tls")

HANDSHAKE_TIMEOUT_S = 60.0
"""A client that has not finished the TLS handshake by then is dropped (asyncio's default)."""

# OpenSSL's verify codes (X509_V_ERR_*) the reasons name.
_EXPIRED = {9, 10}  # certificate not yet valid, has expired
_UNKNOWN_CA = {2, 18, 19, 20, 21}  # issuer unknown, self-signed, chain to an untrusted root
# OpenSSL's reasons for a first record that is not TLS.
_NOT_TLS = {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "UNKNOWN_PROTOCOL"}
_SILENT = (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError)


LOG_BURST = 10
"""Refusals of a reason a listener logs per `LOG_WINDOW_S`; more are only counted."""
LOG_WINDOW_S = 10.0


class RefusalLog:
    """The log lines of one listener's refused handshakes, limited in rate per reason.

    Up to `LOG_BURST` refusals of a reason per window of `LOG_WINDOW_S`
    seconds are logged as they come; the window's others are only counted,
    and their number is logged with the first refusal of that reason after
    the window (the metric counts every one meanwhile). Each reason has its
    own budget, so a flood of one kind (a scanner's plaintext) does not hide
    the first line of another (a broker's expired certificate).

    Args:
        logger: where the lines go.
        level: their level (ERROR at the peer port, WARNING at the client ones).
        clock: monotonic seconds (a test's own).
    """

    def __init__(
        self, logger: logging.Logger, level: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger
        self._level = level
        self._clock = clock
        self._windows: dict[str, list[float]] = {}  # reason -> [start, logged, held]

    def refused(self, reason: str, what: str, *args: object) -> None:
        """Log one refusal for `reason` (`what` % `args`) unless its lines are spent."""
        now = self._clock()
        window = self._windows.setdefault(reason, [-LOG_WINDOW_S, 0, 0])
        if now - window[0] >= LOG_WINDOW_S:
            if window[2]:
                self._log.log(
                    self._level,
                    "%d more TLS handshakes refused (%s) were not logged",
                    window[2],
                    reason,
                )
            window[:] = [now, 0, 0]
        if window[1] < LOG_BURST:
            window[1] += 1
            self._log.log(self._level, what, *args)
        else:
            window[2] += 1

    def handshake_failed(self, what: str, caller: str, exc: BaseException) -> str | None:
        """Log a failed handshake of a `what` connection (``peer``, ``mqtt``, ...) from
        `caller`; its ``reason`` label for the caller's counter, or None when the caller
        just hung up (logged at INFO, not counted: a TCP probe, a port scan)."""
        if closed_silently(exc):
            self._log.info("%s connection from %s closed during the TLS handshake", what, caller)
            return None
        reason = refusal_reason(exc)
        self.refused(
            reason,
            "refusing %s connection from %s: TLS handshake failed (%s): %s",
            what,
            caller,
            reason,
            describe_refusal(exc, reason),
        )
        return reason


def refusal_reason(exc: BaseException) -> str:
    """The ``reason`` label of a failed handshake (see the module docs)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        if exc.verify_code in _EXPIRED:
            return "expired"
        if exc.verify_code in _UNKNOWN_CA:
            return "unknown_ca"
        return "bad_certificate"
    reason = getattr(exc, "reason", None)
    if reason == "PEER_DID_NOT_RETURN_A_CERTIFICATE":
        return "no_certificate"
    if reason in _NOT_TLS:
        return "plaintext"
    return "handshake"


def describe_refusal(exc: BaseException, reason: str) -> str:
    """What went wrong in a failed handshake, for the log line."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate verify failed: {exc.verify_message}"
    if reason == "plaintext":
        return f"the caller does not speak TLS ({exc.reason})"  # type: ignore[attr-defined]
    if reason == "no_certificate":
        return "the caller sent no client certificate"
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    if isinstance(exc, TimeoutError):
        return "no TLS handshake within the handshake timeout"
    return str(exc) or type(exc).__name__


def closed_silently(exc: BaseException) -> bool:
    """The caller just closed the connection before the handshake finished (a TCP probe,
    a port scan): no TLS alert, no certificate refused."""
    return isinstance(exc, _SILENT)


def address(peername: Any) -> str:
    """A transport's ``peername`` as ``host:port`` (``[host]:port`` for IPv6)."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)


ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class TlsAcceptor:
    """Does the TLS handshake of one listener's connections (see the module docs).

    Args:
        listener: the ``listener`` label (``mqtt``, ``mqtt_ws``, ``http``).
        context: the server-side SSL context (`Security.server_ssl_context`).
        metrics: where refusals are counted (``tls_refused``).
        handshake_timeout_s: a caller that has not finished the handshake by
            then is dropped (reason ``handshake``).
    """

    def __init__(
        self,
        listener: str,
        context: ssl.SSLContext,
        metrics: NodeMetrics,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.listener = listener
        self._context = context
        self._refused = metrics.tls_refused
        self._log = RefusalLog(log, logging.WARNING)
        self._timeout = handshake_timeout_s
        self._handshaking: dict[asyncio.Task[None], asyncio.Transport] = {}

    def wrap(self, factory: ProtocolFactory) -> ProtocolFactory:
        """A protocol factory for ``loop.create_server``: each connection does the
        handshake, then is served by a protocol from `factory` over TLS."""
        return lambda: _Handshaking(self, factory)

    def close(self) -> None:
        """Drop the connections still in their handshake (when the listener stops)."""
        for transport in self._handshaking.values():
            transport.abort()

    async def _handshake(self, raw: asyncio.Transport, first: _Handshaking) -> None:
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw, first, self._context, server_side=True, ssl_handshake_timeout=self._timeout
            )
        except (OSError, TimeoutError) as exc:
            self._refuse(address(raw.get_extra_info("peername")), exc)
            raw.abort()
            return
        if tls is not None:  # None: closed meanwhile
            first.hand_over(tls)

    def _refuse(self, caller: str, exc: BaseException) -> None:
        reason = self._log.handshake_failed(self.listener, caller, exc)
        if reason is not None:
            self._refused.labels(listener=self.listener, reason=reason).inc()


class _Handshaking(asyncio.Protocol):
    """A connection's protocol until its TLS handshake is done; then the listener's.

    The TLS transport may deliver the first bytes the moment the handshake
    completes, before `hand_over` has run: they (and an end of stream) wait
    here and are passed on in order.
    """

    def __init__(self, acceptor: TlsAcceptor, factory: ProtocolFactory) -> None:
        self._acceptor = acceptor
        self._factory = factory
        self._pending: list[bytes] = []
        self._eof = False
        self._lost: tuple[Exception | None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        # The task's first step runs before asyncio's first read of the socket, and
        # start_tls pauses reading at once: no byte of the handshake reaches this protocol.
        task = asyncio.get_running_loop().create_task(self._acceptor._handshake(transport, self))
        self._acceptor._handshaking[task] = transport
        task.add_done_callback(self._acceptor._handshaking.pop)

    def hand_over(self, tls: asyncio.Transport) -> None:
        inner = self._factory()
        tls.set_protocol(inner)
        inner.connection_made(tls)
        if self._pending:
            assert isinstance(inner, asyncio.Protocol)
            for data in self._pending:
                inner.data_received(data)
            self._pending.clear()
        if self._eof and isinstance(inner, asyncio.Protocol) and not inner.eof_received():
            tls.close()
        if self._lost is not None:
            inner.connection_lost(self._lost[0])

    def data_received(self, data: bytes) -> None:
        self._pending.append(data)

    def eof_received(self) -> bool:
        self._eof = True
        return True  # the listener's protocol decides, once it has the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = (exc,)
