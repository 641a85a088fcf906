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
import pyarrow.compute as pc
import shapely
from pyspark import Broadcast
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.pandas.functions import arrow_udf

from geofed.routing import Geofence, h3_cover

from ._geo import FilterMatcher, covers_many, extent_km
from ._state import before

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
    by_event: int | None = None,
) -> tuple[DataFrame, DataFrame]:
    """(event, segment) pairs passing ContentCheck and liveness, spatially pre-filtered.

    `expanded` is events joined with the (topic, filter) table. Returns the
    pairs still needing the exact Subscription GeoCheck (geofenced
    subscriptions) and those that need none (world subscriptions), so that
    only the former cross into Python.

    With `by_event`, the world pairs come out hash-partitioned by event
    (``ek``, that many partitions; see `by_event`): the events are shuffled
    before the filter join, which multiplies them, rather than the pairs.
    """
    keyed_side = F.broadcast(keyed) if broadcast_keyed else keyed
    unkeyed_side = F.broadcast(unkeyed) if broadcast_unkeyed else unkeyed
    by_cell = (
        expanded.withColumn("cell", h3_parent(F.col("cell"), res))
        .join(keyed_side, ["filter", "cell"])
        .where(_live())
        .drop("cell")
    )
    world_side = expanded.drop("cell")
    if by_event is not None:
        world_side = spread_by_event(world_side, by_event)
    by_filter = world_side.join(unkeyed_side, ["filter"]).where(_live())
    fenced = by_cell.unionByName(by_filter.where(F.col("sfence").isNotNull()))
    return fenced, by_filter.where(F.col("sfence").isNull())


def spread_by_event(df: DataFrame, partitions: int) -> DataFrame:
    """`df` hash-partitioned by event (``ek``) into `partitions` partitions.

    Pair tables spread this way, with the same count, union into one that
    Spark knows is partitioned by event (spark.sql.unionOutputPartitioning),
    so `per_home` folds them where they are, with no shuffle of its own: the
    fold's shuffle carried several rows per event (every (event, home) row),
    this one an event's row (or a checked pair's) once. Broadcast joins keep
    the partitioning of the side they stream; a Python UDF does not (its
    output is re-spread after it).
    """
    return df.repartition(partitions, "ek")


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
        present = np.asarray(pc.is_valid(fence).to_numpy(zero_copy_only=False), dtype=bool)
        if not present.any():
            return pa.array(result)
        shapes = shapes_bc.value if shapes_bc is not None else None
        ids = np.asarray(pc.fill_null(fence, 0).to_numpy(zero_copy_only=False))
        la = np.asarray(pc.fill_null(lat, 0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
        lo = np.asarray(pc.fill_null(lon, 0.0).to_numpy(zero_copy_only=False), dtype=np.float64)
        rows = np.flatnonzero(present)
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


def matched_pairs(pairs: DataFrame) -> DataFrame:
    """Pairs passing ContentCheck and Subscription GeoCheck, with the flags routing needs.

    sg_ok: the publisher's broker is on the subscription's path under
    subscription-geofence (origin in the brokers its geofence meets);
    em_ok: the subscriber's home meets the event geofence (delivery targets).
    The topic travels as its number (tid, `with_topic_ids`).
    """
    return pairs.select(
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


def per_home(pairs: DataFrame, full: Column) -> DataFrame:
    """Pairs folded to one row per (event, subscriber home).

    n_full: pairs that fully match (`full`), i.e. deliveries; sg_ok/em_ok:
    whether any pair there passes the flag. Everything the costs need, at a
    fraction of the rows: pairs fold within a task before any shuffle, and
    need none when they come partitioned by event (`spread_by_event`).
    """
    return pairs.groupBy("ek", "home", "origin", "tid", "payload").agg(
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
