"""What a handover costs a moving subscriber: events missed and the move's time.

A subscriber with `--subs` world-wide subscriptions (one topic each) moves
back and forth between Paris (eu) and New York (us) on the bundled `three`
federation, `--moves` times `--gap-s` apart (a quarter second: faster than
an old broker lets go over a WAN, so the client often comes back to a broker
that still holds it), while a publisher at Singapore (ap) publishes
`--rate` events a second on those topics, round robin, for the whole run.
Every event is world-wide, so a subscriber that held its subscriptions the
whole time would receive every event once. The client makes before it
breaks (docs/design.md §7): the old broker matches for it until the
renewals stand and lets go once what its peers sent it is delivered, so it
should miss nothing; the price is the time `move` takes, which `--wan
model` (emulated inter-region delays) shows. `--hold-s 0` runs the brokers
without holding (break before make: the old broker withdraws when it
answers the move), which misses what is matched between that withdrawal
and the new broker's registration.

`--client mqtt` moves an MQTT 5 client instead (paho-mqtt, a persistent
session, QoS 1 subscriptions): it reports each new location on a PUBLISH,
follows the redirect to the Server Reference with Clean Start 0 and
subscribes again only if its session is not there. Its old broker sends the
session ahead (docs/design.md §7); with `--hold-s 0` it does not, and the
client subscribes again after each move. Its move time is from the PUBLISH
with the new location until its subscriptions stand at the new broker
(CONNACK with the session present, or the last SUBACK).

`--peer mosquitto` moves the same MQTT client between Debian's Mosquitto
brokers instead, one per region of `three`, eu's and us' bridged to ap's
(the publisher's) with ``topic # both 1``: the usual build from topic-only
brokers. Mosquitto does not redirect, so the client disconnects and connects
to the broker of its new place itself; one run keeps its session (Clean
Start 0, subscribing again where the session is not there), one starts clean
at every move.

Reported per strategy: events published, received, missed (in total and per
move), deliveries the brokers made that never reached the client (counted
from the nodes' delivery metric: none should be), events received more than
once, and the median and worst time a move took. The run ends with the
quiescence barrier, so nothing is counted as missed that was only late.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import geofed
from geofed.node import DELIVERIES
from geofed.routing import STRATEGIES, Federation, GeofedError

from ._machine import record
from .brokers import Mosquitto
from .compare import wan_settings
from .faults import until
from .local import LocalFederation

RESULTS = Path(__file__).resolve().parent / "results" / "handover.md"
PARIS = geofed.LatLon(48.85, 2.35)
NEW_YORK = geofed.LatLon(40.71, -74.0)
SINGAPORE = geofed.LatLon(1.29, 103.85)
HANG_S = 120.0
LOST_S = 10.0  # after the barrier, a delivery made that has not arrived by then was lost


class _Publisher:
    """`rate` events a second at ap on topics ho/0 .. ho/{subs - 1}, round robin;
    `send(topic, n)` publishes the `n`-th and answers its event id."""

    def __init__(self, send: Callable[[str, int], Awaitable[str]], subs: int, rate: float) -> None:
        self.published: list[str] = []
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._publish(send, subs, rate))
        self._rate = rate

    async def _publish(
        self, send: Callable[[str, int], Awaitable[str]], subs: int, rate: float
    ) -> None:
        start, n = time.perf_counter(), 0
        while not self._stop.is_set():
            wait = start + n / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            self.published.append(await send(f"ho/{n % subs}", n))
            n += 1

    async def pause(self, seconds: float) -> None:
        """Until `seconds`' worth more events went out."""
        mark = len(self.published)
        while len(self.published) < mark + self._rate * seconds:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._stop.set()
        await self._task


