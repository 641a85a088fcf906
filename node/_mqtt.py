"""The MQTT front end of a node: MQTT 3.1.1 and 5.0 clients on `mqtt_listen`.

One more front end of the same `BrokerServer`: a CONNECT opens a geofed
session (`client_connect`), a SUBSCRIBE registers one subscription per
filter with its delivery stream (`client_subscribe`), a PUBLISH is checked
and routed like a gRPC `Publish` (`client_event`, `publish`), a location on
any packet is a `client_move`. Matching, routing, durability, identities
and the policy are the node's; this module only speaks the protocol
(`_mqtt_codec`) and reads the geo-context off the packets (`_mqtt_geo`).
The user's guide is docs/mqtt.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from geofed.errors import status_for
from geofed.routing import (
    BrokerInfo,
    Event,
    GeofedError,
    InvalidInput,
    LatLon,
    PermissionDenied,
    StorageFailed,
    SubKey,
    TooLarge,
    Unauthenticated,
    latlon,
    validate_id,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    event_from_pb,
    event_to_pb,
    geofence_from_text,
    geofence_to_pb,
    location_from_text,
)

from . import _mqtt_codec as mq
from ._auth import ANONYMOUS, Principal, certificate_names
from ._metrics import MQTT_PROTOCOL_VERSIONS
from ._mqtt_geo import (
    FENCE_LEVEL,
    GEOFENCE_PROPERTY,
    LOCATION_LEVEL,
    LOCATION_PROPERTY,
    PREFIX,
    REDIRECT_TOPIC,
    GeoTopic,
    split_topic,
    subscription_id,
)
from ._server import _END, _Stream

if TYPE_CHECKING:
    from ._server import BrokerServer, _Session

log = logging.getLogger("geofed.node.mqtt")

_PACKET_OVERHEAD = 1 << 17  # topic, properties and headers allowed beside payload and geofence
_RECEIVE_MAXIMUM = 65_535  # QoS 1 deliveries in flight per connection (MQTT's maximum)
_WRITE_BATCH = 256  # deliveries written to the socket in one go
_WRITE_BATCH_BYTES = 1 << 20  # ... and at most this many bytes of them
_PUBLISH_BATCH = 512  # events of a burst of PUBLISH packets published together
_QOS_SWEEP_AT = 1024  # granted-QoS entries kept before those of ended subscriptions are swept
_LINGER_S = 2.0  # a connection the broker ends reads what the client still sends, this long


class _Writer(Protocol):
    """Where a connection's packets go: an `asyncio.StreamWriter` or a `WebSocketWriter`."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def can_write_eof(self) -> bool: ...

    def write_eof(self) -> None: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


class _Close(Exception):
    """End the connection (after an optional DISCONNECT, MQTT 5 only)."""

    def __init__(self, code: int | None = None, reason: str = "", reference: str = "") -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.reference = reference


def _reason_for(exc: GeofedError) -> int:
    """The MQTT 5 reason code for a rejected request."""
    if isinstance(exc, PermissionDenied | Unauthenticated):
        return mq.NOT_AUTHORIZED
    if isinstance(exc, TooLarge):
        return mq.QUOTA_EXCEEDED
    if isinstance(exc, StorageFailed):
        return mq.SERVER_UNAVAILABLE
    field = getattr(exc, "field", "")
    if isinstance(exc, InvalidInput) and field.endswith("topic"):
        return mq.TOPIC_NAME_INVALID
    if isinstance(exc, InvalidInput) and field.endswith("topic_filter"):
        return mq.TOPIC_FILTER_INVALID
    return mq.IMPLEMENTATION_SPECIFIC_ERROR


def _geo_error(exc: GeofedError, prop: str) -> GeofedError:
    """The error with the MQTT property (or topic level) that carried the bad value named."""
    if isinstance(exc, InvalidInput) and "geofence" in exc.field and prop not in str(exc):
        return InvalidInput(prop, str(exc))
    return exc


@dataclass
class _DelayedWill:
    """A will waiting out its Will Delay Interval (`now`: publish it at once)."""

    task: asyncio.Task[None]
    now: asyncio.Event
    event_id: str  # its row in the store's mqtt_wills


@dataclass
class _Inflight:
    """A QoS 1 delivery waiting for its PUBACK."""

    key: SubKey
    offset: int  # in a persistent subscription's queue; 0 otherwise


