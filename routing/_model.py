"""Events, subscriptions and the match predicate (docs/design.md §1)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ._errors import InvalidInput
from ._geometry import DEFAULT_MAX_VERTICES, Geofence, LatLon, covers, parse_geofence
from ._roaming import Roaming, is_roaming, parse_roaming
from ._topics import topic_matches, validate_filter, validate_topic

MAX_ID_LENGTH = 256
_CONTROL = re.compile("[\x00-\x1f]")


@dataclass(frozen=True, slots=True)
class Event:
    """A published event with its geo-context.

    Attributes:
        id: globally unique event id.
        topic: topic name.
        location: the publisher's location.
        geofence: where subscribers must be; ``None`` is the whole world.
        payload_size: payload bytes.
        t: publish time (seconds; trace time in simulations).
        payload: the payload itself; carried along, never inspected by routing.
    """

    id: str
    topic: str
    location: LatLon
    geofence: Geofence | None = None
    payload_size: int = 0
    t: float = 0.0
    payload: bytes = field(default=b"", compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Subscription:
    """A subscription: topic filter plus where publishers must be.

    Attributes:
        id: subscription id, unique among its client's subscriptions.
        client: the subscriber's client id.
        topic_filter: MQTT topic filter.
        geofence: where publishers must be; ``None`` is the whole world. For
            a roaming subscription: its placement at `at` (None until placed).
        roaming: the geofence relative to the subscriber, which moves with it
            (docs/design.md §1); None for a fixed geofence.
        at: where `roaming` is placed: the subscriber's location as the
            holder of this copy last heard it.
    """

    id: str
    client: str
    topic_filter: str
    geofence: Geofence | None = None
    roaming: Roaming | None = None
    at: LatLon | None = None

    @property
    def key(self) -> SubKey:
        """What identifies it in the federation: ids are scoped by client."""
        return (self.client, self.id)

    def placed(self, at: LatLon) -> Subscription:
        """This subscription with its roaming geofence placed at `at` (itself when fixed)."""
        if self.roaming is None or at == self.at:
            return self
        return replace(self, geofence=self.roaming.place(at), at=at)


SubKey = tuple[str, str]
"""A subscription's key, (client, subscription id)."""


def validate_id(value: object, field: str) -> str:
    """Check an identifier (event, subscription, client, broker)."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(field, "must be a non-empty string")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidInput(field, f"longer than {MAX_ID_LENGTH} characters")
    if _CONTROL.search(value):
        raise InvalidInput(field, "must not contain control characters")
    return value


_IDS: list[str] = []  # fresh ids, made in bulk: one system call for 256
if hasattr(os, "register_at_fork"):  # no fork, no hook (Windows)
    os.register_at_fork(after_in_child=_IDS.clear)  # a child must not hand out its parent's


def new_event_id() -> str:
    """A fresh event id: 128 random bits (from `os.urandom`) as 32 hex digits.

    The one maker of ids for events published without one (the client
    library, the node for MQTT and id-less gRPC publishes). Not
    `uuid.uuid4`, whose system call for every id was 8 % of the node's MQTT
    publish path under py-spy: the ids are unpredictable all the same (a
    client that could guess another's next id could have its event dropped
    as a duplicate).
    """
    try:
        return _IDS.pop()
    except IndexError:
        text = os.urandom(16 * 256).hex()
        _IDS.extend(text[i : i + 32] for i in range(0, len(text), 32))
        return _IDS.pop()


def make_event(
    id: object,
    topic: object,
    location: LatLon,
    geofence: Any = None,
    *,
    payload_size: int = 0,
    t: float = 0.0,
    payload: bytes = b"",
    field: str = "event",
    max_vertices: int = DEFAULT_MAX_VERTICES,
) -> Event:
    """Validate untrusted parts and build an `Event`; errors name ``field.<part>``."""
    return Event(
        id=validate_id(id, f"{field}.id"),
        topic=validate_topic(topic, f"{field}.topic"),
        location=location,
        geofence=geofence
        if isinstance(geofence, Geofence)
        else parse_geofence(geofence, f"{field}.geofence", max_vertices=max_vertices),
        payload_size=payload_size,
        t=t,
        payload=payload,
    )


def make_subscription(
    id: object,
    client: object,
    topic_filter: object,
    geofence: Any = None,
    *,
    field: str = "subscription",
    max_vertices: int = DEFAULT_MAX_VERTICES,
) -> Subscription:
    """Validate untrusted parts and build a `Subscription`; errors name ``field.<part>``.

    A roaming `geofence` (`Roaming`, ``roam:...`` text, ``{"roaming": ...}``)
    gives an unplaced roaming subscription: its broker places it.
    """
    sub_id = validate_id(id, f"{field}.id")
    owner = validate_id(client, f"{field}.client")
    topic = validate_filter(topic_filter, f"{field}.topic_filter")
    if is_roaming(geofence):
        shape = parse_roaming(geofence, f"{field}.geofence", max_vertices=max_vertices)
        return Subscription(sub_id, owner, topic, roaming=shape)
    return Subscription(
        id=sub_id,
        client=owner,
        topic_filter=topic,
        geofence=geofence
        if isinstance(geofence, Geofence)
        else parse_geofence(geofence, f"{field}.geofence", max_vertices=max_vertices),
    )


def content_and_subscription_geocheck(event: Event, sub: Subscription) -> bool:
    """ContentCheck and Subscription GeoCheck: what a publisher's broker can test."""
    return topic_matches(sub.topic_filter, event.topic) and covers(sub.geofence, event.location)


def matches(event: Event, sub: Subscription, subscriber: LatLon) -> bool:
    """The full match predicate: ContentCheck, Subscription and Event GeoCheck."""
    return content_and_subscription_geocheck(event, sub) and covers(event.geofence, subscriber)
