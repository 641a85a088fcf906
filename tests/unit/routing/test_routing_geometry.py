"""Geometry: the *covers* check, antimeridian cutting, circles, multipolygons."""

from __future__ import annotations

import math

import pytest
import shapely
from hypothesis import example, given, reject, settings
from hypothesis import strategies as st
from routing_testkit import LAT, LON, as_parsed, destination, points, rect_wkt, star_ring, wrap_lon
from shapely.geometry import MultiPolygon, Point, Polygon

from geofed.routing import (
    Geofence,
    InvalidInput,
    LatLon,
    build_geofence,
    circle,
    covers,
    great_circle_m,
    latlon,
    parse_geofence,
    parse_geojson,
    parse_wkt,
)

SQUARE = "POLYGON((0 0, 10 0, 10 10, 0 10, 0 0))"

# --------------------------------------------------------------------------
# covers: boundary inside


@pytest.mark.parametrize(
    ("lat", "lon", "inside"),
    [
        (5.0, 5.0, True),  # interior
        (0.0, 5.0, True),  # on an edge
        (10.0, 10.0, True),  # on a vertex
        (0.0, 0.0, True),
        (10.0, 3.0, True),
        (-1e-9, 5.0, False),  # just outside
        (5.0, 10.000001, False),
        (20.0, 20.0, False),
    ],
)
def test_covers_counts_the_boundary_as_inside(lat: float, lon: float, inside: bool) -> None:
    fence = parse_wkt(SQUARE)
    assert fence.covers(latlon(lat, lon)) is inside
    assert covers(fence, latlon(lat, lon)) is inside


def test_no_geofence_is_the_whole_world() -> None:
    for lat, lon in [(90, 0), (-90, 180), (0, -180), (12.5, 77.0)]:
        assert covers(None, latlon(lat, lon))
    assert parse_geofence(None) is None
    assert parse_geofence("") is None


def test_hole_boundary_is_inside_and_hole_interior_outside() -> None:
    fence = parse_wkt("POLYGON((0 0, 10 0, 10 10, 0 10, 0 0), (4 4, 6 4, 6 6, 4 6, 4 4))")
    assert not fence.covers(latlon(5, 5))
    assert fence.covers(latlon(4, 5))  # on the hole's edge
    assert fence.covers(latlon(2, 2))


def test_geojson_and_wkt_give_the_same_geofence() -> None:
    wkt = parse_wkt(SQUARE)
    gj = parse_geojson(
        {"type": "Polygon", "coordinates": [[[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]]]}
    )
    feature = parse_geofence(
        json_text := '{"type": "Feature", "geometry": ' + _geojson_square() + "}"
    )
    assert wkt.wkt == gj.wkt == feature.wkt  # type: ignore[union-attr]
    assert json_text.startswith("{")


def _geojson_square() -> str:
    return '{"type": "Polygon", "coordinates": [[[0, 0], [10, 0], [10, 10], [0, 10], [0, 0]]]}'


# --------------------------------------------------------------------------
# Antimeridian


def test_polygon_across_the_antimeridian_is_cut_into_a_multipolygon() -> None:
    fence = parse_wkt("POLYGON((170 -10, -170 -10, -170 10, 170 10, 170 -10))")
    assert isinstance(fence.geometry, MultiPolygon)
    minx, miny, maxx, maxy = fence.geometry.bounds
    assert (minx, miny, maxx, maxy) == (-180.0, -10.0, 180.0, 10.0)
    assert len(fence.parts) == 2
    assert fence.geometry.area == pytest.approx(20.0 * 20.0)
    for lon in (170.0, 175.0, 179.999, 180.0, -180.0, -179.999, -175.0, -170.0):
        assert fence.covers(latlon(0, lon)), lon
    for lon in (169.9, -169.9, 0.0, 90.0, -90.0):
        assert not fence.covers(latlon(0, lon)), lon


