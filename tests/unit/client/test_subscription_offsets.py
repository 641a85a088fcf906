"""A persistent subscription's offsets are per broker: after a move, deliveries the
old broker sent before it are taken without moving the new broker's acknowledgement."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import geofed
from geofed.client import Subscription
from geofed.wire import Message


def message(event_id: str, broker: str, offset: int) -> Message:
    return Message(
        "q", event_id, "t/x", b"", geofed.LatLon(0.0, 0.0), None, 0.0, 0.0, broker, broker, offset
    )


def test_an_offset_of_the_broker_left_behind_is_not_acknowledged_at_the_new_one() -> None:
    async def run() -> None:
        closed = SimpleNamespace(_closed=True, _endpoint="")  # acknowledgements go nowhere
        sub = Subscription(closed, "q", "t/#", None, 100)  # type: ignore[arg-type]
        sub._broker = "eu"
        sub._push(message("e1", "eu", 7))  # received from eu, not yet taken
        sub._reset_offsets()  # the move to us (`Subscription._attach`)
        sub._broker = "us"
        assert (await sub.next(timeout=1.0)).offset == 7
        assert sub._taken == 0  # us's offset 7 is another delivery
        sub._push(message("e2", "us", 1))
        assert (await sub.next(timeout=1.0)).event_id == "e2"
        assert sub._taken == 1

    asyncio.run(run())
