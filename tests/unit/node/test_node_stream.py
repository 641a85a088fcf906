"""The per-subscription delivery queue is bounded and drops the oldest, counted."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from geofed.node import NodeMetrics
from geofed.node._server import _END, _Stream


def test_full_queue_drops_the_oldest_and_counts() -> None:
    registry = CollectorRegistry()
    metrics = NodeMetrics(registry)
    stream = _Stream(3, metrics)
    for i in range(5):
        stream.push(i)
    stream.close()

    async def drain() -> list[object]:
        out = []
        while (item := await stream.get()) is not _END:
            out.append(item)
        return out

    assert asyncio.run(drain()) == [2, 3, 4]
    assert registry.get_sample_value("geofed_subscriber_queue_dropped_total") == 2
