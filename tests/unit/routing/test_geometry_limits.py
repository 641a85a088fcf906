"""Geofence limits: bounded before the work starts, and what is accepted re-parses.

docs/design.md §1: geofence text over `max_bytes` is refused before it is
parsed (`TooLarge`); positions are counted against `max_vertices` before any
is validated, and again once cut at the antimeridian; a circle's radius is at
least 1 m. The canonical WKT a broker forwards (`Geofence.wkt`) parses back,
under the same limits, to the same shape. Malformed input of any kind is an
`InvalidInput` naming the field, never another exception.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import shapely
from hypothesis import event, given, settings
from hypothesis import strategies as st
from routing_testkit import as_parsed, points, star_ring, wrap_lon

from geofed.routing import (
    DEFAULT_MAX_BYTES,
    MIN_CIRCLE_RADIUS_M,
    Geofence,
    GeofenceCache,
    InvalidInput,
    TooLarge,
    build_geofence,
    check_text_size,
    circle,
    latlon,
    parse_geofence,
    parse_geojson,
    parse_wkt,
    to_wkt,
)

SQUARE = "POLYGON((0 0, 1 0, 1 1, 0 1, 0 0))"


def _ring_wkt(ring: list[tuple[float, float]]) -> str:
    return ", ".join(f"{x!r} {y!r}" for x, y in ring)


def regular_ring(lon: float, lat: float, radius: float, n: int) -> list[tuple[float, float]]:
    """A closed ring of `n` vertices around (lon, lat), longitudes wrapped into [-180, 180]."""
    ring = star_ring(lon, lat, [radius] * n, [2 * math.pi * i / n for i in range(n)])
    return [(wrap_lon(x) if abs(x) > 180.0 else x, y) for x, y in ring]


def reparses(fence: Geofence, max_vertices: int, max_bytes: int | None) -> Geofence:
    """`fence.wkt` parsed under the given limits: the same shape, the same text."""
    again = parse_wkt(fence.wkt, "again", max_vertices=max_vertices, max_bytes=max_bytes)
    assert again.wkt == fence.wkt
    assert again.vertex_count == fence.vertex_count
    assert again.geometry.equals(fence.geometry)
    return again


# --------------------------------------------------------------------------
# The byte limit, before parsing


def test_text_over_the_byte_limit_is_refused_before_it_is_parsed() -> None:
    # Not WKT at all: refused for its size, so it was never handed to a parser.
    junk = "x" * 2_000
    with pytest.raises(TooLarge) as err:
        parse_geofence(junk, "request.event.geofence.wkt", max_bytes=1_000)
    assert (err.value.field, err.value.size, err.value.limit) == (
        "request.event.geofence.wkt",
        2_000,
        1_000,
    )
    with pytest.raises(TooLarge):
        parse_wkt(junk, "g", max_bytes=1_000)
    with pytest.raises(TooLarge) as err:
        parse_geofence("{" + " " * 1_500 + "}", "g.geojson", max_bytes=1_000)
    assert err.value.field == "g.geojson"
    # Within the limit, the same junk is an ordinary parse error.
    with pytest.raises(InvalidInput):
        parse_geofence(junk, "g", max_bytes=None)


def test_the_byte_limit_counts_utf8_bytes() -> None:
    text = "é" * 600  # 1,200 bytes in UTF-8
    with pytest.raises(TooLarge) as err:
        check_text_size(text, "g", 1_000)
    assert err.value.size == 1_200
    check_text_size(text, "g", 1_200)
    check_text_size(text, "g", None)
    with pytest.raises(TooLarge):
        check_text_size("\ud800" * 400, "g", 1_000)  # a lone surrogate still has a size


def test_the_default_byte_limit_fits_the_default_vertex_limit() -> None:
    # 10,000 vertices at full precision, the longest coordinates there are.
    ring = regular_ring(-123.456789012345, -45.678901234567, 0.123456789, 9_999)
    text = f"POLYGON(({_ring_wkt(ring)}))"
    assert len(text) < DEFAULT_MAX_BYTES
    fence = parse_geofence(text, "g")
    assert fence is not None and fence.vertex_count == 10_000
    assert len(fence.wkt) < DEFAULT_MAX_BYTES


def test_the_canonical_wkt_must_fit_the_byte_limit_too() -> None:
    # Canonical WKT puts a space after each comma: longer than this input.
    compact = "POLYGON((0 0,1 0,1 1,0 1,0 0))"
    fence = parse_wkt(compact, "g", max_bytes=len(compact) + 20)
    assert len(fence.wkt) > len(compact)
    with pytest.raises(TooLarge) as err:
        parse_wkt(compact, "g", max_bytes=len(compact))
    assert (err.value.field, err.value.size) == ("g", len(fence.wkt))
    # Mappings have no text, but their canonical WKT is held to the limit.
    mapping = {"type": "Polygon", "coordinates": [[[0, 0], [1, 0], [1, 1], [0, 1], [0, 0]]]}
    with pytest.raises(TooLarge):
        parse_geofence(mapping, "g", max_bytes=20)
    with pytest.raises(TooLarge):
        parse_geofence({"circle": {"lat": 0, "lon": 0, "radius_m": 1e4}}, "g", max_bytes=500)


def test_cache_applies_its_limits_and_stays_within_its_text_budget() -> None:
    cache = GeofenceCache(max_vertices=5, max_bytes=100, text_budget=200)
    with pytest.raises(TooLarge):
        cache.get("P" * 101, "g")
    assert "P" * 101 not in cache
    with pytest.raises(InvalidInput):
        cache.get("POLYGON((0 0, 1 0, 1 1, 0.5 1.5, 0 1, 0 0))", "g")  # 6 vertices
    fence = cache.get(SQUARE, "g")
    assert SQUARE in cache and cache.get(SQUARE, "g") is fence
    # parse() leaves the cache alone (a worker thread may call it); put() fills it.
    other = "POLYGON((0 0, 2 0, 2 2, 0 2, 0 0))"
    parsed = cache.parse(other, "g")
    assert other not in cache
    cache.put(other, parsed)
    assert cache.get(other, "g") is parsed
    # Over the text budget the least recently used text goes; the newest stays.
    for i in range(10):
        cache.put(f"POLYGON((0 0, {i + 3} 0, {i + 3} 1, 0 1, 0 0))", None)
    assert SQUARE not in cache and "POLYGON((0 0, 12 0, 12 1, 0 1, 0 0))" in cache
    huge = GeofenceCache(max_bytes=None, text_budget=10)
    huge.put(SQUARE, fence)
    assert SQUARE in huge  # alone over the budget, and kept


# --------------------------------------------------------------------------
# The vertex limit, before and after the cut


def test_vertices_are_counted_before_any_is_validated() -> None:
    # Out-of-range coordinates everywhere: the count comes first.
    ring = ", ".join(f"{500 + i} {500 + i % 2}" for i in range(19)) + ", 500 500"
    with pytest.raises(InvalidInput) as err:
        parse_wkt(f"POLYGON(({ring}))", "g", max_vertices=10)
    assert err.value.field == "g" and "more than 10 vertices (20)" in err.value.reason
    positions = [["x", "y"]] * 20
    with pytest.raises(InvalidInput) as err:
        parse_geojson({"type": "Polygon", "coordinates": [positions]}, "g", max_vertices=10)
    assert "more than 10 vertices (20)" in err.value.reason
    with pytest.raises(InvalidInput) as err:
        build_geofence([[[("x", "y")] * 20]], "g", max_vertices=10)
    assert "more than 10 vertices (20)" in err.value.reason


def test_a_polygon_over_the_limit_once_cut_at_the_antimeridian_is_refused() -> None:
    ring = regular_ring(179.5, 10.0, 2.0, 99)  # 100 positions with the closing one
    text = f"POLYGON(({_ring_wkt(ring)}))"
    with pytest.raises(InvalidInput) as err:
        parse_wkt(text, "event.geofence", max_vertices=100)
    assert err.value.field == "event.geofence"
    assert "once cut at ±180" in err.value.reason
    fence = parse_wkt(text, "event.geofence", max_vertices=200)
    assert fence.vertex_count > 100 and len(fence.parts) == 2
    # Re-parsed under the limit it was accepted with, and under the tightest one.
    reparses(fence, 200, DEFAULT_MAX_BYTES)
    reparses(fence, fence.vertex_count, len(fence.wkt))


def test_a_circle_must_fit_the_vertex_limit() -> None:
    value = {"circle": {"lat": 0, "lon": 179.99, "radius_m": 10_000}}
    fence = parse_geofence(value, "g")
    assert fence is not None
    with pytest.raises(InvalidInput) as err:
        parse_geofence(value, "g", max_vertices=fence.vertex_count - 1)
    assert err.value.field == "g.circle"
    assert parse_geofence(value, "g", max_vertices=fence.vertex_count) is not None


# --------------------------------------------------------------------------
# Circles


@pytest.mark.parametrize("radius", [1e-9, 0.5, 0.999999])
def test_circles_below_one_metre_are_refused(radius: float) -> None:
    value = {"circle": {"lat": 35.68, "lon": 139.77, "radius_m": radius}}
    with pytest.raises(InvalidInput) as err:
        parse_geofence(value, "request.event.geofence")
    assert err.value.field == "request.event.geofence.circle.radius_m"
    assert "[1, 5000000]" in err.value.reason


@pytest.mark.parametrize(
    ("lat", "lon"),
    [(35.68, 139.77), (0.0, 180.0), (-17.7, -179.9999999), (89.99999, 0.0), (90.0, 10.0)],
)
def test_the_smallest_circle_reparses(lat: float, lon: float) -> None:
    fence = circle(latlon(lat, lon), MIN_CIRCLE_RADIUS_M, "g")
    reparses(fence, fence.vertex_count, len(fence.wkt))
    assert fence.covers(latlon(lat, lon))


@pytest.mark.parametrize("center", [(88.0, 30.0), (-88.0, 30.0), (90.0, 0.0), (89.9, 170.0)])
def test_circles_closed_through_a_pole_reparse(center: tuple[float, float]) -> None:
    # The band closes along the pole with an edge that used to span more than
    # 180 degrees, and read as crossing the antimeridian when parsed again.
    fence = circle(latlon(*center), 500_000.0, "g")
    again = reparses(fence, fence.vertex_count, len(fence.wkt))
    pole = math.copysign(90.0, center[0])
    for lon in (-180.0, -150.0, 0.0, 15.0, 179.0, 180.0):
        assert again.covers(latlon(pole, lon))


# --------------------------------------------------------------------------
# Malformed input names the field


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"type": "Polygon", "coordinates": ' + "[" * 5_000 + "]" * 5_000 + "}", "nested"),
        ('{"type": "Polygon", "coordinates": [[[' + "9" * 5_000 + ", 0]]]}", "too many digits"),
        ('{"type": "Polygon", "coordinates": [[[0, 0], [1, 0], [1, 1', "unparsable GeoJSON"),
    ],
)
def test_malformed_geojson_text_names_the_field(text: str, reason: str) -> None:
    if text.startswith("["):
        text = '{"type": "Polygon", "coordinates": ' + text + "}"
    with pytest.raises(InvalidInput) as err:
        parse_geofence(text, "subscription.geofence.geojson")
    assert err.value.field == "subscription.geofence.geojson"
    assert reason in err.value.reason


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "9" * 400])
def test_non_finite_numbers_in_geojson_name_the_vertex(number: str) -> None:
    ring = f"[[{number}, 0], [1, 0], [1, 1], [0, 1], [0, 0]]"
    with pytest.raises(InvalidInput) as err:
        parse_geofence(f'{{"type": "Polygon", "coordinates": [{ring}]}}', "g")
    assert err.value.field.startswith("g (polygon 0, ring 0, vertex 0)")


@pytest.mark.parametrize(
    "text",
    [
        "POLYGON((" + "9" * 5_000 + " 0, 1 0, 1 1, 0 0))",
        "POLYGON((nan 0, 1 0, 1 1, 0 0))",
        "POLYGON" + "(" * 10_000 + "0 0" + ")" * 10_000,
        "POLYGON((0 0, 1 0, 1 1, 0 0)\x00)",
        "POLYGON((0 0, 1 0, 1 1, 0 0),",
    ],
)
def test_malformed_wkt_names_the_field(text: str) -> None:
    with pytest.raises(InvalidInput) as err:
        parse_geofence(text, "request.event.geofence.wkt")
    assert err.value.field.startswith("request.event.geofence.wkt")


def test_a_feature_holds_a_geometry_not_another_feature() -> None:
    inner = {"type": "Feature", "geometry": json.loads(json.dumps({"type": "Polygon"}))}
    with pytest.raises(InvalidInput) as err:
        parse_geojson({"type": "Feature", "geometry": inner}, "g")
    assert err.value.field == "g.geometry.type"
    loop: dict[str, Any] = {"type": "Feature"}
    loop["geometry"] = loop  # no recursion into it
    with pytest.raises(InvalidInput):
        parse_geofence(loop, "g")


# --------------------------------------------------------------------------
# Accepted input re-parses from its canonical WKT, under the same limits


@st.composite
def near_limit_polygons(draw: st.DrawFn) -> tuple[Any, int]:
    """A polygon (maybe with a hole, maybe across ±180) and a vertex limit close to its size."""
    n = draw(st.integers(3, 300))
    radius = draw(st.sampled_from([1e-4, 0.3, 4.0, 30.0]))
    across = st.floats(-0.9, 0.9).map(lambda f: wrap_lon(180.0 + f * radius))
    lon = draw(st.one_of(across, across, st.floats(-180.0, 180.0)))  # mostly across ±180
    lat = draw(st.floats(-88.0 + 1.2 * radius, 88.0 - 1.2 * radius)) if radius < 30 else 0.0
    rings = [regular_ring(lon, lat, radius, n)]
    if draw(st.booleans()):
        rings.append(regular_ring(lon, lat, radius / 3, max(3, n // 4))[::-1])
    count = sum(len(r) for r in rings)
    limit = count + draw(st.integers(-2, 12))
    if draw(st.booleans()):
        text = "POLYGON(" + ", ".join(f"({_ring_wkt(r)})" for r in rings) + ")"
        return text, limit
    return {"type": "Polygon", "coordinates": [[list(p) for p in r] for r in rings]}, limit


circle_values = st.builds(
    lambda c, r: {"circle": {"lat": c.lat, "lon": c.lon, "radius_m": r}},
    points,
    st.one_of(
        st.sampled_from([1.0, 1.5, 10.0, 1_000.0, 500_000.0, 5_000_000.0]),
        st.floats(1.0, 5_000_000.0),
    ),
)


@settings(max_examples=300, deadline=None)
@given(
    case=st.one_of(near_limit_polygons(), circle_values.map(lambda v: (v, 100))),
    max_bytes=st.one_of(st.none(), st.just(DEFAULT_MAX_BYTES), st.integers(1_000, 40_000)),
    probes=st.lists(points, max_size=10),
)
def test_accepted_geofences_reparse_from_their_wkt_under_the_same_limits(
    case: tuple[Any, int], max_bytes: int | None, probes: list[Any]
) -> None:
    value, max_vertices = case
    try:
        fence = parse_geofence(value, "g", max_vertices=max_vertices, max_bytes=max_bytes)
    except TooLarge as err:
        assert err.field.startswith("g")
        event("refused: too many bytes")
        return
    except InvalidInput as err:
        assert err.field.startswith("g")
        event("refused: too many vertices once cut" if "cut" in err.reason else "refused")
        return
    assert fence is not None
    event(f"accepted: {'circle' if 'circle' in value else 'polygon'}, {len(fence.parts)} part(s)")
    assert fence.vertex_count <= max_vertices
    assert max_bytes is None or len(fence.wkt) <= max_bytes
    again = reparses(fence, max_vertices, max_bytes)
    reparses(fence, fence.vertex_count, len(fence.wkt))  # the tightest limits too
    vertices = [latlon(y, x) for x, y in shapely.get_coordinates(fence.geometry).tolist()]
    for p in [*probes, *vertices]:
        assert again.covers(p) is fence.covers(p), p


@settings(max_examples=300, deadline=None)
@given(
    xs=st.lists(
        st.one_of(
            st.floats(-180.0, 180.0),
            st.floats(-1e-3, 1e-3),
            st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 180.0, -180.0]),
        ),
        min_size=2,
        max_size=2,
        unique=True,
    ),
    ys=st.lists(st.floats(-90.0, 90.0), min_size=2, max_size=2, unique=True),
)
def test_canonical_wkt_is_exact(xs: list[float], ys: list[float]) -> None:
    (x0, x1), (y0, y1) = sorted(xs), sorted(ys)
    if x1 - x0 > 180.0:
        return  # would read as crossing the antimeridian
    ring = [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)]
    try:
        fence = build_geofence([[ring]], "g")
    except InvalidInput:
        return  # no area (subnormal sides)
    text = to_wkt(fence.geometry)
    assert text == fence.wkt
    back = shapely.get_coordinates(shapely.from_wkt(text)).tolist()
    # Exact, but for subnormal coordinates, which read as 0 (GEOS mishandles them).
    given = [[as_parsed(v) for v in p] for p in ring]
    assert back == shapely.get_coordinates(fence.geometry).tolist() == given
