"""The wire: every conversion between geofed.v1 protobuf messages and the routing core.

This is the one module that builds protobuf messages (the broker, the client
library and the tools all go through it). Input from the wire is untrusted:
every conversion validates and names the field in its error. Geofences are
converted to polygons once, at the edge; brokers exchange them as canonical
WKT and cache the parsed shapes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2

from geofed.routing import (
    BrokerInfo,
    DeliveryMsg,
    Event,
    EventMsg,
    Geofence,
    GeofenceCache,
    InvalidInput,
    LatLon,
    PeerMessage,
    SubscribeMsg,
    Subscription,
    TooLarge,
    UnsubscribeMsg,
    latlon,
    make_event,
    make_subscription,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb

CLIENT_SERVICE: str = cpb.DESCRIPTOR.services_by_name["ClientService"].full_name
"""Full name of the client gRPC service (also its health-check service name)."""
FEDERATION_SERVICE: str = fpb.DESCRIPTOR.services_by_name["FederationService"].full_name
"""Full name of the broker-to-broker gRPC service (also its health-check service name)."""


def geofence_from_pb(pb: gpb.Geofence, field: str, cache: GeofenceCache) -> Geofence | None:
    """The geofence a message carries (an unset one is the whole world); text via `cache`."""
    shape = pb.WhichOneof("shape")
    if shape is None:
        return None
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


GeofenceInput = Geofence | str | Mapping[str, Any] | None
"""A geofence as users give it: parsed, WKT or GeoJSON text, a GeoJSON or circle mapping."""


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
    ev = make_event(
        pb.id,
        pb.topic,
        location,
        fence,
        payload_size=len(pb.payload),
        t=pb.publish_time,
        field=field,
    )
    if pb.payload:
        ev = Event(
            ev.id, ev.topic, ev.location, ev.geofence, ev.payload_size, ev.t, bytes(pb.payload)
        )
    return ev


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
    """Validate a subscription from the wire; `client` fills an empty client field."""
    owner = pb.client or client or ""
    if client is not None and pb.client and pb.client != client:
        raise InvalidInput(
            f"{field}.client", f"{pb.client!r} differs from the session's client {client!r}"
        )
    fence = geofence_from_pb(pb.geofence, f"{field}.geofence", cache)  # unset: the world
    return make_subscription(pb.id, owner, pb.topic_filter, fence, field=field)


def subscription_to_pb(sub: Subscription) -> gpb.Subscription:
    """Wire form of a subscription."""
    return gpb.Subscription(
        id=sub.id,
        client=sub.client,
        topic_filter=sub.topic_filter,
        geofence=geofence_to_pb(sub.geofence),
    )


# -- the broker side of the client service ------------------------------------


def accepted_response(broker_id: str) -> cpb.ConnectResponse:
    """The session stays at this broker."""
    return cpb.ConnectResponse(broker_id=broker_id, accepted=True)


def redirect_response(broker_id: str, target: BrokerInfo) -> cpb.ConnectResponse:
    """The client must go to `target` (the broker responsible for its location)."""
    return cpb.ConnectResponse(
        broker_id=broker_id,
        accepted=False,
        redirect=cpb.Redirect(broker_id=target.id, endpoint=target.client_endpoint),
    )


def delivery_to_pb(subscription_id: str, event: gpb.Event, deliver_time: float) -> cpb.Delivery:
    """One delivery on a Subscribe stream (`event` already in wire form, shared)."""
    return cpb.Delivery(subscription_id=subscription_id, event=event, deliver_time=deliver_time)


def unsubscribe_response(existed: bool) -> cpb.UnsubscribeResponse:
    """Answer to Unsubscribe."""
    return cpb.UnsubscribeResponse(existed=existed)


def publish_response(event_id: str) -> cpb.PublishResponse:
    """Answer to Publish: the id of the accepted event."""
    return cpb.PublishResponse(event_id=event_id)


def publish_batch_response(event_ids: list[str]) -> cpb.PublishBatchResponse:
    """Answer to PublishStream: every accepted event id, in order."""
    return cpb.PublishBatchResponse(accepted=len(event_ids), event_ids=event_ids)


# -- broker to broker ---------------------------------------------------------


def hello_frame(
    broker_id: str, strategy: str, federation_digest: str, protocol_version: int, epoch: int
) -> fpb.Frame:
    """The first frame on a link, each way."""
    return fpb.Frame(
        hello=fpb.Hello(
            broker_id=broker_id,
            strategy=strategy,
            federation_digest=federation_digest,
            protocol_version=protocol_version,
            epoch=epoch,
        )
    )


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
            pb = snap.subscriptions.add(subscription=subscription_to_pb(m.sub), home=m.home)
            sizes.append(int(pb.ByteSize()))
            total += sizes[-1]
            end += 1
        yield fpb.Frame(snapshot=snap), subs[start:end], sizes
        start = end
        if start >= len(subs):
            return


def snapshot_from_frame(frame: fpb.Frame, cache: GeofenceCache) -> list[SubscribeMsg]:
    """The subscriptions a snapshot frame carries."""
    return [
        SubscribeMsg(subscription_from_pb(rs.subscription, cache), rs.home)
        for rs in frame.snapshot.subscriptions
    ]


FRAME_RANK = {"subscribe": 0, "unsubscribe": 1, "event": 2, "delivery": 3}
"""Application order of message kinds within one frame."""


def add_to_frame(frame: fpb.Frame, msg: PeerMessage, origin: str) -> int:
    """Append one logical message to a frame; return its serialized size."""
    pb: ProtoMessage
    if isinstance(msg, EventMsg):
        pb = event_to_pb(msg.event, origin)
        frame.events.append(pb)
    elif isinstance(msg, SubscribeMsg):
        pb = fpb.RemoteSubscription(subscription=subscription_to_pb(msg.sub), home=msg.home)
        frame.subscribes.append(pb)
    elif isinstance(msg, UnsubscribeMsg):
        pb = fpb.Unsubscription(subscription_id=msg.sub_id, home=msg.home)
        frame.unsubscribes.append(pb)
    else:
        pb = fpb.EventDelivery(event=event_to_pb(msg.event, origin), subscription_ids=msg.sub_ids)
        frame.deliveries.append(pb)
    return int(pb.ByteSize())


def messages_from_frame(frame: fpb.Frame, cache: GeofenceCache) -> list[PeerMessage]:
    """The logical messages of a frame, in the order they are applied.

    A frame applies subscribes, then unsubscribes, then events, then
    deliveries; senders start a new frame rather than put a message behind
    one of a later rank (`FRAME_RANK`), so this order is the order sent.
    """
    out: list[PeerMessage] = []
    for rs in frame.subscribes:
        out.append(SubscribeMsg(subscription_from_pb(rs.subscription, cache), rs.home))
    for us in frame.unsubscribes:
        out.append(UnsubscribeMsg(us.subscription_id, us.home))
    for ev in frame.events:
        out.append(EventMsg(event_from_pb(ev, cache)))
    for d in frame.deliveries:
        out.append(DeliveryMsg(event_from_pb(d.event, cache), tuple(d.subscription_ids)))
    return out


# -- the client side of the client service ------------------------------------


def connect_request(client: str, location: LatLon) -> cpb.ConnectRequest:
    """Open (or refresh) a session at a broker."""
    return cpb.ConnectRequest(client=client, location=latlon_to_pb(location))


def update_location_request(client: str, location: LatLon) -> cpb.UpdateLocationRequest:
    """Tell the session's broker where the client is now."""
    return cpb.UpdateLocationRequest(client=client, location=latlon_to_pb(location))


def subscribe_request(
    client: str, subscription_id: str, topic_filter: str, geofence: GeofenceInput = None
) -> cpb.SubscribeRequest:
    """Register a subscription (its deliveries stream back on the same call)."""
    return cpb.SubscribeRequest(
        client=client,
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
    )


def health_check_request(service: str = "") -> health_pb2.HealthCheckRequest:
    """A gRPC health check of `service` ("" = the server as a whole)."""
    return health_pb2.HealthCheckRequest(service=service)