def test_geojson_polygon_across_the_antimeridian_is_cut_too() -> None:
    fence = parse_geojson(
        {
            "type": "Polygon",
            "coordinates": [[[175, 50], [-175, 50], [-175, 60], [175, 60], [175, 50]]],
        }
    )
    assert isinstance(fence.geometry, MultiPolygon)
    assert fence.covers(latlon(55, 178)) and fence.covers(latlon(55, -178))
    assert not fence.covers(latlon(55, 0))


def test_edge_along_the_antimeridian_does_not_cross_it() -> None:
    fence = parse_wkt("POLYGON((170 0, 180 0, 180 10, 170 10, 170 0))")
    assert isinstance(fence.geometry, Polygon)
    assert fence.geometry.bounds == (170.0, 0.0, 180.0, 10.0)
    # -180 and 180 are the same meridian.
    assert fence.covers(latlon(5, -180.0))


def test_polygon_winding_around_a_pole_is_rejected() -> None:
    # Four edges of 90 degrees each: the ring never comes back in longitude.
    with pytest.raises(ValueError, match="pole"):
        parse_wkt("POLYGON((0 80, 90 80, 180 80, -90 80, 0 80))")


@settings(max_examples=150, deadline=None)
@given(
    west=LON,
    width=st.floats(0.01, 359.0),
    south=st.floats(-90.0, 80.0),
    height=st.floats(0.01, 10.0),
    probes=st.lists(st.tuples(LAT, LON), min_size=1, max_size=20),
)
# A probe 1.2e-7 degrees west of the rectangle, which the check once took for inside.
@example(west=1.192092896e-07, width=1.0, south=0.0, height=1.0, probes=[(0.0, 0.0)])
def test_rectangles_cover_what_a_direct_check_says(
    west: float, width: float, south: float, height: float, probes: list[tuple[float, float]]
) -> None:
    north = south + height
    fence = parse_wkt(rect_wkt(west, south, west + width, north))
    # A subnormal coordinate reads as 0 (see the test below).
    west, south = as_parsed(west), as_parsed(south)
    minx, miny, maxx, maxy = fence.geometry.bounds
    assert -180.0 <= minx <= maxx <= 180.0 and -90.0 <= miny <= maxy <= 90.0
    assert fence.geometry.area == pytest.approx(width * height, rel=1e-6)
    # Probes at the corners and on the edges too: they must be inside.
    corners = [(south, west), (north, wrap_lon(west + width)), (south, west + width / 2)]
    for lat, lon in [*probes, *((la, wrap_lon(lo)) for la, lo in corners)]:
        east_of_west = (lon - west) % 360.0
        # Rounding at the ±360 wrap can move a probe by one ulp; keep those out
        # (and only those: a probe 1e-7 degrees west of the rectangle is outside).
        if abs(east_of_west - width) < 1e-9 or abs(east_of_west - 360.0) < 1e-9:
            continue
        expected = south <= lat <= north and (east_of_west <= width or lon == wrap_lon(west))
        assert fence.covers(latlon(lat, lon)) is expected, (lat, lon)


def test_a_subnormal_vertex_coordinate_reads_as_zero() -> None:
    # GEOS's overlay mishandles slivers as thin as 5e-324 degrees (a cover of
    # such a rectangle once went wrong): the parser flattens them to 0.
    for west, south in ((5e-324, 1e-310), (-5e-324, -2e-308)):
        fence = parse_wkt(rect_wkt(west, south, 0.001, 2.0))
        xy = shapely.get_coordinates(fence.geometry)
        assert xy[:, 0].min() == 0.0 and xy[:, 1].min() == 0.0
        assert not any(math.copysign(1.0, v) < 0 for v in xy.ravel() if v == 0.0)
        assert fence.geometry.equals(parse_wkt(rect_wkt(0.0, 0.0, 0.001, 2.0)).geometry)


