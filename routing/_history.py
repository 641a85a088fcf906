"""Message history: what a query asks for, what a broker logged, and how answers merge.

Every broker logs the events published in its area (docs/design.md §10). A
history query names a topic filter, a time interval and an area; an entry
answers it when its topic matches the filter (the ContentCheck, MQTT rules),
its publish time lies in the interval (both ends included) and the query area
*covers* its publisher location (boundary included, ±180 one meridian — the
Subscription GeoCheck's predicate). Because an event is logged by the broker
responsible for its publisher location, only the brokers whose areas meet the
query area can hold an answer: `Federation.brokers_meeting`, the routing
core's area index (`history_targets` in the cost model).

Answers are ordered **newest first** (publish time, then event id, both
descending) so that ``limit=1`` is the latest event, as a REST reader of a
topic expects; each broker answers its own first `limit` entries and the
asking broker merges them and cuts the merged list to `limit`, which is exact.
"""

from __future__ import annotations

import base64
import functools
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import shapely
from shapely.geometry import MultiLineString, mapping
from shapely.geometry.base import BaseGeometry

from ._errors import InvalidInput
from ._geometry import Geofence, LatLon
from ._once import once
from ._topics import topic_matches, validate_filter

MAX_BOXES = 32
"""Parts of a query area beyond which the index is asked for its one bounding box instead
(a query of thousands of boxes would outgrow SQL's limits)."""

RECORD_OVERHEAD = 64
"""Bytes counted per history entry besides its texts and payload (ids, times, index)."""

_ANTIMERIDIAN = MultiLineString([[(x, -90.0), (x, 90.0)] for x in (-180.0, 180.0)])

Box = tuple[float, float, float, float]
"""A bounding box: (min lon, min lat, max lon, max lat)."""


@dataclass(frozen=True)
class HistoryRecord:
    """One logged event, as its publisher's broker accepted it.

    Attributes:
        event_id: the event's id (unique in the federation).
        topic: its topic name.
        payload: its payload, opaque bytes.
        published_at: wall-clock seconds since the epoch, set by the publisher's broker.
        origin: id of that broker (where the entry is kept).
        location: the publisher location.
        geofence: the event geofence (where subscribers had to be); None = the world.
    """

    event_id: str
    topic: str
    payload: bytes
    published_at: float
    origin: str
    location: LatLon
    geofence: Geofence | None = None

    @once
    def size(self) -> int:
        """Bytes this entry counts against history limits (payload, texts, overhead).

        Computed when first asked for and kept (`once`: the history's writer
        thread sums the sizes of a batch while the event loop records entries).
        """
        fence = 0 if self.geofence is None else len(self.geofence.wkt)
        return (
            len(self.payload)
            + len(self.topic.encode("utf-8"))
            + len(self.event_id.encode("utf-8"))
            + len(self.origin.encode("utf-8"))
            + fence
            + RECORD_OVERHEAD
        )

    def to_geojson_feature(self) -> dict[str, Any]:
        """A GeoJSON Feature: the publisher location as the point, the rest as properties.

        The payload is given as text when it is UTF-8 (``payload_encoding``
        ``utf-8``), otherwise base64 (``base64``); the event geofence is a
        GeoJSON geometry or null.
        """
        try:
            text, encoding = self.payload.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(self.payload).decode("ascii"), "base64"
        return {
            "type": "Feature",
            "id": self.event_id,
            "geometry": {"type": "Point", "coordinates": [self.location.lon, self.location.lat]},
            "properties": {
                "event_id": self.event_id,
                "topic": self.topic,
                "published_at": self.published_at,
                "origin": self.origin,
                "payload": text,
                "payload_encoding": encoding,
                "geofence": None if self.geofence is None else mapping(self.geofence.geometry),
            },
        }


