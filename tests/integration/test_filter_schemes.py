"""Filter schemes at the broker, switched by load on a live federation (docs/design.md §14).

Three brokers; the eu broker switches to RGRID from 4 local subscriptions and
to GRID from 8 (back below nine tenths). Subscribers near Paris subscribe and
unsubscribe through the paper's sequence T1-T4 (EXACT -> RGRID -> GRID ->
RGRID -> EXACT); after each step events are published around Paris and every
subscription's deliveries are read up to a marker event that all of them
match (it lies in every geofence, so EXACT and RGRID must deliver it), then
held against the exact predicate: equal under EXACT, a superset (recall 1)
flagged ``rgrid`` under RGRID, also after the GRID -> RGRID transition whose
missing state the broker bootstraps from its own copy of the subscriptions.
The broker's recall and precision counters must agree with what arrived.
"""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import aiohttp
import pytest
from paho.mqtt.packettypes import PacketTypes
from test_http import stream
from test_mqtt import Paho, user

import geofed
from geofed.bench import LocalFederation
from geofed.bench.scrape import metric
from geofed.node import (
    FILTER_AUDITED_DELIVERED,
    FILTER_AUDITED_MATCHES,
    FILTER_BOOTSTRAPPED,
    FILTER_FALSE_DELIVERIES,
    FILTER_SCHEME,
    FILTER_TRANSITIONS,
)
from geofed.routing import Event, LatLon, Subscription, make_subscription, matches

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = LatLon(48.85, 2.35)
TIMEOUT = 120.0
ENV = {
    "GEOFED_FILTER_SCHEME_RGRID_AT": "4",
    "GEOFED_FILTER_SCHEME_GRID_AT": "8",
    "GEOFED_FILTER_SCHEME_AUDIT_EVERY": "1",
}


def offset(p: LatLon, east_km: float, north_km: float) -> LatLon:
    lat = p.lat + north_km / 111.195
    return LatLon(lat, p.lon + east_km / (111.195 * math.cos(math.radians(p.lat))))


class Subscriber:
    """One client near Paris with one subscription, and the exact predicate for it."""

    def __init__(self, i: int, fed: LocalFederation) -> None:
        rng = random.Random(i)
        self.i = i
        self.where = offset(PARIS, rng.uniform(-8, 8), rng.uniform(-8, 8))
        self.fed = fed
        if i == 0:
            self.fence: object = None  # a world subscription
        elif i == 1:
            self.fence = "roam:circle:30000"  # around the subscriber, 30 km
        else:  # circles of 20-40 km within 10 km of Paris: all hold Paris itself
            c = offset(PARIS, rng.uniform(-7, 7), rng.uniform(-7, 7))
            radius = rng.uniform(20_000, 40_000)
            self.fence = {"circle": {"lat": c.lat, "lon": c.lon, "radius_m": radius}}
        core = make_subscription(f"s{i}", f"sub-{i}", "fs/#", self.fence)
        self.core: Subscription = core.placed(self.where)

    async def start(self) -> None:
        self.client = await geofed.connect(
            client_id=f"sub-{self.i}", location=self.where, federation=self.fed.federation_path
        )
        assert self.client.broker_id == "eu"
        self.sub = await self.client.subscribe(
            "fs/#", geofence=self.fence, subscription_id=f"s{self.i}"
        )

    async def until(self, marker: str) -> list[geofed.Message]:
        """Deliveries up to and including `marker` (a stream keeps the publish order)."""
        got: list[geofed.Message] = []
        while True:
            msg = await self.sub.next(timeout=TIMEOUT)
            got.append(msg)
            if msg.event_id == marker:
                return got

    def exact(self, event: Event) -> bool:
        return matches(event, self.core, self.where)


async def publish_round(
    pub: geofed.Client, name: str, rng: random.Random
) -> tuple[list[Event], str]:
    """Events scattered up to 60 km around Paris, then the marker at Paris itself."""
    events: list[Event] = []
    for j in range(40):
        at = offset(PARIS, rng.uniform(-60, 60), rng.uniform(-60, 60))
        await pub.move(at)
        eid = await pub.publish("fs/x", b"", event_id=f"{name}-{j}")
        events.append(Event(eid, "fs/x", at))
    await pub.move(PARIS)
    marker = await pub.publish("fs/x", b"", event_id=f"{name}-marker")
    events.append(Event(marker, "fs/x", PARIS))
    return events, marker


def eu_metric(fed: LocalFederation, name: str, **labels: str) -> float:
    return metric(fed.metrics_urls()["eu"], name, **labels)


def scheme(fed: LocalFederation) -> str:
    for s in ("exact", "grid", "rgrid"):
        if eu_metric(fed, FILTER_SCHEME, scheme=s) == 1:
            return s
    raise AssertionError("no scheme is active")


