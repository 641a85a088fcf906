"""Geometry of geo-context: points, geofences, parsing and the *covers* check.

Everything is in WGS84 longitude/latitude degrees. Polygon edges are straight
lines in coordinate space (as GeoJSON, RFC 7946, reads them). Circles are
geodesic: their boundary is densified once, when they are parsed.

Antimeridian: an edge whose longitude span exceeds 180 degrees is read as
crossing the antimeridian the short way, and such a polygon is cut at ±180 into
a MultiPolygon (RFC 7946 §3.1.9). Shapes wider than 180 degrees of longitude
must therefore carry intermediate vertices.

Limits: the work is bounded before it starts. Geofence text longer than
`max_bytes` is refused before it is parsed (`TooLarge`), and positions are
counted against `max_vertices` before any of them is validated. Both limits
hold again for the result in canonical form (after the cut, as `Geofence.wkt`),
so whatever is accepted re-parses under the same limits.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import shapely
from shapely import affinity
from shapely.geometry import MultiPolygon, Polygon, box
from shapely.geometry.base import BaseGeometry

from ._errors import InvalidInput, TooLarge
from ._once import once

EARTH_RADIUS_M = 6_371_008.8
"""Mean Earth radius (IUGG), used for circles and great-circle distances."""

DEFAULT_MAX_VERTICES = 10_000
"""Default limit on the vertices of one geofence (configurable per node)."""

DEFAULT_MAX_BYTES = 1_048_576
"""Default limit on the UTF-8 size of one geofence text (configurable per node).

