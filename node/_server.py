"""The broker node: client and federation gRPC services around one `BrokerState`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from geofed.errors import status_for
from geofed.routing import (
    BrokerState,
    Delivery,
    DeliveryMsg,
    Event,
    EventMsg,
    Federation,
    FederationMismatch,
    GeofedError,
    Geofence,
    GeofenceCache,
    InvalidInput,
    Kind,
    PeerMessage,
    Send,
    SubscribeMsg,
    TooLarge,
    great_circle_m,
    strategy_for,
    validate_id,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import federation_pb2_grpc as fpb_grpc
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    CLIENT_SERVICE,
    FEDERATION_SERVICE,
    PeerGeofenceCache,
    RejectedMessage,
    accepted_response,
    delivery_to_pb,
    event_from_pb,
    event_to_pb,
    hello_frame,
    location_from_pb,
    messages_from_frame,
    publish_batch_response,
    publish_response,
    redirect_response,
    refuse_frame,
    rejection_reason,
    subscription_from_pb,
    unsubscribe_response,
)

from ._config import NodeConfig
from ._errors import Guarded, abort, streaming, unary
from ._links import PROTOCOL_VERSION, SERVER_OPTIONS, ContextTransport, PeerLink
from ._metrics import NodeMetrics
from ._tracefile import MessageTrace

log = logging.getLogger("geofed.node")

_END = object()


class _Stream:
    """The bounded delivery queue of one Subscribe call (drops the oldest when full)."""

    def __init__(self, cap: int, metrics: NodeMetrics) -> None:
        self._items: deque[Any] = deque()
        self._cap = cap
        self._metrics = metrics
        self._ready = asyncio.Event()
        self.end_status: tuple[grpc.StatusCode, str] | None = None

    def push(self, item: Any) -> None:
        if len(self._items) >= self._cap:
            self._items.popleft()
            self._metrics.subscriber_dropped.inc()
        self._items.append(item)
        self._ready.set()

    def close(self, status: tuple[grpc.StatusCode, str] | None = None) -> None:
        self.end_status = status
        self._items.append(_END)
        self._ready.set()

    async def get(self) -> Any:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


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
        self.strategy = strategy_for(config.strategy, self.federation)
        self.core = BrokerState(me.id, self.federation, self.strategy)
        self.metrics = NodeMetrics(registry)
        self.geofences = GeofenceCache(
            config.max_geofence_vertices, max_bytes=config.max_geofence_bytes
        )
        self.peer_geofences = PeerGeofenceCache()  # as the origin validated them: no limits
        self.epoch = time.time_ns()
        self._wan = _wan_matrix(config, self.federation)
        self.links = {b.id: PeerLink(self, b) for b in self.federation if b.id != me.id}
        self._streams: dict[str, _Stream] = {}
        self.trace = (
            MessageTrace(config.trace_path, me.id, config.strategy) if config.trace_path else None
        )
        self.health = health.aio.HealthServicer()
        self._client_server: grpc.aio.Server | None = None
        self._peer_server: grpc.aio.Server | None = None
        self._metrics_server: Any = None
        self.client_port = 0
        self.peer_port = 0
        self.metrics_port = 0
        self._started = False
        self._stopped = False
        self._ready = asyncio.Event()

    # -- lifecycle ---------------------------------------------------------

    async def start(self) -> None:
        """Bind the ports, start serving and dial the peers."""
        if self._started:
            return
        self._started = True
        # Batches carry many events: the per-event payload limit is enforced
        # by the servicer (RESOURCE_EXHAUSTED naming the event), not here.
        self._client_server = grpc.aio.server(options=SERVER_OPTIONS)
        _add_client_service(self._client_server, _ClientServicer(self))
        self._peer_server = grpc.aio.server(options=SERVER_OPTIONS)
        fpb_grpc.add_FederationServiceServicer_to_server(
            _FederationServicer(self), self._peer_server
        )
        for server, service in (
            (self._client_server, CLIENT_SERVICE),
            (self._peer_server, FEDERATION_SERVICE),
        ):
            health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
            reflection.enable_server_reflection(
                (service, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
        self.client_port = _bind(self._client_server, self.config.client_listen, "client_listen")
        self.peer_port = _bind(self._peer_server, self.config.peer_listen, "peer_listen")
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
        await self._client_server.start()
        await self._peer_server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(CLIENT_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.link_state_changed()
        for link in self.links.values():
            link.start()
        log.info(
            "broker %s serving: clients :%d, peers :%d, metrics :%d, strategy %s, %d peers",
            self.broker_id,
            self.client_port,
            self.peer_port,
            self.metrics_port,
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
        for stream in list(self._streams.values()):
            stream.close((grpc.StatusCode.UNAVAILABLE, "broker shutting down"))
        await asyncio.gather(*(link.drain(grace) for link in self.links.values()))
        await asyncio.gather(*(link.stop() for link in self.links.values()))
        for server in (self._client_server, self._peer_server):
            if server is not None:
                await server.stop(grace)
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

    # -- federation protocol -----------------------------------------------

    def hello(self) -> fpb.Frame:
        """Our side of the link handshake."""
        return hello_frame(
            self.broker_id,
            self.config.strategy,
            self.federation.digest,
            PROTOCOL_VERSION,
            self.epoch,
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
        if hello.federation_digest != self.federation.digest:
            return (
                f"federation mismatch: broker {hello.broker_id} has federation digest "
                f"{hello.federation_digest[:12]}, broker {self.broker_id} has "
                f"{self.federation.digest[:12]}"
            )
        return ""

    def dispatch(self, sends: Iterable[Send]) -> None:
        """Hand messages to their peer links."""
        for send in sends:
            self.links[send.dst].enqueue(send.msg)

    def count_sent(self, peer: str, msgs: list[PeerMessage], sizes: list[int]) -> None:
        """Metrics and trace for messages written to a peer."""
        m = self.metrics
        for msg, size in zip(msgs, sizes, strict=True):
            kind = msg.kind.value
            m.peer_sent.labels(peer=peer, kind=kind).inc()
            m.peer_bytes.labels(peer=peer, kind=kind).inc(size)
            if self.trace is not None:
                ids, topic = _trace_fields(msg)
                self.trace.record(peer, kind, ids, topic, size)

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
        applied = 0
        for msg in subs:
            try:
                self.core.on_message(peer, msg)
            except Exception as exc:
                self._reject(peer, msg.kind, msg.sub.id, exc)
            else:
                applied += 1
        if applied:
            self.metrics.peer_received.labels(peer=peer, kind=Kind.SUBSCRIBE.value).inc(applied)
        self._update_sub_gauges()

    def receive_frame(self, peer: str, frame: fpb.Frame) -> None:
        """Apply the messages of a frame from `peer`, in order.

        A message that cannot be converted or applied is skipped, counted in
        `geofed_peer_messages_rejected_total` and logged; it costs neither the
        rest of the frame nor the link.
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
        changed = False
        for msg in msgs:
            # Counted once applied: a scrape (another thread) that sees it
            # received sees its effects too, which the quiescence barrier needs.
            received = self.metrics.peer_received.labels(peer=peer, kind=msg.kind.value)
            try:
                if isinstance(msg, EventMsg | DeliveryMsg):
                    if link.is_duplicate(msg.kind, msg.event.id):
                        self.metrics.peer_duplicates.labels(peer=peer).inc()
                        received.inc()
                        continue
                    with self.metrics.match_seconds.time():
                        out = self.core.on_message(peer, msg)
                    self.deliver(out.deliveries, origin=peer)
                else:
                    changed = True
                    self.core.on_message(peer, msg)
            except Exception as exc:
                self._reject(peer, msg.kind, _trace_fields(msg)[0][0], exc)
                continue
            received.inc()
        if changed:
            self._update_sub_gauges()

    def _reject(self, peer: str, kind: Kind, msg_id: str, exc: Exception) -> None:
        """A message from `peer` that could not be applied (its frame goes on)."""
        if not isinstance(exc, GeofedError):  # a bug rather than bad content: keep the trace
            log.error("applying a %s from %s failed", kind.value, peer, exc_info=exc)
        self.metrics.reject_peer_message(peer, kind.value, msg_id, rejection_reason(exc))

    def wan_delay_s(self, peer: str) -> float:
        """Emulated one-way delay of messages to `peer` (0 when off)."""
        return self._wan.get(peer, 0.0)

    # -- client side -------------------------------------------------------

    def deliver(self, deliveries: list[Delivery], origin: str) -> None:
        """Push deliveries to their subscribers' streams; `origin` is the publisher's broker.

        Events and deliveries from a peer come from the publisher's broker
        (matching or forwarding happens there), so the peer is the origin.
        """
        now = time.time()
        wire: dict[int, gpb.Event] = {}  # one event reaches many subscribers: convert it once
        for d in deliveries:
            stream = self._streams.get(d.subscription)
            if stream is None:
                continue
            pb = wire.get(id(d.event))
            if pb is None:
                pb = wire[id(d.event)] = event_to_pb(d.event, origin)
            stream.push(delivery_to_pb(d.subscription, pb, now))
            self.metrics.deliveries.inc()

    def _update_sub_gauges(self) -> None:
        self.metrics.subscriptions.labels(scope="local").set(len(self.core.local))
        self.metrics.subscriptions.labels(scope="remote").set(len(self.core.remote))
        self.metrics.sessions.set(len(self.core.sessions))

    def on_reject(self, code: grpc.StatusCode) -> None:
        self.metrics.rejected.labels(code=code.name).inc()


