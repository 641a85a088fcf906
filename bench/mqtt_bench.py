"""Benchmark MQTT throughput: events/s through one geofed node next to Mosquitto, as a ratio.

Not a test: it prints what it measured and appends it to
``bench/results/mqtt.md`` with the command and the machine (``--out``
elsewhere, ``--no-record`` nowhere).

Set-up, the same for both brokers, on loopback in one run: ``--publishers``
``mosquitto_pub`` processes (MQTT 5, QoS 0 or 1, one event per input line,
``-l``, up to ``--inflight`` QoS 1 messages in flight each) publish
``--events`` events of ``--payload`` bytes to ``bench/t`` between them, and
one ``mosquitto_sub`` (MQTT 5, the same QoS) subscribed to ``bench/#``
receives them all. The rate is the events over the time from the first
publisher's start until the subscriber has received the last one; the
subscriber is known to be subscribed before that (a probe reached it).

* **geofed**: one ``geofed node`` (a one-broker federation covering the
  world, MQTT listener on, no store). The publishers give their location
  (Paris) on CONNECT; the subscriber's filter carries a subscription
  geofence (a 50 km circle around Paris) that each event is matched
  against, and ``--subs`` more geofenced subscriptions on the same filter
  (1–100 km circles within about 1,000 km of Paris, none containing it: every
  event is checked against them and matches none) are held by a persistent
  gRPC session. The node's subscriber queue is raised to hold every event of
  a run (its default drops the oldest deliveries of a subscriber that falls
  behind; Mosquitto's is unlimited here too).
* **Mosquitto**: Debian's ``mosquitto`` broker, topic-only (it passes the
  geofed user properties on and ignores them), started from a generated
  configuration on a free loopback port: no persistence, no queue limit.

Each QoS runs ``--rounds`` times per broker, the order of the two brokers
rotated from one run to the next so that a drift of the machine's load
favours neither. The ratio is geofed's median events/s over Mosquitto's.

Usage: ``python -m geofed.bench.mqtt_bench [--events 50000] [--publishers 4]
[--subs 1000] [--qos 0,1] [--rounds 3] [--payload 64] [--inflight 100]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from geofed.client import connect
from geofed.node import DELIVERIES, SUBSCRIPTIONS
from geofed.routing import GeofedError, LatLon, great_circle_m

from ._machine import record
from .brokers import Mosquitto
from .local import LocalFederation
from .scrape import metric

RESULTS = Path(__file__).resolve().parent / "results" / "mqtt.md"
TOPIC = "bench/t"
FILTER = "bench/#"
PARIS = (48.85, 2.35)
PARIS_TEXT = f"{PARIS[0]},{PARIS[1]}"
SUBSCRIBER_FENCE = f"circle:{PARIS_TEXT},50000"
HANG_S = 600.0  # a client that has not finished by then is hung, not slow


def one_broker_federation(path: Path) -> Path:
    """A federation of one broker, ``node``, covering the world."""
    world = [[-180.0, -90.0], [180.0, -90.0], [180.0, 90.0], [-180.0, 90.0], [-180.0, -90.0]]
    doc = {
        "type": "FeatureCollection",
        "features": [
            {
                "type": "Feature",
                "properties": {"id": "node", "site": [PARIS[1], PARIS[0]]},
                "geometry": {"type": "Polygon", "coordinates": [world]},
            }
        ],
    }
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def background_fences(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` circles of 1-100 km within about 1,000 km of Paris, none containing Paris."""
    rng = random.Random(seed)
    fences: list[dict[str, Any]] = []
    while len(fences) < n:
        lat = PARIS[0] + rng.uniform(-9.0, 9.0)
        lon = PARIS[1] + rng.uniform(-13.0, 13.0)
        radius = rng.uniform(1_000.0, 100_000.0)
        # Clear of Paris by 20 km more than the radius: the 64-gon's error aside.
        if great_circle_m(LatLon(*PARIS), LatLon(lat, lon)) > radius + 20_000.0:
            fences.append({"circle": {"lat": lat, "lon": lon, "radius_m": radius}})
    return fences