Checked before the text is parsed, and on the canonical WKT of the result.
A 10,000-vertex geofence at full precision takes about 450 KB of WKT."""

MIN_CIRCLE_RADIUS_M = 1.0
"""Smallest accepted circle radius: smaller ones degenerate at WKT precision."""

MAX_CIRCLE_RADIUS_M = 5_000_000.0
"""Largest accepted circle radius; larger areas should be given as polygons."""

CIRCLE_SEGMENTS = 64

_WORLD_BOX = box(-180.0, -90.0, 180.0, 90.0)
_SHEETS = (-360.0, 0.0, 360.0)

Ring = list[tuple[float, float]]


@dataclass(frozen=True, slots=True)
class LatLon:
    """A WGS84 point. Build it with `latlon()` to validate untrusted input."""

    lat: float
    lon: float


def latlon(lat: Any, lon: Any, field: str = "location") -> LatLon:
    """Validate and build a point.

    Raises:
        InvalidInput: naming ``field.lat`` / ``field.lon`` when a coordinate is
            not a finite number or out of range.
    """
    lat_f = _finite(lat, f"{field}.lat")
    lon_f = _finite(lon, f"{field}.lon")
    if not -90.0 <= lat_f <= 90.0:
        raise InvalidInput(f"{field}.lat", f"must be within [-90, 90], got {lat_f!r}")
    if not -180.0 <= lon_f <= 180.0:
        raise InvalidInput(f"{field}.lon", f"must be within [-180, 180], got {lon_f!r}")
    return LatLon(lat_f, lon_f)


def _normal(degrees: float) -> float:
    """A vertex coordinate with subnormal values read as 0.

    Below the smallest normal double (about 2.2e-308 degrees) a coordinate
    means 0 to anyone, but GEOS's overlay loses track of such slivers: the
    intersection of a cell with a piece whose edge stood at 5e-324 came back
    as the whole cell, and geofence covers went wrong.
    """
    return 0.0 if 0.0 < abs(degrees) < sys.float_info.min else degrees


def _finite(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(field, f"must be a number, got {value!r}")
    try:
        f = float(value)
    except OverflowError:  # an int beyond float range, e.g. from JSON
        f = math.inf
    if not math.isfinite(f):
        raise InvalidInput(field, f"must be finite, got {f!r}")
    return f


@dataclass(frozen=True, eq=False)
class Geofence:
    """An area (Polygon or MultiPolygon) within [-180, 180] x [-90, 90].

    ``None`` stands for the whole world wherever a geofence is optional.
    Instances are immutable and hashable by identity; `wkt` is canonical text.
    """

    geometry: BaseGeometry
    bounds: tuple[float, float, float, float] = field(init=False)

    def __post_init__(self) -> None:
        shapely.prepare(self.geometry)
        object.__setattr__(self, "bounds", tuple(self.geometry.bounds))

    @once
    def wkt(self) -> str:
        """Canonical WKT text (full precision: parsed, it gives back these exact coordinates).

        Made when first asked for: a broker holding many subscriptions needs it
        only for those it forwards.
        """
        return to_wkt(self.geometry)

    @once
    def key(self) -> bytes:
        """The exact shape as bytes (WKB), for caches: much cheaper to make than `wkt`."""
        return bytes(shapely.to_wkb(self.geometry))

    def covers(self, point: LatLon) -> bool:
        """True when `point` lies inside or on the boundary."""
        return self.covers_xy(point.lon, point.lat)

    def covers_xy(self, lon: float, lat: float) -> bool:
        """`covers` for raw coordinates (the hot path of matching)."""
        minx, miny, maxx, maxy = self.bounds
        # The bounding box rules out most candidates without calling GEOS.
        if lat < miny or lat > maxy:
            return False
        if abs(lon) == 180.0:
            return _covers_xy(self.geometry, lon, lat)
        if lon < minx or lon > maxx:
            return False
        return bool(_intersects_xy(self.geometry, lon, lat))

    def intersects(self, other: BaseGeometry) -> bool:
        """True when this area and `other` share at least one point."""
        return bool(self.geometry.intersects(other))

    @property
    def parts(self) -> Sequence[Polygon]:
        """The polygons this geofence consists of."""
        geom = self.geometry
        return list(geom.geoms) if isinstance(geom, MultiPolygon) else [geom]

    @property
    def vertex_count(self) -> int:
        """Number of coordinates, holes included."""
        return int(shapely.get_num_coordinates(self.geometry))

    def __repr__(self) -> str:
        text = self.wkt if len(self.wkt) < 80 else self.wkt[:77] + "..."
        return f"Geofence({text})"


def covers(geofence: Geofence | None, point: LatLon) -> bool:
    """The GeoCheck: `point` lies in `geofence` (``None`` is the whole world)."""
    return True if geofence is None else geofence.covers_xy(point.lon, point.lat)


# The ufunc behind shapely.intersects_xy, without its argument handling:
# matching calls it once per candidate subscription.
_intersects_xy = getattr(shapely.lib, "intersects_xy", shapely.intersects_xy)


def _covers_xy(geom: BaseGeometry, lon: float, lat: float) -> bool:
    # For a point, intersects == covers (interior or boundary). Longitudes
    # -180 and 180 are the same meridian, so test both.
    if abs(lon) == 180.0:
        return bool(_intersects_xy(geom, 180.0, lat)) or bool(_intersects_xy(geom, -180.0, lat))
    return bool(_intersects_xy(geom, lon, lat))


def great_circle_m(a: LatLon, b: LatLon) -> float:
    """Great-circle distance in metres (haversine)."""
    p1, p2 = math.radians(a.lat), math.radians(b.lat)
    dp, dl = p2 - p1, math.radians(b.lon - a.lon)
    h = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * EARTH_RADIUS_M * math.asin(min(1.0, math.sqrt(h)))


# --------------------------------------------------------------------------
# Parsing


def parse_geofence(
    value: Any,
    field: str = "geofence",
    *,
    max_vertices: int = DEFAULT_MAX_VERTICES,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Geofence | None:
    """Parse any accepted geofence notation; ``None`` (or "") is the whole world.

    Accepted: WKT text (POLYGON / MULTIPOLYGON), GeoJSON text or mapping
    (Polygon / MultiPolygon geometry, or a Feature holding one), or a circle
    mapping ``{"circle": {"lat": .., "lon": .., "radius_m": ..}}``.

    Text longer than `max_bytes` (UTF-8) is refused before it is parsed, and
    the result's canonical WKT must fit too (None: no limit). At most
    `max_vertices` positions, counted before and after the antimeridian cut.

    Raises:
        TooLarge: naming `field` when the text or its canonical WKT exceeds `max_bytes`.
        InvalidInput: naming `field` for anything unparsable or invalid.
    """
    if value is None or (isinstance(value, str) and not value):
        return None
    if isinstance(value, str):
        check_text_size(value, field, max_bytes)
        text = value.strip()
        if text[:5].lower() == "roam:":
            raise InvalidInput(field, _NOT_HERE)
        if not text.startswith("{"):
            return _parse_wkt(text, field, max_vertices, max_bytes)
        value = _load_json(text, field)
    if isinstance(value, dict):
        if "roaming" in value:
            raise InvalidInput(field, _NOT_HERE)
        if "circle" in value:
            c = value["circle"]
            if not isinstance(c, dict):
                raise InvalidInput(f"{field}.circle", "must be an object with lat, lon, radius_m")
            center = latlon(c.get("lat"), c.get("lon"), f"{field}.circle")
            return circle(
                center,
                c.get("radius_m"),
                f"{field}.circle",
                max_vertices=max_vertices,
                max_bytes=max_bytes,
            )
        return parse_geojson(value, field, max_vertices=max_vertices, max_bytes=max_bytes)
    raise InvalidInput(field, f"must be WKT text, GeoJSON or a circle, got {type(value).__name__}")


_NOT_HERE = "a roaming geofence is accepted only as a subscription geofence"


def check_text_size(text: str, field: str, max_bytes: int | None) -> None:
    """Refuse geofence text over `max_bytes` UTF-8 bytes (None: no limit), before parsing it.

    Raises:
        TooLarge: naming `field`, with the text's size in bytes.
    """
    if max_bytes is None or 4 * len(text) <= max_bytes:  # at most 4 bytes a character
        return
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise TooLarge(field, size, max_bytes)


def _load_json(text: str, field: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(field, f"unparsable GeoJSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise InvalidInput(field, "unparsable GeoJSON: nested too deeply") from None
    except ValueError as exc:  # an integer beyond Python's digit limit for int(str)
        reason = "a number has too many digits" if "digits" in str(exc) else str(exc)[:200]
        raise InvalidInput(field, f"unparsable GeoJSON: {reason}") from None


class GeofenceCache:
    """Parses each distinct geofence text once: traces and wire messages repeat them.

    Every parse applies this cache's limits (`max_vertices`, `max_bytes`, see
    `parse_geofence`). Bounded: at most `size` texts of together at most
    `text_budget` characters (the newest is kept whatever its length); the
    least recently used goes first. Only text (WKT or GeoJSON) is cached;
    other notations are parsed every time.

    Not thread-safe, except `parse`, which leaves the cache alone: a caller
    may parse in a worker thread and `put` the result from its own.
    """

    def __init__(
        self,
        max_vertices: int = DEFAULT_MAX_VERTICES,
        size: int = 8192,
        *,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        text_budget: int = 64 << 20,
    ) -> None:
        self.max_vertices = max_vertices
        self.max_bytes = max_bytes
        self._size = size
        self._budget = text_budget
        self._chars = 0
        self._cache: OrderedDict[str, Geofence | None] = OrderedDict()

    def parse(self, value: Any, field: str = "geofence") -> Geofence | None:
        """`parse_geofence` under this cache's limits, without reading or filling the cache."""
        return parse_geofence(
            value, field, max_vertices=self.max_vertices, max_bytes=self.max_bytes
        )

    def __contains__(self, value: object) -> bool:
        return isinstance(value, str) and value in self._cache

    def put(self, text: str, fence: Geofence | None) -> None:
        """Remember `fence` as what `text` parses to (under this cache's limits)."""
        old = self._cache.pop(text, ...)
        if old is not ...:
            self._chars -= len(text)
        self._cache[text] = fence
        self._chars += len(text)
        while len(self._cache) > 1 and (
            len(self._cache) > self._size or self._chars > self._budget
        ):
            evicted, _ = self._cache.popitem(last=False)
            self._chars -= len(evicted)

    def get(self, value: Any, field: str = "geofence") -> Geofence | None:
        """`parse(value, field)`, from the cache when `value` was seen."""
        if not isinstance(value, str):
            return self.parse(value, field)
        hit = self._cache.get(value, ...)
        if hit is not ...:
            self._cache.move_to_end(value)
            return hit
        fence = self.parse(value, field)
        self.put(value, fence)
        return fence


