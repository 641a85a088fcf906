"""Message history on a live 3-broker federation: queries by time and area across regions.

Events are published in every region (eu, us, ap); a client at eu reads the
federation's history through its broker. Every answer is held against an
independent oracle over what was published, and the brokers asked — read from
the entry broker's `geofed_history_brokers_asked_total` — against the cost
model's `history_targets`, for hypothesis-chosen query areas.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from shapely.geometry import Point, box
from shapely.geometry.base import BaseGeometry

import geofed
from geofed.bench import LocalFederation
from geofed.bench.scrape import scrape
from geofed.node import HISTORY_BROKERS_ASKED
from geofed.routing import (
    HistoryQuery,
    HistoryRecord,
    history_targets,
    parse_geofence,
    reference_topic_match,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"
TIMEOUT = 120.0
GEOFED = [sys.executable, "-m", "geofed.cli"]

# (client, location, topics) per region: two publishers in each.
PUBLISHERS = {
    "eu": [("paris", (48.85, 2.35)), ("berlin", (52.52, 13.40))],
    "us": [("nyc", (40.71, -74.0)), ("chicago", (41.88, -87.63))],
    "ap": [("singapore", (1.29, 103.85)), ("tokyo", (35.68, 139.77))],
}
TOPICS = ["sensors/temp", "sensors/wind", "alerts/road"]
READER = geofed.LatLon(50.11, 8.68)  # Frankfurt: the queries enter at eu


class Seeded:
    """The running federation and everything published into it (as the history logged it)."""

    def __init__(self, fed: LocalFederation, records: list[HistoryRecord]) -> None:
        self.fed = fed
        self.records = records

    @property
    def eu_metrics(self) -> str:
        return self.fed.nodes["eu"].metrics_url


async def _publish_all(where: str) -> list[HistoryRecord]:
    ids: set[str] = set()
    for region, pubs in PUBLISHERS.items():
        for name, (lat, lon) in pubs:
            async with await geofed.connect(
                client_id=f"{region}-{name}", location=geofed.LatLon(lat, lon), federation=where
            ) as client:
                for i, topic in enumerate(TOPICS):
                    fence = "circle:48.85,2.35,500000" if i == 2 else None
                    ids.add(
                        await client.publish(topic, f"{name} {i}".encode(), geofence=_fence(fence))
                    )
    async with await geofed.connect(client_id="reader", location=READER, federation=where) as r:
        everything = await r.history("#", limit=1000)
    assert {rec.event_id for rec in everything} == ids
    return list(everything)


def _fence(text: str | None) -> geofed.wire.GeofenceInput:
    return None if text is None else geofed.wire.geofence_from_text(text, "geofence")


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seeded]:
    fed = LocalFederation(THREE, "event-geofence", tmp_path_factory.mktemp("history"))
    with fed:
        records = asyncio.run(_publish_all(str(fed.federation_path)))
        yield Seeded(fed, records)


def oracle(records: list[HistoryRecord], q: HistoryQuery) -> list[str]:
    """Written apart from the store: reference topic matcher, shapely covers, a sort."""
    hits = [
        r
        for r in records
        if reference_topic_match(q.topic_filter, r.topic)
        and (q.start is None or r.published_at >= q.start)
        and (q.end is None or r.published_at <= q.end)
        and (q.geometry is None or q.geometry.covers(Point(r.location.lon, r.location.lat)))
    ]
    hits.sort(key=lambda r: (r.published_at, r.event_id), reverse=True)
    return [r.event_id for r in hits[: q.limit]]


def asked(url: str) -> dict[str, float]:
    return {
        dict(labels)["broker"]: value
        for (name, labels), value in scrape(url).items()
        if name == HISTORY_BROKERS_ASKED
    }


async def read(where: str, q: HistoryQuery, *, delete: bool = False) -> geofed.HistoryAnswer:
    async with await geofed.connect(
        client_id="reader", location=READER, federation=where
    ) as client:
        call = client.delete_history if delete else client.history
        return await asyncio.wait_for(
            call(
                q.topic_filter,
                start=q.start,
                end=q.end,
                geometry=None if q.geometry is None else q.geometry.wkt,
                limit=q.limit,
            ),
            TIMEOUT,
        )


def check_query(seeded: Seeded, q: HistoryQuery) -> geofed.HistoryAnswer:
    """Run `q` at eu: the answer equals the oracle's, the brokers asked the model's.

    The area travels as WKT and the broker reads it as any geofence (docs/design.md §1:
    an edge over 180° of longitude crosses the antimeridian), so the oracle and the
    model take the area as parsed.
    """
    if q.geometry is not None:
        area = parse_geofence(q.geometry.wkt, "geometry").geometry
        q = HistoryQuery(q.topic_filter, q.start, q.end, area, q.limit)
    before = asked(seeded.eu_metrics)
    answer = asyncio.run(read(str(seeded.fed.federation_path), q))
    after = asked(seeded.eu_metrics)
    delta = {b: after.get(b, 0.0) - before.get(b, 0.0) for b in after}
    model = history_targets(seeded.fed.federation, q)
    assert {b for b, n in delta.items() if n} == model
    assert all(n in (0.0, 1.0) for n in delta.values())
    assert answer.brokers == model
    assert [r.event_id for r in answer] == oracle(seeded.records, q)
    return answer


def test_history_by_time_and_area_across_regions(seeded: Seeded) -> None:
    times = sorted(r.published_at for r in seeded.records)
    # The Atlantic: Europe and North America, not Asia.
    atlantic = box(-100.0, 30.0, 20.0, 60.0)
    q = HistoryQuery("sensors/+", times[2], times[-3], atlantic, 100)
    answer = check_query(seeded, q)
    assert {r.origin for r in answer} == {"eu", "us"}
    assert history_targets(seeded.fed.federation, q) == {"eu", "us"}
    # A small area inside one region asks that broker alone.
    paris = box(2.0, 48.5, 2.5, 49.0)
    only = check_query(seeded, HistoryQuery("#", None, None, paris, 100))
    assert only.brokers == {"eu"} and {r.payload for r in only} == {
        b"paris 0",
        b"paris 1",
        b"paris 2",
    }
    # limit=1: the latest event.
    latest = check_query(seeded, HistoryQuery("#", None, None, None, 1))
    assert latest[0].published_at == times[-1]
    # The event geofence and the payload come back as published.
    fenced = check_query(seeded, HistoryQuery("alerts/road", None, None, None, 100))
    assert len(fenced) == 6 and all(r.geofence is not None for r in fenced)
    feature = fenced[0].to_geojson_feature()
    assert feature["properties"]["geofence"]["type"] == "Polygon"


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: live queries are slow
)
@given(
    x=st.floats(-180.0, 170.0),
    y=st.floats(-80.0, 70.0),
    w=st.floats(0.5, 200.0),
    h=st.floats(0.5, 90.0),
    topic_filter=st.sampled_from(["#", "sensors/#", "+/road", "sensors/wind"]),
    limit=st.integers(1, 20),
)
@example(x=-1.0, y=0.0, w=181.0, h=34.0, topic_filter="#", limit=1)  # read as crossing ±180
def test_brokers_asked_are_the_cost_models(
    seeded: Seeded, x: float, y: float, w: float, h: float, topic_filter: str, limit: int
) -> None:
    area: BaseGeometry = box(x, y, min(x + w, 180.0), min(y + h, 90.0))
    check_query(seeded, HistoryQuery(topic_filter, None, None, area, limit))


def test_delete_returns_what_it_removed_and_they_are_gone(seeded: Seeded) -> None:
    where = str(seeded.fed.federation_path)

    async def publish() -> set[str]:
        ids = set()
        for client_id, loc in (("del-eu", (48.85, 2.35)), ("del-us", (40.71, -74.0))):
            async with await geofed.connect(
                client_id=client_id, location=geofed.LatLon(*loc), federation=where
            ) as c:
                for i in range(3):
                    ids.add(await c.publish(f"trash/{i}", b"x"))
        return ids

    published = asyncio.run(publish())
    america = box(-130.0, 20.0, -60.0, 55.0)
    q = HistoryQuery("trash/#", None, None, america, 100)
    before = asked(seeded.eu_metrics)
    gone = asyncio.run(read(where, q, delete=True))
    after = asked(seeded.eu_metrics)
    assert {b for b in after if after[b] != before.get(b, 0.0)} == {"us"}
    assert len(gone) == 3 and {r.origin for r in gone} == {"us"}
    assert {r.event_id for r in gone} < published
    left = asyncio.run(read(where, HistoryQuery("trash/#", None, None, None, 100)))
    assert {r.event_id for r in left} == published - {r.event_id for r in gone}
    assert asyncio.run(read(where, q, delete=True)) == []
    # The rest goes too, newest first, `limit` at a time.
    first = asyncio.run(read(where, HistoryQuery("trash/#", None, None, None, 2), delete=True))
    assert [r.event_id for r in first] == [r.event_id for r in left][:2]
    rest = asyncio.run(read(where, HistoryQuery("trash/#", None, None, None, 100), delete=True))
    assert len(rest) == 1
    assert asyncio.run(read(where, HistoryQuery("trash/#", None, None, None, 100))) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"topic_filter": "a/#/b"}, geofed.InvalidInput, "topic_filter"),
        ({"limit": 0}, geofed.InvalidInput, "limit"),
        ({"limit": 1_000_000}, geofed.TooLarge, "limit"),
        ({"start": 10.0, "end": 5.0}, geofed.InvalidInput, "end"),
        ({"start": float("inf")}, geofed.InvalidInput, "start"),
        ({"geometry": "POLYGON((0 0, 1 1, 0 1, 1 0, 0 0))"}, geofed.InvalidInput, "geometry.wkt"),
        ({"geometry": "POINT(1 2"}, geofed.InvalidInput, "geometry.wkt"),
        (
            {"geometry": {"circle": {"lat": 0, "lon": 0, "radius_m": -1}}},
            geofed.InvalidInput,
            "geometry.circle.radius_m",
        ),
    ],
)
def test_bad_queries_name_the_field(
    seeded: Seeded, kwargs: dict[str, object], error: type[Exception], field: str
) -> None:
    where = str(seeded.fed.federation_path)
    args = {"topic_filter": "#", **kwargs}

    async def run() -> None:
        async with await geofed.connect(
            client_id="reader", location=READER, federation=where
        ) as client:
            topic_filter = args.pop("topic_filter")
            await client.history(topic_filter, **args)  # type: ignore[arg-type]

    with pytest.raises(error) as err:
        asyncio.run(run())
    assert getattr(err.value, "field", None) == field, err.value
    # The broker keeps serving.
    assert check_query(seeded, HistoryQuery("#", None, None, None, 1))


def test_history_command_prints_geojson(seeded: Seeded) -> None:
    fed_file = str(seeded.fed.federation_path)
    common = ["--federation", fed_file, "--client", "cli", "--location", "50.1,8.7"]
    america = "POLYGON((-130 20, -60 20, -60 55, -130 55, -130 20))"
    start = min(r.published_at for r in seeded.records)
    iso = dt.datetime.fromtimestamp(start - 1, dt.UTC).isoformat()
    out = subprocess.run(
        [
            *GEOFED,
            "history",
            *common,
            "--topic",
            "sensors/#",
            "--geometry",
            america,
            "--from",
            iso,
            "--limit",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    collection = json.loads(out.stdout)
    q = HistoryQuery("sensors/#", start - 1, None, box(-130, 20, -60, 55), 3)
    assert [f["id"] for f in collection["features"]] == oracle(seeded.records, q)
    assert {f["properties"]["origin"] for f in collection["features"]} == {"us"}
    assert "brokers asked: us" in out.stderr
    bad = subprocess.run(
        [*GEOFED, "history", *common, "--topic", "#", "--from", "yesterday"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert bad.returncode == 2 and "from" in bad.stderr, bad.stderr


def test_mqtt_publishes_are_logged_and_history_survives_a_restart(tmp_path: Path) -> None:
    """An MQTT publish (mosquitto_pub, 3.1.1) is logged like a gRPC one; with a data_dir
    the history is a file that a restarted broker reads again."""
    with LocalFederation(THREE, "event-geofence", tmp_path, durable=True) as fed:
        where = str(fed.federation_path)
        port = fed.nodes["eu"].mqtt.rsplit(":", 1)[1]
        out = subprocess.run(
            [
                "mosquitto_pub",
                "-p",
                port,
                "-V",
                "mqttv311",
                "-q",
                "1",
                "-i",
                "mqtt-pub",
                "-t",
                "$geofed/loc=48.85,2.35/sensors/fr/mqtt",
                "-m",
                "via mqtt",
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        q = HistoryQuery("sensors/#", None, None, box(2.0, 48.0, 3.0, 49.0), 10)
        (logged,) = asyncio.run(read(where, q))
        assert (logged.topic, logged.payload, logged.origin) == (
            "sensors/fr/mqtt",
            b"via mqtt",
            "eu",
        )
        assert (logged.location.lat, logged.location.lon) == (48.85, 2.35)
        fed.stop_node("eu")
        fed.start_node("eu")
        fed.wait_ready(TIMEOUT)
        (again,) = asyncio.run(read(where, q))
        assert again == logged


def test_a_federation_on_postgis_answers_alike(tmp_path: Path, postgres_dsn: str) -> None:
    """Every broker keeps its history in one PostgreSQL/PostGIS database (history_dsn):
    the answers and the brokers asked are the same as with SQLite."""
    env = {"GEOFED_HISTORY_DSN": postgres_dsn}
    with LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env) as fed:
        records = asyncio.run(_publish_all(str(fed.federation_path)))
        seeded = Seeded(fed, records)
        times = sorted(r.published_at for r in records)
        check_query(
            seeded, HistoryQuery("sensors/+", times[2], times[-3], box(-100, 30, 20, 60), 100)
        )
        check_query(seeded, HistoryQuery("#", None, None, box(100, -10, 150, 40), 4))
        gone = asyncio.run(
            read(
                str(fed.federation_path),
                HistoryQuery("alerts/#", None, None, None, 100),
                delete=True,
            )
        )
        assert len(gone) == 6 and {r.origin for r in gone} == {"eu", "us", "ap"}
        left = asyncio.run(read(str(fed.federation_path), HistoryQuery("#", None, None, None, 100)))
        assert {r.event_id for r in left} == {r.event_id for r in records} - {
            r.event_id for r in gone
        }