@st.composite
def star_polygons(draw: st.DrawFn) -> tuple[Polygon, Geofence]:
    """A star-shaped polygon in unwrapped coordinates and its parsed geofence."""
    center = draw(points)
    scale = draw(st.sampled_from([1e-3, 0.5, 5.0, 40.0]))
    lat = max(-90.0 + 1.1 * scale, min(90.0 - 1.1 * scale, center.lat))
    n = draw(st.integers(3, 12))
    angles = draw(st.lists(st.floats(0.0, 6.28), min_size=n, max_size=n, unique=True))
    radii = draw(st.lists(st.floats(0.1 * scale, scale), min_size=n, max_size=n))
    ring = star_ring(center.lon, lat, radii, angles)
    # A subnormal coordinate reads as 0 (see the test above): the reference shape too.
    ring = [(as_parsed(x), as_parsed(y)) for x, y in ring]
    raw = Polygon(ring)
    if not raw.is_valid or raw.area == 0.0:
        reject()  # vertices sorted by angle may still cross (see star_ring)
    wrapped = [(wrap_lon(x) if abs(x) > 180.0 else x, y) for x, y in ring]
    return raw, build_geofence([[wrapped]])


@settings(max_examples=150, deadline=None)
@given(
    star=star_polygons(),
    probes=st.lists(st.tuples(LAT, LON), min_size=1, max_size=20),
    near=st.lists(st.tuples(st.floats(-1.0, 1.0), st.floats(-1.0, 1.0)), max_size=10),
)
def test_polygons_cover_what_shapely_says(
    star: tuple[Polygon, Geofence],
    probes: list[tuple[float, float]],
    near: list[tuple[float, float]],
) -> None:
    raw, fence = star
    minx, _, maxx, _ = fence.geometry.bounds
    assert -180.0 <= minx <= maxx <= 180.0
    assert fence.geometry.area == pytest.approx(raw.area, rel=1e-6)
    c = raw.centroid
    bx0, by0, bx1, by1 = raw.bounds
    extra = [
        (c.y + dy * (by1 - by0), wrap_lon(c.x + dx * (bx1 - bx0)))
        for dx, dy in near
        if -90.0 <= c.y + dy * (by1 - by0) <= 90.0
    ]
    vertices = [(y, wrap_lon(x) if abs(x) > 180.0 else x) for x, y in raw.exterior.coords]
    for lat, lon in [*probes, *extra, *vertices]:
        # The raw polygon may run past ±180: a point is inside if any of its
        # copies one turn east or west is.
        copies = [Point(lon + k, lat) for k in (-360.0, 0.0, 360.0)]
        if abs(lon) == 180.0:
            copies += [Point(-lon + k, lat) for k in (-360.0, 0.0, 360.0)]
        expected = any(raw.covers(p) for p in copies)
        if not expected and min(raw.exterior.distance(p) for p in copies) < 1e-9:
            continue  # within rounding of an edge that the cut re-computed
        assert fence.covers(latlon(lat, lon)) is expected, (lat, lon)


# --------------------------------------------------------------------------
# Circles


def test_circle_in_metres_is_geodesic() -> None:
    paris = latlon(48.8566, 2.3522)
    fence = circle(paris, 10_000.0)
    assert isinstance(fence.geometry, Polygon)
    for bearing in range(0, 360, 15):
        assert fence.covers(destination(paris, bearing, 9_900.0)), bearing
        assert not fence.covers(destination(paris, bearing, 10_100.0)), bearing
    assert fence.covers(paris)


def test_tiny_circle_of_a_few_metres() -> None:
    here = latlon(-33.8688, 151.2093)
    fence = circle(here, 5.0)
    assert fence.covers(destination(here, 45.0, 4.9))
    assert not fence.covers(destination(here, 45.0, 5.2))


def test_circle_across_the_antimeridian_is_split() -> None:
    fiji = latlon(-17.7, 179.9)
    fence = circle(fiji, 100_000.0)
    assert isinstance(fence.geometry, MultiPolygon)
    minx, _, maxx, _ = fence.geometry.bounds
    assert (minx, maxx) == (-180.0, 180.0)
    assert fence.covers(latlon(-17.7, 179.5))
    assert fence.covers(latlon(-17.7, -179.5))
    assert fence.covers(latlon(-17.7, 180.0)) and fence.covers(latlon(-17.7, -180.0))
    assert not fence.covers(latlon(-17.7, -178.0))
    assert not fence.covers(latlon(-17.7, 178.0))


