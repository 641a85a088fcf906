"""History queries in the routing core: which brokers a query asks, and the index hints.

`history_targets` is held against a brute-force look at every broker's area
(intersects, with ±180 as one meridian), on the 21-region federation and
hypothesis-chosen areas; the index hints (`boxes`, `topic_range`) must never
leave out an entry the query matches.
"""

from __future__ import annotations

import shapely
from hypothesis import given, settings
from hypothesis import strategies as st
from shapely.geometry import LineString, box

from geofed.routing import (
    Federation,
    HistoryQuery,
    HistoryRecord,
    LatLon,
    federation_path,
    history_targets,
    merge_history,
    reference_topic_match,
)

AWS = Federation.load(federation_path("aws-2020"))
SEAM = [LineString([(x, -90), (x, 90)]) for x in (-180.0, 180.0)]


def brute_force(fed: Federation, area: shapely.Geometry | None) -> frozenset[str]:
    """Every broker whose area intersects `area` or its mirror across ±180 (one meridian)."""
    if area is None:
        return frozenset(fed.ids)
    mirrors = [
        shapely.transform(shapely.intersection(area, line), lambda xy: xy * (-1.0, 1.0))
        for line in SEAM
        if area.intersects(line)
    ]
    return frozenset(
        b.id
        for b in fed
        if b.area.geometry.intersects(area) or any(b.area.geometry.intersects(m) for m in mirrors)
    )


@settings(max_examples=200, deadline=None)
@given(
    x=st.floats(-180.0, 179.0),
    y=st.floats(-90.0, 89.0),
    w=st.floats(0.01, 360.0),
    h=st.floats(0.01, 180.0),
)
def test_history_targets_are_the_brokers_whose_areas_meet_the_query(
    x: float, y: float, w: float, h: float
) -> None:
    area = box(x, y, min(x + w, 180.0), min(y + h, 90.0))
    q = HistoryQuery("#", None, None, area, 1)
    assert history_targets(AWS, q) == brute_force(AWS, area)


def test_no_area_asks_every_broker() -> None:
    assert history_targets(AWS, HistoryQuery("#", None, None, None, 1)) == frozenset(AWS.ids)


TOPICS = [
    "a",
    "a/b",
    "a/bc",
    "ab",
    "b",
    "$SYS/x",
    "a//b",
    "/",
    "/a",
    "a/",
    "é",
    "é/x",
    "\U0010ffff/a",
]
FILTERS = ["#", "+", "a/#", "a/+", "a", "a/b", "+/b", "/#", "a//b", "é/#", "\U0010ffff/#", "$SYS/#"]


@given(st.sampled_from(FILTERS), st.sampled_from(TOPICS))
def test_the_topic_range_holds_every_matching_topic(topic_filter: str, topic: str) -> None:
    q = HistoryQuery(topic_filter, None, None, None, 1)
    if reference_topic_match(topic_filter, topic) and q.topic_range is not None:
        low, high = q.topic_range
        assert low <= topic and (high is None or topic < high)


@given(lat=st.floats(-90, 90), lon=st.sampled_from([-180.0, 180.0, -179.9, 179.9, 0.0]))
def test_the_boxes_hold_every_covered_location(lat: float, lon: float) -> None:
    area = shapely.MultiPolygon([box(170, -50, 180, 50), box(-180, 10, -175, 60)])
    q = HistoryQuery("#", None, None, area, 1)
    r = HistoryRecord("e", "t", b"", 0.0, "b", LatLon(lat, lon))
    if q.matches(r):
        assert q.boxes is not None
        assert any(x0 <= lon <= x1 and y0 <= lat <= y1 for x0, y0, x1, y1 in q.boxes)


def test_merge_is_newest_first_and_cut() -> None:
    def r(i: str, t: float, origin: str) -> HistoryRecord:
        return HistoryRecord(i, "t", b"x" * 10, t, origin, LatLon(0, 0))

    a = [r("a3", 3.0, "a"), r("a1", 1.0, "a")]
    b = [r("b4", 4.0, "b"), r("b2", 2.0, "b"), r("b0", 0.0, "b")]
    merged, cut = merge_history([a, b], 3)
    assert [x.event_id for x in merged] == ["b4", "a3", "b2"] and not cut
    size = a[0].size
    merged, cut = merge_history([a, b], 3, 2 * size)
    assert [x.event_id for x in merged] == ["b4", "a3"] and cut
