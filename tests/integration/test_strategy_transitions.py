"""Switching a topic's strategy at runtime on a live federation (issue #17, §3).

Real nodes, the client library and the central oracle: while subscriptions
stay in place (no client resubscribes), `Client.set_strategy` moves a topic
filter from one strategy to another, for every ordered pair of strategies.

* With the quiescence barrier after every action and every transition (fixed
  points for every pair, and hypothesis-drawn random points and entries), the
  deliveries equal the oracle's (recall 1, precision 1, no duplicates) and
  the inter-broker messages counted by the nodes equal the cost model with
  the same transition points, message for message.
* With publishers publishing while the transitions run (no barrier), the
  deliveries still equal the oracle's.
* A broker that is down holds a transition up; the federation stays exact
  meanwhile, and the transition completes once it is back. A durable broker
  killed in the middle resumes from its store; one restarted without a data
  dir learns the table from its peers. `geofed strategy` drives it all.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import geofed
from geofed.bench import LocalFederation, Replayer, faults, metric, wait_quiescent
from geofed.node import DELIVERIES, SUBSCRIPTIONS
from geofed.routing import (
    STRATEGIES,
    StrategyTable,
    TraceOp,
    Transition,
    latlon,
    parse_geofence,
    predict,
    reference_deliveries,
)

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"
WAIT_S = 120.0  # safety net of every wait on state

pytestmark = pytest.mark.integration

HOMES = {"eu": latlon(50.1, 8.7), "us": latlon(39.0, -77.5), "ap": latlon(35.7, 139.7)}
FENCES = [
    None,
    "POLYGON((-10 35, 30 35, 30 60, -10 60, -10 35))",
    "POLYGON((-130 10, -60 10, -60 55, -130 55, -130 10))",
    {"circle": {"lat": 35.7, "lon": 139.7, "radius_m": 500_000}},
]
PAIRS = list(itertools.permutations(STRATEGIES, 2))
_run = itertools.count()


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    # The default strategy is one of the four; every pair is exercised on 'a/#'.
    with LocalFederation(THREE, "event-geofence", tmp_path_factory.mktemp("transitions")) as fed:
        yield fed


# Conditions scrape metrics, so they run in a thread.
until = functools.partial(faults.until, timeout=WAIT_S, scrapes=True)


def _finished(fed: LocalFederation, epoch: int, ids: list[str] | None = None) -> bool:
    """Every broker (of `ids`) routes by table `epoch` and has no transition under way."""
    urls = fed.metrics_urls()
    return all(
        metric(urls[b], "geofed_strategy_epoch") == epoch
        and metric(urls[b], "geofed_strategy_transition_phase") == 0
        for b in (ids or list(urls))
    )


def _serving(fed: LocalFederation, broker: str) -> bool:
    """Whether the broker's metrics endpoint answers (it started)."""
    try:
        metric(fed.metrics_urls()[broker], "geofed_sessions")
    except OSError:
        return False
    return True


async def _all_delivered(fed: LocalFederation, r: Replayer, made_before: float) -> float:
    """The deliveries the brokers made since `made_before`, once all reached `r`'s clients."""
    made = await asyncio.to_thread(fed.total, DELIVERIES) - made_before
    await until(lambda: r.received >= made, f"{made:g} deliveries reach the clients")
    return made


async def _wind_down(fed: LocalFederation, *clients: Replayer | geofed.Client) -> None:
    """Close the replayers and clients, then wait until their subscriptions are withdrawn
    everywhere and the links are quiet (nothing of this run counted in the next)."""
    for c in clients:
        await c.close()
    await until(lambda: fed.total(SUBSCRIPTIONS) == 0, "subscriptions withdrawn")
    await fed.quiescent(WAIT_S)


async def _change(
    fed: LocalFederation, admin: geofed.Client, topic_filter: str, strategy: str | None
) -> int:
    """Ask for a change; return once every broker has finished it (its epoch)."""
    await admin.set_strategy(topic_filter, strategy)
    deadline = time.monotonic() + WAIT_S
    while True:
        # The admin's broker passed the proposal to the sequencer: wait for the table.
        state = await admin.strategy_table()
        entries = {e["topic_filter"]: e["strategy"] for e in state["table"]["entries"]}
        if entries.get(topic_filter) == strategy and not state["in_transition"]:
            break
        assert time.monotonic() < deadline, f"{topic_filter} -> {strategy} not in force"
        await asyncio.sleep(0.01)
    epoch = int(state["table"]["epoch"])
    await until(lambda: _finished(fed, epoch), f"every broker finished epoch {epoch}")
    await fed.quiescent(WAIT_S)
    return epoch


