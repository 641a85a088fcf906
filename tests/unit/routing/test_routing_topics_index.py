"""Topic matching against the oracle, and the subscription index against brute force."""

from __future__ import annotations

import math

import pytest
import shapely
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from routing_testkit import (
    TOPIC_LEVELS,
    circles,
    filters,
    geofences,
    near,
    points,
    stars,
    topics,
)

from geofed.routing import (
    Geofence,
    LatLon,
    Subscription,
    SubscriptionIndex,
    circle,
    content_and_subscription_geocheck,
    latlon,
    make_event,
    parse_wkt,
    reference_topic_match,
    topic_matches,
    validate_filter,
    validate_topic,
)
from geofed.routing._index import _VECTOR_MIN, _point_cells, part_discs

# --------------------------------------------------------------------------
# Topic matching


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+", "a", False),
        ("a/#", "a", True),  # '#' also matches the parent level
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+", "a", True),
        ("+", "", True),  # an empty topic level is a level
        ("+/+", "/", True),
        ("/+", "/a", True),
        ("a//b", "a//b", True),
        ("a/+/b", "a//b", True),
        ("#", "$SYS/x", False),  # no leading wildcard for '$' topics
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("$SYS/+", "$SYS/x", True),
        ("a/$x", "a/$x", True),
        ("+/$x", "a/$x", True),
        ("A", "a", False),  # case-sensitive
    ],
)
def test_topic_matches_known_answers(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected
    assert reference_topic_match(topic_filter, topic) is expected


_levels_with_wildcards = st.one_of(TOPIC_LEVELS, st.sampled_from(["+", "#", "a+", "#b"]))


@settings(max_examples=2000, deadline=None)
@given(
    topic_filter=st.lists(_levels_with_wildcards, min_size=1, max_size=5).map("/".join),
    topic=st.lists(TOPIC_LEVELS, min_size=1, max_size=5).map("/".join),
)
def test_topic_matches_equals_the_oracle(topic_filter: str, topic: str) -> None:
    try:
        validate_filter(topic_filter)
        validate_topic(topic)
    except ValueError:
        return  # only valid pairs are ever matched
    assert topic_matches(topic_filter, topic) == reference_topic_match(topic_filter, topic)


@settings(max_examples=300, deadline=None)
@given(topic_filter=filters(), topic=topics())
def test_generated_filters_are_valid(topic_filter: str, topic: str) -> None:
    assert validate_filter(topic_filter) == topic_filter
    assert validate_topic(topic) == topic


# --------------------------------------------------------------------------
# Subscription index vs brute force


def _brute(subs: dict[str, Subscription], topic: str, where: LatLon) -> list[str]:
    event = make_event("e", topic, where)
    return sorted(s.id for s in subs.values() if content_and_subscription_geocheck(event, s))


def _brute_groups(
    subs: dict[str, Subscription], groups: dict[str, str], topic: str, where: LatLon
) -> dict[str, tuple[tuple[str, str], ...]]:
    """What `match_groups` answers: per group, world keys sorted, then geofenced ones sorted."""
    out: dict[str, list[tuple[str, str]]] = {}
    for world in (True, False):
        hits: dict[str, list[tuple[str, str]]] = {}
        for sub_id in _brute(subs, topic, where):
            sub = subs[sub_id]
            if (sub.geofence is None) == world:
                hits.setdefault(groups[sub_id], []).append(sub.key)
        for group, keys in hits.items():
            out.setdefault(group, []).extend(sorted(keys))
    return {group: tuple(keys) for group, keys in out.items()}


def _brute_world(
    subs: dict[str, Subscription], groups: dict[str, str], topic: str
) -> dict[str, tuple[tuple[str, str], ...]]:
    """What `world_groups` answers: per group, the matching world subscriptions' keys sorted."""
    out: dict[str, list[tuple[str, str]]] = {}
    for sub in subs.values():
        if sub.geofence is None and topic_matches(sub.topic_filter, topic):
            out.setdefault(groups[sub.id], []).append(sub.key)
    return {group: tuple(sorted(keys)) for group, keys in out.items()}


def test_index_basics() -> None:
    idx = SubscriptionIndex()
    paris = latlon(48.8566, 2.3522)
    s1 = Subscription("s1", "c", "a/+", circle(paris, 10_000))
    s2 = Subscription("s2", "c", "#", None)
    s3 = Subscription("s3", "c", "a/b", parse_wkt("POLYGON((100 0, 101 0, 101 1, 100 1, 100 0))"))
    for s in (s1, s2, s3):
        assert idx.add(s) is None
    assert len(idx) == 3 and ("c", "s1") in idx and idx.get(("c", "s3")) is s3
    assert ("other", "s1") not in idx  # ids are scoped by client
    assert sorted(s.id for s in idx.match("a/b", paris)) == ["s1", "s2"]
    assert sorted(s.id for s in idx.match("a/b", latlon(0.5, 100.5))) == ["s2", "s3"]
    assert [s.id for s in idx.match("$SYS/a", paris)] == []
    # Replacing by id returns the old version and drops it from its old cell.
    s1b = Subscription("s1", "c", "x", None)
    assert idx.add(s1b) is s1
    assert sorted(s.id for s in idx.match("a/b", paris)) == ["s2"]
    assert idx.remove(("c", "s1")) is s1b and idx.remove(("c", "s1")) is None
    assert sorted(s.id for s in idx) == ["s2", "s3"]


def test_index_lists_each_subscription_once_even_for_wildcard_topics() -> None:
    # match() is public: a topic holding '+' or '#' (invalid as a topic name)
    # reaches some trie nodes twice; their subscriptions must not repeat.
    idx = SubscriptionIndex()
    idx.add(Subscription("w", "c", "a/+/#", None))
    idx.add(Subscription("g", "c", "a/+/#", parse_wkt("POLYGON((0 0, 1 0, 1 1, 0 1, 0 0))")))
    idx.add(Subscription("p", "c", "+", None))
    for topic in ("a/+", "a/#", "a/+/#"):
        assert sorted(s.id for s in idx.match(topic, latlon(0.5, 0.5))) == ["g", "w"]
    assert [s.id for s in idx.match("+", latlon(0.5, 0.5))] == ["p"]


def test_index_prunes_empty_branches() -> None:
    idx = SubscriptionIndex()
    idx.add(Subscription("s", "c", "a/b/c/d", parse_wkt("POLYGON((0 0, 1 0, 1 1, 0 1, 0 0))")))
    idx.remove(("c", "s"))
    assert idx._root.children == {} and not idx._root.bucket


def test_index_matches_on_both_sides_of_the_antimeridian() -> None:
    idx = SubscriptionIndex()
    east = parse_wkt("POLYGON((179 0, 180 0, 180 1, 179 1, 179 0))")
    west = parse_wkt("POLYGON((-180 0, -179 0, -179 1, -180 1, -180 0))")
    idx.add(Subscription("east", "c", "t", east))
    idx.add(Subscription("west", "c", "t", west))
    for lon in (180.0, -180.0):
        assert sorted(s.id for s in idx.match("t", latlon(0.5, lon))) == ["east", "west"]
    assert [s.id for s in idx.match("t", latlon(0.5, 179.5))] == ["east"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.floats(-180.0, 180.0), st.sampled_from([-180.0, -90.0, 0.0, 45.0, 180.0])),
            st.one_of(st.floats(-90.0, 90.0), st.sampled_from([-90.0, -45.0, 0.0, 90.0])),
        ),
        min_size=1,
        max_size=3 * _VECTOR_MIN,
    )
)
def test_point_cells_of_a_batch_equal_each_points_own(points: list[tuple[float, float]]) -> None:
    # The array path (a batch of _VECTOR_MIN points or more) must find the very
    # cells the scalar one does, on cell edges too.
    batch = points + [(0.0, 0.0)] * _VECTOR_MIN
    assert _point_cells(batch)[: len(points)] == [_point_cells([p])[0] for p in points]