@pytest.mark.parametrize("pole", [90.0, -90.0])
def test_circle_containing_a_pole(pole: float) -> None:
    center = latlon(math.copysign(88.0, pole), 30.0)
    fence = circle(center, 500_000.0)  # the pole is 222 km away
    for lon in (-180.0, -90.0, 0.0, 30.0, 90.0, 179.0, 180.0):
        assert fence.covers(latlon(pole, lon)), lon
        assert fence.covers(latlon(math.copysign(89.5, pole), lon)), lon
    # Across the pole, on the far meridian: 2 + 3 degrees of arc (556 km) is
    # outside, 2 + 2 (445 km) inside.
    assert not fence.covers(latlon(math.copysign(87.0, pole), -150.0))
    assert fence.covers(latlon(math.copysign(88.0, pole), -150.0))
    minx, _, maxx, _ = fence.geometry.bounds
    assert (minx, maxx) == (-180.0, 180.0)


def test_circle_centred_on_a_pole() -> None:
    fence = circle(latlon(90.0, 0.0), 1_000_000.0)
    edge = 90.0 - math.degrees(1_000_000.0 / 6_371_008.8)
    for lon in (-180.0, -45.0, 0.0, 100.0, 180.0):
        assert fence.covers(latlon(edge + 0.05, lon))
        assert not fence.covers(latlon(edge - 0.05, lon))


@settings(max_examples=200, deadline=None)
@given(
    center=points,
    radius=st.floats(10.0, 4_000_000.0),
    bearing=st.floats(0.0, 360.0),
    fraction=st.one_of(st.floats(0.0, 0.97), st.floats(1.03, 1.5)),
)
def test_circles_agree_with_great_circle_distance(
    center: LatLon, radius: float, bearing: float, fraction: float
) -> None:
    # The 64-gon lies within a few tenths of a percent of the true circle.
    fence = circle(center, radius)
    p = destination(center, bearing, fraction * radius)
    d = great_circle_m(center, p)
    if abs(d / radius - 1.0) < 0.03:
        return  # the destination formula and clamping at the poles round
    assert fence.covers(p) is (d < radius), (d, radius)


# --------------------------------------------------------------------------
# Multipolygons


def test_multipolygon_covers_each_part_and_not_between() -> None:
    fence = parse_wkt(
        "MULTIPOLYGON(((0 0, 1 0, 1 1, 0 1, 0 0)), ((10 10, 11 10, 11 11, 10 11, 10 10)))"
    )
    assert len(fence.parts) == 2
    assert fence.covers(latlon(0.5, 0.5)) and fence.covers(latlon(10.5, 10.5))
    assert fence.covers(latlon(11, 11))
    assert not fence.covers(latlon(5, 5))


def test_multipolygon_with_a_part_across_the_antimeridian() -> None:
    fence = parse_geojson(
        {
            "type": "MultiPolygon",
            "coordinates": [
                [[[170, 0], [-170, 0], [-170, 5], [170, 5], [170, 0]]],
                [[[0, 0], [5, 0], [5, 5], [0, 5], [0, 0]]],
            ],
        }
    )
    assert len(fence.parts) == 3
    for lat, lon in [(2, 175), (2, -175), (2, 2)]:
        assert fence.covers(latlon(lat, lon))
    assert not fence.covers(latlon(2, 90))


def test_multipolygon_parts_sharing_an_edge_are_rejected_not_merged() -> None:
    # OGC: parts of a MultiPolygon touch at points only; nothing is repaired.
    with pytest.raises(InvalidInput, match="invalid multipolygon"):
        parse_wkt("MULTIPOLYGON(((0 0, 1 0, 1 1, 0 1, 0 0)), ((1 0, 2 0, 2 1, 1 1, 1 0)))")
    touching = parse_wkt("MULTIPOLYGON(((0 0, 1 0, 1 1, 0 1, 0 0)), ((1 1, 2 1, 2 2, 1 2, 1 1)))")
    assert touching.covers(latlon(1, 1)) and touching.geometry.area == pytest.approx(2.0)


