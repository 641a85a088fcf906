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

With ``--traffic geo`` the same tests run geofenced (test names ``geo
1->1``, ...): each subscription has a geofence (50 km around Paris) and the
publisher alternates between a location inside it and one just outside (half
the events match; the other half lie in the fence's cover, so the peers'
brokers deliver them and their exact check turns them down). geofed takes
the geofence on the subscription; the peers carry the location in the topic
(`geofed.cover`'s `DecimalLayout`, 0.01° digits:
``g/_/4/8/8/5/_/0/0/2/3/5/bench/x``, a NATS subject with dots),
subscribe to the geofence's cover (`cover`) and check each delivery against
the geofence themselves (the exact location rides in the payload); only
deliveries that pass count.

Each repetition starts every broker afresh and runs the three kinds in an
order rotated from one repetition to the next (a drift of the machine's load
does not favour one). The ratios geofed / Mosquitto and geofed / NATS are
taken within each repetition; the table gives their medians over the
repetitions that completed, and lists every failed one with its error.

Usage: ``python -m geofed.bench.brokers_bench [--events 20000] [--repeat 3]
[--rate 200] [--seconds 5] [--traffic topic --traffic geo]``
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

from geofed.routing import DecimalLayout, LatLon, circle, cover, covers

from ._machine import record
from .brokers import Mosquitto, NatsServer, nats_subject
from .local import LocalFederation

RESULTS = Path(__file__).resolve().parent / "results" / "brokers.md"
KINDS = ("geofed", "mosquitto", "nats")
TESTS = ("1->1", "1->10", "latency")
TRAFFIC = ("topic", "geo")
_PREFIX = {"topic": "", "geo": "geo "}  # a test's name: its traffic's prefix, then the test


def tests_of(traffics: list[str]) -> list[str]:
    """The names of the tests of `traffics` (``1->1``, ..., ``geo 1->1``, ...)."""
    return [_PREFIX[t] + test for t in traffics for test in TESTS]


def _traffics(reps: list[dict[str, Any]]) -> list[str]:
    names = set(reps[0]["results"][KINDS[0]]) if reps else set()
    return [t for t in TRAFFIC if _PREFIX[t] + TESTS[0] in names]


PAYLOAD_BYTES = 64
TOPIC = "bench/x"  # geofed and MQTT
SUBJECT = "bench.x"  # NATS
# Paris, and a point 52 km east: outside the fence, inside its cover (the peers
# receive events published there, and their exact check turns them down).
INSIDE, OUTSIDE = LatLon(48.85, 2.35), LatLon(48.85, 3.05)
FENCE = circle(INSIDE, 50_000.0)
LAYOUT = DecimalLayout(prefix="g", decimals=2)
_IDLE_S = 10.0  # no delivery for this long after the publisher finished: the rest is lost
_POLL_S = 0.02


# -- the publisher process -----------------------------------------------------


def _payloads(n: int, stamped: bool) -> Iterator[bytes]:
    for _ in range(n):
        if stamped:
            yield f"{time.monotonic():.9f}".encode().ljust(PAYLOAD_BYTES)
        else:
            yield b"x" * PAYLOAD_BYTES


def _where(i: int) -> LatLon:
    """Where the `i`-th geofenced event is published: inside the fence, then outside."""
    return INSIDE if i % 2 == 0 else OUTSIDE


def _geo_payload(i: int, stamped: bool) -> bytes:
    """The publish time (0 unstamped) and the exact location, for the peers' exact check."""
    at = _where(i)
    stamp = time.monotonic() if stamped else 0.0
    return f"{stamp:.9f} {at.lat!r} {at.lon!r}".encode().ljust(PAYLOAD_BYTES)


def _topic(i: int, geo: bool, nats: bool = False) -> str:
    """The topic (or NATS subject) of the `i`-th event."""
    if not geo:
        return SUBJECT if nats else TOPIC
    topic = LAYOUT.topic(_where(i), TOPIC)
    return nats_subject(topic) if nats else topic


def _publisher(
    kind: str,
    address: str,
    n: int,
    rate: float,
    conn: multiprocessing.connection.Connection,
    geo: bool = False,
) -> None:
    """Publish `n` events (`rate` > 0: paced and time-stamped); send the first publish's time."""
    try:
        conn.send(asyncio.run(_publish(kind, address, n, rate, geo)))
    except BaseException as exc:
        conn.send(f"publisher failed: {exc!r}")
        raise


