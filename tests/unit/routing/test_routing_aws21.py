"""Known answers on the 21-region AWS (2020) federation, deploy/federations/aws-2020.geojson.

Run with ``pytest -s`` to see the brokers each geofence reaches and the
messages saved against flooding (20 remote brokers per event).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from routing_testkit import check_workload, workloads

from geofed.routing import (
    STRATEGIES,
    Federation,
    TraceOp,
    circle,
    latlon,
    parse_wkt,
    predict,
    reference_deliveries,
    simulate,
    strategy_for,
)

FEDERATION_FILE = (
    Path(__file__).resolve().parents[3] / "deploy" / "federations" / "aws-2020.geojson"
)
GEOFENCE_STRATEGIES = ("event-geofence", "subscription-geofence")

# Mainland Europe west of 30°E, Lisbon to Helsinki, Crete to the North Cape.
EUROPE = "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"
EUROPEAN_REGIONS = {"eu-west-1", "eu-west-2", "eu-west-3", "eu-central-1", "eu-north-1"}
TOKYO = latlon(35.6812, 139.7671)


@pytest.fixture(scope="module")
def aws() -> Federation:
    return Federation.load(FEDERATION_FILE)


def test_the_file_has_21_regions_and_no_gap(aws: Federation) -> None:
    assert len(aws) == 21
    assert aws.gap is None
    # Each region's own site lies in its own area.
    for broker in aws:
        assert broker.site is not None
        assert aws.responsible(broker.site) == broker.id


@pytest.mark.parametrize(
    ("lat", "lon", "region"),
    [
        (48.8566, 2.3522, "eu-west-3"),  # Paris
        (52.52, 13.405, "eu-central-1"),  # Berlin
        (53.35, -6.26, "eu-west-1"),  # Dublin
        (59.33, 18.07, "eu-north-1"),  # Stockholm
        (40.7128, -74.006, "us-east-1"),  # New York
        (47.6062, -122.3321, "us-west-2"),  # Seattle
        (-22.9068, -43.1729, "sa-east-1"),  # Rio de Janeiro
        (-37.8136, 144.9631, "ap-southeast-2"),  # Melbourne
        (35.6812, 139.7671, "ap-northeast-1"),  # Tokyo
        (25.2048, 55.2708, "me-south-1"),  # Dubai
        (21.3069, -157.8583, "us-west-1"),  # Honolulu
    ],
)
def test_cities_belong_to_their_region(
    aws: Federation, lat: float, lon: float, region: str
) -> None:
    assert aws.responsible(latlon(lat, lon)) == region


def test_a_geofence_around_mainland_europe(aws: Federation) -> None:
    fence = parse_wkt(EUROPE)
    met = aws.brokers_meeting(fence)
    # The answer routing gives equals a direct shapely check against each area.
    direct = {b.id for b in aws if b.area.geometry.intersects(fence.geometry)}
    assert met == direct
    assert met >= EUROPEAN_REGIONS
    assert not {"ap-northeast-1", "us-west-2", "sa-east-1", "us-east-1", "ap-southeast-2"} & met

    origin = "eu-central-1"
    remote = strategy_for("event-geofence", aws).event_targets(origin, fence)
    assert remote == met - {origin}
    subs = strategy_for("subscription-geofence", aws).subscription_targets(origin, fence)
    assert subs == remote
    flooding = strategy_for("flooding-events", aws).event_targets(origin, fence)
    assert len(flooding) == 20
    print(
        f"\nEurope {EUROPE}\n  meets {len(met)} brokers: {', '.join(sorted(met))}"
        f"\n  an event published at {origin}: {len(remote)} messages instead of "
        f"{len(flooding)} under flooding ({1 - len(remote) / len(flooding):.0%} saved)"
    )


def test_a_10_km_circle_around_tokyo_stays_home(aws: Federation) -> None:
    fence = circle(TOKYO, 10_000.0)
    assert aws.responsible(TOKYO) == "ap-northeast-1"
    assert aws.brokers_meeting(fence) == {"ap-northeast-1"}
    for name in GEOFENCE_STRATEGIES:
        strat = strategy_for(name, aws)
        assert strat.event_targets("ap-northeast-1", fence) == frozenset()
        assert strat.subscription_targets("ap-northeast-1", fence) == frozenset()
    print("\nTokyo 10 km circle: responsible ap-northeast-1, 0 remote messages instead of 20")


@pytest.mark.parametrize("name", GEOFENCE_STRATEGIES)
def test_a_world_geofence_reaches_every_other_region(aws: Federation, name: str) -> None:
    strat = strategy_for(name, aws)
    for origin in aws.ids:
        reached = (
            strat.event_targets(origin, None)
            if not strat.matches_at_publisher
            else strat.subscription_targets(origin, None)
        )
        assert reached == set(aws.ids) - {origin}
        assert len(reached) == 20


def test_cost_of_a_small_european_workload(aws: Federation) -> None:
    # Two subscribers in Paris and Stockholm; a Berlin publisher with a
    # European event geofence and one with a Tokyo-only one.
    europe = parse_wkt(EUROPE)
    ops = [
        TraceOp(0, "subscribe", "paris", latlon(48.8566, 2.3522), "s1", "news/#", europe),
        TraceOp(1, "subscribe", "sthlm", latlon(59.33, 18.07), "s2", "news/+", None),
        TraceOp(2, "publish", "berlin", latlon(52.52, 13.405), "e1", "news/eu", europe),
        TraceOp(3, "publish", "berlin", latlon(52.52, 13.405), "e2", "news/jp", circle(TOKYO, 1e4)),
    ]
    assert reference_deliveries(ops) == [("e1", "s1"), ("e1", "s2")]
    print()
    for name in STRATEGIES:
        result = simulate(aws, name, ops)
        report = predict(aws, name, ops)
        assert sorted(result.deliveries) == [("e1", "s1"), ("e1", "s2")]
        assert report.messages == +result.messages
        assert report.lower_bound_total == 2  # eu-west-3 and eu-north-1 for e1
        kinds = dict(sorted(result.by_kind().items()))
        print(f"  {name:24} {result.total_messages:3} messages {kinds}")
    assert simulate(aws, "flooding-events", ops).by_kind()["event"] == 40
    # e1 goes to the other brokers Europe meets, e2 to Tokyo only.
    expected_events = len(aws.brokers_meeting(europe) - {"eu-central-1"}) + 1
    assert simulate(aws, "event-geofence", ops).by_kind()["event"] == expected_events


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ops=workloads(max_ops=20))
def test_every_strategy_equals_the_central_matcher_on_aws(
    aws: Federation, ops: list[TraceOp]
) -> None:
    check_workload(aws, ops)
