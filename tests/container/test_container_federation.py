"""The broker image as a 3-region federation of containers, driven from the host.

Each strategy family gets its own federation: `event-geofence` (events cross
regions) and `subscription-geofence` (subscriptions cross regions). Brokers
speak mutual TLS to each other, with certificates made when the test starts.
Clients on the host connect over TLS at their local broker through published
loopback ports, and replay small traces whose deliveries must equal the
central oracle (`reference_deliveries`). Then one region's container is stopped (the others
keep serving their own clients and each other) and started again (its links
come back and cross-region delivery resumes). Every phase uses topics of its
own, so that nothing from an earlier phase can match a later one.

Nothing waits for a fixed time: each step waits for the state it needs, read
from the brokers' gRPC health and Prometheus metrics (links up or down, no
inter-broker message in flight, every counted delivery received).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Collection, Iterator
from typing import Any

import grpc
import pytest
from container_testkit import ContainerFederation, start_federation

import geofed
import geofed.client
from geofed.bench import Replayer
from geofed.client import RetryConfig, health_status
from geofed.k8s import slug
from geofed.node import CLIENT_PORT, METRICS_PORT, PEER_PORT
from geofed.routing import Federation, TraceOp, read_trace, reference_deliveries
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import CLIENT_SERVICE, FEDERATION_SERVICE

pytestmark = [pytest.mark.container, pytest.mark.timeout(2400)]

FRANKFURT = (50.11, 8.68)
PARIS = (48.85, 2.35)
MADRID = (40.42, -3.70)
VIRGINIA = (39.04, -77.49)
MEXICO = (19.43, -99.13)
SINGAPORE = (1.29, 103.85)
TOKYO = (35.69, 139.69)
EUROPE = "POLYGON((-12 34, 35 34, 35 62, -12 62, -12 34))"
AMERICAS = "POLYGON((-130 5, -60 5, -60 55, -130 55, -130 5))"
ASIA = "POLYGON((90 -12, 150 -12, 150 45, 90 45, 90 -12))"
ASIA_AND_AMERICAS = (
    "MULTIPOLYGON(((90 -12, 150 -12, 150 45, 90 45, 90 -12)),"
    "((-130 5, -60 5, -60 55, -130 55, -130 5)))"
)


def _at(place: tuple[float, float]) -> dict[str, float]:
    return {"lat": place[0], "lon": place[1]}


def trace(phase: str, records: list[dict[str, Any]]) -> list[TraceOp]:
    """Trace records with ids, clients and topics prefixed by `phase`."""
    lines = []
    for t, rec in enumerate(records):
        rec = {"t": float(t), **rec, "client": f"{phase}-{rec['client']}"}
        if "id" in rec:
            rec["id"] = f"{phase}-{rec['id']}"
        if "topic" in rec:
            rec["topic"] = f"{phase}/{rec['topic']}"
        lines.append(json.dumps(rec))
    return list(read_trace(lines))


def sub(
    client: str, sid: str, place: tuple[float, float], topic: str, fence: str | None = None
) -> dict[str, Any]:
    return {
        "op": "subscribe",
        "client": client,
        "id": sid,
        "topic": topic,
        "geofence": fence,
        **_at(place),
    }


def pub(
    client: str, eid: str, place: tuple[float, float], topic: str, fence: str | None = None
) -> dict[str, Any]:
    return {
        "op": "publish",
        "client": client,
        "id": eid,
        "topic": topic,
        "geofence": fence,
        **_at(place),
        "payload_size": 64,
    }


def move(client: str, place: tuple[float, float]) -> dict[str, Any]:
    return {"op": "move", "client": client, **_at(place)}


def unsub(client: str, sid: str) -> dict[str, Any]:
    return {"op": "unsubscribe", "client": client, "id": sid}


def cross_region_trace(phase: str) -> list[TraceOp]:
    """Subscribers and publishers in all three regions, with both kinds of geofence."""
    return trace(
        phase,
        [
            sub("eu1", "s-eu-all", FRANKFURT, "#"),
            sub("eu2", "s-eu-temp", PARIS, "+/temp", EUROPE),  # publishers in Europe only
            sub("us1", "s-us-all", VIRGINIA, "#"),
            sub("us2", "s-us-asia", MEXICO, "alerts/#", ASIA),  # publishers in Asia only
            sub("ap1", "s-ap-all", SINGAPORE, "#"),
            sub("ap2", "s-ap-temp", TOKYO, "+/temp"),
            pub("pe", "e-eu-world", FRANKFURT, "de/temp"),
            pub(
                "pu", "e-us-americas", VIRGINIA, "us/temp", AMERICAS
            ),  # subscribers in the Americas
            pub("pa", "e-ap-alert", TOKYO, "alerts/quake", ASIA_AND_AMERICAS),
            pub("pa", "e-ap-europe", SINGAPORE, "sg/temp", EUROPE),
            move("eu2", MADRID),  # stays in eu
            pub("pe", "e-eu-after-move", FRANKFURT, "es/temp", EUROPE),
            move("us2", PARIS),  # leaves us: redirected to eu, subscription moves along
            pub("pa", "e-ap-alert-2", TOKYO, "alerts/flood"),
            unsub("us1", "s-us-all"),
            pub("pe", "e-eu-last", FRANKFURT, "fr/temp"),
        ],
    )


def two_region_trace(phase: str) -> list[TraceOp]:
    """Traffic that involves eu and us only (ap is down)."""
    return trace(
        phase,
        [
            sub("eu1", "s-eu-all", FRANKFURT, "#"),
            sub("us1", "s-us-all", VIRGINIA, "#"),
            sub("eu2", "s-eu-us", PARIS, "+/temp", AMERICAS),
            pub("pe", "e-eu-local", FRANKFURT, "de/temp", EUROPE),  # eu only
            pub("pu", "e-us-world", VIRGINIA, "us/temp"),  # eu, us and (down) ap
            pub("pe", "e-eu-to-asia", FRANKFURT, "de/news", ASIA),  # only the down region
            pub("pu", "e-us-local", VIRGINIA, "us/news", AMERICAS),
        ],
    )


# grpc.aio binds to the first event loop it runs on: one loop serves every replay.
_LOOP = asyncio.new_event_loop()


def replay(
    fed: ContainerFederation, ops: list[TraceOp], timeout: float = 30.0
) -> tuple[list[tuple[str, str]], list[str], int]:
    """Replay `ops` from the host against the live brokers; (deliveries, errors, redirects).

    After each action, and at the end, no inter-broker message is in flight
    (`ContainerFederation.quiescent`); then the clients hold every delivery
    the brokers counted (a late duplicate included) before the results are
    read.
    """

    async def run() -> tuple[list[tuple[str, str]], list[str], int]:
        counted_before = await asyncio.to_thread(fed.deliveries_counted)
        r = Replayer(fed.federation, barrier=fed.quiescent, tls=fed.client_tls)
        try:
            await r.run(ops)
            await fed.quiescent()
            deadline = time.monotonic() + timeout
            while (
                counted := await asyncio.to_thread(fed.deliveries_counted) - counted_before
            ) != len(r.deliveries):
                assert time.monotonic() < deadline, (
                    f"brokers counted {counted:g} deliveries, clients received "
                    f"{len(r.deliveries)}, after {timeout}s"
                )
                await asyncio.sleep(0.01)
        finally:
            await r.close()
        return r.deliveries, r.errors, r.redirects

    return _LOOP.run_until_complete(run())


def assert_equals_oracle(fed: ContainerFederation, ops: list[TraceOp]) -> None:
    """Deliveries of `ops`, replayed against the live brokers, equal the central oracle's."""
    deliveries, errors, _ = replay(fed, ops)
    assert errors == []
    expected = reference_deliveries(ops)
    assert expected, "the trace should deliver something"
    assert sorted(deliveries) == sorted(expected), (
        f"missing {sorted(set(expected) - set(deliveries))}, "
        f"unexpected {sorted(set(deliveries) - set(expected))}"
    )


