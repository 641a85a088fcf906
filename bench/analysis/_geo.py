"""Vectorized geometry for the Spark analysis, answering exactly as the routing core does.

The executors ask the same questions as `geofed.routing` (who is responsible
for a point, which brokers a geofence meets, does a geofence cover a point),
but over whole Arrow batches: one bulk STRtree query or one ``intersects_xy``
call per batch instead of a Python call per row. Every fast path is the
core's own predicate on the same geometries; the rare rows where the core
does something special (a point on ±180, a point in a gap between areas) are
handed to the core function itself. `tests/spark/test_spark_geo.py` holds
each function against its routing counterpart.

Also here: the H3 cover of subscription geofences used as the bucketing key
of the event x subscription join, and the topic-filter matcher. Nothing in
this module imports pyspark.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

import h3
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import shapely
from shapely.geometry.base import BaseGeometry
from shapely.strtree import STRtree

# The H3 cover of subscription geofences is the core's `h3_cover` (shared with
# the broker's filter schemes); a geofence needing more than H3_MAX_CELLS cells
# is matched without the spatial key.
from geofed.routing import (
    KM_PER_DEG,
    Federation,
    Geofence,
    LatLon,
    Subscription,
    SubscriptionIndex,
    covers,
    topic_matches,
)

H3_RES_MAX = 10
"""Finest H3 resolution the job buckets by; events carry their cell at this one."""

H3_RES_MIN = 2
"""Coarsest H3 resolution used: below it cells are too large for the buffer argument."""


def filled(arr: pa.Array, fill: object, dtype: type | np.dtype) -> np.ndarray:
    """The values of an Arrow array (an executor's batch column) as a NumPy array of
    `dtype`, nulls as `fill` (a copy: the caller may write into it)."""
    return np.array(pc.fill_null(arr, fill).to_numpy(zero_copy_only=False), dtype=dtype)


def present(arr: pa.Array) -> np.ndarray:
    """Where an Arrow array holds a value (not null)."""
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def fence_id(fence: Geofence) -> int:
    """A 64-bit id of a geofence, from its canonical WKT (equal shapes, equal ids)."""
    digest = hashlib.blake2b(fence.wkt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class FederationIndex:
    """Batch versions of `Federation.responsible` and `Federation.brokers_meeting`.

    Brokers are numbered by their position in `Federation.ids` (sorted ids), so
    "the smallest covering id" is the smallest covering index.
    """

    def __init__(self, federation: Federation) -> None:
        self.federation = federation
        self.ids: tuple[str, ...] = federation.ids
        self.index = {bid: i for i, bid in enumerate(self.ids)}
        parts: list[BaseGeometry] = []
        owners: list[int] = []
        for i, broker in enumerate(federation.brokers):
            for part in broker.area.parts:
                parts.append(part)
                owners.append(i)
        # Prepared parts, tested after a bounding-box query: the same
        # ``intersects`` as the core's tree query, twenty times faster on
        # areas with thousands of vertices.
        self._parts = np.asarray(parts, dtype=object)
        shapely.prepare(self._parts)
        self._tree = STRtree(self._parts)
        self._owner = np.asarray(owners, dtype=np.int32)
        self._all = list(range(len(self.ids)))

    def _intersecting(self, geoms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input index, part index) of every intersecting pair."""
        idx, part = self._tree.query(geoms)
        keep = np.asarray(shapely.intersects(self._parts[part], geoms[idx]), dtype=bool)
        return idx[keep], part[keep]

    def responsible(self, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
        """Index of the broker responsible for each (lat, lon), as `Federation.responsible`."""
        n = len(lat)
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        pts = shapely.points(lon, lat)
        hit_pt, hit_part = self._intersecting(pts)
        nobody = len(self.ids)
        best = np.full(n, nobody, dtype=np.int32)
        np.minimum.at(best, hit_pt, self._owner[hit_part])
        # Points on ±180 (one meridian, two coordinates) and points in a gap
        # between areas (nearest area) are the core's business, row by row.
        slow = (best == nobody) | (np.abs(lon) == 180.0)
        for i in np.flatnonzero(slow):
            owner = self.federation.responsible(LatLon(float(lat[i]), float(lon[i])))
            best[i] = self.index[owner]
        return best

    def meeting(self, geoms: Sequence[BaseGeometry]) -> list[list[int]]:
        """Sorted broker indices each geofence meets, as `Federation.brokers_meeting`."""
        n = len(geoms)
        out: list[set[int]] = [set() for _ in range(n)]
        if n == 0:
            return []
        arr = np.asarray(geoms, dtype=object)
        hit_geom, hit_part = self._intersecting(arr)
        for g, owner in zip(hit_geom.tolist(), self._owner[hit_part].tolist(), strict=True):
            out[g].add(owner)
        gap = self.federation.gap
        in_gap = shapely.intersects(arr, gap) if gap is not None else np.zeros(n, dtype=bool)
        return [self._all if in_gap[i] else sorted(s) for i, s in enumerate(out)]


def covers_many(fence: Geofence, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """`geofed.routing.covers(fence, point)` for arrays of points."""
    inside = np.asarray(shapely.intersects_xy(fence.geometry, lon, lat), dtype=bool)
    # ±180 is one meridian written two ways: the core tests both.
    for i in np.flatnonzero(np.abs(lon) == 180.0):
        inside[i] = covers(fence, LatLon(float(lat[i]), float(lon[i])))
    return inside


# --------------------------------------------------------------------------
# H3 bucketing


def extent_km(geom: BaseGeometry) -> float:
    """The larger side of a geometry's bounding box, in kilometres."""
    minx, miny, maxx, maxy = geom.bounds
    mid = math.radians((miny + maxy) / 2.0)
    return float(max((maxx - minx) * KM_PER_DEG * math.cos(mid), (maxy - miny) * KM_PER_DEG))


def choose_resolution(median_extent_km: float | None) -> int:
    """The job's H3 resolution: cells about an eighth of the typical geofence.

    Finer cells mean fewer false candidates (the exact check throws them away)
    but more cells per geofence; an eighth of the median extent keeps a typical
    cover at a few dozen cells.
    """
    if median_extent_km is None or not median_extent_km > 0:
        return H3_RES_MIN
    target = median_extent_km / 8.0
    res = H3_RES_MIN
    for r in range(H3_RES_MIN, H3_RES_MAX + 1):
        if h3.average_hexagon_edge_length(r, unit="km") >= target:
            res = r
    return res


def h3_cell(lat: float, lon: float, res: int = H3_RES_MAX) -> int:
    """The H3 cell (as int) of a point."""
    return int(h3.str_to_int(h3.latlng_to_cell(lat, lon, res)))


def h3_cells(lat: np.ndarray, lon: np.ndarray, res: int = H3_RES_MAX) -> np.ndarray:
    """`h3_cell` of each point (h3 answers one point per call; its integer API saves the
    string round trip)."""
    cell = h3.api.basic_int.latlng_to_cell
    return np.fromiter(
        (cell(a, b, res) for a, b in zip(lat.tolist(), lon.tolist(), strict=True)),
        dtype=np.int64,
        count=len(lat),
    )


def h3_parent_int(cell: int, res: int) -> int:
    """Parent of an H3 cell int by bit arithmetic (the same formula the job runs in the JVM).

    An H3 index keeps its resolution in bits 52-55 and one 3-bit digit per
    finer resolution below; digits past the resolution are all ones.
    """
    return (cell & ~(0xF << 52)) | (res << 52) | ((1 << (3 * (15 - res))) - 1)


# --------------------------------------------------------------------------
# Topics


class FilterMatcher:
    """Which of a fixed set of topic filters match a topic.

    The routing core's subscription index proposes the filters (a trie walk);
    the core's `topic_matches` decides, so there is one definition of a match.
    """

    _ANYWHERE = LatLon(0.0, 0.0)

    def __init__(self, filters: Iterable[str]) -> None:
        self._index = SubscriptionIndex()
        for f in filters:
            self._index.add(Subscription(f, "-", f))

    def matching(self, topic: str) -> list[str]:
        """The filters matching `topic`, sorted."""
        found = self._index.match(topic, self._ANYWHERE)
        return sorted(s.topic_filter for s in found if topic_matches(s.topic_filter, topic))
