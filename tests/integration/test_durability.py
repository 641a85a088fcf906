"""What a broker's store keeps (docs/design.md §8), with real node processes.

Each case builds the situation it needs, deterministically: a peer that cannot
take what a broker sends is paused (SIGSTOP) rather than raced against, and a
broker is killed with SIGKILL right after its publisher was answered. Waits
are on state (a delivery arriving, a metric, health, the quiescence barrier
before publishing to a subscription that is forwarded); the `next` timeouts
only turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_node_behaviour import raw_call

import geofed
from geofed.bench import LocalFederation, metric
from geofed.bench.faultproxy import FaultProxy, ProxyHost
from geofed.bench.faults import until
from geofed.client import Publication, RetryConfig, Subscription
from geofed.node import (
    EVENTS_PUBLISHED,
    HANDOFF_DELIVERIES,
    HANDOVERS,
    PUBLISH_DUPLICATES,
    SESSIONS,
    SESSIONS_EXPIRED,
    SUBSCRIPTIONS,
)
from geofed.routing import STRATEGIES
from geofed.wire import leave_request, update_location_request

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = geofed.LatLon(48.85, 2.35)  # eu
SINGAPORE = geofed.LatLon(1.29, 103.85)  # ap
NEW_YORK = geofed.LatLon(40.71, -74.0)  # us
HANG_S = 120.0
# Short liveness so that a killed peer is noticed fast; retries outlast a restart.
ENV = {"GEOFED_PEER_HEARTBEAT_S": "0.2", "GEOFED_PEER_TIMEOUT_S": "1.5"}
RETRY = RetryConfig(attempts=60, initial_backoff_s=0.05, max_backoff_s=0.5)


@pytest.fixture
def durable(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalFederation]:
    strategy = getattr(request, "param", "event-geofence")
    with LocalFederation(THREE, strategy, tmp_path, durable=True, extra_env=ENV) as fed:
        yield fed


async def client(fed: LocalFederation, cid: str, where: geofed.LatLon, **kw: Any) -> geofed.Client:
    return await geofed.connect(
        client_id=cid, location=where, federation=fed.federation_path, retry=RETRY, **kw
    )


async def collect(sub: Subscription, n: int) -> list[geofed.Message]:
    return [await sub.next(timeout=HANG_S) for _ in range(n)]


def batch(prefix: str, n: int, where: geofed.LatLon = PARIS) -> list[Publication]:
    return [
        Publication("d/x", f"{prefix}{i}".encode(), where, None, f"{prefix}{i}") for i in range(n)
    ]


@pytest.mark.parametrize("durable", list(STRATEGIES), indirect=True)
def test_events_acknowledged_before_the_publishers_broker_is_killed_are_delivered(
    durable: LocalFederation,
) -> None:
    """ap is paused, so nothing eu acknowledged can have left eu's outbox; eu is killed
    right after the answers and restarted: every event reaches ap's subscriber once."""
    fed = durable

    async def run() -> None:
        sub_client = await client(fed, "dur-sub", SINGAPORE)
        pub = await client(fed, "dur-pub", PARIS)
        sub = await sub_client.subscribe("d/#", subscription_id="dur-s")
        await fed.quiescent(HANG_S)  # forwarded subscriptions are in place
        await pub.publish("d/x", b"before", event_id="before")  # every path is up
        assert (await sub.next(timeout=HANG_S)).event_id == "before"
        fed.pause_node("ap")
        ids = await pub.publish_many(batch("k", 300), batch_size=50)
        await pub.close()
        fed.stop_node("eu", signal.SIGKILL)  # nothing flushed on the way out
        fed.start_node("eu")
        fed.resume_node("ap")
        fed.wait_ready(HANG_S)
        got = await collect(sub, 300)
        pub = await client(fed, "dur-pub-2", PARIS)
        await pub.publish("d/x", b"marker", event_id="marker")  # after every resend, on the link
        assert (await sub.next(timeout=HANG_S)).event_id == "marker"
        assert sorted(m.event_id for m in got) == sorted(ids)
        assert (sub.received, sub.duplicates) == (302, 0)
        await pub.close()
        await sub_client.close()

    asyncio.run(run())


