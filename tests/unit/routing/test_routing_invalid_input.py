"""Every class of bad input is rejected with `InvalidInput` naming the field.

docs/design.md §1: invalid input is rejected with a message naming the field, never
repaired silently, never a crash (no other exception type escapes).
"""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from geofed.routing import (
    Federation,
    GeofedError,
    InvalidInput,
    NotFound,
    TooLarge,
    WrongBroker,
    circle,
    latlon,
    make_event,
    make_subscription,
    parse_geofence,
    parse_geojson,
    parse_op,
    parse_wkt,
    read_trace,
    strategy_for,
    validate_filter,
    validate_topic,
)


def _reject(fn: Any, *args: Any, field: str, **kwargs: Any) -> InvalidInput:
    """Call `fn`, expect InvalidInput whose field starts with `field`; return it."""
    with pytest.raises(InvalidInput) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.field.startswith(field), (err.field, field)
    assert str(err).startswith(err.field)
    return err


# --------------------------------------------------------------------------
# Geofences


@pytest.mark.parametrize(
    "text",
    ["POLYGON((0 0, 1 0", "POLYGN((0 0, 1 0, 1 1, 0 0))", "not wkt at all", "POLYGON((a b, c d))"],
)
def test_unparsable_wkt(text: str) -> None:
    err = _reject(parse_geofence, text, "event.geofence", field="event.geofence")
    assert "WKT" in err.reason


@pytest.mark.parametrize("text", ['{"type": "Polygon", "coordinates": [', "{not json}"])
def test_unparsable_geojson_text(text: str) -> None:
    err = _reject(parse_geofence, text, "subscription.geofence", field="subscription.geofence")
    assert "GeoJSON" in err.reason


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([1, 2, 3], "g"),
        ({"type": "Polygon"}, "g.coordinates"),
        ({"type": "Polygon", "coordinates": "x"}, "g.coordinates"),
        ({"type": "Polygon", "coordinates": [[[0, 0], [1]]]}, "g.coordinates[0][1]"),
        ({"type": "Polygon", "coordinates": [["x"]]}, "g.coordinates[0][0]"),
        ({"type": "MultiPolygon", "coordinates": [[]]}, "g.coordinates[0]"),
        (
            {"type": "Feature", "geometry": {"type": "Point", "coordinates": [0, 0]}},
            "g.geometry.type",
        ),
    ],
)
def test_malformed_geojson_names_the_part(obj: Any, field: str) -> None:
    err = _reject(parse_geojson, obj, "g", field="g")
    assert err.field == field


def test_self_intersecting_bow_tie() -> None:
    err = _reject(parse_wkt, "POLYGON((0 0, 10 10, 10 0, 0 10, 0 0))", "event.geofence",
                  field="event.geofence")  # fmt: skip
    assert "Self-intersection" in err.reason
    _reject(
        parse_geojson,
        {"type": "Polygon", "coordinates": [[[0, 0], [10, 10], [10, 0], [0, 10], [0, 0]]]},
        "subscription.geofence",
        field="subscription.geofence",
    )


@pytest.mark.parametrize(
    "text",
    [
        "POLYGON((0 0, 190 0, 190 10, 0 10, 0 0))",
        "POLYGON((-181 0, 1 0, 1 1, -181 0))",
        "POLYGON((0 0, 1 0, 1 91, 0 0))",
        "POLYGON((0 -90.5, 1 0, 1 1, 0 -90.5))",
    ],
)
def test_out_of_range_polygon_coordinates(text: str) -> None:
    err = _reject(parse_wkt, text, "event.geofence", field="event.geofence")
    assert "out of" in err.reason