def parse_wkt(
    text: str,
    field: str = "geofence",
    *,
    max_vertices: int = DEFAULT_MAX_VERTICES,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
) -> Geofence:
    """Parse a WKT POLYGON or MULTIPOLYGON (lon lat order); limits as in `parse_geofence`."""
    check_text_size(text, field, max_bytes)
    return _parse_wkt(text, field, max_vertices, max_bytes)


def _parse_wkt(text: str, field: str, max_vertices: int, max_bytes: int | None) -> Geofence:
    try:
        # "nan" parses (numpy warns); the coordinate check below rejects it by field.
        with np.errstate(invalid="ignore"):
            geom = shapely.from_wkt(text)
    except (shapely.errors.GEOSException, ValueError) as exc:
        raise InvalidInput(field, f"unparsable WKT: {str(exc)[:200]}") from None
    if geom is None or geom.is_empty:
        raise InvalidInput(field, "empty geometry")
    if not isinstance(geom, Polygon | MultiPolygon):
        raise InvalidInput(field, f"must be a POLYGON or MULTIPOLYGON, got {geom.geom_type}")
    # Counted before any position is looked at.
    _check_vertices(int(shapely.get_num_coordinates(geom)), field, max_vertices)
    if isinstance(geom, Polygon):
        polygons = [_rings_of(geom)]
    else:
        polygons = [_rings_of(p) for p in geom.geoms]
    return build_geofence(polygons, field, max_vertices=max_vertices, max_bytes=max_bytes)