@pytest.mark.parametrize("durable", list(STRATEGIES), indirect=True)
def test_a_persistent_subscriber_resumes_across_a_kill_of_its_broker_without_loss_or_repeat(
    durable: LocalFederation,
) -> None:
    """ap (the subscriber's broker) is killed with deliveries queued for a persistent session
    and more are published while it is down; after the restart the subscription resumes
    after the last offset it received: everything arrives once, in offset order."""
    fed = durable

    async def run() -> None:
        sub_client = await client(fed, "per-sub", SINGAPORE, session_expiry_s=300.0)
        pub = await client(fed, "per-pub", PARIS)
        sub = await sub_client.subscribe("d/#", subscription_id="per-s")
        await fed.quiescent(HANG_S)  # forwarded subscriptions are in place
        first = await collect(sub, 0) + [
            m for m in await _publish_and_take(pub, sub, batch("a", 50), take=20)
        ]
        fed.stop_node("ap", signal.SIGKILL)  # 30 of the first batch not yet taken, or sent
        second = await pub.publish_many(batch("b", 50))  # acknowledged while ap is down
        fed.start_node("ap")
        fed.wait_ready(HANG_S)
        rest = await collect(sub, 80)
        got = [m.event_id for m in first + rest]
        assert sorted(got) == sorted([f"a{i}" for i in range(50)] + second)
        offsets = [m.offset for m in first + rest]
        assert offsets == sorted(offsets) and len(set(offsets)) == 100
        assert sub.duplicates == 0
        await pub.close()
        await sub_client.close()

    asyncio.run(run())


async def _publish_and_take(
    pub: geofed.Client, sub: Subscription, pubs: list[Publication], take: int
) -> list[geofed.Message]:
    await pub.publish_many(pubs)
    return await collect(sub, take)


def test_a_persistent_session_keeps_deliveries_while_its_client_is_away(
    durable: LocalFederation,
) -> None:
    """A persistent client closes; what is published meanwhile waits at its broker and
    arrives, with offsets, when a client with its id subscribes again; what it took and
    acknowledged is not sent again."""
    fed = durable

    async def run() -> None:
        pub = await client(fed, "away-pub", PARIS)
        first = await client(fed, "away", SINGAPORE, session_expiry_s=300.0)
        assert first.session_expiry_s == 300.0
        sub = await first.subscribe("d/#", subscription_id="away-s")
        await pub.publish_many(batch("x", 5))
        assert [m.offset for m in await collect(sub, 5)] == [1, 2, 3, 4, 5]
        await first.close()  # acknowledges 1..5; the subscription stays
        await pub.publish_many(batch("y", 7))
        again = await client(fed, "away", SINGAPORE, session_expiry_s=300.0)
        sub = await again.subscribe("d/#", subscription_id="away-s")
        got = await collect(sub, 7)
        assert [m.event_id for m in got] == [f"y{i}" for i in range(7)]
        assert [m.offset for m in got] == list(range(6, 13))
        await again.close()
        await pub.close()

    asyncio.run(run())


@pytest.fixture
def to_ap(durable: LocalFederation) -> Iterator[FaultProxy]:
    """A fault proxy in front of ap's client port."""
    host = ProxyHost()
    try:
        yield host.add("client->ap", durable.federation.broker("ap").client_endpoint)
    finally:
        host.close()


async def _taken_while_cut(
    pub: geofed.Client, proxy: FaultProxy, cid: str, n: int, retry: RetryConfig
) -> geofed.Client:
    """A persistent client of ap behind `proxy` that took `n` deliveries while cut off."""
    persistent = await geofed.connect(
        client_id=cid,
        location=SINGAPORE,
        endpoint=proxy.address,
        retry=retry,
        session_expiry_s=300.0,
    )
    sub = await persistent.subscribe("d/#", subscription_id=f"{cid}-s")
    await pub.publish_many(batch("x", n))
    await until(lambda: sub.received == n, f"{n} deliveries at the client", HANG_S)
    proxy.partition()  # the periodic acknowledgement of what is taken now fails
    assert [m.offset for m in await collect(sub, n)] == list(range(1, n + 1))
    return persistent


