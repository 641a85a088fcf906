"""Filter schemes at the broker: how it matches events against its local subscriptions.

The last mile between a broker and its own subscribers (docs/design.md §14).
Routing between brokers is not touched: whatever reaches a subscriber's broker
is matched there by the broker's *filter scheme*:

* `Scheme.EXACT` — the match predicate of docs/design.md §1 on each
  subscription (the location-based scheme, LPS, of Richerzhagen et al., LCN
  2016). The default; recall and precision 1.
* `Scheme.GRID` — one H3 cell per subscription, the cell of its region of
  interest's *anchor*; an event passes when its publisher lies in that cell.
  Approximate both ways: recall and precision below 1.
* `Scheme.RGRID` — the H3 cells covering the subscription's region of
  interest (a conservative cover, `h3_cover`); an event passes when its
  publisher's cell is one of them. Recall 1, precision below 1.

**Region of interest** (ROI) of a subscription: its subscription geofence,
the area where publishers must be — a fixed geofence as given, a roaming one
placed where the broker last heard the subscriber. No geofence means no ROI:
such a subscription is one *world channel* per topic filter in every scheme,
matched on its topic alone (exactly). The **anchor** is the subscriber's
location for a roaming geofence (the centre it is placed around, the paper's
client position) and the geofence's representative point (a point inside it)
for a fixed one. **Resolution**: per subscription, the finest H3 resolution
whose average cell is at least as large as the ROI (the paper's grid has
cells about the size of the area of interest), at least `H3_RES_MIN`; when no
cover can be made there (the ROI reaches beyond 80° of latitude or 179° of
longitude, where planar and geodesic cell edges part), the RGRID entry is a
world channel (recall kept, precision lost).

**Event geofence** (where subscribers must be): under the grid schemes the
broker holds a subscriber's cell, not its point, so the Event GeoCheck
becomes "the subscriber's cell (at the event geofence's own resolution, by
the rule above) is in the cover of the event geofence" — never missing a
match. A cover that cannot be made passes every subscriber.

**Transitions** (`LastMile.transition`) change the scheme of every local
subscription at once: *state transfer* converts each entry from what the old
scheme holds, locally (EXACT → RGRID: the geofence's cover; EXACT → GRID and
RGRID → GRID: the anchor's cell). What the old scheme does not hold (GRID →
RGRID: the cover; GRID or RGRID → EXACT: the geofence) is *bootstrapped*:
from the broker's own routing state when the caller can give it (`recover`),
otherwise the client must send it again — until then a GRID → RGRID entry
keeps its one cell and a → EXACT entry matches nothing (`awaiting`).
Without state transfer every entry is dropped and every client has to
resubscribe (`awaiting` lists them all).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from ._geometry import Geofence, LatLon, covers
from ._h3cells import H3_MAX_CELLS, H3_RES_MIN, area_km2, h3_cell, h3_cover, resolution_for_area
from ._index import SubscriptionIndex
from ._model import Event, SubKey, Subscription, matches
from ._topics import topic_matches


class Scheme(StrEnum):
    """A broker's filter scheme for its local subscriptions."""

    EXACT = "exact"
    GRID = "grid"
    RGRID = "rgrid"


SCHEMES = tuple(s.value for s in Scheme)
"""The scheme names, as settings take them."""

COVER_CACHE_SIZE = 1024
"""Event geofence covers kept (least recently used goes first)."""


def parse_scheme(value: object, field_name: str = "filter_scheme") -> Scheme:
    """A scheme from its name; `InvalidInput` naming `field_name` otherwise."""
    from ._errors import InvalidInput

    try:
        return Scheme(str(value))
    except ValueError:
        raise InvalidInput(field_name, f"one of {', '.join(SCHEMES)}, got {value!r}") from None


def anchor(sub: Subscription) -> LatLon | None:
    """The point a GRID subscription is reduced to (None: no region of interest)."""
    if sub.geofence is None:
        return None
    if sub.roaming is not None and sub.at is not None:
        return sub.at
    p = sub.geofence.geometry.representative_point()
    return LatLon(float(p.y), float(p.x))


def roi_cells(fence: Geofence) -> tuple[int, frozenset[int] | None]:
    """``(resolution, cover)`` of a region of interest; cover None when none can be made."""
    res = resolution_for_area(area_km2(fence.geometry))
    while True:
        cells = h3_cover(fence.geometry, res, H3_MAX_CELLS)
        if cells is not None or res <= H3_RES_MIN:
            return res, None if cells is None else frozenset(cells)
        res -= 1  # too many cells at this resolution: coarser ones


