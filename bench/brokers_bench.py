"""geofed next to Mosquitto and NATS: delivered events/s and latency, side by side.

Not a test: it prints what it measured and appends it to
``bench/results/brokers.md`` with the command, the machine and the load.

One broker of each kind on loopback: one geofed node (a one-broker
federation covering the world, default settings), Debian's ``mosquitto``
and ``nats-server`` (`geofed.bench.brokers`). Python clients on every side:
``geofed.client`` (grpcio), paho-mqtt (QoS 0), nats-py. Topic-only traffic
(no geofences), 64-byte payloads. The subscribers run in this process, the
publisher in a process of its own, each with the fastest publishing API of
its library (geofed: ``publish_many``; paho: ``publish`` in a loop; nats-py:
``publish`` then ``flush``).

Tests, per broker:

* ``1->1`` and ``1->10``: the publisher sends ``--events`` events as fast as
  it can; deliveries/s = deliveries received by all subscribers / (last
  delivery - first publish). Deliveries that never arrive (a broker or a
  client dropped them) are counted as lost next to the figure.
* ``latency``: ``--rate`` events/s for ``--seconds`` to one subscriber; each
  payload carries the publisher's monotonic clock (the same clock in both
  processes), p50 / p99 of publish -> delivery.

Each repetition starts every broker afresh and runs the three kinds in an
order rotated from one repetition to the next (a drift of the machine's load
does not favour one). The ratios geofed / Mosquitto and geofed / NATS are
taken within each repetition; the table gives their medians over the
repetitions that completed, and lists every failed one with its error.

Usage: ``python -m geofed.bench.brokers_bench [--events 20000] [--repeat 3]
[--rate 200] [--seconds 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from ._machine import record
from .brokers import Mosquitto, NatsServer
from .local import LocalFederation

RESULTS = Path(__file__).resolve().parent / "results" / "brokers.md"
KINDS = ("geofed", "mosquitto", "nats")
TESTS = ("1->1", "1->10", "latency")
PAYLOAD_BYTES = 64
TOPIC = "bench/x"  # geofed and MQTT
SUBJECT = "bench.x"  # NATS
_IDLE_S = 10.0  # no delivery for this long after the publisher finished: the rest is lost
_POLL_S = 0.02


# -- the publisher process -----------------------------------------------------


def _payloads(n: int, stamped: bool) -> Iterator[bytes]:
    for _ in range(n):
        if stamped:
            yield f"{time.monotonic():.9f}".encode().ljust(PAYLOAD_BYTES)
        else:
            yield b"x" * PAYLOAD_BYTES


def _publisher(
    kind: str, address: str, n: int, rate: float, conn: multiprocessing.connection.Connection
) -> None:
    """Publish `n` events (`rate` > 0: paced and time-stamped); send the first publish's time."""
    try:
        conn.send(asyncio.run(_publish(kind, address, n, rate)))
    except BaseException as exc:
        conn.send(f"publisher failed: {exc!r}")
        raise


async def _publish(kind: str, address: str, n: int, rate: float) -> float:
    paced = rate > 0

    async def pace(i: int, start: float) -> None:
        if paced:
            wait = start + i / rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)

    if kind == "geofed":
        from geofed.client import Publication, connect
        from geofed.routing import LatLon

        where = LatLon(48.85, 2.35)
        async with await connect(client_id="bench-pub", location=where, endpoint=address) as c:
            t0 = time.monotonic()
            if not paced:
                await c.publish_many([Publication(TOPIC, p, where) for p in _payloads(n, False)])
                return t0
            pending: set[asyncio.Future[str]] = set()
            for i in range(n):
                await pace(i, t0)
                payload = next(_payloads(1, True))
                pending.add(asyncio.ensure_future(c.publish(TOPIC, payload)))
                pending = {p for p in pending if not p.done()}
            await asyncio.gather(*pending)
            return t0
    if kind == "mosquitto":
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="bench-pub")
        host, port = address.rsplit(":", 1)
        client.connect(host, int(port))
        client.loop_start()
        try:
            t0 = time.monotonic()
            infos = []
            for i in range(n):
                await pace(i, t0)
                payload = next(_payloads(1, paced)) if paced else b"x" * PAYLOAD_BYTES
                infos.append(client.publish(TOPIC, payload, qos=0))
            for info in infos:  # QoS 0: "published" = written to the socket
                await asyncio.to_thread(info.wait_for_publish, 120)
            return t0
        finally:
            client.disconnect()
            client.loop_stop()
    if kind == "nats":
        import nats

        nc = await nats.connect(f"nats://{address}")
        try:
            t0 = time.monotonic()
            for i in range(n):
                await pace(i, t0)
                payload = next(_payloads(1, paced)) if paced else b"x" * PAYLOAD_BYTES
                await nc.publish(SUBJECT, payload)
                if paced:
                    await nc.flush()
            await nc.flush()
            return t0
        finally:
            await nc.close()
    raise ValueError(f"unknown broker kind {kind!r}")


