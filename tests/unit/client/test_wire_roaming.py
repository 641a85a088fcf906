"""Roaming geofences on the wire: client requests, peer frames, the text form."""

from __future__ import annotations

import pytest

from geofed.routing import (
    GeofenceCache,
    InvalidInput,
    Kind,
    LatLon,
    RelocateMsg,
    Roaming,
    SubscribeMsg,
    Subscription,
    parse_roaming,
)
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    PeerGeofenceCache,
    RejectedMessage,
    add_to_frame,
    event_from_pb,
    geofence_from_text,
    geofence_to_pb,
    messages_from_frame,
    snapshot_frames,
    snapshot_from_frame,
    subscribe_request,
    subscription_from_pb,
)

PARIS = LatLon(48.85, 2.35)
POLYGON = "roam:polygon:-500 -500, 500 -500, 0 800"


@pytest.mark.parametrize(
    "given",
    [
        "roam:circle:5000",
        {"roaming": {"radius_m": 5000}},
        Roaming(radius_m=5000.0),
        POLYGON,
        {"roaming": {"polygon": [[-500, -500], [500, -500], [0, 800]]}},
    ],
)
def test_client_subscribe_request_carries_the_shape(given: object) -> None:
    req = subscribe_request("c", "s", "t/#", given)  # type: ignore[arg-type]
    assert req.subscription.geofence.WhichOneof("shape") == "roaming"
    sub = subscription_from_pb(req.subscription, GeofenceCache(), client="c")
    assert sub.roaming == parse_roaming(given)
    assert sub.geofence is None and sub.at is None  # the broker places it


def test_text_form_is_parsed_in_one_place() -> None:
    assert geofence_from_text(" roam:circle:250 ", "geofed-geofence") == Roaming(radius_m=250.0)
    with pytest.raises(InvalidInput) as err:
        geofence_from_text("roam:circle:x", "geofed-geofence")
    assert err.value.field == "geofed-geofence"
    assert "roam:circle:RADIUS_M" in err.value.reason


def test_bad_shapes_from_the_wire_name_the_field() -> None:
    pb = gpb.Subscription(id="s", client="c", topic_filter="t")
    pb.geofence.roaming.radius_m = 0.1
    with pytest.raises(InvalidInput) as err:
        subscription_from_pb(pb, GeofenceCache())
    assert err.value.field == "subscription.geofence.roaming.radius_m"
    pb.geofence.roaming.Clear()
    pb.geofence.roaming.SetInParent()
    with pytest.raises(InvalidInput) as err:
        subscription_from_pb(pb, GeofenceCache())
    assert err.value.field == "subscription.geofence.roaming"


def test_the_vertex_limit_is_the_brokers() -> None:
    pb = subscribe_request("c", "s", "t", "roam:polygon:0 0, 10 0, 10 10, 0 10").subscription
    assert subscription_from_pb(pb, GeofenceCache(max_vertices=5)).roaming is not None
    with pytest.raises(InvalidInput) as err:
        subscription_from_pb(pb, GeofenceCache(max_vertices=4))
    assert err.value.field == "subscription.geofence.roaming.polygon"
    assert "more than 4 vertices" in err.value.reason


def test_events_do_not_roam() -> None:
    pb = gpb.Event(id="e", topic="t", publisher=gpb.LatLon(lat=0, lon=0))
    pb.geofence.CopyFrom(geofence_to_pb("roam:circle:5000"))
    with pytest.raises(InvalidInput) as err:
        event_from_pb(pb, GeofenceCache(), field="request.event")
    assert err.value.field == "request.event.geofence.roaming"


def _placed(shape: str) -> Subscription:
    return Subscription("s", "c", "t/#", roaming=parse_roaming(shape)).placed(PARIS)


@pytest.mark.parametrize("shape", ["roam:circle:5000", POLYGON])
def test_peers_get_the_shape_and_where_to_place_it(shape: str) -> None:
    sub = _placed(shape)
    frame = fpb.Frame()
    moved = LatLon(48.86, 2.36)
    add_to_frame(frame, RelocateMsg(sub.key, "eu", moved), "eu")
    size = add_to_frame(frame, SubscribeMsg(sub, "eu"), "eu")
    assert "POLYGON" not in frame.SerializeToString().decode("latin-1")  # the shape, not WKT
    assert size < 200
    got = messages_from_frame(frame, PeerGeofenceCache())
    # Applied in rank order: the subscription first, then the relocation.
    assert [m.kind for m in got] == [Kind.SUBSCRIBE, Kind.RELOCATE]
    first, second = got
    assert isinstance(first, SubscribeMsg) and first.home == "eu"
    assert first.sub.at == PARIS and first.sub.geofence is not None
    assert sub.geofence is not None and first.sub.geofence.wkt == sub.geofence.wkt
    assert second == RelocateMsg(sub.key, "eu", moved)
    # Snapshots carry it the same way.
    (snap, _, _), *_ = list(snapshot_frames([SubscribeMsg(sub, "eu")], 1 << 20))
    (again,) = snapshot_from_frame(snap, PeerGeofenceCache())
    assert again.sub.at == PARIS and again.sub.roaming == sub.roaming


def test_a_peer_message_without_its_location_is_rejected_alone() -> None:
    frame = fpb.Frame()
    add_to_frame(frame, SubscribeMsg(_placed("roam:circle:5000"), "eu"), "eu")
    frame.subscribes[0].ClearField("at")
    frame.relocations.add(client="c", subscription_id="s", home="eu")  # no location
    add_to_frame(frame, RelocateMsg(("c", "s"), "eu", PARIS), "eu")
    rejected: list[RejectedMessage] = []
    got = messages_from_frame(frame, PeerGeofenceCache(), rejected)
    assert got == [RelocateMsg(("c", "s"), "eu", PARIS)]
    assert [(r.kind, r.id) for r in rejected] == [(Kind.SUBSCRIBE, "s"), (Kind.RELOCATE, "s")]
    assert "subscribe.at" in rejected[0].reason and "relocate.at" in rejected[1].reason
