"""geofed.routing covers: geofences as MQTT topic filters (ranged filtering).

The properties: a cover contains its geofence (every point the geofence
covers, encoded, matches one of the filters; the union of the cells covers
the shape), the coverage ratio and the filter count are as asked (or the
refinement says why not), the filters are valid MQTT filters; the encoder and
the decoder agree. The worked examples of the ranged-filtering write-up
(Solace) are reproduced in the layout's one-digit-a-level form.
"""

from __future__ import annotations

import math
import random

import pytest
import shapely
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from routing_testkit import geofences, points, rect_wkt
from shapely.geometry import box

from geofed.routing import (
    Cover,
    DecimalLayout,
    DecimalRect,
    Geofence,
    H3Layout,
    InvalidInput,
    LatLon,
    cover,
    covers,
    latlon,
    parse_geofence,
    parse_wkt,
    topic_matches,
    validate_filter,
)
from geofed.routing._cover import _DecimalSystem, _Greedy, _H3System, _Target

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EUROPE = parse_wkt("POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))")


def sample_points(fence: Geofence | None, rng: random.Random, n: int = 150) -> list[LatLon]:
    """Points the geofence covers: its vertices, points on its edges, inside, on ±180."""
    if fence is None:
        return [latlon(rng.uniform(-90, 90), rng.uniform(-180, 180)) for _ in range(n)] + [
            latlon(90.0, 180.0),
            latlon(-90.0, -180.0),
            latlon(0.0, 0.0),
            latlon(-0.0, -0.0),
        ]
    out: list[LatLon] = []
    coords = shapely.get_coordinates(fence.geometry).tolist()
    out += [LatLon(y, x) for x, y in coords]
    boundary = fence.geometry.boundary
    length = boundary.length
    for _ in range(n // 3):
        p = boundary.interpolate(rng.uniform(0.0, length))
        out.append(LatLon(p.y, p.x))
    minx, miny, maxx, maxy = fence.bounds
    tries = 0
    while len(out) < 2 * n and tries < 20 * n:
        tries += 1
        p = LatLon(rng.uniform(miny, maxy), rng.uniform(minx, maxx))
        out.append(p)
    for lat in (miny, maxy, (miny + maxy) / 2):
        out += [LatLon(lat, 180.0), LatLon(lat, -180.0)]
    return [p for p in out if -90 <= p.lat <= 90 and -180 <= p.lon <= 180 and covers(fence, p)]


def matched(result: Cover, topic: str) -> list[str]:
    return [f for f in result.filters if topic_matches(f, topic)]


def assert_cover_holds(
    fence: Geofence | None,
    result: Cover,
    layout: DecimalLayout | H3Layout,
    coverage: float,
    max_filters: int,
    seed: int,
) -> None:
    assert len(result.filters) == len(result.cells) <= max_filters
    assert len(set(result.filters)) == len(result.filters)
    for f in result.filters:
        assert validate_filter(f) == f
    assert 0.0 < result.coverage <= 1.0
    assert result.stopped in ("coverage", "max_filters", "resolution")
    if result.stopped == "coverage":
        assert result.coverage >= coverage
    else:
        assert result.coverage < coverage
    # Recall 1: every point the geofence covers lands in one cell, and only one.
    rng = random.Random(seed)
    for p in sample_points(fence, rng):
        topic = layout.topic(p, "t/x")
        hits = matched(result, topic)
        assert len(hits) == 1, (p, topic, hits)


def assert_no_split_fits(
    system: _DecimalSystem | _H3System, fence: Geofence | None, result: Cover, max_filters: int
) -> None:
    """Stopped short of the target: no split was left that fits in max_filters
    ("max_filters"), or none at all ("resolution"). A split replaces a cell by its
    kids after their free splits (an H3 kid whose descendants miss the geofence goes)."""
    if result.stopped == "coverage":
        return
    greedy = _Greedy(system, _Target(fence))
    target = box(-180, -90, 180, 90) if fence is None else fence.geometry
    room = max_filters - len(result.cells)
    for r in result.cells:
        node = greedy.node(r, target)
        assert node is not None  # every cell meets the geofence
        if node.coverage >= 1.0 - 1e-12:
            continue
        kids = greedy.kids(node)
        if result.stopped == "resolution":
            assert not kids, r  # only cells at the layout's finest level are left
        else:
            kept = [k for k in map(greedy.free_splits, kids) if k is not None]
            assert not kids or len(kept) - 1 > room, (r, len(kids), len(kept), room)


# --------------------------------------------------------------------------
# The write-up's worked examples


def test_encoding_examples() -> None:
    """§2.2: Ottawa at 2 decimals is _45.38/-075.75; London at 4 is _51.5160/-000.0707."""
    two = DecimalLayout(prefix="", decimals=2)
    assert two.location_levels(LatLon(45.38, -75.75)) == list("_4538-07575")
    four = DecimalLayout(prefix="", decimals=4)
    london = four.location_levels(LatLon(51.516, -0.0707))
    assert "".join(london) == "_515160-0000707"
    assert four.topic(LatLon(51.516, -0.0707), "uk/bus") == ("_/5/1/5/1/6/0/-/0/0/0/0/7/0/7/uk/bus")


@pytest.mark.parametrize(
    ("rect", "inside", "outside"),
    [
        # _45.38*/-075.75*/ : 45.38..45.39 N, 75.75..75.76 W (Fig. 2)
        (
            DecimalRect(False, "4538", True, "07575"),
            [(45.38, -75.75), (45.3899, -75.7599)],
            [(45.39, -75.755), (45.385, -75.76), (45.385, -75.749)],
        ),
        # _45.38*/-075.7*/ : ten times wider (Fig. 3)
        (
            DecimalRect(False, "4538", True, "0757"),
            [(45.385, -75.70), (45.385, -75.7999)],
            [(45.385, -75.80), (45.385, -75.6999)],
        ),
        # _45.3*/ : [45.3, 45.4); _4*/ : [40, 50), not 4..5 (zero padding)
        (
            DecimalRect(False, "453", False, ""),
            [(45.3, 10.0), (45.3999, 170.0)],
            [(45.4, 10.0), (45.2999, 10.0)],
        ),
        (
            DecimalRect(False, "4", False, ""),
            [(40.0, 1.0), (49.99, 1.0)],
            [(4.5, 1.0), (50.0, 1.0)],
        ),
        (DecimalRect(False, "04", False, ""), [(4.0, 1.0), (4.99, 1.0)], [(40.5, 1.0)]),
        # -45.3*/ : (-45.4, -45.3]; -45.*/ : (-46, -45]
        (
            DecimalRect(True, "453", False, ""),
            [(-45.3, 1.0), (-45.3999, 1.0)],
            [(-45.4, 1.0), (-45.2999, 1.0)],
        ),
        (
            DecimalRect(True, "45", False, ""),
            [(-45.0, 1.0), (-45.99, 1.0)],
            [(-46.0, 1.0), (-44.9, 1.0)],
        ),
    ],
)
def test_subscription_examples(
    rect: DecimalRect, inside: list[tuple[float, float]], outside: list[tuple[float, float]]
) -> None:
    """§2.3: a filter with the free digits as '+' is the write-up's prefix subscription."""
    layout = DecimalLayout(prefix="geo", decimals=4)
    f = layout.filter(rect)
    for lat, lon in inside:
        assert topic_matches(f, layout.topic(LatLon(lat, lon), "car/0034")), (f, lat, lon)
    for lat, lon in outside:
        assert not topic_matches(f, layout.topic(LatLon(lat, lon), "car/0034")), (f, lat, lon)


def test_filter_text() -> None:
    layout = DecimalLayout(prefix="geo", decimals=4)
    assert layout.filter(DecimalRect(False, "4538", True, "07575")) == (
        "geo/_/4/5/3/8/+/+/-/0/7/5/7/5/#"
    )
    assert layout.filter(DecimalRect(False, "4538", True, "07575"), "car/+/update") == (
        "geo/_/4/5/3/8/+/+/-/0/7/5/7/5/+/+/car/+/update"
    )
    assert layout.filter(DecimalRect(False, "", True, "")) == "geo/_/+/+/+/+/+/+/-/#"


def test_children_are_a_tenth() -> None:
    """A rectangle splits into ten children: replacing its filter by ten with one more digit."""
    layout = DecimalLayout(prefix="", decimals=3)
    parent = DecimalRect(False, "4538", True, "0757")
    kids = [DecimalRect(False, "4538", True, "0757" + d) for d in "0123456789"]
    rng = random.Random(1)
    for _ in range(300):
        p = LatLon(rng.uniform(45.379, 45.391), rng.uniform(-75.81, -75.69))
        topic = layout.topic(p, "t")
        in_parent = topic_matches(layout.filter(parent), topic)
        assert in_parent == (sum(topic_matches(layout.filter(k), topic) for k in kids) == 1)


def test_parameters_example() -> None:
    """§3.1: 'T covers at least z = 80% of the approximation or no more than k = 50 rectangles'."""
    result = cover(EUROPE, coverage=0.8, max_filters=50)
    assert len(result.filters) <= 50
    assert result.coverage >= 0.8 or result.stopped == "max_filters"
    assert_cover_holds(EUROPE, result, DecimalLayout(), 0.8, 50, 1)
    # More filters allowed: the target is reached, with fewer filters than allowed.
    more = cover(EUROPE, coverage=0.8, max_filters=500)
    assert more.stopped == "coverage" and more.coverage >= 0.8 and len(more.filters) < 500


def test_free_split() -> None:
    """§3.2: a rectangle with one child meeting the target is replaced by it for free."""
    tiny = parse_wkt("POLYGON((2.35 48.85, 2.36 48.85, 2.36 48.86, 2.35 48.86, 2.35 48.85))")
    result = cover(tiny, DecimalLayout(decimals=4), coverage=0.5, max_filters=4)
    # One quadrant at the start; without a cost, it shrinks until a split costs a filter.
    assert len(result.filters) <= 4
    assert all(len(r.lat) >= 3 and len(r.lon) >= 4 for r in result.cells)
    assert result.coverage > 0.05


def test_refinement_order() -> None:
    """The next split goes to the largest (1 - c) * A / 1.2^(|d| - 1).

    After their free splits the two parts sit in 10-degree squares: the big one
    (c = 0.64, A = 100, nine children: weight 8.4) and the small one, a
    one-degree square (A = 1: weight under 1). With room for one split only,
    the big one is split, however the parts are listed.
    """
    for order in (0, 1):
        parts = ["((1 1, 9 1, 9 9, 1 9, 1 1))", "((-1.1 -1.1, -1.5 -1.1, -1.5 -1.5, -1.1 -1.1))"]
        if order:
            parts.reverse()
        fence = parse_wkt(f"MULTIPOLYGON({', '.join(parts)})")
        layout = DecimalLayout(prefix="", decimals=2)
        result = cover(fence, layout, coverage=1.0, max_filters=10)
        assert result.stopped == "max_filters"
        north = sorted(r.lat for r in result.cells if not r.lat_negative)
        assert north == [f"0{d}" for d in "123456789"]
        assert [r for r in result.cells if r.lat_negative] == [DecimalRect(True, "01", True, "001")]
        assert_cover_holds(fence, result, layout, 1.0, 10, order)


# --------------------------------------------------------------------------
# Properties


@SETTINGS
@given(
    fence=geofences(),
    coverage=st.sampled_from([0.0, 0.3, 0.8, 0.95, 1.0]),
    max_filters=st.sampled_from([4, 10, 50, 200]),
    decimals=st.integers(0, 5),
    signs=st.sampled_from(["sign", "offset"]),
    seed=st.integers(0, 2**16),
)
# A vertex at a subnormal longitude (read as 0 since; GEOS's overlay made a
# cell's piece of it the whole cell, and the cover stopped short).
@example(
    fence=parse_wkt(rect_wkt(5e-324, 1.4772556055387014, 0.001, 1.4792087305387014)),
    coverage=0.8,
    max_filters=10,
    decimals=4,
    signs="sign",
    seed=0,
)
def test_decimal_cover_contains_the_geofence(
    fence: Geofence | None,
    coverage: float,
    max_filters: int,
    decimals: int,
    signs: str,
    seed: int,
) -> None:
    layout = DecimalLayout(prefix="geo/v1", decimals=decimals, signs=signs)  # type: ignore[arg-type]
    result = cover(fence, layout, coverage=coverage, max_filters=max_filters)
    assert_cover_holds(fence, result, layout, coverage, max_filters, seed)
    # The cells, as closed boxes, hold the shape (geometry containment).
    system = _DecimalSystem(layout)
    union = shapely.union_all([box(*system.bounds(r)) for r in result.cells])
    target = box(-180, -90, 180, 90) if fence is None else fence.geometry
    assert union.covers(target)
    # Cells are disjoint: their areas add up to the cover's.
    assert math.isclose(sum(system.shape(r).area for r in result.cells), result.area, rel_tol=1e-9)
    assert_no_split_fits(system, fence, result, max_filters)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fence=geofences(),
    coverage=st.sampled_from([0.3, 0.8]),
    max_filters=st.sampled_from([150, 400]),
    resolution=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
# Before a split's count excluded the kids that go (an H3 kid whose
# descendants miss the geofence), the cover stopped with splits left that fit:
# one whose 4 kids keep 2 with room for 1 more filter, and one whose 2 kids
# both go (the count falls, and splits capped earlier fit again).
@example(
    fence=parse_wkt(
        rect_wkt(16.430438483343806, -53.04915330482697, 17.13898302930905, -46.64092492189066)
    ),
    coverage=0.95,
    max_filters=20,
    resolution=6,
    seed=0,
)
@example(
    fence=parse_wkt(
        rect_wkt(153.20582197809256, -7.639280564796344, 163.49829252856503, 3.8723515007257596)
    ),
    coverage=0.95,
    max_filters=20,
    resolution=5,
    seed=0,
)
def test_h3_cover_contains_the_geofence(
    fence: Geofence | None, coverage: float, max_filters: int, resolution: int, seed: int
) -> None:
    layout = H3Layout(prefix="h3", resolution=resolution)
    try:
        result = cover(fence, layout, coverage=coverage, max_filters=max_filters)
    except InvalidInput as exc:  # more base cells than filters allowed: said so
        assert exc.field == "max_filters"
        return
    assert_cover_holds(fence, result, layout, coverage, max_filters, seed)
    assert_no_split_fits(_H3System(layout), fence, result, max_filters)


@SETTINGS
@given(p=points, decimals=st.integers(0, 8), signs=st.sampled_from(["sign", "offset"]))
def test_encode_decode_round_trip(p: LatLon, decimals: int, signs: str) -> None:
    layout = DecimalLayout(prefix="x", decimals=decimals, signs=signs)  # type: ignore[arg-type]
    topic = layout.topic(p, "a/b")
    assert len(topic.split("/")) == 1 + layout.location_level_count + 2
    where, rest = layout.decode(topic)
    assert rest == "a/b"
    assert layout.topic(where, "a/b") == topic  # the centre of the cell encodes the same
    assert abs(where.lat - p.lat) <= 10.0**-decimals
    lon_gap = abs(where.lon - (180.0 if p.lon == -180.0 else p.lon))
    assert lon_gap <= 10.0**-decimals


@settings(max_examples=40, deadline=None)
@given(p=points, resolution=st.integers(0, 12))
def test_h3_encode_decode(p: LatLon, resolution: int) -> None:
    import h3

    layout = H3Layout(prefix="h3", resolution=resolution)
    topic = layout.topic(p, "a")
    where, rest = layout.decode(topic)
    assert rest == "a"
    cell = h3.latlng_to_cell(p.lat, p.lon, resolution)
    assert h3.latlng_to_cell(where.lat, where.lon, resolution) == cell
    # A coarser cell's filter matches the point: the index hierarchy.
    for r in range(resolution + 1):
        parent = h3.str_to_int(h3.cell_to_parent(cell, r))
        assert topic_matches(layout.filter(parent), topic)


def test_world_and_seam() -> None:
    world = cover(None, coverage=0.9)
    assert world.coverage == 1.0 and world.stopped == "coverage" and len(world.filters) == 4
    # A box flush with +180 also takes the points written -180 (the same meridian).
    east = parse_wkt("POLYGON((179.5 10, 180 10, 180 11, 179.5 11, 179.5 10))")
    result = cover(east, coverage=0.99, max_filters=20)
    layout = DecimalLayout()
    for lon in (180.0, -180.0, 179.5, 179.99):
        assert matched(result, layout.topic(LatLon(10.5, lon), "t"))
    assert not matched(result, layout.topic(LatLon(10.5, -179.9), "t"))
    across = parse_geofence("POLYGON((170 -5, -170 -5, -170 5, 170 5, 170 -5))")
    result = cover(across, coverage=0.9, max_filters=40)
    for lon in (175.0, -175.0, 180.0, -180.0):
        assert matched(result, layout.topic(LatLon(0.0, lon), "t"))
    assert not matched(result, layout.topic(LatLon(0.0, 160.0), "t"))


def test_invalid_parameters() -> None:
    with pytest.raises(InvalidInput) as err:
        cover(EUROPE, coverage=1.5)
    assert err.value.field == "coverage"
    with pytest.raises(InvalidInput) as err:
        cover(EUROPE, max_filters=0)
    assert err.value.field == "max_filters"
    # Four quadrants met, three filters allowed: the least is named.
    with pytest.raises(InvalidInput, match="at least 4") as err:
        cover(parse_wkt("POLYGON((-1 -1, 1 -1, 1 1, -1 1, -1 -1))"), max_filters=3)
    assert err.value.field == "max_filters"
    assert (
        len(
            cover(
                parse_wkt("POLYGON((-1 -1, 1 -1, 1 1, -1 1, -1 -1))"),
                DecimalLayout(signs="offset"),
                max_filters=1,
            ).filters
        )
        == 1
    )
    for kwargs, field in (
        ({"decimals": 11}, "layout.decimals"),
        ({"signs": "abs"}, "layout.signs"),
        ({"prefix": "a/+"}, "layout.prefix"),
        ({"prefix": "$SYS"}, "layout.prefix"),
    ):
        with pytest.raises(InvalidInput) as err:
            DecimalLayout(**kwargs)  # type: ignore[arg-type]
        assert err.value.field == field
    with pytest.raises(InvalidInput) as err:
        cover(EUROPE, topic_filter="a/#/b")
    assert err.value.field == "topic_filter"
    with pytest.raises(InvalidInput) as err:
        DecimalLayout(decimals=1).filter(DecimalRect(False, "45381", False, ""))
    assert err.value.field == "rect.lat"
    with pytest.raises(InvalidInput) as err:
        DecimalLayout(signs="offset").filter(DecimalRect(False, "1", True, "2"))
    assert err.value.field == "rect.lon"
    with pytest.raises(InvalidInput) as err:
        H3Layout(resolution=2).filter(0x8A1FB46622DFFFF)  # a resolution-10 cell
    assert err.value.field == "cell"


@pytest.mark.parametrize(
    ("topic", "field"),
    [
        ("other/_/4/5/3/8/0/0/-/0/7/5/7/5/0/0/t", "topic"),
        ("geo/x/4/5/3/8/0/0/-/0/7/5/7/5/0/0/t", "topic.lat"),
        ("geo/_/4/5/3/8/0/0/-/0/7/5/7/5/0/t", "topic.lon"),  # too few digits before the topic
        ("geo/_/9/5/3/8/0/0/-/0/7/5/7/5/0/0/t", "topic.lat"),  # 95 N
        ("geo/_/4/5/3/8/0/0/-/0/7/5/7/5/0/0", "topic"),  # no topic after the location
        ("geo/_/4/5/3/8/0/0/-/0/7/5/7/5/0/12/t", "topic.lon"),
    ],
)
def test_decode_errors(topic: str, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        DecimalLayout().decode(topic)
    assert err.value.field == field
