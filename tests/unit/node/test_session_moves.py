"""A persistent session and its queues move with the client (docs/design.md §7).

The broker a client left hands the deliveries it had queued, not acknowledged, to the
client's new broker (`HandoffMsg`); the new broker queues them for the same
subscription with offsets of its own. For a client whose protocol has no leave step
(MQTT), the old broker first sends the session itself (`SessionMsg`), which the new
broker opens with its subscriptions. Brokers of the bundled `three` federation as
`BrokerServer` objects that are never started (an in-memory store, no sockets):
frames go straight to `receive_frame`, handoffs are read from the link's queue.
"""

from __future__ import annotations

import asyncio

import pytest
from node_fixtures import unstarted_node
from test_peer_isolation import frame_of

from geofed.node import (
    HANDOFF_DELIVERIES,
    HANDOVERS,
    PEER_MESSAGES_REJECTED,
    SESSION_TRANSFERS,
    BrokerServer,
)
from geofed.node import _server as node_server
from geofed.node._auth import ANONYMOUS
from geofed.routing import (
    Delivery,
    HandoffMsg,
    Kind,
    SessionMsg,
    latlon,
    make_event,
    make_subscription,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import geo_pb2 as gpb

PARIS = latlon(48.85, 2.35)  # eu
NEW_YORK = latlon(40.71, -74.0)  # us
KEY = ("walker", "q")


def node(broker_id: str) -> BrokerServer:
    n = unstarted_node(broker_id)
    n.store.open()  # in memory
    return n


def handoffs(n: BrokerServer, peer: str) -> list[HandoffMsg]:
    return [m for m, _ in n.links[peer]._queue if isinstance(m, HandoffMsg)]


def handed(n: BrokerServer, outcome: str) -> float:
    return n.metrics.registry.get_sample_value(HANDOFF_DELIVERIES, {"outcome": outcome}) or 0.0


async def persistent_subscriber(n: BrokerServer, where: object) -> None:
    """`KEY`'s client with a persistent session at `n` and subscription "q", no stream."""
    opened = await n.client_connect(ANONYMOUS, KEY[0], where, 600.0)  # type: ignore[arg-type]
    assert opened.redirect is None
    _, stream = await n.client_subscribe(
        ANONYMOUS, KEY[0], gpb.Subscription(id=KEY[1], topic_filter="t/#")
    )
    n.client_stream_closed(KEY, stream)  # the client went away: its deliveries are queued


async def queue(n: BrokerServer, ids: list[str]) -> None:
    """Deliveries of events `ids` to `KEY`, as a publish here would stage them."""
    staged = node_server._Staged()
    events = [make_event(i, "t/x", PARIS, payload=i.encode()) for i in ids]
    n._stage_deliveries([Delivery(e, KEY[1], KEY[0]) for e in events], n.broker_id, staged)
    await n._commit(staged)


async def queued(n: BrokerServer) -> list[tuple[int, str]]:
    """(offset, event id) of what `n` holds queued for `KEY`, oldest first."""
    return [(offset, d.event.id) for offset, d in await n.replay(KEY, 0)]


def test_a_client_that_leaves_takes_its_queue_to_its_new_broker() -> None:
    async def run() -> None:
        eu, us = node("eu"), node("us")
        await persistent_subscriber(eu, PARIS)
        await queue(eu, ["e1", "e2", "e3"])
        await eu.ack(KEY[0], KEY[1], 1)  # processed: not moved
        await persistent_subscriber(us, NEW_YORK)  # the renewal at the new broker
        assert await eu._end_move(KEY[0], NEW_YORK)
        assert KEY not in eu.pending and KEY[0] not in eu.core.sessions
        assert await queued(eu) == []
        sent = handoffs(eu, "us")
        assert [len(m.deliveries) for m in sent] == [2]
        assert handed(eu, "sent") == 2
        await queue(us, ["u1"])  # delivered at us meanwhile
        await us.receive_frame("eu", frame_of(sent, "eu"))
        assert await queued(us) == [(1, "u1"), (2, "e2"), (3, "e3")]
        assert handed(us, "queued") == 2
        # The same handoff again (a frame resent after a broken link): taken once.
        await us.receive_frame("eu", frame_of(sent, "eu", seq=2))
        assert await queued(us) == [(1, "u1"), (2, "e2"), (3, "e3")]
        assert handed(us, "queued") == 2

    asyncio.run(run())


def test_a_large_queue_goes_in_several_handoffs(monkeypatch: pytest.MonkeyPatch) -> None:
    async def run() -> None:
        eu = node("eu")
        await persistent_subscriber(eu, PARIS)
        ids = [f"e{i}" for i in range(7)]
        await queue(eu, ids)
        one = len((await eu.store.pending_page(node_server._stored(KEY), 0, 1))[0][1])
        monkeypatch.setattr(node_server, "_HANDOFF_BYTES", 3 * one)
        assert await eu._end_move(KEY[0], NEW_YORK)
        sent = handoffs(eu, "us")
        assert [len(m.deliveries) for m in sent] == [3, 3, 1]
        assert len({m.id for m in sent}) == 3
        got = [cpb.Delivery.FromString(d).event.id for m in sent for d in m.deliveries]
        assert got == ids

    asyncio.run(run())


def test_a_handoff_without_its_subscription_is_dropped_and_a_bad_one_rejected() -> None:
    async def run() -> None:
        us = node("us")
        good = cpb.Delivery(subscription_id=KEY[1], event=gpb.Event(id="e1", topic="t/x"))
        lost = HandoffMsg("h1", KEY, (good.SerializeToString(),))
        await us.receive_frame("eu", frame_of([lost], "eu"))
        assert handed(us, "dropped") == 1
        await persistent_subscriber(us, NEW_YORK)
        bad = HandoffMsg("h2", KEY, (b"\xff not a delivery",))
        fine = HandoffMsg("h3", KEY, (good.SerializeToString(),))
        await us.receive_frame("eu", frame_of([bad, fine], "eu", seq=2))
        rejected = us.metrics.registry.get_sample_value(
            PEER_MESSAGES_REJECTED, {"peer": "eu", "kind": Kind.CONTROL.value}
        )
        assert rejected == 1
        assert await queued(us) == [(1, "e1")]  # the rest of the frame was applied

    asyncio.run(run())


def transfers(n: BrokerServer, outcome: str) -> float:
    return n.metrics.registry.get_sample_value(SESSION_TRANSFERS, {"outcome": outcome}) or 0.0


async def transfer(n: BrokerServer, peer: str, msg: SessionMsg, seq: int = 1) -> None:
    """`msg` from `peer` in a frame of sequence `seq`, taken by `n` (its task done)."""
    await n.receive_frame(peer, frame_of([msg], peer, seq=seq))
    await asyncio.gather(*n._background)


def test_a_transferred_session_is_opened_with_its_subscriptions() -> None:
    async def run() -> None:
        us = node("us")
        roaming = make_subscription("r", KEY[0], "t/#", "roam:circle:2000").placed(PARIS)
        plain = make_subscription(KEY[1], KEY[0], "u/+")
        msg = SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (roaming, plain), ((KEY[1], 1),))
        await transfer(us, "eu", msg)
        assert transfers(us, "taken") == 1
        assert us.core.sessions[KEY[0]] == NEW_YORK and us.persistent(KEY[0])
        placed = us.core.local.get((KEY[0], "r"))
        assert placed is not None and placed.at == NEW_YORK  # placed anew, where the client is
        assert set(us.pending) == {(KEY[0], "r"), KEY}  # queues: deliveries wait for the client
        # The client arrives: its session is there, and it is the one transferred.
        opened = await us.client_connect(ANONYMOUS, KEY[0], NEW_YORK, 600.0)
        assert opened.present and opened.redirect is None

    asyncio.run(run())


