"""H3 cells of points and conservative H3 covers of geofences.

One definition shared by the Spark analysis (its event x subscription join is
bucketed by these cells) and the broker's grid filter schemes
(`routing/_schemes.py`). Needs the ``h3`` package (extra ``analysis``),
imported when first used.
"""

from __future__ import annotations

import math

import shapely
from shapely.geometry.base import BaseGeometry

from ._cover import _h3

KM_PER_DEG = 111.195
"""Kilometres per degree of latitude on the mean sphere (6371.0088 km)."""

H3_MAX_CELLS = 4096
"""Default largest cover: a geofence needing more cells gets no cover (None)."""

H3_RES_MIN = 2
"""Coarsest resolution a cover is made at: below it the buffer argument fails."""

# Cells are only used where planar lat/lon polygons and H3's geodesic cell
# edges stay close: away from the poles and the antimeridian.
SAFE_LAT = 80.0
SAFE_LON = 179.0
# h3's polygon fill reads a shape 180 degrees of longitude wide or more as
# crossing the antimeridian (and fills the wrong side of the world).
MAX_WIDTH_DEG = 180.0


def require_h3(field: str, what: str) -> None:
    """Raise `InvalidInput` naming `field` unless the h3 package can be imported."""
    _h3(field, what)


def _buffer_deg(res: int, max_abs_lat: float) -> float:
    # H3 cell edges are great-circle arcs; h3's polygon fill compares planar
    # lat/lon polygons. Between two vertices an edge's arc leaves the planar
    # chord by at most about L^2 tan(lat) / (8 R), under 2% of the edge length
    # L at res >= 2 and |lat| <= 80. A buffer of a fifth of an edge (widened
    # by 1/cos(lat) because degrees of longitude shrink) therefore puts every
    # point's true cell into the "overlap" cover, with ten times the margin.
    h3 = _h3("h3", "an H3 cover")
    edge_deg = float(h3.average_hexagon_edge_length(res, unit="km")) / KM_PER_DEG
    return 0.2 * edge_deg / math.cos(math.radians(min(SAFE_LAT, max_abs_lat)))


def h3_cover(geom: BaseGeometry, res: int, max_cells: int = H3_MAX_CELLS) -> list[int] | None:
    """A conservative set of H3 cells (as ints) holding every point the geometry covers.

    Every point p with `covers` true has ``latlng_to_cell(p, res)`` in the
    result. None when the geometry is too large at `res` or lies where the
    planar approximation is not trusted (near a pole or the antimeridian, 180
    degrees of longitude wide or more, or `res` below `H3_RES_MIN`): callers
    then treat it without cells.
    """
    if res < H3_RES_MIN:
        return None
    h3 = _h3("h3", "an H3 cover")
    minx, miny, maxx, maxy = geom.bounds
    eps = _buffer_deg(res, max(abs(miny), abs(maxy)))
    if (
        minx - eps < -SAFE_LON
        or maxx + eps > SAFE_LON
        or miny - eps < -SAFE_LAT
        or maxy + eps > SAFE_LAT
        or maxx - minx + 2 * eps >= MAX_WIDTH_DEG
    ):
        return None
    # Estimate from the bounding box before asking h3 for a huge cover.
    mid = math.radians((miny + maxy) / 2.0)
    box_km2 = ((maxx - minx + 2 * eps) * math.cos(mid) * KM_PER_DEG) * (
        (maxy - miny + 2 * eps) * KM_PER_DEG
    )
    if box_km2 / h3.average_hexagon_area(res, unit="km^2") > 4 * max_cells:
        return None
    # Round joins are chords inside the true buffer; 8 segments per quarter
    # keep at least 98% of eps everywhere, far above the needed margin.
    grown = shapely.buffer(geom, eps, quad_segs=8)
    shape = h3.geo_to_h3shape(grown.__geo_interface__)
    cells = h3.h3shape_to_cells_experimental(shape, res, contain="overlap")
    if len(cells) > max_cells:
        return None
    return sorted(h3.str_to_int(c) for c in cells)


def h3_cell(lat: float, lon: float, res: int) -> int:
    """The H3 cell (as int) of a point at `res`."""
    return int(_h3("h3", "an H3 cell").api.basic_int.latlng_to_cell(lat, lon, res))


def area_km2(geom: BaseGeometry) -> float:
    """Approximate area of a lon/lat geometry in km² (degrees scaled at its mid latitude)."""
    _, miny, _, maxy = geom.bounds
    k = math.cos(math.radians((miny + maxy) / 2.0))
    return float(geom.area) * KM_PER_DEG * KM_PER_DEG * max(k, 1e-6)


def resolution_for_area(km2: float, finest: int = 15) -> int:
    """The finest H3 resolution (at most `finest`, at least `H3_RES_MIN`) whose average
    cell is at least `km2`: cells about the size of a region of interest."""
    h3 = _h3("h3", "an H3 grid")
    res = H3_RES_MIN
    for r in range(H3_RES_MIN, finest + 1):
        if h3.average_hexagon_area(r, unit="km^2") >= km2:
            res = r
    return res