def test_index_batch_repeats_get_their_own_answers() -> None:
    idx = SubscriptionIndex()
    paris = latlon(48.8566, 2.3522)
    idx.add(Subscription("world", "c", "t/#", None), "east")
    idx.add(Subscription("near", "c", "t/+", circle(paris, 10_000)), "west")
    batch = [("t/a", paris), ("t/b", paris), ("t/a", paris)]
    found = idx.match_many(batch)
    assert [sorted(s.id for s in f) for f in found] == [["near", "world"]] * 3
    assert found[0] is not found[2]
    grouped = idx.match_groups_many(batch)
    assert grouped == [{"east": (("c", "world"),), "west": (("c", "near"),)}] * 3
    grouped[0]["east"] = ()  # a caller's change stays in its answer
    assert grouped[2]["east"] == (("c", "world"),)


@st.composite
def fences_near_a_few_points(draw: st.DrawFn) -> Geofence | None:
    """Geofences of every kind and size, often around the probe points below."""
    return draw(geofences(around=draw(st.one_of(st.none(), st.sampled_from(_PROBES)))))


_NEVER = 10**9  # an `array_batch` or `rebuild_min` no test reaches

_PROBES = [
    latlon(48.8566, 2.3522),
    latlon(0.0, 180.0),
    latlon(0.0, -180.0),
    latlon(90.0, 0.0),
    latlon(-33.9, 151.2),
    latlon(10.0, 0.0),
]
_probe_points = st.one_of(
    points, st.sampled_from(_PROBES), st.sampled_from(_PROBES).flatmap(lambda p: near(p, 5e5))
)