async def hold_subscriptions(fed: LocalFederation, fences: list[dict[str, Any]]) -> None:
    """A persistent gRPC session subscribing `FILTER` once per geofence, then closed (kept)."""
    client = await connect(
        client_id="bench-background",
        location=LatLon(*PARIS),
        federation=fed.federation_path,
        session_expiry_s=86_400.0,
    )
    async with client:
        for i, fence in enumerate(fences):
            await client.subscribe(FILTER, geofence=fence, subscription_id=f"bg-{i}")


@dataclass
class Run:
    """One measured run."""

    broker: str
    qos: int
    events: int
    seconds: float
    cpu_s: float  # the broker process's CPU time (user + system) during the run
    order: int

    @property
    def rate(self) -> float:
        return self.events / self.seconds

    @property
    def per_cpu_s(self) -> float | None:
        """None when the run took less CPU than the clock's tick (too short to tell)."""
        return self.events / self.cpu_s if self.cpu_s > 0 else None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _geo_args(geofed: bool, packet: str, name: str, value: str) -> list[str]:
    return ["-D", packet, "user-property", name, value] if geofed else []


class _Lines:
    """Reads the subscriber's output (one payload per line): probes seen, events counted."""

    def __init__(self, stream: IO[bytes], marker: bytes, events: int) -> None:
        self.stream = stream
        self.marker = marker
        self.events = events
        self.probes = 0
        self.counted = 0
        self.first = threading.Event()
        self.done = threading.Event()
        self.end = 0.0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.stream:
            if line.rstrip(b"\n") == self.marker:
                self.counted += 1
                if self.counted == self.events:
                    self.end = time.perf_counter()
                    self.done.set()
            else:
                self.probes += 1
            self.first.set()


@dataclass(frozen=True)
class Load:
    """What the publishers send in one run."""

    events: int
    publishers: int
    payload: int
    inflight: int  # QoS 1 messages in flight per publisher (mosquitto_pub -M)


