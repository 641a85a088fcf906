"""Peer links: one bidirectional gRPC stream per broker pair.

The broker with the smaller id dials, the other accepts; both then send
batched frames on the same stream. Each link has one bounded queue. While a
link is down, events and deliveries wait in that queue (dropped and counted
when it is full) and subscription changes are not queued at all: on every
(re)connect each side sends a snapshot of the subscriptions the other needs,
which replaces what the other held. Frames carry per-link sequence numbers;
event and delivery frames not acknowledged when a link breaks are sent again
after the reconnect, and receivers drop event ids they have already seen.

With a durable store (``data_dir``) the events and deliveries for a peer are
in the node's outbox before the publish that caused them is acknowledged, and
the outbox is the queue: memory holds a window of it (`peer_queue_size`,
`peer_queue_bytes`), a link that falls behind reads the rest back in order,
and every session starts by reading whatever the peer has not acknowledged.
Nothing is dropped then; without a store the queue is memory only.

An idle link sends an empty frame every ``peer_heartbeat_s``; a link that has
received nothing for ``peer_timeout_s`` is closed and redialled. That catches
a peer whose host stopped or whose network went away without closing the
connection (an application heartbeat, not gRPC keepalive: the HTTP/2 ping
policy of a loaded server answered keepalive pings with "too many pings").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections import deque
from typing import Any, Protocol

import grpc

from geofed.routing import (
    BrokerInfo,
    DeliveryMsg,
    EventMsg,
    GeofenceCache,
    HandoffMsg,
    Kind,
    PeerMessage,
    StorageFailed,
    SubscribeMsg,
    once_id,
)
from geofed.v1 import federation_pb2 as fpb
from geofed.wire import (
    EncodedFrame,
    PeerGeofenceCache,
    RejectedMessage,
    frame_rank,
    snapshot_frames,
    snapshot_from_frame,
    wire_bytes,
)

from ._budget import ByteBudget
from ._config import NodeConfig
from ._dedup import DedupWindow
from ._metrics import NodeMetrics

log = logging.getLogger("geofed.node.links")

PROTOCOL_VERSION = 4
_UNACKED_FRAMES = 4096
_ACK_DELAY_S = 0.02
_STATE_KINDS = (Kind.SUBSCRIBE, Kind.UNSUBSCRIBE, Kind.RELOCATE, Kind.TRANSITION)
"""Kinds whose loss the next session repairs (snapshot, table state): not kept for resending."""
_PAGE = 2048  # outbox messages read back at a time
_TLS_FAILURE = re.compile(r"handshake|ssl|certificate|tls", re.IGNORECASE)
_OVERHEAD = 128  # bytes counted per queued message besides its payload and geofence
LINK_METHOD = f"/{fpb.DESCRIPTOR.services_by_name['FederationService'].full_name}/Link"
"""The peer link's gRPC method (dialled with `wire_bytes` as its serializer)."""
FRAME_SOFT_LIMIT = 4 << 20
"""A frame is closed once its messages reach this many bytes."""
MAX_FRAME_BYTES = 64 << 20
"""Largest frame either side of a link accepts (grpc max message size)."""
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
    ("grpc.max_send_message_length", MAX_FRAME_BYTES),
]
SERVER_OPTIONS = CHANNEL_OPTIONS


class Transport(Protocol):
    """A bidirectional stream of frames (a dialled call or an accepted one).

    Frames are written as `Frame` or `EncodedFrame`: the call's serializer is
    `wire_bytes` (`LINK_METHOD` dialled with it, the node's peer service
    registered with it).
    """

    async def read(self) -> fpb.Frame | None:
        """The next frame, or None when the stream ended."""

    async def write(self, frame: fpb.Frame | EncodedFrame) -> None:
        """Send one frame."""


