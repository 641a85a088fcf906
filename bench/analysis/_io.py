"""Reading traces into Spark with their line numbers, and validating them in the executors.

Workload traces (docs/design.md §4) and node message traces come as JSON
Lines or Parquet. Every record keeps where it came from (`file`: index of
its file in sorted path order, `line`: 1-based line of a JSON Lines file or
row of a Parquet file) so that a malformed record is reported by number, and
so that ties in ``t`` are broken by line as the trace semantics require.
``k`` packs both into one sortable long: ``file * 2**40 + line``.

Workload records are validated by the routing core's `parse_op` inside the
executors (`parse_workload`); a record it rejects becomes a row with `err`
set instead of failing the job.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import shapely
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from geofed.routing import (
    DEFAULT_MAX_VERTICES,
    Federation,
    GeofedError,
    Geofence,
    GeofenceCache,
    InvalidInput,
    parse_op,
)

from ._geo import H3_RES_MAX, FederationIndex, fence_id, h3_cell

LINE_BITS = 40
"""``k = file << LINE_BITS | line``: up to 2**40 lines per file, 2**23 files."""

WORKLOAD_REQUIRED = ("t", "op", "client", "lat", "lon", "id", "topic")
WORKLOAD_OPTIONAL = ("geofence", "payload_size", "roaming")
ROAMING_UNSUPPORTED = "roaming geofences are not supported by the Spark analysis"
"""Error of a record with a roaming geofence: the job refuses the workload (`geofed simulate`
predicts and checks such traces)."""

NODE_REQUIRED = ("strategy", "src", "dst", "kind")
NODE_OPTIONAL = ("t", "ids", "topic", "bytes")
NODE_KINDS = ("event", "subscribe", "unsubscribe", "delivery", "control")
NODE_SCHEMA = (
    "t double, strategy string, src string, dst string, kind string,"
    " ids array<string>, topic string, bytes long"
)

PARSED_SCHEMA = pa.schema(
    [
        ("k", pa.int64()),
        ("file", pa.int32()),
        ("line", pa.int64()),
        ("op", pa.string()),
        ("t", pa.float64()),
        ("client", pa.string()),
        ("lat", pa.float64()),
        ("lon", pa.float64()),
        ("id", pa.string()),
        ("topic", pa.string()),
        ("fence", pa.int64()),
        ("meet", pa.list_(pa.int32())),
        ("wkb", pa.binary()),
        ("payload", pa.int64()),
        ("home", pa.int32()),
        ("cell", pa.int64()),
        ("err", pa.string()),
    ]
)
"""One validated workload op per row (or `err` and where it came from).

