"""Event x subscription matching, distributed.

A match needs ContentCheck, Subscription GeoCheck and Event GeoCheck
(docs/design.md §1). The work is split so that only small tables meet the
event stream and only candidate pairs reach Python:

1. Content: the distinct event topics are run, in the executors, against the
   distinct topic filters (the core's subscription index proposes, its
   `topic_matches` decides): a (topic, filter) table. Events join it on topic,
   so afterwards content is an equi-join on the filter.
2. Subscription GeoCheck: segments of geofenced subscriptions are exploded
   over a conservative H3 cover of their geofence (the core's `h3_cover`);
   events join them on (H3 cell of the publisher, filter). World subscriptions
   (and geofences without a usable cover) join on the filter alone. The exact
   `covers` check then runs in an Arrow UDF, per geofence, vectorized.
3. Event GeoCheck: needs where the subscriber is when the event is
   published: an as-of join (the subscriber's last location op at or before
   the event), built by a window over the client's ops, then `covers` again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import shapely
from pyspark import Broadcast
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.functions import arrow_udf

from geofed.routing import Geofence, h3_cover

from ._geo import FilterMatcher, covers_many, extent_km, filled, present
from ._state import INF_K, INF_T, before

_WORKER: dict[Any, Any] = {}


def _worker_matcher(key: str, filters: Broadcast[list[str]]) -> FilterMatcher:
    # Module-level on purpose: functions defined inside others are shipped by
    # value, and a cache they captured would be a fresh copy in every task.
    matcher = _WORKER.get(key)
    if matcher is None:
        matcher = _WORKER[key] = FilterMatcher(filters.value)
    return matcher


def events(ops: DataFrame) -> DataFrame:
    """Publish ops as events: ek (k), et (t), origin (publisher's home), topic, efence/emeet, ..."""
    return ops.where(F.col("op") == "publish").select(
        F.col("k").alias("ek"),
        F.col("t").alias("et"),
        "lat",
        "lon",
        "cell",
        "topic",
        F.col("fence").alias("efence"),
        F.col("meet").alias("emeet"),
        "payload",
        F.col("home").alias("origin"),
    )


def segment_side(segs: DataFrame) -> DataFrame:
    """Segments with the column names the event joins use."""
    return segs.select(
        "vid",
        F.col("client").alias("sclient"),
        "filter",
        F.col("fence").alias("sfence"),
        F.col("meet").alias("smeet"),
        "home",
        "seg_t",
        "seg_k",
        "seg_end_t",
        "seg_end_k",
    )


# --------------------------------------------------------------------------
# Content


def topic_filter_pairs(topics: DataFrame, filters: Broadcast[list[str]]) -> DataFrame:
    """(topic, filter) for every distinct topic and every filter matching it."""
    key = f"filters-{uuid.uuid4().hex}"  # one matcher per job and Python worker

    def match(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        matcher = _worker_matcher(key, filters)
        for batch in batches:
            out_t: list[str] = []
            out_f: list[str] = []
            for topic in batch.column("topic").to_pylist():
                for f in matcher.matching(topic):
                    out_t.append(topic)
                    out_f.append(f)
            yield pa.RecordBatch.from_pydict({"topic": out_t, "filter": out_f}, schema=_TF_SCHEMA)

    return topics.select("topic").mapInArrow(match, "topic string, filter string")


_TF_SCHEMA = pa.schema([("topic", pa.string()), ("filter", pa.string())])


def with_topic_ids(tf: DataFrame) -> DataFrame:
    """The (topic, filter) table plus ``tid``: a number per distinct topic (dense, from 1).

    Pairs carry the number instead of the topic text through the fold per
    (event, home) (`per_home`): a long hashes and compares in a fraction of
    a string's time there, and the text is joined back once the rows are few
    (`_cost.delivery_messages`). One window over the whole table: it has a
    row per (topic, matching filter), not per event.
    """
    return tf.withColumn("tid", F.dense_rank().over(Window.orderBy("topic")).cast("long"))


# --------------------------------------------------------------------------
# Spatial keys


def fence_extents(fences: DataFrame) -> DataFrame:
    """(fence, extent_km) of each geofence (fence, wkb)."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            geoms = shapely.from_wkb(batch.column("wkb").to_numpy(zero_copy_only=False))
            ext = [extent_km(g) for g in geoms]
            yield pa.RecordBatch.from_pydict(
                {"fence": batch.column("fence"), "extent_km": pa.array(ext, pa.float64())}
            )

    return fences.select("fence", "wkb").mapInArrow(run, "fence long, extent_km double")


def fence_cells(fences: DataFrame, res: int) -> DataFrame:
    """(fence, cells): the H3 cover at `res`, null where a geofence gets no spatial key."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            geoms = shapely.from_wkb(batch.column("wkb").to_numpy(zero_copy_only=False))
            cells = [h3_cover(g, res) for g in geoms]
            yield pa.RecordBatch.from_pydict(
                {"fence": batch.column("fence"), "cells": pa.array(cells, pa.list_(pa.int64()))}
            )

    return fences.select("fence", "wkb").mapInArrow(run, "fence long, cells array<long>")


def keyed_segments(side: DataFrame, cells: DataFrame) -> DataFrame:
    """Geofenced segments with a cover, one row per (segment, cell)."""
    return side.join(
        cells.where(F.col("cells").isNotNull()), side["sfence"] == cells["fence"]
    ).select(*[side[c] for c in side.columns], F.explode("cells").alias("cell"))


def unkeyed_segments(side: DataFrame, cells: DataFrame) -> DataFrame:
    """World segments and geofenced ones without a cover: matched on the filter alone."""
    covered = cells.where(F.col("cells").isNotNull()).select(F.col("fence").alias("sfence"))
    return side.join(covered, "sfence", "left_anti")


def h3_parent(cell: Column, res: int) -> Column:
    """`_geo.h3_parent_int` as a Spark expression (events carry cells at H3_RES_MAX)."""
    keep = ~(0xF << 52)
    tail = (res << 52) | ((1 << (3 * (15 - res))) - 1)
    return cell.bitwiseAND(F.lit(keep)).bitwiseOR(F.lit(tail))


def _live() -> Column:
    # A segment holds the subscription at home for events in [seg, seg_end).
    return ~before(F.col("et"), F.col("ek"), F.col("seg_t"), F.col("seg_k")) & before(
        F.col("et"), F.col("ek"), F.col("seg_end_t"), F.col("seg_end_k")
    )


def candidates(
    expanded: DataFrame,
    keyed: DataFrame,
    unkeyed: DataFrame,
    res: int,
    *,
    broadcast_keyed: bool,
    broadcast_unkeyed: bool,
) -> tuple[DataFrame, DataFrame]:
    """(event, segment) pairs passing ContentCheck and liveness, spatially pre-filtered.

    `expanded` is events joined with the (topic, filter) table. Returns the
    pairs still needing the exact Subscription GeoCheck (geofenced
    subscriptions) and those that need none (world subscriptions), so that
    only the former cross into Python.
    """
    keyed_side = F.broadcast(keyed) if broadcast_keyed else keyed
    unkeyed_side = F.broadcast(unkeyed) if broadcast_unkeyed else unkeyed
    by_cell = (
        expanded.withColumn("cell", h3_parent(F.col("cell"), res))
        .join(keyed_side, ["filter", "cell"])
        .where(_live())
        .drop("cell")
    )
    by_filter = expanded.drop("cell").join(unkeyed_side, ["filter"]).where(_live())
    fenced = by_cell.unionByName(by_filter.where(F.col("sfence").isNotNull()))
    return fenced, by_filter.where(F.col("sfence").isNull())


# --------------------------------------------------------------------------
# World subscriptions, counted instead of paired
#
# A world subscription (no geofence) matches every event whose topic its
# filter matches while its segment is live: no geometry, and both routing
# flags hold (sg_ok, em_ok) for events without a geofence. So for those
# events, the number of world subscriptions at a home is a step function of
# the event's position (t, k) per (topic, home), changing only where a world
# segment starts or ends: a few rows per world segment and matching topic,
# instead of a pair per (event, world segment) (~4 per event in the scale
# benchmark's workload).


_NO_END = (1 << 63) - 1
"""The step index of a position no event reaches (a segment open to the end)."""


def world_positions(world: DataFrame) -> DataFrame:
    """(t, k, r): the distinct finite positions where a world segment starts or ends.

    r numbers them from 1 in (t, k) order: an event at position e has step
    index g = r of the last position <= e (0 before the first), see
    `with_step_index`. A segment's open end (t = infinity) is no position:
    no event reaches it.
    """
    starts = world.select(F.col("seg_t").alias("t"), F.col("seg_k").alias("k"))
    ends = world.select(F.col("seg_end_t").alias("t"), F.col("seg_end_k").alias("k"))
    points = starts.unionByName(ends).where(F.col("t") != F.lit(float("inf"))).distinct()
    # A window without partitions: one task, over a table of at most 2 rows per segment.
    return points.withColumn("r", F.row_number().over(Window.orderBy("t", "k")).cast("long"))


def world_steps(world: DataFrame, positions: DataFrame, tf: DataFrame) -> DataFrame:
    """(tid, home, lo, hi, w, lo_t, lo_k, hi_t, hi_k): w world segments match topic tid
    and are live at home for events with a step index g in [lo, hi), i.e. at
    positions from (lo_t, lo_k) (inclusive) to (hi_t, hi_k) (exclusive); only
    steps with w > 0.

    A segment live for positions in [start, end) is live for step indices in
    [r(start), r(end)): with g = r of the last position <= e, start <= e iff
    g >= r(start), and e < end iff g < r(end). The steps of one (tid, home)
    do not overlap, so a lookup finds at most one.
    """
    start = positions.select(
        F.col("t").alias("seg_t"), F.col("k").alias("seg_k"), F.col("r").alias("lo")
    )
    end = positions.select(
        F.col("t").alias("seg_end_t"), F.col("k").alias("seg_end_k"), F.col("r").alias("hi")
    )
    spans = (
        world.select("filter", "home", "seg_t", "seg_k", "seg_end_t", "seg_end_k")
        .join(start, ["seg_t", "seg_k"])
        .join(end, ["seg_end_t", "seg_end_k"], "left")
        .select("filter", "home", "lo", F.coalesce("hi", F.lit(_NO_END)).alias("hi"))
        .where(F.col("lo") < F.col("hi"))  # a segment ending where it starts holds nothing
        .join(tf.select("filter", "tid"), "filter")
    )
    changes = (
        spans.select("tid", "home", F.col("lo").alias("g"), F.lit(1).alias("d"))
        .unionByName(spans.select("tid", "home", F.col("hi").alias("g"), F.lit(-1).alias("d")))
        .groupBy("tid", "home", "g")
        .agg(F.sum("d").alias("d"))
    )
    w = Window.partitionBy("tid", "home").orderBy("g")
    steps = (
        changes.select(
            "tid",
            "home",
            F.col("g").alias("lo"),
            F.coalesce(F.lead("g").over(w), F.lit(_NO_END)).alias("hi"),
            F.sum("d").over(w.rowsBetween(Window.unboundedPreceding, 0)).alias("w"),
        )
        .where(F.col("w") > 0)
        .select("tid", "home", "lo", "hi", F.col("w").cast("long").alias("w"))
    )
    at = positions.select(
        F.col("r").alias("lo"), F.col("t").alias("lo_t"), F.col("k").alias("lo_k")
    )
    until = positions.select(
        F.col("r").alias("hi"), F.col("t").alias("hi_t"), F.col("k").alias("hi_k")
    )
    return (
        steps.join(F.broadcast(at), "lo")
        .join(F.broadcast(until), "hi", "left")
        .select(
            "tid",
            "home",
            "lo",
            "hi",
            "w",
            "lo_t",
            "lo_k",
            F.coalesce("hi_t", F.lit(INF_T)).alias("hi_t"),
            F.coalesce("hi_k", F.lit(INF_K)).alias("hi_k"),
        )
    )


_BUCKETS = 1 << 16


def with_step_index(events: DataFrame, positions: DataFrame) -> DataFrame:
    """`events` plus ``g``: how many of `positions` are at or before the event's (et, ek).

    Exact, with no sort of the events: the positions' time span is cut into
    `_BUCKETS` buckets of t (a monotone function of t, the same Spark
    expression for positions and events), so the positions in an earlier
    bucket are all before the event and those in a later one all after it.
    An event looks its bucket up in a broadcast table (how many positions
    come before it) and compares itself with the positions in the bucket
    only where there are any: with many more buckets than positions, few
    events (0.4% in the scale benchmark's 1M trace) take that path.
    """
    stats = positions.agg(
        F.min("t").alias("lo"), F.max("t").alias("hi"), F.count(F.lit(1)).alias("n")
    ).first()
    assert stats is not None
    if int(stats["n"]) == 0:
        return events.withColumn("g", F.lit(0).cast("long"))
    t0 = float(stats["lo"])
    # The last position lands in bucket _BUCKETS - 1, so the last bucket
    # (later events) holds none.
    width = (float(stats["hi"]) - t0) / (_BUCKETS - 1)
    if not width > 0:  # one distinct t (or a span too narrow for doubles)
        width = 1.0

    def bucket(t: Column) -> Column:
        # Clipped in doubles first: any finite t lands in [-1, _BUCKETS].
        x = (t - F.lit(t0)) / F.lit(width)
        return F.floor(F.least(F.greatest(x, F.lit(-1.0)), F.lit(float(_BUCKETS))))

    filled = positions.groupBy(bucket(F.col("t")).alias("_b")).agg(
        F.collect_list(F.struct("t", "k")).alias("_pts"), F.count(F.lit(1)).alias("c")
    )
    # One task over _BUCKETS + 2 rows: a cumulative count needs their order.
    order = Window.orderBy("_b").rowsBetween(Window.unboundedPreceding, -1)
    table = (
        positions.sparkSession.range(-1, _BUCKETS + 1)
        .select(F.col("id").alias("_b"))
        .join(filled, "_b", "left")
        .select("_b", F.coalesce(F.sum("c").over(order), F.lit(0)).alias("_base"), "_pts")
    )
    at = F.col("et")
    k = F.col("ek")
    seen = F.size(F.filter("_pts", lambda p: ~before(at, k, p["t"], p["k"])))
    base = F.col("_base").cast("long")
    return (
        events.withColumn("_b", bucket(at))
        .join(F.broadcast(table), "_b")
        .withColumn("g", F.when(F.col("_pts").isNull(), base).otherwise(base + seen))
        .drop("_b", "_base", "_pts")
    )


def world_tally(
    events: DataFrame, topics: DataFrame, steps: DataFrame, *, broadcast: bool
) -> DataFrame:
    """`_cost.delivery_tally` rows of the world subscriptions' (event, home) rows.

    `events` are events without a geofence, with their step index ``g``
    (`with_step_index`); `topics` is (topic, tid). Events are first counted
    per (origin, topic, g), then each count meets the steps of its topic:
    one tally row per (count, home) with w > 0, standing for that many
    (event, home) rows with w deliveries each. Rows with keyed pairs too are
    the same (event, home) rows: `with_world_steps` adds those pairs'
    deliveries and no row. `broadcast`: ship `steps` to every task.
    """
    groups = (
        events.groupBy("origin", "topic", "g")
        .agg(F.count(F.lit(1)).alias("rows"), F.sum("payload").alias("bytes"))
        .join(F.broadcast(topics), "topic")
    )
    s = steps.alias("s")
    hit = (groups["tid"] == s["tid"]) & (s["lo"] <= groups["g"]) & (groups["g"] < s["hi"])
    yes = F.lit(True)
    return groups.join(F.broadcast(s) if broadcast else s, hit).select(
        "origin",
        F.col("s.home").alias("home"),
        groups["tid"],
        yes.alias("sg_ok"),
        yes.alias("em_ok"),
        yes.alias("full"),
        F.col("rows").cast("long").alias("rows"),
        F.col("bytes").cast("long").alias("bytes"),
        (F.col("rows") * F.col("s.w")).cast("long").alias("n_full"),
    )


def with_world_steps(homes: DataFrame, steps: DataFrame, *, broadcast: bool) -> DataFrame:
    """`per_home` rows (with ``et``) as `_cost.delivery_tally` rows, world subscriptions counted.

    Where world subscriptions are live at the same (event, home), the row is
    one of `world_tally`'s: it adds its deliveries there (all flags hold) and
    no row or payload of its own. Elsewhere it is the row it was.
    `broadcast`: ship `steps` to every task.
    """
    s = steps.alias("s")
    at, k = homes["et"], homes["ek"]
    hit = (
        (homes["tid"] == s["tid"])
        & (homes["home"] == s["home"])
        & ~before(at, k, s["lo_t"], s["lo_k"])
        & before(at, k, s["hi_t"], s["hi_k"])
    )
    world = F.col("s.w").isNotNull()
    return homes.join(F.broadcast(s) if broadcast else s, hit, "left").select(
        "origin",
        homes["home"],
        homes["tid"],
        (F.col("sg_ok") | world).alias("sg_ok"),
        (F.col("em_ok") | world).alias("em_ok"),
        ((F.col("n_full") > 0) | world).alias("full"),
        F.when(world, 0).otherwise(1).cast("long").alias("rows"),
        F.when(world, 0).otherwise(F.col("payload")).cast("long").alias("bytes"),
        F.col("n_full").cast("long").alias("n_full"),
    )


# --------------------------------------------------------------------------
# Exact geometry checks


class FenceGeometry:
    """Where executors find a geofence's geometry for the exact `covers` checks.

    Few geofences (the usual case: subscriptions, or events from fixed
    publishers) travel as one broadcast dict; many (moving publishers draw a
    new circle per position) are joined onto the rows that need them, since
    a broadcast of that size would not fit an executor.
    """

    def __init__(self, spark: SparkSession, fences: DataFrame, max_bytes: int) -> None:
        table = (
            fences.where(F.col("wkb").isNotNull()).dropDuplicates(["fence"]).select("fence", "wkb")
        )
        stats = table.agg(F.count(F.lit(1)).alias("n"), F.sum(F.length("wkb")).alias("b")).first()
        assert stats is not None
        self.count = int(stats["n"])
        self.bytes = int(stats["b"] or 0)
        self.broadcast: Broadcast[dict[int, bytes]] | None = None
        self.table: DataFrame | None = None
        if self.bytes <= max_bytes:
            # Bounded by max_bytes: a small table of shapes, not trace rows.
            shapes = {int(r["fence"]): bytes(r["wkb"]) for r in table.toLocalIterator()}
            self.broadcast = spark.sparkContext.broadcast(shapes)
        else:
            self.table = table

    def with_covers(self, df: DataFrame, fence: str, lat: str, lon: str, out: str) -> DataFrame:
        """`df` plus boolean `out`: geofence `fence` (null: world) covers (lat, lon)."""
        udf = _covers_udf(self.broadcast)
        if self.table is None:
            return df.withColumn(
                out, udf(F.col(fence), F.col(lat), F.col(lon), F.lit(None).cast("binary"))
            )
        shapes = self.table.withColumnRenamed("fence", "_gf").withColumnRenamed("wkb", "_gwkb")
        joined = df.join(shapes, df[fence] == shapes["_gf"], "left")
        return joined.withColumn(
            out, udf(F.col(fence), F.col(lat), F.col(lon), F.col("_gwkb"))
        ).drop("_gf", "_gwkb")

    def release(self) -> None:
        """Free the broadcast (if any)."""
        if self.broadcast is not None:
            self.broadcast.destroy()


def _geofence(fid: int, shapes: dict[int, bytes] | None, wkb: Any) -> Geofence:
    cache: dict[int, Geofence] = _WORKER.setdefault("geofences", {})
    fence = cache.get(fid)
    if fence is None:
        raw = shapes[fid] if shapes is not None else wkb
        if len(cache) > 100_000:
            cache.clear()  # bounded
        fence = cache[fid] = Geofence(shapely.from_wkb(raw))
    return fence


def _covers_udf(shapes_bc: Broadcast[dict[int, bytes]] | None) -> Any:
    @arrow_udf("boolean")  # type: ignore[call-overload,untyped-decorator,unused-ignore]
    def covers_udf(fence: pa.Array, lat: pa.Array, lon: pa.Array, wkb: pa.Array) -> pa.Array:
        n = len(fence)
        result = np.ones(n, dtype=bool)  # no geofence: the whole world
        fenced = present(fence)
        if not fenced.any():
            return pa.array(result)
        shapes = shapes_bc.value if shapes_bc is not None else None
        ids = filled(fence, 0, np.int64)
        la = filled(lat, 0.0, np.float64)
        lo = filled(lon, 0.0, np.float64)
        rows = np.flatnonzero(fenced)
        # Group rows by geofence: one vectorized covers per shape in the batch.
        order = rows[np.argsort(ids[rows], kind="stable")]
        sorted_ids = ids[order]
        starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
        ends = np.r_[starts[1:], len(order)]
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            idx = order[s:e]
            fid = int(sorted_ids[s])
            raw = None if shapes is not None else wkb[int(idx[0])].as_py()
            result[idx] = covers_many(_geofence(fid, shapes, raw), la[idx], lo[idx])
        return pa.array(result)

    return covers_udf


def matched_pairs(pairs: DataFrame, *keep: str) -> DataFrame:
    """Pairs passing ContentCheck and Subscription GeoCheck, with the flags routing needs.

    sg_ok: the publisher's broker is on the subscription's path under
    subscription-geofence (origin in the brokers its geofence meets);
    em_ok: the subscriber's home meets the event geofence (delivery targets).
    The topic travels as its number (tid, `with_topic_ids`). `keep`: more
    of the event's columns to carry.
    """
    return pairs.select(
        *keep,
        "ek",
        "et",
        "origin",
        "tid",
        "payload",
        "efence",
        "sclient",
        "home",
        (F.col("smeet").isNull() | F.array_contains("smeet", F.col("origin"))).alias("sg_ok"),
        (F.col("emeet").isNull() | F.array_contains("emeet", F.col("home"))).alias("em_ok"),
    )


def per_home(pairs: DataFrame, full: Column, *keep: str) -> DataFrame:
    """Pairs folded to one row per (event, subscriber home).

    n_full: pairs that fully match (`full`), i.e. deliveries; sg_ok/em_ok:
    whether any pair there passes the flag. Everything the costs need, at a
    fraction of the rows: pairs fold within a task before any shuffle.
    `keep`: more of the event's columns to carry (the event's time ``et``).
    """
    return pairs.groupBy("ek", "home", "origin", "tid", "payload", *keep).agg(
        F.sum(full.cast("long")).alias("n_full"),
        F.max("sg_ok").alias("sg_ok"),
        F.max("em_ok").alias("em_ok"),
    )


def subscriber_locations(pairs: DataFrame, located: DataFrame) -> DataFrame:
    """Pairs with the subscriber's location when the event was published (slat, slon).

    An as-of join as a window: the pairs and the subscribers' location ops
    are one stream per client in (t, k) order, and each pair takes the last
    location at or before it (its own op first when the subscriber is the
    publisher: tag 0 sorts before tag 1).
    """
    locs = located.select(
        F.col("client").alias("sclient"),
        F.col("t").alias("et"),
        F.col("k").alias("ek"),
        F.lit(0).alias("tag"),
        "lat",
        "lon",
    )
    qs = pairs.withColumn("tag", F.lit(1))
    w = (
        Window.partitionBy("sclient")
        .orderBy("et", "ek", "tag")
        .rowsBetween(Window.unboundedPreceding, 0)
    )
    return (
        locs.unionByName(qs, allowMissingColumns=True)
        .select(
            "*",
            F.last("lat", ignorenulls=True).over(w).alias("slat"),
            F.last("lon", ignorenulls=True).over(w).alias("slon"),
        )
        .where(F.col("tag") == 1)
        .drop("tag", "lat", "lon")
    )