def _bind(server: grpc.aio.Server, listen: str, field: str) -> int:
    try:
        port = int(server.add_insecure_port(listen))
    except RuntimeError as exc:
        raise InvalidInput(field, f"cannot listen on {listen}: {exc}") from None
    if port == 0:
        raise InvalidInput(field, f"cannot listen on {listen}")
    return port


def _trace_fields(msg: PeerMessage) -> tuple[list[str], str | None]:
    if isinstance(msg, EventMsg | DeliveryMsg):
        return [msg.event.id], msg.event.topic
    if isinstance(msg, SubscribeMsg):
        return [msg.sub.id], msg.sub.topic_filter
    return [msg.sub_id], None


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


def _add_client_service(server: grpc.aio.Server, servicer: _ClientServicer) -> None:
    """Register the client service as the generated code would, with lenient request decoding."""
    service = cpb.DESCRIPTOR.services_by_name["ClientService"]
    handlers = {
        m.name: _HANDLERS[m.client_streaming, m.server_streaming](
            getattr(servicer, m.name),
            request_deserializer=_lenient(getattr(cpb, m.input_type.name)),
            response_serializer=getattr(cpb, m.output_type.name).SerializeToString,
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

    async def _parse_ahead(self, pb: gpb.Geofence, field: str) -> None:
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
        cache = self.node.geofences
        too_long = cache.max_bytes is not None and len(text) > cache.max_bytes
        if len(text) < OFFLOAD_CHARS or too_long or text in cache:
            return
        fence = await asyncio.to_thread(_parse_and_write, cache, text, f"{field}.{shape}")
        cache.put(text, fence)  # no await until the conversion reads it

    def on_reject(self, code: grpc.StatusCode) -> None:
        self.node.on_reject(code)

    def _redirect(self, broker_id: str) -> cpb.ConnectResponse:
        self.node.metrics.redirects.inc()
        target = self.node.federation.broker(broker_id)
        return redirect_response(self.node.broker_id, target)

    @unary
    async def Connect(self, request: cpb.ConnectRequest, context: Any) -> cpb.ConnectResponse:
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        where = location_from_pb(request, "location", "location")
        redirect = self.node.core.connect(client, where)
        self.node._update_sub_gauges()
        if redirect is not None:
            return self._redirect(redirect)
        return accepted_response(self.node.broker_id)

    @unary
    async def UpdateLocation(
        self, request: cpb.UpdateLocationRequest, context: Any
    ) -> cpb.ConnectResponse:
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        where = location_from_pb(request, "location", "location")
        moved = self.node.core.update_location(client, where)
        if moved.redirect is None:
            return accepted_response(self.node.broker_id)
        self.node.dispatch(moved.sends)
        for sub in moved.dropped:
            stream = self.node._streams.pop(sub.id, None)
            if stream is not None:
                stream.close(
                    (
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"client moved to broker {moved.redirect}",
                    )
                )
        self.node._update_sub_gauges()
        return self._redirect(moved.redirect)

    @streaming
    async def Subscribe(
        self, request: cpb.SubscribeRequest, context: Any
    ) -> AsyncIterator[cpb.Delivery]:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        if not request.HasField("subscription"):
            raise InvalidInput("subscription", "is required")
        await self._parse_ahead(request.subscription.geofence, "subscription.geofence")
        sub = subscription_from_pb(request.subscription, node.geofences, client=client)
        sends = node.core.subscribe(sub)
        node.dispatch(sends)
        stream = _Stream(node.config.subscriber_queue_size, node.metrics)
        old = node._streams.get(sub.id)
        if old is not None:
            old.close(None)  # a newer Subscribe with this id takes over
        node._streams[sub.id] = stream
        node._update_sub_gauges()
        await context.send_initial_metadata((("geofed-broker", node.broker_id),))
        try:
            while True:
                item = await stream.get()
                if item is _END:
                    if stream.end_status is not None:
                        await context.abort(*stream.end_status)
                    return
                yield item
        finally:
            if node._streams.get(sub.id) is stream:
                # The client went away: its subscription goes too.
                del node._streams[sub.id]
                if node.core.local.get(sub.id) is not None and not node._stopped:
                    with contextlib.suppress(GeofedError):
                        node.dispatch(node.core.unsubscribe(client, sub.id))
                node._update_sub_gauges()

    @unary
    async def Unsubscribe(
        self, request: cpb.UnsubscribeRequest, context: Any
    ) -> cpb.UnsubscribeResponse:
        node = self.node
        _decoded(request, "request")
        client = validate_id(request.client, "client")
        sub_id = validate_id(request.subscription_id, "subscription_id")
        node.dispatch(node.core.unsubscribe(client, sub_id))
        stream = node._streams.pop(sub_id, None)
        if stream is not None:
            stream.close(None)
        node._update_sub_gauges()
        return unsubscribe_response(True)

    async def _event(self, pb: gpb.Event, field: str) -> Event:
        """Validate and convert one event (the node's state is not touched)."""
        node = self.node
        if len(pb.payload) > node.config.max_payload_bytes:
            raise TooLarge(f"{field}.payload", len(pb.payload), node.config.max_payload_bytes)
        await self._parse_ahead(pb.geofence, f"{field}.geofence")
        if not pb.id:
            pb.id = uuid.uuid4().hex
        pb.publish_time = time.time()
        event = event_from_pb(pb, node.geofences, field=field)
        node.core.check_publisher(event, f"{field}.publisher")
        return event

    def _publish(self, event: Event) -> str:
        node = self.node
        with node.metrics.match_seconds.time():
            out = node.core.publish(event)
        node.metrics.events_published.inc()
        node.deliver(out.deliveries, origin=node.broker_id)
        node.dispatch(out.sends)
        return event.id

    @unary
    async def Publish(self, request: cpb.PublishRequest, context: Any) -> cpb.PublishResponse:
        _decoded(request, "request")
        validate_id(request.client, "request.client")
        if not request.HasField("event"):
            raise InvalidInput("request.event", "is required")
        event = await self._event(request.event, "request.event")
        return publish_response(self._publish(event))

    async def PublishStream(
        self, request_iterator: AsyncIterator[cpb.PublishBatch], context: Any
    ) -> cpb.PublishBatchResponse:
        ids: list[str] = []
        limit = self.node.config.max_publish_batch
        async for batch in request_iterator:
            try:
                _decoded(batch, "batch")
                validate_id(batch.client, "batch.client")
                if len(ids) + len(batch.events) > limit:
                    raise TooLarge("batch.events", len(ids) + len(batch.events), limit)
                # A batch is published whole or not at all: validate it first.
                events = [
                    await self._event(pb, f"batch.events[{len(ids) + i}]")
                    for i, pb in enumerate(batch.events)
                ]
            except GeofedError as exc:
                self.on_reject(status_for(exc))
                await abort(
                    context, exc, f" (this batch was not published; {len(ids)} earlier events were)"
                )
            ids.extend(self._publish(event) for event in events)
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
        await node.links[first.hello.broker_id].accept(ContextTransport(context))


__all__ = ["BrokerServer", "FederationMismatch"]
