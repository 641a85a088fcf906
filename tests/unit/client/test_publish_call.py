"""`Client.publish` over one open PublishEach call, against a stand-in broker.

The stand-in is a real gRPC server whose PublishEach a test steers: it can
hold an answer back, refuse a request in-band or end the call. What the
client must do: give each publish its own answer (in order, skipping the
answers of publishes that stopped waiting), raise a refusal as its typed
error while the call stays open, and publish again on a new call, with the
same event id, when the call breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

import geofed
from geofed.client import RetryConfig
from geofed.errors import error_json, status_for
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.wire import publish_refused, publish_result

RETRY = RetryConfig(attempts=5, initial_backoff_s=0.01, max_backoff_s=0.02)
HERE = geofed.LatLon(1, 2)
HANG_S = 60.0  # a test that waits this long has failed


class StandIn(cpb_grpc.ClientServiceServicer):
    """A broker whose PublishEach answers each request with its event id, except that
    it holds an answer while `gate` is clear, refuses the event ids in `refuse`, and
    ends its first `break_calls` calls with UNAVAILABLE on their first request."""

    def __init__(self, break_calls: int = 0) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.refuse: set[str] = set()
        self.break_calls = break_calls
        self.calls = 0
        self.requests: list[str] = []  # event ids, in the order they arrived

    async def Connect(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return cpb.ConnectResponse(broker_id="b", accepted=True)

    async def PublishEach(
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        self.calls += 1
        call = self.calls
        async for request in request_iterator:
            event_id = request.event.id
            self.requests.append(event_id)
            if call <= self.break_calls:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "broker shutting down")
            await self.gate.wait()
            if event_id in self.refuse:
                exc = geofed.TooLarge("request.event.payload", 10, 5)
                yield publish_refused(status_for(exc).value[0], str(exc), error_json(exc))
            else:
                yield publish_result(event_id)


@contextlib.asynccontextmanager
async def connected(broker: StandIn, **settings: Any) -> AsyncIterator[geofed.Client]:
    """A client of `broker`, served on a free loopback port while the block runs."""
    server = grpc.aio.server()
    cpb_grpc.add_ClientServiceServicer_to_server(broker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield await geofed.connect(
            client_id="c", location=HERE, endpoint=f"127.0.0.1:{port}", retry=RETRY, **settings
        )
    finally:
        await server.stop(None)


def test_publishes_get_their_own_answers_in_order_on_one_call() -> None:
    async def run() -> None:
        broker = StandIn()
        async with connected(broker) as client:
            broker.gate.clear()  # every answer waits: all 50 requests are in flight at once
            ids = [f"e{i}" for i in range(50)]
            pending = [asyncio.create_task(client.publish("t", event_id=i)) for i in ids]
            while not broker.requests:
                await asyncio.sleep(0.01)
            broker.gate.set()
            assert await asyncio.wait_for(asyncio.gather(*pending), HANG_S) == ids
            assert broker.requests == ids and broker.calls == 1
            await client.close()

    asyncio.run(run())


def test_a_refusal_raises_its_typed_error_and_the_call_stays_open() -> None:
    async def run() -> None:
        broker = StandIn()
        broker.refuse = {"bad"}
        async with connected(broker) as client:
            assert await client.publish("t", event_id="before") == "before"
            with pytest.raises(geofed.TooLarge) as info:
                await client.publish("t", event_id="bad")
            assert (info.value.field, info.value.limit) == ("request.event.payload", 5)
            assert await client.publish("t", event_id="after") == "after"
            assert broker.calls == 1
            await client.close()

    asyncio.run(run())


def test_the_answer_of_a_publish_that_timed_out_goes_to_no_other_publish() -> None:
    async def run() -> None:
        broker = StandIn()
        async with connected(broker, request_timeout_s=0.2) as client:
            broker.gate.clear()
            with pytest.raises(geofed.DeadlineExceeded):
                await client.publish("t", event_id="late")
            # The next publish may take its time (a busy machine): only "late" had to time out.
            client.config = dataclasses.replace(client.config, request_timeout_s=HANG_S)
            broker.gate.set()  # "late" is answered now, after its publish gave up
            assert await asyncio.wait_for(client.publish("t", event_id="next"), HANG_S) == "next"
            assert broker.requests == ["late", "next"] and broker.calls == 1
            await client.close()

    asyncio.run(run())


def test_a_broken_call_is_opened_again_and_the_publish_sent_again_with_its_id() -> None:
    async def run() -> None:
        broker = StandIn(break_calls=2)
        async with connected(broker) as client:
            assert await client.publish("t", event_id="once") == "once"
            assert broker.requests == ["once"] * 3 and broker.calls == 3
            await client.close()

    asyncio.run(run())


def test_publishes_waiting_when_the_client_closes_end_with_client_closed() -> None:
    async def run() -> None:
        broker = StandIn()
        async with connected(broker) as client:
            broker.gate.clear()
            waiting = asyncio.create_task(client.publish("t", event_id="stuck"))
            while not broker.requests:
                await asyncio.sleep(0.01)
            await client.close()
            with pytest.raises(geofed.ClientClosed):
                await asyncio.wait_for(waiting, HANG_S)
            broker.gate.set()

    asyncio.run(run())
