"""``geofed bridge-topics``: geofed and a topic-only MQTT broker, the location in the topic.

*Export*: the bridge subscribes in the federation (topic filters, optionally
a subscription geofence: where publishers must be) and republishes every
event it receives to the MQTT broker on ``PREFIX/<location levels>/<topic>``
(`geofed.routing.DecimalLayout` or `H3Layout`), so that consumers that speak
only MQTT subscribe geographically with the filters ``geofed cover`` prints;
the exact location rides along as the MQTT 5 user property
``geofed-location`` for the consumer's exact check. *Import*: the bridge
subscribes on the MQTT broker to every location under the prefix, decodes
the location from each topic and publishes the event into the federation at
the broker responsible for that location, with that location (the
``geofed-location`` property when it lies in the topic's cell, else the
centre of the cell) as publisher location.

Why a command and not a node option: the bridge is a client of both sides.
As a separate process it uses only the public client API (a geofed
subscription with its geofence check at the broker; publishes at the
responsible broker), runs next to whichever MQTT broker it serves, fails and
restarts on its own without touching a broker node, and keeps the node free
of an MQTT client library (paho-mqtt is the ``bridge`` extra).

Loops: imported events carry ids starting with the bridge's marker, which the
export skips; export and import share one MQTT 5 connection, whose import
subscriptions are *no-local*, so the broker does not hand the bridge back
what it exported. Delivery: MQTT messages are acknowledged (QoS 1, manual
acknowledgement) only once the federation accepted the events (at least
once); the import queue is bounded (the MQTT client waits: back-pressure),
and so are the exported messages in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import signal
import sys
import threading
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from geofed.client import Client, ClientConfig, Publication, Subscription, TLSConfig, connect
from geofed.errors import GeofedError, Unauthenticated, Unavailable
from geofed.routing import (
    DecimalLayout,
    Federation,
    Geofence,
    H3Layout,
    InvalidInput,
    LatLon,
    validate_filter,
)
from geofed.wire import location_from_text

from ._args import GEOFENCE_HELP, LOCATION_HELP, geofence_arg, location_arg
from ._client import _tls, _tls_arguments, _token
from ._cover import add_layout_arguments, layout_from

IMPORT_QUEUE = 1000
"""MQTT messages waiting to be published into the federation; beyond, the MQTT client waits."""
IMPORT_BATCH = 500
"""Most events one import round publishes (one `publish_many` per broker)."""
EXPORT_IN_FLIGHT = 1000
"""QoS 1 messages exported and not yet acknowledged by the MQTT broker; beyond, the export waits."""
IMPORT_DRAIN_S = 30.0
"""How long a stopping bridge waits for the import round in flight to be answered (and
acknowledged to the MQTT broker) before it cancels it."""
CONNECT_TIMEOUT_S = 30.0
"""How long the MQTT broker may take to accept the connection and the import subscriptions."""
RECONNECT_MIN_S, RECONNECT_MAX_S = 1, 10
"""Backoff between attempts to reach a lost MQTT broker (doubling)."""
LOCATION_PROPERTY = "geofed-location"
"""MQTT 5 user property with the exact ``LAT,LON`` (the MQTT front end's name, docs/mqtt.md)."""
READY = "bridging"
"""First word of the line printed (stderr) once both sides are subscribed."""


def register(sub: Any, name: str) -> None:
    """Add the ``bridge-topics`` subcommand."""
    p = sub.add_parser(
        name,
        help="bridge events to and from a topic-only MQTT broker, the location in the topic",
        description="Export: republish the federation's events (--export FILTER, optionally"
        " --export-geofence) to the MQTT broker on PREFIX/<location levels>/TOPIC; MQTT"
        " consumers subscribe with `geofed cover` filters. Import: events published on the"
        " MQTT broker under PREFIX (--import FILTER on the topic after the location levels)"
        " are published into the federation at the decoded location. Runs until"
        " interrupted (SIGINT, SIGTERM).",
    )
    p.add_argument("--mqtt", required=True, metavar="HOST:PORT", help="the MQTT broker")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--federation", help="federation file or bundled name (needed to import)")
    where.add_argument("--endpoint", help="host:port of any broker's client service (export only)")
    p.add_argument("--client", required=True, help="client id of the bridge (geofed and MQTT)")
    p.add_argument(
        "--location",
        help=f"export: the bridge's location, {LOCATION_HELP} (events with an event geofence"
        " reach it only from inside)",
    )
    p.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="FILTER",
        help="geofed topic filter to republish on the MQTT broker (repeatable)",
    )
    p.add_argument(
        "--export-geofence",
        help=f"export only events published in this geofence: {GEOFENCE_HELP}",
    )
    p.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="FILTER",
        help="topic filter (after the location levels) of MQTT events to publish into the"
        " federation (repeatable)",
    )
    p.add_argument("--qos", type=int, choices=[0, 1], default=1, help="MQTT quality of service")
    m = p.add_argument_group("the MQTT broker's login and TLS")
    m.add_argument("--mqtt-user", help="user name at the MQTT broker")
    m.add_argument(
        "--mqtt-password-file", metavar="FILE", help="file holding the MQTT broker password"
    )
    m.add_argument(
        "--mqtt-ca", metavar="FILE", help="PEM CA of the MQTT broker's certificate: TLS on"
    )
    m.add_argument("--mqtt-cert", metavar="FILE", help="PEM client certificate (with TLS)")
    m.add_argument("--mqtt-key", metavar="FILE", help="PEM key of --mqtt-cert")
    add_layout_arguments(p)
    _tls_arguments(p)
    p.set_defaults(func=_bridge)


