"""Memory is bounded in bytes (issue #11, docs/design.md §6-§8), with real node processes.

* A subscriber that never reads, 64 KB payloads, a few thousand events: the
  broker's resident memory grows by at most `subscriber_queue_bytes` plus a
  stated margin, and what does not fit is dropped oldest first and counted;
  a persistent subscription drops nothing from its stream (its deliveries wait
  in the store) and its queue in the store keeps `session_queue_bytes`,
  dropping the oldest (counted).
* A frozen subscriber (a client process stopped with SIGSTOP) stops answering
  the broker's keepalive pings: its connection is closed and its subscription
  withdrawn.
* A peer that is down: with a data_dir, events for it wait in the outbox
  (counted by the peer queue gauge), none is dropped even far beyond
  `peer_queue_size`, and all of them arrive once the peer is back.

The subscriber that never reads is a raw gRPC Subscribe call whose messages
are never taken: the client library would read them into its own buffer.
Waits are on state (metrics, deliveries); RSS is read from ``/proc``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest

import geofed
from geofed.bench import LocalFederation, metric
from geofed.bench.faults import box, until
from geofed.bench.soak import rss_mib
from geofed.client import Publication, RetryConfig
from geofed.node import (
    DELIVERIES,
    EVENTS_PUBLISHED,
    PEER_CONNECTED,
    PEER_QUEUE_DROPPED,
    PEER_QUEUE_LENGTH,
    SESSION_QUEUE_DROPPED,
    SUBSCRIBER_QUEUE_DROPPED,
    SUBSCRIPTIONS,
)
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.wire import connect_request, subscribe_request

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = geofed.LatLon(48.85, 2.35)  # eu
SINGAPORE = geofed.LatLon(1.29, 103.85)  # ap
HANG_S = 120.0
RETRY = RetryConfig(attempts=60, initial_backoff_s=0.05, max_backoff_s=0.5)
MiB = 1 << 20
PAYLOAD = 64 * 1024
EVENTS = 3000  # 3,000 × 64 KB = 188 MiB offered to one subscriber that never reads
BATCH = 16  # events per PublishStream message (1 MiB)
SUBSCRIBER_QUEUE_BYTES = 4 * MiB
SESSION_QUEUE_BYTES = 8 * MiB
MARGIN_MIB = 32.0
"""RSS a broker may gain beyond its byte budgets while 188 MiB pass through it: gRPC's
transport buffers towards the stalled subscriber (its flow-control windows), the batches
being decoded, the allocator keeping freed memory, SQLite's page cache."""
ENV = {
    "GEOFED_SUBSCRIBER_QUEUE_BYTES": str(SUBSCRIBER_QUEUE_BYTES),
    "GEOFED_SESSION_QUEUE_BYTES": str(SESSION_QUEUE_BYTES),
    "GEOFED_PEER_HEARTBEAT_S": "0.2",
    "GEOFED_PEER_TIMEOUT_S": "1.5",
}
NEAR_PARIS = box(PARIS, 1.0)  # event geofence inside eu: nothing is forwarded to a peer


@pytest.fixture
def durable(tmp_path: Path) -> Iterator[LocalFederation]:
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True, extra_env=ENV) as fed:
        yield fed


@asynccontextmanager
async def never_reading(
    fed: LocalFederation, client: str, session_expiry_s: float = 0.0
) -> AsyncIterator[None]:
    """A subscriber at eu to ``m/#`` that takes none of its deliveries, while in the block."""
    async with grpc.aio.insecure_channel(fed.nodes["eu"].client) as channel:
        stub = cpb_grpc.ClientServiceStub(channel)
        await stub.Connect(connect_request(client, PARIS, session_expiry_s), timeout=HANG_S)
        call = stub.Subscribe(subscribe_request(client, f"{client}-s", "m/#"))
        await call.initial_metadata()  # sent once the broker holds the subscription
        try:
            yield
        finally:
            call.cancel()


async def publish_and_watch_rss(
    fed: LocalFederation, n: int, prefix: str, topic: str = "m/x"
) -> float:
    """Publish `n` 64 KB events near Paris at eu; returns eu's largest RSS (MiB) seen between
    the batches."""
    pid = fed.nodes["eu"].process.pid
    peak = rss_mib(pid)
    async with await geofed.connect(
        client_id=f"{prefix}-pub", location=PARIS, federation=fed.federation_path, retry=RETRY
    ) as pub:
        for start in range(0, n, BATCH):
            await pub.publish_many(
                Publication(topic, bytes(PAYLOAD), PARIS, NEAR_PARIS, f"{prefix}{i}")
                for i in range(start, min(n, start + BATCH))
            )
            peak = max(peak, rss_mib(pid))
    return peak


