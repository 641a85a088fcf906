"""Broker-to-broker conversions: peers take the origin's shapes; one bad message is skipped.

What the origin broker accepted from a client (validated with its limits, then
normalized: circles densified, polygons cut at ±180) reaches a peer as canonical
WKT, and the peer must accept it as it is. A frame is converted message by
message: a message that does not convert is reported and the rest keep their order.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import shapely
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed import wire as gw
from geofed.routing import (
    DEFAULT_MAX_VERTICES,
    DeliveryMsg,
    EventMsg,
    FlushMsg,
    Geofence,
    GeofenceCache,
    HandoffMsg,
    InvalidInput,
    KeyWindow,
    Kind,
    PeerMessage,
    Phase,
    ProposeMsg,
    ReportMsg,
    SessionMsg,
    StrategyTable,
    SubscribeMsg,
    TableMsg,
    UnsubscribeMsg,
    make_event,
    make_subscription,
)
from geofed.routing import latlon as ll
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    PeerGeofenceCache,
    RejectedMessage,
    add_to_frame,
    event_from_pb,
    geofence_to_pb,
    messages_from_frame,
    snapshot_frames,
    snapshot_from_frame,
)

# What an origin that took a 1e-9 m circle forwarded: 64 positions that round to one point.
DEGENERATE = "POLYGON ((" + ", ".join(["139.77 35.68000000000001"] * 65) + "))"
CIRCLE = {"circle": {"lat": 35.68, "lon": 139.77, "radius_m": 1000.0}}


def ring_wkt(n: int, lon: float = 180.0, lat: float = 0.0, r: float = 5.0) -> str:
    """A closed ring of `n` positions (n - 1 distinct) around (lon, lat), longitudes wrapped."""
    pts = []
    for i in range(n - 1):
        a = 2 * math.pi * i / (n - 1)
        x = lon + r * math.cos(a)
        pts.append((x - 360.0 if x > 180.0 else x, lat + r * math.sin(a)))
    pts.append(pts[0])
    return "POLYGON((" + ", ".join(f"{x!r} {y!r}" for x, y in pts) + "))"


def origin_accepts(fence: object, max_vertices: int = DEFAULT_MAX_VERTICES) -> Geofence:
    """The origin broker's view: client input through the node's cache and its limit."""
    pb = gpb.Event(id="e", topic="t", publisher=gpb.LatLon(lat=0, lon=0))
    pb.geofence.CopyFrom(geofence_to_pb(fence))  # type: ignore[arg-type]
    got = event_from_pb(pb, GeofenceCache(max_vertices), field="request.event").geofence
    assert got is not None
    return got


def widest_ring_accepted(max_vertices: int) -> tuple[int, Geofence]:
    """The ring of the most positions across ±180 that an origin with this limit accepts.

    Whether the vertices the cut adds count against the limit is the origin's
    business; either way the peer must take what it accepted.
    """
    for n in range(max_vertices, max_vertices - 100, -1):
        try:
            return n, origin_accepts(ring_wkt(n), max_vertices)
        except InvalidInput:
            continue
    raise AssertionError(f"no ring of about {max_vertices} positions accepted")


def forwarded(fence: Geofence) -> tuple[list[PeerMessage], list[RejectedMessage]]:
    """`fence` on an event and on a subscription, through a frame to a peer."""
    frame = fpb.Frame()
    add_to_frame(frame, SubscribeMsg(make_subscription("s", "c", "t/#", fence), "eu"), "eu")
    add_to_frame(frame, EventMsg(make_event("e", "t", ll(0, 0), fence)), "eu")
    rejected: list[RejectedMessage] = []
    wire = fpb.Frame.FromString(frame.SerializeToString())
    return messages_from_frame(wire, PeerGeofenceCache(), rejected), rejected


def assert_same_shape(peer: Geofence | None, origin: Geofence) -> None:
    assert peer is not None
    assert peer.wkt == origin.wkt
    assert peer.geometry.geom_type == origin.geometry.geom_type
    # Canonical WKT may round a coordinate's last bit; nothing more.
    assert shapely.equals_exact(peer.geometry, origin.geometry, tolerance=1e-9)


def test_peers_take_the_shape_the_origin_accepted_without_re_validating_it() -> None:
    """The largest ring across ±180 the origin accepts (the cut adds vertices), one from an
    origin with a higher vertex limit than any peer's, and a degenerate shape an origin let
    through: each reaches a peer unchanged, on an event and on a subscription."""
    n, widest = widest_ring_accepted(DEFAULT_MAX_VERTICES)
    assert widest.vertex_count > n and len(widest.parts) == 2
    with pytest.raises(InvalidInput):
        origin_accepts(ring_wkt(DEFAULT_MAX_VERTICES + 1))  # the limit holds at the origin
    _, larger = widest_ring_accepted(3 * DEFAULT_MAX_VERTICES // 2)  # configs may differ
    degenerate = Geofence(shapely.from_wkt(DEGENERATE))
    for fence in (widest, larger, degenerate):
        msgs, rejected = forwarded(fence)
        assert rejected == []
        assert isinstance(msgs[0], SubscribeMsg) and isinstance(msgs[1], EventMsg)
        assert_same_shape(msgs[0].sub.geofence, fence)
        assert_same_shape(msgs[1].event.geofence, fence)


def test_peer_cache_parses_each_text_once_and_checks_only_structure() -> None:
    cache = PeerGeofenceCache()
    wkt = origin_accepts(CIRCLE).wkt
    assert cache.get(wkt) is cache.get(wkt)
    assert cache.get(DEGENERATE) is not None
    assert cache.get("") is None  # geofence_from_pb turns an empty text into an error
    for bad in ("POINT (1 1)", "POLYGON ((0 0, 1", "not wkt"):
        with pytest.raises(InvalidInput) as err:
            cache.get(bad, "event.geofence.wkt")
        assert err.value.field == "event.geofence.wkt"
    # Bounded by count and by text: the least recently used text goes first.
    other = origin_accepts({"circle": {"lat": 1, "lon": 2, "radius_m": 1000}}).wkt
    small = PeerGeofenceCache(size=3, text_budget=len(wkt) + len(other))
    first, second = small.get(wkt), small.get(other)
    assert small.get(wkt) is first  # a hit, and now the most recent
    small.get(DEGENERATE)  # over the text budget: `other`, the least recent, goes
    assert small.get(wkt) is first
    assert small.get(other) is not second  # parsed again
    # Notations brokers never send are validated as client input (no vertex limit).
    with pytest.raises(InvalidInput):
        cache.get('{"type": "Point", "coordinates": [1, 1]}')
    assert cache.get({"circle": {"lat": 1, "lon": 2, "radius_m": 1000}}) is not None


def bad_event(eid: str, **kw: object) -> gpb.Event:
    pb = gpb.Event(id=eid, topic="t/x", publisher=gpb.LatLon(lat=1, lon=2))
    for name, value in kw.items():
        if name == "wkt":
            pb.geofence.wkt = str(value)
        else:
            setattr(pb, name, value)
    return pb


def mixed_frame() -> fpb.Frame:
    """Good messages of every kind with bad ones among them."""
    frame = fpb.Frame()
    good_ev = make_event("e1", "t/x", ll(1, 2), Geofence(shapely.from_wkt(DEGENERATE)))
    add_to_frame(frame, SubscribeMsg(make_subscription("s1", "c", "t/#"), "eu"), "eu")
    frame.subscribes.add(home="eu").subscription.CopyFrom(
        gpb.Subscription(id="s-bad", client="c", topic_filter="t/#/x")  # '#' not last
    )
    add_to_frame(frame, SubscribeMsg(make_subscription("s2", "c", "t/+"), "eu"), "eu")
    add_to_frame(frame, UnsubscribeMsg(("c", "s0"), "eu"), "eu")
    add_to_frame(frame, EventMsg(good_ev), "eu")
    frame.events.append(bad_event("e-wkt", wkt="POINT (1 2)"))
    frame.events.append(gpb.Event(id="e-nowhere", topic="t/x"))  # no publisher location
    add_to_frame(frame, EventMsg(make_event("e2", "t/y", ll(3, 4))), "eu")
    frame.deliveries.add(event=bad_event("d-bad", topic="t/+")).subscriptions.add(
        client="c", id="s9"
    )
    add_to_frame(frame, DeliveryMsg(make_event("d1", "t/z", ll(5, 6)), (("c", "s7"),)), "eu")
    return fpb.Frame.FromString(frame.SerializeToString())


def test_a_frame_converts_message_by_message_bad_ones_reported_in_order() -> None:
    rejected: list[RejectedMessage] = []
    msgs = messages_from_frame(mixed_frame(), PeerGeofenceCache(), rejected)
    assert [(m.kind, key(m)) for m in msgs] == [
        (Kind.SUBSCRIBE, "s1"),
        (Kind.SUBSCRIBE, "s2"),
        (Kind.UNSUBSCRIBE, "s0"),
        (Kind.EVENT, "e1"),
        (Kind.EVENT, "e2"),
        (Kind.DELIVERY, "d1"),
    ]
    assert [(r.kind, r.id) for r in rejected] == [
        (Kind.SUBSCRIBE, "s-bad"),
        (Kind.EVENT, "e-wkt"),
        (Kind.EVENT, "e-nowhere"),
        (Kind.DELIVERY, "d-bad"),
    ]
    reasons = [r.reason for r in rejected]
    assert reasons[0].startswith("subscription.topic_filter")
    assert reasons[1].startswith("event.geofence.wkt")
    assert reasons[2].startswith("event.publisher")
    assert reasons[3].startswith("delivery.event.topic")
    # Without a list to report into, the first bad message raises (the strict form).
    with pytest.raises(InvalidInput):
        messages_from_frame(mixed_frame(), PeerGeofenceCache())


def key(m: PeerMessage) -> str:
    if isinstance(m, SubscribeMsg):
        return m.sub.id
    if isinstance(m, UnsubscribeMsg):
        return m.key[1]
    return m.event.id


def test_a_snapshot_converts_entry_by_entry() -> None:
    subs = [
        SubscribeMsg(make_subscription("s1", "c", "a/#"), "eu"),
        SubscribeMsg(make_subscription("s2", "c", "a/#", origin_accepts(CIRCLE)), "eu"),
    ]
    ((frame, _, _),) = snapshot_frames(subs, 1 << 20)
    bad = frame.snapshot.subscriptions.add(home="eu")
    bad.subscription.CopyFrom(gpb.Subscription(id="s-bad", client="c", topic_filter="a/#"))
    bad.subscription.geofence.wkt = "LINESTRING (0 0, 1 1)"
    frame.snapshot.subscriptions.add(home="eu").subscription.CopyFrom(
        gpb.Subscription(id="s3", client="c", topic_filter="a/+")
    )
    rejected: list[RejectedMessage] = []
    got = snapshot_from_frame(frame, PeerGeofenceCache(), rejected)
    assert [m.sub.id for m in got] == ["s1", "s2", "s3"]
    assert [(r.kind, r.id) for r in rejected] == [(Kind.SUBSCRIBE, "s-bad")]
    assert "POLYGON or MULTIPOLYGON" in rejected[0].reason
    with pytest.raises(InvalidInput):
        snapshot_from_frame(frame, PeerGeofenceCache())


# -- property: whatever the origin accepted, a peer accepts -----------------

# Biased towards the antimeridian and the poles, where normalizing changes a shape most.
LAT = st.one_of(st.floats(-90.0, 90.0), st.floats(80.0, 90.0), st.floats(-90.0, -80.0))
LON = st.one_of(st.floats(-180.0, 180.0), st.floats(175.0, 180.0), st.floats(-180.0, -175.0))


@st.composite
def circle_inputs(draw: st.DrawFn) -> dict[str, object]:
    """Client circles anywhere (poles and ±180 included), from 1e-9 m to the 5,000 km limit."""
    radius = draw(
        st.one_of(
            st.sampled_from([1e-9, 1e-3, 1.0, 1e3, 1e6, 5e6]),
            st.floats(1e-9, 5e6),
        )
    )
    return {"circle": {"lat": draw(LAT), "lon": draw(LON), "radius_m": radius}}


@st.composite
def ring_inputs(draw: st.DrawFn) -> str:
    """Client WKT: star-shaped rings (often across ±180) of 3 to 2,000 vertices.

    Many are invalid (crossing edges, rings winding round a pole); the origin
    rejects those and the property skips them.
    """
    n = draw(st.one_of(st.integers(3, 12), st.sampled_from([500, 2000])))
    lon, lat = draw(LON), draw(st.floats(-89.0, 89.0))
    scale = draw(st.sampled_from([1e-7, 1e-3, 0.5, 10.0, 60.0]))
    stretch = draw(st.floats(0.2, 3.0))
    phase = draw(st.floats(0.0, 2 * math.pi))
    pts = []
    for i in range(n):
        a = phase + 2 * math.pi * i / n
        x = lon + scale * stretch * math.cos(a)
        y = max(-90.0, min(90.0, lat + scale * math.sin(a)))
        pts.append(((x + 180.0) % 360.0 - 180.0, y))
    pts.append(pts[0])
    return "POLYGON((" + ", ".join(f"{x!r} {y!r}" for x, y in pts) + "))"


@settings(max_examples=150, deadline=None)
@given(fence=st.one_of(circle_inputs(), ring_inputs()))
def test_every_geofence_the_origin_accepts_every_peer_accepts(fence: object) -> None:
    try:
        accepted = origin_accepts(fence)
    except InvalidInput:
        return  # rejected where it entered: it never travels
    msgs, rejected = forwarded(accepted)
    assert rejected == []
    assert isinstance(msgs[0], SubscribeMsg) and isinstance(msgs[1], EventMsg)
    assert_same_shape(msgs[0].sub.geofence, accepted)
    assert_same_shape(msgs[1].event.geofence, accepted)


def test_strategy_transition_messages_round_trip_and_bad_ones_are_rejected_alone() -> None:
    """Tables and proposals (protocol 4) travel in frames, after deliveries; a table a peer
    sends that does not validate is skipped naming its field, the rest of the frame is kept."""
    table = StrategyTable("event-geofence").with_entry("t/#", "flooding-subscriptions")
    table = table.with_entry("u/#", "event-geofence", adaptive=True)  # the controller's
    frame = gw.new_frame()
    for msg in (
        TableMsg(table, Phase.PREPARED),
        ProposeMsg("u/+", "flooding-events"),
        ProposeMsg("u/+", None),
    ):
        gw.add_to_frame(frame, msg, "a")
    bad = frame.tables.add(phase=1)
    bad.table.CopyFrom(gw.table_to_pb(table))
    bad.table.entries[0].strategy = "gossip"
    rejected: list[gw.RejectedMessage] = []
    msgs = gw.messages_from_frame(frame, gw.PeerGeofenceCache(), rejected)
    assert msgs == [
        TableMsg(table, Phase.PREPARED),
        ProposeMsg("u/+", "flooding-events"),
        ProposeMsg("u/+", None),
    ]
    assert [(r.kind.value, r.id) for r in rejected] == [("transition", "2")]  # its epoch
    assert rejected[0].reason.startswith("tables.table.entries[0].strategy")
    with pytest.raises(InvalidInput) as err:
        gw.set_strategy_request("a/#/b", "event-geofence")
    assert err.value.field == "topic_filter"
    with pytest.raises(InvalidInput) as err:
        gw.set_strategy_request("a/#", "gossip")
    assert err.value.field == "strategy"


def test_adaptive_reports_round_trip_and_a_bad_one_is_rejected_alone() -> None:
    """The adaptive controller's report (docs/design.md §13) travels last in a frame; one
    naming an unknown strategy or a bad key is skipped naming its field."""
    share = KeyWindow("t/#", "event-geofence", events=3, subscribes=1, event_reach=9)
    share.predicted = {"event-geofence": 6, "subscription-geofence": 4}
    share.moved = {"event-geofence": 0, "subscription-geofence": 1}
    report = ReportMsg(7, (share, KeyWindow("u/#", "flooding-events")))
    frame = gw.new_frame()
    gw.add_to_frame(frame, ProposeMsg("u/+", None), "a")
    gw.add_to_frame(frame, report, "a")
    for window, key, strategy in ((8, "t/#", "gossip"), (9, "t/#/x", "event-geofence")):
        bad = frame.reports.add(window=window)
        bad.keys.add(key=key).predicted.add(strategy=strategy, messages=1)
    rejected: list[gw.RejectedMessage] = []
    msgs = gw.messages_from_frame(frame, gw.PeerGeofenceCache(), rejected)
    assert msgs == [ProposeMsg("u/+", None), report]
    assert [(r.kind, r.id) for r in rejected] == [(Kind.CONTROL, "8"), (Kind.CONTROL, "9")]
    assert rejected[0].reason.startswith("reports.keys[0].predicted.strategy")
    assert rejected[1].reason.startswith("reports.keys[0].key")
    assert gw.FRAME_RANK[report.kind.value] > gw.FRAME_RANK["transition"]


def test_handover_flushes_cross_a_frame_and_are_applied_after_its_events_and_deliveries() -> None:
    frame = gw.new_frame()
    flushes = [FlushMsg(3, False), FlushMsg(4, True)]
    event = EventMsg(make_event("e1", "t/x", ll(48.1, 11.6)))
    gw.add_to_frame(frame, flushes[0], "a")
    gw.add_to_frame(frame, event, "a")
    gw.add_to_frame(frame, flushes[1], "a")
    wire = fpb.Frame.FromString(frame.SerializeToString())
    assert gw.messages_from_frame(wire, gw.PeerGeofenceCache()) == [event, *flushes]
    assert gw.FRAME_RANK[Kind.CONTROL.value] == max(gw.FRAME_RANK.values())


def test_queue_handoffs_and_session_transfers_cross_a_frame_as_control_traffic() -> None:
    roaming = make_subscription("r", "walker", "t/#", "roam:circle:2000").placed(ll(48.85, 2.35))
    plain = make_subscription("p", "walker", "u/+")
    session = SessionMsg(
        7,
        "walker",
        "alice",
        ll(40.71, -74.0),
        600.0,
        (roaming, plain),
        (("p", 1),),
        (("p", ("e9", "e8")), ("r", ())),
    )
    handoff = HandoffMsg("h1", ("walker", "p"), (b"one", b"two"))
    frame = gw.new_frame()
    for msg in (session, handoff):
        gw.add_to_frame(frame, msg, "eu")
    wire = fpb.Frame.FromString(frame.SerializeToString())
    got = gw.messages_from_frame(wire, gw.PeerGeofenceCache())
    assert got[0] == handoff  # control traffic in field order: reports, flushes, handoffs, sessions
    taken = got[1]
    assert isinstance(taken, SessionMsg)
    assert (taken.token, taken.client, taken.owner, taken.at, taken.expiry_s, taken.qos) == (
        7,
        "walker",
        "alice",
        ll(40.71, -74.0),
        600.0,
        (("p", 1),),
    )
    assert taken.queued == (("p", ("e9", "e8")), ("r", ()))  # newest first, as sent
    # The roaming one keeps its shape (the receiver places it at the client's new location).
    assert [(s.key, s.roaming is not None) for s in taken.subs] == [
        (("walker", "r"), True),
        (("walker", "p"), False),
    ]
    assert (
        gw.FRAME_RANK[session.kind.value]
        == gw.FRAME_RANK[handoff.kind.value]
        == max(gw.FRAME_RANK.values())
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda st: setattr(st, "expiry_s", 0.0), "session.expiry_s"),
        (lambda st: setattr(st, "client", ""), "session.client"),
        (lambda st: st.mqtt_qos.__setitem__("p", 2), "session.mqtt_qos"),
        (lambda st: st.subscriptions[0].subscription.__setattr__("client", "other"),
         "session.subscriptions.client"),
        (lambda st: st.ClearField("at"), "session.at"),
        (lambda st: st.queued.add(subscription_id="nope"), "session.queued.subscription_id"),
        (lambda st: st.queued.add(subscription_id="p", event_ids=[""]),
         "session.queued.event_ids"),
    ],
)  # fmt: skip
def test_a_bad_session_transfer_is_rejected_by_field(change: Any, field: str) -> None:
    plain = make_subscription("p", "walker", "u/+")
    session = SessionMsg(7, "walker", "", ll(40.71, -74.0), 600.0, (plain,), ())
    frame = gw.new_frame()
    gw.add_to_frame(frame, session, "eu")
    change(frame.sessions[0])
    rejected: list[RejectedMessage] = []
    assert gw.messages_from_frame(frame, gw.PeerGeofenceCache(), rejected) == []
    assert [(r.kind, r.reason.split(":")[0]) for r in rejected] == [(Kind.CONTROL, field)]