def _check_vertices(count: int, field: str, max_vertices: int, where: str = "") -> None:
    if count > max_vertices:
        raise InvalidInput(field, f"more than {max_vertices} vertices{where} ({count})")


def _rings_of(p: Polygon) -> list[Ring]:
    return [list(p.exterior.coords), *(list(r.coords) for r in p.interiors)]


def parse_geojson(
    obj: Any,
    field: str = "geofence",
    *,
    max_vertices: int = DEFAULT_MAX_VERTICES,
    max_bytes: int | None = None,
) -> Geofence:
    """Parse a GeoJSON Polygon / MultiPolygon geometry (or a Feature holding one).

    Positions are counted against `max_vertices` before any is validated;
    `max_bytes` (None: no limit) bounds the result's canonical WKT.
    """
    if not isinstance(obj, dict):
        raise InvalidInput(field, "GeoJSON must be an object")
    if obj.get("type") == "Feature":
        # One level: a Feature's geometry is a geometry, never another Feature.
        field = f"{field}.geometry"
        obj = obj.get("geometry")
        if not isinstance(obj, dict):
            raise InvalidInput(field, "GeoJSON must be an object")
    kind, coords = obj.get("type"), obj.get("coordinates")
    if not isinstance(kind, str) or kind not in ("Polygon", "MultiPolygon"):
        raise InvalidInput(f"{field}.type", f"must be Polygon or MultiPolygon, got {kind!r:.80}")
    if not isinstance(coords, list) or not coords:
        raise InvalidInput(f"{field}.coordinates", "empty geometry")
    raw = [coords] if kind == "Polygon" else coords
    _check_vertices(
        sum(
            len(ring)
            for poly in raw
            if isinstance(poly, list)
            for ring in poly
            if isinstance(ring, list)
        ),
        field,
        max_vertices,
    )
    polygons: list[list[Ring]] = []
    for i, poly in enumerate(raw):
        where = f"{field}.coordinates" if kind == "Polygon" else f"{field}.coordinates[{i}]"
        if not isinstance(poly, list) or not poly:
            raise InvalidInput(where, "a polygon needs at least an exterior ring")
        rings: list[Ring] = []
        for j, ring in enumerate(poly):
            if not isinstance(ring, list):
                raise InvalidInput(f"{where}[{j}]", "a ring must be a list of positions")
            pts: Ring = []
            for k, pos in enumerate(ring):
                if not isinstance(pos, list | tuple) or len(pos) < 2:
                    raise InvalidInput(f"{where}[{j}][{k}]", "a position is [lon, lat]")
                pts.append((pos[0], pos[1]))
            rings.append(pts)
        polygons.append(rings)
    return build_geofence(polygons, field, max_vertices=max_vertices, max_bytes=max_bytes)


