"""Reading what the nodes count: their Prometheus metrics.

One scrape (`scrape`, parsed by ``prometheus_client.parser``) serves every
tool: the quiescence barrier (`wait_quiescent`: every inter-broker message
sent has been received), the message counts the benchmarks and the demo
compare with the cost model, and the tests.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from geofed.node import (
    DELIVERIES,
    PEER_MESSAGES_RECEIVED,
    PEER_MESSAGES_SENT,
    PEER_QUEUE_LENGTH,
    SUBSCRIBER_QUEUE_DROPPED,
)
from geofed.routing import GeofedError

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]
"""One node's metrics: {(sample name, sorted labels): value}."""


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample a node's ``/metrics`` endpoint exposes."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def scrape_all(urls: Mapping[str, str]) -> dict[str, Samples]:
    """`scrape` of several nodes at once, keyed like `urls`."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(urls, pool.map(scrape, urls.values()), strict=True))


def metric(url: str, name: str, **labels: str) -> float:
    """One metric of a node, summed over its series that carry `labels`."""
    return sum(
        v
        for (n, labs), v in scrape(url).items()
        if n == name and all(dict(labs).get(k) == x for k, x in labels.items())
    )


def peer_message_counts(
    metrics_urls: Mapping[str, str],
) -> dict[str, dict[tuple[str, str, str], float]]:
    """Sent and received inter-broker messages by (kind, src, dst), from every node's metrics."""
    sent: dict[tuple[str, str, str], float] = {}
    received: dict[tuple[str, str, str], float] = {}
    for broker, samples in scrape_all(metrics_urls).items():
        for (name, labels), value in samples.items():
            lab = dict(labels)
            if name == PEER_MESSAGES_SENT:
                sent[(lab["kind"], broker, lab["peer"])] = value
            elif name == PEER_MESSAGES_RECEIVED:
                received[(lab["kind"], lab["peer"], broker)] = value
    return {"sent": sent, "received": received}


Link = tuple[str, str, str]
"""An inter-broker message stream: (kind, sending broker, receiving broker)."""


class Quiescence:
    """The quiescence barrier, per link, across broker restarts.

    Nothing is in flight between the brokers whose metrics it reads when no
    peer queue towards one of them holds a message (the queue gauge includes
    the frame being written; a message leaves it only once counted as sent)
    and, for every link between two of them and every non-control kind, the
    sender counted as many messages sent as the receiver counted received (a
    node counts a message received only once it has applied it).

    A restarted broker counts from zero while its peers keep their counts, so
    the link totals would never meet again: `restarted` sets aside, per link,
    the peers' counts of the traffic with its previous process. Brokers that
    are down are left out by not passing their metrics URL.
    """

    def __init__(self) -> None:
        self._sent_before: dict[Link, float] = {}
        self._received_before: dict[Link, float] = {}

    def restarted(self, broker_id: str, peer_urls: Mapping[str, str]) -> None:
        """Set aside the traffic of `broker_id`'s previous process.

        Call it once that process is gone and every peer in `peer_urls` (the
        live ones) has closed its link to it, so that nothing more is sent to
        or received from it, and before the new process starts.
        """
        counts = peer_message_counts({b: u for b, u in peer_urls.items() if b != broker_id})
        for side in (self._sent_before, self._received_before):
            for link in [k for k in side if broker_id in k[1:]]:
                del side[link]
        self._sent_before.update({k: v for k, v in counts["sent"].items() if k[2] == broker_id})
        self._received_before.update(
            {k: v for k, v in counts["received"].items() if k[1] == broker_id}
        )

    def in_flight(self, metrics_urls: Mapping[str, str]) -> dict[str, float]:
        """What is still in flight between the brokers of `metrics_urls`: messages queued
        (``queued src->dst``) and sent but not received (``kind src->dst``); empty when
        nothing is."""
        live = set(metrics_urls)
        pending: dict[str, float] = {}
        sent: dict[Link, float] = {}
        received: dict[Link, float] = {}
        for broker, samples in scrape_all(metrics_urls).items():
            for (name, labels), value in samples.items():
                lab = dict(labels)
                if name == PEER_QUEUE_LENGTH and lab.get("peer") in live and value:
                    pending[f"queued {broker}->{lab['peer']}"] = value
                elif name == PEER_MESSAGES_SENT and lab.get("peer") in live:
                    sent[(lab["kind"], broker, lab["peer"])] = value
                elif name == PEER_MESSAGES_RECEIVED and lab.get("peer") in live:
                    received[(lab["kind"], lab["peer"], broker)] = value
        for link in sent.keys() | received.keys():
            if link[0] == "control":
                continue
            out = sent.get(link, 0.0) - self._sent_before.get(link, 0.0)
            got = received.get(link, 0.0) - self._received_before.get(link, 0.0)
            if out != got:
                pending[f"{link[0]} {link[1]}->{link[2]}"] = out - got
        return pending

    async def wait(self, metrics_urls: Mapping[str, str], timeout: float = 10.0) -> None:
        """Wait until nothing is in flight between the brokers of `metrics_urls`.

        Raises:
            GeofedError: when messages are still in flight after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while pending := await asyncio.to_thread(self.in_flight, metrics_urls):
            if time.monotonic() > deadline:
                raise GeofedError(f"federation not quiescent after {timeout}s: in flight {pending}")
            await asyncio.sleep(0.005)


async def wait_quiescent(metrics_urls: Mapping[str, str], timeout: float = 10.0) -> None:
    """The quiescence barrier (`Quiescence`) of brokers none of which restarted.

    Raises:
        GeofedError: when messages are still in flight after `timeout` seconds.
    """
    await Quiescence().wait(metrics_urls, timeout)


def delivered(metrics_urls: Mapping[str, str]) -> float:
    """Deliveries the brokers handed to subscriber streams (minus what those queues dropped)."""
    total = 0.0
    for node in scrape_all(metrics_urls).values():
        for (name, _), value in node.items():
            if name == DELIVERIES:
                total += value
            elif name == SUBSCRIBER_QUEUE_DROPPED:
                total -= value
    return total