class CallTransport:
    """The dialling side's stream."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def read(self) -> fpb.Frame | None:
        frame = await self._call.read()
        return None if frame is grpc.aio.EOF else frame

    async def write(self, frame: fpb.Frame | EncodedFrame) -> None:
        await self._call.write(frame)


class ContextTransport:
    """The accepting side's stream."""

    def __init__(self, context: Any) -> None:
        self._context = context

    async def read(self) -> fpb.Frame | None:
        frame = await self._context.read()
        return None if frame is grpc.aio.EOF else frame

    async def write(self, frame: fpb.Frame | EncodedFrame) -> None:
        await self._context.write(frame)


class LinkHost(Protocol):
    """What a link needs from the broker it belongs to (`BrokerServer`, or a test's fake)."""

    broker_id: str
    config: NodeConfig
    metrics: NodeMetrics
    geofences: GeofenceCache
    peer_geofences: PeerGeofenceCache  # geofences forwarded by peers (the read loop's)
    durable: bool  # events and deliveries for peers are in a durable outbox
    budget: ByteBudget  # the node's bytes queued in memory, shared with its other queues

    def hello(self) -> fpb.Frame:
        """This broker's hello frame."""

    def dial(self, peer: BrokerInfo) -> grpc.aio.Channel:
        """A channel to `peer`'s federation port (TLS when configured)."""

    def check_hello(self, hello: fpb.Hello, expect: str | None = None) -> str:
        """Why a peer's hello is refused ("" if accepted)."""

    def snapshot_for(self, peer: str) -> list[SubscribeMsg]:
        """The subscriptions `peer` needs from this broker (sent on every connect)."""

    def tables_for(self, peer: str) -> list[PeerMessage]:
        """Where this broker's strategy transitions stand (sent after the snapshot)."""

    def apply_snapshot(self, peer: str, subs: list[SubscribeMsg], *, replace: bool) -> None:
        """Replace (or extend) what this broker holds from `peer`."""

    async def receive_frame(self, peer: str, frame: fpb.Frame) -> None:
        """Apply the messages of a frame from `peer`; return once they are durable.

        Raises:
            StorageFailed: the store could not keep them: nothing was applied
                and the frame must not be acknowledged.
        """

    async def outbox_page(
        self, peer: str, from_oid: int, limit: int
    ) -> list[tuple[int, PeerMessage]]:
        """Durable mode: up to `limit` outbox messages for `peer` from `from_oid` on."""

    def outbox_acked(self, peer: str, msgs: list[PeerMessage]) -> None:
        """Durable mode: `peer` acknowledged these messages."""

    def count_sent(self, peer: str, msgs: list[PeerMessage], sizes: list[int]) -> None:
        """Account for messages written to `peer`."""

    def count_control(self, peer: str) -> None:
        """Account for a control-only frame written to `peer`."""

    def link_state_changed(self) -> None:
        """A link went up or down."""

    def wan_delay_s(self, peer: str) -> float:
        """Emulated one-way delay towards `peer` (0 when off)."""


class LinkRefused(Exception):
    """The peer (or this side) refused the link: mismatched strategy or federation."""


