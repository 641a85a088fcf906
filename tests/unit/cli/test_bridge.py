"""`geofed bridge-topics` without a network: what an imported MQTT message becomes.

The bridge decodes the location from the topic (the centre of its cell) or
takes the exact one of the `geofed-location` property when it lies in that
cell; anything else is refused with the field named. The end-to-end runs
against Mosquitto are in tests/integration/test_bridge_topics.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from geofed.cli.bridge import LOCATION_PROPERTY, TopicBridge
from geofed.routing import DecimalLayout, Federation, H3Layout, InvalidInput, LatLon

LAYOUT = DecimalLayout(prefix="geo", decimals=2)


@dataclass
class Props:
    UserProperty: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Msg:
    topic: str
    properties: Props | None = None


def bridge(**kwargs: object) -> TopicBridge:
    args: dict[str, object] = {
        "mqtt": ("127.0.0.1", 1883),
        "layout": LAYOUT,
        "client_id": "b",
        "federation": Federation.load("three"),
        "imports": ["sensors/#"],
    }
    args.update(kwargs)
    return TopicBridge(**args)  # type: ignore[arg-type]


def test_import_subscribes_to_every_location_under_the_prefix() -> None:
    assert bridge(imports=["#"]).import_filters == ["geo/#"]
    assert bridge().import_filters == ["geo/+/+/+/+/+/+/+/+/+/+/+/sensors/#"]
    assert bridge(imports=["sensors/+/temp"]).import_filters == [
        "geo/+/+/+/+/+/+/+/+/+/+/+/sensors/+/temp"
    ]
    h3 = bridge(layout=H3Layout(prefix="h", resolution=3), imports=["a"])
    assert h3.import_filters == ["h/+/+/+/+/a"]


def test_the_location_is_the_cell_centre_or_the_exact_property() -> None:
    b = bridge()
    topic = LAYOUT.topic(LatLon(48.8566, 2.3522), "sensors/paris/temp")
    assert topic == "geo/_/4/8/8/5/_/0/0/2/3/5/sensors/paris/temp"
    where, rest = b._decode(Msg(topic))
    assert rest == "sensors/paris/temp"
    assert where == LatLon(48.855, 2.355)
    exact = Props([(LOCATION_PROPERTY, "48.8566,2.3522")])
    assert b._decode(Msg(topic, exact))[0] == LatLon(48.8566, 2.3522)
    elsewhere = Props([(LOCATION_PROPERTY, "48.8666,2.3522")])
    with pytest.raises(InvalidInput) as err:
        b._decode(Msg(topic, elsewhere))
    assert err.value.field == LOCATION_PROPERTY
    with pytest.raises(InvalidInput) as err:
        b._decode(Msg("geo/_/4/8/8/sensors"))
    assert err.value.field.startswith("mqtt.topic")


def test_imported_events_are_marked_per_bridge() -> None:
    a, b = bridge(client_id="a"), bridge(client_id="b")
    assert a.marker != b.marker and a.marker.startswith("bridge-")
    assert len(a.marker) < 40  # leaves an event id room (ids are at most 256 characters)
