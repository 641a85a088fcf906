"""The analysis job: from trace files to the message tables, stage by stage.

`analyze` wires the DataFrame -> DataFrame steps of `_io`, `_state`,
`_match` and `_cost` together, materializes the few intermediate results
that are used more than once, and collects only bounded summaries (one row
per strategy, kind, region pair, top topic or error, capped) to the driver.
Writing files is `_report`'s job.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TextIO

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from geofed.cli.progress import bar as progress_bar
from geofed.cli.progress import enabled as progress_enabled
from geofed.cli.progress import write as progress_write
from geofed.routing import STRATEGIES, Federation, InvalidInput, federation_path

from . import _cost as cost
from . import _fs as fs
from . import _io as io
from . import _match as match
from . import _state as state
from ._geo import choose_resolution
from ._session import is_local


@dataclass(frozen=True)
class AnalysisConfig:
    """What to analyze and a few knobs; every field has a usable default but the inputs."""

    federation: str
    """Federation file (GeoJSON FeatureCollection, docs/design.md §2)."""
    workload: tuple[str, ...]
    """Workload trace files or folders (JSON Lines or Parquet, docs/design.md §4)."""
    node_traces: tuple[str, ...] = ()
    """Node message trace files or folders (optional; see README.md, section "Analysis")."""
    workload_format: str | None = None
    """``json`` or ``parquet``; None: by content (Parquet files start with ``PAR1``)."""
    node_format: str | None = None
    """As `workload_format`, for the node traces."""
    h3_res: int | None = None
    """H3 resolution of the spatial join key; None: picked from the geofence sizes."""
    max_errors: int = 100
    """Malformed rows listed individually (all are counted)."""
    broadcast_bytes: int = 64 << 20
    """Geofence shapes shipped to executors as a broadcast up to this many WKB bytes."""
    broadcast_rows: int = 2_000_000
    """Small join sides (topic x filter, segment cells) are broadcast below this many rows."""
    top_topics: int = 10
    """Topics listed per strategy in the summary (all are in messages.parquet)."""
    checkpoint_dir: str | None = None
    """Where intermediate tables are checkpointed (a folder or URI every executor can
    write and read, e.g. on HDFS or S3); None: a temporary local folder, which
    only a local master can use. The job's files there are deleted at the end."""


@dataclass
class Analysis:
    """Results: a JSON-able summary plus the tables too large to collect."""

    summary: dict[str, Any]
    messages: DataFrame
    malformed: DataFrame | None = None
    comparison: DataFrame | None = None
    comparison_topics: DataFrame | None = None
    _cleanup: list[Any] = field(default_factory=list)

    def release(self) -> None:
        """Unpersist cached tables, destroy broadcasts, delete the job's checkpoints."""
        _release(self._cleanup)


def _release(items: list[Any]) -> None:
    for item in items:
        if isinstance(item, DataFrame):
            item.unpersist()
        elif callable(item):
            item()
        elif hasattr(item, "release"):
            item.release()
        else:
            item.destroy()
    items.clear()


