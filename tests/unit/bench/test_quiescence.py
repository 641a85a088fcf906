"""The quiescence barrier's condition on hand-made metrics: per link, across a restart.

The live federations (tests/integration/test_node_behaviour.py, the container tests)
use it on real nodes; here `scrape_all` answers what the test says each broker counts.
"""

from __future__ import annotations

import asyncio
import importlib

import pytest

from geofed.bench import Quiescence
from geofed.bench.scrape import Samples
from geofed.node import PEER_MESSAGES_RECEIVED, PEER_MESSAGES_SENT, PEER_QUEUE_LENGTH
from geofed.routing import GeofedError

URLS = {"eu": "eu-url", "us": "us-url", "ap": "ap-url"}
# The module (geofed.bench's attribute of that name is its scrape function).
scraping = importlib.import_module("geofed.bench.scrape")


class Counts:
    """What each broker's /metrics says: sent and received per (kind, peer), queue per peer."""

    def __init__(self) -> None:
        self.samples: dict[str, Samples] = {b: {} for b in URLS}

    def set(self, broker: str, name: str, value: float, **labels: str) -> None:
        self.samples[broker][(name, tuple(sorted(labels.items())))] = value

    def link(self, src: str, dst: str, sent: float, received: float, kind: str = "event") -> None:
        self.set(src, PEER_MESSAGES_SENT, sent, peer=dst, kind=kind)
        self.set(dst, PEER_MESSAGES_RECEIVED, received, peer=src, kind=kind)

    def scrape_all(self, urls: dict[str, str]) -> dict[str, Samples]:
        return {b: self.samples[b] for b in urls}


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    c = Counts()
    monkeypatch.setattr(scraping, "scrape_all", c.scrape_all)
    return c


def test_sent_not_received_or_queued_is_in_flight_per_link(counts: Counts) -> None:
    barrier = Quiescence()
    counts.link("eu", "us", 5, 5)
    counts.link("us", "eu", 3, 2, kind="delivery")
    counts.link("eu", "ap", 1, 1, kind="control")  # control messages are not waited for
    counts.set("ap", PEER_QUEUE_LENGTH, 2, peer="eu")
    assert barrier.in_flight(URLS) == {"delivery us->eu": 1, "queued ap->eu": 2}
    counts.link("us", "eu", 3, 3, kind="delivery")
    counts.set("ap", PEER_QUEUE_LENGTH, 0, peer="eu")
    assert barrier.in_flight(URLS) == {}


def test_a_down_broker_is_left_out_and_a_restarted_one_counts_from_zero(counts: Counts) -> None:
    barrier = Quiescence()
    # us sent ap 10 and received 7 of ap's 9 before it was killed: 2 lost with it.
    counts.link("us", "ap", 10, 10)
    counts.link("ap", "us", 9, 7)
    counts.set("ap", PEER_QUEUE_LENGTH, 4, peer="us")  # waiting for us: not in flight
    up = {b: u for b, u in URLS.items() if b != "us"}
    assert barrier.in_flight(up) == {}
    barrier.restarted("us", up)
    # The new us process counts from zero; ap resends, and each side counts it anew.
    counts.link("us", "ap", 1, 11)
    counts.link("ap", "us", 12, 2)
    counts.set("ap", PEER_QUEUE_LENGTH, 1, peer="us")
    assert barrier.in_flight(URLS) == {"event ap->us": 1, "queued ap->us": 1}
    counts.link("ap", "us", 13, 4)
    counts.set("ap", PEER_QUEUE_LENGTH, 0, peer="us")
    assert barrier.in_flight(URLS) == {}
    # Without setting the earlier traffic aside, the totals would never meet.
    assert Quiescence().in_flight(URLS) == {"event us->ap": -10, "event ap->us": 9}


def test_wait_names_what_is_still_in_flight(counts: Counts) -> None:
    counts.link("eu", "us", 2, 1)
    with pytest.raises(GeofedError, match=r"event eu->us': 1"):
        asyncio.run(Quiescence().wait(URLS, timeout=0))
