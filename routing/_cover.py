"""Geofences as MQTT topic filters: covers for topic-only brokers (ranged filtering).

A topic-only broker (Mosquitto, any MQTT broker) knows nothing of geometry, but
it matches topic levels. Write a location into the topic as fixed-width
decimal digits, one digit per level, and every *decimal-aligned rectangle*
(the latitudes sharing a digit prefix, times the longitudes sharing one) is a
single topic filter: the fixed digits, then ``+`` for each free digit. A
geofence becomes a union of such rectangles, one filter each;
an unmodified MQTT consumer subscribing to those filters receives every event
published inside the geofence (recall 1), and some published near it (the
over-delivery, which an exact check at the consumer removes).

This is the ranged-filtering method of Solace's write-up on geolocation
filtering over topics (A. W. Lee, Solace Systems), adapted to MQTT, whose
wildcards fill whole levels (hence one digit a level where the write-up puts a
prefix wildcard inside a level):

* start from the rectangles covering the world (one per sign quadrant, or one
  when the coordinates are offset to be non-negative);
* while the coverage ratio c(S) = A(T) / A(S) is below the target and
  filters remain, split the rectangle R of largest weight
  (1 − c(R)) · A(R) / 1.2^(|d(R)| − 1) into its ten children along one axis,
  keeping the children that meet the geofence; |d(R)| is the number kept. A
  split keeping one child costs no filter and is made at once;
* a wide rectangle is cut across its longitudes, a tall one across its
  latitudes (so that children are square); a square one across the axis
  along which the part of the geofence inside it is longer (a tie: latitude).

Areas are planar, in square degrees of lon/lat (the geofence semantics are
planar too: docs/design.md §1), and rectangles count only their part inside
[-180, 180] x [-90, 90]. The H3 variant runs the same greedy over the H3 cell
hierarchy (seven children a split) for comparison; it needs the ``h3``
package (extra ``analysis``) and imports it when used.

Recall is exact by construction: the encoder truncates a coordinate's
shortest decimal form (``repr``) to the layout's digits, and a rectangle is
kept exactly when the geofence meets the floats written with its digits (a
box half-open by one ulp), so every point the geofence covers falls in a
kept rectangle, and in one only. Longitude -180 is written as 180 (one
meridian), and a geofence touching -180 is covered on the 180 side as well.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, Protocol

import shapely
from shapely import affinity
from shapely.geometry import LineString, Polygon, box
from shapely.geometry.base import BaseGeometry

from ._errors import InvalidInput
from ._geometry import Geofence, LatLon, latlon
from ._topics import validate_filter, validate_topic

Signs = Literal["sign", "offset"]
"""How a layout writes negative coordinates: a sign level (``_`` or ``-`` then the
magnitude, the write-up's form), or offset to be non-negative (lat + 90, lon + 180)."""

SIGN_POSITIVE = "_"
"""Sign level of a non-negative coordinate (``+`` is a wildcard in MQTT)."""
SIGN_NEGATIVE = "-"

DEFAULT_COVERAGE = 0.8
DEFAULT_MAX_FILTERS = 50
MAX_FILTERS_LIMIT = 100_000
"""Largest `max_filters` accepted: the greedy's work grows with it."""
MAX_DECIMALS = 10
"""Most digits after the point: with 3 whole digits, 13 significant ones, few enough
that a cell's decimal bounds are the only such decimals rounding to their floats
(what the exact recall rests on, see `_DecimalSystem.test_shape`)."""
SPLIT_BASE = 1.2
"""The write-up's weight: (1 − c) · A / SPLIT_BASE^(|d| − 1)."""

_WORLD = box(-180.0, -90.0, 180.0, 90.0)
_DIGITS = "0123456789"
_FULL = 1.0 - 1e-12  # a coverage this close to 1 is complete (area rounding)


# --------------------------------------------------------------------------
# Layouts: where a location goes in a topic


@dataclass(frozen=True)
class _Axis:
    """One coordinate's fixed-width digits: `whole` digits before the point, `decimals` after."""

    name: str  # "lat" or "lon"
    whole: int
    decimals: int
    signed: bool
    offset: int  # added before writing (offset layouts), 0 otherwise
    limit: int  # |value| <= limit

    @property
    def digits(self) -> int:
        return self.whole + self.decimals

    def encode(self, value: float) -> tuple[bool, str]:
        """(negative, digits) of `value`: its shortest decimal form (``repr``, what a
        person wrote: 51.516, not the binary 51.51599...) truncated towards zero
        (signed axes) or down (offset ones).

        That decimal rounds back to `value`, and rounding is monotonic, so
        `value` lies in the closed float box of the cell the digits name: the
        cover's containment argument holds for the float as well.
        """
        exact = Fraction(repr(float(value)))
        negative = self.signed and exact < 0
        magnitude = -exact if negative else exact + self.offset
        scaled = math.floor(magnitude * 10**self.decimals)
        return negative, f"{scaled:0{self.digits}d}"

    def interval(self, negative: bool, prefix: str) -> tuple[Fraction, Fraction]:
        """[lo, hi] (as exact fractions) of the values whose digits start with `prefix`."""
        width = Fraction(10) ** (self.whole - len(prefix))
        lo = int(prefix or "0") * width
        hi = lo + width
        if negative:
            return -hi, -lo
        return lo - self.offset, hi - self.offset

    def decode(self, negative: bool, digits: str) -> float:
        """The centre of the finest interval `digits` names, within [-limit, limit].

        The centre (not the low edge) so that encoding the result gives `digits`
        back whatever the float rounding.
        """
        lo, hi = self.interval(negative, digits)
        return max(-self.limit, min(self.limit, float((lo + hi) / 2)))


class _LayoutBase:
    """What both layouts share: a prefix, the location levels, the event's topic after them."""

    prefix: str

    @property
    def location_level_count(self) -> int:
        """Topic levels a location takes (after the prefix)."""
        raise NotImplementedError

    def location_levels(self, location: LatLon) -> list[str]:
        """The levels of a location: what a publisher puts after the prefix."""
        raise NotImplementedError

    def topic(self, location: LatLon, topic: str) -> str:
        """The topic an event at `location` is published to: prefix, location, then `topic`."""
        validate_topic(topic)
        return "/".join([*_check_prefix(self.prefix), *self.location_levels(location), topic])

    def any_location(self, topic_filter: str = "#") -> str:
        """The filter of every location (then `topic_filter`): what an importer subscribes to."""
        _check_suffix(topic_filter)
        levels = [*_check_prefix(self.prefix), *"+" * self.location_level_count]
        return _join_filter(levels, topic_filter)

    def _rest(self, topic: str, field: str) -> tuple[list[str], int]:
        """The topic's levels and where the location starts, once the prefix is checked."""
        levels = validate_topic(topic, field).split("/")
        prefix = _check_prefix(self.prefix)
        if tuple(levels[: len(prefix)]) != prefix:
            raise InvalidInput(field, f"does not start with the prefix {self.prefix!r}")
        return levels, len(prefix)


def _check_prefix(prefix: str) -> tuple[str, ...]:
    if not prefix:
        return ()
    validate_topic(prefix, "layout.prefix")
    if prefix.startswith("$"):
        raise InvalidInput("layout.prefix", "must not start with '$' (reserved topics)")
    return tuple(prefix.split("/"))


def _check_suffix(topic_filter: str) -> str:
    return validate_filter(topic_filter, "topic_filter")


def _join_filter(levels: Sequence[str], topic_filter: str) -> str:
    """Levels then `topic_filter`; ``+`` levels just before a final ``#`` fold into it
    (equivalent on the layout's fixed-width topics, and shorter)."""
    out = list(levels)
    if topic_filter == "#":
        while out and out[-1] == "+":
            out.pop()
    return "/".join([*out, topic_filter])


@dataclass(frozen=True)
class DecimalLayout(_LayoutBase):
    """Topics ``PREFIX/<lat digits>/<lon digits>/TOPIC``, one digit a level.

    With ``signs="sign"`` (the default) each coordinate is a sign level (``_``
    for non-negative, ``-``) and its magnitude with 2 (lat) or 3 (lon) whole
    digits; with ``signs="offset"`` lat + 90 and lon + 180, 3 whole digits each,
    no sign level. Then `decimals` digits after the point: the finest
    rectangle a cover can use is 10^-decimals degrees on a side. A coordinate
    is truncated (towards zero when signed), so ``45.38`` is in ``[45.38,
    45.39)`` and ``-75.75`` in ``(-75.76, -75.75]``.
    """

    prefix: str = "geo"
    decimals: int = 4
    signs: Signs = "sign"

    def __post_init__(self) -> None:
        _check_prefix(self.prefix)
        if isinstance(self.decimals, bool) or not isinstance(self.decimals, int):
            raise InvalidInput("layout.decimals", f"must be an integer, got {self.decimals!r}")
        if not 0 <= self.decimals <= MAX_DECIMALS:
            raise InvalidInput(
                "layout.decimals", f"must be within [0, {MAX_DECIMALS}], got {self.decimals}"
            )
        if self.signs not in ("sign", "offset"):
            raise InvalidInput("layout.signs", f"must be 'sign' or 'offset', got {self.signs!r}")

    @property
    def lat_axis(self) -> _Axis:
        signed = self.signs == "sign"
        return _Axis("lat", 2 if signed else 3, self.decimals, signed, 0 if signed else 90, 90)

    @property
    def lon_axis(self) -> _Axis:
        signed = self.signs == "sign"
        return _Axis("lon", 3, self.decimals, signed, 0 if signed else 180, 180)

    @property
    def location_level_count(self) -> int:
        return sum(a.digits + a.signed for a in (self.lat_axis, self.lon_axis))

    def location_levels(self, location: LatLon) -> list[str]:
        lon = 180.0 if location.lon == -180.0 else location.lon  # one meridian, one topic
        return [
            *self._axis_levels(self.lat_axis, *self.lat_axis.encode(location.lat), None),
            *self._axis_levels(self.lon_axis, *self.lon_axis.encode(lon), None),
        ]

    def filter(self, rect: DecimalRect, topic_filter: str = "#") -> str:
        """The one topic filter matching exactly the locations in `rect` (then `topic_filter`).

        Raises:
            InvalidInput: naming ``rect`` when its digits do not fit the layout.
        """
        _check_suffix(topic_filter)
        for axis, digits, negative in (
            (self.lat_axis, rect.lat, rect.lat_negative),
            (self.lon_axis, rect.lon, rect.lon_negative),
        ):
            if len(digits) > axis.digits or not all(d in _DIGITS for d in digits):
                raise InvalidInput(
                    f"rect.{axis.name}", f"{digits!r} is not {axis.digits} digits or fewer"
                )
            if negative and not axis.signed:
                raise InvalidInput(f"rect.{axis.name}", "offset layouts have no negative cells")
        levels = [
            *_check_prefix(self.prefix),
            *self._axis_levels(self.lat_axis, rect.lat_negative, rect.lat, self.lat_axis.digits),
            *self._axis_levels(self.lon_axis, rect.lon_negative, rect.lon, self.lon_axis.digits),
        ]
        return _join_filter(levels, topic_filter)

    def decode(self, topic: str, field: str = "topic") -> tuple[LatLon, str]:
        """(location, rest of the topic) of a topic written by `topic`.

        The location is the centre of the 10^-decimals cell the digits name.

        Raises:
            InvalidInput: naming `field`, when the topic does not follow the layout.
        """
        levels, at = self._rest(topic, field)
        values: list[float] = []
        for axis in (self.lat_axis, self.lon_axis):
            negative = False
            if axis.signed:
                sign = levels[at] if at < len(levels) else ""
                if sign not in (SIGN_POSITIVE, SIGN_NEGATIVE):
                    raise InvalidInput(
                        f"{field}.{axis.name}",
                        f"level {at + 1} must be a sign, {SIGN_POSITIVE!r} or {SIGN_NEGATIVE!r},"
                        f" got {sign!r}",
                    )
                negative = sign == SIGN_NEGATIVE
                at += 1
            digits = levels[at : at + axis.digits]
            if len(digits) != axis.digits or not all(
                len(d) == 1 and d in "0123456789" for d in digits
            ):
                raise InvalidInput(
                    f"{field}.{axis.name}",
                    f"expected {axis.digits} one-digit levels from level {at + 1},"
                    f" got {'/'.join(digits)!r}",
                )
            at += axis.digits
            lo, hi = axis.interval(negative, "".join(digits))
            inner = hi if negative else lo  # the value the digits were truncated to
            if not -axis.limit <= inner <= axis.limit:
                raise InvalidInput(f"{field}.{axis.name}", f"{float(inner)!r} is out of range")
            values.append(axis.decode(negative, "".join(digits)))
        rest = "/".join(levels[at:])
        if not rest:
            raise InvalidInput(field, "has no topic after the location levels")
        return latlon(values[0], values[1], field), rest

    def _axis_levels(
        self, axis: _Axis, negative: bool, digits: str, width: int | None
    ) -> list[str]:
        out = [SIGN_NEGATIVE if negative else SIGN_POSITIVE] if axis.signed else []
        out.extend(digits)
        if width is not None:
            out.extend("+" * (width - len(digits)))
        return out


@dataclass(frozen=True)
class DecimalRect:
    """A decimal-aligned rectangle: the locations whose digits start with `lat` and `lon`
    (with the given signs; offset layouts have none)."""

    lat_negative: bool
    lat: str
    lon_negative: bool
    lon: str


@dataclass(frozen=True)
class H3Layout(_LayoutBase):
    """Topics ``PREFIX/<base cell>/<digit 1>/.../<digit R>/TOPIC`` of a location's H3 cell.

    The base cell (``000``-``121``) then one level per resolution (``0``-``6``)
    down to `resolution`: a cell of any coarser resolution is one filter (its
    index digits, then ``#``), matching the locations whose resolution-R cell
    descends from it. Needs the ``h3`` package.
    """

    prefix: str = "h3"
    resolution: int = 9

    def __post_init__(self) -> None:
        _check_prefix(self.prefix)
        if isinstance(self.resolution, bool) or not isinstance(self.resolution, int):
            raise InvalidInput("layout.resolution", f"must be an integer, got {self.resolution!r}")
        if not 0 <= self.resolution <= 15:
            raise InvalidInput(
                "layout.resolution", f"must be within [0, 15], got {self.resolution}"
            )

    @property
    def location_level_count(self) -> int:
        return 1 + self.resolution

    def location_levels(self, location: LatLon) -> list[str]:
        h3 = _h3()
        cell = h3.str_to_int(h3.latlng_to_cell(location.lat, location.lon, self.resolution))
        return _cell_levels(cell)

    def filter(self, cell: int, topic_filter: str = "#") -> str:
        """The topic filter of an H3 cell (as int) of resolution <= `resolution`.

        Raises:
            InvalidInput: naming ``cell`` when it is finer than the layout.
        """
        _check_suffix(topic_filter)
        levels = _cell_levels(cell)
        if len(levels) > 1 + self.resolution:
            raise InvalidInput("cell", f"resolution {len(levels) - 1} > {self.resolution}")
        levels.extend("+" * (1 + self.resolution - len(levels)))
        return _join_filter([*_check_prefix(self.prefix), *levels], topic_filter)

    def decode(self, topic: str, field: str = "topic") -> tuple[LatLon, str]:
        """(centre of the cell, rest of the topic) of a topic written by `topic`."""
        h3 = _h3()
        levels, at = self._rest(topic, field)
        cell_levels = levels[at : at + 1 + self.resolution]
        cell = _cell_from_levels(cell_levels, self.resolution)
        if cell is None or not h3.is_valid_cell(h3.int_to_str(cell)):
            raise InvalidInput(f"{field}.cell", f"not an H3 cell: {'/'.join(cell_levels)!r}")
        rest = "/".join(levels[at + 1 + self.resolution :])
        if not rest:
            raise InvalidInput(field, "has no topic after the location levels")
        lat, lon = h3.cell_to_latlng(h3.int_to_str(cell))
        return latlon(lat, lon, field), rest


def _h3(field: str = "layout", what: str = "the H3 layout") -> Any:
    """The h3 module, imported when first needed (it is in the ``analysis`` extra)."""
    try:
        import h3
    except ModuleNotFoundError:  # pragma: no cover - h3 is in the analysis extra
        raise InvalidInput(
            field, f"{what} needs the h3 package (pip install 'geofed[analysis]')"
        ) from None
    return h3


# An H3 index: resolution in bits 52-55, base cell in bits 45-51, then a 3-bit
# digit per resolution 1..15 (7 past the cell's resolution).
def _cell_levels(cell: int) -> list[str]:
    res = (cell >> 52) & 0xF
    base = (cell >> 45) & 0x7F
    return [f"{base:03d}", *(str((cell >> (3 * (15 - r))) & 7) for r in range(1, res + 1))]


def _cell_from_levels(levels: Sequence[str], res: int) -> int | None:
    if len(levels) != 1 + res or len(levels[0]) != 3 or not levels[0].isdigit():
        return None
    base = int(levels[0])
    cell = (1 << 59) | (res << 52) | (base << 45)
    for r in range(1, 16):
        if r <= res:
            d = levels[r]
            if len(d) != 1 or d not in "0123456":
                return None
            cell |= int(d) << (3 * (15 - r))
        else:
            cell |= 7 << (3 * (15 - r))
    return cell


# --------------------------------------------------------------------------
# The cover


@dataclass(frozen=True)
class Cover:
    """A geofence's cover: cells (rectangles or H3 cells), one topic filter each.

    Attributes:
        cells: `DecimalRect`s or H3 cells (ints), disjoint.
        filters: one topic filter per cell, in the same order.
        coverage: A(geofence) / A(cover), planar square degrees (1.0: exact).
        area: A(cover), the union's area in square degrees (inside the world).
        stopped: why the refinement stopped: ``coverage`` (target reached),
            ``max_filters`` (no split fits the cap), ``resolution`` (nothing
            left to split: cells at the layout's finest size or fully inside).
    """

    cells: tuple[Any, ...]
    filters: tuple[str, ...]
    coverage: float
    area: float
    stopped: str


class _Target:
    """The geofence as the greedy tests it: its area, and 'meets' with the closed shape."""

    def __init__(self, fence: Geofence | None) -> None:
        geom = _WORLD if fence is None else fence.geometry
        self.geometry = geom
        self.area = float(geom.area)
        shapely.prepare(geom)
        # Points on lon -180 are written as 180: cover that side for them too.
        seam = shapely.intersection(geom, LineString([(-180.0, -90.0), (-180.0, 90.0)]))
        self.extra = None if seam.is_empty else affinity.translate(seam, xoff=360.0)

    def meets(self, geom: BaseGeometry) -> bool:
        if self.geometry.intersects(geom):
            return True
        return self.extra is not None and bool(self.extra.intersects(geom))


class _System(Protocol):
    """A hierarchy of cells the greedy refines (decimal rectangles, H3 cells)."""

    nested: bool  # children lie inside their parent (pieces can be clipped from it)

    def roots(self) -> list[Any]: ...

    def shape(self, cell: Any) -> BaseGeometry:
        """The cell's part of the world map (areas, pieces of the geofence)."""
        ...

    def test_shape(self, cell: Any) -> BaseGeometry:
        """A closed shape holding every location the cell's filter matches."""
        ...

    def children(self, cell: Any, piece: BaseGeometry) -> list[Any]: ...

    def order(self, cell: Any) -> Any:
        """Sort key of the cells in a cover."""
        ...


@dataclass
class _Node:
    cell: Any
    area: float
    piece: BaseGeometry  # the geofence inside the cell
    coverage: float
    kids: list[_Node] | None = None  # children meeting the geofence (made when asked)


class _Greedy:
    def __init__(self, system: _System, target: _Target) -> None:
        self.system = system
        self.target = target

    def node(self, cell: Any, parent_piece: BaseGeometry) -> _Node | None:
        if not self.target.meets(self.system.test_shape(cell)):
            return None
        shape = self.system.shape(cell)
        area = float(shape.area)
        piece = shapely.intersection(parent_piece, shape)
        inside = float(piece.area)
        coverage = 1.0 if area <= 0.0 else min(1.0, inside / area)
        return _Node(cell, area, piece, coverage)

    def kids(self, node: _Node) -> list[_Node]:
        if node.kids is None:
            base = node.piece if self.system.nested else self.target.geometry
            made = (self.node(c, base) for c in self.system.children(node.cell, node.piece))
            node.kids = [k for k in made if k is not None]
        return node.kids

    def free_splits(self, node: _Node) -> _Node | None:
        """Replace a node by its only child while it has one: a finer cell, same filter count.

        None when no child meets the geofence (an H3 cell kept only for its
        margin, whose descendants all turn out to miss it): the cell goes.
        """
        while node.coverage < _FULL:
            kids = self.kids(node)
            if not kids and self.system.children(node.cell, node.piece):
                return None
            if len(kids) != 1:
                break
            node = kids[0]
        return node

    def run(self, coverage: float, max_filters: int) -> tuple[list[_Node], float, str]:
        live: dict[int, _Node] = {}
        heap: list[tuple[float, int]] = []
        total = 0.0
        serial = 0

        def add(kept: _Node) -> None:
            """Make a node live (one `free_splits` has reached), queued if it can split."""
            nonlocal total, serial
            serial += 1
            live[serial] = kept
            total += kept.area
            if kept.coverage < _FULL:
                d = len(self.kids(kept))
                if d > 0:
                    weight = (1.0 - kept.coverage) * kept.area / SPLIT_BASE ** (d - 1)
                    heapq.heappush(heap, (-weight, serial))

        def split(n: _Node) -> list[_Node]:
            """What replaces `n`: its kids after their free splits (an H3 kid whose
            descendants all miss the geofence goes, so maybe fewer than its kids)."""
            return [k for k in map(self.free_splits, self.kids(n)) if k is not None]

        for c in self.system.roots():
            root = self.node(c, self.target.geometry)
            start = None if root is None else self.free_splits(root)
            if start is not None:
                add(start)
        if len(live) > max_filters:
            raise InvalidInput(
                "max_filters",
                f"this geofence needs at least {len(live)} filters in this layout,"
                f" got {max_filters}",
            )
        stopped = "resolution"
        capped: list[tuple[float, int]] = []  # splits that did not fit
        while True:
            achieved = self.target.area / total if total > 0 else 1.0
            if achieved >= coverage:
                stopped = "coverage"
                break
            if not heap:
                stopped = "max_filters" if capped else "resolution"
                break
            item = heapq.heappop(heap)
            n = live[item[1]]
            kept = split(n)
            if len(live) - 1 + len(kept) > max_filters:
                capped.append(item)
                continue
            del live[item[1]]
            total -= n.area
            for k in kept:
                add(k)
            if not kept:
                # The count fell: a split that did not fit before may fit now.
                for c in capped:
                    heapq.heappush(heap, c)
                capped.clear()
        return list(live.values()), min(1.0, achieved), stopped


def _check_params(coverage: float, max_filters: int) -> None:
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float)):
        raise InvalidInput("coverage", f"must be a number, got {coverage!r}")
    if not 0.0 <= coverage <= 1.0:
        raise InvalidInput("coverage", f"must be within [0, 1], got {coverage!r}")
    if isinstance(max_filters, bool) or not isinstance(max_filters, int):
        raise InvalidInput("max_filters", f"must be an integer, got {max_filters!r}")
    if not 1 <= max_filters <= MAX_FILTERS_LIMIT:
        raise InvalidInput(
            "max_filters", f"must be within [1, {MAX_FILTERS_LIMIT}], got {max_filters}"
        )