@settings(max_examples=100, deadline=None)
@given(
    boxes=st.lists(
        st.tuples(st.integers(-17, 16), st.integers(-8, 7)), min_size=1, max_size=5, unique=True
    ),
    probes=st.lists(st.tuples(LAT, LON), min_size=1, max_size=20),
)
def test_multipolygons_of_grid_cells_cover_what_shapely_says(
    boxes: list[tuple[int, int]], probes: list[tuple[float, float]]
) -> None:
    # Distinct 10-degree cells with a 1-degree margin never overlap or touch.
    cells = [
        [[(x * 10 + 1, y * 10 + 1), (x * 10 + 9, y * 10 + 1), (x * 10 + 9, y * 10 + 9),
          (x * 10 + 1, y * 10 + 9), (x * 10 + 1, y * 10 + 1)]]
        for x, y in boxes
    ]  # fmt: skip
    fence = build_geofence(cells)
    reference = MultiPolygon([Polygon(c[0]) for c in cells])
    for lat, lon in [*probes, *((y * 10 + 1, x * 10 + 9) for x, y in boxes)]:
        assert fence.covers(latlon(lat, lon)) is bool(reference.covers(Point(lon, lat)))


def test_geofence_text_is_canonical_and_repr_is_short() -> None:
    fence = circle(latlon(0, 0), 1000.0)
    # Full precision: the text gives back the exact coordinates (GEOS's writer
    # rounds small ones to 16 decimals).
    back = shapely.from_wkt(fence.wkt)
    assert (
        shapely.get_coordinates(back).tolist() == shapely.get_coordinates(fence.geometry).tolist()
    )
    assert len(repr(fence)) < 100
    assert fence.vertex_count == 65


def test_a_sliver_across_the_antimeridian_with_a_subnormal_latitude_builds() -> None:
    # Snapping the cut back onto the given vertices made GEOS signal an
    # invalid operation (a RuntimeWarning, an error under pytest); the snapped
    # shape is invalid and the cut is kept as it is.
    ring = [
        (-179.99998, 0.0),
        (-179.99998, 5.348839960520485e-261),
        (-179.99998919395387, 1.682941969615793e-05),
        (179.99999167706326, 1.8185948536513636e-05),
        (-179.99998, 0.0),
    ]
    fence = build_geofence([[ring]])
    assert isinstance(fence.geometry, MultiPolygon)
    assert fence.geometry.is_valid
    assert parse_wkt(fence.wkt).wkt == fence.wkt


def test_every_given_vertex_is_still_covered_after_the_antimeridian_cut() -> None:
    # Unwrapping this ring shifts 121.22924977699323 by -360 and the cut shifts
    # it back, one ulp off: the vertex ended just outside its own geofence.
    ring = [
        (-171.41745688624493, 59.259204260229765),
        (174.19945775777998, 69.74157435713028),
        (157.78787134212445, 73.22662426231999),
        (138.60985743624371, 56.695755036407974),
        (128.8216727659855, 46.89752692831664),
        (121.22924977699323, 44.256344834904574),
        (141.97341832238527, 42.132364053584126),
        (142.70547047931407, 26.19036626482127),
        (154.77265258582702, 37.23292342916164),
        (159.23702372116324, 11.054992282065811),
        (159.95065195416973, 14.929822408928501),
        (165.02333668995897, 44.95473234214254),
        (-171.41745688624493, 59.259204260229765),
    ]
    fence = build_geofence([[ring]])
    assert isinstance(fence.geometry, MultiPolygon)
    for lon, lat in ring:
        assert fence.covers(latlon(lat, lon)), (lat, lon)
