"""The DataFrame -> DataFrame steps on small hand-made frames."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual
from spark_helpers import write_jsonl

from geofed.bench.analysis import (
    LINE_BITS,
    accepted_subscription_ops,
    h3_cell,
    h3_parent,
    h3_parent_int,
    read_numbered,
    rehomings,
    segments,
    subscriber_locations,
    subscription_message_sources,
    version_rehomings,
    versions,
    with_step_index,
    world_positions,
    world_steps,
)

pytestmark = pytest.mark.spark

OPS = (
    "id string, t double, k long, client string, op string, topic string, fence long,"
    " meet array<int>, home int"
)


def test_ownership_rule(spark: Any) -> None:
    ops = spark.createDataFrame(
        [
            ("s1", 1.0, 1, "a", "subscribe", "x", None, None, 0),  # a owns s1
            ("s1", 2.0, 2, "b", "subscribe", "x", None, None, 1),  # live for a: ignored
            (
                "s1",
                3.0,
                3,
                "b",
                "unsubscribe",
                None,
                None,
                None,
                None,
            ),  # b does not hold it: ignored
            ("s1", 3.0, 4, "a", "subscribe", "y", 7, [0], 0),  # a's update (same t, later line)
            ("s1", 5.0, 5, "a", "unsubscribe", None, None, None, None),  # freed
            ("s1", 6.0, 6, "b", "subscribe", "z", None, None, 1),  # now b may
            ("s2", 0.0, 7, "a", "unsubscribe", None, None, None, None),  # never held
        ],
        OPS,
    )
    got = accepted_subscription_ops(ops).select("id", "k", "client", "op")
    assertDataFrameEqual(
        got,
        [
            ("s1", 1, "a", "subscribe"),
            ("s1", 4, "a", "subscribe"),
            ("s1", 5, "a", "unsubscribe"),
            ("s1", 6, "b", "subscribe"),
        ],
        checkRowOrder=False,
    )


def test_versions_rehomings_and_segments(spark: Any) -> None:
    # Client a subscribes at home 0, moves to home 1, updates its geofence
    # there while moving to home 2, and unsubscribes.
    accepted = spark.createDataFrame(
        [
            ("s1", 1.0, 1, "a", "subscribe", "x", None, None, 0),
            ("s1", 4.0, 4, "a", "subscribe", "x", 9, [2], 2),
            ("s1", 6.0, 6, "a", "unsubscribe", None, None, None, None),
        ],
        OPS,
    )
    vers = versions(accepted)
    assertDataFrameEqual(
        vers.select("vid", "start_t", "end_t", "end_op", "home0", "upd", "old_fence"),
        [(1, 1.0, 4.0, "subscribe", 0, False, None), (4, 4.0, 6.0, "unsubscribe", 2, True, None)],
        checkRowOrder=False,
    )
    located = spark.createDataFrame(
        [
            ("a", 1.0, 1, 0.0, 0.0, 0),
            ("a", 2.0, 2, 0.0, 1.0, 0),
            ("a", 3.0, 3, 0.0, 2.0, 1),
            ("a", 4.0, 4, 0.0, 3.0, 2),
        ],
        "client string, t double, k long, lat double, lon double, home int",
    )
    rh = rehomings(located)
    assertDataFrameEqual(
        rh.select("p_k", "old", "new"), [(3, 0, 1), (4, 1, 2)], checkRowOrder=False
    )
    vrh = version_rehomings(vers, rh)
    # The move at 4 re-homes the old version too: it is ended by that very op.
    assertDataFrameEqual(
        vrh.select("vid", "p_k", "old", "new"), [(1, 3, 0, 1), (1, 4, 1, 2)], checkRowOrder=False
    )
    segs = segments(vers, vrh)
    assertDataFrameEqual(
        segs.select("vid", "home", "seg_k", "seg_end_k", "last"),
        [(1, 0, 1, 3, False), (1, 1, 3, 4, True), (4, 2, 4, 6, True)],
        checkRowOrder=False,
    )
    sources = subscription_message_sources(vers, vrh, segs)
    assertDataFrameEqual(
        sources.select("kind", "src", "has_minus"),
        [
            ("subscribe", 0, False),  # s1 at home 0
            ("subscribe", 2, False),  # the update, from home 2
            ("unsubscribe", 2, True),  # ... withdrawing the old version where the new does not go
            ("unsubscribe", 0, False),
            ("subscribe", 1, False),  # re-homed 0 -> 1
            ("unsubscribe", 1, False),
            ("subscribe", 2, False),  # re-homed 1 -> 2
            ("unsubscribe", 2, False),  # the unsubscribe, from where it ended up
        ],
        checkRowOrder=False,
    )


def test_subscriber_location_at_event_time(spark: Any) -> None:
    located = spark.createDataFrame(
        [("a", 1.0, 1, 10.0, 10.0, 0), ("a", 5.0, 5, 20.0, 20.0, 0), ("a", 5.0, 8, 30.0, 30.0, 0)],
        "client string, t double, k long, lat double, lon double, home int",
    )
    pairs = spark.createDataFrame(
        [("a", 4.0, 4, 1), ("a", 5.0, 6, 2), ("a", 5.0, 8, 3), ("a", 9.0, 9, 4)],
        "sclient string, et double, ek long, n int",
    )
    got = subscriber_locations(pairs, located).select("n", "slat")
    # Before the move; after it (same t, later line); its own op (the subscriber publishes).
    assertDataFrameEqual(got, [(1, 10.0), (2, 20.0), (3, 30.0), (4, 30.0)], checkRowOrder=False)


def test_line_numbers_across_splits_and_files(spark: Any, tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [f'{{"n": {i}}}' if i % 5 else "" for i in range(1, 301)])
    b = write_jsonl(tmp_path / "b.jsonl", [f'{{"n": {i}}}' for i in range(1, 41)])
    old = spark.conf.get("spark.sql.files.maxPartitionBytes")
    spark.conf.set("spark.sql.files.maxPartitionBytes", "512")  # many splits per file
    try:
        numbered, inputs = read_numbered(spark, [str(a), str(b)], "json", what="workload")
        assert numbered.rdd.getNumPartitions() > 4
        got = numbered.select(
            "file",
            "line",
            F.get_json_object("value", "$.n").cast("long").alias("n"),
            (F.col("k") == F.col("file").cast("long") * (1 << LINE_BITS) + F.col("line")).alias(
                "k_ok"
            ),
        )
        want = [(0, i, i if i % 5 else None, True) for i in range(1, 301)]
        want += [(1, i, i, True) for i in range(1, 41)]
        assertDataFrameEqual(got, want, checkRowOrder=False)
        assert [Path(f).name for f in inputs.files] == ["a.jsonl", "b.jsonl"]
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", old)


def test_h3_parent_expression_matches_python(spark: Any) -> None:
    cells = [h3_cell(48.1, 11.6), h3_cell(-33.9, 151.2), h3_cell(0.0, -179.9)]
    df = spark.createDataFrame([(c,) for c in cells], "cell long")
    got = df.select(*[h3_parent(F.col("cell"), r).alias(f"r{r}") for r in (2, 5, 9)])
    assertDataFrameEqual(
        got, [tuple(h3_parent_int(c, r) for r in (2, 5, 9)) for c in cells], checkRowOrder=False
    )


# World subscriptions counted per step (world_positions, world_steps, with_step_index)

_WORLD = "filter string, home int, seg_t double, seg_k long, seg_end_t double, seg_end_k long"
_OPEN = (float("inf"), (1 << 63) - 1)  # a segment no op ended (`_state.INF_T`, `INF_K`)


def _at_or_before(p: tuple[float, int], e: tuple[float, int]) -> bool:
    return p <= e  # (t, k) in lexicographic order, as `before`


def _world_case(spark: Any, segs: list[tuple[Any, ...]], tf: list[tuple[str, int]]) -> None:
    """Every event's step index and world count equal a direct count over the segments."""
    world = spark.createDataFrame(segs, _WORLD)
    tfd = spark.createDataFrame(tf, "filter string, tid long")
    positions = world_positions(world)
    steps = world_steps(world, positions, tfd).collect()
    points = sorted(
        {(s[2], s[3]) for s in segs} | {(s[4], s[5]) for s in segs if s[4] != float("inf")}
    )
    times = sorted({p[0] for p in points} | {-1e9, 0.0, 2e9} | {p[0] + 0.25 for p in points})
    ks = sorted({p[1] for p in points} | {0, 1 << 40})
    tids = sorted({i for _, i in tf})
    events = [(t, k, tid) for t in times for k in ks for tid in tids]
    ev = spark.createDataFrame(events, "et double, ek long, tid long")
    got = {(r["et"], r["ek"], r["tid"]): r["g"] for r in with_step_index(ev, positions).collect()}
    homes = sorted({s[1] for s in segs})
    for t, k, tid in events:
        e = (t, k)
        g = sum(_at_or_before(p, e) for p in points)
        assert got[(t, k, tid)] == g, (e, tid)
        filters = {f for f, i in tf if i == tid}
        for home in homes:
            want = sum(
                1
                for f, h, st, sk, et_, ek_ in segs
                if f in filters and h == home and (st, sk) <= e < (et_, ek_)
            )
            by_index = [
                r["w"]
                for r in steps
                if (r["tid"], r["home"]) == (tid, home) and r["lo"] <= g < r["hi"]
            ]
            by_position = [
                r["w"]
                for r in steps
                if (r["tid"], r["home"]) == (tid, home)
                and (r["lo_t"], r["lo_k"]) <= e < (r["hi_t"], r["hi_k"])
            ]
            assert by_index == by_position == ([want] if want else []), (e, tid, home)


def test_world_steps_count_live_world_segments(spark: Any) -> None:
    segs = [
        ("a/#", 0, 1.0, 5, 4.0, 2),
        ("a/#", 0, 1.0, 9, *_OPEN),  # same t, later line
        ("a/+", 0, 2.5, 1, 2.5, 1),  # ends where it starts: never live
        ("a/+", 1, 2.5, 1, 7.0, 3),
        ("a/x", 1, 0.5, 7, 2.5, 1),  # ends where another starts
        ("a/x", 1, 7.0, 3, *_OPEN),
        ("b", 2, 3.0, 4, 3.0, 8),
        ("b", 2, 1e6, 2, 1e6, 3),
    ]
    tf = [("a/#", 1), ("a/+", 1), ("a/x", 1), ("a/#", 2), ("b", 3)]
    _world_case(spark, segs, tf)


def test_world_steps_when_every_position_shares_one_time(spark: Any) -> None:
    segs = [("x", 0, 5.0, 1, 5.0, 4), ("x", 1, 5.0, 2, *_OPEN), ("x", 0, 5.0, 3, 5.0, 9)]
    _world_case(spark, segs, [("x", 1)])