def _refine(
    system: _System,
    geofence: Geofence | None,
    coverage: float,
    max_filters: int,
    topic_filter: str,
    to_filter: Callable[[Any, str], str],
) -> Cover:
    _check_params(coverage, max_filters)
    _check_suffix(topic_filter)
    nodes, achieved, stopped = _Greedy(system, _Target(geofence)).run(coverage, max_filters)
    nodes.sort(key=lambda n: system.order(n.cell))
    cells = tuple(n.cell for n in nodes)
    return Cover(
        cells,
        tuple(to_filter(c, topic_filter) for c in cells),
        achieved,
        sum(n.area for n in nodes),
        stopped,
    )


class _DecimalSystem:
    nested = True

    def __init__(self, layout: DecimalLayout) -> None:
        self.lat = layout.lat_axis
        self.lon = layout.lon_axis

    def roots(self) -> list[DecimalRect]:
        signs = (False, True) if self.lat.signed else (False,)
        return [DecimalRect(a, "", b, "") for a in signs for b in signs]

    def bounds(self, r: DecimalRect) -> tuple[float, float, float, float]:
        lat0, lat1 = self.lat.interval(r.lat_negative, r.lat)
        lon0, lon1 = self.lon.interval(r.lon_negative, r.lon)
        return float(lon0), float(lat0), float(lon1), float(lat1)

    def test_shape(self, r: DecimalRect) -> BaseGeometry:
        """The floats the rectangle's digits take: half-open, the open side an ulp in.

        With at most 13 significant digits a decimal bound is the one such
        decimal rounding to its float, so a float x is written with digits in
        [lo, hi) exactly when float(lo) <= x < float(hi) (mirrored when negative).
        """
        lon0, lat0, lon1, lat1 = self.bounds(r)
        if r.lat_negative:
            lat0 = math.nextafter(lat0, math.inf)
        else:
            lat1 = math.nextafter(lat1, -math.inf)
        if r.lon_negative:
            lon0 = math.nextafter(lon0, math.inf)
        else:
            lon1 = math.nextafter(lon1, -math.inf)
        return box(lon0, lat0, lon1, lat1)

    def shape(self, r: DecimalRect) -> BaseGeometry:
        return shapely.intersection(box(*self.bounds(r)), _WORLD)

    def order(self, r: DecimalRect) -> tuple[float, float]:
        lon0, lat0, _, _ = self.bounds(r)
        return lat0, lon0  # south to north, then west to east

    def _split(self, r: DecimalRect, axis: str) -> list[DecimalRect]:
        if axis == "lat":
            return [
                DecimalRect(r.lat_negative, r.lat + d, r.lon_negative, r.lon) for d in "0123456789"
            ]
        return [DecimalRect(r.lat_negative, r.lat, r.lon_negative, r.lon + d) for d in "0123456789"]

    def children(self, r: DecimalRect, piece: BaseGeometry) -> list[DecimalRect]:
        lat_left = len(r.lat) < self.lat.digits
        lon_left = len(r.lon) < self.lon.digits
        if not (lat_left or lon_left):
            return []
        if not (lat_left and lon_left):
            return self._split(r, "lat" if lat_left else "lon")
        tall = self.lat.whole - len(r.lat)  # log10 of the side lengths
        wide = self.lon.whole - len(r.lon)
        if wide != tall:
            return self._split(r, "lon" if wide > tall else "lat")
        # A square: cut across the geofence's longer extent inside it.
        minx, miny, maxx, maxy = piece.bounds if not piece.is_empty else (0.0, 0.0, 0.0, 0.0)
        if maxy - miny != maxx - minx:
            return self._split(r, "lon" if maxy - miny > maxx - minx else "lat")
        return self._split(r, "lat")


