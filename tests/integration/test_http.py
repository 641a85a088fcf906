"""The HTTP bridge against a live 3-broker federation: publish, live push, errors, limits.

One federation (eu, us, ap; subscription-geofence, so that event streams are
forwarded subscriptions like any other) serves the module, each broker with
its bridge on `http_listen` (`LocalFederation` turns it on). Every test uses
its own topics. Waiting is on state: an event stream is held once its
``ready`` event arrived and the quiescence barrier says its subscription was
forwarded; a delivery once it arrives. Timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

import geofed
from geofed.bench import LocalFederation, metric
from geofed.bench.faults import until
from geofed.node import EVENTS_PUBLISHED, REQUESTS_REJECTED, TLS_REFUSED
from geofed.routing import GeofenceCache

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = "48.85,2.35"
NEW_YORK = "40.71,-74.0"
SINGAPORE = "1.29,103.85"
EUROPE = "POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"
HANG_S = 120.0  # a request or stream that has not answered by then is hung, not slow
MAX_PAYLOAD = 4096
MAX_URL = 8192


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    workdir = tmp_path_factory.mktemp("http-fed")
    env = {"GEOFED_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD), "GEOFED_HTTP_MAX_URL_BYTES": str(MAX_URL)}
    with LocalFederation(THREE, "subscription-geofence", workdir, extra_env=env) as running:
        yield running


def url(fed: LocalFederation, broker: str, path: str) -> str:
    return f"http://{fed.nodes[broker].http}{path}"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, HANG_S))


class EventStream:
    """A Server-Sent Events stream read event by event."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp

    async def next(self) -> tuple[str, dict[str, Any]]:
        """The next event (name, parsed data); keep-alive comments are skipped."""
        name, data = "message", []
        while True:
            line = (await self.resp.content.readline()).decode()
            if not line:
                raise AssertionError("event stream ended")
            line = line.rstrip("\n")
            if line.startswith(":"):
                continue
            if not line:
                if data:
                    return name, json.loads("\n".join(data))
                continue
            key, _, value = line.partition(": ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)

    async def event(self) -> dict[str, Any]:
        name, data = await self.next()
        assert name == "event", (name, data)
        return data


@asynccontextmanager
async def stream(
    http: aiohttp.ClientSession, fed: LocalFederation, broker: str, path: str, **params: str
) -> AsyncIterator[EventStream]:
    """An event stream at `broker`, held (and forwarded) before it is handed out."""
    async with http.get(url(fed, broker, path), params=params) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = EventStream(resp)
        name, ready = await events.next()
        assert name == "ready" and ready["broker"] == broker, ready
        await fed.quiescent()
        yield events


async def put(
    http: aiohttp.ClientSession,
    fed: LocalFederation,
    broker: str,
    path: str,
    body: bytes,
    **params: str,
) -> tuple[int, dict[str, Any]]:
    async with http.put(url(fed, broker, path), params=params, data=body) as resp:
        return resp.status, await resp.json()


def test_http_publish_reaches_event_streams_and_grpc_subscribers(fed: LocalFederation) -> None:
    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            stream(http, fed, "ap", "/subscribe/t1/%23", location=SINGAPORE) as live,
            await geofed.connect(
                client_id="t1-grpc",
                location=geofed.LatLon(40.71, -74.0),
                federation=str(fed.federation_path),
            ) as grpc_client,
        ):
            sub = await grpc_client.subscribe("t1/+/temp")
            await fed.quiescent()
            status, body = await put(
                http, fed, "eu", "/geopublish/t1/fr/temp", b"21.5", location=PARIS, client="t1-pub"
            )
            assert status == 200, body
            assert body["broker"] == "eu" and body["topic"] == "t1/fr/temp"
            got = await live.event()
            assert got["id"] == body["id"]
            assert got["geometry"] == {"type": "Point", "coordinates": [2.35, 48.85]}
            assert got["properties"]["published_at"] == body["time"]
            props = got["properties"]
            assert (props["topic"], props["payload"], props["origin"]) == (
                "t1/fr/temp",
                "21.5",
                "eu",
            )
            msg = await sub.next(timeout=HANG_S)
            assert (msg.event_id, msg.payload, msg.origin) == (body["id"], b"21.5", "eu")

    run(main())


