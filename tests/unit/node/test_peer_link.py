"""PeerLink in-process: an in-memory transport pair, a fake host, the test as the peer broker.

No sockets and no wall-clock assumptions: tests wait for state (frames read, host
callbacks); the watchdog test drives the link's clock by hand. `SAFETY_S` only turns a
hang into a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from geofed import routing
from geofed import wire as gw
from geofed.node import PEER_LINK_FAILURES, ByteBudget, NodeConfig, NodeMetrics, PeerLink, _links
from geofed.routing import (
    BrokerInfo,
    EventMsg,
    GeofenceCache,
    Kind,
    LatLon,
    PeerMessage,
    RelocateMsg,
    SubscribeMsg,
)
from geofed.v1 import federation_pb2 as fpb

SAFETY_S = 30.0
CACHE = GeofenceCache()
Frames = asyncio.Queue[bytes | None]


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def guarded() -> None:
        async with asyncio.timeout(SAFETY_S):
            await test()

    asyncio.run(guarded())


def event(eid: str) -> EventMsg:
    return EventMsg(routing.make_event(eid, "news/local", routing.latlon(48.1, 11.6)))


def sub(sid: str) -> SubscribeMsg:
    return SubscribeMsg(routing.make_subscription(sid, "client-1", "news/#"), "b")


def hello(broker: str) -> fpb.Frame:
    return gw.hello_frame(broker, "event-geofence", "digest", _links.PROTOCOL_VERSION, 1)


def ids(frame: fpb.Frame) -> list[str]:
    """Event ids a frame carries."""
    return [m.event.id for m in gw.messages_from_frame(frame, CACHE) if isinstance(m, EventMsg)]


class Wire:
    """An in-memory connection; frames cross it serialized. `cut()` breaks both ends."""

    def __init__(self) -> None:
        self.broken = False
        self.queues: tuple[Frames, Frames] = (asyncio.Queue(), asyncio.Queue())
        self.link_end = End(self, *self.queues)
        self.peer_end = End(self, self.queues[1], self.queues[0])

    def cut(self) -> None:
        self.broken = True
        for q in self.queues:
            q.put_nowait(None)


class End:
    """One end of a `Wire`, a `Transport`; frames still in flight when cut are lost."""

    def __init__(self, wire: Wire, inbox: Frames, outbox: Frames) -> None:
        self.wire, self.inbox, self.outbox = wire, inbox, outbox

    async def read(self) -> fpb.Frame | None:
        data = None if self.wire.broken else await self.inbox.get()
        return None if data is None or self.wire.broken else fpb.Frame.FromString(data)

    async def write(self, frame: fpb.Frame) -> None:
        if self.wire.broken:
            raise ConnectionError("wire cut")
        self.outbox.put_nowait(frame.SerializeToString())

    async def frame_with_events(self) -> fpb.Frame:
        """The next frame carrying events (skipping acks and heartbeats)."""
        while True:
            frame = await self.read()
            assert frame is not None, "the link closed the stream"
            if frame.events:
                return frame


class FakeHost:
    """A `LinkHost` recording what its link hands it; drops duplicates as `BrokerServer` does."""

    def __init__(self, broker_id: str = "b", **config: float) -> None:
        self.broker_id = broker_id
        self.budget = ByteBudget(int(config.pop("node_queue_bytes", 1 << 40)))
        self.config = NodeConfig(broker_id=broker_id, federation="-", **config)  # type: ignore[arg-type]
        self.metrics = NodeMetrics(CollectorRegistry())
        self.geofences = GeofenceCache()
        self.peer_geofences = gw.PeerGeofenceCache()
        self.durable = False
        self.subs: list[SubscribeMsg] = []  # what snapshot_for answers
        self.tables: list[routing.PeerMessage] = []  # what tables_for answers
        self.applied: list[str] = []  # event ids received, duplicates dropped
        self.snapshots: list[tuple[list[str], bool]] = []  # (subscription ids, replace)
        self.frames = 0  # frames received
        self.sent: list[str] = []  # event ids written to the peer
        self.states: list[bool] = []  # link.connected at each link_state_changed
        self._poke = asyncio.Event()

    def make_link(self, peer: str = "a") -> PeerLink:
        self.link = PeerLink(self, BrokerInfo(peer, area=None))  # type: ignore[arg-type]
        return self.link

    def metric(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"peer": self.link.peer.id})

    async def until(self, pred: Callable[[], bool]) -> None:
        """Wait until `pred()` holds, re-checking after every host callback."""
        while not pred():
            self._poke.clear()
            await self._poke.wait()

    # -- LinkHost --
    def hello(self) -> fpb.Frame:
        return gw.hello_frame(
            self.broker_id, "event-geofence", "digest", _links.PROTOCOL_VERSION, 1
        )

    def dial(self, peer: BrokerInfo) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(peer.endpoint, options=[])

    def check_hello(self, hello: fpb.Hello, expect: str | None = None) -> str:
        return "" if expect in (None, hello.broker_id) else f"expected {expect}"

    def snapshot_for(self, peer: str) -> list[SubscribeMsg]:
        return list(self.subs)

    def tables_for(self, peer: str) -> list[routing.PeerMessage]:
        return list(self.tables)

    def apply_snapshot(self, peer: str, subs: list[SubscribeMsg], *, replace: bool) -> None:
        self.snapshots.append(([m.sub.id for m in subs], replace))
        self._poke.set()

    async def receive_frame(self, peer: str, frame: fpb.Frame) -> None:
        self.frames += 1
        for m in gw.messages_from_frame(frame, self.geofences):
            if isinstance(m, EventMsg) and self.link.window.add(m.kind, m.event.id):
                self.applied.append(m.event.id)
        self._poke.set()

    async def outbox_page(
        self, peer: str, from_oid: int, limit: int
    ) -> list[tuple[int, PeerMessage]]:
        raise AssertionError("not durable")

    def outbox_acked(self, peer: str, msgs: list[PeerMessage]) -> None:
        raise AssertionError("not durable")

    def count_sent(self, peer: str, msgs: list[PeerMessage], sizes: list[int]) -> None:
        self.sent += [m.event.id for m in msgs if isinstance(m, EventMsg)]
        self._poke.set()

    def count_control(self, peer: str) -> None:
        pass

    def link_state_changed(self) -> None:
        self.states.append(self.link.connected)
        self._poke.set()

    def wan_delay_s(self, peer: str) -> float:
        return 0.0


async def accept(link: PeerLink) -> tuple[Wire, asyncio.Task[None], fpb.Frame]:
    """Start a session on the accepting side; return the wire, the session and the snapshot."""
    wire = Wire()
    task = asyncio.create_task(link.accept(wire.link_end))
    first = await wire.peer_end.read()
    assert first is not None and first.hello.broker_id == link.node.broker_id
    snapshot = await wire.peer_end.read()
    assert snapshot is not None and snapshot.HasField("snapshot")
    return wire, task, snapshot


async def close(link: PeerLink, wire: Wire, task: asyncio.Task[None]) -> None:
    """Cut the wire and wait until the link noticed."""
    wire.cut()
    await task
    assert not link.connected


def test_accept_sends_hello_snapshot_then_sequenced_events_and_acks_clear_them() -> None:
    """accept(): hello, the snapshot, then events (queued before and after) in frames with
    rising sequence numbers; the peer's ack empties the unacknowledged set; the link acks
    the peer's sequenced frames in turn."""

    async def test() -> None:
        host = FakeHost(batch_max_messages=2)
        host.subs = [sub("s1")]
        link = host.make_link()
        link.enqueue(event("e1"))  # queued while down
        wire, task, snapshot = await accept(link)
        assert snapshot.seq == 1 and not snapshot.snapshot.continued
        assert [rs.subscription.id for rs in snapshot.snapshot.subscriptions] == ["s1"]
        assert host.states == [True] and host.metric("geofed_peer_connected") == 1
        link.enqueue(event("e2"))
        link.enqueue(event("e3"))
        got: list[tuple[int, list[str]]] = []
        while sum(len(i) for _, i in got) < 3:
            frame = await wire.peer_end.frame_with_events()
            got.append((frame.seq, ids(frame)))
        assert [eid for _, i in got for eid in i] == ["e1", "e2", "e3"]
        assert [seq for seq, _ in got] == list(range(2, 2 + len(got)))
        assert [seq for seq, _ in link._unacked] == [seq for seq, _ in got]
        await wire.peer_end.write(gw.ack_frame(got[-1][0]))
        await host.until(lambda: not link._unacked)

        frame = gw.new_frame()
        gw.add_to_frame(frame, event("p1"), "a")
        frame.seq = 7  # wire has no builder for a sequenced frame: only the field is set here
        await wire.peer_end.write(frame)
        while (reply := await wire.peer_end.read()) is not None and reply.ack.seq != 7:
            pass  # the link acks in a control frame (it has nothing else to send)
        assert reply is not None and host.applied == ["p1"]
        await close(link, wire, task)
        assert host.states == [True, False] and host.metric("geofed_peer_connected") == 0

    run(test)


