"""Broker behaviour through the client library: redirects, moves, bad input, peers down, mismatches.

Every request goes through `geofed.client`, except the two a well-behaved
client cannot send (an event without a location, an empty client id), which
go as raw gRPC built with `geofed.wire`. Waiting is on state: `subscribe`
returns once the broker holds the subscription, `Subscription.next` returns
as soon as a delivery arrives, metrics are polled until they reach a value,
and `all_arrived` proves that nothing more arrives: once the federation is
quiescent, the deliveries the brokers made are all the clients got.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

import geofed
from geofed.bench import LocalFederation, faults, peer_message_counts
from geofed.bench import metric as node_metric
from geofed.client import Publication, health_status
from geofed.errors import from_rpc_error
from geofed.node import (
    DELIVERIES,
    EVENTS_PUBLISHED,
    PEER_CONNECTED,
    PEER_MESSAGES_RECEIVED,
    PEER_MESSAGES_SENT,
    PEER_QUEUE_DROPPED,
    PEER_QUEUE_LENGTH,
    REDIRECTS,
    REQUESTS_REJECTED,
    SESSIONS,
    SUBSCRIPTIONS,
)
from geofed.routing import Kind
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.wire import FEDERATION_SERVICE, connect_request, publish_request

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
FRANKFURT = geofed.LatLon(50.11, 8.68)
VIRGINIA = geofed.LatLon(39.04, -77.49)
SINGAPORE = geofed.LatLon(1.29, 103.85)
WAIT_S = 30.0  # safety net of every wait on state; none is expected to come near it


def metric(fed: LocalFederation, broker: str, name: str, **labels: str) -> float:
    return node_metric(fed.nodes[broker].metrics_url, name, **labels)


async def connect(fed: LocalFederation, client_id: str, where: geofed.LatLon) -> geofed.Client:
    """A session at the broker responsible for `where` (found in the federation file)."""
    return await geofed.connect(client_id=client_id, location=where, federation=fed.federation_path)


# Conditions may scrape metrics, so they run in a thread.
until = functools.partial(faults.until, timeout=WAIT_S, scrapes=True)


async def next_ids(sub: geofed.Subscription, n: int, timeout: float = WAIT_S) -> list[str]:
    """The event ids of the next `n` deliveries of `sub`, as they arrive."""
    return [(await sub.next(timeout=timeout)).event_id for _ in range(n)]


async def all_arrived(fed: LocalFederation, subs: list[geofed.Subscription]) -> int:
    """Once no inter-broker message is in flight, every delivery the brokers made has
    reached `subs` (all the subscriptions of the test), and no more than that: no
    event reached a subscription twice. Returns the number of deliveries.

    The barrier holds across a broker's restart (`LocalFederation.quiescent` sets its
    previous process's traffic aside).
    """
    await fed.quiescent(WAIT_S)
    made = await asyncio.to_thread(
        lambda: sum(node_metric(n.metrics_url, DELIVERIES) for n in fed.nodes.values())
    )
    await until(lambda: sum(s.received for s in subs) >= made, f"{made:g} deliveries arrive")
    assert sum(s.received for s in subs) == made
    assert [s.duplicates for s in subs] == [0] * len(subs)
    return int(made)


async def raw_call(
    fed: LocalFederation, broker: str, method: str, request: Any, timeout: float = 10
) -> Any:
    """Raw gRPC, only for a request the client library cannot send (it validates
    its input first); a rejection is raised typed, as the library would raise it."""
    async with grpc.aio.insecure_channel(fed.nodes[broker].client) as channel:
        try:
            stub = cpb_grpc.ClientServiceStub(channel)
            return await getattr(stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None


def test_connect_outside_area_is_redirected(three_federation: LocalFederation) -> None:
    fed = three_federation

    async def run() -> None:
        # Asked at eu, a client in Singapore is redirected to ap; the client knows
        # no federation file, so ap's endpoint came with the redirect.
        async with await geofed.connect(
            client_id="c1", location=SINGAPORE, endpoint=fed.nodes["eu"].client
        ) as far:
            assert (far.broker_id, far.endpoint, far.redirects) == ("ap", fed.nodes["ap"].client, 1)
        async with await geofed.connect(
            client_id="c2", location=SINGAPORE, endpoint=fed.nodes["ap"].client
        ) as near:
            assert (near.broker_id, near.redirects) == ("ap", 0)

    asyncio.run(run())
    assert metric(fed, "eu", REDIRECTS) == 1 and metric(fed, "ap", REDIRECTS) == 0
    # The redirected connect opened no session at eu; both are at ap.
    assert metric(fed, "eu", SESSIONS) == 0 and metric(fed, "ap", SESSIONS) == 2


def test_moving_subscriber_is_rehomed_and_keeps_receiving(
    three_federation: LocalFederation,
) -> None:
    fed = three_federation

    async def run() -> None:
        async with (
            await connect(fed, "walker", FRANKFURT) as walker,
            await connect(fed, "pub-us", VIRGINIA) as pub_us,
            await connect(fed, "pub-ap", SINGAPORE) as pub_ap,
        ):
            sub = await walker.subscribe("t/#", subscription_id="s-walk")
            await pub_us.publish("t/x", event_id="e-before")
            first = await sub.next(timeout=WAIT_S)
            assert (first.event_id, first.origin, first.broker) == ("e-before", "us", "eu")
            # The update leaves eu's area: eu ends the session and the stream and
            # redirects to us; the client follows and renews the subscription there.
            assert await walker.move(VIRGINIA)
            assert (walker.broker_id, walker.endpoint) == ("us", fed.nodes["us"].client)
            assert walker.redirects == 1 and metric(fed, "eu", REDIRECTS) == 1
            assert metric(fed, "us", SUBSCRIPTIONS, scope="local") == 1
            assert metric(fed, "eu", SUBSCRIPTIONS, scope="local") == 0
            assert metric(fed, "eu", SESSIONS) == 0 and metric(fed, "us", SESSIONS) == 2
            await pub_ap.publish("t/x", event_id="e-after")
            second = await sub.next(timeout=WAIT_S)  # the same Subscription, now through us
            assert (second.event_id, second.origin, second.broker) == ("e-after", "ap", "us")
            assert await all_arrived(fed, [sub]) == 2

    asyncio.run(run())


async def _publish_without_location(client: geofed.Client, fed: LocalFederation) -> Any:
    # Raw gRPC: the library always sends the client's location.
    request = publish_request(client.client_id, Publication("t/x", b"", FRANKFURT, None, "b2"))
    request.event.ClearField("publisher")
    return await raw_call(fed, "eu", "Publish", request)


BAD_INPUT: list[Any] = [
    pytest.param(
        lambda c, fed: c.publish("t/+", event_id="b1"),
        geofed.InvalidInput,
        "request.event.topic",
        id="wildcard-topic",
    ),
    pytest.param(
        _publish_without_location,
        geofed.InvalidInput,
        "request.event.publisher",
        id="no-location",
    ),
    pytest.param(
        # The client checks its own location; an event's location in a batch goes as given.
        lambda c, fed: c.publish_many([Publication("t/x", b"", geofed.LatLon(91, 0), None, "b3")]),
        geofed.InvalidInput,
        "batch.events[0].publisher.lat",
        id="latitude-91",
    ),
    pytest.param(
        lambda c, fed: c.publish(
            "t/x", geofence="POLYGON((0 0, 1 1, 1 0, 0 1, 0 0))", event_id="b4"
        ),
        geofed.InvalidInput,
        "request.event.geofence.wkt",
        id="self-intersecting-geofence",
    ),
    pytest.param(
        lambda c, fed: c.publish("t/x", geofence="POLYGON((0 0, nan 1", event_id="b5"),
        geofed.InvalidInput,
        "request.event.geofence.wkt",
        id="broken-wkt",
    ),
    pytest.param(
        lambda c, fed: c.publish("t/x", b"x" * 1_100_000, event_id="b6"),
        geofed.TooLarge,
        "request.event.payload",
        id="payload-too-large",
    ),
    pytest.param(
        lambda c, fed: c.publish_many([Publication("t/x", b"", SINGAPORE, None, "b7")]),
        geofed.WrongBroker,
        "batch.events[0].publisher",
        id="publisher-of-another-broker",
    ),
]


@pytest.mark.parametrize(("call", "kind", "field"), BAD_INPUT)
def test_bad_input_is_rejected_naming_the_field_and_the_node_keeps_serving(
    three_federation: LocalFederation,
    call: Callable[[geofed.Client, LocalFederation], Awaitable[Any]],
    kind: type[geofed.GeofedError],
    field: str,
) -> None:
    fed = three_federation

    async def run() -> None:
        async with (
            await connect(fed, "w", FRANKFURT) as watcher_client,
            await connect(fed, "pub", FRANKFURT) as pub,
        ):
            watcher = await watcher_client.subscribe("t/#", subscription_id="s-w")
            with pytest.raises(kind) as err:
                await call(pub, fed)
            assert err.value.field == field  # type: ignore[attr-defined]
            if isinstance(err.value, geofed.TooLarge):
                assert (err.value.size, err.value.limit) == (1_100_000, 1_048_576)
            if isinstance(err.value, geofed.WrongBroker):
                assert (err.value.broker_id, err.value.endpoint) == ("ap", fed.nodes["ap"].client)
            # Nothing was half-applied, and the node still serves the same client.
            assert await pub.publish("t/x", event_id="ok-1") == "ok-1"
            assert await next_ids(watcher, 1) == ["ok-1"]
            assert await all_arrived(fed, [watcher]) == 1

    asyncio.run(run())
    assert metric(fed, "eu", EVENTS_PUBLISHED) == 1
    assert metric(fed, "eu", REQUESTS_REJECTED) == 1


def test_publish_stream_applies_a_batch_whole_or_not_at_all(
    three_federation: LocalFederation,
) -> None:
    fed = three_federation

    def events(*ids: str) -> list[Publication]:
        where = {"bad": SINGAPORE}
        return [Publication("t/x", b"", where.get(i, FRANKFURT), None, i) for i in ids]

    async def run() -> None:
        async with (
            await connect(fed, "w", FRANKFURT) as watcher_client,
            await connect(fed, "pub", FRANKFURT) as pub,
        ):
            watcher = await watcher_client.subscribe("t/#", subscription_id="s-w")
            # Batches of 3: [b1 b2 b3] [b4 bad b5]; the bad event is named.
            with pytest.raises(geofed.WrongBroker) as err:
                await pub.publish_many(events("b1", "b2", "b3", "b4", "bad", "b5"), batch_size=3)
            assert (err.value.field, err.value.broker_id) == ("batch.events[4].publisher", "ap")
            # The earlier batch was published; no event of the rejected one was,
            # neither before the bad event nor after it.
            assert await next_ids(watcher, 3) == ["b1", "b2", "b3"]
            assert metric(fed, "eu", EVENTS_PUBLISHED) == 3
            assert await pub.publish_many(events("b6")) == ["b6"]
            assert await next_ids(watcher, 1) == ["b6"]
            assert await all_arrived(fed, [watcher]) == 4  # b4 and b5 never come

    asyncio.run(run())
    assert metric(fed, "eu", EVENTS_PUBLISHED) == 4


def test_bad_subscription_is_rejected(three_federation: LocalFederation) -> None:
    fed = three_federation

    async def run() -> None:
        async with await connect(fed, "c", FRANKFURT) as client:
            with pytest.raises(geofed.InvalidInput) as err:
                await client.subscribe("a/#/b", subscription_id="s1")
            assert err.value.field == "subscription.topic_filter"
            assert client.subscriptions == []
            # Raw gRPC: the library refuses an empty client id before sending anything.
            with pytest.raises(geofed.InvalidInput) as err:
                await raw_call(fed, "eu", "Connect", connect_request("", FRANKFURT))
            assert err.value.field == "client"
            # The broker holds nothing of the rejected subscription, and still serves.
            assert metric(fed, "eu", SUBSCRIPTIONS, scope="local") == 0
            sub = await client.subscribe("a/#", subscription_id="s1")
            await client.publish("a/b", event_id="fine")
            assert await next_ids(sub, 1) == ["fine"]

    asyncio.run(run())
    assert metric(fed, "eu", REQUESTS_REJECTED) == 2


def test_peer_down_local_traffic_continues_queue_bounded_link_recovers(
    three_federation: LocalFederation,
) -> None:
    fed = three_federation

    async def run() -> None:
        async with (
            await connect(fed, "l", FRANKFURT) as local_client,
            await connect(fed, "pub", FRANKFURT) as pub,
        ):
            local = await local_client.subscribe("t/#", subscription_id="s-local")
            await asyncio.to_thread(fed.stop_node, "us", signal.SIGKILL)
            await until(
                lambda: metric(fed, "eu", PEER_CONNECTED, peer="us") == 0, "eu sees us down"
            )
            assert health_status(fed.nodes["eu"].peer, FEDERATION_SERVICE) == "NOT_SERVING"
            down = [f"down-{i}" for i in range(20)]
            for event_id in down:  # event-geofence, world events: each is also for us
                await pub.publish("t/x", event_id=event_id)
            assert await next_ids(local, 20) == down
            # GEOFED_PEER_QUEUE_SIZE=5: the rest was dropped and counted.
            assert metric(fed, "eu", PEER_QUEUE_DROPPED, peer="us") == 15
            assert metric(fed, "eu", PEER_QUEUE_LENGTH, peer="us") == 5
            await asyncio.to_thread(fed.start_node, "us")
            await asyncio.to_thread(fed.wait_ready, 30)
            # What eu kept for us goes out once the link is back, before anyone
            # subscribes there: it matches nobody at the restarted us.
            await until(
                lambda: metric(fed, "eu", PEER_MESSAGES_SENT, peer="us", kind=Kind.EVENT) == 5,
                "the 5 queued events are sent to us",
            )
            await fed.quiescent(WAIT_S)
            assert metric(fed, "us", PEER_MESSAGES_RECEIVED, peer="eu", kind=Kind.EVENT) == 5
            assert metric(fed, "eu", PEER_QUEUE_LENGTH, peer="us") == 0
            async with await connect(fed, "r", VIRGINIA) as remote_client:
                remote = await remote_client.subscribe("t/#", subscription_id="s-remote")
                await pub.publish("t/x", event_id="after")
                assert await next_ids(remote, 1) == ["after"]
                assert await next_ids(local, 1) == ["after"]
                assert await all_arrived(fed, [local, remote]) == 22

    asyncio.run(run())


def test_silent_peer_is_detected_by_heartbeat_and_nothing_is_lost(tmp_path: Path) -> None:
    # A stopped process keeps its TCP connections open: only the heartbeat
    # timeout tells the link it is gone. Events published meanwhile wait in
    # the peer queue and arrive once, after the peer continues.
    heartbeat_s, timeout_s = 0.2, 1.5
    env = {"GEOFED_PEER_HEARTBEAT_S": str(heartbeat_s), "GEOFED_PEER_TIMEOUT_S": str(timeout_s)}
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env) as fed:
        eu_log = fed.nodes["eu"].log_path

        def eu_link_to_us_up() -> bool:
            return metric(fed, "eu", PEER_CONNECTED, peer="us") == 1

        async def run() -> None:
            async with (
                await connect(fed, "r", VIRGINIA) as remote_client,
                await connect(fed, "pub", FRANKFURT) as pub,
            ):
                remote = await remote_client.subscribe("t/#", subscription_id="s-silent")
                await pub.publish("t/x", event_id="before")
                assert await next_ids(remote, 1) == ["before"]
                us = fed.nodes["us"].process
                os.kill(us.pid, signal.SIGSTOP)
                try:
                    await until(lambda: not eu_link_to_us_up(), "eu times us out", timeout=10)
                    assert "nothing received for" in eu_log.read_text()
                    while_ids = [f"while-{i}" for i in range(5)]
                    for event_id in while_ids:
                        await pub.publish("t/x", event_id=event_id)
                    assert metric(fed, "eu", PEER_QUEUE_LENGTH, peer="us") == 5
                finally:
                    os.kill(us.pid, signal.SIGCONT)
                await until(eu_link_to_us_up, "the link comes back")
                assert sorted(await next_ids(remote, 5)) == while_ids
                await pub.publish("t/x", event_id="after")
                assert await next_ids(remote, 1) == ["after"]
                # While connected and idle, heartbeats keep the link up: wait until
                # eu has heard twice the timeout's worth of them from us, and the
                # link has not dropped (nor come up again) meanwhile.
                log_before = eu_log.read_text()
                heard = metric(fed, "eu", PEER_MESSAGES_RECEIVED, peer="us", kind=Kind.CONTROL)
                beats = 2 * timeout_s / heartbeat_s
                await until(
                    lambda: (
                        metric(fed, "eu", PEER_MESSAGES_RECEIVED, peer="us", kind=Kind.CONTROL)
                        >= heard + beats
                    ),
                    f"{beats:g} heartbeats from us",
                )
                assert eu_link_to_us_up()
                log_after = eu_log.read_text()
                for line in ("nothing received for", "link us up", "link us closed"):
                    assert log_after.count(line) == log_before.count(line), line
                # Nothing was lost and nothing came twice (resent frames are dropped as duplicates).
                assert await all_arrived(fed, [remote]) == 7

        asyncio.run(run())


def test_strategy_and_federation_mismatch_are_refused(
    three_federation: LocalFederation, tmp_path: Path
) -> None:
    fed = three_federation
    log = fed.nodes["ap"].log_path

    async def refused(reason: str) -> None:
        await until(lambda: reason in log.read_text(), f"ap logs {reason}")
        # No link to ap comes up: ap and its peers each report theirs down.
        await until(
            lambda: all(
                metric(fed, a, PEER_CONNECTED, peer=b) == 0
                for a, b in (("ap", "eu"), ("ap", "us"), ("eu", "ap"), ("us", "ap"))
            ),
            "every link of ap down",
        )
        assert health_status(fed.nodes["eu"].peer, FEDERATION_SERVICE) == "NOT_SERVING"
        # ap still serves its own clients.
        assert health_status(fed.nodes["ap"].client) == "SERVING"
        async with await connect(fed, f"ap-{len(reason)}", SINGAPORE) as client:
            sub = await client.subscribe("t/#")
            event_id = await client.publish("t/x")
            assert await next_ids(sub, 1) == [event_id]

    fed.stop_node("ap")
    fed.start_node("ap", env={"GEOFED_STRATEGY": "flooding-events"})
    asyncio.run(refused("strategy mismatch"))
    fed.stop_node("ap")
    other = json.loads(fed.federation_path.read_text())
    other["features"][0]["geometry"]["coordinates"][0][0][1] += 0.0  # same shape ...
    other["features"].reverse()  # ... feature order does not matter ...
    for feat in other["features"]:
        if feat["properties"]["id"] == "us":  # ... but a different area does
            feat["properties"]["name"] = "changed"
            geom = feat["geometry"]
            ring = (
                geom["coordinates"][0] if geom["type"] == "Polygon" else geom["coordinates"][0][0]
            )
            ring[1] = [ring[1][0], ring[1][1] - 0.5]
    changed = tmp_path / "changed.geojson"
    changed.write_text(json.dumps(other))
    fed.start_node("ap", env={"GEOFED_FEDERATION": str(changed)})
    asyncio.run(refused("federation mismatch"))
    fed.stop_node("ap")
    fed.start_node("ap")
    fed.wait_ready(30)
    assert metric(fed, "eu", PEER_CONNECTED, peer="ap") == 1


def test_a_federation_that_fails_to_start_stops_the_nodes_it_started(tmp_path: Path) -> None:
    """`with LocalFederation(...)` runs no __exit__ when start fails: start itself stops
    every node it started (none outlives the failed test)."""
    fed = LocalFederation(THREE, "event-geofence", tmp_path)
    with pytest.raises(geofed.GeofedError, match="not ready after 0s"):
        fed.start(timeout=0)  # the first health check comes before any node can be ready
    assert len(fed.nodes) == 3
    assert all(node.process.poll() is not None for node in fed.nodes.values())


def test_message_trace_records_every_message_sent(tmp_path: Path) -> None:
    fed = LocalFederation(THREE, "flooding-subscriptions", tmp_path, trace=True)
    with fed:

        async def run() -> None:
            async with await connect(fed, "pub", FRANKFURT) as pub:
                async with await connect(fed, "w", VIRGINIA) as watcher_client:
                    watcher = await watcher_client.subscribe("t/#", subscription_id="s-trace")
                    await until(
                        lambda: metric(fed, "eu", SUBSCRIPTIONS, scope="remote") == 1,
                        "eu holds the subscription",
                    )
                    ids = [await pub.publish("t/x", event_id=f"tr-{i}") for i in range(5)]
                    assert await next_ids(watcher, 5) == ids
                    assert await all_arrived(fed, [watcher]) == 5
                # The stream ended: us withdraws the subscription everywhere.
                for b in fed.nodes:
                    await until(lambda b=b: metric(fed, b, SUBSCRIPTIONS) == 0, f"{b} holds none")
            await fed.quiescent(WAIT_S)

        asyncio.run(run())
        sent = {
            k: v
            for k, v in peer_message_counts(fed.metrics_urls())["sent"].items()
            if v and k[0] != "control"
        }
        for b in fed.nodes:
            fed.stop_node(b)  # graceful: exits 0 and flushes its trace
            assert fed.nodes[b].process.returncode == 0
            assert "stopped" in fed.nodes[b].log_path.read_text()
        traced: Counter[tuple[str, str, str]] = Counter()
        for b in fed.nodes:
            for line in (tmp_path / f"trace-{b}.jsonl").read_text().splitlines():
                rec = json.loads(line)
                assert rec["strategy"] == "flooding-subscriptions" and rec["src"] == b
                traced[(rec["kind"], rec["src"], rec["dst"])] += 1
        # Messages sent after the scrape (shutdown) are control frames only.
        assert {k: v for k, v in traced.items() if k[0] != "control"} == sent
        assert traced[("subscribe", "us", "eu")] == 1
        assert traced[("delivery", "eu", "us")] == 5
        assert traced[("unsubscribe", "us", "eu")] == 1


def test_restarted_peer_gets_the_subscriptions_again(tmp_path: Path) -> None:
    # subscription-geofence: subscriptions travel; a restarted broker has lost
    # what it held and must get it back from the snapshot sent on reconnect.
    with LocalFederation(THREE, "subscription-geofence", tmp_path) as fed:

        async def run() -> None:
            async with (
                await connect(fed, "w", FRANKFURT) as first,
                await connect(fed, "w2", FRANKFURT) as second,
            ):
                watcher = await first.subscribe("t/#", subscription_id="s-resync")
                await until(
                    lambda: metric(fed, "us", SUBSCRIPTIONS, scope="remote") == 1,
                    "us holds the subscription",
                )
                await asyncio.to_thread(fed.stop_node, "us", signal.SIGKILL)
                late = await second.subscribe("t/#", subscription_id="s-late")  # while us is down
                await asyncio.to_thread(fed.start_node, "us")
                await asyncio.to_thread(fed.wait_ready, 30)
                await until(
                    lambda: metric(fed, "us", SUBSCRIPTIONS, scope="remote") == 2,
                    "the restarted us holds both subscriptions",
                )
                async with await connect(fed, "pub-us", VIRGINIA) as pub:
                    await pub.publish("t/x", event_id="from-us")
                assert await next_ids(watcher, 1) == ["from-us"]
                assert await next_ids(late, 1) == ["from-us"]
                # The barrier across the restart: the subscribes sent to us before it was
                # killed are set aside, those of the snapshot are counted.
                assert await all_arrived(fed, [watcher, late]) == 2

        asyncio.run(run())
