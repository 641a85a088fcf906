"""The subscription index: find the subscriptions an event can match without a scan.

Two stages. A topic trie (one node per filter level, ``+`` and ``#`` as their
own children) yields the filters matching a topic. Each trie node keeps its
subscriptions in a spatial bucket: world subscriptions in a plain dict, and
geofenced ones in a multi-level lon/lat grid keyed by the bounding box of each
geofence part (each part lands in at most 2 x 2 cells of the level its size
picks). A lookup probes one cell per level in use, then applies the exact
*covers* check. Candidates are a superset of the answer, so nothing is missed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import numpy as np
import shapely

from ._geometry import Geofence, LatLon
from ._model import Subscription

_MAX_LEVEL = 14  # cell edge 180 / 2**14 degrees, about 1.2 km
_VECTOR_MIN = 4  # candidates from which one array call beats per-candidate calls


def _level_for(width: float, height: float) -> int:
    span = max(width, height)
    if span <= 0.0:
        return _MAX_LEVEL
    return max(0, min(_MAX_LEVEL, math.floor(math.log2(180.0 / span))))


def _cell(v: float, origin: float, size: float) -> int:
    return math.floor((v + origin) / size)


class _SpatialBucket:
    """Subscriptions of one topic filter, bucketed by where their geofence is."""

    __slots__ = ("cells", "levels", "world")

    def __init__(self) -> None:
        self.world: dict[str, Subscription] = {}
        self.cells: dict[tuple[int, int, int], dict[str, Subscription]] = {}
        self.levels: Counter[int] = Counter()

    def __bool__(self) -> bool:
        return bool(self.world) or bool(self.cells)

    @staticmethod
    def _keys(fence: Geofence) -> set[tuple[int, int, int]]:
        keys: set[tuple[int, int, int]] = set()
        for part in fence.parts:
            minx, miny, maxx, maxy = part.bounds
            level = _level_for(maxx - minx, maxy - miny)
            size = 180.0 / (1 << level)
            for ix in range(_cell(minx, 180.0, size), _cell(maxx, 180.0, size) + 1):
                for iy in range(_cell(miny, 90.0, size), _cell(maxy, 90.0, size) + 1):
                    keys.add((level, ix, iy))
        return keys

    def add(self, sub: Subscription) -> None:
        if sub.geofence is None:
            self.world[sub.id] = sub
            return
        for key in self._keys(sub.geofence):
            bucket = self.cells.get(key)
            if bucket is None:
                bucket = self.cells[key] = {}
                self.levels[key[0]] += 1
            bucket[sub.id] = sub

    def remove(self, sub: Subscription) -> None:
        if sub.geofence is None:
            self.world.pop(sub.id, None)
            return
        for key in self._keys(sub.geofence):
            bucket = self.cells.get(key)
            if bucket is None:
                continue
            bucket.pop(sub.id, None)
            if not bucket:
                del self.cells[key]
                self.levels[key[0]] -= 1
                if not self.levels[key[0]]:
                    del self.levels[key[0]]

    def candidates(
        self,
        lon: float,
        lat: float,
        keys: list[list[_Key] | None],
        out: dict[str, Subscription],
        world: list[Subscription],
    ) -> None:
        """Add the subscriptions that may cover the point (`keys` caches its cells per level).

        World subscriptions go to `world`: they match anywhere and sit in this
        one bucket only, so they need neither the covers check nor de-duplication.
        """
        world.extend(self.world.values())
        if not self.cells:
            return
        for level in self.levels:
            cells = keys[level]
            if cells is None:
                cells = keys[level] = _point_keys(level, lon, lat)
            for key in cells:
                bucket = self.cells.get(key)
                if bucket:
                    out.update(bucket)


_Key = tuple[int, int, int]
_SIZES = [180.0 / (1 << level) for level in range(_MAX_LEVEL + 1)]


def _point_keys(level: int, lon: float, lat: float) -> list[_Key]:
    """The grid cell of a point at `level` (both sides of the antimeridian)."""
    size = _SIZES[level]
    iy = math.floor((lat + 90.0) / size)
    if abs(lon) == 180.0:
        return [(level, math.floor(x / size), iy) for x in (360.0, 0.0)]
    return [(level, math.floor((lon + 180.0) / size), iy)]


class _TrieNode:
    __slots__ = ("bucket", "children")

    def __init__(self) -> None:
        self.children: dict[str, _TrieNode] = {}
        self.bucket = _SpatialBucket()


class SubscriptionIndex:
    """Subscriptions by id, with lookup by event topic and publisher location."""

    def __init__(self) -> None:
        self._root = _TrieNode()
        self._subs: dict[str, Subscription] = {}

    def __len__(self) -> int:
        return len(self._subs)

    def __contains__(self, sub_id: object) -> bool:
        return sub_id in self._subs

    def __iter__(self) -> Iterator[Subscription]:
        return iter(list(self._subs.values()))

    def get(self, sub_id: str) -> Subscription | None:
        """The subscription with this id, if indexed."""
        return self._subs.get(sub_id)

    def add(self, sub: Subscription) -> Subscription | None:
        """Index `sub`, replacing any subscription with the same id; return the old one."""
        old = self.remove(sub.id)
        node = self._root
        for level in sub.topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _TrieNode()
            node = child
        node.bucket.add(sub)
        self._subs[sub.id] = sub
        return old

    def remove(self, sub_id: str) -> Subscription | None:
        """Drop the subscription with this id; return it (``None`` if unknown)."""
        sub = self._subs.pop(sub_id, None)
        if sub is None:
            return None
        path = [self._root]
        levels = sub.topic_filter.split("/")
        for level in levels:
            path.append(path[-1].children[level])
        path[-1].bucket.remove(sub)
        # Prune empty branches so memory follows the live subscriptions.
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.children or node.bucket:
                break
            del path[depth - 1].children[levels[depth - 1]]
        return sub

    def match(self, topic: str, location: LatLon) -> list[Subscription]:
        """Subscriptions passing ContentCheck and Subscription GeoCheck for an event."""
        if not self._subs:
            return []
        nodes = self._nodes_for(topic)
        if not nodes:
            return []
        lon, lat = location.lon, location.lat
        keys: list[list[_Key] | None] = [None] * (_MAX_LEVEL + 1)
        found: dict[str, Subscription] = {}
        matched: list[Subscription] = []  # world subscriptions first
        # dict.fromkeys: a topic holding a wildcard (invalid, but match() is
        # public) reaches a node twice, which would list its world subs twice.
        for node in dict.fromkeys(nodes):
            node.bucket.candidates(lon, lat, keys, found, matched)
        if abs(lon) == 180.0:
            matched.extend(
                s for s in found.values() if s.geofence and s.geofence.covers_xy(lon, lat)
            )
            return matched
        # Bounding boxes first (plain comparisons), then one vectorized GEOS
        # call for the survivors instead of one call per candidate.
        inside = [
            s
            for s in found.values()
            if s.geofence is not None
            and s.geofence.bounds[0] <= lon <= s.geofence.bounds[2]
            and s.geofence.bounds[1] <= lat <= s.geofence.bounds[3]
        ]
        if len(inside) < _VECTOR_MIN:
            matched.extend(s for s in inside if s.geofence and s.geofence.covers_xy(lon, lat))
        elif inside:
            geoms = np.fromiter(
                (s.geofence.geometry for s in inside if s.geofence), object, len(inside)
            )
            hits = shapely.intersects_xy(geoms, lon, lat)
            matched.extend(s for s, hit in zip(inside, hits, strict=True) if hit)
        return matched

    def _nodes_for(self, topic: str) -> list[_TrieNode]:
        levels = topic.split("/")
        out: list[_TrieNode] = []
        # A leading wildcard does not match topics that start with '$'.
        dollar = topic.startswith("$")
        frontier = [self._root]
        for depth, level in enumerate(levels):
            nxt: list[_TrieNode] = []
            for node in frontier:
                wild = not (dollar and depth == 0)
                if wild:
                    hash_child = node.children.get("#")
                    if hash_child is not None:
                        out.append(hash_child)
                child = node.children.get(level)
                if child is not None:
                    nxt.append(child)
                if wild:
                    plus = node.children.get("+")
                    if plus is not None:
                        nxt.append(plus)
            frontier = nxt
            if not frontier:
                return out
        out.extend(frontier)
        # 'a/#' also matches 'a' itself.
        for node in frontier:
            hash_child = node.children.get("#")
            if hash_child is not None:
                out.append(hash_child)
        return out
