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
from hypothesis import HealthCheck, given, settings
from routing_testkit import gap_federation, tiling_federation, workloads

from geofed.routing import (
    STRATEGIES,
    Federation,
    LatLon,
    Simulator,
    TraceOp,
    predict,
    reference_deliveries,
    simulate,
)

FEDERATIONS = {"tiling": tiling_federation(), "gap": gap_federation()}

# 2 federations x 200 workloads, each run under all four strategies.
EQUIVALENCE = settings(
    max_examples=int(__import__("os").environ.get("EQ_N", 200)),
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


@pytest.mark.parametrize("fed_name", sorted(FEDERATIONS))
@EQUIVALENCE
@given(ops=workloads())
def test_every_strategy_equals_the_central_matcher(fed_name: str, ops: list[TraceOp]) -> None:
    federation = FEDERATIONS[fed_name]
    n = len(federation)
    expected = reference_deliveries(ops)
    bounds = _lower_bounds(federation, ops)
    events = sum(op.op == "publish" for op in ops)
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
