"""Make before break: a client moving to another broker is matched at the old one until
its subscriptions stand at the new one (docs/design.md §7).

The old broker holds a handover (`UpdateLocation` with `hold`) until the client's
`Leave`, its bound (`handover_hold_s`) or the client's return; a renewal flagged
`handover` is answered once every connected peer has applied what it sent, and a
`Leave` once every connected peer's flush reply has arrived. Waits are on answers,
metrics and the quiescence barrier, not on time: the federation that waits on a
held link has long bounds (`HOLD_S`), the one that lets them run out short ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import geofed
from geofed import wire as gw
from geofed.bench import LocalFederation, metric
from geofed.bench.faults import until
from geofed.node import (
    DELIVERIES,
    HANDOFF_DELIVERIES,
    HANDOVER_WAIT_TIMEOUTS,
    HANDOVERS,
    PEER_MESSAGES_RECEIVED,
    SESSIONS,
    SUBSCRIPTIONS,
)

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = geofed.LatLon(48.85, 2.35)  # eu
FRANKFURT = geofed.LatLon(50.11, 8.68)  # eu
NEW_YORK = geofed.LatLon(40.71, -74.0)  # us
SINGAPORE = geofed.LatLon(1.29, 103.85)  # ap
WAIT_S = 60.0
HOLD_S = 120.0  # no wait of `fed` runs out while a test holds a link (half of it)


def _federation(workdir: Path, hold_s: float) -> LocalFederation:
    # A subscription-forwarding strategy: renewals travel to the publishers' brokers.
    # A fault proxy on every link, to slow one down.
    env = {"GEOFED_HANDOVER_HOLD_S": f"{hold_s:g}"}
    return LocalFederation(
        THREE, "flooding-subscriptions", workdir, links=True, mqtt=False, http=False, extra_env=env
    )


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with _federation(tmp_path_factory.mktemp("handover"), HOLD_S) as running:
        yield running


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """Holds of half a second: its waits run out."""
    with _federation(tmp_path_factory.mktemp("handover-short"), 0.5) as running:
        yield running


def count(fed: LocalFederation, broker: str, name: str, **labels: str) -> float:
    return metric(fed.nodes[broker].metrics_url, name, **labels)


async def connect(fed: LocalFederation, client_id: str, where: geofed.LatLon) -> geofed.Client:
    return await geofed.connect(client_id=client_id, location=where, federation=fed.federation_path)


async def keeper(fed: LocalFederation, client_id: str, where: geofed.LatLon) -> geofed.Client:
    """A client with a persistent session."""
    return await geofed.connect(
        client_id=client_id,
        location=where,
        federation=fed.federation_path,
        session_expiry_s=600.0,
    )


async def raw(client: geofed.Client, name: str, request: Any) -> Any:
    """One call of the client service at the client's broker, as the library would send it."""
    return await client._call(
        name, lambda stub, timeout: getattr(stub, name)(request, timeout=timeout)
    )


def test_a_held_handover_matches_at_the_old_broker_until_the_client_leaves(
    fed: LocalFederation,
) -> None:
    async def run() -> None:
        mover = await connect(fed, "held", PARIS)
        far = await connect(fed, "held-far", SINGAPORE)
        near = await connect(fed, "held-near", FRANKFURT)
        sub = await mover.subscribe("held/x", subscription_id="h")
        await fed.quiescent()
        left = count(fed, "eu", HANDOVERS, outcome="left")
        local, sessions = count(fed, "eu", SUBSCRIPTIONS, scope="local"), count(fed, "eu", SESSIONS)
        answer = await raw(
            mover, "UpdateLocation", gw.update_location_request("held", NEW_YORK, hold=True)
        )
        assert not answer.accepted and answer.redirect.broker_id == "us"
        assert answer.held_s == HOLD_S
        # Held: eu still matches for the client, for its own publishers and the others'.
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local
        await near.publish("held/x", b"from eu")
        await far.publish("held/x", b"from ap")
        assert {(await sub.next(timeout=WAIT_S)).payload for _ in range(2)} == {
            b"from eu",
            b"from ap",
        }
        assert (await raw(mover, "Leave", gw.leave_request("held"))).held
        assert count(fed, "eu", HANDOVERS, outcome="left") == left + 1
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local - 1
        assert count(fed, "eu", SESSIONS) == sessions - 1
        # A retried Leave finds nothing held, and touches nothing.
        assert not (await raw(mover, "Leave", gw.leave_request("held"))).held
        await fed.quiescent()
        made = count(fed, "eu", DELIVERIES)
        await near.publish("held/x", b"after leaving")
        await fed.quiescent()
        assert count(fed, "eu", DELIVERIES) == made
        for client in (mover, far, near):
            await client.close()

    asyncio.run(run())