async def fill(fed: LocalFederation, prefix: str, full: Callable[[], bool]) -> int:
    """Publish batches until `full()` holds; returns how many events it took."""
    n = 0
    while not await asyncio.to_thread(full):
        await publish_and_watch_rss(fed, BATCH, f"{prefix}{n}-")
        n += BATCH
    return n


def test_a_subscriber_that_never_reads_costs_its_byte_budget_and_drops_the_rest(
    durable: LocalFederation,
) -> None:
    """Once its queue and the transport's windows are full, each new event drops the oldest
    one queued (counted); eu grows by the budget and the margin, not by what was offered."""
    eu = durable.nodes["eu"].metrics_url
    pid = durable.nodes["eu"].process.pid

    async def run() -> None:
        async with never_reading(durable, "stalled"):
            # Warm-up through the same paths, with events the subscriber does not match.
            await publish_and_watch_rss(durable, 4 * BATCH, "warm", topic="w/x")
            before = rss_mib(pid)
            filled = await fill(durable, "fill", lambda: metric(eu, SUBSCRIBER_QUEUE_DROPPED) > 0)
            dropped_before = metric(eu, SUBSCRIBER_QUEUE_DROPPED)
            peak = await publish_and_watch_rss(durable, EVENTS, "big")
            after = rss_mib(pid)
            assert metric(eu, EVENTS_PUBLISHED) == 4 * BATCH + filled + EVENTS
            assert metric(eu, DELIVERIES) == filled + EVENTS
            assert metric(eu, SUBSCRIBER_QUEUE_DROPPED) - dropped_before == EVENTS
            bound = SUBSCRIBER_QUEUE_BYTES / MiB + MARGIN_MIB
            assert max(peak, after) - before <= bound, (before, peak, after, bound)

    asyncio.run(run())


def test_a_persistent_subscriber_that_never_reads_keeps_its_queue_in_the_store(
    durable: LocalFederation,
) -> None:
    """The same for a persistent session: nothing is dropped from its stream (what does not
    fit waits in the store, read back in order), and its queue in the store keeps
    session_queue_bytes, the oldest deliveries beyond it dropped and counted."""
    eu = durable.nodes["eu"].metrics_url
    pid = durable.nodes["eu"].process.pid
    # At most this many fit the store's queue; a batch committed while the previous trim ran
    # is trimmed with the next delivery (node/_server.py `_trim`), so allow one batch more.
    kept = SESSION_QUEUE_BYTES // PAYLOAD + BATCH

    async def run() -> None:
        async with never_reading(durable, "stalled-p", session_expiry_s=300.0):
            await publish_and_watch_rss(durable, 4 * BATCH, "warm", topic="w/x")
            before = rss_mib(pid)
            peak = await publish_and_watch_rss(durable, EVENTS, "big")
            await until(
                lambda: metric(eu, SESSION_QUEUE_DROPPED) >= EVENTS - kept,
                f"the store keeps at most {kept} deliveries (the oldest dropped)",
                HANG_S,
                scrapes=True,
            )
            after = rss_mib(pid)
            assert metric(eu, DELIVERIES) == EVENTS
            assert metric(eu, SUBSCRIBER_QUEUE_DROPPED) == 0
            assert metric(eu, SESSION_QUEUE_DROPPED) <= EVENTS
            bound = SUBSCRIBER_QUEUE_BYTES / MiB + MARGIN_MIB
            assert max(peak, after) - before <= bound, (before, peak, after, bound)

    asyncio.run(run())


FROZEN = """
import asyncio, sys
import geofed

async def main():
    client = await geofed.connect(
        client_id="frozen", location=geofed.LatLon(48.85, 2.35), endpoint=sys.argv[1]
    )
    sub = await client.subscribe("m/#", subscription_id="frozen-s")
    print("subscribed", flush=True)
    async for _ in sub:
        pass

asyncio.run(main())
"""


def test_a_frozen_subscriber_is_detected_by_keepalive_and_its_subscription_withdrawn(
    tmp_path: Path,
) -> None:
    """A subscriber process (plain session) is stopped with SIGSTOP: it no longer answers the
    broker's keepalive pings (client_keepalive_s=1), so the broker closes its connection and
    withdraws its subscription."""
    env = {"GEOFED_CLIENT_KEEPALIVE_S": "1"}
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env) as fed:
        eu = fed.nodes["eu"].metrics_url
        with subprocess.Popen(
            [sys.executable, "-c", FROZEN, fed.nodes["eu"].client],
            stdout=subprocess.PIPE,
            text=True,
        ) as proc:
            try:
                assert proc.stdout is not None
                assert proc.stdout.readline() == "subscribed\n"
                assert metric(eu, SUBSCRIPTIONS, scope="local") == 1
                proc.send_signal(signal.SIGSTOP)
                asyncio.run(
                    until(
                        lambda: metric(eu, SUBSCRIPTIONS, scope="local") == 0,
                        "eu withdraws the frozen subscriber's subscription",
                        HANG_S,
                        scrapes=True,
                    )
                )
            finally:
                proc.kill()  # SIGKILL ends a stopped process too


