"""Filter schemes at the broker (routing/_schemes.py) against the exact predicate.

EXACT must equal a brute-force matcher; RGRID must never lose a match (recall
1); the filter complexity must count subscriptions (EXACT) or distinct channels
(grid schemes); transitions with state transfer must keep RGRID's recall 1
(EXACT -> RGRID locally, GRID -> RGRID when the broker recovers the missing
state), and those without must deliver nothing to a subscription until it is
subscribed again.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routing_testkit import (
    circles,
    near,
    points,
    rectangles,
    roamings,
    stars,
    tiling_federation,
    workloads,
)
from test_cover import sample_points

from geofed.routing import (
    STRATEGIES,
    Event,
    Geofence,
    InvalidInput,
    LastMile,
    LatLon,
    Scheme,
    Simulator,
    Subscription,
    SubscriptionIndex,
    TraceOp,
    h3_cell,
    latlon,
    matches,
    parse_scheme,
    parse_wkt,
    reference_deliveries,
    scheme_for_load,
)
from geofed.routing._schemes import anchor, roi_cells

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOPICS = ["a/b", "a/c", "x"]
FILTERS = ["a/b", "a/+", "#", "x"]


@dataclass
class World:
    subs: list[Subscription]
    where: dict[str, LatLon]
    events: list[Event]


@st.composite
def worlds(draw: st.DrawFn) -> World:
    """Subscribers around one place with fixed, roaming and no geofences; events there."""
    center = draw(points.filter(lambda p: abs(p.lat) < 70))
    n = draw(st.integers(1, 6))
    subs: list[Subscription] = []
    where: dict[str, LatLon] = {}
    for i in range(n):
        client = f"c{i}"
        where[client] = draw(near(center, 300_000.0))
        kind = draw(st.sampled_from(["fixed", "roaming", "world"]))
        flt = draw(st.sampled_from(FILTERS))
        if kind == "roaming":
            shape = draw(roamings(scales=(500.0, 20_000.0, 300_000.0)))
            subs.append(Subscription(f"s{i}", client, flt, roaming=shape).placed(where[client]))
        elif kind == "fixed":
            fence = draw(st.one_of(circles(around=center), rectangles(around=center)))
            subs.append(Subscription(f"s{i}", client, flt, fence))
        else:
            subs.append(Subscription(f"s{i}", client, flt))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    spots: list[LatLon] = []
    for s in subs:
        spots += sample_points(s.geofence, rng, 12)[:12] if s.geofence is not None else []
    spots += [draw(near(center, 400_000.0)) for _ in range(5)]
    event_fences = [None, None, draw(st.one_of(st.none(), circles(around=center)))]
    events = [
        Event(f"e{j}", rng.choice(TOPICS), p, rng.choice(event_fences)) for j, p in enumerate(spots)
    ]
    return World(subs, where, events)


def exact(world: World, e: Event) -> list[tuple[str, str]]:
    """The brute-force answer: every subscription, the full predicate."""
    return sorted(s.key for s in world.subs if matches(e, s, world.where[s.client]))


def filled(world: World, scheme: Scheme) -> LastMile:
    lm = LastMile(scheme)
    for s in world.subs:
        lm.add(s)
    return lm


@SETTINGS
@given(worlds())
def test_exact_equals_the_brute_force_matcher(world: World) -> None:
    lm = filled(world, Scheme.EXACT)
    for e in world.events:
        assert sorted(lm.match(e, world.where.get)) == exact(world, e)


@SETTINGS
@given(worlds())
def test_rgrid_never_loses_a_match(world: World) -> None:
    lm = filled(world, Scheme.RGRID)
    for e in world.events:
        got = set(lm.match(e, world.where.get))
        assert set(exact(world, e)) <= got
        for key in got:  # and accepts() answers as match() does
            sub = next(s for s in world.subs if s.key == key)
            assert lm.accepts(e, key, world.where[sub.client])


@SETTINGS
@given(worlds())
def test_grid_matches_the_anchor_cell(world: World) -> None:
    """GRID delivers exactly when the topic matches, the publisher is in the anchor's
    cell (or the subscription has no geofence) and the event side passes as in RGRID."""
    grid, rgrid = filled(world, Scheme.GRID), filled(world, Scheme.RGRID)
    for e in world.events:
        got = set(grid.match(e, world.where.get))
        for s in world.subs:
            entry = grid.entry(s.key)
            assert entry is not None
            a = anchor(s)
            in_cell = a is None or h3_cell(e.location.lat, e.location.lon, entry.res) == h3_cell(
                a.lat, a.lon, entry.res
            )
            expect = (
                in_cell
                and s.key in {k.key for k in _topic_subs(world, e)}
                and rgrid._event_side(e.geofence, world.where[s.client])
            )
            assert (s.key in got) == expect


def _topic_subs(world: World, e: Event) -> list[Subscription]:
    idx = SubscriptionIndex()
    for s in world.subs:
        idx.add(Subscription(s.id, s.client, s.topic_filter))
    return idx.match(e.topic, e.location)


@SETTINGS
@given(worlds())
def test_complexity_counts_subscriptions_or_channels(world: World) -> None:
    for scheme in Scheme:
        lm = filled(world, scheme)
        if scheme is Scheme.EXACT:
            assert lm.complexity == len(world.subs)
        else:
            channels = set()
            for s in world.subs:
                entry = lm.entry(s.key)
                assert entry is not None
                channels.update(entry.channels(scheme))
            assert lm.complexity == len(channels)
            if scheme is Scheme.GRID:  # one channel per subscription at most
                assert lm.complexity <= len(world.subs)
        for e in world.events[:3]:  # each match counts the complexity once
            before = lm.stats.match_operations
            lm.match(e, world.where.get)
            assert lm.stats.match_operations - before == lm.complexity
        for s in world.subs:
            lm.remove(s.key)
        assert lm.complexity == 0 and len(lm) == 0


@SETTINGS
@given(worlds())
def test_transitions_with_state_transfer(world: World) -> None:
    """T1-T4 of the paper on a broker keeping only its scheme's state (no recovery)."""
    lm = filled(world, Scheme.EXACT)
    fenced = sorted(s.key for s in world.subs if s.geofence is not None)
    t1 = lm.transition(Scheme.RGRID)  # EXACT -> RGRID: all local, recall stays 1
    assert (t1.transferred, t1.awaiting) == (len(world.subs), ())
    fresh = filled(world, Scheme.RGRID)
    for e in world.events:
        assert sorted(lm.match(e, world.where.get)) == sorted(fresh.match(e, world.where.get))
    t2 = lm.transition(Scheme.GRID)  # RGRID -> GRID: the core cell, all local
    assert (t2.transferred, t2.awaiting) == (len(world.subs), ())
    fresh = filled(world, Scheme.GRID)
    for e in world.events:
        assert sorted(lm.match(e, world.where.get)) == sorted(fresh.match(e, world.where.get))
    t3 = lm.transition(Scheme.RGRID)  # GRID -> RGRID: covers missing, the client has them
    assert list(t3.awaiting) == fenced
    for s in world.subs:  # the clients' bootstrap answers arrive
        if s.key in t3.awaiting:
            lm.add(s)
    assert not lm.awaiting
    for e in world.events:
        assert set(exact(world, e)) <= set(lm.match(e, world.where.get))
    t4 = lm.transition(Scheme.EXACT)  # RGRID -> EXACT: geofences missing
    assert list(t4.awaiting) == fenced
    for e in world.events:  # until they come back, fenced subscriptions get nothing
        assert set(lm.match(e, world.where.get)) == {
            k for k in exact(world, e) if k not in t4.awaiting
        }
    for s in world.subs:
        if s.key in t4.awaiting:
            lm.add(s)
    for e in world.events:
        assert sorted(lm.match(e, world.where.get)) == exact(world, e)


