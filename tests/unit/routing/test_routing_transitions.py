"""Strategy per topic and transitions between strategies at runtime (issue #17, §3).

The filter algebra the table rests on is checked against the oracle's regex
matcher by brute force; the table's choices by example; and the acceptance
property: with random transition points (several per run, per topic filter,
between every pair of strategies) the simulated federation delivers exactly
what the central matcher does (recall 1, precision 1, no duplicates), and
the cost model predicts exactly the messages the simulation sent. Runs with
the transition messages held back and released between actions check
exactness in the middle of a transition's phases too.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routing_testkit import filter_for, filters, gap_federation, tiling_federation, workloads

from geofed.routing import (
    STRATEGIES,
    BrokerState,
    InvalidInput,
    Phase,
    Simulator,
    StrategyTable,
    TraceOp,
    Transition,
    filter_covers,
    filter_specificity,
    filters_overlap,
    latlon,
    predict,
    reference_deliveries,
    reference_topic_match,
    simulate,
)

FEDERATIONS = {"tiling": tiling_federation(), "gap": gap_federation()}
NAMES = sorted(STRATEGIES)
SETTINGS = settings(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
SHRINK_TIMEOUT = pytest.mark.timeout(900)

# Every topic of up to three levels over the testkit's alphabet plus one
# letter no filter names: a witness for overlap, a counterexample for cover.
_LEVELS = ["a", "b", "c", "", "$s", "$", "z"]
_TOPICS = ["/".join(p) or "/" for n in range(1, 4) for p in itertools.product(_LEVELS, repeat=n)]
_SHORT_FILTERS = filters().filter(lambda f: f.count("/") <= 1)


def _matched(topic_filter: str) -> set[str]:
    return {t for t in _TOPICS if reference_topic_match(topic_filter, t)}


# --------------------------------------------------------------------------
# Filter algebra


@SETTINGS
@given(first=_SHORT_FILTERS, second=_SHORT_FILTERS)
def test_overlap_and_cover_agree_with_the_regex_matcher(first: str, second: str) -> None:
    # Filters of at most two levels (plus '#') over topics of up to three
    # levels: any witness or counterexample has a representative there.
    a, b = _matched(first), _matched(second)
    assert filters_overlap(first, second) == bool(a & b), (first, second)
    assert filter_covers(first, second) == (b <= a), (first, second)


@SETTINGS
@given(data=st.data(), first=_SHORT_FILTERS, second=_SHORT_FILTERS)
def test_two_filters_matching_one_topic_never_tie(
    data: st.DataObject, first: str, second: str
) -> None:
    common = sorted(_matched(first) & _matched(second))
    if first != second and common:
        assert filter_specificity(first) != filter_specificity(second)
    if common:
        topic = data.draw(st.sampled_from(common))
        table = StrategyTable.build(
            "flooding-events", {first: "event-geofence", second: "subscription-geofence"}
        )
        # The chosen entry matches and no matching entry is more specific.
        chosen = table.strategy_for(topic)
        best = max((first, second), key=filter_specificity)
        assert chosen == dict(table.entries)[best]
    for sub_filter in (first, second, "#", "+/+"):
        # A subscription is placed under every strategy that routes one of its topics.
        table = StrategyTable.build("flooding-events", {first: "event-geofence"})
        table = table.with_entry(second, "subscription-geofence")
        routed = {table.strategy_for(t) for t in _matched(sub_filter)}
        assert routed <= table.strategies_for(sub_filter), sub_filter


def test_the_most_specific_entry_decides_a_topic() -> None:
    table = StrategyTable.build(
        "flooding-events",
        {
            "#": "flooding-subscriptions",
            "a/#": "event-geofence",
            "a/+": "subscription-geofence",
            "a/b": "flooding-events",
            "+/b": "event-geofence",
        },
    )
    assert table.strategy_for("a/b") == "flooding-events"
    assert table.strategy_for("a/c") == "subscription-geofence"
    assert table.strategy_for("a") == "event-geofence"  # 'a/#' matches its parent
    assert table.strategy_for("c/b") == "event-geofence"
    assert table.strategy_for("c") == "flooding-subscriptions"
    assert table.strategy_for("$s/b") == "flooding-events"  # wildcards skip '$' topics
    # A subscription is placed under every strategy one of its topics may use.
    assert table.strategies_for("a/b") == {"flooding-events"}
    assert table.strategies_for("a/+") == {"subscription-geofence", "flooding-events"}
    # 'a/+' and 'a/#' route no topic of '+/b' ('a/b' outranks them) but are
    # not ruled out one by one: a superset, which costs messages, not results.
    assert table.strategies_for("+/b") == {
        "event-geofence",
        "flooding-events",
        "subscription-geofence",
    }
    assert table.strategies_for("$s/#") == {"flooding-events"}  # only the default reaches


def test_a_bad_table_names_the_field() -> None:
    table = StrategyTable("event-geofence")
    with pytest.raises(InvalidInput) as bad:
        table.with_entry("a/#/b", "event-geofence")
    assert bad.value.field == "topic_filter"
    with pytest.raises(InvalidInput) as bad:
        table.with_entry("a/#", "nearest")
    assert bad.value.field == "strategy"
    with pytest.raises(InvalidInput) as bad:
        StrategyTable("nearest")
    assert bad.value.field == "default"
    with pytest.raises(InvalidInput) as bad:
        StrategyTable.build("event-geofence", [("a", "event-geofence"), ("a", "flooding-events")])
    assert bad.value.field == "entries[1].topic_filter"
    with pytest.raises(InvalidInput) as bad:
        StrategyTable.from_dict({"default": "event-geofence", "entries": [{"topic_filter": "a"}]})
    assert bad.value.field == "entries[0].strategy"
    with pytest.raises(InvalidInput) as bad:
        StrategyTable.build("event-geofence", epoch=-1)
    assert bad.value.field == "epoch"
    new = table.with_entry("a/#", "flooding-events")
    assert (new.epoch, new.entries) == (1, (("a/#", "flooding-events"),))
    assert StrategyTable.from_dict(new.to_dict()) == new
    assert new.with_entry("a/#", None).same_routes(table)
    with pytest.raises(InvalidInput) as bad:
        StrategyTable.build("event-geofence", {"a/#": "flooding-events"}, adaptive=["b/#"])
    assert bad.value.field == "adaptive"
    with pytest.raises(InvalidInput) as bad:
        data = new.to_dict()
        data["entries"][0]["adaptive"] = "yes"
        StrategyTable.from_dict(data)
    assert bad.value.field == "entries[0].adaptive"


def test_the_controllers_entries_are_marked_and_an_operators_change_unmarks_them() -> None:
    """`StrategyTable.adaptive`: the entries the adaptive controller set (§13). They route
    as any entry, travel with the table (to_dict, and the wire: tests/unit/client), and
    an operator who sets or removes one makes it theirs — a new epoch even when the
    strategy stays, which the sequencer numbers; the same change twice makes none."""
    table = StrategyTable("event-geofence")
    mine = table.with_entry("t/#", "flooding-events", adaptive=True)
    assert mine.adaptive == {"t/#"} and mine.strategy_for("t/x") == "flooding-events"
    assert StrategyTable.from_dict(mine.to_dict()) == mine
    assert mine.to_dict()["entries"] == [
        {"topic_filter": "t/#", "strategy": "flooding-events", "adaptive": True}
    ]
    theirs = mine.with_entry("t/#", "flooding-events")
    assert theirs.same_routes(mine) and not theirs.same_entries(mine)
    assert theirs.adaptive == frozenset()
    assert mine.with_entry("t/#", None).adaptive == frozenset()
    assert mine.with_entry("u/#", "event-geofence").adaptive == {"t/#"}  # others' marks stay

    federation = FEDERATIONS["tiling"]
    cores = {b: BrokerState(b, federation, table) for b in "abc"}
    seq = cores["a"]
    assert seq.sequencer == "a"
    seq.propose("t/#", "flooding-events", adaptive=True)
    assert (seq.newest_table.epoch, seq.newest_table.adaptive) == (1, {"t/#"})
    assert seq.propose("t/#", "flooding-events", adaptive=True) == []  # nothing changes
    sends = cores["b"].propose("t/#", "flooding-events")  # an operator, at another broker
    assert [s.dst for s in sends] == ["a"]
    seq.on_message("b", sends[0].msg)
    assert (seq.newest_table.epoch, seq.newest_table.adaptive) == (2, frozenset())


# --------------------------------------------------------------------------
# The acceptance property through transitions


@st.composite
def transition_points(
    draw: st.DrawFn, ops: list[TraceOp], pair: tuple[str, str] | None = None
) -> list[Transition]:
    """Several changes at random points, for filters of the workload's topics.

    With `pair`, each filter is switched from the pair's first strategy to its
    second (and back now and then); otherwise any strategy, or the entry removed.
    """
    topics = sorted({op.topic for op in ops if op.op == "publish"}) or ["a"]
    pool = [draw(filter_for(draw(st.sampled_from(topics)))) for _ in range(2)]
    pool.append(draw(st.one_of(filters(), st.just("#"))))
    out: list[Transition] = []
    for _ in range(draw(st.integers(1, 5))):
        at = draw(st.integers(0, len(ops)))
        topic_filter = draw(st.sampled_from(pool))
        if pair is None:
            strategy = draw(st.one_of(st.none(), st.sampled_from(NAMES)))
        else:
            strategy = pair[draw(st.integers(0, 1))]
        via = draw(st.one_of(st.none(), st.sampled_from(["a", "b", "c", "eu", "as", "pac"])))
        out.append(Transition(at, topic_filter, strategy, via))
    return out


def _via_in(fed_name: str, ts: list[Transition]) -> list[Transition]:
    ids = set(FEDERATIONS[fed_name].ids)
    return [t if t.via in ids else Transition(t.before, t.topic_filter, t.strategy) for t in ts]


def _check(fed_name: str, start: str, ops: list[TraceOp], ts: list[Transition]) -> None:
    federation = FEDERATIONS[fed_name]
    expected = reference_deliveries(ops)
    result = simulate(federation, start, ops, ts)
    assert not [e for e in result.errors if "subscription id" not in e and "has no" not in e]
    assert sorted(result.deliveries) == sorted(expected)
    assert max(Counter(result.deliveries).values(), default=1) == 1
    report = predict(federation, start, ops, ts)
    assert report.messages == +result.messages
    sim = Simulator(federation, start)
    sim.run(ops, ts)
    assert all(not core.in_transition for core in sim.cores.values())
    assert len({(c.table, c.placing) for c in sim.cores.values()}) == 1


@SHRINK_TIMEOUT
@pytest.mark.parametrize("fed_name", sorted(FEDERATIONS))
@settings(SETTINGS, max_examples=60)
@given(data=st.data(), ops=workloads(max_ops=24), start=st.sampled_from(NAMES))
def test_transitions_at_random_points_stay_exact(
    fed_name: str, data: st.DataObject, ops: list[TraceOp], start: str
) -> None:
    ts = _via_in(fed_name, data.draw(transition_points(ops)))
    _check(fed_name, start, ops, ts)


@SHRINK_TIMEOUT
@pytest.mark.parametrize(("old", "new"), list(itertools.permutations(NAMES, 2)))
@settings(SETTINGS, max_examples=12)
@given(data=st.data(), ops=workloads(max_ops=20))
def test_every_pair_of_strategies(
    old: str, new: str, data: st.DataObject, ops: list[TraceOp]
) -> None:
    # The default is `old`; filters of the workload's topics go to `new` and back.
    ts = _via_in("tiling", data.draw(transition_points(ops, (new, old))))
    _check("tiling", old, ops, ts)


@SHRINK_TIMEOUT
@pytest.mark.parametrize("fed_name", sorted(FEDERATIONS))
@settings(SETTINGS, max_examples=60)
@given(data=st.data(), ops=workloads(max_ops=24), start=st.sampled_from(NAMES))
def test_actions_between_the_phases_of_a_transition_stay_exact(
    fed_name: str, data: st.DataObject, ops: list[TraceOp], start: str
) -> None:
    # Transition messages wait on their links and are released a few at a
    # time between actions: publishes, subscriptions, moves and re-homing
    # happen while brokers are prepared, switched or finishing, each at its
    # own phase.
    federation = FEDERATIONS[fed_name]
    ts = _via_in(fed_name, data.draw(transition_points(ops)))
    sim = Simulator(federation, start, hold_transitions=True)
    links = sorted((a, b) for a in federation.ids for b in federation.ids if a != b)
    for i, op in enumerate(ops):
        for t in ts:
            if t.before == i:
                sim.set_strategy(t.topic_filter, t.strategy, t.via)
        for _ in range(data.draw(st.integers(0, 6))):
            sim.release(data.draw(st.sampled_from(links)))
        sim.apply(op)
    for t in ts:
        if t.before >= len(ops):
            sim.set_strategy(t.topic_filter, t.strategy, t.via)
    sim.release_all()
    delivered = sim.result.deliveries
    assert sorted(delivered) == sorted(reference_deliveries(ops))
    assert max(Counter(delivered).values(), default=1) == 1
    cores = list(sim.cores.values())
    assert all(not c.in_transition for c in cores)
    assert len({(c.table, c.placing) for c in cores}) == 1
    # Every change was applied, in one order (the sequencer's epochs).
    final = sim.table
    assert final.epoch <= len(ts)
    assert all(c.progress == (final.epoch, Phase.SWITCHED) for c in cores)


def test_a_transition_waits_for_every_broker() -> None:
    # Event forwarding to subscription forwarding: the copies go out first,
    # events switch only once every peer has them; the reverse withdraws the
    # copies only after every broker switched.
    federation = FEDERATIONS["tiling"]
    cores = {b: BrokerState(b, federation, StrategyTable("flooding-events")) for b in "abc"}
    sends = cores["b"].propose("t/#", "flooding-subscriptions")
    assert [(s.dst, s.msg.kind.value) for s in sends] == [("a", "transition")]
    sends = cores["a"].on_message("b", sends[0].msg).sends
    assert {s.dst for s in sends} == {"b", "c"}
    assert cores["a"].progress == (1, Phase.PREPARED)
    assert cores["a"].table.epoch == 0  # still routing by the old table
    for s in sends:
        cores[s.dst].on_message("a", s.msg)
    assert cores["b"].progress == (1, Phase.PREPARED)
    assert cores["b"].table.epoch == 0  # c has not said PREPARED yet


_HOMES = {"a": latlon(0.0, 0.0), "b": latlon(30.0, 100.0), "c": latlon(-30.0, -120.0)}


@pytest.mark.parametrize(("old", "new"), list(itertools.permutations(NAMES, 2)))
@pytest.mark.parametrize("order", ["forward", "backward"])
def test_every_broker_publishes_between_every_step_of_a_transition(
    old: str, new: str, order: str
) -> None:
    # One subscriber and one publisher per broker; 't/#' moves from `old` to
    # `new` (asked at a broker that is not the sequencer) while every
    # transition message is released one at a time, each broker publishing
    # in between: whichever phase each broker is in, every event reaches
    # every subscriber once.
    federation = FEDERATIONS["tiling"]
    sim = Simulator(federation, old, hold_transitions=True)
    ops: list[TraceOp] = []

    def run(op: TraceOp) -> None:
        ops.append(op)
        sim.apply(op)

    for b, where in _HOMES.items():
        run(TraceOp(len(ops), "subscribe", f"sub-{b}", where, f"s-{b}", "t/#"))

    def publish_everywhere() -> None:
        for b, where in _HOMES.items():
            run(TraceOp(len(ops), "publish", f"pub-{b}", where, f"e{len(ops)}", "t/x"))

    sim.set_strategy("t/#", new, via="c")
    steps = 0
    while True:
        publish_everywhere()
        links = sorted((k for k, q in sim.held.items() if q), reverse=order == "backward")
        if not links:
            break
        sim.release(links[0])
        steps += 1
    publish_everywhere()
    assert steps >= 13  # the proposal, then PREPARED and SWITCHED on each of 6 links
    assert sorted(sim.result.deliveries) == sorted(reference_deliveries(ops))
    assert max(Counter(sim.result.deliveries).values()) == 1
    assert {c.table.strategy_for("t/x") for c in sim.cores.values()} == {new}


def test_a_strategy_state_of_the_previous_form_keeps_the_controllers_entries() -> None:
    """Before tables marked them, a sequencer stored its controller's entries beside its
    tables (``adaptive_owned``); a node reading such a state marks those entries (with
    the strategy it recorded), and leaves an entry an operator changed since pinned."""
    from geofed.node._server import _mark_adaptive  # the node's reading of its store

    federation = FEDERATIONS["tiling"]
    table = StrategyTable.build(
        "event-geofence", {"t/#": "flooding-events", "u/#": "event-geofence"}
    )
    core = BrokerState("a", federation, table)
    state = core.transition_state()
    state["adaptive_owned"] = {"t/#": "flooding-events", "u/#": "flooding-subscriptions"}
    _mark_adaptive(state)
    assert "adaptive_owned" not in state
    restored = BrokerState("a", federation, StrategyTable("event-geofence"))
    restored.restore_transition_state(state)
    assert restored.table.adaptive == {"t/#"}
    assert restored.table.same_routes(table)
