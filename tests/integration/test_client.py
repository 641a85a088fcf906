"""The Python client library (`geofed.client`) against real broker processes.

One 3-broker federation (eu, us, ap; event-geofence) serves the module;
every test uses its own client ids. Waiting is on state: a subscription is
held once `subscribe` returns, the quiescence barrier says no inter-broker
message is in flight, and `Subscription.next` returns as soon as a delivery
arrives.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

import geofed
from geofed import wire as gw
from geofed.bench import LocalFederation, metric
from geofed.client import Publication, RetryConfig
from geofed.node import DELIVERIES, SUBSCRIPTIONS, BrokerServer, NodeConfig

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = geofed.LatLon(48.85, 2.35)
FRANKFURT = geofed.LatLon(50.11, 8.68)
NEW_YORK = geofed.LatLon(40.71, -74.0)
SINGAPORE = geofed.LatLon(1.29, 103.85)
MAX_PAYLOAD = 4096


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    workdir = tmp_path_factory.mktemp("client-fed")
    env = {"GEOFED_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD), "GEOFED_MAX_PUBLISH_BATCH": "50"}
    with LocalFederation(THREE, "event-geofence", workdir, extra_env=env) as running:
        yield running


async def quiet(fed: LocalFederation) -> None:
    await fed.quiescent()


def test_connect_finds_the_local_broker_from_the_federation_or_by_redirect(
    fed: LocalFederation,
) -> None:
    async def run() -> None:
        direct = await geofed.connect(
            client_id="find-1", location=SINGAPORE, federation=fed.federation_path
        )
        async with direct:
            assert (direct.broker_id, direct.redirects) == ("ap", 0)
            assert direct.endpoint == fed.nodes["ap"].client
        # Any broker will do: eu answers with a redirect to ap, which the client follows.
        asked = await geofed.connect(
            client_id="find-2", location=SINGAPORE, endpoint=fed.nodes["eu"].client
        )
        async with asked:
            assert (asked.broker_id, asked.redirects) == ("ap", 1)
            assert asked.endpoint == fed.nodes["ap"].client

    asyncio.run(run())


def test_async_for_yields_deliveries_across_regions_and_close_ends_it(
    fed: LocalFederation,
) -> None:
    async def run() -> None:
        sub_client = await geofed.connect(
            client_id="iter-sub", location=SINGAPORE, federation=fed.federation_path
        )
        pub_client = await geofed.connect(
            client_id="iter-pub", location=FRANKFURT, federation=fed.federation_path
        )
        sub = await sub_client.subscribe("iter/#", subscription_id="iter-s")
        got: list[geofed.Message] = []

        async def read() -> None:
            async for msg in sub:
                got.append(msg)

        reader = asyncio.create_task(read())
        ids = [await pub_client.publish(f"iter/{i}", f"v{i}") for i in range(3)]
        await quiet(fed)
        while len(got) < 3 and not reader.done():
            await asyncio.sleep(0.01)  # the last deliveries may still be on the stream
        await sub_client.close()
        await asyncio.wait_for(reader, 30)  # close ends the iteration, without an error
        await pub_client.close()
        assert [m.event_id for m in got] == ids
        first = got[0]
        assert (first.topic, first.payload, first.subscription_id) == ("iter/0", b"v0", "iter-s")
        assert (first.origin, first.broker) == ("eu", "ap")
        assert first.publisher == FRANKFURT and first.geofence is None
        assert first.deliver_time >= first.publish_time > 0
        with pytest.raises(geofed.ClientClosed):
            await sub_client.publish("iter/x")

    asyncio.run(run())


def test_unsubscribe_ends_iteration_after_what_was_delivered(fed: LocalFederation) -> None:
    async def run() -> None:
        async with await geofed.connect(
            client_id="unsub", location=PARIS, federation=fed.federation_path
        ) as client:
            sub = await client.subscribe("unsub/+")
            event_id = await client.publish("unsub/a", b"x")
            await sub.unsubscribe()
            assert [m.event_id async for m in sub] == [event_id]
            assert client.subscriptions == []
            await client.publish("unsub/a", b"y")  # nobody listens any more
            # Unsubscribing again (a retry whose first answer was lost) is no error.
            again = await client._call(
                "unsubscribe",
                lambda stub, timeout: stub.Unsubscribe(
                    gw.unsubscribe_request("unsub", sub.id), timeout=timeout
                ),
            )
            assert again.existed is False

    asyncio.run(run())


def test_move_across_a_boundary_renews_subscriptions_while_events_flow(
    fed: LocalFederation,
) -> None:
    """Nothing is missed and nothing delivered twice (make before break).

    The publisher sits at the subscriber's old broker (eu), which matches for
    the client until the client leaves it, once the renewal stands at us; an
    event published after that is forwarded to us (event-geofence, world
    geofence), where the renewed subscription is held by then.
    """

    async def run() -> None:
        mover = await geofed.connect(
            client_id="mover", location=PARIS, federation=fed.federation_path
        )
        pub = await geofed.connect(
            client_id="mover-pub", location=FRANKFURT, federation=fed.federation_path
        )
        before = deliveries(fed)
        sub = await mover.subscribe("flow/#", subscription_id="flow")
        published: list[str] = []
        stop = asyncio.Event()

        async def publish(n: int) -> None:
            for _ in range(n):
                if stop.is_set():
                    return
                published.append(await pub.publish(f"flow/{len(published)}", b"x"))

        await publish(20)
        flowing = asyncio.create_task(publish(100_000))
        while len(published) < 30:
            await asyncio.sleep(0)  # events flow while the client moves
        moved = await mover.move(NEW_YORK)
        n_moved = len(published)
        while len(published) < n_moved + 10:
            await asyncio.sleep(0)  # and go on flowing after it
        stop.set()
        await flowing
        await publish(20)
        await quiet(fed)
        assert moved and mover.broker_id == "us" and mover.location == NEW_YORK
        # Every delivery the brokers made to this subscription reaches it, and
        # they made one (or, during the handover, two) for every event.
        handed_over = deliveries(fed) - before
        got: list[str] = []
        while len(got) + sub.duplicates < handed_over:
            got.append((await sub.next(timeout=60)).event_id)
        assert len(got) == len(set(got)), "an event was delivered twice"
        assert sorted(got) == sorted(published)
        await mover.close()
        await pub.close()

    asyncio.run(run())


def test_moves_back_and_forth_lose_no_delivery_a_broker_made(fed: LocalFederation) -> None:
    """Ten handovers of a client with eight subscriptions while events flow from eu: every
    delivery a broker made reaches the client, the old broker's in-flight ones included
    (its stream is drained, not cancelled, after a move), and none arrives twice. (What
    a handover may miss: `test_move_across_a_boundary_renews_subscriptions_while_events_flow`.)"""

    async def run() -> None:
        mover = await geofed.connect(
            client_id="shuttle", location=PARIS, federation=fed.federation_path
        )
        pub = await geofed.connect(
            client_id="shuttle-pub", location=FRANKFURT, federation=fed.federation_path
        )
        before = deliveries(fed)
        subs = [await mover.subscribe(f"shuttle/{i}", subscription_id=f"s{i}") for i in range(8)]
        await quiet(fed)
        published: list[str] = []
        stop = asyncio.Event()

        async def publish() -> None:
            while not stop.is_set():  # bursts of 50 events of 4 KiB: many in flight
                burst = (
                    Publication(f"shuttle/{i % 8}", bytes(MAX_PAYLOAD), FRANKFURT)
                    for i in range(50)
                )
                published.extend(await pub.publish_many(burst))

        got: list[str] = []

        async def take(sub: geofed.Subscription) -> None:
            async for msg in sub:
                got.append(msg.event_id)

        takers = [asyncio.create_task(take(s)) for s in subs]
        flowing = asyncio.create_task(publish())
        for i in range(10):
            mark = len(published)
            while len(published) < mark + 10:
                await asyncio.sleep(0)  # events flow between the moves
            assert await mover.move(NEW_YORK if i % 2 == 0 else PARIS)
        stop.set()
        await flowing
        await quiet(fed)
        made = deliveries(fed) - before
        async with asyncio.timeout(120):  # a delivery made and lost: hung here
            while sum(s.received for s in subs) < made:
                await asyncio.sleep(0.01)
        await mover.close()  # iterations end after what arrived
        await asyncio.gather(*takers)
        assert len(got) == len(set(got)), "an event was delivered twice"
        assert set(got) <= set(published)
        await pub.close()

    asyncio.run(run())


def deliveries(fed: LocalFederation) -> float:
    """Deliveries the brokers have handed to subscriber streams so far."""
    return sum(metric(n.metrics_url, DELIVERIES) for n in fed.nodes.values())


def test_bad_input_raises_typed_errors_naming_the_field(fed: LocalFederation) -> None:
    async def run() -> None:
        async with await geofed.connect(
            client_id="bad", location=PARIS, federation=fed.federation_path
        ) as client:
            cases = [
                (lambda: client.publish("a/+", b""), geofed.InvalidInput, "request.event.topic"),
                (
                    lambda: client.publish("a/b", geofence="POLYGON((0 0, 1 1, 1 0, 0 1, 0 0))"),
                    geofed.InvalidInput,
                    "request.event.geofence.wkt",
                ),
                (
                    lambda: client.publish(
                        "a/b", geofence={"circle": {"lat": 0, "lon": 0, "radius_m": -1}}
                    ),
                    geofed.InvalidInput,
                    "request.event.geofence.circle.radius_m",
                ),
                (
                    lambda: client.publish("a/b", b"x" * (MAX_PAYLOAD + 1)),
                    geofed.TooLarge,
                    "request.event.payload",
                ),
                (
                    lambda: client.subscribe("a/#/b"),
                    geofed.InvalidInput,
                    "subscription.topic_filter",
                ),
                (
                    lambda: client.subscribe(
                        "a/#", geofence="POLYGON((200 0, 201 0, 201 1, 200 0))"
                    ),
                    geofed.InvalidInput,
                    "subscription.geofence.wkt",
                ),
                (
                    lambda: client.publish_many([Publication("a/b", b"", NEW_YORK)]),
                    geofed.WrongBroker,
                    "batch.events[0].publisher",
                ),
                (
                    lambda: client.publish_many([Publication("a/b", b"", PARIS)] * 51),
                    geofed.TooLarge,
                    "batch.events",
                ),
            ]
            for call, kind, field in cases:
                with pytest.raises(kind) as info:
                    await call()
                assert info.value.field == field, info.value
            too_large = info.value
            assert isinstance(too_large, geofed.TooLarge) and too_large.limit == 50
            # The broker keeps serving this client after every rejection.
            assert await client.publish("a/b", b"ok")

    asyncio.run(run())


def test_concurrent_publishes_are_answered_and_delivered_in_the_order_they_were_made(
    fed: LocalFederation,
) -> None:
    """One client's publishes share one PublishEach call: refusals in between do not
    end it, and the subscriber gets the accepted events in the order of the calls."""

    async def run() -> None:
        async with (
            await geofed.connect(
                client_id="each-sub", location=SINGAPORE, federation=fed.federation_path
            ) as sub_client,
            await geofed.connect(
                client_id="each-pub", location=PARIS, federation=fed.federation_path
            ) as client,
        ):
            sub = await sub_client.subscribe("each/#")
            await quiet(fed)
            topics = ["each/+" if i % 7 == 3 else f"each/{i}" for i in range(200)]
            answers = await asyncio.gather(
                *(client.publish(t, t) for t in topics), return_exceptions=True
            )
            call = client._publishing
            for topic, answer in zip(topics, answers, strict=True):
                if "+" in topic:
                    assert isinstance(answer, geofed.InvalidInput), answer
                    assert answer.field == "request.event.topic"
                else:
                    assert isinstance(answer, str), answer
            assert await client.publish("each/last") and client._publishing is call
            accepted = [t for t in topics if "+" not in t]
            got = [(await sub.next(timeout=60)).topic for _ in range(len(accepted) + 1)]
            assert got == [*accepted, "each/last"]

    asyncio.run(run())


def test_a_stopping_broker_ends_an_idle_publish_call_with_unavailable() -> None:
    """Shutdown does not wait out its grace period for a publisher's open call: the
    call ends UNAVAILABLE (the client publishes again on a new one)."""
    config = NodeConfig(
        broker_id="eu",
        federation="three",
        client_listen="127.0.0.1:0",
        peer_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        peer_timeout_s=0,
        shutdown_grace_s=600,
    )

    async def run() -> None:
        node = BrokerServer(config, CollectorRegistry())
        await node.start()
        try:
            client = await geofed.connect(
                client_id="idle-pub",
                location=PARIS,
                endpoint=f"127.0.0.1:{node.client_port}",
                retry=RetryConfig(attempts=1),
            )
            assert await client.publish("idle/x")
            call = client._publishing
            assert call is not None and len(node.publish_calls) == 1
            await asyncio.wait_for(node.stop(), 300)  # well inside the grace period
            assert node.publish_calls == {}
            while call.ended is None:
                await asyncio.sleep(0.01)
            assert call.ended.code() == grpc.StatusCode.UNAVAILABLE
            assert call.ended.details() == "broker shutting down"
            with pytest.raises(geofed.Unavailable):
                await client.publish("idle/y")
            await client.close()
        finally:
            await node.stop()

    asyncio.run(run())


def test_client_side_settings_are_checked_before_anything_is_sent() -> None:
    with pytest.raises(geofed.InvalidInput) as info:
        geofed.ClientConfig("c", geofed.LatLon(91.0, 0.0), endpoint="127.0.0.1:1")
    assert info.value.field == "location.lat"
    with pytest.raises(geofed.InvalidInput) as info:
        geofed.ClientConfig("c", PARIS)
    assert info.value.field == "federation"
    with pytest.raises(geofed.InvalidInput) as info:
        geofed.ClientConfig("", PARIS, endpoint="127.0.0.1:1")
    assert info.value.field == "client_id"
    with pytest.raises(geofed.InvalidInput) as info:
        asyncio.run(geofed.connect(client_id="c", location=PARIS, federation="no-such-one"))
    assert info.value.field == "federation"


def test_unreachable_and_silent_brokers_raise_typed_errors() -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed_port = free.getsockname()[1]  # nobody listens once the socket is closed
    with pytest.raises(geofed.Unavailable):
        asyncio.run(
            geofed.connect(
                client_id="c",
                location=PARIS,
                endpoint=f"127.0.0.1:{closed_port}",
                retry=RetryConfig(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.01),
            )
        )
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(geofed.DeadlineExceeded):
            asyncio.run(
                geofed.connect(
                    client_id="c",
                    location=PARIS,
                    endpoint=f"127.0.0.1:{silent.getsockname()[1]}",
                    connect_timeout_s=0.5,
                )
            )


def test_subscription_is_renewed_when_its_broker_comes_back(tmp_path: Path) -> None:
    """A broker restart ends the stream (UNAVAILABLE); the client reconnects and resubscribes."""
    with LocalFederation(THREE, "event-geofence", tmp_path) as own:

        async def run() -> None:
            retry = RetryConfig(attempts=200, initial_backoff_s=0.05, max_backoff_s=0.5)
            sub_client = await geofed.connect(
                client_id="phoenix", location=PARIS, federation=own.federation_path, retry=retry
            )
            pub = await geofed.connect(
                client_id="phoenix-pub", location=NEW_YORK, federation=own.federation_path
            )
            sub = await sub_client.subscribe("phoenix/#", subscription_id="phoenix")
            await asyncio.to_thread(own.stop_node, "eu")
            await asyncio.to_thread(own.start_node, "eu")
            await asyncio.to_thread(own.wait_ready, 120.0)
            eu = own.nodes["eu"].metrics_url
            while await asyncio.to_thread(metric, eu, SUBSCRIPTIONS, scope="local") < 1:
                assert sub.pending == 0
                if sub._done:  # the renewal gave up: say why instead of waiting for ever
                    await sub.next()
                await asyncio.sleep(0.05)  # the client is renewing the subscription
            await own.quiescent()  # and it reached the other brokers
            event_id = await pub.publish("phoenix/x", b"back")
            assert (await sub.next(timeout=60)).event_id == event_id
            await sub_client.close()
            await pub.close()

        asyncio.run(run())


def test_close_gives_up_a_renewal_in_progress(tmp_path: Path) -> None:
    """A client whose broker is gone closes at once, though it would retry for ever."""
    with LocalFederation(THREE, "event-geofence", tmp_path) as own:

        async def run() -> None:
            forever = RetryConfig(attempts=10**9, initial_backoff_s=0.05, max_backoff_s=0.5)
            client = await geofed.connect(
                client_id="stuck", location=PARIS, federation=own.federation_path, retry=forever
            )
            sub = await client.subscribe("stuck/#")
            await asyncio.to_thread(own.stop_node, "eu")
            while sub._recovery is None:
                await asyncio.sleep(0.01)  # the stream broke: the client is renewing it
            await client.close()  # without giving up the renewal, this would never return
            assert [m async for m in sub] == []

        asyncio.run(run())