def circle(
    center: LatLon,
    radius_m: Any,
    field: str = "geofence.circle",
    *,
    max_vertices: int = DEFAULT_MAX_VERTICES,
    max_bytes: int | None = None,
) -> Geofence:
    """A geodesic circle, densified into a polygon (split at the antimeridian).

    Its canonical form must fit `max_vertices` and `max_bytes` (None: no limit).

    Raises:
        InvalidInput: naming ``field.radius_m`` unless 1 m <= radius <= 5000 km.
    """
    r = _finite(radius_m, f"{field}.radius_m")
    if not MIN_CIRCLE_RADIUS_M <= r <= MAX_CIRCLE_RADIUS_M:
        raise InvalidInput(
            f"{field}.radius_m",
            f"must be within [{MIN_CIRCLE_RADIUS_M:g}, {MAX_CIRCLE_RADIUS_M:.0f}] metres,"
            f" got {r!r}",
        )
    delta = r / EARTH_RADIUS_M
    lat1, lon1 = math.radians(center.lat), math.radians(center.lon)
    ring: Ring = []
    # Longitudes are kept continuous around the centre (not wrapped), so the
    # generic antimeridian cut below handles circles across ±180.
    for i in range(CIRCLE_SEGMENTS):
        ring.append(destination(lat1, lon1, 2 * math.pi * i / CIRCLE_SEGMENTS, delta))
    pole_dist = math.radians(90.0 - abs(center.lat))
    if delta >= pole_dist:
        # The cap holds a pole: walk the boundary by longitude and close it
        # through the pole, so the shape is a band in lon/lat space.
        ring = _pole_cap_ring(ring, center)
    else:
        ring.append(ring[0])
    poly = Polygon([(_normal(lon), _normal(lat)) for lon, lat in ring])
    if not poly.is_valid or poly.area == 0.0:
        raise InvalidInput(field, f"degenerate circle: {shapely.is_valid_reason(poly)}")
    return _canonical(_cut_antimeridian(poly), field, max_vertices, max_bytes)


def destination(lat1: float, lon1: float, bearing: float, delta: float) -> tuple[float, float]:
    """(lon, lat) in degrees reached from (`lat1`, `lon1`) in radians along `bearing`.

    `delta` is the angular distance (metres / `EARTH_RADIUS_M`). The longitude
    is not wrapped: it stays continuous around `lon1`, so that a ring of such
    points crossing ±180 is cut there by the generic antimeridian cut.
    """
    lat2 = math.asin(
        math.sin(lat1) * math.cos(delta) + math.cos(lat1) * math.sin(delta) * math.cos(bearing)
    )
    dlon = math.atan2(
        math.sin(bearing) * math.sin(delta) * math.cos(lat1),
        math.cos(delta) - math.sin(lat1) * math.sin(lat2),
    )
    return (math.degrees(lon1 + dlon), math.degrees(lat2))


def _pole_cap_ring(ring: Ring, center: LatLon) -> Ring:
    pole = 90.0 if center.lat >= 0 else -90.0
    # Boundary points ordered by longitude over one full turn from the centre's
    # antipodal meridian; the band closes through the pole.
    start = center.lon - 180.0
    # A boundary point on the pole itself would touch the closing edge along it.
    pts = sorted(((lon - start) % 360.0 + start, lat) for lon, lat in ring if lat != pole)
    first = pts[0]
    return [*pts, (first[0] + 360.0, first[1]), (first[0] + 360.0, pole), (first[0], pole), first]