# --- fixtures -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=["event-geofence", "subscription-geofence"])
def fed(
    request: pytest.FixtureRequest,
    geofed_image: str,
    docker_engine: Any,
    three_source: Federation,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ContainerFederation]:
    workdir = tmp_path_factory.mktemp(f"fed-{request.param}")
    workdir.chmod(0o755)
    yield from start_federation(geofed_image, three_source, request.param, workdir, docker_engine)


# --- the image ------------------------------------------------------------------------


def test_image_runs_the_cli_as_non_root(geofed_image: str, docker_engine: Any) -> None:
    image = docker_engine.images.get(geofed_image)
    config = image.attrs["Config"]
    assert config["User"].split(":")[0] not in ("", "0", "root")
    assert config["Entrypoint"][-1] == "node" and "geofed" in config["Entrypoint"][-2]
    assert set(config["ExposedPorts"]) == {
        f"{p}/tcp" for p in (CLIENT_PORT, PEER_PORT, METRICS_PORT)
    }
    assert "healthcheck.py" in " ".join(config["Healthcheck"]["Test"])
    out = docker_engine.containers.run(
        geofed_image, ["--help"], entrypoint=["geofed"], remove=True, read_only=True
    )
    for command in ("node", "k8s", "route"):
        assert command in out.decode()


