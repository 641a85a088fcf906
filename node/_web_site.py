"""The node's aiohttp listeners (the HTTP bridge, MQTT over WebSocket): one way to bind them.

Imported only by the modules that serve with aiohttp, which the node imports
only when such a listener is configured.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from geofed.routing import InvalidInput

from ._tls_accept import TlsAcceptor


async def start_site(
    runner: web.AppRunner, listen: str, field: str, acceptor: TlsAcceptor | None
) -> int:
    """Set up `runner` and serve it on `listen` (``host:port``); returns the bound port.

    With an `acceptor` (``tls_dir``), each connection does the node's TLS
    handshake first, so refused handshakes are logged and counted
    (`TlsAcceptor`), not dropped unseen as aiohttp's own TLS site would.

    Raises:
        InvalidInput: naming `field` when the port cannot be bound.
    """
    await runner.setup()
    host, _, port = listen.rpartition(":")
    site = _Site(runner, host or None, int(port), acceptor)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise InvalidInput(field, f"cannot listen on {listen}: {exc.strerror}") from None
    return int(runner.addresses[0][1])


class _Site(web.BaseSite):
    """aiohttp's TCP site, with the TLS handshake done by a `TlsAcceptor`."""

    __slots__ = ("_acceptor", "_host", "_port")

    def __init__(
        self, runner: web.AppRunner, host: str | None, port: int, acceptor: TlsAcceptor | None
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._acceptor = acceptor

    @property
    def name(self) -> str:
        scheme = "https" if self._acceptor else "http"
        return f"{scheme}://{self._host or '0.0.0.0'}:{self._port}"

    async def start(self) -> None:
        await super().start()
        handler = self._runner.server
        assert handler is not None
        factory = self._acceptor.wrap(handler) if self._acceptor else handler
        self._server = await asyncio.get_running_loop().create_server(
            factory, self._host, self._port, backlog=self._backlog
        )

    async def stop(self) -> None:
        if self._acceptor is not None:
            self._acceptor.close()
        await super().stop()
