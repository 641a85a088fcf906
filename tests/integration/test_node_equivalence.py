"""Randomized workloads through real nodes equal the oracle and the cost model.

One federation per strategy serves many hypothesis examples. Each example uses
fresh client and subscription ids, replays through the client library with a
barrier after every action (no inter-broker message in flight), and compares
the deliveries with the central oracle and the metric deltas of inter-broker
messages with the routing cost model, exactly. Whether every delivery has
arrived is decided by the brokers' own delivery counts, never by waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geofed
from geofed.bench import LocalFederation, Replayer, faults, wait_quiescent
from geofed.node import DELIVERIES, SUBSCRIPTIONS
from geofed.routing import (
    STRATEGIES,
    LatLon,
    Roaming,
    TraceOp,
    latlon,
    parse_geofence,
    predict,
    reference_deliveries,
)

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"

pytestmark = pytest.mark.integration

# Places inside each of the three areas, and some near their borders.
PLACES = [
    (50.1, 8.7),
    (48.9, 2.3),
    (40.4, -3.7),
    (39.0, -77.5),
    (19.4, -99.1),
    (-23.5, -46.6),
    (1.3, 103.8),
    (35.7, 139.7),
    (-33.9, 151.2),
    (28.6, 77.2),
    (10.0, 60.0),
    (62.0, -20.0),
]
FENCES = [
    None,
    None,
    "POLYGON((-10 35, 30 35, 30 60, -10 60, -10 35))",
    "POLYGON((-130 10, -60 10, -60 55, -130 55, -130 10))",
    "POLYGON((60 -45, 160 -45, 160 45, 60 45, 60 -45))",
    "POLYGON((170 -50, -170 -50, -170 50, 170 50, 170 -50))",
    {"circle": {"lat": 50.1, "lon": 8.7, "radius_m": 300_000}},
    {"circle": {"lat": 20.0, "lon": 40.0, "radius_m": 3_000_000}},
]
# Subscriptions also get roaming geofences: a regional one, and one reaching other areas.
ROAMING = [None, None, None, Roaming(radius_m=300_000.0), Roaming(radius_m=2_500_000.0)]
FILTERS = ["a/b", "a/+", "a/#", "#", "+/b"]
TOPICS = ["a/b", "a/c", "b/b", "a"]

_counter = itertools.count()


@st.composite
def workloads(draw: st.DrawFn) -> list[TraceOp]:
    run = next(_counter)
    n_clients = draw(st.integers(2, 6))
    clients = [f"r{run}c{i}" for i in range(n_clients)]
    ops: list[TraceOp] = []
    live: dict[str, str] = {}
    at: dict[str, LatLon] = {}  # where each client was last

    def add(op: TraceOp) -> None:
        # An action elsewhere than the client's last location moves it first. The
        # move goes as an action of its own, so that the barrier separates it from
        # the action: the old broker's withdrawals are through before the client
        # subscribes or publishes at the new one (the model applies them at once).
        if op.location is not None:
            if at.get(op.client, op.location) != op.location and op.op != "move":
                ops.append(TraceOp(len(ops), "move", op.client, op.location))
            at[op.client] = op.location
        ops.append(dataclasses.replace(op, t=len(ops)))

    # Subscriptions first, then a mix dominated by publishes, so that most
    # examples have deliveries (and some have none).
    kinds = ["subscribe"] * draw(st.integers(1, 5)) + draw(
        st.lists(
            st.sampled_from(["publish"] * 4 + ["move", "unsubscribe", "subscribe"]),
            min_size=3,
            max_size=20,
        )
    )
    for step, kind in enumerate(kinds):
        client = draw(st.sampled_from(clients))
        where = latlon(*draw(st.sampled_from(PLACES)))
        fence = parse_geofence(draw(st.sampled_from(FENCES)))
        if kind == "subscribe":
            sid = f"r{run}s{step}"
            filt = draw(st.sampled_from(FILTERS))
            roam = draw(st.sampled_from(ROAMING))
            if roam is not None:
                add(TraceOp(step, "subscribe", client, where, sid, filt, roaming=roam))
            else:
                add(TraceOp(step, "subscribe", client, where, sid, filt, fence))
            live[sid] = client
        elif kind == "publish":
            topic = draw(st.sampled_from(TOPICS))
            add(TraceOp(step, "publish", client, where, f"r{run}e{step}", topic, fence, 8))
        elif kind == "move":
            add(TraceOp(step, "move", client, where))
        elif live:
            sid = draw(st.sampled_from(sorted(live)))
            add(TraceOp(step, "unsubscribe", live.pop(sid), id=sid))
    return ops


@pytest.fixture(scope="module", params=list(STRATEGIES))
def federation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFederation]:
    with LocalFederation(THREE, request.param, tmp_path_factory.mktemp(request.param)) as fed:
        yield fed


WAIT_S = 60.0  # safety net of every wait on state; none is expected to come near it


# Conditions scrape metrics, so they run in a thread.
until = functools.partial(faults.until, timeout=WAIT_S, scrapes=True)


async def _replay(
    fed: LocalFederation, ops: list[TraceOp]
) -> tuple[list[tuple[str, str]], int, Counter[tuple[str, str, str]]]:
    """Replay `ops`; the deliveries, how many the brokers made, and the messages sent."""
    urls = fed.metrics_urls()
    r = Replayer(fed.federation, barrier=lambda: wait_quiescent(urls, timeout=WAIT_S))
    before = await asyncio.to_thread(fed.sent)
    made_before = await asyncio.to_thread(fed.total, DELIVERIES)
    try:
        await r.run(ops)
        # The barrier after the last action: every delivery has been pushed to a
        # stream. The streams may still carry some: wait until every delivery the
        # brokers made for this example has reached its client.
        made = await asyncio.to_thread(fed.total, DELIVERIES) - made_before
        await until(lambda: r.received >= made, f"{made:g} deliveries reach the clients")
        after = await asyncio.to_thread(fed.sent)
    finally:
        await r.close()  # cancels the streams: their subscriptions are withdrawn
        # A broker withdraws a subscription when it sees its stream end, after
        # `close` returned: wait for that, then for what it sent to its peers,
        # so that none of it is counted in the next example.
        await until(
            lambda: fed.total(SUBSCRIPTIONS) == 0, "every broker has withdrawn every subscription"
        )
        await wait_quiescent(urls, timeout=WAIT_S)
    assert not r.errors, r.errors
    assert r.received == made  # nothing arrived that the brokers did not count
    return r.deliveries, int(made), after - before


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=workloads())
def test_live_federation_matches_oracle_and_cost_model(
    federation: LocalFederation, ops: list[TraceOp]
) -> None:
    deliveries, made, sent = asyncio.run(_replay(federation, ops))
    expected = reference_deliveries(ops)
    assert Counter(deliveries) == Counter(expected)  # recall 1, precision 1, no duplicates
    assert made == len(expected)  # not even a duplicate the client dropped
    predicted = predict(federation.federation, federation.strategy, ops)
    assert sent == +predicted.messages


def test_roaming_geofence_follows_a_subscriber_across_an_area_edge(
    federation: LocalFederation, eu_ap_edge: float
) -> None:
    # A subscriber with a 200 km roaming circle drives east along latitude 30
    # from eu's area across the edge into ap's; one publisher on each side
    # publishes after every move. Which events it gets depends on where its
    # geofence is at that moment; under subscription-geofence its moves near
    # the edge send ap the subscription, relocate ap's copy, hand it over,
    # relocate eu's copy and withdraw it again. Deliveries must equal the oracle's and the
    # messages the cost model's, under every strategy.
    edge = eu_ap_edge
    run = next(_counter)
    rover, pe, pa = (f"r{run}{name}" for name in ("rover", "pe", "pa"))
    east, west = LatLon(30.0, edge + 1.0), LatLon(30.0, edge - 1.0)
    ops: list[TraceOp] = []

    def both(t: int) -> None:
        ops.append(TraceOp(t, "publish", pe, west, f"r{run}e{t}w", "a/b", payload_size=8))
        ops.append(TraceOp(t, "publish", pa, east, f"r{run}e{t}e", "a/b", payload_size=8))

    start = LatLon(30.0, edge - 3.0)
    ops.append(TraceOp(0, "subscribe", rover, start, f"r{run}s", "a/#", roaming=Roaming(200_000.0)))
    both(1)
    # At +1.8 eu still holds a copy (relocated), which must no longer match pe.
    for t, offset in enumerate((-0.5, -0.3, 0.5, 1.8, 3.0), start=2):
        ops.append(TraceOp(t * 2, "move", rover, LatLon(30.0, edge + offset)))
        both(t * 2 + 1)
    deliveries, _, sent = asyncio.run(_replay(federation, ops))
    expected = reference_deliveries(ops)
    # The geofence met each side's publisher at some moves and not at others.
    assert {ev[-1] for ev, _ in expected} == {"w", "e"}
    assert 2 < len(expected) < 2 * 6
    assert Counter(deliveries) == Counter(expected)
    predicted = predict(federation.federation, federation.strategy, ops)
    assert sent == +predicted.messages
    if federation.strategy == "subscription-geofence":
        assert predicted.by_kind()["relocate"] == 2


def test_a_connect_at_a_new_place_moves_roaming_geofences_too(
    federation: LocalFederation, eu_ap_edge: float
) -> None:
    # A known client connecting again elsewhere in its broker's area is a
    # move (docs/design.md §7): its 130 km roaming circle, which reaches into
    # ap from either place, must be relocated there too — from the first
    # place ap's publisher is 144 km away, from the second 125 km.
    edge = eu_ap_edge
    run = next(_counter)
    rover = f"r{run}rover"
    where = str(federation.federation_path)

    async def scenario() -> geofed.Message:
        first = await geofed.connect(
            client_id=rover, location=LatLon(30.0, edge - 0.5), federation=where
        )
        sub = await first.subscribe("a/#", geofence="roam:circle:130000")
        await federation.quiescent(WAIT_S)
        again = await geofed.connect(
            client_id=rover, location=LatLon(30.0, edge - 0.3), federation=where
        )
        await federation.quiescent(WAIT_S)
        async with await geofed.connect(
            client_id=f"r{run}pa", location=LatLon(30.0, edge + 1.0), federation=where
        ) as pa:
            await pa.publish("a/b", b"near enough now")
        try:
            return await sub.next(timeout=WAIT_S)
        finally:
            await again.close()
            await first.close()
            await until(lambda: federation.total(SUBSCRIPTIONS) == 0, "withdrawn")
            await federation.quiescent(WAIT_S)

    assert asyncio.run(scenario()).payload == b"near enough now"
