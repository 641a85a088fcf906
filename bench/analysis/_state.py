"""Time-ordered workload state as DataFrames: subscriptions, their homes, client locations.

The routing core's `predict` walks the trace once, in (t, line) order, keeping
dicts. Here the same state is built per key with window functions, so nothing
sequential runs on the driver:

- subscription ownership: per subscription id, in order, which subscribe and
  unsubscribe ops the federation accepts (a subscribe of an id live for another
  client and an unsubscribe of an id the client does not hold are ignored);
- *versions*: an accepted subscribe opens a version (id, client, filter,
  geofence) that lasts until the next accepted op on the id;
- *re-homings*: per client, the location ops whose responsible broker differs
  from the previous one (lag over the client's location ops);
- *segments*: a version split at its client's re-homings, each with the home
  broker that holds it, valid for events at positions in [start, end).

Positions are (t, k) pairs, compared lexicographically; k orders ties by file
and line (see `_io`). Every function here is DataFrame -> DataFrame.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

INF_T = float("inf")
INF_K = (1 << 63) - 1


def before(t1: Column, k1: Column, t2: Column, k2: Column) -> Column:
    """Position (t1, k1) comes strictly before (t2, k2)."""
    return (t1 < t2) | ((t1 == t2) & (k1 < k2))


def valid_ops(parsed: DataFrame) -> DataFrame:
    """The rows `parse_op` accepted."""
    return parsed.where(F.col("err").isNull()).drop("err", "file", "line")


def located_ops(ops: DataFrame, clients: DataFrame) -> DataFrame:
    """Location-carrying ops of the given clients: (client, t, k, lat, lon, home)."""
    return (
        ops.where(F.col("lat").isNotNull())
        .join(clients, "client", "left_semi")
        .select("client", "t", "k", "lat", "lon", "home")
    )


def accepted_subscription_ops(ops: DataFrame) -> DataFrame:
    """Subscribe and unsubscribe ops the federation accepts, per the ownership rule.

    Ownership of an id is a small state machine over that id's ops in order
    (free -> owned by the subscriber -> free on its unsubscribe); its steps do
    not compose into a window aggregate, so each id's ops are folded in the
    JVM with `aggregate`. Ids have a handful of ops each.
    """
    subops = ops.where(F.col("op").isin("subscribe", "unsubscribe")).select(
        "id", "t", "k", "client", "op", "topic", "fence", "meet", "home"
    )
    seq = subops.groupBy("id").agg(
        F.sort_array(
            F.collect_list(F.struct("t", "k", "client", "op", "topic", "fence", "meet", "home"))
        ).alias("seq")
    )
    init = F.struct(
        F.lit(None).cast("string").alias("owner"),
        F.slice("seq", 1, 0).alias("acc"),  # an empty array of the element type
    )

    def step(state: Column, x: Column) -> Column:
        owner = state["owner"]
        is_sub = x["op"] == "subscribe"
        ok = F.when(is_sub, owner.isNull() | (owner == x["client"])).otherwise(
            F.coalesce(owner == x["client"], F.lit(False))
        )
        new_owner = (
            F.when(ok & is_sub, x["client"]).when(ok, F.lit(None).cast("string")).otherwise(owner)
        )
        acc = F.when(ok, F.concat(state["acc"], F.array(x))).otherwise(state["acc"])
        return F.struct(new_owner.alias("owner"), acc.alias("acc"))

    accepted = seq.select("id", F.explode(F.aggregate("seq", init, step)["acc"]).alias("x"))
    return accepted.select("id", "x.*")


def versions(accepted: DataFrame) -> DataFrame:
    """One row per accepted subscribe: the subscription version it opens.

    Columns: vid (k of the subscribe), id, client, filter, fence, meet, start
    and end positions (end: the next accepted op on the id, or infinity),
    end_op, home0 (home at the subscribe), and for an update of the same
    client's live id (upd) the version it replaces (old_fence, old_meet,
    old_filter).
    """
    w = Window.partitionBy("id").orderBy("t", "k")
    a = accepted.select(
        "*",
        F.lead("t").over(w).alias("nt"),
        F.lead("k").over(w).alias("nk"),
        F.lead("op").over(w).alias("nop"),
        F.lag("op").over(w).alias("pop"),
        F.lag("fence").over(w).alias("pfence"),
        F.lag("meet").over(w).alias("pmeet"),
        F.lag("topic").over(w).alias("ptopic"),
    )
    return a.where(F.col("op") == "subscribe").select(
        F.col("k").alias("vid"),
        "id",
        "client",
        F.col("topic").alias("filter"),
        "fence",
        "meet",
        F.col("t").alias("start_t"),
        F.col("k").alias("start_k"),
        F.coalesce("nt", F.lit(INF_T)).alias("end_t"),
        F.coalesce("nk", F.lit(INF_K)).alias("end_k"),
        F.col("nop").alias("end_op"),
        F.col("home").alias("home0"),
        F.coalesce(F.col("pop") == "subscribe", F.lit(False)).alias("upd"),
        F.col("pfence").alias("old_fence"),
        F.col("pmeet").alias("old_meet"),
        F.col("ptopic").alias("old_filter"),
    )


def rehomings(located: DataFrame) -> DataFrame:
    """Location ops that change a client's home: (client, p_t, p_k, old, new)."""
    w = Window.partitionBy("client").orderBy("t", "k")
    prev = F.lag("home").over(w)
    return (
        located.select("client", "t", "k", "home", prev.alias("prev"))
        .where(F.col("prev").isNotNull() & (F.col("prev") != F.col("home")))
        .select(
            "client",
            F.col("t").alias("p_t"),
            F.col("k").alias("p_k"),
            F.col("prev").alias("old"),
            F.col("home").alias("new"),
        )
    )


