"""Known answers on the 3-broker test federation, deploy/federations/three.geojson."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from routing_testkit import check_workload, workloads

from geofed.routing import (
    Federation,
    TraceOp,
    latlon,
    parse_wkt,
)

FEDERATION_FILE = Path(__file__).resolve().parents[3] / "deploy" / "federations" / "three.geojson"


@pytest.fixture(scope="module")
def three() -> Federation:
    return Federation.load(FEDERATION_FILE)


def test_brokers_endpoints_and_sites(three: Federation) -> None:
    assert three.ids == ("ap", "eu", "us")
    assert three.gap is None
    ports = {b.id: (b.endpoint, b.client_endpoint) for b in three}
    assert ports == {
        "eu": ("127.0.0.1:7401", "127.0.0.1:7400"),
        "us": ("127.0.0.1:7411", "127.0.0.1:7410"),
        "ap": ("127.0.0.1:7421", "127.0.0.1:7420"),
    }
    for b in three:
        assert b.site is not None and three.responsible(b.site) == b.id
    # The areas tile the globe: total area of the lon/lat rectangle.
    assert sum(b.area.geometry.area for b in three) == pytest.approx(360.0 * 180.0)


@pytest.mark.parametrize(
    ("lat", "lon", "broker"),
    [
        (48.8566, 2.3522, "eu"),  # Paris
        (-33.9249, 18.4241, "eu"),  # Cape Town
        (40.7128, -74.006, "us"),  # New York
        (-23.5505, -46.6333, "us"),  # São Paulo
        (21.3069, -157.8583, "us"),  # Honolulu, across the antimeridian from Asia
        (35.6812, 139.7671, "ap"),  # Tokyo
        (-33.8688, 151.2093, "ap"),  # Sydney
    ],
)
def test_cities(three: Federation, lat: float, lon: float, broker: str) -> None:
    assert three.responsible(latlon(lat, lon)) == broker


def test_digest_is_independent_of_feature_order(three: Federation) -> None:
    obj = json.loads(FEDERATION_FILE.read_text(encoding="utf-8"))
    random.Random(3).shuffle(obj["features"])
    assert Federation.from_geojson(obj).digest == three.digest
    assert Federation.load(FEDERATION_FILE).digest == three.digest


def test_a_european_geofence_stays_in_europe(three: Federation) -> None:
    fence = parse_wkt("POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))")
    assert three.brokers_meeting(fence) == {"eu"}
    assert three.brokers_meeting(None) == {"ap", "eu", "us"}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ops=workloads(max_ops=25))
def test_every_strategy_equals_the_central_matcher_on_three(
    three: Federation, ops: list[TraceOp]
) -> None:
    check_workload(three, ops)