fence: id of the geofence (null: the whole world); meet: indices of the
brokers it meets; wkb: its geometry, on the first row of each fence in a
partition only; home: index of the broker responsible for the op's location;
cell: H3 cell of a publish location at `H3_RES_MAX`.
"""


class Inputs:
    """The files of one trace argument and their indices (the `file` column)."""

    def __init__(self, files: Sequence[str]) -> None:
        self.files = list(files)

    def name(self, index: int) -> str:
        """A short name of file `index` for messages."""
        return os.path.basename(self.files[index]) if 0 <= index < len(self.files) else "?"


def detect_format(paths: Sequence[str], given: str | None = None) -> str:
    """``parquet`` or ``json``: as given, else Parquet if every path looks like Parquet."""
    if given:
        return given

    def is_parquet(p: str) -> bool:
        path = Path(p)
        if path.is_dir():
            return any(path.glob("*.parquet")) or any(path.glob("**/*.parquet"))
        return p.endswith(".parquet")

    return "parquet" if paths and all(is_parquet(p) for p in paths) else "json"


def _check_paths(paths: Sequence[str], what: str) -> None:
    for p in paths:
        if "://" not in p and not Path(p).exists():
            raise InvalidInput(what, f"{p}: no such file or directory")


def read_numbered(
    spark: SparkSession,
    paths: Sequence[str],
    fmt: str,
    *,
    what: str,
    required: Sequence[str] = (),
    optional: Sequence[str] = (),
) -> tuple[DataFrame, Inputs]:
    """Read JSON Lines (as column `value`) or Parquet (its columns) with src, line and k.

    Raises:
        InvalidInput: naming `what` and the column when a Parquet input lacks a
            required column, or the path when it does not exist.
    """
    _check_paths(paths, what)
    if fmt == "parquet":
        return _numbered_parquet(spark, paths, what, required, optional)
    return _numbered_text(spark, paths)


def _numbered_text(spark: SparkSession, paths: Sequence[str]) -> tuple[DataFrame, Inputs]:
    raw = spark.read.text(list(paths)).select(
        "value",
        F.col("_metadata.file_path").alias("_file"),
        F.col("_metadata.file_block_start").alias("_block"),
        F.spark_partition_id().alias("_pid"),
        F.monotonically_increasing_id().alias("_mid"),
    )
    # Line numbers without a pass through Python: a file split is read by one
    # task in order, so a line's number is the lines of the file's earlier
    # splits plus its position in its own split. One row per split reaches
    # the driver.
    splits = (
        raw.groupBy("_file", "_block", "_pid")
        .agg(F.count(F.lit(1)).alias("n"), F.min("_mid").alias("m0"))
        .collect()
    )
    files = sorted({r["_file"] for r in splits})
    src_of = {f: i for i, f in enumerate(files)}
    rows: list[tuple[str, int, int, int, int]] = []
    for f in files:
        before = 0
        for r in sorted((r for r in splits if r["_file"] == f), key=lambda r: r["_block"]):
            rows.append((f, r["_block"], r["_pid"], src_of[f], before - r["m0"] + 1))
            before += r["n"]
    base = spark.createDataFrame(rows, "_file string, _block long, _pid int, file int, _base long")
    line = F.col("_mid") + F.col("_base")
    numbered = raw.join(F.broadcast(base), ["_file", "_block", "_pid"]).select(
        ((F.col("file").cast("long") * (1 << LINE_BITS)) + line).alias("k"),
        "file",
        line.alias("line"),
        "value",
    )
    return numbered, Inputs(files)


def _numbered_parquet(
    spark: SparkSession,
    paths: Sequence[str],
    what: str,
    required: Sequence[str],
    optional: Sequence[str],
) -> tuple[DataFrame, Inputs]:
    try:
        df = spark.read.parquet(*paths)
    except Exception as exc:  # Spark raises its own analysis errors for unreadable files
        raise InvalidInput(what, f"cannot read Parquet {', '.join(paths)}: {exc}") from None
    present = set(df.columns)
    for col in required:
        if col not in present:
            raise InvalidInput(f"{what}.{col}", f"required column missing from {', '.join(paths)}")
    # The paths as the scan spells them (inputFiles() may spell them otherwise):
    # one row per file reaches the driver.
    files = sorted(r[0] for r in df.select("_metadata.file_path").distinct().collect())
    src_of = F.create_map(*[x for i, f in enumerate(files) for x in (F.lit(f), F.lit(i))])
    index = src_of[F.col("_metadata.file_path")].cast("int")
    line = F.col("_metadata.row_index") + 1
    cols = [c for c in (*required, *optional) if c in present]
    numbered = df.select(
        ((index.cast("long") * (1 << LINE_BITS)) + line).alias("k"),
        index.alias("file"),
        line.alias("line"),
        *cols,
    )
    return numbered, Inputs(files)


# --------------------------------------------------------------------------
# Workload parsing in the executors

_WORKER: dict[str, Any] = {}


def worker_federation(text: str) -> FederationIndex:
    """The federation of this job, built once per Python worker from the broadcast file text."""
    key = "fed:" + str(hash(text))
    fidx = _WORKER.get(key)
    if fidx is None:
        fidx = FederationIndex(Federation.from_geojson(json.loads(text)))
        _WORKER[key] = fidx
    return fidx


def parse_workload(fed_text: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The `mapInArrow` function validating workload records into `PARSED_SCHEMA` rows."""

    def parse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fidx = worker_federation(fed_text)
        cache = GeofenceCache(DEFAULT_MAX_VERTICES)
        ids: dict[Geofence, int] = {}
        meet: dict[int, list[int]] = {}
        shipped: set[int] = set()  # fences whose geometry this partition already emitted
        for batch in batches:
            yield _parse_batch(batch, fidx, cache, ids, meet, shipped)

    return parse


