"""In-memory federation: N broker cores, no network, exact message accounting.

The client side follows the trace semantics (see `TraceOp`): an action that
carries a location first moves the client there; a client that leaves its
broker's area is redirected, reconnects at the responsible broker and renews
its subscriptions there. Messages between brokers are delivered in FIFO order
before the next action, as if links were instantaneous; only the messages of
a strategy transition may be held back (`hold_transitions`) and released
between actions, to run actions in the middle of a transition's phases.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ._broker import BrokerState, Delivery, Kind, MessageCounts, PeerMessage, Send
from ._errors import GeofedError
from ._federation import Federation
from ._geometry import LatLon
from ._model import Event, Subscription
from ._strategies import strategy_for
from ._table import StrategyTable, Transition
from ._trace import TraceOp


@dataclass
class SimResult(MessageCounts):
    """What a simulated run produced.

    Attributes:
        deliveries: (event id, subscription id) per delivery, in order.
        messages: inter-broker messages by (kind, src, dst).
        payload_bytes: payload bytes carried by event and delivery messages, by (src, dst).
        errors: trace actions that were rejected, with their line numbers.
    """

    deliveries: list[tuple[str, str]] = field(default_factory=list)
    payload_bytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)


@dataclass
class _Client:
    location: LatLon
    home: str
    subs: dict[str, Subscription] = field(default_factory=dict)


class Simulator:
    """Runs trace actions through one `BrokerState` per broker.

    `strategy` is a strategy's name (every topic routed by it) or a per-topic
    `StrategyTable`. With `hold_transitions`, the messages of strategy
    transitions wait on their link (in order) until `release` delivers them,
    so actions can run between a transition's phases; the other messages
    are delivered at once, as always.
    """

    def __init__(
        self,
        federation: Federation,
        strategy: str | StrategyTable,
        *,
        hold_transitions: bool = False,
    ) -> None:
        self.federation = federation
        if isinstance(strategy, str):
            strategy = StrategyTable(strategy_for(strategy, federation).name)
        self.cores = {b.id: BrokerState(b.id, federation, strategy) for b in federation}
        self.result = SimResult()
        self.hold_transitions = hold_transitions
        self.held: dict[tuple[str, str], deque[PeerMessage]] = {}
        """Transition messages waiting, by (src, dst) link."""
        self._clients: dict[str, _Client] = {}
        self._owner: dict[str, str] = {}  # live subscription id -> client

    def run(self, ops: Iterable[TraceOp], transitions: Sequence[Transition] = ()) -> SimResult:
        """Apply every action in order, each transition before its action; return the result."""
        pending = sorted(transitions, key=lambda t: t.before)
        i = -1
        for i, op in enumerate(ops):
            while pending and pending[0].before <= i:
                t = pending.pop(0)
                self.set_strategy(t.topic_filter, t.strategy, t.via)
            self.apply(op)
        for t in pending:
            self.set_strategy(t.topic_filter, t.strategy, t.via)
        return self.result

    def set_strategy(
        self,
        topic_filter: str,
        strategy: str | None,
        via: str | None = None,
        *,
        adaptive: bool = False,
    ) -> None:
        """Ask broker `via` (default: the sequencer) to route `topic_filter` by `strategy`
        (`adaptive`: as the adaptive controller's entry, `BrokerState.propose`).

        Raises:
            InvalidInput: naming ``topic_filter`` or ``strategy``.
        """
        any_core = next(iter(self.cores.values()))
        at = self.cores[any_core.sequencer if via is None else via]
        self._flush(at.id, at.propose(topic_filter, strategy, adaptive=adaptive))

    def release(self, link: tuple[str, str] | None = None) -> bool:
        """Deliver the first held transition message of `link` (default: any link).

        Returns False when nothing was held there.
        """
        if link is None:
            link = next((k for k, q in sorted(self.held.items()) if q), None)
        queue = self.held.get(link) if link is not None else None
        if link is None or not queue:
            return False
        self._drain(self._deliver(link[0], Send(link[1], queue.popleft())))
        return True

    def release_all(self) -> None:
        """Deliver held transition messages until none is left (transitions complete)."""
        while self.release():
            pass

    @property
    def table(self) -> StrategyTable:
        """The newest table a broker routes by."""
        return max((c.table for c in self.cores.values()), key=lambda t: t.epoch)

    def apply(self, op: TraceOp) -> None:
        """Apply one trace action; a rejected action is recorded in `errors`."""
        try:
            self._apply(op)
        except GeofedError as exc:
            self.result.errors.append(f"line {op.line}: {exc}")

    def _apply(self, op: TraceOp) -> None:
        if op.location is not None:
            self._move(op.client, op.location)
        client = self._clients.get(op.client)
        if op.op == "subscribe":
            assert client is not None
            owner = self._owner.get(op.id)
            if owner is not None and owner != op.client:
                raise _Rejected(f"subscription id {op.id!r} is used by client {owner!r}")
            sub = Subscription(op.id, op.client, op.topic, op.geofence, op.roaming)
            self._flush(client.home, self.cores[client.home].subscribe(sub))
            client.subs[op.id] = sub
            self._owner[op.id] = op.client
        elif op.op == "unsubscribe":
            if client is None or op.id not in client.subs:
                raise _Rejected(f"client {op.client!r} has no subscription {op.id!r}")
            self._flush(client.home, self.cores[client.home].unsubscribe(op.client, op.id))
            del client.subs[op.id]
            del self._owner[op.id]
        elif op.op == "publish":
            assert client is not None and op.location is not None
            event = Event(op.id, op.topic, op.location, op.geofence, op.payload_size, op.t)
            out = self.cores[client.home].publish(event)
            self._record(out.deliveries)
            self._flush(client.home, out.sends)

    def _move(self, client_id: str, location: LatLon) -> None:
        client = self._clients.get(client_id)
        if client is None:
            home = self.federation.responsible(location)
            redirect = self.cores[home].connect(client_id, location)
            assert redirect is None
            self._clients[client_id] = _Client(location, home)
            return
        moved = self.cores[client.home].update_location(client_id, location)
        self._flush(client.home, moved.sends)
        client.location = location
        if moved.redirect is None:
            return
        client.home = moved.redirect
        new = self.cores[client.home]
        assert new.connect(client_id, location) is None
        for sub in client.subs.values():
            self._flush(client.home, new.subscribe(sub))

    def _flush(self, src: str, sends: list[Send]) -> None:
        self._drain([(src, s) for s in sends])

    def _drain(self, sends: list[tuple[str, Send]]) -> None:
        queue = deque(sends)
        while queue:
            origin, send = queue.popleft()
            if self.hold_transitions and send.msg.kind is Kind.TRANSITION:
                self.held.setdefault((origin, send.dst), deque()).append(send.msg)
                continue
            queue.extend(self._deliver(origin, send))

    def _deliver(self, origin: str, send: Send) -> list[tuple[str, Send]]:
        """Count one message, apply it at its destination; what that sends in turn."""
        msg = send.msg
        self.result.messages[(msg.kind.value, origin, send.dst)] += 1
        size = getattr(msg, "event", None)
        if size is not None:
            self.result.payload_bytes[(origin, send.dst)] += size.payload_size
        out = self.cores[send.dst].on_message(origin, msg)
        self._record(out.deliveries)
        return [(send.dst, s) for s in out.sends]

    def _record(self, deliveries: list[Delivery]) -> None:
        self.result.deliveries.extend((d.event.id, d.subscription) for d in deliveries)


class _Rejected(GeofedError):
    """A trace action the federation refuses (recorded, not raised)."""


def simulate(
    federation: Federation,
    strategy: str | StrategyTable,
    ops: Iterable[TraceOp],
    transitions: Sequence[Transition] = (),
) -> SimResult:
    """Run a workload through an in-memory federation under `strategy` (a name or a
    per-topic table), changing the table at `transitions`."""
    return Simulator(federation, strategy).run(ops, transitions)