def _workload(run: int, topic_pool: list[str]) -> list[list[TraceOp]]:
    """Segments of actions: subscriptions at every broker, then publishes between changes."""
    subs: list[TraceOp] = []
    filters = ["a/#", "a/b", "#", "+/b", "a/+"]
    for i, where in enumerate(list(HOMES.values()) * 3):
        fence = parse_geofence(FENCES[i % len(FENCES)])
        subs.append(
            TraceOp(0, "subscribe", f"r{run}sub{i}", where, f"r{run}s{i}", filters[i % 5], fence)
        )
    segments = [subs]
    for k in range(4):
        seg = []
        for j, (b, where) in enumerate(HOMES.items()):
            for topic in topic_pool:
                fence = parse_geofence(FENCES[(k + j) % len(FENCES)])
                seg.append(
                    TraceOp(
                        0,
                        "publish",
                        f"r{run}p-{b}",
                        where,
                        f"r{run}e{k}{b}{topic}",
                        topic,
                        fence,
                        8,
                    )
                )
        segments.append(seg)
    return segments


@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_barrier_synchronised_transitions_match_oracle_and_cost_model(
    federation: LocalFederation, old: str, new: str
) -> None:
    run = next(_run)
    segments = _workload(run, ["a/b", "a/c", "b/b"])
    where = str(federation.federation_path)
    urls = federation.metrics_urls()

    async def scenario() -> tuple[
        list[tuple[str, str]], list[TraceOp], list[Transition], Counter[tuple[str, str, str]], dict
    ]:
        r = Replayer(federation.federation, barrier=lambda: wait_quiescent(urls, timeout=WAIT_S))
        admin = await geofed.connect(
            client_id=f"r{run}admin", location=HOMES["us"], federation=where
        )
        ops: list[TraceOp] = []
        transitions: list[Transition] = []
        # The starting point: 'a/#' by `old`, 'a/b' unpinned (before anything is measured).
        await _change(federation, admin, "a/#", old)
        await _change(federation, admin, "a/b", None)
        start_table = await admin.strategy_table()
        before = await asyncio.to_thread(federation.sent)
        made_before = await asyncio.to_thread(federation.total, DELIVERIES)
        changes = [("a/#", new), ("a/b", old), ("a/#", old)]
        try:
            for i, seg in enumerate(segments):
                if 1 < i <= len(changes) + 1:
                    topic_filter, strategy = changes[i - 2]
                    transitions.append(Transition(len(ops), topic_filter, strategy, via="us"))
                    await _change(federation, admin, topic_filter, strategy)
                await r.run(seg)
                ops.extend(seg)
            made = await _all_delivered(federation, r, made_before)
            after = await asyncio.to_thread(federation.sent)
        finally:
            await _wind_down(federation, r, admin)
        assert not r.errors, r.errors
        assert r.received == made
        return r.deliveries, ops, transitions, after - before, start_table

    deliveries, ops, transitions, sent, start = asyncio.run(scenario())
    expected = reference_deliveries(ops)
    assert expected  # the workload delivers something across brokers
    assert Counter(deliveries) == Counter(expected)  # recall 1, precision 1, no duplicates
    table = StrategyTable.from_dict(start["table"])
    predicted = predict(federation.federation, table, ops, transitions)
    assert predicted.by_kind()["transition"] > 0
    assert sent == +predicted.messages


# Visits every ordered pair of the four strategies once (an Euler circuit).
_TOUR = [0, 1, 2, 3, 0, 2, 1, 3, 2, 0, 3, 1, 0]