@pytest.mark.parametrize(
    ("lat", "lon", "field"),
    [(91, 0, "loc.lat"), (-90.01, 0, "loc.lat"), (0, 180.5, "loc.lon"), (0, -181, "loc.lon")],
)
def test_out_of_range_location(lat: float, lon: float, field: str) -> None:
    assert _reject(latlon, lat, lon, "loc", field=field).field == field


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_coordinates(bad: float) -> None:
    assert _reject(latlon, bad, 0.0, "loc", field="loc.lat").field == "loc.lat"
    assert _reject(latlon, 0.0, bad, "loc", field="loc.lon").field == "loc.lon"
    ring = [[0, 0], [1, 0], [bad, 1], [0, 0]]
    err = _reject(parse_geojson, {"type": "Polygon", "coordinates": [ring]}, "g", field="g")
    assert "finite" in err.reason and "lon" in err.field
    text = "POLYGON((0 0, 1 0, 1 {}, 0 0))".format("nan" if math.isnan(bad) else bad)
    _reject(parse_wkt, text, "e.geofence", field="e.geofence")
    _reject(circle, latlon(0, 0), bad, "c", field="c.radius_m")


def test_integers_beyond_float_range() -> None:
    # JSON has arbitrary-precision integers; float() of them overflows.
    huge = 10**400
    assert _reject(latlon, huge, 0, "loc", field="loc.lat").reason.startswith("must be finite")
    ring = [[0, 0], [huge, 0], [1, 1], [0, 0]]
    _reject(parse_geojson, {"type": "Polygon", "coordinates": [ring]}, "g", field="g")
    _reject(circle, latlon(0, 0), huge, "c", field="c.radius_m")
    line = '{"t": 1%s, "op": "move", "client": "c", "lat": 0, "lon": 0}' % ("0" * 400)
    _reject(lambda: list(read_trace([line])), field="line 1: t")


@pytest.mark.parametrize("bad", ["12", None, True, [1]])
def test_non_numeric_coordinates(bad: Any) -> None:
    assert _reject(latlon, bad, 0.0, "loc", field="loc.lat").field == "loc.lat"


@pytest.mark.parametrize(
    "value",
    [
        "POLYGON EMPTY",
        "MULTIPOLYGON EMPTY",
        {"type": "Polygon", "coordinates": []},
        {"type": "MultiPolygon", "coordinates": []},
        "POLYGON((0 0, 1 1, 2 2, 0 0))",  # no area
        "POLYGON((0 0, 1 0, 0 0))",  # too few positions
    ],
)
def test_empty_or_degenerate_geometry(value: Any) -> None:
    _reject(parse_geofence, value, "event.geofence", field="event.geofence")


def test_too_many_vertices() -> None:
    ring = ", ".join(
        f"{math.cos(i / 50 * 2 * math.pi)} {math.sin(i / 50 * 2 * math.pi)}" for i in range(50)
    )
    text = f"POLYGON(({ring}, 1 0))"
    assert parse_wkt(text, max_vertices=51).vertex_count == 51
    err = _reject(parse_wkt, text, "subscription.geofence", max_vertices=50,
                  field="subscription.geofence")  # fmt: skip
    assert "50" in err.reason
    _reject(make_subscription, "s", "c", "a", text, max_vertices=10, field="subscription.geofence")


@pytest.mark.parametrize(
    "text",
    ["POINT(0 0)", "LINESTRING(0 0, 1 1)", "GEOMETRYCOLLECTION(POINT(0 0))"],
)
def test_wrong_geometry_type_wkt(text: str) -> None:
    err = _reject(parse_wkt, text, "event.geofence", field="event.geofence")
    assert "POLYGON" in err.reason


@pytest.mark.parametrize("kind", ["Point", "LineString", "GeometryCollection", None])
def test_wrong_geometry_type_geojson(kind: str | None) -> None:
    err = _reject(parse_geojson, {"type": kind, "coordinates": [0, 0]}, "g", field="g.type")
    assert err.field == "g.type"


@pytest.mark.parametrize("value", [42, 1.5, ["POLYGON"], b"POLYGON"])
def test_wrong_geofence_value_type(value: Any) -> None:
    _reject(parse_geofence, value, "event.geofence", field="event.geofence")


