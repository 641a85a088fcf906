"""The broker's routing state machine: pure, synchronous, no I/O.

`BrokerState` holds what one broker knows (client sessions, local and remote
subscriptions) and turns client actions and peer messages into local
deliveries and messages for other brokers. The node drives it from gRPC; the
simulator drives N of them over in-memory queues. Both therefore send exactly
the same messages for the same inputs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

from ._errors import InvalidInput, NotFound, WrongBroker
from ._federation import Federation
from ._geometry import LatLon, covers
from ._index import SubscriptionIndex
from ._model import Event, SubKey, Subscription, matches
from ._schemes import LastMile, Scheme, TransitionReport
from ._strategies import Strategy, all_strategies
from ._table import StrategyTable, placement

if TYPE_CHECKING:  # the meter's module imports this one
    from ._adaptive import KeyWindow, ShareMeter


class Kind(StrEnum):
    """Kinds of inter-broker messages (metric label ``kind``)."""

    EVENT = "event"
    SUBSCRIBE = "subscribe"
    UNSUBSCRIBE = "unsubscribe"
    RELOCATE = "relocate"
    DELIVERY = "delivery"
    TRANSITION = "transition"
    CONTROL = "control"


@dataclass(frozen=True, slots=True)
class EventMsg:
    """An event forwarded for matching at the receiving broker."""

    event: Event
    kind = Kind.EVENT


@dataclass(frozen=True, slots=True)
class SubscribeMsg:
    """A subscription (or its new version) made at broker `home`."""

    sub: Subscription
    home: str
    kind = Kind.SUBSCRIBE


@dataclass(frozen=True, slots=True)
class UnsubscribeMsg:
    """Withdrawal of a subscription (by key: client, id) made at broker `home`."""

    key: SubKey
    home: str
    kind = Kind.UNSUBSCRIBE


@dataclass(frozen=True, slots=True)
class RelocateMsg:
    """The subscriber of a roaming subscription (by key) held here moved: place it at `at`.

    Sent by its broker `home` to the brokers that hold a copy before and after
    the move; smaller than a new version of the subscription (docs/design.md §3).
    """

    key: SubKey
    home: str
    at: LatLon
    kind = Kind.RELOCATE


@dataclass(frozen=True, slots=True)
class DeliveryMsg:
    """An event matched at the publisher's broker, for these subscriptions (by key).

    `world`, when set, is the leading part of `subs`: the topic's world-wide
    subscriptions at the receiving broker, the same tuple (the index's cache)
    for every event of the topic, so that their encoding is joined once
    (`geofed.wire`). It changes nothing the message means: on the wire the
    subscriptions are one list.
    """

    event: Event
    subs: tuple[SubKey, ...]
    world: tuple[SubKey, ...] = field(default=(), compare=False, repr=False)
    kind = Kind.DELIVERY


class Phase(IntEnum):
    """How far a broker has taken the transition to a table's epoch (docs/design.md §3)."""

    KNOWN = 0
    """It knows the table (and passes it on), nothing more."""
    PREPARED = 1
    """Its subscriptions are placed for the old and the new table alike."""
    SWITCHED = 2
    """It routes its events by the new table."""


@dataclass(frozen=True, slots=True)
class TableMsg:
    """The sender reached `phase` of the transition to `table` (and every earlier one)."""

    table: StrategyTable
    phase: Phase
    kind = Kind.TRANSITION


@dataclass(frozen=True, slots=True)
class ProposeMsg:
    """A change of the strategy table asked for at another broker, for the sequencer.

    `strategy` None removes the entry of `topic_filter`.
    """

    topic_filter: str
    strategy: str | None
    kind = Kind.TRANSITION


@dataclass(frozen=True, slots=True)
class ReportMsg:
    """The sender's share of its last adaptive-controller window, for the sequencer (§13).

    Control traffic: the node sends it and the sequencer's controller takes it;
    the broker core ignores it, and the cost model leaves it out.
    """

    window: int
    shares: tuple[KeyWindow, ...]
    kind = Kind.CONTROL


@dataclass(frozen=True, slots=True)
class FlushMsg:
    """A handover flush (docs/design.md §7): a request, or the reply to request `token`.

    Control traffic between nodes: the broker core ignores it, and the cost
    model leaves it out.
    """

    token: int
    reply: bool
    kind = Kind.CONTROL


@dataclass(frozen=True, slots=True)
class HandoffMsg:
    """A persistent subscription's queue, moved with its client by a handover (§7).

    Sent by the broker the client left to its new broker, which queues the
    deliveries for the subscription `key` there (with its own offsets).
    `deliveries` are the queued deliveries as the client protocol encodes them
    (``geofed.v1.Delivery``), oldest first: the broker core never reads them.
    `id` is unique per sending broker, so that a resent handoff is taken once.
    Control traffic: the cost model leaves it out.
    """

    id: str
    key: SubKey
    deliveries: tuple[bytes, ...]
    kind = Kind.CONTROL


@dataclass(frozen=True, slots=True)
class SessionMsg:
    """A persistent session moving with its client (§7): sent by the broker the client left
    to its new broker, before the client is told to go there.

    The receiver opens the session for `client` at `at` (owned by `owner`, kept for
    `expiry_s` without a connection) with these subscriptions, and answers with a
    flush reply (`FlushMsg(token, reply=True)`) once its peers have applied them.
    `qos` is the MQTT QoS granted to subscriptions made over MQTT, by subscription id.
    `queued` names, per subscription id, events the sender queued for it since the
    session came there: a receiver that still holds the session (the client came back
    before it let go) drops them from its queue, as the client gets them from the sender.
    Control traffic: the broker core never sees it, and the cost model leaves it out.
    """

    token: int
    client: str
    owner: str
    at: LatLon
    expiry_s: float
    subs: tuple[Subscription, ...]
    qos: tuple[tuple[str, int], ...] = ()
    queued: tuple[tuple[str, tuple[str, ...]], ...] = ()
    kind = Kind.CONTROL


PeerMessage = (
    EventMsg
    | SubscribeMsg
    | UnsubscribeMsg
    | RelocateMsg
    | DeliveryMsg
    | TableMsg
    | ProposeMsg
    | ReportMsg
    | FlushMsg
    | HandoffMsg
    | SessionMsg
)


def once_id(msg: PeerMessage) -> str | None:
    """The id by which a peer takes a message once (its duplicate window), a sender's
    outbox keeps it and a broken link resends it: the event's of an event or delivery,
    a handoff's own; None for the others, which are not resent as they are (a new
    session's snapshot and table state repair their loss)."""
    if isinstance(msg, EventMsg | DeliveryMsg):
        return msg.event.id
    if isinstance(msg, HandoffMsg):
        return msg.id
    return None


MessageKey = tuple[str, str, str]
"""(kind, src broker, dst broker)."""


@dataclass
class MessageCounts:
    """Inter-broker messages by (kind, src, dst), with the usual totals."""

    messages: Counter[MessageKey] = field(default_factory=Counter)

    def by_kind(self) -> Counter[str]:
        """Message totals per kind."""
        out: Counter[str] = Counter()
        for (kind, _, _), n in self.messages.items():
            out[kind] += n
        return out

    @property
    def total_messages(self) -> int:
        """All inter-broker messages."""
        return sum(self.messages.values())


@dataclass(frozen=True, slots=True)
class Send:
    """One logical message to one destination broker."""

    dst: str
    msg: PeerMessage


@dataclass(frozen=True, slots=True)
class Delivery:
    """An event handed to a local subscriber."""

    event: Event
    subscription: str
    client: str
    scheme: Scheme = Scheme.EXACT  # the filter scheme that matched it (docs/design.md §14)


@dataclass(slots=True)
class Outcome:
    """What a step produced: deliveries here and messages to other brokers."""

    deliveries: list[Delivery] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)


