"""The per-topic strategy table (docs/design.md §3, "Strategy per topic").

A federation-wide table maps topic filters to strategies, with a default for
topics no entry matches, and is versioned by an epoch that grows by one with
every change. It answers two questions, both pure:

* which strategy routes an event: the one of the *most specific* entry whose
  filter matches the event's topic (`filter_specificity`; two entries never
  tie), else the default;
* under which strategies a subscription is placed: every strategy that can
  route a topic its filter matches. That is the strategies of the entries
  whose filter overlaps it and that are at least as specific as the most
  specific entry covering it (a less specific one is outranked on every such
  topic), plus the default when no entry covers it. This is exact or a
  superset (an entry may be outranked by several others together): a
  superset costs messages, never a wrong delivery.

An event is routed under its topic's strategy alone, and a subscription is
placed under every strategy that may route one of its topics, so each
strategy sees every subscription it needs and every event is routed once:
results stay those of a central matcher, with no duplicate deliveries.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ._errors import InvalidInput
from ._model import Subscription
from ._strategies import STRATEGIES, Strategy
from ._topics import (
    filter_covers,
    filter_specificity,
    filters_overlap,
    topic_matches,
    validate_filter,
)

MAX_TABLE_ENTRIES = 256
"""Entries a table may hold: it is matched per publish and sent whole in every change."""


def _check_strategy(name: object, field: str) -> str:
    if not isinstance(name, str) or name not in STRATEGIES:
        raise InvalidInput(field, f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}")
    return name


@dataclass(frozen=True, slots=True)
class StrategyTable:
    """Topic filter → strategy, a default, and the epoch of this version.

    Attributes:
        default: the strategy of topics no entry matches (the node's
            ``strategy`` setting at epoch 0).
        entries: (topic filter, strategy) pairs sorted by filter, one per filter.
        epoch: the version; every change makes the next one.
        adaptive: the filters of the entries the adaptive controller set
            (§13); every other entry is an operator's, which the controller
            never changes. Routing ignores it; it travels with the table, so
            every broker can tell the two apart and a sequencer that lost its
            state learns it back from its peers.
    """

    default: str
    entries: tuple[tuple[str, str], ...] = ()
    epoch: int = 0
    adaptive: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        _check_strategy(self.default, "default")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise InvalidInput("epoch", f"must be a non-negative integer, got {self.epoch!r}")
        if len(self.entries) > MAX_TABLE_ENTRIES:
            raise InvalidInput("entries", f"more than {MAX_TABLE_ENTRIES} entries")
        seen: set[str] = set()
        for i, (topic_filter, strategy) in enumerate(self.entries):
            validate_filter(topic_filter, f"entries[{i}].topic_filter")
            _check_strategy(strategy, f"entries[{i}].strategy")
            if topic_filter in seen:
                raise InvalidInput(f"entries[{i}].topic_filter", f"{topic_filter!r} twice")
            seen.add(topic_filter)
        if list(self.entries) != sorted(self.entries):
            raise InvalidInput("entries", "must be sorted by filter (StrategyTable.build sorts)")
        if not self.adaptive <= seen:
            unknown = sorted(self.adaptive - seen)[0]
            raise InvalidInput("adaptive", f"{unknown!r} is not the filter of an entry")

    @classmethod
    def build(
        cls,
        default: str,
        entries: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        epoch: int = 0,
        adaptive: Iterable[str] = (),
    ) -> StrategyTable:
        """A table from entries in any order (validated, naming the bad field);
        `adaptive` names the entries the controller set."""
        pairs = list(entries.items() if isinstance(entries, Mapping) else entries)
        for i, pair in enumerate(pairs):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise InvalidInput(f"entries[{i}]", "must be a (topic filter, strategy) pair")
        return cls(
            default, tuple(sorted((str(f), s) for f, s in pairs)), epoch, frozenset(adaptive)
        )

    @classmethod
    def from_json(cls, default: str, text: str, field: str) -> StrategyTable:
        """A table of epoch 0 from a JSON object topic filter → strategy ('' for none).

        The form of the node's ``strategy_table`` setting and of
        ``geofed simulate --table``.

        Raises:
            InvalidInput: naming `field` (and the bad entry).
        """
        entries: Any = {}
        if text:
            try:
                entries = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidInput(field, f"not JSON: {exc}") from None
        if not isinstance(entries, dict):
            raise InvalidInput(field, "must be a JSON object: topic filter -> strategy")
        try:
            return cls.build(default, entries)
        except InvalidInput as exc:
            raise exc.within(field) from None

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.entries)

    def strategy_for(self, topic: str) -> str:
        """The strategy that routes an event on `topic` (a validated topic name)."""
        return _strategy_for(self.default, self.entries, topic)

    def strategies_for(self, topic_filter: str) -> frozenset[str]:
        """Every strategy a subscription with `topic_filter` is placed under."""
        return _strategies_for(self.default, self.entries, topic_filter)

    def with_entry(
        self, topic_filter: str, strategy: str | None, *, adaptive: bool = False
    ) -> StrategyTable:
        """The next version: `topic_filter` pinned to `strategy` (None: the entry removed),
        as the adaptive controller's entry if `adaptive`, else as an operator's.

        Raises:
            InvalidInput: naming ``topic_filter`` or ``strategy``.
        """
        validate_filter(topic_filter, "topic_filter")
        entries = {f: s for f, s in self.entries if f != topic_filter}
        marked = self.adaptive - {topic_filter}
        if strategy is not None:
            entries[topic_filter] = _check_strategy(strategy, "strategy")
            if len(entries) > MAX_TABLE_ENTRIES:
                raise InvalidInput("topic_filter", f"the table holds {MAX_TABLE_ENTRIES} entries")
            if adaptive:
                marked |= {topic_filter}
        return StrategyTable.build(self.default, entries, self.epoch + 1, marked)

    def same_routes(self, other: StrategyTable) -> bool:
        """Whether both versions route alike (same default and entries, any epoch)."""
        return self.default == other.default and self.entries == other.entries

    def same_entries(self, other: StrategyTable) -> bool:
        """Whether both versions route alike and the controller set the same entries."""
        return self.same_routes(other) and self.adaptive == other.adaptive

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the node's state file, ``geofed strategy show``)."""
        return {
            "epoch": self.epoch,
            "default": self.default,
            "entries": [
                {"topic_filter": f, "strategy": s, "adaptive": f in self.adaptive}
                for f, s in self.entries
            ],
        }

    @classmethod
    def from_dict(cls, data: object) -> StrategyTable:
        """Parse `to_dict`'s form (fields named as there when wrong)."""
        if not isinstance(data, dict):
            raise InvalidInput("strategy_table", "must be an object")
        raw = data.get("entries", [])
        if not isinstance(raw, list):
            raise InvalidInput("entries", "must be a list")
        pairs: list[tuple[str, str]] = []
        adaptive: list[str] = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise InvalidInput(f"entries[{i}]", "must be an object")
            topic_filter = item.get("topic_filter")
            if not isinstance(topic_filter, str):
                raise InvalidInput(f"entries[{i}].topic_filter", "must be a string")
            strategy = _check_strategy(item.get("strategy"), f"entries[{i}].strategy")
            pairs.append((topic_filter, strategy))
            marked = item.get("adaptive", False)
            if not isinstance(marked, bool):
                raise InvalidInput(f"entries[{i}].adaptive", "must be true or false")
            if marked:
                adaptive.append(topic_filter)
        return cls.build(data.get("default"), pairs, data.get("epoch", 0), adaptive)  # type: ignore[arg-type]


