"""The adaptive controller in the node (issue #17, docs/design.md §13 "Where it runs").

Real nodes with ``adaptive`` on and one-second windows: each broker measures its
share of every topic key's window and sends it to the sequencer, which sums the
shares, predicts each strategy's cost with the cost model and switches a key
through the transition protocol when the rule says so.

Traffic that makes subscription forwarding clearly cheaper for ``t/#`` (world-wide
events published in Frankfurt, a subscriber in Tokyo that wants only what is
published near Frankfurt): the controller switches ``t/#`` from event-geofence to
subscription-geofence while events flow, the deliveries equal the oracle's (recall
1, precision 1, no duplicates), and afterwards the messages the nodes count are
the cost model's under the new table. ``p/#`` gets the same traffic but an
operator pinned it with ``set_strategy``: the controller leaves it alone. And
the reverse: a topic whose subscriptions churn world-wide while its events stay
local goes from subscription-geofence to event-geofence, exactly.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from test_strategy_transitions import HOMES, WAIT_S, _all_delivered, _change, _finished, until

import geofed
from geofed.bench import LocalFederation, Replayer, metric, wait_quiescent
from geofed.node import (
    ADAPTIVE_DEFERRED,
    ADAPTIVE_SWITCHES,
    ADAPTIVE_WINDOWS,
    DELIVERIES,
    PEER_CONNECTED,
    SUBSCRIPTIONS,
)
from geofed.routing import StrategyTable, TraceOp, parse_geofence, predict, reference_deliveries

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"

pytestmark = pytest.mark.integration

# Short windows; one window of history and of dwell, any positive saving: the
# test waits for the first switch the rule allows, and the hysteresis still applies.
ADAPTIVE = {
    "GEOFED_ADAPTIVE": "on",
    "GEOFED_ADAPTIVE_CONFIG": json.dumps(
        {"window_s": 1.0, "average_windows": 1, "dwell_windows": 1, "min_saving": 0}
    ),
}
NEAR_EU = parse_geofence({"circle": {"lat": 50.1, "lon": 8.7, "radius_m": 300_000}})
NEAR_AP = parse_geofence({"circle": {"lat": 35.7, "lon": 139.7, "radius_m": 300_000}})


def _subscriptions() -> list[TraceOp]:
    return [
        # Wants what is published near Frankfurt, lives in Tokyo: subscription
        # forwarding sends it one delivery per event, event forwarding every event.
        TraceOp(0, "subscribe", "far", HOMES["ap"], "s-t", "t/x", NEAR_EU),
        TraceOp(0, "subscribe", "far", HOMES["ap"], "s-p", "p/x", NEAR_EU),
        TraceOp(0, "subscribe", "local", HOMES["eu"], "s-local", "#"),  # spans keys
        TraceOp(0, "subscribe", "none", HOMES["us"], "s-none", "t/x", NEAR_AP),  # never matches
    ]


def _publishes(batch: int, topics: tuple[str, ...] = ("t/x", "p/x"), n: int = 4) -> list[TraceOp]:
    return [
        TraceOp(0, "publish", "pub", HOMES["eu"], f"e{batch}-{i}-{topic}", topic, None, 8)
        for i in range(n)
        for topic in topics
    ]


def _entries(state: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return {e["topic_filter"]: e["strategy"] for e in state["table"]["entries"]}


async def _until_switched(
    fed: LocalFederation,
    admin: geofed.Client,
    replayer: Replayer,
    segment: Callable[[int], list[TraceOp]],
    key: str,
    strategy: str,
) -> tuple[list[TraceOp], int]:
    """Replay `segment(0)`, `segment(1)`, … until the controller has switched `key` to
    `strategy` (state, not time) and every broker finished that epoch; the actions
    replayed and the epoch."""
    deadline = time.monotonic() + WAIT_S
    ops: list[TraceOp] = []
    while True:
        seg = segment(len(ops))
        await replayer.run(seg)
        ops += seg
        state = await admin.strategy_table()
        if _entries(state).get(key) == strategy:
            break
        assert time.monotonic() < deadline, f"no switch within {WAIT_S:g}s: {state}"
    epoch = int(state["newest"]["epoch"])
    await until(lambda: _finished(fed, epoch), f"every broker finished epoch {epoch}")
    return ops, epoch


def _churn(topic: str, home: str) -> Callable[[int], list[TraceOp]]:
    """Traffic that makes event forwarding cheaper for `topic`: a world-wide subscription
    made and withdrawn at `home`, between them one event for subscribers near eu."""

    def segment(i: int) -> list[TraceOp]:
        return [
            TraceOp(0, "subscribe", "churn", HOMES[home], f"c{i}", topic),
            TraceOp(0, "publish", "pub", HOMES["eu"], f"e{i}", topic, NEAR_EU, 8),
            TraceOp(0, "unsubscribe", "churn", id=f"c{i}"),
        ]

    return segment


async def _adapt_phase(
    fed: LocalFederation,
    subscriptions: list[TraceOp],
    traffic: Callable[[int], list[TraceOp]],
    key: str,
    strategy: str,
) -> list[TraceOp]:
    """Subscribe, replay `traffic` until the controller switched `key` to `strategy`,
    then withdraw everything; the deliveries must be the oracle's. The actions."""
    # The federation's barrier (it holds across a restart of a broker).
    subs = Replayer(fed.federation, barrier=lambda: fed.quiescent(WAIT_S))
    admin = await geofed.connect(
        client_id="admin", location=HOMES["eu"], federation=str(fed.federation_path)
    )
    ops = list(subscriptions)
    try:
        made_before = await asyncio.to_thread(fed.total, DELIVERIES)
        await subs.run(ops)
        sent_ops, _epoch = await _until_switched(fed, admin, subs, traffic, key, strategy)
        ops += sent_ops
        await fed.quiescent(WAIT_S)
        made = await _all_delivered(fed, subs, made_before)
        assert subs.received == made
    finally:
        for client in (subs, admin):
            await client.close()
        await until(lambda: fed.total(SUBSCRIPTIONS) == 0, "subscriptions withdrawn")
    assert not subs.errors, subs.errors
    expected = reference_deliveries(ops)
    assert expected
    assert Counter(subs.deliveries) == Counter(expected)  # recall 1, precision 1, no dups
    return ops


