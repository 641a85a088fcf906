"""Emulated WAN latency: cross-region deliveries take the one-way delay, local ones do not.

Three brokers (eu, us, ap), a world-wide subscriber at each and a publisher at
each. Events are replayed with a barrier (no inter-broker message in flight),
so no delivery waits behind another and the publish → delivery latency of a
cross-region delivery is one emulated hop plus processing. Both hop kinds
are covered: events forwarded to the subscribers' brokers (event-geofence)
and deliveries sent from the publisher's broker (subscription-geofence). The
delays (137 to 326 ms, or a matrix of 150 to 300 ms) dwarf the noise of a
loaded 2-core machine; the bounds below hold with a wide margin there.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from geofed.bench import LocalFederation, Replayer, metric, wait_quiescent
from geofed.node import DELIVERIES
from geofed.routing import LatLon, TraceOp, great_circle_m, latlon

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"

pytestmark = pytest.mark.integration

PLACES = {"eu": latlon(50.11, 8.68), "us": latlon(39.04, -77.49), "ap": latlon(1.29, 103.85)}
# Asymmetric, so that a delay applied on the wrong side of a link shows.
MATRIX_MS = {
    "eu": {"us": 150.0, "ap": 250.0},
    "us": {"eu": 200.0, "ap": 300.0},
    "ap": {"eu": 180.0, "us": 220.0},
}
NODE_DEFAULT_MS_PER_KM = 0.021  # NodeConfig.wan_ms_per_km's documented default
# Frame batching (2 ms), three event loops and a scheduler shared with other
# jobs: what a delivery may take beyond the emulated delay.
SLACK_MS = 60.0
LOCAL_MAX_MS = 30.0
EVENTS_PER_PUBLISHER = 5


def _ops() -> list[TraceOp]:
    ops = [
        TraceOp(0.0, "subscribe", f"sub-{b}", where, f"s-{b}", "wan/#")
        for b, where in PLACES.items()
    ]
    for i in range(EVENTS_PER_PUBLISHER):
        ops += [
            TraceOp(1.0 + i, "publish", f"pub-{b}", where, f"e-{b}-{i}", f"wan/{b}", None, 16)
            for b, where in PLACES.items()
        ]
    return ops


def _medians_ms(fed: LocalFederation) -> tuple[dict[tuple[str, str], float], int]:
    urls = fed.metrics_urls()

    async def replay() -> tuple[Replayer, float]:
        r = Replayer(fed.federation, None, barrier=lambda: wait_quiescent(urls))
        try:
            await r.run(_ops())
            await wait_quiescent(urls, timeout=60.0)
            # The last deliveries may still be on their way to the clients: wait
            # until every one the brokers made has arrived.
            await r.settle(urls)
            made = sum(metric(url, DELIVERIES) for url in urls.values())
        finally:
            await r.close()
        return r, made

    r, made = asyncio.run(replay())
    assert not r.errors
    assert r.received == len(r.latencies) == made  # none arrived twice, none uncounted
    by_pair: dict[tuple[str, str], list[float]] = defaultdict(list)
    for origin, broker, seconds in r.latencies:
        by_pair[(origin, broker)].append(seconds * 1000.0)
    return {k: statistics.median(v) for k, v in by_pair.items()}, len(r.latencies)


def _km(a: LatLon | None, b: LatLon | None) -> float:
    assert a is not None and b is not None
    return great_circle_m(a, b) / 1000.0


def _check(
    medians: dict[tuple[str, str], float], n: int, delay_ms: dict[str, dict[str, float]]
) -> None:
    assert n == len(PLACES) ** 2 * EVENTS_PER_PUBLISHER  # every event reached every subscriber
    for (src, dst), median in sorted(medians.items()):
        if src == dst:
            assert median < LOCAL_MAX_MS, (src, dst, median)
        else:
            want = delay_ms[src][dst]
            assert want - 0.5 <= median <= want + SLACK_MS, (src, dst, median, want)


def test_model_delay_follows_site_distance(tmp_path: Path) -> None:
    """``wan_latency=model``: event hops take 0.021 ms per km between the brokers' sites."""
    with LocalFederation(
        THREE, "event-geofence", tmp_path, extra_env={"GEOFED_WAN_LATENCY": "model"}
    ) as fed:
        sites = {b.id: b.site for b in fed.federation}
        delay = {
            a: {b: _km(sites[a], sites[b]) * NODE_DEFAULT_MS_PER_KM for b in sites if b != a}
            for a in sites
        }
        medians, n = _medians_ms(fed)
    assert 130 < delay["eu"]["us"] < delay["eu"]["ap"] < delay["us"]["ap"] < 330
    _check(medians, n, delay)


def test_matrix_delay_is_per_direction(tmp_path: Path) -> None:
    """A latency matrix file: delivery hops take the sender's row, not the receiver's."""
    matrix = tmp_path / "wan.json"
    matrix.write_text(json.dumps(MATRIX_MS), encoding="utf-8")
    with LocalFederation(
        THREE,
        "subscription-geofence",
        tmp_path / "fed",
        extra_env={"GEOFED_WAN_LATENCY": str(matrix)},
    ) as fed:
        medians, n = _medians_ms(fed)
    _check(medians, n, MATRIX_MS)