async def check_round(
    fed: LocalFederation,
    pub: geofed.Client,
    subs: list[Subscriber],
    name: str,
    want: str,
    skip: set[str],
) -> None:
    """A round under scheme `want`: EXACT delivers exactly, RGRID a flagged superset."""
    assert scheme(fed) == want
    audited = (eu_metric(fed, FILTER_AUDITED_MATCHES), eu_metric(fed, FILTER_AUDITED_DELIVERED))
    false_before = eu_metric(fed, FILTER_FALSE_DELIVERIES)
    events, marker = await publish_round(pub, name, random.Random(name))
    false_seen = 0
    for s in subs:
        read = await s.until(marker)
        # Deliveries of an earlier GRID round still in the stream: each says so.
        assert {m.filter_scheme for m in read if m.event_id in skip} <= {"grid"}
        got = [m for m in read if m.event_id not in skip]
        ids = [m.event_id for m in got]
        assert len(ids) == len(set(ids)), "a duplicate delivery"
        exact = {e.id for e in events if s.exact(e)}
        assert marker in exact
        if want == "exact":
            assert set(ids) == exact
            assert {m.filter_scheme for m in got} == {""}
        else:
            assert exact <= set(ids), f"s{s.i} missed {sorted(exact - set(ids))}"
            assert {m.filter_scheme for m in got} == {want}
            false_seen += len(set(ids) - exact)
    await fed.quiescent()
    # The broker's own counters: recall 1 on every audited event, and the
    # deliveries the exact predicate denies are those the clients saw.
    matches_now = eu_metric(fed, FILTER_AUDITED_MATCHES)
    delivered_now = eu_metric(fed, FILTER_AUDITED_DELIVERED)
    if want != "exact":
        assert matches_now - audited[0] > 0
        assert matches_now - audited[0] == delivered_now - audited[1]
        assert eu_metric(fed, FILTER_FALSE_DELIVERIES) - false_before == false_seen


def test_load_triggered_transitions_keep_recall(tmp_path: Path) -> None:
    async def run(fed: LocalFederation) -> None:
        subs = [Subscriber(i, fed) for i in range(8)]
        pub = await geofed.connect(
            client_id="fs-pub", location=PARIS, federation=fed.federation_path
        )
        for s in subs[:3]:
            await s.start()
        await check_round(fed, pub, subs[:3], "a", "exact", set())
        await subs[3].start()  # 4 local subscriptions: T1, EXACT -> RGRID
        await check_round(fed, pub, subs[:4], "b", "rgrid", set())
        assert eu_metric(fed, FILTER_FALSE_DELIVERIES) > 0  # RGRID's precision is below 1
        for s in subs[4:]:
            await s.start()  # 8: T2, RGRID -> GRID
        assert scheme(fed) == "grid"
        grid_events, grid_marker = await publish_round(pub, "c", random.Random("c"))
        await fed.quiescent()
        skip = {e.id for e in grid_events}
        await subs[7].sub.unsubscribe()  # 7 < 0.9 x 8: T3, GRID -> RGRID
        await check_round(fed, pub, subs[:7], "d", "rgrid", skip | {grid_marker})
        assert eu_metric(fed, FILTER_BOOTSTRAPPED) > 0  # the covers came from the broker
        for s in subs[3:7]:
            await s.sub.unsubscribe()  # 3: T4, RGRID -> EXACT
        await check_round(fed, pub, subs[:3], "e", "exact", set())
        for source, target in (("exact", "rgrid"), ("rgrid", "grid"), ("grid", "rgrid")):
            assert eu_metric(fed, FILTER_TRANSITIONS, source=source, target=target) == 1
        assert eu_metric(fed, FILTER_TRANSITIONS, source="rgrid", target="exact") == 1
        for s in subs:
            await s.client.close()
        await pub.close()

    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=ENV, mqtt=False) as fed:
        asyncio.run(run(fed))


def test_mqtt_and_http_deliveries_say_when_an_approximate_scheme_matched(
    tmp_path: Path,
) -> None:
    """Every broker under RGRID: an MQTT 5 subscriber and an HTTP event stream near Paris,
    each with a 20 km subscription geofence, get an event published in Paris flagged
    ``rgrid`` (user property ``geofed-filter-scheme``, feature property ``filter_scheme``)."""
    fence = f"circle:{PARIS.lat},{PARIS.lon},20000"
    env = {"GEOFED_FILTER_SCHEME": "rgrid"}
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env) as fed:
        mqtt = Paho("fs-mqtt")
        props = user(PacketTypes.CONNECT, geofed_location=f"{PARIS.lat},{PARIS.lon}")
        assert mqtt.connect(fed.nodes["eu"].mqtt, props) == 0
        sub = user(PacketTypes.SUBSCRIBE, geofed_geofence=fence)
        assert mqtt.subscribe("fsq/#", 1, sub) == [1]

        async def run() -> dict[str, object]:
            async with (
                aiohttp.ClientSession() as http,
                stream(
                    http,
                    fed,
                    "eu",
                    "/subscribe/fsq/%23",
                    location=f"{PARIS.lat},{PARIS.lon}",
                    geofence=fence,
                ) as live,  # fmt: skip
                await geofed.connect(
                    client_id="fs-pub", location=PARIS, federation=fed.federation_path
                ) as pub,
            ):
                event_id = await pub.publish("fsq/x", b"here")
                feature = await live.event()
                assert feature["id"] == event_id
                return dict(feature["properties"])

        properties = asyncio.run(asyncio.wait_for(run(), TIMEOUT))
        assert properties["filter_scheme"] == "rgrid"
        mqtt.receive(1)
        (msg,) = mqtt.messages
        assert ("geofed-filter-scheme", "rgrid") in msg.properties.UserProperty
        mqtt.close()