def test_a_client_coming_back_ends_the_hold_and_keeps_its_subscriptions(
    fed: LocalFederation,
) -> None:
    async def run() -> None:
        mover = await connect(fed, "back", PARIS)
        near = await connect(fed, "back-near", FRANKFURT)
        sub = await mover.subscribe("back/x", subscription_id="b")
        returned = count(fed, "eu", HANDOVERS, outcome="returned")
        answer = await raw(
            mover, "UpdateLocation", gw.update_location_request("back", NEW_YORK, hold=True)
        )
        assert answer.held_s > 0
        assert (
            await raw(mover, "UpdateLocation", gw.update_location_request("back", PARIS))
        ).accepted
        assert count(fed, "eu", HANDOVERS, outcome="returned") == returned + 1
        assert not (await raw(mover, "Leave", gw.leave_request("back"))).held
        await near.publish("back/x", b"still here")
        assert (await sub.next(timeout=WAIT_S)).payload == b"still here"
        await mover.close()
        await near.close()

    asyncio.run(run())


def test_a_renewal_is_answered_once_every_peer_holds_it(fed: LocalFederation) -> None:
    """After `move` returns, ap has applied us's announcement (it counts a message
    received once applied) and the old broker has let go: no barrier needed."""

    async def run() -> None:
        mover = await connect(fed, "settle", PARIS)
        local = count(fed, "eu", SUBSCRIPTIONS, scope="local")
        await mover.subscribe("settle/x", subscription_id="s")
        await fed.quiescent()
        from_us = count(fed, "ap", PEER_MESSAGES_RECEIVED, peer="us", kind="subscribe")
        timeouts = count(fed, "us", HANDOVER_WAIT_TIMEOUTS, step="settle")
        assert await mover.move(NEW_YORK)
        assert count(fed, "ap", PEER_MESSAGES_RECEIVED, peer="us", kind="subscribe") == from_us + 1
        assert count(fed, "us", HANDOVER_WAIT_TIMEOUTS, step="settle") == timeouts
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local
        await mover.close()

    asyncio.run(run())


def test_what_a_peer_sent_the_old_broker_before_the_move_is_delivered_before_it_lets_go(
    fed: LocalFederation,
) -> None:
    """ap matches events against eu's copy while the ap-eu link is slow (held): the
    deliveries wait on the link while the client moves to us. eu takes `Leave` only
    after ap's flush reply, which comes behind them: they reach the client."""

    async def run() -> None:
        mover = await connect(fed, "inflight", PARIS)
        far = await connect(fed, "inflight-far", SINGAPORE)
        sub = await mover.subscribe("inflight/x", subscription_id="i")
        await fed.quiescent()
        left, local = (
            count(fed, "eu", HANDOVERS, outcome="left"),
            count(fed, "eu", SUBSCRIPTIONS, scope="local"),
        )
        await asyncio.to_thread(fed.link("ap", "eu").hold)
        try:
            sent = [await far.publish("inflight/x", f"{i}".encode()) for i in range(5)]
            moving = asyncio.create_task(mover.move(NEW_YORK))
            await until(
                lambda: count(fed, "eu", HANDOVERS, outcome="left") == left + 1,
                "the client left eu",
                WAIT_S,
                scrapes=True,
            )
            assert not moving.done()  # eu waits for ap's flush reply
            assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local
        finally:
            await asyncio.to_thread(fed.link("ap", "eu").heal)
        assert await moving
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local - 1
        assert sorted([(await sub.next(timeout=WAIT_S)).event_id for _ in sent]) == sorted(sent)
        for client in (mover, far):
            await client.close()

    asyncio.run(run())


