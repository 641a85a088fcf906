"""Conversions between the wire (geofed.v1 protobuf) and the routing core.

Client input is untrusted: every conversion validates and names the field in
its error. Geofences are converted to polygons once, at the edge; brokers
exchange them as canonical WKT and cache the parsed shapes.
"""

from __future__ import annotations

from geofed.routing import (
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
    UnsubscribeMsg,
    latlon,
    make_event,
    make_subscription,
)
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb


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


def geofence_to_pb(fence: Geofence | None) -> gpb.Geofence:
    """Canonical wire form: WKT, or unset for the whole world."""
    return gpb.Geofence() if fence is None else gpb.Geofence(wkt=fence.wkt)


def event_from_pb(
    pb: gpb.Event, cache: GeofenceCache, *, field: str = "event", max_payload: int | None = None
) -> Event:
    """Validate an event from the wire."""
    location = location_from_pb(pb, "publisher", f"{field}.publisher")
    fence = geofence_from_pb(pb.geofence, f"{field}.geofence", cache)  # unset: the world
    if max_payload is not None and len(pb.payload) > max_payload:
        from geofed.routing import TooLarge

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
        publisher=gpb.LatLon(lat=ev.location.lat, lon=ev.location.lon),
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


FRAME_RANK = {"subscribe": 0, "unsubscribe": 1, "event": 2, "delivery": 3}
"""Application order of message kinds within one frame."""


def add_to_frame(frame: fpb.Frame, msg: PeerMessage, origin: str) -> int:
    """Append one logical message to a frame; return its serialized size."""
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
