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
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import shapely
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from geofed.routing import (
    DEFAULT_MAX_VERTICES,
    MAX_ID_LENGTH,
    MAX_TOPIC_BYTES,
    Federation,
    GeofedError,
    Geofence,
    GeofenceCache,
    InvalidInput,
    TraceOp,
    parse_op,
)

from ._geo import H3_RES_MAX, FederationIndex, fence_id, h3_cell, h3_cells

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

    `paths` are files or folders (`_fs.detect_format` lists an input's files).

    Raises:
        InvalidInput: naming `what` and the column when a Parquet input lacks a
            required column.
    """
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
# Workload parsing: typed in the JVM, geometry in the executors' Python

# The typed record from_json reads. String fields take any JSON token (a
# number or an array comes back as its JSON text), number fields a number or
# Spark's NaN/Infinity spellings; anything else sets _corrupt.
WORKLOAD_JSON_SCHEMA = (
    "t double, op string, client string, lat double, lon double, id string, topic string,"
    " geofence string, payload_size long, roaming string, _corrupt string"
)
_JSON_OPTIONS = {
    "mode": "PERMISSIVE",
    "columnNameOfCorruptRecord": "_corrupt",
    "allowSingleQuotes": "false",  # json.loads refuses them
}
# One flat object: nothing nested (no trailing second object either, which
# from_json would ignore and json.loads refuses) and no escapes (whose edge
# cases, lone surrogates and the like, the two parsers decode differently).
_FLAT_OBJECT = r"^[ \t]*\{[^{}\\]*\}[ \t]*$"
# The JSON text of a non-string token as from_json hands it to a string
# field: a number, true/false/null, an array, a quoted NaN/Infinity.
_NOT_A_STRING = (
    r"^(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?|true|false|null|-?Infinity|NaN|[\[\"].*)$"
)
_NUMERIC_TYPES = ("tinyint", "smallint", "int", "bigint", "float", "double")
_OPTIONAL_TYPES = {"geofence": "string", "payload_size": "bigint", "roaming": "string"}
_STRING_FIELDS = ("op", "client", "id", "topic", "geofence")
_NUMBER_FIELDS = ("t", "lat", "lon", "payload_size")


def workload_records(numbered: DataFrame, fmt: str) -> DataFrame:
    """Numbered workload rows with typed fields and `_fast`: the JVM found the row valid.

    JSON Lines are decoded by ``from_json`` with `WORKLOAD_JSON_SCHEMA`;
    Parquet columns are checked as they are typed. `_fast` is a conservative
    pre-check of everything `parse_op` checks but the geofence: a row it
    passes is one `parse_op` accepts with the same values, so the executors
    only add geometry to it (`parse_workload`). Any other row (a malformed
    one, or one whose JSON the JVM cannot judge exactly) keeps its text in
    `value` (JSON) or its columns (Parquet) for `parse_op` itself, which
    names the field that is wrong. `tests/spark/test_spark_parse.py` holds
    the split against `parse_op` on random records.
    """
    if fmt == "json":
        rec = F.from_json(F.col("value"), WORKLOAD_JSON_SCHEMA, _JSON_OPTIONS)
        typed = numbered.select("k", "file", "line", "value", rec.alias("r")).select(
            "k", "file", "line", "value", "r.*"
        )
        fast = (
            F.col("value").rlike(_FLAT_OBJECT)
            & F.col("_corrupt").isNull()
            & F.col("roaming").isNull()  # a roaming geofence: parse_op refuses it by name
            & _valid(F.col, json=True)
        )
        return typed.select(
            "k",
            "file",
            "line",
            F.when(~fast, F.col("value")).alias("value"),  # the text only where Python needs it
            *[F.col(c) for c in ("t", "op", "client", "lat", "lon", "id", "topic", "geofence")],
            F.col("payload_size"),
            fast.alias("_fast"),
        )
    types = dict(numbered.dtypes)

    def typed_col(name: str) -> Column:
        # A column whose type parse_op would refuse (or that is absent) reads
        # as null here: its rows fail the pre-check unless null is fine.
        kind = types.get(name)
        want = "string" if name in _STRING_FIELDS else "double"
        if name in _STRING_FIELDS and kind == "string":
            return F.col(name)
        if name in _NUMBER_FIELDS and kind in _NUMERIC_TYPES:
            return F.col(name).cast(want)
        return F.lit(None).cast(want)

    def usable(name: str) -> bool:
        kind = types.get(name)
        if kind is None:
            return True  # absent: null, as in a record without the field
        return kind == "string" if name in _STRING_FIELDS else kind in _NUMERIC_TYPES

    fast = _valid(typed_col, json=False)
    if "roaming" in types:  # a roaming geofence: parse_op refuses it by name
        fast = fast & F.col("roaming").isNull()
    for name in (*_STRING_FIELDS, *_NUMBER_FIELDS):
        if not usable(name):
            fast = F.lit(False)
    # An optional column the file lacks reads as null, as a record without the field.
    for name, kind in _OPTIONAL_TYPES.items():
        if name not in types:
            numbered = numbered.withColumn(name, F.lit(None).cast(kind))
    return numbered.withColumn("_fast", fast)


def _valid(col: Callable[[str], Column], *, json: bool) -> Column:
    """The pre-check: the conditions of `parse_op`, as SQL over typed fields."""

    def text_ok(c: Column) -> Column:
        ok = c.isNotNull()
        return ok & ~c.rlike(_NOT_A_STRING) if json else ok

    def ident(name: str) -> Column:
        c = col(name)
        return text_ok(c) & F.length(c).between(1, MAX_ID_LENGTH) & ~c.rlike("[\\x00-\\x1f]")

    def topic_text(name: str) -> Column:
        c = col(name)
        return (
            text_ok(c)
            & (F.length(c) >= 1)
            & (F.instr(c, "\x00") == 0)
            & (F.octet_length(c) <= MAX_TOPIC_BYTES)
        )

    def finite(c: Column) -> Column:
        return c.isNotNull() & ~F.isnan(c)

    def located() -> Column:
        lat, lon = col("lat"), col("lon")
        return finite(lat) & lat.between(-90.0, 90.0) & finite(lon) & lon.between(-180.0, 180.0)

    topic = col("topic")
    sharp = F.instr(topic, "#")
    filter_ok = (
        topic_text("topic")
        # '+' only as a whole level
        & ~topic.rlike("[^/]\\+|\\+[^/]")
        # '#' only as the whole last level
        & ((sharp == 0) | (((topic == "#") | topic.endswith("/#")) & (sharp == F.length(topic))))
    )
    topic_ok = topic_text("topic") & (F.instr(topic, "+") == 0) & (sharp == 0)
    size = col("payload_size")
    size_ok = size.isNull() | (
        finite(size) & (size >= 0) & (size < 2.0**63) & (size == F.floor(size))
    )
    fence = col("geofence")
    fence_ok = fence.isNull() | text_ok(fence)  # parsed in Python (`_fast_batch`)
    t, op = col("t"), col("op")
    return (
        finite(t)
        & (t >= 0)
        & (t <= sys.float_info.max)
        & ident("client")
        & F.coalesce(
            F.when(op == "unsubscribe", ident("id"))
            .when(op == "move", located())
            .when(op == "subscribe", located() & ident("id") & fence_ok & filter_ok)
            .when(op == "publish", located() & ident("id") & fence_ok & topic_ok & size_ok),
            F.lit(False),
        )
    )


_WORKER: dict[str, Any] = {}


def worker_federation(text: str) -> FederationIndex:
    """The federation of this job, built once per Python worker from the broadcast file text."""
    key = "fed:" + str(hash(text))
    fidx = _WORKER.get(key)
    if fidx is None:
        fidx = FederationIndex(Federation.from_geojson(json.loads(text)))
        _WORKER[key] = fidx
    return fidx


class _Fences:
    """A partition's geofences: parsed once per text, an id and the brokers met once per shape,
    the geometry shipped on the first row that uses it."""

    def __init__(self, fidx: FederationIndex) -> None:
        self.fidx = fidx
        self.cache = GeofenceCache(DEFAULT_MAX_VERTICES)
        self.ids: dict[Geofence, int] = {}
        self.meet: dict[int, list[int]] = {}
        self.shipped: set[int] = set()

    def columns(self, fences: Sequence[Geofence | None]) -> tuple[list[Any], list[Any], list[Any]]:
        """fence, meet and wkb columns for one geofence per row (None: the world)."""
        new = [f for f in {f for f in fences if f is not None} if f not in self.ids]
        if len(self.ids) > 50_000:
            self.ids.clear()  # bounded; the geofence cache drops its objects in the same way
        for f in new:
            self.ids[f] = fence_id(f)
        todo = {self.ids[f]: f for f in new if self.ids[f] not in self.meet}
        if todo:
            met = self.fidx.meeting([f.geometry for f in todo.values()])
            for fid, brokers in zip(todo, met, strict=True):
                self.meet[fid] = brokers
        fid_col: list[Any] = []
        meet_col: list[Any] = []
        wkb_col: list[Any] = []
        for fence in fences:
            if fence is None:
                fid_col.append(None)
                meet_col.append(None)
                wkb_col.append(None)
                continue
            fid = self.ids[fence]
            fid_col.append(fid)
            meet_col.append(self.meet[fid])
            if fid in self.shipped:
                wkb_col.append(None)
            else:
                self.shipped.add(fid)
                wkb_col.append(shapely.to_wkb(fence.geometry))
        return fid_col, meet_col, wkb_col


def parse_workload(fed_text: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The `mapInArrow` function turning `workload_records` rows into `PARSED_SCHEMA` rows."""

    def parse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fences = _Fences(worker_federation(fed_text))
        for batch in batches:
            fast = np.asarray(batch.column("_fast").to_numpy(zero_copy_only=False), dtype=bool)
            fast_rows = np.flatnonzero(fast)
            slow_rows = np.flatnonzero(~fast)
            if len(fast_rows):
                yield from _fast_batch(batch.take(pa.array(fast_rows)), fences)
            if len(slow_rows):
                yield _slow_batch(batch.take(pa.array(slow_rows)), fences)

    return parse


def _fast_batch(batch: pa.RecordBatch, fences: _Fences) -> Iterator[pa.RecordBatch]:
    """Rows the JVM validated: the core's values, vectorized, plus geometry.

    The geofence is the one check left: its text goes through the core's
    parser (once per distinct text); a row whose geofence it refuses becomes
    an error row with the core's message, as `parse_op` would have raised it
    (every field parse_op checks before the geofence passed in the JVM).
    """
    # Only rows that carry a geofence reach Python objects, one by one.
    fenced = pc.and_(
        pc.is_valid(batch.column("geofence")),
        pc.is_in(batch.column("op"), pa.array(["subscribe", "publish"])),
    )
    rows = np.flatnonzero(np.asarray(fenced.to_numpy(zero_copy_only=False), dtype=bool))
    texts = batch.column("geofence").take(pa.array(rows)).to_pylist()
    lines = batch.column("line").take(pa.array(rows)).to_pylist()
    fence_of: list[Geofence | None] = [None] * batch.num_rows
    refused: dict[int, str] = {}
    for i, text, line in zip(rows.tolist(), texts, lines, strict=True):
        try:
            fence_of[i] = fences.cache.get(text, f"line {line}: geofence")
        except GeofedError as exc:
            refused[i] = str(exc)
        except Exception as exc:  # as in _slow_batch: a core bug is reported as a row
            refused[i] = f"line {line}: unexpected {type(exc).__name__}: {exc}"
    if refused:
        rows = pa.array(sorted(refused))
        yield _error_batch(batch.take(rows), [refused[i] for i in sorted(refused)])
        keep = np.ones(batch.num_rows, dtype=bool)
        keep[sorted(refused)] = False
        kept = np.flatnonzero(keep)
        batch = batch.take(pa.array(kept))
        fence_of = [fence_of[i] for i in kept.tolist()]
    op = batch.column("op")
    is_unsub = pc.equal(op, "unsubscribe")
    is_move = pc.equal(op, "move")
    is_pub = pc.equal(op, "publish")
    n = batch.num_rows
    null_f64 = pa.nulls(n, pa.float64())
    lat = pc.cast(batch.column("lat"), pa.float64(), safe=False)
    lon = pc.cast(batch.column("lon"), pa.float64(), safe=False)
    lat = pc.if_else(is_unsub, null_f64, lat)
    lon = pc.if_else(is_unsub, null_f64, lon)
    la = np.asarray(pc.fill_null(lat, np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)
    lo = np.asarray(pc.fill_null(lon, np.nan).to_numpy(zero_copy_only=False), dtype=np.float64)
    located = np.flatnonzero(~np.isnan(la))
    home = np.zeros(n, dtype=np.int32)
    home[located] = _per_point(la[located], lo[located], fences.fidx.responsible)
    home_mask = np.isnan(la)
    pub = np.asarray(is_pub.to_numpy(zero_copy_only=False), dtype=bool)
    cells = np.zeros(n, dtype=np.int64)
    pub_rows = np.flatnonzero(pub)
    cells[pub_rows] = _per_point(
        la[pub_rows], lo[pub_rows], lambda a, b: h3_cells(a, b, H3_RES_MAX)
    )
    null_str = pa.nulls(n, pa.string())
    size = batch.column("payload_size")
    payload = pc.if_else(
        is_pub,
        pc.fill_null(pc.cast(size, pa.int64(), safe=False), 0),
        pa.nulls(n, pa.int64()),
    )
    if any(f is not None for f in fence_of):
        fid_col, meet_col, wkb_col = fences.columns(fence_of)
        fid, meet, wkb = (
            pa.array(fid_col, pa.int64()),
            pa.array(meet_col, pa.list_(pa.int32())),
            pa.array(wkb_col, pa.binary()),
        )
    else:  # most batches: publishes without a geofence
        fid, meet, wkb = (
            pa.nulls(n, PARSED_SCHEMA.field(c).type) for c in ("fence", "meet", "wkb")
        )
    out = pa.RecordBatch.from_arrays(
        [
            batch.column("k"),
            batch.column("file"),
            batch.column("line"),
            op,
            pc.cast(batch.column("t"), pa.float64(), safe=False),
            batch.column("client"),
            lat,
            lon,
            pc.if_else(is_move, null_str, batch.column("id")),
            pc.if_else(pc.or_(is_move, is_unsub), null_str, batch.column("topic")),
            fid,
            meet,
            wkb,
            payload,
            pa.array(home, mask=home_mask),
            pa.array(cells, mask=~pub),
            null_str,
        ],
        schema=PARSED_SCHEMA,
    )
    yield out


def _per_point(
    lat: np.ndarray, lon: np.ndarray, fn: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    """`fn` of each point, asked once per distinct point (fixed publishers repeat theirs).

    Points are told apart by their bits, so -0.0 and 0.0 stay distinct.
    """
    if len(lat) == 0:
        return fn(lat, lon)
    a, b = lat.view(np.int64), lon.view(np.int64)
    # Sorted by (lat, lon) bits, a run of equal points is one group (np.unique
    # over rows sorts a structured view, several times slower).
    order = np.lexsort((b, a))
    sa, sb = a[order], b[order]
    first = np.empty(len(order), dtype=bool)
    first[0] = True
    first[1:] = (sa[1:] != sa[:-1]) | (sb[1:] != sb[:-1])
    inverse = np.empty(len(order), dtype=np.intp)
    inverse[order] = np.cumsum(first) - 1
    rep = order[first]
    return np.asarray(fn(lat[rep], lon[rep]))[inverse]


def _error_batch(batch: pa.RecordBatch, errors: list[str]) -> pa.RecordBatch:
    """Error rows (k, file, line, err; everything else null) for `batch`'s rows."""
    n = batch.num_rows
    cols = {name: pa.nulls(n, PARSED_SCHEMA.field(name).type) for name in PARSED_SCHEMA.names}
    for name in ("k", "file", "line"):
        cols[name] = batch.column(name)
    cols["err"] = pa.array(errors, pa.string())
    return pa.RecordBatch.from_arrays(list(cols.values()), schema=PARSED_SCHEMA)


def _record(row: dict[str, Any]) -> dict[str, Any]:
    # Parquet columns are typed: a float payload_size column (what pandas
    # writes for an integer column with nulls) holding whole numbers means
    # integers. JSON text stays as written.
    size = row.get("payload_size")
    if isinstance(size, float) and size.is_integer():
        row["payload_size"] = int(size)
    return row


_NOT_FIELDS = ("k", "file", "line", "_fast", "value")


def _unrepresentable(op: TraceOp, line: int) -> str | None:
    """An error for what parse_op accepts but a Spark row cannot hold: text with a lone
    surrogate (JSON escapes can spell one), a payload size beyond 64 bits."""
    if op.payload_size >= 1 << 63:
        return f"line {line}: payload_size: must be below 2**63, got {op.payload_size}"
    for name in ("client", "id", "topic"):
        try:
            getattr(op, name).encode("utf-8")
        except UnicodeEncodeError:
            return f"line {line}: {name}: not valid Unicode (a lone surrogate)"
    return None


def _slow_batch(batch: pa.RecordBatch, fences: _Fences) -> pa.RecordBatch:
    """Rows the JVM did not pass: `parse_op` on each, which names what is wrong (if anything)."""
    cols = batch.to_pydict()
    n = batch.num_rows
    text = cols.get("value")
    out: dict[str, list[Any]] = {name: [] for name in PARSED_SCHEMA.names}
    fence_of: list[Geofence | None] = []
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
            record = _record({c: cols[c][i] for c in cols if c not in _NOT_FIELDS})
        if err is None:
            try:
                op = parse_op(record, line, fences.cache)
            except GeofedError as exc:
                err = str(exc)
            except Exception as exc:  # a core bug must not hide a row: report it as one
                err = f"line {line}: unexpected {type(exc).__name__}: {exc}"
            if op is not None and op.roaming is not None:
                op, err = None, f"line {line}: roaming: {ROAMING_UNSUPPORTED}"
        if op is not None:
            err = _unrepresentable(op, line)
            op = None if err else op
        out["k"].append(cols["k"][i])
        out["file"].append(cols["file"][i])
        out["line"].append(line)
        out["err"].append(err)
        if op is None:
            for name in ("op", "t", "client", "lat", "lon", "id", "topic", "payload"):
                out[name].append(None)
            fence_of.append(None)
            continue
        out["op"].append(op.op)
        out["t"].append(op.t)
        out["client"].append(op.client)
        out["lat"].append(op.location.lat if op.location is not None else None)
        out["lon"].append(op.location.lon if op.location is not None else None)
        out["id"].append(op.id or None)
        out["topic"].append(op.topic or None)
        out["payload"].append(op.payload_size if op.op == "publish" else None)
        fence_of.append(op.geofence)

    m = len(out["k"])
    lat = np.array([np.nan if v is None else v for v in out["lat"]], dtype=np.float64)
    lon = np.array([np.nan if v is None else v for v in out["lon"]], dtype=np.float64)
    located = np.flatnonzero(~np.isnan(lat))
    home: list[int | None] = [None] * m
    for i, h in zip(
        located.tolist(), fences.fidx.responsible(lat[located], lon[located]).tolist(), strict=True
    ):
        home[i] = h
    out["home"] = home
    out["cell"] = [
        h3_cell(out["lat"][i], out["lon"][i], H3_RES_MAX) if out["op"][i] == "publish" else None
        for i in range(m)
    ]
    out["fence"], out["meet"], out["wkb"] = fences.columns(fence_of)
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