def build_geofence(
    polygons: Iterable[Sequence[Sequence[Any]]],
    field: str = "geofence",
    *,
    max_vertices: int = DEFAULT_MAX_VERTICES,
    max_bytes: int | None = None,
) -> Geofence:
    """Validate rings of (lon, lat) positions and build a geofence.

    Each element of `polygons` is an exterior ring followed by its holes.
    Positions are counted against `max_vertices` before any is validated, and
    the canonical form again; `max_bytes` (None: no limit) bounds its WKT.
    """
    polygons = list(polygons)
    _check_vertices(sum(len(ring) for rings in polygons for ring in rings), field, max_vertices)
    parts: list[BaseGeometry] = []
    for p_idx, rings in enumerate(polygons):
        if not rings:
            raise InvalidInput(field, "empty polygon")
        checked: list[Ring] = []
        for r_idx, ring in enumerate(rings):
            pts: Ring = []
            for v_idx, pos in enumerate(ring):
                where = f"{field} (polygon {p_idx}, ring {r_idx}, vertex {v_idx})"
                lon = _normal(_finite(pos[0], f"{where} lon"))
                lat = _normal(_finite(pos[1], f"{where} lat"))
                if not -180.0 <= lon <= 180.0:
                    raise InvalidInput(field, f"longitude {lon!r} out of [-180, 180] at {where}")
                if not -90.0 <= lat <= 90.0:
                    raise InvalidInput(field, f"latitude {lat!r} out of [-90, 90] at {where}")
                pts.append((lon, lat))
            if len(pts) < 4 or pts[0] != pts[-1]:
                raise InvalidInput(
                    field,
                    f"ring {r_idx} of polygon {p_idx} must be closed with at least 4 positions",
                )
            checked.append(pts)
        exterior = _unwrap(checked[0])
        holes = [_align(_unwrap(h), exterior) for h in checked[1:]]
        for ring in (exterior, *holes):
            if ring[-1][0] != ring[0][0]:
                raise InvalidInput(
                    field, f"polygon {p_idx} winds around a pole; cut it at the antimeridian"
                )
        poly = Polygon(exterior, holes)
        if not poly.is_valid:
            raise InvalidInput(field, f"invalid polygon {p_idx}: {shapely.is_valid_reason(poly)}")
        if poly.area == 0.0:
            raise InvalidInput(field, f"polygon {p_idx} has no area")
        cut = _cut_antimeridian(poly)
        if cut is not poly:
            # Unwrapping (±360) and the cut move input vertices by an ulp, which
            # can put one just outside although the boundary is inside: put the
            # vertices back where they were given.
            given = shapely.multipoints([xy for ring in checked for xy in ring])
            # Near-degenerate slivers (subnormal coordinates) make GEOS signal
            # an invalid operation; such a result fails the validity check below.
            with np.errstate(invalid="ignore"):
                snapped = shapely.snap(cut, given, _SNAP_DEG)
            if snapped.is_valid and not snapped.is_empty:
                cut = snapped
        parts.append(cut)
    if not parts:
        raise InvalidInput(field, "empty geometry")
    geom = parts[0]
    if len(parts) > 1:
        # Parts of a MultiPolygon must not overlap (OGC validity). Valid, they
        # are already what their union would be (which costs far more).
        geom = MultiPolygon([p for g in parts for p in _polygons(g)])
        if not geom.is_valid:
            raise InvalidInput(field, f"invalid multipolygon: {shapely.is_valid_reason(geom)}")
    if geom.is_empty:
        raise InvalidInput(field, "empty geometry")
    return _canonical(geom, field, max_vertices, max_bytes)


def _canonical(
    geom: BaseGeometry, field: str, max_vertices: int, max_bytes: int | None
) -> Geofence:
    """The geofence as it travels (`Geofence.wkt`), held to the limits it will be re-parsed under.

    An edge that would read as crossing the antimeridian when parsed again is
    split first; the vertices are then counted again (the cut adds some) and
    the WKT measured against `max_bytes`.
    """
    split = _split_long_edges(geom)
    if split is not geom and not split.is_valid:  # a split keeps a shape valid; make sure
        raise InvalidInput(field, f"invalid once cut: {shapely.is_valid_reason(split)}")
    geom = split
    vertices = int(shapely.get_num_coordinates(geom))
    _check_vertices(vertices, field, max_vertices, " once cut at ±180")
    if max_bytes is not None:
        rings = sum(1 + len(p.interiors) for p in _polygons(geom))
        if _WKT_VERTEX_BYTES * vertices + _WKT_RING_BYTES * rings + 16 > max_bytes:
            size = len(to_wkt(geom))  # written only when the bound says it may not fit
            if size > max_bytes:
                raise TooLarge(field, size, max_bytes)
    return Geofence(geom)


# Bounds on canonical WKT: a coordinate takes at most 24 characters
# ("-1.2345678901234567e-300"), a vertex two of them, " " and ", "; a ring (or
# polygon) "(", ")" and ", "; "MULTIPOLYGON (" and ")" 16 in all.
_WKT_VERTEX_BYTES = 51
_WKT_RING_BYTES = 8


def to_wkt(geom: BaseGeometry) -> str:
    """WKT of a Polygon or MultiPolygon with every coordinate exact (shortest round-trip repr).

    GEOS's own writer prints at most 16 decimals, which changes small
    coordinates in their last bits.
    """
    if isinstance(geom, Polygon):
        return f"POLYGON {_polygon_wkt(geom)}" if not geom.is_empty else "POLYGON EMPTY"
    if isinstance(geom, MultiPolygon):
        if geom.is_empty:
            return "MULTIPOLYGON EMPTY"
        return f"MULTIPOLYGON ({', '.join(_polygon_wkt(p) for p in geom.geoms)})"
    return str(shapely.to_wkt(geom, rounding_precision=-1))