def test_the_controller_switches_a_topic_exactly_and_leaves_a_pinned_one(tmp_path: Path) -> None:
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=ADAPTIVE) as fed:
        urls = fed.metrics_urls()
        where = str(fed.federation_path)
        sequencer = min(fed.federation.ids)

        async def scenario() -> None:
            subs = Replayer(fed.federation, barrier=lambda: wait_quiescent(urls, timeout=WAIT_S))
            pub = Replayer(fed.federation)  # no barrier: events in flight through the switch
            admin = await geofed.connect(client_id="admin", location=HOMES["us"], federation=where)
            ops = _subscriptions()
            try:
                pinned_epoch = await _change(fed, admin, "p/#", "event-geofence")
                made_before = await asyncio.to_thread(fed.total, DELIVERIES)
                await subs.run(ops)
                sent_ops, epoch = await _until_switched(
                    fed, admin, pub, _publishes, "t/#", "subscription-geofence"
                )
                ops += sent_ops
                batch = len(sent_ops)
                assert epoch > pinned_epoch
                await fed.quiescent(WAIT_S)
                table = StrategyTable.from_dict((await admin.strategy_table())["table"])
                assert dict(table.entries) == {
                    "p/#": "event-geofence",  # pinned by the operator: left alone
                    "t/#": "subscription-geofence",
                }
                assert table.adaptive == {"t/#"}  # shown as the controller's at every broker
                # After the switch: t/x costs what the cost model says under the new table.
                sent_before = await asyncio.to_thread(fed.sent)
                after = _publishes(batch, ("t/x",), n=10)
                await pub.run(after)
                await fed.quiescent(WAIT_S)
                sent = await asyncio.to_thread(fed.sent) - sent_before
                state_ops = _subscriptions()
                model = predict(fed.federation, table, [*state_ops, *after])
                base = predict(fed.federation, table, state_ops)
                assert sent == model.messages - base.messages
                assert sent == Counter({("delivery", "eu", "ap"): 10})
                ops += after
                made = await _all_delivered(fed, subs, made_before)
                assert subs.received == made
            finally:
                for client in (subs, pub, admin):
                    await client.close()
                await until(lambda: fed.total(SUBSCRIPTIONS) == 0, "subscriptions withdrawn")
            assert not subs.errors and not pub.errors, subs.errors + pub.errors
            expected = reference_deliveries(ops)
            # recall 1, precision 1, no duplicates: through the switch and after it
            assert Counter(subs.deliveries) == Counter(expected)
            assert any(sid == "s-t" for _e, sid in expected)

        asyncio.run(scenario())
        assert metric(urls[sequencer], ADAPTIVE_SWITCHES, strategy="subscription-geofence") == 1
        assert fed.total(ADAPTIVE_SWITCHES) == 1  # t/# once; p/# never
        assert all(metric(u, ADAPTIVE_WINDOWS) >= 1 for u in urls.values())