@lru_cache(maxsize=8192)
def _strategy_for(default: str, entries: tuple[tuple[str, str], ...], topic: str) -> str:
    best: tuple[int, ...] | None = None
    chosen = default
    for topic_filter, strategy in entries:
        if topic_matches(topic_filter, topic):
            key = filter_specificity(topic_filter)
            if best is None or key > best:
                best, chosen = key, strategy
    return chosen


@lru_cache(maxsize=8192)
def _strategies_for(
    default: str, entries: tuple[tuple[str, str], ...], topic_filter: str
) -> frozenset[str]:
    # An entry covering the filter matches each of its topics, so only entries
    # at least as specific (keys compare across topics) can decide one; with
    # none covering it, a topic of the filter may fall to the default.
    covering = [filter_specificity(f) for f, _ in entries if filter_covers(f, topic_filter)]
    floor = max(covering, default=())
    out = {
        s for f, s in entries if filter_specificity(f) >= floor and filters_overlap(f, topic_filter)
    }
    if not covering:
        out.add(default)
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of the strategy table between two actions of a workload.

    Attributes:
        before: index of the action it comes before (the workload's length: after the last).
        topic_filter: the entry's filter.
        strategy: its new strategy; None removes the entry.
        via: the broker it is asked at (None: the sequencer, which numbers changes).
    """

    before: int
    topic_filter: str
    strategy: str | None
    via: str | None = None


def placement(
    strategies: Mapping[str, Strategy],
    tables: Iterable[StrategyTable],
    home: str,
    sub: Subscription,
) -> frozenset[str]:
    """The remote brokers that hold a copy of `sub` (made at `home`).

    The union, over `tables` (the one in force, and during a transition the
    next one too) and the strategies each places the subscription under, of
    their `subscription_targets`.
    """
    out: set[str] = set()
    for table in tables:
        for name in table.strategies_for(sub.topic_filter):
            out |= strategies[name].subscription_targets(home, sub.geofence)
    return frozenset(out)