# -- the subscribers (this process) --------------------------------------------


class _Receivers:
    """Counters of the subscribers of one test, and the latency samples."""

    def __init__(self, subscribers: int, stamped: bool) -> None:
        self.counts = [0] * subscribers
        self.last = 0.0
        self.stamped = stamped
        self.latencies: list[float] = []
        self._lock = threading.Lock()  # paho calls back from one thread per client

    def got(self, i: int, payload: bytes) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[i] += 1
            self.last = now
            if self.stamped:
                self.latencies.append(now - float(payload.decode().strip()))

    @property
    def total(self) -> int:
        return sum(self.counts)


@contextmanager
def _broker(kind: str) -> Iterator[str]:
    """Start a broker of `kind`; yield its client address."""
    if kind == "geofed":
        with tempfile.TemporaryDirectory(prefix="geofed-brokers-bench-") as tmp:
            path = Path(tmp) / "one.geojson"
            path.write_text(json.dumps(_one_broker_federation()), encoding="utf-8")
            with LocalFederation(path, "event-geofence", Path(tmp) / "work", mqtt=False) as fed:
                yield fed.nodes["node"].client
        return
    broker: AbstractContextManager[Mosquitto | NatsServer]
    broker = Mosquitto() if kind == "mosquitto" else NatsServer()
    with broker as b:
        yield b.address


def _one_broker_federation() -> dict[str, Any]:
    world = [[-180.0, -90.0], [180.0, -90.0], [180.0, 90.0], [-180.0, 90.0], [-180.0, -90.0]]
    return {
        "type": "FeatureCollection",
        "features": [
            {
                "type": "Feature",
                "properties": {
                    "id": "node",
                    "endpoint": "127.0.0.1:1",
                    "client_endpoint": "127.0.0.1:2",
                },
                "geometry": {"type": "Polygon", "coordinates": [world]},
            }
        ],
    }


async def _subscribe(
    kind: str, address: str, rx: _Receivers
) -> tuple[list[asyncio.Task[None]], Callable[[], Any]]:
    """Open the subscribers; return their reader tasks and an async closer."""
    n = len(rx.counts)
    if kind == "geofed":
        from geofed.client import connect
        from geofed.routing import LatLon

        clients = [
            await connect(
                client_id=f"bench-sub-{i}", location=LatLon(48.85, 2.35), endpoint=address
            )
            for i in range(n)
        ]
        subs = [await c.subscribe("bench/#") for c in clients]

        async def read(i: int) -> None:
            async for msg in subs[i]:
                rx.got(i, msg.payload)

        tasks = [asyncio.create_task(read(i)) for i in range(n)]

        async def close_geofed() -> None:
            for c in clients:
                await c.close()

        return tasks, close_geofed
    if kind == "mosquitto":
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        host, port = address.rsplit(":", 1)
        clients_m = []
        for i in range(n):
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-sub-{i}")
            subscribed = threading.Event()
            c.on_message = lambda _c, _u, m, i=i: rx.got(i, m.payload)
            c.on_subscribe = lambda *_a, ev=subscribed: ev.set()
            c.connect(host, int(port))
            c.loop_start()
            c.subscribe(TOPIC, qos=0)
            if not await asyncio.to_thread(subscribed.wait, 60):
                raise TimeoutError("mosquitto did not acknowledge a subscription")
            clients_m.append(c)

        async def close_mqtt() -> None:
            for c in clients_m:
                c.disconnect()
                c.loop_stop()

        return [], close_mqtt
    import nats

    conns = []
    for i in range(n):
        nc = await nats.connect(f"nats://{address}", pending_size=256 << 20)

        async def on_msg(msg: Any, i: int = i) -> None:
            rx.got(i, msg.data)

        await nc.subscribe(SUBJECT, cb=on_msg, pending_msgs_limit=1 << 20)
        await nc.flush()  # the server holds the subscription
        conns.append(nc)

    async def close_nats() -> None:
        for nc in conns:
            await nc.close()

    return [], close_nats


