"""The adaptive controller: its predictions are the cost model's, its switches are damped."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from routing_testkit import gap_federation, tiling_federation, workloads

from geofed.routing import (
    STRATEGIES,
    AdaptiveConfig,
    AdaptiveController,
    FederatedController,
    Federation,
    InvalidInput,
    KeyWindow,
    LatLon,
    ShareMeter,
    Simulator,
    StrategyTable,
    Switch,
    TraceOp,
    circle,
    predict,
    reference_deliveries,
    simulate_adaptive,
    topic_key,
    transition_cost,
)

FED = tiling_federation()
A = LatLon(10.0, 0.0)  # broker a
B = LatLon(10.0, 100.0)  # broker b
C = LatLon(10.0, -100.0)  # broker c


def keyed(ops: list[TraceOp]) -> list[TraceOp]:
    """Two keys: subscriptions s0, s2 and even events on ``x``, the rest on ``y``.

    A subscription id keeps its key through updates, so each key's actions
    form a trace of their own.
    """
    out = []
    for op in ops:
        if op.op in ("subscribe", "publish"):
            out.append(dataclasses.replace(op, topic=f"{_key(op.id)}/{op.topic}"))
        else:
            out.append(op)
    return out


def _key(op_id: str) -> str:
    return "x" if int(op_id[1:]) % 2 == 0 else "y"


def only(key: str, ops: list[TraceOp]) -> list[TraceOp]:
    """The key's own trace: its actions, and every other action's location as a move."""
    out = []
    for op in ops:
        if op.op == "move" or _key_of(op) == key:
            out.append(op)
        elif op.location is not None:
            out.append(TraceOp(op.t, "move", op.client, op.location))
    return out


def _key_of(op: TraceOp) -> str:
    return _key(op.id) if op.id[1:].isdigit() else "-"


@settings(max_examples=60, deadline=None)
@given(ops=workloads(max_ops=30), width=st.sampled_from([1.0, 3.0, 7.0, 100.0]))
def test_window_predictions_add_up_to_predict_of_each_key(ops: list[TraceOp], width: float) -> None:
    ops = keyed(ops)
    config = AdaptiveConfig(window_s=width, candidates=tuple(STRATEGIES))
    ctl = AdaptiveController(FED, config, default="event-geofence", pinned={})
    totals: Counter[tuple[str, str]] = Counter()
    lower: Counter[str] = Counter()
    for _end, reports, _switches in ctl.run(ops):
        for r in reports:
            for name, n in r.predicted.items():
                totals[r.key, name] += n
            lower[r.key] += r.lower_bound
    for key in ("x", "y"):
        mine = only(key, ops)
        for name in STRATEGIES:
            whole = predict(FED, name, mine)
            assert totals[f"{key}/#", name] == whole.total_messages, (key, name)
        assert lower[f"{key}/#"] == predict(FED, "event-geofence", mine).lower_bound_total


def eager(width: float, **more: object) -> AdaptiveConfig:
    """Settings under which keys switch often, between every pair of strategies."""
    base = {
        "hysteresis": 0.0,
        "min_saving": 0,
        "dwell_windows": 0,
        "horizon_windows": 1000,
        "average_windows": 1,
    }
    return AdaptiveConfig(window_s=width, **(base | more))  # type: ignore[arg-type]


def closed_window(ops: list[TraceOp], width: float, repeats: int) -> list[TraceOp]:
    """`ops` on one key, made to end where they started, repeated `repeats` windows.

    Each window starts by moving every client to its first location and ends by
    withdrawing every subscription still held, so every window starts from the
    same state and costs every strategy the same.
    """
    first: dict[str, LatLon] = {}
    for op in ops:
        if op.location is not None:
            first.setdefault(op.client, op.location)
    span = max((op.t for op in ops), default=0.0) + 2.0
    out: list[TraceOp] = []
    for r in range(repeats):
        base = r * max(width, span)
        out += [TraceOp(base, "move", c, loc) for c, loc in sorted(first.items())]
        owner: dict[str, str] = {}
        for op in ops:
            t = base + 0.5 + op.t
            if op.op == "publish":
                out.append(dataclasses.replace(op, t=t, id=f"e{r}x{op.id}", topic=f"k/{op.topic}"))
            elif op.op == "subscribe":
                owner.setdefault(op.id, op.client)
                out.append(dataclasses.replace(op, t=t, topic=f"k/{op.topic}"))
            elif op.op == "unsubscribe":
                if owner.get(op.id) == op.client:
                    del owner[op.id]
                out.append(dataclasses.replace(op, t=t))
            else:
                out.append(dataclasses.replace(op, t=t))
        out += [TraceOp(base + span - 1.0, "unsubscribe", c, id=s) for s, c in owner.items()]
    return out


@settings(max_examples=40, deadline=None)
@given(
    ops=workloads(max_ops=20),
    hysteresis=st.sampled_from([0.0, 0.1, 0.5]),
    dwell=st.integers(0, 3),
    default=st.sampled_from(list(STRATEGIES)),
)
def test_a_stationary_workload_switches_each_key_at_most_once(
    ops: list[TraceOp], hysteresis: float, dwell: int, default: str
) -> None:
    span = max(op.t for op in ops) + 2.0
    trace = closed_window(ops, span, repeats=5)
    config = AdaptiveConfig(window_s=span, hysteresis=hysteresis, min_saving=0, dwell_windows=dwell)
    ctl = AdaptiveController(FED, config, default=default)
    switches = [s for _end, _r, found in ctl.run(trace) for s in found]
    assert len(switches) <= 1
    costs = [
        r.predicted
        for _end, reports, _s in AdaptiveController(FED, config, default=default).run(trace)
        for r in reports
    ]
    assert all(c == costs[0] for c in costs[:5])  # the windows do cost the same
    if switches:
        assert costs[0][switches[0].new] == min(costs[0].values())


@settings(max_examples=40, deadline=None)
@given(
    ops=workloads(max_ops=30),
    width=st.sampled_from([2.0, 4.0]),
    dwell=st.integers(0, 3),
    horizon=st.integers(1, 6),
)
def test_switches_keep_the_dwell_time_and_pay_for_their_transition(
    ops: list[TraceOp], width: float, dwell: int, horizon: int
) -> None:
    config = AdaptiveConfig(
        window_s=width,
        hysteresis=0.0,
        min_saving=0,
        dwell_windows=dwell,
        horizon_windows=horizon,
        average_windows=1,
    )
    ctl = AdaptiveController(FED, config, pinned={"y/#": "flooding-events"})
    last: dict[str, int] = {}
    for i, (_end, reports, switches) in enumerate(ctl.run(keyed(ops))):
        by_key = {r.key: r for r in reports}
        for s in switches:
            assert s.key != "y/#"  # pinned
            # It ran its strategy for `dwell` whole windows since the last switch.
            assert s.key not in last or i - last[s.key] >= max(dwell, 1)
            r = by_key[s.key]
            assert r.strategy == s.old
            gain = (r.predicted[s.old] - r.predicted[s.new]) * horizon - s.transition_cost
            assert gain == s.saving > 0
            last[s.key] = i
    assert ctl.strategy("y/#") == "flooding-events"


def test_world_wide_telemetry_moves_to_subscription_forwarding_in_one_window() -> None:
    # 10 world-wide events per window published at a, one subscriber at b that
    # wants only what is published within 100 km of the publisher.
    near_a = circle(A, 100_000)
    ops = [TraceOp(0.0, "subscribe", "sub", B, "s1", "t/x", near_a)]
    ops += [TraceOp(0.1 * i + 0.1, "publish", "pub", A, f"e{i}", "t/x") for i in range(30)]
    config = AdaptiveConfig(window_s=1.0, min_saving=0, average_windows=1)
    ctl = AdaptiveController(FED, config, default="event-geofence")
    windows = list(ctl.run(ops))
    first = windows[0][1][0]
    assert (first.events, first.subscribes, first.unsubscribes) == (9, 1, 0)
    assert first.event_reach == 9 * 3  # world-wide: every broker
    assert first.subscription_reach == 1  # the circle stays in a's area
    assert first.predicted["event-geofence"] == 18  # 2 remote brokers per event
    assert first.predicted["subscription-geofence"] == 1 + 9  # the subscription, 9 deliveries
    assert first.lower_bound == 9
    assert [s.new for s in windows[0][2]] == ["subscription-geofence"]
    assert ctl.strategy("t/#") == "subscription-geofence"
    assert all(not found for _end, _r, found in windows[1:])


def test_keys_past_the_cap_are_not_measured_and_keep_the_default() -> None:
    ops = [
        TraceOp(0.0, "publish", "p", A, "e1", "a/1"),
        TraceOp(0.1, "publish", "p", A, "e2", "b/1"),
        TraceOp(0.2, "subscribe", "s", B, "s1", "+/1"),  # spans keys: counted under a/#
    ]
    ctl = AdaptiveController(FED, AdaptiveConfig(max_keys=1), default="flooding-events")
    for op in ops:
        ctl.observe(op)
    reports, _ = ctl.close_window(10.0)
    assert [(r.key, r.events, r.subscribes) for r in reports] == [("a/#", 1, 1)]
    assert ctl.keys == {"a/#": "flooding-events"}
    assert ctl.strategy("b/#") == "flooding-events"


def test_an_idle_key_without_subscriptions_is_forgotten() -> None:
    ctl = AdaptiveController(FED, AdaptiveConfig(window_s=1.0, idle_windows=2))
    ops = [TraceOp(0.5, "publish", "p", A, "e1", "a/1"), TraceOp(5.5, "move", "p", A)]
    ends = [(end, {r.key for r in reports}) for end, reports, _ in ctl.run(ops)]
    assert ends[0] == (1.0, {"a/#"})
    assert ends[2] == (3.0, {"a/#"}) and ends[3] == (4.0, set())
    assert ctl.keys == {}


@pytest.mark.parametrize(
    ("topic", "levels", "key"),
    [
        ("telemetry/de/berlin/noise", 1, "telemetry/#"),
        ("telemetry/de/berlin/noise", 2, "telemetry/de/#"),
        ("a", 3, "a/#"),
        ("alerts/#", 1, "alerts/#"),
        ("+/x", 1, None),
        ("a/+/x", 2, None),
        ("a/+/x", 1, "a/#"),
        ("#", 1, None),
    ],
)
def test_topic_keys(topic: str, levels: int, key: str | None) -> None:
    assert topic_key(topic, levels) == key


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_s", 0.0),
        ("window_s", float("nan")),
        ("hysteresis", 1.0),
        ("hysteresis", -0.1),
        ("min_saving", -1),
        ("dwell_windows", 1.5),
        ("horizon_windows", 0),
        ("key_levels", 0),
        ("max_keys", True),
        ("idle_windows", 0),
        ("candidates", ()),
        ("candidates", ("event-geofence", "nearest")),
    ],
)
def test_bad_settings_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidInput, match=rf"^{field}: "):
        AdaptiveConfig(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"^pinned\['k/#'\]: "):
        AdaptiveController(FED, pinned={"k/#": "nearest"})


def test_a_transition_costs_the_moved_copies_and_its_protocol_messages() -> None:
    state = [
        TraceOp(0.0, "move", "c", A),
        TraceOp(0.0, "subscribe", "c", None, "s1", "k/x", None),
        TraceOp(0.0, "subscribe", "c", None, "s2", "k/x", circle(A, 1000)),
    ]
    protocol = 2 * 3 * 2  # PREPARED and SWITCHED from each broker to each other one

    def cost(old: str, new: str) -> int:
        return transition_cost(
            FED, StrategyTable.build("event-geofence", {"k/#": old}), "k/#", new, state
        )

    # The world-wide copy goes to b and c, the small circle nowhere.
    assert cost("event-geofence", "subscription-geofence") == 2 + protocol
    assert cost("subscription-geofence", "flooding-subscriptions") == 2 + protocol
    assert cost("flooding-subscriptions", "flooding-events") == 4 + protocol
    assert cost("event-geofence", "flooding-events") == protocol


@settings(max_examples=40, deadline=None)
@given(
    ops=workloads(max_ops=30),
    width=st.sampled_from([1.0, 2.0, 5.0]),
    default=st.sampled_from(list(STRATEGIES)),
)
def test_adaptive_runs_deliver_exactly_and_cost_what_the_model_says(
    ops: list[TraceOp], width: float, default: str
) -> None:
    config = eager(width)
    ops = keyed(ops)
    run = simulate_adaptive(FED, ops, default, config)
    assert sorted(run.result.deliveries) == sorted(reference_deliveries(ops))
    assert max(Counter(run.result.deliveries).values(), default=1) == 1
    model = predict(FED, StrategyTable(default), ops, run.transitions)
    assert model.messages == +run.result.messages
    assert sum(run.per_bin.values()) == run.result.total_messages
    switched = [s for _end, _r, found in run.windows for s in found]
    assert [(t.topic_filter, t.strategy) for t in run.transitions] == [
        (s.key, s.new) for s in switched
    ]
    event(f"transitions: {min(len(switched), 3)}")


def test_adaptive_run_switches_world_wide_telemetry_and_the_static_run_does_not() -> None:
    near_a = circle(A, 100_000)
    ops = [TraceOp(0.0, "subscribe", "sub", B, "s1", "t/x", near_a)]
    ops += [TraceOp(0.1 * i + 0.1, "publish", "pub", A, f"e{i}", "t/x") for i in range(30)]
    config = AdaptiveConfig(window_s=1.0, min_saving=0, average_windows=1)
    static = simulate_adaptive(FED, ops, "event-geofence", config, adapt=False)
    adaptive = simulate_adaptive(FED, ops, "event-geofence", config)
    assert static.transitions == [] and static.result.total_messages == 2 * 30
    assert [(t.before, t.topic_filter, t.strategy) for t in adaptive.transitions] == [
        (10, "t/#", "subscription-geofence")
    ]
    # 9 events by event forwarding, the transition (the copy, 12 protocol
    # messages), then one delivery per event.
    assert adaptive.result.total_messages == 18 + 1 + 12 + 21
    assert adaptive.per_bin[0] == 18 and adaptive.per_bin[1] == 13 + 10  # the switch at 1.0
    assert sorted(adaptive.result.deliveries) == sorted(reference_deliveries(ops))


@pytest.mark.parametrize(("average", "switched"), [(1, ["event-geofence"]), (2, [])])
def test_averaging_keeps_a_start_burst_of_subscriptions_from_switching(
    average: int, switched: list[str]
) -> None:
    # Ten world-wide subscriptions at b in the first window, then 5 world-wide
    # events per window at a: subscription forwarding pays 20 copies once,
    # event forwarding 2 messages per event for ever.
    ops = [TraceOp(0.01 * i, "subscribe", f"s{i}", B, f"s{i}", "t/x") for i in range(10)]
    ops += [TraceOp(0.2 * i + 0.1, "publish", "pub", A, f"e{i}", "t/x") for i in range(30)]
    config = AdaptiveConfig(window_s=1.0, min_saving=0, average_windows=average)
    run = simulate_adaptive(FED, ops, "subscription-geofence", config)
    first = run.windows[0][1][0].predicted
    assert (first["subscription-geofence"], first["event-geofence"]) == (20 + 5, 10)
    assert [t.strategy for t in run.transitions] == switched


def test_a_forgotten_key_comes_back_with_the_strategy_it_was_switched_to() -> None:
    near_a = circle(A, 100_000)
    ops = [TraceOp(0.0, "subscribe", "sub", B, "s1", "t/x", near_a)]
    ops += [TraceOp(0.1 * i + 0.1, "publish", "pub", A, f"e{i}", "t/x") for i in range(10)]
    ops += [TraceOp(1.5, "unsubscribe", "sub", id="s1")]
    config = AdaptiveConfig(window_s=1.0, min_saving=0, average_windows=1, idle_windows=1)
    ctl = AdaptiveController(FED, config, default="event-geofence")
    list(ctl.run([*ops, TraceOp(5.5, "move", "pub", A)]))
    assert ctl.keys == {} and ctl.strategy("t/#") == "subscription-geofence"
    ctl.observe(TraceOp(6.0, "publish", "pub", A, "e99", "t/y"))
    assert ctl.keys == {"t/#": "subscription-geofence"}


def test_a_full_table_switches_no_new_key() -> None:
    from geofed.routing import MAX_TABLE_ENTRIES

    pins = {f"p{i}/#": "event-geofence" for i in range(MAX_TABLE_ENTRIES)}
    near_a = circle(A, 100_000)
    ops = [TraceOp(0.0, "subscribe", "sub", B, "s1", "t/x", near_a)]
    ops += [TraceOp(0.1 * i + 0.1, "publish", "pub", A, f"e{i}", "t/x") for i in range(30)]
    config = AdaptiveConfig(window_s=1.0, min_saving=0, average_windows=1)
    run = simulate_adaptive(FED, ops, "event-geofence", config, pinned=pins)
    assert run.transitions == [] and run.result.total_messages == 2 * 30


# ---------------------------------------------- the federated controller (§13, in the node)


def federated_run(
    fed: Federation,
    ops: list[TraceOp],
    default: str,
    config: AdaptiveConfig,
    pinned: dict[str, str] | None = None,
) -> list[tuple[list[KeyWindow], list[Switch], list[Switch]]]:
    """`ops` through the simulator with a `ShareMeter` in every broker, windows closed as
    `AdaptiveController.run` closes them; at each window end the single controller and
    the `FederatedController` (fed the brokers' shares) decide, the shares are held to
    the single controller's figures, and the single controller's switches are executed.

    Returns per window: the single controller's reports and switches, and the
    federated controller's switches.
    """
    ctl = AdaptiveController(fed, config, default=default, pinned=pinned)
    sim = Simulator(fed, ctl.table)
    meters = {}
    for core in sim.cores.values():
        core.meter = meters[core.id] = ShareMeter(config)
    sequencer = FederatedController(fed, config)
    out = []

    def close(end: float) -> None:
        before = ctl.table
        states = {key: ctl.state(key, at_start=False) for key in ctl.keys}
        shares = {b: m.close(sim.cores[b]) for b, m in meters.items()}
        reports, switches = ctl.close_window(end)
        for b, mine in shares.items():
            sequencer.add(b, mine)
        summed: dict[str, KeyWindow] = {}
        for mine in shares.values():
            for w in mine:
                summed.setdefault(w.key, KeyWindow(w.key, w.strategy)).add(w)
        for r in reports:
            w = summed[r.key]
            assert w.predicted == r.predicted, r.key
            assert w.events == r.events
            for name in config.candidates:
                if dict(before.entries).get(r.key) == name or not r.predicted:
                    continue  # no transition: the table stays as it is
                model = transition_cost(fed, before, r.key, name, states[r.key])
                assert w.moved[name] + sequencer.protocol_cost == model, (r.key, name)
        _fed_reports, fed_switches = sequencer.close_window(sim.table, end)
        out.append((reports, switches, fed_switches))
        for s in switches:
            sim.set_strategy(s.key, s.new, adaptive=True)

    end = config.window_s
    for op in ops:
        while op.t >= end:
            close(end)
            end += config.window_s
        for m in meters.values():
            m.track(ctl.keys)  # the keys the sequencer decides on (§13: spanning filters)
        sim.apply(op)
        ctl.observe(op)
    close(end)
    assert sorted(sim.result.deliveries) == sorted(reference_deliveries(ops))
    return out


@settings(max_examples=60, deadline=None)
@given(
    ops=workloads(max_ops=30),
    width=st.sampled_from([1.0, 3.0, 100.0]),
    default=st.sampled_from(list(STRATEGIES)),
    fed=st.sampled_from([FED, gap_federation()]),
)
def test_the_brokers_shares_add_up_to_the_single_controllers_figures(
    ops: list[TraceOp], width: float, default: str, fed: Federation
) -> None:
    # Shares are measured under every table the switches make.
    config = eager(width, idle_windows=1000, candidates=tuple(STRATEGIES))
    windows = federated_run(fed, keyed(ops), default, config, pinned={"y/a/#": "flooding-events"})
    for _reports, switches, fed_switches in windows:
        assert fed_switches == sorted(switches, key=lambda s: s.key)  # keys in order
    event(f"switches: {min(sum(len(s) for _r, s, _f in windows), 3)}")


@settings(max_examples=40, deadline=None)
@given(ops=workloads(max_ops=30), width=st.sampled_from([2.0, 4.0]), dwell=st.integers(0, 3))
def test_the_federated_controller_decides_as_the_single_one_with_the_defaults(
    ops: list[TraceOp], width: float, dwell: int
) -> None:
    config = AdaptiveConfig(window_s=width, min_saving=0, dwell_windows=dwell, idle_windows=1000)
    windows = federated_run(
        FED, keyed(ops), "event-geofence", config, pinned={"y/#": "flooding-events"}
    )
    for _reports, switches, fed_switches in windows:
        assert fed_switches == sorted(switches, key=lambda s: s.key)
        assert all(s.key != "y/#" for s in fed_switches)


def test_world_wide_telemetry_switches_in_the_federated_controller_too() -> None:
    near_a = circle(A, 100_000)
    ops = [TraceOp(0.0, "subscribe", "sub", B, "s1", "t/x", near_a)]
    ops += [TraceOp(0.1 * i + 0.1, "publish", "pub", A, f"e{i}", "t/x") for i in range(30)]
    config = AdaptiveConfig(window_s=1.0, min_saving=0, average_windows=1)
    windows = federated_run(FED, ops, "event-geofence", config)
    assert [[s.new for s in f] for _r, _s, f in windows] == [["subscription-geofence"], [], [], []]


def test_an_operators_entry_is_pinned_and_an_unset_one_adapts_again() -> None:
    sequencer = FederatedController(FED, AdaptiveConfig(window_s=1.0, average_windows=1))
    share = KeyWindow("t/#", "event-geofence", events=10)
    share.predicted = {"subscription-geofence": 10, "event-geofence": 1000}
    share.predicted |= {"flooding-subscriptions": 10, "flooding-events": 2000}
    pinned = StrategyTable.build("event-geofence", {"t/#": "event-geofence"})
    sequencer.add("a", [share])
    assert sequencer.close_window(pinned, 1.0)[1] == []
    sequencer.add("a", [share])
    _reports, switches = sequencer.close_window(StrategyTable("event-geofence"), 2.0)
    assert [(s.key, s.new) for s in switches] == [("t/#", "subscription-geofence")]
    # The controller's own entry (proposed as adaptive) is not pinned; once an
    # operator sets it, even to the same strategy, it is.
    table = StrategyTable("event-geofence").with_entry(
        "t/#", "subscription-geofence", adaptive=True
    )
    assert table.adaptive == {"t/#"}
    assert not sequencer.pinned(table, "t/#")
    table = table.with_entry("t/#", "subscription-geofence")
    assert table.adaptive == frozenset()
    assert sequencer.pinned(table, "t/#")
    assert not sequencer.pinned(table.with_entry("t/#", None), "t/#")


def test_a_key_no_broker_reports_is_forgotten_by_the_sequencer() -> None:
    sequencer = FederatedController(FED, AdaptiveConfig(idle_windows=2))
    sequencer.add("a", [KeyWindow("t/#", "event-geofence")])
    table = StrategyTable("event-geofence")
    assert [r.key for r in sequencer.close_window(table, 1.0)[0]] == ["t/#"]
    sequencer.close_window(table, 2.0)
    assert sequencer.keys == {"t/#": "event-geofence"}
    sequencer.close_window(table, 3.0)
    assert sequencer.keys == {}
