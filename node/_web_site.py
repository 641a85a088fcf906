"""The node's aiohttp listeners (the HTTP bridge, MQTT over WebSocket): one way to bind them.

Imported only by the modules that serve with aiohttp, which the node imports
only when such a listener is configured.
"""

from __future__ import annotations

import ssl

from aiohttp import web

from geofed.routing import InvalidInput


async def start_site(
    runner: web.AppRunner, listen: str, field: str, ssl_context: ssl.SSLContext | None
) -> int:
    """Set up `runner` and serve it on `listen` (``host:port``); returns the bound port.

    Raises:
        InvalidInput: naming `field` when the port cannot be bound.
    """
    await runner.setup()
    host, _, port = listen.rpartition(":")
    site = web.TCPSite(runner, host or None, int(port), ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise InvalidInput(field, f"cannot listen on {listen}: {exc.strerror}") from None
    return int(runner.addresses[0][1])