class HistoryAnswer(list[HistoryRecord]):
    """The entries a history query answered (newest first), with how it was answered.

    Attributes:
        truncated: ``history_max_answer_bytes`` cut the list before the query's limit.
        brokers: the brokers asked (`history_targets` of the query).
    """

    def __init__(
        self,
        records: Iterable[HistoryRecord] = (),
        *,
        truncated: bool = False,
        brokers: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(records)
        self.truncated = truncated
        self.brokers = brokers


def history_order(record: HistoryRecord) -> tuple[float, str, str]:
    """Sort key of history answers; they are listed in descending order (newest first)."""
    return (record.published_at, record.event_id, record.origin)


@dataclass(frozen=True)
class HistoryQuery:
    """What a history read (or delete) asks for; validated when built.

    Attributes:
        topic_filter: an MQTT topic filter (``+``, ``#``).
        start: earliest publish time (unix seconds, included); None = no lower bound.
        end: latest publish time (included); None = no upper bound.
        geometry: the area whose publisher locations are asked for (any shapely
            geometry in lon/lat, usually a Polygon or MultiPolygon cut at ±180);
            None = the whole world.
        limit: the most entries answered (the newest first).

    Raises:
        InvalidInput: naming the field (``topic_filter``, ``start``, ``end``,
            ``geometry``, ``limit``).
    """

    topic_filter: str
    start: float | None
    end: float | None
    geometry: BaseGeometry | None
    limit: int

    def __post_init__(self) -> None:
        validate_filter(self.topic_filter, "topic_filter")
        for name in ("start", "end"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidInput(name, f"must be a time in unix seconds, got {value!r}")
            if not math.isfinite(value):
                raise InvalidInput(name, f"must be finite, got {value!r}")
        if self.start is not None and self.end is not None and self.end < self.start:
            raise InvalidInput("end", f"{self.end!r} is before start {self.start!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise InvalidInput("limit", f"must be an integer >= 1, got {self.limit!r}")
        if self.geometry is not None:
            _check_geometry(self.geometry)

    @functools.cached_property
    def area(self) -> Geofence | None:
        """The query geometry as the routing core takes it (None = the world)."""
        return None if self.geometry is None else Geofence(self.geometry)

    @functools.cached_property
    def boxes(self) -> list[Box] | None:
        """Bounding boxes that hold every publisher location the area covers (None = all).

        One per part of the geometry (one for all beyond `MAX_BOXES` parts),
        plus the mirror image of where it touches ±180 (a point on 180 is
        also on −180): a spatial index asked for these boxes returns a
        superset of the answer, `matches` decides.
        """
        if self.geometry is None:
            return None
        parts = getattr(self.geometry, "geoms", [self.geometry])
        if len(parts) > MAX_BOXES:  # one box for them all: still a superset
            parts = [self.geometry]
        out: list[Box] = [tuple(p.bounds) for p in parts]
        seam = shapely.intersection(self.geometry, _ANTIMERIDIAN)
        if not seam.is_empty:
            minx, miny, maxx, maxy = seam.bounds
            for x in {-minx, -maxx}:
                out.append((x, miny, x, maxy))
        return out

    @functools.cached_property
    def topic_range(self) -> tuple[str, str | None] | None:
        """(low, high) such that every matching topic t has low <= t < high (high None: no bound).

        From the filter's literal levels before its first wildcard, for an
        index on topics; None when the filter starts with a wildcard.
        Comparison is by code point (UTF-8 byte order).
        """
        literal: list[str] = []
        for level in self.topic_filter.split("/"):
            if level in ("+", "#"):
                break
            literal.append(level)
        else:
            # No wildcard: one topic. Topics hold no NUL, so none lies between.
            return (self.topic_filter, self.topic_filter + "\x01")
        if not literal:
            return None
        prefix = "/".join(literal)
        return (prefix, _successor(prefix))

    def matches(self, record: HistoryRecord) -> bool:
        """The record answers this query (topic, time interval, area)."""
        t = record.published_at
        if self.start is not None and t < self.start:
            return False
        if self.end is not None and t > self.end:
            return False
        if not topic_matches(self.topic_filter, record.topic):
            return False
        area = self.area
        return area is None or area.covers(record.location)


def merge_history(
    answers: Iterable[Iterable[HistoryRecord]], limit: int, max_bytes: int | None = None
) -> tuple[list[HistoryRecord], bool]:
    """Merge brokers' answers into one, newest first, cut to `limit` and `max_bytes`.

    Each answer must hold its broker's first entries in that order (its first
    `limit`, or fewer if it was cut by `max_bytes` itself): the merged prefix
    is then exact, since every entry of it is within its own broker's prefix.

    Returns:
        (the entries, whether `max_bytes` cut the list before `limit`).
    """
    merged = sorted((r for answer in answers for r in answer), key=history_order, reverse=True)
    return cut_history(merged[:limit], max_bytes)


def cut_history(
    records: list[HistoryRecord], max_bytes: int | None
) -> tuple[list[HistoryRecord], bool]:
    """The longest prefix of `records` whose sizes sum to at most `max_bytes`, and if it cut."""
    if max_bytes is None:
        return records, False
    total = 0
    for i, r in enumerate(records):
        total += r.size
        if total > max_bytes:
            return records[:i], True
    return records, False


def _successor(prefix: str) -> str | None:
    """The smallest string greater than every string starting with `prefix`."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop())
        if last < sys.maxunicode:
            nxt = last + 1
            if 0xD800 <= nxt <= 0xDFFF:  # surrogates are not characters
                nxt = 0xE000
            return "".join(chars) + chr(nxt)
    return None


def _check_geometry(geom: Any) -> None:
    if not isinstance(geom, BaseGeometry):
        raise InvalidInput("geometry", f"must be a geometry, got {type(geom).__name__}")
    if geom.is_empty:
        raise InvalidInput("geometry", "must not be empty (leave it unset for the world)")
    if not geom.is_valid:
        reason = shapely.is_valid_reason(geom)
        raise InvalidInput("geometry", f"invalid geometry: {reason}")
    minx, miny, maxx, maxy = geom.bounds
    if not all(math.isfinite(v) for v in (minx, miny, maxx, maxy)):
        raise InvalidInput("geometry", "coordinates must be finite")
    if minx < -180.0 or maxx > 180.0:
        raise InvalidInput("geometry", f"longitudes must be within [-180, 180], got {minx}..{maxx}")
    if miny < -90.0 or maxy > 90.0:
        raise InvalidInput("geometry", f"latitudes must be within [-90, 90], got {miny}..{maxy}")