@SETTINGS
@given(worlds(), st.sampled_from(list(Scheme)), st.sampled_from(list(Scheme)))
def test_transitions_recovering_from_the_broker(world: World, a: Scheme, b: Scheme) -> None:
    """A broker that keeps the full subscriptions (the node: its routing table) bootstraps
    every missing state itself: after any transition the scheme answers as a fresh one."""
    table = SubscriptionIndex()
    for s in world.subs:
        table.add(s)
    lm = LastMile(a, exact=table)
    for s in world.subs:
        lm.add(s)
    report = lm.transition(b, recover=table.get)
    assert report.awaiting == ()
    fresh = LastMile(b, exact=table)
    for s in world.subs:
        fresh.add(s)
    for e in world.events:
        got = sorted(lm.match(e, world.where.get))
        assert got == sorted(fresh.match(e, world.where.get))
        if b is not Scheme.GRID:
            assert set(exact(world, e)) <= set(got)


@SETTINGS
@given(worlds(), st.sampled_from(list(Scheme)), st.sampled_from(list(Scheme)))
def test_transitions_without_state_transfer(world: World, a: Scheme, b: Scheme) -> None:
    lm = filled(world, a)
    report = lm.transition(b, state_transfer=False)
    if a is b:
        return
    assert sorted(report.awaiting) == sorted(s.key for s in world.subs)
    for e in world.events:
        assert lm.match(e, world.where.get) == []
    for s in world.subs:  # the clients resubscribe
        lm.add(s)
    fresh = filled(world, b)
    for e in world.events:
        assert sorted(lm.match(e, world.where.get)) == sorted(fresh.match(e, world.where.get))