class PeerLink:
    """The link from this broker to one peer."""

    def __init__(self, node: LinkHost, peer: BrokerInfo) -> None:
        self.node = node
        self.peer = peer
        self.dials = node.broker_id < peer.id
        cfg = node.config
        self._cap = cfg.peer_queue_size
        self._byte_cap = cfg.peer_queue_bytes
        self._queue: deque[tuple[PeerMessage, int]] = deque()  # (message, outbox id or 0)
        self._queued_bytes = 0
        self._queue_gauge: Any = None  # this peer's child of the queue gauge (`_count_queued`)
        self._resend: deque[tuple[PeerMessage, int]] = deque()
        self.durable = node.durable
        # Durable mode: the outbox id from which the queue must be read back from
        # the store (None: memory holds everything not yet sent), and how many
        # messages were left there since.
        self._behind: int | None = 0 if self.durable else None
        self._skipped = 0
        self._wake = asyncio.Event()
        self._restart = asyncio.Event()
        self._writing = 0  # messages in the frame being written
        self._restart_reason = ""
        self._unacked: deque[tuple[int, list[PeerMessage]]] = deque(maxlen=_UNACKED_FRAMES)
        # Without a store: (seq, messages) of the frames that fell out of `_unacked`
        # and no acknowledgement has covered yet (until the watchdog ends a silent link).
        self._forgotten: deque[tuple[int, int]] = deque()
        # `settled`: messages taken from the queue so far, (frame seq, that count once
        # the frame was written), the count the peer has acknowledged, and the waiters.
        self._popped = 0
        self._marks: deque[tuple[int, int]] = deque(maxlen=_UNACKED_FRAMES)
        self._acked_popped = 0
        self._settling: list[tuple[int, asyncio.Future[None]]] = []
        self._after_backlog: list[PeerMessage] = []  # `enqueue_behind`, while `_behind`
        self._window: DedupWindow | None = None  # what came over this link: see `window`
        self._seq = 0
        self._ack_pending = 0
        self._last_flush = 0.0
        self._last_heard = 0.0
        self._session: asyncio.Task[None] | None = None
        self._dialer: asyncio.Task[None] | None = None
        self._stopping = False
        self.connected = False
        self.sessions = 0
        """Sessions begun so far: a change tells a waiter that the link broke meanwhile."""
        self.delay_s = node.wan_delay_s(peer.id)
        self._delay_line: asyncio.Queue[tuple[float, EncodedFrame]] | None = None
        self._labels = {"peer": peer.id}

    @property
    def window(self) -> DedupWindow:
        """The (kind, event id) pairs taken over this link (node/_dedup.py).

        Allocated (whole: about 10 MiB per 100,000 keys) when first needed, the
        link's first event or delivery or a restart's stored ids: a broker of a
        large federation pays only for the peers that send it events.
        """
        window = self._window
        if window is None:
            window = self._window = DedupWindow(self.node.config.dedup_window)
        return window

    # -- producer side ---------------------------------------------------

    def enqueue(self, msg: PeerMessage, oid: int = 0) -> None:
        """Queue one logical message for the peer (never blocks).

        `oid` is its outbox id when the store holds it (durable mode): then a
        full queue leaves it there, to be read back in order, instead of
        dropping it.
        """
        subscription_change = msg.kind in _STATE_KINDS
        if subscription_change and not self.connected:
            # The snapshot and the table state sent on reconnect carry the current state.
            return
        if oid and self._behind is not None:
            self._skipped += 1  # in the outbox, read back after what is queued before it
            self._count_queued()
            return
        size = _size(msg)
        if (
            len(self._queue) >= self._cap
            or self._queued_bytes + size > self._byte_cap
            or not self.node.budget.fits(size)
        ):
            if oid:
                self._behind, self._skipped = oid, 1
                self._count_queued()
                return
            self.node.metrics.peer_dropped.labels(peer=self.peer.id).inc()
            if subscription_change:
                # Subscription state must not diverge: resynchronise.
                self._restart_session("queue overflow lost a subscription change")
            return
        self._queue.append((msg, oid))
        self._account(size)
        self._count_queued()
        self._wake.set()

    def enqueue_behind(self, msg: PeerMessage) -> None:
        """Queue `msg` behind every message queued for the peer so far.

        `enqueue` puts a message without an outbox id ahead of a durable
        link's backlog still in the outbox (read back later); this one waits
        until the backlog is in the queue. Dropped if the session ends first.
        """
        if self._behind is None:
            self.enqueue(msg)
        else:
            self._after_backlog.append(msg)

    @property
    def queued(self) -> int:
        """Messages waiting to be sent (in memory, and left in the outbox)."""
        return len(self._queue) + len(self._resend) + self._outboxed()

    def _outboxed(self) -> int:
        return max(self._skipped, 1) if self._behind is not None else 0

    def _count_queued(self) -> None:
        # Includes the frame being written and what waits in the outbox: a
        # message leaves the gauge only once it is counted as sent, so "queues
        # empty and sent == received" means nothing is in flight (the
        # quiescence barrier relies on it).
        # The labelled child is looked up once: this runs on every message queued.
        gauge = self._queue_gauge
        if gauge is None:
            gauge = self._queue_gauge = self.node.metrics.peer_queue.labels(peer=self.peer.id)
        gauge.set(len(self._queue) + self._writing + self._outboxed())

    def _pop(self) -> PeerMessage:
        msg, _ = self._queue.popleft()
        self._account(-_size(msg))
        self._popped += 1
        return msg

    async def settled(self) -> None:
        """Wait until the peer has applied every message queued for it so far.

        Returns at once when the link is down, and when the session ends
        meanwhile: the next session's snapshot carries the subscription state.
        Messages the durable outbox still holds behind the queue (events,
        deliveries) are not waited for.
        """
        if not self.connected:
            return
        target = self._popped + len(self._queue)
        if target <= self._acked_popped:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._settling.append((target, waiter))
        await waiter

    def _release_settled(self, everyone: bool = False) -> None:
        keep = []
        for target, waiter in self._settling:
            if everyone or target <= self._acked_popped:
                if not waiter.done():
                    waiter.set_result(None)
            elif not waiter.done():  # a waiter that gave up is forgotten
                keep.append((target, waiter))
        self._settling = keep

    def _account(self, delta: int) -> None:
        self._queued_bytes += delta
        self.node.budget.add(delta)

    def _keep_resendable(self, unacked: int = 0) -> None:
        """Drop queued subscription changes (the snapshot supersedes them).

        In durable mode the events, deliveries and handoffs go too: the next session
        reads them back from the outbox, with everything not acknowledged
        (`unacked` messages written to the link that ended), and the queue
        gauge goes on counting them there.
        """
        if not self.durable:
            self._queue = deque(e for e in self._queue if once_id(e[0]) is not None)
        else:
            left = sum(1 for m, _ in self._queue if once_id(m) is not None) + unacked
            self._queue = deque()
            if self._behind is None:
                self._skipped = 0
            self._behind = 0
            self._skipped += left
        self._account(sum(_size(m) for m, _ in self._queue) - self._queued_bytes)
        self._count_queued()

    async def _refill(self) -> None:
        """Durable mode: queue the next page of the outbox (or catch up with it)."""
        assert self._behind is not None
        rows = await self.node.outbox_page(self.peer.id, self._behind, _PAGE)
        if rows:
            for oid, msg in rows:
                self._queue.append((msg, oid))
                self._account(_size(msg))
            self._behind = rows[-1][0] + 1
            self._skipped = max(0, self._skipped - len(rows))
        else:
            # Whatever is committed from now on is dispatched after this point
            # (the store reads and commits in order): memory is complete again.
            self._behind, self._skipped = None, 0
            after, self._after_backlog = self._after_backlog, []
            for msg in after:
                self.enqueue(msg)
        self._count_queued()

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Start dialling (if this side dials)."""
        if self.dials and self._dialer is None:
            self._dialer = asyncio.create_task(self._dial_forever(), name=f"dial-{self.peer.id}")

    async def drain(self, timeout: float) -> None:
        """Wait until the queue is empty or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while self.queued and self.connected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Close the link (idempotent)."""
        self._stopping = True
        for task in (self._dialer, self._session):
            if task is not None and not task.done():
                task.cancel()
        for task in (self._dialer, self._session):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _restart_session(self, why: str) -> None:
        # Ends the session as a broken connection would (not by cancelling its
        # task: on the dialling side that task is the dialler itself).
        if self.connected and not self._restart.is_set():
            log.warning("link %s: restarting: %s", self.peer.id, why)
            self._restart_reason = why
            self._restart.set()

    async def _until_restart(self) -> None:
        await self._restart.wait()
        raise ConnectionError(f"restarted: {self._restart_reason}")

    # -- dialling side ---------------------------------------------------

    async def _dial_forever(self) -> None:
        cfg = self.node.config
        backoff = cfg.reconnect_initial_s
        while not self._stopping:
            channel = self.node.dial(self.peer)
            established = False
            try:
                # Not the generated stub: its serializer takes only a `Frame`.
                call = channel.stream_stream(
                    LINK_METHOD,
                    request_serializer=wire_bytes,
                    response_deserializer=fpb.Frame.FromString,
                )()
                transport = CallTransport(call)
                first = await self._handshake(transport)
                if first.refuse_reason:
                    raise LinkRefused(first.refuse_reason)
                problem = self.node.check_hello(first.hello, expect=self.peer.id)
                if problem:
                    raise LinkRefused(problem)
                established = True
                await self._run_session(transport)
            except asyncio.CancelledError:
                raise
            except LinkRefused as exc:
                log.error("link %s refused: %s", self.peer.id, exc)
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                level = logging.INFO if not established else logging.WARNING
                reason = _reason(exc)
                if not established and _TLS_FAILURE.search(reason):
                    # The peer's certificate (or ours, to it) did not pass: say so loudly.
                    level = logging.ERROR
                    self.node.metrics.peer_refused.labels(reason="tls").inc()
                log.log(level, "link %s down: %s", self.peer.id, reason)
            except Exception:
                # Whatever broke this session (a write on a dying call, a frame
                # that does not parse), the dialler must live on: redial.
                self.node.metrics.peer_link_failures.labels(peer=self.peer.id).inc()
                log.exception("link %s failed; redialling", self.peer.id)
            finally:
                await channel.close(grace=None)
            if established:
                backoff = cfg.reconnect_initial_s
            # Full jitter keeps a restarted broker from being hit by every peer at once.
            await asyncio.sleep(random.uniform(0.5, 1.0) * backoff)
            backoff = min(cfg.reconnect_max_s, backoff * 2)

    async def _handshake(self, transport: Transport) -> fpb.Frame:
        timeout = self.node.config.peer_timeout_s or None
        try:
            async with asyncio.timeout(timeout):
                await transport.write(self.node.hello())
                self.node.count_control(self.peer.id)
                first = await transport.read()
        except TimeoutError:
            raise ConnectionError(f"no hello within peer_timeout_s ({timeout:g}s)") from None
        if first is None:
            raise ConnectionError("stream closed before hello")
        return first

    # -- accepting side --------------------------------------------------

    async def accept(self, transport: Transport) -> None:
        """Serve an accepted stream whose hello was already checked."""
        await transport.write(self.node.hello())
        self.node.count_control(self.peer.id)
        if self._session is not None and not self._session.done():
            self._session.cancel()  # the peer reconnected before we saw the old stream die
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._session
        try:
            await self._run_session(transport)
        except ConnectionError as exc:  # the dialling side reconnects
            log.warning("link %s down: %s", self.peer.id, exc)
        except Exception:
            # As on the dialling side: the session ends, counted, and the peer redials.
            self.node.metrics.peer_link_failures.labels(peer=self.peer.id).inc()
            log.exception("link %s failed; the peer redials", self.peer.id)

    # -- a connected session ---------------------------------------------

    async def _run_session(self, transport: Transport) -> None:
        current = asyncio.current_task()
        self._session = current
        self._begin_session()
        log.info("link %s up (%s)", self.peer.id, "dialled" if self.dials else "accepted")
        tasks = {
            asyncio.create_task(self._read_loop(transport)),
            asyncio.create_task(self._write_loop(transport)),
            asyncio.create_task(self._until_restart()),
        }
        if self.delay_s:
            self._delay_line = asyncio.Queue()
            tasks.add(asyncio.create_task(self._transmit_delayed(transport, self._delay_line)))
        if self.node.config.peer_timeout_s:
            tasks.add(asyncio.create_task(self._watchdog(self.node.config.peer_timeout_s)))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                exc = task.exception()
                if exc is not None:
                    raise exc
        finally:
            for task in tasks:
                task.cancel()
            try:
                # A read blocked inside gRPC may not react to cancellation at
                # once: the link is marked down regardless, without waiting.
                await asyncio.wait(tasks, timeout=1.0)
            finally:
                self._delay_line = None
                self._end_session()

    async def _watchdog(self, timeout: float) -> None:
        while True:
            silent = time.monotonic() - self._last_heard
            if silent > timeout:
                raise ConnectionError(
                    f"nothing received for {silent:.1f}s (peer_timeout_s {timeout:g})"
                )
            await asyncio.sleep(timeout - silent + 0.05)

    async def _transmit_delayed(
        self, transport: Transport, line: asyncio.Queue[tuple[float, EncodedFrame]]
    ) -> None:
        while True:
            due, frame = await line.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await transport.write(frame)

    def _begin_session(self) -> None:
        self._restart.clear()
        self.connected = True
        self.sessions += 1
        self._seq = 0
        self._ack_pending = 0
        self._last_heard = time.monotonic()
        self._marks.clear()
        self._acked_popped = self._popped
        self._keep_resendable()
        self.node.metrics.peer_connected.labels(peer=self.peer.id).set(1)
        self.node.link_state_changed()

    def _end_session(self) -> None:
        self.connected = False
        # What the peer may not have received is sent again after reconnecting
        # (in durable mode it is all in the outbox, read back from the start).
        unacked = sum(len(msgs) for _, msgs in self._unacked)
        if not self.durable:
            for _, msgs in self._unacked:
                self._resend.extend((m, 0) for m in msgs)
            forgotten = sum(n for _, n in self._forgotten)
            if forgotten:
                self.node.metrics.peer_forgotten.labels(peer=self.peer.id).inc(forgotten)
                log.warning(
                    "link %s: %d events and deliveries of unacknowledged frames beyond the"
                    " last %d are not sent again",
                    self.peer.id,
                    forgotten,
                    _UNACKED_FRAMES,
                )
        self._forgotten.clear()
        self._unacked.clear()
        self._release_settled(everyone=True)
        self._after_backlog.clear()
        self._keep_resendable(unacked)
        self.node.metrics.peer_connected.labels(peer=self.peer.id).set(0)
        self.node.link_state_changed()
        if not self._stopping:
            log.info("link %s closed", self.peer.id)

    async def _write_loop(self, transport: Transport) -> None:
        await self._send_snapshot(transport)
        resend, self._resend = self._resend, deque()
        self._queue.extendleft(reversed(resend))
        self._account(sum(_size(m) for m, _ in resend))
        cfg = self.node.config
        max_msgs = cfg.batch_max_messages
        delay = cfg.batch_max_delay_ms / 1000.0
        heartbeat = cfg.peer_heartbeat_s
        origin = self.node.broker_id
        while True:
            if not self._queue and self._behind is not None:
                await self._refill()
                continue
            if not self._queue:
                self._wake.clear()
                idle = _ACK_DELAY_S if self._ack_pending else heartbeat
                # Not asyncio.wait_for: on 3.11 it can swallow a cancellation
                # that arrives as the event is set, leaving this writer running.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(idle):
                        await self._wake.wait()
            if self._queue and len(self._queue) < max_msgs and delay:
                # Nagle-like: right after a flush, let the next frame fill a little.
                wait = self._last_flush + delay - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            frame = EncodedFrame()
            msgs: list[PeerMessage] = []
            sizes: list[int] = []
            rank, total = (-1, 0), 0
            while self._queue and len(msgs) < max_msgs and total < FRAME_SOFT_LIMIT:
                r = frame_rank(self._queue[0][0])
                if r < rank:
                    break  # keep the sender's order: next frame
                rank = r
                msg = self._pop()
                sizes.append(frame.add(msg, origin))
                total += sizes[-1]
                msgs.append(msg)
            if msgs or self._ack_pending or time.monotonic() - self._last_flush >= heartbeat:
                self._writing = len(msgs)
                try:
                    await self._write(transport, frame, msgs, sizes)  # empty: a heartbeat
                finally:
                    self._writing = 0
            self._count_queued()

    async def _send_snapshot(self, transport: Transport) -> None:
        subs = self.node.snapshot_for(self.peer.id)
        for frame, msgs, sizes in snapshot_frames(subs, FRAME_SOFT_LIMIT):
            await self._write(transport, EncodedFrame(frame), msgs, sizes)
        tables = self.node.tables_for(self.peer.id)
        if tables:
            # Behind the snapshot: a PREPARED it carries promises the copies above.
            out = EncodedFrame()
            sizes = [out.add(m, self.node.broker_id) for m in tables]
            await self._write(transport, out, tables, sizes)

    async def _write(
        self, transport: Transport, out: EncodedFrame, msgs: list[Any], sizes: list[int]
    ) -> None:
        node = self.node
        frame = out.frame
        if msgs:
            self._seq += 1
            frame.seq = self._seq
            resendable = [m for m in msgs if once_id(m) is not None]
            if resendable:
                if len(self._unacked) == self._unacked.maxlen and not self.durable:
                    # The oldest falls out: it cannot be sent again unless acknowledged.
                    seq, lost = self._unacked[0]
                    self._forgotten.append((seq, len(lost)))
                self._unacked.append((self._seq, resendable))
            self._marks.append((self._seq, self._popped))
        if self._ack_pending:
            frame.ack.seq = self._ack_pending
            self._ack_pending = 0
        if self._delay_line is not None:
            # Emulated WAN: the frame leaves after the link's one-way delay,
            # without holding up the frames behind it.
            await self._delay_line.put((time.monotonic() + self.delay_s, out))
        else:
            await transport.write(out)
        self._last_flush = time.monotonic()
        if msgs:
            node.count_sent(self.peer.id, msgs, sizes)
        else:
            node.count_control(self.peer.id)

    async def _read_loop(self, transport: Transport) -> None:
        # What a frame carries never ends the session: a message that cannot be
        # converted or applied is skipped and counted (the host does the same
        # for the messages it applies), and the frame is acknowledged all the
        # same, so that the sender does not resend it on every reconnect.
        node = self.node
        peer = self.peer.id
        while True:
            frame = await transport.read()
            if frame is None:
                return
            self._last_heard = time.monotonic()
            if frame.HasField("ack"):
                acked: list[PeerMessage] = []
                while self._unacked and self._unacked[0][0] <= frame.ack.seq:
                    acked.extend(self._unacked.popleft()[1])
                forgotten = self._forgotten
                while forgotten and forgotten[0][0] <= frame.ack.seq:
                    forgotten.popleft()  # it arrived after all
                if acked and self.durable:
                    node.outbox_acked(peer, acked)
                marks = self._marks
                while marks and marks[0][0] <= frame.ack.seq:
                    self._acked_popped = marks.popleft()[1]
                if self._settling:
                    self._release_settled()
            try:
                if frame.HasField("snapshot"):
                    rejected: list[RejectedMessage] = []
                    subs = snapshot_from_frame(frame, node.peer_geofences, rejected)
                    for r in rejected:
                        node.metrics.reject_peer_message(peer, r.kind.value, r.id, r.reason)
                    node.apply_snapshot(peer, subs, replace=not frame.snapshot.continued)
                await node.receive_frame(peer, frame)
            except StorageFailed as exc:
                # Not kept, so not acknowledged: the peer sends it again.
                raise ConnectionError(f"frame {frame.seq} not stored: {exc}") from None
            except Exception:
                # A bug, not the content of one message (those are isolated):
                # still no reason to drop the link and have the frame resent.
                log.exception("link %s: frame %d not fully applied", peer, frame.seq)
            if frame.seq:
                self._ack_pending = frame.seq
                self._wake.set()


def _size(msg: PeerMessage) -> int:
    """What a queued message counts against `peer_queue_bytes` (an estimate, cheap)."""
    if isinstance(msg, EventMsg | DeliveryMsg):
        fence = msg.event.geofence
        return _OVERHEAD + len(msg.event.payload) + (len(fence.wkt) if fence is not None else 0)
    if isinstance(msg, HandoffMsg):
        return _OVERHEAD + sum(map(len, msg.deliveries))
    return _OVERHEAD


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