def test_event_stream_gets_grpc_events_inside_its_subscription_geofence_only(
    fed: LocalFederation,
) -> None:
    where = str(fed.federation_path)

    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            stream(
                http, fed, "us", "/subscribe/t2/%2B", location=NEW_YORK, geofence=EUROPE
            ) as live,
            await geofed.connect(
                client_id="t2-sg", location=geofed.LatLon(1.29, 103.85), federation=where
            ) as singapore,
            await geofed.connect(
                client_id="t2-fr", location=geofed.LatLon(48.85, 2.35), federation=where
            ) as paris,
        ):
            outside = await singapore.publish("t2/x", b"from Singapore")
            await fed.quiescent()  # had it matched, its delivery would be in the stream now
            inside = await paris.publish("t2/x", b"from Paris")
            got = await live.event()
            assert got["id"] == inside != outside
            assert got["properties"]["payload"] == "from Paris"

    run(main())


def test_event_geofence_on_http_publish_is_checked_against_the_stream_location(
    fed: LocalFederation,
) -> None:
    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            stream(http, fed, "us", "/subscribe/t3/%23", location=NEW_YORK) as live,
        ):
            status, away = await put(
                http, fed, "eu", "/publish/t3/a", b"only Europe", location=PARIS, geofence=EUROPE
            )
            assert status == 200 and away["geofence"].startswith("POLYGON")
            await fed.quiescent()
            status, here = await put(
                http,
                fed,
                "eu",
                "/publish/t3/a",
                b"only NY",
                location=PARIS,
                geofence="circle:40.71,-74.0,100000",
            )
            assert status == 200
            got = await live.event()
            assert got["id"] == here["id"] != away["id"]

    run(main())


def test_an_event_stream_of_a_grpc_clients_id_leaves_its_session_alone(
    fed: LocalFederation,
) -> None:
    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            await geofed.connect(
                client_id="t8",
                location=geofed.LatLon(48.85, 2.35),
                federation=str(fed.federation_path),
            ) as grpc_client,
        ):
            sub = await grpc_client.subscribe("t8/grpc")
            async with stream(http, fed, "eu", "/subscribe/t8/sse", client="t8") as live:
                _, first = await put(http, fed, "eu", "/publish/t8/sse", b"1", location=PARIS)
                assert (await live.event())["id"] == first["id"]
            _, second = await put(http, fed, "eu", "/publish/t8/grpc", b"2", location=PARIS)
            msg = await sub.next(timeout=HANG_S)  # the gRPC session and subscription stayed
            assert msg.event_id == second["id"]

    run(main())


def test_websocket_stream_gets_events_and_its_close_withdraws_the_subscription(
    fed: LocalFederation,
) -> None:
    def held_at_ap() -> float:
        return metric(fed.nodes["ap"].metrics_url, "geofed_subscriptions", scope="local")

    async def main() -> None:
        while held_at_ap():  # earlier tests' streams at ap are gone (a hang fails)
            await asyncio.sleep(0.05)
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(
                url(fed, "ap", "/ws/subscribe/t9/%23"), params={"location": SINGAPORE}
            ) as ws:
                ready = await ws.receive_json()
                assert ready["type"] == "ready" and ready["broker"] == "ap"
                assert held_at_ap() == 1
                await fed.quiescent()
                _, body = await put(http, fed, "eu", "/publish/t9/x", b"ws", location=PARIS)
                got = await ws.receive_json()
                assert got["id"] == body["id"] and got["properties"]["payload"] == "ws"
            # Closed by the client: the stream's subscription is withdrawn (a hang fails).
            while held_at_ap():
                await asyncio.sleep(0.05)
            async with http.get(url(fed, "ap", "/ws/subscribe/t9/%23")) as resp:
                assert resp.status == 400 and (await resp.json())["field"] == "Upgrade"

    run(main())