async def _publish(kind: str, address: str, n: int, rate: float, geo: bool = False) -> float:
    paced = rate > 0

    def payload(i: int) -> bytes:
        if geo:
            return _geo_payload(i, paced)
        return next(_payloads(1, paced)) if paced else b"x" * PAYLOAD_BYTES

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
                at = _where if geo else (lambda _i: where)
                await c.publish_many([Publication(TOPIC, payload(i), at(i)) for i in range(n)])
                return t0
            pending: set[asyncio.Future[Any]] = set()
            for i in range(n):
                await pace(i, t0)
                if geo:
                    one = c.publish_many([Publication(TOPIC, payload(i), _where(i))])
                    pending.add(asyncio.ensure_future(one))
                else:
                    pending.add(asyncio.ensure_future(c.publish(TOPIC, payload(i))))
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
                infos.append(client.publish(_topic(i, geo), payload(i), qos=0))
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
                await nc.publish(_topic(i, geo, nats=True), payload(i))
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

    def __init__(self, subscribers: int, stamped: bool, check: bool = False) -> None:
        self.counts = [0] * subscribers
        self.last = 0.0
        self.stamped = stamped
        self.check = check  # the exact check against FENCE (peers on geofenced traffic)
        self.filtered = 0  # deliveries the exact check turned down
        self.latencies: list[float] = []
        self._lock = threading.Lock()  # paho calls back from one thread per client

    def got(self, i: int, payload: bytes) -> None:
        now = time.monotonic()
        head = payload.decode().split()
        if self.check and not covers(FENCE, LatLon(float(head[1]), float(head[2]))):
            with self._lock:
                self.filtered += 1
            return
        with self._lock:
            self.counts[i] += 1
            self.last = now
            if self.stamped:
                self.latencies.append(now - float(head[0]))

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
    kind: str, address: str, rx: _Receivers, geo: bool = False
) -> tuple[list[asyncio.Task[None]], Callable[[], Any]]:
    """Open the subscribers; return their reader tasks and an async closer."""
    n = len(rx.counts)
    filters = list(cover(FENCE, LAYOUT, topic_filter=TOPIC).filters) if geo else [TOPIC]
    if kind == "geofed":
        from geofed.client import connect
        from geofed.routing import LatLon

        clients = [
            await connect(
                client_id=f"bench-sub-{i}", location=LatLon(48.85, 2.35), endpoint=address
            )
            for i in range(n)
        ]
        fence = FENCE if geo else None
        subs = [await c.subscribe("bench/#", geofence=fence) for c in clients]

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
            c.subscribe([(f, 0) for f in filters])
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

        for f in filters:
            subject = nats_subject(f) if geo else SUBJECT
            await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=1 << 20)
        await nc.flush()  # the server holds the subscription
        conns.append(nc)

    async def close_nats() -> None:
        for nc in conns:
            await nc.close()

    return [], close_nats


