"""A single central matcher, written independently of the routing code.

It keeps every subscription and every client location in plain dicts and
tests every subscription against every event with a regex topic match. Tests
hold each strategy, the live federation and the Spark job against it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

from ._geometry import Geofence, LatLon
from ._roaming import Roaming
from ._trace import TraceOp


@lru_cache(maxsize=4096)
def _filter_regex(topic_filter: str) -> re.Pattern[str]:
    parts: list[str] = []
    levels = topic_filter.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            # 'a/#' matches 'a' too: the separator before '#' is optional.
            if parts:
                parts[-1] = parts[-1] + "(?:/.*)?"
                return re.compile("".join(parts) + "\\Z", re.S)
            return re.compile(".*\\Z", re.S)
        atom = "[^/]*" if level == "+" else re.escape(level)
        parts.append(atom if i == 0 else "/" + atom)
    return re.compile("".join(parts) + "\\Z", re.S)


def reference_topic_match(topic_filter: str, topic: str) -> bool:
    """MQTT topic matching by regular expression (reference implementation)."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    return _filter_regex(topic_filter).match(topic) is not None


def _inside(fence: Geofence | None, p: LatLon) -> bool:
    if fence is None:
        return True
    lons = (180.0, -180.0) if abs(p.lon) == 180.0 else (p.lon,)
    from shapely.geometry import Point

    return any(fence.geometry.covers(Point(x, p.lat)) for x in lons)


def reference_deliveries(ops: Iterable[TraceOp]) -> list[tuple[str, str]]:
    """Every (event id, subscription id) a central matcher delivers, in order.

    Rejections mirror the simulator: a subscribe reusing another client's live
    id and an unsubscribe of an id the client does not hold are ignored. A
    roaming geofence is put down around its subscriber's location of the
    moment of each publish.
    """
    subs: dict[str, tuple[str, str, Geofence | None, Roaming | None]] = {}
    where: dict[str, LatLon] = {}
    out: list[tuple[str, str]] = []
    for op in ops:
        if op.location is not None:
            where[op.client] = op.location
        if op.op == "subscribe":
            held = subs.get(op.id)
            if held is None or held[0] == op.client:
                subs[op.id] = (op.client, op.topic, op.geofence, op.roaming)
        elif op.op == "unsubscribe":
            held = subs.get(op.id)
            if held is not None and held[0] == op.client:
                del subs[op.id]
        elif op.op == "publish":
            assert op.location is not None
            for sub_id in sorted(subs):
                client, topic_filter, fence, roaming = subs[sub_id]
                if roaming is not None:
                    fence = roaming.place(where[client])
                if (
                    reference_topic_match(topic_filter, op.topic)
                    and _inside(fence, op.location)
                    and _inside(op.geofence, where[client])
                ):
                    out.append((op.id, sub_id))
    return out