def test_image_has_the_postgresql_history_and_the_h3_layout(
    geofed_image: str, docker_engine: Any
) -> None:
    """The image's `image` extra: psycopg with its libpq (history_dsn works in a container)
    and h3 (bridge-topics --layout h3), used as the node and the CLI use them."""
    script = (
        "import psycopg\n"
        "from geofed.routing import H3Layout, latlon\n"
        "layout = H3Layout(prefix='h3', resolution=5)\n"
        "where, rest = layout.decode(layout.topic(latlon(48.85, 2.35), 'sensors/t'))\n"
        "print(psycopg.pq.version() > 0, rest, round(where.lat), round(where.lon))\n"
    )
    out = docker_engine.containers.run(
        geofed_image,
        ["-c", script],
        entrypoint=["/opt/geofed/bin/python"],
        remove=True,
        read_only=True,
    )
    assert out.decode().split() == ["True", "sensors/t", "49", "2"]


# --- a federation of containers ----------------------------------------------------------


def test_brokers_are_healthy(fed: ContainerFederation) -> None:
    for bid in fed.containers:
        for service in ("", CLIENT_SERVICE, FEDERATION_SERVICE):
            assert fed.health(bid, service) == "SERVING"
        # The client port serves TLS only.
        assert health_status(fed.client(bid)) == "UNREACHABLE"
    # The image's own HEALTHCHECK (deploy/image/healthcheck.py, over TLS) agrees.
    deadline = time.monotonic() + 90
    pending = set(fed.containers)
    while pending := {b for b in pending if fed.docker_health(b) != "healthy"}:
        assert time.monotonic() < deadline, f"docker health never healthy for {pending}"
        time.sleep(0.5)


def test_health_port_answers_in_plaintext(fed: ContainerFederation) -> None:
    """The kubelet's probes (plaintext gRPC) reach the health-only port of a TLS broker."""
    for bid in fed.containers:
        c = fed.wrapped(bid)
        env = dict(e.split("=", 1) for e in c.attrs["Config"]["Env"])
        port = env["GEOFED_HEALTH_LISTEN"].rpartition(":")[2]
        check = c.attrs["Config"]["Healthcheck"]["Test"][1:]
        for service in ("", CLIENT_SERVICE):
            args = [*check, "--target", f"127.0.0.1:{port}", "--service", service]
            code, out = c.exec_run(args, environment={"GEOFED_TLS_DIR": ""})
            assert code == 0, out.decode()


def test_peer_port_needs_mutual_tls(fed: ContainerFederation) -> None:
    """Inside the network, us's peer port answers eu's certificate and nothing in plaintext.

    The image's own health check runs in eu's container, asking us's peer
    port as broker us (the name TLS must verify), with eu's certificate.
    """
    check = fed.wrapped("eu").attrs["Config"]["Healthcheck"]["Test"][1:]
    target = ["--peer", "--target", f"geofed-{slug('us')}:{PEER_PORT}"]
    as_us = {"GEOFED_BROKER_ID": "us"}
    code, out = fed.wrapped("eu").exec_run([*check, *target], environment=as_us)
    assert code == 0, out.decode()
    plain = {**as_us, "GEOFED_TLS_DIR": ""}
    code, out = fed.wrapped("eu").exec_run([*check, *target], environment=plain)
    assert code == 1 and b"UNREACHABLE" in out, out.decode()


def test_connect_redirects_to_the_local_broker(fed: ContainerFederation) -> None:
    with grpc.secure_channel(fed.client("eu"), fed.client_tls.credentials()) as ch:
        resp = cpb_grpc.ClientServiceStub(ch).Connect(
            cpb.ConnectRequest(
                client="traveller", location=gpb.LatLon(lat=SINGAPORE[0], lon=SINGAPORE[1])
            )
        )
    assert not resp.accepted
    assert resp.redirect.broker_id == "ap"
    assert resp.redirect.endpoint == fed.client("ap")  # reachable from where the client is
    with grpc.secure_channel(resp.redirect.endpoint, fed.client_tls.credentials()) as ch:
        again = cpb_grpc.ClientServiceStub(ch).Connect(
            cpb.ConnectRequest(
                client="traveller", location=gpb.LatLon(lat=SINGAPORE[0], lon=SINGAPORE[1])
            )
        )
    assert again.accepted and again.broker_id == "ap"


