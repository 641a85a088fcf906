"""The side-by-side benchmark, its broker launchers and node_bench at a tiny size.

Content and shape only (every broker, every test, nothing lost, ratios
computed), never timings: the figures are measured in ``bench/`` and recorded
in ``bench/results/``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import nats
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from geofed.bench.brokers import Mosquitto, NatsServer

pytestmark = pytest.mark.integration


def test_mosquitto_launcher_carries_a_message_and_cleans_up() -> None:
    with Mosquitto() as broker:
        workdir = broker.workdir
        assert workdir is not None and (workdir / "mosquitto.conf").exists()
        got = threading.Event()
        subscribed = threading.Event()
        payloads: list[bytes] = []

        def on_message(_c: object, _u: object, msg: mqtt.MQTTMessage) -> None:
            payloads.append(msg.payload)
            got.set()

        sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="sub")
        sub.on_message = on_message
        sub.on_subscribe = lambda *_: subscribed.set()
        sub.connect(broker.host, broker.port)
        sub.loop_start()
        try:
            sub.subscribe("a/b", qos=0)
            assert subscribed.wait(120)
            pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="pub")
            pub.connect(broker.host, broker.port)
            pub.loop_start()
            pub.publish("a/b", b"hello", qos=0).wait_for_publish(120)
            assert got.wait(120)
            pub.disconnect()
            pub.loop_stop()
        finally:
            sub.disconnect()
            sub.loop_stop()
        assert payloads == [b"hello"]
    assert broker.process is None and not workdir.exists()


def test_nats_launcher_carries_a_message_and_cleans_up() -> None:
    async def roundtrip(address: str) -> bytes:
        nc = await nats.connect(f"nats://{address}")
        try:
            sub = await nc.subscribe("a.b")
            await nc.flush()
            await nc.publish("a.b", b"hello")
            msg = await sub.next_msg(timeout=120)
            return bytes(msg.data)
        finally:
            await nc.close()

    with NatsServer() as broker:
        workdir = broker.workdir
        assert workdir is not None
        assert asyncio.run(roundtrip(broker.address)) == b"hello"
    assert broker.process is None and not workdir.exists()


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )


@pytest.mark.timeout(600)
def test_brokers_bench_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "brokers.json"
    proc = _run(
        "geofed.bench.brokers_bench",
        "--events",
        "300",
        "--repeat",
        "1",
        "--rate",
        "100",
        "--seconds",
        "1",
        "--no-record",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    (rep,) = doc["repetitions"]
    assert set(rep["results"]) == {"geofed", "mosquitto", "nats"}
    for kind, tests in rep["results"].items():
        for test, row in tests.items():
            assert "error" not in row, (kind, test, row)
            subscribers = 10 if test == "1->10" else 1
            events = 100 if test == "latency" else 300
            assert row["expected"] == row["delivered"] == subscribers * events, (kind, test)
        assert tests["1->1"]["per_s"] > 0 and tests["1->10"]["per_s"] > 0
        assert 0 < tests["latency"]["p50_ms"] <= tests["latency"]["p99_ms"]
    ratios = doc["median_ratios"]
    assert set(ratios) >= {"1->1 vs mosquitto", "1->10 vs mosquitto", "p99_ms vs mosquitto"}
    assert all(v is not None and v > 0 for v in ratios.values())
    assert "Failed repetitions: none" in proc.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "link", [[], ["--tls", "on", "--peer-dials", "--world-events"]], ids=["plain", "peer-dials"]
)
def test_node_bench_tiny_run_delivers_locally(link: list[str]) -> None:
    """Every local delivery arrives. With --peer-dials --tls on the peer's link enters
    through the node's TLS front and carries the subscriptions in (the bench waits for
    all 200) and the deliveries out (and for the peer to have every one sent)."""
    proc = _run(
        "geofed.bench.node_bench",
        "--subs",
        "200",
        "--events",
        "500",
        "--local-subs",
        "3",
        "--local-events",
        "400",
        "--durability",
        "off",
        "--rate",
        "100",
        "--seconds",
        "1",
        "--no-record",
        *link,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 200 |")]
    assert len(rows) == 1, proc.stdout
    assert " to 3 (0) |" in rows[0]  # every local delivery arrived
    if link:
        head = next(line for line in proc.stdout.splitlines() if line.startswith("| subscr"))
        column = [c.strip() for c in head.split("|")].index("delivery msgs")
        assert int(rows[0].split("|")[column].strip().replace(",", "")) > 0, rows[0]


@pytest.mark.timeout(600)
def test_peer_tls_bench_tiny_run() -> None:
    proc = _run(
        "geofed.bench.peer_tls_bench",
        "--mib",
        "2",
        "--pings",
        "100",
        "--rounds",
        "1",
        "--no-record",
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if "|" in line}
    assert {"plaintext", "grpc-tls", "front"} <= set(rows), proc.stdout
