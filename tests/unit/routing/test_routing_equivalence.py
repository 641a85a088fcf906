"""The main acceptance property: every strategy delivers what a central matcher does.

Hypothesis generates random workloads (subscribes, moves across broker areas,
publishes, unsubscribes of live and unknown ids, re-subscribes that change the
geofence) over a federation that tiles the globe and one that leaves a gap.
For each of the four strategies the simulated federation must deliver exactly
the reference deliveries (recall 1, precision 1, no duplicates), and the cost
model must predict exactly the messages the simulation sent.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st
from routing_testkit import (
    boundary_fences,
    boundary_points,
    gap_federation,
    points,
    rect_wkt,
    tiling_federation,
    workloads,
)

from geofed.routing import (
    STRATEGIES,
    Federation,
    LatLon,
    Simulator,
    TraceOp,
    latlon,
    parse_wkt,
    predict,
    reference_deliveries,
    simulate,
)

FEDERATIONS = {"tiling": tiling_federation(), "gap": gap_federation()}

# Hypothesis may shrink a failing workload for up to 5 minutes: leave it the
# time to report a small counterexample instead of pytest-timeout's traceback.
SHRINK_TIMEOUT = pytest.mark.timeout(900)

# 2 federations x 200 workloads, each run under all four strategies.
EQUIVALENCE = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _lower_bounds(federation: Federation, ops: list[TraceOp]) -> dict[str, tuple[str, set[str]]]:
    """Per event id: (origin broker, remote brokers hosting a matching subscriber).

    Computed from the reference deliveries and the clients' locations alone,
    not from the routing code's own bookkeeping.
    """
    delivered: dict[str, set[str]] = {}
    for event_id, sub_id in reference_deliveries(ops):
        delivered.setdefault(event_id, set()).add(sub_id)
    where: dict[str, LatLon] = {}
    owner: dict[str, str] = {}
    out: dict[str, tuple[str, set[str]]] = {}
    for op in ops:
        if op.location is not None:
            where[op.client] = op.location
        if op.op == "subscribe":
            owner.setdefault(op.id, op.client)
        elif op.op == "unsubscribe" and owner.get(op.id) == op.client:
            del owner[op.id]
        elif op.op == "publish":
            origin = federation.responsible(where[op.client])
            homes = {federation.responsible(where[owner[s]]) for s in delivered.get(op.id, ())}
            out[op.id] = (origin, homes - {origin})
    return out


@SHRINK_TIMEOUT
@pytest.mark.parametrize("fed_name", sorted(FEDERATIONS))
@EQUIVALENCE
@given(ops=workloads())
def test_every_strategy_equals_the_central_matcher(fed_name: str, ops: list[TraceOp]) -> None:
    check_workload(FEDERATIONS[fed_name], ops)


@SHRINK_TIMEOUT
@settings(EQUIVALENCE, max_examples=100)
@given(ops=workloads(anchor_points=boundary_points, fences_near=boundary_fences))
def test_every_strategy_equals_the_central_matcher_on_boundaries(ops: list[TraceOp]) -> None:
    # Clients and geofences on area edges and on the antimeridian, where the
    # tie-break and the ±180 seam decide who is responsible.
    check_workload(FEDERATIONS["tiling"], ops)


def _describe(
    federation: Federation,
    ops: list[TraceOp],
    expected: list[tuple[str, str]],
    bounds: dict[str, tuple[str, set[str]]],
) -> None:
    """Label the workload (see ``pytest --hypothesis-show-statistics``)."""
    home: dict[str, str] = {}
    rehomed = 0
    for op in ops:
        if op.location is not None:
            new = federation.responsible(op.location)
            rehomed += home.get(op.client, new) != new
            home[op.client] = new
    remote = sum(len(h) for _, h in bounds.values())
    event(f"deliveries: {'none' if not expected else 'some'}")
    event(f"remote subscriber brokers: {'some' if remote else 'none'}")
    # Steer generation towards workloads where events must cross brokers.
    target(float(remote), label="remote subscriber brokers")
    event(f"clients re-homed: {'some' if rehomed else 'none'}")


def check_workload(federation: Federation, ops: list[TraceOp]) -> None:
    """Every strategy against the reference; the cost model against the simulation."""
    n = len(federation)
    expected = reference_deliveries(ops)
    bounds = _lower_bounds(federation, ops)
    events = sum(op.op == "publish" for op in ops)
    _describe(federation, ops, expected, bounds)
    for name in STRATEGIES:
        # Step through the trace to see each event's own messages.
        sim = Simulator(federation, name)
        per_event: dict[str, int] = {}
        for op in ops:
            before = sim.result.by_kind()
            sim.apply(op)
            if op.op == "publish":
                after = sim.result.by_kind()
                per_event[op.id] = sum(after[k] - before[k] for k in ("event", "delivery"))
        result = sim.result
        assert not [e for e in result.errors if "subscription id" not in e and "has no" not in e]

        assert sorted(result.deliveries) == sorted(expected), name
        assert max(Counter(result.deliveries).values(), default=1) == 1, name
        # The one-shot entry point agrees with the stepped run.
        assert simulate(federation, name, ops).deliveries == result.deliveries, name

        report = predict(federation, name, ops)
        assert report.messages == +result.messages, name
        assert report.events == events
        assert report.lower_bound_total == sum(len(h) for _, h in bounds.values()), name

        for event_id, (_origin, homes) in bounds.items():
            # The lower bound holds for every exact strategy.
            assert len(homes) <= per_event[event_id], (name, event_id)
        # Per broker pair too: every event dst needs must reach it somehow.
        sent = Counter(
            {(s, d): c for (k, s, d), c in result.messages.items() if k in ("event", "delivery")}
        )
        for pair, needed in report.lower_bound.items():
            assert needed <= sent[pair], (name, pair)

        if name == "flooding-events":
            assert all(count == n - 1 for count in per_event.values())
            assert result.by_kind()["event"] == (n - 1) * events
            assert report.by_kind()["event"] == (n - 1) * events
            assert result.by_kind()["subscribe"] == 0


@SHRINK_TIMEOUT
@settings(EQUIVALENCE, max_examples=80)
@given(
    lat=st.floats(-89.0, 89.0),
    seam_lon=st.sampled_from([180.0, -180.0]),
    box_west=st.sampled_from([-180.0, 179.5]),
    elsewhere=points,
    sub_fenced=st.booleans(),
)
def test_antimeridian_is_one_meridian_for_routing(
    lat: float, seam_lon: float, box_west: float, elsewhere: LatLon, sub_fenced: bool
) -> None:
    # A client exactly on ±180 and a geofence that touches the antimeridian
    # from one side only; north of the equator the brokers on either side
    # differ. Either the subscriber sits on the seam under such an event
    # geofence, or the publisher does under such a subscription geofence:
    # the event must be delivered under every strategy.
    box = parse_wkt(rect_wkt(box_west, lat - 0.5, box_west + 0.5, lat + 0.5))
    seam = latlon(lat, seam_lon)
    if sub_fenced:
        sub, pub, sub_fence, event_fence = elsewhere, seam, box, None
    else:
        sub, pub, sub_fence, event_fence = seam, elsewhere, None, box
    ops = [
        TraceOp(0.0, "subscribe", "sub", sub, "s", "t/#", sub_fence),
        TraceOp(1.0, "publish", "pub", pub, "e", "t/x", event_fence),
    ]
    assert reference_deliveries(ops) == [("e", "s")]
    check_workload(FEDERATIONS["tiling"], ops)