def test_publisher_and_subscriber_outside_the_area_are_redirected(fed: LocalFederation) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            target = url(fed, "eu", "/geopublish/t4/x")
            async with http.put(
                target, params={"location": NEW_YORK}, data=b"1", allow_redirects=False
            ) as resp:
                assert resp.status == 307
                body = await resp.json()
                assert body["broker_id"] == "us" and body["type"] == "WrongBroker"
                assert resp.headers["Location"] == (
                    f"http://{fed.nodes['us'].http}/geopublish/t4/x?location={NEW_YORK}"
                )
            async with http.put(target, params={"location": NEW_YORK}, data=b"1") as resp:
                assert resp.status == 200  # followed, the body sent again
                assert (await resp.json())["broker"] == "us"
            async with http.get(
                url(fed, "ap", "/subscribe/t4/%23"),
                params={"location": PARIS},
                allow_redirects=False,
            ) as resp:
                assert resp.status == 307
                assert resp.headers["Location"].startswith(
                    f"http://{fed.nodes['eu'].http}/subscribe/"
                )

    run(main())


BAD = [
    ("PUT", "/geopublish/t5/x", {}, "location", 400),
    ("PUT", "/geopublish/t5/x", {"location": "91,0"}, "location", 400),
    ("PUT", "/geopublish/t5/x", {"location": "paris"}, "location", 400),
    ("PUT", "/publish/t5/+", {"location": PARIS}, "topic", 400),
    ("PUT", "/publish/t5/x", {"geofence": "POLYGON((0 0, 1 1))"}, "geofence", 400),
    ("PUT", "/publish/t5/x", {"geofence": "circle:1,2"}, "geofence", 400),
    ("PUT", "/publish/t5/x", {"geofence": "circle:1,2,9000000"}, "geofence", 400),
    ("PUT", "/publish/t5/x", {"locaton": PARIS}, "locaton", 400),
    ("PUT", "/publish/t5/x", {"client": "a\x01b"}, "client", 400),
    ("GET", "/subscribe/t5/%23/x", {}, "filter", 400),
    ("GET", "/subscribe/t5/%23", {"geofence": "LINESTRING(0 0, 1 1)"}, "geofence", 400),
    ("GET", "/subscribe/t5/%23", {"location": "0,200"}, "location", 400),
    ("GET", "/api/route", {}, "geofence", 400),
    ("GET", "/api/route", {"geofence": "POLYGON((0 0, 1 0, 0 1, 1 1, 0 0))"}, "geofence", 400),
    ("GET", "/api/route", {"geofence": EUROPE, "origin": "mars"}, "origin", 400),
    ("GET", "/api/status", {"x": "1"}, "x", 400),
    ("GET", "/publish/t5/%23", {"from": "yesterday"}, "from", 400),
    ("GET", "/publish/t5/%23", {"from": "20", "to": "10"}, "to", 400),
    ("GET", "/publish/t5/%23", {"geometry": "POINT(1 2)"}, "geometry", 400),
    ("GET", "/publish/t5/%23", {"size": "0"}, "size", 400),
    ("GET", "/publish/t5/%23/x", {}, "topic", 400),
    ("DELETE", "/geopublish/t5/%23", {"size": "many"}, "size", 400),
]


@pytest.mark.parametrize(("method", "path", "params", "field", "status"), BAD)
def test_bad_parameters_are_refused_with_json_naming_them(
    fed: LocalFederation, method: str, path: str, params: dict[str, str], field: str, status: int
) -> None:
    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.request(method, url(fed, "eu", path), params=params, data=b"x") as resp,
        ):
            assert resp.status == status, await resp.text()
            body = await resp.json()
            assert body["field"] == field, body
            assert body["type"] == "InvalidInput" and field in body["message"]
        # The node keeps serving.
        async with (
            aiohttp.ClientSession() as http,
            http.get(url(fed, "eu", "/api/status")) as resp,
        ):
            assert resp.status == 200

    run(main())