class _MqttMover:
    """A paho-mqtt 5.0 client with a persistent session that follows its redirects."""

    def __init__(self, endpoints: dict[str, str], subs: int) -> None:
        self.endpoints = endpoints  # broker -> host:port of its MQTT listener
        self.subs = subs
        self.received: Counter[str] = Counter()  # event id -> copies
        self.broker = "eu"
        self._lock = threading.Lock()
        self._client: Any = None
        self._stopping: list[threading.Thread] = []  # old connections' network threads
        self._gone = threading.Event()  # the connection ended (a redirect: `_reference`)
        self._reference: list[str] = []

    @staticmethod
    def _located(packet: str, where: geofed.LatLon) -> Any:
        """MQTT 5 properties of a `packet` ("CONNECT", "PUBLISH") that carry `where`."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(getattr(PacketTypes, packet))  # type: ignore[no-untyped-call]
        props.UserProperty = [("geofed-location", f"{where.lat},{where.lon}")]
        return props

    def connect(self, broker: str, where: geofed.LatLon, clean: bool) -> None:
        """Connect to `broker` at `where`; subscribe unless the session was there."""
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        c = paho.Client(CallbackAPIVersion.VERSION2, client_id="mqtt-mover", protocol=paho.MQTTv5)
        c.reconnect_delay_set(int(HANG_S), int(HANG_S))  # redirects are followed, not retried
        acked = threading.Event()
        present: list[bool] = []
        subacks: set[int] = set()
        suback = threading.Event()
        gone = threading.Event()  # this connection's, whatever the others' threads still do
        reference: list[str] = []

        def on_connect(c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
            present.append(bool(flags.session_present))
            acked.set()

        def on_subscribe(c: Any, u: Any, mid: int, rcs: Any, props: Any) -> None:
            subacks.add(mid)
            suback.set()

        def on_disconnect(c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
            reference.append(str(getattr(props, "ServerReference", "") or ""))
            gone.set()

        def on_message(c: Any, u: Any, msg: Any) -> None:
            props = getattr(msg.properties, "UserProperty", [])
            ids = [v for k, v in props if k == "geofed-event-id"] or [msg.payload.decode()]
            with self._lock:
                self.received.update(ids)

        c.on_connect, c.on_subscribe = on_connect, on_subscribe
        c.on_disconnect, c.on_message = on_disconnect, on_message
        host, _, port = self.endpoints[broker].rpartition(":")
        props = self._located("CONNECT", where)
        props.SessionExpiryInterval = 600
        c.connect(host, int(port), clean_start=clean, properties=props)
        c.loop_start()
        if not acked.wait(HANG_S):
            raise TimeoutError(f"no CONNACK from {broker}")
        self._client, self.broker = c, broker
        self._gone, self._reference = gone, reference
        if present[0]:
            return
        mids = {c.subscribe(f"ho/{i}", 1)[1] for i in range(self.subs)}
        deadline = time.monotonic() + HANG_S
        while not mids <= subacks:  # paho's thread adds them
            suback.clear()
            if not mids <= subacks and not suback.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"no SUBACKs from {broker}")

    def move(self, where: geofed.LatLon) -> None:
        """Report `where`; follow the redirect there (Clean Start 0)."""
        self._client.publish("ho/where", b"", 0, properties=self._located("PUBLISH", where))
        if not self._gone.wait(HANG_S):
            raise TimeoutError("no redirect")
        targets = [b for b, e in self.endpoints.items() if e == self._reference[0]]
        if not targets:
            raise RuntimeError(f"disconnected by {self.broker} without a redirect")
        self._reconnect(targets[0], where)

    def hop(self, broker: str, where: geofed.LatLon, clean: bool = False) -> None:
        """Leave this broker (DISCONNECT, the session kept) for `broker`, the one of
        `where`, as a client of brokers that do not redirect picks its broker itself."""
        self._client.disconnect()
        if not self._gone.wait(HANG_S):
            raise TimeoutError("the DISCONNECT did not end the connection")
        self._reconnect(broker, where, clean)

    def _reconnect(self, broker: str, where: geofed.LatLon, clean: bool = False) -> None:
        old = self._client
        self.connect(broker, where, clean=clean)
        # Its network thread ends within a second (paho's select timeout): not the move's time.
        self._stopping.append(threading.Thread(target=old.loop_stop))
        self._stopping[-1].start()

    def close(self) -> None:
        if self._client is not None:
            self._client.disconnect()
            self._client.loop_stop()
        for thread in self._stopping:
            thread.join()


async def _run_mqtt(
    fed: LocalFederation, subs: int, moves: int, rate: float, gap_s: float
) -> dict[str, float]:
    where = str(fed.federation_path)
    took: list[float] = []
    mover = _MqttMover({b: n.mqtt for b, n in fed.nodes.items()}, subs)
    try:
        await asyncio.to_thread(mover.connect, "eu", PARIS, True)
        async with await geofed.connect(
            client_id="pub", location=SINGAPORE, federation=where
        ) as pub:
            await fed.quiescent(HANG_S)
            publisher = _Publisher(lambda topic, n: pub.publish(topic, b"x"), subs, rate)
            await publisher.pause(gap_s)  # publishing before the first move
            for i in range(moves):
                began = time.perf_counter()
                await asyncio.to_thread(mover.move, NEW_YORK if i % 2 == 0 else PARIS)
                took.append(time.perf_counter() - began)
                await publisher.pause(gap_s)  # between moves
            await publisher.stop()
            await fed.quiescent(HANG_S)
            with contextlib.suppress(GeofedError):  # what is still on its way arrives
                await until(
                    lambda: set(publisher.published) <= set(mover.received), "the events", LOST_S
                )
    finally:
        await asyncio.to_thread(mover.close)
    # Not measured: "made, never received" (a queue handed to the new broker is
    # delivered from there again, so deliveries made and copies received differ).
    return _figures(publisher.published, mover.received, took, moves)


def _mosquitto_star() -> dict[str, Mosquitto]:
    """Debian's Mosquitto for each broker of `three`, eu's and us' bridged to ap's (the
    publisher's, the hub) with ``topic # both 1``: every event reaches every broker,
    the usual build from topic-only brokers (bench/peers.py's star)."""
    hub = Mosquitto().start()
    out = {"ap": hub}
    try:
        for leaf in ("eu", "us"):
            out[leaf] = Mosquitto(extra=Mosquitto.bridge(leaf, "ap", hub.address, 1)).start()
    except BaseException:
        for broker in out.values():
            broker.stop()
        raise
    return out


def _paho(endpoint: str, client_id: str) -> Any:
    """A connected paho-mqtt 5.0 client with its network thread running."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    host, _, port = endpoint.rpartition(":")
    c.connect(host, int(port))
    c.loop_start()
    return c


async def _bridged(endpoints: dict[str, str]) -> None:
    """Until a message published at ap reaches eu and us (their bridges are up)."""
    seen: set[str] = set()
    probes = []
    for leaf in ("eu", "us"):
        c = _paho(endpoints[leaf], f"probe-{leaf}")
        c.on_message = lambda c, u, m, leaf=leaf: seen.add(leaf)
        c.subscribe("probe", 1)
        probes.append(c)
    pub = _paho(endpoints["ap"], "probe-pub")
    try:
        deadline = time.monotonic() + HANG_S
        while seen != {"eu", "us"}:
            if time.monotonic() > deadline:
                raise TimeoutError("the bridges to ap did not come up")
            pub.publish("probe", b"", 1)
            await asyncio.sleep(0.1)
    finally:
        for c in (*probes, pub):
            c.disconnect()
            c.loop_stop()


async def _run_mosquitto(
    subs: int, moves: int, rate: float, gap_s: float, clean: bool
) -> dict[str, Any]:
    """The MQTT client's moves between Mosquitto brokers (`_mosquitto_star`). Mosquitto
    does not redirect: the client disconnects and connects to the broker of its new
    place itself, with Clean Start 0 (`clean`: 1) and its subscriptions when the
    session is not there. The publisher is a paho client at ap, the event's id its
    payload."""
    brokers = await asyncio.to_thread(_mosquitto_star)
    took: list[float] = []
    try:
        endpoints = {b: m.address for b, m in brokers.items()}
        await _bridged(endpoints)
        mover = _MqttMover(endpoints, subs)
        pub = await asyncio.to_thread(_paho, endpoints["ap"], "pub")
        try:
            await asyncio.to_thread(mover.connect, "eu", PARIS, True)

            async def send(topic: str, n: int) -> str:
                pub.publish(topic, f"e{n}".encode(), 1)
                return f"e{n}"

            publisher = _Publisher(send, subs, rate)
            await publisher.pause(gap_s)
            for i in range(moves):
                to, where = ("us", NEW_YORK) if i % 2 == 0 else ("eu", PARIS)
                began = time.perf_counter()
                await asyncio.to_thread(mover.hop, to, where, clean)
                took.append(time.perf_counter() - began)
                await publisher.pause(gap_s)
            await publisher.stop()
            with contextlib.suppress(GeofedError):  # what is still on its way arrives
                await until(
                    lambda: set(publisher.published) <= set(mover.received), "the events", LOST_S
                )
        finally:
            pub.disconnect()
            pub.loop_stop()
            await asyncio.to_thread(mover.close)
    finally:
        for broker in brokers.values():
            broker.stop()
    return _figures(publisher.published, mover.received, took, moves)


def _figures(
    published: list[str], received: Counter[str], took: list[float], moves: int
) -> dict[str, Any]:
    missed = len(set(published) - set(received))
    return {
        "published": len(published),
        "received": len(set(received) & set(published)),
        "missed": missed,
        "per_move": missed / moves,
        "twice": sum(1 for n in received.values() if n > 1),
        "move_ms_p50": 1000 * statistics.median(took),
        "move_ms_max": 1000 * max(took),
        "lost": None,
    }


async def _run(
    fed: LocalFederation, subs: int, moves: int, rate: float, gap_s: float
) -> dict[str, float]:
    where = str(fed.federation_path)
    received: Counter[str] = Counter()
    took: list[float] = []
    async with (
        await geofed.connect(client_id="mover", location=PARIS, federation=where) as mover,
        await geofed.connect(client_id="pub", location=SINGAPORE, federation=where) as pub,
    ):
        streams = [await mover.subscribe(f"ho/{i}", subscription_id=f"s{i}") for i in range(subs)]
        await fed.quiescent(HANG_S)

        async def take(sub: geofed.Subscription) -> None:
            async for msg in sub:
                received[msg.event_id] += 1

        takers = [asyncio.create_task(take(s)) for s in streams]

        publisher = _Publisher(lambda topic, n: pub.publish(topic, b"x"), subs, rate)
        await publisher.pause(gap_s)  # publishing before the first move
        for i in range(moves):
            began = time.perf_counter()
            assert await mover.move(NEW_YORK if i % 2 == 0 else PARIS)
            took.append(time.perf_counter() - began)
            await publisher.pause(gap_s)  # between moves
        await publisher.stop()
        await fed.quiescent(HANG_S)
        made = await asyncio.to_thread(fed.total, DELIVERIES)  # every delivery the brokers made
        with contextlib.suppress(GeofedError):  # one made and lost never arrives: counted
            await until(
                lambda: sum(s.received for s in streams) >= made, "the deliveries arrive", LOST_S
            )
        arrived = sum(s.received for s in streams)
        await mover.close()
        for t in takers:
            await t
    # The library drops a second copy (counted in `duplicates`, not in `received`).
    return _figures(publisher.published, received, took, moves) | {"lost": made - arrived}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--subs", type=int, default=20, help="subscriptions of the moving client")
    p.add_argument("--moves", type=int, default=20, help="handovers (eu <-> us)")
    p.add_argument("--rate", type=float, default=400.0, help="events/s published at ap")
    p.add_argument("--gap-s", type=float, default=0.25, help="seconds between moves")
    p.add_argument(
        "--strategy", action="append", choices=list(STRATEGIES), help="repeatable; default: all"
    )
    p.add_argument(
        "--hold-s",
        type=float,
        help="the brokers' handover_hold_s (default: theirs, 10; 0: break before make)",
    )
    p.add_argument(
        "--wan",
        default="off",
        metavar="model|off|FILE",
        help="emulated inter-broker latency, as for `geofed compare` (default: off)",
    )
    p.add_argument("--wan-ms-per-km", type=float, help="with --wan model (default 0.021)")
    p.add_argument(
        "--client",
        choices=("grpc", "mqtt"),
        default="grpc",
        help="the moving client: geofed's Python client, or paho-mqtt 5.0 (default: grpc)",
    )
    p.add_argument(
        "--peer",
        choices=("mosquitto",),
        help="move the MQTT client between Debian Mosquitto brokers bridged to ap's instead"
        " (persistent and clean sessions; no --strategy, --hold-s or --wan)",
    )
    p.add_argument("--no-record", action="store_true", help="do not append to handover.md")
    args = p.parse_args(argv)
    if args.peer and (args.strategy or args.hold_s is not None or args.wan != "off"):
        p.error("--peer: the brokers are Mosquitto's (no --strategy, --hold-s or --wan)")
    if args.peer:
        return _main_peer(args, argv)
    env, wan_text = wan_settings(args.wan, args.wan_ms_per_km, Federation.load("three"))
    if args.hold_s is not None:
        env["GEOFED_HANDOVER_HOLD_S"] = f"{args.hold_s:g}"
    rows = []
    for strategy in args.strategy or list(STRATEGIES):
        with (
            tempfile.TemporaryDirectory(prefix="geofed-handover-") as work,
            LocalFederation("three", strategy, Path(work), extra_env=env) as fed,
        ):
            runner = _run_mqtt if args.client == "mqtt" else _run
            r = asyncio.run(runner(fed, args.subs, args.moves, args.rate, args.gap_s))
        rows.append(_row(strategy, r))
    mover = (
        "an MQTT 5.0 client (paho-mqtt, persistent session, QoS 1)"
        if args.client == "mqtt"
        else "geofed's Python client"
    )
    body = (
        f"{mover} with {args.subs} world-wide subscriptions, {args.moves} moves eu <-> us,"
        f" {args.gap_s:g} s apart, {args.rate:g} events/s published at ap throughout;"
        f" handover_hold_s {'10, the default' if args.hold_s is None else f'{args.hold_s:g}'}:"
        f" {'break before make' if args.hold_s == 0 else 'make before break'}; WAN"
        f" emulation: {wan_text}.\n\n" + _table("strategy", rows)
    )
    print(body)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.handover_bench",
            argv,
            body,
            title="# Handover: what a moving subscriber misses\n\n"
            "`python -m geofed.bench.handover_bench` (bench/handover_bench.py says what it"
            " measures).\n",
        )
    return 0


def _row(name: str, r: dict[str, Any]) -> str:
    """A table row of one run's figures, printed as it is made."""
    lost = "-" if r["lost"] is None else f"{r['lost']:,.0f}"
    row = (
        f"| {name} | {r['published']:,.0f} | {r['received']:,.0f} | {r['missed']:,.0f}"
        f" | {r['per_move']:.1f} | {lost} | {r['twice']:,.0f}"
        f" | {r['move_ms_p50']:.1f} | {r['move_ms_max']:.1f} |"
    )
    print(row, flush=True)
    return row


def _table(first: str, rows: list[str]) -> str:
    """The results table of `_row`s, its first column headed `first`."""
    return (
        f"| {first} | published | received | missed | missed per move | made, never received"
        " | received twice | move ms p50 | move ms max |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )


def _main_peer(args: argparse.Namespace, argv: list[str] | None) -> int:
    rows = []
    for clean in (False, True):
        r = asyncio.run(_run_mosquitto(args.subs, args.moves, args.rate, args.gap_s, clean))
        session = "clean session (Clean Start 1)" if clean else "persistent session"
        rows.append(_row(f"mosquitto star, {session}", r))
    body = (
        f"an MQTT 5.0 client (paho-mqtt, QoS 1) with {args.subs} subscriptions, {args.moves}"
        f" moves between Mosquitto brokers of eu and us, {args.gap_s:g} s apart, {args.rate:g}"
        " events/s published at ap's Mosquitto throughout (QoS 1); eu's and us' bridged to"
        " ap's with `topic # both 1`; the client disconnects and connects to its new place's"
        " broker itself (Mosquitto does not redirect), subscribing again when its session is"
        " not there; loopback.\n\n" + _table("broker", rows)
    )
    print(body)
    if not args.no_record:
        record(RESULTS, "geofed.bench.handover_bench", argv, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