def _client_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "geofed.client" and r.levelno >= logging.WARNING]


def test_a_closing_persistent_client_retries_its_last_acknowledgement(
    durable: LocalFederation, to_ap: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """`close` sends a persistent subscription's last acknowledgement until the broker
    takes it: with the client's connection cut while it takes its deliveries and
    closes, the acknowledgement arrives once the connection is back, and the next
    client with its id gets nothing the first one took."""
    fed = durable
    caplog.set_level(logging.DEBUG, logger="geofed.client")

    def retried_ack() -> bool:
        return any(r.getMessage().startswith("ack, try") for r in caplog.records)

    async def run() -> None:
        pub = await client(fed, "ack-pub", PARIS)
        first = await _taken_while_cut(pub, to_ap, "acker", 5, RETRY)
        closing = asyncio.create_task(first.close())
        await until(retried_ack, "a failed try of the last acknowledgement", HANG_S)
        to_ap.heal()
        await closing
        assert not _client_warnings(caplog)
        await pub.publish_many(batch("y", 3))
        again = await client(fed, "acker", SINGAPORE, session_expiry_s=300.0)
        sub = await again.subscribe("d/#", subscription_id="acker-s")
        got = await collect(sub, 3)
        assert [(m.event_id, m.offset) for m in got] == [("y0", 6), ("y1", 7), ("y2", 8)]
        await again.close()
        await pub.close()

    asyncio.run(run())


def test_a_closing_persistent_client_that_cannot_reach_its_broker_says_what_comes_again(
    durable: LocalFederation, to_ap: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    """When every try of the last acknowledgement fails, `close` still returns, and logs
    which deliveries the next client with its id will receive again; that client
    does receive them again (at least once across a client restart)."""
    fed = durable

    async def run() -> None:
        pub = await client(fed, "gone-pub", PARIS)
        retry = RetryConfig(attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1)
        await (await _taken_while_cut(pub, to_ap, "gone", 4, retry)).close()
        (warning,) = _client_warnings(caplog)
        assert "(offset 4)" in warning.getMessage()
        assert "deliveries after offset 0 again" in warning.getMessage()
        again = await client(fed, "gone", SINGAPORE, session_expiry_s=300.0)
        sub = await again.subscribe("d/#", subscription_id="gone-s")
        assert [m.offset for m in await collect(sub, 4)] == [1, 2, 3, 4]
        await again.close()
        await pub.close()

    asyncio.run(run())


def test_sessions_expire_and_their_subscriptions_go(tmp_path: Path) -> None:
    """A persistent session without a stream for its expiry, and plain sessions idle for
    session_idle_s, are forgotten (counted); the persistent one's subscription with it."""
    env = ENV | {"GEOFED_SESSION_IDLE_S": "1"}
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env) as fed:
        ap = fed.nodes["ap"].metrics_url

        async def run() -> None:
            persistent = await client(fed, "exp-p", SINGAPORE, session_expiry_s=1.0)
            await persistent.subscribe("d/#", subscription_id="exp-s")
            await persistent.close()
            for i in range(20):
                plain = await client(fed, f"exp-{i}", SINGAPORE)
                await plain.close()
            # (Open + expired is not checked at one instant: the two gauges are two reads,
            # and the reaper may move a session between them.)
            await until(lambda: metric(ap, SESSIONS_EXPIRED) == 21, "sessions expired", HANG_S)
            assert metric(ap, SESSIONS) == 0
            assert metric(ap, "geofed_subscriptions", scope="local") == 0

        asyncio.run(run())


def test_a_retried_publish_is_delivered_once_here_and_remotely(
    durable: LocalFederation,
) -> None:
    """The same event id published twice (a retry after a lost answer): the broker drops
    the second, so the local and the remote subscriber each get one copy."""
    fed = durable

    async def run() -> None:
        local = await client(fed, "retry-local", PARIS)
        remote = await client(fed, "retry-remote", SINGAPORE)
        ls = await local.subscribe("d/#")
        rs = await remote.subscribe("d/#")
        pub = await client(fed, "retry-pub", PARIS)
        for _ in range(2):
            assert await pub.publish("d/x", b"1", event_id="same") == "same"
        await pub.publish("d/x", b"2", event_id="next")
        for sub in (ls, rs):
            assert [m.event_id for m in await collect(sub, 2)] == ["same", "next"]
            assert sub.received == 2
        assert metric(fed.nodes["eu"].metrics_url, PUBLISH_DUPLICATES) == 1
        for c in (local, remote, pub):
            await c.close()

    asyncio.run(run())


def test_a_full_store_refuses_publishes_and_keeps_what_it_acknowledged(tmp_path: Path) -> None:
    """With its peers paused, eu's outbox fills its store (store_max_bytes): publishing is
    refused with StorageFailed (UNAVAILABLE), never acknowledged and lost; eu keeps
    serving, and once the peers take the outbox, publishing works again and every
    acknowledged event is delivered."""
    env = ENV | {"GEOFED_STORE_MAX_BYTES": str(256 * 1024)}
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True, extra_env=env) as fed:

        async def run() -> None:
            sub_client = await client(fed, "full-sub", SINGAPORE)
            sub = await sub_client.subscribe("d/#")
            pub = await geofed.connect(
                client_id="full-pub",
                location=PARIS,
                federation=fed.federation_path,
                retry=RetryConfig(attempts=1),
            )
            fed.pause_node("ap")
            fed.pause_node("us")
            acked: list[str] = []
            with pytest.raises(geofed.StorageFailed, match="full"):
                for i in range(1000):
                    acked.append(await pub.publish("d/x", b"p" * 4096, event_id=f"f{i}"))
            assert 0 < len(acked) < 1000
            assert geofed.client.health_status(fed.nodes["eu"].client, timeout=HANG_S) == "SERVING"
            fed.resume_node("ap")
            fed.resume_node("us")
            got = await collect(sub, len(acked))
            assert [m.event_id for m in got] == acked
            eu = fed.nodes["eu"].metrics_url
            await until(
                lambda: metric(eu, "geofed_peer_queue_length", peer="ap") == 0, "drained", HANG_S
            )
            await until(
                lambda: metric(eu, "geofed_peer_queue_length", peer="us") == 0, "drained", HANG_S
            )
            # The refused event's id was taken out of the duplicate window: its retry goes
            # through rather than being dropped as a duplicate.
            refused = f"f{len(acked)}"
            assert await pub.publish("d/x", b"retry", event_id=refused) == refused
            assert (await sub.next(timeout=HANG_S)).event_id == refused
            assert await pub.publish("d/x", b"again", event_id="again") == "again"
            assert (await sub.next(timeout=HANG_S)).event_id == "again"
            await pub.close()
            await sub_client.close()

        asyncio.run(run())


