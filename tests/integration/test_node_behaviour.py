"""Broker behaviour through real gRPC: redirects, moves, bad input, peers down, mismatches."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from geofed.bench import LocalFederation, scrape
from geofed.bench import metric as node_metric
from geofed.client import health_status
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import FEDERATION_SERVICE

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
FRANKFURT = gpb.LatLon(lat=50.11, lon=8.68)
VIRGINIA = gpb.LatLon(lat=39.04, lon=-77.49)
SINGAPORE = gpb.LatLon(lat=1.29, lon=103.85)


def stub(fed: LocalFederation, broker: str) -> cpb_grpc.ClientServiceStub:
    return cpb_grpc.ClientServiceStub(grpc.insecure_channel(fed.nodes[broker].client))


def metric(fed: LocalFederation, broker: str, name: str, **labels: str) -> float:
    return node_metric(fed.nodes[broker].metrics_url, name, **labels)


class Collector:
    """Reads a Subscribe stream in a thread."""

    def __init__(self, call: grpc.Future) -> None:
        self.call = call
        self.items: list[cpb.Delivery] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        call.initial_metadata()  # returned once the broker registered the subscription
        self.thread.start()

    def _run(self) -> None:
        try:
            for d in self.call:
                self.items.append(d)
        except grpc.RpcError as exc:
            self.error = exc

    def wait_for(self, n: int, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.items) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return [d.event.id for d in self.items]


def subscribe(
    fed: LocalFederation, broker: str, client: str, sid: str, where: gpb.LatLon, topic: str = "t/#"
) -> Collector:
    s = stub(fed, broker)
    assert s.Connect(cpb.ConnectRequest(client=client, location=where)).accepted
    call = s.Subscribe(
        cpb.SubscribeRequest(
            client=client, subscription=gpb.Subscription(id=sid, topic_filter=topic)
        )
    )
    return Collector(call)


def publish(
    fed: LocalFederation, broker: str, eid: str, where: gpb.LatLon, topic: str = "t/x", **kw: object
) -> str:
    ev = gpb.Event(id=eid, topic=topic, publisher=where, **kw)
    return str(stub(fed, broker).Publish(cpb.PublishRequest(client="pub", event=ev)).event_id)


def wait_until(cond, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_connect_outside_area_is_redirected(three_federation: LocalFederation) -> None:
    resp = stub(three_federation, "eu").Connect(cpb.ConnectRequest(client="c1", location=SINGAPORE))
    assert not resp.accepted
    assert resp.redirect.broker_id == "ap"
    assert resp.redirect.endpoint == three_federation.nodes["ap"].client
    assert (
        stub(three_federation, "ap")
        .Connect(cpb.ConnectRequest(client="c1", location=SINGAPORE))
        .accepted
    )


def test_moving_subscriber_is_rehomed_and_keeps_receiving(
    three_federation: LocalFederation,
) -> None:
    fed = three_federation
    first = subscribe(fed, "eu", "walker", "s-walk", FRANKFURT)
    publish(fed, "us", "e-before", VIRGINIA)
    assert first.wait_for(1) == ["e-before"]
    # The update leaves eu's area: eu ends the stream and redirects.
    resp = stub(fed, "eu").UpdateLocation(
        cpb.UpdateLocationRequest(client="walker", location=VIRGINIA)
    )
    assert not resp.accepted and resp.redirect.broker_id == "us"
    first.thread.join(5)
    assert first.error is not None and first.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    second = subscribe(fed, "us", "walker", "s-walk", VIRGINIA)
    publish(fed, "ap", "e-after", SINGAPORE)
    assert second.wait_for(1) == ["e-after"]
    assert metric(fed, "us", "geofed_subscriptions", scope="local") == 1
    assert metric(fed, "eu", "geofed_subscriptions", scope="local") == 0


@pytest.mark.parametrize(
    ("event", "code", "field"),
    [
        (
            gpb.Event(id="b1", topic="t/+", publisher=FRANKFURT),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request.event.topic",
        ),
        (
            gpb.Event(id="b2", topic="t/x"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request.event.publisher",
        ),
        (
            gpb.Event(id="b3", topic="t/x", publisher=gpb.LatLon(lat=91, lon=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request.event.publisher.lat",
        ),
        (
            gpb.Event(
                id="b4",
                topic="t/x",
                publisher=FRANKFURT,
                geofence=gpb.Geofence(wkt="POLYGON((0 0, 1 1, 1 0, 0 1, 0 0))"),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request.event.geofence.wkt",
        ),
        (
            gpb.Event(
                id="b5",
                topic="t/x",
                publisher=FRANKFURT,
                geofence=gpb.Geofence(wkt="POLYGON((0 0, nan 1"),
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "request.event.geofence.wkt",
        ),
        (
            gpb.Event(id="b6", topic="t/x", publisher=FRANKFURT, payload=b"x" * 1_100_000),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "request.event.payload",
        ),
        (
            gpb.Event(id="b7", topic="t/x", publisher=SINGAPORE),
            grpc.StatusCode.FAILED_PRECONDITION,
            "ap",
        ),
    ],
)
def test_bad_input_is_rejected_naming_the_field_and_the_node_keeps_serving(
    three_federation: LocalFederation, event: gpb.Event, code: grpc.StatusCode, field: str
) -> None:
    fed = three_federation
    watcher = subscribe(fed, "eu", "w", "s-w", FRANKFURT)
    with pytest.raises(grpc.RpcError) as err:
        stub(fed, "eu").Publish(cpb.PublishRequest(client="pub", event=event))
    assert err.value.code() == code
    assert field in err.value.details()
    # Nothing was half-applied, and the node still serves.
    publish(fed, "eu", "ok-1", FRANKFURT)
    assert watcher.wait_for(1) == ["ok-1"]
    assert metric(fed, "eu", "geofed_events_published_total") == 1


def test_publish_stream_applies_a_batch_whole_or_not_at_all(
    three_federation: LocalFederation,
) -> None:
    fed = three_federation
    watcher = subscribe(fed, "eu", "w", "s-w", FRANKFURT)

    def batch(*ids: str) -> cpb.PublishBatch:
        return cpb.PublishBatch(
            client="pub",
            events=[
                gpb.Event(id=i, topic="t/x", publisher=SINGAPORE if i == "bad" else FRANKFURT)
                for i in ids
            ],
        )

    with pytest.raises(grpc.RpcError) as err:
        stub(fed, "eu").PublishStream(iter([batch("b1", "b2"), batch("b3", "bad", "b4")]))
    # The bad event is named; its batch is not published, the earlier one is.
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "batch.events[3].publisher" in err.value.details()
    assert "this batch was not published; 2 earlier events were" in err.value.details()
    assert watcher.wait_for(2) == ["b1", "b2"]
    assert metric(fed, "eu", "geofed_events_published_total") == 2
    ok = stub(fed, "eu").PublishStream(iter([batch("b5")]))
    assert ok.accepted == 1 and list(ok.event_ids) == ["b5"]
    assert watcher.wait_for(3) == ["b1", "b2", "b5"]


def test_bad_subscription_is_rejected(three_federation: LocalFederation) -> None:
    s = stub(three_federation, "eu")
    assert s.Connect(cpb.ConnectRequest(client="c", location=FRANKFURT)).accepted
    bad = gpb.Subscription(id="s1", topic_filter="a/#/b")
    with pytest.raises(grpc.RpcError) as err:
        next(iter(s.Subscribe(cpb.SubscribeRequest(client="c", subscription=bad))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "subscription.topic_filter" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        s.Connect(cpb.ConnectRequest(client="", location=FRANKFURT))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client" in err.value.details()


def test_peer_down_local_traffic_continues_queue_bounded_link_recovers(
    three_federation: LocalFederation,
) -> None:
    fed = three_federation
    local = subscribe(fed, "eu", "l", "s-local", FRANKFURT)
    fed.stop_node("us", signal.SIGKILL)
    wait_until(lambda: metric(fed, "eu", "geofed_peer_connected", peer="us") == 0)
    assert health_status(fed.nodes["eu"].peer, FEDERATION_SERVICE) == "NOT_SERVING"
    for i in range(20):  # event-geofence, world events: each is also for us
        publish(fed, "eu", f"down-{i}", FRANKFURT)
    assert len(local.wait_for(20)) == 20
    # GEOFED_PEER_QUEUE_SIZE=5: the rest was dropped and counted.
    assert metric(fed, "eu", "geofed_peer_queue_dropped_total", peer="us") == 15
    assert metric(fed, "eu", "geofed_peer_queue_length", peer="us") == 5
    fed.start_node("us")
    fed.wait_ready(30)
    remote = subscribe(fed, "us", "r", "s-remote", VIRGINIA)
    publish(fed, "eu", "after", FRANKFURT)
    assert remote.wait_for(1) == ["after"]


def test_silent_peer_is_detected_by_heartbeat_and_nothing_is_lost(tmp_path: Path) -> None:
    # A stopped process keeps its TCP connections open: only the heartbeat
    # timeout tells the link it is gone. Events published meanwhile wait in
    # the peer queue and arrive once, after the peer continues.
    env = {"GEOFED_PEER_HEARTBEAT_S": "0.2", "GEOFED_PEER_TIMEOUT_S": "1.5"}
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env) as fed:
        remote = subscribe(fed, "us", "r", "s-silent", VIRGINIA)
        publish(fed, "eu", "before", FRANKFURT)
        assert remote.wait_for(1) == ["before"]
        us = fed.nodes["us"].process
        os.kill(us.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: metric(fed, "eu", "geofed_peer_connected", peer="us") == 0, 10)
            assert "nothing received for" in fed.nodes["eu"].log_path.read_text()
            for i in range(5):
                publish(fed, "eu", f"while-{i}", FRANKFURT)
            assert metric(fed, "eu", "geofed_peer_queue_length", peer="us") == 5
        finally:
            os.kill(us.pid, signal.SIGCONT)
        wait_until(lambda: metric(fed, "eu", "geofed_peer_connected", peer="us") == 1, 20)
        want = ["before"] + [f"while-{i}" for i in range(5)]
        assert sorted(remote.wait_for(6, timeout=20)) == sorted(want)
        publish(fed, "eu", "after", FRANKFURT)
        got = remote.wait_for(7)
        assert got[-1] == "after" and sorted(got) == sorted([*want, "after"])
        # While connected and idle, heartbeats keep the link up; no duplicate shows up.
        time.sleep(2.0)
        assert metric(fed, "eu", "geofed_peer_connected", peer="us") == 1
        assert len(remote.items) == 7


def test_strategy_and_federation_mismatch_are_refused(
    three_federation: LocalFederation, tmp_path: Path
) -> None:
    fed = three_federation
    fed.stop_node("ap")
    fed.start_node("ap", env={"GEOFED_STRATEGY": "flooding-events"})
    log = fed.nodes["ap"].log_path
    wait_until(lambda: "strategy mismatch" in log.read_text())
    assert health_status(fed.nodes["ap"].client) == "SERVING"  # still serves its own clients
    assert health_status(fed.nodes["eu"].peer, FEDERATION_SERVICE) == "NOT_SERVING"
    fed.stop_node("ap")
    other = json.loads(fed.federation_path.read_text())
    other["features"][0]["geometry"]["coordinates"][0][0][1] += 0.0  # same shape ...
    other["features"].reverse()  # ... feature order does not matter ...
    for feat in other["features"]:
        if feat["properties"]["id"] == "us":  # ... but a different area does
            feat["properties"]["name"] = "changed"
            geom = feat["geometry"]
            ring = (
                geom["coordinates"][0] if geom["type"] == "Polygon" else geom["coordinates"][0][0]
            )
            ring[1] = [ring[1][0], ring[1][1] - 0.5]
    changed = tmp_path / "changed.geojson"
    changed.write_text(json.dumps(other))
    fed.start_node("ap", env={"GEOFED_FEDERATION": str(changed)})
    wait_until(lambda: "federation mismatch" in log.read_text())
    fed.stop_node("ap")
    fed.start_node("ap")
    fed.wait_ready(30)


def test_message_trace_records_every_message_sent(tmp_path: Path) -> None:
    fed = LocalFederation(THREE, "flooding-subscriptions", tmp_path, trace=True)
    with fed:
        watcher = subscribe(fed, "us", "w", "s-trace", VIRGINIA, topic="t/#")
        wait_until(lambda: metric(fed, "eu", "geofed_subscriptions", scope="remote") == 1)
        for i in range(5):
            publish(fed, "eu", f"tr-{i}", FRANKFURT)
        assert len(watcher.wait_for(5)) == 5
        sent = {
            (dict(labels)["kind"], b, dict(labels)["peer"]): v
            for b in fed.nodes
            for (name, labels), v in scrape(fed.nodes[b].metrics_url).items()
            if name == "geofed_peer_messages_sent_total" and v
        }
        for b in fed.nodes:
            fed.stop_node(b)  # graceful: exits 0 and flushes its trace
            assert fed.nodes[b].process.returncode == 0
            assert "stopped" in fed.nodes[b].log_path.read_text()
        traced: dict[tuple[str, str, str], float] = {}
        for b in fed.nodes:
            for line in (tmp_path / f"trace-{b}.jsonl").read_text().splitlines():
                rec = json.loads(line)
                assert rec["strategy"] == "flooding-subscriptions" and rec["src"] == b
                key = (rec["kind"], rec["src"], rec["dst"])
                traced[key] = traced.get(key, 0) + 1
        # Messages sent after the scrape (shutdown) are control frames only.
        assert {k: v for k, v in traced.items() if k[0] != "control"} == {
            k: v for k, v in sent.items() if k[0] != "control"
        }
        assert traced[("subscribe", "us", "eu")] == 1
        assert traced[("delivery", "eu", "us")] == 5


def test_restarted_peer_gets_the_subscriptions_again(tmp_path: Path) -> None:
    # subscription-geofence: subscriptions travel; a restarted broker has lost
    # what it held and must get it back from the snapshot sent on reconnect.
    with LocalFederation(THREE, "subscription-geofence", tmp_path) as fed:
        watcher = subscribe(fed, "eu", "w", "s-resync", FRANKFURT)
        wait_until(lambda: metric(fed, "us", "geofed_subscriptions", scope="remote") == 1)
        fed.stop_node("us", signal.SIGKILL)
        late = subscribe(fed, "eu", "w2", "s-late", FRANKFURT)  # made while us is down
        fed.start_node("us")
        fed.wait_ready(30)
        wait_until(lambda: metric(fed, "us", "geofed_subscriptions", scope="remote") == 2)
        publish(fed, "us", "from-us", VIRGINIA)
        assert watcher.wait_for(1) == ["from-us"]
        assert late.wait_for(1) == ["from-us"]
