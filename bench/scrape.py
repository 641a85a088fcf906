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


async def wait_quiescent(metrics_urls: Mapping[str, str], timeout: float = 10.0) -> None:
    """The quiescence barrier: wait until no inter-broker message is in flight.

    In flight means queued for a peer (or in the frame being written, which
    the queue gauge includes) or sent and not yet applied by its receiver
    (sent and received totals per kind differ; a node counts a received
    message once it has applied it). Counts are per node lifetime: a node
    restarted since its peers last sent to it breaks the comparison.

    Raises:
        GeofedError: when messages are still in flight after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        samples = await asyncio.to_thread(scrape_all, metrics_urls)
        totals: dict[str, list[float]] = {}
        queued = 0.0
        for node in samples.values():
            for (name, labels), value in node.items():
                if name == PEER_QUEUE_LENGTH:
                    queued += value
                    continue
                side = {PEER_MESSAGES_SENT: 0, PEER_MESSAGES_RECEIVED: 1}.get(name)
                kind = dict(labels).get("kind")
                if side is not None and kind != "control":
                    totals.setdefault(str(kind), [0.0, 0.0])[side] += value
        if not queued and all(sent == received for sent, received in totals.values()):
            return
        if time.monotonic() > deadline:
            raise GeofedError(
                f"federation not quiescent after {timeout}s: {queued:g} queued,"
                f" [sent, received] {totals}"
            )
        await asyncio.sleep(0.005)


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