def test_a_restarted_broker_drops_retries_within_its_window_and_its_store_keeps_no_more(
    tmp_path: Path,
) -> None:
    """dedup_window 8: eu publishes 20 events, one by one, and is killed once its peers
    acknowledged them (its outbox is empty on disk: else the restarted eu resends the
    older ones, which ap's window of 8 has forgotten, and ap takes them again, w11 among
    them); restarted, it still drops a retry of the oldest id of the last 8 and takes
    the id before it as new. The store's copies of the windows (eu's own, ap's for what
    came from eu) hold at most 1.25 windows (trimmed every quarter window)."""
    env = ENV | {"GEOFED_DEDUP_WINDOW": "8"}
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True, extra_env=env) as fed:

        def rows(broker: str, query: str, *args: str) -> int:
            db = sqlite3.connect(fed.data_dir(broker) / "geofed.db")
            try:
                return int(db.execute(query, args).fetchone()[0])
            finally:
                db.close()

        def seen_rows(broker: str, peer: str) -> int:
            return rows(broker, "SELECT COUNT(*) FROM seen WHERE peer = ?", peer)

        async def run() -> None:
            sub_client = await client(fed, "win-sub", SINGAPORE)
            sub = await sub_client.subscribe("d/#")
            await fed.quiescent(HANG_S)  # the subscription is forwarded
            pub = await client(fed, "win-pub", PARIS)
            for i in range(20):
                await pub.publish("d/x", b"w", event_id=f"w{i}")
            assert [m.event_id for m in await collect(sub, 20)] == [f"w{i}" for i in range(20)]
            await pub.close()
            assert 8 <= seen_rows("eu", "") <= 10
            assert 8 <= seen_rows("ap", "eu") <= 10
            # The acknowledgements reach eu's store within a second (its periodic commit).
            outbox = "SELECT COUNT(*) FROM outbox"
            await until(lambda: rows("eu", outbox) == 0, "eu's outbox empty", HANG_S)
            fed.stop_node("eu", signal.SIGKILL)
            fed.start_node("eu")
            fed.wait_ready(HANG_S)
            eu = fed.nodes["eu"].metrics_url
            # A new subscriber (the first one's client drops ids it has had already).
            late_client = await client(fed, "win-late", SINGAPORE)
            late = await late_client.subscribe("d/#")
            await fed.quiescent(HANG_S)
            pub = await client(fed, "win-pub-2", PARIS)
            assert await pub.publish("d/x", b"retry", event_id="w12") == "w12"
            assert await pub.publish("d/x", b"new", event_id="w11") == "w11"
            assert (await late.next(timeout=HANG_S)).event_id == "w11"  # w12 went nowhere
            assert (metric(eu, PUBLISH_DUPLICATES), metric(eu, EVENTS_PUBLISHED)) == (1, 1)
            await pub.close()
            await late_client.close()
            await sub_client.close()

        asyncio.run(run())