def test_events_flowing_through_transitions_are_delivered_exactly(
    federation: LocalFederation,
) -> None:
    # Subscriptions are placed (barrier), then publishers at every broker
    # publish without any barrier while 'a/#' is moved along every ordered
    # pair of strategies, each change asked for while the previous ones may
    # still be under way: every broker is in some phase of some transition
    # when events arrive. The deliveries must be the oracle's all the same.
    names = list(STRATEGIES)
    tour = [names[i] for i in _TOUR]
    assert len({(a, b) for a, b in itertools.pairwise(tour)}) == len(PAIRS)
    run = next(_run)
    segments = _workload(run, ["a/b", "a/c"])
    subs = segments[0]
    publishes = [
        TraceOp(0, "publish", op.client, op.location, f"{op.id}x{i}", op.topic, op.geofence, 8)
        for i in range(3)
        for seg in segments[1:]
        for op in seg
    ]
    where = str(federation.federation_path)
    urls = federation.metrics_urls()

    async def scenario() -> tuple[list[tuple[str, str]], int]:
        r = Replayer(federation.federation, barrier=lambda: wait_quiescent(urls, timeout=WAIT_S))
        pub = Replayer(federation.federation)
        admin = await geofed.connect(
            client_id=f"r{run}admin", location=HOMES["eu"], federation=where
        )
        first = await _change(federation, admin, "a/#", tour[0])
        made_before = await asyncio.to_thread(federation.total, DELIVERIES)
        try:
            await r.run(subs)

            async def changes() -> None:
                for strategy in tour[1:]:
                    await admin.set_strategy("a/#", strategy)
                    await asyncio.sleep(0)  # let publishes interleave

            await asyncio.gather(pub.run(publishes), changes())
            last = await _change(federation, admin, "a/#", tour[-1])  # every change finished
            assert last == first + len(PAIRS)  # one epoch each, none lost
            made = await _all_delivered(federation, r, made_before)
        finally:
            await _wind_down(federation, pub, r, admin)
        assert not r.errors and not pub.errors, (r.errors, pub.errors)
        return r.deliveries, int(made)

    deliveries, made = asyncio.run(scenario())
    expected = reference_deliveries([*subs, *publishes])
    assert len(expected) > 50
    assert Counter(deliveries) == Counter(expected)  # recall 1, precision 1, no duplicates
    assert made == len(expected)  # no duplicate even among those the client would drop


def test_a_down_broker_holds_a_transition_up_and_a_restart_keeps_the_table(
    tmp_path: Path,
) -> None:
    # us is frozen (its links look up, it answers nothing) while 'a/#' moves
    # from event forwarding to subscription forwarding: eu and ap prepare and
    # wait for it, and the federation stays exact meanwhile. Once us runs
    # again the transition completes. While us is stopped, a change is
    # refused (the sequencer needs all its links); us restarts from its data
    # dir with the table it had.
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True) as fed:
        where = str(fed.federation_path)
        urls = fed.metrics_urls()

        async def scenario() -> None:
            admin = await geofed.connect(client_id="admin", location=HOMES["eu"], federation=where)
            subscriber = await geofed.connect(
                client_id="sub-ap", location=HOMES["ap"], federation=where
            )
            sub = await subscriber.subscribe("a/#")
            await fed.quiescent(WAIT_S)
            fed.pause_node("us")
            try:
                await admin.set_strategy("a/#", "flooding-subscriptions")
                await until(
                    lambda: (
                        metric(urls["eu"], "geofed_strategy_transition_phase") == 1
                        and metric(urls["ap"], "geofed_strategy_transition_phase") == 1
                    ),
                    "eu and ap prepared, waiting for us",
                )
                assert metric(urls["ap"], "geofed_strategy_epoch") == 1
                async with await geofed.connect(
                    client_id="pub-eu", location=HOMES["eu"], federation=where
                ) as pub:
                    await pub.publish("a/b", b"while us is frozen", event_id="frozen")
                msg = await sub.next(timeout=WAIT_S)
                assert (msg.event_id, msg.payload) == ("frozen", b"while us is frozen")
            finally:
                fed.resume_node("us")
            await until(lambda: _finished(fed, 1), "the transition completes with us back")
            await fed.quiescent(WAIT_S)
            async with await geofed.connect(
                client_id="pub-us", location=HOMES["us"], federation=where
            ) as pub:
                await pub.publish("a/b", b"after", event_id="after")
            msg = await sub.next(timeout=WAIT_S)
            assert msg.event_id == "after"
            await asyncio.to_thread(fed.stop_node, "us")
            await until(
                lambda: metric(urls["eu"], "geofed_peer_connected", peer="us") == 0,
                "eu saw its link to us go down",
            )
            with pytest.raises(geofed.GeofedError, match="link to us down"):
                await admin.set_strategy("a/#", "event-geofence")
            await asyncio.to_thread(fed.start_node, "us")
            await asyncio.to_thread(fed.wait_ready, WAIT_S, ["us"])
            await until(lambda: _finished(fed, 1), "us restarted at epoch 1")
            state = await admin.strategy_table()
            assert state["table"]["entries"] == [
                {"topic_filter": "a/#", "strategy": "flooding-subscriptions", "adaptive": False}
            ]
            await sub.unsubscribe()
            await subscriber.close()
            await admin.close()

        asyncio.run(scenario())