@dataclass(frozen=True, slots=True)
class Entry:
    """One local subscription as a grid scheme holds it.

    Attributes:
        key: the subscription's key.
        topic_filter: its topic filter.
        res: H3 resolution of the ROI (the area rule); -1 for a world
            channel (no ROI).
        core: GRID's channel, the anchor's cell at `res`.
        cells: RGRID's channels, the ROI's cover; None when the scheme does
            not hold them (GRID) or none can be made (RGRID: a world channel).
        cells_res: the cover's resolution (coarser than `res` when the ROI
            needs too many cells at `res`).
    """

    key: SubKey
    topic_filter: str
    res: int = -1
    core: int = 0
    cells: frozenset[int] | None = None
    cells_res: int = -1

    @property
    def world(self) -> bool:
        """No region of interest: matched on the topic alone."""
        return self.res < 0

    def channels(self, scheme: Scheme) -> list[tuple[str, int, int]]:
        """The channels (topic filter, resolution, cell) this entry occupies under `scheme`."""
        if self.world or (scheme is Scheme.RGRID and self.cells is None):
            return [(self.topic_filter, -1, 0)]
        if scheme is Scheme.GRID:
            return [(self.topic_filter, self.res, self.core)]
        assert self.cells is not None
        return [(self.topic_filter, self.cells_res, c) for c in self.cells]


def entry_for(sub: Subscription, scheme: Scheme) -> Entry:
    """A subscription's entry under a grid scheme, from its full state."""
    point = anchor(sub)
    if sub.geofence is None or point is None:
        return Entry(sub.key, sub.topic_filter)
    res = resolution_for_area(area_km2(sub.geofence.geometry))
    core = h3_cell(point.lat, point.lon, res)
    if scheme is Scheme.RGRID:
        cells_res, cells = roi_cells(sub.geofence)
        return Entry(sub.key, sub.topic_filter, res, core, cells, cells_res)
    return Entry(sub.key, sub.topic_filter, res, core)


@dataclass
class SchemeStats:
    """Counters of one broker's last mile (the node exports them, docs/design.md §5).

    Precision is measured on every delivery (the exact predicate on the
    delivered pair: one check per delivery); recall on audited events (the
    exact matcher run beside the scheme on one event in `audit_every`).
    """

    events: int = 0
    match_operations: int = 0
    deliveries: int = 0
    false_deliveries: int = 0
    audited_events: int = 0
    audited_matches: int = 0
    audited_delivered: int = 0
    transitions: Counter[tuple[str, str]] = field(default_factory=Counter)
    recovered: int = 0
    awaiting: int = 0

    @property
    def precision(self) -> float:
        """Deliveries the exact predicate confirms, over all deliveries (1 when none)."""
        return 1.0 - self.false_deliveries / self.deliveries if self.deliveries else 1.0

    @property
    def recall(self) -> float:
        """Exact matches of audited events that were delivered (1 when none)."""
        return self.audited_delivered / self.audited_matches if self.audited_matches else 1.0


@dataclass(frozen=True)
class TransitionReport:
    """What a transition did.

    Attributes:
        source, target: the schemes.
        state_transfer: whether state was converted (False: dropped).
        transferred: entries converted from the old scheme's state alone.
        recovered: entries whose missing state the broker recovered itself.
        awaiting: subscriptions whose state only their client can give again
            (bootstrap round trip, or a resubscription without state transfer).
    """

    source: Scheme
    target: Scheme
    state_transfer: bool
    transferred: int
    recovered: int
    awaiting: tuple[SubKey, ...]


Recover = Callable[[SubKey], Subscription | None]
"""The broker's own full copy of a subscription, if it has one."""