@pytest.mark.parametrize("durable", ["flooding-subscriptions"], indirect=True)
def test_two_clients_may_use_the_same_subscription_id(durable: LocalFederation) -> None:
    """Subscription ids are scoped by client: the same id at two brokers is two
    subscriptions at every peer, each matched, delivered and withdrawn on its own."""
    fed = durable
    new_york = geofed.LatLon(40.71, -74.0)  # us

    async def run() -> None:
        a = await client(fed, "same-a", PARIS)
        b = await client(fed, "same-b", SINGAPORE)
        sub_a = await a.subscribe("x/a", subscription_id="same")
        sub_b = await b.subscribe("x/b", subscription_id="same")
        await fed.quiescent(HANG_S)  # forwarded subscriptions are in place
        pub = await client(fed, "same-pub", new_york)
        await pub.publish("x/a", b"1", event_id="a1")
        await pub.publish("x/b", b"1", event_id="b1")
        assert (await sub_a.next(timeout=HANG_S)).event_id == "a1"
        assert (await sub_b.next(timeout=HANG_S)).event_id == "b1"
        await sub_b.unsubscribe()
        await pub.publish("x/b", b"2", event_id="b2")  # nobody's now
        await pub.publish("x/a", b"2", event_id="a2")
        assert (await sub_a.next(timeout=HANG_S)).event_id == "a2"
        us = fed.nodes["us"].metrics_url
        await until(lambda: metric(us, "geofed_subscriptions", scope="remote") == 1, "1", HANG_S)
        for c in (a, b, pub):
            await c.close()

    asyncio.run(run())


async def hold(mover: geofed.Client, cid: str) -> None:
    """`mover` asks eu to hold its move to us (make before break, §7)."""
    answer = await mover._call(
        "move",
        lambda stub, timeout: stub.UpdateLocation(
            update_location_request(cid, NEW_YORK, hold=True), timeout=timeout
        ),
    )
    assert answer.held_s > 0  # held: eu still matches for the client


async def leave(fed: LocalFederation, cid: str) -> bool:
    """The client's `Leave` at eu (raw: the client library leaves only as part of a move
    it makes itself)."""
    answer = await raw_call(fed, "eu", "Leave", leave_request(cid), timeout=HANG_S)
    return bool(answer.held)


async def held_with_a_queue(
    fed: LocalFederation, cid: str, sub_id: str
) -> tuple[geofed.Client, list[str]]:
    """A persistent subscriber of `cid` with three deliveries queued at eu asks eu to hold
    its move to us and closes (nothing taken: its subscription and queue stay at eu).
    Returns the publisher, still connected, and the ids it published."""
    mover = await client(fed, cid, PARIS, session_expiry_s=300.0)
    await mover.subscribe("d/#", subscription_id=sub_id)
    pub = await client(fed, f"{cid}-pub", PARIS)
    sent = [await pub.publish("d/x", f"{cid}{i}".encode()) for i in range(3)]
    await hold(mover, cid)
    await mover.close()
    return pub, sent


