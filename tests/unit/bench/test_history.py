"""The history checker's verdicts on hand-made histories: lost, duplicated, unexpected."""

from __future__ import annotations

import pytest

from geofed.bench import History
from geofed.bench.history import EXAMPLES, digest
from geofed.client import Message
from geofed.routing import LatLon

PARIS = LatLon(48.85, 2.35)
NEW_YORK = LatLon(40.71, -74.0)
EUROPE = "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"
AMERICA = "POLYGON((-130 20, -60 20, -60 55, -130 55, -130 20))"


def delivery(
    subscription_id: str, event_id: str, payload: bytes, broker: str = "eu", offset: int = 0
) -> Message:
    """A delivery as the client library hands it over (only what the checker reads matters)."""
    return Message(
        subscription_id, event_id, "t/x", payload, PARIS, None, 0.0, 0.0, "eu", broker, offset
    )


def history() -> History:
    """Two subscribers in Paris and New York; events published from Paris."""
    h = History()
    h.subscribed("s-paris", "c-paris", "t/#", None, PARIS)
    h.subscribed("s-ny", "c-ny", "t/+", EUROPE, NEW_YORK)  # publishers in Europe only
    h.subscribed("s-ny-am", "c-ny", "t/#", AMERICA, NEW_YORK)  # publishers in America only
    return h


def publish(
    h: History, event_id: str, fence: str | None = None, *, acked: bool = True, topic: str = "t/x"
) -> None:
    h.attempt(event_id, topic, PARIS, fence, event_id.encode(), "eu")
    if acked:
        h.acknowledged(event_id, 1.0)
    else:
        h.failed(event_id, "Unavailable: broker down")


def deliver(h: History, client: str, sub: str, event_id: str, payload: bytes | None = None) -> None:
    h.received(client, delivery(sub, event_id, event_id.encode() if payload is None else payload))


def test_every_required_delivery_once_is_ok() -> None:
    h = history()
    publish(h, "e1")  # world: both Paris and New York (its geofence covers Paris)
    publish(h, "e2", AMERICA)  # event geofence: only subscribers in America
    assert h.expected() == {("e1", "s-paris"), ("e1", "s-ny"), ("e2", "s-ny")}
    deliver(h, "c-paris", "s-paris", "e1")
    deliver(h, "c-ny", "s-ny", "e1")
    deliver(h, "c-ny", "s-ny", "e2")
    report = h.check()
    assert report.ok
    assert report.counts() == {
        "published": 2,
        "acknowledged": 2,
        "required": 3,
        "delivered": 3,
        "received": 3,
        "lost": 0,
        "duplicated": 0,
        "unexpected": 0,
    }
    assert str(report).startswith("2 events published, 2 acknowledged; 3 of 3 required")


def test_an_acknowledged_event_that_never_arrives_is_lost() -> None:
    h = history()
    publish(h, "e1")
    deliver(h, "c-paris", "s-paris", "e1")
    report = h.check()
    assert not report.ok
    assert report.lost == [("e1", "s-ny")]
    assert (report.required, report.delivered) == (2, 1)
    assert "  lost: e1 s-ny" in str(report)


def test_a_second_copy_is_duplicated() -> None:
    h = history()
    publish(h, "e1", AMERICA)
    for _ in range(3):
        deliver(h, "c-ny", "s-ny", "e1")
    report = h.check()
    assert report.duplicated == [("e1", "s-ny", 3)]
    assert report.duplicates == 2 and report.counts()["duplicated"] == 2
    assert not report.lost and not report.unexpected and not report.ok


@pytest.mark.parametrize(
    ("client", "sub", "event", "payload", "why"),
    [
        ("c-ny", "s-ny-am", "e1", None, "does not match"),  # publisher not in America
        ("c-paris", "s-paris", "e-none", None, "never published"),
        ("c-paris", "s-gone", "e1", None, "no such subscription"),
        ("c-ny", "s-paris", "e1", None, "delivered to c-ny, the subscription is c-paris's"),
        ("c-paris", "s-paris", "e1", b"tampered", "differs from the one published"),
    ],
)
def test_a_delivery_that_should_not_happen_is_unexpected(
    client: str, sub: str, event: str, payload: bytes | None, why: str
) -> None:
    h = history()
    publish(h, "e1", EUROPE)  # only Paris is inside the event geofence
    deliver(h, "c-paris", "s-paris", "e1")
    deliver(h, client, sub, event, payload)
    report = h.check()
    assert len(report.unexpected) == 1 and not report.lost
    assert why in report.unexpected[0][2]
    assert report.unexpected[0][:2] == (event, sub)


def test_an_unacknowledged_event_may_or_may_not_arrive() -> None:
    h = history()
    publish(h, "e-maybe", acked=False)  # matches both: neither required nor unexpected
    publish(h, "e-late", acked=False)
    deliver(h, "c-paris", "s-paris", "e-maybe")
    deliver(h, "c-ny", "s-ny-am", "e-late")  # but a non-matching one is still unexpected
    report = h.check()
    assert (report.published, report.acknowledged, report.required) == (2, 0, 0)
    assert not report.lost
    assert [(e, s) for e, s, _ in report.unexpected] == [("e-late", "s-ny-am")]


def test_a_retry_with_the_same_id_is_one_event_acknowledged_once() -> None:
    h = history()
    publish(h, "e1", acked=False)
    publish(h, "e1")
    assert h.events["e1"].attempts == 2 and h.events["e1"].acknowledged
    assert h.events["e1"].errors == ("Unavailable: broker down",)
    assert h.acks == 1 and h.attempts == 2
    assert h.check().lost == [("e1", "s-ny"), ("e1", "s-paris")]


def test_a_released_subscription_is_not_required_but_still_checked_for_duplicates() -> None:
    h = history()
    h.release("s-ny")  # its subscriber moved: its location is no longer known
    publish(h, "e1", EUROPE)  # would not match s-ny where it stood
    publish(h, "e2")
    deliver(h, "c-ny", "s-ny", "e1")
    deliver(h, "c-ny", "s-ny", "e1")
    deliver(h, "c-paris", "s-paris", "e1")
    deliver(h, "c-paris", "s-paris", "e2")
    report = h.check()
    assert not report.lost and not report.unexpected
    assert report.duplicated == [("e1", "s-ny", 2)]
    assert report.required == 2


def test_offsets_and_digests_are_recorded() -> None:
    h = history()
    publish(h, "e1")
    h.received("c-paris", delivery("s-paris", "e1", b"e1", broker="eu", offset=7))
    h.received("c-ny", delivery("s-ny", "e1", b"e1", broker="us"))
    first, second = h.deliveries
    assert (first.offset, first.broker, first.digest) == (7, "eu", digest(b"e1"))
    assert second.offset is None
    assert h.arrived("e1", "s-ny") and not h.arrived("e1", "s-ny-am")


def test_the_report_prints_a_bounded_number_of_examples() -> None:
    h = history()
    for i in range(EXAMPLES + 3):
        publish(h, f"e{i}", AMERICA)  # for s-ny only; none arrives
    text = str(h.check())
    assert text.count("  lost: ") == EXAMPLES
    assert text.endswith("... and 3 more lost")
