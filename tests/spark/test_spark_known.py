"""Known answers, worked out by hand: the 3-broker federation and the 21-region Europe example."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual
from spark_helpers import AWS, THREE, run, write_jsonl

pytestmark = pytest.mark.spark

FRANKFURT, ASHBURN, SINGAPORE, PARIS = (50.11, 8.68), (39.04, -77.49), (1.29, 103.85), (48.85, 2.35)
CENTRAL_EUROPE = "POLYGON((0 44, 20 44, 20 56, 0 56, 0 44))"  # meets eu only
AROUND_FRANKFURT = "POLYGON((8 49.5, 9.5 49.5, 9.5 50.5, 8 50.5, 8 49.5))"
AROUND_SINGAPORE = "POLYGON((103 1, 104.5 1, 104.5 2, 103 2, 103 1))"  # meets ap only


def op(
    t: float, kind: str, client: str, where: tuple[float, float] | None = None, **kw: Any
) -> dict[str, Any]:
    rec: dict[str, Any] = {"t": t, "op": kind, "client": client}
    if where is not None:
        rec.update(lat=where[0], lon=where[1])
    rec.update(kw)
    return rec


THREE_TRACE = [
    # s1: eu, Central Europe only; s2: us, the whole world.
    op(0, "subscribe", "c1", FRANKFURT, id="s1", topic="sensors/#", geofence=CENTRAL_EUROPE),
    op(0, "subscribe", "c2", ASHBURN, id="s2", topic="sensors/+", geofence=None),
    # e1 (ap, world): s2 matches (s1's geofence excludes Singapore).
    op(1, "publish", "c3", SINGAPORE, id="e1", topic="sensors/x", geofence=None, payload_size=100),
    # e2 (ap, Singapore only): s2 passes at ap, but Ashburn is outside.
    op(
        2,
        "publish",
        "c3",
        SINGAPORE,
        id="e2",
        topic="sensors/x",
        geofence=AROUND_SINGAPORE,
        payload_size=50,
    ),
    # e3 (eu, Frankfurt only): s1 matches locally; Ashburn is outside.
    op(
        3,
        "publish",
        "c4",
        PARIS,
        id="e3",
        topic="sensors/y",
        geofence=AROUND_FRANKFURT,
        payload_size=10,
    ),
    op(4, "unsubscribe", "c2", id="s2"),
]

# (strategy, kind) -> (messages, payload bytes)
THREE_EXPECTED = {
    # Every event to the two other brokers.
    ("flooding-events", "event"): (6, 2 * (100 + 50 + 10)),
    # s1 and s2 to two brokers each, s2 withdrawn from both; e1 ap -> us.
    ("flooding-subscriptions", "subscribe"): (4, 0),
    ("flooding-subscriptions", "unsubscribe"): (2, 0),
    ("flooding-subscriptions", "delivery"): (1, 100),
    # Only e1 (world) travels: ap -> eu, ap -> us.
    ("event-geofence", "event"): (2, 200),
    # s1 meets eu only (its home): stays; s2 (world) as under flooding.
    ("subscription-geofence", "subscribe"): (2, 0),
    ("subscription-geofence", "unsubscribe"): (2, 0),
    ("subscription-geofence", "delivery"): (1, 100),
    # e1 must reach us; nothing else must cross.
    ("lower-bound", "event"): (1, 100),
}


def test_three_brokers_by_hand(spark: Any, tmp_path: Path) -> None:
    result = run(spark, THREE, write_jsonl(tmp_path / "t.jsonl", THREE_TRACE))
    got = result.messages.groupBy("strategy", "kind").agg(
        F.sum("messages").alias("messages"), F.sum("bytes").alias("bytes")
    )
    want = spark.createDataFrame(
        [(s, k, m, b) for (s, k), (m, b) in THREE_EXPECTED.items()],
        "strategy string, kind string, messages long, bytes long",
    )
    assertDataFrameEqual(got, want)
    ap_us = result.messages.where("strategy = 'lower-bound'").select(
        "src", "dst", "topic", "messages"
    )
    assertDataFrameEqual(ap_us, [("ap", "us", "sensors/x", 1)], checkRowOrder=False)

    s = result.summary
    assert s["events"] == 3 and s["deliveries"] == 2  # e1 to s2, e3 to s1
    per = s["strategies"]
    assert [
        per[x]["messages"]
        for x in (
            "flooding-events",
            "flooding-subscriptions",
            "event-geofence",
            "subscription-geofence",
            "lower-bound",
        )
    ] == [6, 7, 2, 5, 1]
    assert per["event-geofence"]["savings"]["flooding-events"] == {"messages": 4, "percent": 66.667}
    assert per["event-geofence"]["savings"]["flooding-subscriptions"] == {
        "messages": 5,
        "percent": 71.429,
    }
    assert per["subscription-geofence"]["over_lower_bound"] == 5.0
    assert s["matrix"]["event-geofence"] == {"ap": {"eu": 1, "us": 1}}


def test_checkpoint_folder_given_to_a_local_master_holds_the_tables(
    spark: Any, tmp_path: Path
) -> None:
    # --checkpoint-dir with a local master: the intermediate tables are files
    # there while the result is held, deleted on release, and the results are
    # those of the default (a temporary folder).
    trace = write_jsonl(tmp_path / "t.jsonl", THREE_TRACE)
    default = run(spark, THREE, trace)
    folder = tmp_path / "checkpoints"
    given = run(spark, THREE, trace, checkpoint_dir=str(folder))
    assert [p for p in folder.rglob("*") if p.is_file()], "no checkpoint files in the folder"
    assertDataFrameEqual(given.messages, default.messages, checkRowOrder=False)
    same = {k: v for k, v in default.summary.items() if k != "timings_s"}
    assert {k: v for k, v in given.summary.items() if k != "timings_s"} == same
    given.release()
    default.release()
    assert not [p for p in folder.rglob("*") if p.is_file()]


# Mainland Europe, roughly: Iberia to the Baltics, Brittany to the Black Sea.
MAINLAND_EUROPE = "POLYGON((-9.5 36, 30 36, 30 60, 5 60, -5 48, -9.5 44, -9.5 36))"


def test_europe_event_geofence_on_21_regions(spark: Any, tmp_path: Path) -> None:
    # One event from Frankfurt for mainland Europe, and a subscriber in
    # Stockholm: under flooding it goes to all 20 other regions; under
    # event-geofence only to the regions whose area reaches into the fence.
    trace = [
        op(0, "subscribe", "sub", (59.33, 18.07), id="s1", topic="alerts/#", geofence=None),
        op(
            1,
            "publish",
            "pub",
            FRANKFURT,
            id="e1",
            topic="alerts/storm",
            geofence=MAINLAND_EUROPE,
            payload_size=1000,
        ),
    ]
    result = run(spark, AWS, write_jsonl(tmp_path / "eu.jsonl", trace))
    events = result.messages.where("kind = 'event'")
    eg = events.where("strategy = 'event-geofence'").select("src", "dst")
    expected = [
        "eu-north-1",
        "eu-west-2",
        "eu-west-3",
        "me-south-1",
    ]  # Stockholm, London, Paris, Bahrain
    assertDataFrameEqual(eg, [("eu-central-1", d) for d in expected], checkRowOrder=False)
    assert events.where("strategy = 'flooding-events'").count() == 20
    per = result.summary["strategies"]
    assert per["event-geofence"]["savings"]["flooding-events"] == {"messages": 16, "percent": 80.0}
    # Stockholm's broker is the only one that needs it.
    lb = result.messages.where("strategy = 'lower-bound'").select("src", "dst", "messages")
    assertDataFrameEqual(lb, [("eu-central-1", "eu-north-1", 1)])
    assert json.dumps(result.summary)  # the summary is JSON as it stands