def test_a_transfer_outside_the_area_is_refused_and_one_to_a_session_here_adds_to_it() -> None:
    async def run() -> None:
        us = node("us")
        alien = SessionMsg(4, KEY[0], "", PARIS, 600.0, (), ())  # eu's area
        await transfer(us, "eu", alien)
        assert transfers(us, "refused") == 1 and KEY[0] not in us.core.sessions
        await persistent_subscriber(us, NEW_YORK)  # the client was here first, with "q"
        more = make_subscription("r", KEY[0], "v/#")
        await transfer(us, "eu", SessionMsg(5, KEY[0], "", NEW_YORK, 60.0, (more,), ()), seq=2)
        assert transfers(us, "taken") == 1
        assert {s.id for s in us.core.subscriptions_of(KEY[0])} == {"q", "r"}
        assert us._sessions[KEY[0]].expiry_s == 600.0  # the longer expiry stays

    asyncio.run(run())


def test_a_session_transferred_back_to_a_broker_still_holding_it_stays() -> None:
    """The client left eu (held) and its session comes back before eu let go: the hold
    ends as for a client that returns, and nothing of the session is withdrawn."""

    async def run() -> None:
        eu = node("eu")
        await persistent_subscriber(eu, PARIS)
        _, held_s = await eu.client_handover(ANONYMOUS, KEY[0], NEW_YORK)
        assert held_s > 0 and KEY[0] in eu._held
        sub = eu.core.local.get(KEY)
        assert sub is not None
        back = SessionMsg(6, KEY[0], "", PARIS, 600.0, (sub,), ())
        await transfer(eu, "us", back)
        assert KEY[0] not in eu._held  # no timer or leave withdraws it any more
        assert eu.core.sessions[KEY[0]] == PARIS and KEY in eu.pending
        returned = eu.metrics.registry.get_sample_value(HANDOVERS, {"outcome": "returned"})
        assert returned == 1

    asyncio.run(run())