class MqttListener:
    """The MQTT listeners of one node, TCP and WebSocket: one `_Connection` per client.

    Both transports share the client table (a client may reconnect over the
    other one: session takeover works across them) and the session logic.
    """

    def __init__(self, node: BrokerServer) -> None:
        self.node = node
        cfg = node.config
        self.max_packet = cfg.max_payload_bytes + cfg.max_geofence_bytes + _PACKET_OVERHEAD
        self.connections: dict[str, _Connection] = {}
        self.qos: dict[SubKey, int] = {}  # granted QoS of the MQTT subscriptions held here
        self._restored = False
        self.wills: dict[str, _DelayedWill] = {}  # wills waiting out their Will Delay Interval
        self._server: asyncio.Server | None = None
        self._ws_server: Any = None  # the _mqtt_ws.WebSocketServer, with mqtt_ws_listen
        self._acceptor = node.security.acceptor("mqtt")  # the TCP listener's TLS (tls_dir)
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0
        self.ws_port = 0
        self.tls = node.security.files is not None
        self.default_location = _default_location(node.federation.broker(node.broker_id), node)

    async def start(self, listen: str) -> int:
        """Bind `listen` (TLS with the node's ``tls_dir``) and serve; returns the port.

        Raises:
            InvalidInput: naming ``mqtt_listen`` when the port cannot be bound.
        """
        await self._restore()
        host, _, port = listen.rpartition(":")
        try:
            self._server = await asyncio.get_running_loop().create_server(
                self._acceptor.wrap(self._stream) if self._acceptor else self._stream,
                host or None,
                int(port),
            )
        except OSError as exc:
            raise InvalidInput(
                "mqtt_listen", f"cannot listen on {listen}: {exc.strerror}"
            ) from None
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def start_websocket(self, listen: str) -> int:
        """Serve MQTT over WebSocket on `listen` (wss with the node's ``tls_dir``); the port.

        Raises:
            InvalidInput: naming ``mqtt_ws_listen`` when the port cannot be bound.
        """
        from ._mqtt_ws import WebSocketServer  # aiohttp is imported only when it serves

        await self._restore()
        self._ws_server = WebSocketServer(self._serve_websocket, self.max_packet)
        self.ws_port = await self._ws_server.start(listen, self.node.security.acceptor("mqtt_ws"))
        return self.ws_port

    async def _restore(self) -> None:
        """What a durable node kept (once): the QoS of the persistent MQTT subscriptions, and
        the delayed wills (one whose delay passed while the node was down goes at once)."""
        if self._restored:
            return
        self._restored = True
        store = self.node.store
        for stored, qos in (await store.mqtt_qos()).items():
            client, sub_id = stored.split("\x1f")  # as _stored joined them
            self.qos[(client, sub_id)] = qos
        for client, due, data in await store.mqtt_wills():
            event = event_from_pb(gpb.Event.FromString(data), self.node.geofences)
            left = max(0.0, due - time.time())
            self._schedule_will(client, event, left)
            log.info("mqtt client %s: delayed will kept, due in %.0f s", client, left)

    def grant(self, key: SubKey, qos: int) -> None:
        """Remember the QoS granted to an MQTT subscription.

        Entries are not removed everywhere a subscription can end (expiry,
        a stream closing, a move, a gRPC unsubscribe): once the table holds
        twice as many entries as the node has subscriptions (and at least
        1,024), the entries of subscriptions gone are swept, so the table
        stays within a constant factor of the live subscriptions.
        """
        self.qos[key] = qos
        local = self.node.core.local
        if len(self.qos) > max(_QOS_SWEEP_AT, 2 * len(local)):
            self.qos = {k: q for k, q in self.qos.items() if k in local}

    def reference(self, target: BrokerInfo, websocket: bool) -> str:
        """What a redirect names: the target's MQTT endpoint over the client's transport.

        A WebSocket client gets a URL (``ws[s]://host:port/mqtt``), what
        browser clients connect to; a TCP client ``host:port``.
        """
        if not websocket:
            return target.mqtt_endpoint
        if not target.mqtt_ws_endpoint:
            return ""
        from ._mqtt_ws import PATH

        return f"{'wss' if self.tls else 'ws'}://{target.mqtt_ws_endpoint}{PATH}"

    def _stream(self) -> asyncio.StreamReaderProtocol:
        """A TCP connection's protocol: `_accept` gets it as a reader and a writer (what
        ``asyncio.start_server`` would make)."""
        return asyncio.StreamReaderProtocol(asyncio.StreamReader(), self._accept)

    async def delay_will(self, client: str, event: Event, delay: float) -> None:
        """Publish `client`'s will `event` after `delay` s (MQTT 5 Will Delay Interval, capped
        by the session expiry) unless the client reconnects first (`reconnected`).

        The will is in the store (committed) before this returns: a durable node that
        stops or crashes meanwhile publishes it when it is back (`_restore`).
        """
        store = self.node.store
        store.put_mqtt_will(
            event.id, client, time.time() + delay, event_to_pb(event).SerializeToString()
        )
        try:
            await store.commit()
        except StorageFailed as exc:  # it still waits here; only a restart would lose it
            log.warning("mqtt client %s: delayed will not stored: %s", client, exc)
        self._schedule_will(client, event, delay)
        log.info("mqtt client %s gone without DISCONNECT: will in %.0f s", client, delay)

    def _schedule_will(self, client: str, event: Event, delay: float) -> None:
        now = asyncio.Event()

        async def later() -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(now.wait(), delay)
            if self.wills.get(client) is delayed:
                del self.wills[client]
            await self.publish_will(client, event)

        task = asyncio.get_running_loop().create_task(later(), name=f"mqtt-will-{client}")
        delayed = self.wills[client] = _DelayedWill(task, now, event.id)

    async def publish_will(self, client: str, event: Event) -> None:
        """Publish a will (the store forgets it with the same commit)."""
        self.node.store.delete_mqtt_will(event.id)
        try:
            await self.node.publish([event])
            log.info("mqtt client %s gone without DISCONNECT: will published", client)
        except GeofedError as exc:
            log.warning("mqtt client %s: will not published: %s", client, exc)

    def reconnected(self, client: str, clean_start: bool) -> None:
        """A client connected again: its delayed will is dropped, or (Clean Start: the old
        session ended) published now."""
        delayed = self.wills.pop(client, None)
        if delayed is None:
            return
        if clean_start:
            delayed.now.set()
        else:
            delayed.task.cancel()
            self.node.store.delete_mqtt_will(delayed.event_id)
            log.info("mqtt client %s reconnected within its Will Delay Interval: no will", client)

    async def stop(self) -> None:
        """Stop accepting, tell MQTT 5 clients the server shuts down, close every connection."""
        for delayed in self.wills.values():  # not published now: kept in a durable store
            delayed.task.cancel()
        self.wills.clear()
        if self._server is not None:
            self._server.close()
        if self._acceptor is not None:
            self._acceptor.close()
        for conn in list(self.connections.values()):
            conn.shutdown()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.node.config.shutdown_grace_s)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._ws_server is not None:
            await self._ws_server.stop()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._run(_Connection(self, reader, writer, websocket=False))

    async def _serve_websocket(self, reader: mq.ByteReader, writer: _Writer) -> None:
        await self._run(_Connection(self, reader, writer, websocket=True))

    async def _run(self, conn: _Connection) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await conn.run()
        finally:
            self._tasks.discard(task)