def test_a_handover_waits_for_a_slow_peer_only_up_to_its_bound(short: LocalFederation) -> None:
    """With the us-ap link held, us answers the renewal once half the hold has run out
    (counted), and the client still leaves eu."""

    async def run() -> None:
        fed = short
        mover = await connect(fed, "slow", PARIS)
        local = count(fed, "eu", SUBSCRIPTIONS, scope="local")
        await mover.subscribe("slow/x", subscription_id="s")
        await fed.quiescent()
        timeouts = count(fed, "us", HANDOVER_WAIT_TIMEOUTS, step="settle")
        await asyncio.to_thread(fed.link("us", "ap").hold)
        try:
            assert await mover.move(NEW_YORK)  # ap's acknowledgement cannot come
            assert count(fed, "us", HANDOVER_WAIT_TIMEOUTS, step="settle") == timeouts + 1
            await until(  # left, or its hold ran out first
                lambda: count(fed, "eu", SUBSCRIPTIONS, scope="local") == local,
                "eu withdrew",
                WAIT_S,
                scrapes=True,
            )
        finally:
            await asyncio.to_thread(fed.link("us", "ap").heal)
        await fed.quiescent()
        await mover.close()

    asyncio.run(run())


def test_a_publisher_at_the_old_broker_misses_nothing_while_the_client_moves(
    fed: LocalFederation,
) -> None:
    """Events flow from eu while a subscriber moves eu -> us -> eu: eu matches each event
    for the client's local subscription until the client leaves it, and by then us
    holds the renewal and eu us's copy, so every event reaches the client, once."""

    async def run() -> None:
        mover = await connect(fed, "shuttle", PARIS)
        pub = await connect(fed, "shuttle-pub", FRANKFURT)
        sub = await mover.subscribe("shuttle/#", subscription_id="s")
        await fed.quiescent()
        published: list[str] = []
        stop = asyncio.Event()

        async def publish() -> None:
            while not stop.is_set():
                published.append(await pub.publish(f"shuttle/{len(published)}", b"x"))

        flowing = asyncio.create_task(publish())
        for i in range(6):
            mark = len(published)
            while len(published) < mark + 5:
                await asyncio.sleep(0)  # events flow between the moves
            assert await mover.move(NEW_YORK if i % 2 == 0 else PARIS)
        stop.set()
        await flowing
        await fed.quiescent()
        got: list[str] = []
        while len(got) < len(published):
            got.append((await sub.next(timeout=WAIT_S)).event_id)
        assert sorted(got) == sorted(published)
        assert sub.pending == 0
        await mover.close()
        await pub.close()

    asyncio.run(run())


