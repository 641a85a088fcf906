"""Geo-context on MQTT packets (`geofed.node._mqtt_geo`): properties and the $geofed/ prefix."""

from __future__ import annotations

import pytest

from geofed.node._mqtt_geo import GeoTopic, split_topic, subscription_id
from geofed.routing import InvalidInput, LatLon
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import geofence_from_text, geofence_to_pb
from geofed.wire import location_from_text as parse_location


def geofence_pb(text: str, field: str) -> gpb.Geofence:
    """A geofence property as the MQTT front end reads it."""
    return geofence_to_pb(geofence_from_text(text, field))


def test_a_location_is_lat_comma_lon() -> None:
    assert parse_location("48.85,2.35", "geofed-location") == LatLon(48.85, 2.35)
    assert parse_location(" -33.9 , 151.2 ", "p") == LatLon(-33.9, 151.2)


@pytest.mark.parametrize("text", ["48.85", "a,b", "91,0", "0,181", "nan,0", "1,2,3", ""])
def test_a_bad_location_names_the_property(text: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_location(text, "geofed-location")
    assert err.value.field.startswith("geofed-location")


def test_geofence_forms() -> None:
    assert geofence_pb("", "p").WhichOneof("shape") is None
    assert geofence_pb("world", "p").WhichOneof("shape") is None
    circle = geofence_pb("circle:48.85,2.35,50000", "p").circle
    assert (circle.center.lat, circle.center.lon, circle.radius_m) == (48.85, 2.35, 50000)
    wkt = "POLYGON((0 40, 20 40, 20 55, 0 55, 0 40))"
    assert geofence_pb(wkt, "p").wkt == wkt
    geojson = '{"type": "Polygon", "coordinates": []}'
    assert geofence_pb(geojson, "p").geojson == geojson
    with pytest.raises(InvalidInput) as err:
        geofence_pb("circle:1,2", "geofed-geofence")
    assert err.value.field == "geofed-geofence"


def test_roaming_geofences_in_the_property_and_the_prefix() -> None:
    assert geofence_pb("roam:circle:2000", "geofed-geofence").roaming.radius_m == 2000
    geo = split_topic("$geofed/loc=1,2/fence=roam:polygon:0 0, 10 0, 0 10/parking/#")
    assert geo == GeoTopic("parking/#", "1,2", "roam:polygon:0 0, 10 0, 0 10")
    assert geo.geofence is not None
    ring = geofence_pb(geo.geofence, "$geofed/fence=").roaming.polygon.vertices
    assert [(v.east_m, v.north_m) for v in ring] == [(0, 0), (10, 0), (0, 10), (0, 0)]
    with pytest.raises(InvalidInput) as err:
        geofence_pb("roam:circle:0", "geofed-geofence")
    assert err.value.field == "geofed-geofence.radius_m"


def test_the_geofed_prefix_carries_location_and_geofence_before_the_topic() -> None:
    assert split_topic("sensors/#") == GeoTopic("sensors/#")
    assert split_topic("$SYS/x") == GeoTopic("$SYS/x")
    assert split_topic("$geofed/loc=48.85,2.35/sensors/#") == GeoTopic("sensors/#", "48.85,2.35")
    fence = "POLYGON((0 40, 20 40, 20 55, 0 55, 0 40))"
    assert split_topic(f"$geofed/fence={fence}/loc=1,2/a/b") == GeoTopic("a/b", "1,2", fence)
    assert split_topic("$geofed/loc=1,2") == GeoTopic("", "1,2")
    for bad in ("$geofed/sensors", "$geofed/loc=1,2/loc=3,4/a"):
        with pytest.raises(InvalidInput) as err:
            split_topic(bad)
        assert err.value.field == "$geofed/"


def test_a_filter_is_its_subscription_id_unless_it_cannot_be_one() -> None:
    assert subscription_id("sensors/+/temp") == "sensors/+/temp"
    long = "a/" * 200
    assert subscription_id(long).startswith("mqtt-sha256:")
    assert subscription_id(long) == subscription_id(long) != subscription_id(long + "b")
