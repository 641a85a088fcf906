"""The executors' batch geometry answers exactly as the routing core does (no Spark needed)."""

from __future__ import annotations

import h3
import numpy as np
import pytest
import shapely
from hypothesis import given, settings
from hypothesis import strategies as st
from spark_helpers import AWS, THREE

from geofed.bench.analysis import (
    FederationIndex,
    FilterMatcher,
    choose_resolution,
    covers_many,
    extent_km,
    h3_cell,
    h3_cover,
    h3_parent_int,
)
from geofed.routing import Federation, LatLon, circle, covers, parse_wkt, topic_matches

pytestmark = pytest.mark.spark

FEDS = {p.name: Federation.load(p) for p in (THREE, AWS)}
INDEX = {name: FederationIndex(fed) for name, fed in FEDS.items()}

lats = st.floats(-90, 90, allow_nan=False)
lons = st.one_of(st.floats(-180, 180, allow_nan=False), st.sampled_from([-180.0, 180.0]))


@settings(max_examples=60, deadline=None)
@given(
    pts=st.lists(st.tuples(lats, lons), min_size=1, max_size=40), name=st.sampled_from(sorted(FEDS))
)
def test_responsible_matches_the_federation(pts: list[tuple[float, float]], name: str) -> None:
    idx, fed = INDEX[name], FEDS[name]
    lat = np.array([p[0] for p in pts])
    lon = np.array([p[1] for p in pts])
    got = [idx.ids[i] for i in idx.responsible(lat, lon)]
    assert got == [fed.responsible(LatLon(a, b)) for a, b in pts]


@settings(max_examples=40, deadline=None)
@given(
    centers=st.lists(st.tuples(st.floats(-85, 85), st.floats(-180, 180)), min_size=1, max_size=8),
    radius=st.floats(1_000, 3_000_000),
    name=st.sampled_from(sorted(FEDS)),
)
def test_meeting_matches_the_federation(
    centers: list[tuple[float, float]], radius: float, name: str
) -> None:
    fences = [circle(LatLon(a, b), radius) for a, b in centers]
    got = INDEX[name].meeting([f.geometry for f in fences])
    assert [frozenset(INDEX[name].ids[i] for i in g) for g in got] == [
        FEDS[name].brokers_meeting(f) for f in fences
    ]


def test_meeting_in_a_gap_is_everyone() -> None:
    fed = Federation.from_geojson(
        {
            "type": "FeatureCollection",
            "features": [
                {
                    "type": "Feature",
                    "properties": {"id": "a"},
                    "geometry": {
                        "type": "Polygon",
                        "coordinates": [[[-10, -10], [0, -10], [0, 10], [-10, 10], [-10, -10]]],
                    },
                },
                {
                    "type": "Feature",
                    "properties": {"id": "b"},
                    "geometry": {
                        "type": "Polygon",
                        "coordinates": [[[0, -10], [10, -10], [10, 10], [0, 10], [0, -10]]],
                    },
                },
            ],
        }
    )
    fence = parse_wkt("POLYGON((5 5, 20 5, 20 20, 5 20, 5 5))")
    assert FederationIndex(fed).meeting([fence.geometry]) == [[0, 1]]
    assert fed.brokers_meeting(fence) == {"a", "b"}
    assert list(FederationIndex(fed).responsible(np.array([50.0]), np.array([3.0]))) == [1]


@settings(max_examples=60, deadline=None)
@given(pts=st.lists(st.tuples(lats, lons), min_size=1, max_size=50))
def test_covers_many_matches_covers(pts: list[tuple[float, float]]) -> None:
    fence = parse_wkt("POLYGON((170 -40, -170 -40, -170 10, 170 10, 170 -40))")  # split at ±180
    pts = [*pts, (0.0, 180.0), (0.0, -180.0), (-40.0, 175.0), (10.0, 170.0)]  # boundary points too
    lat = np.array([p[0] for p in pts])
    lon = np.array([p[1] for p in pts])
    assert list(covers_many(fence, lat, lon)) == [covers(fence, LatLon(a, b)) for a, b in pts]


@settings(max_examples=40, deadline=None)
@given(
    lat=st.floats(-75, 75),
    lon=st.floats(-175, 175),
    radius=st.floats(200, 800_000),
    seed=st.integers(0, 2**32 - 1),
)
def test_h3_cover_holds_every_covered_point(
    lat: float, lon: float, radius: float, seed: int
) -> None:
    fence = circle(LatLon(lat, lon), radius)
    res = choose_resolution(extent_km(fence.geometry))
    cells = h3_cover(fence.geometry, res)
    if cells is None:
        return  # matched without the spatial key: nothing to hold
    cover = set(cells)
    rng = np.random.default_rng(seed)
    minx, miny, maxx, maxy = fence.geometry.bounds
    samples = list(zip(rng.uniform(miny, maxy, 300), rng.uniform(minx, maxx, 300), strict=True))
    # The boundary is where a too-tight cover would fail first.
    samples += [(y, x) for x, y in shapely.get_coordinates(fence.geometry.boundary)]
    for a, b in samples:
        if covers(fence, LatLon(a, b)):
            assert h3_cell(a, b, res) in cover


def test_h3_cover_declines_poles_antimeridian_and_huge_shapes() -> None:
    assert (
        h3_cover(parse_wkt("POLYGON((-10 80, 10 80, 10 85, -10 85, -10 80))").geometry, 4) is None
    )
    assert (
        h3_cover(parse_wkt("POLYGON((178 0, 179.5 0, 179.5 1, 178 1, 178 0))").geometry, 4) is None
    )
    assert (
        h3_cover(parse_wkt("POLYGON((-60 -50, 60 -50, 60 50, -60 50, -60 -50))").geometry, 8)
        is None
    )


@settings(max_examples=100, deadline=None)
@given(lat=lats, lon=lons)
def test_h3_parent_by_bits(lat: float, lon: float) -> None:
    cell = h3.latlng_to_cell(lat, lon, 10)
    for res in range(11):
        assert h3_parent_int(h3.str_to_int(cell), res) == h3.str_to_int(
            h3.cell_to_parent(cell, res)
        )


level = st.sampled_from(["a", "b", "", "$x", "c"])
topics = st.lists(level, min_size=1, max_size=4).map("/".join)
filters = st.lists(st.sampled_from(["a", "b", "", "+", "$x", "c"]), min_size=1, max_size=4).flatmap(
    lambda lv: st.sampled_from(["/".join(lv), "/".join([*lv, "#"]), "#"])
)


@settings(max_examples=100, deadline=None)
@given(fs=st.lists(filters, min_size=1, max_size=12, unique=True), topic=topics)
def test_filter_matcher_matches_topic_matches(fs: list[str], topic: str) -> None:
    assert FilterMatcher(fs).matching(topic) == sorted(f for f in fs if topic_matches(f, topic))