async def _one_test(kind: str, address: str, test: str, args: argparse.Namespace) -> dict[str, Any]:
    """One test against a running broker."""
    subscribers = 10 if test == "1->10" else 1
    stamped = test == "latency"
    n = int(args.rate * args.seconds) if stamped else args.events
    rx = _Receivers(subscribers, stamped)
    tasks, close = await _subscribe(kind, address, rx)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_publisher, args=(kind, address, n, args.rate if stamped else 0.0, there)
    )
    try:
        proc.start()
        there.close()
        answer = await asyncio.to_thread(_receive, here, 600.0)
        if not isinstance(answer, float):
            raise RuntimeError(str(answer))
        t0 = answer
        expected = n * subscribers
        seen, since = -1, time.monotonic()
        while rx.total < expected:
            if rx.total != seen:
                seen, since = rx.total, time.monotonic()
            elif time.monotonic() - since > _IDLE_S:
                break  # the rest never comes
            await asyncio.sleep(_POLL_S)
        await asyncio.to_thread(proc.join, 60)
    finally:
        if proc.is_alive():
            proc.kill()
        await close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    delivered = rx.total
    row: dict[str, Any] = {"expected": expected, "delivered": delivered}
    if delivered == 0:
        raise RuntimeError(f"nothing was delivered of {expected}")
    if stamped:
        lat = sorted(x * 1000 for x in rx.latencies)
        row.update(
            p50_ms=round(statistics.median(lat), 3),
            p99_ms=round(lat[int(0.99 * (len(lat) - 1))], 3),
        )
    else:
        row["per_s"] = round(delivered / max(rx.last - t0, 1e-9))
    return row


def _receive(conn: multiprocessing.connection.Connection, timeout: float) -> Any:
    if not conn.poll(timeout):
        return f"publisher gave no answer within {timeout} s"
    return conn.recv()