@pytest.mark.parametrize("radius", [0, -5, 5_000_001, "10", None])
def test_bad_circle_radius(radius: Any) -> None:
    err = _reject(circle, latlon(0, 0), radius, "sub.geofence.circle", field="sub.geofence.circle")
    assert err.field == "sub.geofence.circle.radius_m"
    value = {"circle": {"lat": 0, "lon": 0, "radius_m": radius}}
    _reject(parse_geofence, value, "sub.geofence", field="sub.geofence.circle.radius_m")


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"circle": {"lat": 95, "lon": 0, "radius_m": 10}}, "g.circle.lat"),
        ({"circle": {"lon": 0, "radius_m": 10}}, "g.circle.lat"),
        ({"circle": "here"}, "g.circle"),
    ],
)
def test_bad_circle_centre(value: Any, field: str) -> None:
    assert _reject(parse_geofence, value, "g", field=field).field == field


# --------------------------------------------------------------------------
# Topics and filters


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("a/#/b", "'#'"),
        ("#/a", "'#'"),
        ("a#", "'#'"),
        ("a+", "'+'"),
        ("a/+b/c", "'+'"),
        ("", "empty"),
        ("a/\x00/b", "NUL"),
        (None, "string"),
        ("x" * 70_000, "longer"),
    ],
)
def test_bad_topic_filter(value: Any, reason: str) -> None:
    err = _reject(validate_filter, value, "subscription.topic_filter",
                  field="subscription.topic_filter")  # fmt: skip
    assert reason in err.reason
    _reject(make_subscription, "s1", "c1", value, field="subscription.topic_filter")


@pytest.mark.parametrize("value", ["a/+", "a/#", "#", "+", "", "a\x00", 7])
def test_bad_topic_name(value: Any) -> None:
    _reject(validate_topic, value, "event.topic", field="event.topic")
    _reject(make_event, "e1", value, latlon(0, 0), field="event.topic")


@pytest.mark.parametrize("value", ["", None, "x" * 300, "a\nb", 5])
def test_bad_ids(value: Any) -> None:
    _reject(make_event, value, "t", latlon(0, 0), field="event.id")
    _reject(make_subscription, value, "c", "t", field="subscription.id")
    _reject(make_subscription, "s", value, "t", field="subscription.client")


def test_unknown_strategy() -> None:
    fed = Federation.from_geojson(_collection([_feature("a")]))
    err = _reject(strategy_for, "gossip", fed, field="strategy")
    assert "flooding-events" in err.reason


# --------------------------------------------------------------------------
# Trace lines: the error names the line number


GOOD = {
    "t": 0.0,
    "op": "subscribe",
    "client": "c1",
    "lat": 1.0,
    "lon": 2.0,
    "id": "s1",
    "topic": "a/+",
}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"op": "publishh"}, "line 3: op"),
        ({"op": None}, "line 3: op"),
        ({"t": "soon"}, "line 3: t"),
        ({"t": -1}, "line 3: t"),
        ({"t": math.nan}, "line 3: t"),
        ({"t": math.inf}, "line 3: t"),
        ({"t": True}, "line 3: t"),
        ({"lat": None}, "line 3.lat"),
        ({"lon": 200}, "line 3.lon"),
        ({"client": ""}, "line 3: client"),
        ({"id": None}, "line 3: id"),
        ({"topic": "a/#/b"}, "line 3: topic"),
        ({"geofence": "POLYGON((0 0, 10 10, 10 0, 0 10, 0 0))"}, "line 3: geofence"),
        ({"op": "publish", "topic": "a/+"}, "line 3: topic"),
        ({"op": "publish", "topic": "a", "payload_size": -1}, "line 3: payload_size"),
        ({"op": "publish", "topic": "a", "payload_size": 1.5}, "line 3: payload_size"),
    ],
)
def test_bad_trace_record(change: dict[str, Any], field: str) -> None:
    record = {**GOOD, **change}
    record = {k: v for k, v in record.items() if not (k == "lat" and v is None)}
    assert _reject(parse_op, record, 3, field=field).field == field


