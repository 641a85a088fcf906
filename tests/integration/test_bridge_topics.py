"""`geofed bridge-topics` against a real Mosquitto and a three-broker federation.

Debian's `mosquitto` runs on a free loopback port with a generated config
(never as a service); `geofed.bench.LocalFederation` runs eu, us and ap; the
bridge is the `geofed bridge-topics` command, exporting and importing
``sensors/#`` on one connection.

* Export: events published in the federation at locations in and around a
  geofence (its vertices, points on its edges, inside, outside, far away)
  reach a paho subscriber holding the filters `geofed cover` prints exactly
  when their location is in a rectangle of the cover: recall 1, and after the
  consumer's exact check (the `geofed-location` property against the
  geofence) exactly the events published inside. The over-delivery (events
  in the cover, outside the geofence) is measured and bounded by the cover's
  area.
* Import: events published to Mosquitto on geo-encoded topics reach geofed
  subscribers with the decoded location (the exact one of the property, or
  the centre of the topic's cell), and a subscription geofence sees exactly
  those located inside it. Nothing loops back.

Waits are on state: Mosquitto accepting a connection, the bridge's "bridging"
line, subscriptions acknowledged, deliveries arriving, the federation's
quiescence barrier; HANG_S only turns a hang into a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

import geofed
from geofed.bench import LocalFederation
from geofed.bench.brokers import Mosquitto
from geofed.node import create_ca, issue_broker
from geofed.routing import (
    DecimalLayout,
    LatLon,
    cover,
    covers,
    latlon,
    parse_geofence,
    topic_matches,
)
from geofed.wire import location_from_text

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
BIN = Path(sys.executable).parent
HANG_S = 120.0
# Around Paris, edges off the decimal grid (and one vertex on it).
FENCE_WKT = "POLYGON((1.5 47.3, 6.25 46.9, 7.8 50.05, 2.1 51.3, 1.5 47.3))"
FENCE = parse_geofence(FENCE_WKT)
assert FENCE is not None
LAYOUT = DecimalLayout(prefix="geo", decimals=2)
PARIS = LatLon(48.85, 2.35)


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"hung waiting for {what}")
        time.sleep(0.02)


class MQTTClient:
    """A paho MQTT 5 client on its own network thread, collecting what it receives."""

    def __init__(
        self,
        port: int,
        client_id: str,
        persistent: bool = False,
        auth: tuple[str, str] | None = None,
        ca: Path | None = None,
    ) -> None:
        self.messages: list[paho.MQTTMessage] = []
        self.subacks = 0
        self.lock = threading.Lock()
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5
        )
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.client.reconnect_delay_set(0.1, 1.0)
        if auth is not None:
            self.client.username_pw_set(*auth)
        if ca is not None:
            self.client.tls_set(ca_certs=str(ca))
        props = None
        if persistent:  # the session and its QoS 1 queue outlive a connection
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
        self.client.connect("127.0.0.1", port, clean_start=not persistent, properties=props)
        self.client.loop_start()
        until(self.client.is_connected, f"{client_id} connected")

    def _on_message(self, _c: Any, _u: Any, msg: paho.MQTTMessage) -> None:
        with self.lock:
            self.messages.append(msg)

    def _on_subscribe(self, _c: Any, _u: Any, _mid: Any, reasons: Any, _p: Any) -> None:
        assert all(not r.is_failure for r in reasons)
        self.subacks += 1

    def subscribe(self, filters: list[str]) -> None:
        before = self.subacks
        self.client.subscribe([(f, 1) for f in filters])
        until(lambda: self.subacks > before, "SUBACK")

    def received(self) -> list[paho.MQTTMessage]:
        with self.lock:
            return list(self.messages)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def __enter__(self) -> MQTTClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


# The test brokers keep what they queue for an offline session (mosquitto's default: 1,000).
QUEUE = ["max_queued_messages 100000"]


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    broker = Mosquitto(QUEUE, workdir=tmp_path_factory.mktemp("mosquitto"))
    try:
        broker.start()
        yield broker.port
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with LocalFederation(THREE, "event-geofence", tmp_path_factory.mktemp("fed")) as running:
        yield running


@contextlib.contextmanager
def running_bridge(port: int, fed: LocalFederation, *args: str) -> Iterator[list[str]]:
    """`geofed bridge-topics` with `args`, once it printed "bridging"; yields its stderr lines.

    On leaving: SIGTERM, exit status 0, and its summary counts nothing rejected.
    """
    cmd = [
        str(BIN / "geofed"),
        "bridge-topics",
        "--mqtt",
        f"127.0.0.1:{port}",
        "--federation",
        str(fed.federation_path),
        "--location",
        "48.85,2.35",
        *args,
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    assert proc.stderr is not None
    stderr = proc.stderr

    def read() -> None:
        for line in stderr:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        until(
            lambda: any(ln.startswith("bridging") for ln in lines) or proc.poll() is not None,
            "the bridge to subscribe",
        )
        assert proc.poll() is None, "\n".join(lines)
        yield lines
        proc.terminate()
        assert proc.wait(timeout=HANG_S) == 0, "\n".join(lines)
        reader.join(timeout=HANG_S)
        summary = lines[-1]
        assert summary.startswith("exported") and "rejected 0" in summary, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=HANG_S)
        reader.join(timeout=HANG_S)
        stderr.close()


@pytest.fixture(scope="module")
def bridge(mosquitto: int, fed: LocalFederation) -> Iterator[list[str]]:
    with running_bridge(
        mosquitto,
        fed,
        *("--client", "bridge", "--export", "sensors/#", "--import", "sensors/#"),
        *("--decimals", "2"),
    ) as lines:
        yield lines


def points_around(rng: random.Random) -> list[LatLon]:
    """Vertices and edge points of the geofence, points in and around it, far away ones."""
    geom = FENCE.geometry
    out = [LatLon(y, x) for x, y in geom.exterior.coords[:-1]]
    for _ in range(30):
        p = geom.exterior.interpolate(rng.uniform(0, geom.exterior.length))
        out.append(LatLon(p.y, p.x))
    minx, miny, maxx, maxy = geom.bounds
    for _ in range(150):
        out.append(latlon(rng.uniform(miny - 1.0, maxy + 1.0), rng.uniform(minx - 1.0, maxx + 1.0)))
    out += [latlon(40.71, -74.0), latlon(1.29, 103.85), latlon(-33.9, 151.2), latlon(52.52, 13.4)]
    return out


async def publish_at(fed: LocalFederation, pubs: list[geofed.Publication]) -> None:
    """Publish each event at the broker responsible for its location (one client a broker)."""
    groups: dict[str, list[geofed.Publication]] = {}
    for p in pubs:
        groups.setdefault(fed.federation.responsible(p.location), []).append(p)
    for broker, group in groups.items():
        async with await geofed.connect(
            client_id=f"pub-{broker}",
            location=group[0].location,
            federation=str(fed.federation_path),
        ) as client:
            await client.publish_many(group)


def test_export_delivers_the_cover(mosquitto: int, fed: LocalFederation, bridge: list[str]) -> None:
    result = cover(FENCE, LAYOUT, coverage=0.8, max_filters=40)
    consumer = MQTTClient(mosquitto, "consumer")
    try:
        consumer.subscribe(list(result.filters))
        rng = random.Random(7)
        where = points_around(rng)
        pubs = [geofed.Publication(f"sensors/{i}", str(i).encode(), p) for i, p in enumerate(where)]
        asyncio.run(publish_at(fed, pubs))
        asyncio.run(fed.quiescent())
        # The bridge's stream has every event now; one more, local to it and inside,
        # arrives after all of them.
        asyncio.run(publish_at(fed, [geofed.Publication("sensors/end", b"end", PARIS)]))
        until(
            lambda: any(m.topic.endswith("/sensors/end") for m in consumer.received()),
            "the last export",
        )
        got = {int(m.payload) for m in consumer.received() if m.payload != b"end"}
        in_cover = {
            i
            for i, p in enumerate(where)
            if any(topic_matches(f, LAYOUT.topic(p, f"sensors/{i}")) for f in result.filters)
        }
        inside = {i for i, p in enumerate(where) if covers(FENCE, p)}
        assert inside <= in_cover  # the cover contains the geofence
        assert got == in_cover  # Mosquitto delivers exactly the cover's locations
        # The consumer's exact check, with the exact location the bridge sends along.
        checked = set()
        for m in consumer.received():
            if m.payload == b"end":
                continue
            props = dict(m.properties.UserProperty)  # type: ignore[union-attr]
            exact = location_from_text(props["geofed-location"], "geofed-location")
            assert exact == where[int(m.payload)]
            if covers(FENCE, exact):
                checked.add(int(m.payload))
        assert checked == inside  # recall 1, precision 1 after the exact check
        over = len(got - inside)
        print(
            f"cover: {len(result.filters)} filters, coverage {result.coverage:.3f}; "
            f"{len(got)} delivered for {len(inside)} inside: over-delivery {over}"
        )
        assert len(inside) >= 40 and over > 0  # the sample reaches into the cover's margin
    finally:
        consumer.close()


def test_import_reaches_geofed_subscribers(
    mosquitto: int, fed: LocalFederation, bridge: list[str]
) -> None:
    rng = random.Random(11)
    where = points_around(rng)

    async def run() -> tuple[list[geofed.Message], list[geofed.Message], list[LatLon]]:
        path = str(fed.federation_path)
        async with (
            await geofed.connect(
                client_id="sub-all", location=latlon(1.29, 103.85), federation=path
            ) as far,
            await geofed.connect(
                client_id="sub-fenced", location=latlon(40.71, -74.0), federation=path
            ) as near,
        ):
            everything = await far.subscribe("sensors/in/#")
            fenced = await near.subscribe("sensors/in/#", geofence=FENCE)
            await fed.quiescent()
            producer = MQTTClient(mosquitto, "producer")
            expected: list[LatLon] = []
            try:
                for i, p in enumerate(where):
                    props = None
                    if i % 2:  # the exact location along, else the topic's cell centre
                        props = Properties(PacketTypes.PUBLISH)
                        props.UserProperty = [("geofed-location", f"{p.lat!r},{p.lon!r}")]
                        expected.append(p)
                    else:
                        expected.append(LAYOUT.decode(LAYOUT.topic(p, "x"))[0])
                    info = producer.client.publish(
                        LAYOUT.topic(p, f"sensors/in/{i}"), str(i), qos=1, properties=props
                    )
                    await asyncio.to_thread(info.wait_for_publish, HANG_S)
            finally:
                producer.close()
            got_all: list[geofed.Message] = []
            while len(got_all) < len(where):
                got_all.append(await everything.next(timeout=HANG_S))
            await fed.quiescent()
            async with await geofed.connect(
                client_id="pub-end", location=PARIS, federation=path
            ) as paris:
                await paris.publish("sensors/in/end", b"end")
            got_fenced: list[geofed.Message] = []
            while not got_fenced or got_fenced[-1].payload != b"end":
                got_fenced.append(await fenced.next(timeout=HANG_S))
            return got_all, got_fenced[:-1], expected

    got_all, got_fenced, expected = asyncio.run(run())
    by_id = {int(m.payload): m for m in got_all}
    assert sorted(by_id) == list(range(len(where)))  # each once
    for i, m in by_id.items():
        assert m.topic == f"sensors/in/{i}"
        assert m.publisher == expected[i], (i, m.publisher, expected[i])
        assert m.origin == fed.federation.responsible(expected[i])
    inside = {i for i, p in enumerate(expected) if covers(FENCE, p)}
    assert {int(m.payload) for m in got_fenced} == inside
    assert len(got_fenced) == len(inside) >= 20


def test_the_bridge_rides_out_a_mosquitto_restart(fed: LocalFederation, tmp_path: Path) -> None:
    """Mosquitto stops and starts again (its store keeps the sessions): an event exported
    while it was down arrives, and one published to it before the bridge is back is
    imported once the bridge reconnects."""
    broker = Mosquitto(QUEUE, workdir=tmp_path, persistent=True)
    broker.start()
    args = ("--client", "bridge-r", "--prefix", "geo2", "--export", "alerts/out/#")
    try:
        with (
            running_bridge(broker.port, fed, *args, "--import", "alerts/in/#") as lines,
            MQTTClient(broker.port, "consumer-r", persistent=True) as consumer,
        ):
            consumer.subscribe(["geo2/#"])
            asyncio.run(restart_run(fed, broker, consumer))
        assert "exported 2, imported 1" in lines[-1], lines
    finally:
        broker.stop()


async def restart_run(fed: LocalFederation, broker: Mosquitto, consumer: MQTTClient) -> None:
    path = str(fed.federation_path)

    def payloads() -> set[bytes]:
        return {m.payload for m in consumer.received()}

    async with (
        await geofed.connect(
            client_id="sub-r", location=latlon(40.71, -74.0), federation=path
        ) as listener,
        await geofed.connect(client_id="pub-r", location=PARIS, federation=path) as paris,
    ):
        sub = await listener.subscribe("alerts/in/#")
        await fed.quiescent()
        await paris.publish("alerts/out/1", b"before")
        await asyncio.to_thread(until, lambda: b"before" in payloads(), "the first export")
        broker.stop()
        # Accepted by the federation while the MQTT broker is down: the bridge holds it.
        await paris.publish("alerts/out/2", b"while down")
        broker.start()
        producer = MQTTClient(broker.port, "producer-r")
        try:
            topic = DecimalLayout(prefix="geo2").topic(latlon(51.5, -0.12), "alerts/in/3")
            info = producer.client.publish(topic, b"after", qos=1)
            await asyncio.to_thread(info.wait_for_publish, HANG_S)
        finally:
            producer.close()
        await asyncio.to_thread(until, lambda: b"while down" in payloads(), "the held export")
        msg = await sub.next(timeout=HANG_S)
        assert (msg.topic, msg.payload) == ("alerts/in/3", b"after")
        assert abs(msg.publisher.lat - 51.5) < 1e-4 and abs(msg.publisher.lon + 0.12) < 1e-4


def test_the_bridge_logs_in_to_the_mqtt_broker(fed: LocalFederation, tmp_path: Path) -> None:
    """A broker that admits one user: the bridge with its name and password bridges both
    ways (exporting only events published in its export geofence); with a wrong password
    it stops at once, naming the refusal (exit status 2)."""
    user = ("bridge-user", "s3cret")
    broker = Mosquitto(QUEUE, workdir=tmp_path, password=user)
    broker.start()
    secret = tmp_path / "password"
    secret.write_text("s3cret\n", encoding="utf-8")
    try:
        login = ("--mqtt-user", "bridge-user", "--mqtt-password-file", str(secret))
        args = ("--client", "bridge-p", "--prefix", "geo3", "--export", "notes/out/#")
        args += ("--export-geofence", FENCE_WKT)  # publishers around Paris only
        with (
            running_bridge(broker.port, fed, *args, "--import", "notes/in/#", *login) as lines,
            MQTTClient(broker.port, "consumer-p", auth=user) as consumer,
        ):
            consumer.subscribe(["geo3/#"])
            asyncio.run(login_run(fed, broker, consumer))
        assert "exported 2, imported 1" in lines[-1], lines
        secret.write_text("wrong\n", encoding="utf-8")
        cmd = [str(BIN / "geofed"), "bridge-topics", "--mqtt", f"127.0.0.1:{broker.port}"]
        cmd += ["--federation", str(fed.federation_path), "--client", "bridge-p2"]
        refused = subprocess.run(
            [*cmd, "--import", "notes/in/#", *login],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
        assert refused.returncode == 2, refused.stderr
        assert "refused" in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    finally:
        broker.stop()


async def login_run(fed: LocalFederation, broker: Mosquitto, consumer: MQTTClient) -> None:
    path = str(fed.federation_path)
    async with (
        await geofed.connect(
            client_id="sub-p", location=latlon(1.29, 103.85), federation=path
        ) as listener,
        await geofed.connect(client_id="pub-p", location=PARIS, federation=path) as paris,
    ):
        sub = await listener.subscribe("notes/in/#")
        await fed.quiescent()
        # In order through one broker (eu): Paris, Berlin (outside the export geofence), Paris.
        berlin = latlon(52.52, 13.4)
        assert fed.federation.responsible(berlin) == fed.federation.responsible(PARIS)
        await paris.publish_many(
            [
                geofed.Publication("notes/out/1", b"out", PARIS),
                geofed.Publication("notes/out/2", b"berlin", berlin),
                geofed.Publication("notes/out/3", b"last", PARIS),
            ]
        )
        await asyncio.to_thread(
            until, lambda: any(m.payload == b"last" for m in consumer.received()), "the export"
        )
        assert [m.payload for m in consumer.received()] == [b"out", b"last"]
        topic = DecimalLayout(prefix="geo3").topic(latlon(-33.9, 151.2), "notes/in/2")
        info = consumer.client.publish(topic, b"in", qos=1)
        await asyncio.to_thread(info.wait_for_publish, HANG_S)
        msg = await sub.next(timeout=HANG_S)
        assert (msg.topic, msg.payload) == ("notes/in/2", b"in")


def test_the_bridge_speaks_tls_to_the_mqtt_broker(fed: LocalFederation, tmp_path: Path) -> None:
    """A TLS-only Mosquitto (a certificate from a throw-away CA): the bridge with that CA
    exports over TLS; with another CA it refuses the broker (exit status 3)."""
    ca = create_ca(tmp_path / "ca")
    issue_broker(ca, "mqtt", [], tmp_path / "server")
    broker = Mosquitto(QUEUE, workdir=tmp_path, tls=tmp_path / "server")
    broker.start()
    try:
        args = ("--client", "bridge-t", "--prefix", "geo4", "--export", "tls/#")
        trust = ("--mqtt-ca", str(ca.cert_path))
        with (
            running_bridge(broker.port, fed, *args, *trust) as lines,
            MQTTClient(broker.port, "consumer-t", ca=ca.cert_path) as consumer,
        ):
            consumer.subscribe(["geo4/#"])

            async def publish() -> None:
                path = str(fed.federation_path)
                async with await geofed.connect(
                    client_id="pub-t", location=PARIS, federation=path
                ) as paris:
                    await paris.publish("tls/1", b"sealed")

            asyncio.run(publish())
            until(lambda: any(m.payload == b"sealed" for m in consumer.received()), "TLS export")
        assert "exported 1," in lines[-1], lines
        other = create_ca(tmp_path / "other")
        cmd = [str(BIN / "geofed"), "bridge-topics", "--mqtt", f"127.0.0.1:{broker.port}"]
        cmd += ["--federation", str(fed.federation_path), "--client", "bridge-t2"]
        refused = subprocess.run(
            [*cmd, "--import", "tls/#", "--mqtt-ca", str(other.cert_path)],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            check=False,
        )
        assert refused.returncode == 3, refused.stderr
        assert "certificate verify failed" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr, refused.stderr
    finally:
        broker.stop()