class IndexMachine(RuleBasedStateMachine):
    """Random add / replace / remove sequences; every lookup equals brute force."""

    ids = Bundle("ids")

    def __init__(self) -> None:
        super().__init__()
        self.index = SubscriptionIndex()
        self.model: dict[str, Subscription] = {}
        self.groups: dict[str, str] = {}

    @rule(target=ids, sub_id=st.sampled_from([f"s{i}" for i in range(12)]))
    def new_id(self, sub_id: str) -> str:
        return sub_id

    @rule(
        sub_id=ids,
        topic_filter=filters(),
        fence=fences_near_a_few_points(),
        group=st.sampled_from(["", "east", "west"]),
    )
    def add(self, sub_id: str, topic_filter: str, fence: Geofence | None, group: str) -> None:
        # Adding an indexed id is an update (new filter, geofence and group).
        old = self.index.add(Subscription(sub_id, "c", topic_filter, fence), group)
        assert old is self.model.get(sub_id)
        self.model[sub_id] = self.index.get(("c", sub_id))  # type: ignore[assignment]
        self.groups[sub_id] = group

    @rule(sub_id=consumes(ids))
    def remove(self, sub_id: str) -> None:
        assert self.index.remove(("c", sub_id)) is self.model.pop(sub_id, None)
        self.groups.pop(sub_id, None)

    @rule(topic=topics(), where=_probe_points)
    def match(self, topic: str, where: LatLon) -> None:
        got = [s.id for s in self.index.match(topic, where)]
        assert len(got) == len(set(got))
        assert sorted(got) == _brute(self.model, topic, where)
        # Twice: the second lookup of a topic answers from the caches.
        for _ in range(2):
            grouped = self.index.match_groups(topic, where)
            assert grouped == _brute_groups(self.model, self.groups, topic, where)
        # Each group's answer starts with the topic's world block, the same tuple
        # while nothing changes (a delivery's encoding of it is cached by identity).
        world = self.index.world_groups(topic)
        assert world == _brute_world(self.model, self.groups, topic)
        for group, keys in world.items():
            assert tuple(grouped[group][: len(keys)]) == keys
            assert self.index.world_groups(topic)[group] is keys

    @rule(
        array_batch=st.sampled_from([1, 4, _NEVER]),
        rebuild_min=st.sampled_from([0, 2, _NEVER]),
    )
    def tune(self, array_batch: int, rebuild_min: int) -> None:
        # From which batch size lookups take the cell array, and how many changes
        # rebuild it: 1 and 0 take it for every lookup, rebuilt each time; 2 leaves
        # changed buckets to the dict way for a while; _NEVER keeps to one way.
        self.index.array_batch = array_batch
        self.index.rebuild_min = rebuild_min

    @rule(probes=st.lists(st.tuples(topics(), _probe_points), max_size=12))
    def match_batch(self, probes: list[tuple[str, LatLon]]) -> None:
        # A batch is tested in one go (`_PartStore.covering`): each answer as alone,
        # and repeated (topic, point) pairs copy the first answer.
        probes = probes + probes[::2]
        found = self.index.match_many(probes)
        grouped = self.index.match_groups_many(probes)
        assert len(found) == len(grouped) == len(probes)
        for (topic, where), subs, groups in zip(probes, found, grouped, strict=True):
            got = [s.id for s in subs]
            assert len(got) == len(set(got))
            assert sorted(got) == _brute(self.model, topic, where)
            assert groups == _brute_groups(self.model, self.groups, topic, where)

    @invariant()
    def same_contents(self) -> None:
        assert len(self.index) == len(self.model)
        assert {s.id: s for s in self.index} == self.model


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_index_equals_brute_force = IndexMachine.TestCase


