"""The main acceptance property: every strategy delivers what a central matcher does.

Hypothesis generates random workloads (subscribes, moves across broker areas,
publishes, unsubscribes of live and unknown ids, re-subscribes that change the
geofence) over a federation that tiles the globe and one that leaves a gap.
For each of the four strategies the simulated federation must deliver exactly
the reference deliveries (recall 1, precision 1, no duplicates), and the cost
model must predict exactly the messages the simulation sent.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routing_testkit import (
    boundary_fences,
    boundary_points,
    check_workload,
    gap_federation,
    points,
    rect_wkt,
    roamings,
    tiling_federation,
    workloads,
)

from geofed.routing import (
    LatLon,
    TraceOp,
    latlon,
    parse_wkt,
    reference_deliveries,
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


@SHRINK_TIMEOUT
@settings(EQUIVALENCE, max_examples=150)
@given(
    ops=workloads(
        anchor_points=boundary_points,
        roaming_shapes=roamings(scales=(20_000.0, 100_000.0, 400_000.0)),
        near_m=400_000.0,
        roaming_share=1,
    )
)
def test_every_strategy_equals_the_central_matcher_with_roaming_geofences(
    ops: list[TraceOp],
) -> None:
    # Subscribers with roaming geofences about as large as their moves, near
    # area edges: a move within an area shifts which publishers the geofence
    # covers at a remote broker holding a copy, and moves add and drop such
    # brokers. A remote copy left where the subscriber was would be caught.
    check_workload(FEDERATIONS["tiling"], ops)


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