def test_events_for_a_peer_that_is_down_wait_in_the_outbox_beyond_its_queue_size(
    tmp_path: Path,
) -> None:
    """ap (a persistent subscriber's broker) is down: eu keeps every event for it in its
    outbox, counted by the peer queue gauge and never dropped although peer_queue_size is 5;
    after ap's restart they all arrive, once each."""
    env = ENV | {"GEOFED_PEER_QUEUE_SIZE": "5"}
    n = 200
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True, extra_env=env) as fed:
        eu = fed.nodes["eu"].metrics_url

        async def run() -> None:
            sub_client = await geofed.connect(
                client_id="outbox-sub",
                location=SINGAPORE,
                federation=fed.federation_path,
                retry=RETRY,
                session_expiry_s=300.0,
            )
            sub = await sub_client.subscribe("o/#", subscription_id="outbox-s")
            await asyncio.to_thread(fed.stop_node, "ap")
            await until(
                lambda: metric(eu, PEER_CONNECTED, peer="ap") == 0,
                "eu sees ap down",
                HANG_S,
                scrapes=True,
            )
            async with await geofed.connect(
                client_id="outbox-pub", location=PARIS, federation=fed.federation_path
            ) as pub:
                ids = [await pub.publish("o/x", f"e{i}", event_id=f"e{i}") for i in range(n)]
            assert metric(eu, PEER_QUEUE_LENGTH, peer="ap") == n
            assert metric(eu, PEER_QUEUE_DROPPED) == 0
            await asyncio.to_thread(fed.start_node, "ap")
            got = [(await sub.next(timeout=HANG_S)).event_id for _ in range(n)]
            assert got == ids
            await until(
                lambda: metric(eu, PEER_QUEUE_LENGTH, peer="ap") == 0,
                "eu's outbox for ap is empty",
                HANG_S,
                scrapes=True,
            )
            assert metric(eu, PEER_QUEUE_DROPPED) == 0
            assert sub.duplicates == 0
            await sub_client.close()

        asyncio.run(run())


def test_the_peer_queue_gauge_counts_what_a_broken_link_left_in_the_outbox(
    tmp_path: Path,
) -> None:
    """Events sent to ap but not acknowledged (ap is frozen) wait in eu's outbox once eu
    times the link out: the gauge counts them, and the events published afterwards; all
    of them arrive once ap is resumed.
    """
    sent, later = 20, 10
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True, extra_env=ENV) as fed:
        eu = fed.nodes["eu"].metrics_url

        async def run() -> None:
            sub_client = await geofed.connect(
                client_id="gauge-sub",
                location=SINGAPORE,
                federation=fed.federation_path,
                retry=RETRY,
                session_expiry_s=300.0,
            )
            sub = await sub_client.subscribe("g/#", subscription_id="gauge-s")
            fed.pause_node("ap")
            try:
                async with await geofed.connect(
                    client_id="gauge-pub", location=PARIS, federation=fed.federation_path
                ) as pub:
                    ids = [await pub.publish("g/x", b"", event_id=f"g{i}") for i in range(sent)]
                    await until(
                        lambda: metric(eu, PEER_QUEUE_LENGTH, peer="ap") == 0,
                        "eu wrote them to the link (unacknowledged: ap is frozen)",
                        HANG_S,
                        scrapes=True,
                    )
                    await until(
                        lambda: metric(eu, PEER_CONNECTED, peer="ap") == 0,
                        "eu times the frozen ap out",
                        HANG_S,
                        scrapes=True,
                    )
                    assert metric(eu, PEER_QUEUE_LENGTH, peer="ap") == sent
                    ids += [await pub.publish("g/x", b"", event_id=f"h{i}") for i in range(later)]
                    assert metric(eu, PEER_QUEUE_LENGTH, peer="ap") == sent + later
            finally:
                fed.resume_node("ap")
            got = [(await sub.next(timeout=HANG_S)).event_id for _ in range(sent + later)]
            assert got == ids
            await sub_client.close()

        asyncio.run(run())