class Progress:
    """One line per stage on stderr with the elapsed time, plus a heartbeat for long stages.

    On a terminal (see `geofed.cli.progress`) the stage being run is a live
    line instead (its name, elapsed time and Spark's task counts, redrawn in
    place), replaced by the stage's "done" line; elsewhere (logs, a pipe) the
    heartbeat prints a line every `heartbeat_s` seconds, never a carriage return.
    """

    def __init__(
        self,
        spark: SparkSession | None = None,
        out: TextIO | None = None,
        heartbeat_s: float = 30.0,
    ) -> None:
        self.t0 = time.monotonic()
        self.out = out if out is not None else sys.stderr
        self.spark = spark
        self.timings: dict[str, float] = {}
        self.live = progress_enabled(self.out)
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if spark is not None and heartbeat_s > 0:
            every = min(heartbeat_s, 1.0) if self.live else heartbeat_s
            self._thread = threading.Thread(target=self._beat, args=(every,), daemon=True)
            self._thread.start()

    def say(self, text: str) -> None:
        """Print one progress line."""
        line = f"[geofed analyze {time.monotonic() - self.t0:8.1f}s] {text}"
        if self.live:
            progress_write(line, self.out)  # above the live line, which stays
        else:
            print(line, file=self.out, flush=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a stage; Spark jobs started inside carry its name (Spark UI, logs)."""
        if self.live:
            self._bar = progress_bar(
                f"[geofed analyze] {name}",
                stream=self.out,
                bar_format="{desc} {elapsed}{postfix}",
            )
        else:
            self.say(f"{name} ...")
        if self.spark is not None:
            self.spark.sparkContext.setJobDescription(name)
        start = time.monotonic()
        try:
            yield
        finally:
            bar, self._bar = self._bar, None
            if bar is not None:
                bar.close()
        took = time.monotonic() - start
        self.timings[name] = round(took, 3)
        self.say(f"{name}: done in {took:.1f}s")

    def _beat(self, every: float) -> None:
        assert self.spark is not None
        tracker = self.spark.sparkContext.statusTracker()
        while not self._stop.wait(every):
            try:
                tasks = []
                for sid in tracker.getActiveStageIds():
                    info = tracker.getStageInfo(sid)
                    if info is not None:
                        tasks.append(
                            f"stage {sid}: {info.numCompletedTasks}/{info.numTasks} tasks"
                            f" ({info.numActiveTasks} running)"
                        )
                bar = self._bar
                if self.live:
                    if bar is not None:
                        bar.set_postfix_str("; ".join(tasks))  # redraws, elapsed too
                else:
                    for text in tasks:
                        self.say("  " + text)
            except Exception:  # the context may be stopping; a heartbeat is best effort
                return

    def close(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()


def _persist(df: DataFrame, cleanup: list[Any]) -> DataFrame:
    # Materialized and cut from its lineage: the later plans stay shallow
    # (Spark spends seconds planning deep ones, every action) and nothing
    # upstream (the Python parse, the UDFs) runs twice. A reliable checkpoint
    # (files in the checkpoint folder, compressed) rather than a local one
    # (blocks on the executors): when an executor is lost, its part is read
    # again from the files instead of failing the job.
    out = df.checkpoint(eager=True)
    cleanup.append(out)
    return out


def _checkpoints(spark: SparkSession, cfg: AnalysisConfig) -> Any:
    """Point the context's checkpoints at this job's folder; return what deletes it.

    Raises:
        InvalidInput: naming ``checkpoint_dir`` when none is given and the
            master is not local (a temporary folder on the driver is not one
            executors elsewhere can reach).
    """
    sc = spark.sparkContext
    made: str | None = None
    base = cfg.checkpoint_dir
    if base is None:
        if not is_local(sc.master):
            raise InvalidInput(
                "checkpoint_dir",
                f"master {sc.master}: give a folder every executor can reach (--checkpoint-dir)",
            )
        base = made = tempfile.mkdtemp(prefix="geofed-checkpoints-")
    sc.setCheckpointDir(base)  # Spark adds a folder of its own (a UUID) for this context
    own = sc._jsc.sc().getCheckpointDir().get()

    def cleanup() -> None:
        fs.remove(spark, own)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)

    return cleanup


def _union(*dfs: DataFrame) -> DataFrame:
    out = dfs[0]
    for df in dfs[1:]:
        out = out.unionByName(df)
    return out


def load_federation(path: str) -> tuple[Federation, str]:
    """The federation and its file text (which executors rebuild it from).

    Raises:
        InvalidInput: naming the file, or the feature and field that is wrong.
    """
    file = federation_path(path)  # a bundled name too
    return Federation.load(file), file.read_text(encoding="utf-8")


def analyze(spark: SparkSession, cfg: AnalysisConfig, progress: Progress | None = None) -> Analysis:
    """Run the what-if (and, with node traces, the measured) analysis.

    The result holds the job's checkpoints until `Analysis.release`; a job
    that fails deletes them before it raises.

    Raises:
        InvalidInput: for an unreadable or invalid federation file, a missing
            input or a Parquet input without a required column.
    """
    keep: list[Any] = []
    try:
        return _analyze(spark, cfg, progress or Progress(None), keep)
    except BaseException:
        # Best effort: the job's own error is the one to report.
        with suppress(Exception):
            _release(keep)
        raise


def _analyze(
    spark: SparkSession, cfg: AnalysisConfig, progress: Progress, keep: list[Any]
) -> Analysis:
    sc = spark.sparkContext
    fed, fed_text = load_federation(cfg.federation)
    ids = fed.ids
    n = len(ids)
    if cfg.h3_res is not None and not 2 <= cfg.h3_res <= 10:
        raise InvalidInput("h3_res", f"must be within [2, 10], got {cfg.h3_res}")
    summary: dict[str, Any] = {
        "federation": {"file": cfg.federation, "brokers": list(ids)},
        "workload": {"files": [], "format": None},
    }

    keep.append(_checkpoints(spark, cfg))

    # -- validate ---------------------------------------------------------
    with progress.stage("workload: numbering lines"):
        wfmt, wfiles = fs.detect_format(spark, cfg.workload, cfg.workload_format, "workload")
        numbered, inputs = io.read_numbered(
            spark,
            wfiles,
            wfmt,
            what="workload",
            required=io.WORKLOAD_REQUIRED,
            optional=io.WORKLOAD_OPTIONAL,
        )
    summary["workload"] = {"files": inputs.files, "format": wfmt}
    with progress.stage("workload: validating ops"):
        workload = io.parse_workload(
            io.workload_records(numbered, wfmt),
            numbered,
            wfmt,
            fed_text,
            lambda df: _persist(df, keep),
            cfg.broadcast_rows,
        )
        parsed = workload.parsed
        by_op = dict(workload.by_op)
        bad = by_op.pop(None, 0)  # error rows have no op
        # Each query reads the whole checkpoint back: none for a clean trace.
        errors = (
            [
                {"file": inputs.name(r["file"]), "line": int(r["line"]), "error": r["err"]}
                for r in parsed.where(F.col("err").isNotNull())
                .orderBy("k")
                .select("file", "line", "err")
                .limit(cfg.max_errors)
                .collect()
            ]
            if bad
            else []
        )
        roaming = (
            parsed.where(F.col("err").contains(io.ROAMING_UNSUPPORTED))
            .orderBy("k")
            .select("file", "line")
            .limit(1)
            .collect()
            if bad
            else []
        )
    if roaming:
        where = f"{inputs.name(roaming[0]['file'])} line {roaming[0]['line']}"
        raise InvalidInput(
            "workload.roaming",
            f"{where} and maybe more: {io.ROAMING_UNSUPPORTED}; `geofed simulate` predicts"
            " and checks traces with roaming geofences",
        )
    summary["ops"] = {"valid": sum(by_op.values()), "malformed": bad, "by_op": by_op}
    summary["errors"] = {"total": bad, "shown": errors}
    progress.say(f"  {sum(by_op.values()):,} valid ops, {bad:,} malformed")

    ops = state.valid_ops(parsed)
    ev = match.events(ops)

    # -- subscriptions over time --------------------------------------------
    with progress.stage("subscriptions: ownership, versions, re-homing, segments"):
        accepted = state.accepted_subscription_ops(ops)
        vers = _persist(state.versions(accepted), keep)
        located = _persist(state.located_ops(ops, vers.select("client").distinct()), keep)
        vrh = _persist(state.version_rehomings(vers, state.rehomings(located)), keep)
        segs = _persist(state.segments(vers, vrh), keep)
        n_versions = vers.count()
        n_segments = segs.count()
        n_rehome = vrh.count()
    summary["subscriptions"] = {
        "versions": n_versions,
        "segments": n_segments,
        "renewed_by_rehoming": n_rehome,
        "subscribe_ops_ignored": by_op.get("subscribe", 0) - n_versions,
    }

    # -- spatial key --------------------------------------------------------
    with progress.stage("geofences: H3 cover of subscription geofences"):
        shapes = workload.shapes.dropDuplicates(["fence"])
        sub_fences = _persist(shapes.join(vers.select("fence"), "fence", "left_semi"), keep)
        res = cfg.h3_res
        if res is None:
            median = (
                match.fence_extents(sub_fences).agg(F.percentile_approx("extent_km", 0.5)).first()
            )
            res = choose_resolution(None if median is None else median[0])
        cells = _persist(match.fence_cells(sub_fences, res), keep)
        side = match.segment_side(segs)
        keyed = _persist(match.keyed_segments(side, cells), keep)
        unkeyed = _persist(match.unkeyed_segments(side, cells), keep)
        n_keyed, n_unkeyed = keyed.count(), unkeyed.count()
    summary["matching"] = {
        "h3_resolution": res,
        "keyed_segment_cells": n_keyed,
        "unkeyed_segments": n_unkeyed,
    }

    # -- content ------------------------------------------------------------
    with progress.stage("topics: topic x filter table"):
        # Distinct filters: at most one per subscription, never per event.
        filters = sorted(r["filter"] for r in segs.select("filter").distinct().collect())
        fbc = sc.broadcast(filters)
        keep.append(fbc)
        tf = _persist(
            match.with_topic_ids(match.topic_filter_pairs(ev.select("topic").distinct(), fbc)),
            keep,
        )
        n_tf = tf.count()
    summary["matching"].update({"filters": len(filters), "topic_filter_pairs": n_tf})

    # -- matching -----------------------------------------------------------
    with progress.stage("matching: candidates and exact Subscription GeoCheck"):
        small = cfg.broadcast_rows
        tf_side = F.broadcast(tf) if n_tf <= small else tf
        topics = tf.select("tid", "topic").distinct()
        sgeom = match.FenceGeometry(spark, sub_fences, cfg.broadcast_bytes)
        keep.append(sgeom)
        # World subscriptions of events without a geofence are counted, not
        # paired (see `match.world_steps`); geofenced segments without a
        # cover still pair on the filter alone.
        world_segs = unkeyed.where(F.col("sfence").isNull())
        positions = _persist(match.world_positions(world_segs), keep)
        steps = _persist(match.world_steps(world_segs, positions, tf), keep)
        broadcast_steps = steps.count() <= small

        def pairs_of(events: DataFrame, unkeyed_side: DataFrame, *carry: str) -> DataFrame:
            to_check, world = match.candidates(
                events.join(tf_side, "topic").drop("topic"),
                keyed,
                unkeyed_side,
                res,
                broadcast_keyed=n_keyed <= small,
                broadcast_unkeyed=n_unkeyed <= small,
            )
            checked = (
                sgeom.with_covers(to_check, "sfence", "lat", "lon", "sgeo")
                .where("sgeo")
                .drop("sgeo")
            )
            return match.matched_pairs(checked.unionByName(world), *carry)

        # Events without a geofence pass the Event GeoCheck everywhere: their
        # pairs fold right away. The others wait for subscriber locations.
        plain = ev.where(F.col("efence").isNull())
        uncovered = unkeyed.where(F.col("sfence").isNotNull())
        homes_plain = match.per_home(pairs_of(plain, uncovered), F.lit(True), "et")
        fenced = _persist(pairs_of(ev.where(F.col("efence").isNotNull()), unkeyed), keep)
        n_fenced = fenced.count()

    with progress.stage(
        "matching: Event GeoCheck at subscriber locations, pairs per (event, home)"
    ):
        egeom = match.FenceGeometry(
            spark,
            shapes.join(fenced.select(F.col("efence").alias("fence")), "fence", "left_semi"),
            cfg.broadcast_bytes,
        )
        keep.append(egeom)
        at = match.subscriber_locations(fenced, located)
        checked = egeom.with_covers(at, "efence", "slat", "slon", "egeo")
        tally = _persist(
            cost.merge_tallies(
                match.world_tally(
                    match.with_step_index(plain, positions),
                    topics,
                    steps,
                    broadcast=broadcast_steps,
                ),
                match.with_world_steps(homes_plain, steps, broadcast=broadcast_steps),
                cost.delivery_tally(match.per_home(checked, F.col("egeo"))),
            ),
            keep,
        )
        totals = tally.agg(F.sum("n_full").alias("d"), F.sum("rows").alias("h")).first()
        assert totals is not None
        deliveries = int(totals["d"] or 0)
    summary["matching"].update(
        {"pairs_awaiting_event_geocheck": n_fenced, "event_home_rows": int(totals["h"] or 0)}
    )
    summary["deliveries"] = deliveries
    summary["events"] = by_op.get("publish", 0)

    # -- costs --------------------------------------------------------------
    with progress.stage("costs: messages per strategy, lower bound"):
        sources = state.subscription_message_sources(vers, vrh, segs)
        msgs = _union(
            cost.event_messages(ev, n),
            cost.subscription_messages(sources, n),
            cost.delivery_messages(tally, topics),
        )
        named = _persist(cost.with_broker_names(msgs, ids), keep)
        summary.update(_summaries(named, cfg.top_topics))
    malformed = parsed.where(F.col("err").isNotNull()).select(
        "file", "line", F.col("err").alias("error")
    )
    result = Analysis(summary, named, malformed=malformed, _cleanup=keep)

    # -- measured -----------------------------------------------------------
    if cfg.node_traces:
        with progress.stage("node traces: validating and comparing"):
            _measured(spark, cfg, ids, named, result)
    summary["timings_s"] = dict(progress.timings)
    return result


def _summaries(named: DataFrame, top: int) -> dict[str, Any]:
    totals = (
        named.groupBy("strategy", "kind")
        .agg(F.sum("messages").alias("messages"), F.sum("bytes").alias("bytes"))
        .collect()
    )
    per: dict[str, dict[str, Any]] = {
        s: {"messages": 0, "bytes": 0, "by_kind": {}} for s in (*STRATEGIES, cost.LOWER_BOUND)
    }
    for r in totals:
        entry = per[r["strategy"]]
        entry["by_kind"][r["kind"]] = {
            "messages": int(r["messages"]),
            "bytes": int(r["bytes"] or 0),
        }
        entry["messages"] += int(r["messages"])
        entry["bytes"] += int(r["bytes"] or 0)
    for entry in per.values():
        for kind in cost.KINDS:
            entry["by_kind"].setdefault(kind, {"messages": 0, "bytes": 0})
    for entry in per.values():
        entry["savings"] = {}
        for base in (cost.FLOOD_EVENTS, cost.FLOOD_SUBS):
            b = per[base]["messages"]
            saved = b - entry["messages"]
            entry["savings"][base] = {
                "messages": saved,
                "percent": round(100.0 * saved / b, 3) if b else None,
            }
        lb = per[cost.LOWER_BOUND]["messages"]
        entry["over_lower_bound"] = round(entry["messages"] / lb, 4) if lb else None
    matrix: dict[str, dict[str, dict[str, int]]] = {}
    for r in named.groupBy("strategy", "src", "dst").agg(F.sum("messages").alias("m")).collect():
        matrix.setdefault(r["strategy"], {}).setdefault(r["src"], {})[r["dst"]] = int(r["m"])
    by_topic = named.groupBy("strategy", "topic").agg(
        F.sum("messages").alias("messages"), F.sum("bytes").alias("bytes")
    )
    w = Window.partitionBy("strategy").orderBy(F.desc("messages"), "topic")
    topics: dict[str, list[dict[str, Any]]] = {}
    for r in (
        by_topic.withColumn("r", F.row_number().over(w))
        .where(F.col("r") <= top)
        .orderBy("strategy", "r")
        .collect()
    ):
        topics.setdefault(r["strategy"], []).append(
            {"topic": r["topic"], "messages": int(r["messages"]), "bytes": int(r["bytes"] or 0)}
        )
    return {"strategies": per, "matrix": matrix, "top_topics": topics}


def _measured(
    spark: SparkSession,
    cfg: AnalysisConfig,
    ids: tuple[str, ...],
    named: DataFrame,
    result: Analysis,
) -> None:
    nfmt, nfiles = fs.detect_format(spark, cfg.node_traces, cfg.node_format, "node trace")
    numbered, inputs = io.read_numbered(
        spark,
        nfiles,
        nfmt,
        what="node trace",
        required=io.NODE_REQUIRED,
        optional=io.NODE_OPTIONAL,
    )
    rows = _persist(io.parse_node_trace(numbered, nfmt, ids), result._cleanup)
    n_rows = rows.count()
    bad = rows.where(F.col("err").isNotNull())
    n_bad = bad.count()
    shown = [
        {"file": inputs.name(r["file"]), "line": int(r["line"]), "error": r["err"]}
        for r in bad.orderBy("k").select("file", "line", "err").limit(cfg.max_errors).collect()
    ]
    measured = cost.measured_messages(rows)
    cmp_cells = _persist(
        cost.compare(named, measured, ["strategy", "kind", "src", "dst"]), result._cleanup
    )
    cmp_topics = _persist(
        cost.compare(named, measured, ["strategy", "kind", "topic"]), result._cleanup
    )
    totals = (
        cost.compare(named, measured, ["strategy", "kind"]).orderBy("strategy", "kind").collect()
    )
    status_counts = {
        r["status"]: int(r["n"])
        for r in cmp_cells.groupBy("status").agg(F.count(F.lit(1)).alias("n")).collect()
    }
    differences = [
        r.asDict()
        for r in cmp_cells.where(F.col("status") != "ok")
        .orderBy(F.desc(F.abs(F.col("delta"))), "strategy", "kind", "src", "dst")
        .limit(cfg.max_errors)
        .collect()
    ]
    topic_diffs = cmp_topics.where(~F.col("status").isin("ok", "not-modelled")).count()
    dups = [r.asDict() for r in cost.duplicate_messages(rows).orderBy("strategy", "kind").collect()]
    result.summary["measured"] = {
        "files": inputs.files,
        "format": nfmt,
        "records": n_rows - n_bad,
        "errors": {"total": n_bad, "shown": shown},
        "by_strategy_kind": [r.asDict() for r in totals],
        "cells_by_status": status_counts,
        "differences": differences,
        "topic_differences": topic_diffs,
        "duplicates": dups,
    }
    result.comparison = cmp_cells
    result.comparison_topics = cmp_topics
