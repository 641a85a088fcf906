"""Roaming geofences: subscription geofences relative to the subscriber (docs/design.md §1).

A roaming geofence is a shape given around its subscriber — a circle of
``radius_m`` metres, or a polygon whose vertices are (east, north) offsets in
metres — that moves with the subscriber's location. Wherever a broker holds
a roaming subscription it holds it *placed*: the shape put down at a
location (`Roaming.place`), an ordinary `Geofence` from then on, so matching,
indexing and routing treat it like any other subscription geofence.

Placement is a pure function of (shape, location), computed by every holder
itself: a subscriber's broker places it at the subscriber's location, and a
broker holding a forwarded copy places it at the location the subscriber's
broker sent along (docs/design.md §3). So every holder, the cost model and the
oracle get the very same polygon.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import shapely
from shapely.geometry import Polygon

from ._errors import InvalidInput
from ._geometry import (
    DEFAULT_MAX_VERTICES,
    EARTH_RADIUS_M,
    MAX_CIRCLE_RADIUS_M,
    MIN_CIRCLE_RADIUS_M,
    Geofence,
    LatLon,
    _canonical,
    _cut_antimeridian,
    _finite,
    circle,
    destination,
)

ROAM_PREFIX = "roam:"
"""Text form of a roaming geofence: ``roam:circle:R`` or ``roam:polygon:E N, E N, ...``."""

MAX_ROAMING_EXTENT_M = MAX_CIRCLE_RADIUS_M
"""Farthest a roaming geofence reaches from its subscriber (as for circles)."""


@dataclass(frozen=True, slots=True)
class Roaming:
    """A subscription geofence relative to its subscriber; build it with `parse_roaming`.

    Attributes:
        radius_m: a circle of this radius around the subscriber; None for a polygon.
        ring: the polygon: closed ring of (east, north) offsets in metres
            from the subscriber; empty for a circle.
    """

    radius_m: float | None = None
    ring: tuple[tuple[float, float], ...] = ()

    @property
    def text(self) -> str:
        """Canonical text: ``roam:circle:R`` or ``roam:polygon:E N, ...``."""
        if self.radius_m is not None:
            return f"{ROAM_PREFIX}circle:{self.radius_m!r}"
        return f"{ROAM_PREFIX}polygon:" + ", ".join(f"{e!r} {n!r}" for e, n in self.ring)

    @property
    def extent_m(self) -> float:
        """How far from the subscriber the shape reaches, in metres."""
        if self.radius_m is not None:
            return self.radius_m
        return max(math.hypot(e, n) for e, n in self.ring)

    def place(self, at: LatLon) -> Geofence:
        """The geofence this shape makes around a subscriber at `at` (cached, deterministic)."""
        return _place(self, at.lat, at.lon)

    def __repr__(self) -> str:
        text = self.text
        return f"Roaming({text if len(text) < 80 else text[:77] + '...'})"


def is_roaming(value: Any) -> bool:
    """True when `value` is written as a roaming geofence (text or mapping form)."""
    if isinstance(value, Roaming):
        return True
    if isinstance(value, str):
        return value.strip().lower().startswith(ROAM_PREFIX)
    return isinstance(value, Mapping) and "roaming" in value


def parse_roaming(
    value: Any, field: str = "geofence", *, max_vertices: int = DEFAULT_MAX_VERTICES
) -> Roaming:
    """Validate a roaming geofence, in any of its notations.

    Text: ``roam:circle:RADIUS_M`` or ``roam:polygon:E N, E N, ...`` (offsets in
    metres east and north of the subscriber; the ring is closed if it is not).
    Mapping: ``{"roaming": {"radius_m": R}}`` or ``{"roaming": {"polygon":
    [[E, N], ...]}}``. The shape must reach at least 1 m and at most 5,000 km;
    a polygon must be valid (not self-intersecting, with an area) in the
    plane of its offsets, with at most `max_vertices` vertices.

    Raises:
        InvalidInput: naming `field` (``field.roaming.radius_m``, ...).
    """
    if isinstance(value, Roaming):
        return value
    if isinstance(value, str):
        return _from_text(value, field, max_vertices)
    if not isinstance(value, Mapping) or not isinstance(value.get("roaming"), Mapping):
        raise InvalidInput(
            f"{field}.roaming", "must be an object with radius_m or polygon (offsets in metres)"
        )
    spec = value["roaming"]
    if ("radius_m" in spec) == ("polygon" in spec):
        raise InvalidInput(f"{field}.roaming", "needs exactly one of radius_m and polygon")
    if "radius_m" in spec:
        return _circle(spec["radius_m"], f"{field}.roaming.radius_m")
    return _polygon(spec["polygon"], f"{field}.roaming.polygon", max_vertices)


def _from_text(text: str, field: str, max_vertices: int) -> Roaming:
    body = text.strip()
    if not body.lower().startswith(ROAM_PREFIX):
        raise InvalidInput(
            field, f"a roaming geofence starts with {ROAM_PREFIX!r}, got {text!r:.80}"
        )
    kind, sep, rest = body[len(ROAM_PREFIX) :].partition(":")
    usage = f"expected {ROAM_PREFIX}circle:RADIUS_M or {ROAM_PREFIX}polygon:E N, E N, ... (metres)"
    if not sep or kind.lower() not in ("circle", "polygon"):
        raise InvalidInput(field, f"{usage}, got {text!r:.80}")
    if kind.lower() == "circle":
        try:
            radius = float(rest)
        except ValueError:
            raise InvalidInput(field, f"{usage}, got {text!r:.80}") from None
        return _circle(radius, f"{field}.radius_m")
    pairs = [p.split() for p in rest.split(",")]
    _check_count(len(pairs), field, max_vertices)
    try:
        ring = [(float(p[0]), float(p[1])) for p in pairs if len(p) == 2]
    except ValueError:
        raise InvalidInput(field, f"{usage}, got {text!r:.80}") from None
    if len(ring) != len(pairs):
        raise InvalidInput(field, f"{usage}: each vertex is two numbers, got {text!r:.80}")
    return _polygon(ring, f"{field}.polygon", max_vertices)


def _circle(radius: Any, field: str) -> Roaming:
    r = _finite(radius, field)
    if not MIN_CIRCLE_RADIUS_M <= r <= MAX_CIRCLE_RADIUS_M:
        raise InvalidInput(
            field,
            f"must be within [{MIN_CIRCLE_RADIUS_M:g}, {MAX_CIRCLE_RADIUS_M:.0f}] metres,"
            f" got {r!r}",
        )
    return Roaming(radius_m=r)


def _check_count(count: int, field: str, max_vertices: int) -> None:
    if count > max_vertices:
        raise InvalidInput(field, f"more than {max_vertices} vertices ({count})")


def _polygon(raw: Any, field: str, max_vertices: int) -> Roaming:
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise InvalidInput(field, "must be a list of [east_m, north_m] offsets")
    _check_count(len(raw), field, max_vertices)
    ring: list[tuple[float, float]] = []
    for i, pos in enumerate(raw):
        if not isinstance(pos, Sequence) or isinstance(pos, str) or len(pos) != 2:
            raise InvalidInput(f"{field}[{i}]", "a vertex is [east_m, north_m]")
        e, n = _finite(pos[0], f"{field}[{i}].east_m"), _finite(pos[1], f"{field}[{i}].north_m")
        if math.hypot(e, n) > MAX_ROAMING_EXTENT_M:
            raise InvalidInput(
                f"{field}[{i}]", f"farther than {MAX_ROAMING_EXTENT_M:.0f} m from the subscriber"
            )
        ring.append((e, n))
    if ring and ring[0] != ring[-1]:
        ring.append(ring[0])
    if len(ring) < 4:
        raise InvalidInput(field, "a polygon needs at least 3 vertices")
    _check_count(len(ring), field, max_vertices)
    poly = Polygon(ring)
    if not poly.is_valid:
        raise InvalidInput(field, f"invalid polygon: {shapely.is_valid_reason(poly)}")
    if poly.area == 0.0:
        raise InvalidInput(field, "the polygon has no area")
    shape = Roaming(ring=tuple(ring))
    if shape.extent_m < MIN_CIRCLE_RADIUS_M:
        raise InvalidInput(
            field, f"reaches less than {MIN_CIRCLE_RADIUS_M:g} m from the subscriber"
        )
    return shape


@functools.lru_cache(maxsize=1024)
def _place(shape: Roaming, lat: float, lon: float) -> Geofence:
    """The placement (pure; cached, bounded: the home, the copies and the models ask for it).

    A circle is the geodesic circle of `circle`. A polygon's vertices go to
    the points at their offset's distance and bearing (an azimuthal
    equidistant placement), joined by straight lon/lat edges like any
    polygon. Where that would not give a valid geofence — the shape reaches
    as far as a pole, or is distorted into an invalid one near it — the
    polygon's circumscribed circle around the subscriber is used instead, so
    that placement always succeeds (the same everywhere, hence still exact).
    """
    at = LatLon(lat, lon)
    field = "roaming geofence"
    if shape.radius_m is not None:
        return circle(at, shape.radius_m, field, max_vertices=sys.maxsize)
    extent = shape.extent_m
    to_pole = math.radians(90.0 - abs(lat)) * EARTH_RADIUS_M
    if extent < to_pole:
        lat1, lon1 = math.radians(lat), math.radians(lon)
        ring = [
            destination(lat1, lon1, math.atan2(e, n), math.hypot(e, n) / EARTH_RADIUS_M)
            for e, n in shape.ring
        ]
        ring[-1] = ring[0]  # the closing vertex is the first one, bit for bit
        poly = Polygon(ring)
        if poly.is_valid and poly.area > 0.0:
            try:
                return _canonical(_cut_antimeridian(poly), field, sys.maxsize, None)
            except InvalidInput:
                pass
    return circle(at, max(extent, MIN_CIRCLE_RADIUS_M), field, max_vertices=sys.maxsize)