def _endpoint(text: str, field: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(field, f"expected HOST:PORT, got {text!r}")
    return host, int(port)


@dataclass
class BridgeCounts:
    """What a bridge did (printed when it stops)."""

    exported: int = 0
    imported: int = 0
    skipped: int = 0  # exports of events the bridge itself imported (loop)
    rejected: list[str] = field(default_factory=list)  # first reasons, at most 20
    rejected_count: int = 0

    def reject(self, reason: str) -> None:
        self.rejected_count += 1
        if len(self.rejected) < 20:
            self.rejected.append(reason)
            print(f"geofed bridge-topics: skipped: {reason}", file=sys.stderr, flush=True)


class TopicBridge:
    """Export and import between a geofed federation and one MQTT broker (see the module)."""

    def __init__(
        self,
        *,
        mqtt: tuple[str, int],
        layout: DecimalLayout | H3Layout,
        client_id: str,
        federation: Federation | None,
        endpoint: str | None = None,
        location: LatLon | None = None,
        exports: Sequence[str] = (),
        export_geofence: Geofence | None = None,
        imports: Sequence[str] = (),
        qos: int = 1,
        tls: TLSConfig | None = None,
        token: str = "",
        mqtt_auth: tuple[str, str] | None = None,
        mqtt_tls: TLSConfig | None = None,
    ) -> None:
        for f in exports:
            validate_filter(f, "export")
        self.import_filters = [layout.any_location(validate_filter(f, "import")) for f in imports]
        if not exports and not imports:
            raise InvalidInput("export", "give at least one --export or --import filter")
        if exports and location is None:
            raise InvalidInput("location", "the export needs the bridge's location")
        if imports and federation is None:
            raise InvalidInput("federation", "the import needs the federation file")
        self.mqtt_address = mqtt
        self.mqtt_auth = mqtt_auth
        self.mqtt_tls = mqtt_tls
        self.layout = layout
        self.client_id = client_id
        self.federation = federation
        self.endpoint = endpoint
        self.location = location
        self.exports = list(exports)
        self.export_geofence = export_geofence
        self.qos = qos
        self.tls = tls
        self.token = token
        digest = hashlib.blake2b(client_id.encode(), digest_size=6).hexdigest()
        self.marker = f"bridge-{digest}-"
        """Prefix of the ids of the events this bridge imports."""
        self.counts = BridgeCounts()
        self._publishers: dict[str, Client] = {}
        self._queue: asyncio.Queue[Any] = asyncio.Queue(IMPORT_QUEUE)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._subscribed = threading.Event()
        self._closing = threading.Event()
        self._refused = ""  # the MQTT broker's reason when it refused the connection
        self._mqtt: Any = None
        self._Properties: Any = None
        self._PUBLISH: Any = None
        self._NO_CONN: Any = None
        self._round: asyncio.Future[None] | None = None  # the import round in flight
        self._acked = asyncio.Event()
        self._puback: set[int] = set()  # ids of acknowledged exports not yet out of the window

    # -- MQTT side (paho's network thread calls the callbacks) ---------------

    def _start_mqtt(self) -> None:
        try:
            import paho.mqtt.client as paho
            from paho.mqtt.enums import CallbackAPIVersion
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties
            from paho.mqtt.subscribeoptions import SubscribeOptions
        except ModuleNotFoundError:
            raise InvalidInput(
                "mqtt", "geofed bridge-topics needs paho-mqtt: pip install 'geofed[bridge]'"
            ) from None
        client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"{self.client_id}",
            protocol=paho.MQTTv5,
            manual_ack=True,
        )
        filters = [(f, SubscribeOptions(qos=self.qos, noLocal=True)) for f in self.import_filters]

        def on_connect(c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
            if reason.is_failure:
                self._refused = str(reason)
                self._subscribed.set()  # wakes `run`, which gives up
                return
            if filters:
                c.subscribe(filters)
            else:
                self._subscribed.set()

        def on_subscribe(_c: Any, _u: Any, _mid: Any, reasons: Any, _p: Any) -> None:
            if all(not r.is_failure for r in reasons):
                self._subscribed.set()

        def on_message(_c: Any, _u: Any, msg: Any) -> None:
            assert self._loop is not None
            # Blocks paho's thread while the queue is full: back-pressure, not loss
            # (unacknowledged, the message comes again if the bridge stops meanwhile).
            put = asyncio.run_coroutine_threadsafe(self._queue.put(msg), self._loop)
            while not self._closing.is_set():
                with contextlib.suppress(TimeoutError):
                    put.result(timeout=0.5)
                    return
            put.cancel()

        self._Properties, self._PUBLISH = Properties, PacketTypes.PUBLISH

        def acked(mid: int) -> None:
            self._puback.add(mid)
            self._acked.set()

        def on_publish(_c: Any, _u: Any, mid: int, _reason: Any, _p: Any) -> None:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(acked, mid)

        self._NO_CONN = paho.MQTT_ERR_NO_CONN
        client.on_publish = on_publish
        client.on_connect = on_connect
        client.on_subscribe = on_subscribe
        client.on_message = on_message
        client.max_inflight_messages_set(EXPORT_IN_FLIGHT)
        client.reconnect_delay_set(RECONNECT_MIN_S, RECONNECT_MAX_S)
        if self.mqtt_auth is not None:
            client.username_pw_set(*self.mqtt_auth)
        if self.mqtt_tls is not None:
            t = self.mqtt_tls
            try:
                client.tls_set(
                    ca_certs=t.ca_file or None,
                    certfile=t.cert_file or None,
                    keyfile=t.key_file or None,
                )
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                raise InvalidInput("mqtt-ca", f"unusable TLS files: {exc}") from None
        props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
        props.SessionExpiryInterval = 3600  # QoS 1 imports wait for a restarted bridge
        host, port = self.mqtt_address
        try:
            client.connect(host, port, keepalive=30, clean_start=False, properties=props)
        except OSError as exc:
            raise Unavailable(f"{host}:{port}", f"MQTT broker: {exc.strerror or exc}") from None
        client.loop_start()
        self._mqtt = client

    # -- geofed side ----------------------------------------------------------

    def _config(self, client_id: str, location: LatLon) -> ClientConfig:
        return ClientConfig(
            client_id=client_id,
            location=location,
            federation=self.federation if self.endpoint is None else None,
            endpoint=self.endpoint,
            tls=self.tls,
            token=self.token,
        )

    async def _publisher(self, broker: str, location: LatLon) -> Client:
        """The bridge's client at `broker` (one per broker: a publish must be at its own)."""
        client = self._publishers.get(broker)
        if client is None:
            client = await connect(self._config(f"{self.client_id}-in-{broker}", location))
            self._publishers[broker] = client
        return client

    async def _export(self, sub: Subscription) -> None:
        pending: deque[int] = deque()
        async for msg in sub:
            if msg.event_id.startswith(self.marker):
                self.counts.skipped += 1
                continue
            try:
                topic = self.layout.topic(msg.publisher, msg.topic)
            except InvalidInput as exc:
                self.counts.reject(f"event {msg.event_id}: {exc}")
                continue
            props = self._Properties(self._PUBLISH)
            where = msg.publisher
            props.UserProperty = [(LOCATION_PROPERTY, f"{where.lat!r},{where.lon!r}")]
            info = self._mqtt.publish(topic, msg.payload, qos=self.qos, properties=props)
            # QoS 1 while disconnected: queued by paho (rc "no connection"), sent on reconnect.
            if info.rc != 0 and not (self.qos and info.rc == self._NO_CONN):
                self.counts.reject(f"event {msg.event_id}: MQTT publish failed (rc {info.rc})")
                continue
            self.counts.exported += 1
            if self.qos:
                pending.append(info.mid)
                await self._window(pending)

    async def _window(self, pending: deque[int]) -> None:
        """Wait while `EXPORT_IN_FLIGHT` exports are unacknowledged (the oldest first).

        By message id, as PUBACKs report them: paho's `MQTTMessageInfo` of a
        message queued while disconnected reports a failure even once resent
        and acknowledged.
        """
        while True:
            while pending and pending[0] in self._puback:
                self._puback.discard(pending.popleft())
            if len(pending) < EXPORT_IN_FLIGHT:
                return
            self._acked.clear()
            if pending[0] not in self._puback:  # checked again after clear: no lost wake-up
                await self._acked.wait()

    async def _import(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < IMPORT_BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            # A task of its own, so that a stopping bridge can let it finish (`run`):
            # cancelled after its events were published and before the MQTT broker
            # was told, the messages would come again and be imported twice.
            self._round = asyncio.ensure_future(self._import_round(batch))
            await self._round

    async def _import_round(self, batch: list[Any]) -> None:
        """Publish one round of MQTT messages into the federation, then acknowledge them."""
        assert self.federation is not None
        groups: dict[str, list[Publication]] = {}
        where: dict[str, LatLon] = {}
        for msg in batch:
            try:
                location, topic = self._decode(msg)
            except InvalidInput as exc:
                self.counts.reject(f"MQTT topic {msg.topic!r}: {exc}")
                continue
            broker = self.federation.responsible(location)
            where.setdefault(broker, location)
            event_id = f"{self.marker}{uuid.uuid4().hex}"
            groups.setdefault(broker, []).append(
                Publication(topic, bytes(msg.payload), location, None, event_id)
            )
        await asyncio.gather(*(self._publish(b, where[b], pubs) for b, pubs in groups.items()))
        for msg in batch:
            if msg.qos:
                self._mqtt.ack(msg.mid, msg.qos)

    def _decode(self, msg: Any) -> tuple[LatLon, str]:
        """(publisher location, geofed topic) of an MQTT message on a layout topic.

        The location is the exact one of a ``geofed-location`` user property
        (MQTT 5) when it lies in the topic's cell, else the cell's centre.
        """
        location, topic = self.layout.decode(msg.topic, "mqtt.topic")
        props = getattr(msg, "properties", None)
        given = [v for k, v in getattr(props, "UserProperty", []) if k == LOCATION_PROPERTY]
        if given:
            exact = location_from_text(given[0], LOCATION_PROPERTY)
            if self.layout.location_levels(exact) != self.layout.location_levels(location):
                raise InvalidInput(LOCATION_PROPERTY, f"{given[0]} is not in the topic's cell")
            location = exact
        return location, topic

    async def _publish(self, broker: str, location: LatLon, pubs: list[Publication]) -> None:
        client = await self._publisher(broker, location)
        try:
            await client.publish_many(pubs)
        except Unavailable:
            raise
        except GeofedError:
            # One of them is refused (a policy, a topic too long): find which, keep the rest.
            for p in pubs:
                try:
                    await client.publish_many([p])
                except Unavailable:
                    raise
                except GeofedError as exc:
                    self.counts.reject(f"MQTT event on {p.topic!r}: {exc}")
                    continue
                self.counts.imported += 1
            return
        self.counts.imported += len(pubs)

    async def run(self, stop: asyncio.Event, ready: Callable[[], None] | None = None) -> None:
        """Bridge until `stop` is set (or a side fails for good); `ready` once subscribed."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self._start_mqtt)
        tasks: list[asyncio.Task[None]] = []
        exporter: Client | None = None
        try:
            host, port = self.mqtt_address
            if not await asyncio.to_thread(self._subscribed.wait, CONNECT_TIMEOUT_S):
                raise Unavailable(f"{host}:{port}", "MQTT broker: no CONNACK or SUBACK")
            if self._refused:
                raise Unauthenticated(f"the MQTT broker at {host}:{port} refused: {self._refused}")
            if self.exports:
                assert self.location is not None
                exporter = await connect(self._config(self.client_id, self.location))
                for f in self.exports:
                    sub = await exporter.subscribe(f, geofence=self.export_geofence)
                    tasks.append(asyncio.create_task(self._export(sub)))
            if self.import_filters:
                tasks.append(asyncio.create_task(self._import()))
            if ready is not None:
                ready()
            stopping = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopping:
                    t.result()  # a side failed: raise its error
        finally:
            if self._round is not None and not self._round.done():
                await asyncio.wait([self._round], timeout=IMPORT_DRAIN_S)
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, GeofedError):
                    await t
            for c in [*self._publishers.values(), *([exporter] if exporter else [])]:
                with contextlib.suppress(GeofedError):
                    await c.close()
            self._closing.set()
            self._mqtt.disconnect()
            await asyncio.to_thread(self._mqtt.loop_stop)


def _mqtt_auth(args: argparse.Namespace) -> tuple[str, str] | None:
    if args.mqtt_password_file and not args.mqtt_user:
        raise InvalidInput("mqtt-user", "a password needs its user name")
    if not args.mqtt_user:
        return None
    password = ""
    if args.mqtt_password_file:
        try:
            with open(args.mqtt_password_file, encoding="utf-8") as f:
                password = f.read().strip()
        except OSError as exc:
            raise InvalidInput(
                "mqtt-password-file", f"cannot read {args.mqtt_password_file}: {exc.strerror}"
            ) from None
    return args.mqtt_user, password


def _mqtt_tls(args: argparse.Namespace) -> TLSConfig | None:
    if not (args.mqtt_ca or args.mqtt_cert or args.mqtt_key):
        return None
    if not args.mqtt_ca:
        raise InvalidInput("mqtt-ca", "TLS towards the MQTT broker needs its CA")
    if bool(args.mqtt_cert) != bool(args.mqtt_key):
        raise InvalidInput("mqtt-key", "give both --mqtt-cert and --mqtt-key, or neither")
    cert, key = args.mqtt_cert or "", args.mqtt_key or ""
    return TLSConfig(ca_file=args.mqtt_ca, cert_file=cert, key_file=key)


def _bridge(args: argparse.Namespace) -> int:
    layout = layout_from(args)
    bridge = TopicBridge(
        mqtt=_endpoint(args.mqtt, "mqtt"),
        layout=layout,
        client_id=args.client,
        federation=Federation.load(args.federation) if args.federation else None,
        endpoint=args.endpoint,
        location=location_arg(args.location) if args.location else None,
        exports=args.export,
        export_geofence=geofence_arg(args.export_geofence, "export-geofence")
        if args.export_geofence
        else None,
        imports=args.imports,
        qos=args.qos,
        tls=_tls(args),
        token=_token(args),
        mqtt_auth=_mqtt_auth(args),
        mqtt_tls=_mqtt_tls(args),
    )

    started = False

    def ready() -> None:
        nonlocal started
        started = True
        parts = [f"export {', '.join(bridge.exports)}"] if bridge.exports else []
        parts += [f"import {', '.join(bridge.import_filters)}"] if bridge.import_filters else []
        host, port = bridge.mqtt_address
        print(f"{READY} {host}:{port}: {'; '.join(parts)}", file=sys.stderr, flush=True)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await bridge.run(stop, ready)

    try:
        asyncio.run(run())
    finally:
        if started:  # a bridge that never ran has nothing to report, only its error
            c = bridge.counts
            print(
                f"exported {c.exported}, imported {c.imported}, skipped {c.skipped} (own imports),"
                f" rejected {c.rejected_count}",
                file=sys.stderr,
                flush=True,
            )
    return 0
