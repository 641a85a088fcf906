"""The client library against a stand-in broker: which failures it retries."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

import geofed
from geofed.client import RetryConfig
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc

RETRY = RetryConfig(attempts=5, initial_backoff_s=0.01, max_backoff_s=0.02)


class CancelsFirst(cpb_grpc.ClientServiceServicer):
    """A broker that cancels the first `cancels` Connect calls (as one that is stopping does)."""

    def __init__(self, cancels: int) -> None:
        self.cancels = cancels
        self.calls = 0

    async def Connect(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        if self.calls <= self.cancels:
            await context.abort(grpc.StatusCode.CANCELLED, "server shutting down")
        return cpb.ConnectResponse(broker_id="b", accepted=True)


async def _serve(servicer: CancelsFirst) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    cpb_grpc.add_ClientServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_a_call_the_broker_cancelled_is_tried_again() -> None:
    async def run() -> None:
        broker = CancelsFirst(cancels=2)
        server, endpoint = await _serve(broker)
        try:
            client = await geofed.connect(
                client_id="c", location=geofed.LatLon(1, 2), endpoint=endpoint, retry=RETRY
            )
            assert (client.broker_id, broker.calls) == ("b", 3)
            await client.close()
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_cancelled_through_every_retry_is_unavailable() -> None:
    async def run() -> None:
        broker = CancelsFirst(cancels=100)
        server, endpoint = await _serve(broker)
        try:
            with pytest.raises(geofed.Unavailable, match="connect cancelled"):
                await geofed.connect(
                    client_id="c", location=geofed.LatLon(1, 2), endpoint=endpoint, retry=RETRY
                )
            assert broker.calls == RETRY.attempts
        finally:
            await server.stop(None)

    asyncio.run(run())
