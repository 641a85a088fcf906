"""MQTT clients against a local federation: Debian's mosquitto clients, paho-mqtt and gRPC.

One 3-broker federation (eu, us, ap; subscription-geofence, durable) with an
MQTT listener on every broker serves the module; every test uses its own
client ids and topics. Waiting is on state: a subscription is held once the
node's subscription gauge says so and the quiescence barrier says it has
been forwarded; a delivery once it arrives; subprocesses only get generous
hang timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import sqlite3
import ssl
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import paho.mqtt.client as paho
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

import geofed
from geofed.bench import LocalFederation, metric
from geofed.client import TLSConfig
from geofed.node import (
    AUTH_REFUSED,
    DELIVERIES,
    EVENTS_PUBLISHED,
    HANDOVERS,
    SESSION_TRANSFERS,
    SUBSCRIPTIONS,
    TLS_REFUSED,
    issue_federation,
)
from geofed.node import _mqtt_codec as mq
from geofed.node._mqtt_ws import WebSocketReader

if TYPE_CHECKING:
    from conftest import TokenSigner  # tests/integration/conftest.py
from geofed.routing import LatLon, TraceOp, parse_roaming, reference_deliveries

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = "48.85,2.35"
FRANKFURT = geofed.LatLon(50.11, 8.68)
NEW_YORK = "40.71,-74.0"
SINGAPORE = "1.29,103.85"
EUROPE = "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"
HANG_S = 60.0  # a client that does not finish by then is hung, not slow


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    assert shutil.which("mosquitto_sub"), "mosquitto-clients are installed by .ci/run"
    workdir = tmp_path_factory.mktemp("mqtt-fed")
    with LocalFederation(THREE, "subscription-geofence", workdir, durable=True) as running:
        yield running


def port(fed: LocalFederation, broker: str) -> str:
    return fed.nodes[broker].mqtt.rsplit(":", 1)[1]


def until(cond: Callable[[], bool], what: str, step: Callable[[], None] | None = None) -> None:
    """Wait for a state (`step` drives a paho client meanwhile); HANG_S means hung."""
    deadline = time.monotonic() + HANG_S
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"hung waiting for {what}")
        if step is not None:
            step()
        else:
            time.sleep(0.02)


def local_subs(fed: LocalFederation, broker: str) -> float:
    return metric(fed.nodes[broker].metrics_url, SUBSCRIPTIONS, scope="local")


def mosquitto(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=HANG_S, check=False)


def user(packet: int, **props: str) -> Properties:
    p = Properties(packet)
    p.UserProperty = [(k.replace("_", "-"), v) for k, v in props.items()]
    return p


@dataclass
class Paho:
    """A paho-mqtt client driven by hand (`step`), recording what the broker answered."""

    client_id: str
    version: int = paho.MQTTv5
    clean_session: bool = True  # 3.1.1
    websocket: bool = False  # MQTT over WebSocket (connect to the mqtt_ws endpoint)
    c: paho.Client = field(init=False)
    connack: Any = None
    connack_props: Any = None
    session_present: bool | None = None
    messages: list[paho.MQTTMessage] = field(default_factory=list)
    disconnect: Any = None
    disconnect_props: Any = None
    acks: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    subacks: dict[int, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        kw: dict[str, Any] = {}
        if self.version == paho.MQTTv311:
            kw["clean_session"] = self.clean_session
        self.c = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=self.version,
            transport="websockets" if self.websocket else "tcp",
            **kw,
        )
        if self.websocket:
            self.c.ws_set_options(path="/mqtt")
        self.c.on_connect = self._on_connect
        self.c.on_message = lambda c, u, m: self.messages.append(m)
        self.c.on_disconnect = self._on_disconnect
        self.c.on_publish = lambda c, u, mid, rc, props: self.acks.__setitem__(mid, (rc, props))
        self.c.on_subscribe = lambda c, u, mid, rcs, props: self.subacks.__setitem__(mid, rcs)

    def _on_connect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
        self.connack, self.connack_props = rc, props
        self.session_present = flags.session_present

    def _on_disconnect(self, c: Any, u: Any, flags: Any, rc: Any, props: Any) -> None:
        self.disconnect, self.disconnect_props = rc, props

    def step(self) -> None:
        self.c.loop(timeout=0.05)

    def connect(
        self,
        endpoint: str,
        props: Properties | None = None,
        clean: bool = True,
        keepalive: int = 30,
    ) -> Any:
        """Connect to ``host:port`` (or, over WebSocket, ``ws[s]://host:port/mqtt``)."""
        if self.websocket and "://" in endpoint:
            url = urllib.parse.urlsplit(endpoint)
            assert url.path == "/mqtt", endpoint
            endpoint = url.netloc
        host, _, p = endpoint.rpartition(":")
        self.connack = self.disconnect = None
        if self.version == paho.MQTTv5:
            self.c.connect(host, int(p), keepalive=keepalive, clean_start=clean, properties=props)
        else:
            self.c.connect(host, int(p), keepalive=keepalive)
        until(lambda: self.connack is not None, f"{self.client_id}: CONNACK", self.step)
        return self.connack

    def subscribe(self, topic: str, qos: int = 1, props: Properties | None = None) -> list[Any]:
        _, mid = self.c.subscribe(topic, qos, properties=props)
        until(lambda: mid in self.subacks, f"{self.client_id}: SUBACK", self.step)
        return self.subacks[mid]

    def publish(self, topic: str, payload: bytes, props: Properties | None = None) -> Any:
        info = self.c.publish(topic, payload, qos=1, properties=props)
        until(lambda: info.mid in self.acks, f"{self.client_id}: PUBACK", self.step)
        return self.acks[info.mid]

    def receive(self, n: int) -> list[tuple[str, bytes]]:
        until(lambda: len(self.messages) >= n, f"{self.client_id}: {n} messages", self.step)
        return [(m.topic, m.payload) for m in self.messages]

    def close(self) -> None:
        self.c.disconnect()
        self.step()


class RawMqtt:
    """An MQTT 5 client writing packets exactly as a test gives them, over TCP or a
    WebSocket (binary frames, subprotocol ``mqtt``)."""

    def __init__(self, endpoint: str, websocket: bool) -> None:
        self.endpoint, self.websocket = endpoint, websocket

    async def __aenter__(self) -> RawMqtt:
        if self.websocket:
            self.http = aiohttp.ClientSession()
            ws = await self.http.ws_connect(f"http://{self.endpoint}/mqtt", protocols=("mqtt",))
            self.ws = ws
            self.packets = mq.PacketReader(WebSocketReader(ws), 1 << 20)  # type: ignore[arg-type]
        else:
            host, _, p = self.endpoint.rpartition(":")
            reader, self.writer = await asyncio.open_connection(host, int(p))
            self.packets = mq.PacketReader(reader, 1 << 20)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.websocket:
            await self.ws.close()
            await self.http.close()
        else:
            self.writer.close()
            await self.writer.wait_closed()

    async def write(self, *packets: Any) -> None:
        data = b"".join(
            p.encode() if isinstance(p, mq.Connect) else p.encode(mq.MQTT_5) for p in packets
        )
        if self.websocket:
            await self.ws.send_bytes(data)
        else:
            self.writer.write(data)

    async def read(self) -> Any:
        kind, flags, body = await asyncio.wait_for(self.packets.next(), HANG_S)
        return mq.decode_server(kind, flags, body, mq.MQTT_5)


def test_mqtt_and_grpc_clients_see_each_others_events_across_regions(
    fed: LocalFederation,
) -> None:
    """Publishers in eu (mosquitto_pub 5.0 and 3.1.1, a gRPC client), subscribers everywhere.

    Hand-computed expectation (docs/design.md §1: topic, subscription
    geofence over the publisher, event geofence over the subscriber):
    e1 from Paris to sensors/fr/temp, no geofence; e2 from Paris with an
    event geofence of 500 km around New York; e3 from Frankfurt (gRPC) to
    sensors/de/temp.
    """
    before = {b: local_subs(fed, b) for b in fed.nodes}
    delivered = fed.total(DELIVERIES)
    # A: mosquitto_sub 3.1.1 in New York, location and filter in the $geofed/ prefix.
    a = subprocess.Popen(
        [
            "mosquitto_sub", "-p", port(fed, "us"), "-V", "mqttv311", "-i", "x-a", "-v",
            "-C", "3", "-W", str(int(HANG_S)), "-t", f"$geofed/loc={NEW_YORK}/sensors/#",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    # B: paho 5.0 in Singapore, location on CONNECT, a geofence over Europe on SUBSCRIBE.
    b = Paho("x-b")
    assert (
        b.connect(fed.nodes["ap"].mqtt, user(PacketTypes.CONNECT, geofed_location=SINGAPORE)) == 0
    )
    assert b.subscribe(
        "sensors/+/temp", 1, user(PacketTypes.SUBSCRIBE, geofed_geofence=EUROPE)
    ) == [1]
    # E: paho 3.1.1 in Frankfurt; a 100 km circle around Paris in the prefix.
    e = Paho("x-e", paho.MQTTv311)
    assert e.connect(fed.nodes["eu"].mqtt) == 0
    fence = "circle:48.85,2.35,100000"
    assert e.subscribe(f"$geofed/loc=50.11,8.68/fence={fence}/sensors/#", 0) == [0]

    async def run() -> dict[str, list[str]]:
        # C: gRPC in New York, publishers must be near Tokyo; D: gRPC in Frankfurt.
        c_client = await geofed.connect(
            client_id="x-c", location=geofed.LatLon(40.71, -74.0), federation=fed.federation_path
        )
        d_client = await geofed.connect(
            client_id="x-d", location=FRANKFURT, federation=fed.federation_path
        )
        async with c_client, d_client:
            c = await c_client.subscribe(
                "sensors/#", geofence={"circle": {"lat": 35.68, "lon": 139.77, "radius_m": 300000}}
            )
            d = await d_client.subscribe("sensors/fr/#")
            await asyncio.to_thread(
                until,
                lambda: [local_subs(fed, x) - before[x] for x in ("eu", "us", "ap")] == [2, 2, 1],
                "every subscription held",
            )
            await fed.quiescent(HANG_S)  # forwarded where they go
            e1 = await asyncio.to_thread(
                mosquitto,
                "mosquitto_pub", "-p", port(fed, "eu"), "-V", "mqttv5", "-q", "1", "-d",
                "-t", "sensors/fr/temp", "-m", "e1",
                "-D", "publish", "user-property", "geofed-location", PARIS,
            )  # fmt: skip
            assert e1.returncode == 0, e1.stderr
            assert "received PUBACK" in e1.stdout  # QoS 1 acknowledged
            e2 = await asyncio.to_thread(
                mosquitto,
                "mosquitto_pub", "-p", port(fed, "eu"), "-V", "mqttv311", "-q", "1", "-d",
                "-t", f"$geofed/loc={PARIS}/fence=circle:40.71,-74.0,500000/sensors/fr/temp",
                "-m", "e2",
            )  # fmt: skip
            assert e2.returncode == 0 and "received PUBACK" in e2.stdout, e2
            async with await geofed.connect(
                client_id="x-pub", location=FRANKFURT, federation=fed.federation_path
            ) as pub:
                await pub.publish("sensors/de/temp", b"e3")
            d_got = [(await d.next(HANG_S)).payload.decode()]
            await asyncio.to_thread(until, lambda: fed.total(DELIVERIES) - delivered >= 7, "7")
            await fed.quiescent(HANG_S)
            del c  # it gets nothing: the delivery count below holds every delivery made
            return {"c": [], "d": d_got}

    grpc_got = asyncio.run(run())
    out, err = a.communicate(timeout=HANG_S)
    assert a.returncode == 0, err
    got = {
        "a": [line.split(" ", 1)[1] for line in out.splitlines()],
        "b": [p.decode() for _, p in b.receive(2)],
        "e": [p.decode() for _, p in e.receive(1)],
        **grpc_got,
    }
    expected = {"a": ["e1", "e2", "e3"], "b": ["e1", "e3"], "c": [], "d": ["e1"], "e": ["e1"]}
    assert {k: sorted(v) for k, v in got.items()} == expected
    assert fed.total(DELIVERIES) - delivered == 7
    b.close()
    e.close()


def test_redirects_name_the_responsible_brokers_mqtt_endpoint(fed: LocalFederation) -> None:
    # 5.0: CONNACK "Use another server" with Server Reference; paho connects there itself.
    r = Paho("x-redirect")
    rc = r.connect(fed.nodes["eu"].mqtt, user(PacketTypes.CONNECT, geofed_location=NEW_YORK))
    assert rc.value == 0x9C
    reference = r.connack_props.ServerReference
    assert reference == fed.nodes["us"].mqtt
    r = Paho("x-redirect")
    assert r.connect(reference, user(PacketTypes.CONNECT, geofed_location=NEW_YORK)) == 0
    # Moving out of the area: DISCONNECT "Server moved", the new broker named.
    r.c.publish(
        "any/topic", b"x", 0, properties=user(PacketTypes.PUBLISH, geofed_location=SINGAPORE)
    )
    until(lambda: r.disconnect is not None, "DISCONNECT", r.step)
    assert r.disconnect.value == 0x9D
    assert r.disconnect_props.ServerReference == fed.nodes["ap"].mqtt
    # 3.1.1: the new endpoint as a message on $geofed/redirect, then the connection closes.
    old = Paho("x-redirect-311", paho.MQTTv311)
    assert old.connect(fed.nodes["eu"].mqtt) == 0
    old.c.publish(f"$geofed/loc={SINGAPORE}", b"", 0)
    until(lambda: old.disconnect is not None, "the connection to close", old.step)
    assert [(t, p.decode()) for t, p in old.receive(1)] == [
        ("$geofed/redirect", fed.nodes["ap"].mqtt)
    ]


def test_a_redirect_reaches_a_client_that_is_still_sending(fed: LocalFederation) -> None:
    """The broker ends the connection of a client that moved while more of its packets
    wait to be read: it half-closes and reads them first, since a socket closed with
    input unread is reset, and the reset would discard the DISCONNECT it just wrote."""
    r = Paho("x-redirect-busy")
    assert r.connect(fed.nodes["eu"].mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
    sock = r.c.socket()
    sock.setblocking(True)
    moved = mq.Publish(
        "any/topic", b"x", properties=mq.Properties(user=[("geofed-location", NEW_YORK)])
    )
    # Far more than the broker reads at a time: most are still unread when it closes.
    sock.sendall(moved.encode(mq.MQTT_5) + mq.PingReq().encode(mq.MQTT_5) * 200_000)
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    sock.close()
    end = got.rfind(bytes([mq.DISCONNECT << 4]))
    assert end >= 0 and got[end + 2] == mq.SERVER_MOVED
    assert fed.nodes["us"].mqtt.encode() in got[end:]  # the Server Reference


def test_bad_geo_context_is_answered_and_the_node_keeps_serving(fed: LocalFederation) -> None:
    eu = fed.nodes["eu"]
    bad = Paho("x-bad-connect")
    rc = bad.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location="95,2"))
    assert rc.value == 0x83 and "geofed-location" in rc_reason(bad.connack_props)
    p = Paho("x-bad")
    assert p.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
    rc, props = p.publish(
        "x/bad", b"1", user(PacketTypes.PUBLISH, geofed_geofence="POLYGON((0 0, 1 1, 0 0))")
    )
    assert rc.value == 0x83 and "geofed-geofence" in props.ReasonString
    rc, props = p.publish("x/bad", b"2", user(PacketTypes.PUBLISH, geofed_geofence="circle:1,2"))
    assert rc.value == 0x83 and "geofed-geofence" in props.ReasonString
    # Only subscription geofences roam.
    rc, props = p.publish("x/bad", b"2", user(PacketTypes.PUBLISH, geofed_geofence="roam:circle:9"))
    assert rc.value == 0x83 and "geofed-geofence" in props.ReasonString
    assert "only as a subscription geofence" in props.ReasonString
    codes = p.subscribe("x/#", 1, user(PacketTypes.SUBSCRIBE, geofed_geofence="POLYGON((1 1))"))
    assert [c.value for c in codes] == [0x83]
    rc, _ = p.publish("x/good", b"3")  # the connection goes on
    assert rc == 0
    # 3.1.1: no reason codes; the client is disconnected and the log names the topic level.
    topic = "$geofed/fence=POLYGON((0 0, 1 1, 0 0))/x/bad"
    done = mosquitto("mosquitto_pub", "-p", eu.mqtt.rsplit(":")[1], "-V", "mqttv311", "-q", "1",
                     "-i", "x-bad-311", "-t", topic, "-m", "4")  # fmt: skip
    assert done.returncode != 0  # no PUBACK: the broker closed the connection
    until(lambda: "$geofed/fence=" in eu.log_path.read_text(), "the log line")
    line = next(x for x in eu.log_path.read_text().splitlines() if "x-bad-311" in x)
    assert "$geofed/fence=" in line and "disconnected" in line
    published = metric(eu.metrics_url, EVENTS_PUBLISHED)
    ok = mosquitto("mosquitto_pub", "-p", eu.mqtt.rsplit(":")[1], "-V", "mqttv311", "-q", "1",
                   "-t", f"$geofed/loc={PARIS}/x/good", "-m", "5", "-d")  # fmt: skip
    assert ok.returncode == 0 and "received PUBACK" in ok.stdout
    assert metric(eu.metrics_url, EVENTS_PUBLISHED) == published + 1
    p.close()


def rc_reason(props: Any) -> str:
    return str(getattr(props, "ReasonString", ""))


def test_a_persistent_session_keeps_qos1_deliveries_across_a_disconnect(
    fed: LocalFederation,
) -> None:
    us = fed.nodes["us"]
    connect = Properties(PacketTypes.CONNECT)
    connect.SessionExpiryInterval = 300
    connect.UserProperty = [("geofed-location", NEW_YORK)]
    s = Paho("x-persistent")
    assert s.connect(us.mqtt, connect) == 0 and s.session_present is False
    assert s.subscribe("alerts/#", 1) == [1]
    s.close()
    until(lambda: s.disconnect is not None, "the disconnect", s.step)
    asyncio.run(fed.quiescent(HANG_S))  # the subscription is everywhere

    def publish(payload: str) -> None:
        delivered = metric(us.metrics_url, DELIVERIES)
        done = mosquitto("mosquitto_pub", "-p", port(fed, "eu"), "-V", "mqttv5", "-q", "1",
                         "-t", "alerts/flood", "-m", payload,
                         "-D", "publish", "user-property", "geofed-location", PARIS)  # fmt: skip
        assert done.returncode == 0, done.stderr
        until(lambda: metric(us.metrics_url, DELIVERIES) > delivered, "queued at us")

    publish("while away")
    s = Paho("x-persistent")
    assert s.connect(us.mqtt, connect, clean=False) == 0 and s.session_present is True
    [(topic, payload)] = s.receive(1)
    assert (topic, payload, s.messages[0].qos) == ("alerts/flood", b"while away", 1)
    s.close()  # paho acknowledged it (PUBACK) before: the broker forgets it
    until(lambda: s.disconnect is not None, "the disconnect", s.step)
    publish("second")
    s = Paho("x-persistent")
    assert s.connect(us.mqtt, connect, clean=False) == 0 and s.session_present is True
    assert [p for _, p in s.receive(1)] == [b"second"]  # not "while away" again
    s.close()


def test_a_persistent_session_moves_with_its_client_to_the_new_broker(
    fed: LocalFederation,
) -> None:
    """A persistent MQTT 5 session at eu reports a location in us: eu sends the session to
    us before it redirects the client, so at us the client finds it present, subscribed
    at the QoS it was granted, with what was published while it was between brokers."""
    eu, us = fed.nodes["eu"], fed.nodes["us"]

    def props(where: str) -> Properties:
        p = Properties(PacketTypes.CONNECT)
        p.SessionExpiryInterval = 300
        p.UserProperty = [("geofed-location", where)]
        return p

    s = Paho("x-traveller")
    assert s.connect(eu.mqtt, props(PARIS)) == 0
    assert s.subscribe("trips/#", 1) == [1]
    asyncio.run(fed.quiescent(HANG_S))
    before = local_subs(fed, "eu")
    taken = metric(us.metrics_url, SESSION_TRANSFERS, outcome="taken")
    left = metric(eu.metrics_url, HANDOVERS, outcome="left")
    s.c.publish(
        "any/topic", b"x", 0, properties=user(PacketTypes.PUBLISH, geofed_location=NEW_YORK)
    )
    until(lambda: s.disconnect is not None, "DISCONNECT", s.step)
    assert s.disconnect.value == 0x9D and s.disconnect_props.ServerReference == us.mqtt
    assert metric(us.metrics_url, SESSION_TRANSFERS, outcome="taken") == taken + 1
    # eu lets go once the connection has ended; then only us holds the subscription.
    until(lambda: local_subs(fed, "eu") == before - 1, "eu let go")
    assert metric(eu.metrics_url, HANDOVERS, outcome="left") == left + 1
    done = mosquitto("mosquitto_pub", "-p", port(fed, "eu"), "-V", "mqttv5", "-q", "1",
                     "-t", "trips/paris", "-m", "between brokers",
                     "-D", "publish", "user-property", "geofed-location", PARIS)  # fmt: skip
    assert done.returncode == 0, done.stderr
    s = Paho("x-traveller")
    assert s.connect(us.mqtt, props(NEW_YORK), clean=False) == 0 and s.session_present is True
    [(topic, payload)] = s.receive(1)
    assert (topic, payload, s.messages[0].qos) == ("trips/paris", b"between brokers", 1)
    s.close()


@pytest.mark.parametrize("websocket", [False, True], ids=["tcp", "websocket"])
def test_acknowledgements_sent_after_a_redirect_count_at_the_old_broker(
    fed: LocalFederation, websocket: bool
) -> None:
    """A redirected client acknowledges, after the DISCONNECT, QoS 1 deliveries it read
    before it (paho does: it answers the packets it had read). The old broker, reading
    until the client closes, takes those PUBACKs: the queue it hands to the new broker
    leaves them out, and the client does not get those events a second time there."""
    eu, us = fed.nodes["eu"], fed.nodes["us"]
    client_id = f"x-late-acks-{websocket}"
    before = local_subs(fed, "eu")
    here = mq.Properties({mq.SESSION_EXPIRY_INTERVAL: 300}, [("geofed-location", PARIS)])
    moved = mq.Properties(user=[("geofed-location", NEW_YORK)])

    async def run() -> None:
        async with RawMqtt(eu.mqtt_ws if websocket else eu.mqtt, websocket) as c:
            await c.write(mq.Connect(client_id, properties=here))
            assert (await c.read()).code == mq.SUCCESS
            await c.write(mq.Subscribe(1, [("late/#", 1)]))
            assert isinstance(await c.read(), mq.SubAck)
            await fed.quiescent(HANG_S)
            # Three events for itself, read and not acknowledged yet.
            await c.write(*(mq.Publish("late/x", b"m%d" % i) for i in range(3)))
            got = [await c.read() for _ in range(3)]
            assert [(d.payload, d.qos) for d in got] == [(b"m0", 1), (b"m1", 1), (b"m2", 1)]
            await c.write(mq.Publish("any/topic", b"x", properties=moved))
            bye = await c.read()
            assert isinstance(bye, mq.Disconnect) and bye.code == mq.SERVER_MOVED
            await c.write(*(mq.PubAck(d.packet_id) for d in got))

    asyncio.run(run())
    until(lambda: local_subs(fed, "eu") == before, "eu let go")
    asyncio.run(fed.quiescent(HANG_S))  # eu's handoff, if any, is queued at us
    done = mosquitto("mosquitto_pub", "-p", port(fed, "eu"), "-V", "mqttv5", "-q", "1",
                     "-t", "late/marker", "-m", "after",
                     "-D", "publish", "user-property", "geofed-location", PARIS)  # fmt: skip
    assert done.returncode == 0, done.stderr
    s = Paho(client_id)
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 300
    props.UserProperty = [("geofed-location", NEW_YORK)]
    assert s.connect(us.mqtt, props, clean=False) == 0 and s.session_present is True
    # A delivery handed over by eu would be queued ahead of the marker.
    assert s.receive(1)[0] == ("late/marker", b"after")
    s.close()


def test_the_will_is_published_when_a_client_vanishes(fed: LocalFederation) -> None:
    start = local_subs(fed, "eu")
    w = Paho("x-will-watch")
    assert w.connect(fed.nodes["eu"].mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
    assert w.subscribe("status/#", 1) == [1]
    held = local_subs(fed, "eu")
    sub = subprocess.Popen(
        ["mosquitto_sub", "-p", port(fed, "eu"), "-V", "mqttv5", "-i", "x-will", "-t", "x/will",
         "--will-topic", "status/x-will", "--will-payload", "gone"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    until(lambda: local_subs(fed, "eu") == held + 1, "the subscription")
    sub.send_signal(signal.SIGKILL)  # no DISCONNECT
    sub.wait(HANG_S)
    assert w.receive(1) == [("status/x-will", b"gone")]
    w.close()
    # Both subscriptions end asynchronously: gone before the next test counts eu's.
    until(lambda: local_subs(fed, "eu") == start, "the subscriptions withdrawn")


def test_websocket_clients_and_tcp_and_grpc_see_each_others_events(fed: LocalFederation) -> None:
    """MQTT over WebSocket (paho, transport "websockets") beside TCP and gRPC clients.

    X: paho 5.0 over WebSocket at us (New York) with a subscription geofence
    over Europe; Y: paho 3.1.1 over TCP at ap; Z: gRPC at eu. Publishers: w1
    paho 3.1.1 over WebSocket at eu (Paris, in the topic prefix), w2
    mosquitto_pub over TCP at eu (Paris), w3 gRPC in Frankfurt, w4 gRPC in
    New York. X takes publishers in Europe only: w1, w2, w3; Y and Z all four.
    """
    before = {b: local_subs(fed, b) for b in fed.nodes}
    delivered = fed.total(DELIVERIES)
    x = Paho("x-ws-sub", websocket=True)
    assert (
        x.connect(fed.nodes["us"].mqtt_ws, user(PacketTypes.CONNECT, geofed_location=NEW_YORK)) == 0
    )
    assert x.subscribe("web/#", 1, user(PacketTypes.SUBSCRIBE, geofed_geofence=EUROPE)) == [1]
    y = Paho("x-tcp-sub", paho.MQTTv311)
    assert y.connect(fed.nodes["ap"].mqtt) == 0
    assert y.subscribe(f"$geofed/loc={SINGAPORE}/web/#", 1) == [1]
    w = Paho("x-ws-pub", paho.MQTTv311, websocket=True)
    assert w.connect(fed.nodes["eu"].mqtt_ws) == 0

    async def run() -> list[str]:
        z_client = await geofed.connect(
            client_id="x-ws-z", location=FRANKFURT, federation=fed.federation_path
        )
        async with z_client:
            z = await z_client.subscribe("web/#")
            await asyncio.to_thread(
                until,
                lambda: [local_subs(fed, b) - before[b] for b in ("eu", "us", "ap")] == [1, 1, 1],
                "every subscription held",
            )
            await fed.quiescent(HANG_S)
            rc, _ = await asyncio.to_thread(w.publish, f"$geofed/loc={PARIS}/web/ws", b"w1")
            assert rc == 0
            done = await asyncio.to_thread(
                mosquitto,
                "mosquitto_pub", "-p", port(fed, "eu"), "-V", "mqttv5", "-q", "1", "-t", "web/tcp",
                "-m", "w2", "-D", "publish", "user-property", "geofed-location", PARIS,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            for cid, where, payload in (
                ("x-ws-p3", FRANKFURT, b"w3"),
                ("x-ws-p4", geofed.LatLon(40.71, -74.0), b"w4"),
            ):
                async with await geofed.connect(
                    client_id=cid, location=where, federation=fed.federation_path
                ) as pub:
                    await pub.publish("web/grpc", payload)
            return sorted([(await z.next(HANG_S)).payload.decode() for _ in range(4)])

    z_got = asyncio.run(run())
    got = {
        "x": sorted(p.decode() for _, p in x.receive(3)),
        "y": sorted(p.decode() for _, p in y.receive(4)),
        "z": z_got,
    }
    assert got == {
        "x": ["w1", "w2", "w3"],
        "y": ["w1", "w2", "w3", "w4"],
        "z": ["w1", "w2", "w3", "w4"],
    }
    asyncio.run(fed.quiescent(HANG_S))
    assert fed.total(DELIVERIES) - delivered == 11  # nothing else was delivered
    assert [m.qos for m in x.messages] == [1, 1, 1]
    for c in (x, y, w):
        c.close()


def test_websocket_redirects_name_the_websocket_endpoint(fed: LocalFederation) -> None:
    ws_url = {b: f"ws://{n.mqtt_ws}/mqtt" for b, n in fed.nodes.items()}
    r = Paho("x-ws-redirect", websocket=True)
    rc = r.connect(fed.nodes["eu"].mqtt_ws, user(PacketTypes.CONNECT, geofed_location=NEW_YORK))
    assert rc.value == 0x9C
    assert r.connack_props.ServerReference == ws_url["us"]
    r = Paho("x-ws-redirect", websocket=True)
    connect = user(PacketTypes.CONNECT, geofed_location=NEW_YORK)
    assert r.connect(ws_url["us"], connect) == 0  # paho follows the reference
    r.c.publish(
        "any/topic", b"x", 0, properties=user(PacketTypes.PUBLISH, geofed_location=SINGAPORE)
    )
    until(lambda: r.disconnect is not None, "DISCONNECT", r.step)
    assert r.disconnect.value == 0x9D
    assert r.disconnect_props.ServerReference == ws_url["ap"]
    old = Paho("x-ws-redirect-311", paho.MQTTv311, websocket=True)
    assert old.connect(fed.nodes["eu"].mqtt_ws) == 0
    old.c.publish(f"$geofed/loc={SINGAPORE}", b"", 0)
    until(lambda: old.disconnect is not None, "the connection to close", old.step)
    assert [(t, p.decode()) for t, p in old.receive(1)] == [("$geofed/redirect", ws_url["ap"])]


def test_websocket_needs_the_mqtt_subprotocol_and_binary_frames(fed: LocalFederation) -> None:
    url = f"http://{fed.nodes['eu'].mqtt_ws}/mqtt"

    async def run() -> None:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(url)  # no subprotocol
            assert refused.value.status == 400
            async with http.ws_connect(url, protocols=("mqtt",)) as ws:
                assert ws.protocol == "mqtt"
                await ws.send_str("CONNECT")  # MQTT goes in binary frames: the server closes
                msg = await ws.receive(HANG_S)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)

    asyncio.run(run())
    p = Paho("x-ws-after", websocket=True)  # the node keeps serving
    assert p.connect(fed.nodes["eu"].mqtt_ws) == 0
    p.close()


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    """With tls_dir the listener serves TLS; with client_auth cert a certificate is the identity."""
    with LocalFederation(THREE, "event-geofence", tmp_path, tls=True, client_auth="cert") as sec:
        eu = sec.nodes["eu"]
        alice = sec.client_tls("alice")
        assert alice is not None and alice.cert_file and alice.key_file
        clients = []
        for cid in ("alice-sub", "alice-pub"):
            c = Paho(cid)
            c.c.tls_set(ca_certs=alice.ca_file, certfile=alice.cert_file, keyfile=alice.key_file)
            assert c.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
            clients.append(c)
        wss = Paho("alice-wss", websocket=True)  # MQTT over WebSocket over TLS
        wss.c.tls_set(ca_certs=alice.ca_file, certfile=alice.cert_file, keyfile=alice.key_file)
        assert wss.connect(eu.mqtt_ws, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
        clients.append(wss)
        sub, pub, wss = clients
        assert sub.subscribe("t/#", 1) == [1]
        assert wss.subscribe("t/#", 1) == [1]
        rc, _ = pub.publish("t/1", b"over TLS")
        assert rc == 0
        rc, _ = wss.publish("t/2", b"over wss")
        assert rc == 0
        for c in (sub, wss):
            assert sorted(c.receive(2)) == [("t/1", b"over TLS"), ("t/2", b"over wss")]
        moved = Paho("alice-wss-moved", websocket=True)
        moved.c.tls_set(ca_certs=alice.ca_file, certfile=alice.cert_file, keyfile=alice.key_file)
        rc = moved.connect(eu.mqtt_ws, user(PacketTypes.CONNECT, geofed_location=NEW_YORK))
        assert rc.value == 0x9C
        assert moved.connack_props.ServerReference == f"wss://{sec.nodes['us'].mqtt_ws}/mqtt"
        # Certificates re-issued under the same CA: new connections get the new one
        # (TCP and wss), the open ones go on.
        cert = sec.certs_dir / "brokers" / "eu" / "cert.pem"
        before = cert.read_bytes()
        issue_federation(sec.federation_path, sec.certs_dir)
        assert cert.read_bytes() != before
        new = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(Encoding.DER)
        for endpoint in (eu.mqtt, eu.mqtt_ws):
            assert served_certificate(endpoint, alice) == new
        rc, _ = pub.publish("t/3", b"after the rotation")
        assert rc == 0
        assert sub.receive(3)[2] == ("t/3", b"after the rotation")
        late = Paho("alice-late")
        late.c.tls_set(ca_certs=alice.ca_file, certfile=alice.cert_file, keyfile=alice.key_file)
        assert late.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
        clients.append(late)
        # Without a client certificate the handshake fails; without TLS nothing is read.
        refused = metric(eu.metrics_url, "geofed_mqtt_connects_total")
        for extra in (["--cafile", alice.ca_file], []):
            done = mosquitto("mosquitto_pub", "-p", eu.mqtt.rsplit(":")[1], "-t", "t/2",
                             "-m", "x", *extra)  # fmt: skip
            assert done.returncode != 0
        assert metric(eu.metrics_url, "geofed_mqtt_connects_total") == refused
        # A wss client without a certificate fails too, and eu logs and counts every
        # refusal (its own handshake: asyncio's TLS drops a failed one silently).
        served_certificate(eu.mqtt_ws, TLSConfig(ca_file=alice.ca_file))
        for listener, reason in (
            ("mqtt", "no_certificate"),
            ("mqtt", "plaintext"),
            ("mqtt_ws", "no_certificate"),
        ):
            labels = {"listener": listener, "reason": reason}
            until(
                lambda labels=labels: metric(eu.metrics_url, TLS_REFUSED, **labels) == 1,
                f"{listener} {reason} refusal counted",
            )
            line = f"refusing {listener} connection from 127.0.0.1:"
            assert any(
                line in x and f"TLS handshake failed ({reason})" in x
                for x in eu.log_path.read_text().splitlines()
            )
        for c in clients:
            c.close()


def test_a_client_silent_past_its_keep_alive_is_closed_and_its_will_published(
    fed: LocalFederation,
) -> None:
    """A client that stops sending (no PINGREQ: its loop is not driven) is closed once
    1.5 x its keep-alive passed without a packet, and its will is published."""
    eu = fed.nodes["eu"]
    start = local_subs(fed, "eu")
    w = Paho("x-ka-watch")
    assert w.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
    assert w.subscribe("status/#", 1) == [1]
    silent = Paho("x-ka-silent")
    silent.c.will_set("status/x-ka-silent", b"timed out", qos=1)
    assert silent.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS), keepalive=1)
    assert silent.connack == 0
    # From here on `silent` is never driven: it sends nothing, not even PINGREQ.
    assert w.receive(1) == [("status/x-ka-silent", b"timed out")]
    line = next(x for x in eu.log_path.read_text().splitlines() if "x-ka-silent" in x)
    assert "keep-alive" in line
    w.close()
    silent.c.socket().close()
    until(lambda: local_subs(fed, "eu") == start, "the subscription withdrawn")


def test_a_jwt_in_the_connect_password_is_the_identity(
    tmp_path: Path, token_signer: TokenSigner
) -> None:
    """client_auth token: the JWT goes in the CONNECT password (TCP and WebSocket);
    a forged or expired one, or none, is refused with CONNACK 0x86 (3.1.1: 4)."""
    token = token_signer.token
    env = {"GEOFED_TOKEN_KEY": str(token_signer.public)}
    with LocalFederation(
        THREE, "event-geofence", tmp_path / "fed", tls=True, client_auth="token", extra_env=env
    ) as sec:
        eu = sec.nodes["eu"]
        tls = sec.client_tls()
        assert tls is not None

        def client(
            cid: str, password: str | None, version: int = paho.MQTTv5, ws: bool = False
        ) -> Paho:
            c = Paho(cid, version, websocket=ws)
            c.c.tls_set(ca_certs=tls.ca_file)
            if password is not None:
                c.c.username_pw_set("any", password)
            return c

        sub = client("carol-sub", token("carol"))
        assert sub.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
        assert sub.subscribe("t/#", 1) == [1]
        pub = client("carol-pub", token("carol"), ws=True)  # wss, the same password
        assert pub.connect(eu.mqtt_ws, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
        rc, _ = pub.publish("t/1", b"with a token")
        assert rc == 0
        assert sub.receive(1) == [("t/1", b"with a token")]
        refused = metric(eu.metrics_url, AUTH_REFUSED, reason="unauthenticated")
        for bad in (None, token("carol", forged=True), token("carol", ttl=-60)):
            c = client("carol-bad", bad)
            rc = c.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS))
            assert rc.value == 0x86, (bad, rc)
        port_ = eu.mqtt.rsplit(":", 1)[1]
        forged = token("carol", forged=True)
        old = mosquitto("mosquitto_pub", "-p", port_, "-V", "mqttv311", "--cafile", tls.ca_file,
                        "-u", "any", "-P", forged, "-t", "t/2", "-m", "x")  # fmt: skip
        assert old.returncode != 0 and "bad user name or password" in old.stderr.lower(), old
        ok = mosquitto("mosquitto_pub", "-p", port_, "-V", "mqttv311", "--cafile", tls.ca_file,
                       "-u", "any", "-P", token("carol"), "-q", "1", "-d",
                       "-t", f"$geofed/loc={PARIS}/t/3", "-m", "3.1.1 with a token")  # fmt: skip
        assert ok.returncode == 0 and "received PUBACK" in ok.stdout, ok
        assert sub.receive(2)[1] == ("t/3", b"3.1.1 with a token")
        assert metric(eu.metrics_url, AUTH_REFUSED, reason="unauthenticated") == refused + 4
        for c in (sub, pub):
            c.close()


def test_the_will_delay_interval_holds_the_will_until_it_passed_or_the_client_is_back(
    fed: LocalFederation,
) -> None:
    """MQTT 5 Will Delay Interval: the will of a vanished client waits; a reconnect to the
    session within the delay drops it, a reconnect with Clean Start (the old session
    ends) publishes it at once."""
    eu = fed.nodes["eu"]
    start = local_subs(fed, "eu")
    w = Paho("x-wd-watch")
    assert w.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
    assert w.subscribe("wills/#", 1) == [1]

    def connect_props() -> Properties:
        props = user(PacketTypes.CONNECT, geofed_location=PARIS)
        props.SessionExpiryInterval = 300
        return props

    def vanish(cid: str, delay: int) -> None:
        """A client with a delayed will that goes without DISCONNECT."""
        c = Paho(cid)
        will = Properties(PacketTypes.WILLMESSAGE)
        will.WillDelayInterval = delay
        c.c.will_set(f"wills/{cid}", b"gone", qos=1, properties=will)
        assert c.connect(eu.mqtt, connect_props()) == 0
        c.c.socket().close()
        logged = f"mqtt client {cid} gone without DISCONNECT: will in {delay} s"
        until(lambda: logged in eu.log_path.read_text(), logged)

    vanish("x-wd-late", 1)
    assert w.receive(1) == [("wills/x-wd-late", b"gone")]  # once the delay passed
    vanish("x-wd-back", 300)
    back = Paho("x-wd-back")
    assert back.connect(eu.mqtt, connect_props(), clean=False) == 0
    dropped = "mqtt client x-wd-back reconnected within its Will Delay Interval: no will"
    until(lambda: dropped in eu.log_path.read_text(), dropped)
    vanish("x-wd-clean", 300)
    fresh = Paho("x-wd-clean")
    assert fresh.connect(eu.mqtt, connect_props(), clean=True) == 0
    assert w.receive(2)[1] == ("wills/x-wd-clean", b"gone")  # the old session ended: now
    for c in (w, back, fresh):
        c.close()
    until(lambda: local_subs(fed, "eu") == start, "the subscription withdrawn")


def served_certificate(endpoint: str, tls: TLSConfig) -> bytes:
    """The certificate a TLS listener presents to a new connection (DER)."""
    ctx = ssl.create_default_context(cafile=tls.ca_file)
    if tls.cert_file and tls.key_file:  # else: the refusal, by a server that wants one
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    ctx.check_hostname = False  # the broker's name is not the loopback address
    host, _, p = endpoint.rpartition(":")
    with (
        socket.create_connection((host, int(p))) as raw,
        ctx.wrap_socket(raw) as conn,
    ):
        der = conn.getpeercert(binary_form=True)
        if not tls.cert_file:  # TLS 1.3: a server that wants one refuses after our Finished
            assert conn.recv(1) == b""  # and hangs up
    assert der is not None
    return der


def test_a_durable_broker_keeps_the_qos_of_persistent_subscriptions_across_a_restart(
    tmp_path: Path,
) -> None:
    """QoS 0 and QoS 1 subscriptions of a persistent session, the broker restarted while the
    client is away: on reconnect each resumes at the QoS it was granted."""
    with LocalFederation(THREE, "subscription-geofence", tmp_path, durable=True) as dur:
        connect = user(PacketTypes.CONNECT, geofed_location=NEW_YORK)
        connect.SessionExpiryInterval = 3600
        s = Paho("x-qos-kept")
        assert s.connect(dur.nodes["us"].mqtt, connect) == 0
        assert s.subscribe("q0/#", 0) == [0]
        assert s.subscribe("q1/#", 1) == [1]
        s.close()
        until(lambda: s.disconnect is not None, "the disconnect", s.step)
        dur.stop_node("us")
        dur.start_node("us")
        dur.wait_ready(HANG_S)
        us = dur.nodes["us"]
        for topic in ("q0/a", "q1/a"):
            where = ["-D", "publish", "user-property", "geofed-location", NEW_YORK]
            done = mosquitto("mosquitto_pub", "-p", us.mqtt.rsplit(":", 1)[1], "-V", "mqttv5",
                             "-q", "1", "-t", topic, "-m", topic, *where)  # fmt: skip
            assert done.returncode == 0, done.stderr
        until(lambda: metric(us.metrics_url, DELIVERIES) >= 2, "both queued at us")
        s = Paho("x-qos-kept")
        assert s.connect(us.mqtt, connect, clean=False) == 0 and s.session_present is True
        s.receive(2)
        assert sorted((m.topic, m.qos) for m in s.messages) == [("q0/a", 0), ("q1/a", 1)]
        s.close()


def test_a_durable_broker_keeps_delayed_wills_across_a_crash(tmp_path: Path) -> None:
    """Two clients vanish with wills delayed by 300 s and the broker is killed (SIGKILL):
    after the restart both wills are still waiting. The client that comes back to its
    session drops its will; the one that comes back with Clean Start ends its old
    session, so its will is published at once; the store keeps neither afterwards."""
    with LocalFederation(THREE, "subscription-geofence", tmp_path, durable=True) as dur:
        eu = dur.nodes["eu"]

        def connect_props() -> Properties:
            props = user(PacketTypes.CONNECT, geofed_location=PARIS)
            props.SessionExpiryInterval = 300
            return props

        def logged(line: str) -> None:
            until(lambda: line in dur.nodes["eu"].log_path.read_text(), line)

        for cid in ("x-dw-back", "x-dw-clean"):
            c = Paho(cid)
            will = Properties(PacketTypes.WILLMESSAGE)
            will.WillDelayInterval = 300
            c.c.will_set(f"wills/{cid}", b"gone", qos=1, properties=will)
            assert c.connect(eu.mqtt, connect_props()) == 0
            c.c.socket().close()
            logged(f"mqtt client {cid} gone without DISCONNECT: will in 300 s")  # stored by then
        dur.stop_node("eu", signal.SIGKILL)
        dur.start_node("eu")
        dur.wait_ready(HANG_S)
        eu = dur.nodes["eu"]
        for cid in ("x-dw-back", "x-dw-clean"):
            logged(f"mqtt client {cid}: delayed will kept")
        w = Paho("x-dw-watch")
        assert w.connect(eu.mqtt, user(PacketTypes.CONNECT, geofed_location=PARIS)) == 0
        assert w.subscribe("wills/#", 1) == [1]
        back = Paho("x-dw-back")
        assert back.connect(eu.mqtt, connect_props(), clean=False) == 0
        assert back.session_present is True
        logged("mqtt client x-dw-back reconnected within its Will Delay Interval: no will")
        fresh = Paho("x-dw-clean")
        assert fresh.connect(eu.mqtt, connect_props(), clean=True) == 0
        assert w.receive(1) == [("wills/x-dw-clean", b"gone")]
        for c in (w, back, fresh):
            c.close()
        dur.stop_node("eu")
        with contextlib.closing(sqlite3.connect(dur.data_dir("eu") / "geofed.db")) as db:
            assert db.execute("SELECT count(*) FROM mqtt_wills").fetchone() == (0,)


def test_a_roaming_geofence_follows_an_mqtt_subscriber_across_an_area_edge(
    fed: LocalFederation, eu_ap_edge: float
) -> None:
    """paho 5.0 subscribes with ``geofed-geofence: roam:circle:200000`` and drives east along
    latitude 30 across the eu/ap edge, reporting each position on a ``$geofed/loc=`` PUBLISH;
    after every move mosquitto_pub publishes once on each side of the edge. After every
    step, what the brokers delivered and what paho received equal the oracle's deliveries
    for the same actions."""
    edge = eu_ap_edge
    roam = "roam:circle:200000"
    ops: list[TraceOp] = []
    delivered = fed.total(DELIVERIES)
    held = local_subs(fed, "eu")
    earlier: list[str] = []  # received on a connection that has ended

    def at(lon: float) -> str:
        return f"30,{lon}"

    def connect(broker: str, lon: float) -> Paho:
        s = Paho("x-roam")
        props = user(PacketTypes.CONNECT, geofed_location=at(lon))
        assert s.connect(fed.nodes[broker].mqtt, props) == 0
        assert s.subscribe("x/roam/#", 1, user(PacketTypes.SUBSCRIBE, geofed_geofence=roam)) == [1]
        where = LatLon(30.0, lon)
        ops.append(TraceOp(len(ops), "subscribe", "x-roam", where, "x/roam/#", "x/roam/#",
                           roaming=parse_roaming(roam)))  # fmt: skip
        return s

    def settle(sub: Paho) -> None:
        asyncio.run(fed.quiescent(HANG_S))
        want = len(reference_deliveries(ops))
        until(lambda: fed.total(DELIVERIES) - delivered == want, f"{want} deliveries made")
        until(lambda: len(earlier) + len(sub.messages) >= want, f"{want} received", sub.step)

    def publish_both(n: int, sub: Paho) -> None:
        for side, lon, broker in (("w", edge - 1.0, "eu"), ("e", edge + 1.0, "ap")):
            topic = f"x/roam/r{n}{side}"
            done = mosquitto("mosquitto_pub", "-p", port(fed, broker), "-V", "mqttv311", "-q", "1",
                             "-i", f"x-roam-{side}", "-t", f"$geofed/loc={at(lon)}/{topic}",
                             "-m", topic)  # fmt: skip
            assert done.returncode == 0, done.stderr
            ops.append(TraceOp(len(ops), "publish", f"x-roam-{side}", LatLon(30.0, lon), topic,
                               topic))  # fmt: skip
        settle(sub)

    sub = connect("eu", edge - 3.0)
    until(lambda: local_subs(fed, "eu") == held + 1, "the subscription held")
    publish_both(1, sub)
    for n, offset in enumerate((-0.5, -0.3, 0.5, 1.8, 3.0), start=2):
        lon = edge + offset
        info = sub.c.publish(f"$geofed/loc={at(lon)}", b"", 1)
        if offset == 0.5:  # into ap's area: "Server moved", and on to ap
            until(lambda s=sub: s.disconnect is not None, "DISCONNECT", sub.step)
            assert sub.disconnect.value == 0x9D
            assert sub.disconnect_props.ServerReference == fed.nodes["ap"].mqtt
            earlier += [m.payload.decode() for m in sub.messages]
            sub = connect("ap", lon)  # a new session at ap: the subscribe moves it there
        else:
            until(lambda s=sub, i=info: i.mid in s.acks, "PUBACK of the location", sub.step)
            ops.append(TraceOp(len(ops), "move", "x-roam", LatLon(30.0, lon)))
        settle(sub)
        publish_both(n, sub)
    expected = sorted(event for event, _ in reference_deliveries(ops))
    # Events from both sides, and not every one: the geofence moved.
    assert {e[-1] for e in expected} == {"w", "e"} and len(expected) == 9
    received = earlier + [m.payload.decode() for m in sub.messages]
    assert sorted(received) == expected
    assert fed.total(DELIVERIES) - delivered == len(expected)
    sub.close()


def test_a_burst_of_packets_is_answered_in_order_and_a_subscribe_splits_it(
    fed: LocalFederation,
) -> None:
    """Packets written in one go (CONNECT, PUBLISH a, SUBSCRIBE, PUBLISH b): the listener
    publishes a burst's events together, but never across another packet: the PUBACKs
    come in order and the new subscription gets b, not a (published before it)."""
    out = [
        mq.Connect("x-burst", properties=mq.Properties(user=[("geofed-location", PARIS)])),
        mq.Publish("burst/a", b"before", 1, packet_id=1),
        mq.Subscribe(2, [("burst/#", 1)]),
        mq.Publish("burst/b", b"after", 1, packet_id=3),
    ]

    async def run() -> list[tuple[str, Any]]:
        got: list[tuple[str, Any]] = []
        async with RawMqtt(fed.nodes["eu"].mqtt, websocket=False) as c:
            await c.write(*out)  # one write: one burst
            # Until the first delivery and the last PUBACK (a delivery may come before
            # the PUBACK of its publish: the broker writes deliveries first).
            while not any(kind == "publish" for kind, _ in got) or ("puback", 3) not in got:
                packet = await c.read()
                if isinstance(packet, mq.PubAck):
                    got.append(("puback", packet.packet_id))
                elif isinstance(packet, mq.SubAck):
                    got.append(("suback", packet.packet_id))
                elif isinstance(packet, mq.Publish):
                    got.append(("publish", (packet.topic, packet.payload)))
            await c.write(mq.Disconnect())
        return got

    got = asyncio.run(run())
    acks = [x for x in got if x[0] != "publish"]
    assert acks == [("puback", 1), ("suback", 2), ("puback", 3)]
    first = next(x for x in got if x[0] == "publish")
    assert first == ("publish", ("burst/b", b"after"))  # the first delivery: not "before"