# --------------------------------------------------------------------------
# The H3 variant

_KM_PER_DEG = 111.195  # per degree of latitude on the mean sphere
_EARTH_KM = 6371.0088
_POLE_BAND_DEG = 88.0


class _H3System:
    """H3 cells as a hierarchy for the greedy.

    H3 children do not tile their parent exactly (they stick out a little), and
    a location's coarse cell is the *index* ancestor of its finest cell, not
    the coarse cell containing it. So a cell stands for the locations whose
    finest cell descends from it: its test shape is its outline grown by a
    margin that holds the descendants (and the gap between H3's great-circle
    edges and straight lon/lat ones); at the layout's resolution only the
    latter. Cells reaching within 2° of a pole are taken as the band from
    their lowest latitude to the pole.
    """

    nested = False

    def __init__(self, layout: H3Layout) -> None:
        self.h3 = _h3()
        self.res = layout.resolution
        self._shapes: dict[int, tuple[BaseGeometry, BaseGeometry]] = {}

    def roots(self) -> list[int]:
        return sorted(self.h3.str_to_int(c) for c in self.h3.get_res0_cells())

    def _outline(self, cell: int) -> BaseGeometry:
        h3 = self.h3
        ring = [(lng, lat) for lat, lng in h3.cell_to_boundary(h3.int_to_str(cell))]
        lons = [x for x, _ in ring]
        if max(lons) - min(lons) > 180.0:  # crosses the antimeridian: unwrap eastwards
            ring = [(x + 360.0 if x < 0 else x, y) for x, y in ring]
        return Polygon(ring)

    def _pole_cells(self, res: int) -> tuple[int, int]:
        h3 = self.h3
        return tuple(h3.str_to_int(h3.latlng_to_cell(lat, 0.0, res)) for lat in (90.0, -90.0))

    def _edge_deg(self, res: int) -> float:
        return float(self.h3.average_hexagon_edge_length(res, unit="km")) / _KM_PER_DEG

    def _shapes_of(self, cell: int) -> tuple[BaseGeometry, BaseGeometry]:
        got = self._shapes.get(cell)
        if got is not None:
            return got
        res = (cell >> 52) & 0xF
        outline = self._outline(cell)
        _, miny, _, maxy = outline.bounds
        edge = self._edge_deg(res)
        edge_km = edge * _KM_PER_DEG
        top = max(abs(miny), abs(maxy))
        # Great-circle edge vs straight lon/lat chord: about L^2 tan(lat) / 8R,
        # times 2 for safety; descendants of a coarser cell stick out by under
        # a quarter of their edge (half an edge here).
        bulge = edge * (2.0 * edge_km * math.tan(math.radians(min(top, 89.0))) / (8 * _EARTH_KM))
        margin = bulge + (0.5 * edge if res < self.res else 0.05 * edge)
        if top + margin >= _POLE_BAND_DEG or cell in self._pole_cells(res):
            # Near a pole straight lon/lat outlines mean little: the band to the pole.
            if maxy + miny > 0:
                test: BaseGeometry = box(-180.0, max(-90.0, miny - margin), 180.0, 90.0)
                shape = box(-180.0, max(-90.0, miny), 180.0, 90.0)
            else:
                test = box(-180.0, -90.0, 180.0, min(90.0, maxy + margin))
                shape = box(-180.0, -90.0, 180.0, min(90.0, maxy))
        else:
            # A margin of `margin` degrees of latitude and as many km of longitude:
            # buffered where longitudes are shrunk by cos(lat).
            shrink = math.cos(math.radians(top + margin))
            flat = affinity.scale(outline, xfact=shrink, yfact=1.0, origin=(0.0, 0.0))
            grown = affinity.scale(
                shapely.buffer(flat, margin, quad_segs=4),
                xfact=1.0 / shrink,
                yfact=1.0,
                origin=(0.0, 0.0),
            )
            test = self._both_sides(grown)
            shape = self._on_map(outline)
        self._shapes[cell] = (shape, test)
        return shape, test

    @staticmethod
    def _both_sides(geom: BaseGeometry) -> BaseGeometry:
        minx, _, maxx, _ = geom.bounds
        parts = [geom]
        if maxx > 180.0:
            parts.append(affinity.translate(geom, xoff=-360.0))
        if minx < -180.0:
            parts.append(affinity.translate(geom, xoff=360.0))
        return shapely.union_all(parts) if len(parts) > 1 else geom

    def _on_map(self, outline: BaseGeometry) -> BaseGeometry:
        return shapely.intersection(self._both_sides(outline), _WORLD)

    def shape(self, cell: int) -> BaseGeometry:
        return self._shapes_of(cell)[0]

    def test_shape(self, cell: int) -> BaseGeometry:
        return self._shapes_of(cell)[1]

    def order(self, cell: int) -> int:
        return cell

    def children(self, cell: int, piece: BaseGeometry) -> list[int]:
        res = (cell >> 52) & 0xF
        if res >= self.res:
            return []
        h3 = self.h3
        return sorted(h3.str_to_int(c) for c in h3.cell_to_children(h3.int_to_str(cell), res + 1))