def test_a_persistent_queue_moves_with_its_client(fed: LocalFederation) -> None:
    """A persistent subscriber behind its queue at eu moves to us: eu hands us what the
    client has not acknowledged, us queues it, and the session resumed at us gets it."""

    async def run() -> None:
        first = await keeper(fed, "queue", PARIS)
        await first.subscribe("queue/x", subscription_id="q")
        await first.close()  # the subscription stays at eu, its deliveries queued there
        pub = await connect(fed, "queue-pub", FRANKFURT)
        sent = [await pub.publish("queue/x", f"{i}".encode()) for i in range(5)]
        handed = count(fed, "eu", HANDOFF_DELIVERIES, outcome="sent")
        queued = count(fed, "us", HANDOFF_DELIVERIES, outcome="queued")
        second = await keeper(fed, "queue", PARIS)
        await second.subscribe("queue/x", subscription_id="q")  # nothing taken, nothing acked
        assert await second.move(NEW_YORK)
        assert count(fed, "eu", HANDOFF_DELIVERIES, outcome="sent") == handed + 5
        await until(
            lambda: count(fed, "us", HANDOFF_DELIVERIES, outcome="queued") == queued + 5,
            "us queued the handoff",
            WAIT_S,
            scrapes=True,
        )
        await second.close()
        third = await keeper(fed, "queue", NEW_YORK)
        sub = await third.subscribe("queue/x", subscription_id="q")
        got = [await sub.next(timeout=WAIT_S) for _ in sent]
        assert sorted(m.event_id for m in got) == sorted(sent)
        assert [(m.broker, m.offset) for m in got] == [("us", i) for i in range(1, 6)]
        await third.close()
        await pub.close()

    asyncio.run(run())


def test_a_handover_not_left_is_withdrawn_when_its_hold_runs_out(short: LocalFederation) -> None:
    async def run() -> None:
        fed = short
        mover = await connect(fed, "gone", PARIS)
        local, sessions = count(fed, "eu", SUBSCRIPTIONS, scope="local"), count(fed, "eu", SESSIONS)
        await mover.subscribe("gone/x", subscription_id="g")
        expired = count(fed, "eu", HANDOVERS, outcome="expired")
        answer = await raw(
            mover, "UpdateLocation", gw.update_location_request("gone", NEW_YORK, hold=True)
        )
        assert answer.held_s == 0.5
        await until(
            lambda: count(fed, "eu", HANDOVERS, outcome="expired") == expired + 1,
            "eu's hold ran out",
            WAIT_S,
            scrapes=True,
        )
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local
        assert count(fed, "eu", SESSIONS) == sessions - 1
        assert not (await raw(mover, "Leave", gw.leave_request("gone"))).held
        await mover.close()

    asyncio.run(run())


def test_a_persistent_session_not_left_goes_ahead_of_its_client_when_the_hold_runs_out(
    short: LocalFederation,
) -> None:
    """A persistent subscriber asks eu to hold its move to us and never gets there (no
    renewal, no Leave). When the hold runs out, eu sends us the session before it hands
    its queue over, so the queue has a subscription to join at us, and the client
    connecting to us later finds the session with what was queued for it at eu."""

    async def run() -> None:
        fed = short
        first = await keeper(fed, "late", PARIS)
        await first.subscribe("late/x", subscription_id="q")
        await first.close()  # its deliveries are queued at eu
        pub = await connect(fed, "late-pub", FRANKFURT)
        sent = [await pub.publish("late/x", f"{i}".encode()) for i in range(3)]
        expired = count(fed, "eu", HANDOVERS, outcome="expired")
        second = await keeper(fed, "late", PARIS)
        answer = await raw(
            second, "UpdateLocation", gw.update_location_request("late", NEW_YORK, hold=True)
        )
        assert answer.held_s == 0.5
        await second.close()
        await until(
            lambda: count(fed, "eu", HANDOVERS, outcome="expired") == expired + 1,
            "eu's hold ran out",
            WAIT_S,
            scrapes=True,
        )
        await fed.quiescent(WAIT_S)  # the session and the handoff have reached us
        third = await keeper(fed, "late", NEW_YORK)
        sub = await third.subscribe("late/x", subscription_id="q")
        got = [await sub.next(timeout=WAIT_S) for _ in sent]
        assert sorted(m.event_id for m in got) == sorted(sent)
        assert {m.broker for m in got} == {"us"}
        await third.close()
        await pub.close()

    asyncio.run(run())
