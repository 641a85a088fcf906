"""Wire conversions: validation names the field; frames keep the sender's order."""

from __future__ import annotations

import pytest

from geofed import wire as gw
from geofed.routing import (
    DeliveryMsg,
    EventMsg,
    GeofenceCache,
    InvalidInput,
    SubscribeMsg,
    TooLarge,
    UnsubscribeMsg,
    make_event,
    make_subscription,
    parse_geofence,
)
from geofed.routing import latlon as ll
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    add_to_frame,
    event_from_pb,
    event_to_pb,
    messages_from_frame,
    subscription_from_pb,
)


def test_event_round_trip_keeps_geofence_and_payload() -> None:
    cache = GeofenceCache(100)
    fence = parse_geofence({"circle": {"lat": 50, "lon": 8, "radius_m": 10_000}})
    ev = make_event("e1", "a/b", ll(50, 8), fence, payload_size=3, t=12.5)
    pb = event_to_pb(ev, "eu")
    pb.payload = b"abc"
    back = event_from_pb(pb, cache)
    assert (back.id, back.topic, back.location, back.t, back.payload) == (
        "e1",
        "a/b",
        ev.location,
        12.5,
        b"abc",
    )
    assert back.geofence is not None and fence is not None
    assert back.geofence.wkt == fence.wkt
    assert event_from_pb(pb, cache).geofence is back.geofence  # parsed once, cached


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (gpb.Event(id="", topic="a", publisher=gpb.LatLon(lat=1, lon=1)), "event.id"),
        (gpb.Event(id="e", topic="a/#", publisher=gpb.LatLon(lat=1, lon=1)), "event.topic"),
        (gpb.Event(id="e", topic="a"), "event.publisher"),
        (gpb.Event(id="e", topic="a", publisher=gpb.LatLon(lat=1, lon=181)), "event.publisher.lon"),
        (
            gpb.Event(
                id="e",
                topic="a",
                publisher=gpb.LatLon(lat=1, lon=1),
                geofence=gpb.Geofence(wkt="POINT(1 1)"),
            ),
            "event.geofence.wkt",
        ),
        (
            gpb.Event(
                id="e",
                topic="a",
                publisher=gpb.LatLon(lat=1, lon=1),
                geofence=gpb.Geofence(geojson="{"),
            ),
            "event.geofence.geojson",
        ),
        (
            gpb.Event(
                id="e",
                topic="a",
                publisher=gpb.LatLon(lat=1, lon=1),
                geofence=gpb.Geofence(
                    circle=gpb.Circle(center=gpb.LatLon(lat=1, lon=1), radius_m=-5)
                ),
            ),
            "event.geofence.circle.radius_m",
        ),
    ],
)
def test_bad_events_name_the_field(event: gpb.Event, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        event_from_pb(event, GeofenceCache(100))
    assert err.value.field.startswith(field)


def test_payload_limit() -> None:
    pb = gpb.Event(id="e", topic="a", publisher=gpb.LatLon(lat=1, lon=1), payload=b"x" * 11)
    with pytest.raises(TooLarge):
        event_from_pb(pb, GeofenceCache(100), max_payload=10)


def test_subscription_client_must_match_session() -> None:
    pb = gpb.Subscription(id="s", client="other", topic_filter="a/+")
    with pytest.raises(InvalidInput) as err:
        subscription_from_pb(pb, GeofenceCache(100), client="me")
    assert err.value.field == "subscription.client"
    assert (
        subscription_from_pb(
            gpb.Subscription(id="s", topic_filter="a/+"), GeofenceCache(100), client="me"
        ).client
        == "me"
    )


def test_frame_round_trip_in_application_order() -> None:
    cache = GeofenceCache(100)
    ev = make_event("e1", "a/b", ll(1, 2))
    sub = make_subscription("s1", "c", "a/#", "POLYGON((0 0, 3 0, 3 3, 0 3, 0 0))")
    frame = fpb.Frame()
    msgs = [
        SubscribeMsg(sub, "eu"),
        UnsubscribeMsg(("c", "s0"), "eu"),
        EventMsg(ev),
        DeliveryMsg(ev, (("c", "s1"), ("d", "s2"))),
    ]
    sizes = [add_to_frame(frame, m, "eu") for m in msgs]
    assert all(s > 0 for s in sizes)
    back = messages_from_frame(fpb.Frame.FromString(frame.SerializeToString()), cache)
    assert [m.kind for m in back] == [m.kind for m in msgs]
    assert back[0] == SubscribeMsg(back[0].sub, "eu") and back[0].sub.geofence is not None
    assert back[1] == UnsubscribeMsg(("c", "s0"), "eu")
    assert back[3] == DeliveryMsg(back[3].event, (("c", "s1"), ("d", "s2")))


def test_a_stream_message_carries_one_delivery_or_a_batch() -> None:
    """`delivery_batch` sends a lone delivery as it is and many in `batch`;
    `deliveries_in` reads both forms back in order (old brokers send only the first)."""
    ds = [gw.delivery_to_pb("s1", gpb.Event(id=f"e{i}", payload=b"p"), 1.0, i) for i in range(1, 4)]
    one = gw.delivery_batch(ds[:1])
    assert one is ds[0] and list(gw.deliveries_in(one)) == [ds[0]]
    many = cpb.Delivery.FromString(gw.delivery_batch(ds).SerializeToString())
    assert not many.subscription_id and not many.HasField("event")
    assert [d.event.id for d in gw.deliveries_in(many)] == ["e1", "e2", "e3"]
    assert [d.offset for d in gw.deliveries_in(many)] == [1, 2, 3]


def test_an_encoded_frame_is_the_frame_add_to_frame_builds() -> None:
    """`EncodedFrame` keeps deliveries encoded behind the other fields: a reader
    gets the same frame (same messages, same order) as from `add_to_frame`, and a
    world block (`DeliveryMsg.world`, cached by identity) encodes as the keys it leads."""
    cache = GeofenceCache(100)
    ev = make_event("e1", "a/b", ll(1, 2), payload_size=2)
    sub = make_subscription("s1", "c", "a/#", "POLYGON((0 0, 3 0, 3 3, 0 3, 0 0))")
    world = tuple(("w", f"s{i}") for i in range(200))  # > 127 bytes of references: 2-byte lengths
    msgs = [
        SubscribeMsg(sub, "eu"),
        EventMsg(ev),
        DeliveryMsg(ev, (("c", "s1"), ("d", "s2"))),
        DeliveryMsg(ev, (*world, ("x", "fenced"))),
        DeliveryMsg(ev, (*world, ("a", "other")), world),
        DeliveryMsg(ev, world, world),
    ]
    plain = fpb.Frame(seq=7)
    encoded = gw.EncodedFrame()
    encoded.frame.seq = 7
    sizes = [add_to_frame(plain, m, "eu") for m in msgs]
    assert [encoded.add(m, "eu") for m in msgs] == sizes
    assert len(encoded.deliveries) == 4
    data = gw.wire_bytes(encoded)
    assert fpb.Frame.FromString(data) == plain
    back = messages_from_frame(fpb.Frame.FromString(data), cache)
    assert [m for m in back if isinstance(m, DeliveryMsg)] == [
        DeliveryMsg(back[2].event, m.subs) for m in msgs[2:]
    ]
    again = gw.EncodedFrame()  # the cached block again, and an equal tuple that is another object
    again.add(DeliveryMsg(ev, (*world, ("b", "late")), world), "eu")
    again.add(DeliveryMsg(ev, (*world, ("b", "late")), tuple(list(world))), "eu")
    first, second = fpb.Frame.FromString(gw.wire_bytes(again)).deliveries
    assert first == second
    assert [(r.client, r.id) for r in first.subscriptions] == [*world, ("b", "late")]
    assert gw.wire_bytes(gw.EncodedFrame(fpb.Frame(seq=3))) == fpb.Frame(seq=3).SerializeToString()


def test_a_stored_message_reads_back_as_the_frame_add_to_frame_builds() -> None:
    """The outbox's stored form (`message_to_bytes`, built by `EncodedFrame`) is a
    frame holding exactly the message, whatever its kind, and reads back equal."""
    cache = GeofenceCache(100)
    ev = make_event("e1", "a/b", ll(1, 2), payload_size=2)
    sub = make_subscription("s1", "c", "a/#", "POLYGON((0 0, 3 0, 3 3, 0 3, 0 0))")
    world = tuple(("w", f"s{i}") for i in range(70))
    for msg in (
        SubscribeMsg(sub, "eu"),
        UnsubscribeMsg(("c", "s1"), "eu"),
        EventMsg(ev),
        DeliveryMsg(ev, (*world, ("x", "fenced")), world),
    ):
        data = gw.message_to_bytes(msg, "eu")
        plain = fpb.Frame()
        add_to_frame(plain, msg, "eu")
        assert fpb.Frame.FromString(data) == plain
        back = gw.message_from_bytes(data, cache)
        assert type(back) is type(msg)
        assert messages_from_frame(plain, cache) == [back]
    with pytest.raises(InvalidInput, match="stored message"):
        gw.message_from_bytes(gw.message_to_bytes(EventMsg(ev), "eu") * 2, cache)
