"""The node's memory budget for queued messages, shared by every queue.

Each subscriber stream and each peer queue has a budget of its own
(`subscriber_queue_bytes`, `peer_queue_bytes`); a node with thousands of
streams could still exceed its memory through their sum. `ByteBudget` is the
sum's limit (`node_queue_bytes`): a queue asks it before it takes a message,
and one that is told no applies its own overflow policy, as if it were full
(a plain stream drops its oldest, a persistent stream and a durable peer
queue leave the message in the store, a memory-only peer queue drops it).
"""

from __future__ import annotations

from prometheus_client import Gauge


class ByteBudget:
    """Bytes held in memory by a node's queues, against a limit."""

    def __init__(self, limit: int, gauge: Gauge | None = None) -> None:
        self.limit = limit
        self.used = 0
        if gauge is not None:
            # Read when scraped: setting a gauge takes a lock, and `add` runs
            # twice per delivery (a fifth of the node's time at 100k deliveries/s).
            gauge.set_function(lambda: self.used)

    def fits(self, n: int) -> bool:
        """Whether `n` more bytes stay within the limit."""
        return self.used + n <= self.limit

    def add(self, n: int) -> None:
        """Account for `n` bytes taken (negative: given back)."""
        self.used += n