def test_unacknowledged_events_are_resent_after_reconnect_acknowledged_ones_are_not() -> None:
    """Events written but not acknowledged when the transport broke go out again first on the
    next session (sequence numbers restart), ahead of events queued while down."""

    async def test() -> None:
        host = FakeHost(batch_max_messages=1)  # one event per frame: each has its own seq
        link = host.make_link()
        wire, task, _ = await accept(link)
        for eid in ("e1", "e2", "e3"):
            link.enqueue(event(eid))
        seqs = {}
        for _ in range(3):
            frame = await wire.peer_end.frame_with_events()
            seqs[ids(frame)[0]] = frame.seq
        await wire.peer_end.write(gw.ack_frame(seqs["e2"]))
        await host.until(lambda: host.frames == 1)  # the ack was read
        await close(link, wire, task)
        link.enqueue(event("e4"))  # queued while down

        wire, task, snapshot = await accept(link)
        assert not snapshot.seq  # an empty snapshot is a control frame
        first = await wire.peer_end.frame_with_events()
        second = await wire.peer_end.frame_with_events()
        assert (ids(first), first.seq, ids(second), second.seq) == (["e3"], 1, ["e4"], 2)
        await link.stop()

    run(test)


def test_frames_beyond_the_unacknowledged_bound_are_counted_when_the_link_ends_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a store a link keeps the last `_UNACKED_FRAMES` unacknowledged frames: the
    older ones' messages are counted (and logged) when the session ends before an ack
    covered them; those an ack covered are not."""
    monkeypatch.setattr(_links, "_UNACKED_FRAMES", 2)

    async def test() -> None:
        host = FakeHost(batch_max_messages=1)
        link = host.make_link()
        forgotten = "geofed_peer_unacked_forgotten_total"
        wire, task, _ = await accept(link)
        for eid in ("e1", "e2", "e3"):
            link.enqueue(event(eid))
        seqs = [(await wire.peer_end.frame_with_events()).seq for _ in range(3)]
        await wire.peer_end.write(gw.ack_frame(seqs[0]))  # e1 arrived after all
        await host.until(lambda: host.frames == 1)
        await close(link, wire, task)
        assert not host.metric(forgotten)  # no sample: nothing counted

        wire, task, _ = await accept(link)  # e2 and e3 again, then four more
        for eid in ("e4", "e5", "e6", "e7"):
            link.enqueue(event(eid))
        frames = [await wire.peer_end.frame_with_events() for _ in range(6)]
        assert [ids(f)[0] for f in frames] == ["e2", "e3", "e4", "e5", "e6", "e7"]
        seen = host.frames
        await wire.peer_end.write(gw.ack_frame(frames[0].seq))  # e2 arrived after all
        await host.until(lambda: host.frames == seen + 1)
        await close(link, wire, task)  # e3..e5 fell out of the two kept frames
        assert host.metric(forgotten) == 3.0
        wire, task, _ = await accept(link)
        assert ids(await wire.peer_end.frame_with_events()) == ["e6"]
        await link.stop()

    run(test)


def test_duplicate_window_remembers_event_ids_per_kind() -> None:
    """An event id seen on the link is a duplicate (per kind) until dedup_window newer keys
    pushed it out; so the host drops an event the peer resends on a new session."""
    window = FakeHost(dedup_window=3).make_link().window
    assert not window.seen(Kind.EVENT, "e1")
    assert window.add(Kind.EVENT, "e1")
    assert window.seen(Kind.EVENT, "e1")
    assert not window.seen(Kind.DELIVERY, "e1")  # a delivery of e1 is another message
    assert window.add(Kind.DELIVERY, "e1")
    assert window.add(Kind.EVENT, "e2")
    assert window.add(Kind.EVENT, "e3")  # the oldest is forgotten
    assert not window.seen(Kind.EVENT, "e1")
    assert window.seen(Kind.EVENT, "e3")

    async def test() -> None:
        host = FakeHost()
        link = host.make_link()
        for session in (1, 2):  # the peer sends e1, then again on a second session
            wire, task, _ = await accept(link)
            frame = gw.new_frame()
            gw.add_to_frame(frame, event("e1"), "a")
            await wire.peer_end.write(frame)
            await host.until(lambda session=session: host.frames == session)
            await close(link, wire, task)
        assert host.applied == ["e1"]

    run(test)


def test_snapshots_start_every_session_span_frames_and_replace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every session sends snapshot_for(peer) first: the first frame replaces, the rest are
    continued; subscription changes made while down are not queued (the snapshot has them).
    Snapshot frames received make the host replace (first frame), then extend."""
    monkeypatch.setattr(_links, "FRAME_SOFT_LIMIT", 1)  # one subscription per frame

    async def snapshot(wire: Wire, frame: fpb.Frame | None, n: int) -> list[object]:
        got: list[object] = []
        while True:
            assert frame is not None and frame.HasField("snapshot")
            subs = [rs.subscription.id for rs in frame.snapshot.subscriptions]
            got.append((subs, frame.snapshot.continued))
            if len(got) == n:
                return got
            frame = await wire.peer_end.read()

    async def test() -> None:
        host = FakeHost()
        host.subs = [sub("s1"), sub("s2"), sub("s3")]
        link = host.make_link()
        wire, task, first = await accept(link)
        assert await snapshot(wire, first, 3) == [(["s1"], False), (["s2"], True), (["s3"], True)]
        await close(link, wire, task)

        host.subs = [sub("s2"), sub("s4")]
        table = routing.StrategyTable("event-geofence").with_entry("t/#", "flooding-events")
        host.tables = [routing.TableMsg(table, routing.Phase.PREPARED)]
        link.enqueue(sub("s4"))
        link.enqueue(RelocateMsg(("c", "s2"), "eu", LatLon(1.0, 2.0)))  # a roaming move
        link.enqueue(routing.TableMsg(table, routing.Phase.SWITCHED))
        assert link.queued == 0  # not queued: the next snapshot (and table state) carries them
        link.enqueue(event("marker"))
        wire, task, first = await accept(link)
        assert await snapshot(wire, first, 2) == [(["s2"], False), (["s4"], True)]
        frame = await wire.peer_end.read()  # behind the snapshot: where transitions stand
        assert frame is not None and [(t.table.epoch, t.phase) for t in frame.tables] == [(1, 1)]
        frame = await wire.peer_end.read()  # then the queue
        assert frame is not None and ids(frame) == ["marker"] and not frame.subscribes

        # The other way: the peer's snapshot replaces (first frame) then extends what we held.
        for subs in ([sub("r1"), sub("r2")], []):
            for frame, _, _ in gw.snapshot_frames(subs, 1):
                await wire.peer_end.write(frame)
        await host.until(lambda: len(host.snapshots) == 3)
        assert host.snapshots == [(["r1"], True), (["r2"], False), ([], True)]
        await link.stop()

    run(test)


