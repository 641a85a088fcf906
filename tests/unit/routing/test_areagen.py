"""Tests for the broker-area generator: spherical Voronoi cells as a federation file."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import shapely
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shapely.geometry import shape

from geofed.routing import Site, generate_areas, read_sites

FEDERATIONS = Path(__file__).resolve().parents[3] / "deploy" / "federations"
WORLD_AREA = 360.0 * 180.0
# Boundaries are polylines standing in for great-circle arcs. With the default
# step_deg=0.5 they stay within ~0.0011 degrees of arc of the true bisectors
# (measured over thousands of random and degenerate site sets); 0.005 degrees
# (~550 m) leaves room without hiding a wrongly assigned region.
BOUNDARY_TOL_DEG = 0.005
SLOW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def unit(lon: Any, lat: Any) -> np.ndarray:
    lon, lat = np.radians(lon), np.radians(lat)
    return np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=-1)


def site_vectors(sites: list[Site]) -> np.ndarray:
    return unit(np.array([s.lon for s in sites]), np.array([s.lat for s in sites]))


def geometries(fc: dict[str, Any]) -> list[Any]:
    return [shape(feature["geometry"]) for feature in fc["features"]]


def bisector_distance_deg(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Angular distance of points x from the great circle equidistant from sites a and b."""
    normal = a - b
    sine = np.abs(np.sum(x * normal, axis=-1)) / np.linalg.norm(normal, axis=-1)
    degrees: np.ndarray = np.degrees(np.arcsin(np.clip(sine, 0.0, 1.0)))
    return degrees


def assert_tiles_world(fc: dict[str, Any]) -> None:
    """Valid areas inside the lon/lat rectangle, no overlap, no gap."""
    geoms = geometries(fc)
    for geom in geoms:
        assert shapely.is_valid(geom), shapely.is_valid_reason(geom)
        assert not geom.is_empty
        xmin, ymin, xmax, ymax = geom.bounds
        assert xmin >= -180 and xmax <= 180 and ymin >= -90 and ymax <= 90
    for a, b in itertools.combinations(geoms, 2):
        assert shapely.intersection(a, b).area <= 1e-9
    assert shapely.union_all(geoms).area == pytest.approx(WORLD_AREA, abs=1e-6)


def assert_boundaries_on_bisectors(fc: dict[str, Any], sites: list[Site]) -> None:
    """Every point of an area boundary (off the world border) lies on a true Voronoi edge.

    A point inside the Voronoi cell of its nearest site a is at least as far from
    the cell's border as from the nearest bisector of a and another site; on the
    exact border that distance is 0.
    """
    s = site_vectors(sites)
    for geom in geometries(fc):
        for ring in shapely.get_rings(shapely.get_parts(geom)):
            c = shapely.get_coordinates(ring)
            for fraction in (0.25, 0.5, 0.75):
                p = c[:-1] + fraction * (c[1:] - c[:-1])
                border = (np.abs(p[:, 0]) == 180) | (np.abs(p[:, 1]) == 90)
                x = unit(p[~border, 0], p[~border, 1])
                if len(x) == 0:
                    continue
                nearest = np.argmax(x @ s.T, axis=1)
                dist = np.full((len(x), len(s)), np.inf)
                for k in range(len(s)):
                    other = nearest != k
                    dist[other, k] = bisector_distance_deg(x[other], s[nearest[other]], s[k])
                assert np.min(dist, axis=1).max() <= BOUNDARY_TOL_DEG


def assert_points_in_nearest_area(
    fc: dict[str, Any], sites: list[Site], lon: np.ndarray, lat: np.ndarray
) -> None:
    """Each point is covered, and only by areas whose site is (within tolerance) nearest."""
    s = site_vectors(sites)
    x = unit(lon, lat)
    nearest = np.argmax(x @ s.T, axis=1)
    points = shapely.points(lon, lat)
    covered = np.stack([shapely.covers(g, points) for g in geometries(fc)], axis=1)
    assert covered.any(axis=1).all(), "a point lies in no area"
    for k, c in zip(*np.nonzero(covered), strict=True):
        if c != nearest[k]:
            assert bisector_distance_deg(x[k], s[c], s[nearest[k]]) <= BOUNDARY_TOL_DEG


def well_separated(coords: list[tuple[float, float]]) -> bool:
    # generate_areas rejects sites closer than 1e-6 degrees; stay clear of that edge.
    v = unit(np.array([c[1] for c in coords]), np.array([c[0] for c in coords]))
    return all(
        np.linalg.norm(v[i] - v[j]) > math.radians(2e-6)
        for i, j in itertools.combinations(range(len(v)), 2)
    )