class LastMile:
    """The filter scheme of one broker and its state for the local subscriptions.

    Args:
        scheme: the initial scheme.
        exact: the EXACT scheme's state, an index of full subscriptions. A
            broker passes its routing table's local index (kept anyway for
            routing, and maintained by it: this class then never changes
            it); without one the class keeps its own, and drops it on leaving
            EXACT (the paper's broker, which keeps only its scheme's state).
    """

    def __init__(self, scheme: Scheme = Scheme.EXACT, exact: SubscriptionIndex | None = None):
        self.scheme = scheme
        self._owns_exact = exact is None
        self._exact = SubscriptionIndex() if exact is None else exact
        self._entries: dict[SubKey, Entry] = {}
        self._topics = SubscriptionIndex()  # entries by topic filter (no geofence)
        self._channels: Counter[tuple[str, int, int]] = Counter()
        self._covers: OrderedDict[bytes, tuple[int, frozenset[int] | None]] = OrderedDict()
        self.awaiting: set[SubKey] = set()
        self.stats = SchemeStats()

    # -- state -------------------------------------------------------------

    @property
    def complexity(self) -> int:
        """Filter complexity: entries an event is matched against (subscriptions or channels).

        EXACT: one per subscription; GRID and RGRID: the distinct channels
        (topic filter, cell), world channels counted once per topic filter.
        """
        if self.scheme is Scheme.EXACT:
            return len(self._exact)
        return len(self._channels)

    def __len__(self) -> int:
        """Subscriptions the scheme holds (awaiting ones not counted)."""
        return len(self._exact) if self.scheme is Scheme.EXACT else len(self._entries)

    def add(self, sub: Subscription) -> None:
        """A subscription's full state arrived (subscribe, move, or a client's bootstrap answer)."""
        self.awaiting.discard(sub.key)
        if self.scheme is Scheme.EXACT:
            if self._owns_exact:
                self._exact.add(sub)
            return
        self._put(entry_for(sub, self.scheme))

    def remove(self, key: SubKey) -> None:
        """The subscription is gone."""
        self.awaiting.discard(key)
        if self._owns_exact:
            self._exact.remove(key)
        self._drop(key)

    def entry(self, key: SubKey) -> Entry | None:
        """The grid entry of a subscription (None under EXACT or when not held)."""
        return self._entries.get(key)

    def _put(self, e: Entry) -> None:
        self._drop(e.key)
        self._entries[e.key] = e
        self._topics.add(Subscription(e.key[1], e.key[0], e.topic_filter))
        self._channels.update(e.channels(self.scheme))

    def _drop(self, key: SubKey) -> None:
        old = self._entries.pop(key, None)
        if old is None:
            return
        self._topics.remove(key)
        self._channels.subtract(old.channels(self.scheme))
        self._channels += Counter()  # drop zero counts

    # -- matching ----------------------------------------------------------

    def match(self, event: Event, where: Callable[[str], LatLon | None]) -> list[SubKey]:
        """Keys of the local subscriptions the scheme delivers `event` to, in no set order.

        `where` gives a subscriber's location as the broker knows it (None:
        no session, nothing delivered). The broker orders its deliveries
        itself (`BrokerState._match_local`): sorting here too would be a
        second sort of every local match on the publish path.
        """
        return self.match_many([event], where)[0]

    def match_many(
        self, events: Sequence[Event], where: Callable[[str], LatLon | None]
    ) -> list[list[SubKey]]:
        """`match` for each event of a batch, in order (the index tests the batch in one go)."""
        self.stats.events += len(events)
        self.stats.match_operations += self.complexity * len(events)
        points = [(event.topic, event.location) for event in events]
        out: list[list[SubKey]] = []
        if self.scheme is Scheme.EXACT:
            for event, found in zip(events, self._exact.match_many(points), strict=True):
                keys = []
                for sub in found:
                    at = where(sub.client)
                    if at is not None and covers(event.geofence, at):
                        keys.append(sub.key)
                out.append(keys)
            return out
        for event, found in zip(events, self._topics.match_many(points), strict=True):
            cells: dict[int, int] = {}
            keys = []
            for topic_only in found:
                e = self._entries[topic_only.key]
                at = where(e.key[0])
                if at is not None and self._passes(e, event, at, cells):
                    keys.append(e.key)
            out.append(keys)
        return out

    def accepts(self, event: Event, key: SubKey, at: LatLon) -> bool:
        """Whether the scheme delivers `event` to subscription `key`, its subscriber at `at`."""
        if self.scheme is Scheme.EXACT:
            sub = self._exact.get(key)
            return sub is not None and matches(event, sub, at)
        e = self._entries.get(key)
        return (
            e is not None
            and topic_matches(e.topic_filter, event.topic)
            and self._passes(e, event, at, {})
        )

    def _passes(self, e: Entry, event: Event, at: LatLon, cells: dict[int, int]) -> bool:
        if not e.world and not (self.scheme is Scheme.RGRID and e.cells is None):
            res = e.res if self.scheme is Scheme.GRID else e.cells_res
            cell = cells.get(res)
            if cell is None:
                cell = cells[res] = h3_cell(event.location.lat, event.location.lon, res)
            if self.scheme is Scheme.GRID:
                if cell != e.core:
                    return False
            elif e.cells is not None and cell not in e.cells:
                return False
        return self._event_side(event.geofence, at)

    def _event_side(self, fence: Geofence | None, at: LatLon) -> bool:
        """The Event GeoCheck on the subscriber's cell: the cover of the event geofence."""
        if fence is None:
            return True
        got = self._covers.get(fence.key)
        if got is None:
            got = self._covers[fence.key] = roi_cells(fence)
            if len(self._covers) > COVER_CACHE_SIZE:
                self._covers.popitem(last=False)
        else:
            self._covers.move_to_end(fence.key)
        res, cells = got
        return cells is None or h3_cell(at.lat, at.lon, res) in cells

    def observe(
        self, delivered: Iterable[SubKey], false: int, exact: Iterable[SubKey] | None
    ) -> None:
        """Count one matched event's deliveries: `false` of them the exact predicate denies;
        `exact` (audited events only) the keys the exact predicate matches."""
        got = set(delivered)
        self.stats.deliveries += len(got)
        self.stats.false_deliveries += false
        if exact is not None:
            want = set(exact)
            self.stats.audited_events += 1
            self.stats.audited_matches += len(want)
            self.stats.audited_delivered += len(want & got)

    # -- transitions -------------------------------------------------------

    def keys(self) -> set[SubKey]:
        """Every subscription the scheme holds or awaits."""
        held = {s.key for s in self._exact} if self.scheme is Scheme.EXACT else set(self._entries)
        return held | self.awaiting

    def transition(
        self, target: Scheme, *, state_transfer: bool = True, recover: Recover | None = None
    ) -> TransitionReport:
        """Switch every local subscription to `target` (notifications wait meanwhile: the
        caller runs this between two matches, so each event sees one scheme).

        With `state_transfer`, entries are converted locally and missing state
        is bootstrapped from `recover` when it has the subscription, else
        awaited from the client (`add` brings it). Without, all state is
        dropped and every subscription awaits its client's resubscription.
        """
        source = self.scheme
        if target is source:
            return TransitionReport(source, target, state_transfer, 0, 0, ())
        keys = sorted(self.keys())
        old_exact = {k: s for k in keys if (s := self._exact.get(k)) is not None}
        old_entries = dict(self._entries)
        self.stats.transitions[(source.value, target.value)] += 1
        # Leave the old scheme: its state goes (the shared EXACT index is the broker's).
        if self._owns_exact:
            for k in list(old_exact):
                self._exact.remove(k)
        for k in list(self._entries):
            self._drop(k)
        self.scheme = target
        if not state_transfer:
            self.awaiting = set(keys)
            self.stats.awaiting += len(keys)
            return TransitionReport(source, target, False, 0, 0, tuple(keys))
        transferred = recovered = 0
        awaiting: list[SubKey] = []
        for k in keys:
            sub = old_exact.get(k) if source is Scheme.EXACT else None
            e = old_entries.get(k)
            if sub is not None:  # EXACT -> grid: everything is here
                self._put(entry_for(sub, target))
                transferred += 1
                continue
            if e is not None and (e.world or target is Scheme.GRID):
                # World channels carry over as they are; RGRID -> GRID keeps the core cell.
                if target is Scheme.EXACT:
                    if self._owns_exact:
                        self._exact.add(Subscription(k[1], k[0], e.topic_filter))
                else:
                    self._put(Entry(k, e.topic_filter, e.res, e.core))
                transferred += 1
                continue
            full = recover(k) if recover is not None else None
            if full is not None:  # bootstrap from the broker's own state
                if target is Scheme.EXACT:
                    if self._owns_exact:
                        self._exact.add(full)
                else:
                    self._put(entry_for(full, target))
                recovered += 1
                continue
            # Only the client has it: GRID -> RGRID keeps its one cell meanwhile.
            if e is not None and target is Scheme.RGRID:
                self._put(Entry(k, e.topic_filter, e.res, e.core, frozenset({e.core}), e.res))
            awaiting.append(k)
        self.awaiting = set(awaiting)
        self.stats.recovered += recovered
        self.stats.awaiting += len(awaiting)
        return TransitionReport(source, target, True, transferred, recovered, tuple(awaiting))


HYSTERESIS = 0.1
"""A load-triggered switch back waits until the load is this share below its threshold."""


def scheme_for_load(
    current: Scheme, subscriptions: int, base: Scheme, rgrid_at: int, grid_at: int
) -> Scheme:
    """The scheme for a broker holding `subscriptions` local subscriptions (the paper's rule).

    At least `grid_at` (0: never): GRID; at least `rgrid_at` (0: never):
    RGRID; else `base`. A switch to a cheaper scheme happens at the threshold,
    one back only below (1 - `HYSTERESIS`) of it, so that a load hovering at
    a threshold does not flap.
    """

    def level(n: float) -> Scheme:
        if grid_at and n >= grid_at:
            return Scheme.GRID
        if rgrid_at and n >= rgrid_at:
            return Scheme.RGRID
        return base

    rank = {base: 0, Scheme.RGRID: 1, Scheme.GRID: 2}
    up = level(subscriptions)
    if rank.get(up, 0) >= rank.get(current, 0):
        return up
    down = level(subscriptions / (1.0 - HYSTERESIS))
    return down if rank.get(down, 0) < rank.get(current, 0) else current
