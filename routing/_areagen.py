"""Broker areas from broker sites: the spherical Voronoi diagram as a federation file.

Every point on Earth belongs to the site nearest to it by great-circle distance.
The cells are built without an intermediate per-cell approximation, so that
neighbouring areas share their boundaries exactly:

1. The Voronoi edges are found exactly. The edge between sites *i* and *j* lies on
   the great circle of points equidistant from both; on it, each third site *k*
   keeps a closed half circle for *i* and *j*. The intersection of these half
   circles is the edge (an arc, possibly empty).
2. Each edge (lengthened a little past its ends, so that edges meeting at a
   vertex surely cross there) is drawn in lon/lat as a polyline, cut at the
   antimeridian and at the poles (RFC 7946 §3.1.9).
3. All polylines plus the border of the lon/lat rectangle are noded together once
   (snap-rounded to the 1e-7 degree output grid) and polygonized. The faces tile
   the rectangle by construction; each face goes to the site nearest to its
   most interior point, and a site's faces are dissolved into its area.

The only approximation is the polyline standing in for a great-circle arc: with
the default ``step_deg`` of 0.5 degrees, boundaries stay within about 0.0011
degrees of arc (~120 m) of the true ones (measured; the error grows with the
square of ``step_deg``).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np
import numpy.typing as npt
import shapely
from shapely.geometry import MultiPolygon, Polygon

from ._errors import InvalidInput

__all__ = ["Site", "generate_areas", "read_sites"]

FloatArray = npt.NDArray[np.float64]

_DECIMALS = 7
_GRID = 10.0**-_DECIMALS  # output precision in degrees (about 1 cm)
# Sites closer than this (degrees of arc, ~11 cm) count as the same position.
# Ten output grid steps keep every area non-empty: a cell always contains the
# cap of half the distance to the nearest other site around its site.
_MIN_SEPARATION_DEG = 1e-6
# A bisector whose plane normal has |z| below this passes (within ~1e-12 rad)
# through the poles: it is treated as a pair of meridians, cut at the poles.
_THROUGH_POLE = 1e-12
_CSV_COLUMNS = ("id", "name", "lat", "lon", "endpoint", "client_endpoint")


@dataclass(frozen=True)
class Site:
    """A broker's location and identity.

    Attributes:
        id: Unique broker id.
        lat: Latitude in degrees, within [-90, 90].
        lon: Longitude in degrees, within [-180, 180].
        name: Human-readable name.
        endpoint: ``host:port`` of the broker's federation gRPC port, or "".
        client_endpoint: ``host:port`` of the broker's client port, or "".
    """

    id: str
    lat: float
    lon: float
    name: str = ""
    endpoint: str = ""
    client_endpoint: str = ""


# --------------------------------------------------------------------------- public API


def generate_areas(sites: Sequence[Site], *, step_deg: float = 0.5) -> dict[str, Any]:
    """Computes the broker areas of a federation as a GeoJSON FeatureCollection.

    The area of a site is its spherical Voronoi cell: all points for which it is
    the nearest site by great-circle distance. The areas tile the lon/lat
    rectangle [-180, 180] x [-90, 90] without overlap or gap; a cell crossing the
    antimeridian is a MultiPolygon split at ±180. Coordinates are rounded to 7
    decimals, the features keep the order of ``sites``.

    Args:
        sites: The brokers; at least one, unique ids, positions at least 1e-6
            degrees apart.
        step_deg: Maximal vertex spacing along area boundaries, in degrees of arc
            and of longitude. Smaller is more precise and larger.

    Returns:
        A plain dict, ready for ``json.dump``: one Feature per site with a
        Polygon/MultiPolygon geometry (lon, lat order) and properties ``id``,
        ``name``, ``site`` ([lon, lat]) and, when non-empty, ``endpoint`` and
        ``client_endpoint``.

    Raises:
        InvalidInput: (a ValueError) if a site or ``step_deg`` is invalid, naming the
            offending field, e.g. ``sites[3].lat``.
    """
    if isinstance(step_deg, bool) or not (
        isinstance(step_deg, int | float) and 0.0 < step_deg <= 10.0
    ):
        raise _invalid(f"step_deg: must be within (0, 10], got {step_deg!r}")
    _check_sites(sites, lambda k, field: f"sites[{k}].{field}" if field else f"sites[{k}]")
    cells = _voronoi_cells(_unit_vectors(sites), math.radians(step_deg))
    return {
        "type": "FeatureCollection",
        "features": [_feature(site, cell) for site, cell in zip(sites, cells, strict=True)],
    }


def read_sites(text: str, fmt: str) -> list[Site]:
    """Parses broker sites from CSV or GeoJSON text.

    CSV has a header row ``id,name,lat,lon`` and optionally the columns
    ``endpoint`` and ``client_endpoint`` (any order; only ``id``, ``lat`` and
    ``lon`` are required). GeoJSON is a FeatureCollection of Point features with
    ``properties.id`` and optionally ``name``, ``endpoint``, ``client_endpoint``.

    Args:
        text: The file content.
        fmt: ``"csv"`` or ``"geojson"``.

    Returns:
        The sites in file order, validated as ``generate_areas`` requires.

    Raises:
        InvalidInput: (a ValueError) if the text is malformed or a site invalid, naming
            the line (CSV) or feature (GeoJSON) and the field, e.g.
            ``line 4: lat: not a number: 'x'``.
    """
    if fmt == "csv":
        sites, lines = _read_csv(text)
        _check_sites(sites, lambda k, field: f"line {lines[k]}" + (f": {field}" if field else ""))
    elif fmt == "geojson":
        sites = _read_geojson(text)
        _check_sites(sites, _geojson_label)
    else:
        raise _invalid(f"fmt: must be 'csv' or 'geojson', got {fmt!r}")
    return sites


# --------------------------------------------------------------------------- validation


def _check_sites(sites: Sequence[Site], label: Callable[[int, str], str]) -> None:
    """Raises InvalidInput for the first invalid site.

    ``label(k, field)`` names a field of site k in messages, ``label(k, "")`` the site.
    """
    if len(sites) == 0:
        raise _invalid("sites: at least one site is required")
    first_with_id: dict[str, int] = {}
    for k, site in enumerate(sites):
        problem = _site_problem(site)
        if problem is not None:
            raise _invalid(f"{label(k, problem[0])}: {problem[1]}")
        if site.id in first_with_id:
            other = label(first_with_id[site.id], "")
            raise _invalid(f"{label(k, 'id')}: duplicate id {site.id!r} (also {other})")
        first_with_id[site.id] = k
    xyz = _unit_vectors(sites)
    # The chord length is the angle for tiny angles.
    chord = np.linalg.norm(xyz[:, None, :] - xyz[None, :, :], axis=-1)
    too_close = np.argwhere(np.tril(chord < math.radians(_MIN_SEPARATION_DEG), k=-1))
    if len(too_close) > 0:
        j, i = too_close[0]  # the first site that repeats an earlier one
        raise _invalid(
            f"{label(j, 'lat/lon')}: same position as {label(i, '')} "
            f"({sites[i].id!r}; sites must be at least {_MIN_SEPARATION_DEG:g} degrees apart)"
        )


def _geojson_label(k: int, field: str) -> str:
    if not field:
        return f"features[{k}]"
    if field in ("lat", "lon", "lat/lon"):
        return f"features[{k}].geometry.coordinates: {field}"
    return f"features[{k}].properties.{field}"


def _site_problem(site: object) -> tuple[str, str] | None:
    """Returns (field, message) for the first problem of one site, or None."""
    if not isinstance(site, Site):
        return "type", f"not a Site: {site!r}"
    if not isinstance(site.id, str) or not site.id:
        return "id", f"must be a non-empty string, got {site.id!r}"
    for field, limit in (("lat", 90.0), ("lon", 180.0)):
        value = getattr(site, field)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return field, f"not a number: {value!r}"
        if not math.isfinite(value):
            return field, f"must be finite, got {value!r}"
        if not -limit <= value <= limit:
            return field, f"must be within [{-limit:g}, {limit:g}], got {value!r}"
    for field in ("name", "endpoint", "client_endpoint"):
        if not isinstance(getattr(site, field), str):
            return field, f"must be a string, got {getattr(site, field)!r}"
    return None


def _read_csv(text: str) -> tuple[list[Site], list[int]]:
    """Sites and the line number each one came from."""
    # A byte-order mark (spreadsheet exports) is not part of the first column name.
    reader = csv.DictReader(io.StringIO(text.removeprefix("\ufeff")), skipinitialspace=True)
    header = reader.fieldnames
    if header is None:
        raise _invalid("line 1: missing header row (id,name,lat,lon[,endpoint,client_endpoint])")
    header = [column.strip() for column in header]
    for column in header:
        if column not in _CSV_COLUMNS:
            expected = ", ".join(_CSV_COLUMNS)
            raise _invalid(f"line 1: unknown column {column!r}, expected {expected}")
    for column in ("id", "lat", "lon"):
        if column not in header:
            raise _invalid(f"line 1: missing column {column!r}")
    if len(set(header)) != len(header):
        raise _invalid("line 1: duplicate column")
    reader.fieldnames = header
    sites: list[Site] = []
    lines: list[int] = []
    for row in reader:
        label = f"line {reader.line_num}"
        if None in row:
            raise _invalid(f"{label}: more than {len(header)} fields")
        values: dict[str, str] = {}
        for column in header:
            value = row[column]
            if value is None:
                raise _invalid(f"{label}: {column}: missing")
            values[column] = value.strip()
        coords = {c: _parse_number(values[c], f"{label}: {c}") for c in ("lat", "lon")}
        sites.append(
            Site(
                id=values["id"],
                lat=coords["lat"],
                lon=coords["lon"],
                name=values.get("name", ""),
                endpoint=values.get("endpoint", ""),
                client_endpoint=values.get("client_endpoint", ""),
            )
        )
        lines.append(reader.line_num)
    return sites, lines


def _parse_number(text: str, label: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _invalid(f"{label}: not a number: {text!r}") from None


def _read_geojson(text: str) -> list[Site]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _invalid(f"line {exc.lineno}: not JSON: {exc.msg}") from None
    if not isinstance(doc, dict) or doc.get("type") != "FeatureCollection":
        raise _invalid("type: must be 'FeatureCollection'")
    features = doc.get("features")
    if not isinstance(features, list):
        raise _invalid("features: must be a list")
    return [_site_from_feature(feature, f"features[{k}]") for k, feature in enumerate(features)]


def _site_from_feature(feature: object, label: str) -> Site:
    if not isinstance(feature, dict) or feature.get("type") != "Feature":
        raise _invalid(f"{label}.type: must be 'Feature'")
    geometry = feature.get("geometry")
    if not isinstance(geometry, dict) or geometry.get("type") != "Point":
        raise _invalid(f"{label}.geometry.type: must be 'Point'")
    coords = geometry.get("coordinates")
    # A third (altitude) position element is allowed by RFC 7946 and ignored.
    if not isinstance(coords, list) or len(coords) not in (2, 3):
        raise _invalid(f"{label}.geometry.coordinates: must be [lon, lat]")
    for axis, value in zip(("lon", "lat"), coords, strict=False):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _invalid(f"{label}.geometry.coordinates: {axis}: not a number: {value!r}")
    props = feature.get("properties")
    if not isinstance(props, dict):
        raise _invalid(f"{label}.properties: must be an object")
    if "id" not in props:
        raise _invalid(f"{label}.properties.id: missing")
    fields = {f: props.get(f, "") for f in ("id", "name", "endpoint", "client_endpoint")}
    for field, value in fields.items():
        if not isinstance(value, str):
            raise _invalid(f"{label}.properties.{field}: must be a string, got {value!r}")
    return Site(lat=float(coords[1]), lon=float(coords[0]), **fields)


# --------------------------------------------------------------------------- geometry


def _unit_vectors(sites: Sequence[Site]) -> FloatArray:
    lat = np.radians([s.lat for s in sites])
    lon = np.radians([s.lon for s in sites])
    return _xyz(lon, lat)


def _xyz(lon: FloatArray, lat: FloatArray) -> FloatArray:
    """Unit vectors (n x 3) from longitudes and latitudes in radians."""
    return np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=-1)


def _voronoi_cells(xyz: FloatArray, step: float) -> list[Polygon | MultiPolygon]:
    """The Voronoi cell of each site, in lon/lat degrees, tiling the world rectangle."""
    world = shapely.box(-180.0, -90.0, 180.0, 90.0)
    if len(xyz) == 1:
        return [world]
    lines: list[shapely.LineString] = [shapely.LineString(world.exterior.coords)]
    for i, j in combinations(range(len(xyz)), 2):
        for piece in _edge_polylines(xyz, i, j, step):
            lines.append(shapely.LineString(piece))
    # One global snap-rounded noding: every face shares exactly the vertices of
    # its neighbours, which is what makes the areas tile without slivers.
    noded = shapely.union_all(lines, grid_size=_GRID)
    faces = shapely.get_parts(shapely.polygonize(shapely.get_parts(noded).tolist()))
    # Classify each face by its most interior point: any point of a face would do
    # for the exact diagram, but one near the face's edge could fall on the wrong
    # side of a true bisector by the polyline approximation.
    inner = shapely.get_point(shapely.maximum_inscribed_circle(faces), 0)
    owner = np.argmax(
        _xyz(np.radians(shapely.get_x(inner)), np.radians(shapely.get_y(inner))) @ xyz.T, axis=1
    )
    cells: list[Polygon | MultiPolygon] = []
    for k in range(len(xyz)):
        cell = shapely.coverage_union_all(faces[owner == k])
        if not isinstance(cell, Polygon | MultiPolygon) or cell.is_empty:
            # Cannot happen for sites 1e-6 degrees apart: the face around a site is its own.
            raise AssertionError(f"site {k} got no area")
        cells.append(cell)
    return cells


def _edge_polylines(xyz: FloatArray, i: int, j: int, step: float) -> list[FloatArray]:
    """Lon/lat polylines of the Voronoi edge between sites i and j (none if not adjacent)."""
    normal = xyz[i] - xyz[j]
    normal /= np.linalg.norm(normal)
    # Orthonormal basis (u, v) of the bisector plane: x(t) = u cos t + v sin t.
    axis = np.eye(3)[int(np.argmin(np.abs(normal)))]
    u = np.cross(normal, axis)
    u /= np.linalg.norm(u)
    v = np.cross(normal, u)
    others = xyz[i] - np.delete(xyz, [i, j], axis=0)
    # On the bisector, x(t)·(s_i - s_k) = r cos(t - theta_k) >= 0 keeps i and j
    # at least as near as k: a half circle centred on theta_k.
    theta = np.sort(np.mod(np.arctan2(others @ v, others @ u), 2 * math.pi))
    if len(theta) == 0:
        t0, t1 = 0.0, 2 * math.pi
    else:
        gaps = np.diff(np.append(theta, theta[0] + 2 * math.pi))
        g = int(np.argmax(gaps))
        # Half circles intersect in an arc of length gap - pi iff all centres fit
        # in the arc opposite the largest gap. Near-zero edges are kept (cheap).
        if gaps[g] <= math.pi - 1e-9:
            return []
        alpha = theta[(g + 1) % len(theta)]
        beta = alpha + 2 * math.pi - gaps[g]
        # Lengthen by one step at each end so that edges meeting at a vertex
        # cross there robustly; the overshoot becomes a dangle and is dropped.
        t0, t1 = beta - math.pi / 2 - step, alpha + math.pi / 2 + step
        if t1 - t0 >= 2 * math.pi:
            t0, t1 = 0.0, 2 * math.pi
    return list(_arc_to_lonlat(normal, u, v, t0, t1, step))


def _arc_to_lonlat(
    normal: FloatArray, u: FloatArray, v: FloatArray, t0: float, t1: float, step: float
) -> Iterator[FloatArray]:
    """Samples the arc x(t), t0 <= t <= t1, as lon/lat polylines cut at ±180 and the poles."""
    # Parameters where lon/lat breaks, to cut the arc there.
    poles: list[float] = []
    if abs(normal[2]) < _THROUGH_POLE:
        # Two meridians through the poles; they meet ±180 only at the poles (or
        # lie on it, which the world border already draws).
        t_north = math.atan2(v[2], u[2])
        poles = [t_north, t_north + math.pi]
        cuts = poles
    else:
        # Crosses every meridian once, the antimeridian (y = 0, x < 0) too.
        t_cross = math.atan2(-u[1], v[1])
        if math.cos(t_cross) * u[0] + math.sin(t_cross) * v[0] > 0:
            t_cross += math.pi
        cuts = [t_cross]
    inside = [
        c + 2 * math.pi * k for c in cuts for k in range(-2, 3) if t0 < c + 2 * math.pi * k < t1
    ]
    ts = np.unique(np.concatenate([np.linspace(t0, t1, math.ceil((t1 - t0) / step) + 1), inside]))
    pole_ts = np.array([p + 2 * math.pi * k for p in poles for k in range(-2, 3)])
    ts = _refine(ts, u, v, step, pole_ts)
    bounds = np.searchsorted(ts, sorted(inside))
    starts = [0, *bounds.tolist()]
    ends = [*bounds.tolist(), len(ts) - 1]
    for start, end in zip(starts, ends, strict=True):
        if end > start:
            piece = _piece_lonlat(ts[start : end + 1], u, v, pole_ts)
            if len(np.unique(piece, axis=0)) >= 2:
                yield piece


def _refine(
    ts: FloatArray, u: FloatArray, v: FloatArray, step: float, pole_ts: FloatArray
) -> FloatArray:
    """Adds samples until consecutive ones differ by at most ``step`` in longitude too.

    Near a pole, a short arc sweeps many degrees of longitude; linear
    interpolation in lon/lat would cut the corner there.
    """
    for _ in range(60):
        p = _points(ts, u, v)
        lon = np.arctan2(p[:, 1], p[:, 0])
        dlon = np.abs(np.angle(np.exp(1j * np.diff(lon))))
        at_pole = np.isin(ts[:-1], pole_ts) | np.isin(ts[1:], pole_ts)
        split = (dlon > step) & ~at_pole & (np.diff(ts) > 1e-15)
        if not split.any():
            break
        ts = np.sort(np.concatenate([ts, (ts[:-1][split] + ts[1:][split]) / 2]))
    return ts


def _points(ts: FloatArray, u: FloatArray, v: FloatArray) -> FloatArray:
    points: FloatArray = np.outer(np.cos(ts), u) + np.outer(np.sin(ts), v)
    return points


def _piece_lonlat(ts: FloatArray, u: FloatArray, v: FloatArray, pole_ts: FloatArray) -> FloatArray:
    """Lon/lat (degrees) of one piece that crosses neither ±180 nor a pole inside."""
    p = _points(ts, u, v)
    lat = np.degrees(np.arcsin(np.clip(p[:, 2], -1.0, 1.0)))
    lon = np.degrees(np.arctan2(p[:, 1], p[:, 0]))
    # At a pole the longitude is that of the meridian the piece runs along.
    for end, neighbour in ((0, 1), (-1, -2)):
        if np.isin(ts[end], pole_ts):
            lat[end] = math.copysign(90.0, lat[end])
            lon[end] = lon[neighbour]
    # Points on (or within float noise of) the antimeridian may come out as -180
    # on the +180 side; unwrap to a continuous run, then bring it into range.
    lon = np.degrees(np.unwrap(np.radians(lon)))
    mid = lon[len(lon) // 2]
    lon = np.clip(lon - 360.0 * np.round(mid / 360.0), -180.0, 180.0)
    return np.column_stack([lon, lat])


# --------------------------------------------------------------------------- output


def _feature(site: Site, cell: Polygon | MultiPolygon) -> dict[str, Any]:
    props: dict[str, Any] = {
        "id": site.id,
        "name": site.name,
        "site": [_round(site.lon), _round(site.lat)],
    }
    if site.endpoint:
        props["endpoint"] = site.endpoint
    if site.client_endpoint:
        props["client_endpoint"] = site.client_endpoint
    return {"type": "Feature", "geometry": _geojson_geometry(cell), "properties": props}


def _geojson_geometry(cell: Polygon | MultiPolygon) -> dict[str, Any]:
    # RFC 7946 §3.1.6: exterior rings counterclockwise, holes clockwise.
    cell = shapely.orient_polygons(cell)
    if isinstance(cell, Polygon):
        return {"type": "Polygon", "coordinates": _rings(cell)}
    return {"type": "MultiPolygon", "coordinates": [_rings(p) for p in cell.geoms]}


def _rings(polygon: Polygon) -> list[list[list[float]]]:
    rings = [polygon.exterior, *polygon.interiors]
    return [[[_round(x), _round(y)] for x, y in ring.coords] for ring in rings]


def _round(value: float) -> float:
    # Vertices already lie on the 1e-7 grid; this only makes their decimal
    # representation short. +0.0 avoids "-0.0" in the file.
    return round(float(value), _DECIMALS) + 0.0


def _invalid(message: str) -> InvalidInput:
    """The error for a message written ``field: reason`` (every message here is)."""
    field, _, reason = message.partition(": ")
    return InvalidInput(field, reason)
