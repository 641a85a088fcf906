"""A message a peer cannot apply costs only itself: not its frame, not the link.

Brokers of the bundled `three` federation (eu, us, ap) as `BrokerServer` objects that
are never started (no sockets): frames go straight to `receive_frame`, or through a
`PeerLink` over the in-memory wires of test_peer_link. Tests wait for state (an
acknowledgement, a redial), never for time.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import shapely
from node_fixtures import unstarted_node
from test_peer_link import FakeHost, Wire, accept, dial_into_wires, event, run

from geofed import wire as gw
from geofed.errors import Unavailable
from geofed.node import (
    PEER_MESSAGES_RECEIVED,
    PEER_MESSAGES_REJECTED,
    BrokerServer,
    _links,
)
from geofed.node._auth import Principal
from geofed.routing import (
    EventMsg,
    Geofence,
    InvalidInput,
    Kind,
    Outcome,
    PeerMessage,
    PermissionDenied,
    Send,
    SubscribeMsg,
    make_event,
    make_subscription,
    parse_geofence,
)
from geofed.routing import latlon as ll
from geofed.v1 import federation_pb2 as fpb
from geofed.v1 import geo_pb2 as gpb

TOKYO = ll(35.68, 139.77)  # ap
PARIS = ll(48.85, 2.35)  # eu
SEAM = ll(0.0, 179.9)  # ap, just west of the antimeridian
# What an origin that took a 1e-9 m circle forwarded: 64 positions that round to one point.
DEGENERATE = "POLYGON ((" + ", ".join(["139.77 35.68000000000001"] * 65) + "))"


def node(broker_id: str, strategy: str = "event-geofence") -> BrokerServer:
    return unstarted_node(
        broker_id,
        strategy=strategy,
        reconnect_initial_s=0.001,
        reconnect_max_s=0.01,
        peer_timeout_s=0,
    )


def metric(n: BrokerServer, name: str, peer: str, kind: Kind) -> float:
    return n.metrics.registry.get_sample_value(name, {"peer": peer, "kind": kind.value}) or 0.0


def record_deliveries(n: BrokerServer) -> list[str]:
    """Event ids `n` hands to its local subscribers, in order."""
    got: list[str] = []
    n._stage_deliveries = lambda deliveries, origin, staged: got.extend(  # type: ignore[method-assign]
        d.event.id for d in deliveries
    )
    return got


def subscriber(n: BrokerServer, sid: str, where: object, fence: object = None) -> None:
    assert n.core.connect(f"client-{sid}", where) is None  # type: ignore[arg-type]
    n.core.subscribe(make_subscription(sid, f"client-{sid}", "t/#", fence))


def frame_of(msgs: list[PeerMessage], origin: str, seq: int = 1) -> fpb.Frame:
    frame = gw.new_frame()
    for m in msgs:
        gw.add_to_frame(frame, m, origin)
    frame.seq = seq
    return fpb.Frame.FromString(frame.SerializeToString())


def forward(src: BrokerServer, sends: list[Send], dst: BrokerServer) -> None:
    """What the link from `src` to `dst` would carry, as one frame."""
    msgs = [s.msg for s in sends if s.dst == dst.broker_id]
    assert msgs, f"{src.broker_id} sends nothing to {dst.broker_id}"
    receive(dst, src.broker_id, frame_of(msgs, src.broker_id))


def receive(dst: BrokerServer, peer: str, frame: fpb.Frame) -> None:
    """`dst` applies a frame from `peer` (not durable: nothing to wait for)."""
    asyncio.run(dst.receive_frame(peer, frame))


def ring_wkt(n: int, lon: float = 180.0, lat: float = 0.0, r: float = 5.0) -> str:
    """A closed ring of `n` positions around (lon, lat), longitudes wrapped into [-180, 180]."""
    pts = []
    for i in range(n - 1):
        a = 2 * math.pi * i / (n - 1)
        x = lon + r * math.cos(a)
        pts.append((x - 360.0 if x > 180.0 else x, lat + r * math.sin(a)))
    pts.append(pts[0])
    return "POLYGON((" + ", ".join(f"{x!r} {y!r}" for x, y in pts) + "))"


def widest_ring(n: BrokerServer, field: str) -> Geofence:
    """The ring of the most positions across ±180 that `n` accepts from a client."""
    limit = n.config.max_geofence_vertices
    for count in range(limit, limit - 100, -1):
        try:
            fence = n.geofences.get(ring_wkt(count), field)
        except InvalidInput:
            continue
        assert fence is not None and fence.vertex_count > count  # the cut added vertices
        return fence
    raise AssertionError(f"no ring of about {limit} positions accepted")


def test_one_bad_event_is_skipped_and_counted_the_rest_of_the_frame_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ap = node("ap")
    got = record_deliveries(ap)
    subscriber(ap, "s1", TOKYO)
    around_tokyo = parse_geofence(ring_wkt(50, TOKYO.lon, TOKYO.lat))
    frame = frame_of(
        [
            EventMsg(make_event("e1", "t/a", PARIS)),
            EventMsg(make_event("e2", "t/a", PARIS)),
            EventMsg(make_event("e3", "t/a", PARIS, around_tokyo)),
            EventMsg(make_event("e4", "t/a", PARIS)),
            # As an origin normalized it: taken as it is (and Tokyo is not in it).
            EventMsg(make_event("e5", "t/a", PARIS, Geofence(shapely.from_wkt(DEGENERATE)))),
        ],
        "eu",
    )
    frame.events[1].geofence.wkt = "POINT (139.77 35.68)"  # no area: cannot be converted
    frame.events.insert(3, gpb.Event(id="e-nowhere", topic="t/a"))  # no publisher location
    receive(ap, "eu", frame)
    assert got == ["e1", "e3", "e4"]
    assert metric(ap, PEER_MESSAGES_REJECTED, "eu", Kind.EVENT) == 2
    assert metric(ap, PEER_MESSAGES_RECEIVED, "eu", Kind.EVENT) == 6  # read = sent
    logged = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(logged) == 2  # once each, with the id and the reason
    assert "'e2'" in logged[0] and "event.geofence.wkt" in logged[0]
    assert "'e-nowhere'" in logged[1] and "event.publisher" in logged[1]

    # One that converts but fails to apply is skipped the same way.
    on_message = ap.core.on_message

    def failing(src: str, msg: PeerMessage) -> Outcome:
        if isinstance(msg, EventMsg) and msg.event.id == "f2":
            raise RuntimeError("boom")
        return on_message(src, msg)

    ap.core.on_message = failing  # type: ignore[method-assign]
    receive(
        ap,
        "eu",
        frame_of([EventMsg(make_event(eid, "t/a", PARIS)) for eid in ("f1", "f2", "f3")], "eu"),
    )
    assert got[3:] == ["f1", "f3"]
    assert metric(ap, PEER_MESSAGES_REJECTED, "eu", Kind.EVENT) == 3
    assert metric(ap, PEER_MESSAGES_RECEIVED, "eu", Kind.EVENT) == 9


def test_geofence_of_max_vertices_across_the_antimeridian_is_accepted_by_peers() -> None:
    """The origin takes the widest ring across ±180 its max_geofence_vertices allows (the cut
    makes it longer); the peer applies it, as an event geofence and as a subscription
    geofence."""
    # Event forwarding: eu publishes with the geofence, ap matches its subscriber in it.
    eu, ap = node("eu"), node("ap")
    got = record_deliveries(ap)
    subscriber(ap, "s1", SEAM)
    fence = widest_ring(eu, "request.event.geofence.wkt")  # the client path's check
    forward(eu, eu.core.publish(make_event("e1", "t/a", PARIS, fence)).sends, ap)
    assert got == ["e1"]
    assert metric(ap, PEER_MESSAGES_REJECTED, "eu", Kind.EVENT) == 0

    # Subscription forwarding: eu's subscription reaches ap, ap's publisher matches it there.
    eu, ap = node("eu", "flooding-subscriptions"), node("ap", "flooding-subscriptions")
    got = record_deliveries(eu)
    subscriber(eu, "s2", PARIS, widest_ring(eu, "subscription.geofence.wkt"))
    forward(eu, eu.core.subscribe(eu.core.local.get(("client-s2", "s2"))), ap)  # type: ignore[arg-type]
    assert ap.core.remote_home(("client-s2", "s2")) == "eu"
    forward(ap, ap.core.publish(make_event("e2", "t/a", SEAM)).sends, eu)
    assert got == ["e2"]
    assert metric(ap, PEER_MESSAGES_REJECTED, "eu", Kind.SUBSCRIBE) == 0


def test_a_bad_snapshot_entry_is_skipped_and_the_dialler_stays_up_across_reconnects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """eu dials us (subscription-geofence); the test plays us and, on every session, sends
    a snapshot with one subscription eu cannot convert among good ones (whose geofences are
    as origins normalized them: the degenerate ring of a 1e-9 m circle, the widest ring
    across ±180).
    eu applies the good ones, counts the bad one, acknowledges the frame and keeps the
    session: no redial until the test cuts the wire."""
    dialled = dial_into_wires(monkeypatch)
    tiny = Geofence(shapely.from_wkt(DEGENERATE))
    wide = widest_ring(node("us", "subscription-geofence"), "subscription.geofence")
    good = [
        SubscribeMsg(make_subscription("s1", "c1", "t/#", tiny), "us"),
        SubscribeMsg(make_subscription("s3", "c3", "t/#", wide), "us"),
    ]
    ((snapshot, _, _),) = gw.snapshot_frames(good, 1 << 30)
    bad = snapshot.snapshot.subscriptions.add(home="us").subscription
    bad.CopyFrom(gpb.Subscription(id="s2", client="c2", topic_filter="t/#"))
    bad.geofence.wkt = "LINESTRING (0 0, 1 1)"
    snapshot.snapshot.subscriptions.add(home="us").subscription.CopyFrom(
        gpb.Subscription(id="s4", client="c4", topic_filter="t/+")
    )
    snapshot.seq = 1

    async def session(eu: BrokerServer, n: int) -> Wire:
        wire = await dialled.get()
        first = await wire.peer_end.read()
        assert first is not None and first.hello.broker_id == "eu"
        await wire.peer_end.write(
            gw.hello_frame(
                "us", eu.config.strategy, eu.federation.digest, _links.PROTOCOL_VERSION, n
            )
        )
        await wire.peer_end.write(snapshot)
        while True:  # eu's snapshot (empty), then the acknowledgement of ours
            frame = await wire.peer_end.read()
            assert frame is not None, "eu closed the session"
            if frame.ack.seq == 1:
                return wire

    async def test() -> None:
        eu = node("eu", "subscription-geofence")
        link = eu.links["us"]
        link.start()
        for n in (1, 2):
            wire = await session(eu, n)
            assert link.connected and dialled.empty()
            held = sorted(s.id for s in eu.core.remote if eu.core.remote_home(s.key) == "us")
            assert held == ["s1", "s3", "s4"]
            assert metric(eu, PEER_MESSAGES_REJECTED, "us", Kind.SUBSCRIBE) == n
            assert metric(eu, PEER_MESSAGES_RECEIVED, "us", Kind.SUBSCRIBE) == 4 * n
            wire.cut()  # the reconnect: the same snapshot again
        await link.stop()

    run(test)


def test_a_frame_the_host_fails_on_is_still_acknowledged_and_the_link_stays_up() -> None:
    """Even an error escaping the host (a bug, not one message's content) leaves the session
    up and the frame acknowledged: the peer would otherwise resend it on every reconnect."""

    class FailingHost(FakeHost):
        async def receive_frame(self, peer: str, frame: fpb.Frame) -> None:
            await super().receive_frame(peer, frame)
            if frame.seq == 1:
                raise RuntimeError("a bug in the host")

    async def test() -> None:
        host = FailingHost()
        link = host.make_link()
        wire, task, _ = await accept(link)
        for seq, eid in ((1, "p1"), (2, "p2")):
            await wire.peer_end.write(frame_of([event(eid)], "a", seq))
            while (reply := await wire.peer_end.read()) is not None and reply.ack.seq != seq:
                pass
            assert reply is not None and not task.done()
        assert host.applied == ["p1", "p2"] and link.connected
        await link.stop()

    run(test)


def test_a_strategy_change_needs_an_admin_and_every_link() -> None:
    """With client authentication only `strategy_admins` may change the table (rule
    `strategy`, counted); anyone else's request changes nothing. A change asked for while
    a link is down is refused as unavailable, naming the link; a bad one names the field."""
    n = node("eu")
    object.__setattr__(n.config, "client_auth", "token")  # the check, without a token setup
    object.__setattr__(n.config, "strategy_admins", "ops")

    async def test() -> None:
        with pytest.raises(PermissionDenied) as denied:
            await n.set_strategy(Principal("bob", ("dev",)), "t/#", "flooding-events")
        assert denied.value.rule == "strategy"
        refused = n.metrics.registry.get_sample_value(
            "geofed_auth_refused_total", {"reason": "strategy"}
        )
        assert refused == 1
        with pytest.raises(InvalidInput) as bad:
            await n.set_strategy(Principal("carol", ("ops",)), "t/#", "gossip")
        assert bad.value.field == "strategy"
        with pytest.raises(Unavailable, match="link to ap, us down"):
            await n.set_strategy(Principal("carol", ("ops",)), "t/#", "flooding-events")
        assert n.core.newest_table.epoch == 0 and not n.core.in_transition

    asyncio.run(test())
