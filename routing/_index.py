"""The subscription index: find the subscriptions an event can match without a scan.

Two stages. A topic trie (one node per filter level, ``+`` and ``#`` as their
own children) yields the filters matching a topic. Each trie node keeps its
subscriptions in a spatial bucket: world subscriptions in a plain dict, and
geofenced ones in a multi-level lon/lat grid keyed by the bounding box of each
geofence part (each part lands in at most 2 x 2 cells of the level its size
picks). A lookup probes one cell per level in use, then applies the exact
*covers* check. Candidates are a superset of the answer, so nothing is missed.
A batch of events probes the cells of every bucket at once instead, in one
sorted array of (bucket, cell) keys (`_CellArray`, `np.searchsorted`), built
lazily and rebuilt after enough churn; a bucket changed since its build is
probed the dict way, so the answer never depends on the array being current.

The exact check runs on packed arrays, one slot per geofence part (`_PartStore`),
vectorized over the candidates of a whole batch of events (`match_many`,
`match_groups_many`; a single lookup is a batch of one): a disc test decides
most of them (a disc around an interior point that lies inside the part, and
one holding the whole part, both measured in a frame where the part's
longitudes are scaled by the cosine of its latitude, so that a geodesic circle
is nearly round), and GEOS decides the rest, which lie in the thin ring
between the two discs.

`SubscriptionIndex.match_groups` serves the publisher's broker, which sends one
delivery message per subscriber broker naming the matched subscriptions: each
subscription is indexed with a group (its home broker) and the answer comes as
keys per group, with no `Subscription` touched on the way. The trie nodes of a
topic, and the keys of the world subscriptions they hold (every lookup of the
topic returns all of them), grouped and sorted, are cached per topic until the
trie or its world subscriptions change: an event that matches many world
subscriptions costs little more than copying their keys.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import shapely
from shapely.geometry import Polygon

from ._geometry import Geofence, LatLon
from ._model import SubKey, Subscription

_MAX_LEVEL = 14  # cell edge 180 / 2**14 degrees, about 1.2 km
_VECTOR_MIN = 8  # candidates from which array calls beat per-candidate calls
_DISC_MARGIN = 1e-9  # degrees: far above the rounding error of the disc test
_NO_DISC = (0.0, 0.0, 0.0, -1.0, math.inf)  # decides nothing: always ask GEOS
_TOPIC_CACHE = 4096  # topics whose trie nodes are cached (all forgotten when full)


def _level_for(width: float, height: float) -> int:
    span = max(width, height)
    if span <= 0.0:
        return _MAX_LEVEL
    return max(0, min(_MAX_LEVEL, math.floor(math.log2(180.0 / span))))


def _cell(v: float, origin: float, size: float) -> int:
    return math.floor((v + origin) / size)


def _grid_key(level: int, ix: int, iy: int) -> int:
    """A grid cell as one int (``level`` in the low 4 bits; 0 <= ix <= 2**15, 0 <= iy <= 2**14).

    An int rather than a (level, ix, iy) tuple: a lookup probes ~40 cells per
    event, and an int hashes to itself where a tuple hashes its three items
    on every probe.
    """
    return ((iy << 17) | ix) << 4 | level


def part_discs(part: Polygon) -> tuple[float, float, float, float, float]:
    """``(cx, cy, k, r_in², r_out²)``: discs for the exact test of one polygon.

    In the frame ``x = (lon - cx) * k, y = lat - cy`` (``k`` the cosine of the
    centre's latitude) the polygon contains the disc of radius ``r_in`` around
    the origin and lies within the disc of radius ``r_out``. Both hold for any
    polygon whose centre point is inside it (the nearest edge bounds the
    inner disc, the farthest vertex the outer one); the margins keep rounding
    on the safe side. Points between the discs need the exact test.
    """
    c = part.centroid
    if not part.contains(c):
        c = part.representative_point()
    cx, cy = float(c.x), float(c.y)
    k = math.cos(math.radians(cy))
    if k < 1e-3:
        return _NO_DISC
    r_in = math.inf
    for ring in (part.exterior, *part.interiors):
        xy = np.asarray(ring.coords)
        x, y = (xy[:, 0] - cx) * k, xy[:, 1] - cy
        ax, ay, ex, ey = x[:-1], y[:-1], np.diff(x), np.diff(y)
        length2 = ex * ex + ey * ey
        t = np.clip(-(ax * ex + ay * ey) / np.where(length2 > 0, length2, 1.0), 0.0, 1.0)
        px, py = ax + t * ex, ay + t * ey
        r_in = min(r_in, float(np.sqrt((px * px + py * py).min())))
    xy = np.asarray(part.exterior.coords)
    r_out = float(np.hypot((xy[:, 0] - cx) * k, xy[:, 1] - cy).max())
    inner = max(r_in - _DISC_MARGIN, 0.0)
    return cx, cy, k, inner * inner if inner > 0 else -1.0, (r_out + _DISC_MARGIN) ** 2


class _PartStore:
    """Geofence parts of indexed subscriptions packed in arrays, one slot per part."""

    __slots__ = (
        "buckets",
        "cells",
        "discs",
        "free",
        "geoms",
        "group_names",
        "group_numbers",
        "groups",
        "keys",
        "multipart",
        "numbers",
        "owners",
        "slots",
    )

    def __init__(self) -> None:
        self.owners: list[Subscription | None] = []
        self.keys: list[SubKey | None] = []  # owners' keys (a property builds a new tuple)
        self.groups: list[str | None] = []  # owners' groups (`SubscriptionIndex.add`)
        self.discs = np.empty((0, 5))
        self.geoms = np.empty(0, dtype=object)
        # Per slot, for the array path of `SubscriptionIndex.match_groups_many`: its
        # group's number (`group_names`).
        self.numbers = np.empty(0, dtype=np.intp)
        self.group_numbers: dict[str, int] = {}
        self.group_names: list[str] = []
        # Per slot, for `_CellArray`: its grid cells (`_grid_key`s) and its bucket's ident.
        self.cells: list[list[int]] = []
        self.buckets = np.empty(0, dtype=np.int64)
        self.free: list[int] = []
        self.slots: dict[SubKey, list[int]] = {}  # subscription key -> its slots
        self.multipart = 0  # subscriptions with several parts (may be found twice)

    def add(self, sub: Subscription, fence: Geofence, group: str) -> list[tuple[int, Polygon]]:
        """Give each part of `fence` a slot (filed under `group`); return (slot, part) pairs."""
        out = []
        for part in fence.parts:
            if self.free:
                slot = self.free.pop()
            else:
                slot = len(self.owners)
                self.owners.append(None)
                self.keys.append(None)
                self.groups.append(None)
                self.cells.append([])
                if slot >= len(self.geoms):
                    self._grow(max(64, 2 * len(self.geoms)))
            shapely.prepare(part)
            self.owners[slot] = sub
            self.keys[slot] = sub.key
            self.groups[slot] = group
            number = self.group_numbers.get(group)
            if number is None:
                number = self.group_numbers[group] = len(self.group_names)
                self.group_names.append(group)
            self.numbers[slot] = number
            self.geoms[slot] = part
            self.discs[slot] = part_discs(part)
            out.append((slot, part))
        self.slots[sub.key] = [slot for slot, _ in out]
        self.multipart += len(out) > 1
        return out

    def remove(self, key: SubKey) -> list[int]:
        """Free the slots of a subscription; return them."""
        slots = self.slots.pop(key, [])
        self.multipart -= len(slots) > 1
        for slot in slots:
            self.owners[slot] = None
            self.keys[slot] = None
            self.groups[slot] = None
            self.geoms[slot] = None
            self.cells[slot] = []
            self.free.append(slot)
        return slots

    def _grow(self, size: int) -> None:
        def grown(a: np.ndarray) -> np.ndarray:
            out = np.empty((size, *a.shape[1:]), dtype=a.dtype)
            out[: len(a)] = a
            return out

        self.discs, self.geoms = grown(self.discs), grown(self.geoms)
        self.numbers, self.buckets = grown(self.numbers), grown(self.buckets)

    def covering(
        self, slots: list[list[int]], lons: list[float], lats: list[float]
    ) -> list[list[int]]:
        """For each point, the parts among its `slots` that cover it, one per owner.

        The disc test runs on the candidates of all the points at once (and
        GEOS on all the undecided ones at once): a batch of events costs one
        round of array calls, not one per event, whose fixed cost would
        dominate the ~20 candidates of a typical event.
        """
        total = sum(map(len, slots))
        if total < _VECTOR_MIN:
            return self._one_per_owner(
                [
                    [s for s in some if self._covers(s, lon, lat)]
                    for some, lon, lat in zip(slots, lons, lats, strict=True)
                ]
            )
        counts = np.fromiter(map(len, slots), np.intp, len(slots))
        pairs = self.covering_pairs(
            np.repeat(np.arange(len(slots)), counts),
            np.fromiter(itertools.chain.from_iterable(slots), np.intp, total),
            np.asarray(lons, dtype=float),
            np.asarray(lats, dtype=float),
        )
        return self.per_point(*pairs, len(slots))

    def per_point(self, at: np.ndarray, found: np.ndarray, n: int) -> list[list[int]]:
        """(point, slot) pairs sorted by point (`covering_pairs`) as slots per point
        (`n` points), one per owner."""
        if n < _VECTOR_MIN:  # e.g. a single lookup: cheaper than the array calls below
            hits: list[list[int]] = [[] for _ in range(n)]
            for k, slot in zip(at.tolist(), found.tolist(), strict=True):
                hits[k].append(slot)
            return self._one_per_owner(hits)
        bounds = np.searchsorted(at, np.arange(n + 1)).tolist()
        flat = found.tolist()
        return self._one_per_owner([flat[a:b] for a, b in itertools.pairwise(bounds)])

    def covering_pairs(
        self, point: np.ndarray, idx: np.ndarray, lons: np.ndarray, lats: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The candidates (part `idx[j]` for the point `point[j]`, at ``lons[point[j]]``,
        ``lats[point[j]]``; `point` non-decreasing) that cover their point, as
        (point, slot) pairs in that order; not one per owner (`per_point`)."""
        x = lons[point]
        y = lats[point]
        cx, cy, k, inner2, outer2 = self.discs[idx].T
        dx = (x - cx) * k
        dy = y - cy
        d2 = dx * dx + dy * dy
        hit = d2 < inner2
        unsure = np.flatnonzero(~hit & (d2 <= outer2))
        if len(unsure):
            hit[unsure] = shapely.intersects_xy(self.geoms[idx[unsure]], x[unsure], y[unsure])
        where = np.flatnonzero(hit)
        return point[where], idx[where]

    def _one_per_owner(self, hits: list[list[int]]) -> list[list[int]]:
        if self.multipart:
            # A subscription with several parts can be found through each of them.
            owners = self.owners
            return [list({id(owners[s]): s for s in hit}.values()) for hit in hits]
        return hits

    def _covers(self, slot: int, lon: float, lat: float) -> bool:
        cx, cy, k, inner2, outer2 = self.discs[slot].tolist()
        dx, dy = (lon - cx) * k, lat - cy
        d2 = dx * dx + dy * dy
        if d2 < inner2:
            return True
        if d2 > outer2:
            return False
        return bool(shapely.intersects_xy(self.geoms[slot], lon, lat))


class _SpatialBucket:
    """Subscriptions of one topic filter, bucketed by where their geofence is.

    Geofenced subscriptions are held as the slots of their parts in `_PartStore`.
    World subscriptions match anywhere and sit in this one bucket only, so a
    lookup takes them with neither the covers check nor de-duplication.
    """

    __slots__ = ("cells", "ident", "levels", "world")

    def __init__(self, ident: int) -> None:
        self.world: dict[SubKey, Subscription] = {}
        self.cells: dict[int, set[int]] = {}  # `_grid_key` -> slots
        self.levels: Counter[int] = Counter()
        self.ident = ident  # its buckets' part of its keys in `_CellArray`, unique in its index

    def __bool__(self) -> bool:
        return bool(self.world) or bool(self.cells)

    @staticmethod
    def _keys(part: Polygon) -> list[int]:
        minx, miny, maxx, maxy = part.bounds
        level = _level_for(maxx - minx, maxy - miny)
        size = 180.0 / (1 << level)
        return [
            _grid_key(level, ix, iy)
            for ix in range(_cell(minx, 180.0, size), _cell(maxx, 180.0, size) + 1)
            for iy in range(_cell(miny, 90.0, size), _cell(maxy, 90.0, size) + 1)
        ]

    def add(self, sub: Subscription, parts: list[tuple[int, Polygon]], store: _PartStore) -> None:
        if sub.geofence is None:
            self.world[sub.key] = sub
            return
        for slot, part in parts:
            keys = store.cells[slot] = self._keys(part)
            store.buckets[slot] = self.ident
            for key in keys:
                cell = self.cells.get(key)
                if cell is None:
                    cell = self.cells[key] = set()
                    self.levels[key & 15] += 1
                cell.add(slot)

    def remove(self, sub: Subscription, slots: list[int]) -> None:
        if sub.geofence is None:
            self.world.pop(sub.key, None)
            return
        for slot, part in zip(slots, sub.geofence.parts, strict=True):
            for key in self._keys(part):
                cell = self.cells.get(key)
                if cell is None:
                    continue
                cell.discard(slot)
                if not cell:
                    del self.cells[key]
                    level = key & 15
                    self.levels[level] -= 1
                    if not self.levels[level]:
                        del self.levels[level]

    def cell_candidates(self, cells: list[_Key], out: list[int]) -> None:
        """Add the slots of the geofence parts that may cover a point (its cells per level)."""
        get = self.cells.get
        for level in self.levels:
            cell = get(cells[level])
            if cell:
                out.extend(cell)


_Key = int  # `_grid_key`


def _firsts(events: Sequence[tuple[str, LatLon]]) -> list[int]:
    """For each event, the position of the batch's first event with its topic and point.

    A batch mostly comes from one client (a `PublishStream` message, an MQTT
    connection's burst), so from one point: a repeat copies the first answer.
    """
    seen: dict[tuple[str, float, float], int] = {}
    return [seen.setdefault((topic, p.lon, p.lat), i) for i, (topic, p) in enumerate(events)]


_SIZES = [180.0 / (1 << level) for level in range(_MAX_LEVEL + 1)]
_SIZES_ARRAY = np.array(_SIZES)
_LEVELS_ARRAY = np.arange(_MAX_LEVEL + 1, dtype=np.int64)


def _point_cells(points: Sequence[tuple[float, float]]) -> list[list[_Key]]:
    """Each (lon, lat)'s grid cell at every level, as `_grid_key`s indexed by level.

    All levels of all the points in a few array calls: a batch of events
    probes ~20 cells per (topic, point), and computing each key in Python
    cost more than the probe. A point on the antimeridian sits in two cells
    per level; this gives the one of its own longitude (see `_cell_rows`).
    """
    if len(points) < _VECTOR_MIN:
        return [
            [
                _grid_key(level, _cell(lon, 180.0, size), _cell(lat, 90.0, size))
                for level, size in enumerate(_SIZES)
            ]
            for lon, lat in points
        ]
    keys: list[list[_Key]] = _point_cell_array(
        np.asarray([lon for lon, _ in points], dtype=float),
        np.asarray([lat for _, lat in points], dtype=float),
    ).tolist()
    return keys


def _point_cell_array(lons: np.ndarray, lats: np.ndarray) -> np.ndarray:
    """`_point_cells` as an int64 array, one row per point (of its own longitude)."""
    ix = np.floor((lons[:, None] + 180.0) / _SIZES_ARRAY).astype(np.int64)
    iy = np.floor((lats[:, None] + 90.0) / _SIZES_ARRAY).astype(np.int64)
    keys: np.ndarray = ((iy << 17) | ix) << 4 | _LEVELS_ARRAY
    return keys


_BUCKET_SHIFT = 36  # a `_grid_key` is below 2**36: a bucket's ident sits above it
_REBUILD_MIN = 1024  # changed geofenced subscriptions that always allow a rebuild


class _CellArray:
    """Every bucket's grid cells in one sorted int64 array, probed a whole batch at a time.

    A key is ``bucket ident << _BUCKET_SHIFT | _grid_key``; the slots of the
    key at ``keys[j]`` are ``slots[starts[j]:starts[j] + counts[j]]``. One
    `np.searchsorted` finds the cells of every (bucket, level) a batch
    probes, where the buckets' dicts cost one Python look-up each (~20 per
    event). Built from the slots' cells as they are (`SubscriptionIndex._cell_array`);
    a bucket changed since is probed the dict way (`SubscriptionIndex._dirty`),
    so answers stay exact under churn between builds.
    """

    __slots__ = ("counts", "keys", "slots", "starts")

    def __init__(self, parts: _PartStore) -> None:
        n = len(parts.cells)
        counts = np.fromiter(map(len, parts.cells), np.intp, n)
        total = int(counts.sum())
        cells = np.fromiter(itertools.chain.from_iterable(parts.cells), np.int64, total)
        slots = np.repeat(np.arange(n), counts)
        keys = parts.buckets[slots] << _BUCKET_SHIFT | cells
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        self.slots = slots[order]
        first = np.ones(total, dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        self.starts = np.flatnonzero(first)
        self.keys = keys[self.starts]
        self.counts = np.diff(np.append(self.starts, total))

    def candidates(
        self, point: np.ndarray, probes: np.ndarray, cells: np.ndarray, levels: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(point, slot) pairs: the slots of the cells of `cells[point[j], levels[j]]`
        in the bucket `probes[j]` (its ident shifted), in the order of `point`."""
        if not len(self.keys) or not len(point):
            return point[:0], self.slots[:0]
        wanted = probes | cells[point, levels]
        pos = np.searchsorted(self.keys, wanted)
        np.minimum(pos, len(self.keys) - 1, out=pos)
        found = np.flatnonzero(self.keys[pos] == wanted)
        pos = pos[found]
        count = self.counts[pos]
        ends = np.cumsum(count)
        total = int(ends[-1]) if len(ends) else 0
        first = np.repeat(self.starts[pos] - (ends - count), count)
        return np.repeat(point[found], count), self.slots[first + np.arange(total)]


class _Probes:
    """What a lookup of one topic probes: in the cell array, one (bucket, level) per
    item of `high` (the bucket's ident shifted) and `levels`; aside, the `dirty`
    buckets (changed since the array was built), the dict way. Planned from the
    topic's `buckets` in the `state` they were in (`_bucket_state`) at `generation`
    (`SubscriptionIndex._generation`)."""

    __slots__ = ("buckets", "dirty", "generation", "high", "levels", "state")

    def __init__(
        self,
        high: np.ndarray,
        levels: np.ndarray,
        dirty: list[_SpatialBucket],
        buckets: list[_SpatialBucket],
        state: list[int],
        generation: int,
    ) -> None:
        self.high, self.levels, self.dirty = high, levels, dirty
        self.buckets, self.state, self.generation = buckets, state, generation


class _Candidates(NamedTuple):
    """A batch's candidates from the cell array (`SubscriptionIndex._candidates`): per
    event, the hits already decided (`out`: a point on the antimeridian); the events
    `at` to test in one go, by point (at `lons`, `lats`), and their candidate parts
    as pairs (`point`, `slots`)."""

    out: list[list[int]]
    at: list[int]
    point: np.ndarray
    slots: np.ndarray
    lons: np.ndarray
    lats: np.ndarray


_NONE = np.empty(0, dtype=np.intp)


class _TrieNode:
    __slots__ = ("bucket", "children")

    def __init__(self, ident: int) -> None:
        self.children: dict[str, _TrieNode] = {}
        self.bucket = _SpatialBucket(ident)


class SubscriptionIndex:
    """Subscriptions by key (client, id), with lookup by event topic and publisher location."""

    def __init__(self) -> None:
        self._root = _TrieNode(0)
        self._idents: list[int] = []  # buckets' idents free for reuse (pruned trie nodes)
        self._next_ident = 1
        self._subs: dict[SubKey, Subscription] = {}
        self._groups: dict[SubKey, str] = {}  # each subscription's group (`match_groups`)
        self._parts = _PartStore()
        self._topics: dict[str, list[_TrieNode]] = {}  # trie nodes by topic, until it changes
        # World subscription keys by topic and group, sorted, until a world subscription changes.
        self._world: dict[str, dict[str, tuple[SubKey, ...]]] = {}
        # The grid cells of all buckets as one array (`_CellArray`), built lazily by a batch;
        # `_changed` geofenced subscriptions since; per topic, what a batch probes in it.
        self._cells: _CellArray | None = None
        self._changed = 0
        self._probes: dict[str, _Probes] = {}
        self._generation = 0  # counts the changes that may outdate `_probes`
        self._dirty: set[int] = set()  # idents of the buckets changed since the array's build
        # Distinct (topic, point) pairs from which a batch probes the cell array (below,
        # the buckets' dicts cost less), and changes that always allow a rebuild.
        self.array_batch = _VECTOR_MIN
        self.rebuild_min = _REBUILD_MIN

    def __len__(self) -> int:
        return len(self._subs)

    def __contains__(self, key: object) -> bool:
        return key in self._subs

    def __iter__(self) -> Iterator[Subscription]:
        return iter(list(self._subs.values()))

    def get(self, key: SubKey) -> Subscription | None:
        """The subscription with this key, if indexed."""
        return self._subs.get(key)

    def add(self, sub: Subscription, group: str = "") -> Subscription | None:
        """Index `sub`, replacing any subscription with the same key; return the old one.

        `group` is what `match_groups` files it under (the publisher's broker
        gives a remote subscription's home broker).
        """
        old = self.remove(sub.key)
        node = self._root
        for level in sub.topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _TrieNode(
                    self._idents.pop() if self._idents else self._new_ident()
                )
                self._forget_topics()
            node = child
        if sub.geofence is None:
            self._world.clear()
        else:
            self._changed_bucket(node.bucket)
        self._groups[sub.key] = group
        parts = [] if sub.geofence is None else self._parts.add(sub, sub.geofence, group)
        node.bucket.add(sub, parts, self._parts)
        self._subs[sub.key] = sub
        return old

    def remove(self, key: SubKey) -> Subscription | None:
        """Drop the subscription with this key; return it (``None`` if unknown)."""
        sub = self._subs.pop(key, None)
        if sub is None:
            return None
        del self._groups[key]
        path = [self._root]
        levels = sub.topic_filter.split("/")
        for level in levels:
            path.append(path[-1].children[level])
        if sub.geofence is None:
            self._world.clear()
        else:
            self._changed_bucket(path[-1].bucket)
        path[-1].bucket.remove(sub, self._parts.remove(key))
        # Prune empty branches so memory follows the live subscriptions.
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.children or node.bucket:
                break
            del path[depth - 1].children[levels[depth - 1]]
            self._idents.append(node.bucket.ident)  # its cells left the array (`_dirty`)
            self._forget_topics()
        return sub

    def _forget_topics(self) -> None:
        """The trie changed: forget what is cached per topic."""
        self._topics.clear()
        self._world.clear()
        self._probes.clear()

    def _changed_bucket(self, bucket: _SpatialBucket) -> None:
        """A geofenced subscription of `bucket` changes (before the change is made).

        The cell array no longer holds the bucket; and if it was there, or had
        no cells yet (so no topic's probes name it), the probes planned for the
        topics reaching it may be out of date (`_probes_of` checks them).
        """
        self._changed += 1
        if bucket.ident not in self._dirty or not bucket.cells:
            self._dirty.add(bucket.ident)
            self._generation += 1

    def _new_ident(self) -> int:
        ident = self._next_ident
        self._next_ident += 1
        return ident

    def _bucket_state(self, buckets: list[_SpatialBucket]) -> list[int]:
        """What a topic's probes depend on: per bucket, 0 if the cell array holds its
        cells, 1 if it has cells outside it (changed since), 2 if it has none."""
        dirty = self._dirty
        return [(bucket.ident in dirty) if bucket.cells else 2 for bucket in buckets]

    def match(self, topic: str, location: LatLon) -> list[Subscription]:
        """Subscriptions passing ContentCheck and Subscription GeoCheck for an event."""
        return self.match_many([(topic, location)])[0]

    def match_many(self, events: Sequence[tuple[str, LatLon]]) -> list[list[Subscription]]:
        """`match` for each (topic, publisher location) of a batch, in order.

        The geometric test of the whole batch runs as one round of array
        calls (`_PartStore.covering`), and an event with the topic and point
        of an earlier one copies its answer: publishing a batch costs less
        than publishing its events one by one.
        """
        if not self._subs:  # e.g. a broker's local index while no client subscribes
            return [[] for _ in events]
        firsts, nodes = self._looked_up(events)
        owners = self._parts.owners
        found: list[list[Subscription]] = []  # world subscriptions first
        for some, hits in zip(nodes, self._hits(events, nodes), strict=True):
            matched: list[Subscription] = []
            for node in some:
                matched.extend(node.bucket.world.values())
            matched.extend(owners[s] for s in hits)  # type: ignore[misc]
            found.append(matched)
        for i, first in enumerate(firsts):
            if first != i:
                found[i] = list(found[first])
        return found

    def match_groups(self, topic: str, location: LatLon) -> dict[str, tuple[SubKey, ...]]:
        """`match` as subscription keys per group (see `add`); no empty groups.

        In a group the world subscriptions come first, then the geofenced
        ones, each part sorted (deterministic; sorting the whole would cost
        more than the rest of the lookup when there are many). Tuples: a
        group with no geofenced hit answers with the topic's cached world
        tuple itself (`world_groups`), uncopied.
        """
        return self.match_groups_many([(topic, location)])[0]

    def match_groups_many(
        self, events: Sequence[tuple[str, LatLon]]
    ) -> list[dict[str, tuple[SubKey, ...]]]:
        """`match_groups` for each (topic, publisher location) of a batch, in order.

        As `match_many`, the geometric test of the batch runs in one go, and
        an event with the topic and point of an earlier one copies its answer.
        """
        if not self._subs:
            return [{} for _ in events]
        found: list[dict[str, tuple[SubKey, ...]]] = []
        firsts, nodes = self._looked_up(events)
        for (topic, _), some in zip(events, nodes, strict=True):
            if not some:
                found.append({})
                continue
            world = self._world.get(topic)
            if world is None:
                world = self._world_groups(topic, some)
            found.append(dict(world))
        candidates = self._candidates(events, nodes)
        if candidates is None:
            for out, covering in zip(found, self._hits_dict(events, nodes), strict=True):
                if covering:
                    self._file(out, covering)
        else:
            self._file_pairs(found, candidates)
        for i, first in enumerate(firsts):
            if first != i:
                found[i] = dict(found[first])
        return found

    def _file(self, out: dict[str, tuple[SubKey, ...]], covering: list[int]) -> None:
        """Add an event's geofenced hits (slots) to its answer, sorted per group."""
        # Gathered with `map` (C loops); live slots have keys and groups.
        keys: list[SubKey] = list(map(self._parts.keys.__getitem__, covering))  # type: ignore[arg-type]
        slot_groups = self._parts.groups  # per slot: no look-up in a dict of every subscription
        groups: list[str] = list(map(slot_groups.__getitem__, covering))  # type: ignore[arg-type]
        hits: dict[str, list[SubKey]]
        if groups.count(groups[0]) == len(groups):  # one home: the usual case
            hits = {groups[0]: keys}
        else:
            hits = {}
            for group, key in zip(groups, keys, strict=True):
                hits.setdefault(group, []).append(key)
        for group, keys in hits.items():
            keys.sort()
            out[group] = out.get(group, ()) + tuple(keys)

    def _file_pairs(self, found: list[dict[str, tuple[SubKey, ...]]], cand: _Candidates) -> None:
        """`_file` for a batch from the cell array, its hits grouped in arrays.

        One `np.lexsort` by (event, group) and one gather of the batch's keys
        replace gathering and grouping ~20 keys per event in Python; each
        (event, group) run is then sorted as it is.
        """
        parts = self._parts
        for i, hits in enumerate(cand.out):  # points on the antimeridian, decided aside
            if hits:
                self._file(found[i], hits)
        point, slots = parts.covering_pairs(cand.point, cand.slots, cand.lons, cand.lats)
        if not len(slots):
            return
        groups = parts.numbers[slots]
        if groups.min() != groups.max():  # by point already (`covering_pairs`): by group too
            order = np.lexsort((groups, point))
            point, groups, slots = point[order], groups[order], slots[order]
        keys: list[SubKey] = list(map(parts.keys.__getitem__, slots.tolist()))  # type: ignore[arg-type]
        cut = np.flatnonzero((point[1:] != point[:-1]) | (groups[1:] != groups[:-1])) + 1
        starts = [0, *cut.tolist()]
        ends = [*starts[1:], len(keys)]
        events = [cand.at[k] for k in point[starts].tolist()]
        names = parts.group_names
        # A subscription with several parts may be found through each: its key repeats.
        unique = set if parts.multipart else list
        for i, group, start, end in zip(events, groups[starts].tolist(), starts, ends, strict=True):
            answer = found[i]
            name = names[group]
            answer[name] = answer.get(name, ()) + tuple(sorted(unique(keys[start:end])))

    def world_groups(self, topic: str) -> dict[str, tuple[SubKey, ...]]:
        """The world subscriptions matching `topic`: sorted keys per group (no empty groups).

        What `match_groups` starts each group's answer with, as the index
        caches it: the same tuples for every lookup of the topic until a
        world subscription or the trie changes (a delivery message's
        encoding of them is cached by that identity, `DeliveryMsg.world`).
        """
        world = self._world.get(topic)
        if world is None:
            nodes = self._nodes(topic) if self._subs else []
            world = self._world_groups(topic, nodes) if nodes else {}
        return world

    def _world_groups(self, topic: str, nodes: list[_TrieNode]) -> dict[str, tuple[SubKey, ...]]:
        """The world subscriptions matching `topic`, sorted keys by group (cached)."""
        if len(self._world) >= _TOPIC_CACHE:
            self._world.clear()
        found: dict[str, list[SubKey]] = {}
        groups = self._groups
        for node in nodes:
            for key in node.bucket.world:
                found.setdefault(groups[key], []).append(key)
        world = {group: tuple(sorted(keys)) for group, keys in found.items()}
        self._world[topic] = world
        return world

    def _looked_up(
        self, events: Sequence[tuple[str, LatLon]]
    ) -> tuple[list[int], list[list[_TrieNode]]]:
        """`_firsts` of a batch, and each event's trie nodes (none for a repeat)."""
        firsts = _firsts(events)
        return firsts, [
            self._nodes(topic) if first == i else []
            for i, ((topic, _), first) in enumerate(zip(events, firsts, strict=True))
        ]

    def _candidates(
        self, events: Sequence[tuple[str, LatLon]], nodes: list[list[_TrieNode]]
    ) -> _Candidates | None:
        """The geofence parts that may cover each event's point, found in the cell array.

        `nodes` holds each event's trie nodes (none: the event is not looked up).
        A batch of at least `array_batch` such events finds its candidates in
        the cell array (`_CellArray`, rebuilt here when it is missing or
        enough has changed), with the buckets changed since its build probed
        the dict way; None for a smaller batch (`_hits_dict` probes every
        bucket the dict way, and a lookup of one event sets up no arrays
        beyond the exact test's). A point on the antimeridian is decided here.
        """
        looked = [i for i, some in enumerate(nodes) if some]
        if len(looked) < self.array_batch:
            return None
        cells = self._cell_array()
        out: list[list[int]] = [[] for _ in events]
        at: list[int] = []  # events tested as one batch, by point
        lons: list[float] = []
        lats: list[float] = []
        probe_at: list[np.ndarray] = []  # per point: bucket idents (shifted) and levels to probe
        probe_levels: list[np.ndarray] = []
        probe_counts: list[int] = []
        slow: list[tuple[int, list[_SpatialBucket]]] = []  # (point, buckets probed the dict way)
        for i in looked:
            topic, location = events[i]
            lon, lat = location.lon, location.lat
            if abs(lon) == 180.0:
                out[i] = self._antimeridian(lon, lat, nodes[i])
                continue
            probes = self._probes_of(topic, nodes[i])
            probe_at.append(probes.high)
            probe_levels.append(probes.levels)
            probe_counts.append(len(probes.levels))
            if probes.dirty:
                slow.append((len(at), probes.dirty))
            at.append(i)
            lons.append(lon)
            lats.append(lat)
        xs, ys = np.array(lons), np.array(lats)
        grid = _point_cell_array(xs, ys)
        point, slots = cells.candidates(
            np.repeat(np.arange(len(at)), probe_counts),
            np.concatenate(probe_at) if at else _NONE,
            grid,
            np.concatenate(probe_levels) if at else _NONE,
        )
        if slow:
            extra_point: list[int] = []
            extra: list[int] = []
            for k, buckets in slow:
                before = len(extra)
                row = grid[k].tolist()
                for bucket in buckets:
                    bucket.cell_candidates(row, extra)
                extra_point.extend([k] * (len(extra) - before))
            point = np.concatenate([point, np.array(extra_point, dtype=np.intp)])
            slots = np.concatenate([slots, np.array(extra, dtype=np.intp)])
            order = np.argsort(point, kind="stable")  # by point, as `covering_pairs` takes them
            point, slots = point[order], slots[order]
        return _Candidates(out, at, point, slots, xs, ys)

    def _hits_dict(
        self, events: Sequence[tuple[str, LatLon]], nodes: list[list[_TrieNode]]
    ) -> list[list[int]]:
        """`_hits` of a batch too small for the cell array: each bucket probed the dict way."""
        out: list[list[int]] = [[] for _ in events]
        at: list[int] = []
        lons: list[float] = []
        lats: list[float] = []
        for i, some in enumerate(nodes):
            # Only buckets holding geofenced subscriptions are probed: a point
            # whose topic has none (world subscriptions only) needs no cells.
            if any(node.bucket.cells for node in some):
                lon, lat = events[i][1].lon, events[i][1].lat
                if abs(lon) == 180.0:
                    out[i] = self._antimeridian(lon, lat, some)
                else:
                    at.append(i)
                    lons.append(lon)
                    lats.append(lat)
        lists: list[list[int]] = []
        for i, row in zip(at, _point_cells(list(zip(lons, lats, strict=True))), strict=True):
            candidates: list[int] = []
            for node in nodes[i]:
                if node.bucket.cells:
                    node.bucket.cell_candidates(row, candidates)
            lists.append(candidates)
        for i, hit in zip(at, self._parts.covering(lists, lons, lats), strict=True):
            out[i] = hit
        return out

    def _antimeridian(self, lon: float, lat: float, nodes: list[_TrieNode]) -> list[int]:
        """`_hits` of a point on the antimeridian: -180 and 180 are one meridian, and a
        point there sits in two cells per level."""
        owners = self._parts.owners
        some: list[int] = []
        for row in _point_cells([(lon, lat), (-lon, lat)]):
            for node in nodes:
                if node.bucket.cells:
                    node.bucket.cell_candidates(row, some)
        first = {id(owners[s]): s for s in some}
        return [
            s
            for s in first.values()
            if (o := owners[s]) and o.geofence and o.geofence.covers_xy(lon, lat)
        ]

    def _hits(
        self, events: Sequence[tuple[str, LatLon]], nodes: list[list[_TrieNode]]
    ) -> list[list[int]]:
        """Per event, the slots of the geofence parts covering its point, one per subscription."""
        found = self._candidates(events, nodes)
        if found is None:
            return self._hits_dict(events, nodes)
        out = found.out
        parts = self._parts
        pairs = parts.covering_pairs(found.point, found.slots, found.lons, found.lats)
        for i, hit in zip(found.at, parts.per_point(*pairs, len(found.at)), strict=True):
            out[i] = hit
        return out

    def _cell_array(self) -> _CellArray:
        """The cell array, (re)built first if missing or if enough has changed since.

        Rebuilt once the changed geofenced subscriptions reach `rebuild_min` or
        a sixteenth of the index, whichever is more: a build sorts the cells of
        every slot (~70 ms of CPU at 100,000 subscriptions, on the lookup that
        triggers it), so its cost spread over the changes that called for it
        stays a few cells per change; until then the changed buckets (only
        they) are probed the dict way.
        """
        if self._cells is None or self._changed >= max(self.rebuild_min, len(self._subs) >> 4):
            self._cells = _CellArray(self._parts)
            self._dirty.clear()
            self._changed = 0
            self._probes.clear()
        return self._cells

    def _probes_of(self, topic: str, nodes: list[_TrieNode]) -> _Probes:
        """What a lookup of `topic` probes in the cell array, and the buckets it probes aside.

        Cached per topic. After a change that may outdate it (`_generation`),
        a cached plan is checked against the state of its buckets (cheap: ~4
        per topic) rather than all plans dropped at every such change.
        """
        probes = self._probes.get(topic)
        if probes is not None:
            if probes.generation == self._generation:
                return probes
            if probes.state == self._bucket_state(probes.buckets):
                probes.generation = self._generation
                return probes
        elif len(self._probes) >= _TOPIC_CACHE:
            self._probes.clear()
        buckets = [node.bucket for node in nodes]
        high: list[int] = []
        levels: list[int] = []
        dirty: list[_SpatialBucket] = []
        for bucket in buckets:
            if not bucket.cells:
                continue
            if bucket.ident in self._dirty:
                dirty.append(bucket)
                continue
            for level in bucket.levels:
                high.append(bucket.ident << _BUCKET_SHIFT)
                levels.append(level)
        probes = self._probes[topic] = _Probes(
            np.array(high, dtype=np.int64),
            np.array(levels, dtype=np.intp),
            dirty,
            buckets,
            self._bucket_state(buckets),
            self._generation,
        )
        return probes

    def _nodes(self, topic: str) -> list[_TrieNode]:
        """The trie nodes whose filter matches `topic`, each once (cached)."""
        nodes = self._topics.get(topic)
        if nodes is None:
            if len(self._topics) >= _TOPIC_CACHE:
                self._topics.clear()
                self._probes.clear()
            # dict.fromkeys: a topic holding a wildcard (invalid, but match() is
            # public) reaches a node twice, which would list its world subs twice.
            nodes = self._topics[topic] = list(dict.fromkeys(self._nodes_for(topic)))
        return nodes

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