def _lines(*records: Any) -> list[str]:
    return [r if isinstance(r, str) else json.dumps(r) for r in records]


def test_missing_lat_names_the_line() -> None:
    record = dict(GOOD)
    del record["lat"]
    err = _reject(lambda: list(read_trace(_lines(GOOD, "", record))), field="line 3")
    assert err.field == "line 3.lat"


def test_malformed_json_names_the_line() -> None:
    err = _reject(lambda: list(read_trace(_lines(GOOD, GOOD, '{"t": 1, "op": '))), field="line 3")
    assert err.field == "line 3" and "JSON" in err.reason
    err = _reject(lambda: list(read_trace(_lines(GOOD, "[1, 2]"))), field="line 2")
    assert "object" in err.reason


def test_time_going_backwards_names_the_line() -> None:
    later = {**GOOD, "t": 5.0}
    err = _reject(lambda: list(read_trace(_lines(later, GOOD))), field="line 2: t")
    assert "back" in err.reason


def test_unknown_fields_are_ignored_and_blank_lines_skipped() -> None:
    ops = list(read_trace(_lines({**GOOD, "extra": 1}, "   ", {**GOOD, "op": "move", "t": 1})))
    assert [op.op for op in ops] == ["subscribe", "move"]
    assert [op.line for op in ops] == [1, 3]


# --------------------------------------------------------------------------
# Federation files


def _feature(
    bid: Any, wkt_box: tuple[float, float, float, float] = (-180, -90, 180, 90), **props: Any
) -> dict[str, Any]:
    w, s, e, n = wkt_box
    return {
        "type": "Feature",
        "geometry": {"type": "Polygon", "coordinates": [[[w, s], [e, s], [e, n], [w, n], [w, s]]]},
        "properties": {"id": bid, **props} if bid is not None else dict(props),
    }


def _collection(features: list[Any]) -> dict[str, Any]:
    return {"type": "FeatureCollection", "features": features}


def _write(tmp_path: Path, obj: Any) -> Path:
    path = tmp_path / "fed.geojson"
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj), encoding="utf-8")
    return path


def test_duplicate_broker_id(tmp_path: Path) -> None:
    path = _write(
        tmp_path, _collection([_feature("a", (0, 0, 10, 10)), _feature("a", (20, 0, 30, 10))])
    )
    err = _reject(Federation.load, path, field="federation fed.geojson.features[1].properties.id")
    assert "duplicate" in err.reason


@pytest.mark.parametrize("bid", [None, "", 17])
def test_missing_or_bad_broker_id(tmp_path: Path, bid: Any) -> None:
    path = _write(
        tmp_path, _collection([_feature("a", (0, 0, 10, 10)), _feature(bid, (20, 0, 30, 10))])
    )
    _reject(Federation.load, path, field="federation fed.geojson.features[1].properties.id")


@pytest.mark.parametrize("endpoint", ["localhost", "host:port", ":7400", "h:0", "h:70000", 7400])
def test_bad_endpoint(tmp_path: Path, endpoint: Any) -> None:
    path = _write(tmp_path, _collection([_feature("a", endpoint=endpoint)]))
    _reject(Federation.load, path, field="federation fed.geojson.features[0].properties.endpoint")
    path = _write(tmp_path, _collection([_feature("a", client_endpoint=endpoint)]))
    _reject(
        Federation.load, path, field="federation fed.geojson.features[0].properties.client_endpoint"
    )


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "Feature", "geometry": None, "properties": {"id": "a"}},
        [1, 2],
        {"type": "GeometryCollection", "geometries": []},
    ],
)
def test_not_a_feature_collection(tmp_path: Path, obj: Any) -> None:
    err = _reject(Federation.load, _write(tmp_path, obj), field="federation fed.geojson")
    assert "FeatureCollection" in err.reason


