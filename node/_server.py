"""The broker node: client and federation gRPC services around one `BrokerState`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import shapely
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from geofed.errors import Unavailable, details_for, error_json, status_for
from geofed.routing import (
    BrokerInfo,
    BrokerState,
    Delivery,
    DeliveryMsg,
    Event,
    EventMsg,
    FederatedController,
    Federation,
    FederationMismatch,
    FlushMsg,
    GeofedError,
    Geofence,
    GeofenceCache,
    HandoffMsg,
    HistoryQuery,
    HistoryRecord,
    InvalidInput,
    KeyWindow,
    Kind,
    LatLon,
    Moved,
    NotFound,
    PeerMessage,
    PermissionDenied,
    Phase,
    ProposeMsg,
    RelocateMsg,
    ReportMsg,
    Scheme,
    Send,
    SessionMsg,
    ShareMeter,
    StorageFailed,
    SubKey,
    SubscribeMsg,
    Subscription,
    TableMsg,
    TooLarge,
    UnsubscribeMsg,
    WrongBroker,
    great_circle_m,
    history_targets,
    merge_history,
    new_event_id,
    once_id,
    parse_scheme,
    require_h3,
    scheme_for_load,
    validate_id,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import federation_pb2_grpc as fpb_grpc
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    BATCH_METADATA,
    BROKER_METADATA,
    CLIENT_SERVICE,
    FEDERATION_SERVICE,
    PeerGeofenceCache,
    RejectedMessage,
    accepted_response,
    ack_response,
    delivery_batch,
    delivery_from_bytes,
    delivery_to_pb,
    event_from_pb,
    event_to_pb,
    hello_frame,
    history_query_from_pb,
    history_query_from_peer,
    history_record_from_pb,
    history_response,
    leave_response,
    location_from_pb,
    message_from_bytes,
    message_to_bytes,
    messages_from_frame,
    peer_history_request,
    peer_history_response,
    publish_batch_response,
    publish_refused,
    publish_response,
    publish_result,
    redirect_response,
    refuse_frame,
    rejection_reason,
    strategy_state_response,
    subscription_from_pb,
    table_from_pb,
    unsubscribe_response,
    wire_bytes,
)

from ._auth import Principal, Security, add_port
from ._budget import ByteBudget
from ._config import NodeConfig
from ._dedup import DedupWindow
from ._errors import Guarded, abort, rejected, streaming, unary
from ._heap import HeapFreezer
from ._history import HistoryAnswer, HistoryLog, open_backend
from ._links import PROTOCOL_VERSION, SERVER_OPTIONS, ContextTransport, PeerLink
from ._metrics import NodeMetrics
from ._store import Loaded, PendingInfo, Store, sqlite_memory_used
from ._tracefile import MessageTrace

log = logging.getLogger("geofed.node")

_END = object()
_DELIVERY_OVERHEAD = 128  # bytes counted per buffered delivery besides its payload
_BATCH_BYTES = 1 << 20  # a batch of deliveries stays below this (clients accept 4 MiB)
_REAP_EVERY_S = 1.0
_REPLAY_PAGE = 1024  # queued deliveries read back from the store at a time
_LOCAL = ""  # the duplicate window of local publishes, among the peers' windows in the store
_PUBLISH = "publish"
_NUMBERED_WAIT_S = 20.0  # a strategy change waits this long for its number without peer_timeout_s
_T = TypeVar("_T")
_HANDOFF_BYTES = 1 << 20  # a handoff message carries at most this many bytes of deliveries
_ARRIVED_IDS = 1 << 16  # event ids kept per transferred subscription to drop its handoff's repeats

Refill = Callable[[int], Awaitable[list[tuple[int, cpb.Delivery]]]]


class _Stream:
    """The bounded delivery queue of one Subscribe call.

    A plain subscription's queue drops the oldest delivery when it holds
    `cap` deliveries or `byte_cap` bytes. A persistent subscription's
    deliveries are all in the store: its queue holds a window of them and,
    when that is full (or the stream resumes after an offset), stops taking
    live ones and reads them back from the store in order (`refill`).

    Flow control (plain streams): a stream more than half full (`pressed`)
    makes local publishes wait for it to drain back to half (`drained`),
    for at most `subscriber_backpressure_ms`; one that did not drain in
    time is marked `slow` and is not waited for again until it has drained,
    so a stalled subscriber costs each publisher one bounded wait and then
    loses its oldest deliveries as before (bounded memory wins).
    """

    def __init__(
        self,
        cap: int,
        byte_cap: int,
        metrics: NodeMetrics,
        refill: Refill | None = None,
        budget: ByteBudget | None = None,
    ) -> None:
        self._items: deque[tuple[Any, int]] = deque()  # (delivery, bytes counted)
        self._bytes = 0
        self._budget = budget if budget is not None else ByteBudget(byte_cap)
        self._cap = cap
        self._byte_cap = byte_cap
        self._metrics = metrics
        self._ready = asyncio.Event()
        self._refill = refill
        self.behind: int | None = None  # read from the store after this offset
        self.session: _Session | None = None  # the session whose streams it counts
        self.end_status: tuple[grpc.StatusCode, str] | None = None
        self._drained = asyncio.Event()  # at most half full (or ended)
        self._drained.set()
        self.slow = False  # did not drain within a publisher's wait: not waited for again

    def push(self, item: cpb.Delivery) -> None:
        size = _DELIVERY_OVERHEAD + len(item.event.payload)
        if self._refill is not None:
            if self.behind is None and self._full(size):
                self.behind = item.offset - 1  # this one and what follows: from the store
            if self.behind is not None:
                self._ready.set()
                return
        else:
            while self._items and self._full(size):
                self._take()
                self._metrics.subscriber_dropped.inc()
            if self._full(size):  # the node's budget, held by other queues
                self._metrics.subscriber_dropped.inc()
                return
        self._put(item, size)
        self._ready.set()

    def _full(self, size: int) -> bool:
        return (
            len(self._items) >= self._cap
            or self._bytes + size > self._byte_cap
            or not self._budget.fits(size)
        )

    def _put(self, item: Any, size: int) -> None:
        self._items.append((item, size))
        self._bytes += size
        self._budget.add(size)
        if self._refill is None and self._drained.is_set() and self._over_half():
            self._drained.clear()

    def _take(self) -> Any:
        item, size = self._items.popleft()
        self._bytes -= size
        self._budget.add(-size)
        if not self._drained.is_set() and not self._over_half():
            self._drained.set()
            self.slow = False
        return item

    def _over_half(self) -> bool:
        return 2 * len(self._items) > self._cap or 2 * self._bytes > self._byte_cap

    @property
    def pressed(self) -> bool:
        """More than half full and not known to be stalled: publishers should wait."""
        return not self._drained.is_set() and not self.slow

    async def drained(self) -> None:
        """Wait until the stream is at most half full (or ended)."""
        await self._drained.wait()

    def take_ready(self, max_items: int, max_bytes: int) -> list[Any]:
        """Deliveries queued behind the one just taken, without waiting (for one batch).

        Stops before the end marker (the next `get` returns it) and before
        `max_items` deliveries or `max_bytes` counted bytes.
        """
        out: list[Any] = []
        items = self._items
        while items and len(out) < max_items:
            item, size = items[0]
            if item is _END or size > max_bytes:
                break
            max_bytes -= size
            out.append(self._take())
        return out

    def __len__(self) -> int:
        return len(self._items)

    def release(self) -> None:
        """The stream ended: what it still held leaves the node's budget."""
        self._budget.add(-self._bytes)
        self._items.clear()
        self._bytes = 0
        self._drained.set()

    def close(self, status: tuple[grpc.StatusCode, str] | None = None) -> None:
        self.end_status = status
        self._items.append((_END, 0))
        self._ready.set()
        self._drained.set()  # nobody reads it any more: publishers must not wait

    async def get(self) -> Any:
        while not self._items:
            if self.behind is not None and self._refill is not None:
                rows = await self._refill(self.behind)
                if not rows:
                    # Committed later means pushed later (the store reads and
                    # commits in order): live deliveries are complete again.
                    self.behind = None
                    continue
                for _, item in rows:
                    self._put(item, _DELIVERY_OVERHEAD + len(item.event.payload))
                self.behind = rows[-1][0]
                continue
            self._ready.clear()
            await self._ready.wait()
        return self._take()


@dataclass
class _Session:
    """A client session's persistence and liveness."""

    expiry_s: float  # > 0: persistent
    owner: str = ""  # the identity that opened it (with client authentication)
    streams: int = 0  # open Subscribe calls
    idle_since: float = field(default_factory=time.monotonic)  # since when it has none


@dataclass
class _Held:
    """A handover held open (make before break): where the client went, the timer
    that withdraws its subscriptions if it does not leave first, and, once it left,
    the task that withdraws them after the peers' flushes."""

    where: LatLon
    timer: asyncio.TimerHandle
    leaving: asyncio.Task[None] | None = None


@dataclass(frozen=True)
class Opened:
    """What a client's connect got: a session (persistent or not) or a redirect."""

    redirect: BrokerInfo | None = None
    present: bool = False  # a persistent session was there already
    expiry_s: float = 0.0  # the expiry granted (> 0: persistent)


@dataclass
class _Staged:
    """What a publish or a peer frame causes, applied once the store holds it."""

    sends: list[tuple[Send, int]] = field(default_factory=list)  # (message, outbox id)
    pushes: list[tuple[_Stream, cpb.Delivery]] = field(default_factory=list)
    delivered: int = 0
    seen: list[tuple[str, Kind, str]] = field(default_factory=list)  # (peer, kind, event id)
    received: list[Kind] = field(default_factory=list)


