"""Make before break: a client moving to another broker is matched at the old one until
its subscriptions stand at the new one (docs/design.md §7).

The old broker holds a handover (`UpdateLocation` with `hold`) until the client's
`Leave`, its bound (`handover_hold_s`) or the client's return; a renewal flagged
`handover` is answered once every connected peer has applied what it sent. Waits
are on answers, metrics and the quiescence barrier, not on time.
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
    HANDOVER_SETTLE_TIMEOUTS,
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


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    # A subscription-forwarding strategy: renewals travel to the publishers' brokers.
    # A fault proxy on every link, to slow one down.
    workdir = tmp_path_factory.mktemp("handover")
    with LocalFederation(
        THREE, "flooding-subscriptions", workdir, links=True, mqtt=False, http=False
    ) as running:
        yield running


def count(fed: LocalFederation, broker: str, name: str, **labels: str) -> float:
    return metric(fed.nodes[broker].metrics_url, name, **labels)


async def connect(fed: LocalFederation, client_id: str, where: geofed.LatLon) -> geofed.Client:
    return await geofed.connect(client_id=client_id, location=where, federation=fed.federation_path)


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
        assert answer.held_s == 10.0  # handover_hold_s's default
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
        timeouts = count(fed, "us", HANDOVER_SETTLE_TIMEOUTS)
        assert await mover.move(NEW_YORK)
        assert count(fed, "ap", PEER_MESSAGES_RECEIVED, peer="us", kind="subscribe") == from_us + 1
        assert count(fed, "us", HANDOVER_SETTLE_TIMEOUTS) == timeouts
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local
        await mover.close()

    asyncio.run(run())


def test_a_renewal_waits_for_a_slow_peer_only_up_to_its_bound(fed: LocalFederation) -> None:
    async def run() -> None:
        mover = await connect(fed, "slow", PARIS)
        local = count(fed, "eu", SUBSCRIPTIONS, scope="local")
        await mover.subscribe("slow/x", subscription_id="s")
        await fed.quiescent()
        timeouts = count(fed, "us", HANDOVER_SETTLE_TIMEOUTS)
        await asyncio.to_thread(fed.link("us", "ap").hold)
        try:
            assert await mover.move(NEW_YORK)  # ap's acknowledgement cannot come
            assert count(fed, "us", HANDOVER_SETTLE_TIMEOUTS) == timeouts + 1
            assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == local  # left all the same
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


def test_a_handover_not_left_is_withdrawn_when_its_hold_runs_out(tmp_path: Path) -> None:
    env = {"GEOFED_HANDOVER_HOLD_S": "0.2"}

    async def run(fed: LocalFederation) -> None:
        mover = await connect(fed, "gone", PARIS)
        await mover.subscribe("gone/x", subscription_id="g")
        answer = await raw(
            mover, "UpdateLocation", gw.update_location_request("gone", NEW_YORK, hold=True)
        )
        assert answer.held_s == 0.2
        await until(
            lambda: count(fed, "eu", HANDOVERS, outcome="expired") == 1,
            "eu's hold ran out",
            WAIT_S,
            scrapes=True,
        )
        assert count(fed, "eu", SUBSCRIPTIONS, scope="local") == 0
        assert count(fed, "eu", SESSIONS) == 0
        assert not (await raw(mover, "Leave", gw.leave_request("gone"))).held
        await mover.close()

    with LocalFederation(
        THREE, "event-geofence", tmp_path, extra_env=env, mqtt=False, http=False
    ) as fed:
        asyncio.run(run(fed))