@settings(max_examples=80, deadline=None)
@given(
    subs=st.lists(st.tuples(filters(), fences_near_a_few_points()), min_size=1, max_size=40),
    probes=st.lists(st.tuples(topics(), _probe_points), min_size=1, max_size=30),
    array_batch=st.sampled_from([1, 8, _NEVER]),
)
def test_index_equals_brute_force_on_bulk_loads(
    subs: list[tuple[str, Geofence | None]], probes: list[tuple[str, LatLon]], array_batch: int
) -> None:
    idx = SubscriptionIndex()
    idx.array_batch = array_batch
    model = {}
    groups = {}
    for i, (f, fence) in enumerate(subs):
        s = Subscription(f"s{i}", "c", f, fence)
        groups[s.id] = "east" if i % 3 else "west"
        idx.add(s, groups[s.id])
        model[s.id] = s
    for topic, where in probes:
        assert sorted(s.id for s in idx.match(topic, where)) == _brute(model, topic, where)
        assert idx.match_groups(topic, where) == _brute_groups(model, groups, topic, where)
    # The same probes as one batch.
    for (topic, where), found, grouped in zip(
        probes, idx.match_many(probes), idx.match_groups_many(probes), strict=True
    ):
        assert sorted(s.id for s in found) == _brute(model, topic, where)
        assert grouped == _brute_groups(model, groups, topic, where)


_churn = st.lists(
    st.tuples(
        st.integers(0, 29),  # which subscription
        st.one_of(st.none(), st.tuples(filters(), fences_near_a_few_points())),  # None: remove
        st.sampled_from(["east", "west", "north"]),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=100, deadline=None)
@given(
    subs=st.lists(
        st.tuples(filters(), fences_near_a_few_points(), st.sampled_from(["east", "west"])),
        min_size=1,
        max_size=30,
    ),
    churn=_churn,
    probes=st.lists(st.tuples(topics(), _probe_points), min_size=1, max_size=20),
    rebuild_min=st.sampled_from([0, 1, 3, _NEVER]),
)
def test_cell_array_stays_exact_under_churn(
    subs: list[tuple[str, Geofence | None, str]],
    churn: list[tuple[int, tuple[str, Geofence | None] | None, str]],
    probes: list[tuple[str, LatLon]],
    rebuild_min: int,
) -> None:
    # One index answers every batch from its cell array (rebuilt after
    # `rebuild_min` changes, the buckets changed since probed the dict way, hits
    # added since filed without their rank); the other never builds one. Both
    # equal brute force after every change.
    fast, plain = SubscriptionIndex(), SubscriptionIndex()
    fast.array_batch, fast.rebuild_min, plain.array_batch = 1, rebuild_min, _NEVER
    model: dict[str, Subscription] = {}
    groups: dict[str, str] = {}

    def put(i: int, topic_filter: str, fence: Geofence | None, group: str) -> None:
        sub = Subscription(f"s{i}", f"c{i % 4}", topic_filter, fence)
        for idx in (fast, plain):
            idx.add(sub, group)
        model[sub.id], groups[sub.id] = sub, group

    def check() -> None:
        grouped = fast.match_groups_many(probes)
        assert grouped == plain.match_groups_many(probes)
        found = fast.match_many(probes)
        for (topic, where), got, matched in zip(probes, grouped, found, strict=True):
            assert got == _brute_groups(model, groups, topic, where)
            assert sorted(s.id for s in matched) == _brute(model, topic, where)

    for i, (topic_filter, fence, group) in enumerate(subs):
        put(i, topic_filter, fence, group)
    check()
    assert plain._cells is None  # never built: the dict way throughout
    for i, change, group in churn:
        if change is None:
            for idx in (fast, plain):
                idx.remove((f"c{i % 4}", f"s{i}"))
            model.pop(f"s{i}", None)
            groups.pop(f"s{i}", None)
        else:
            put(i, *change, group)
        check()


def _square(lon: float, lat: float, size: float = 1.0) -> Geofence:
    return parse_wkt(
        f"POLYGON(({lon} {lat}, {lon + size} {lat}, {lon + size} {lat + size},"
        f" {lon} {lat + size}, {lon} {lat}))"
    )


def test_cell_array_is_rebuilt_after_enough_changes() -> None:
    idx = SubscriptionIndex()
    idx.array_batch, idx.rebuild_min = 1, 3
    for i in range(4):
        idx.add(Subscription(f"s{i}", "c", f"t/{i}", _square(i, 0.0)), "east")
    probe = [("t/1", latlon(0.5, 1.5))]
    assert idx.match_groups_many(probe) == [{"east": (("c", "s1"),)}]
    built = idx._cells
    assert built is not None
    # Two changes: the array stays, the changed buckets are probed the dict way.
    idx.add(Subscription("new", "c", "t/1", _square(1.0, 0.0)), "west")
    idx.remove(("c", "s1"))
    assert idx.match_groups_many(probe) == [{"west": (("c", "new"),)}]
    assert idx._cells is built
    idx.add(Subscription("s1", "c", "t/1", _square(1.0, 0.0)), "east")  # the third
    assert idx.match_groups_many(probe) == [{"east": (("c", "s1"),), "west": (("c", "new"),)}]
    assert idx._cells is not built


# --------------------------------------------------------------------------
# The exact check's disc pre-test (decides most candidates without GEOS)


def _frame_point(part_disc: tuple[float, ...], r: float, angle: float) -> tuple[float, float]:
    cx, cy, k = part_disc[:3]
    return cx + r * math.cos(angle) / k, cy + r * math.sin(angle)


@settings(max_examples=300, deadline=None)
@given(
    fence=st.one_of(circles(), stars(), geofences(around=latlon(48.85, 2.35))).filter(
        lambda f: f is not None
    ),
    angle=st.floats(0.0, 2 * math.pi),
    scale=st.sampled_from([0.0, 0.5, 1.0 - 1e-9, 1.0, 1.0 + 1e-9, 1.5]),
)
def test_part_discs_never_decide_wrongly(fence: Geofence, angle: float, scale: float) -> None:
    for part in fence.parts:
        disc = part_discs(part)
        cx, cy, k, inner2, outer2 = disc
        if k == 0.0:
            continue  # near a pole: no discs, GEOS decides every candidate
        for r in (math.sqrt(max(inner2, 0.0)), math.sqrt(outer2)):
            lon, lat = _frame_point(disc, r * scale, angle)
            if not (-180.0 <= lon <= 180.0 and -90.0 <= lat <= 90.0):
                continue
            d2 = ((lon - cx) * k) ** 2 + (lat - cy) ** 2
            covered = bool(shapely.intersects_xy(part, lon, lat))
            if d2 < inner2:
                assert covered, (part.wkt, lon, lat)
            if d2 > outer2:
                assert not covered, (part.wkt, lon, lat)


@st.composite
def near_an_edge(draw: st.DrawFn, fence: Geofence) -> LatLon:
    """A vertex, a point on an edge, or one a hair inside or outside it."""
    part = draw(st.sampled_from(list(fence.parts)))
    ring = list(part.exterior.coords)
    i = draw(st.integers(0, len(ring) - 2))
    (ax, ay), (bx, by) = ring[i], ring[i + 1]
    t = draw(st.one_of(st.sampled_from([0.0, 0.5]), st.floats(0.0, 1.0)))
    off = draw(st.sampled_from([0.0, 1e-12, -1e-12, 1e-9, -1e-9, 1e-6, -1e-6, 1e-3, -1e-3]))
    length = math.hypot(bx - ax, by - ay) or 1.0
    lon = ax + t * (bx - ax) - off * (by - ay) / length
    lat = ay + t * (by - ay) + off * (bx - ax) / length
    return latlon(min(90.0, max(-90.0, lat)), min(180.0, max(-180.0, lon)))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), copies=st.sampled_from([1, 3, 12]))