lat_lon = st.tuples(
    st.one_of(st.floats(-90, 90), st.sampled_from([-90.0, -45.0, 0.0, 45.0, 90.0])),
    st.one_of(st.floats(-180, 180), st.sampled_from([-180.0, -90.0, 0.0, 90.0, 180.0])),
)
site_sets = (
    st.lists(lat_lon, min_size=2, max_size=12, unique=True)
    .filter(well_separated)
    .map(lambda coords: [Site(f"s{k}", lat, lon) for k, (lat, lon) in enumerate(coords)])
)
points = st.lists(st.tuples(st.floats(-90, 90), st.floats(-180, 180)), min_size=1, max_size=40)


def load_csv(name: str) -> list[Site]:
    return read_sites((FEDERATIONS / name).read_text(encoding="utf-8"), "csv")


# --------------------------------------------------------------------------- federations


@pytest.mark.parametrize("name", ["aws-2020", "three"])
def test_committed_federation_is_generator_output(name: str) -> None:
    committed = json.loads((FEDERATIONS / f"{name}.geojson").read_text(encoding="utf-8"))
    # Through JSON so that the comparison sees what a file holds (lists, floats).
    generated = json.loads(json.dumps(generate_areas(load_csv(f"{name}-sites.csv"))))
    assert committed == generated


def test_aws_federation_tiles_the_world() -> None:
    sites = load_csv("aws-2020-sites.csv")
    assert len(sites) == 21
    fc = json.loads((FEDERATIONS / "aws-2020.geojson").read_text(encoding="utf-8"))
    assert [f["properties"]["id"] for f in fc["features"]] == [s.id for s in sites]
    assert_tiles_world(fc)
    assert_boundaries_on_bisectors(fc, sites)
    assert (FEDERATIONS / "aws-2020.geojson").stat().st_size < 2_000_000


def test_three_federation_properties() -> None:
    fc = json.loads((FEDERATIONS / "three.geojson").read_text(encoding="utf-8"))
    props = {f["properties"]["id"]: f["properties"] for f in fc["features"]}
    assert {k: (p["endpoint"], p["client_endpoint"]) for k, p in props.items()} == {
        "eu": ("127.0.0.1:7401", "127.0.0.1:7400"),
        "us": ("127.0.0.1:7411", "127.0.0.1:7410"),
        "ap": ("127.0.0.1:7421", "127.0.0.1:7420"),
    }
    assert props["eu"]["site"] == [8.68417, 50.11552]
    assert_tiles_world(fc)


# --------------------------------------------------------------------------- geometry


@SLOW
@given(site_sets)
def test_random_sites_tile_the_world(sites: list[Site]) -> None:
    fc = generate_areas(sites)
    assert_tiles_world(fc)
    assert_boundaries_on_bisectors(fc, sites)


@SLOW
@given(site_sets, points)
def test_points_lie_in_the_area_of_their_nearest_site(
    sites: list[Site], pts: list[tuple[float, float]]
) -> None:
    fc = generate_areas(sites)
    lat, lon = np.array(pts).T
    assert_points_in_nearest_area(fc, sites, lon, lat)


def test_points_in_aws_areas() -> None:
    sites = load_csv("aws-2020-sites.csv")
    fc = json.loads((FEDERATIONS / "aws-2020.geojson").read_text(encoding="utf-8"))
    rng = np.random.default_rng(7)
    lon = rng.uniform(-180, 180, 5000)
    lat = np.degrees(np.arcsin(rng.uniform(-1, 1, 5000)))  # uniform on the sphere
    assert_points_in_nearest_area(fc, sites, lon, lat)
    # Each site lies in its own area.
    for site, geom in zip(sites, geometries(fc), strict=True):
        assert geom.covers(shapely.Point(site.lon, site.lat))


@pytest.mark.parametrize("lon", [179.9, -179.9, 180.0, -180.0])
def test_area_across_antimeridian_is_split(lon: float) -> None:
    # Neighbours all around keep the dateline area away from the poles.
    fc = generate_areas(
        [
            Site("dateline", 10.0, lon),
            Site("north", 60.0, 180.0),
            Site("south", -40.0, -180.0),
            Site("east", 0.0, -100.0),
            Site("west", 0.0, 100.0),
        ]
    )
    dateline, *others = fc["features"]
    assert dateline["geometry"]["type"] == "MultiPolygon"
    parts = shapely.get_parts(shape(dateline["geometry"]))
    assert len(parts) == 2
    assert sorted(p.bounds[0] for p in parts)[0] == -180  # one part starts at -180
    assert sorted(p.bounds[2] for p in parts)[1] == 180  # the other ends at +180
    assert all(p.bounds[0] > -180 or p.bounds[2] < 180 for p in parts)  # neither spans all
    assert [f["geometry"]["type"] for f in others[2:]] == ["Polygon", "Polygon"]
    coords = shapely.get_coordinates(geometries(fc))
    assert np.all(np.abs(coords[:, 0]) <= 180) and np.all(np.abs(coords[:, 1]) <= 90)
    assert_tiles_world(fc)