def restart_eu(fed: LocalFederation) -> str:
    """Kill eu and start it again; its metrics URL once the federation is ready."""
    fed.stop_node("eu", signal.SIGKILL)
    fed.start_node("eu")
    fed.wait_ready(HANG_S)
    return fed.nodes["eu"].metrics_url


def test_a_broker_killed_while_it_holds_a_handover_holds_it_again_when_restarted(
    durable: LocalFederation,
) -> None:
    """eu holds the handover of a persistent session and is killed before the client
    leaves: the store has the session at its new place, so the restarted eu holds it
    again (matching for the client at its last place there) until the client's Leave,
    which withdraws its subscription and closes the session."""
    fed = durable

    async def run() -> None:
        mover = await client(fed, "hold-kill", PARIS, session_expiry_s=300.0)
        await mover.subscribe("d/#", subscription_id="hold-s")
        assert metric(fed.nodes["eu"].metrics_url, SUBSCRIPTIONS, scope="local") == 1
        await hold(mover, "hold-kill")
        await mover.close()  # it does not come back to eu
        assert metric(fed.nodes["eu"].metrics_url, SESSIONS) == 1
        eu = restart_eu(fed)
        assert metric(eu, SESSIONS) == 1
        assert metric(eu, SUBSCRIPTIONS, scope="local") == 1
        assert await leave(fed, "hold-kill")  # a hold was there to end
        assert metric(eu, SESSIONS) == 0
        assert metric(eu, SUBSCRIPTIONS, scope="local") == 0
        assert metric(eu, HANDOVERS, outcome="left") == 1

    asyncio.run(run())


def test_a_restarted_broker_hands_a_held_sessions_queue_to_the_new_broker(
    durable: LocalFederation,
) -> None:
    """eu holds the handover of a persistent session with deliveries queued, the client
    renewed its subscription at us, and eu is killed before the client leaves: the
    client's Leave at the restarted eu ends the move and hands the queue to us, which
    delivers it."""
    fed = durable

    async def run() -> None:
        pub, sent = await held_with_a_queue(fed, "hand-kill", "hk")
        renewed = await client(fed, "hand-kill", NEW_YORK, session_expiry_s=300.0)
        sub = await renewed.subscribe("d/#", subscription_id="hk")
        eu = restart_eu(fed)
        assert await leave(fed, "hand-kill")
        assert metric(eu, HANDOFF_DELIVERIES, outcome="sent") == 3
        got = await collect(sub, 3)
        assert sorted(m.event_id for m in got) == sorted(sent)
        assert {m.broker for m in got} == {"us"}
        for c in (renewed, pub):
            await c.close()

    asyncio.run(run())


def test_a_held_session_goes_ahead_of_its_client_when_its_hold_runs_out_after_a_restart(
    durable: LocalFederation,
) -> None:
    """eu holds the handover of a persistent session with deliveries queued; the client
    never reaches us and eu is killed. The restarted eu holds the session again, and
    when that hold runs out it sends us the session before the queue, so the client
    connecting to us later finds both. (A restart that ended the move at once sent the
    queue alone, which us dropped: no subscription to queue it for.)"""
    fed = durable

    async def run() -> None:
        pub, sent = await held_with_a_queue(fed, "stray", "st")
        eu = restart_eu(fed)
        await until(
            lambda: metric(eu, HANDOVERS, outcome="expired") == 1, "eu's hold ran out", HANG_S
        )
        assert metric(eu, HANDOFF_DELIVERIES, outcome="sent") == 3
        await fed.quiescent(HANG_S)  # the session and the handoff have reached us
        later = await client(fed, "stray", NEW_YORK, session_expiry_s=300.0)
        sub = await later.subscribe("d/#", subscription_id="st")
        got = await collect(sub, 3)
        assert sorted(m.event_id for m in got) == sorted(sent)
        assert {m.broker for m in got} == {"us"}
        for c in (later, pub):
            await c.close()

    asyncio.run(run())