@pytest.mark.parametrize(
    ("features", "field"),
    [
        ([], "federation fed.geojson.features"),
        (["x"], "federation fed.geojson.features[0]"),
        (
            [{"type": "Feature", "geometry": None, "properties": None}],
            "federation fed.geojson.features[0].properties",
        ),
        (
            [{"type": "Feature", "geometry": None, "properties": {"id": "a"}}],
            "federation fed.geojson.features[0].geometry",
        ),
        ([_feature("a", site=[1])], "federation fed.geojson.features[0].properties.site"),
        ([_feature("a", site=[0, 95])], "federation fed.geojson.features[0].properties.site.lat"),
    ],
)
def test_bad_features(tmp_path: Path, features: list[Any], field: str) -> None:
    assert (
        _reject(Federation.load, _write(tmp_path, _collection(features)), field=field).field
        == field
    )


def test_unreadable_file(tmp_path: Path) -> None:
    err = _reject(Federation.load, tmp_path / "missing.geojson", field="federation")
    assert "missing.geojson" in err.reason
    err = _reject(Federation.load, tmp_path, field="federation")  # a directory
    assert "cannot read" in err.reason


def test_file_that_is_not_json(tmp_path: Path) -> None:
    err = _reject(
        Federation.load, _write(tmp_path, "{'type': 'FeatureCollection'"), field="federation"
    )
    assert "not JSON" in err.reason


def test_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.geojson"
    path.write_bytes(b'{"type": "FeatureCollection", "name": "\xe9"}')
    _reject(Federation.load, path, field="federation")


# --------------------------------------------------------------------------
# Fuzz: whatever comes in, only InvalidInput goes out

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-500, 500)
    | st.sampled_from([10**400, -(10**400)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["Polygon", "MultiPolygon", "Feature", "POLYGON((0 0, 1 0, 1 1, 0 0))"])
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            st.sampled_from(
                ["type", "coordinates", "geometry", "circle", "lat", "lon", "radius_m"]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=_json_values)
def test_any_geofence_value_is_parsed_or_rejected(value: Any) -> None:
    try:
        parse_geofence(value, "g")
    except InvalidInput as err:
        assert err.field.startswith("g")


@settings(max_examples=300, deadline=None)
@given(
    text=st.one_of(
        st.text(max_size=60),
        st.builds(
            lambda kind, nums: f"{kind}(({', '.join(f'{a} {b}' for a, b in nums)}))",
            st.sampled_from(["POLYGON", "MULTIPOLYGON", "POLYGON(", "LINESTRING"]),
            st.lists(st.tuples(st.floats(), st.floats()), max_size=6),
        ),
    )
)
def test_any_text_is_parsed_or_rejected(text: str) -> None:
    try:
        parse_geofence(text, "g")
    except InvalidInput as err:
        assert err.field.startswith("g")


@settings(max_examples=300, deadline=None)
@given(
    record=st.fixed_dictionaries(
        {},
        optional={
            "t": _json_values,
            "op": st.sampled_from(["subscribe", "move", "publish", "unsubscribe", "x"]),
            "client": _json_values,
            "lat": _json_values,
            "lon": _json_values,
            "id": _json_values,
            "topic": _json_values,
            "geofence": _json_values,
            "payload_size": _json_values,
        },
    )
)
def test_any_trace_record_is_parsed_or_rejected_with_its_line(record: dict[str, Any]) -> None:
    try:
        parse_op(record, 9)
    except InvalidInput as err:
        assert err.field.startswith("line 9")


@pytest.mark.parametrize(
    "err",
    [
        InvalidInput("event.geofence", "empty geometry"),
        TooLarge("event.payload", 10, 5),
        NotFound("subscription", "s1"),
        WrongBroker("event.publisher", "eu", "127.0.0.1:7400"),
    ],
)
def test_errors_survive_pickling(err: GeofedError) -> None:
    # Worker processes (multiprocessing, Spark) send errors back pickled; an
    # error that cannot be rebuilt hangs a multiprocessing pool.
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err) and str(again) == str(err) and vars(again) == vars(err)
