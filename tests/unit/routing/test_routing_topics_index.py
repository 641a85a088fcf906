"""Topic matching against the oracle, and the subscription index against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule
from routing_testkit import (
    TOPIC_LEVELS,
    filters,
    geofences,
    near,
    points,
    topics,
)

from geofed.routing import (
    Geofence,
    LatLon,
    Subscription,
    SubscriptionIndex,
    circle,
    latlon,
    parse_wkt,
    reference_topic_match,
    topic_matches,
    validate_filter,
    validate_topic,
)
from geofed.routing._model import content_and_subscription_geocheck, make_event

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


def test_index_basics() -> None:
    idx = SubscriptionIndex()
    paris = latlon(48.8566, 2.3522)
    s1 = Subscription("s1", "c", "a/+", circle(paris, 10_000))
    s2 = Subscription("s2", "c", "#", None)
    s3 = Subscription("s3", "c", "a/b", parse_wkt("POLYGON((100 0, 101 0, 101 1, 100 1, 100 0))"))
    for s in (s1, s2, s3):
        assert idx.add(s) is None
    assert len(idx) == 3 and "s1" in idx and idx.get("s3") is s3
    assert sorted(s.id for s in idx.match("a/b", paris)) == ["s1", "s2"]
    assert sorted(s.id for s in idx.match("a/b", latlon(0.5, 100.5))) == ["s2", "s3"]
    assert [s.id for s in idx.match("$SYS/a", paris)] == []
    # Replacing by id returns the old version and drops it from its old cell.
    s1b = Subscription("s1", "c", "x", None)
    assert idx.add(s1b) is s1
    assert sorted(s.id for s in idx.match("a/b", paris)) == ["s2"]
    assert idx.remove("s1") is s1b and idx.remove("s1") is None
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
    idx.remove("s")
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


@st.composite
def fences_near_a_few_points(draw: st.DrawFn) -> Geofence | None:
    """Geofences of every kind and size, often around the probe points below."""
    return draw(geofences(around=draw(st.one_of(st.none(), st.sampled_from(_PROBES)))))


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

    @rule(target=ids, sub_id=st.sampled_from([f"s{i}" for i in range(12)]))
    def new_id(self, sub_id: str) -> str:
        return sub_id

    @rule(sub_id=ids, topic_filter=filters(), fence=fences_near_a_few_points())
    def add(self, sub_id: str, topic_filter: str, fence: Geofence | None) -> None:
        # Adding an indexed id is an update (new filter and geofence).
        old = self.index.add(Subscription(sub_id, "c", topic_filter, fence))
        assert old is self.model.get(sub_id)
        self.model[sub_id] = self.index.get(sub_id)  # type: ignore[assignment]

    @rule(sub_id=consumes(ids))
    def remove(self, sub_id: str) -> None:
        assert self.index.remove(sub_id) is self.model.pop(sub_id, None)

    @rule(topic=topics(), where=_probe_points)
    def match(self, topic: str, where: LatLon) -> None:
        got = [s.id for s in self.index.match(topic, where)]
        assert len(got) == len(set(got))
        assert sorted(got) == _brute(self.model, topic, where)

    @invariant()
    def same_contents(self) -> None:
        assert len(self.index) == len(self.model)
        assert {s.id: s for s in self.index} == self.model


IndexMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
test_index_equals_brute_force = IndexMachine.TestCase


@settings(max_examples=60, deadline=None)
@given(
    subs=st.lists(st.tuples(filters(), fences_near_a_few_points()), min_size=1, max_size=40),
    probes=st.lists(st.tuples(topics(), _probe_points), min_size=1, max_size=30),
)
def test_index_equals_brute_force_on_bulk_loads(
    subs: list[tuple[str, Geofence | None]], probes: list[tuple[str, LatLon]]
) -> None:
    idx = SubscriptionIndex()
    model = {}
    for i, (f, fence) in enumerate(subs):
        s = Subscription(f"s{i}", "c", f, fence)
        idx.add(s)
        model[s.id] = s
    for topic, where in probes:
        assert sorted(s.id for s in idx.match(topic, where)) == _brute(model, topic, where)
