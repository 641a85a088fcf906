"""A Jepsen-style history of a live run, checked against the central oracle.

`History` records every publish attempt (acknowledged or not) and every
delivery a subscriber takes; `History.check` compares them with what a single
central matcher (`geofed.routing.reference_deliveries`, written independently
of the routing code) says must be delivered, and returns a `Report`:

* **lost**: an (event, subscription) pair the oracle matches, whose publish
  was acknowledged and whose subscription is *required* (its subscriber stood
  still and stayed subscribed for the whole run), that never arrived;
* **duplicated**: every copy of an (event, subscription) pair after the first;
* **unexpected**: a delivery the oracle does not match, of an event nobody
  published, to a subscription nobody made or to another client, or whose
  payload differs from the one published.

An event whose publish was not acknowledged may or may not arrive: it is
neither required nor, when it matches, unexpected. Deliveries to subscriptions
that are not required (their subscriber moved, or unsubscribed) are only
checked for duplicates and for payloads.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace

from geofed.client import Message
from geofed.routing import GeofenceCache, LatLon, TraceOp, reference_deliveries

EXAMPLES = 10
"""Examples of each verdict a `Report` prints."""


def digest(payload: bytes) -> str:
    """The payload digest histories compare (SHA-256, hex, first 16 digits)."""
    return hashlib.sha256(payload).hexdigest()[:16]


@dataclass(frozen=True)
class Published:
    """One event as its publisher tried to publish it (all attempts with its id merged).

    Attributes:
        event_id: the event id (the same on every attempt).
        topic: topic name.
        location: the publisher's location.
        geofence: the event geofence as given to the client (None: the world).
        digest: `digest` of the payload.
        broker: the publishing broker (the publisher's local broker).
        ack_time: wall-clock seconds of the first acknowledgement; None if
            no attempt was acknowledged.
        attempts: publish calls made with this id.
        errors: what the failed attempts raised.
    """

    event_id: str
    topic: str
    location: LatLon
    geofence: str | None
    digest: str
    broker: str
    ack_time: float | None = None
    attempts: int = 0
    errors: tuple[str, ...] = ()

    @property
    def acknowledged(self) -> bool:
        """Whether a publish of this event was acknowledged."""
        return self.ack_time is not None


@dataclass(frozen=True)
class Subscribed:
    """One subscription of the run.

    Attributes:
        subscription_id: its id.
        client: the subscriber's client id.
        topic_filter: MQTT filter.
        geofence: subscription geofence as given (None: the world).
        location: where the subscriber stands.
        required: the subscriber stood still and stayed subscribed for the
            whole run, so every matching acknowledged event must reach it.
    """

    subscription_id: str
    client: str
    topic_filter: str
    geofence: str | None
    location: LatLon
    required: bool = True


@dataclass(frozen=True)
class Received:
    """One delivery as the subscriber's application took it.

    Attributes:
        client: the subscriber's client id.
        subscription_id: the subscription it came through.
        event_id: the event id.
        digest: `digest` of the payload received.
        broker: the broker that delivered it.
        offset: `Message.offset`, the delivery's place in a persistent
            subscription; None outside one.
    """

    client: str
    subscription_id: str
    event_id: str
    digest: str
    broker: str
    offset: int | None = None


@dataclass
class Report:
    """What `History.check` found: counts and examples; `str()` prints it."""

    published: int = 0
    """Distinct events publishers tried to publish."""
    acknowledged: int = 0
    """Events whose publish was acknowledged."""
    required: int = 0
    """(Acknowledged event, required subscription) pairs the oracle matches."""
    delivered: int = 0
    """Of those, the pairs that arrived at least once."""
    received: int = 0
    """Deliveries recorded, every copy counted."""
    lost: list[tuple[str, str]] = field(default_factory=list)
    """(event id, subscription id) required and never received."""
    duplicated: list[tuple[str, str, int]] = field(default_factory=list)
    """(event id, subscription id, copies received) for pairs received more than once."""
    unexpected: list[tuple[str, str, str]] = field(default_factory=list)
    """(event id, subscription id, why) of deliveries that should not have happened."""

    @property
    def duplicates(self) -> int:
        """Copies received beyond the first, over all pairs."""
        return sum(n - 1 for _, _, n in self.duplicated)

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing duplicated, nothing unexpected."""
        return not (self.lost or self.duplicated or self.unexpected)

    def counts(self) -> dict[str, int]:
        """The figures, by name (what the fault benchmark tabulates)."""
        return {
            "published": self.published,
            "acknowledged": self.acknowledged,
            "required": self.required,
            "delivered": self.delivered,
            "received": self.received,
            "lost": len(self.lost),
            "duplicated": self.duplicates,
            "unexpected": len(self.unexpected),
        }

    def __str__(self) -> str:
        c = self.counts()
        lines = [
            f"{c['published']} events published, {c['acknowledged']} acknowledged; "
            f"{c['delivered']} of {c['required']} required deliveries arrived "
            f"({c['received']} deliveries received): lost {c['lost']}, "
            f"duplicated {c['duplicated']}, unexpected {c['unexpected']}"
        ]
        for name, rows in (
            ("lost", self.lost),
            ("duplicated", self.duplicated),
            ("unexpected", self.unexpected),
        ):
            for row in rows[:EXAMPLES]:
                lines.append(f"  {name}: " + " ".join(str(x) for x in row))
            if len(rows) > EXAMPLES:
                lines.append(f"  ... and {len(rows) - EXAMPLES} more {name}")
        return "\n".join(lines)


class History:
    """Everything publishers were told and subscribers got during one run.

    Publishers call `attempt` before each publish call and `acknowledged` or
    `failed` after it, subscribers `received`
    for each delivery they take; `check` gives the verdict. Not thread-safe:
    record from one event loop.
    """

    def __init__(self) -> None:
        self.events: dict[str, Published] = {}
        """Publish attempts by event id, in the order first tried."""
        self.subscriptions: dict[str, Subscribed] = {}
        """The run's subscriptions by id."""
        self.deliveries: list[Received] = []
        """Deliveries in the order they were taken."""

    @property
    def acks(self) -> int:
        """Events acknowledged so far."""
        return sum(e.acknowledged for e in self.events.values())

    @property
    def attempts(self) -> int:
        """Publish calls so far, failed ones included."""
        return sum(e.attempts for e in self.events.values())

    def subscribed(
        self,
        subscription_id: str,
        client: str,
        topic_filter: str,
        geofence: str | None,
        location: LatLon,
        *,
        required: bool = True,
    ) -> None:
        """Record a subscription (before anything is published for it)."""
        self.subscriptions[subscription_id] = Subscribed(
            subscription_id, client, topic_filter, geofence, location, required
        )

    def release(self, subscription_id: str) -> None:
        """The subscriber moved or unsubscribed: its subscription is no longer required."""
        self.subscriptions[subscription_id] = replace(
            self.subscriptions[subscription_id], required=False
        )

    def attempt(
        self,
        event_id: str,
        topic: str,
        location: LatLon,
        geofence: str | None,
        payload: bytes,
        broker: str,
    ) -> None:
        """Record a publish call about to be made (then `acknowledged` or `failed`).

        Recorded before the call: a call cut short (its task cancelled) may
        still have been accepted, and its event may arrive.
        """
        event = self.events.get(event_id) or Published(
            event_id, topic, location, geofence, digest(payload), broker
        )
        self.events[event_id] = replace(event, attempts=event.attempts + 1)

    def acknowledged(self, event_id: str, ack_time: float) -> None:
        """The broker acknowledged a publish of `event_id` at wall-clock `ack_time`."""
        event = self.events[event_id]
        if event.ack_time is None:
            self.events[event_id] = replace(event, ack_time=ack_time)

    def failed(self, event_id: str, error: str) -> None:
        """A publish of `event_id` raised `error` (it may still have been accepted)."""
        event = self.events[event_id]
        self.events[event_id] = replace(event, errors=(*event.errors, error))

    def received(self, client: str, message: Message) -> None:
        """Record one delivery taken by `client`."""
        self.deliveries.append(
            Received(
                client,
                message.subscription_id,
                message.event_id,
                digest(message.payload),
                message.broker,
                message.offset or None,  # 0: not in a persistent session
            )
        )

    def arrived(self, event_id: str, subscription_id: str) -> bool:
        """Whether this pair was received (for waiting on a marker event)."""
        return any(
            d.event_id == event_id and d.subscription_id == subscription_id
            for d in reversed(self.deliveries)
        )

    def expected(self) -> set[tuple[str, str]]:
        """Every (event id, subscription id) the oracle matches, acknowledged or not."""
        cache = GeofenceCache()
        ops = [
            TraceOp(
                0.0,
                "subscribe",
                s.client,
                s.location,
                s.subscription_id,
                s.topic_filter,
                cache.get(s.geofence, f"subscription {s.subscription_id}"),
            )
            for s in self.subscriptions.values()
        ]
        ops += [
            TraceOp(
                0.0,
                "publish",
                f"publisher of {e.event_id}",
                e.location,
                e.event_id,
                e.topic,
                cache.get(e.geofence, f"event {e.event_id}"),
            )
            for e in self.events.values()
        ]
        return set(reference_deliveries(ops))

    def check(self) -> Report:
        """Compare the deliveries with the oracle (see the module docs for the verdicts)."""
        expected = self.expected()
        report = Report(
            published=len(self.events),
            acknowledged=self.acks,
            received=len(self.deliveries),
        )
        copies = Counter((d.event_id, d.subscription_id) for d in self.deliveries)
        seen: set[tuple[str, str, str]] = set()
        for d in self.deliveries:  # a copy is duplicated, and unexpected only for a new reason
            why = self._unexpected(d, (d.event_id, d.subscription_id) in expected)
            verdict = (d.event_id, d.subscription_id, why)
            if why and verdict not in seen:
                seen.add(verdict)
                report.unexpected.append(verdict)
        report.duplicated = [(e, s, n) for (e, s), n in copies.items() if n > 1]
        for event_id, sub_id in sorted(expected):
            if self.events[event_id].acknowledged and self.subscriptions[sub_id].required:
                report.required += 1
                if copies[(event_id, sub_id)]:
                    report.delivered += 1
                else:
                    report.lost.append((event_id, sub_id))
        return report

    def _unexpected(self, d: Received, matches: bool) -> str:
        """Why delivery `d` should not have happened ("" if it may)."""
        sub = self.subscriptions.get(d.subscription_id)
        event = self.events.get(d.event_id)
        if sub is None:
            return "no such subscription"
        if event is None:
            return "never published"
        if sub.client != d.client:
            return f"delivered to {d.client}, the subscription is {sub.client}'s"
        if event.digest != d.digest:
            return f"payload {d.digest} differs from the one published ({event.digest})"
        if sub.required and not matches:
            return "does not match"
        return ""


__all__ = ["EXAMPLES", "History", "Published", "Received", "Report", "Subscribed", "digest"]