@SETTINGS
@given(st.one_of(circles(), stars(), rectangles()))
def test_roi_cover_holds_every_covered_point(fence: Geofence) -> None:
    res, cells = roi_cells(fence)
    if cells is None:
        return  # a world channel: nothing to lose
    for p in sample_points(fence, random.Random(1), 60):
        assert h3_cell(p.lat, p.lon, res) in cells


def test_region_of_interest_examples() -> None:
    paris = latlon(48.85, 2.35)
    fence = parse_wkt("POLYGON((2 48.5, 3 48.5, 3 49, 2 49, 2 48.5))")
    sub = Subscription("s", "c", "#", fence)
    res, cells = roi_cells(fence)
    # About 4,100 km² of ROI: res 3 cells (12,393 km² on average; res 4: 1,770), a few.
    assert res == 3 and cells is not None and 2 <= len(cells) <= 20
    a = anchor(sub)
    assert a is not None and fence.covers(a)
    lm = LastMile(Scheme.GRID)
    lm.add(sub)
    inside = Event("in", "t", latlon(48.7, 2.6))
    far = Event("far", "t", latlon(40.0, 2.6))
    assert lm.match(far, {"c": paris}.get) == []
    assert LastMile(Scheme.RGRID).match(inside, {"c": paris}.get) == []  # nothing held
    world_sub = Subscription("w", "c", "t")
    for scheme in Scheme:
        m = LastMile(scheme)
        m.add(world_sub)
        assert m.match(far, {"c": paris}.get) == [("c", "w")]  # world: topic alone
        assert m.match(far, {}.get) == []  # no session: no delivery


def test_parse_scheme_names_the_field() -> None:
    assert parse_scheme("rgrid") is Scheme.RGRID
    with pytest.raises(InvalidInput, match="filter_scheme"):
        parse_scheme("lps")


def test_scheme_for_load_has_hysteresis() -> None:
    e, r, g = Scheme.EXACT, Scheme.RGRID, Scheme.GRID
    path = []
    cur = e
    for n in [0, 99, 100, 150, 199, 200, 190, 181, 179, 95, 91, 89, 0]:
        cur = scheme_for_load(cur, n, e, 100, 200)
        path.append(cur)
    assert path == [e, e, r, r, r, g, g, g, r, r, r, e, e]
    assert scheme_for_load(e, 10**9, e, 0, 0) is e  # off
    assert scheme_for_load(e, 500, e, 0, 200) is g


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=workloads(max_ops=25),
    switches=st.lists(
        st.tuples(st.integers(0, 25), st.sampled_from(list(Scheme))), min_size=1, max_size=4
    ),
    strategy=st.sampled_from(sorted(STRATEGIES)),
)
def test_schemes_in_the_federation(
    ops: list[TraceOp], switches: list[tuple[int, Scheme]], strategy: str
) -> None:
    """The simulated federation under any strategy, every broker switching scheme at
    random points (state transfer, bootstrap from its own subscriptions): while no
    broker runs GRID nothing is missed, and under EXACT only the oracle's pairs arrive."""
    fed = tiling_federation()
    sim = Simulator(fed, strategy)
    expected = set(reference_deliveries(ops))
    at = dict(switches)  # op index -> the scheme every broker switches to there
    schemes = {Scheme.EXACT}
    for i, op in enumerate(ops):
        if i in at:
            for core in sim.cores.values():
                core.set_scheme(at[i])
            schemes.add(at[i])
        before = len(sim.result.deliveries)
        sim.apply(op)
        if op.op != "publish":
            continue
        current = next(iter(sim.cores.values())).last_mile.scheme
        got = set(sim.result.deliveries[before:])
        want = {d for d in expected if d[0] == op.id}
        assert len(got) == len(sim.result.deliveries) - before, "a duplicate delivery"
        if current is Scheme.EXACT:
            assert got == want
        elif current is Scheme.RGRID:
            assert want <= got