def measure(
    port: int, qos: int, load: Load, geofed: bool, tag: str, workdir: Path
) -> tuple[float, int]:
    """Seconds from the first publisher's start until the subscriber has every event; probes.

    The subscriber is known to be subscribed once a probe published after it
    started reaches it (probes are sent one after the other until one does).
    """
    where = _geo_args(geofed, "connect", "geofed-location", PARIS_TEXT)
    sub = subprocess.Popen(
        [
            "mosquitto_sub", "-p", str(port), "-V", "mqttv5", "-q", str(qos),
            "-i", f"bench-sub-{tag}", "-t", FILTER, *where,
            *_geo_args(geofed, "subscribe", "geofed-geofence", SUBSCRIBER_FENCE),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert sub.stdout is not None
    events = load.events
    marker = b"x" * load.payload
    lines = _Lines(sub.stdout, marker, events)
    try:
        deadline = time.monotonic() + 60.0
        while not lines.first.is_set():
            if time.monotonic() > deadline or sub.poll() is not None:
                raise GeofedError(f"the subscriber on port {port} got no probe in 60 s")
            probe = ["mosquitto_pub", "-p", str(port), "-V", "mqttv5", "-q", "1",
                     "-i", f"bench-probe-{tag}", "-t", "bench/probe", "-m", "-",
                     *where]  # fmt: skip
            subprocess.run(probe, check=True, timeout=HANG_S, capture_output=True)
            lines.first.wait(1.0)  # a poll interval: the next probe follows if none arrived
        n = load.publishers
        shares = [events // n + (i < events % n) for i in range(n)]
        inputs = []
        for i, share in enumerate(s for s in shares if s):
            path = workdir / f"lines-{i}"  # one event per line: mosquitto_pub -l
            if not path.exists() or path.stat().st_size != share * (load.payload + 1):
                path.write_bytes((marker + b"\n") * share)
            inputs.append(path)
        command = ["mosquitto_pub", "-p", str(port), "-V", "mqttv5", "-q", str(qos),
                   "-M", str(load.inflight), "-t", TOPIC, "-l", *where]  # fmt: skip
        start = time.perf_counter()
        pubs = []
        for i, path in enumerate(inputs):
            with path.open("rb") as lines_in:
                pubs.append(
                    subprocess.Popen(
                        [*command, "-i", f"bench-pub-{tag}-{i}"],
                        stdin=lines_in,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                    )
                )
        for p in pubs:
            _, err = p.communicate(timeout=HANG_S)
            if p.returncode != 0:
                raise GeofedError(f"mosquitto_pub failed ({p.returncode}): {err.decode()}")
        if not lines.done.wait(HANG_S):
            raise GeofedError(
                f"the subscriber got {lines.counted} of {events} events in {HANG_S} s"
            )
        return lines.end - start, lines.probes
    finally:
        sub.kill()
        sub.wait()
        lines.thread.join()
        sub.stdout.close()


def run(
    load: Load, subs: int, qos_levels: list[int], rounds: int
) -> tuple[list[Run], dict[str, Any]]:
    """Both brokers, every QoS, `rounds` times each, the brokers' order rotated."""
    runs: list[Run] = []
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="geofed-mqtt-bench-") as tmp:
        work = Path(tmp)
        fed_file = one_broker_federation(work / "one.geojson")
        events = load.events
        queue = str(max(events, 1) * 2)
        env = {
            "GEOFED_SUBSCRIBER_QUEUE_SIZE": queue,
            "GEOFED_SUBSCRIBER_QUEUE_BYTES": str(max(events, 1) * 4096),
            "GEOFED_LOG_LEVEL": "warning",
        }
        with (
            LocalFederation(fed_file, "event-geofence", work / "geofed", extra_env=env) as fed,
            Mosquitto(extra=["max_queued_messages 0"]) as mosq,  # no limit, no drop: as geofed
        ):
            node = fed.nodes["node"]
            asyncio.run(hold_subscriptions(fed, background_fences(subs, seed=1)))
            held = metric(node.metrics_url, SUBSCRIPTIONS, scope="local")
            if held != subs:
                raise GeofedError(f"the node holds {held:.0f} subscriptions, not {subs}")
            ports = {"geofed": int(node.mqtt.rsplit(":", 1)[1]), "mosquitto": mosq.port}
            assert mosq.process is not None  # started
            pids = {"geofed": node.process.pid, "mosquitto": mosq.process.pid}
            delivered = metric(node.metrics_url, DELIVERIES)
            expected = 0
            turn = 0
            for qos in qos_levels:
                for _ in range(rounds):
                    order = ["geofed", "mosquitto"][:: 1 if turn % 2 == 0 else -1]
                    turn += 1
                    for broker in order:
                        tag = f"{broker}-{len(runs)}"
                        print(f"[qos {qos}] {broker} ...", file=sys.stderr)
                        cpu = cpu_seconds(pids[broker])
                        seconds, probes = measure(
                            ports[broker], qos, load, broker == "geofed", tag, work
                        )
                        cpu = cpu_seconds(pids[broker]) - cpu
                        runs.append(Run(broker, qos, events, seconds, cpu, len(runs) + 1))
                        if broker == "geofed":
                            expected += events + probes
            facts["geofed_deliveries"] = metric(node.metrics_url, DELIVERIES) - delivered
            facts["expected_deliveries"] = expected
            facts["subscriptions"] = metric(node.metrics_url, SUBSCRIPTIONS, scope="local")
            facts["mosquitto_version"] = _mosquitto_version()
    if facts["geofed_deliveries"] != facts["expected_deliveries"]:
        raise GeofedError(
            f"geofed delivered {facts['geofed_deliveries']:.0f} events,"
            f" {facts['expected_deliveries']} expected (events and probes received; no"
            " background subscription may match)"
        )
    return runs, facts


def _mosquitto_version() -> str:
    done = subprocess.run(
        [Mosquitto.executable(), "-h"], capture_output=True, text=True, timeout=60, check=False
    )
    first = (done.stdout or done.stderr).splitlines()
    return first[0].strip() if first else "mosquitto"


def table(runs: list[Run]) -> str:
    """Per QoS: every run's events/s, the medians and geofed's ratio to Mosquitto.

    Beside the wall-clock rates, the events per CPU second of the broker
    process: on a shared machine, what each broker costs, whatever else ran.
    """
    lines = [
        "| QoS | geofed events/s (runs) | Mosquitto events/s (runs) | geofed median "
        "| Mosquitto median | ratio | geofed events per CPU s | Mosquitto events per CPU s "
        "| ratio per CPU s |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for qos in sorted({r.qos for r in runs}):
        g = [r for r in runs if r.qos == qos and r.broker == "geofed"]
        m = [r for r in runs if r.qos == qos and r.broker == "mosquitto"]
        gm, mm = statistics.median(r.rate for r in g), statistics.median(r.rate for r in m)
        gc, mc = _median_per_cpu(g), _median_per_cpu(m)
        per_cpu = (
            f"{gc:,.0f} | {mc:,.0f} | {gc / mc:.2f}×"
            if gc is not None and mc is not None
            else "– | – | –"  # a run too short for the CPU clock
        )
        lines.append(
            f"| {qos} | {', '.join(f'{r.rate:,.0f}' for r in g)} "
            f"| {', '.join(f'{r.rate:,.0f}' for r in m)} | {gm:,.0f} | {mm:,.0f} "
            f"| {gm / mm:.2f}× | {per_cpu} |"
        )
    return "\n".join(lines)


def _median_per_cpu(runs: list[Run]) -> float | None:
    values = [r.per_cpu_s for r in runs]
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--events", type=int, default=50_000, help="events per run")
    p.add_argument("--publishers", type=int, default=4, help="mosquitto_pub processes per run")
    p.add_argument(
        "--subs", type=int, default=1000, help="background geofenced subscriptions at geofed"
    )
    p.add_argument("--qos", default="0,1", help="comma-separated QoS levels (0, 1)")
    p.add_argument("--rounds", type=int, default=3, help="runs per broker and QoS")
    p.add_argument("--payload", type=int, default=64, help="payload bytes")
    p.add_argument(
        "--inflight", type=int, default=100, help="QoS 1 messages in flight per publisher"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="the Markdown file appended to")
    p.add_argument("--no-record", action="store_true", help="append the result nowhere")
    args = p.parse_args(argv)
    qos_levels = [int(q) for q in args.qos.split(",") if q.strip()]
    if not qos_levels or any(q not in (0, 1) for q in qos_levels):
        p.error(f"--qos takes 0, 1 or 0,1; got {args.qos!r}")
    for name in ("events", "publishers", "rounds", "payload", "inflight"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.subs < 0:
        p.error("--subs must be >= 0")
    load_before = os.getloadavg()
    load = Load(args.events, args.publishers, args.payload, args.inflight)
    runs, facts = run(load, args.subs, qos_levels, args.rounds)
    load_after = os.getloadavg()
    result = table(runs)
    print(result)
    if not args.no_record:
        record(
            args.out,
            "geofed.bench.mqtt_bench",
            argv,
            f"Broker: {facts['mosquitto_version']}  \n"
            f"Load average (1 / 5 min): {load_before[0]:.2f} / {load_before[1]:.2f} before,"
            f" {load_after[0]:.2f} / {load_after[1]:.2f} after  \n"
            f"geofed: {facts['subscriptions']:,.0f} geofenced subscriptions held, "
            f"{facts['geofed_deliveries']:,.0f} deliveries, all to the measured subscriber"
            f" ({facts['expected_deliveries']:,} events and probes it received)\n\n{result}",
            title="# MQTT throughput: one geofed node next to Mosquitto\n",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