def test_the_node_budget_bounds_a_link_queue_too() -> None:
    """node_queue_bytes: a link whose node has no bytes left drops new events (counted), as
    if its own queue were full; the bytes of what it sends come back."""
    host = FakeHost(node_queue_bytes=2 * _links._size(event("x")))
    link = host.make_link()
    for i in range(4):
        link.enqueue(event(f"e{i}"))
    assert link.queued == 2 and host.metric("geofed_peer_queue_dropped_total") == 2
    assert host.budget.used == host.budget.limit


def test_peer_queue_bytes_bounds_a_link_queue_in_bytes() -> None:
    """peer_queue_bytes: beyond the link's byte budget new events are dropped and counted
    (without a store), however few messages are queued; what is sent frees its bytes."""

    async def test() -> None:
        size = _links._size(event("e0"))
        host = FakeHost(peer_queue_bytes=2 * size + size // 2, batch_max_messages=10)
        link = host.make_link()
        for i in range(4):
            link.enqueue(event(f"e{i}"))
        assert link.queued == 2 and host.metric("geofed_peer_queue_dropped_total") == 2
        wire, _, _ = await accept(link)
        assert ids(await wire.peer_end.frame_with_events()) == ["e0", "e1"]
        link.enqueue(event("e4"))  # the sent ones' bytes are free again
        assert ids(await wire.peer_end.frame_with_events()) == ["e4"]
        assert host.metric("geofed_peer_queue_dropped_total") == 2
        await link.stop()

    run(test)


def test_full_queue_drops_new_events_and_counts_them() -> None:
    """Beyond peer_queue_size, new events are dropped and counted; the queued ones still go
    out. A subscription change dropped so restarts the session (the next one resyncs)."""

    async def test() -> None:
        host = FakeHost(peer_queue_size=3, batch_max_messages=10)
        link = host.make_link()
        for i in range(5):
            link.enqueue(event(f"e{i}"))
        assert link.queued == 3 and host.metric("geofed_peer_queue_dropped_total") == 2
        wire, task, _ = await accept(link)
        assert ids(await wire.peer_end.frame_with_events()) == ["e0", "e1", "e2"]

        for i in range(3):
            link.enqueue(event(f"f{i}"))
        link.enqueue(sub("s1"))  # no room: dropped, counted, and the session restarts
        assert host.metric("geofed_peer_queue_dropped_total") == 3
        await asyncio.wait([task])  # the server handler ends; the peer redials
        assert host.states == [True, False]
        await accept(link)  # asserts the new session starts with a snapshot
        await link.stop()

    run(test)


def test_idle_link_sends_empty_heartbeat_frames() -> None:
    """With nothing to send, the link writes an empty frame every peer_heartbeat_s."""

    async def test() -> None:
        link = FakeHost(peer_heartbeat_s=0.01, peer_timeout_s=0).make_link()
        wire, _, _ = await accept(link)
        for _ in range(2):
            frame = await wire.peer_end.read()
            assert frame is not None and frame.ByteSize() == 0
        await link.stop()

    run(test)


def test_watchdog_keeps_a_talking_peer_and_closes_a_silent_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A link hearing from its peer more often than peer_timeout_s stays up (over several
    watchdog rounds); once the peer falls silent for longer, the link closes itself."""
    clock = SimpleNamespace(now=1000.0)  # the link's monotonic clock; asyncio keeps the real one
    monkeypatch.setattr(_links, "time", SimpleNamespace(monotonic=lambda: clock.now))
    timeout = 0.05

    async def test() -> None:
        host = FakeHost(peer_heartbeat_s=0.02, peer_timeout_s=timeout)
        link = host.make_link()
        wire, task, _ = await accept(link)
        loop = asyncio.get_running_loop()
        start = loop.time()
        # A watchdog round sleeps about timeout + 0.05 s of real time: outlast 3 of them.
        while loop.time() - start < 3 * (timeout + 0.05):
            clock.now += 0.8 * timeout
            heard = host.frames
            await wire.peer_end.write(gw.new_frame())
            await host.until(lambda heard=heard: host.frames > heard)
            assert link.connected and not task.done()
            await asyncio.sleep(0.005)  # pacing only: silence is measured on `clock`
        clock.now += 1.5 * timeout  # the peer falls silent
        await task
        assert host.states == [True, False] and not link.connected

    run(test)


def dial_into_wires(monkeypatch: pytest.MonkeyPatch) -> asyncio.Queue[Wire]:
    """Make the dialling side dial Wires instead of gRPC; returns the queue of dialled wires."""
    dialled: asyncio.Queue[Wire] = asyncio.Queue()

    def call() -> End:
        dialled.put_nowait(wire := Wire())
        return wire.link_end

    async def close_channel(grace: float | None) -> None:
        pass

    def stream_stream(method: str, request_serializer: Any, response_deserializer: Any) -> Any:
        assert method == _links.LINK_METHOD == "/geofed.v1.FederationService/Link"
        assert request_serializer is gw.wire_bytes  # takes the links' EncodedFrames
        return call

    channel = SimpleNamespace(close=close_channel, stream_stream=stream_stream)
    monkeypatch.setattr(_links.grpc.aio, "insecure_channel", lambda endpoint, options: channel)
    monkeypatch.setattr(_links, "CallTransport", lambda call: call)
    return dialled


async def answer(wire: Wire) -> None:
    """Play the accepting peer "b": read the dialler's hello and answer with ours."""
    first = await wire.peer_end.read()
    assert first is not None and first.hello.broker_id == "a"
    await wire.peer_end.write(hello("b"))


def dialler() -> tuple[FakeHost, PeerLink]:
    host = FakeHost("a", peer_queue_size=2, reconnect_initial_s=0.001, reconnect_max_s=0.01)
    link = host.make_link("b")
    assert link.dials
    link.start()
    return host, link


def test_dialling_side_redials_and_resends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The smaller id dials; when the stream breaks it dials again and resends unacked events."""
    dialled = dial_into_wires(monkeypatch)

    async def test() -> None:
        host, link = dialler()
        link.enqueue(event("e1"))
        for _ in range(2):
            await answer(wire := await dialled.get())
            assert ids(await wire.peer_end.frame_with_events()) == ["e1"]
            wire.cut()  # not acknowledged: sent again after the redial
        assert host.states[:3] == [True, False, True]
        await link.stop()

    run(test)


@pytest.mark.parametrize(
    "error", [asyncio.InvalidStateError("write on a dying call"), RuntimeError("a bug")]
)
def test_the_dialler_survives_any_error_in_a_session_counts_it_and_redials(
    monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """Any exception that ends a session (grpc's ``call.write`` raises InvalidStateError when
    the peer dies mid-write) is logged and counted, and the link dials again and resends."""
    dialled = dial_into_wires(monkeypatch)

    async def test() -> None:
        host, link = dialler()
        wire = await dialled.get()
        await answer(wire)
        await host.until(lambda: link.connected)

        async def broken_write(frame: fpb.Frame) -> None:
            raise error

        wire.link_end.write = broken_write  # type: ignore[method-assign]
        link.enqueue(event("e1"))
        await answer(again := await dialled.get())
        assert ids(await again.peer_end.frame_with_events()) == ["e1"]
        assert host.metric(PEER_LINK_FAILURES) == 1
        assert link._dialer is not None and not link._dialer.done()
        await link.stop()

    run(test)


def test_dialling_side_redials_after_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    """A subscription change dropped for a full queue restarts the session on the dialling
    side too: the link dials again (and resyncs) instead of staying down."""
    dialled = dial_into_wires(monkeypatch)

    async def test() -> None:
        host, link = dialler()
        await answer(await dialled.get())
        await host.until(lambda: link.connected)
        link.enqueue(event("e1"))
        link.enqueue(event("e2"))
        link.enqueue(sub("s1"))  # no room: dropped, and the session restarts
        redial = asyncio.ensure_future(dialled.get())
        assert link._dialer is not None
        await asyncio.wait([redial, link._dialer], return_when=asyncio.FIRST_COMPLETED)
        assert redial.done(), "the dialler task ended instead of dialling again"
        await link.stop()

    run(test)


def test_a_replaced_session_stops_writing() -> None:
    """The peer reconnects while an event is on its way (accept() replaces the live session):
    the old session's writer stops, and everything goes out on the new stream."""

    async def test() -> None:
        host = FakeHost()
        link = host.make_link()
        old, _, _ = await accept(link)
        link.enqueue(event("e1"))  # wakes the writer in the same loop turn as the cancel below
        new, _, _ = await accept(link)
        link.enqueue(event("e2"))
        await host.until(lambda: "e2" in host.sent)
        while not old.peer_end.inbox.empty():
            data = old.peer_end.inbox.get_nowait()
            assert data is None or not ids(fpb.Frame.FromString(data)), "old stream written"
        got: list[str] = []
        while "e2" not in got:
            got += ids(await new.peer_end.frame_with_events())
        assert got == ["e1", "e2"]
        await link.stop()

    run(test)


def test_settled_waits_for_the_peers_ack_of_what_was_queued_and_not_for_later_messages() -> None:
    """`settled` returns once the peer acknowledged the frame carrying the last message
    queued before the call (a later message does not hold it), at once with nothing
    pending, and when the session ends (the next one's snapshot carries the state)."""

    async def test() -> None:
        host = FakeHost(batch_max_messages=1)
        link = host.make_link()
        wire, task, _ = await accept(link)
        await link.settled()  # nothing queued: at once
        link.enqueue(event("e1"))
        link.enqueue(event("e2"))
        waiting = asyncio.create_task(link.settled())
        await asyncio.sleep(0)  # the call takes its mark
        link.enqueue(event("e3"))  # after the call: not waited for
        seqs = [(await wire.peer_end.frame_with_events()).seq for _ in range(3)]
        await wire.peer_end.write(gw.ack_frame(seqs[0]))
        await host.until(lambda: len(link._unacked) == 2)
        assert not waiting.done()  # e2 is not acknowledged yet
        await wire.peer_end.write(gw.ack_frame(seqs[1]))
        await waiting
        link.enqueue(event("e4"))
        pending = asyncio.create_task(link.settled())
        await wire.peer_end.frame_with_events()
        assert not pending.done()
        await close(link, wire, task)
        await pending  # the session ended: not waited for any longer
        await link.settled()  # down: at once

    run(test)


def test_control_messages_are_applied_in_the_order_they_were_queued() -> None:
    """A frame applies control traffic by field (reports, flushes, handoffs, sessions):
    a session queued before a handoff and a flush goes in a frame of its own, so the
    peer opens the session before the handoff joins its queue."""

    async def test() -> None:
        host = FakeHost(batch_max_messages=10)
        link = host.make_link()
        session = routing.SessionMsg(
            1, "client-1", "", routing.latlon(40.7, -74.0), 60.0, (sub("q").sub,)
        )
        handoff = routing.HandoffMsg("h1", ("client-1", "q"), (b"x",))
        flush = routing.FlushMsg(2, False)
        wire, task, _ = await accept(link)
        for msg in (session, handoff, flush):
            link.enqueue(msg)  # at once: the writer finds all three waiting
        got: list[object] = []
        while len(got) < 3:
            frame = await wire.peer_end.read()
            assert frame is not None
            got.extend(gw.messages_from_frame(frame, CACHE))
        assert got == [session, handoff, flush]
        assert gw.frame_rank(session) > gw.frame_rank(handoff) > gw.frame_rank(flush)
        await close(link, wire, task)

    run(test)