def _default_location(me: BrokerInfo, node: BrokerServer) -> LatLon:
    """Where a client that gave no location counts as being: a point of this broker's area.

    The broker's site if this broker is responsible for it, else a point
    inside one of the parts of its area for which it is.
    """
    candidates = [me.site] if me.site is not None else []
    for part in me.area.parts:
        p = part.representative_point()
        candidates.append(latlon(p.y, p.x, "area"))
    for c in candidates:
        if node.federation.responsible(c) == me.id:
            return c
    return candidates[-1]


class _Connection:
    """One MQTT client connection: the protocol state between CONNECT and the socket closing."""

    def __init__(
        self, listener: MqttListener, reader: mq.ByteReader, writer: _Writer, *, websocket: bool
    ) -> None:
        self.listener = listener
        self.node = listener.node
        self.packets = mq.PacketReader(reader, listener.max_packet)
        self.writer = writer
        self.out: list[bytes] = []  # packets to write once no more input is waiting
        self.pending: list[tuple[Event, int]] = []  # a burst's events, QoS 1 packet ids (or 0)
        self.websocket = websocket  # redirects name the WebSocket endpoint
        self.version = mq.MQTT_5
        self.client = ""
        self.who: Principal = ANONYMOUS
        self.connected = False
        self.will: mq.Will | None = None
        self.keep_alive = 0
        self.expiry = 0.0  # the session expiry granted (> 0: persistent)
        self.session: _Session | None = None
        self.pumps: dict[SubKey, asyncio.Task[None]] = {}
        self.inflight: dict[int, _Inflight] = {}
        self.outstanding: dict[SubKey, set[int]] = {}  # unacknowledged offsets per subscription
        self.sent: dict[SubKey, int] = {}  # highest offset written per persistent subscription
        self.window = asyncio.Semaphore(_RECEIVE_MAXIMUM)
        self.next_id = 0
        self.closed = asyncio.Event()
        self.acks: set[asyncio.Task[None]] = set()  # offsets being acknowledged to the node
        self.held = False  # redirected with its session held here (`client_transfer`)
        self.lingering = False  # the broker ends the connection: `_linger` before closing
        self.peer = writer.get_extra_info("peername")

    # -- writing ---------------------------------------------------------------

    def send(self, packet: mq.ConnAck | mq.Publish | mq.PubAck | mq.SubAck | mq.UnsubAck) -> None:
        """Queue a packet: the answers to a burst of packets go out in one write (`flush`)."""
        self.out.append(packet.encode(self.version))

    def send_other(self, packet: mq.PingResp | mq.Disconnect) -> None:
        """Write a packet now, after what is queued."""
        self.out.append(packet.encode(self.version))
        self.flush()

    def flush(self, more: list[bytes] | None = None) -> None:
        """Write what is queued (and `more`) in one go."""
        out = self.out + more if more else self.out
        if out:
            self.writer.write(out[0] if len(out) == 1 else b"".join(out))
            self.out = []

    def shutdown(self) -> None:
        """The node stops: MQTT 5 clients are told so; the socket closes."""
        with contextlib.suppress(Exception):
            if self.version == mq.MQTT_5 and self.connected:
                self.send_other(mq.Disconnect(mq.SERVER_SHUTTING_DOWN))
            self.flush()
        self.writer.close()

    # -- the connection ----------------------------------------------------------

    async def run(self) -> None:
        clean = False
        try:
            if not await self._connect():
                return
            clean = await self._serve()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, TimeoutError):
            pass
        except _Close as close:
            self._disconnect(close)
            self.lingering = True
            clean = close.code == mq.SERVER_MOVED  # redirected, not gone: no will
        except mq.PacketError as exc:
            log.info("mqtt client %s (%s) sent a bad packet: %s", self.client, self.peer, exc)
            self._disconnect(_Close(exc.code, exc.message))
        finally:
            await self._end(clean)
            if self.held:
                # Its session went ahead to the new broker; once what it acknowledged
                # here is acknowledged, the rest of its queues follows (`client_leave`).
                with contextlib.suppress(GeofedError):
                    await self.node.client_leave(self.who, self.client)

    def _disconnect(self, close: _Close) -> None:
        if self.version == mq.MQTT_5 and self.connected and close.code is not None:
            props = mq.Properties()
            if close.reason:
                props.values[mq.REASON_STRING] = close.reason[:1000]
            if close.reference:
                props.values[mq.SERVER_REFERENCE] = close.reference
            with contextlib.suppress(Exception):
                self.send_other(mq.Disconnect(close.code, props))

    async def _end(self, clean: bool) -> None:
        node = self.node
        with contextlib.suppress(_Close):  # what was read before the end is published
            await self._publish_pending()
        for task in self.pumps.values():
            task.cancel()
        for task in list(self.pumps.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.pumps.clear()
        await self._acknowledged()  # before a reconnect could read the queue
        if self.connected:
            self.connected = False
            node.metrics.mqtt_connections.labels(version=MQTT_PROTOCOL_VERSIONS[self.version]).dec()
            node.stream_closed(self.session)
            if self.listener.connections.get(self.client) is self:
                del self.listener.connections[self.client]
            if not clean and self.will is not None and not node._stopped:
                delay = min(self.will.properties.get(mq.WILL_DELAY_INTERVAL, 0), self.expiry)
                event = await self._will_event(self.will)
                if event is not None and delay > 0:
                    await self.listener.delay_will(self.client, event, delay)
                elif event is not None:
                    await self.listener.publish_will(self.client, event)
        with contextlib.suppress(Exception):
            self.flush()
            if self.lingering:
                await self._linger()
            self.writer.close()
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        self.closed.set()

    async def _linger(self) -> None:
        """Half-close (TCP), then read what the client still sends until it closes (for
        at most `_LINGER_S`): its PUBACKs are taken, the rest is dropped. Those
        acknowledgements count: a redirected client's queue goes to its new broker
        without them. And a TCP socket closed with input unread is reset, which can
        discard what was written last before the client read it: the DISCONNECT
        naming the new broker of a subscriber still acknowledging QoS 1 deliveries."""
        await self.writer.drain()
        if self.writer.can_write_eof():  # a WebSocket's close handshake comes after
            self.writer.write_eof()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_LINGER_S):
                while True:
                    kind, flags, body = await self.packets.next(None)  # raises at the close
                    if kind == mq.PUBACK:
                        packet = mq.decode(kind, flags, body, self.version)
                        assert isinstance(packet, mq.PubAck)
                        self._on_puback(packet)
        await self._acknowledged()  # before a move hands the rest of the queue over

    async def _will_event(self, will: mq.Will) -> Event | None:
        """The will as the client's event, from where the client was last (None: refused)."""
        try:
            fence = will.properties.user_values(GEOFENCE_PROPERTY)
            return await self._event(
                will.topic, will.payload, fence[-1] if fence else None, GEOFENCE_PROPERTY
            )
        except GeofedError as exc:
            log.warning("mqtt client %s: will not published: %s", self.client, exc)
            return None

    # -- CONNECT -----------------------------------------------------------------

    async def _connect(self) -> bool:
        node = self.node
        timeout = node.config.mqtt_connect_timeout_s or None
        kind, flags, body = await self.packets.next(timeout)
        if kind != mq.CONNECT:
            log.info("mqtt connection %s: first packet is not a CONNECT", self.peer)
            return False
        try:
            packet = mq.decode_connect(flags, body)
        except mq.PacketError as exc:
            if exc.code == mq.UNSUPPORTED_PROTOCOL_VERSION:
                # Answered in 3.1.1 form, which every version reads.
                self.out.append(mq.ConnAck(mq.V311_REFUSED_PROTOCOL).encode(mq.MQTT_311))
            log.info("mqtt connection %s: refused CONNECT: %s", self.peer, exc)
            return False
        self.version = packet.version
        v5 = self.version == mq.MQTT_5
        label = MQTT_PROTOCOL_VERSIONS[self.version]
        props = packet.properties
        ack = mq.ConnAck()
        if v5:
            ack.properties.values.update(
                {
                    mq.RETAIN_AVAILABLE: 0,
                    mq.MAXIMUM_QOS: 1,
                    mq.SUBSCRIPTION_IDENTIFIER_AVAILABLE: 0,
                    mq.SHARED_SUBSCRIPTION_AVAILABLE: 0,
                }
            )
            if props.get(mq.RECEIVE_MAXIMUM) == 0:
                return self._refuse(label, mq.PROTOCOL_ERROR, "Receive Maximum 0")
            self.window = asyncio.Semaphore(props.get(mq.RECEIVE_MAXIMUM, _RECEIVE_MAXIMUM))
            if props.get(mq.AUTHENTICATION_METHOD) is not None:
                return self._refuse(label, mq.BAD_USER_NAME_OR_PASSWORD, "no enhanced auth")
            if packet.will is not None and packet.will.retain:
                return self._refuse(label, mq.RETAIN_NOT_SUPPORTED, "retained wills")
            if packet.will is not None and packet.will.qos == 2:
                return self._refuse(label, mq.QOS_NOT_SUPPORTED, "will QoS 2")
        client = packet.client_id
        if not client:
            if not v5 and not packet.clean_start:
                return self._refuse(label, mq.V311_REFUSED_IDENTIFIER, "empty client id")
            client = "mqtt-" + uuid.uuid4().hex
            if v5:
                ack.properties.values[mq.ASSIGNED_CLIENT_IDENTIFIER] = client
        try:
            validate_id(client, "client")
        except InvalidInput as exc:
            code = mq.CLIENT_IDENTIFIER_NOT_VALID if v5 else mq.V311_REFUSED_IDENTIFIER
            return self._refuse(label, code, str(exc))
        self.client = client
        try:
            self.who = self._principal(packet)
        except Unauthenticated as exc:
            code = mq.BAD_USER_NAME_OR_PASSWORD if v5 else mq.V311_REFUSED_CREDENTIALS
            return self._refuse(label, code, str(exc))
        if v5:
            expiry = float(props.get(mq.SESSION_EXPIRY_INTERVAL, 0))
        else:
            expiry = 0.0 if packet.clean_start else node.config.max_session_expiry_s
        where = node.location_of(client) or self.listener.default_location
        try:
            located = props.user_values(LOCATION_PROPERTY)
            if located:
                where = location_from_text(located[-1], LOCATION_PROPERTY)
        except InvalidInput as exc:
            node.on_reject(status_for(exc))
            return self._refuse(label, mq.IMPLEMENTATION_SPECIFIC_ERROR, str(exc))
        old = self.listener.connections.get(client)
        if old is not None:  # session takeover: the older connection goes first
            if old.version == mq.MQTT_5:
                with contextlib.suppress(Exception):
                    old.send_other(mq.Disconnect(mq.SESSION_TAKEN_OVER))
            old.writer.close()
            await old.closed.wait()
        try:
            if packet.clean_start and expiry and node.persistent(client):
                await node.client_connect(self.who, client, where, 0.0)  # discard the old one
            opened = await node.client_connect(self.who, client, where, expiry)
        except GeofedError as exc:
            node.on_reject(status_for(exc))
            if v5:
                return self._refuse(label, _reason_for(exc), str(exc))
            code = (
                mq.V311_REFUSED_NOT_AUTHORIZED
                if isinstance(exc, PermissionDenied)
                else mq.V311_REFUSED_UNAVAILABLE
            )
            return self._refuse(label, code, str(exc))
        if opened.redirect is not None:
            target = opened.redirect
            reference = self.listener.reference(target, self.websocket)
            node.metrics.mqtt_connects.labels(version=label, result="redirected").inc()
            log.info(
                "mqtt client %s at %s,%s redirected to broker %s (%s)",
                client,
                where.lat,
                where.lon,
                target.id,
                reference,
            )
            if v5:
                ack.code = mq.USE_ANOTHER_SERVER
                if reference:
                    ack.properties.values[mq.SERVER_REFERENCE] = reference
                ack.properties.values[mq.REASON_STRING] = f"location belongs to broker {target.id}"
            else:
                ack.code = mq.V311_REFUSED_UNAVAILABLE
            self.send(ack)
            return False
        if v5 and opened.expiry_s != expiry:
            ack.properties.values[mq.SESSION_EXPIRY_INTERVAL] = int(opened.expiry_s)
        ack.session_present = opened.present
        self.will = packet.will
        self.keep_alive = packet.keep_alive
        self.expiry = opened.expiry_s
        self.listener.reconnected(client, packet.clean_start)
        self.send(ack)
        self.connected = True
        self.session = node.stream_opened(client)  # the connection keeps the session alive
        self.listener.connections[client] = self
        node.metrics.mqtt_connects.labels(version=label, result="accepted").inc()
        node.metrics.mqtt_connections.labels(version=label).inc()
        if opened.present:
            for sub in node.core.subscriptions_of(client):
                qos = self.listener.qos.get(sub.key, 1)
                self._pump(sub.key, node.client_stream(sub.key), qos)
        return True

    def _refuse(self, label: str, code: int, reason: str) -> bool:
        ack = mq.ConnAck(code)
        if self.version == mq.MQTT_5:
            ack.properties.values[mq.REASON_STRING] = reason[:1000]
        self.send(ack)
        self.node.metrics.mqtt_connects.labels(version=label, result="refused").inc()
        log.info("mqtt client %r (%s) refused: %s", self.client, self.peer, reason)
        return False

    def _principal(self, packet: mq.Connect) -> Principal:
        """Who the client is: its TLS certificate or the JWT in its CONNECT password."""
        security = self.node.security
        if not security.authenticating:
            return ANONYMOUS
        token = None
        if packet.password:
            token = packet.password.decode("ascii", errors="replace")
        names = certificate_names(self.writer.get_extra_info("ssl_object"))
        return security.authenticate(token, names, "no token in the CONNECT password")

    # -- after CONNECT -------------------------------------------------------------

    async def _serve(self) -> bool:
        """Handle packets until DISCONNECT (True: a normal one, the will is dropped)."""
        timeout = 1.5 * self.keep_alive if self.keep_alive else None
        while True:
            if not self.packets.ready():  # answered what came in one go: send, then wait
                await self._publish_pending()
                self.flush()
                await self.writer.drain()
            try:
                kind, flags, body = await self.packets.next(timeout)
            except TimeoutError:
                log.info("mqtt client %s silent for 1.5x its keep-alive: closed", self.client)
                raise _Close(mq.KEEP_ALIVE_TIMEOUT, "keep-alive timeout") from None
            packet = mq.decode(kind, flags, body, self.version)
            if not isinstance(packet, mq.Publish):
                await self._publish_pending()
            props = getattr(packet, "properties", None)
            if props is not None:
                located = props.user_values(LOCATION_PROPERTY)
                if located:
                    await self._publish_pending()  # published from where they were
                    await self._locate(located[-1], LOCATION_PROPERTY)
            if isinstance(packet, mq.Publish):
                await self._on_publish(packet)
            elif isinstance(packet, mq.PubAck):
                self._on_puback(packet)
            elif isinstance(packet, mq.Subscribe):
                await self._on_subscribe(packet)
            elif isinstance(packet, mq.Unsubscribe):
                self._on_unsubscribe(packet)
            elif isinstance(packet, mq.PingReq):
                self.send_other(mq.PingResp())
            elif isinstance(packet, mq.Disconnect):
                return packet.code != mq.DISCONNECT_WITH_WILL
            else:
                raise _Close(mq.PROTOCOL_ERROR, f"unexpected packet type {kind}")

    def _bad_geo(self, exc: GeofedError) -> _Close:
        """Bad geo-context that no acknowledgement can carry: log it, end the connection."""
        self.node.on_reject(status_for(exc))
        log.warning("mqtt client %s: %s: disconnected", self.client, exc)
        return _Close(_reason_for(exc), str(exc))

    async def _locate(self, text: str, where: str) -> None:
        """A location on a packet: the client's last known location, or a redirect."""
        try:
            point = location_from_text(text, where)
            target, self.held = await self.node.client_transfer(self.who, self.client, point)
        except GeofedError as exc:
            raise self._bad_geo(exc) from None
        if target is None:
            return
        reference = self.listener.reference(target, self.websocket)
        log.info(
            "mqtt client %s moved to %s,%s: redirected to broker %s (%s)",
            self.client,
            point.lat,
            point.lon,
            target.id,
            reference,
        )
        if self.version == mq.MQTT_311:
            # No Server Reference in 3.1.1: the new broker as a message, then the close.
            self.send(mq.Publish(REDIRECT_TOPIC, reference.encode()))
        raise _Close(mq.SERVER_MOVED, f"location belongs to broker {target.id}", reference)

    # PUBLISH ---------------------------------------------------------------------

    async def _on_publish(self, packet: mq.Publish) -> None:
        """A PUBLISH: its event joins the burst being read (`pending`), or is refused.

        A plain PUBLISH (QoS 0/1, no geo-context in the topic) only adds its
        event to `pending`; everything else first publishes what is pending,
        so the events of a connection are published and acknowledged in order.
        """
        v5 = self.version == mq.MQTT_5
        plain = (
            packet.qos < 2
            and not (packet.retain and v5)
            and (not v5 or packet.properties.get(mq.TOPIC_ALIAS) is None)
            and not packet.topic.startswith(PREFIX)
        )
        if not plain:
            await self._publish_pending()
        if packet.qos == 2:
            raise _Close(mq.QOS_NOT_SUPPORTED, "QoS 2 is not supported")
        if packet.retain and v5:
            raise _Close(mq.RETAIN_NOT_SUPPORTED, "retained messages are not supported")
        if v5 and packet.properties.get(mq.TOPIC_ALIAS) is not None:
            raise _Close(mq.PROTOCOL_ERROR, "topic aliases are not supported (maximum 0)")
        try:
            geo = split_topic(packet.topic)
        except InvalidInput as exc:
            raise self._bad_geo(exc) from None
        if geo.location is not None:
            await self._locate(geo.location, PREFIX + LOCATION_LEVEL)
        fences = packet.properties.user_values(GEOFENCE_PROPERTY)
        fence, source = (geo.geofence, PREFIX + FENCE_LEVEL)
        if fence is None and fences:
            fence, source = fences[-1], GEOFENCE_PROPERTY
        if not geo.topic:  # geo-context only
            if packet.qos:
                self.send(mq.PubAck(packet.packet_id))
            return
        try:
            event = await self._event(geo.topic, packet.payload, fence, source)
        except GeofedError as exc:
            await self._publish_pending()
            self.node.on_reject(status_for(exc))
            if not v5 or not packet.qos:
                log.warning(
                    "mqtt client %s: publish to %r refused: %s: disconnected",
                    self.client,
                    geo.topic,
                    exc,
                )
                raise _Close(_reason_for(exc), str(exc)) from None
            props = mq.Properties({mq.REASON_STRING: str(exc)[:1000]})
            self.send(mq.PubAck(packet.packet_id, _reason_for(exc), props))
            return
        self.pending.append((event, packet.packet_id if packet.qos else 0))
        if len(self.pending) >= _PUBLISH_BATCH:
            await self._publish_pending()

    async def _publish_pending(self) -> None:
        """Publish the events of a burst together, then acknowledge the QoS 1 ones in order.

        PUBACK follows the node's acceptance (with a store: once durable).
        """
        if not self.pending:
            return
        batch, self.pending = self.pending, []
        try:
            await self.node.publish([event for event, _ in batch])
        except GeofedError as exc:
            for _ in batch:
                self.node.on_reject(status_for(exc))
            # Not acknowledged: the client sends them again after reconnecting.
            code = mq.SERVER_UNAVAILABLE if isinstance(exc, StorageFailed) else _reason_for(exc)
            raise _Close(code, str(exc)) from None
        for _, packet_id in batch:
            if packet_id:
                self.send(mq.PubAck(packet_id))

    async def _event(self, topic: str, payload: bytes, fence: str | None, source: str) -> Event:
        """A client's event, checked by the node as a gRPC publish is (not yet published)."""
        node = self.node
        where = node.location_of(self.client) or self.listener.default_location
        pb = gpb.Event(
            topic=topic, payload=payload, publisher=gpb.LatLon(lat=where.lat, lon=where.lon)
        )
        if fence:
            pb.geofence.CopyFrom(geofence_to_pb(geofence_from_text(fence, source)))
        node.check_owner(self.who, self.client)
        try:
            return await node.client_event(self.who, self.client, pb, "event")
        except GeofedError as exc:
            raise _geo_error(exc, source) from None

    # SUBSCRIBE / UNSUBSCRIBE ---------------------------------------------------------

    async def _on_subscribe(self, packet: mq.Subscribe) -> None:
        v5 = self.version == mq.MQTT_5
        if v5 and packet.properties.get(mq.SUBSCRIPTION_IDENTIFIER) is not None:
            raise _Close(
                mq.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED, "subscription identifiers not supported"
            )
        fences = packet.properties.user_values(GEOFENCE_PROPERTY)
        codes: list[int] = []
        reasons: list[str] = []
        opened: list[tuple[SubKey, _Stream, int]] = []
        for topic_filter, options in packet.filters:
            try:
                geo = split_topic(topic_filter)
            except InvalidInput as exc:
                geo = None
                error: GeofedError | None = exc
            else:
                error = None
            if geo is not None and geo.location is not None:
                await self._locate(geo.location, PREFIX + LOCATION_LEVEL)
            if geo is not None and not geo.topic:
                codes.append(mq.SUCCESS)  # geo-context only: nothing will come
                continue
            if geo is not None:
                try:
                    opened.append(await self._subscribe(geo, fences, min(options & 0x03, 1)))
                    codes.append(opened[-1][2])
                    continue
                except GeofedError as exc:
                    error = exc
            assert error is not None
            self.node.on_reject(status_for(error))
            geo_context = isinstance(error, InvalidInput) and (
                error.field.startswith((PREFIX, GEOFENCE_PROPERTY, LOCATION_PROPERTY))
            )
            if not v5 and geo_context:
                raise self._bad_geo(error)
            log.info("mqtt client %s: subscribe %r refused: %s", self.client, topic_filter, error)
            codes.append(_reason_for(error) if v5 else mq.V311_SUBACK_FAILURE)
            reasons.append(str(error))
        ack = mq.SubAck(packet.packet_id, codes)
        if reasons and v5:
            ack.properties.values[mq.REASON_STRING] = "; ".join(reasons)[:1000]
        self.send(ack)
        for key, stream, qos in opened:
            self._pump(key, stream, qos)

    async def _subscribe(
        self, geo: GeoTopic, fences: list[str], qos: int
    ) -> tuple[SubKey, _Stream, int]:
        if geo.topic.startswith("$share/"):
            raise InvalidInput(
                "subscription.topic_filter", "shared subscriptions are not supported"
            )
        fence, source = geo.geofence, PREFIX + FENCE_LEVEL
        if fence is None and fences:
            fence, source = fences[-1], GEOFENCE_PROPERTY
        pb = gpb.Subscription(
            id=subscription_id(geo.topic),
            client=self.client,
            topic_filter=geo.topic,
            geofence=geofence_to_pb(geofence_from_text(fence or "", source)),
        )
        try:
            sub, stream = await self.node.client_subscribe(self.who, self.client, pb)
        except GeofedError as exc:
            raise _geo_error(exc, source) from None
        self.node.grant_qos(sub.key, qos)
        if self.node.store.dirty:  # a persistent subscription's QoS is kept
            await self.node.store.commit()
        old = self.pumps.pop(sub.key, None)
        if old is not None:
            old.cancel()  # its stream was closed by the new one: it only ends
        return sub.key, stream, qos

    def _on_unsubscribe(self, packet: mq.Unsubscribe) -> None:
        codes = []
        for topic_filter in packet.filters:
            try:
                topic = split_topic(topic_filter).topic
            except InvalidInput:
                topic = topic_filter
            key = (self.client, subscription_id(topic))
            if not self.node.client_unsubscribe(self.who, self.client, key[1]):
                codes.append(mq.NO_SUBSCRIPTION_EXISTED)
                continue
            self.listener.qos.pop(key, None)
            codes.append(mq.SUCCESS)
        self.send(mq.UnsubAck(packet.packet_id, codes))

    # deliveries ----------------------------------------------------------------------

    def _pump(self, key: SubKey, stream: _Stream, qos: int) -> None:
        self.pumps[key] = asyncio.get_running_loop().create_task(
            self._deliver(key, stream, qos), name=f"mqtt-{key[0]}-{key[1]}"
        )

    async def _deliver(self, key: SubKey, stream: _Stream, qos: int) -> None:
        """Write a subscription's deliveries to the client until its stream ends.

        What the stream holds when the pump wakes is written in one go (one
        socket write for up to `_WRITE_BATCH` deliveries, not one each).
        """
        node = self.node
        try:
            while True:
                items = [
                    await stream.get(),
                    *stream.take_ready(_WRITE_BATCH - 1, _WRITE_BATCH_BYTES),
                ]
                out: list[bytes] = []
                ended = False
                for item in items:
                    if item is _END:
                        ended = True
                        break
                    if qos and self.window.locked():  # the client's window is full
                        await self._write_out(out)
                        out = []
                    out.append(await self._delivery(key, item, qos))
                await self._write_out(out)
                if not qos and key in self.sent:
                    await self._ack(key)  # QoS 0: handed over is done
                if ended:
                    return
        except (ConnectionError, RuntimeError):
            self.writer.close()  # the read loop ends and cleans up
        finally:
            node.client_stream_closed(key, stream)
            if self.pumps.get(key) is asyncio.current_task():
                del self.pumps[key]

    async def _write_out(self, packets: list[bytes]) -> None:
        self.flush(packets)
        await self.writer.drain()

    async def _delivery(self, key: SubKey, item: cpb.Delivery, qos: int) -> bytes:
        """The PUBLISH of one delivery, encoded; a QoS 1 one takes a place in the window."""
        event = item.event
        packet = mq.Publish(event.topic, bytes(event.payload), qos)
        if self.version == mq.MQTT_5:
            packet.properties.user.extend(
                [("geofed-event-id", event.id), ("geofed-origin", event.origin)]
            )
            if item.filter_scheme:  # matched approximately (docs/design.md §14)
                packet.properties.user.append(("geofed-filter-scheme", item.filter_scheme))
        if qos:
            await self.window.acquire()
            packet.packet_id = self._packet_id()
            self.inflight[packet.packet_id] = _Inflight(key, item.offset)
            if item.offset:
                self.outstanding.setdefault(key, set()).add(item.offset)
        if item.offset:
            self.sent[key] = max(self.sent.get(key, 0), item.offset)
        return packet.encode(self.version)

    def _packet_id(self) -> int:
        for _ in range(65_535):
            self.next_id = self.next_id % 65_535 + 1
            if self.next_id not in self.inflight:
                return self.next_id
        raise RuntimeError("no free packet identifier")  # bounded by the window

    def _on_puback(self, packet: mq.PubAck) -> None:
        if packet.kind != mq.PUBACK:
            raise _Close(mq.PROTOCOL_ERROR, "QoS 2 acknowledgements: this server sends QoS <= 1")
        done = self.inflight.pop(packet.packet_id, None)
        if done is None:
            return  # unknown id (the spec lets it be ignored)
        self.window.release()
        if done.offset:
            self.outstanding.get(done.key, set()).discard(done.offset)
            task = asyncio.get_running_loop().create_task(self._ack(done.key))
            self.acks.add(task)
            task.add_done_callback(self.acks.discard)

    async def _acknowledged(self) -> None:
        """Until what the client acknowledged so far is acknowledged to the node."""
        if self.acks:
            await asyncio.wait(set(self.acks))

    async def _ack(self, key: SubKey) -> None:
        """Acknowledge to the node what the client took: up to the first unacknowledged offset."""
        pending = self.outstanding.get(key)
        upto = min(pending) - 1 if pending else self.sent.get(key, 0)
        info = self.node.pending.get(key)
        if info is None or upto <= info.acked:
            return
        try:
            await self.node.ack(key[0], key[1], upto)
        except GeofedError as exc:
            log.warning("mqtt client %s: acknowledging %s failed: %s", self.client, key[1], exc)


__all__ = ["MqttListener"]
