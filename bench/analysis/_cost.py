"""Inter-region messages per strategy, the lower bound, and measured-vs-predicted.

Strategies are the routing core's (`STRATEGIES`); which brokers a message
goes to is `Strategy.event_targets` / `subscription_targets` /
`delivery_targets` written over broker-index arrays:

| strategy | events to | subscriptions to | deliveries to |
|---|---|---|---|
| flooding-events | all - origin | - | - |
| flooding-subscriptions | - | all - home | remote homes meeting the event geofence |
| event-geofence | meets(event geofence) - origin | - | - |
| subscription-geofence | - | meets(subscription geofence) - home | as above, if origin in it (*) |

(*) if the origin is among the brokers the subscription geofence meets.

`tests/spark/test_spark_equivalence.py` holds the results against
`geofed.routing.predict` on random workloads.

The fact table (`MESSAGES_COLUMNS`) has one row per (strategy, kind, src,
dst, topic): ``messages`` logical messages and ``bytes`` of payload (events
and deliveries; 0 for subscription traffic). The lower bound is the
pseudo-strategy ``lower-bound`` with kind ``event``: per event, one message to
each remote broker hosting a matching subscription.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from geofed.routing import STRATEGIES

LOWER_BOUND = "lower-bound"
FLOOD_EVENTS = "flooding-events"
FLOOD_SUBS = "flooding-subscriptions"
EVENT_GEOFENCE = "event-geofence"
SUB_GEOFENCE = "subscription-geofence"
KINDS = ("event", "subscribe", "unsubscribe", "delivery")
MESSAGES_COLUMNS = ("strategy", "kind", "src", "dst", "topic", "messages", "bytes")

assert set(STRATEGIES) == {FLOOD_EVENTS, FLOOD_SUBS, EVENT_GEOFENCE, SUB_GEOFENCE}


def _all(n: int) -> Column:
    return F.array(*[F.lit(i) for i in range(n)])


def _without(brokers: Column, b: Column) -> Column:
    return F.filter(brokers, lambda x: x != b)


def _reach(world: Column, meet: Column, n: int) -> Column:
    # The brokers a geofence meets; a null geofence is the whole world.
    return F.when(world, _all(n)).otherwise(meet)


def _explode_targets(
    df: DataFrame, strategy: str, kind: Column, src: str, targets: Column
) -> DataFrame:
    # Targets first, in their own projection: an explode next to aliases of
    # the columns it reads trips Spark's lateral-alias resolution.
    return df.withColumn("_targets", targets).select(
        F.lit(strategy).alias("strategy"),
        kind.alias("kind"),
        F.col(src).alias("src"),
        F.explode("_targets").alias("dst"),
        "topic",
        F.col("n").alias("messages"),
        F.col("bytes").cast("long").alias("bytes"),
    )


def _tally(df: DataFrame) -> DataFrame:
    return df.groupBy("strategy", "kind", "src", "dst", "topic").agg(
        F.sum("messages").cast("long").alias("messages"), F.sum("bytes").cast("long").alias("bytes")
    )


def event_messages(events: DataFrame, n: int) -> DataFrame:
    """Event messages of the strategies that move events (the others send none)."""
    by = events.groupBy("origin", "topic", F.col("efence").isNull().alias("world"), "emeet").agg(
        F.count(F.lit(1)).alias("n"), F.sum("payload").alias("bytes")
    )
    # Both strategies from one pass over the grouped events.
    per = F.array(
        F.struct(F.lit(FLOOD_EVENTS).alias("s"), _without(_all(n), F.col("origin")).alias("d")),
        F.struct(
            F.lit(EVENT_GEOFENCE).alias("s"),
            _without(_reach(F.col("world"), F.col("emeet"), n), F.col("origin")).alias("d"),
        ),
    )
    out = by.withColumn("_p", F.explode(per)).select(
        F.col("_p.s").alias("strategy"),
        F.lit("event").alias("kind"),
        F.col("origin").alias("src"),
        F.explode("_p.d").alias("dst"),
        "topic",
        F.col("n").alias("messages"),
        F.col("bytes").cast("long").alias("bytes"),
    )
    return _tally(out)


def subscription_messages(sources: DataFrame, n: int) -> DataFrame:
    """Subscribe/unsubscribe messages of the strategies that move subscriptions."""
    keys = [
        "kind",
        "src",
        "plus_world",
        "plus_meet",
        "has_minus",
        "minus_world",
        "minus_meet",
        "topic",
    ]
    by = sources.groupBy(*keys).agg(F.count(F.lit(1)).alias("n")).withColumn("bytes", F.lit(0))
    none = F.array().cast("array<int>")
    src = F.col("src")

    def targets(path: str) -> Column:
        def along(world: str, meet: str) -> Column:
            if path == FLOOD_SUBS:
                return _without(_all(n), src)
            return _without(_reach(F.col(world), F.col(meet), n), src)

        spared = F.when(F.col("has_minus"), along("minus_world", "minus_meet")).otherwise(none)
        return F.array_except(along("plus_world", "plus_meet"), spared)

    out = [
        _explode_targets(by, s, F.col("kind"), "src", targets(s))
        for s in (FLOOD_SUBS, SUB_GEOFENCE)
    ]
    return _tally(out[0].unionByName(out[1]))


TALLY_KEYS = ("origin", "home", "tid", "sg_ok", "em_ok", "full")
"""What a `delivery_tally` row is counted by; ``rows``, ``bytes`` and ``n_full`` are sums."""


def delivery_tally(homes: DataFrame) -> DataFrame:
    """One row per (event, subscriber home) folded to what the costs and the summary need.

    `homes` holds each (event, home) with a subscription passing ContentCheck
    and Subscription GeoCheck (`_match.per_home`). The rows that share origin,
    home, topic and flags (sg_ok, em_ok, full: some pair fully matches) are
    counted together: ``rows`` (event-home rows), ``bytes`` (their payload)
    and ``n_full`` (deliveries). The result has at most topics x brokers^2 x 8
    rows, whatever the trace's length, so the job keeps this instead of the
    (event, home) table, which is several rows per event (its checkpoint and
    the reads of it cost more than the whole fold).
    """
    return homes.groupBy(*TALLY_KEYS[:-1], (F.col("n_full") > 0).alias("full")).agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum("payload").alias("bytes"),
        F.sum("n_full").alias("n_full"),
    )


def merge_tallies(*parts: DataFrame) -> DataFrame:
    """`delivery_tally` rows from parts counted apart (`_match.world_tally` and the like)."""
    return (
        reduce(DataFrame.unionByName, parts)
        .groupBy(*TALLY_KEYS)
        .agg(
            F.sum("rows").cast("long").alias("rows"),
            F.sum("bytes").cast("long").alias("bytes"),
            F.sum("n_full").cast("long").alias("n_full"),
        )
    )


def delivery_messages(tally: DataFrame, topics: DataFrame) -> DataFrame:
    """Deliveries and the lower bound, from `delivery_tally`'s rows.

    `topics` names the tally's topic numbers: (tid, topic) rows, one per tid.

    A remote home gets one delivery per event when it meets the event
    geofence (em_ok), under subscription-geofence only if the subscription's
    path reaches the publisher's broker (sg_ok); the lower bound counts
    remote homes with a full match. Each tally row stands for ``rows``
    (event, home) rows.
    """
    remote = tally.where(F.col("home") != F.col("origin")).join(F.broadcast(topics), "tid")
    labels = F.filter(
        F.array(
            F.when(
                F.col("em_ok"), F.struct(F.lit(FLOOD_SUBS).alias("s"), F.lit("delivery").alias("k"))
            ),
            F.when(
                F.col("em_ok") & F.col("sg_ok"),
                F.struct(F.lit(SUB_GEOFENCE).alias("s"), F.lit("delivery").alias("k")),
            ),
            F.when(
                F.col("full"),
                F.struct(F.lit(LOWER_BOUND).alias("s"), F.lit("event").alias("k")),
            ),
        ),
        lambda x: x.isNotNull(),
    )
    return (
        remote.withColumn("_l", F.explode(labels))
        .groupBy(
            F.col("_l.s").alias("strategy"), F.col("_l.k").alias("kind"), "origin", "home", "topic"
        )
        .agg(F.sum("rows").alias("messages"), F.sum("bytes").alias("bytes"))
        .select(
            "strategy",
            "kind",
            F.col("origin").alias("src"),
            F.col("home").alias("dst"),
            "topic",
            F.col("messages").cast("long").alias("messages"),
            F.col("bytes").cast("long").alias("bytes"),
        )
    )


def with_broker_names(messages: DataFrame, ids: Sequence[str]) -> DataFrame:
    """Broker indices replaced by broker ids."""
    names = F.array(*[F.lit(i) for i in ids])
    return messages.select(
        "strategy",
        "kind",
        F.element_at(names, F.col("src") + 1).alias("src"),
        F.element_at(names, F.col("dst") + 1).alias("dst"),
        "topic",
        "messages",
        "bytes",
    )


# --------------------------------------------------------------------------
# Measured


def measured_messages(node_rows: DataFrame) -> DataFrame:
    """The node traces' valid records as the fact table (one record = one message)."""
    return (
        node_rows.where(F.col("err").isNull())
        .groupBy("strategy", "kind", "src", "dst", "topic")
        .agg(F.count(F.lit(1)).alias("messages"), F.sum("bytes").cast("long").alias("bytes"))
    )