def test_cross_region_deliveries_equal_the_oracle(fed: ContainerFederation) -> None:
    assert_equals_oracle(fed, cross_region_trace("p1"))


def test_region_down_then_back(fed: ContainerFederation) -> None:
    # ap stops gracefully on SIGTERM, as PID 1 of its container.
    assert fed.stop_broker("ap") == 0, fed.logs("ap")
    for bid in ("eu", "us"):
        # Still serving clients (the readiness probe) though a peer link is down.
        assert fed.health(bid, CLIENT_SERVICE) == "SERVING"
    # A closed stream is noticed at once; a peer gone silently within
    # peer_timeout_s (20 s by default) of heartbeats not arriving.
    unnoticed = wait_for_link_down(fed, ("eu", "us"), timeout=45)
    assert not unnoticed, f"peer link loss not detected within 45 s: {unnoticed}"
    assert set(fed.live) == {"eu", "us"}
    assert_equals_oracle(fed, two_region_trace("p2"))

    fed.start_broker("ap")
    fed.wait_linked(timeout=120)
    assert_equals_oracle(fed, cross_region_trace("p3"))


def wait_for_link_down(
    fed: ContainerFederation, brokers: Collection[str], timeout: float
) -> dict[str, list[str]]:
    """Wait until each broker reports its federation health NOT_SERVING; who did not, and why."""
    deadline = time.monotonic() + timeout
    pending = set(brokers)
    while pending and time.monotonic() < deadline:
        pending = {b for b in pending if fed.health(b, FEDERATION_SERVICE) != "NOT_SERVING"}
        time.sleep(0.2)
    return {b: fed.peer_gauges(b) for b in sorted(pending)}


# --- a durable federation: stores on volumes -------------------------------------------


@pytest.fixture(scope="module")
def durable_fed(
    geofed_image: str,
    docker_engine: Any,
    three_source: Federation,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ContainerFederation]:
    workdir = tmp_path_factory.mktemp("fed-durable")
    workdir.chmod(0o755)
    yield from start_federation(
        geofed_image, three_source, "subscription-geofence", workdir, docker_engine, durable=True
    )


def test_a_durable_broker_keeps_its_sessions_across_a_crash(
    durable_fed: ContainerFederation,
) -> None:
    """ap keeps its store on its volume: SIGKILLed with a persistent session's deliveries
    queued, and started again, it resumes the session; what eu acknowledged meanwhile
    (kept in eu's outbox for ap) arrives too: every event once, in offset order."""
    fed = durable_fed
    singapore, paris = geofed.LatLon(1.29, 103.85), geofed.LatLon(48.85, 2.35)
    retry = RetryConfig(attempts=120, initial_backoff_s=0.05, max_backoff_s=1.0)

    async def connect(cid: str, where: geofed.LatLon, **kw: Any) -> geofed.Client:
        return await geofed.connect(
            client_id=cid,
            location=where,
            federation=str(fed.federation_file),
            tls=fed.client_tls,
            retry=retry,
            **kw,
        )

    async def take(sub: geofed.client.Subscription, n: int) -> list[geofed.Message]:
        return [await sub.next(timeout=300.0) for _ in range(n)]

    async def run() -> None:
        sub_client = await connect("dur-sub", singapore, session_expiry_s=600.0)
        pub = await connect("dur-pub", paris)
        sub = await sub_client.subscribe("d/#", subscription_id="dur-s")
        await fed.quiescent()  # ap's subscription is at eu
        first = await pub.publish_many(
            [geofed.client.Publication("d/x", b"a", paris, None, f"a{i}") for i in range(10)]
        )
        got = await take(sub, 4)  # the rest queued at ap, or on their way
        fed.kill_broker("ap")
        second = await pub.publish_many(
            [geofed.client.Publication("d/x", b"b", paris, None, f"b{i}") for i in range(10)]
        )
        fed.start_broker("ap")
        await asyncio.to_thread(fed.wait_linked, 180.0)
        got += await take(sub, 16)
        assert sorted(m.event_id for m in got) == sorted(first + second)
        offsets = [m.offset for m in got]
        assert offsets == sorted(offsets) and len(set(offsets)) == 20
        assert sub.duplicates == 0
        await pub.close()
        await sub_client.close()

    _LOOP.run_until_complete(run())
