"""Benchmark the HTTP bridge: publish latency and throughput next to gRPC, live-push latency.

Not a test: it prints what it measured and appends it to
``bench/results/http.md`` with the command and the machine.

Set-up: the bundled three-broker federation (event-geofence) on loopback,
every broker with its HTTP bridge (`LocalFederation`). Publishers are in
Paris and publish at eu.

1. Publish latency: `--requests` publishes one after the other, over HTTP
   (``PUT /geopublish/<topic>?location=...``, one kept-alive connection) and
   over gRPC (`Client.publish`, unary); each answered once eu accepted the
   event. p50 / p99 from the client's clock.
2. Publish throughput: the same number of publishes from `--concurrency`
   concurrent workers (HTTP: one connection each; gRPC: one channel, concurrent
   calls); publishes/s.
3. Live push: a Server-Sent Events subscriber at us (New York), events
   published over HTTP at eu one at a time; publish -> event received at the
   subscriber (one peer link hop and the bridge's stream), p50 / p99.

Usage: ``python -m geofed.bench.http_bench [--requests 2000] [--concurrency 16]
[--push 300] [--out bench/results/http.md]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from geofed.client import connect
from geofed.routing import LatLon

from ._machine import describe
from .local import LocalFederation

PARIS = "48.85,2.35"
NEW_YORK = "40.71,-74.0"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _timed(n: int, call: Callable[[int], Awaitable[None]]) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await call(i)
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


async def _throughput(n: int, workers: int, call: Callable[[int, int], Awaitable[None]]) -> float:
    per = n // workers

    async def worker(w: int) -> None:
        for i in range(per):
            await call(w, i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return per * workers / (time.perf_counter() - t0)


async def run(fed: LocalFederation, requests: int, concurrency: int, push: int) -> dict[str, float]:
    eu, us = fed.nodes["eu"].http, fed.nodes["us"].http
    results: dict[str, float] = {}

    async def http_put(session: aiohttp.ClientSession, topic: str, body: bytes) -> str:
        async with session.put(
            f"http://{eu}/geopublish/{topic}", params={"location": PARIS}, data=body
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            event_id: str = (await resp.json())["id"]
            return event_id

    async with aiohttp.ClientSession() as session:
        await http_put(session, "bench/warm", b"0")

        async def one_http(i: int) -> None:
            await http_put(session, "bench/http/lat", b"%d" % i)

        lat = await _timed(requests, one_http)
        results["http_p50"], results["http_p99"] = _pct(lat, 0.5), _pct(lat, 0.99)

    client = await connect(
        client_id="bench-grpc", location=LatLon(48.85, 2.35), federation=str(fed.federation_path)
    )
    try:

        async def one_grpc(i: int) -> None:
            await client.publish("bench/grpc/lat", b"%d" % i)

        lat = await _timed(requests, one_grpc)
        results["grpc_p50"], results["grpc_p99"] = _pct(lat, 0.5), _pct(lat, 0.99)

        async def grpc_call(w: int, i: int) -> None:
            await client.publish(f"bench/grpc/{w}", b"%d" % i)

        results["grpc_rate"] = await _throughput(requests, concurrency, grpc_call)
    finally:
        await client.close()

    sessions = [aiohttp.ClientSession() for _ in range(concurrency)]
    try:

        async def http_call(w: int, i: int) -> None:
            await http_put(sessions[w], f"bench/http/{w}", b"%d" % i)

        results["http_rate"] = await _throughput(requests, concurrency, http_call)
    finally:
        for s in sessions:
            await s.close()

    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://{us}/subscribe/bench/push/%23", params={"location": NEW_YORK}
        ) as stream,
    ):
        if (await stream.content.readline()).strip() != b"event: ready":
            raise RuntimeError("the event stream did not open")

        async def next_event() -> str:
            while True:
                line = (await stream.content.readline()).decode()
                if not line:
                    raise RuntimeError("the event stream ended")
                if line.startswith("id: "):
                    return line[4:].strip()

        await fed.quiescent()
        push_ms = []
        for i in range(push):
            t0 = time.perf_counter()
            event_id = await http_put(session, "bench/push/x", b"%d" % i)
            while await next_event() != event_id:
                pass
            push_ms.append((time.perf_counter() - t0) * 1000.0)
        results["push_p50"], results["push_p99"] = _pct(push_ms, 0.5), _pct(push_ms, 0.99)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m geofed.bench.http_bench")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--push", type=int, default=300)
    parser.add_argument("--out", default="bench/results/http.md")
    args = parser.parse_args(argv)
    load0 = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory(prefix="geofed-http-bench-") as work,
        LocalFederation("three", "event-geofence", Path(work)) as fed,
    ):
        r = asyncio.run(run(fed, args.requests, args.concurrency, args.push))
    load = statistics.mean([load0, os.getloadavg()[0]])
    command = "python -m geofed.bench.http_bench " + " ".join(argv or sys.argv[1:])
    report = f"""
## {time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

Command: `{command.strip()}`

Machine: {describe()}; load average about {load:.1f} during the run

| front end | publish p50 ms | publish p99 ms | publishes/s ({args.concurrency} concurrent) |
|---|---:|---:|---:|
| HTTP `PUT /geopublish` | {r["http_p50"]:.2f} | {r["http_p99"]:.2f} | {r["http_rate"]:,.0f} |
| gRPC `Publish` (unary) | {r["grpc_p50"]:.2f} | {r["grpc_p99"]:.2f} | {r["grpc_rate"]:,.0f} |

Live push, HTTP publish at eu -> Server-Sent Event at a New York subscriber
(one peer link hop), {args.push} events one at a time: p50
{r["push_p50"]:.2f} ms, p99 {r["push_p99"]:.2f} ms.
"""
    print(report)
    out = Path(args.out)
    if not out.exists():
        out.write_text(
            "# HTTP bridge: publish and live push\n\n"
            "`python -m geofed.bench.http_bench` (bench/http_bench.py says what it measures).\n",
            encoding="utf-8",
        )
    with out.open("a", encoding="utf-8") as f:
        f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
