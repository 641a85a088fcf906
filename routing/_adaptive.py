"""The adaptive controller: which strategy each topic key should use next (docs/design.md §13).

Pure and synchronous, like the rest of the routing core: it is fed the
workload's actions (`observe`) and asked at the end of each measurement window
(`close_window`) which topic keys should switch strategy. For every tracked key
it measures the window's rates (events, subscriptions, unsubscriptions) and the
geofence reach, and predicts with the cost model (`predict`) what the window
would have cost under each candidate strategy; the window just seen is the
forecast for the next ones. With `cost` the mean per window over the last
`AdaptiveConfig.average_windows` windows, a key switches to the cheapest
candidate when

    (cost now - cost of the candidate) * horizon_windows - transition cost
        > max(min_saving, hysteresis * cost now * horizon_windows)

and it has kept its strategy for `AdaptiveConfig.dwell_windows` windows: the
saving must pay for the transition within the horizon with a margin, so a
stationary workload switches a key at most once, and noise between windows
does not make it flap.

Keys. A topic's key is the filter of its first `AdaptiveConfig.key_levels`
levels (``telemetry/#`` for ``telemetry/de/berlin/noise`` with one level).
At most `AdaptiveConfig.max_keys` keys are tracked; actions on a new key past
the cap are not measured and its topics keep the strategy they have (the
default) until a tracked key is forgotten: a key without live subscriptions
that saw no action for `AdaptiveConfig.idle_windows` windows, so the key set
follows the traffic. A subscription filter with a wildcard within the key
levels (``+/x``, ``#``) may match topics of every key: it is counted under
every tracked key (a key first seen in the middle of a window misses that
window's such actions before it).

Why the cost model and not a rule of thumb: `predict` is what the simulator,
the live federation and the Spark job are held to message for message, so a
prediction made from a window's actions is exactly what that window would
have cost (the unit tests hold the two equal).

In a federation no broker sees every action: `ShareMeter` measures one
broker's exact share of each key's window from what the broker does, and
`FederatedController` sums the shares at the sequencer and applies the same
decision rule (docs/design.md §13, "Where it runs"; the node runs both).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ._broker import BrokerState
from ._cost import predict
from ._errors import InvalidInput
from ._federation import Federation
from ._geometry import LatLon
from ._model import Event, SubKey, Subscription
from ._simulate import SimResult, Simulator
from ._strategies import STRATEGIES, strategy_for
from ._table import MAX_TABLE_ENTRIES, StrategyTable, Transition, placement
from ._trace import TraceOp


def topic_key(topic: str, levels: int) -> str | None:
    """The key of a topic name or filter: its first `levels` levels as a ``/#`` filter.

    None for a filter with a wildcard within those levels (it spans keys).
    A topic with fewer levels is its own key (``a`` → ``a/#``).
    """
    head = topic.split("/")[:levels]
    if any(level in ("+", "#") for level in head):
        return None
    return "/".join(head) + "/#"


@dataclass(frozen=True)
class AdaptiveConfig:
    """When the controller switches a key; every field has a usable default.

    Raises:
        InvalidInput: naming the field of a bad value.
    """

    window_s: float = 10.0
    """Length of a measurement window in trace seconds."""
    hysteresis: float = 0.1
    """A switch must save more than this share of the key's current predicted cost."""
    min_saving: int = 20
    """... and more than this many messages (over the horizon, after the transition's cost)."""
    dwell_windows: int = 3
    """Windows a key keeps a strategy after switching before it may switch again."""
    horizon_windows: int = 6
    """Windows a switch's per-window saving is counted over against its one-off cost."""
    average_windows: int = 2
    """Decisions use the mean of the last this many windows, and a key needs as many
    windows of history first: a burst of subscriptions as a topic starts is a one-off,
    not its steady rate."""
    key_levels: int = 1
    """Topic levels that make a key."""
    max_keys: int = 256
    """Keys tracked at most; past it, a new key is not measured and keeps the default."""
    idle_windows: int = 6
    """Windows without action (and no live subscription) after which a key is forgotten."""
    candidates: tuple[str, ...] = (
        "subscription-geofence",
        "event-geofence",
        "flooding-subscriptions",
        "flooding-events",
    )
    """Strategies a key may switch to; on a tie the current one stays, else the earlier."""

    def __post_init__(self) -> None:
        if not (isinstance(self.window_s, int | float) and 0 < self.window_s < float("inf")):
            raise InvalidInput("window_s", f"must be a finite number > 0, got {self.window_s!r}")
        if not (isinstance(self.hysteresis, int | float) and 0 <= self.hysteresis < 1):
            raise InvalidInput("hysteresis", f"must be in [0, 1), got {self.hysteresis!r}")
        for name, low in (
            ("min_saving", 0),
            ("dwell_windows", 0),
            ("horizon_windows", 1),
            ("average_windows", 1),
            ("key_levels", 1),
            ("max_keys", 1),
            ("idle_windows", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidInput(name, f"must be an integer >= {low}, got {value!r}")
        if not self.candidates or any(c not in STRATEGIES for c in self.candidates):
            raise InvalidInput(
                "candidates",
                f"must name strategies of {', '.join(STRATEGIES)}, got {self.candidates!r}",
            )


@dataclass
class KeyWindow:
    """What one key did in one window, and what each strategy would have cost.

    Attributes:
        key: the topic key (a ``/#`` filter).
        events, subscribes, unsubscribes: actions in the window.
        event_reach: brokers the window's event geofences meet, summed (the
            publisher's included; a world-wide event meets all).
        subscription_reach: the same for the subscriptions made in the window.
        predicted: inter-broker messages of the window per candidate strategy
            (empty when the table is full and has no entry for the key).
        lower_bound: the window's lower bound (`CostReport.lower_bound_total`).
        strategy: the key's strategy during the window.
    """

    key: str
    strategy: str
    events: int = 0
    subscribes: int = 0
    unsubscribes: int = 0
    event_reach: int = 0
    subscription_reach: int = 0
    predicted: dict[str, int] = field(default_factory=dict)
    lower_bound: int = 0
    moved: dict[str, int] = field(default_factory=dict)
    """In a broker's share (`ShareMeter`): copies of its live subscriptions of the key a
    transition to each candidate would move now (the transition's cost less its
    PREPARED / SWITCHED messages)."""

    def add(self, other: KeyWindow) -> None:
        """Add another broker's share of the same key and window (`FederatedController`)."""
        self.events += other.events
        self.subscribes += other.subscribes
        self.unsubscribes += other.unsubscribes
        self.event_reach += other.event_reach
        self.subscription_reach += other.subscription_reach
        self.lower_bound += other.lower_bound
        for name, n in other.predicted.items():
            self.predicted[name] = self.predicted.get(name, 0) + n
        for name, n in other.moved.items():
            self.moved[name] = self.moved.get(name, 0) + n


@dataclass(frozen=True)
class Switch:
    """A proposed transition of one key, with the figures that justified it."""

    key: str
    old: str
    new: str
    window_end: float
    saving: int
    """Predicted messages saved over the horizon, the transition's cost already deducted."""
    transition_cost: int


def transition_cost(
    federation: Federation, table: StrategyTable, key: str, new: str, state: list[TraceOp]
) -> int:
    """What switching `key` to `new` costs, by the cost model's own account of a transition.

    `state` rebuilds the live subscriptions concerned (`AdaptiveController.state`):
    ``predict`` with the transition after them, less without it — the copies
    moved between placements and the transition's PREPARED / SWITCHED messages
    between every pair of brokers.
    """
    after = predict(federation, table, state, [Transition(len(state), key, new)])
    return after.total_messages - predict(federation, table, state).total_messages


@dataclass
class _Key:
    strategy: str
    window: list[TraceOp] = field(default_factory=list)
    since_switch: int = 0
    recent: deque[dict[str, int]] = field(default_factory=deque)
    idle: int = 0


class AdaptiveController:
    """Per-key windowed measurement, prediction and switching decisions.

    Memory: the live subscriptions and client locations (as a broker holds
    them) and the current window's actions of the tracked keys.

    Args:
        federation: the federation the predictions are for.
        config: thresholds and bounds.
        default: the strategy of a key the controller has not switched (the
            table's default).
        pinned: topic filters whose strategy is fixed (never switched): the
            table's entries an operator set; a key equal to one is not switched.
    """

    def __init__(
        self,
        federation: Federation,
        config: AdaptiveConfig | None = None,
        *,
        default: str = "event-geofence",
        pinned: Mapping[str, str] | None = None,
    ) -> None:
        self.federation = federation
        self.config = config or AdaptiveConfig()
        strategy_for(default, federation, field="default")
        for key, name in (pinned or {}).items():
            strategy_for(name, federation, field=f"pinned[{key!r}]")
        self.default = default
        self.pinned = dict(pinned or {})
        self.table = StrategyTable.build(default, self.pinned)
        """The table the controller's switches make (epochs are the federation's)."""
        self._keys: dict[str, _Key] = {}
        self._where: dict[str, LatLon] = {}
        self._live: dict[str, TraceOp] = {}  # subscription id -> its subscribe action
        self._held: dict[str, set[str]] = {}  # client -> its live subscription ids
        # The live state at the start of the window, which its prediction starts from.
        self._start_where: dict[str, LatLon] = {}
        self._start_live: dict[str, TraceOp] = {}

    def strategy(self, key: str) -> str:
        """The strategy the controller's table gives `key` now (its entry, else the default)."""
        return dict(self.table.entries).get(key, self.default)

    @property
    def keys(self) -> dict[str, str]:
        """Every tracked key and its strategy."""
        return {key: k.strategy for key, k in self._keys.items()}

    def _tracked(self, key: str | None) -> _Key | None:
        if key is None:
            return None
        k = self._keys.get(key)
        if k is None and len(self._keys) < self.config.max_keys:
            # A new key may switch at its first window's end: it has not switched yet.
            # A forgotten key comes back with the entry it left in the table.
            k = self._keys[key] = _Key(
                self.strategy(key),
                since_switch=self.config.dwell_windows,
                recent=deque(maxlen=self.config.average_windows),
            )
        return k

    # ---------------------------------------------------------------- observe

    def observe(self, op: TraceOp) -> None:
        """Take one workload action into the current window (trace semantics, §4)."""
        holding = self._keys_of_client(op.client)
        went: set[str] = set()
        if op.op == "publish":
            went = self._append(op.topic, op)
        elif op.op == "subscribe":
            owner = self._live.get(op.id)
            if owner is None or owner.client == op.client:  # else refused, as by `predict`
                went = self._append(op.topic, op)
                self._live[op.id] = op
                self._held.setdefault(op.client, set()).add(op.id)
        elif op.op == "unsubscribe":
            held = self._live.get(op.id)
            if held is not None and held.client == op.client:
                went = self._append(held.topic, op)
                del self._live[op.id]
                self._held[op.client].discard(op.id)
                if not self._held[op.client]:
                    del self._held[op.client]
        if op.location is not None:
            # Any action with a location moves its client first: for the keys
            # whose subscriptions it holds, that is a move (re-homing, roaming).
            move = op if op.op == "move" else TraceOp(op.t, "move", op.client, op.location)
            for key in holding - went:
                self._keys[key].window.append(move)
            self._where[op.client] = op.location

    def _append(self, topic: str, op: TraceOp) -> set[str]:
        """Add `op` to its key's window (every key's for a spanning filter); the keys."""
        key = topic_key(topic, self.config.key_levels)
        if key is None:  # a filter spanning keys: every key may match through it
            for k in self._keys.values():
                k.window.append(op)
            return set(self._keys)
        if self._tracked(key) is None:
            return set()
        self._keys[key].window.append(op)
        return {key}

    def _keys_of_client(self, client: str) -> set[str]:
        out: set[str] = set()
        for sid in self._held.get(client, ()):
            key = topic_key(self._live[sid].topic, self.config.key_levels)
            if key is None:
                return set(self._keys)
            if key in self._keys:
                out.add(key)
        return out

    def run(
        self,
        ops: Iterable[TraceOp],
        on_switch: Callable[[Switch, int], None] | None = None,
        on_op: Callable[[TraceOp], None] | None = None,
    ) -> Iterator[tuple[float, list[KeyWindow], list[Switch]]]:
        """Feed a trace, closing a window at every multiple of `AdaptiveConfig.window_s`.

        Yields each window's end, figures and switches, the last window closed
        at the multiple after the last action. `on_op` sees each action before
        the controller does; `on_switch` each switch with the index of the
        action it comes before (the simulator executes the transition there).
        """
        width = self.config.window_s
        end = width
        i = -1
        for i, op in enumerate(ops):
            while op.t >= end:
                yield self._closed(end, i, on_switch)
                end += width
            if on_op is not None:
                on_op(op)
            self.observe(op)
        if i >= 0:
            yield self._closed(end, i + 1, on_switch)

    def _closed(
        self, end: float, before: int, on_switch: Callable[[Switch, int], None] | None
    ) -> tuple[float, list[KeyWindow], list[Switch]]:
        reports, switches = self.close_window(end)
        if on_switch is not None:
            for switch in switches:
                on_switch(switch, before)
        return end, reports, switches

    # ------------------------------------------------------------ the window

    def close_window(self, now: float) -> tuple[list[KeyWindow], list[Switch]]:
        """End the window at trace time `now`: per-key figures and the switches to make.

        The switches are already applied to the controller's view
        (`strategy`); the caller executes them (one transition per key).
        """
        reports: list[KeyWindow] = []
        switches: list[Switch] = []
        for key, k in list(self._keys.items()):
            report = self.measure(key, self.state(key, at_start=True), k.window)
            reports.append(report)
            k.since_switch += 1
            k.idle = 0 if k.window else k.idle + 1
            k.window = []
            if key not in self.pinned:
                switch = self._decide(key, k, report, now)
                if switch is not None:
                    switches.append(switch)
                    k.strategy, k.since_switch = switch.new, 0
                    self.table = self.table.with_entry(key, switch.new, adaptive=True)
            if k.idle >= self.config.idle_windows and not self.state(key, at_start=False):
                del self._keys[key]
        self._start_where = dict(self._where)
        self._start_live = dict(self._live)
        return reports, switches

    def state(self, key: str, *, at_start: bool) -> list[TraceOp]:
        """Actions that rebuild `key`'s live subscriptions: moves, then subscribes.

        As they stood at the start of the current window (`at_start`) or now.
        """
        where = self._start_where if at_start else self._where
        live = self._start_live if at_start else self._live
        subs = [
            op for op in live.values() if topic_key(op.topic, self.config.key_levels) in (key, None)
        ]
        moves = [TraceOp(0.0, "move", c, where[c]) for c in sorted({op.client for op in subs})]
        return moves + [
            TraceOp(
                0.0, "subscribe", op.client, None, op.id, op.topic, op.geofence, roaming=op.roaming
            )
            for op in subs
        ]

    def measure(self, key: str, state: list[TraceOp], window: list[TraceOp]) -> KeyWindow:
        """A window's figures for `key`: rates, reach and each candidate's predicted messages.

        The prediction of strategy S is ``predict(T, state + window)`` less
        ``predict(T, state)``, T the controller's table with `key` routed by S:
        what the window's actions cost starting from the key's live
        subscriptions.
        """
        fed = self.federation
        report = KeyWindow(key, self.strategy(key))
        for op in window:
            if op.op == "publish":
                report.events += 1
                report.event_reach += len(fed.brokers_meeting(op.geofence))
            elif op.op == "subscribe":
                report.subscribes += 1
                fence = op.geofence
                if op.roaming is not None and op.location is not None:
                    fence = op.roaming.place(op.location)
                report.subscription_reach += len(fed.brokers_meeting(fence))
            elif op.op == "unsubscribe":
                report.unsubscribes += 1
        if not self._may_set(key):
            return report  # the table is full: no entry for the key, nothing to predict
        if not window:
            report.predicted = dict.fromkeys(self.config.candidates, 0)
            return report
        for name in self.config.candidates:
            table = self.table.with_entry(key, name)
            base = predict(fed, table, state).total_messages
            after = predict(fed, table, [*state, *window])
            report.predicted[name] = after.total_messages - base
            report.lower_bound = after.lower_bound_total
        return report

    def _may_set(self, key: str) -> bool:
        """Whether the table can route `key` by an entry (it has one, or room for one)."""
        return key in dict(self.table.entries) or len(self.table.entries) < MAX_TABLE_ENTRIES

    def _decide(self, key: str, k: _Key, report: KeyWindow, now: float) -> Switch | None:
        def cost(best: str) -> int:
            state = self.state(key, at_start=False)
            return transition_cost(self.federation, self.table, key, best, state)

        return _decide(self.config, key, k, report, now, cost)


def _decide(
    cfg: AdaptiveConfig,
    key: str,
    k: _Key,
    report: KeyWindow,
    now: float,
    cost_of: Callable[[str], int],
) -> Switch | None:
    """The decision rule (module docstring) on a key's window; `cost_of(best)` is the
    transition's cost. One rule for the single controller and the federated one."""
    if not report.predicted:
        return None
    k.recent.append(report.predicted)
    if len(k.recent) < cfg.average_windows or k.since_switch < cfg.dwell_windows:
        return None
    # Per-window means over the last `average_windows` windows, in messages.
    n = len(k.recent)
    mean = {s: sum(w.get(s, 0) for w in k.recent) / n for s in cfg.candidates}
    if k.strategy not in mean:
        return None  # routed by a strategy that is no candidate: nothing to compare with
    current = mean[k.strategy]
    best = min(mean, key=lambda s: (mean[s], s != k.strategy, cfg.candidates.index(s)))
    if best == k.strategy:
        return None
    cost = cost_of(best)
    saving = round((current - mean[best]) * cfg.horizon_windows) - cost
    if saving <= max(cfg.min_saving, cfg.hysteresis * current * cfg.horizon_windows):
        return None
    return Switch(key, k.strategy, best, now, saving, cost)


@dataclass
class AdaptiveRun:
    """A trace run through the in-memory federation with the controller switching keys.

    Attributes:
        result: what the simulator measured (messages, deliveries), transitions included.
        transitions: the switches as executed, each before the action it names.
        windows: each window's end, per-key figures and switches.
        per_bin: messages sent per `bin_s` of trace time (a transition's at its window's end).
    """

    result: SimResult
    transitions: list[Transition] = field(default_factory=list)
    windows: list[tuple[float, list[KeyWindow], list[Switch]]] = field(default_factory=list)
    per_bin: Counter[int] = field(default_factory=Counter)


def simulate_adaptive(
    federation: Federation,
    ops: Iterable[TraceOp],
    default: str,
    config: AdaptiveConfig | None = None,
    *,
    pinned: Mapping[str, str] | None = None,
    adapt: bool = True,
    bin_s: float = 1.0,
) -> AdaptiveRun:
    """Run `ops` through the `Simulator`, the controller proposing a transition at window ends.

    The simulator executes each switch as a transition of its table (asked at
    the sequencer, run to its end before the next action), so its messages
    and deliveries are those of the transition protocol itself; ``predict``
    with the same transitions gives the same count. `adapt` False runs the
    static table (the baseline, binned alike).
    """
    ctl = AdaptiveController(federation, config, default=default, pinned=pinned)
    sim = Simulator(federation, ctl.table)
    run = AdaptiveRun(sim.result)
    sent = 0

    def count(t: float) -> None:
        nonlocal sent
        now = sim.result.total_messages
        run.per_bin[int(t // bin_s)] += now - sent
        sent = now

    def on_op(op: TraceOp) -> None:
        sim.apply(op)
        count(op.t)

    def on_switch(switch: Switch, before: int) -> None:
        run.transitions.append(Transition(before, switch.key, switch.new))
        sim.set_strategy(switch.key, switch.new, adaptive=True)
        count(switch.window_end)

    if not adapt:
        for op in ops:
            on_op(op)
        return run
    run.windows = list(ctl.run(ops, on_switch, on_op))
    return run


# ------------------------------------------------------- the federated controller


@functools.lru_cache(maxsize=4096)
def _candidate_tables(
    table: StrategyTable, key: str, candidates: tuple[str, ...]
) -> tuple[StrategyTable, ...] | None:
    """`table` with `key` routed by each candidate; None when the table is full without it."""
    if key not in dict(table.entries) and len(table.entries) >= MAX_TABLE_ENTRIES:
        return None
    return tuple(table.with_entry(key, name) for name in candidates)


class ShareMeter:
    """One broker's share of every key's window, measured from what the broker does.

    The federated form of `AdaptiveController.measure` (docs/design.md §13,
    "Where it runs"): the broker's `BrokerState` calls it (its ``meter``) on
    each local publish, event received, local subscription change and
    roaming relocation, and the meter adds what that action costs under
    each candidate strategy of the key, by the cost model's own rules, with
    the broker's table as `T`:

    * a publish here: the event messages of each candidate, and the
      deliveries when this broker matches it now (a subscription strategy
      routes it: the remote copies held here are every one that can match);
    * an event received (an event strategy routes it): the one delivery a
      subscription strategy would send here, if a local subscription passes
      the content and subscription geofence checks — the event geofence
      that limits deliveries also limits where the event goes, so every
      broker that could get a delivery gets the event;
    * a local subscribe, unsubscribe (withdrawals on leaving the area too)
      and relocation: its messages under each candidate's placement.

    Each message of the single controller's prediction is counted by
    exactly one broker, so the shares of all brokers add up to it (a
    hypothesis test holds them equal). `close` ends the window: the shares,
    with the copies a transition to each candidate would move now (`KeyWindow.moved`).

    Keys: those of the local actions and of the events received, at most
    `AdaptiveConfig.max_keys`; a subscription filter spanning keys counts under
    every key the broker tracks. A key without local live subscriptions and
    without actions here for `AdaptiveConfig.idle_windows` windows is forgotten.
    Memory: one `KeyWindow` per tracked key.
    """

    def __init__(self, config: AdaptiveConfig | None = None) -> None:
        self.config = config or AdaptiveConfig()
        self._windows: dict[str, KeyWindow] = {}
        self._idle: dict[str, int] = {}  # tracked keys -> windows without action here

    @property
    def keys(self) -> frozenset[str]:
        """The keys tracked here."""
        return frozenset(self._idle)

    def track(self, keys: Iterable[str]) -> None:
        """Track these keys too (within the cap), e.g. the ones the sequencer decides on."""
        for key in keys:
            self._window(key)

    def _window(self, key: str) -> KeyWindow | None:
        w = self._windows.get(key)
        if w is None:
            if key not in self._idle and len(self._idle) >= self.config.max_keys:
                return None
            self._idle.setdefault(key, 0)
            w = self._windows[key] = KeyWindow(key, "")
        return w

    def _keys_of(self, topic: str) -> list[KeyWindow]:
        key = topic_key(topic, self.config.key_levels)
        if key is None:  # a filter spanning keys: every tracked key may match through it
            return [w for k in sorted(self._idle) if (w := self._window(k)) is not None]
        w = self._window(key)
        return [] if w is None else [w]

    def _add(self, state: BrokerState, w: KeyWindow, cost: Callable[[StrategyTable], int]) -> None:
        tables = _candidate_tables(state.table, w.key, self.config.candidates)
        if tables is None:
            return  # the table is full without an entry for the key: it cannot switch
        for name, table in zip(self.config.candidates, tables, strict=True):
            w.predicted[name] = w.predicted.get(name, 0) + cost(table)

    # ------------------------------------------------------------- hooks

    def published(
        self, state: BrokerState, event: Event, by_home: Mapping[str, Sequence[SubKey]] | None
    ) -> None:
        """An event published here; `by_home`: the remote copies matching it, by home,
        when this broker matches it for a subscription strategy (None: an event strategy)."""
        fed, strats = state.federation, state.strategies
        copies = by_home or {}

        def placed_here(table: StrategyTable, home: str, keys: Sequence[SubKey]) -> bool:
            # One copy placed here is enough: usually the first (copies are fetched lazily).
            for key in keys:
                sub = state.remote.get(key)
                if sub is not None and state.id in placement(strats, (table,), home, sub):
                    return True
            return False

        for w in self._keys_of(event.topic):
            w.events += 1
            w.event_reach += len(fed.brokers_meeting(event.geofence))

            def cost(table: StrategyTable) -> int:
                x = state.strategies[table.strategy_for(event.topic)]
                n = len(x.event_targets(state.id, event.geofence))
                if x.matches_at_publisher and copies:
                    homes = {h for h, keys in copies.items() if placed_here(table, h, keys)}
                    n += len(x.delivery_targets(state.id, event.geofence, homes))
                return n

            self._add(state, w, cost)

    def received(self, state: BrokerState, origin: str, event: Event) -> None:
        """An event from its publisher's broker `origin`, routed by an event strategy."""
        matched: list[Subscription] | None = None
        for w in self._keys_of(event.topic):

            def cost(table: StrategyTable) -> int:
                nonlocal matched
                x = state.strategies[table.strategy_for(event.topic)]
                if not x.matches_at_publisher:
                    return 0
                if state.id not in x.delivery_targets(origin, event.geofence, (state.id,)):
                    return 0
                if matched is None:
                    matched = state.local.match(event.topic, event.location)
                strats = state.strategies
                return int(any(origin in placement(strats, (table,), state.id, s) for s in matched))

            self._add(state, w, cost)

    def subscribed(self, state: BrokerState, sub: Subscription, old: Subscription | None) -> None:
        """A local subscription (placed), `old` the version it replaces."""
        levels = self.config.key_levels
        for w in self._keys_of(sub.topic_filter):
            w.subscribes += 1
            w.subscription_reach += len(state.federation.brokers_meeting(sub.geofence))
            # The replaced version counts where the key's own trace holds it (`predict`).
            counted = old is not None and topic_key(old.topic_filter, levels) in (w.key, None)
            was = old if counted else None

            def cost(table: StrategyTable, was: Subscription | None = was) -> int:
                after = placement(state.strategies, (table,), state.id, sub)
                if was is None:
                    return len(after)
                gone = placement(state.strategies, (table,), state.id, was) - after
                return len(after) + len(gone)

            self._add(state, w, cost)

    def unsubscribed(self, state: BrokerState, sub: Subscription) -> None:
        """A local subscription withdrawn (by its client, or as its client left the area)."""
        for w in self._keys_of(sub.topic_filter):
            w.unsubscribes += 1
            self._add(
                state,
                w,
                lambda table: len(placement(state.strategies, (table,), state.id, sub)),
            )

    def relocated(self, state: BrokerState, old: Subscription, new: Subscription) -> None:
        """A roaming subscription placed anew as its subscriber moved within the area."""
        for w in self._keys_of(new.topic_filter):

            def cost(table: StrategyTable) -> int:
                before = placement(state.strategies, (table,), state.id, old)
                return len(before | placement(state.strategies, (table,), state.id, new))

            self._add(state, w, cost)

    # ------------------------------------------------------------- window

    def close(self, state: BrokerState) -> list[KeyWindow]:
        """End the window: this broker's share of every tracked key, then start the next."""
        levels = self.config.key_levels
        by_key: dict[str | None, list[Subscription]] = {}
        for sub in state.local:
            by_key.setdefault(topic_key(sub.topic_filter, levels), []).append(sub)
        spanning = by_key.get(None, [])
        entries = dict(state.table.entries)
        out: list[KeyWindow] = []
        for key in sorted(self._idle):
            w = self._windows.pop(key, None)
            active = w is not None  # an action here, or an event received
            w = w or KeyWindow(key, "")
            w.strategy = entries.get(key, state.table.default)
            live = by_key.get(key, []) + spanning
            tables = _candidate_tables(state.table, key, self.config.candidates)
            if tables is not None:
                for name, table in zip(self.config.candidates, tables, strict=True):
                    w.predicted.setdefault(name, 0)
                    w.moved[name] = sum(
                        len(
                            placement(state.strategies, (state.table,), state.id, s)
                            ^ placement(state.strategies, (table,), state.id, s)
                        )
                        for s in live
                    )
            out.append(w)
            self._idle[key] = 0 if active else self._idle[key] + 1
            if self._idle[key] >= self.config.idle_windows and not live:
                del self._idle[key]
        self._windows.clear()
        return out


class FederatedController:
    """The sequencer's side of the federated controller (docs/design.md §13).

    Every broker sends its `ShareMeter` shares at the end of each window;
    `add` sums them, and `close_window` applies the decision rule of
    `AdaptiveController` to the sums, with a transition's cost the copies the
    brokers would move (their latest `KeyWindow.moved`) plus the PREPARED /
    SWITCHED messages between every pair of brokers, 2·N·(N−1).

    Pinned keys: an entry of the table that the controller did not set
    (`StrategyTable.adaptive`: its switches are proposed as its own) is an
    operator's, never overridden; an operator who sets or removes one of the
    controller's entries makes it theirs. A key no broker reported for
    `AdaptiveConfig.idle_windows` windows is forgotten.
    Memory: per key, the summed window and the last `average_windows` predictions.
    """

    def __init__(self, federation: Federation, config: AdaptiveConfig | None = None) -> None:
        self.federation = federation
        self.config = config or AdaptiveConfig()
        self._keys: dict[str, _Key] = {}
        self._window: dict[str, KeyWindow] = {}
        self._moved: dict[str, dict[str, dict[str, int]]] = {}  # broker -> key -> candidate
        self.deferred: list[Switch] = []
        """The switches the last `close_window` did not make (``may_switch`` False)."""
        n = len(federation)
        self.protocol_cost = 2 * n * (n - 1)
        """PREPARED and SWITCHED messages of one transition."""

    @property
    def keys(self) -> dict[str, str]:
        """Every key decided on and its strategy."""
        return {key: k.strategy for key, k in self._keys.items()}

    def add(self, broker: str, shares: Iterable[KeyWindow]) -> None:
        """Take `broker`'s shares of its last window (they count in the window being summed)."""
        moved = self._moved[broker] = {}
        for share in itertools.islice(shares, self.config.max_keys):  # bounded whatever it sent
            w = self._window.setdefault(share.key, KeyWindow(share.key, share.strategy))
            w.add(dataclasses.replace(share, moved={}))
            moved[share.key] = dict(share.moved)

    def pinned(self, table: StrategyTable, key: str) -> bool:
        """Whether `table`'s entry for `key` is an operator's (never switched)."""
        return key in dict(table.entries) and key not in table.adaptive

    def transition_cost(self, key: str, new: str) -> int:
        """What switching `key` to `new` costs: the copies the brokers move, and the protocol."""
        moved = sum(m.get(key, {}).get(new, 0) for m in self._moved.values())
        return moved + self.protocol_cost

    def close_window(
        self, table: StrategyTable, now: float, *, may_switch: bool = True
    ) -> tuple[list[KeyWindow], list[Switch]]:
        """End the window: the summed figures per key and the switches to propose.

        `table` is the newest table the sequencer knows. With `may_switch` False
        (a transition under way, a broker down) the window still counts towards
        the averages, but nothing switches. The caller proposes the switches,
        as the controller's entries (`BrokerState.propose` with ``adaptive``).
        """
        cfg = self.config
        entries = dict(table.entries)
        reports: list[KeyWindow] = []
        switches: list[Switch] = []
        self.deferred = []
        for key in sorted(set(self._keys) | set(self._window)):
            report = self._window.pop(key, None)
            strategy = entries.get(key, table.default)
            k = self._keys.get(key)
            if k is None:
                if len(self._keys) >= cfg.max_keys:
                    continue
                k = self._keys[key] = _Key(
                    strategy,
                    since_switch=cfg.dwell_windows,
                    recent=deque(maxlen=cfg.average_windows),
                )
            k.idle = 0 if report is not None else k.idle + 1
            may_set = key in entries or len(entries) < MAX_TABLE_ENTRIES
            if report is None:
                report = KeyWindow(key, strategy)
                if may_set:
                    report.predicted = dict.fromkeys(cfg.candidates, 0)
            report.strategy = k.strategy = strategy
            reports.append(report)
            k.since_switch += 1
            if may_set and not self.pinned(table, key):
                cost = functools.partial(self.transition_cost, key)
                switch = _decide(cfg, key, k, report, now, cost)
                if switch is not None and not may_switch:
                    self.deferred.append(switch)
                elif switch is not None:
                    switches.append(switch)
                    k.strategy, k.since_switch = switch.new, 0
            if k.idle >= cfg.idle_windows:
                del self._keys[key]
        return reports, switches