def test_single_site_gets_the_world() -> None:
    fc = generate_areas([Site("only", 52.5, 13.4, name="Berlin")])
    (feature,) = fc["features"]
    assert shape(feature["geometry"]).equals(shapely.box(-180, -90, 180, 90))
    assert feature["properties"] == {"id": "only", "name": "Berlin", "site": [13.4, 52.5]}


def test_sites_at_the_same_latitude() -> None:
    # Their bisectors are meridian pairs through the poles.
    sites = [Site(f"m{k}", 45.0, -180.0 + 45.0 * k) for k in range(8)]
    fc = generate_areas(sites)
    assert_tiles_world(fc)
    assert_boundaries_on_bisectors(fc, sites)


def test_sites_almost_together_keep_an_area() -> None:
    sites = [Site("a", 10.0, 10.0), Site("b", 10.0, 10.000002), Site("c", -40.0, 100.0)]
    fc = generate_areas(sites)
    assert_tiles_world(fc)
    for site, geom in zip(sites, geometries(fc), strict=True):
        assert geom.covers(shapely.Point(site.lon, site.lat))


def test_output_format() -> None:
    fc = generate_areas(
        [
            Site("a", 1.23456789, 2.3456789012, name="A", endpoint="h:1", client_endpoint="h:2"),
            Site("b", -30.0, -100.0),
        ]
    )
    assert fc["type"] == "FeatureCollection"
    a, b = (f["properties"] for f in fc["features"])
    assert a == {
        "id": "a",
        "name": "A",
        "site": [2.3456789, 1.2345679],
        "endpoint": "h:1",
        "client_endpoint": "h:2",
    }
    assert b == {"id": "b", "name": "", "site": [-100.0, -30.0]}
    for geom in geometries(fc):
        coords = shapely.get_coordinates(geom)
        assert np.array_equal(np.round(coords, 7), coords)  # 7 decimals
        for polygon in shapely.get_parts(geom):
            assert polygon.exterior.is_ccw  # RFC 7946 §3.1.6
            assert not any(ring.is_ccw for ring in polygon.interiors)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("sites", "message"),
    [
        ([], "sites: at least one site"),
        (
            [Site("a", 0, 0), Site("b", 91.0, 0)],
            r"sites\[1\]\.lat: must be within \[-90, 90\], got 91.0",
        ),
        ([Site("a", 0, -180.5)], r"sites\[0\]\.lon: must be within \[-180, 180\]"),
        ([Site("a", math.nan, 0)], r"sites\[0\]\.lat: must be finite"),
        ([Site("a", 0, math.inf)], r"sites\[0\]\.lon: must be finite"),
        ([Site("a", 0, "1")], r"sites\[0\]\.lon: not a number: '1'"),  # type: ignore[arg-type]
        ([Site("", 0, 0)], r"sites\[0\]\.id: must be a non-empty string"),
        ([Site("a", 0, 0), Site("a", 1, 1)], r"sites\[1\]\.id: duplicate id 'a' \(also sites\[0\]"),
        (
            [Site("a", 5, 180), Site("b", 5, -180)],
            r"sites\[1\]\.lat/lon: same position as sites\[0\]",
        ),
        ([Site("n", 90, 0), Site("m", 90, 45)], r"sites\[1\]\.lat/lon: same position"),
        ([Site("a", 0, 0, endpoint=None)], r"sites\[0\]\.endpoint: must be a string"),  # type: ignore[arg-type]
    ],
)
def test_generate_rejects_bad_sites(sites: list[Site], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate_areas(sites)


def test_generate_rejects_bad_step() -> None:
    with pytest.raises(ValueError, match="step_deg: must be within"):
        generate_areas([Site("a", 0, 0)], step_deg=0)


def test_read_csv() -> None:
    text = (
        "id, lat,lon,name,client_endpoint,endpoint\n"
        "eu,50.1,8.7,Frankfurt,127.0.0.1:7400,127.0.0.1:7401\n"
        "\n"
        "us, 39.0 ,-77.5,,,\n"
    )
    assert read_sites(text, "csv") == [
        Site("eu", 50.1, 8.7, "Frankfurt", "127.0.0.1:7401", "127.0.0.1:7400"),
        Site("us", 39.0, -77.5),
    ]


def test_read_geojson_round_trip() -> None:
    sites = [Site("eu", 50.1, 8.7, "Frankfurt", "h:1", "h:2"), Site("us", 39.0, -77.5)]
    doc = {
        "type": "FeatureCollection",
        "features": [
            {
                "type": "Feature",
                "geometry": {"type": "Point", "coordinates": [s.lon, s.lat]},
                "properties": {
                    k: v
                    for k, v in [
                        ("id", s.id),
                        ("name", s.name),
                        ("endpoint", s.endpoint),
                        ("client_endpoint", s.client_endpoint),
                    ]
                    if v
                },
            }
            for s in sites
        ],
    }
    assert read_sites(json.dumps(doc), "geojson") == sites


HEADER = "id,name,lat,lon\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEADER + "a,A,1,2\nb,B,3,4\nc,C,x,5\n", r"^line 4: lat: not a number: 'x'$"),
        (HEADER + "a,A,1,2\nb,B,91,4\n", r"^line 3: lat: must be within \[-90, 90\], got 91.0$"),
        (HEADER + "a,A,1,nan\n", r"^line 2: lon: must be finite"),
        (HEADER + "a,A,1\n", r"^line 2: lon: missing$"),
        (HEADER + "a,A,1,2,3\n", r"^line 2: more than 4 fields$"),
        (HEADER + "a,A,1,2\na,B,3,4\n", r"^line 3: id: duplicate id 'a' \(also line 2\)$"),
        (HEADER + ",A,1,2\n", r"^line 2: id: must be a non-empty string"),
        (HEADER + "a,A,1,2\nb,B,1,2\n", r"^line 3: lat/lon: same position as line 2 \('a'"),
        ("id,name,lat\na,A,1\n", r"^line 1: missing column 'lon'$"),
        ("id,lat,lon,height\n", r"^line 1: unknown column 'height'"),
        ("", r"^line 1: missing header row"),
        (HEADER, r"^sites: at least one site"),
    ],
)
def test_read_csv_errors_name_line_and_field(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_sites(text, "csv")


def _point_feature(coords: Any, props: Any) -> dict[str, Any]:
    return {
        "type": "Feature",
        "geometry": {"type": "Point", "coordinates": coords},
        "properties": props,
    }


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([_point_feature([1, 2], {"name": "x"})], r"^features\[0\]\.properties\.id: missing$"),
        (
            [_point_feature([1, 2], {"id": "a"}), _point_feature(["1", 2], {"id": "b"})],
            r"^features\[1\]\.geometry\.coordinates: lon: not a number: '1'$",
        ),
        (
            [_point_feature([1, 95], {"id": "a"})],
            r"^features\[0\]\.geometry\.coordinates: lat: must be within \[-90, 90\], got 95.0$",
        ),
        ([_point_feature([1, 2], {"id": 7})], r"^features\[0\]\.properties\.id: must be a string"),
        (
            [_point_feature([1, 2], {"id": "a", "endpoint": 7401})],
            r"^features\[0\]\.properties\.endpoint: must be a string",
        ),
        (
            [{"type": "Feature", "geometry": {"type": "Polygon"}, "properties": {"id": "a"}}],
            r"^features\[0\]\.geometry\.type: must be 'Point'$",
        ),
        (
            [_point_feature([1, 2], {"id": "a"}), _point_feature([1, 2], {"id": "a"})],
            r"^features\[1\]\.properties\.id: duplicate id 'a' \(also features\[0\]\)$",
        ),
    ],
)
def test_read_geojson_errors_name_feature_and_field(features: list[Any], message: str) -> None:
    text = json.dumps({"type": "FeatureCollection", "features": features})
    with pytest.raises(ValueError, match=message):
        read_sites(text, "geojson")


@pytest.mark.parametrize(
    ("text", "fmt", "message"),
    [
        ("{", "geojson", r"^line 1: not JSON"),
        ('{"type": "Feature"}', "geojson", r"^type: must be 'FeatureCollection'$"),
        (HEADER, "kml", r"^fmt: must be 'csv' or 'geojson'"),
    ],
)
def test_read_rejects_bad_documents(text: str, fmt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_sites(text, fmt)