class BrokerServer(Guarded):
    """The broker process: gRPC services and peer links around one `BrokerState`.

    Serves clients and peers, keeps a `PeerLink` per other broker of the
    federation file (whose entries are `BrokerInfo`s), exports metrics and
    writes the node message trace. Use ``async with BrokerServer(config): ...``
    or `start` / `stop`.
    """

    def __init__(self, config: NodeConfig, registry: CollectorRegistry = REGISTRY) -> None:
        self.config = config
        self.broker_id = config.broker_id
        self.federation = Federation.load(config.federation)
        me = self.federation.broker(config.broker_id)
        self.core = BrokerState(me.id, self.federation, config.initial_table())
        self.metrics = NodeMetrics(registry)
        self._init_filter_scheme(config)
        # The adaptive controller (docs/design.md §13): every broker measures its
        # share of each window; the sequencer sums the shares and decides.
        self.controller: FederatedController | None = None
        self._adaptive: asyncio.Task[None] | None = None
        if config.adaptive == "on":
            self.core.meter = ShareMeter(config.adaptive_settings())
            if me.id == self.core.sequencer:
                self.controller = FederatedController(self.federation, self.core.meter.config)
        self.budget = ByteBudget(config.node_queue_bytes, self.metrics.queued_bytes)
        self._heap = HeapFreezer()  # subscriptions out of the collector's full passes
        self.security = Security(config, self.metrics)
        self.geofences = GeofenceCache(
            config.max_geofence_vertices, max_bytes=config.max_geofence_bytes
        )
        self.peer_geofences = PeerGeofenceCache()  # as the origin validated them: no limits
        self.epoch = time.time_ns()
        self._adaptive_digest = config.adaptive_digest()  # what the hello says and checks
        self._wan = _wan_matrix(config, self.federation)
        self.store = Store(
            config.data_dir,
            config.store_sync,
            {
                "broker_id": me.id,
                "strategy": config.strategy,
                "federation_digest": self.federation.digest,
            },
            config.store_max_bytes,
            config.store_cache_kib,
        )
        self.durable = self.store.durable
        if sqlite_memory_used() is not None:  # read at each scrape
            self.metrics.sqlite_memory.set_function(lambda: sqlite_memory_used() or 0)
        self.history: HistoryLog | None = None
        if config.history == "on":
            self.history = HistoryLog(
                open_backend(me.id, config.data_dir, config.history_dsn, config.store_sync),
                config.history_retention_s,
                config.history_max_bytes,
                on_change=self._history_changed,
                on_removed=lambda reason, n: self.metrics.history_removed.labels(reason=reason).inc(
                    n
                ),
                on_dropped=self.metrics.history_dropped.inc,
            )
        self._history_channels: dict[str, grpc.aio.Channel] = {}
        self.links = {b.id: PeerLink(self, b) for b in self.federation if b.id != me.id}
        self._streams: dict[SubKey, _Stream] = {}
        # Open PublishEach calls: the task serving each, and whether it is
        # publishing a request now (shutdown cancels only the ones waiting for one).
        self.publish_calls: dict[asyncio.Task[Any], bool] = {}
        self._sessions: dict[str, _Session] = {}
        self._held: dict[str, _Held] = {}  # clients that moved away, not yet withdrawn
        self._moving: dict[str, asyncio.Event] = {}  # clients whose queues are being handed off
        self._background: set[asyncio.Task[None]] = set()  # expired holds, transferred sessions
        # Subscriptions that came with a transferred session: the events the client
        # gets from here since (queued here), oldest first, until the old broker's
        # handoff has come (`_take_handoff`) and for a transfer onwards (`_arrived_ids`),
        # or the subscription ends here (`forget_queue`).
        self._arrived: dict[SubKey, dict[str, None]] = {}
        # Subscriptions whose session came from another broker: the events the client
        # gets from there (`SessionMsg.queued`), not matched for it here again.
        self._theirs: dict[SubKey, set[str]] = {}
        self._flush_token = 0
        self._flushes: dict[tuple[str, int], asyncio.Future[None]] = {}  # (peer, token)
        self.pending: dict[SubKey, PendingInfo] = {}  # persistent subscriptions' queues
        self._published = DedupWindow(config.dedup_window)  # recent local event ids
        self._next_oid = 1
        self._next_seen = 1
        self._reaper: asyncio.Task[None] | None = None
        self.trace = (
            MessageTrace(config.trace_path, me.id, config.strategy) if config.trace_path else None
        )
        self.health = health.aio.HealthServicer()
        self._client_server: grpc.aio.Server | None = None
        self._peer_server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        self._metrics_server: Any = None
        self.client_port = 0
        self.peer_port = 0
        self.metrics_port = 0
        self.mqtt: Any = None  # the MqttListener, with mqtt_listen or mqtt_ws_listen
        self.mqtt_port = 0
        self.mqtt_ws_port = 0
        self.http: Any = None  # the HttpBridge, with http_listen
        self.http_port = 0
        self._started = False
        self._table_news = asyncio.Event()  # set (and replaced) when a table or a link changes
        self._stopped = False
        self._ready = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Bind the ports, start serving and dial the peers."""
        if self._started:
            return
        self._started = True
        # Sessions stored outside the area: by a held handover, or an area that changed.
        away = self._restore(self.store.open())
        if not self.config.handover_hold_s:  # no holds: those moves end here
            for client, where in away:
                log.info("session of %s: its location lies outside this area; closed", client)
                await self._end_move(client, where)
            away = []
        if self.history is not None:
            self.history.open()
            self.history.start_sweeping()
        # Batches carry many events: the per-event payload limit is enforced
        # by the servicer (RESOURCE_EXHAUSTED naming the event), not here.
        keepalive_ms = int(self.config.client_keepalive_s * 1000)
        client_options = SERVER_OPTIONS + (
            [
                # A frozen or vanished subscriber does not answer: its streams end.
                ("grpc.keepalive_time_ms", keepalive_ms),
                ("grpc.keepalive_timeout_ms", keepalive_ms),
                # Without it gRPC waits its default minute for the ping's answer.
                ("grpc.http2.ping_timeout_ms", keepalive_ms),
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.keepalive_permit_without_calls", 1),
            ]
            if keepalive_ms
            else []
        )
        self._client_server = grpc.aio.server(options=client_options)
        _add_service(self._client_server, cpb, _ClientServicer(self), _lenient)
        self._peer_server = grpc.aio.server(
            options=SERVER_OPTIONS, interceptors=self.security.peer_interceptors()
        )
        # Registered with `wire_bytes` as Link's serializer: the links write
        # `EncodedFrame`s, whose deliveries stay encoded.
        _add_service(self._peer_server, fpb, _FederationServicer(self), _strict)
        for server, service in (
            (self._client_server, CLIENT_SERVICE),
            (self._peer_server, FEDERATION_SERVICE),
        ):
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            if self.config.reflection == "on":
                reflection.enable_server_reflection(
                    (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
                )
        bind = self.security.bind
        self.client_port = bind(self._client_server, self.config.client_listen, "client_listen")
        self.peer_port = await self.security.bind_peers(self._peer_server, self.config.peer_listen)
        if self.config.health_listen:
            # Health only, plaintext: probes that cannot present a certificate.
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
            self.health_port = add_port(
                self._health_server, self.config.health_listen, "health_listen"
            )
        host, _, port = self.config.metrics_listen.rpartition(":")
        try:
            self._metrics_server, _ = start_http_server(
                int(port), host, registry=self.metrics.registry
            )
        except OSError as exc:
            raise InvalidInput(
                "metrics_listen", f"cannot listen on {self.config.metrics_listen}: {exc.strerror}"
            ) from None
        self.metrics_port = self._metrics_server.server_port
        if self.config.mqtt_listen or self.config.mqtt_ws_listen:
            from ._mqtt import MqttListener  # the module imports this one

            self.mqtt = MqttListener(self)
            if self.config.mqtt_listen:
                self.mqtt_port = await self.mqtt.start(self.config.mqtt_listen)
            if self.config.mqtt_ws_listen:
                self.mqtt_ws_port = await self.mqtt.start_websocket(self.config.mqtt_ws_listen)
        if self.config.http_listen:
            from ._http import HttpBridge  # aiohttp is imported only when the bridge runs

            self.http = HttpBridge(self)
            self.http_port = await self.http.start(self.config.http_listen)
        await self._client_server.start()
        await self._peer_server.start()
        if self._health_server is not None:
            await self._health_server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(CLIENT_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.link_state_changed()
        for link in self.links.values():
            link.start()
        for client, where in away:
            # Held again, so that the client's Leave, its return or the hold running
            # out ends the move as it would have without the restart (the last sends
            # the session ahead).
            log.info("session of %s: its location lies outside this area; held", client)
            self._hold(client, where)
        self._reaper = asyncio.create_task(self._reap_sessions(), name="session-reaper")
        if self.core.meter is not None:
            self._adaptive = asyncio.create_task(self._adapt(), name="adaptive-controller")
        log.info(
            "broker %s serving: clients :%d, peers :%d, metrics :%d, mqtt %s, mqtt-ws %s,"
            " http %s, strategy %s, %d peers",
            self.broker_id,
            self.client_port,
            self.peer_port,
            self.metrics_port,
            f":{self.mqtt_port}" if self.mqtt_port else "off",
            f":{self.mqtt_ws_port}" if self.mqtt_ws_port else "off",
            f":{self.http_port}" if self.http is not None else "off",
            self.config.strategy,
            len(self.links),
        )

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown (idempotent): NOT_SERVING, drain, close."""
        if self._stopped or not self._started:
            self._stopped = True
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        if self.mqtt is not None:
            await self.mqtt.stop()
        if self.http is not None:
            await self.http.stop()
        for stream in list(self._streams.values()):
            stream.close((grpc.StatusCode.UNAVAILABLE, "broker shutting down"))
        for call, busy in self.publish_calls.items():
            if not busy:
                call.cancel()  # the rest end after their request (`PublishEach`)
        await asyncio.gather(*(link.drain(grace) for link in self.links.values()))
        await asyncio.gather(*(link.stop() for link in self.links.values()))
        for task in (self._reaper, self._adaptive):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for server in (self._client_server, self._peer_server, self._health_server):
            if server is not None:
                await server.stop(grace)
        await self.security.close()  # the peer port's TLS front, after gRPC said goodbye
        await self.store.close()
        if self.history is not None:
            await self.history.close()
        for channel in self._history_channels.values():
            await channel.close(grace=None)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.trace is not None:
            self.trace.close()
        log.info("broker %s stopped", self.broker_id)

    async def __aenter__(self) -> BrokerServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_closed(self) -> None:
        """Block until the client server terminates."""
        if self._client_server is not None:
            await self._client_server.wait_for_termination()

    def link_state_changed(self) -> None:
        """Federation readiness: SERVING while every peer link is up."""
        up = all(link.connected for link in self.links.values())
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if up
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if not self._stopped and self._started:
            asyncio.get_running_loop().create_task(self.health.set(FEDERATION_SERVICE, status))
        self._announce_tables()  # a strategy change waiting on a link that broke
        for (peer, _), waiter in self._flushes.items():
            if not self.links[peer].connected and not waiter.done():
                waiter.set_result(None)  # no reply comes over a broken link

    # -- federation protocol -----------------------------------------------

    def dial(self, peer: BrokerInfo) -> grpc.aio.Channel:
        """A channel to `peer`'s federation port (mutual TLS when configured)."""
        return self.security.dial(peer)

    def hello(self) -> fpb.Frame:
        """Our side of the link handshake."""
        return hello_frame(
            self.broker_id,
            self.config.strategy,
            self.federation.digest,
            PROTOCOL_VERSION,
            self.epoch,
            # Every broker has finished the transition to it (docs/design.md §6).
            self.core.placing[0],
            self._adaptive_digest,
        )

    def check_hello(self, hello: fpb.Hello, expect: str | None = None) -> str:
        """Why a peer's hello is refused ("" if accepted)."""
        if hello.broker_id not in self.links:
            return f"unknown broker id {hello.broker_id!r} (not a peer in this federation file)"
        if expect is not None and hello.broker_id != expect:
            return f"expected broker {expect!r}, {hello.broker_id!r} answered"
        if hello.protocol_version != PROTOCOL_VERSION:
            return (
                f"protocol version {hello.protocol_version}, this broker speaks {PROTOCOL_VERSION}"
            )
        if hello.strategy != self.config.strategy:
            return (
                f"strategy mismatch: broker {hello.broker_id} runs {hello.strategy!r}, "
                f"broker {self.broker_id} runs {self.config.strategy!r}"
            )
        adaptive = hello.adaptive or "off"  # empty: a sender older than the field
        if adaptive != self._adaptive_digest:
            return (
                f"adaptive mismatch: broker {hello.broker_id} runs adaptive {adaptive!r},"
                f" broker {self.broker_id} runs {self._adaptive_digest!r}"
            )
        if hello.federation_digest != self.federation.digest:
            return (
                f"federation mismatch: broker {hello.broker_id} has federation digest "
                f"{hello.federation_digest[:12]}, broker {self.broker_id} has "
                f"{self.federation.digest[:12]}"
            )
        self.core.forget_progress(hello.broker_id)  # restated behind its snapshot
        if not hello.HasField("finished_table"):
            return ""  # a peer that tells no table (a test double) starts from ours
        try:
            theirs = table_from_pb(hello.finished_table, "hello.finished_table")
        except InvalidInput as exc:
            return str(exc)
        mine = self.config.initial_table()
        if theirs.epoch == 0 and not theirs.same_routes(mine):
            return (
                f"strategy table mismatch: broker {hello.broker_id} starts from "
                f"{theirs.to_dict()['entries']}, broker {self.broker_id} from "
                f"{mine.to_dict()['entries']}"
            )
        if theirs.epoch > self.core.newest_table.epoch:
            # Every broker finished it, this one excepted: it lost its table
            # (restarted without a data dir). Taken before the snapshot is sent.
            log.warning(
                "strategy table epoch %d learned from %s (this broker was at %d)",
                theirs.epoch,
                hello.broker_id,
                self.core.newest_table.epoch,
            )
            self._transition(self.core.adopt(theirs))
        return ""

    def tables_for(self, peer: str) -> list[PeerMessage]:
        """Where this broker's transitions stand, for a peer after a (re)connect.

        Nothing at the start (epoch 0, none under way): the peer assumes it.
        """
        if self.core.progress == (0, Phase.SWITCHED) and not self.core.in_transition:
            return []
        return list(self.core.table_messages())

    def _transition(self, sends: list[Send]) -> None:
        """Hand a transition step's messages to the links and keep its state (§3)."""
        self.dispatch(sends)
        if self.durable:
            self.store.put_strategy_state(json.dumps(self.core.transition_state()))
        epoch, phase = self.core.progress
        self.metrics.strategy_epoch.set(epoch)
        self.metrics.strategy_phase.set(int(phase) if len(self.core.placing) > 1 else 0)
        self._announce_tables()

    def _announce_tables(self) -> None:
        """Wake what waits for a table to be numbered (`_numbered`)."""
        self._table_news.set()
        self._table_news = asyncio.Event()

    async def set_strategy(
        self,
        who: Principal,
        topic_filter: str,
        strategy: str | None,
        wait_s: float | None = None,
    ) -> None:
        """Propose a change of the strategy table; return once the sequencer numbered it (§3).

        Args:
            wait_s: how long to wait for the sequencer's table with the change
                (default and at most ``peer_timeout_s``).

        Raises:
            PermissionDenied: client authentication is on and `who` is not in
                `strategy_admins`.
            InvalidInput: naming ``topic_filter`` or ``strategy``.
            Unavailable: the change cannot be numbered now (a link it needs is
                down), or was not numbered in time (the link to the sequencer
                broke while the proposal was on it, or the sequencer refused
                it): asking again is safe, a change already made makes no epoch.
        """
        if self.config.client_auth != "none":
            admins = self.config.strategy_admin_names()
            if not admins & {who.identity, *who.groups}:
                self.metrics.auth_refused.labels(reason="strategy").inc()
                raise PermissionDenied(
                    "strategy", f"{who.identity or 'anonymous'} is not in strategy_admins"
                )
        self.core.newest_table.with_entry(topic_filter, strategy)  # validates here
        self._check_links()
        link = self.links.get(self.core.sequencer)
        sessions = 0 if link is None else link.sessions
        self._transition(self.core.propose(topic_filter, strategy))
        if self.store.dirty:
            await self.store.commit()
        if link is not None:
            limit = self.config.peer_timeout_s or _NUMBERED_WAIT_S
            await self._numbered(
                topic_filter, strategy, link, sessions, min(limit, wait_s or limit)
            )

    async def _numbered(
        self,
        topic_filter: str,
        strategy: str | None,
        link: PeerLink,
        sessions: int,
        wait_s: float,
    ) -> None:
        """Wait until the newest table known here routes `topic_filter` by `strategy`.

        A proposal travels as link state, which the next session does not
        resend (the snapshot and the table state repair everything else):
        one on a link that broke is lost, so the caller hears of it.

        Raises:
            Unavailable: the link to the sequencer broke (or came back) first,
                or `wait_s` passed.
        """
        deadline = asyncio.get_running_loop().time() + wait_s
        seq = self.core.sequencer
        while True:
            newest = self.core.newest_table
            if newest.with_entry(topic_filter, strategy).same_entries(newest):
                return
            if not link.connected or link.sessions != sessions:
                raise Unavailable(
                    self.broker_id,
                    f"the link to the sequencer {seq} broke with the strategy change on it; "
                    "ask again",
                )
            news = self._table_news
            try:
                await asyncio.wait_for(news.wait(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                raise Unavailable(
                    self.broker_id,
                    f"the sequencer {seq} did not number the strategy change within "
                    f"{wait_s:g}s (a link of its down?); ask again",
                ) from None

    async def _adapt(self) -> None:
        """The adaptive controller's windows (docs/design.md §13).

        Windows end at multiples of `window_s` on the wall clock, so the brokers
        close theirs together; each sends its share to the sequencer, which
        decides half a window later, once the shares have arrived (one that
        arrives later counts in the next window: every action is counted once),
        and then tells every broker the keys it decides on (a report of keys alone).
        """
        meter = self.core.meter
        assert meter is not None
        width = meter.config.window_s
        while True:
            window = int(time.time() // width) + 1
            await asyncio.sleep(max(0.0, window * width - time.time()))
            try:
                shares = meter.close(self.core)
                self.metrics.adaptive_windows.inc()
                self.metrics.adaptive_keys.set(len(meter.keys))
                if self.controller is None:
                    link = self.links[self.core.sequencer]
                    if link.connected:  # a lost report only leaves a window short
                        link.enqueue(ReportMsg(window, tuple(shares)))
                    continue
                self.controller.add(self.broker_id, shares)
                await asyncio.sleep(max(0.0, (window + 0.5) * width - time.time()))
                await self._adaptive_decide(time.time())
                # Every broker measures the keys decided on, so that a subscription
                # filter spanning keys counts under each of them everywhere.
                keys = tuple(KeyWindow(k, s) for k, s in sorted(self.controller.keys.items()))
                meter.track(k.key for k in keys)
                for link in self.links.values():
                    if link.connected:
                        link.enqueue(ReportMsg(window, keys))
            except Exception:  # a bug: keep the trace and the controller running
                log.exception("adaptive controller window failed")

    async def _adaptive_decide(self, now: float) -> None:
        """At the sequencer: decide on the summed window, propose the switches."""
        ctl = self.controller
        assert ctl is not None
        may_switch = not self.core.in_transition and all(
            link.connected for link in self.links.values()
        )
        reports, switches = ctl.close_window(self.core.newest_table, now, may_switch=may_switch)
        self.metrics.adaptive_deferred.inc(len(ctl.deferred))
        totals: Counter[str] = Counter()
        for r in reports:
            totals.update(r.predicted)
            totals["current"] += r.predicted.get(r.strategy, 0)
        for name, n in totals.items():
            self.metrics.adaptive_predicted.labels(strategy=name).set(n)
        for switch in switches:
            log.info(
                "adaptive controller: %s from %s to %s (saves %d messages over the horizon,"
                " the transition's %d deducted)",
                switch.key,
                switch.old,
                switch.new,
                switch.saving,
                switch.transition_cost,
            )
            self._transition(self.core.propose(switch.key, switch.new, adaptive=True))
            self.metrics.adaptive_switches.labels(strategy=switch.new).inc()
            self.metrics.adaptive_saving.inc(switch.saving)
        if self.store.dirty:
            await self.store.commit()

    def _check_links(self) -> None:
        """A change is asked for, and numbered, only with every link of this broker up.

        The sequencer then knows the newest table (one restarted without a
        data dir learns it from its peers' hellos first), the proposer's
        message to it is not lost on a link that is down, and a broker that
        is down — which would hold the transition up — makes the request fail
        at once instead (docs/design.md §3).
        """
        down = sorted(p for p, link in self.links.items() if not link.connected)
        if down:
            raise Unavailable(
                self.broker_id,
                f"a strategy change needs every broker: link to {', '.join(down)} down",
            )

    def strategy_state(self) -> cpb.StrategyState:
        """This broker's table, the newest it knows and whether a transition is under way."""
        return strategy_state_response(
            self.broker_id,
            self.core.table,
            self.core.newest_table,
            self.core.in_transition,
            self.core.sequencer,
        )

    def dispatch(self, sends: Iterable[Send]) -> None:
        """Hand messages that need no outbox (subscription changes) to their links."""
        for send in sends:
            self.links[send.dst].enqueue(send.msg)

    def count_sent(self, peer: str, msgs: list[PeerMessage], sizes: list[int]) -> None:
        """Metrics and trace for messages written to a peer."""
        m = self.metrics
        # Summed per kind first: a labelled counter's look-up and increment
        # take a lock each, and a frame holds hundreds of messages.
        count: Counter[str] = Counter()
        total: Counter[str] = Counter()
        for msg, size in zip(msgs, sizes, strict=True):
            kind = msg.kind.value
            count[kind] += 1
            total[kind] += size
            if self.trace is not None:
                ids, topic = _trace_fields(msg)
                self.trace.record(peer, kind, ids, topic, size)
        for kind, n in count.items():
            m.peer_sent.labels(peer=peer, kind=kind).inc(n)
            m.peer_bytes.labels(peer=peer, kind=kind).inc(total[kind])

    def count_control(self, peer: str) -> None:
        """Metrics (and trace) for a control-only frame."""
        self.metrics.peer_sent.labels(peer=peer, kind=Kind.CONTROL.value).inc()
        if self.trace is not None:
            self.trace.record(peer, Kind.CONTROL.value, [], None, 0)

    def snapshot_for(self, peer: str) -> list[SubscribeMsg]:
        """The subscriptions `peer` needs from this broker."""
        return self.core.snapshot_for(peer)

    def apply_snapshot(self, peer: str, subs: list[SubscribeMsg], *, replace: bool) -> None:
        """Replace (or, for a continued snapshot, extend) the subscriptions held from `peer`.

        A subscription that cannot be applied is skipped and counted; the others are.
        """
        if replace:
            self.core.replace_remote(peer, [])
            if self.durable:
                self.store.clear_remote(peer)
        applied = 0
        for msg in subs:
            try:
                self._apply_subscription_change(peer, msg)
            except Exception as exc:
                self._reject(peer, msg.kind, msg.sub.id, exc)
            else:
                applied += 1
        if applied:
            self.metrics.peer_received.labels(peer=peer, kind=Kind.SUBSCRIBE.value).inc(applied)
        self._update_sub_gauges()

    def _apply_subscription_change(self, peer: str, msg: PeerMessage) -> None:
        self.core.on_message(peer, msg)
        if not self.durable:
            return
        if isinstance(msg, RelocateMsg):
            # Kept as the copy now placed (a relocation of no copy held changed nothing).
            held = self.core.remote_copy(msg.key, msg.home)
            if held is None:
                return
            msg = SubscribeMsg(held, msg.home)
        if isinstance(msg, SubscribeMsg):
            self.store.put_remote(
                _stored(msg.sub.key), msg.home, message_to_bytes(msg, self.broker_id)
            )
        elif isinstance(msg, UnsubscribeMsg):
            self.store.delete_remote(_stored(msg.key), msg.home)

    async def receive_frame(self, peer: str, frame: fpb.Frame) -> None:
        """Apply the messages of a frame from `peer`, in order; return once they are durable.

        A message that cannot be converted or applied is skipped, counted in
        `geofed_peer_messages_rejected_total` and logged; it costs neither the
        rest of the frame nor the link.

        Raises:
            StorageFailed: the store did not keep the frame's effects: none of
                its events or deliveries was handed over, and the frame must not
                be acknowledged (the peer sends it again).
        """
        rejected: list[RejectedMessage] = []
        msgs = messages_from_frame(frame, self.peer_geofences, rejected)
        for r in rejected:
            self.metrics.reject_peer_message(peer, r.kind.value, r.id, r.reason)
        if not msgs:
            if not rejected and not frame.HasField("snapshot"):
                self.metrics.peer_received.labels(peer=peer, kind=Kind.CONTROL.value).inc()
            return
        link = self.links[peer]
        staged = _Staged()
        in_frame: set[tuple[Kind, str]] = set()
        flushes: list[FlushMsg] = []
        sessions: list[SessionMsg] = []
        changed = False
        for msg in msgs:
            try:
                if (once := once_id(msg)) is not None:
                    key = (msg.kind, once)
                    if link.window.seen(*key) or key in in_frame:
                        self.metrics.peer_duplicates.labels(peer=peer).inc()
                        staged.received.append(msg.kind)
                        continue
                    if isinstance(msg, HandoffMsg):
                        self._take_handoff(peer, msg, staged)
                    else:
                        with self.metrics.match_seconds.time():
                            out = self.core.on_message(peer, msg)
                        self._stage_deliveries(out.deliveries, peer, staged)
                    in_frame.add(key)
                    staged.seen.append((peer, *key))
                elif isinstance(msg, TableMsg | ProposeMsg):
                    if isinstance(msg, ProposeMsg):
                        self._check_links()
                    self._transition(self.core.on_message(peer, msg).sends)
                elif isinstance(msg, FlushMsg):
                    flushes.append(msg)
                elif isinstance(msg, SessionMsg):
                    sessions.append(msg)
                elif isinstance(msg, ReportMsg):
                    if self.controller is not None:  # a broker's share
                        self.controller.add(peer, msg.shares)
                    elif self.core.meter is not None and peer == self.core.sequencer:
                        # The keys the sequencer decides on: measured here too (§13).
                        self.core.meter.track(w.key for w in msg.shares)
                else:
                    changed = True
                    self._apply_subscription_change(peer, msg)
            except Exception as exc:
                self._reject(peer, msg.kind, _trace_fields(msg)[0][0], exc)
                continue
            # Counted once applied and committed: a scrape (another thread) that
            # sees it received sees its effects too (the quiescence barrier).
            staged.received.append(msg.kind)
        if changed:
            self._update_sub_gauges()
        self.metrics.sync_filter(self.core.last_mile)
        await self._commit(staged)
        for kind in staged.received:
            self.metrics.peer_received.labels(peer=peer, kind=kind.value).inc()
        # After the frame's deliveries went to their streams: a reply means
        # everything the peer sent before it is in place here.
        for flush in flushes:
            if not flush.reply:
                link.enqueue_behind(FlushMsg(flush.token, True))
            elif (waiter := self._flushes.get((peer, flush.token))) is not None:
                if not waiter.done():
                    waiter.set_result(None)
        for transfer in sessions:
            # In a task: its reply waits for the peers' acknowledgements, which
            # this link's reader (here) must go on reading.
            self._spawn(self._take_session(peer, transfer), f"session-{transfer.client}")

    def _reject(self, peer: str, kind: Kind, msg_id: str, exc: Exception) -> None:
        """A message from `peer` that could not be applied (its frame goes on)."""
        if not isinstance(exc, GeofedError):  # a bug rather than bad content: keep the trace
            log.error("applying a %s from %s failed", kind.value, peer, exc_info=exc)
        self.metrics.reject_peer_message(peer, kind.value, msg_id, rejection_reason(exc))

    def wan_delay_s(self, peer: str) -> float:
        """Emulated one-way delay of messages to `peer` (0 when off)."""
        return self._wan.get(peer, 0.0)

    # -- staging: what must be durable before it takes effect ----------------

    async def publish(self, events: list[Event]) -> None:
        """Match and route events published here; return once they are durable.

        An event id this broker already published is skipped (a client's retry).
        A batch is published in parts (`_parts`) that cannot overflow a stream
        that flow control left at most half full, each part waiting for the
        streams it filled past half, so one large batch is held back by a slow
        subscriber as a series of small ones would be.

        Raises:
            StorageFailed: the store did not keep a part: neither it nor any
                later part was published (the parts before it were, and a
                retry of the whole batch with the same ids skips them).
        """
        for part in self._parts(events):
            await self._publish_part(part)

    def _parts(self, events: list[Event]) -> Iterator[list[Event]]:
        """`events` in order, in parts of at most half a subscriber stream's size
        (count and bytes, as the stream counts a delivery; at least one event)."""
        cfg = self.config
        return _batches(
            events,
            lambda event: _DELIVERY_OVERHEAD + len(event.payload),
            cfg.subscriber_queue_bytes // 2,
            most=max(1, cfg.subscriber_queue_size // 2),
        )

    async def _publish_part(self, events: list[Event]) -> None:
        staged = _Staged()
        fresh: list[Event] = []
        logged: list[HistoryRecord] = []
        try:
            for event in events:
                if not self._remember(_LOCAL, Kind.EVENT, event.id):
                    self.metrics.publish_duplicates.inc()
                    continue
                fresh.append(event)
                if self.history is not None:
                    logged.append(
                        HistoryRecord(
                            event.id,
                            event.topic,
                            event.payload,
                            event.t,
                            self.broker_id,
                            event.location,
                            event.geofence,
                        )
                    )
            if fresh:
                # Matched as one batch (the index tests its geometry in one go):
                # the histogram gets the batch's time per event, once per batch.
                t0 = time.perf_counter()
                outs = self.core.publish_many(fresh)
                self.metrics.match_seconds.observe((time.perf_counter() - t0) / len(fresh))
                for out in outs:
                    self._stage_deliveries(out.deliveries, self.broker_id, staged)
                    self._stage_sends(out.sends, staged)
            self.metrics.sync_filter(self.core.last_mile)
            await self._commit(staged)
        except BaseException:
            for event in fresh:  # not published: a retry must go through
                self._published.forget(Kind.EVENT, event.id)
            raise
        self.metrics.events_published.inc(len(fresh))
        if self.history is not None:
            # Queued before the publish is answered: a later query sees it.
            self.history.record(logged)
        if staged.pushes:
            # The subscriber streams this woke write their deliveries before the
            # publisher's answer is written (publish -> delivery latency).
            await asyncio.sleep(0)
        # Published: now the publisher waits for subscribers it filled up.
        await self._backpressure(staged)

    async def _backpressure(self, staged: _Staged) -> None:
        """Flow control: wait (bounded) for the plain streams this publish left over half full.

        Only local publishes wait: a peer link carries every publisher of its
        broker, and holding it for one slow subscriber would stall them all.
        """
        bound = self.config.subscriber_backpressure_ms / 1000.0
        if not bound or not staged.pushes:
            return
        pressed = {id(st): st for st, _ in staged.pushes if st.pressed}
        if not pressed:
            return
        self.metrics.publish_waits.inc()
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(bound):
                for st in pressed.values():
                    await st.drained()
        except TimeoutError:
            for st in pressed.values():
                if st.pressed:
                    st.slow = True  # stalled: its oldest go, and nobody waits for it again
        finally:
            self.metrics.publish_backpressure.inc(time.monotonic() - t0)

    def _stage_sends(self, sends: list[Send], staged: _Staged) -> None:
        for send in sends:
            oid = 0
            msg = send.msg
            once = once_id(msg)
            if self.durable and once is not None:
                oid, self._next_oid = self._next_oid, self._next_oid + 1
                self.store.put_outbox(
                    oid, send.dst, msg.kind.value, once, message_to_bytes(msg, self.broker_id)
                )
            staged.sends.append((send, oid))

    def _stage_deliveries(self, deliveries: list[Delivery], origin: str, staged: _Staged) -> None:
        """Deliveries for local subscribers: queued in the store for persistent ones.

        Events and deliveries from a peer come from the publisher's broker
        (matching or forwarding happens there), so the peer is the `origin`.
        """
        now = time.time()
        wire: dict[int, gpb.Event] = {}  # one event reaches many subscribers: convert it once
        theirs = 0
        for d in deliveries:
            key = (d.client, d.subscription)
            stream = self._streams.get(key)
            info = self.pending.get(key)
            if stream is None and info is None:
                continue
            if self._theirs and d.event.id in self._theirs.get(key, ()):
                theirs += 1  # the client gets it from the broker it came from
                continue
            pb = wire.get(id(d.event))
            if pb is None:
                pb = wire[id(d.event)] = event_to_pb(d.event, origin)
            item = delivery_to_pb(d.subscription, pb, now, filter_scheme=_flag(d))
            if info is not None:
                self._queue_delivery(key, info, item)
            staged.delivered += 1
            if stream is not None:
                staged.pushes.append((stream, item))
        if theirs:
            self.metrics.handoff_deliveries.labels(outcome="duplicate").inc(theirs)

    def _queue_delivery(self, key: SubKey, info: PendingInfo, item: cpb.Delivery) -> None:
        """Give `item` the persistent subscription's next offset and queue it in the store."""
        info.last += 1
        item.offset = info.last
        data = item.SerializeToString()
        self.store.put_pending(_stored(key), info.last, data)
        arrived = self._arrived.get(key)
        if arrived is not None and len(arrived) < _ARRIVED_IDS:
            arrived[item.event.id] = None
        info.count += 1
        info.bytes += len(data)
        if info.bytes > self.config.session_queue_bytes and not info.trimming:
            info.trimming = True
            asyncio.get_running_loop().create_task(self._trim(key, info))

    def _take_handoff(self, peer: str, msg: HandoffMsg, staged: _Staged) -> None:
        """A queue handed off by `peer`, the broker the client left: queued for the same
        subscription here (with offsets of this broker), or pushed to its stream.

        Raises:
            InvalidInput: a delivery is not a valid ``geofed.v1.Delivery`` (none is taken).
        """
        key = msg.key
        stream = self._streams.get(key)
        info = self.pending.get(key)
        if stream is None and info is None:
            self.metrics.handoff_deliveries.labels(outcome="dropped").inc(len(msg.deliveries))
            log.warning(
                "%d queued deliveries of %s handed off by %s dropped: no such subscription here",
                len(msg.deliveries),
                key,
                peer,
            )
            return
        try:
            items = [cpb.Delivery.FromString(data) for data in msg.deliveries]
        except Exception as exc:
            raise InvalidInput("handoff.deliveries", f"not a valid Delivery: {exc}") from None
        arrived = self._arrived.get(key, {})
        fresh = [item for item in items if item.event.id not in arrived]
        if len(fresh) < len(items):  # queued here already since the session came
            self.metrics.handoff_deliveries.labels(outcome="duplicate").inc(len(items) - len(fresh))
        items = fresh
        theirs = self._theirs.get(key)
        if theirs is not None:  # an event that reaches this broker later is not matched again
            theirs.update(item.event.id for item in items)
        for item in items:
            item.offset = 0
            if info is not None:
                self._queue_delivery(key, info, item)
            if stream is not None:
                staged.pushes.append((stream, item))
        self.metrics.handoff_deliveries.labels(outcome="queued").inc(len(items))

    async def _commit(self, staged: _Staged) -> None:
        """Wait for the store to hold what `staged` wrote, then let it take effect."""
        if self.durable:
            # The ids go into the transaction that keeps their effects: a broker
            # killed before its next commit must still know them when the peer,
            # which never saw its acknowledgement, sends them again.
            for peer, kind, event_id in staged.seen:
                self._store_seen(peer, kind, event_id)
        if self.store.dirty:
            try:
                await self.store.commit()
            except StorageFailed:
                self.metrics.store_failures.inc()
                raise
        for send, oid in staged.sends:
            self.links[send.dst].enqueue(send.msg, oid)
        for stream, item in staged.pushes:
            stream.push(item)
        self.metrics.deliveries.inc(staged.delivered)
        for peer, kind, event_id in staged.seen:
            self._remember(peer, kind, event_id, stored=True)

    def _remember(self, peer: str, kind: Kind, event_id: str, stored: bool = False) -> bool:
        """Add an event id to a duplicate window, and to the store's copy; False if it was there.

        `stored`: its store copy was written already (`_commit`). The store's
        copy is trimmed to the window's newest `dedup_window` ids every quarter
        window, so it holds at most 1.25 windows per peer: a superset of the
        window, of which a restart keeps the newest (`_restore`).
        """
        window = self._published if peer == _LOCAL else self.links[peer].window
        if not window.add(kind, event_id):
            return False
        if self.durable:
            if not stored:
                self._store_seen(peer, kind, event_id)
            if window.added % max(1, window.size // 4) == 0:
                self.store.trim_seen(peer, window.size)
        return True

    def _store_seen(self, peer: str, kind: Kind, event_id: str) -> None:
        self.store.put_seen(peer, kind.value, event_id, self._next_seen)
        self._next_seen += 1

    async def _trim(self, key: SubKey, info: PendingInfo) -> None:
        """Keep a persistent subscription's queue within `session_queue_bytes` (oldest go)."""
        try:
            n, size, last = await self.store.drop_oldest(
                _stored(key), self.config.session_queue_bytes
            )
            if n:
                info.count -= n
                info.bytes -= size
                self.metrics.session_dropped.inc(n)
                log.warning(
                    "subscription %s: %d queued deliveries dropped (up to offset %d):"
                    " over session_queue_bytes",
                    key,
                    n,
                    last,
                )
        except StorageFailed as exc:
            log.error("subscription %s: trimming its queue failed: %s", key, exc)
        finally:
            info.trimming = False

    # -- the outbox (LinkHost, durable mode) ----------------------------------

    async def outbox_page(
        self, peer: str, from_oid: int, limit: int
    ) -> list[tuple[int, PeerMessage]]:
        """Up to `limit` outbox messages for `peer` from `from_oid` on, in order."""
        out: list[tuple[int, PeerMessage]] = []
        for oid, kind, data in await self.store.outbox_page(peer, from_oid, limit):
            try:
                out.append((oid, message_from_bytes(data, self.peer_geofences)))
            except GeofedError as exc:  # written by this code: only a damaged file gets here
                log.error("outbox message %d (%s) for %s unreadable: %s", oid, kind, peer, exc)
        return out

    def outbox_acked(self, peer: str, msgs: list[PeerMessage]) -> None:
        """`peer` acknowledged these: the outbox forgets them."""
        self.store.delete_outbox(
            peer, [(m.kind.value, once) for m in msgs if (once := once_id(m)) is not None]
        )

    # -- restart ---------------------------------------------------------------

    def _restore(self, loaded: Loaded) -> list[tuple[str, LatLon]]:
        """Rebuild the state a store kept (nothing to do for a new or in-memory one);
        return the sessions whose location lies outside this area, to hold or end (`start`)."""
        if loaded.strategy_state:
            # Before the subscriptions: they are placed for the tables in force.
            state = json.loads(loaded.strategy_state)
            _mark_adaptive(state)
            self.core.restore_transition_state(state)
            self._transition([])
            epoch, phase = self.core.progress
            log.info("strategy table restored: epoch %d, %s", epoch, phase.name.lower())
        for client, lat, lon, expiry_s, owner in loaded.sessions:
            self.core.sessions[client] = LatLon(lat, lon)
            self._sessions[client] = _Session(expiry_s, owner)
        for stored, _client, data in loaded.subscriptions:
            msg = message_from_bytes(data, self.peer_geofences)
            assert isinstance(msg, SubscribeMsg)
            self.core.subscribe(msg.sub)  # the links are down: their snapshots carry it
            self.pending[msg.sub.key] = loaded.pending.get(stored) or PendingInfo()
        for home, data in loaded.remote:
            self.core.on_message(home, message_from_bytes(data, self.peer_geofences))
        away = [
            (client, where)
            for client, where in self.core.sessions.items()
            if self.federation.responsible(where) != self.broker_id
        ]
        for peer, keys in loaded.seen.items():
            window = self._published if peer == _LOCAL else None
            if peer in self.links:
                window = self.links[peer].window
            if window is not None:
                for kind, event_id in keys:  # oldest first: the window keeps the newest
                    window.add(kind, event_id)
        self._next_oid = loaded.next_oid
        self._next_seen = loaded.next_seen
        if self.durable:
            log.info(
                "broker %s restored from %s: %d sessions, %d subscriptions (%d deliveries"
                " queued), %d forwarded subscriptions, %d messages for peers",
                self.broker_id,
                self.store.path,
                len(loaded.sessions),
                len(loaded.subscriptions),
                sum(p.count for p in loaded.pending.values()),
                len(loaded.remote),
                sum(loaded.outbox.values()),
            )
        self._update_sub_gauges()
        return away

    # -- sessions ----------------------------------------------------------

    async def open_session(
        self, client: str, where: LatLon, expiry_s: float, owner: str = ""
    ) -> tuple[bool, float]:
        """Open or refresh a session here; returns (a persistent one existed, expiry granted)."""
        expiry_s = min(expiry_s, self.config.max_session_expiry_s)
        session = self._sessions.get(client)
        present = session is not None and session.expiry_s > 0
        if session is None:
            session = self._sessions[client] = _Session(expiry_s, owner)
        elif present and not expiry_s:
            # Asked for a clean session: what the persistent one kept goes.
            for sub in self.core.subscriptions_of(client):
                self.forget_queue(sub.key)
                if sub.key not in self._streams:
                    self.dispatch(self.core.unsubscribe(client, sub.id))
            self.store.delete_session(client)
        session.expiry_s = expiry_s
        session.idle_since = time.monotonic()
        if expiry_s:
            if self.durable:
                self.store.put_session(client, where.lat, where.lon, expiry_s, session.owner)
            for sub in self.core.subscriptions_of(client):
                self.persist_subscription(sub)
        if self.store.dirty:
            await self.store.commit()
        return present, expiry_s

    def check_owner(self, who: Principal, client: str) -> None:
        """Refuse an identity other than the one that opened the client's session."""
        session = self._sessions.get(client)
        self.security.deny_other_owner(who, client, None if session is None else session.owner)

    def persistent(self, client: str) -> bool:
        """The client's session is persistent."""
        session = self._sessions.get(client)
        return session is not None and session.expiry_s > 0

    def persist_subscription(self, sub: Subscription) -> PendingInfo:
        """Keep a subscription of a persistent session (and its queue) in the store."""
        info = self.pending.get(sub.key)
        if info is None:
            info = self.pending[sub.key] = PendingInfo()
        if self.durable:
            data = message_to_bytes(SubscribeMsg(sub, self.broker_id), self.broker_id)
            self.store.put_subscription(_stored(sub.key), sub.client, data, info.acked)
        return info

    def forget_queue(self, key: SubKey) -> None:
        """A persistent subscription ended: its queue goes, and the event ids kept for it."""
        for ids in (self._arrived, self._theirs):
            ids.pop(key, None)
        if self.pending.pop(key, None) is not None:
            self.store.delete_subscription(_stored(key))

    def end_session(self, client: str, subs: list[Subscription]) -> None:
        """The session is gone (moved away or expired): its queues and stored state too."""
        session = self._sessions.pop(client, None)
        for sub in subs:
            self.forget_queue(sub.key)
        if session is not None and session.expiry_s:
            self.store.delete_session(client)

    def stream_opened(self, client: str) -> _Session | None:
        session = self._sessions.get(client)
        if session is not None:
            session.streams += 1
        return session

    def stream_closed(self, session: _Session | None) -> None:
        if session is not None:
            session.streams -= 1
            if not session.streams:
                session.idle_since = time.monotonic()

    async def _reap_sessions(self) -> None:
        """Every `_REAP_EVERY_S`: forget sessions without a stream for longer than their
        expiry (or session_idle_s), and commit what the store holds uncommitted.

        The outbox forgets what peers acknowledged with the next commit, and a
        broker that publishes nothing more would otherwise keep those rows on
        disk: after a crash it would resend all of them, and a peer whose
        duplicate window has moved past them would take them again.
        """
        while True:
            await asyncio.sleep(_REAP_EVERY_S)
            if self.store.dirty:
                try:
                    await self.store.commit()
                except StorageFailed:  # logged by the store; the next commit tries again
                    self.metrics.store_failures.inc()
            now = time.monotonic()
            for client, session in list(self._sessions.items()):
                limit = session.expiry_s or self.config.session_idle_s
                if session.streams or now - session.idle_since < limit:
                    continue
                log.info("session of %s expired after %.0fs without a stream", client, limit)
                self.end_session(client, self.core.subscriptions_of(client))
                self.dispatch(self.core.disconnect(client))
                self.metrics.sessions_expired.inc()
                self._update_sub_gauges()

    async def ack(self, client: str, sub_id: str, offset: int) -> None:
        """The subscriber processed a persistent subscription's deliveries up to `offset`."""
        key = (client, sub_id)
        info = self.pending.get(key)
        if info is None:
            raise NotFound("persistent subscription", sub_id)
        if offset > info.last:
            raise InvalidInput("offset", f"{offset} is beyond the last delivery ({info.last})")
        if offset > info.acked:
            info.acked = offset
            n, size = await self.store.ack(_stored(key), offset)
            info.count -= n
            info.bytes -= size

    async def replay(self, key: SubKey, after: int) -> list[tuple[int, cpb.Delivery]]:
        """A page of a persistent subscription's queued deliveries after offset `after`."""
        rows = await self.store.pending_page(_stored(key), after, _REPLAY_PAGE)
        return [(offset, delivery_from_bytes(data)) for offset, data in rows]

    # -- client side: what every front end (gRPC, MQTT) calls ------------------

    async def client_connect(
        self, who: Principal, client: str, where: LatLon, expiry_s: float
    ) -> Opened:
        """A client connects at `where`: open or refresh its session, or name its broker.

        Raises:
            InvalidInput: a bad expiry.
            PermissionDenied: another identity's client id, or a location the
                policy does not allow.
        """
        if not (math.isfinite(expiry_s) and expiry_s >= 0):
            raise InvalidInput("session_expiry_s", f"must be a number >= 0, got {expiry_s!r}")
        if (moving := self._moving.get(client)) is not None:
            await moving.wait()  # its session here is ending (`_end_move`): then a new one
        self.check_owner(who, client)
        self.security.may_be_at(who, where)
        if client in self.core.sessions and self.federation.responsible(where) == self.broker_id:
            # A known client at a new place: its roaming geofences follow.
            self._unhold(client, where)
            self.dispatch(self.core.update_location(client, where).sends)
        redirect = self.core.connect(client, where)
        if redirect is not None:
            self.metrics.redirects.inc()
            return Opened(redirect=self.federation.broker(redirect))
        present, granted = await self.open_session(client, where, expiry_s, who.identity)
        self._update_sub_gauges()
        return Opened(present=present, expiry_s=granted)

    def client_move(self, who: Principal, client: str, where: LatLon) -> BrokerInfo | None:
        """A client's new location; the broker it must go to if it left this area.

        On a redirect its subscriptions are withdrawn, their streams ended
        (FAILED_PRECONDITION ``client moved to broker X``) and its session closed.

        Raises:
            NotFound: the client has no session here.
            PermissionDenied: as for `client_connect`.
        """
        self.check_owner(who, client)
        self.security.may_be_at(who, where)
        self._unhold(client, where)
        moved = self.core.update_location(client, where)
        self.dispatch(moved.sends)  # withdrawals, or where its roaming geofences now reach
        if moved.redirect is None:
            self._store_location(client, where)
            return None
        self.metrics.redirects.inc()
        return self._moved_away(client, moved)

    async def client_handover(
        self, who: Principal, client: str, where: LatLon
    ) -> tuple[BrokerInfo | None, float]:
        """`client_move`, make before break: (broker to go to, seconds held here).

        A move out of the area keeps the session and its subscriptions (matched
        at the client's last location here) until the client leaves
        (`client_leave`, once its subscriptions stand at the new broker) or
        `handover_hold_s` runs out. A persistent session is stored at the new
        location first, so that a restart meanwhile holds it again (`start`).
        Otherwise (in the area, or `handover_hold_s` 0) as `client_move`.

        Raises:
            NotFound, PermissionDenied: as for `client_move`.
            StorageFailed: the store did not keep the new location (nothing held).
        """
        hold_s = self.config.handover_hold_s
        owner = self.federation.responsible(where)
        if not hold_s or owner == self.broker_id:
            return self.client_move(who, client, where), 0.0
        self.check_owner(who, client)
        self.security.may_be_at(who, where)
        if client not in self.core.sessions:
            raise NotFound("client session", client)
        if self._store_location(client, where):
            await self.store.commit()
        self._hold(client, where)
        self.metrics.redirects.inc()
        return self.federation.broker(owner), hold_s

    async def client_transfer(
        self, who: Principal, client: str, where: LatLon
    ) -> tuple[BrokerInfo | None, bool]:
        """`client_move` for a front end whose protocol has no leave step (MQTT): (broker
        to go to, held here).

        A persistent session leaving the area moves first: held as by
        `client_handover`, it is sent to the new broker (`SessionMsg`), which
        opens it with the client's subscriptions and replies once its peers
        applied them (the wait bounded like a renewal's, `step="transfer"`).
        The caller then redirects the client, which finds its session present
        there, and calls `client_leave` once its connection here has ended.
        A plain session, holding off (`handover_hold_s` 0) or a new broker not
        connected: as `client_move`.

        Raises:
            NotFound, PermissionDenied, StorageFailed: as for `client_handover`.
        """
        owner = self.federation.responsible(where)
        link = self.links.get(owner)
        if not (
            self.config.handover_hold_s
            and self.persistent(client)
            and link is not None
            and link.connected
        ):
            return self.client_move(who, client, where), False
        target, _ = await self.client_handover(who, client, where)
        for sub in self.core.subscriptions_of(client):
            # From now on its deliveries wait here with the rest of the queue, for the
            # handoff; the new broker drops those it queued itself meanwhile. So the
            # client gets each event once, not once here and again there.
            stream = self._streams.pop(sub.key, None)
            if stream is not None:
                stream.close()
        await self._send_session(client, where)
        return target, True

    async def _send_session(self, client: str, where: LatLon) -> None:
        """Send the persistent session of `client` to the broker of `where` (`SessionMsg`)
        and wait for its reply (bounded: `step="transfer"`); nothing when that broker's
        link is down."""
        owner = self.federation.responsible(where)
        link = self.links.get(owner)
        if link is None or not link.connected:
            return
        session = self._sessions[client]
        subs = tuple(self.core.subscriptions_of(client))
        granted = {} if self.mqtt is None else self.mqtt.qos
        qos = tuple((sub.id, granted[sub.key]) for sub in subs if sub.key in granted)
        queued = self._arrived_ids(subs)
        await self._ask(
            "transfer",
            [
                (
                    owner,
                    lambda token: SessionMsg(
                        token, client, session.owner, where, session.expiry_s, subs, qos, queued
                    ),
                )
            ],
        )
        self.metrics.session_transfers.labels(outcome="sent").inc()

    def _arrived_ids(self, subs: Iterable[Subscription]) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Per subscription of `subs` that came here with its session, the events queued
        for it here since (`_arrived`), newest first, at most `_HANDOFF_BYTES` of ids."""
        budget = _HANDOFF_BYTES
        out: list[tuple[str, tuple[str, ...]]] = []
        for sub in subs:
            arrived = self._arrived.get(sub.key)
            if not arrived:
                continue
            ids: list[str] = []
            for event_id in reversed(arrived):
                budget -= len(event_id)
                if budget < 0:
                    break
                ids.append(event_id)
            out.append((sub.id, tuple(ids)))
        return tuple(out)

    async def _take_back(self, peer: str, msg: SessionMsg) -> None:
        """The client's session came back from `peer` while held here: its queues here
        keep only what the client does not get from `peer`.

        The events `peer` queued for it (`msg.queued`) reach the client from there,
        delivered or in its handoff: they are dropped here. What is left here reaches
        the client from here: those ids join `_arrived`, so `peer`'s handoff drops its
        copies (events both brokers matched after `peer` sent the session). A queue
        the store cannot read or change is kept whole."""
        there = {(msg.client, sub_id): set(ids) for sub_id, ids in msg.queued}
        for sub in msg.subs:
            key = sub.key
            info = self.pending.get(key)
            arrived = self._arrived.get(key)
            if info is None or not info.count or arrived is None:
                continue
            drop = there.get(key, set())
            offsets: list[int] = []
            kept: list[str] = []
            try:
                for offset, data in await self._unacked(key, info):
                    event_id = delivery_from_bytes(data).event.id
                    if event_id in drop:
                        offsets.append(offset)
                    else:
                        kept.append(event_id)
                n, size = await self.store.drop_pending(_stored(key), offsets)
            except StorageFailed as exc:
                log.error("subscription %s: events queued at %s kept here: %s", key, peer, exc)
                continue
            info.count -= n
            info.bytes -= size
            self.metrics.handoff_deliveries.labels(outcome="duplicate").inc(n)
            # Older than what was queued since the session came: first in the order.
            merged = dict.fromkeys(kept[: max(0, _ARRIVED_IDS - len(arrived))])
            merged.update(arrived)
            arrived.clear()
            arrived.update(merged)

    async def _take_session(self, peer: str, msg: SessionMsg) -> None:
        """A session `peer` transferred (`client_transfer`, or a hold that ran out): opened
        here with its subscriptions; the flush reply goes once the peers applied them.
        A session here whose client is connected keeps its location and its own
        subscriptions (a copy of the same id is not taken); one held here (the client
        is back) or idle takes the sender's. One that cannot be taken (another owner's
        session here, a location outside the area, a store that failed) gets no reply:
        the sender withdraws when its wait runs out."""
        client, where = msg.client, msg.at
        if (moving := self._moving.get(client)) is not None:
            await moving.wait()  # an earlier session of the client here is ending
        try:
            if self.federation.responsible(where) != self.broker_id:
                raise WrongBroker("session.at", self.federation.responsible(where))
            session = self._sessions.get(client)
            self.security.deny_other_owner(
                Principal(msg.owner), client, None if session is None else session.owner
            )
            # Back before this broker let go of it: the hold ends, the session stays.
            back = client in self._held
            # Connected here (it got here first, renewed and never left the sender):
            # where it is and what it subscribed here are newer than the sender's copy.
            live = session is not None and session.streams > 0 and not back
            self._unhold(client, where)
            if client not in self.core.sessions:
                self.core.connect(client, where)
            elif not live:
                self.dispatch(self.core.update_location(client, where).sends)
            if session is None:
                session = self._sessions[client] = _Session(msg.expiry_s, msg.owner)
            session.expiry_s = max(session.expiry_s, msg.expiry_s)
            session.idle_since = time.monotonic()
            self._store_location(client, where)
            keep = 2 * self.config.handover_hold_s  # its handoff comes within the hold
            there = dict(msg.queued)
            for sub in msg.subs:
                if not (live and self.core.local.get(sub.key) is not None):
                    self.dispatch(self.core.subscribe(sub))
                    self.persist_subscription(sub)
                # Sent again while the session stayed here (a restarted sender whose hold
                # ran out): what came since the first transfer is still here, queued or
                # delivered, and what the sender's handoff brought stays known. A session
                # back here gets its ids from `_take_back`.
                earlier = None if back else self._arrived.get(sub.key)
                ids = self._arrived[sub.key] = dict(earlier or {})
                known = () if back else self._theirs.get(sub.key, ())
                theirs = self._theirs[sub.key] = {*there.get(sub.id, ()), *known}
                loop = asyncio.get_running_loop()
                loop.call_later(keep, _forget, self._arrived, sub.key, ids)
                loop.call_later(keep, _forget, self._theirs, sub.key, theirs)
            for sub_id, qos in msg.qos:
                self.grant_qos((client, sub_id), qos)
            self._update_sub_gauges()
            if self.store.dirty:
                await self.store.commit()
        except GeofedError as exc:
            self.metrics.session_transfers.labels(outcome="refused").inc()
            log.warning("session of %s transferred by %s not taken: %s", client, peer, exc)
            return
        self.metrics.session_transfers.labels(outcome="taken").inc()
        if back:
            await self._take_back(peer, msg)
        await self.peers_settled()
        link = self.links[peer]
        if link.connected:
            link.enqueue(FlushMsg(msg.token, True))

    def grant_qos(self, key: SubKey, qos: int) -> None:
        """The MQTT QoS granted to a subscription: the listener's (when it runs) and, for a
        persistent subscription, the store's (uncommitted)."""
        if self.mqtt is not None:
            self.mqtt.grant(key, qos)
        if self.durable and key in self.pending:
            self.store.put_mqtt_qos(_stored(key), qos)

    async def client_leave(self, who: Principal, client: str) -> bool:
        """The client whose handover this broker holds left: withdraw and close its session.

        The withdrawal waits for every connected peer's flush reply (`peers_flushed`):
        what the peers sent here before they learnt of the client's new broker
        (events it matched too late there, deliveries matched against this
        broker's copy) is delivered first. Returns once withdrawn (in a task of
        its own: a caller that goes away does not stop it halfway), True; False
        when no handover was held (a retried Leave, or one after the hold ran
        out); a session in the area is never touched.

        Raises:
            PermissionDenied: another identity's client id.
        """
        self.check_owner(who, client)
        held = self._held.get(client)
        if held is None:
            return False
        if held.leaving is None:
            held.timer.cancel()
            self.metrics.handovers.labels(outcome="left").inc()
            held.leaving = asyncio.get_running_loop().create_task(
                self._leave(client, held), name=f"leave-{client}"
            )
        await asyncio.wait([held.leaving])  # cancelled if the client came back meanwhile
        return True

    async def _leave(self, client: str, held: _Held) -> None:
        await self.peers_flushed()
        if self._held.get(client) is held:  # still away (not back meanwhile)
            del self._held[client]
            await self._end_move(client, held.where)

    def _hold_ran_out(self, client: str) -> None:
        held = self._held.pop(client, None)
        if held is None:
            return
        self._spawn(self._expire(client, held.where), f"expire-{client}")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run `work` in a task of its own, kept until it ends."""
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _expire(self, client: str, where: LatLon) -> None:
        # The client did not reach its new broker in time: a persistent session goes
        # there ahead of it, so that its queue has subscriptions to join there.
        if await self._end_move(client, where, send_session=True):
            log.info("handover of %s: not left within handover_hold_s; withdrawn", client)
        # Counted once withdrawn: whoever sees the count sees the withdrawal.
        self.metrics.handovers.labels(outcome="expired").inc()

    async def _end_move(self, client: str, where: LatLon, send_session: bool = False) -> bool:
        """A client gone to `where`, outside the area: withdraw and close its session here,
        its persistent queues handed off to its new broker (False: it has no session any
        more, expired meanwhile).

        With `send_session`, a persistent session is first sent to the new broker
        (`_send_session`), for a client that has not renewed there. The queues
        are read after the withdrawal (nothing is added to them then), and the
        handoffs go into the transaction that deletes them: a crash before it
        commits finds the session at its new place again on restart and ends the
        move anew. A `Connect` of the client meanwhile waits.
        """
        if client not in self.core.sessions:
            return False
        done = self._moving[client] = asyncio.Event()
        staged = _Staged()
        try:
            if send_session and self.persistent(client):
                await self._send_session(client, where)
                if client not in self.core.sessions:  # expired meanwhile
                    return False
            moved = self.core.update_location(client, where)  # nothing matched for it here now
            assert moved.redirect is not None
            sent = self._stage_handoffs(moved.redirect, await self._queues(moved.dropped), staged)
            self._moved_away(client, moved)
            await self._commit(staged)
        except StorageFailed as exc:  # a restart ends the move again
            log.error("session of %s: its move did not reach the store: %s", client, exc)
        else:
            self.metrics.handoff_deliveries.labels(outcome="sent").inc(sent)
        finally:
            del self._moving[client]
            done.set()
        return True

    async def _unacked(self, key: SubKey, info: PendingInfo) -> list[tuple[int, bytes]]:
        """(offset, encoded delivery) of everything queued for `key` and not acknowledged,
        oldest first, read from the store a page at a time.

        Raises:
            StorageFailed: the store could not read it.
        """
        out: list[tuple[int, bytes]] = []
        after = info.acked
        while rows := await self.store.pending_page(_stored(key), after, _REPLAY_PAGE):
            out.extend(rows)
            after = rows[-1][0]
        return out

    async def _queues(self, subs: list[Subscription]) -> list[tuple[SubKey, list[bytes]]]:
        """The deliveries queued, not acknowledged, for the persistent ones of `subs` (a
        queue the store cannot read is left out, counted as dropped)."""
        out: list[tuple[SubKey, list[bytes]]] = []
        for sub in subs:
            info = self.pending.get(sub.key)
            if info is None or not info.count:
                continue
            try:
                items = [data for _, data in await self._unacked(sub.key, info)]
            except StorageFailed as exc:
                self.metrics.handoff_deliveries.labels(outcome="dropped").inc(info.count)
                log.error(
                    "subscription %s: its queue could not be read to hand off: %s", sub.key, exc
                )
                continue
            if items:
                out.append((sub.key, items))
        return out

    def _stage_handoffs(
        self, dst: str, queues: list[tuple[SubKey, list[bytes]]], staged: _Staged
    ) -> int:
        """Handoffs of `queues` to broker `dst`, in messages of at most `_HANDOFF_BYTES`;
        the number of deliveries they carry."""
        n = sum(len(items) for _, items in queues)
        if dst not in self.links:  # not a peer (a federation file changed): nowhere to go
            if n:
                self.metrics.handoff_deliveries.labels(outcome="dropped").inc(n)
                log.warning("%d queued deliveries lost: broker %s is not a peer", n, dst)
            return 0
        sends: list[Send] = []
        for key, items in queues:
            for part in _batches(items, len, _HANDOFF_BYTES):
                sends.append(Send(dst, HandoffMsg(uuid.uuid4().hex, key, tuple(part))))
        self._stage_sends(sends, staged)
        return n

    def _store_location(self, client: str, where: LatLon) -> bool:
        """Keep a persistent session's new location in the store (uncommitted); False
        when there is nothing to keep (no store, or a plain session)."""
        if not (self.durable and self.persistent(client)):
            return False
        session = self._sessions[client]
        self.store.put_session(client, where.lat, where.lon, session.expiry_s, session.owner)
        return True

    def _hold(self, client: str, where: LatLon) -> None:
        """Hold the handover of `client`, gone to `where`, for `handover_hold_s` (anew)."""
        self._unhold(client, where)
        hold_s = self.config.handover_hold_s
        timer = asyncio.get_running_loop().call_later(hold_s, self._hold_ran_out, client)
        self._held[client] = _Held(where, timer)

    def _unhold(self, client: str, where: LatLon) -> None:
        """A held client's new location or connect: the hold ends without withdrawing."""
        held = self._held.pop(client, None)
        if held is not None:
            held.timer.cancel()
            if held.leaving is not None:
                held.leaving.cancel()
            if self.federation.responsible(where) == self.broker_id:
                self.metrics.handovers.labels(outcome="returned").inc()

    def _moved_away(self, client: str, moved: Moved) -> BrokerInfo:
        """After `update_location` redirected: end the client's streams and session here."""
        assert moved.redirect is not None
        self.dispatch(moved.sends)  # the withdrawals
        for sub in moved.dropped:
            stream = self._streams.pop(sub.key, None)
            if stream is not None:
                stream.close(
                    (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"client moved to broker {moved.redirect}",
                    )
                )
        self.end_session(client, moved.dropped)
        self._update_sub_gauges()
        return self.federation.broker(moved.redirect)

    async def peers_settled(self) -> None:
        """Wait until every connected peer applied what was queued for it so far (a
        handover's renewal, before the client leaves its old broker)."""
        await self._handover_wait(
            "settle", [link.settled() for link in self.links.values() if link.connected]
        )

    async def peers_flushed(self) -> None:
        """Ask every connected peer for a flush and wait for the replies (a handover's
        withdrawal): each peer queues its reply behind everything it had queued for
        this broker, and a reply is taken once its frame's effects are in place."""
        await self._ask(
            "flush",
            [
                (peer, lambda token: FlushMsg(token, False))
                for peer, link in self.links.items()
                if link.connected
            ],
        )

    async def _ask(self, step: str, asks: list[tuple[str, Callable[[int], PeerMessage]]]) -> None:
        """Send each peer its request, made with a token of its own, and wait for the
        flush replies of those tokens (bounded: `_handover_wait`; a link that breaks
        meanwhile is not waited for)."""
        loop = asyncio.get_running_loop()
        mine: list[tuple[str, int]] = []
        for peer, request in asks:
            self._flush_token += 1
            key = (peer, self._flush_token)
            self._flushes[key] = loop.create_future()
            mine.append(key)
            self.links[peer].enqueue(request(self._flush_token))
        try:
            await self._handover_wait(step, [self._flushes[key] for key in mine])
        finally:
            for key in mine:
                self._flushes.pop(key, None)

    async def _handover_wait(self, step: str, waits: list[Awaitable[Any]]) -> None:
        """Wait for `waits`, for at most half of `handover_hold_s` (counted when that
        runs out: the handover goes on without them)."""
        if not waits:
            return
        try:
            async with asyncio.timeout(self.config.handover_hold_s / 2):
                await asyncio.gather(*waits)
        except TimeoutError:
            self.metrics.handover_wait_timeouts.labels(step=step).inc()

    async def client_subscribe(
        self, who: Principal, client: str, pb: gpb.Subscription, resume_after: int = 0
    ) -> tuple[Subscription, _Stream]:
        """Register a client's subscription (durably in a persistent session) and its stream.

        The same id again is an update and ends the older stream normally. The
        caller reads the stream (`_Stream.get`) until `_END` and then calls
        `client_stream_closed`.

        Raises:
            GeofedError: the subscription is invalid or not allowed, or the store
                did not keep it (the broker then holds what it held before).
        """
        self.check_owner(who, client)
        self.security.may_subscribe(who, client, pb.topic_filter)
        await self.parse_ahead(pb.geofence, "subscription.geofence")
        sub = subscription_from_pb(pb, self.geofences, client=client)
        old = self.core.local.get(sub.key)
        sends = self.core.subscribe(sub)
        if self.persistent(client):
            info = self.persist_subscription(sub)
            try:
                # Beyond the last offset: the client knew an older queue (ours was lost).
                resume = min(resume_after, info.last)
                if resume > info.acked:
                    await self.ack(client, sub.id, resume)
                if self.store.dirty:
                    await self.store.commit()
            except GeofedError:
                # Not kept: the broker holds what it held before.
                if old is not None:
                    self.core.subscribe(old)
                else:
                    self.core.unsubscribe(client, sub.id)
                    self.forget_queue(sub.key)
                raise
        self.dispatch(sends)
        return sub, self.client_stream(sub.key)

    def client_stream(self, key: SubKey) -> _Stream:
        """Open the delivery stream of a subscription held here (a newer one takes over).

        A persistent subscription's stream starts with what is queued after
        the last acknowledged offset.
        """
        cfg = self.config
        refill: Refill | None = None
        if key in self.pending:
            refill = functools.partial(self.replay, key)
        stream = _Stream(
            cfg.subscriber_queue_size, cfg.subscriber_queue_bytes, self.metrics, refill, self.budget
        )
        if refill is not None:
            stream.behind = self.pending[key].acked  # queued deliveries first
        old_stream = self._streams.get(key)
        if old_stream is not None:
            old_stream.close(None)  # a newer stream of this subscription takes over
        self._streams[key] = stream
        stream.session = self.stream_opened(key[0])
        self._update_sub_gauges()
        return stream

    def client_stream_closed(self, key: SubKey, stream: _Stream) -> None:
        """A subscription's stream ended: a plain subscription goes too (if it was the last)."""
        stream.release()
        self.stream_closed(stream.session)
        stream.session = None
        if self._streams.get(key) is stream:
            del self._streams[key]
            # The client went away: a plain subscription goes too; a
            # persistent one stays, its deliveries queued for the session.
            if (
                self.core.local.get(key) is not None
                and not self._stopped
                and key not in self.pending
            ):
                with contextlib.suppress(GeofedError):
                    self.dispatch(self.core.unsubscribe(*key))
            self._update_sub_gauges()

    def client_disconnect(self, who: Principal, client: str) -> None:
        """A client leaves for good: its session ends and its subscriptions are withdrawn."""
        self.check_owner(who, client)
        for sub in self.core.subscriptions_of(client):
            stream = self._streams.pop(sub.key, None)
            if stream is not None:
                stream.close(None)
        self.end_session(client, self.core.subscriptions_of(client))
        self.dispatch(self.core.disconnect(client))
        self._update_sub_gauges()

    def client_unsubscribe(self, who: Principal, client: str, sub_id: str) -> bool:
        """Withdraw a subscription, end its stream and forget its queue.

        False if the client holds no subscription with that id: an unsubscribe
        retried after its answer was lost is not an error (MQTT's "no
        subscription existed" answer, the same idea).
        """
        self.check_owner(who, client)
        if self.core.local.get((client, sub_id)) is None:
            return False
        self.dispatch(self.core.unsubscribe(client, sub_id))
        self.forget_queue((client, sub_id))
        stream = self._streams.pop((client, sub_id), None)
        if stream is not None:
            stream.close(None)
        self._update_sub_gauges()
        return True

    async def client_event(self, who: Principal, client: str, pb: gpb.Event, field: str) -> Event:
        """Validate, authorize and convert one event a client publishes (state untouched).

        Sets its id (when empty) and publish time; `publish` then routes it.
        """
        self._check_payload(pb, field)  # before any geofence text is parsed
        await self.parse_ahead(pb.geofence, f"{field}.geofence")
        return self.client_event_now(who, client, pb, field)

    def _check_payload(self, pb: gpb.Event, field: str) -> None:
        if len(pb.payload) > self.config.max_payload_bytes:
            raise TooLarge(f"{field}.payload", len(pb.payload), self.config.max_payload_bytes)

    def client_event_now(self, who: Principal, client: str, pb: gpb.Event, field: str) -> Event:
        """`client_event` without a wait: for an event with no long geofence text to parse.

        A `PublishStream` batch of world-wide events converts each with no
        coroutine to create and await (two per event, ~1 µs of the loop's time).
        """
        self._check_payload(pb, field)
        if not pb.id:
            pb.id = new_event_id()
        pb.publish_time = time.time()
        event = event_from_pb(pb, self.geofences, field=field)
        self.security.may_publish(who, client, event.topic, event.location)
        self.core.check_publisher(event, f"{field}.publisher")
        return event

    async def parse_ahead(self, pb: gpb.Geofence, field: str) -> None:
        """Parse a long geofence text in a worker thread, into the node's cache.

        The conversion that follows (`event_from_pb`, `subscription_from_pb`)
        then finds it there; meanwhile other clients' requests are served.
        Short text, text over the byte limit (refused before parsing) and text
        already cached are left to the conversion.
        """
        shape = pb.WhichOneof("shape")
        if shape not in ("wkt", "geojson"):
            return
        text: str = getattr(pb, shape)
        cache = self.geofences
        too_long = cache.max_bytes is not None and len(text) > cache.max_bytes
        if len(text) < OFFLOAD_CHARS or too_long or text in cache:
            return
        fence = await asyncio.to_thread(_parse_and_write, cache, text, f"{field}.{shape}")
        cache.put(text, fence)  # no await until the conversion reads it

    # -- history (docs/design.md §10) -------------------------------------------

    async def client_history(
        self, principal: Principal, query: HistoryQuery, delete: bool = False, *, client: str = ""
    ) -> HistoryAnswer:
        """Answer a history query for a client, federation-wide.

        Asks the brokers whose areas meet the query geometry (all of them
        without one; `history_targets`, the cost model's answer), itself
        included, each for its first `query.limit` entries newest first;
        merges them newest first (publish time, then event id, descending)
        and cuts the list to `limit` and to ``history_max_answer_bytes``
        (then `truncated`). With `delete` the entries so selected are removed,
        each at its broker, and what was removed is returned.

        Permissions (with a policy): reading needs subscribe permission on the
        topic filter, deleting needs publish permission covering every topic
        it matches. `client` (optional) fills ``%c`` in policy patterns.

        Raises:
            InvalidInput: a bad query (the field is named).
            TooLarge: ``limit`` over ``history_max_rows``, a ``geometry`` over
                ``max_geofence_vertices``.
            PermissionDenied: not allowed.
            StorageFailed: a broker asked did not answer within
                ``history_timeout_s``, or a store failed; nothing is returned.
                A delete may then have removed entries at the brokers that
                did answer: asking again removes the rest.
        """
        cfg = self.config
        if delete:
            self.security.may_delete_history(principal, client, query.topic_filter)
        else:
            self.security.may_read_history(principal, client, query.topic_filter)
        if query.limit > cfg.history_max_rows:
            raise TooLarge("limit", query.limit, cfg.history_max_rows)
        if query.geometry is not None:
            vertices = int(shapely.get_num_coordinates(query.geometry))
            if vertices > cfg.max_geofence_vertices:
                raise TooLarge("geometry", vertices, cfg.max_geofence_vertices)
        asked = history_targets(self.federation, query)
        self.metrics.history_queries.labels(kind="delete" if delete else "read").inc()
        for broker in asked:
            self.metrics.history_brokers_asked.labels(broker=broker).inc()
        max_bytes = cfg.history_max_answer_bytes
        answers = await _all(self._history_share(b, query, max_bytes) for b in sorted(asked))
        records, truncated = merge_history(answers, query.limit, max_bytes)
        if delete:
            chosen: dict[str, list[str]] = {}
            for r in records:
                chosen.setdefault(r.origin, []).append(r.event_id)
            removed = await _all(
                self._history_delete(b, query, ids) for b, ids in sorted(chosen.items())
            )
            records, _ = merge_history(removed, query.limit)
        return HistoryAnswer(records, truncated=truncated, brokers=asked)

    async def _history_share(
        self, broker: str, query: HistoryQuery, max_bytes: int
    ) -> list[HistoryRecord]:
        """One broker's first entries for `query`, newest first (this one's, or a peer's)."""
        if broker == self.broker_id:
            if self.history is None:
                return []
            records, _ = await self.history.query(query, max_bytes)
            return records
        answer = await self._peer_history(
            broker, peer_history_request(self.broker_id, query, max_bytes)
        )
        return self._peer_records(broker, answer)

    async def _history_delete(
        self, broker: str, query: HistoryQuery, event_ids: list[str]
    ) -> list[HistoryRecord]:
        """Remove entries at `broker`; what it removed."""
        if broker == self.broker_id:
            return [] if self.history is None else await self.history.delete(event_ids)
        pb = peer_history_request(self.broker_id, query, 0, event_ids)
        return self._peer_records(broker, await self._peer_history(broker, pb))

    def _peer_records(self, broker: str, answer: fpb.PeerHistoryResponse) -> list[HistoryRecord]:
        out = []
        for i, pb in enumerate(answer.events):
            record = history_record_from_pb(
                pb, self.peer_geofences, f"history answer of {broker}.events[{i}]"
            )
            if record.origin != broker:
                raise StorageFailed(
                    f"history: broker {broker} answered an entry of {record.origin}"
                )
            out.append(record)
        return out

    async def _peer_history(
        self, broker: str, request: fpb.PeerHistoryRequest
    ) -> fpb.PeerHistoryResponse:
        """Call a peer's `History` over the federation port (mutual TLS when configured)."""
        if broker not in self._history_channels:
            self._history_channels[broker] = self.dial(self.federation.broker(broker))
        channel: Any = self._history_channels[broker]
        try:
            answer: fpb.PeerHistoryResponse = await fpb_grpc.FederationServiceStub(channel).History(
                request, timeout=self.config.history_timeout_s
            )
        except grpc.RpcError as exc:
            current: Any = self._history_channels.get(broker)
            if exc.code() == grpc.StatusCode.UNAVAILABLE and current is channel:
                # Dial afresh next time: a restarted peer, rotated certificates.
                del self._history_channels[broker]
                asyncio.get_running_loop().create_task(channel.close(grace=1.0))
            raise StorageFailed(
                f"history: broker {broker} did not answer: {exc.code().name} {exc.details()}"
            ) from None
        return answer

    async def peer_history(self, request: fpb.PeerHistoryRequest) -> fpb.PeerHistoryResponse:
        """A peer's request for this broker's share of a history query (or a removal)."""
        if self.history is None:
            return peer_history_response([], False)
        cfg = self.config
        if request.delete_ids:
            if len(request.delete_ids) > cfg.history_max_rows:
                raise TooLarge("delete_ids", len(request.delete_ids), cfg.history_max_rows)
            ids = [validate_id(x, f"delete_ids[{i}]") for i, x in enumerate(request.delete_ids)]
            return peer_history_response(await self.history.delete(ids), False)
        query = history_query_from_peer(request)
        if query.limit > cfg.history_max_rows:
            raise TooLarge("limit", query.limit, cfg.history_max_rows)
        max_bytes = min(request.max_bytes or cfg.history_max_answer_bytes, _PEER_ANSWER_BYTES)
        records, truncated = await self.history.query(query, max_bytes)
        return peer_history_response(records, truncated)

    def _history_changed(self, entries: int, size: int) -> None:
        self.metrics.history_entries.set(entries)
        self.metrics.history_bytes.set(size)

    def location_of(self, client: str) -> LatLon | None:
        """The client's last known location (None without a session here)."""
        return self.core.sessions.get(client)

    def _update_sub_gauges(self) -> None:
        local, remote = len(self.core.local), len(self.core.remote)
        self.metrics.subscriptions.labels(scope="local").set(local)
        self.metrics.subscriptions.labels(scope="remote").set(remote)
        self._heap.held(local + remote)
        self.metrics.sessions.set(len(self.core.sessions))
        self._filter_load()

    # -- filter schemes (docs/design.md §14) ---------------------------------

    def _init_filter_scheme(self, config: NodeConfig) -> None:
        self._base_scheme = parse_scheme(config.filter_scheme)
        self.core.audit_every = config.filter_scheme_audit_every
        if self._base_scheme is not Scheme.EXACT or (
            config.filter_scheme_rgrid_at or config.filter_scheme_grid_at
        ):
            require_h3("filter_scheme", "an approximate filter scheme")  # at start, not later
        self.set_filter_scheme(self._base_scheme)

    def set_filter_scheme(self, scheme: Scheme) -> None:
        """Switch the filter scheme of the local subscriptions, with state transfer.

        Runs on the event loop between two matches, so every event sees one
        scheme (the paper's queued notifications); nothing is asked of clients.
        """
        if scheme is self.core.last_mile.scheme:
            self.metrics.sync_filter(self.core.last_mile)
            return
        report = self.core.set_scheme(scheme)
        log.info(
            "filter scheme %s -> %s at %d local subscriptions: %d transferred,"
            " %d bootstrapped from the broker",
            report.source,
            report.target,
            len(self.core.local),
            report.transferred,
            report.recovered,
        )
        self.metrics.sync_filter(self.core.last_mile)

    def _filter_load(self) -> None:
        """Load-triggered transitions: the scheme for the local subscriptions held now."""
        cfg = self.config
        if not (cfg.filter_scheme_rgrid_at or cfg.filter_scheme_grid_at):
            return
        self.set_filter_scheme(
            scheme_for_load(
                self.core.last_mile.scheme,
                len(self.core.local),
                self._base_scheme,
                cfg.filter_scheme_rgrid_at,
                cfg.filter_scheme_grid_at,
            )
        )

    def on_reject(self, code: grpc.StatusCode) -> None:
        self.metrics.rejected.labels(code=code.name).inc()


_PEER_ANSWER_BYTES = 32 << 20
"""A broker's share of a history answer takes at most this (within the 64 MiB frame limit)."""


async def _all(calls: Iterable[Awaitable[list[HistoryRecord]]]) -> list[list[HistoryRecord]]:
    """Run the calls at once; all of them finish before the first error (if any) is raised."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    out: list[list[HistoryRecord]] = []
    for r in results:
        if isinstance(r, BaseException):
            raise r
        out.append(r)
    return out


def _batches(
    items: Iterable[_T], cost: Callable[[_T], int], budget: int, most: int | None = None
) -> Iterator[list[_T]]:
    """`items` in order, in lists of at most `budget` total cost and `most` items;
    an item costing more than `budget` goes alone (a list is never empty)."""
    part: list[_T] = []
    size = 0
    for item in items:
        c = cost(item)
        if part and (len(part) == most or size + c > budget):
            yield part
            part, size = [], 0
        part.append(item)
        size += c
    if part:
        yield part


def _flag(d: Delivery) -> str:
    """The wire's filter_scheme of a delivery: its scheme when approximate, else ""."""
    return "" if d.scheme is Scheme.EXACT else d.scheme.value


def _trace_fields(msg: PeerMessage) -> tuple[list[str], str | None]:
    if isinstance(msg, EventMsg | DeliveryMsg):
        return [msg.event.id], msg.event.topic
    if isinstance(msg, HandoffMsg):
        return [msg.id], None
    if isinstance(msg, SubscribeMsg):
        return [msg.sub.id], msg.sub.topic_filter
    if isinstance(msg, TableMsg):
        return [str(msg.table.epoch)], None
    if isinstance(msg, ProposeMsg):
        return [], msg.topic_filter
    if isinstance(msg, ReportMsg):
        return [str(msg.window)], None
    if isinstance(msg, FlushMsg):
        return [str(msg.token)], None
    if isinstance(msg, SessionMsg):
        return [msg.client], None
    return [msg.key[1]], None


def _mark_adaptive(state: dict[str, Any]) -> None:
    """Carry a strategy state stored before tables marked the controller's entries.

    Such a state kept them beside the tables (``adaptive_owned``: filter ->
    strategy); an entry it names with that strategy becomes marked adaptive,
    so that the controller goes on switching it instead of taking it for an
    operator's.
    """
    owned = state.pop("adaptive_owned", None)
    if not isinstance(owned, dict):
        return
    for table in [*state.get("placing", []), *state.get("future", [])]:
        for entry in table.get("entries", []) if isinstance(table, dict) else []:
            if isinstance(entry, dict) and owned.get(entry.get("topic_filter")) == entry.get(
                "strategy"
            ):
                entry["adaptive"] = True


def _forget(table: dict[SubKey, Any], key: SubKey, value: object) -> None:
    """Drop `key` from `table` if it still holds `value` (not a later transfer's)."""
    if table.get(key) is value:
        del table[key]


def _stored(key: SubKey) -> str:
    """A subscription key as the store keeps it (ids hold no control characters)."""
    return "\x1f".join(key)


def _wan_matrix(config: NodeConfig, fed: Federation) -> dict[str, float]:
    if config.wan_latency == "off":
        return {}
    me = fed.broker(config.broker_id)
    if config.wan_latency == "model":
        if me.site is None:
            raise InvalidInput(
                "wan_latency", f"'model' needs a site for broker {me.id} in the federation file"
            )
        out: dict[str, float] = {}
        for b in fed:
            if b.id == me.id:
                continue
            if b.site is None:
                raise InvalidInput("wan_latency", f"'model' needs a site for broker {b.id}")
            out[b.id] = great_circle_m(me.site, b.site) / 1000.0 * config.wan_ms_per_km / 1000.0
        return out
    try:
        with open(config.wan_latency, encoding="utf-8") as f:
            matrix = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidInput(
            "wan_latency", f"cannot read latency matrix {config.wan_latency}: {exc}"
        ) from None
    row = matrix.get(me.id) if isinstance(matrix, dict) else None
    if not isinstance(row, dict):
        raise InvalidInput("wan_latency", f"latency matrix has no row for broker {me.id!r}")
    return {peer: float(ms) / 1000.0 for peer, ms in row.items() if peer != me.id}


OFFLOAD_CHARS = 16 * 1024
"""Geofence text at least this long is parsed in a worker thread, off the event loop.

Shorter text is parsed inline: the thread hop would cost more than the parse.
"""


class _Undecodable:
    """What a client request that is not valid protobuf decodes to.

    grpc would answer such a request UNKNOWN, without our metadata or metrics;
    the servicer rejects it as `InvalidInput` (INVALID_ARGUMENT) and counts it.
    """

    def __init__(self, message: str, reason: str) -> None:
        self.message = message
        self.reason = reason


def _lenient(cls: Any) -> Any:
    """A request deserializer that returns `_Undecodable` instead of raising."""

    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError, or anything the runtime raises on bad bytes
            return _Undecodable(cls.DESCRIPTOR.name, str(exc) or type(exc).__name__)

    return decode


def _decoded(request: Any, field: str) -> None:
    """Reject a request that did not decode (see `_Undecodable`)."""
    if isinstance(request, _Undecodable):
        raise InvalidInput(field, f"not a valid {request.message} message: {request.reason}")


def _parse_and_write(cache: GeofenceCache, text: str, field: str) -> Geofence | None:
    """`cache.parse`, and the canonical WKT made too (routing and forwarding need it)."""
    fence = cache.parse(text, field)
    if fence is not None:
        _ = fence.wkt  # a cached property: made here, in the worker thread
    return fence


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _strict(cls: Any) -> Any:
    return cls.FromString


def _add_service(
    server: grpc.aio.Server, module: Any, servicer: Any, decode: Callable[[Any], Any]
) -> None:
    """Register the one service of a `_pb2` module as the generated code would, but
    with `decode(request class)` decoding requests and `wire_bytes` (any message's
    `SerializeToString`) encoding responses: a peer link writes `EncodedFrame`s."""
    (service,) = module.DESCRIPTOR.services_by_name.values()
    handlers = {
        m.name: _HANDLERS[m.client_streaming, m.server_streaming](
            getattr(servicer, m.name),
            request_deserializer=decode(getattr(module, m.input_type.name)),
            response_serializer=wire_bytes,
        )
        for m in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


class _ClientServicer(cpb_grpc.ClientServiceServicer, Guarded):
    def __init__(self, node: BrokerServer) -> None:
        self.node = node

    def on_reject(self, code: grpc.StatusCode) -> None:
        self.node.on_reject(code)

    @unary
    async def Connect(self, request: cpb.ConnectRequest, context: Any) -> cpb.ConnectResponse:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        where = location_from_pb(request, "location", "location")
        who = node.security.principal(context)
        opened = await node.client_connect(who, client, where, request.session_expiry_s)
        if opened.redirect is not None:
            return redirect_response(node.broker_id, opened.redirect)
        return accepted_response(node.broker_id, opened.present, opened.expiry_s)

    @unary
    async def UpdateLocation(
        self, request: cpb.UpdateLocationRequest, context: Any
    ) -> cpb.ConnectResponse:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        where = location_from_pb(request, "location", "location")
        who = node.security.principal(context)
        if request.hold:
            target, held_s = await node.client_handover(who, client, where)
        else:
            target, held_s = node.client_move(who, client, where), 0.0
        if target is None:
            return accepted_response(node.broker_id)
        return redirect_response(node.broker_id, target, held_s)

    @unary
    async def Leave(self, request: cpb.LeaveRequest, context: Any) -> cpb.LeaveResponse:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        return leave_response(await node.client_leave(node.security.principal(context), client))

    @streaming
    async def Subscribe(
        self, request: cpb.SubscribeRequest, context: Any
    ) -> AsyncIterator[cpb.Delivery]:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        if not request.HasField("subscription"):
            raise InvalidInput("subscription", "is required")
        who = node.security.principal(context)
        sub, stream = await node.client_subscribe(
            who, client, request.subscription, request.resume_after
        )
        cfg = node.config
        batched = BATCH_METADATA in (context.invocation_metadata() or ())
        most = cfg.subscriber_batch_max if batched else 1
        delay = cfg.subscriber_batch_delay_ms / 1000.0
        last = 0.0
        try:
            if request.handover:
                # The client lets go of its old broker once this answers: first
                # the peers must hold what the subscription sent them.
                await node.peers_settled()
            await context.send_initial_metadata(((BROKER_METADATA, node.broker_id),))
            while True:
                item = await stream.get()
                if item is _END:
                    if stream.end_status is not None:
                        await context.abort(*stream.end_status)
                    return
                if most == 1:
                    yield item
                    continue
                if delay and len(stream) < most - 1:
                    # Nagle-like, as on peer links: right after a message, let
                    # the next one fill a little (a lone delivery goes at once).
                    wait = last + delay - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                room = _BATCH_BYTES - _DELIVERY_OVERHEAD - len(item.event.payload)
                yield delivery_batch([item, *stream.take_ready(most - 1, room)])
                last = time.monotonic()
        finally:
            node.client_stream_closed(sub.key, stream)

    @unary
    async def Unsubscribe(
        self, request: cpb.UnsubscribeRequest, context: Any
    ) -> cpb.UnsubscribeResponse:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        sub_id = validate_id(request.subscription_id, "subscription_id")
        existed = node.client_unsubscribe(node.security.principal(context), client, sub_id)
        return unsubscribe_response(existed)

    @unary
    async def Ack(self, request: cpb.AckRequest, context: Any) -> cpb.AckResponse:
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        sub_id = validate_id(request.subscription_id, "subscription_id")
        self.node.check_owner(self.node.security.principal(context), client)
        await self.node.ack(client, sub_id, request.offset)
        return ack_response()

    @unary
    async def Publish(self, request: cpb.PublishRequest, context: Any) -> cpb.PublishResponse:
        return publish_response(await self._publish(request, context))

    @streaming
    async def PublishEach(
        self, request_iterator: AsyncIterator[cpb.PublishRequest], context: Any
    ) -> AsyncIterator[cpb.PublishResult]:
        # One request at a time, in order: a publisher held back by flow
        # control holds back its next requests too (gRPC's window bounds them).
        # Shutdown ends the call with UNAVAILABLE once the request being
        # published is answered (the client sends the rest again, elsewhere or later).
        node = self.node
        calls, me = node.publish_calls, asyncio.current_task()
        assert me is not None
        calls[me] = False
        try:
            async for request in request_iterator:
                calls[me] = True
                try:
                    answer = publish_result(await self._publish(request, context))
                except GeofedError as exc:
                    code = rejected(self, "PublishEach request", exc)
                    answer = publish_refused(code.value[0], details_for(exc), error_json(exc))
                yield answer
                if node._stopped:
                    break
                calls[me] = False
            else:
                return  # the client is done
        except asyncio.CancelledError:
            if not node._stopped:
                raise  # the call itself was cancelled
        finally:
            del calls[me]
        await context.abort(grpc.StatusCode.UNAVAILABLE, "broker shutting down")

    async def _publish(self, request: cpb.PublishRequest, context: Any) -> str:
        """Publish one `PublishRequest` (Publish, PublishEach); the event's id."""
        _decoded(request, "request")
        client = validate_id(request.client, "request.client")
        if not request.HasField("event"):
            raise InvalidInput("request.event", "is required")
        who = self.node.security.principal(context)
        self.node.check_owner(who, client)
        event = await self.node.client_event(who, client, request.event, "request.event")
        await self.node.publish([event])
        return event.id

    @unary
    async def SetStrategy(self, request: cpb.SetStrategyRequest, context: Any) -> cpb.StrategyState:
        _decoded(request, "request")
        who = self.node.security.principal(context)
        left = context.time_remaining()  # answer before the caller's deadline
        await self.node.set_strategy(
            who,
            request.topic_filter,
            request.strategy or None,
            None if left is None else max(0.1, 0.8 * left),
        )
        return self.node.strategy_state()

    @unary
    async def GetStrategy(self, request: cpb.GetStrategyRequest, context: Any) -> cpb.StrategyState:
        self.node.security.principal(context)
        return self.node.strategy_state()

    @unary
    async def History(self, request: cpb.HistoryRequest, context: Any) -> cpb.HistoryResponse:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client") if request.client else ""
        who = node.security.principal(context)
        if client:
            node.check_owner(who, client)
        await node.parse_ahead(request.geometry, "geometry")
        query = history_query_from_pb(request, node.geofences, node.config.history_max_rows)
        answer = await node.client_history(who, query, request.delete, client=client)
        return history_response(answer, answer.truncated, answer.brokers)

    async def PublishStream(
        self, request_iterator: AsyncIterator[cpb.PublishBatch], context: Any
    ) -> cpb.PublishBatchResponse:
        ids: list[str] = []
        limit = self.node.config.max_publish_batch
        who: Principal | None = None
        async for batch in request_iterator:
            try:
                if who is None:
                    who = self.node.security.principal(context)
                _decoded(batch, "batch")
                client = validate_id(batch.client, "batch.client")
                self.node.check_owner(who, client)
                if len(ids) + len(batch.events) > limit:
                    raise TooLarge("batch.events", len(ids) + len(batch.events), limit)
                # A batch is published whole or not at all: validate it first.
                events = []
                for i, pb in enumerate(batch.events, len(ids)):
                    field = f"batch.events[{i}]"
                    events.append(
                        await self.node.client_event(who, client, pb, field)
                        if pb.HasField("geofence")  # its text may be parsed off the loop
                        else self.node.client_event_now(who, client, pb, field)
                    )
                await self.node.publish(events)
            except GeofedError as exc:
                self.on_reject(status_for(exc))
                await abort(
                    context, exc, f" (this batch was not published; {len(ids)} earlier events were)"
                )
            ids.extend(event.id for event in events)
        return publish_batch_response(ids)


class _FederationServicer(fpb_grpc.FederationServiceServicer):
    def __init__(self, node: BrokerServer) -> None:
        self.node = node

    async def Link(self, request_iterator: Any, context: Any) -> None:
        node = self.node
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("hello"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "hello: the first frame must be a hello"
            )
        problem = node.check_hello(first.hello)
        if problem:
            log.error("refusing link from %s: %s", first.hello.broker_id or "?", problem)
            await context.write(refuse_frame(problem))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            node.security.check_peer(context, first.hello.broker_id)
        except GeofedError as exc:
            log.error("refusing link from %s: %s", first.hello.broker_id, exc)
            await context.write(refuse_frame(str(exc)))
            await abort(context, exc)
        await node.links[first.hello.broker_id].accept(ContextTransport(context))

    async def History(
        self, request: fpb.PeerHistoryRequest, context: Any
    ) -> fpb.PeerHistoryResponse:
        node = self.node
        try:
            if request.broker_id not in node.links:
                raise PermissionDenied(
                    "identity", f"{request.broker_id!r} is not a peer in this federation file"
                )
            node.security.check_peer(context, request.broker_id)
            return await node.peer_history(request)
        except GeofedError as exc:
            log.info("history request of %s rejected: %s", request.broker_id or "?", exc)
            await abort(context, exc)
            raise  # unreachable: abort raises


__all__ = ["BrokerServer", "FederationMismatch"]