def version_rehomings(vers: DataFrame, rehomes: DataFrame) -> DataFrame:
    """Re-homings each version lives through: start < p <= end.

    A version ended by the op at p itself is still live when that op first
    moves its client (an update's old version is withdrawn and renewed too).
    """
    v = vers.select(
        "vid", "client", "filter", "fence", "meet", "start_t", "start_k", "end_t", "end_k"
    )
    cond = (
        (v["client"] == rehomes["client"])
        & before(v["start_t"], v["start_k"], rehomes["p_t"], rehomes["p_k"])
        & ~before(v["end_t"], v["end_k"], rehomes["p_t"], rehomes["p_k"])
    )
    return v.join(rehomes, cond).select(
        "vid", v["client"], "filter", "fence", "meet", "end_t", "end_k", "p_t", "p_k", "old", "new"
    )


def segments(vers: DataFrame, vrh: DataFrame) -> DataFrame:
    """Versions split at re-homings: who holds a subscription, from when to when.

    Columns: vid, id, client, filter, fence, meet, home, seg_t/seg_k (start,
    inclusive), seg_end_t/seg_end_k (exclusive), last (the version's last
    segment), end_op.
    """
    cols = ["vid", "id", "client", "filter", "fence", "meet", "end_t", "end_k", "end_op"]
    starts = vers.select(
        *cols,
        F.col("start_t").alias("bt"),
        F.col("start_k").alias("bk"),
        F.col("home0").alias("home"),
    )
    info = vers.select("vid", "id", "end_op")
    moves = (
        vrh.where(before(F.col("p_t"), F.col("p_k"), F.col("end_t"), F.col("end_k")))
        .join(info, "vid")
        .select(
            *cols, F.col("p_t").alias("bt"), F.col("p_k").alias("bk"), F.col("new").alias("home")
        )
    )
    w = Window.partitionBy("vid").orderBy("bt", "bk")
    nxt_t = F.lead("bt").over(w)
    nxt_k = F.lead("bk").over(w)
    return starts.unionByName(moves).select(
        "vid",
        "id",
        "client",
        "filter",
        "fence",
        "meet",
        "home",
        F.col("bt").alias("seg_t"),
        F.col("bk").alias("seg_k"),
        F.coalesce(nxt_t, F.col("end_t")).alias("seg_end_t"),
        F.coalesce(nxt_k, F.col("end_k")).alias("seg_end_k"),
        nxt_t.isNull().alias("last"),
        "end_op",
    )


def subscription_message_sources(vers: DataFrame, vrh: DataFrame, segs: DataFrame) -> DataFrame:
    """What makes subscribe/unsubscribe messages, before any strategy picks targets.

    One row per cause: kind, src (the deciding broker), the geofence whose
    targets receive it (plus_world/plus_meet) and, for a geofence change, the
    geofence whose targets are spared (has_minus, minus_world/minus_meet),
    topic (the filter concerned). A strategy turns a row into
    ``subscription_targets(src, plus) - subscription_targets(src, minus)``.
    """

    def row(
        kind: str,
        src: Column,
        pw: Column,
        pm: Column,
        hm: bool,
        mw: Column,
        mm: Column,
        topic: Column,
    ) -> list[Column]:
        return [
            F.lit(kind).alias("kind"),
            src.alias("src"),
            pw.alias("plus_world"),
            pm.alias("plus_meet"),
            F.lit(hm).alias("has_minus"),
            mw.alias("minus_world"),
            mm.alias("minus_meet"),
            topic.alias("topic"),
        ]

    none_w = F.lit(None).cast("boolean")
    none_m = F.lit(None).cast("array<int>")
    world = F.col("fence").isNull()

    def plain(kind: str, src: Column) -> list[Column]:
        # The current version's geofence and filter, nothing spared.
        return row(kind, src, world, F.col("meet"), False, none_w, none_m, F.col("filter"))

    out = [
        # A subscribe (new or changed) goes along its path from its home.
        vers.select(*plain("subscribe", F.col("home0"))),
        # A change withdraws the old version where the new one does not go.
        vers.where("upd").select(
            *row(
                "unsubscribe",
                F.col("home0"),
                F.col("old_fence").isNull(),
                F.col("old_meet"),
                True,
                world,
                F.col("meet"),
                F.col("old_filter"),
            )
        ),
        # Re-homing: withdrawn at the old home, renewed at the new one.
        vrh.select(*plain("unsubscribe", F.col("old"))),
        vrh.select(*plain("subscribe", F.col("new"))),
        # An unsubscribe leaves from wherever the version ended up.
        segs.where(F.col("last") & (F.col("end_op") == "unsubscribe")).select(
            *plain("unsubscribe", F.col("home"))
        ),
    ]
    result = out[0]
    for df in out[1:]:
        result = result.unionByName(df)
    return result
