"""The HTTP bridge's route table, its OpenAPI document and its parameter parsing (no network)."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer
from node_fixtures import unstarted_node
from openapi_spec_validator import validate

from geofed.node._http import WEB_DIR, HttpBridge, _as_param
from geofed.routing import InvalidInput, TooLarge, WrongBroker


def bridge(**settings: str) -> HttpBridge:
    return HttpBridge(unstarted_node(http_listen="127.0.0.1:0", **settings))


def routes(b: HttpBridge) -> set[tuple[str, str]]:
    """(method, path template) of every route the bridge registers (HEAD is aiohttp's own)."""
    out = set()
    for route in b.app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("formatter") or info.get("path")
        if path is None:  # the static folder
            path = info["prefix"] + "/{filename}"
        path = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)
        if route.method != "HEAD":
            out.add((route.method.lower(), path))
    return out


def test_openapi_document_lists_exactly_the_routes_the_bridge_serves() -> None:
    b = bridge()
    from geofed.node._http_openapi import openapi_document

    doc = openapi_document("eu")
    validate(doc)  # a valid OpenAPI 3 document
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    served = routes(b)
    assert served == documented
    assert ("delete", "/publish/{topic}") in served and ("get", "/subscribe/{filter}") in served
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            named = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert named == set(re.findall(r"\{(\w+)\}", path)), (method, path)
            assert op["responses"], (method, path)


def test_errors_are_renamed_to_the_parameter_that_carried_the_value() -> None:
    params = {"event.geofence": "geofence", "event.topic": "topic"}
    err = _as_param(InvalidInput("event.geofence.wkt", "unparsable"), params)
    assert isinstance(err, InvalidInput) and err.field == "geofence"
    assert "unparsable" in err.reason and "event.geofence.wkt" in err.reason
    big = _as_param(TooLarge("event.geofence.wkt", 10, 5), params)
    assert isinstance(big, TooLarge) and (big.field, big.size, big.limit) == ("geofence", 10, 5)
    other = InvalidInput("event.topicality", "x")  # a prefix of the name is not enough
    assert _as_param(other, params) is other
    redirect = WrongBroker("event.publisher", "us")
    assert _as_param(redirect, {"event.publisher": "location"}) is redirect


@pytest.mark.parametrize(
    "name",
    [
        "index.html",
        "map.js",
        "map.css",
        "vendor/leaflet/leaflet.js",
        "vendor/leaflet/leaflet.css",
        "vendor/geoman/leaflet-geoman.min.js",
        "vendor/topojson-client/topojson-client.min.js",
        "vendor/world-atlas/land-110m.json",
        "vendor/VENDOR.md",
    ],
)
def test_the_map_files_are_in_the_package(name: str) -> None:
    assert (WEB_DIR / name).is_file()


def test_the_map_settings_come_from_the_node_config() -> None:
    tiles = "http://127.0.0.1:9/tiles/{z}/{x}/{y}.png"
    b = bridge(http_map_tiles=tiles, strategy="subscription-geofence")

    async def main() -> dict[str, object]:
        async with TestClient(TestServer(b.app)) as client:
            resp = await client.get("/api/federation")
            assert resp.status == 200
            answer: dict[str, object] = await resp.json()
            return answer

    answer = asyncio.run(main())
    assert answer["tiles"] == tiles and answer["broker"] == "eu"
    assert answer["strategy"] == "subscription-geofence"
    features = answer["federation"]["features"]  # type: ignore[index]
    assert sorted(f["properties"]["id"] for f in features) == ["ap", "eu", "us"]