@dataclass(slots=True)
class Moved:
    """Result of a location update.

    Attributes:
        redirect: the responsible broker's id if the client left this area.
        sends: messages withdrawing the client's subscriptions (on redirect).
        dropped: the subscriptions the client must renew at `redirect`.
    """

    redirect: str | None = None
    sends: list[Send] = field(default_factory=list)
    dropped: list[Subscription] = field(default_factory=list)


class BrokerState:
    """The routing state machine of one broker: what it holds and what it decides.

    Pure and synchronous: sessions, local and remote subscriptions, and for
    each client action or peer message the deliveries to make here and the
    messages to send (`Outcome`). `geofed.node.BrokerServer` runs one behind
    its gRPC services; the simulator runs one per `BrokerInfo` in memory.
    """

    def __init__(
        self, broker_id: str, federation: Federation, strategy: Strategy | StrategyTable
    ) -> None:
        federation.broker(broker_id)  # raises NotFound for an unknown id
        self.id = broker_id
        self.federation = federation
        self.strategies = all_strategies(federation)
        self.table = (
            strategy if isinstance(strategy, StrategyTable) else StrategyTable(strategy.name)
        )
        """The table this broker routes its events by."""
        self.placing: tuple[StrategyTable, ...] = (self.table,)
        """The tables its subscriptions are placed for: during a transition the old and the new."""
        self._future: dict[int, StrategyTable] = {}
        self._progress: dict[str, tuple[int, Phase]] = {}
        self.peers = tuple(b for b in federation.ids if b != broker_id)
        self.sequencer = min(federation.ids)
        self.sessions: dict[str, LatLon] = {}
        self.local = SubscriptionIndex()
        self.remote = SubscriptionIndex()
        """Remote subscriptions: per key the copy of one home (`remote_home`), the one that
        announced it last among those that have not withdrawn it."""
        self._remote_home: dict[SubKey, str] = {}
        # Copies of other homes not withdrawn yet, by key, oldest announcement
        # first: the subscriber moved, and that home's withdrawal is on its way.
        self._shadowed: dict[SubKey, dict[str, Subscription]] = {}
        self._client_subs: dict[str, dict[str, Subscription]] = defaultdict(dict)
        # The last mile: how local subscriptions are matched (docs/design.md §14).
        # Its EXACT state is `local` itself, which routing keeps anyway.
        self.last_mile = LastMile(Scheme.EXACT, exact=self.local)
        self.audit_every = 16  # recall audit: the exact matcher on one event in this many
        self._audit_count = 0
        self.meter: ShareMeter | None = None
        """With the adaptive controller on: measures this broker's share (docs/design.md §13)."""

    # -- client side -----------------------------------------------------

    def connect(self, client: str, location: LatLon) -> str | None:
        """Open a session; return the responsible broker if not this one.

        A client that already has a session here reports a new location with
        `update_location` (its roaming geofences move, which may send messages).
        """
        owner = self.federation.responsible(location)
        if owner != self.id:
            return owner
        if client in self.sessions and self.sessions[client] != location:
            raise ValueError(f"client {client!r} has a session: update_location moves it")
        self.sessions[client] = location
        return None

    def update_location(self, client: str, location: LatLon) -> Moved:
        """Record a client's new location; redirect it if it left this area.

        Location updates never cross regions. When the client leaves, its
        session ends here and its subscriptions are withdrawn (they follow
        their own path), to be renewed at the responsible broker.
        """
        self._session(client)
        owner = self.federation.responsible(location)
        if owner == self.id:
            return Moved(sends=self._relocate(client, location))
        moved = Moved(redirect=owner)
        for sub in list(self._client_subs.get(client, {}).values()):
            moved.sends.extend(self.unsubscribe(client, sub.id))
            moved.dropped.append(sub)
        self.disconnect(client)
        return moved

    def subscriptions_of(self, client: str) -> list[Subscription]:
        """The client's local subscriptions."""
        return list(self._client_subs.get(client, {}).values())

    def disconnect(self, client: str) -> list[Send]:
        """End a session and withdraw its remaining subscriptions."""
        sends: list[Send] = []
        for sub_id in list(self._client_subs.get(client, {})):
            sends.extend(self.unsubscribe(client, sub_id))
        self._client_subs.pop(client, None)
        self.sessions.pop(client, None)
        return sends

    def subscribe(self, sub: Subscription) -> list[Send]:
        """Add or change a local subscription; return the messages it causes.

        A subscription is known by its client and id (`Subscription.key`):
        the same id of another client is another subscription. Changing a
        geofence sends the new version along its new path and withdraws it
        where the new path no longer goes.
        """
        sub = sub.placed(self._session(sub.client))
        old = self.local.get(sub.key)
        self.local.add(sub)
        self.last_mile.add(sub)
        self._client_subs[sub.client][sub.id] = sub
        targets = self._placement(sub)
        sends = [Send(dst, SubscribeMsg(sub, self.id)) for dst in sorted(targets)]
        if old is not None:
            gone = self._placement(old) - targets
            sends.extend(Send(dst, UnsubscribeMsg(sub.key, self.id)) for dst in sorted(gone))
        if self.meter is not None:
            self.meter.subscribed(self, sub, old)
        return sends

    def unsubscribe(self, client: str, sub_id: str) -> list[Send]:
        """Remove a client's subscription; return the withdrawal messages.

        Raises:
            NotFound: if the client has no subscription with that id.
        """
        sub = self._client_subs.get(client, {}).get(sub_id)
        if sub is None:
            raise NotFound("subscription", sub_id)
        del self._client_subs[client][sub_id]
        self.local.remove(sub.key)
        self.last_mile.remove(sub.key)
        targets = self._placement(sub)
        if self.meter is not None:
            self.meter.unsubscribed(self, sub)
        return [Send(dst, UnsubscribeMsg(sub.key, self.id)) for dst in sorted(targets)]

    def publish(self, event: Event) -> Outcome:
        """Match an event published here and route it on.

        Raises:
            WrongBroker: if another broker is responsible for the publisher's
                location (the client must publish there).
        """
        return self.publish_many([event])[0]

    def publish_many(self, events: Sequence[Event]) -> list[Outcome]:
        """`publish` for each event of a batch, in order: what each alone would give.

        The subscription indexes test the geometry of the whole batch in one
        go (`SubscriptionIndex.match_many`), which costs less per event.

        Raises:
            WrongBroker: for the first event another broker is responsible
                for; then no event is matched.
        """
        for event in events:
            self.check_publisher(event)
        out = [Outcome(deliveries=d) for d in self._match_local_many(events)]
        # Per event, its remote subscriptions matched by home (None: routed as an event).
        homes: list[dict[str, tuple[SubKey, ...]] | None] = [None] * len(events)
        remote: list[tuple[int, frozenset[str]]] = []  # events to match against remote subs
        for i, event in enumerate(events):
            strategy = self.strategy_for(event.topic)
            if strategy.matches_at_publisher:
                homes[i] = {}
                # Only brokers whose area meets the event geofence can get a
                # delivery: when there is none, remote subscriptions need no match.
                reachable = strategy.delivery_targets(self.id, event.geofence, self.federation.ids)
                if reachable:
                    remote.append((i, reachable))
            else:
                for dst in sorted(strategy.event_targets(self.id, event.geofence)):
                    out[i].sends.append(Send(dst, EventMsg(event)))
        if remote:
            # Remote subscriptions are indexed by home (`on_message`), so the
            # index answers with sorted keys per home.
            points = [(events[i].topic, events[i].location) for i, _ in remote]
            for (i, reachable), by_home in zip(
                remote, self.remote.match_groups_many(points), strict=True
            ):
                homes[i] = by_home
                # Each home's keys start with the topic's world block, whose encoding is cached.
                world = self.remote.world_groups(events[i].topic) if by_home else {}
                for dst in sorted(by_home):
                    if dst in reachable:
                        msg = DeliveryMsg(events[i], by_home[dst], world.get(dst, ()))
                        out[i].sends.append(Send(dst, msg))
        if self.meter is not None:
            for event, matched in zip(events, homes, strict=True):
                self.meter.published(self, event, matched)
        return out

    def check_publisher(self, event: Event, field: str = "event.publisher") -> None:
        """Raise `WrongBroker` (naming `field`) unless this broker is the event's local broker."""
        owner = self.federation.responsible(event.location)
        if owner != self.id:
            raise WrongBroker(field, owner, self.federation.broker(owner).client_endpoint)

    # -- peer side -------------------------------------------------------

    def on_message(self, src: str, msg: PeerMessage) -> Outcome:
        """Apply a message from broker `src`."""
        if isinstance(msg, EventMsg):
            if self.meter is not None:
                self.meter.received(self, src, msg.event)
            return Outcome(deliveries=self._match_local(msg.event))
        if isinstance(msg, DeliveryMsg):
            return Outcome(deliveries=self._deliver(msg))
        if isinstance(msg, SubscribeMsg):
            if msg.sub.roaming is not None and msg.sub.geofence is None:
                raise ValueError(f"roaming subscription {msg.sub.key} arrived unplaced")
            self._hold(msg.sub, msg.home)
        elif isinstance(msg, RelocateMsg):
            # Only the copy from that home moves (another home's stays as it is).
            held = self.remote_copy(msg.key, msg.home)
            if held is not None:
                self._hold(held.placed(msg.at), msg.home, announced=False)
        elif isinstance(msg, UnsubscribeMsg):
            self._drop(msg.key, msg.home)
        elif isinstance(msg, TableMsg):
            return Outcome(sends=self._on_table(src, msg))
        elif isinstance(msg, ProposeMsg):
            return Outcome(sends=self.propose(msg.topic_filter, msg.strategy))
        return Outcome()

    def snapshot_for(self, peer: str) -> list[SubscribeMsg]:
        """Every local subscription `peer` must hold: re-sent after a reconnect."""
        return [SubscribeMsg(sub, self.id) for sub in self.local if peer in self._placement(sub)]

    def replace_remote(self, src: str, snapshot: list[SubscribeMsg]) -> None:
        """Replace everything held from `src` by its snapshot."""
        held = [key for key, home in self._remote_home.items() if home == src]
        shadowed = [key for key, homes in self._shadowed.items() if src in homes]
        for key in (*held, *shadowed):
            self._drop(key, src)
        for msg in snapshot:
            self.on_message(src, msg)

    def remote_home(self, key: SubKey) -> str | None:
        """The home broker of the copy of a remote subscription that matching uses here."""
        return self._remote_home.get(key)

    def remote_copy(self, key: SubKey, home: str) -> Subscription | None:
        """The copy of a remote subscription that broker `home` announced and has not
        withdrawn, whether matching uses it or not."""
        if self._remote_home.get(key) == home:
            return self.remote.get(key)
        return self._shadowed.get(key, {}).get(home)

    def _hold(self, sub: Subscription, home: str, *, announced: bool = True) -> None:
        """Keep `home`'s copy of a remote subscription. Announced (a new version), it is
        the copy matching uses; moved (`announced` false), it keeps its rank.

        Why per home: a subscriber that moves A -> B -> A makes B announce and
        withdraw between A's withdrawal and A's renewal, and the links from A
        and from B deliver in their own time. Kept per home, each home's last
        word stands whatever the interleaving: B's late announcement does not
        replace A's renewal for good, and B's withdrawal removes B's copy only.
        """
        key = sub.key
        current = self._remote_home.get(key)
        if current is not None and current != home:
            if not announced:
                self._shadowed[key][home] = sub
                return
            held = self.remote.get(key)
            assert held is not None  # the index holds the current home's copy
            self._shadowed.setdefault(key, {})[current] = held
        self._unshadow(key, home)
        self.remote.add(sub, home)
        self._remote_home[key] = home

    def _drop(self, key: SubKey, home: str) -> None:
        """Forget `home`'s copy of a remote subscription (the newest other copy, if
        any, becomes the one matching uses)."""
        if self._remote_home.get(key) != home:
            self._unshadow(key, home)
            return
        self.remote.remove(key)
        del self._remote_home[key]
        others = self._shadowed.get(key)
        if others:
            newest = next(reversed(others))
            self._hold(others[newest], newest)

    def _unshadow(self, key: SubKey, home: str) -> None:
        """`home`'s copy of `key` is no longer one set aside (an empty set goes)."""
        others = self._shadowed.get(key)
        if others is not None:
            others.pop(home, None)
            if not others:
                del self._shadowed[key]

    # -- strategy per topic and transitions (docs/design.md §3) -----------

    def strategy_for(self, topic: str) -> Strategy:
        """The strategy that routes this broker's events on `topic` now."""
        return self.strategies[self.table.strategy_for(topic)]

    @property
    def newest_table(self) -> StrategyTable:
        """The newest table this broker knows (in force, in transition or waiting)."""
        if self._future:
            return self._future[max(self._future)]
        return self.placing[-1]

    @property
    def progress(self) -> tuple[int, Phase]:
        """(epoch, phase) this broker reached: SWITCHED of the epoch it routes by,
        or PREPARED of the next one while it places for both."""
        if self.table is not self.placing[-1]:
            return (self.placing[-1].epoch, Phase.PREPARED)
        return (self.table.epoch, Phase.SWITCHED)

    @property
    def in_transition(self) -> bool:
        """Whether a transition is under way here (or waits to start)."""
        return len(self.placing) > 1 or bool(self._future)

    def propose(
        self, topic_filter: str, strategy: str | None, *, adaptive: bool = False
    ) -> list[Send]:
        """Ask for `topic_filter` to be routed by `strategy` (None: by the table's other entries).

        The sequencer (the broker whose id sorts first) numbers every change,
        one epoch each, on top of the newest table it knows; any other broker
        passes the proposal to it. A change that changes nothing makes no epoch.
        `adaptive` marks the entry as the adaptive controller's, which runs at
        the sequencer (§13); a proposal from elsewhere is an operator's.

        Raises:
            InvalidInput: naming ``topic_filter`` or ``strategy``.
        """
        table = self.newest_table.with_entry(topic_filter, strategy, adaptive=adaptive)
        if self.id != self.sequencer:
            assert not adaptive, "the adaptive controller runs at the sequencer"
            return [Send(self.sequencer, ProposeMsg(topic_filter, strategy))]
        if table.same_entries(self.newest_table):
            return []
        self._future[table.epoch] = table
        return self._advance()

    def table_messages(self) -> list[TableMsg]:
        """What a peer must hear when a link (re)starts: the tables known beyond
        the one in force, and this broker's progress (sent after the snapshot)."""
        out = [TableMsg(t, Phase.KNOWN) for _, t in sorted(self._future.items())]
        epoch, phase = self.progress
        current = self.placing[-1]
        assert current.epoch == epoch
        return [TableMsg(current, phase), *out]

    def adopt(self, table: StrategyTable) -> list[Send]:
        """Take `table` as the one in force, skipping the epochs in between.

        For a broker that lost its table (a restart without a data dir) and
        hears from a peer that every broker has finished the transition to
        `table` (the peer routes by it and is past it, §6): its own
        subscriptions move to the new placement at once. An older or equal
        table changes nothing.
        """
        if table.epoch <= self.newest_table.epoch:
            return []
        old = self.placing
        self.table = table
        self.placing = (table,)
        self._future.clear()
        return self._replace_placement(old, self.placing)

    def transition_state(self) -> dict[str, Any]:
        """What a durable node keeps of its tables (JSON-ready; peers' progress is re-sent)."""
        return {
            "placing": [t.to_dict() for t in self.placing],
            "switched": self.table is self.placing[-1],
            "future": [t.to_dict() for _, t in sorted(self._future.items())],
        }

    def restore_transition_state(self, data: dict[str, Any]) -> None:
        """Take back `transition_state` after a restart, before any subscription is restored.

        Raises:
            InvalidInput: naming the part of `data` that is wrong.
        """
        placing = data.get("placing")
        if not isinstance(placing, list) or len(placing) not in (1, 2):
            raise InvalidInput("strategy_state.placing", "must list one or two tables")
        tables = tuple(StrategyTable.from_dict(t) for t in placing)
        future = [StrategyTable.from_dict(t) for t in data.get("future", [])]
        self.placing = tables
        self.table = tables[-1] if data.get("switched", True) else tables[0]
        self._future = {t.epoch: t for t in future}

    def forget_progress(self, peer: str) -> None:
        """A new session with `peer` starts: it states its progress again after its snapshot.

        It may have gone back (a restart without a data dir); until then no
        transition counts on what it said before.
        """
        self._progress.pop(peer, None)

    def _on_table(self, src: str, msg: TableMsg) -> list[Send]:
        table = msg.table
        if table.epoch > self.placing[-1].epoch:
            self._future.setdefault(table.epoch, table)
        if msg.phase > Phase.KNOWN:
            reached = (table.epoch, msg.phase)
            self._progress[src] = max(self._progress.get(src, reached), reached)
        return self._advance()

    def _peers_reached(self, epoch: int, phase: Phase) -> bool:
        return all(self._progress.get(p, (0, Phase.KNOWN)) >= (epoch, phase) for p in self.peers)

    def _advance(self) -> list[Send]:
        """Take the transitions as far as the peers' progress allows.

        1. prepare epoch e+1 (when e is finished here and its table is known):
           place every local subscription for both tables, then tell every
           peer PREPARED — behind those subscriptions on each link;
        2. switch: once every peer is PREPARED, each one holds the copies the
           new table needs, so events go by it; tell every peer SWITCHED;
        3. finish: once every peer has SWITCHED, no broker routes by the old
           table, so the copies only it needed are withdrawn.
        """
        sends: list[Send] = []
        while True:
            if len(self.placing) == 1:
                new = self._future.pop(self.table.epoch + 1, None)
                if new is None:
                    return sends
                old: tuple[StrategyTable, ...] = self.placing
                self.placing = (self.table, new)
                sends += self._replace_placement(old, self.placing)
                sends += self._tell(TableMsg(new, Phase.PREPARED))
            elif self.table is not self.placing[-1]:
                new = self.placing[-1]
                if not self._peers_reached(new.epoch, Phase.PREPARED):
                    return sends
                self.table = new
                sends += self._tell(TableMsg(new, Phase.SWITCHED))
            else:
                if not self._peers_reached(self.table.epoch, Phase.SWITCHED):
                    return sends
                old = self.placing
                self.placing = (self.table,)
                sends += self._replace_placement(old, self.placing)

    def _tell(self, msg: PeerMessage) -> list[Send]:
        return [Send(p, msg) for p in self.peers]

    def _replace_placement(
        self, old: tuple[StrategyTable, ...], new: tuple[StrategyTable, ...]
    ) -> list[Send]:
        """Subscribe where the new placement reaches and the old did not; withdraw the reverse."""
        sends: list[Send] = []
        for sub in sorted(self.local, key=lambda s: s.key):
            before = placement(self.strategies, old, self.id, sub)
            after = placement(self.strategies, new, self.id, sub)
            sends += [Send(d, SubscribeMsg(sub, self.id)) for d in sorted(after - before)]
            sends += [Send(d, UnsubscribeMsg(sub.key, self.id)) for d in sorted(before - after)]
        return sends

    def _placement(self, sub: Subscription) -> frozenset[str]:
        return placement(self.strategies, self.placing, self.id, sub)

    # -- internals -------------------------------------------------------

    def _relocate(self, client: str, location: LatLon) -> list[Send]:
        """The client moved within this area: its roaming geofences move with it.

        Each one is placed at the new location. A broker its old placement
        did not reach but the new one does gets the subscription, one it no
        longer reaches an unsubscription, and one that holds a copy before
        and after a `RelocateMsg`; fixed geofences and an unchanged location
        send nothing.
        """
        old_at = self.sessions[client]
        self.sessions[client] = location
        if location == old_at:
            return []
        sends: list[Send] = []
        for sub in list(self._client_subs.get(client, {}).values()):
            if sub.roaming is None:
                continue
            new = sub.placed(location)
            self.local.add(new)
            self.last_mile.add(new)
            self._client_subs[client][sub.id] = new
            before = self._placement(sub)
            after = self._placement(new)
            if self.meter is not None:
                self.meter.relocated(self, sub, new)
            for dst in sorted(before | after):
                msg: PeerMessage
                if dst not in before:
                    msg = SubscribeMsg(new, self.id)
                elif dst not in after:
                    msg = UnsubscribeMsg(new.key, self.id)
                else:
                    msg = RelocateMsg(new.key, self.id, location)
                sends.append(Send(dst, msg))
        return sends

    def _session(self, client: str) -> LatLon:
        try:
            return self.sessions[client]
        except KeyError:
            raise NotFound("client session", client) from None

    def _match_local(self, event: Event) -> list[Delivery]:
        return self._match_local_many([event])[0]

    def _match_local_many(self, events: Sequence[Event]) -> list[list[Delivery]]:
        scheme = self.last_mile.scheme
        found = []
        for event, keys in zip(
            events, self.last_mile.match_many(events, self.sessions.get), strict=True
        ):
            if scheme is not Scheme.EXACT:
                self._observe(event, keys, None)
            out = [Delivery(event, sub_id, client, scheme) for client, sub_id in keys]
            out.sort(key=lambda d: (d.subscription, d.client))
            found.append(out)
        return found

    def _deliver(self, msg: DeliveryMsg) -> list[Delivery]:
        out: list[Delivery] = []
        scheme = self.last_mile.scheme
        for key in msg.subs:
            sub = self.local.get(key)
            if sub is None:
                continue  # withdrawn while the event was in flight
            where = self.sessions.get(sub.client)
            if where is None:
                continue
            if scheme is Scheme.EXACT:
                if covers(msg.event.geofence, where):
                    out.append(Delivery(msg.event, sub.id, sub.client))
            elif self.last_mile.accepts(msg.event, key, where):
                out.append(Delivery(msg.event, sub.id, sub.client, scheme))
        if scheme is not Scheme.EXACT:
            self._observe(msg.event, [(d.client, d.subscription) for d in out], msg.subs)
        return out

    def _observe(self, event: Event, keys: list[SubKey], listed: tuple[SubKey, ...] | None) -> None:
        """Recall and precision of an approximate scheme (docs/design.md §14).

        Every delivery is checked with the exact predicate (one check each);
        on one event in `audit_every` the exact matcher runs too, for recall.
        For a delivery message only the subscriptions it lists are candidates:
        the publisher's broker matched the rest of the federation exactly.
        """
        sessions = self.sessions
        false = 0
        for k in keys:
            sub, where = self.local.get(k), sessions.get(k[0])
            if sub is None or where is None or not matches(event, sub, where):
                false += 1
        self._audit_count += 1
        exact: list[SubKey] | None = None
        if self._audit_count >= self.audit_every:
            self._audit_count = 0
            if listed is None:
                candidates = self.local.match(event.topic, event.location)
            else:
                candidates = [s for k in listed if (s := self.local.get(k)) is not None]
            exact = []
            for sub in candidates:
                where = sessions.get(sub.client)
                if where is not None and covers(event.geofence, where):
                    exact.append(sub.key)
        self.last_mile.observe(keys, false, exact)

    def set_scheme(self, scheme: Scheme) -> TransitionReport:
        """Switch the filter scheme of every local subscription (docs/design.md §14).

        State transfer with bootstrap from this broker's own subscriptions
        (routing keeps them whole), so no client is asked for anything.
        """
        return self.last_mile.transition(scheme, recover=self.local.get)