def test_a_strategy_change_lost_on_a_breaking_link_is_not_answered_as_made(
    tmp_path: Path,
) -> None:
    # eu's link to the sequencer (ap) swallows everything (a black hole) as the
    # admin at eu asks for a change: the proposal is lost with the link. eu
    # must not answer the change as made: it answers once the sequencer has
    # numbered it, so the client's retries carry it through once the link is
    # back, and every broker ends up routing by it.
    env = {"GEOFED_PEER_HEARTBEAT_S": "0.2", "GEOFED_PEER_TIMEOUT_S": "1.5"}
    with LocalFederation(THREE, "event-geofence", tmp_path, links=True, extra_env=env) as fed:
        urls = fed.metrics_urls()
        link = fed.link("ap", "eu")
        retry = geofed.RetryConfig(attempts=200, initial_backoff_s=0.05, max_backoff_s=0.5)

        async def scenario() -> None:
            admin = await geofed.connect(
                client_id="admin-lost",
                location=HOMES["eu"],
                federation=str(fed.federation_path),
                retry=retry,
            )
            await asyncio.to_thread(link.set_mode, "blackhole")
            change = asyncio.create_task(admin.set_strategy("a/#", "flooding-events"))
            await until(
                lambda: metric(urls["eu"], "geofed_peer_connected", peer="ap") == 0,
                "eu saw its link to ap break",
            )
            assert not change.done() or change.exception() is not None
            await asyncio.to_thread(link.heal)
            state = await change
            entry = {"topic_filter": "a/#", "strategy": "flooding-events", "adaptive": False}
            assert entry in state["newest"]["entries"]
            await until(lambda: _finished(fed, 1), "every broker routes by the change")
            await admin.close()

        asyncio.run(scenario())


def test_the_cli_pins_a_topic_and_a_broker_restarted_without_data_learns_the_table(
    tmp_path: Path,
) -> None:
    # `geofed strategy set/show/unset` through a broker that is not the
    # sequencer; eu then restarts without a data dir (it lost its table)
    # and takes the federation's table from its peers' hellos.
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        where = ["--federation", str(fed.federation_path), "--client", "admin"]
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "geofed.cli",
                "strategy",
                *args,
                *where,
                "--location",
                "50.1,8.7",
            ],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            check=False,
        )

    with LocalFederation(THREE, "flooding-events", tmp_path) as fed:
        done = cli("set", "t/#", "subscription-geofence", "--wait", str(WAIT_S))
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout)
        assert (state["broker"], state["sequencer"], state["in_transition"]) == ("eu", "ap", False)
        assert state["table"] == {
            "epoch": 1,
            "default": "flooding-events",
            "entries": [
                {"topic_filter": "t/#", "strategy": "subscription-geofence", "adaptive": False}
            ],
        }
        asyncio.run(until(lambda: _finished(fed, 1), "every broker at epoch 1"))
        fed.stop_node("eu")
        fed.start_node("eu")
        fed.wait_ready(WAIT_S, ["eu"])
        asyncio.run(until(lambda: _finished(fed, 1), "eu learned epoch 1"))
        shown = cli("show")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["table"] == state["table"]
        done = cli("unset", "t/#", "--wait", str(WAIT_S))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["table"]["entries"] == []
        bad = cli("set", "t/#/x", "event-geofence")
        assert bad.returncode == 2 and "topic_filter" in bad.stderr, bad.stderr
        bad = cli("set", "t/#")
        assert bad.returncode == 2 and "strategy" in bad.stderr, bad.stderr