def _record(row: dict[str, Any]) -> dict[str, Any]:
    # Parquet columns are typed: a float payload_size column (what pandas
    # writes for an integer column with nulls) holding whole numbers means
    # integers. JSON text stays as written.
    size = row.get("payload_size")
    if isinstance(size, float) and size.is_integer():
        row["payload_size"] = int(size)
    return row


def _parse_batch(
    batch: pa.RecordBatch,
    fidx: FederationIndex,
    cache: GeofenceCache,
    ids: dict[Geofence, int],
    meet: dict[int, list[int]],
    shipped: set[int],
) -> pa.RecordBatch:
    cols = batch.to_pydict()
    n = batch.num_rows
    text = cols.get("value")
    out: dict[str, list[Any]] = {name: [] for name in PARSED_SCHEMA.names}
    fences: list[Geofence | None] = []
    for i in range(n):
        line = cols["line"][i]
        err: str | None = None
        op = None
        if text is not None:
            value = text[i]
            if not value.strip():
                continue  # blank lines are skipped, as read_trace does
            try:
                record: Any = json.loads(value)
            except json.JSONDecodeError as exc:
                err = f"line {line}: not JSON: {exc.msg}"
            except RecursionError:
                err = f"line {line}: not JSON: nested too deeply"
        else:
            record = _record({c: cols[c][i] for c in cols if c not in ("k", "file", "line")})
        if err is None:
            try:
                op = parse_op(record, line, cache)
            except GeofedError as exc:
                err = str(exc)
            except Exception as exc:  # a core bug must not hide a row: report it as one
                err = f"line {line}: unexpected {type(exc).__name__}: {exc}"
            if op is not None and op.roaming is not None:
                op, err = None, f"line {line}: roaming: {ROAMING_UNSUPPORTED}"
        out["k"].append(cols["k"][i])
        out["file"].append(cols["file"][i])
        out["line"].append(line)
        out["err"].append(err)
        if op is None:
            for name in ("op", "t", "client", "lat", "lon", "id", "topic", "payload"):
                out[name].append(None)
            fences.append(None)
            continue
        out["op"].append(op.op)
        out["t"].append(op.t)
        out["client"].append(op.client)
        out["lat"].append(op.location.lat if op.location is not None else None)
        out["lon"].append(op.location.lon if op.location is not None else None)
        out["id"].append(op.id or None)
        out["topic"].append(op.topic or None)
        out["payload"].append(op.payload_size if op.op == "publish" else None)
        fences.append(op.geofence)

    m = len(out["k"])
    lat = np.array([np.nan if v is None else v for v in out["lat"]], dtype=np.float64)
    lon = np.array([np.nan if v is None else v for v in out["lon"]], dtype=np.float64)
    located = np.flatnonzero(~np.isnan(lat))
    home: list[int | None] = [None] * m
    for i, h in zip(
        located.tolist(), fidx.responsible(lat[located], lon[located]).tolist(), strict=True
    ):
        home[i] = h
    out["home"] = home
    out["cell"] = [
        h3_cell(out["lat"][i], out["lon"][i], H3_RES_MAX) if out["op"][i] == "publish" else None
        for i in range(m)
    ]

    # Geofences: one id per distinct shape, the brokers it meets computed once
    # per partition in one vectorized query, the geometry shipped once.
    new = [f for f in {f for f in fences if f is not None} if f not in ids]
    if len(ids) > 50_000:
        ids.clear()  # bounded; the geofence cache drops its objects in the same way
    for f in new:
        ids[f] = fence_id(f)
    todo = {ids[f]: f for f in new if ids[f] not in meet}
    if todo:
        for fid, brokers in zip(
            todo, fidx.meeting([f.geometry for f in todo.values()]), strict=True
        ):
            meet[fid] = brokers
    for fence in fences:
        if fence is None:
            out["fence"].append(None)
            out["meet"].append(None)
            out["wkb"].append(None)
            continue
        fid = ids[fence]
        out["fence"].append(fid)
        out["meet"].append(meet[fid])
        if fid in shipped:
            out["wkb"].append(None)
        else:
            shipped.add(fid)
            out["wkb"].append(shapely.to_wkb(fence.geometry))
    return pa.RecordBatch.from_pydict(out, schema=PARSED_SCHEMA)


