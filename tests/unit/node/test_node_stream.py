"""The per-subscription delivery queue: bounded in count and bytes.

A plain subscription drops the oldest (counted); a persistent one stops taking
live deliveries when full and reads them back from its store in order.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from geofed import wire as gw
from geofed.node import ByteBudget, NodeMetrics
from geofed.node._server import _END, _Stream
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import geo_pb2 as gpb


def delivery(offset: int, payload: bytes = b"x") -> cpb.Delivery:
    return gw.delivery_to_pb("s1", gpb.Event(id=f"e{offset}", payload=payload), 0.0, offset)


async def drain(stream: _Stream) -> list[int]:
    out = []
    while (item := await stream.get()) is not _END:
        out.append(item.offset)
    return out


def test_full_queue_drops_the_oldest_and_counts() -> None:
    registry = CollectorRegistry()
    stream = _Stream(3, 1 << 20, NodeMetrics(registry))
    for i in range(1, 6):
        stream.push(delivery(i))
    stream.close()
    assert asyncio.run(drain(stream)) == [3, 4, 5]
    assert registry.get_sample_value("geofed_subscriber_queue_dropped_total") == 2


def test_byte_budget_drops_the_oldest_too() -> None:
    registry = CollectorRegistry()
    # Each delivery counts 128 + 1,000 bytes: three fit in 3,500, not four.
    stream = _Stream(100, 3_500, NodeMetrics(registry))
    for i in range(1, 6):
        stream.push(delivery(i, b"p" * 1000))
    stream.close()
    assert asyncio.run(drain(stream)) == [3, 4, 5]
    assert registry.get_sample_value("geofed_subscriber_queue_dropped_total") == 2


def test_persistent_queue_reads_back_what_did_not_fit_in_order() -> None:
    """Full: live deliveries are left to the store, read back when the window drains;
    once the store has nothing newer, live deliveries are queued again."""
    registry = CollectorRegistry()
    stored = {i: delivery(i) for i in range(1, 11)}  # the store holds every delivery
    reads: list[int] = []

    async def refill(after: int) -> list[tuple[int, cpb.Delivery]]:
        reads.append(after)
        return [(o, d) for o, d in sorted(stored.items()) if o > after][:3]

    async def test() -> list[int]:
        stream = _Stream(2, 1 << 20, NodeMetrics(registry), refill)
        for i in range(1, 11):
            stream.push(stored[i])  # 1, 2 queued; 3.. left in the store
        out = [(await stream.get()).offset for _ in range(10)]
        stored[11] = delivery(11)
        stream.push(stored[11])  # still behind: left in the store
        out.append((await stream.get()).offset)
        waiting = asyncio.create_task(stream.get())
        while reads[-1] != 11:  # it found nothing newer than 11: caught up
            await asyncio.sleep(0)
        stream.push(delivery(12))  # queued live again
        out.append((await waiting).offset)
        stream.close()
        return out + await drain(stream)

    assert asyncio.run(test()) == list(range(1, 13))
    assert reads == [2, 5, 8, 10, 11]  # pages of 3, then nothing newer than 11
    assert registry.get_sample_value("geofed_subscriber_queue_dropped_total") == 0


def test_streams_share_the_node_budget() -> None:
    """node_queue_bytes: what one stream holds, another cannot take; a plain stream whose
    own queue is empty drops what does not fit (counted), and bytes come back as the
    streams are read or end."""
    registry = CollectorRegistry()
    metrics = NodeMetrics(registry)
    budget = ByteBudget(3 * 1128, metrics.queued_bytes)  # three 1,000-byte deliveries
    first = _Stream(100, 1 << 20, metrics, budget=budget)
    second = _Stream(100, 1 << 20, metrics, budget=budget)
    for i in range(1, 4):
        first.push(delivery(i, b"p" * 1000))
    second.push(delivery(9, b"p" * 1000))
    assert registry.get_sample_value("geofed_subscriber_queue_dropped_total") == 1
    assert registry.get_sample_value("geofed_queued_bytes") == 3 * 1128

    async def take_one() -> int:
        return int((await first.get()).offset)

    assert asyncio.run(take_one()) == 1
    second.push(delivery(10, b"p" * 1000))  # room again
    assert budget.used == 3 * 1128
    first.release()
    assert budget.used == 1128


def test_take_ready_batches_what_is_queued_within_its_limits() -> None:
    """A batch takes what is queued without waiting: up to a count, up to a byte size, and
    never the end marker (the next `get` still returns it)."""
    stream = _Stream(100, 1 << 20, NodeMetrics(CollectorRegistry()))
    for i in range(1, 8):
        stream.push(delivery(i, b"p" * 100))  # 228 bytes counted each
    assert [d.offset for d in stream.take_ready(3, 1 << 20)] == [1, 2, 3]
    assert [d.offset for d in stream.take_ready(10, 2 * 228 + 1)] == [4, 5]
    stream.close()
    assert [d.offset for d in stream.take_ready(10, 1 << 20)] == [6, 7]
    assert stream.take_ready(10, 1 << 20) == []
    assert asyncio.run(stream.get()) is _END


def test_a_stream_over_half_full_presses_publishers_until_it_drains() -> None:
    """Flow control: over half its count (or bytes) a plain stream is `pressed` and
    `drained` waits; taking it back to half releases the waiters."""
    stream = _Stream(10, 1 << 20, NodeMetrics(CollectorRegistry()))
    for i in range(1, 6):
        stream.push(delivery(i))
    assert not stream.pressed  # exactly half
    stream.push(delivery(6))
    assert stream.pressed

    async def test() -> list[int]:
        waiter = asyncio.create_task(stream.drained())
        await asyncio.sleep(0)
        assert not waiter.done()
        taken = [(await stream.get()).offset]  # 5 left: half
        await asyncio.wait_for(waiter, 120)
        return taken

    assert asyncio.run(test()) == [1]
    assert not stream.pressed


def test_a_stalled_stream_is_marked_slow_until_it_drains() -> None:
    """A stream that did not drain within a publisher's wait is `slow`: not pressed (nobody
    waits again), dropping its oldest when full; once it drains it may press again."""
    registry = CollectorRegistry()
    stream = _Stream(4, 1 << 20, NodeMetrics(registry))
    for i in range(1, 4):
        stream.push(delivery(i))
    assert stream.pressed
    stream.slow = True  # what BrokerServer._backpressure does when its wait timed out
    assert not stream.pressed
    for i in range(4, 7):
        stream.push(delivery(i))
    assert registry.get_sample_value("geofed_subscriber_queue_dropped_total") == 2
    assert [asyncio.run(stream.get()).offset for _ in range(2)] == [3, 4]  # drained to half
    assert not stream.slow
    stream.push(delivery(7))
    assert stream.pressed


def test_persistent_streams_never_press_publishers() -> None:
    """Their deliveries wait in the store: publishers are not slowed for them."""

    async def refill(after: int) -> list[tuple[int, cpb.Delivery]]:
        return []

    stream = _Stream(2, 1 << 20, NodeMetrics(CollectorRegistry()), refill)
    for i in range(1, 6):
        stream.push(delivery(i))
    assert not stream.pressed


def test_closing_a_stream_releases_waiting_publishers() -> None:
    stream = _Stream(2, 1 << 20, NodeMetrics(CollectorRegistry()))
    for i in range(1, 3):
        stream.push(delivery(i))
    assert stream.pressed
    stream.close()
    assert not stream.pressed
    asyncio.run(asyncio.wait_for(stream.drained(), 120))