def duplicate_messages(node_rows: DataFrame) -> DataFrame:
    """(strategy, kind, duplicates): records repeating a (kind, src, dst, ids) already sent."""
    return (
        node_rows.where(
            F.col("err").isNull() & (F.col("kind") != "control") & F.col("ids").isNotNull()
        )
        .groupBy("strategy", "kind", "src", "dst", "ids")
        .agg(F.count(F.lit(1)).alias("n"))
        .where(F.col("n") > 1)
        .groupBy("strategy", "kind")
        .agg(F.sum(F.col("n") - 1).cast("long").alias("duplicates"))
    )


def compare(predicted: DataFrame, measured: DataFrame, keys: Sequence[str]) -> DataFrame:
    """Predicted and measured side by side on `keys`, each difference flagged.

    Only strategies that appear in the measurements are compared. status:
    ``ok``, ``differs`` (both sides, other counts), ``missing`` (predicted,
    not measured), ``unexpected`` (measured, not predicted), ``not-modelled``
    (control traffic, which the cost model leaves out).
    """
    strategies = measured.select("strategy").distinct()
    if "topic" in keys:
        # A node cannot name the topic of an unsubscription (the message
        # carries the subscription id only): neither side does, here.
        predicted = predicted.withColumn(
            "topic", F.when(F.col("kind") == "unsubscribe", F.lit(None)).otherwise(F.col("topic"))
        )
    p = (
        predicted.where(F.col("strategy") != LOWER_BOUND)
        .join(strategies, "strategy", "left_semi")
        .groupBy(*keys)
        .agg(F.sum("messages").alias("predicted"), F.sum("bytes").alias("predicted_bytes"))
    )
    m = measured.groupBy(*keys).agg(
        F.sum("messages").alias("measured"), F.sum("bytes").alias("measured_bytes")
    )
    j = p.join(m, list(keys), "full_outer")
    pred = F.coalesce("predicted", F.lit(0)).cast("long")
    meas = F.coalesce("measured", F.lit(0)).cast("long")
    status = (
        F.when(F.col("kind") == "control", "not-modelled")
        .when(pred == meas, "ok")
        .when(meas == 0, "missing")
        .when(pred == 0, "unexpected")
        .otherwise("differs")
    )
    return j.select(
        *keys,
        pred.alias("predicted"),
        meas.alias("measured"),
        (meas - pred).alias("delta"),
        F.coalesce("predicted_bytes", F.lit(0)).cast("long").alias("predicted_payload_bytes"),
        F.col("measured_bytes").cast("long").alias("measured_bytes"),
        status.alias("status"),
    )
