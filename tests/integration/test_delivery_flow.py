"""The subscriber stream under load, with real node processes (issue #15).

* Batching: a client that asks (``geofed-batch`` call metadata) gets many
  deliveries per stream message; one that does not gets one per message;
  both get every delivery once, in order.
* Flow control: a subscriber that is only momentarily slow loses nothing;
  its publisher waits (counted by ``geofed_publish_backpressure_waits_total``).
* Overflow: a subscriber that stays stalled costs its publisher one bounded
  wait; then its oldest deliveries are dropped (counted), the newest arrive.

The slow subscriber is a raw gRPC Subscribe call whose messages are not
taken (the client library would read them into its own buffer). Waits are on
state (metrics, deliveries), never on a clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

import geofed
from geofed.bench import LocalFederation, metric
from geofed.bench.faults import box, until
from geofed.client import Publication
from geofed.node import PUBLISH_BACKPRESSURE_WAITS, SUBSCRIBER_QUEUE_DROPPED
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.wire import BATCH_METADATA, connect_request, deliveries_in, subscribe_request

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = geofed.LatLon(48.85, 2.35)  # eu
NEAR_PARIS = box(PARIS, 1.0)  # event geofence inside eu: nothing is forwarded
HANG_S = 120.0
QUEUE = 100  # deliveries per subscriber stream: publishers wait above 50
PAYLOAD = 8 * 1024  # 3,000 of them (24 MiB) fill gRPC's windows towards a stalled reader
EVENTS = 3000


def _federation(tmp_path: Path, backpressure_ms: float) -> LocalFederation:
    env = {
        "GEOFED_SUBSCRIBER_QUEUE_SIZE": str(QUEUE),
        "GEOFED_SUBSCRIBER_BACKPRESSURE_MS": str(backpressure_ms),
    }
    return LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env, mqtt=False)


@pytest.fixture
def patient(tmp_path: Path) -> Iterator[LocalFederation]:
    """Publishers wait (up to the hang bound) for a subscriber to catch up."""
    with _federation(tmp_path, HANG_S * 1000) as fed:
        yield fed


@pytest.fixture
def impatient(tmp_path: Path) -> Iterator[LocalFederation]:
    """Publishers wait at most 200 ms for a subscriber."""
    with _federation(tmp_path, 200) as fed:
        yield fed


@asynccontextmanager
async def raw_subscriber(
    fed: LocalFederation, client: str, batched: bool = True
) -> AsyncIterator[Any]:
    """A Subscribe call at eu to ``m/#`` whose messages the test reads itself."""
    async with grpc.aio.insecure_channel(fed.nodes["eu"].client) as channel:
        stub = cpb_grpc.ClientServiceStub(channel)
        await stub.Connect(connect_request(client, PARIS), timeout=HANG_S)
        call = stub.Subscribe(
            subscribe_request(client, f"{client}-s", "m/#"),
            metadata=(BATCH_METADATA,) if batched else None,
        )
        await call.initial_metadata()  # sent once the broker holds the subscription
        try:
            yield call
        finally:
            call.cancel()


async def publish(fed: LocalFederation, n: int, payload: int, batch: int) -> list[str]:
    async with await geofed.connect(
        client_id="pub", location=PARIS, federation=fed.federation_path
    ) as pub:
        return await pub.publish_many(
            [Publication("m/x", bytes(payload), PARIS, NEAR_PARIS) for _ in range(n)],
            batch_size=batch,
        )


async def read(call: Any, n: int, sizes: list[int] | None = None) -> list[str]:
    """Event ids of the next `n` deliveries (and the deliveries per stream message)."""
    ids: list[str] = []
    async with asyncio.timeout(HANG_S):
        while len(ids) < n:
            pb = await call.read()
            assert pb is not grpc.aio.EOF
            got = [d.event.id for d in deliveries_in(pb)]
            if sizes is not None:
                sizes.append(len(got))
            ids.extend(got)
    return ids


def count(fed: LocalFederation, name: str) -> float:
    return metric(fed.nodes["eu"].metrics_url, name)


def test_batched_and_single_streams_deliver_everything_in_order(patient: LocalFederation) -> None:
    async def run() -> None:
        async with (
            raw_subscriber(patient, "batched") as batched,
            raw_subscriber(patient, "single", batched=False) as single,
        ):
            sizes: list[int] = []
            singles: list[int] = []
            ids, got, got_single = await asyncio.gather(
                publish(patient, 600, 64, batch=40),
                read(batched, 600, sizes),
                read(single, 600, singles),
            )
            assert got == got_single == ids
            # A publish of 40 queues them at once: they leave together.
            assert max(sizes) > 1 and sum(sizes) == 600
            assert set(singles) == {1}

    asyncio.run(run())
    assert count(patient, SUBSCRIBER_QUEUE_DROPPED) == 0


@pytest.mark.parametrize("batch", [20, 3 * QUEUE])  # a batch larger than the queue, too
def test_a_momentarily_slow_subscriber_slows_the_publisher_and_loses_nothing(
    patient: LocalFederation, batch: int
) -> None:
    async def run() -> None:
        async with raw_subscriber(patient, f"slow-{batch}") as call:
            publishing = asyncio.create_task(publish(patient, EVENTS, PAYLOAD, batch=batch))
            # The subscriber reads nothing until the publisher had to wait for it.
            await until(
                lambda: count(patient, PUBLISH_BACKPRESSURE_WAITS) >= 1,
                "a publish waiting for the subscriber",
                HANG_S,
                scrapes=True,
            )
            assert not publishing.done()
            got = await read(call, EVENTS)
            assert got == await publishing

    asyncio.run(run())
    assert count(patient, SUBSCRIBER_QUEUE_DROPPED) == 0


def test_a_stalled_subscriber_costs_one_bounded_wait_then_loses_its_oldest(
    impatient: LocalFederation,
) -> None:
    async def run() -> None:
        async with raw_subscriber(impatient, "stalled") as call:
            ids = await publish(impatient, EVENTS, PAYLOAD, batch=20)  # finishes: bounded wait
            dropped = int(count(impatient, SUBSCRIBER_QUEUE_DROPPED))
            assert dropped > 0
            assert count(impatient, PUBLISH_BACKPRESSURE_WAITS) >= 1
            got = await read(call, EVENTS - dropped)
            # What arrives is in order and ends with the newest; the oldest queued went.
            positions = [ids.index(x) for x in got]
            assert positions == sorted(positions) and got[-1] == ids[-1]

    asyncio.run(run())