def test_the_controller_moves_a_churning_topic_back_to_event_forwarding(tmp_path: Path) -> None:
    # The reverse direction: under subscription-geofence every world-wide
    # subscription made or withdrawn at ap costs a copy at each other broker, and
    # the events (published at eu for subscribers near eu) would cost nothing
    # under event-geofence: the controller switches a/# there, exactly.
    with LocalFederation(THREE, "subscription-geofence", tmp_path, extra_env=ADAPTIVE) as fed:
        local = [TraceOp(0, "subscribe", "local", HOMES["eu"], "s-local", "a/x")]
        asyncio.run(_adapt_phase(fed, local, _churn("a/x", "ap"), "a/#", "event-geofence"))
        assert fed.total(ADAPTIVE_SWITCHES) == 1
        sequencer = fed.metrics_urls()[min(fed.federation.ids)]
        assert metric(sequencer, ADAPTIVE_SWITCHES, strategy="event-geofence") == 1


def test_the_controller_waits_while_a_link_of_the_sequencer_is_down(tmp_path: Path) -> None:
    # The link between the sequencer (ap) and us is cut: the rule asks for the
    # switch but the controller defers it (a transition would wait for us); once
    # the link is back it switches, and the deliveries are exact throughout.
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=ADAPTIVE, links=True) as fed:
        urls = fed.metrics_urls()
        where = str(fed.federation_path)
        sequencer = min(fed.federation.ids)
        link = fed.link(sequencer, "us")

        async def scenario() -> None:
            subs = Replayer(fed.federation, barrier=lambda: wait_quiescent(urls, timeout=WAIT_S))
            pub = Replayer(fed.federation)
            admin = await geofed.connect(client_id="admin", location=HOMES["eu"], federation=where)
            ops = [
                _subscriptions()[0],
                TraceOp(0, "subscribe", "local", HOMES["eu"], "s-local", "t/#"),
            ]
            try:
                made_before = await asyncio.to_thread(fed.total, DELIVERIES)
                await subs.run(ops)
                link.partition()
                await until(
                    lambda: metric(urls[sequencer], PEER_CONNECTED, peer="us") == 0,
                    "the sequencer's link to us is down",
                )
                deadline = time.monotonic() + WAIT_S
                while await asyncio.to_thread(metric, urls[sequencer], ADAPTIVE_DEFERRED) < 1:
                    seg = _publishes(len(ops), ("t/x",))
                    await pub.run(seg)
                    ops += seg
                    assert time.monotonic() < deadline, "the rule never asked for the switch"
                assert "t/#" not in _entries(await admin.strategy_table())
                link.heal()
                sent_ops, _epoch = await _until_switched(
                    fed,
                    admin,
                    pub,
                    lambda i: _publishes(len(ops) + i, ("t/x",)),
                    "t/#",
                    "subscription-geofence",
                )
                ops += sent_ops
                await fed.quiescent(WAIT_S)
                made = await _all_delivered(fed, subs, made_before)
                assert subs.received == made
            finally:
                for client in (subs, pub, admin):
                    await client.close()
            assert not subs.errors and not pub.errors, subs.errors + pub.errors
            assert Counter(subs.deliveries) == Counter(reference_deliveries(ops))

        asyncio.run(scenario())
        assert fed.total(ADAPTIVE_SWITCHES) == 1


@pytest.mark.parametrize("durable", [True, False], ids=["from-its-store", "from-its-peers"])
def test_a_restarted_sequencer_knows_which_entries_are_the_controllers(
    tmp_path: Path, durable: bool
) -> None:
    # The controller switches t/#, the sequencer restarts (from its store, or with
    # nothing and learns the table from its peers), and t/# is still the controller's
    # (not taken for an operator's pin): when the traffic turns, the restarted
    # sequencer switches it back.
    with LocalFederation(
        THREE, "event-geofence", tmp_path, extra_env=ADAPTIVE, durable=durable
    ) as fed:
        sequencer = min(fed.federation.ids)
        far = [_subscriptions()[0]]
        publishes = functools.partial(_publishes, topics=("t/x",))
        asyncio.run(_adapt_phase(fed, far, publishes, "t/#", "subscription-geofence"))
        fed.stop_node(sequencer)
        fed.start_node(sequencer)
        fed.wait_ready(WAIT_S)
        local = [TraceOp(0, "subscribe", "local", HOMES["eu"], "s-local", "t/x")]
        asyncio.run(_adapt_phase(fed, local, _churn("t/x", "us"), "t/#", "event-geofence"))
        assert metric(fed.metrics_urls()[sequencer], ADAPTIVE_SWITCHES) == 1  # since the restart