def _polygon_wkt(poly: Polygon) -> str:
    return f"({', '.join(_ring_wkt(r) for r in (poly.exterior, *poly.interiors))})"


def _ring_wkt(ring: BaseGeometry) -> str:
    text = ", ".join(f"{x!r} {y!r}" for x, y in shapely.get_coordinates(ring).tolist())
    # Whole numbers as GEOS prints them, "10" rather than "10.0" (no other
    # repr of a float ends in ".0").
    if text.endswith(".0"):
        text = text[:-2]
    return f"({text.replace('.0 ', ' ').replace('.0,', ',')})"


def _split_long_edges(geom: BaseGeometry) -> BaseGeometry:
    """Halve each edge spanning more than 180 degrees of longitude, unless it runs along ±180.

    Such edges arise along a pole (a circle closed through it); parsed again,
    they would read as crossing the antimeridian.
    """
    out: list[Polygon] = []
    changed = False
    for poly in _polygons(geom):
        rings = [np.asarray(r.coords)[:, :2] for r in (poly.exterior, *poly.interiors)]
        split = [_split_ring(r) for r in rings]
        if any(a is not b for a, b in zip(rings, split, strict=True)):
            changed = True
            poly = Polygon(split[0], split[1:])
        out.append(poly)
    if not changed:
        return geom
    return out[0] if isinstance(geom, Polygon) else MultiPolygon(out)


def _split_ring(xy: np.ndarray) -> np.ndarray:
    x = xy[:, 0]
    along_seam = (np.abs(x[:-1]) == 180.0) & (np.abs(x[1:]) == 180.0)
    long = (np.abs(np.diff(x)) > 180.0) & ~along_seam
    if not long.any():
        return xy
    at = np.flatnonzero(long) + 1
    return np.insert(xy, at, (xy[at - 1] + xy[at]) / 2.0, axis=0)


def _polygons(geom: BaseGeometry) -> list[Polygon]:
    if isinstance(geom, Polygon):
        return [geom]
    if isinstance(geom, MultiPolygon):
        return list(geom.geoms)
    return [g for g in getattr(geom, "geoms", []) if isinstance(g, Polygon)]


def _unwrap(ring: Ring) -> Ring:
    """Make longitudes continuous: an edge spanning > 180 degrees crosses ±180."""
    out: Ring = [ring[0]]
    offset = 0.0
    for (lon0, _), (lon1, lat1) in itertools.pairwise(ring):
        # Both ends on the antimeridian: the edge runs along it, not across.
        if abs(lon1 - lon0) > 180.0 and not (abs(lon0) == 180.0 and abs(lon1) == 180.0):
            offset += -360.0 if lon1 > lon0 else 360.0
        out.append((lon1 + offset, lat1))
    return out


def _align(hole: Ring, exterior: Ring) -> Ring:
    lo = min(x for x, _ in exterior)
    if lo <= hole[0][0] <= max(x for x, _ in exterior):
        return hole  # starts within the exterior's longitudes (a hole may touch x = lo + 360)
    shift = 360.0 * math.floor((hole[0][0] - lo) / 360.0)
    return [(x - shift, y) for x, y in hole] if shift else hole


_SNAP_DEG = 1e-9  # far below any real shape, far above the ulps unwrapping moves a vertex


def _cut_antimeridian(poly: Polygon) -> BaseGeometry:
    minx, _, maxx, _ = poly.bounds
    if minx >= -180.0 and maxx <= 180.0:
        return poly
    pieces: list[BaseGeometry] = []
    for sheet in _SHEETS:
        window = box(sheet - 180.0, -90.0, sheet + 180.0, 90.0)
        if not poly.intersects(window):
            continue
        piece = shapely.intersection(poly, window)
        piece = affinity.translate(piece, xoff=-sheet) if sheet else piece
        pieces.extend(_polygons(piece))
    merged = shapely.union_all(pieces)
    merged = shapely.intersection(merged, _WORLD_BOX)
    polys = [p for p in _polygons(merged) if p.area > 0]
    return polys[0] if len(polys) == 1 else MultiPolygon(polys)