def _run_broker(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every test against a fresh broker of `kind`; a failed test is recorded, not raised."""
    out: dict[str, Any] = {}
    try:
        with _broker(kind) as address:
            for test in TESTS:
                print(f"  {kind} {test} ...", file=sys.stderr, flush=True)
                try:
                    out[test] = asyncio.run(_one_test(kind, address, test, args))
                except Exception as exc:
                    out[test] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
    except Exception as exc:
        for test in TESTS:
            out.setdefault(test, {"error": f"broker did not start: {exc}"})
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if "error" in a or "error" in b or not b.get(key):
        return None
    return float(a[key]) / float(b[key])


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-repetition ratios and the medians over repetitions that completed."""
    ratios: list[dict[str, float | None]] = []
    for rep in reps:
        r = rep["results"]
        row: dict[str, float | None] = {}
        for other in ("mosquitto", "nats"):
            for test in ("1->1", "1->10"):
                row[f"{test} vs {other}"] = _ratio(r["geofed"][test], r[other][test], "per_s")
            for q in ("p50_ms", "p99_ms"):
                row[f"{q} vs {other}"] = _ratio(r["geofed"]["latency"], r[other]["latency"], q)
        ratios.append(row)
    medians: dict[str, Any] = {}
    for key in ratios[0] if ratios else []:
        vals = [v for x in ratios if (v := x[key]) is not None]
        medians[key] = round(statistics.median(vals), 3) if vals else None
    figures: dict[str, Any] = {}
    for kind in KINDS:
        for test, key in (
            ("1->1", "per_s"),
            ("1->10", "per_s"),
            ("latency", "p50_ms"),
            ("latency", "p99_ms"),
        ):
            figs: list[float] = [
                rep["results"][kind][test][key] for rep in reps if key in rep["results"][kind][test]
            ]
            figures[f"{kind} {test} {key}"] = statistics.median(figs) if figs else None
    return {"ratios": ratios, "median_ratios": medians, "median_figures": figures}


def _markdown(reps: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = [
        "| repetition | order | load before | broker | 1→1 deliveries/s | 1→10 deliveries/s"
        " | p50 / p99 ms at rate | lost (1→1, 1→10, latency) |",
        "|---:|---|---|---|---:|---:|---:|---|",
    ]
    for rep in reps:
        for kind in KINDS:
            r = rep["results"][kind]
            cells = []
            for test in ("1->1", "1->10"):
                cells.append(r[test].get("per_s", "failed") if "error" not in r[test] else "failed")
            lat = r["latency"]
            cells.append("failed" if "error" in lat else f"{lat['p50_ms']} / {lat['p99_ms']}")
            lost = ", ".join(
                "—" if "error" in r[t] else f"{r[t]['expected'] - r[t]['delivered']:,}"
                for t in TESTS
            )
            fmt = [f"{c:,}" if isinstance(c, int) else str(c) for c in cells]
            lines.append(
                f"| {rep['repetition']} | {' → '.join(rep['order'])} | {rep['load'][0]:.2f} "
                f"| {kind} | {fmt[0]} | {fmt[1]} | {fmt[2]} | {lost} |"
            )
    failures = [
        f"- repetition {rep['repetition']}, {kind} {test}: {rep['results'][kind][test]['error']}"
        for rep in reps
        for kind in KINDS
        for test in TESTS
        if "error" in rep["results"][kind][test]
    ]
    lines += [
        "",
        "Ratios geofed / other, per repetition (throughput: higher is better; latency: lower):",
        "",
    ]
    keys = list(summary["median_ratios"])
    lines.append("| repetition | " + " | ".join(keys) + " |")
    lines.append("|---:|" + "---:|" * len(keys))
    for rep, row in zip(reps, summary["ratios"], strict=True):
        cells = ["—" if row[k] is None else f"{row[k]:.2f}" for k in keys]
        lines.append(f"| {rep['repetition']} | " + " | ".join(cells) + " |")
    med = [
        "—" if summary["median_ratios"][k] is None else f"**{summary['median_ratios'][k]:.2f}**"
        for k in keys
    ]
    lines.append("| median | " + " | ".join(med) + " |")
    lines += ["", "Failed repetitions: " + ("none" if not failures else ""), *failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--events", type=int, default=20_000, help="events per throughput test")
    p.add_argument("--repeat", type=int, default=3, help="repetitions (order rotated)")
    p.add_argument("--rate", type=float, default=200.0, help="events/s of the latency test")
    p.add_argument("--seconds", type=float, default=5.0, help="length of the latency test")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--no-record", action="store_true", help="do not append to bench/results/brokers.md"
    )
    args = p.parse_args(argv)
    if args.events < 1 or args.repeat < 1 or args.rate <= 0 or args.seconds <= 0:
        p.error("--events, --repeat, --rate and --seconds must be positive")
    reps: list[dict[str, Any]] = []
    for k in range(args.repeat):
        order = list(KINDS[k % len(KINDS) :] + KINDS[: k % len(KINDS)])
        load = os.getloadavg()
        print(f"repetition {k + 1}: {' -> '.join(order)} (load {load[0]:.2f})", file=sys.stderr)
        results = {kind: _run_broker(kind, args) for kind in order}
        reps.append({"repetition": k + 1, "order": order, "load": load, "results": results})
    summary = summarize(reps)
    table = _markdown(reps, summary)
    print(table)
    if args.json is not None:
        args.json.write_text(json.dumps({"repetitions": reps, **summary}, indent=1), "utf-8")
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.brokers_bench",
            argv,
            f"Events per throughput test: {args.events:,}; latency: {args.rate:.0f}/s"
            f" for {args.seconds} s; {PAYLOAD_BYTES}-byte payloads\n\n{table}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
