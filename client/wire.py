"""The wire: every conversion between geofed.v1 protobuf messages and the routing core.

This is the one module that builds protobuf messages (the broker, the client
library and the tools all go through it). Input from the wire is untrusted:
every conversion validates and names the field in its error. Geofences are
converted to polygons once, at the edge; brokers exchange them as canonical
WKT and cache the parsed shapes. A peer takes a forwarded geofence as the
origin normalized it (`PeerGeofenceCache`), and a frame from a peer is
converted message by message: one that fails is skipped and reported
(`RejectedMessage`), never the whole frame.
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import shapely
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2
from shapely.geometry import MultiPolygon, Polygon

from geofed.routing import (
    DEFAULT_MAX_VERTICES,
    STRATEGIES,
    BrokerInfo,
    DeliveryMsg,
    Event,
    EventMsg,
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
    PeerMessage,
    Phase,
    ProposeMsg,
    RelocateMsg,
    ReportMsg,
    Roaming,
    SessionMsg,
    StrategyTable,
    SubKey,
    SubscribeMsg,
    Subscription,
    TableMsg,
    TooLarge,
    UnsubscribeMsg,
    is_roaming,
    latlon,
    make_event,
    make_subscription,
    parse_roaming,
    validate_filter,
    validate_id,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb

BROKER_METADATA = "geofed-broker"
"""Initial metadata a broker sends on Subscribe once it holds the subscription (its id)."""
BATCH_METADATA = ("geofed-batch", "1")
"""Subscribe call metadata: the client reads batched deliveries (`Delivery.batch`)."""
CLIENT_SERVICE: str = cpb.DESCRIPTOR.services_by_name["ClientService"].full_name
"""Full name of the client gRPC service (also its health-check service name)."""
FEDERATION_SERVICE: str = fpb.DESCRIPTOR.services_by_name["FederationService"].full_name
"""Full name of the broker-to-broker gRPC service (also its health-check service name)."""


def geofence_from_pb(pb: gpb.Geofence, field: str, cache: GeofenceCache) -> Geofence | None:
    """The geofence a message carries (an unset one is the whole world); text via `cache`."""
    shape = pb.WhichOneof("shape")
    if shape is None:
        return None
    if shape == "roaming":
        raise InvalidInput(
            f"{field}.roaming", "a roaming geofence is accepted only as a subscription geofence"
        )
    if shape == "circle":
        c = pb.circle
        if not c.HasField("center"):
            raise InvalidInput(f"{field}.circle.center", "is required")
        return cache.get(
            {"circle": {"lat": c.center.lat, "lon": c.center.lon, "radius_m": c.radius_m}},
            field,
        )
    fence = cache.get(pb.wkt if shape == "wkt" else pb.geojson, f"{field}.{shape}")
    if fence is None:
        raise InvalidInput(
            f"{field}.{shape}", "must not be empty (leave the geofence unset for the world)"
        )
    return fence


def location_from_pb(msg: object, name: str, field: str) -> LatLon:
    """A required LatLon field of `msg`."""
    if not msg.HasField(name):  # type: ignore[attr-defined]
        raise InvalidInput(field, "is required")
    pb = getattr(msg, name)
    return latlon(pb.lat, pb.lon, field)


GeofenceInput = Geofence | Roaming | str | Mapping[str, Any] | None
"""A geofence as users give it: parsed, WKT or GeoJSON text, a GeoJSON or circle mapping.

