"""Randomized workloads through real nodes equal the oracle and the cost model.

One federation per strategy serves many hypothesis examples. Each example uses
fresh client and subscription ids, replays through real gRPC clients with a
barrier after every action (no inter-broker message in flight), and compares
the deliveries with the central oracle and the metric deltas of inter-broker
messages with the routing cost model, exactly.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geofed.bench import LocalFederation, Replayer, peer_message_counts, wait_quiescent
from geofed.routing import (
    STRATEGIES,
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
            ops.append(
                TraceOp(
                    step, "subscribe", client, where, sid, draw(st.sampled_from(FILTERS)), fence
                )
            )
            live[sid] = client
        elif kind == "publish":
            topic = draw(st.sampled_from(TOPICS))
            ops.append(TraceOp(step, "publish", client, where, f"r{run}e{step}", topic, fence, 8))
        elif kind == "move":
            ops.append(TraceOp(step, "move", client, where))
        elif live:
            sid = draw(st.sampled_from(sorted(live)))
            ops.append(TraceOp(step, "unsubscribe", live.pop(sid), id=sid))
    return ops


@pytest.fixture(scope="module", params=list(STRATEGIES))
def federation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFederation]:
    with LocalFederation(THREE, request.param, tmp_path_factory.mktemp(request.param)) as fed:
        yield fed


def _sent(fed: LocalFederation) -> Counter[tuple[str, str, str]]:
    urls = {b: n.metrics_url for b, n in fed.nodes.items()}
    return Counter(
        {k: int(v) for k, v in peer_message_counts(urls)["sent"].items() if k[0] != "control"}
    )


async def _replay(
    fed: LocalFederation, ops: list[TraceOp]
) -> tuple[list[tuple[str, str]], Counter[tuple[str, str, str]]]:
    urls = {b: n.metrics_url for b, n in fed.nodes.items()}
    r = Replayer(fed.federation, barrier=lambda: wait_quiescent(urls))
    before = await asyncio.to_thread(_sent, fed)
    try:
        await r.run(ops)
        # Every delivery was pushed before the barrier returned; let the streams drain.
        await asyncio.sleep(0.1)
        after = await asyncio.to_thread(_sent, fed)
    finally:
        await r.close()  # cancels the streams: their subscriptions are withdrawn
        await wait_quiescent(urls)
    assert not r.errors, r.errors
    return r.deliveries, after - before


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=workloads())
def test_live_federation_matches_oracle_and_cost_model(
    federation: LocalFederation, ops: list[TraceOp]
) -> None:
    deliveries, sent = asyncio.run(_replay(federation, ops))
    expected = reference_deliveries(ops)
    assert Counter(deliveries) == Counter(expected)  # recall 1, precision 1, no duplicates
    predicted = predict(federation.federation, federation.strategy, ops)
    assert sent == +predicted.messages
