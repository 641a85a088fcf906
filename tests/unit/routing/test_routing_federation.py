"""Federation: who is responsible where, which brokers a geofence meets, the digest."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from routing_testkit import gap_federation, geofences, points, tiling_federation
from shapely.geometry import Point

from geofed.routing import (
    BrokerInfo,
    Federation,
    Geofence,
    LatLon,
    NotFound,
    circle,
    latlon,
    parse_wkt,
)


def _box(w: float, s: float, e: float, n: float) -> Geofence:
    return parse_wkt(f"POLYGON(({w} {s}, {e} {s}, {e} {n}, {w} {n}, {w} {s}))")


def _four_quadrants() -> Federation:
    # Ids deliberately not in geometric order.
    return Federation(
        [
            BrokerInfo("ne", _box(0, 0, 180, 90)),
            BrokerInfo("nw", _box(-180, 0, 0, 90)),
            BrokerInfo("se", _box(0, -90, 180, 0)),
            BrokerInfo("sw", _box(-180, -90, 0, 0)),
        ]
    )


# --------------------------------------------------------------------------
# responsible()


@pytest.mark.parametrize(
    ("lat", "lon", "owner"),
    [
        (45.0, 90.0, "ne"),
        (-45.0, -90.0, "sw"),
        (0.0, 90.0, "ne"),  # ne / se boundary: smallest id
        (0.0, -90.0, "nw"),  # nw / sw
        (45.0, 0.0, "ne"),  # ne / nw
        (-45.0, 0.0, "se"),  # se / sw
        (0.0, 0.0, "ne"),  # all four meet: smallest of four
        (0.0, 180.0, "ne"),  # ±180 is one meridian: ne, nw, se and sw all touch it
        (0.0, -180.0, "ne"),
        (-45.0, 180.0, "se"),  # se (at 180) and sw (at -180)
        (-45.0, -180.0, "se"),
        (90.0, 10.0, "ne"),
        (-90.0, -10.0, "sw"),
    ],
)
def test_responsible_breaks_ties_by_smallest_id(lat: float, lon: float, owner: str) -> None:
    assert _four_quadrants().responsible(latlon(lat, lon)) == owner


def test_shared_slanted_boundary_belongs_to_the_smallest_id() -> None:
    fed = tiling_federation()
    # a / b share the edge from (60, -90) to (30, 90): lon = 45 - lat / 6.
    for lat, lon in [(0.0, 45.0), (45.0, 37.5), (-45.0, 52.5)]:
        assert fed.responsible(latlon(lat, lon)) == "a"
        assert fed.responsible(latlon(lat, lon + 1e-9)) == "b"
    # North of the equator the antimeridian separates b (at 180) from c (at -180).
    assert fed.responsible(latlon(10.0, 180.0)) == "b"
    assert fed.responsible(latlon(10.0, -180.0)) == "b"
    assert fed.responsible(latlon(10.0, -179.99)) == "c"
    assert fed.responsible(latlon(-10.0, 180.0)) == "c"


@pytest.mark.parametrize(
    ("lat", "lon", "owner"),
    [
        (50.0, 10.0, "eu"),
        (30.0, 100.0, "as"),
        (0.0, 170.0, "pac"),
        (0.0, -170.0, "pac"),
        (50.0, 45.0, "eu"),  # gap: 5 degrees east of eu, 15 west of as
        (50.0, 55.0, "as"),  # gap: 5 west of as
        (0.0, -100.0, "pac"),  # gap: nearest is pac, 50 degrees east of -150
        (-70.0, 175.0, "pac"),  # gap south of pac
        (80.0, 0.0, "eu"),
        (20.0, 50.0, "as"),  # gap: 10 from as (lon 60), 10.77 from eu corner
    ],
)
def test_location_in_a_gap_belongs_to_the_nearest_area(lat: float, lon: float, owner: str) -> None:
    assert gap_federation().responsible(latlon(lat, lon)) == owner


def test_nearest_area_looks_across_the_antimeridian() -> None:
    fed = Federation(
        [BrokerInfo("x", _box(170, -10, 179, 10)), BrokerInfo("y", _box(-100, -10, 0, 10))]
    )
    # -175 is 4 degrees from x across ±180, 75 degrees from y.
    assert fed.responsible(latlon(0.0, -175.0)) == "x"


def test_equidistant_gap_location_goes_to_the_smallest_id() -> None:
    fed = Federation([BrokerInfo("z", _box(10, 0, 20, 10)), BrokerInfo("m", _box(-20, 0, -10, 10))])
    assert fed.responsible(latlon(5.0, 0.0)) == "m"


@settings(max_examples=200, deadline=None)
@given(where=points)
def test_responsible_covers_the_location_where_the_areas_tile(where: LatLon) -> None:
    fed = tiling_federation()
    owner = fed.broker(fed.responsible(where))
    assert owner.area.covers(where)
    covering = [b.id for b in fed if b.area.covers(where)]
    assert owner.id == min(covering)


# --------------------------------------------------------------------------
# brokers_meeting()


def test_brokers_meeting_without_a_gap() -> None:
    fed = _four_quadrants()
    assert fed.gap is None
    assert fed.brokers_meeting(None) == {"ne", "nw", "se", "sw"}
    assert fed.brokers_meeting(_box(10, 10, 20, 20)) == {"ne"}
    assert fed.brokers_meeting(_box(-10, 10, 10, 20)) == {"ne", "nw"}
    assert fed.brokers_meeting(_box(0, 10, 10, 20)) == {"ne", "nw"}  # touching counts
    assert fed.brokers_meeting(circle(latlon(0, 0), 1000)) == {"ne", "nw", "se", "sw"}
    # Across the antimeridian.
    assert fed.brokers_meeting(parse_wkt("POLYGON((170 5, -170 5, -170 6, 170 6, 170 5))")) == {
        "ne",
        "nw",
    }


def test_brokers_meeting_a_geofence_flush_with_the_antimeridian() -> None:
    fed = tiling_federation()
    # Touches -180 only, north of the equator: the points of it on the
    # antimeridian belong to b, whose area reaches 180 there.
    west_side = _box(-180, 5, -175, 15)
    assert fed.brokers_meeting(west_side) == {"b", "c"}
    east_side = _box(175, 5, 180, 15)
    assert fed.brokers_meeting(east_side) == {"b", "c"}
    assert fed.brokers_meeting(_box(-179, 5, -175, 15)) == {"c"}


def test_brokers_meeting_a_gap_is_every_broker() -> None:
    fed = gap_federation()
    assert fed.gap is not None
    assert fed.brokers_meeting(_box(0, 40, 10, 50)) == {"eu"}  # inside eu
    assert fed.brokers_meeting(_box(0, 40, 10, 80)) == {"eu", "as", "pac"}  # reaches the gap
    assert fed.brokers_meeting(_box(-100, 0, -90, 10)) == {"eu", "as", "pac"}  # gap only
    assert fed.brokers_meeting(None) == {"eu", "as", "pac"}


@settings(max_examples=200, deadline=None)
@given(fence=geofences(), where=points)
def test_the_responsible_broker_of_a_covered_point_is_met(
    fence: Geofence | None, where: LatLon
) -> None:
    # The property routing rests on: if a geofence covers a location, the
    # location's broker is among the brokers the geofence meets.
    for fed in (tiling_federation(), gap_federation()):
        if fence is None or fence.covers(where):
            assert fed.responsible(where) in fed.brokers_meeting(fence)


def test_brokers_meeting_is_cached_by_geofence_text() -> None:
    fed = _four_quadrants()
    first = fed.brokers_meeting(_box(10, 10, 20, 20))
    assert fed.brokers_meeting(_box(10, 10, 20, 20)) is first


# --------------------------------------------------------------------------
# Digest, loading, round trip


def _feature(broker: BrokerInfo) -> dict[str, Any]:
    return {
        "type": "Feature",
        "geometry": broker.area.geometry.__geo_interface__,
        "properties": {"id": broker.id, "endpoint": f"127.0.0.1:{7000 + len(broker.id)}"},
    }


def test_digest_is_stable_and_independent_of_feature_order() -> None:
    brokers = list(_four_quadrants())
    features = [_feature(b) for b in brokers]
    digests = set()
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(features)
        fed = Federation.from_geojson(
            json.loads(json.dumps({"type": "FeatureCollection", "features": features}))
        )
        digests.add(fed.digest)
        assert fed.ids == ("ne", "nw", "se", "sw")
    assert len(digests) == 1
    assert digests == {_four_quadrants().digest}
    assert len(digests.pop()) == 64


def test_digest_changes_with_an_area_or_an_id() -> None:
    base = _four_quadrants()
    moved = Federation(
        [BrokerInfo(b.id, _box(0, 0, 90, 90)) if b.id == "ne" else b for b in _four_quadrants()]
    )
    renamed = Federation(
        [BrokerInfo("ne2", b.area) if b.id == "ne" else b for b in _four_quadrants()]
    )
    assert len({base.digest, moved.digest, renamed.digest}) == 3


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    fed = Federation(
        [
            BrokerInfo(
                "a", _box(-180, -90, 0, 90), "10.0.0.1:7401", "10.0.0.1:7400", latlon(1, 2), "A"
            ),
            BrokerInfo("b", _box(0, -90, 180, 90)),
        ]
    )
    path = tmp_path / "f.geojson"
    path.write_text(json.dumps(fed.to_geojson()), encoding="utf-8")
    again = Federation.load(path)
    assert again.digest == fed.digest
    a = again.broker("a")
    assert (a.endpoint, a.client_endpoint, a.site, a.name) == (
        "10.0.0.1:7401",
        "10.0.0.1:7400",
        latlon(1, 2),
        "A",
    )
    assert again.broker("b").endpoint == ""
    moved = again.with_endpoints({"b": ("127.0.0.1:1", "127.0.0.1:2")})
    assert moved.broker("b").endpoint == "127.0.0.1:1" and moved.digest == fed.digest
    assert "a" in again and "zz" not in again and len(again) == 2
    with pytest.raises(NotFound):
        again.broker("zz")


def test_gap_below_the_tolerance_is_ignored() -> None:
    # Two areas that miss each other by a sliver of 1e-12 degrees.
    fed = Federation(
        [BrokerInfo("a", _box(-180, -90, 0, 90)), BrokerInfo("b", _box(1e-12, -90, 180, 90))]
    )
    assert fed.gap is None


def test_areas_are_checked_against_shapely_directly() -> None:
    fed = gap_federation()
    pac = fed.broker("pac").area.geometry
    assert pac.geom_type == "MultiPolygon"
    assert pac.covers(Point(170, 0)) and pac.covers(Point(-160, 0))


def test_to_geojson_is_json_shaped_and_reads_back_directly() -> None:
    fed = Federation(
        [BrokerInfo("a", _box(-180, -90, 0, 90)), BrokerInfo("b", _box(0, -90, 180, 90))]
    )
    doc = fed.to_geojson()
    assert doc == json.loads(json.dumps(doc))  # lists, not tuples
    assert Federation.from_geojson(doc).digest == fed.digest
