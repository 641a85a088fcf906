"""MQTT over WebSocket (for browsers): the byte stream of an MQTT connection in WebSocket frames.

MQTT 3.1.1 §6 / 5.0 §6: the client asks for the subprotocol ``mqtt``, the
packets travel in binary frames, and a frame may hold several packets or
part of one. This module only turns an aiohttp WebSocket into the reader
and writer the MQTT session (`geofed.node._mqtt._Connection`) reads and
writes, the same interface `asyncio.start_server` gives the TCP listener;
the session logic, geo-context, authentication and TLS are the TCP
listener's. aiohttp is the node's one HTTP stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import WSMsgType, web

from . import _mqtt_codec as mq
from ._tls_accept import TlsAcceptor
from ._web_site import start_site

log = logging.getLogger("geofed.node.mqtt")

PATH = "/mqtt"
"""The URL path of the MQTT WebSocket endpoint (paho's and MQTT.js's default path)."""
SUBPROTOCOL = "mqtt"
"""The WebSocket subprotocol MQTT 3.1.1 and 5.0 clients ask for."""
_FRAME_OVERHEAD = 16  # an MQTT fixed header beside the largest packet, in one frame


class WebSocketReader:
    """The client's bytes, a binary frame at a time (`ByteReader`)."""

    def __init__(self, ws: web.WebSocketResponse) -> None:
        self._ws = ws

    async def read(self, n: int) -> bytes:
        """The next frame's bytes (a frame is at most the largest packet); b"" at the end.

        Raises:
            PacketError: a text frame (MQTT packets travel in binary frames).
        """
        while True:
            msg = await self._ws.receive()
            if msg.type is WSMsgType.BINARY:
                if msg.data:
                    return bytes(msg.data)
            elif msg.type is WSMsgType.TEXT:
                raise mq.PacketError(
                    mq.MALFORMED_PACKET, "a WebSocket text frame (MQTT packets go in binary frames)"
                )
            else:  # CLOSE, CLOSING, CLOSED, ERROR
                return b""


class WebSocketWriter:
    """Packets written by the session, sent as binary frames; the interface of a StreamWriter.

    `write` queues and starts a flush (the session writes synchronously and
    may not drain, as a StreamWriter sends at once); what is queued while a
    frame is being sent goes in the next one. `drain` waits for the flush;
    `close` sends what is left, then the close frame.
    """

    def __init__(self, ws: web.WebSocketResponse, request: web.Request) -> None:
        self._ws = ws
        self._transport = request.transport
        self._out: list[bytes] = []
        self._flushing: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None

    def write(self, data: bytes) -> None:
        if self._closing is not None:
            return
        self._out.append(data)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.get_running_loop().create_task(self._flush())
            self._flushing.add_done_callback(_retrieve)

    async def _flush(self) -> None:
        while self._out:
            data = self._out[0] if len(self._out) == 1 else b"".join(self._out)
            self._out.clear()
            await self._ws.send_bytes(data)

    async def drain(self) -> None:
        """Wait until what was written is sent (ConnectionError if it cannot be)."""
        if self._flushing is not None:
            await asyncio.shield(self._flushing)

    def can_write_eof(self) -> bool:
        """No half-close: the WebSocket close handshake ends a connection cleanly."""
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("a WebSocket has no half-close")

    def close(self) -> None:
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._close())

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            await self.drain()
        with contextlib.suppress(Exception):
            await self._ws.close()

    async def wait_closed(self) -> None:
        if self._closing is not None:
            await asyncio.shield(self._closing)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if self._transport is None:
            return default
        return self._transport.get_extra_info(name, default)


def _retrieve(task: asyncio.Task[None]) -> None:
    """A failed flush is seen by the next `drain`, not reported as never retrieved."""
    if not task.cancelled():
        task.exception()


Serve = Callable[[WebSocketReader, WebSocketWriter], Awaitable[None]]


class WebSocketServer:
    """An aiohttp server with one route, `PATH`, handing each MQTT WebSocket to `serve`."""

    def __init__(self, serve: Serve, max_packet: int) -> None:
        self._serve = serve
        self._max_frame = max_packet + _FRAME_OVERHEAD
        self._runner: web.AppRunner | None = None

    async def start(self, listen: str, acceptor: TlsAcceptor | None) -> int:
        """Bind `listen` and serve; returns the port.

        Raises:
            InvalidInput: naming ``mqtt_ws_listen`` when the port cannot be bound.
        """
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        return await start_site(self._runner, listen, "mqtt_ws_listen", acceptor)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(
            protocols=(SUBPROTOCOL,), max_msg_size=self._max_frame, compress=False
        )
        ready = ws.can_prepare(request)
        if not ready.ok or ready.protocol != SUBPROTOCOL:
            log.info("mqtt websocket %s: refused: no subprotocol %r", request.remote, SUBPROTOCOL)
            raise web.HTTPBadRequest(
                text=f"MQTT over WebSocket: a WebSocket upgrade with subprotocol {SUBPROTOCOL!r}\n"
            )
        await ws.prepare(request)
        writer = WebSocketWriter(ws, request)
        try:
            await self._serve(WebSocketReader(ws), writer)
        finally:
            writer.close()
            await writer.wait_closed()
        return ws


__all__ = ["PATH", "SUBPROTOCOL", "WebSocketReader", "WebSocketServer", "WebSocketWriter"]
