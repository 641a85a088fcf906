"""The cost model over a whole workload: predicted inter-broker messages.

Computed from the strategies' pure routing answers and a central view of the
subscriptions, without running broker cores: the simulator, the live
federation and the Spark job are checked against these figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._broker import Kind, MessageCounts
from ._federation import Federation
from ._geometry import LatLon
from ._history import HistoryQuery
from ._model import Event, Subscription, content_and_subscription_geocheck, matches
from ._strategies import Strategy, all_strategies, strategy_for
from ._table import StrategyTable, Transition, placement
from ._trace import TraceOp


@dataclass
class CostReport(MessageCounts):
    """Predicted messages for one strategy.

    Attributes:
        messages: by (kind, src, dst).
        lower_bound: per (src, dst), events for which dst hosts a matching subscription.
        events: events published.
    """

    lower_bound: Counter[tuple[str, str]] = field(default_factory=Counter)
    events: int = 0

    @property
    def lower_bound_total(self) -> int:
        """Sum of the per-event lower bounds."""
        return sum(self.lower_bound.values())


def predict(
    federation: Federation,
    strategy: str | Strategy | StrategyTable,
    ops: Iterable[TraceOp],
    transitions: Sequence[Transition] = (),
) -> CostReport:
    """Predict the inter-broker messages `strategy` sends for a workload.

    `strategy` is one strategy for every topic or a per-topic `StrategyTable`;
    each of `transitions` changes the table before its action and runs to
    its end before that action (the simulator without held messages, a live
    federation quiescent around the change; docs/design.md §3).
    """
    if isinstance(strategy, StrategyTable):
        table = strategy
    else:
        strat = strategy if isinstance(strategy, Strategy) else strategy_for(strategy, federation)
        table = StrategyTable(strat.name)
    strategies = all_strategies(federation)
    sequencer = min(federation.ids)
    pending = sorted(transitions, key=lambda t: t.before)
    report = CostReport()
    where: dict[str, LatLon] = {}
    home: dict[str, str] = {}
    subs: dict[str, Subscription] = {}
    by_client: dict[str, dict[str, Subscription]] = {}

    def send(kind: Kind, src: str, dsts: Iterable[str]) -> None:
        for dst in dsts:
            report.messages[(kind.value, src, dst)] += 1

    def place(h: str, sub: Subscription) -> frozenset[str]:
        return placement(strategies, (table,), h, sub)

    def transition(t: Transition) -> None:
        # BrokerState._advance: one PREPARED and one SWITCHED per ordered pair,
        # the copies the new table adds before, those it drops after.
        nonlocal table
        if t.via is not None and t.via != sequencer:
            send(Kind.TRANSITION, t.via, [sequencer])
        new = table.with_entry(t.topic_filter, t.strategy)
        if new.same_routes(table):
            return
        for sub in subs.values():
            h = home[sub.client]
            before, after = place(h, sub), placement(strategies, (new,), h, sub)
            send(Kind.SUBSCRIBE, h, after - before)
            send(Kind.UNSUBSCRIBE, h, before - after)
        for src in federation.ids:
            send(Kind.TRANSITION, src, [d for d in federation.ids if d != src] * 2)
        table = new

    i = -1
    for i, op in enumerate(ops):
        while pending and pending[0].before <= i:
            transition(pending.pop(0))
        if op.location is not None:
            new_home = federation.responsible(op.location)
            old_home = home.get(op.client)
            held = by_client.get(op.client, {})
            if old_home is not None and old_home != new_home:
                # Re-homing: withdrawn at the old broker, renewed at the new one.
                for sub in held.values():
                    send(Kind.UNSUBSCRIBE, old_home, place(old_home, sub))
                    sub = held[sub.id] = subs[sub.id] = sub.placed(op.location)
                    send(Kind.SUBSCRIBE, new_home, place(new_home, sub))
            elif old_home is not None and where[op.client] != op.location:
                # A move within the area: roaming geofences follow (BrokerState._relocate).
                for sub in [s for s in held.values() if s.roaming is not None]:
                    before = place(old_home, sub)
                    sub = held[sub.id] = subs[sub.id] = sub.placed(op.location)
                    after = place(old_home, sub)
                    send(Kind.SUBSCRIBE, old_home, after - before)
                    send(Kind.UNSUBSCRIBE, old_home, before - after)
                    send(Kind.RELOCATE, old_home, before & after)
            where[op.client] = op.location
            home[op.client] = new_home
        if op.op == "subscribe":
            old = subs.get(op.id)
            if old is not None and old.client != op.client:
                continue
            sub = Subscription(op.id, op.client, op.topic, op.geofence, op.roaming)
            sub = sub.placed(where[op.client])
            h = home[op.client]
            targets = place(h, sub)
            send(Kind.SUBSCRIBE, h, targets)
            if old is not None:
                send(Kind.UNSUBSCRIBE, h, place(h, old) - targets)
            subs[op.id] = sub
            by_client.setdefault(op.client, {})[op.id] = sub
        elif op.op == "unsubscribe":
            sub_or_none = by_client.get(op.client, {}).pop(op.id, None)
            if sub_or_none is None:
                continue
            del subs[op.id]
            h = home[op.client]
            send(Kind.UNSUBSCRIBE, h, place(h, sub_or_none))
        elif op.op == "publish":
            assert op.location is not None
            report.events += 1
            origin = home[op.client]
            event = Event(op.id, op.topic, op.location, op.geofence, op.payload_size, op.t)
            strat = strategies[table.strategy_for(event.topic)]
            send(Kind.EVENT, origin, strat.event_targets(origin, event.geofence))
            if strat.matches_at_publisher:
                homes = {
                    home[s.client]
                    for s in subs.values()
                    if content_and_subscription_geocheck(event, s)
                    and origin in place(home[s.client], s)
                }
                send(Kind.DELIVERY, origin, strat.delivery_targets(origin, event.geofence, homes))
            for dst in {
                home[s.client]
                for s in subs.values()
                if home[s.client] != origin and matches(event, s, where[s.client])
            }:
                report.lower_bound[(origin, dst)] += 1
    for t in pending:
        transition(t)
    return report


def history_targets(federation: Federation, query: HistoryQuery) -> frozenset[str]:
    """The brokers a history query asks: those whose area meets the query area.

    An event is logged by the broker responsible for its publisher location,
    so no other broker can hold an answer (docs/design.md §10). The asking
    broker counts itself when it is among them; without an area every broker
    is asked. `len()` of the answer is the metric
    ``geofed_history_brokers_asked_total`` summed over brokers.
    """
    return federation.brokers_meeting(query.area)