Subscription geofences may also roam: a `Roaming`, ``roam:circle:R`` /
``roam:polygon:E N, ...`` text or a ``{"roaming": {...}}`` mapping (`parse_roaming`).
"""


def roaming_from_pb(
    pb: gpb.Roaming, field: str, max_vertices: int = DEFAULT_MAX_VERTICES
) -> Roaming:
    """A roaming geofence from the wire; errors name ``field.roaming...``."""
    shape = pb.WhichOneof("shape")
    if shape == "radius_m":
        return parse_roaming({"roaming": {"radius_m": pb.radius_m}}, field)
    if shape == "polygon":
        if len(pb.polygon.vertices) > max_vertices:  # counted before any is looked at
            raise InvalidInput(
                f"{field}.roaming.polygon",
                f"more than {max_vertices} vertices ({len(pb.polygon.vertices)})",
            )
        ring = [[v.east_m, v.north_m] for v in pb.polygon.vertices]
        return parse_roaming({"roaming": {"polygon": ring}}, field, max_vertices=max_vertices)
    raise InvalidInput(f"{field}.roaming", "needs radius_m or polygon")


def roaming_to_pb(shape: Roaming) -> gpb.Roaming:
    """Wire form of a roaming geofence."""
    if shape.radius_m is not None:
        return gpb.Roaming(radius_m=shape.radius_m)
    return gpb.Roaming(
        polygon=gpb.RoamingPolygon(
            vertices=[gpb.Offset(east_m=e, north_m=n) for e, n in shape.ring]
        )
    )


def location_from_text(text: str, field: str) -> LatLon:
    """A location written ``LAT,LON`` in decimal degrees (the command line, MQTT).

    Raises:
        InvalidInput: naming `field`.
    """
    parts = text.split(",")
    try:
        if len(parts) != 2:
            raise ValueError(text)
        lat, lon = (float(p) for p in parts)
    except ValueError:
        raise InvalidInput(field, f"expected LAT,LON (two numbers), got {text!r}") from None
    return latlon(lat, lon, field)


def geofence_from_text(text: str, field: str) -> GeofenceInput:
    """A geofence written as text (the command line, MQTT), in `GeofenceInput` form.

    Empty text and ``world`` are None (the whole world); ``circle:LAT,LON,RADIUS_M``
    is a circle mapping; ``roam:circle:RADIUS_M`` and ``roam:polygon:E N, E N, ...``
    a roaming geofence (`parse_roaming`; subscriptions only); anything else is
    WKT or GeoJSON text, validated where it is parsed.

    Raises:
        InvalidInput: a malformed circle or roaming geofence, naming `field`.
    """
    stripped = text.strip()
    if not stripped or stripped.lower() == "world":
        return None
    if is_roaming(stripped):
        return parse_roaming(stripped, field)
    if stripped.lower().startswith("circle:"):
        try:
            lat, lon, radius = (float(v) for v in stripped[len("circle:") :].split(","))
        except ValueError:
            raise InvalidInput(
                field, f"expected circle:LAT,LON,RADIUS_M (three numbers), got {text!r}"
            ) from None
        if not math.isfinite(radius):
            raise InvalidInput(field, f"circle radius must be a number of metres, got {text!r}")
        return {"circle": {"lat": lat, "lon": lon, "radius_m": radius}}
    return text


def geofence_to_pb(fence: GeofenceInput) -> gpb.Geofence:
    """Wire form of a geofence; unset for the whole world (None).

    A parsed `Geofence` goes as canonical WKT; text goes as written (GeoJSON
    if it starts with ``{``, else WKT) and mappings as GeoJSON or a circle
    (``{"circle": {"lat", "lon", "radius_m"}}``), for the broker to validate.
    """
    if fence is None:
        return gpb.Geofence()
    if isinstance(fence, Geofence):
        return gpb.Geofence(wkt=fence.wkt)
    if isinstance(fence, Roaming) or is_roaming(fence):
        return gpb.Geofence(roaming=roaming_to_pb(parse_roaming(fence)))
    if isinstance(fence, str):
        text = fence.strip()
        return gpb.Geofence(geojson=text) if text.startswith("{") else gpb.Geofence(wkt=text)
    circle = fence.get("circle")
    if isinstance(circle, Mapping):
        return gpb.Geofence(
            circle=gpb.Circle(
                center=gpb.LatLon(lat=circle.get("lat", math.nan), lon=circle.get("lon", math.nan)),
                radius_m=circle.get("radius_m", math.nan),
            )
        )
    return gpb.Geofence(geojson=json.dumps(fence))


def latlon_to_pb(p: LatLon) -> gpb.LatLon:
    """Wire form of a point."""
    return gpb.LatLon(lat=p.lat, lon=p.lon)


def event_from_pb(
    pb: gpb.Event, cache: GeofenceCache, *, field: str = "event", max_payload: int | None = None
) -> Event:
    """Validate an event from the wire."""
    location = location_from_pb(pb, "publisher", f"{field}.publisher")
    fence = geofence_from_pb(pb.geofence, f"{field}.geofence", cache)  # unset: the world
    if max_payload is not None and len(pb.payload) > max_payload:
        raise TooLarge(f"{field}.payload", len(pb.payload), max_payload)
    payload = pb.payload
    return make_event(
        pb.id,
        pb.topic,
        location,
        fence,
        payload_size=len(payload),
        t=pb.publish_time,
        payload=bytes(payload),
        field=field,
    )


def event_to_pb(ev: Event, origin: str = "") -> gpb.Event:
    """Wire form of an event (geofence as canonical WKT)."""
    return gpb.Event(
        id=ev.id,
        topic=ev.topic,
        payload=ev.payload,
        publisher=latlon_to_pb(ev.location),
        geofence=geofence_to_pb(ev.geofence),
        publish_time=ev.t,
        origin=origin,
    )


def subscription_from_pb(
    pb: gpb.Subscription,
    cache: GeofenceCache,
    *,
    client: str | None = None,
    field: str = "subscription",
) -> Subscription:
    """Validate a subscription from the wire; `client` fills an empty client field.

    A roaming geofence gives an unplaced roaming subscription (its broker places it).
    """
    owner = pb.client or client or ""
    if client is not None and pb.client and pb.client != client:
        raise InvalidInput(
            f"{field}.client", f"{pb.client!r} differs from the session's client {client!r}"
        )
    fence: Geofence | Roaming | None
    if pb.geofence.WhichOneof("shape") == "roaming":
        fence = roaming_from_pb(pb.geofence.roaming, f"{field}.geofence", cache.max_vertices)
    else:
        fence = geofence_from_pb(pb.geofence, f"{field}.geofence", cache)  # unset: the world
    return make_subscription(pb.id, owner, pb.topic_filter, fence, field=field)


def subscription_to_pb(sub: Subscription) -> gpb.Subscription:
    """Wire form of a subscription (a roaming one as its shape, not its placement)."""
    return gpb.Subscription(
        id=sub.id,
        client=sub.client,
        topic_filter=sub.topic_filter,
        geofence=geofence_to_pb(sub.roaming if sub.roaming is not None else sub.geofence),
    )


def remote_subscription_to_pb(msg: SubscribeMsg) -> fpb.RemoteSubscription:
    """A subscription as it goes to a peer: with its home and, roaming, where it is placed."""
    pb = fpb.RemoteSubscription(subscription=subscription_to_pb(msg.sub), home=msg.home)
    if msg.sub.at is not None:
        pb.at.CopyFrom(latlon_to_pb(msg.sub.at))
    return pb


# -- the broker side of the client service ------------------------------------


def accepted_response(
    broker_id: str, session_present: bool = False, session_expiry_s: float = 0.0
) -> cpb.ConnectResponse:
    """The session stays at this broker (with the persistence it was granted)."""
    return cpb.ConnectResponse(
        broker_id=broker_id,
        accepted=True,
        session_present=session_present,
        session_expiry_s=session_expiry_s,
    )


def redirect_response(
    broker_id: str, target: BrokerInfo, held_s: float = 0.0
) -> cpb.ConnectResponse:
    """The client must go to `target` (the broker responsible for its location).

    `held_s` > 0: this broker keeps matching for the client until it leaves
    (`leave_request`), for at most that long.
    """
    return cpb.ConnectResponse(
        broker_id=broker_id,
        accepted=False,
        redirect=cpb.Redirect(broker_id=target.id, endpoint=target.client_endpoint),
        held_s=held_s,
    )


def delivery_to_pb(
    subscription_id: str,
    event: gpb.Event,
    deliver_time: float,
    offset: int = 0,
    filter_scheme: str = "",
) -> cpb.Delivery:
    """One delivery on a Subscribe stream (`event` already in wire form, shared);
    `filter_scheme` names an approximate scheme that matched it ("": exact)."""
    return cpb.Delivery(
        subscription_id=subscription_id,
        event=event,
        deliver_time=deliver_time,
        offset=offset,
        filter_scheme=filter_scheme,
    )


def delivery_batch(items: list[cpb.Delivery]) -> cpb.Delivery:
    """One stream message for many deliveries (a single one is sent as it is)."""
    if len(items) == 1:
        return items[0]
    return cpb.Delivery(batch=items)


def deliveries_in(pb: cpb.Delivery) -> Iterable[cpb.Delivery]:
    """The deliveries a Subscribe stream message carries: a batch, or itself."""
    return pb.batch if pb.batch else (pb,)


def delivery_from_bytes(data: bytes) -> cpb.Delivery:
    """A delivery the broker stored (`delivery_to_pb` serialized)."""
    return cpb.Delivery.FromString(data)


def leave_response(held: bool) -> cpb.LeaveResponse:
    """Whether a held handover ended (`leave_request`)."""
    return cpb.LeaveResponse(held=held)


def unsubscribe_response(existed: bool) -> cpb.UnsubscribeResponse:
    """Answer to Unsubscribe."""
    return cpb.UnsubscribeResponse(existed=existed)


def publish_response(event_id: str) -> cpb.PublishResponse:
    """Answer to Publish: the id of the accepted event."""
    return cpb.PublishResponse(event_id=event_id)


def publish_result(event_id: str) -> cpb.PublishResult:
    """Answer to one PublishEach request: the id of the accepted event."""
    return cpb.PublishResult(event_id=event_id)


def publish_refused(code: int, details: str, error: str) -> cpb.PublishResult:
    """Answer to one PublishEach request that was refused: the status a unary
    `Publish` would have ended with (`error`: the typed error record, JSON)."""
    return cpb.PublishResult(refused=cpb.Refusal(code=code, details=details, error=error))


def publish_batch_response(event_ids: list[str]) -> cpb.PublishBatchResponse:
    """Answer to PublishStream: every accepted event id, in order."""
    return cpb.PublishBatchResponse(accepted=len(event_ids), event_ids=event_ids)


# -- broker to broker ---------------------------------------------------------


def hello_frame(
    broker_id: str,
    strategy: str,
    federation_digest: str,
    protocol_version: int,
    epoch: int,
    finished_table: StrategyTable | None = None,
    adaptive: str = "off",
) -> fpb.Frame:
    """The first frame on a link, each way (`finished_table`: protocol 4; `adaptive`: the
    node's `NodeConfig.adaptive_digest`)."""
    return fpb.Frame(
        hello=fpb.Hello(
            broker_id=broker_id,
            strategy=strategy,
            federation_digest=federation_digest,
            protocol_version=protocol_version,
            epoch=epoch,
            finished_table=None if finished_table is None else table_to_pb(finished_table),
            adaptive=adaptive,
        )
    )


def table_to_pb(table: StrategyTable) -> gpb.StrategyTable:
    """Wire form of a per-topic strategy table."""
    return gpb.StrategyTable(
        epoch=table.epoch,
        default_strategy=table.default,
        entries=[
            gpb.StrategyEntry(topic_filter=f, strategy=s, adaptive=f in table.adaptive)
            for f, s in table.entries
        ],
    )


def table_from_pb(pb: gpb.StrategyTable, field: str = "table") -> StrategyTable:
    """A strategy table from the wire (validated; an error names `field`'s part)."""
    try:
        return StrategyTable.build(
            pb.default_strategy,
            [(e.topic_filter, e.strategy) for e in pb.entries],
            pb.epoch,
            [e.topic_filter for e in pb.entries if e.adaptive],
        )
    except InvalidInput as exc:
        raise exc.within(field) from None


def strategy_state_response(
    broker_id: str,
    table: StrategyTable,
    newest: StrategyTable,
    in_transition: bool,
    sequencer: str,
) -> cpb.StrategyState:
    """Answer to SetStrategy and GetStrategy: one broker's view of the table."""
    return cpb.StrategyState(
        broker_id=broker_id,
        table=table_to_pb(table),
        newest=table_to_pb(newest),
        in_transition=in_transition,
        sequencer=sequencer,
    )


def set_strategy_request(topic_filter: str, strategy: str | None) -> cpb.SetStrategyRequest:
    """A SetStrategy request, checked here as the broker will (errors name the field)."""
    StrategyTable("event-geofence").with_entry(topic_filter, strategy)
    return cpb.SetStrategyRequest(topic_filter=topic_filter, strategy=strategy or "")


def get_strategy_request() -> cpb.GetStrategyRequest:
    """A GetStrategy request (it has no fields)."""
    return cpb.GetStrategyRequest()


def strategy_state_from_pb(pb: cpb.StrategyState) -> dict[str, Any]:
    """A broker's StrategyState as JSON-ready data (what ``geofed strategy show`` prints)."""
    return {
        "broker": pb.broker_id,
        "sequencer": pb.sequencer,
        "in_transition": pb.in_transition,
        "table": table_from_pb(pb.table, "table").to_dict(),
        "newest": table_from_pb(pb.newest, "newest").to_dict(),
    }


def _table_msg(pb: fpb.TableState) -> TableMsg:
    if pb.phase not in tuple(Phase):
        raise InvalidInput("tables.phase", f"unknown phase {pb.phase}")
    return TableMsg(table_from_pb(pb.table, "tables.table"), Phase(pb.phase))


def refuse_frame(reason: str) -> fpb.Frame:
    """The answer to a hello that is refused (mismatched strategy or federation)."""
    return fpb.Frame(refuse_reason=reason)


def new_frame() -> fpb.Frame:
    """An empty frame, to fill with `add_to_frame` (sent empty, it is a heartbeat)."""
    return fpb.Frame()


def ack_frame(seq: int) -> fpb.Frame:
    """A control frame acknowledging every frame up to `seq`."""
    return fpb.Frame(ack=fpb.Ack(seq=seq))


def snapshot_frames(
    subs: list[SubscribeMsg], soft_limit: int
) -> Iterable[tuple[fpb.Frame, list[SubscribeMsg], list[int]]]:
    """The subscription snapshot in frames of about `soft_limit` bytes.

    Yields (frame, the messages in it, their sizes); the first frame replaces
    what the peer held, the following ones (``continued``) add to it. An empty
    snapshot is one empty frame.
    """
    start = 0
    while True:
        snap = fpb.SubscriptionSnapshot(continued=start > 0)
        sizes: list[int] = []
        total, end = 0, start
        while end < len(subs) and total < soft_limit:
            m = subs[end]
            pb = snap.subscriptions.add()
            pb.CopyFrom(remote_subscription_to_pb(m))
            sizes.append(int(pb.ByteSize()))
            total += sizes[-1]
            end += 1
        yield fpb.Frame(snapshot=snap), subs[start:end], sizes
        start = end
        if start >= len(subs):
            return


class PeerGeofenceCache(GeofenceCache):
    """Geofences in messages from peer brokers: the origin's validated, normalized shape.

    The broker where a geofence entered validated it against its own limits
    and normalized it (a circle densified, a polygon cut at the antimeridian)
    before forwarding it as canonical WKT. A peer takes that shape as it is,
    without applying client rules to it again: the cut can add vertices beyond
    `max_geofence_vertices`, a tiny circle or a cut polygon need not pass
    validation a second time, and the peer's limits may differ from the
    origin's. Whatever the origin accepted, every peer accepts. Only the
    structure is checked: the text must be a WKT POLYGON or MULTIPOLYGON.

    Other notations (brokers do not send them) are validated as client input,
    without a vertex limit. Keep this cache apart from the one for client
    input, whose hits must have passed client validation. Bounded: at most
    `size` texts of together at most `text_budget` characters (the newest is
    kept whatever its length); the least recently used goes first.
    """

    def __init__(self, size: int = 8192, text_budget: int = 64 << 20) -> None:
        super().__init__(max_vertices=sys.maxsize, size=size)
        self._trusted: OrderedDict[str, Geofence] = OrderedDict()
        self._trusted_size = size
        self._text_budget = text_budget
        self._text_chars = 0

    def get(self, value: Any, field: str = "geofence") -> Geofence | None:
        """The shape of a forwarded geofence (canonical WKT), parsed once per text."""
        if not isinstance(value, str) or not value.strip() or value.lstrip().startswith("{"):
            return super().get(value, field)
        hit = self._trusted.get(value)
        if hit is not None:
            self._trusted.move_to_end(value)
            return hit
        fence = _canonical_wkt(value, field)
        self._trusted[value] = fence
        self._text_chars += len(value)
        while len(self._trusted) > 1 and (
            len(self._trusted) > self._trusted_size or self._text_chars > self._text_budget
        ):
            evicted, _ = self._trusted.popitem(last=False)
            self._text_chars -= len(evicted)
        return fence


def _canonical_wkt(text: str, field: str) -> Geofence:
    """A geofence from the canonical WKT another broker made of a validated shape."""
    try:
        geom = shapely.from_wkt(text)
    except (shapely.errors.GEOSException, ValueError) as exc:
        raise InvalidInput(field, f"unparsable WKT: {str(exc)[:200]}") from None
    if not isinstance(geom, Polygon | MultiPolygon):
        raise InvalidInput(field, f"must be a POLYGON or MULTIPOLYGON, got {geom.geom_type}")
    return Geofence(geom)


@dataclass(frozen=True, slots=True)
class RejectedMessage:
    """A message of a peer's frame that was skipped: it could not be converted or applied.

    Attributes:
        kind: its kind (the metric label).
        id: the event id (events, deliveries) or subscription id ("" when it has none).
        reason: why, with the offending field.
    """

    kind: Kind
    id: str
    reason: str


def rejection_reason(exc: BaseException) -> str:
    """The reason logged for a rejected peer message (a GeofedError's text names the field)."""
    return str(exc) if isinstance(exc, GeofedError) else f"{type(exc).__name__}: {exc}"


_Pb = TypeVar("_Pb")
_Msg = TypeVar("_Msg")


def _each(
    items: Iterable[_Pb],
    kind: Kind,
    id_of: Callable[[_Pb], str],
    convert: Callable[[_Pb], _Msg],
    rejected: list[RejectedMessage] | None,
) -> Iterator[_Msg]:
    """`convert` each item; one that fails goes to `rejected` (raises without it)."""
    for item in items:
        try:
            yield convert(item)
        except Exception as exc:
            if rejected is None:
                raise
            rejected.append(RejectedMessage(kind, id_of(item), rejection_reason(exc)))


def _subscribe_msg(rs: fpb.RemoteSubscription, cache: GeofenceCache) -> SubscribeMsg:
    sub = subscription_from_pb(rs.subscription, cache)
    if sub.roaming is not None:
        sub = sub.placed(location_from_pb(rs, "at", "subscribe.at"))
    return SubscribeMsg(sub, rs.home)


def _relocate_msg(rl: fpb.Relocation) -> RelocateMsg:
    return RelocateMsg(
        (rl.client, rl.subscription_id), rl.home, location_from_pb(rl, "at", "relocate.at")
    )


def _subscription_id(rs: fpb.RemoteSubscription) -> str:
    return str(rs.subscription.id)


def snapshot_from_frame(
    frame: fpb.Frame, cache: GeofenceCache, rejected: list[RejectedMessage] | None = None
) -> list[SubscribeMsg]:
    """The subscriptions a snapshot frame carries, in order.

    `cache` is the receiving broker's `PeerGeofenceCache`. An entry that
    cannot be converted is skipped and appended to `rejected`; without
    `rejected` it raises its error instead.
    """
    return list(
        _each(
            frame.snapshot.subscriptions,
            Kind.SUBSCRIBE,
            _subscription_id,
            lambda rs: _subscribe_msg(rs, cache),
            rejected,
        )
    )


FRAME_RANK = {
    "subscribe": 0,
    "unsubscribe": 1,
    "relocate": 2,
    "event": 3,
    "delivery": 4,
    "transition": 5,
    "control": 6,  # adaptive-controller reports, handover flushes, handoffs, session transfers
}
"""Application order of message kinds within one frame."""

# A frame keeps the messages of one kind in fields of their own, applied in field
# order: tables before proposals, then reports, flushes, handoffs, sessions.
_FIELD_RANK: dict[type, int] = {
    TableMsg: 0,
    ProposeMsg: 1,
    ReportMsg: 0,
    FlushMsg: 1,
    HandoffMsg: 2,
    SessionMsg: 3,
}


def frame_rank(msg: PeerMessage) -> tuple[int, int]:
    """Where `msg` is applied in a frame: by kind (`FRAME_RANK`), then by the field that
    carries it. A sender starts a new frame rather than put a message behind one of a
    later rank, so a frame is applied in the order it was sent (a session transfer
    before the handoff sent after it, say)."""
    return FRAME_RANK[msg.kind.value], _FIELD_RANK.get(type(msg), 0)


def add_to_frame(frame: fpb.Frame, msg: PeerMessage, origin: str) -> int:
    """Append one logical message to a frame; return its serialized size."""
    pb: ProtoMessage
    if isinstance(msg, EventMsg):
        pb = event_to_pb(msg.event, origin)
        frame.events.append(pb)
    elif isinstance(msg, SubscribeMsg):
        pb = remote_subscription_to_pb(msg)
        frame.subscribes.append(pb)
    elif isinstance(msg, RelocateMsg):
        client, sub_id = msg.key
        pb = fpb.Relocation(
            client=client, subscription_id=sub_id, home=msg.home, at=latlon_to_pb(msg.at)
        )
        frame.relocations.append(pb)
    elif isinstance(msg, UnsubscribeMsg):
        client, sub_id = msg.key
        pb = fpb.Unsubscription(subscription_id=sub_id, home=msg.home, client=client)
        frame.unsubscribes.append(pb)
    elif isinstance(msg, TableMsg):
        pb = fpb.TableState(table=table_to_pb(msg.table), phase=int(msg.phase))
        frame.tables.append(pb)
    elif isinstance(msg, ProposeMsg):
        pb = fpb.StrategyProposal(topic_filter=msg.topic_filter, strategy=msg.strategy or "")
        frame.proposals.append(pb)
    elif isinstance(msg, ReportMsg):
        pb = report_to_pb(msg)
        frame.reports.append(pb)
    elif isinstance(msg, FlushMsg):
        pb = fpb.Flush(token=msg.token, reply=msg.reply)
        frame.flushes.append(pb)
    elif isinstance(msg, HandoffMsg):
        client, sub_id = msg.key
        pb = fpb.QueueHandoff(
            id=msg.id,
            subscription=fpb.SubscriptionRef(client=client, id=sub_id),
            deliveries=msg.deliveries,
        )
        frame.handoffs.append(pb)
    elif isinstance(msg, SessionMsg):
        pb = fpb.SessionTransfer(
            token=msg.token,
            client=msg.client,
            owner=msg.owner,
            at=latlon_to_pb(msg.at),
            expiry_s=msg.expiry_s,
            subscriptions=[remote_subscription_to_pb(SubscribeMsg(s, "")) for s in msg.subs],
            mqtt_qos=dict(msg.qos),
            queued=[
                fpb.QueuedEvents(subscription_id=sub_id, event_ids=ids)
                for sub_id, ids in msg.queued
            ],
        )
        frame.sessions.append(pb)
    else:
        # A delivery to a busy broker names many subscriptions: its encoding
        # is joined from cached encoded references and parsed in C, 2.5x
        # faster with 80 than adding them one by one.
        data = _delivery_bytes(msg, origin)
        frame.deliveries.add().MergeFromString(data)
        return len(data)
    return int(pb.ByteSize())


class EncodedFrame:
    """A frame being built to be sent, its deliveries kept encoded.

    A peer link's frames are mostly deliveries naming ~80 subscriptions each
    (a world-wide event at a broker holding 100,000). `add_to_frame` parses
    each into the frame, which serializing then encodes again: 10 µs per
    delivery on the benchmark machine against 2 µs when its bytes are kept and
    appended behind the rest of the frame (`SerializeToString`). The bytes on
    the wire are a valid `Frame` either way (a repeated field's entries may
    follow the other fields; their order among themselves is kept), so a
    peer reads them as before. Whatever sends one needs a serializer that
    calls its `SerializeToString` (`wire_bytes`), not `Frame`'s.
    """

    __slots__ = ("deliveries", "frame")

    def __init__(self, frame: fpb.Frame | None = None) -> None:
        self.frame = frame if frame is not None else new_frame()
        self.deliveries: list[bytes] = []  # encoded as `Frame.deliveries` fields

    def add(self, msg: PeerMessage, origin: str) -> int:
        """`add_to_frame` for this frame; a delivery stays encoded."""
        if not isinstance(msg, DeliveryMsg):
            return add_to_frame(self.frame, msg, origin)
        data = _delivery_bytes(msg, origin)
        self.deliveries.append(_DELIVERY_TAG + _varint(len(data)) + data)
        return len(data)

    def SerializeToString(self) -> bytes:  # protobuf's name: gRPC serializes by it
        """The frame's wire form: its fields, then the encoded deliveries."""
        head: bytes = self.frame.SerializeToString()
        return head + b"".join(self.deliveries) if self.deliveries else head


def wire_bytes(msg: ProtoMessage | EncodedFrame) -> bytes:
    """A gRPC serializer for any message, an `EncodedFrame` too (the node's and its links')."""
    data: bytes = msg.SerializeToString()
    return data


_DELIVERY_TAG = bytes([fpb.Frame.DESCRIPTOR.fields_by_name["deliveries"].number << 3 | 2])
_EVENT_TAG = bytes([fpb.EventDelivery.DESCRIPTOR.fields_by_name["event"].number << 3 | 2])


def _varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a length."""
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _delivery_bytes(msg: DeliveryMsg, origin: str) -> bytes:
    """A delivery message encoded as an `EventDelivery`.

    The references are joined from cached encodings; the leading block of
    the topic's world subscriptions at that home (`DeliveryMsg.world`, the
    same tuple for every event of the topic) is cached joined.
    """
    # `EventDelivery.event` written by hand around the event's own encoding: the
    # message built around it copied the event into it first (a third of the cost).
    event: bytes = event_to_pb(msg.event, origin).SerializeToString()
    data = _EVENT_TAG + _varint(len(event)) + event
    n = len(msg.world)
    if n:
        return data + _world_block(msg.world) + _ref_fields(msg.subs[n:])
    return data + _ref_fields(msg.subs)


_BLOCKS: dict[int, tuple[tuple[SubKey, ...], bytes]] = {}  # id(world keys) -> (them, encoded)
_BLOCKS_SIZE = 4096  # cached world blocks (all forgotten when full)


def _world_block(keys: tuple[SubKey, ...]) -> bytes:
    """The encoded references of a world block, joined once per tuple (by identity)."""
    got = _BLOCKS.get(id(keys))
    if got is not None and got[0] is keys:
        return got[1]
    if len(_BLOCKS) >= _BLOCKS_SIZE:
        _BLOCKS.clear()
    data = _ref_fields(keys)
    _BLOCKS[id(keys)] = (keys, data)  # holding the tuple keeps its id from being reused
    return data


_REFS: dict[SubKey, bytes] = {}
_REFS_SIZE = 1 << 16  # cached references (all forgotten when full)


def _ref_fields(keys: tuple[SubKey, ...]) -> bytes:
    """Subscription references encoded as fields of `EventDelivery`, joined.

    Each reference's encoding is cached: the same subscriptions (above all
    the world-wide ones of a topic) are named by delivery after delivery. A
    plain dict read through `map` rather than `functools.lru_cache`: the
    LRU bookkeeping made each of a delivery's ~80 look-ups cost twice as much.
    """
    try:
        return b"".join(map(_REFS.__getitem__, keys))
    except KeyError:
        if len(_REFS) >= _REFS_SIZE:
            _REFS.clear()
        for key in keys:
            if key not in _REFS:
                client, sub_id = key
                ref = fpb.SubscriptionRef(client=client, id=sub_id)
                _REFS[key] = fpb.EventDelivery(subscriptions=[ref]).SerializeToString()
        return b"".join(map(_REFS.__getitem__, keys))


def message_to_bytes(msg: PeerMessage, origin: str) -> bytes:
    """One peer message in stored form: a frame holding only it.

    Built as the links build theirs (`EncodedFrame`): a delivery is encoded
    from its cached parts instead of parsed into a `Frame` and encoded again.
    """
    frame = EncodedFrame()
    frame.add(msg, origin)
    return frame.SerializeToString()


def message_from_bytes(data: bytes, cache: GeofenceCache) -> PeerMessage:
    """A message `message_to_bytes` stored (`cache`: the node's `PeerGeofenceCache`).

    Raises:
        InvalidInput: `data` does not hold exactly one valid message.
    """
    try:
        frame = fpb.Frame.FromString(data)
    except Exception as exc:
        raise InvalidInput("stored message", f"not a valid frame: {exc}") from None
    msgs = messages_from_frame(frame, cache)
    if len(msgs) != 1:
        raise InvalidInput("stored message", f"holds {len(msgs)} messages, not 1")
    return msgs[0]


def messages_from_frame(
    frame: fpb.Frame, cache: GeofenceCache, rejected: list[RejectedMessage] | None = None
) -> list[PeerMessage]:
    """The logical messages of a frame, in the order they are applied.

    A frame applies subscribes, then unsubscribes, relocations, events,
    deliveries, strategy tables and proposals, then control traffic (reports,
    handover flushes, queue handoffs, session transfers); senders start a new
    frame rather than put a message behind one of a later rank (`frame_rank`),
    so this order is the order sent.

    `cache` is the receiving broker's `PeerGeofenceCache`. A message that
    cannot be converted is skipped and appended to `rejected`, and the others
    keep their order: one message never costs the rest of its frame. Without
    `rejected` the first such message raises its error instead.
    """
    out: list[PeerMessage] = []
    out.extend(
        _each(
            frame.subscribes,
            Kind.SUBSCRIBE,
            _subscription_id,
            lambda rs: _subscribe_msg(rs, cache),
            rejected,
        )
    )
    out.extend(
        UnsubscribeMsg((us.client, us.subscription_id), us.home) for us in frame.unsubscribes
    )
    out.extend(
        _each(
            frame.relocations,
            Kind.RELOCATE,
            lambda rl: str(rl.subscription_id),
            _relocate_msg,
            rejected,
        )
    )
    out.extend(
        _each(
            frame.events,
            Kind.EVENT,
            lambda ev: str(ev.id),
            lambda ev: EventMsg(event_from_pb(ev, cache)),
            rejected,
        )
    )
    out.extend(
        _each(
            frame.deliveries,
            Kind.DELIVERY,
            lambda d: str(d.event.id),
            lambda d: DeliveryMsg(
                event_from_pb(d.event, cache, field="delivery.event"),
                tuple((ref.client, ref.id) for ref in d.subscriptions),
            ),
            rejected,
        )
    )
    # Tables and proposals: applied last (FRAME_RANK), validated when applied.
    out.extend(
        _each(frame.tables, Kind.TRANSITION, lambda t: str(t.table.epoch), _table_msg, rejected)
    )
    out.extend(ProposeMsg(p.topic_filter, p.strategy or None) for p in frame.proposals)
    out.extend(
        _each(frame.reports, Kind.CONTROL, lambda r: str(r.window), report_from_pb, rejected)
    )
    out.extend(FlushMsg(int(f.token), f.reply) for f in frame.flushes)
    out.extend(
        HandoffMsg(h.id, (h.subscription.client, h.subscription.id), tuple(h.deliveries))
        for h in frame.handoffs
    )
    out.extend(
        _each(
            frame.sessions,
            Kind.CONTROL,
            lambda st: st.client,
            lambda st: _session_msg(st, cache),
            rejected,
        )
    )
    return out


def _session_msg(st: fpb.SessionTransfer, cache: GeofenceCache) -> SessionMsg:
    validate_id(st.client, "session.client")
    if not (math.isfinite(st.expiry_s) and st.expiry_s > 0):
        raise InvalidInput("session.expiry_s", f"must be a number > 0, got {st.expiry_s!r}")
    subs = tuple(_subscribe_msg(rs, cache).sub for rs in st.subscriptions)
    for sub in subs:
        if sub.client != st.client:
            raise InvalidInput(
                "session.subscriptions.client", f"{sub.client!r} is not {st.client!r}"
            )
    qos = tuple(sorted((sub_id, int(q)) for sub_id, q in st.mqtt_qos.items()))
    for _, q in qos:
        if q > 1:
            raise InvalidInput("session.mqtt_qos", f"QoS {q}: at most 1")
    sub_ids = {sub.id for sub in subs}
    queued = []
    for entry in st.queued:
        if entry.subscription_id not in sub_ids:
            raise InvalidInput(
                "session.queued.subscription_id",
                f"{entry.subscription_id!r} is not a subscription of the session",
            )
        for event_id in entry.event_ids:
            validate_id(event_id, "session.queued.event_ids")
        queued.append((entry.subscription_id, tuple(entry.event_ids)))
    return SessionMsg(
        int(st.token),
        st.client,
        st.owner,
        location_from_pb(st, "at", "session.at"),
        float(st.expiry_s),
        subs,
        qos,
        tuple(queued),
    )


def report_to_pb(msg: ReportMsg) -> fpb.AdaptiveReport:
    """An adaptive-controller report (docs/design.md §13)."""
    return fpb.AdaptiveReport(
        window=msg.window,
        keys=[
            fpb.KeyShare(
                key=w.key,
                strategy=w.strategy,
                events=w.events,
                subscribes=w.subscribes,
                unsubscribes=w.unsubscribes,
                event_reach=w.event_reach,
                subscription_reach=w.subscription_reach,
                predicted=[
                    fpb.StrategyCount(strategy=s, messages=n) for s, n in w.predicted.items()
                ],
                moved=[fpb.StrategyCount(strategy=s, messages=n) for s, n in w.moved.items()],
            )
            for w in msg.shares
        ],
    )


def report_from_pb(pb: fpb.AdaptiveReport) -> ReportMsg:
    """A report from a peer, checked: keys are topic filters, strategies known ones.

    Raises:
        InvalidInput: naming the field (``reports.keys[i].…``).
    """
    shares = []
    for i, k in enumerate(pb.keys):
        where = f"reports.keys[{i}]"
        validate_filter(k.key, f"{where}.key")
        counts: list[dict[str, int]] = []
        for name in ("predicted", "moved"):
            out: dict[str, int] = {}
            for c in getattr(k, name):
                if c.strategy not in STRATEGIES:
                    raise InvalidInput(f"{where}.{name}.strategy", f"unknown {c.strategy!r}")
                out[c.strategy] = int(c.messages)
            counts.append(out)
        shares.append(
            KeyWindow(
                k.key,
                k.strategy,
                events=k.events,
                subscribes=k.subscribes,
                unsubscribes=k.unsubscribes,
                event_reach=k.event_reach,
                subscription_reach=k.subscription_reach,
                predicted=counts[0],
                moved=counts[1],
            )
        )
    return ReportMsg(int(pb.window), tuple(shares))


# -- message history (docs/design.md §10) ----------------------------------------


def history_record_to_pb(record: HistoryRecord) -> gpb.Event:
    """Wire form of a history entry: the event as its broker logged it."""
    event = Event(
        record.event_id,
        record.topic,
        record.location,
        record.geofence,
        len(record.payload),
        record.published_at,
        record.payload,
    )
    return event_to_pb(event, record.origin)


def history_record_from_pb(pb: gpb.Event, cache: GeofenceCache, field: str) -> HistoryRecord:
    """A history entry from a broker's answer (validated like any event)."""
    ev = event_from_pb(pb, cache, field=field)
    origin = validate_id(pb.origin, f"{field}.origin")
    return HistoryRecord(
        ev.id, ev.topic, bytes(pb.payload), pb.publish_time, origin, ev.location, ev.geofence
    )


def history_query_from_pb(
    request: cpb.HistoryRequest, cache: GeofenceCache, limit_max: int
) -> HistoryQuery:
    """The query a client asks for; the geometry is parsed under the cache's limits.

    Raises:
        InvalidInput: naming ``topic_filter``, ``start``, ``end``, ``geometry`` or ``limit``.
        TooLarge: ``limit`` over `limit_max`, or a geometry over the geofence limits.
    """
    if request.limit > limit_max:
        raise TooLarge("limit", request.limit, limit_max)
    fence = geofence_from_pb(request.geometry, "geometry", cache)
    return HistoryQuery(
        request.topic_filter,
        request.start if request.HasField("start") else None,
        request.end if request.HasField("end") else None,
        None if fence is None else fence.geometry,
        request.limit,
    )


def history_response(
    records: Iterable[HistoryRecord], truncated: bool, brokers: Iterable[str]
) -> cpb.HistoryResponse:
    """Answer to History."""
    return cpb.HistoryResponse(
        events=[history_record_to_pb(r) for r in records],
        truncated=truncated,
        brokers=sorted(brokers),
    )


def peer_history_request(
    broker_id: str, query: HistoryQuery, max_bytes: int, delete_ids: Iterable[str] = ()
) -> fpb.PeerHistoryRequest:
    """What a broker asks another broker for (its share of a query, or a removal)."""
    pb = fpb.PeerHistoryRequest(
        broker_id=broker_id,
        topic_filter=query.topic_filter,
        limit=query.limit,
        max_bytes=max_bytes,
        delete_ids=list(delete_ids),
    )
    if query.start is not None:
        pb.start = query.start
    if query.end is not None:
        pb.end = query.end
    if query.geometry is not None:
        pb.geometry_wkb = shapely.to_wkb(query.geometry)
    return pb


def history_query_from_peer(pb: fpb.PeerHistoryRequest) -> HistoryQuery:
    """The query a peer broker sent (it validated the client's; checked again, cheaply)."""
    geometry = None
    if pb.geometry_wkb:
        try:
            geometry = shapely.from_wkb(pb.geometry_wkb)
        except shapely.errors.GEOSException as exc:
            raise InvalidInput("geometry_wkb", f"not WKB: {exc}") from None
    return HistoryQuery(
        pb.topic_filter,
        pb.start if pb.HasField("start") else None,
        pb.end if pb.HasField("end") else None,
        geometry,
        pb.limit,
    )


def peer_history_response(
    records: Iterable[HistoryRecord], truncated: bool
) -> fpb.PeerHistoryResponse:
    """A broker's answer to a peer's history request."""
    return fpb.PeerHistoryResponse(
        events=[history_record_to_pb(r) for r in records], truncated=truncated
    )


def history_request(
    topic_filter: str,
    *,
    start: float | None = None,
    end: float | None = None,
    geometry: GeofenceInput = None,
    limit: int = 100,
    delete: bool = False,
    client: str = "",
) -> cpb.HistoryRequest:
    """A client's history query (read, or remove with `delete`)."""
    pb = cpb.HistoryRequest(
        client=client,
        topic_filter=topic_filter,
        geometry=geofence_to_pb(geometry),
        limit=limit,
        delete=delete,
    )
    if start is not None:
        pb.start = start
    if end is not None:
        pb.end = end
    return pb


# -- the client side of the client service ------------------------------------


def connect_request(
    client: str, location: LatLon, session_expiry_s: float = 0.0
) -> cpb.ConnectRequest:
    """Open (or refresh) a session at a broker; persistent if `session_expiry_s` > 0."""
    return cpb.ConnectRequest(
        client=client, location=latlon_to_pb(location), session_expiry_s=session_expiry_s
    )


def update_location_request(
    client: str, location: LatLon, hold: bool = False
) -> cpb.UpdateLocationRequest:
    """Tell the session's broker where the client is now.

    `hold`: if that leaves the area, the broker keeps the subscriptions until
    `leave_request` (make before break).
    """
    return cpb.UpdateLocationRequest(client=client, location=latlon_to_pb(location), hold=hold)


def leave_request(client: str) -> cpb.LeaveRequest:
    """End a held handover at the old broker: its subscriptions and session go."""
    return cpb.LeaveRequest(client=client)


def subscribe_request(
    client: str,
    subscription_id: str,
    topic_filter: str,
    geofence: GeofenceInput = None,
    resume_after: int = 0,
    handover: bool = False,
) -> cpb.SubscribeRequest:
    """Register a subscription (its deliveries stream back on the same call).

    In a persistent session `resume_after` is the last offset received: the
    broker sends what it queued after it. `handover`: a renewal after a move,
    answered once the peers hold it.
    """
    return cpb.SubscribeRequest(
        client=client,
        resume_after=resume_after,
        handover=handover,
        subscription=gpb.Subscription(
            id=subscription_id,
            client=client,
            topic_filter=topic_filter,
            geofence=geofence_to_pb(geofence),
        ),
    )


def unsubscribe_request(client: str, subscription_id: str) -> cpb.UnsubscribeRequest:
    """Withdraw a subscription."""
    return cpb.UnsubscribeRequest(client=client, subscription_id=subscription_id)


def ack_request(client: str, subscription_id: str, offset: int) -> cpb.AckRequest:
    """Acknowledge a persistent subscription's deliveries up to `offset`."""
    return cpb.AckRequest(client=client, subscription_id=subscription_id, offset=offset)


def ack_response() -> cpb.AckResponse:
    """Answer to Ack."""
    return cpb.AckResponse()


@dataclass(frozen=True, slots=True)
class Publication:
    """One event as a client publishes it (the broker sets the time and, if empty, the id).

    Attributes:
        topic: topic name (MQTT levels, no wildcards).
        payload: the payload bytes.
        location: the publisher's location.
        geofence: the event geofence (where subscribers must be); None = the world.
        event_id: a globally unique id, or "" for one chosen by the broker.
    """

    topic: str
    payload: bytes
    location: LatLon
    geofence: GeofenceInput = None
    event_id: str = ""

    def to_pb(self) -> gpb.Event:
        """Wire form of the event."""
        return gpb.Event(
            id=self.event_id,
            topic=self.topic,
            payload=self.payload,
            publisher=latlon_to_pb(self.location),
            geofence=geofence_to_pb(self.geofence),
        )


def publish_request(client: str, publication: Publication) -> cpb.PublishRequest:
    """Publish one event."""
    return cpb.PublishRequest(client=client, event=publication.to_pb())


def publish_batch(client: str, publications: Iterable[Publication]) -> cpb.PublishBatch:
    """One batch of a `PublishStream` call."""
    return cpb.PublishBatch(client=client, events=[p.to_pb() for p in publications])


@dataclass(frozen=True, slots=True)
class Message:
    """An event delivered to a subscription.

    Attributes:
        subscription_id: the subscription it matched.
        event_id: the event's globally unique id.
        topic: the event's topic.
        payload: the payload bytes.
        publisher: where the publisher was.
        geofence: the event geofence as WKT, or None (the whole world).
        publish_time: wall-clock seconds when the publisher's broker accepted it.
        deliver_time: wall-clock seconds when the subscriber's broker handed it over.
        origin: id of the publisher's broker ("" when the broker did not say).
        broker: id of the broker that delivered it (the subscriber's).
        offset: its position in a persistent subscription (1, 2, ...); 0 otherwise.
        filter_scheme: "" when the broker matched it exactly; otherwise its
            approximate filter scheme ("grid", "rgrid"), and the event may not
            match the subscription (docs/design.md §14).
    """

    subscription_id: str
    event_id: str
    topic: str
    payload: bytes
    publisher: LatLon
    geofence: str | None
    publish_time: float
    deliver_time: float
    origin: str
    broker: str
    offset: int = 0
    filter_scheme: str = ""


def message_from_pb(pb: cpb.Delivery, broker: str) -> Message:
    """A delivery from the wire (the broker already validated the event)."""
    ev = pb.event
    return Message(
        subscription_id=pb.subscription_id,
        event_id=ev.id,
        topic=ev.topic,
        payload=bytes(ev.payload),
        publisher=LatLon(ev.publisher.lat, ev.publisher.lon),
        geofence=ev.geofence.wkt or None,
        publish_time=ev.publish_time,
        deliver_time=pb.deliver_time,
        origin=ev.origin,
        broker=broker,
        offset=pb.offset,
        filter_scheme=pb.filter_scheme,
    )


def health_check_request(service: str = "") -> health_pb2.HealthCheckRequest:
    """A gRPC health check of `service` ("" = the server as a whole)."""
    return health_pb2.HealthCheckRequest(service=service)