# --------------------------------------------------------------------------
# Node message traces


def parse_node_trace(numbered: DataFrame, fmt: str, broker_ids: Sequence[str]) -> DataFrame:
    """Typed node-trace rows with `err` naming what is wrong (null for a good row).

    JSON Lines are decoded in the JVM (``from_json``): node traces are as long
    as the message stream, and their schema is flat. A line that is not a JSON
    object, a field of the wrong type or an unknown strategy, kind or broker
    becomes an error row.
    """
    from geofed.routing import STRATEGIES

    if fmt == "json":
        value = F.trim(F.col("value"))
        rec = F.from_json(F.col("value"), NODE_SCHEMA, {"mode": "PERMISSIVE"})
        typed = (
            numbered.where(value != "")
            .select(
                "k",
                "file",
                "line",
                # from_json gives a row of nulls for text that is not an object.
                (value.startswith("{") & value.endswith("}")).alias("_obj"),
                F.get_json_object("value", "$.bytes").alias("_bytes_raw"),
                F.get_json_object("value", "$.t").alias("_t_raw"),
                rec.alias("r"),
            )
            .select("k", "file", "line", "_obj", "_bytes_raw", "_t_raw", "r.*")
        )
    else:
        present = set(numbered.columns)
        fields = [f.split() for f in NODE_SCHEMA.split(",")]
        typed = numbered.select(
            "k",
            "file",
            "line",
            F.lit(True).alias("_obj"),
            (F.col("bytes").cast("string") if "bytes" in present else F.lit(None)).alias(
                "_bytes_raw"
            ),
            (F.col("t").cast("string") if "t" in present else F.lit(None)).alias("_t_raw"),
            *[
                (F.col(c).cast(t) if c in present else F.lit(None).cast(t)).alias(c)
                for c, t in fields
            ],
        )
    known = F.array(*[F.lit(b) for b in broker_ids])
    checks = [
        (~F.col("_obj"), "not a JSON object"),
        (
            ~F.coalesce(F.col("strategy").isin(*STRATEGIES), F.lit(False)),
            "strategy: unknown or missing",
        ),
        (~F.coalesce(F.col("kind").isin(*NODE_KINDS), F.lit(False)), "kind: unknown or missing"),
        (
            ~F.coalesce(F.array_contains(known, F.col("src")), F.lit(False)),
            "src: not a broker of the federation",
        ),
        (
            ~F.coalesce(F.array_contains(known, F.col("dst")), F.lit(False)),
            "dst: not a broker of the federation",
        ),
        (F.coalesce(F.col("src") == F.col("dst"), F.lit(False)), "dst: same broker as src"),
        (
            F.col("_bytes_raw").isNotNull() & ~F.coalesce(F.col("bytes") >= 0, F.lit(False)),
            "bytes: must be an integer >= 0",
        ),
        (F.col("_t_raw").isNotNull() & F.col("t").isNull(), "t: must be a number"),
    ]
    problems = F.concat_ws("; ", *[F.when(cond, F.lit(msg)) for cond, msg in checks])
    err = F.when(
        problems != "",
        F.concat(F.lit("line "), F.col("line").cast("string"), F.lit(": "), problems),
    )
    return typed.select(
        "k",
        "file",
        "line",
        "t",
        "strategy",
        "src",
        "dst",
        "kind",
        "ids",
        "topic",
        "bytes",
        err.alias("err"),
    )