def test_a_broker_killed_in_the_middle_of_a_transition_resumes_it_from_its_store(
    tmp_path: Path,
) -> None:
    # eu is frozen, so us and ap prepare and wait. us is then killed (no
    # shutdown at all) and restarts from its data dir: it is still prepared
    # (both placements), and once eu runs again the transition completes
    # and events go by the new table, to a subscriber that never resubscribed.
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True) as fed:
        where = str(fed.federation_path)

        def phase(b: str) -> float:
            return metric(fed.metrics_urls()[b], "geofed_strategy_transition_phase")

        async def scenario() -> None:
            admin = await geofed.connect(client_id="admin", location=HOMES["ap"], federation=where)
            subscriber = await geofed.connect(
                client_id="sub-eu", location=HOMES["eu"], federation=where
            )
            sub = await subscriber.subscribe("a/#")
            await fed.quiescent(WAIT_S)
            fed.pause_node("eu")
            try:
                await admin.set_strategy("a/#", "subscription-geofence")
                await until(lambda: phase("us") == 1 and phase("ap") == 1, "us, ap prepared")
                await asyncio.to_thread(fed.stop_node, "us", signal.SIGKILL)
                await asyncio.to_thread(fed.start_node, "us")
                # Not ready (its link to eu cannot come up): its metrics tell, once served.
                await until(lambda: _serving(fed, "us"), "us serves its metrics again")
                # Restored from the store (not learned again): still prepared.
                log = fed.nodes["us"].log_path.read_text(errors="replace")
                assert "strategy table restored: epoch 1, prepared" in log
                assert phase("us") == 1
                assert metric(fed.metrics_urls()["us"], "geofed_strategy_epoch") == 1
            finally:
                fed.resume_node("eu")
            await until(lambda: _finished(fed, 1), "the transition completes")
            async with await geofed.connect(
                client_id="pub-us", location=HOMES["us"], federation=where
            ) as pub:
                await pub.publish("a/x", b"by the new table", event_id="new")
            msg = await sub.next(timeout=WAIT_S)
            assert (msg.event_id, msg.payload) == ("new", b"by the new table")
            # Subscription forwarding now: us holds eu's subscription and sent a delivery.
            assert metric(fed.metrics_urls()["us"], "geofed_subscriptions", scope="remote") == 1
            await sub.unsubscribe()
            await subscriber.close()
            await admin.close()

        asyncio.run(scenario())


@st.composite
def _live_runs(draw: st.DrawFn) -> tuple[list[TraceOp], list[Transition]]:
    """Random subscriptions, then publishes with random transition points among them."""
    run = next(_run)
    homes = list(HOMES.values())
    ops: list[TraceOp] = []
    for i in range(draw(st.integers(2, 6))):
        where = draw(st.sampled_from(homes))
        fence = parse_geofence(draw(st.sampled_from(FENCES)))
        topic_filter = draw(st.sampled_from(["a/#", "a/b", "+/b", "#", "a/+"]))
        ops.append(
            TraceOp(0, "subscribe", f"r{run}sub{i}", where, f"r{run}s{i}", topic_filter, fence)
        )
    transitions: list[Transition] = []
    for i in range(draw(st.integers(4, 12))):
        if draw(st.integers(0, 2)) == 0:
            topic_filter = draw(st.sampled_from(["a/#", "a/b", "+/b", "#"]))
            strategy = draw(st.one_of(st.none(), st.sampled_from(list(STRATEGIES))))
            transitions.append(Transition(len(ops), topic_filter, strategy, via="eu"))
        b, where = draw(st.sampled_from(list(HOMES.items())))
        fence = parse_geofence(draw(st.sampled_from(FENCES)))
        topic = draw(st.sampled_from(["a/b", "a/c", "b/b", "a"]))
        ops.append(TraceOp(0, "publish", f"r{run}p-{b}", where, f"r{run}e{i}", topic, fence, 8))
    return ops, transitions


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_live_runs())
def test_random_transition_points_match_oracle_and_cost_model(
    federation: LocalFederation, case: tuple[list[TraceOp], list[Transition]]
) -> None:
    # Changes of random entries (any strategy, or the entry removed) at
    # random points between publishes, each finished before the next action.
    ops, transitions = case
    where = str(federation.federation_path)
    urls = federation.metrics_urls()

    async def scenario() -> tuple[list[tuple[str, str]], Counter[tuple[str, str, str]], dict]:
        r = Replayer(federation.federation, barrier=lambda: wait_quiescent(urls, timeout=WAIT_S))
        admin = await geofed.connect(
            client_id="admin-random", location=HOMES["eu"], federation=where
        )
        start = await admin.strategy_table()
        before = await asyncio.to_thread(federation.sent)
        made_before = await asyncio.to_thread(federation.total, DELIVERIES)
        try:
            for i, op in enumerate(ops):
                for t in transitions:
                    if t.before == i:
                        await _change(federation, admin, t.topic_filter, t.strategy)
                await r.run([op])
            made = await _all_delivered(federation, r, made_before)
            after = await asyncio.to_thread(federation.sent)
        finally:
            await _wind_down(federation, r, admin)
        assert not r.errors, r.errors
        assert r.received == made
        return r.deliveries, after - before, start

    deliveries, sent, start = asyncio.run(scenario())
    assert Counter(deliveries) == Counter(reference_deliveries(ops))
    table = StrategyTable.from_dict(start["table"])
    assert sent == +predict(federation.federation, table, ops, transitions).messages