def test_a_handoff_to_a_transferred_session_drops_what_was_queued_here_since() -> None:
    """Events both brokers matched while the session moved reach the client once: the
    new broker drops from the handoff those it queued itself since the session came."""

    async def run() -> None:
        us = node("us")
        plain = make_subscription(KEY[1], KEY[0], "t/#")
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (plain,), ()))
        await queue(us, ["both"])  # matched here too, after the session came
        items = [
            cpb.Delivery(subscription_id=KEY[1], event=gpb.Event(id=i, topic="t/x"), offset=n)
            for n, i in enumerate(["old", "both"], start=7)
        ]
        handoff = HandoffMsg("h", KEY, tuple(d.SerializeToString() for d in items))
        await us.receive_frame("eu", frame_of([handoff], "eu", seq=2))
        assert await queued(us) == [(1, "both"), (2, "old")]
        assert handed(us, "duplicate") == 1 and handed(us, "queued") == 1

    asyncio.run(run())


def old_and_both_handoff(seq: int) -> HandoffMsg:
    """eu's handoff of "old" (queued at eu alone) and "both" (queued at us too)."""
    items = [
        cpb.Delivery(subscription_id=KEY[1], event=gpb.Event(id=i, topic="t/x"))
        for i in ["old", "both"]
    ]
    return HandoffMsg(f"h{seq}", KEY, tuple(d.SerializeToString() for d in items))


def test_a_session_transferred_again_keeps_what_came_here_since_the_first() -> None:
    """eu sent the session, was restarted, and sends it again when its hold runs out:
    what us queued since the first transfer still drops from eu's handoff."""

    async def run() -> None:
        us = node("us")
        plain = make_subscription(KEY[1], KEY[0], "t/#")
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (plain,), ()))
        await queue(us, ["both"])
        await transfer(us, "eu", SessionMsg(1, KEY[0], "", NEW_YORK, 600.0, (plain,), ()), seq=2)
        await us.receive_frame("eu", frame_of([old_and_both_handoff(3)], "eu", seq=3))
        assert await queued(us) == [(1, "both"), (2, "old")]
        assert handed(us, "duplicate") == 1

    asyncio.run(run())


def test_what_arrived_for_a_session_that_left_is_forgotten() -> None:
    """The session left us (its queue handed on) and comes again: what us queued during
    its earlier stay is no reason to drop anything from the next handoff."""

    async def run() -> None:
        us = node("us")
        plain = make_subscription(KEY[1], KEY[0], "t/#")
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (plain,), ()))
        await queue(us, ["both"])
        assert await us._end_move(KEY[0], PARIS)  # handed on to eu
        assert KEY not in us._arrived
        await transfer(us, "eu", SessionMsg(4, KEY[0], "", NEW_YORK, 600.0, (plain,), ()), seq=2)
        await us.receive_frame("eu", frame_of([old_and_both_handoff(3)], "eu", seq=3))
        assert [i for _, i in await queued(us)] == ["old", "both"]
        assert handed(us, "duplicate") == 0

    asyncio.run(run())


def test_what_the_client_gets_from_the_broker_it_came_from_is_not_matched_again() -> None:
    async def run() -> None:
        us = node("us")
        plain = make_subscription(KEY[1], KEY[0], "t/#")
        sent = SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (plain,), (), ((KEY[1], ("e1",)),))
        await transfer(us, "eu", sent)
        await queue(us, ["e1", "e2"])  # e1 reaches us after the session: eu sent it already
        assert await queued(us) == [(1, "e2")]
        assert handed(us, "duplicate") == 1

    asyncio.run(run())


