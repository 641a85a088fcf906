"""Geo-context on MQTT packets: user properties (MQTT 5) and the ``$geofed/`` topic prefix.

Pure: text in, a `GeoTopic` out, or an `InvalidInput` naming the topic
prefix that was wrong. Locations and geofences are written as on the command
line (`geofed.wire.location_from_text`, `geofence_from_text`); the geofence
text itself is validated later by the node, exactly as for gRPC clients
(`docs/design.md` §1). The conventions are in docs/mqtt.md.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from geofed.routing import InvalidInput, validate_id

LOCATION_PROPERTY = "geofed-location"
"""MQTT 5 user property: the client's location, ``LAT,LON`` (any packet)."""
GEOFENCE_PROPERTY = "geofed-geofence"
"""MQTT 5 user property: the event geofence (PUBLISH) or subscription geofence (SUBSCRIBE)."""
PREFIX = "$geofed/"
"""Topic prefix carrying geo-context for clients without properties (MQTT 3.1.1)."""
LOCATION_LEVEL = "loc="
FENCE_LEVEL = "fence="
REDIRECT_TOPIC = "$geofed/redirect"
"""Where a 3.1.1 client is told its new broker (payload ``host:port``) before it is disconnected."""


@dataclass(frozen=True)
class GeoTopic:
    """A topic (or filter) with its ``$geofed/`` prefix taken apart.

    Attributes:
        topic: the topic or filter itself; "" when the packet only carried geo-context.
        location: text of a ``loc=`` level, or None.
        geofence: text of a ``fence=`` level, or None.
    """

    topic: str
    location: str | None = None
    geofence: str | None = None


def split_topic(topic: str) -> GeoTopic:
    """Take ``$geofed/loc=LAT,LON/fence=GEOFENCE/`` levels off a topic name or filter.

    Anything not starting with ``$geofed/`` is returned as it is. After the
    prefix, levels ``loc=...`` and ``fence=...`` (each at most once, in any
    order) are read until the first other level, where the topic starts.

    Raises:
        InvalidInput: a level given twice, or a ``$geofed/`` topic with neither.
    """
    if not topic.startswith(PREFIX):
        return GeoTopic(topic)
    levels = topic[len(PREFIX) :].split("/")
    location: str | None = None
    fence: str | None = None
    i = 0
    while i < len(levels):
        level = levels[i]
        if level.startswith(LOCATION_LEVEL) and location is None:
            location = level[len(LOCATION_LEVEL) :]
        elif level.startswith(FENCE_LEVEL) and fence is None:
            fence = level[len(FENCE_LEVEL) :]
        elif level.startswith((LOCATION_LEVEL, FENCE_LEVEL)):
            raise InvalidInput(PREFIX, f"{level.split('=')[0]}= given twice in {topic!r}")
        else:
            break
        i += 1
    if location is None and fence is None:
        raise InvalidInput(
            PREFIX, f"{topic!r}: topics under {PREFIX} start with loc= or fence= levels"
        )
    return GeoTopic("/".join(levels[i:]), location, fence)


def subscription_id(topic_filter: str) -> str:
    """The geofed subscription id of an MQTT client's filter: the filter itself if it can be one.

    A filter is a subscription's identity in MQTT (subscribing again replaces
    it); a filter that is no valid id (too long, control characters) is
    known by its SHA-256 instead.
    """
    try:
        return validate_id(topic_filter, "filter")
    except InvalidInput:
        return "mqtt-sha256:" + hashlib.sha256(topic_filter.encode("utf-8")).hexdigest()