def test_index_equals_covers_on_and_near_the_boundary(data: st.DataObject, copies: int) -> None:
    # copies: few candidates take the per-candidate path, many the array path.
    fence = data.draw(st.one_of(circles(), stars(), geofences()).filter(lambda f: f is not None))
    idx = SubscriptionIndex()
    for i in range(copies):
        idx.add(Subscription(f"s{i}", "c", "t", fence))
    points = [data.draw(near_an_edge(fence)) for _ in range(5)]
    for where in points:
        got = sorted(s.id for s in idx.match("t", where))
        expected = [f"s{i}" for i in range(copies)] if fence.covers(where) else []
        assert got == sorted(expected), (fence.wkt, where)
    # As one batch: with 3 copies the batch takes the array path, one point alone does not.
    for where, found in zip(points, idx.match_many([("t", p) for p in points]), strict=True):
        expected = [f"s{i}" for i in range(copies)] if fence.covers(where) else []
        assert sorted(s.id for s in found) == sorted(expected), (fence.wkt, where)


def test_cell_array_sees_a_bucket_that_gains_its_first_geofence() -> None:
    # The topic's probes were planned while one of its buckets held only a world
    # subscription (no cells, so not in the array): its first geofence must count.
    idx = SubscriptionIndex()
    idx.array_batch, idx.rebuild_min = 1, _NEVER
    idx.add(Subscription("a", "c", "t/+", _square(0.0, 0.0)))
    idx.add(Subscription("w", "c", "t/x", None))
    probe = [("t/x", latlon(0.5, 0.5))]
    assert idx.match_groups_many(probe) == [{"": (("c", "w"), ("c", "a"))}]
    idx.add(Subscription("b", "c", "t/x", _square(0.0, 0.0)))
    assert idx.match_groups_many(probe) == [{"": (("c", "w"), ("c", "a"), ("c", "b"))}]