async def _one_test(kind: str, address: str, test: str, args: argparse.Namespace) -> dict[str, Any]:
    """One test against a running broker."""
    geo = test.startswith("geo ")
    base = test.removeprefix("geo ")
    subscribers = 10 if base == "1->10" else 1
    stamped = base == "latency"
    n = int(args.rate * args.seconds) if stamped else args.events
    rx = _Receivers(subscribers, stamped, check=geo and kind != "geofed")
    tasks, close = await _subscribe(kind, address, rx, geo)
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_publisher, args=(kind, address, n, args.rate if stamped else 0.0, there, geo)
    )
    try:
        proc.start()
        there.close()
        answer = await asyncio.to_thread(_receive, here, 600.0)
        if not isinstance(answer, float):
            raise RuntimeError(str(answer))
        t0 = answer
        expected = ((n + 1) // 2 if geo else n) * subscribers  # geo: the events inside
        # The peers also receive the events just outside (their check drops them).
        arriving = expected + (n // 2 * subscribers if rx.check else 0)
        seen, since = -1, time.monotonic()
        while (got := rx.total + rx.filtered) < arriving:
            if got != seen:
                seen, since = got, time.monotonic()
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
    if rx.check:
        row["filtered"] = rx.filtered
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
    tests = tests_of(args.traffic)
    try:
        with _broker(kind) as address:
            for test in tests:
                print(f"  {kind} {test} ...", file=sys.stderr, flush=True)
                try:
                    out[test] = asyncio.run(_one_test(kind, address, test, args))
                except Exception as exc:
                    out[test] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
    except Exception as exc:
        for test in tests:
            out.setdefault(test, {"error": f"broker did not start: {exc}"})
    return out


def _ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    if "error" in a or "error" in b or not b.get(key):
        return None
    return float(a[key]) / float(b[key])


def summarize(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-repetition ratios and the medians over repetitions that completed."""
    ratios: list[dict[str, float | None]] = []
    prefixes = [_PREFIX[t] for t in _traffics(reps)]
    for rep in reps:
        r = rep["results"]
        row: dict[str, float | None] = {}
        for pre in prefixes:
            for other in ("mosquitto", "nats"):
                for test in (pre + "1->1", pre + "1->10"):
                    row[f"{test} vs {other}"] = _ratio(r["geofed"][test], r[other][test], "per_s")
                lat = pre + "latency"
                for q in ("p50_ms", "p99_ms"):
                    row[f"{pre}{q} vs {other}"] = _ratio(r["geofed"][lat], r[other][lat], q)
        ratios.append(row)
    medians: dict[str, Any] = {}
    for key in ratios[0] if ratios else []:
        vals = [v for x in ratios if (v := x[key]) is not None]
        medians[key] = round(statistics.median(vals), 3) if vals else None
    figures: dict[str, Any] = {}
    for kind, pre in ((k, p) for k in KINDS for p in prefixes):
        for test, key in (
            (pre + "1->1", "per_s"),
            (pre + "1->10", "per_s"),
            (pre + "latency", "p50_ms"),
            (pre + "latency", "p99_ms"),
        ):
            figs: list[float] = [
                rep["results"][kind][test][key] for rep in reps if key in rep["results"][kind][test]
            ]
            figures[f"{kind} {test} {key}"] = statistics.median(figs) if figs else None
    return {"ratios": ratios, "median_ratios": medians, "median_figures": figures}


def _markdown(reps: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    traffics = _traffics(reps)
    lines = [
        "| repetition | order | load before | broker | traffic | 1→1 deliveries/s"
        " | 1→10 deliveries/s | p50 / p99 ms at rate | lost (1→1, 1→10, latency) |",
        "|---:|---|---|---|---|---:|---:|---:|---|",
    ]
    for rep in reps:
        for kind, traffic in ((k, t) for k in KINDS for t in traffics):
            r = rep["results"][kind]
            pre = _PREFIX[traffic]
            cells = []
            for test in (pre + "1->1", pre + "1->10"):
                cells.append(r[test].get("per_s", "failed") if "error" not in r[test] else "failed")
            lat = r[pre + "latency"]
            cells.append("failed" if "error" in lat else f"{lat['p50_ms']} / {lat['p99_ms']}")
            lost = ", ".join(
                "—" if "error" in r[t] else f"{r[t]['expected'] - r[t]['delivered']:,}"
                for t in tests_of([traffic])
            )
            fmt = [f"{c:,}" if isinstance(c, int) else str(c) for c in cells]
            lines.append(
                f"| {rep['repetition']} | {' → '.join(rep['order'])} | {rep['load'][0]:.2f} "
                f"| {kind} | {traffic} | {fmt[0]} | {fmt[1]} | {fmt[2]} | {lost} |"
            )
    failures = [
        f"- repetition {rep['repetition']}, {kind} {test}: {rep['results'][kind][test]['error']}"
        for rep in reps
        for kind in KINDS
        for test in tests_of(traffics)
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


def add_arguments(
    p: Any,
    prefix: str = "",
    events: int = 20_000,
    repeat: int = 3,
    seconds: float = 5.0,
    traffic: str = "topic",
) -> None:
    """The options of the tests, named ``--{prefix}events`` ... (an argparse parser or
    group; the defaults given)."""
    p.add_argument(f"--{prefix}events", type=int, default=events, help="events per throughput test")
    p.add_argument(
        f"--{prefix}repeat", type=int, default=repeat, help="repetitions (order rotated)"
    )
    p.add_argument(
        f"--{prefix}rate", type=float, default=200.0, help="events/s of the latency test"
    )
    p.add_argument(
        f"--{prefix}seconds", type=float, default=seconds, help="length of the latency test"
    )
    p.add_argument(
        f"--{prefix}traffic",
        action="append",
        choices=TRAFFIC,
        help=f"topic-only and/or geofenced (repeatable; default: {traffic})",
    )


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    """Every repetition: the results, their summary and the Markdown table."""
    args.traffic = list(dict.fromkeys(args.traffic or ["topic"]))
    reps: list[dict[str, Any]] = []
    for k in range(args.repeat):
        order = list(KINDS[k % len(KINDS) :] + KINDS[: k % len(KINDS)])
        load = os.getloadavg()
        print(f"repetition {k + 1}: {' -> '.join(order)} (load {load[0]:.2f})", file=sys.stderr)
        results = {kind: _run_broker(kind, args) for kind in order}
        reps.append({"repetition": k + 1, "order": order, "load": load, "results": results})
    summary = summarize(reps)
    return reps, summary, _markdown(reps, summary)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(p)
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--no-record", action="store_true", help="do not append to bench/results/brokers.md"
    )
    args = p.parse_args(argv)
    if args.events < 1 or args.repeat < 1 or args.rate <= 0 or args.seconds <= 0:
        p.error("--events, --repeat, --rate and --seconds must be positive")
    reps, summary, table = run(args)
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