def cover(
    geofence: Geofence | None,
    layout: DecimalLayout | H3Layout | None = None,
    *,
    coverage: float = DEFAULT_COVERAGE,
    max_filters: int = DEFAULT_MAX_FILTERS,
    topic_filter: str = "#",
) -> Cover:
    """The cover of `geofence` (None: the world) in `layout` (default: `DecimalLayout()`).

    Decimal layouts: the write-up's decimal-aligned rectangles; H3 layouts: the
    same greedy over H3 cells (seven children a split, starting from the base
    cells that meet the geofence). Refines until the coverage ratio reaches
    `coverage`, or no split fits in `max_filters` filters (a split that would
    exceed it is skipped for the next best one that fits), or nothing is left
    to split; `Cover.stopped` says which. `topic_filter` follows the location
    levels in every filter (``#``: any topic).

    Raises:
        InvalidInput: naming ``coverage``, ``max_filters`` (also when the
            geofence needs more filters to start with: sign quadrants, base
            cells), ``topic_filter``, or ``layout`` (H3 without the h3 package).
    """
    _check_params(coverage, max_filters)  # before h3 is imported
    layout = layout or DecimalLayout()
    system: _System = _H3System(layout) if isinstance(layout, H3Layout) else _DecimalSystem(layout)
    return _refine(system, geofence, coverage, max_filters, topic_filter, layout.filter)
