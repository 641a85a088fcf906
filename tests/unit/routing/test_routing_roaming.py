"""Roaming geofences: notation, placement, what a move sends (docs/design.md §3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from routing_testkit import points, roamings, tiling_federation

from geofed.routing import (
    EARTH_RADIUS_M,
    BrokerState,
    Event,
    InvalidInput,
    LatLon,
    RelocateMsg,
    Roaming,
    SubscribeMsg,
    Subscription,
    UnsubscribeMsg,
    circle,
    great_circle_m,
    latlon,
    make_event,
    make_subscription,
    op_to_record,
    parse_geofence,
    parse_op,
    parse_roaming,
    predict,
    reference_deliveries,
    simulate,
    strategy_for,
)

SQUARE = [[-1000.0, -1000.0], [1000.0, -1000.0], [1000.0, 1000.0], [-1000.0, 1000.0]]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("roam:circle:5000", Roaming(radius_m=5000.0)),
        ("  ROAM:Circle:5e3 ", Roaming(radius_m=5000.0)),
        ({"roaming": {"radius_m": 5000}}, Roaming(radius_m=5000.0)),
        (
            "roam:polygon:0 0, 100 0, 0 100",
            Roaming(ring=((0.0, 0.0), (100.0, 0.0), (0.0, 100.0), (0.0, 0.0))),
        ),
        (
            {"roaming": {"polygon": [[0, 0], [100, 0], [0, 100], [0, 0]]}},
            Roaming(ring=((0.0, 0.0), (100.0, 0.0), (0.0, 100.0), (0.0, 0.0))),
        ),
    ],
)
def test_notations(value: object, expected: Roaming) -> None:
    shape = parse_roaming(value, "subscription.geofence")
    assert shape == expected
    assert parse_roaming(shape.text) == shape  # the canonical text reads back


@pytest.mark.parametrize(
    ("value", "field", "reason"),
    [
        ("roam:circle:0.5", "subscription.geofence.radius_m", "within [1, 5000000]"),
        ("roam:circle:6e6", "subscription.geofence.radius_m", "within"),
        ("roam:circle:nan", "subscription.geofence.radius_m", "finite"),
        ("roam:circle:", "subscription.geofence", "roam:circle:RADIUS_M"),
        ("roam:square:5", "subscription.geofence", "roam:polygon:"),
        ("roam:polygon:0 0, 1 1", "subscription.geofence.polygon", "at least 3 vertices"),
        ("roam:polygon:0 0, 10, 0 10", "subscription.geofence", "two numbers"),
        (
            "roam:polygon:0 0, 10 10, 10 0, 0 10",
            "subscription.geofence.polygon",
            "Self-intersection",
        ),
        ("roam:polygon:0 0, 10 0, 20 0", "subscription.geofence.polygon", "invalid polygon"),
        (
            "roam:polygon:0 0, 6e6 0, 0 10",
            "subscription.geofence.polygon[1]",
            "farther than 5000000 m",
        ),
        ({"roaming": {}}, "subscription.geofence.roaming", "exactly one of"),
        ({"roaming": {"radius_m": "5"}}, "subscription.geofence.roaming.radius_m", "number"),
        (
            {"roaming": {"polygon": [[0, 0], [1, "x"], [0, 1]]}},
            "subscription.geofence.roaming.polygon[1].north_m",
            "number",
        ),
    ],
)
def test_bad_roaming_geofences_name_the_field(value: object, field: str, reason: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_roaming(value, "subscription.geofence")
    assert err.value.field == field
    assert reason in err.value.reason


def test_polygon_vertex_limit() -> None:
    ring = [[1000 * math.cos(a / 10), 1000 * math.sin(a / 10)] for a in range(60)]
    with pytest.raises(InvalidInput, match="more than 20 vertices"):
        parse_roaming({"roaming": {"polygon": ring}}, max_vertices=20)


@pytest.mark.parametrize("value", ["roam:circle:5000", {"roaming": {"radius_m": 5000}}])
def test_only_subscription_geofences_roam(value: object) -> None:
    with pytest.raises(InvalidInput, match="only as a subscription geofence") as err:
        make_event("e", "t", latlon(0, 0), value)
    assert err.value.field == "event.geofence"
    with pytest.raises(InvalidInput, match="only as a subscription geofence"):
        parse_geofence(value)
    sub = make_subscription("s", "c", "t/#", value)
    assert sub.roaming == Roaming(radius_m=5000.0) and sub.geofence is None


@settings(max_examples=150, deadline=None)
@given(shape=roamings(), at=points)
def test_any_shape_reads_back_and_places_anywhere(shape: Roaming, at: LatLon) -> None:
    # Text and wire forms give back the very same shape, and placement always
    # succeeds with a valid geofence (poles and the antimeridian included).
    assert parse_roaming(shape.text) == shape
    fence = shape.place(at)
    assert fence.geometry.is_valid and fence.geometry.area > 0
    assert shape.place(at) is fence  # the same input, the same shape (cached)
    to_pole = math.radians(90.0 - abs(at.lat)) * EARTH_RADIUS_M
    if fence.geometry.geom_type == "Polygon" and shape.extent_m < to_pole:
        # Neither cut at ±180 nor holding a pole: its vertices are the offsets' points.
        for lon, lat in fence.geometry.exterior.coords:
            assert great_circle_m(at, LatLon(lat, lon)) <= shape.extent_m * (1 + 1e-9) + 1e-3


def test_a_circle_is_placed_as_the_geodesic_circle() -> None:
    at = LatLon(48.85, 2.35)
    placed = Roaming(radius_m=5000.0).place(at)
    assert placed.wkt == circle(at, 5000.0).wkt
    assert placed is Roaming(radius_m=5000.0).place(LatLon(48.85, 2.35))  # cached


def test_a_polygon_is_placed_by_distance_and_bearing() -> None:
    at = LatLon(48.85, 2.35)
    fence = parse_roaming({"roaming": {"polygon": SQUARE}}).place(at)
    corners = {(round(x, 9), round(y, 9)) for x, y in fence.geometry.exterior.coords}
    assert len(corners) == 4
    for lon, lat in corners:
        assert great_circle_m(at, LatLon(lat, lon)) == pytest.approx(1000 * math.sqrt(2))
    assert fence.covers(at)
    # An offset polygon beside the subscriber does not cover it.
    ahead = parse_roaming("roam:polygon:-100 1000, 100 1000, 100 2000, -100 2000").place(at)
    assert not ahead.covers(at)
    assert ahead.covers(LatLon(at.lat + 1500 / 111_195, at.lon))


def test_placement_across_the_antimeridian_and_at_a_pole() -> None:
    square = parse_roaming({"roaming": {"polygon": SQUARE}})
    seam = square.place(LatLon(0.0, 179.9999))
    assert seam.geometry.geom_type == "MultiPolygon"
    assert seam.covers(LatLon(0.0, -179.9999)) and seam.covers(LatLon(0.0, 179.9999))
    # Reaching a pole, a polygon is placed as its circumscribed circle (valid, same everywhere).
    pole = square.place(LatLon(89.9999, 10.0))
    assert pole.wkt == circle(LatLon(89.9999, 10.0), 1000 * math.sqrt(2)).wkt
    assert pole.covers(LatLon(90.0, 0.0))


# -- the broker: what a subscriber's move sends -------------------------------
# Tiling federation: a and b share the slanted edge lon = 45 - lat / 6 (lon 45 at the equator).

NEAR_EDGE = LatLon(0.0, 44.0)  # in a, 111 km from b
DEEP_IN_A = LatLon(0.0, 40.0)


def _states(strategy: str) -> dict[str, BrokerState]:
    fed = tiling_federation()
    strat = strategy_for(strategy, fed)
    return {b.id: BrokerState(b.id, fed, strat) for b in fed}


def test_a_move_sends_relocations_and_follows_the_brokers_its_geofence_meets() -> None:
    cores = _states("subscription-geofence")
    a, b = cores["a"], cores["b"]
    a.connect("sub", NEAR_EDGE)
    sends = a.subscribe(Subscription("s", "sub", "t/#", roaming=Roaming(radius_m=200_000.0)))
    assert [(s.dst, type(s.msg)) for s in sends] == [("b", SubscribeMsg)]
    assert isinstance(sends[0].msg, SubscribeMsg) and sends[0].msg.sub.at == NEAR_EDGE
    b.on_message("a", sends[0].msg)

    # Within reach of b: b's copy is moved, nothing else is sent.
    closer = LatLon(0.0, 44.5)
    moved = a.update_location("sub", closer)
    assert moved.redirect is None
    assert [(s.dst, s.msg) for s in moved.sends] == [("b", RelocateMsg(("sub", "s"), "a", closer))]
    b.on_message("a", moved.sends[0].msg)
    copy = b.remote.get(("sub", "s"))
    assert copy is not None and copy.at == closer
    assert copy.geofence is Roaming(radius_m=200_000.0).place(closer)

    # A publisher in b 150 km from the subscriber is matched at b, one 250 km away is not.
    near_pub = Event("e1", "t/x", LatLon(0.0, 45.85))
    far_pub = Event("e2", "t/x", LatLon(0.0, 46.8))
    assert [s.dst for s in b.publish(near_pub).sends] == ["a"]
    assert b.publish(far_pub).sends == []

    # Out of b's reach: withdrawn there; back: sent again. The same place: nothing.
    away = a.update_location("sub", DEEP_IN_A)
    assert [(s.dst, type(s.msg)) for s in away.sends] == [("b", UnsubscribeMsg)]
    assert a.update_location("sub", DEEP_IN_A).sends == []
    back = a.update_location("sub", NEAR_EDGE)
    assert [(s.dst, type(s.msg)) for s in back.sends] == [("b", SubscribeMsg)]


def test_fixed_geofences_and_event_forwarding_send_nothing_on_a_move() -> None:
    cores = _states("subscription-geofence")
    a = cores["a"]
    a.connect("sub", NEAR_EDGE)
    a.subscribe(Subscription("s", "sub", "t/#", circle(NEAR_EDGE, 200_000.0)))
    assert a.update_location("sub", LatLon(0.0, 44.5)).sends == []
    ev = _states("event-geofence")["a"]
    ev.connect("sub", NEAR_EDGE)
    assert ev.subscribe(Subscription("s", "sub", "t/#", roaming=Roaming(radius_m=200_000.0))) == []
    assert ev.update_location("sub", LatLon(0.0, 44.5)).sends == []
    held = ev.local.get(("sub", "s"))
    assert held is not None and held.at == LatLon(0.0, 44.5)  # matched where it is now


def test_a_relocation_from_another_home_is_ignored() -> None:
    b = _states("subscription-geofence")["b"]
    sub = Subscription("s", "sub", "t/#", roaming=Roaming(radius_m=200_000.0)).placed(NEAR_EDGE)
    b.on_message("a", SubscribeMsg(sub, "a"))
    b.on_message("c", RelocateMsg(sub.key, "c", DEEP_IN_A))
    b.on_message("a", RelocateMsg(("sub", "other"), "a", DEEP_IN_A))
    held = b.remote.get(sub.key)
    assert held is not None and held.at == NEAR_EDGE


def test_a_known_client_moves_through_update_location_not_connect() -> None:
    a = _states("subscription-geofence")["a"]
    a.connect("sub", NEAR_EDGE)
    assert a.connect("sub", NEAR_EDGE) is None  # a refresh at the same place
    with pytest.raises(ValueError, match="update_location"):
        a.connect("sub", DEEP_IN_A)


# -- traces ---------------------------------------------------------------------


def test_trace_records_with_roaming_geofences() -> None:
    rec = {
        "t": 1.0,
        "op": "subscribe",
        "client": "c",
        "lat": 0.0,
        "lon": 44.0,
        "id": "s",
        "topic": "t/#",
        "roaming": "roam:circle:200000",
    }
    op = parse_op(rec, 3)
    assert op.roaming == Roaming(radius_m=200_000.0) and op.geofence is None
    assert parse_op(op_to_record(op), 3) == op
    with pytest.raises(InvalidInput) as err:
        parse_op({**rec, "geofence": "POLYGON((0 0, 1 0, 1 1, 0 0))"}, 4)
    assert err.value.field == "line 4: roaming"
    with pytest.raises(InvalidInput) as err:
        parse_op({**rec, "op": "publish", "roaming": "roam:circle:5"}, 5)
    assert err.value.field == "line 5: roaming"
    with pytest.raises(InvalidInput) as err:
        parse_op({**rec, "roaming": "roam:circle:-1"}, 6)
    assert err.value.field == "line 6: roaming.radius_m"


def test_a_roaming_subscriber_crossing_an_area_edge_under_every_strategy() -> None:
    # The subscriber drives from deep in a (lon 40) across the edge (lon 45)
    # into b; publishers sit at lon 43.5 (a) and 46 (b). Its 200 km (1.8
    # degrees) geofence picks them up only while it is close to them.
    def pub(t: float, ev: str, client: str, lon: float) -> dict[str, object]:
        return {"t": t, "op": "publish", "client": client, "lat": 0, "lon": lon, "id": ev}

    def move(t: float, lon: float) -> dict[str, object]:
        return {"t": t, "op": "move", "client": "sub", "lat": 0, "lon": lon}

    records: list[dict[str, object]] = [
        {"t": 0, "op": "subscribe", "client": "sub", "lat": 0, "lon": 40, "id": "s"}
        | {"topic": "t/#", "roaming": "roam:circle:200000"},
        pub(1, "e1", "pa", 43.5),
        pub(2, "e2", "pb", 46),
        move(3, 44.5),  # b comes within reach: a sends b the subscription
        pub(4, "e3", "pa", 43.5),
        pub(5, "e4", "pb", 46),
        move(6, 45.2),  # into b: withdrawn from b, renewed at b, which sends it to a
        pub(7, "e5", "pb", 46),
        pub(8, "e6", "pa", 43.5),
        move(9, 45.4),  # a keeps a copy: a relocation (pa now 10 km outside the geofence)
        pub(10, "e7", "pa", 43.5),
        move(11, 47.5),  # out of a's reach: withdrawn from a
        pub(12, "e8", "pa", 43.5),
        pub(13, "e9", "pb", 46),
    ]
    ops = [parse_op({"topic": "t/x", **r}, i + 1) for i, r in enumerate(records)]
    expected = [("e3", "s"), ("e4", "s"), ("e5", "s"), ("e6", "s"), ("e9", "s")]
    assert reference_deliveries(ops) == expected
    fed = tiling_federation()
    for name in ("flooding-events", "flooding-subscriptions", "event-geofence"):
        result = simulate(fed, name, ops)
        assert result.deliveries == expected, name
        assert result.messages == predict(fed, name, ops).messages, name
    result = simulate(fed, "subscription-geofence", ops)
    assert result.deliveries == expected
    assert result.messages == predict(fed, "subscription-geofence", ops).messages
    kinds = result.by_kind()
    assert (kinds["subscribe"], kinds["relocate"], kinds["unsubscribe"]) == (2, 1, 2)
    assert kinds["delivery"] == 2  # e4 (b -> a) and e6 (a -> b); the rest are local
