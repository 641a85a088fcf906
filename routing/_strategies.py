"""Routing strategies (docs/design.md §3) and their cost model.

Each strategy answers, without sending anything, which remote brokers an event,
a subscription (or its unsubscription / geofence change) and a matched event
go to. The broker core, the simulator, the benchmark and the Spark job all ask
these methods, so predicted and measured message counts can be compared exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from ._errors import InvalidInput
from ._federation import Federation
from ._geometry import Geofence


class Strategy(ABC):
    """Where matching happens and what crosses regions.

    Attributes:
        name: the strategy's config name.
        matches_at_publisher: True when subscriptions travel and matching runs
            at the publisher's broker (which then sends deliveries); False when
            events travel and each receiving broker matches locally.
    """

    name: ClassVar[str]
    matches_at_publisher: ClassVar[bool]

    def __init__(self, federation: Federation) -> None:
        self.federation = federation

    @abstractmethod
    def event_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        """Remote brokers an event published at `origin` is forwarded to."""

    @abstractmethod
    def subscription_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        """Remote brokers a subscription made at `origin` (and its changes) go to."""

    def delivery_targets(
        self, origin: str, event_geofence: Geofence | None, homes: Iterable[str]
    ) -> frozenset[str]:
        """Subscriber brokers that get one delivery message for a matched event.

        `homes` are the local brokers of the remote subscriptions that passed
        ContentCheck and Subscription GeoCheck at `origin`. Only brokers whose
        area meets the event geofence can have a subscriber inside it.
        """
        if not self.matches_at_publisher:
            return frozenset()
        meeting = self.federation.brokers_meeting(event_geofence)
        return frozenset(h for h in homes if h != origin and h in meeting)

    def _remote(self, origin: str, brokers: frozenset[str]) -> frozenset[str]:
        return brokers - {origin} if origin in brokers else brokers


class FloodingEvents(Strategy):
    """Every event goes to every other broker; subscriptions stay local."""

    name = "flooding-events"
    matches_at_publisher = False

    def event_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return self._remote(origin, self.federation.brokers_meeting(None))

    def subscription_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return frozenset()


class FloodingSubscriptions(Strategy):
    """Every subscription goes to every other broker; events are matched where published."""

    name = "flooding-subscriptions"
    matches_at_publisher = True

    def event_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return frozenset()

    def subscription_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return self._remote(origin, self.federation.brokers_meeting(None))


class EventGeofence(Strategy):
    """Rendezvous near the subscribers: events go where their geofence reaches."""

    name = "event-geofence"
    matches_at_publisher = False

    def event_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return self._remote(origin, self.federation.brokers_meeting(geofence))

    def subscription_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return frozenset()


class SubscriptionGeofence(Strategy):
    """Rendezvous near the publishers: subscriptions go where their geofence reaches."""

    name = "subscription-geofence"
    matches_at_publisher = True

    def event_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return frozenset()

    def subscription_targets(self, origin: str, geofence: Geofence | None) -> frozenset[str]:
        return self._remote(origin, self.federation.brokers_meeting(geofence))


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls
    for cls in (FloodingEvents, FloodingSubscriptions, EventGeofence, SubscriptionGeofence)
}
"""Every strategy by its config name, flooding baselines first."""


def strategy_for(name: str, federation: Federation, *, field: str = "strategy") -> Strategy:
    """The strategy called `name`, bound to `federation`.

    Raises:
        InvalidInput: naming `field` when there is no such strategy.
    """
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise InvalidInput(
            field, f"unknown strategy {name!r}; one of {', '.join(STRATEGIES)}"
        ) from None
    return cls(federation)


def route_summary(federation: Federation, origin: str, geofence: Geofence | None) -> dict[str, Any]:
    """Where a geofence drawn at broker `origin` sends messages, per strategy (JSON-ready).

    What ``geofed route`` prints and the HTTP bridge's ``/api/route`` answers:
    the brokers whose area meets the geofence (`Federation.brokers_meeting`,
    the origin included), the remote ones among them, and each strategy's event
    and subscription targets from `origin`, against the N−1 messages of flooding.
    """
    meeting = federation.brokers_meeting(geofence)
    remote = sorted(meeting - {origin})
    flood = len(federation) - 1
    rows = []
    for name in STRATEGIES:
        s = strategy_for(name, federation)
        rows.append(
            {
                "strategy": name,
                "event_to": sorted(s.event_targets(origin, geofence)),
                "subscription_to": sorted(s.subscription_targets(origin, geofence)),
            }
        )
    return {
        "origin": origin,
        "geofence": None if geofence is None else geofence.wkt,
        "brokers": sorted(meeting),
        "brokers_meeting": remote,
        "flooding_messages": flood,
        "geofence_messages": len(remote),
        "saved": flood - len(remote),
        "saved_pct": round(100.0 * (flood - len(remote)) / flood, 1) if flood else 0.0,
        "strategies": rows,
    }


def all_strategies(federation: Federation) -> dict[str, Strategy]:
    """Every strategy bound to `federation`, by name (what a per-topic table chooses from)."""
    return {name: cls(federation) for name, cls in STRATEGIES.items()}