def test_limits_refuse_large_bodies_and_urls_and_the_node_keeps_serving(
    fed: LocalFederation,
) -> None:
    eu = fed.nodes["eu"].metrics_url

    async def main() -> None:
        rejected = metric(eu, REQUESTS_REJECTED)
        published = metric(eu, EVENTS_PUBLISHED)
        async with aiohttp.ClientSession() as http:
            status, body = await put(http, fed, "eu", "/publish/t6/x", b"x" * (MAX_PAYLOAD + 1))
            assert status == 413
            assert (body["type"], body["field"], body["limit"]) == ("TooLarge", "body", MAX_PAYLOAD)

            async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as read
                for _ in range(MAX_PAYLOAD // 1000 + 1):
                    yield b"y" * 1000

            async with http.put(url(fed, "eu", "/publish/t6/x"), data=chunks()) as resp:
                assert resp.status == 413 and (await resp.json())["field"] == "body"
            padded = EUROPE + " " * MAX_URL  # over the limit (spaces are sent as '+')
            async with http.get(url(fed, "eu", "/api/route"), params={"geofence": padded}) as resp:
                assert resp.status == 400
                assert (await resp.json())["field"] == "query"
            status, body = await put(http, fed, "eu", "/publish/t6/x", b"x" * MAX_PAYLOAD)
            assert status == 200, body
        assert metric(eu, REQUESTS_REJECTED) == rejected + 3
        assert metric(eu, EVENTS_PUBLISHED) == published + 1

    run(main())


def test_route_names_the_brokers_the_routing_core_names(fed: LocalFederation) -> None:
    cache = GeofenceCache()

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            for fence in (
                EUROPE,
                "circle:40.71,-74.0,3000000",
                "POLYGON((0 -60, 179 -60, 179 60, 0 60, 0 -60))",
            ):
                async with http.get(
                    url(fed, "us", "/api/route"), params={"geofence": fence}
                ) as resp:
                    assert resp.status == 200
                    answer = await resp.json()
                parsed = cache.get(
                    {"circle": {"lat": 40.71, "lon": -74.0, "radius_m": 3e6}}
                    if fence.startswith("circle")
                    else fence,
                    "geofence",
                )
                assert answer["origin"] == "us"
                assert answer["brokers"] == sorted(fed.federation.brokers_meeting(parsed))
                assert answer["geofence"] == parsed.wkt

    run(main())


def test_status_shows_every_link_up_and_counts_what_was_sent(fed: LocalFederation) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            await fed.quiescent()
            async with http.get(url(fed, "ap", "/api/federation/status")) as resp:
                assert resp.status == 200
                brokers = (await resp.json())["brokers"]
        assert sorted(brokers) == ["ap", "eu", "us"]
        for bid, status in brokers.items():
            assert status["broker"] == bid
            assert sorted(link["peer"] for link in status["links"]) == sorted(
                {"ap", "eu", "us"} - {bid}
            )
            for link in status["links"]:
                assert link["connected"] is True
                sent = metric(
                    fed.nodes[bid].metrics_url,
                    "geofed_peer_messages_sent_total",
                    peer=link["peer"],
                    kind="subscribe",
                )
                assert link["sent"]["subscribe"] == sent

    run(main())


def test_openapi_document_and_the_map_are_served(fed: LocalFederation) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            async with http.get(url(fed, "eu", "/openapi.json")) as resp:
                doc = await resp.json()
            assert doc["openapi"].startswith("3.") and "/geopublish/{topic}" in doc["paths"]
            async with http.get(url(fed, "eu", "/")) as resp:
                assert resp.status == 200 and "static/map.js" in await resp.text()
            for path in (
                "/static/map.js",
                "/static/vendor/leaflet/leaflet.js",
                "/static/vendor/world-atlas/land-110m.json",
            ):
                async with http.get(url(fed, "eu", path)) as resp:
                    assert resp.status == 200, path
            async with http.get(url(fed, "eu", "/static/../_http.py")) as resp:
                assert resp.status in (403, 404)
            async with http.head(url(fed, "eu", "/subscribe/%23")) as resp:
                assert resp.status == 200  # answered, no subscription held open
                assert resp.headers["Content-Type"].startswith("text/event-stream")

    run(main())


EUROPE_AND_AMERICA = "POLYGON((-130 20, 40 20, 40 72, -130 72, -130 20))"


def test_history_by_time_and_geometry_across_two_regions_and_delete(
    fed: LocalFederation,
) -> None:
    cache = GeofenceCache()

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            published: list[dict[str, Any]] = []
            for broker, where, n in (
                ("eu", PARIS, 1),
                ("us", NEW_YORK, 2),
                ("ap", SINGAPORE, 3),
                ("eu", PARIS, 4),
                ("us", NEW_YORK, 5),
            ):
                status, body = await put(
                    http, fed, broker, f"/geopublish/h1/{broker}/n", str(n).encode(), location=where
                )
                assert status == 200, body
                published.append(body)
            ids = [p["id"] for p in published]

            async def history(method: str, **params: str) -> dict[str, Any]:
                async with http.request(
                    method, url(fed, "ap", "/publish/h1/%23"), params=params
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    answer: dict[str, Any] = await resp.json()
                    return answer

            everything = await history("GET")
            assert [f["id"] for f in everything["features"]] == ids[::-1]  # newest first
            assert everything["brokers"] == ["ap", "eu", "us"]

            two_regions = await history("GET", geometry=EUROPE_AND_AMERICA)
            assert [f["id"] for f in two_regions["features"]] == [ids[4], ids[3], ids[1], ids[0]]
            meeting = fed.federation.brokers_meeting(cache.get(EUROPE_AND_AMERICA, "geometry"))
            assert two_regions["brokers"] == sorted(meeting) and "ap" not in meeting
            first = two_regions["features"][-1]
            assert first["geometry"]["coordinates"] == [2.35, 48.85]
            assert first["properties"]["payload"] == "1"
            assert first["properties"]["origin"] == "eu"

            window = await history(
                "GET",
                geometry=EUROPE_AND_AMERICA,
                **{"from": str(published[1]["time"]), "to": str(published[3]["time"])},
            )
            assert [f["id"] for f in window["features"]] == [ids[3], ids[1]]
            latest = await history("GET", size="1")
            assert [f["id"] for f in latest["features"]] == [ids[4]]

            removed = await history(
                "DELETE", geometry=EUROPE_AND_AMERICA, **{"to": str(published[1]["time"])}
            )
            assert [f["id"] for f in removed["features"]] == [ids[1], ids[0]]
            after = await history("GET")
            assert [f["id"] for f in after["features"]] == [ids[4], ids[3], ids[2]]
            again = await history(
                "DELETE", geometry=EUROPE_AND_AMERICA, **{"to": str(published[1]["time"])}
            )
            assert again["features"] == []

    run(main())


def test_history_size_over_the_limit_is_too_large(fed: LocalFederation) -> None:
    async def main() -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.get(url(fed, "eu", "/geopublish/h2/%23"), params={"size": "10001"}) as resp,
        ):
            assert resp.status == 413
            body = await resp.json()
            assert (body["type"], body["field"], body["limit"]) == ("TooLarge", "size", 10_000)

    run(main())


POLICY = """
[identities.alice]
publish = ["sensors/%u/+"]
subscribe = ["sensors/#"]
"""


def test_tls_client_certificates_and_the_policy_hold_over_http(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY, encoding="utf-8")
    with LocalFederation(
        THREE,
        "event-geofence",
        tmp_path / "fed",
        tls=True,
        client_auth="cert",
        extra_env={"GEOFED_POLICY_FILE": str(policy)},
    ) as tls_fed:
        alice = tls_fed.client_tls("alice")
        anonymous = tls_fed.client_tls()
        assert alice is not None and anonymous is not None

        def context(tls: Any) -> ssl.SSLContext:
            ctx = ssl.create_default_context(cafile=tls.ca_file)
            if tls.cert_file:
                ctx.load_cert_chain(tls.cert_file, tls.key_file)
            return ctx

        def https(broker: str, path: str) -> str:
            return f"https://{tls_fed.nodes[broker].http}{path}"

        async def main() -> None:
            async with aiohttp.ClientSession() as http:
                with pytest.raises(aiohttp.ClientError):  # no client certificate: no handshake
                    async with http.get(https("eu", "/api/status"), ssl=context(anonymous)):
                        pass
                with pytest.raises(aiohttp.ClientError):  # plaintext on the TLS port
                    async with http.get(f"http://{tls_fed.nodes['eu'].http}/api/status"):
                        pass
                # eu logs and counts both refusals (its own handshake: asyncio's is silent;
                # aiohttp tries a dropped request twice, so each may count twice).
                eu = tls_fed.nodes["eu"]
                for reason in ("no_certificate", "plaintext"):
                    labels = {"listener": "http", "reason": reason}
                    await until(
                        lambda labels=labels: metric(eu.metrics_url, TLS_REFUSED, **labels) >= 1,
                        f"http {reason} refusal counted",
                        HANG_S,
                        scrapes=True,
                    )
                    assert f"TLS handshake failed ({reason})" in eu.log_path.read_text()
                ctx = context(alice)
                async with http.put(
                    https("eu", "/geopublish/sensors/alice/temp"),
                    params={"location": PARIS},
                    data=b"20",
                    ssl=ctx,
                ) as resp:
                    assert resp.status == 200, await resp.text()
                async with http.put(
                    https("eu", "/geopublish/sensors/bob/temp"),
                    params={"location": PARIS},
                    data=b"20",
                    ssl=ctx,
                ) as resp:
                    assert resp.status == 403
                    assert (await resp.json())["rule"] == "publish"
                async with http.put(
                    https("eu", "/geopublish/sensors/alice/temp"),
                    params={"location": NEW_YORK},
                    data=b"20",
                    ssl=ctx,
                    allow_redirects=False,
                ) as resp:
                    assert resp.status == 307
                    assert resp.headers["Location"].startswith(
                        f"https://{tls_fed.nodes['us'].http}/"
                    )
                async with http.get(https("ap", "/publish/sensors/%23"), ssl=ctx) as resp:
                    assert resp.status == 200
                    features = (await resp.json())["features"]
                    assert [f["properties"]["topic"] for f in features] == ["sensors/alice/temp"]
                async with http.get(https("ap", "/publish/secrets/%23"), ssl=ctx) as resp:
                    assert resp.status == 403  # reading needs subscribe permission
                async with http.get(https("us", "/api/federation/status"), ssl=ctx) as resp:
                    brokers = (await resp.json())["brokers"]
                    assert all("error" not in s for s in brokers.values()), brokers
                    assert all(link["connected"] for s in brokers.values() for link in s["links"])

        run(main())


def test_bearer_tokens_authenticate_http_clients(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / "token.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )

    def token(sub: str, signer: ec.EllipticCurvePrivateKey = key) -> str:
        claims = {"sub": sub, "exp": int(time.time() + 600), "iat": int(time.time()) - 1}
        return jwt.encode(claims, signer, algorithm="ES256")

    with LocalFederation(
        THREE,
        "event-geofence",
        tmp_path / "fed",
        tls=True,
        client_auth="token",
        extra_env={"GEOFED_TOKEN_KEY": str(public), "GEOFED_STRATEGY_ADMINS": "ops"},
    ) as tls_fed:
        tls = tls_fed.client_tls()
        assert tls is not None
        ctx = ssl.create_default_context(cafile=tls.ca_file)
        eu = tls_fed.nodes["eu"].http

        forger = ec.generate_private_key(ec.SECP256R1())

        async def main() -> None:
            async with aiohttp.ClientSession() as http:
                for headers in (
                    {},
                    {"Authorization": f"Bearer {token('carol', forger)}"},
                    {"Authorization": "Basic Y2Fyb2w6eA=="},
                ):
                    async with http.put(
                        f"https://{eu}/publish/t7/x", data=b"1", headers=headers, ssl=ctx
                    ) as resp:
                        assert resp.status == 401, await resp.text()
                        assert resp.headers["WWW-Authenticate"] == "Bearer"
                        assert (await resp.json())["type"] == "Unauthenticated"
                carol = {"Authorization": f"Bearer {token('carol')}"}
                async with http.get(
                    f"https://{eu}/subscribe/t7/%23", headers=carol, ssl=ctx
                ) as resp:
                    assert resp.status == 200
                    live = EventStream(resp)
                    assert (await live.next())[0] == "ready"
                    async with http.put(
                        f"https://{eu}/publish/t7/x", data=b"1", headers=carol, ssl=ctx
                    ) as published:
                        assert published.status == 200
                        event_id = (await published.json())["id"]
                    assert (await live.event())["id"] == event_id
                    # The client goes away: an SSL stream closed politely would finish its
                    # shutdown after this event loop ends (an unclosed-transport warning).
                    assert resp.connection is not None and resp.connection.transport is not None
                    resp.connection.transport.abort()
                # A browser's EventSource cannot send the header: the token in the URL.
                raw = token("carol")
                async with http.get(
                    f"https://{eu}/subscribe/t7/%23", params={"access_token": raw}, ssl=ctx
                ) as resp:
                    assert resp.status == 200
                    live = EventStream(resp)
                    assert (await live.next())[0] == "ready"
                    assert resp.connection is not None and resp.connection.transport is not None
                    resp.connection.transport.abort()
                for params, headers, status, field in (
                    ({"access_token": token("carol", forger)}, {}, 401, None),
                    ({"access_token": raw}, carol, 400, "access_token"),
                    ([("access_token", raw), ("access_token", raw)], {}, 400, "access_token"),
                ):
                    async with http.get(
                        f"https://{eu}/publish/t7/%23", params=params, headers=headers, ssl=ctx
                    ) as resp:
                        assert resp.status == status, await resp.text()
                        assert (await resp.json()).get("field") == field
                # Only strategy_admins change the strategy table.
                change = f"https://{eu}/api/strategy/t7%2F%23"
                for who, status in (("carol", 403), ("ops", 200)):
                    headers = {"Authorization": f"Bearer {token(who)}"}
                    async with http.put(
                        change, params={"strategy": "flooding-events"}, headers=headers, ssl=ctx
                    ) as resp:
                        assert resp.status == status, await resp.text()
                async with http.get(f"https://{eu}/api/strategy", ssl=ctx) as resp:
                    assert resp.status == 401

        run(main())


def test_the_strategy_table_is_read_and_changed_over_http(fed: LocalFederation) -> None:
    """PUT /api/strategy/{filter} at one broker changes the table of every broker (GET
    /api/strategy at another shows it in force); DELETE removes the entry; bad input is
    refused naming the parameter."""

    async def state(http: aiohttp.ClientSession, broker: str) -> dict[str, Any]:
        async with http.get(url(fed, broker, "/api/strategy")) as resp:
            assert resp.status == 200
            answer: dict[str, Any] = await resp.json()
            return answer

    async def in_force(http: aiohttp.ClientSession, broker: str, entries: list[Any]) -> None:
        deadline = time.monotonic() + HANG_S
        while (now := await state(http, broker))["in_transition"] or now["table"][
            "entries"
        ] != entries:
            assert time.monotonic() < deadline, now
            await asyncio.sleep(0.02)

    async def main() -> None:
        async with aiohttp.ClientSession() as http:
            before = await state(http, "ap")
            assert before["table"]["default"] == "subscription-geofence"
            entry = {"topic_filter": "strat/#", "strategy": "flooding-events", "adaptive": False}
            path = url(fed, "us", "/api/strategy/strat%2F%23")
            async with http.put(path, params={"strategy": "flooding-events"}) as resp:
                assert resp.status == 200, await resp.text()
                assert entry in (await resp.json())["newest"]["entries"]
            await in_force(http, "ap", [*before["table"]["entries"], entry])
            for params, field in (({"strategy": "nope"}, "strategy"), ({}, "strategy")):
                async with http.put(path, params=params) as resp:
                    assert resp.status == 400 and (await resp.json())["field"] == field
            async with http.put(
                url(fed, "us", "/api/strategy/a%2F%23%2Fb"), params={"strategy": "event-geofence"}
            ) as resp:
                assert resp.status == 400 and (await resp.json())["field"] == "filter"
            async with http.delete(path) as resp:
                assert resp.status == 200, await resp.text()
            await in_force(http, "eu", before["table"]["entries"])

    run(main())