def test_an_event_handed_off_before_it_reaches_the_new_broker_is_not_matched_again() -> None:
    """eu's handoff reaches us before one of its events does (that event's own path from
    its publisher is slower): us matches it then, but the client has it from the handoff."""

    async def run() -> None:
        us = node("us")
        plain = make_subscription(KEY[1], KEY[0], "t/#")
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (plain,), ()))
        await us.receive_frame("eu", frame_of([old_and_both_handoff(2)], "eu", seq=2))
        await queue(us, ["both", "new"])
        assert await queued(us) == [(1, "old"), (2, "both"), (3, "new")]
        assert handed(us, "duplicate") == 1

    asyncio.run(run())


def test_a_session_back_before_its_broker_let_go_drops_what_the_other_broker_queued() -> None:
    """The client went eu -> us and comes back before eu let go. eu queued events while
    it held the session; those us queued too (`SessionMsg.queued`) reach the client
    from us (delivered there, or in us' handoff), so eu drops them from its queue, and
    drops from us' handoff what it kept."""

    async def run() -> None:
        eu, us = node("eu"), node("us")
        await persistent_subscriber(eu, PARIS)
        await eu.client_handover(ANONYMOUS, KEY[0], NEW_YORK)
        sub = eu.core.local.get(KEY)
        assert sub is not None
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (sub,), ()))
        await queue(eu, ["early", "both1", "both2", "late"])  # eu still holds the session
        await queue(us, ["both1", "both2", "only-us"])  # what us matched since it came
        # us sends it back (the client heads for eu): its message names what us queued.
        back = us._arrived_ids([sub])
        assert back == ((KEY[1], ("only-us", "both2", "both1")),)  # newest first
        info = eu.pending[KEY]
        before = info.bytes
        await transfer(eu, "us", SessionMsg(4, KEY[0], "", PARIS, 600.0, (sub,), (), back))
        assert KEY[0] not in eu._held
        assert await queued(eu) == [(1, "early"), (4, "late")]
        assert info.count == 2 and 0 < info.bytes < before
        assert handed(eu, "duplicate") == 2
        # us' handoff then: "late" reached us after it sent the session, and eu has it.
        items = [
            cpb.Delivery(subscription_id=KEY[1], event=gpb.Event(id=i, topic="t/x"))
            for i in ["only-us", "late"]
        ]
        handoff = HandoffMsg("h", KEY, tuple(d.SerializeToString() for d in items))
        await eu.receive_frame("us", frame_of([handoff], "us", seq=2))
        assert [i for _, i in await queued(eu)] == ["early", "late", "only-us"]
        assert handed(eu, "duplicate") == 3
        # A broker that did not hold the session keeps its queue as it is.
        await queue(us, ["kept"])
        await transfer(us, "eu", SessionMsg(5, KEY[0], "", NEW_YORK, 600.0, (sub,), (), back))
        assert [i for _, i in await queued(us)] == ["both1", "both2", "only-us", "kept"]

    asyncio.run(run())


def test_a_transfer_names_at_most_a_bounded_number_of_queued_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def run() -> None:
        us = node("us")
        sub = make_subscription(KEY[1], KEY[0], "t/#")
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", NEW_YORK, 600.0, (sub,), ()))
        await queue(us, ["e1", "e2", "e3"])
        monkeypatch.setattr(node_server, "_HANDOFF_BYTES", 5)  # room for two ids of 2 bytes
        assert us._arrived_ids([sub]) == ((KEY[1], ("e3", "e2")),)

    asyncio.run(run())


def test_a_transfer_to_a_broker_the_client_is_connected_to_keeps_what_it_has_there() -> None:
    """eu's hold ran out and eu sends the session, but the client got to us first (it
    renewed there and never left eu): what it subscribed at us and where it reported
    being are newer than eu's copy, so us keeps them and only adds what it lacks."""

    async def run() -> None:
        us = node("us")
        opened = await us.client_connect(ANONYMOUS, KEY[0], NEW_YORK, 600.0)
        assert opened.redirect is None
        await us.client_subscribe(  # its stream stays open: the client is here
            ANONYMOUS, KEY[0], gpb.Subscription(id=KEY[1], topic_filter="new/#")
        )
        boston = latlon(42.36, -71.06)  # us, where the client was when it left eu
        old = make_subscription(KEY[1], KEY[0], "old/#")
        more = make_subscription("r", KEY[0], "v/#")
        await transfer(us, "eu", SessionMsg(3, KEY[0], "", boston, 600.0, (old, more), ()))
        assert transfers(us, "taken") == 1
        assert {s.id: s.topic_filter for s in us.core.subscriptions_of(KEY[0])} == {
            KEY[1]: "new/#",
            "r": "v/#",
        }
        assert us.core.sessions[KEY[0]] == NEW_YORK

    asyncio.run(run())
