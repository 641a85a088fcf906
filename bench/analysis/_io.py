"""Reading traces into Spark with their line numbers, and validating them in the executors.

Workload traces (docs/design.md §4) and node message traces come as JSON
Lines or Parquet. Every record keeps where it came from (`file`: index of
its file in sorted path order, `line`: 1-based line of a JSON Lines file or
row of a Parquet file) so that a malformed record is reported by number, and
so that ties in ``t`` are broken by line as the trace semantics require.
``k`` packs both into one sortable long: ``file * 2**40 + line``.

Workload records are typed and checked in the JVM (`workload_records`);
the executors' Python computes geometry once per distinct point and
geofence text, which the rows the JVM vouched for join, and runs the routing
core's `parse_op` on the others (`parse_workload`); a record it rejects
becomes a row with `err` set instead of failing the job.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import shapely
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.functions import arrow_udf
from pyspark.sql.pandas.types import from_arrow_type

from geofed.routing import (
    DEFAULT_MAX_VERTICES,
    MAX_ID_LENGTH,
    MAX_TOPIC_BYTES,
    OPS,
    Federation,
    GeofedError,
    Geofence,
    GeofenceCache,
    InvalidInput,
    TraceOp,
    parse_op,
)

from ._geo import H3_RES_MAX, FederationIndex, fence_id, filled, h3_cells, present

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
        ("payload", pa.int64()),
        ("home", pa.int32()),
        ("cell", pa.int64()),
        ("err", pa.string()),
    ]
)
"""One validated workload op per row (or `err` and where it came from).

fence: id of the geofence (null: the whole world; its shape is in
`Workload.shapes`); meet: indices of the brokers it meets; home: index of
the broker responsible for the op's location; cell: H3 cell of a publish
location at `H3_RES_MAX`.
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
    columns = set(df.columns)
    for col in required:
        if col not in columns:
            raise InvalidInput(f"{what}.{col}", f"required column missing from {', '.join(paths)}")
    # The paths as the scan spells them (inputFiles() may spell them otherwise):
    # one row per file reaches the driver. Each row finds its file's index by
    # a broadcast join (a map literal would compare the paths one by one: 19
    # CPU s a pass over 10M rows in 400 files, bench/results/spark.md). Left
    # outer: every path is in the index, and a query that needs no index
    # (grouping the keys) drops the join.
    files = sorted(r[0] for r in df.select("_metadata.file_path").distinct().collect())
    index = spark.createDataFrame(list(enumerate(files)), "file int, _path string")
    cols = [c for c in (*required, *optional) if c in columns]
    numbered = (
        df.select(
            F.col("_metadata.file_path").alias("_path"),
            (F.col("_metadata.row_index") + 1).alias("line"),
            *cols,
        )
        .join(F.broadcast(index), "_path", "left")
        .select(
            ((F.col("file").cast("long") * (1 << LINE_BITS)) + F.col("line")).alias("k"),
            "file",
            "line",
            *cols,
        )
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
    # A raw control character in a string makes the record corrupt (json.loads
    # refuses it too): a row from_json decodes holds none (see `_valid`).
    "allowUnquotedControlChars": "false",
}
# One flat object: nothing nested (no trailing second object either, which
# from_json would ignore and json.loads refuses) and no escapes (whose edge
# cases, lone surrogates and the like, the two parsers decode differently).
_FLAT_OBJECT = r"^[ \t]*\{[^{}\\]*\}[ \t]*$"
# The JSON text of a non-string token as from_json hands it to a string
# field: a number (its first character a digit or '-'), true/false/null, an
# array, a quoted NaN/Infinity. Told by the first character and a few whole
# words (cheap in the JVM, where a regular expression per field cost more
# than decoding the line), a little wider than needed: a string that merely
# starts like a number goes to parse_op too, which accepts it.
_NOT_A_STRING_FIRST = (ord("-"), ord('"'), ord("["), *range(ord("0"), ord("9") + 1))
_NOT_A_STRING_WORDS = ("true", "false", "null", "NaN", "Infinity")
_NUMERIC_TYPES = ("tinyint", "smallint", "int", "bigint", "float", "double")
_OPTIONAL_TYPES = {"geofence": "string", "payload_size": "bigint", "roaming": "string"}
_STRING_FIELDS = ("op", "client", "id", "topic", "geofence")
_NUMBER_FIELDS = ("t", "lat", "lon", "payload_size")
WORKLOAD_TYPED = ("t", "op", "client", "lat", "lon", "id", "topic", "geofence", "payload_size")
"""The typed fields of `workload_records` rows."""


def workload_records(numbered: DataFrame, fmt: str) -> DataFrame:
    """Numbered workload rows, typed, with `_fast`: the JVM found the row valid.

    Columns: k, file, line, the fields `WORKLOAD_TYPED` (numbers as doubles,
    payload_size as a long from JSON) and `_fast`. `_fast` is a conservative
    pre-check of everything `parse_op` checks but the geofence: a row it
    passes is one `parse_op` accepts with the same values, so the executors
    only add geometry to it (`parse_workload`); the others (a malformed row,
    or one whose JSON the JVM cannot judge exactly) go to `parse_op` itself,
    which names the field that is wrong. `tests/spark/test_spark_parse.py`
    holds the split against `parse_op` on random records.

    JSON Lines are decoded by ``from_json`` with `WORKLOAD_JSON_SCHEMA`
    (only a flat object can be fast, see `_FLAT_OBJECT`); Parquet columns
    are checked as they are typed.
    """
    if fmt == "json":
        rec = F.from_json(F.col("value"), WORKLOAD_JSON_SCHEMA, _JSON_OPTIONS)
        src = numbered.select("k", "file", "line", "value", rec.alias("r")).select(
            "k", "file", "line", "value", "r.*"
        )
        fast = (
            F.col("value").rlike(_FLAT_OBJECT)
            & F.col("_corrupt").isNull()
            & F.col("roaming").isNull()  # a roaming geofence: parse_op refuses it by name
            & _valid(F.col, json=True)
        )
        typed = {name: F.col(name) for name in WORKLOAD_TYPED}
    else:
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
        src = numbered
        typed = {name: typed_col(name) for name in WORKLOAD_TYPED}
    return src.select(
        "k",
        "file",
        "line",
        *[c.alias(name) for name, c in typed.items()],
        F.coalesce(fast, F.lit(False)).alias("_fast"),
    )


def _slow_records(numbered: DataFrame, fmt: str) -> DataFrame:
    """Numbered rows as `_by_parse_op` hands them to `parse_op`: k, file, line and `_raw`,
    the record as the file holds it (a JSON line's text; a Parquet row's columns, an
    optional column the file lacks as null, as a record without the field)."""
    if fmt == "json":
        raw = F.struct("value")
    else:
        kinds = dict(numbered.dtypes)
        cols = [F.col(c) for c in numbered.columns if c not in ("k", "file", "line")]
        for name, kind in _OPTIONAL_TYPES.items():
            if name not in kinds:
                cols.append(F.lit(None).cast(kind).alias(name))
        raw = F.struct(*cols)
    return numbered.select("k", "file", "line", raw.alias("_raw"))


def _valid(col: Callable[[str], Column], *, json: bool) -> Column:
    """The pre-check: the conditions of `parse_op`, as SQL over typed fields."""

    def text_ok(c: Column) -> Column:
        ok = c.isNotNull()
        if not json:
            return ok
        return ok & ~F.ascii(c).isin(*_NOT_A_STRING_FIRST) & ~c.isin(*_NOT_A_STRING_WORDS)

    def ident(name: str) -> Column:
        c = col(name)
        # Characters: counted only when the bytes exceed the bound (a
        # character is at least one byte; counting scans the text).
        size = F.octet_length(c)
        ok = text_ok(c) & (size >= 1) & ((size <= MAX_ID_LENGTH) | (F.length(c) <= MAX_ID_LENGTH))
        # JSON: a string from_json decoded without escapes (the line has no
        # backslash) and without marking the record corrupt holds no control
        # character, so only Parquet strings need the regular expression.
        return ok if json else ok & ~c.rlike("[\\x00-\\x1f]")

    def finite(c: Column) -> Column:
        return c.isNotNull() & ~F.isnan(c)

    lat, lon, t, op, topic = col("lat"), col("lon"), col("t"), col("op"), col("topic")
    located = finite(lat) & lat.between(-90.0, 90.0) & finite(lon) & lon.between(-180.0, 180.0)
    # `contains` and byte lengths rather than `instr` and character counts:
    # a byte scan, not a character walk (each instr cost ~0.2 us a row).
    topic_text = (
        text_ok(topic) & F.octet_length(topic).between(1, MAX_TOPIC_BYTES) & ~topic.contains("\x00")
    )
    sharp = F.instr(topic, "#")
    filter_rules = (
        # '+' only as a whole level
        ~topic.rlike("[^/]\\+|\\+[^/]")
        # '#' only as the whole last level
        & ((sharp == 0) | (((topic == "#") | topic.endswith("/#")) & (sharp == F.length(topic))))
    )
    topic_rules = ~topic.contains("+") & ~topic.contains("#")
    size = col("payload_size")
    size_ok = size.isNull() | (
        finite(size) & (size >= 0) & (size < 2.0**63) & (size == F.floor(size))
    )
    fence = col("geofence")
    fence_ok = fence.isNull() | text_ok(fence)  # parsed in Python (`_answers`)
    sub, pub = op == "subscribe", op == "publish"
    # One conjunction, each rule written once and skipped by the ops it does
    # not concern, rather than a CASE over the op repeating the shared rules
    # per branch: that expression cost about 5 us a row in the JVM (as much
    # as decoding the line), this one next to nothing. Null (no op) is false.
    return F.coalesce(
        finite(t)
        & (t >= 0)
        & (t <= sys.float_info.max)
        & ident("client")
        & op.isin(*OPS)
        & ((op == "unsubscribe") | located)
        & ((op == "move") | ident("id"))
        & (~(sub | pub) | (fence_ok & topic_text))
        & (~sub | filter_rules)
        & (~pub | (topic_rules & size_ok)),
        F.lit(False),
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
    """A worker's geofences: parsed once per text (the core's cache), an id and the brokers
    met once per shape, the shape shipped on the first row that uses it."""

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


ANSWERS = pa.schema(
    [
        ("lat", pa.float64()),
        ("lon", pa.float64()),
        PARSED_SCHEMA.field("home"),
        PARSED_SCHEMA.field("cell"),
        ("geofence", pa.string()),
        PARSED_SCHEMA.field("fence"),
        PARSED_SCHEMA.field("meet"),
        ("wkb", pa.binary()),
        ("err", pa.string()),
    ]
)
"""The executors' answers per distinct point or geofence text (`_answers`).

A point row (lat, lon set): its home broker and, where a publish stands
there, its H3 cell. A text row (geofence set): its id, the brokers it meets
and its shape (all null for the whole world), or the core's error without
the line (``geofence: ...``).
"""
_OP_FIELDS = ("op", "t", "client", "lat", "lon", "id", "topic", "payload")
PARSE_OP_TYPE = pa.struct(
    [
        *(PARSED_SCHEMA.field(name) for name in _OP_FIELDS),
        *(PARSED_SCHEMA.field(name) for name in ("fence", "meet")),
        pa.field("wkb", pa.binary()),
        *(PARSED_SCHEMA.field(name) for name in ("home", "cell", "err")),
        pa.field("blank", pa.bool_()),
    ]
)
"""What the executors' Python answers per row the JVM did not vouch for (`_by_parse_op`):
every field of `PARSED_SCHEMA` but k, file and line from `parse_op`, or err; wkb the
shape of its geofence; blank: an empty line, which is skipped as `read_trace` skips it.
"""


class Workload(NamedTuple):
    """A validated workload (`parse_workload`)."""

    parsed: DataFrame
    """`PARSED_SCHEMA` rows: one validated op, or its error, per line."""
    shapes: DataFrame
    """(fence, wkb): the shape of every geofence a valid row names, maybe more than once
    (and shapes of texts only malformed rows carry)."""
    by_op: dict[str | None, int]
    """Rows per op; None: the error rows."""


def _count_ops(rows: DataFrame, apart: Column | None = None) -> tuple[dict[str | None, int], int]:
    """Rows per op (None: the error rows) and the rows where `apart` holds (counted
    only there), in one pass over `rows`.

    Counting while the checkpoint is written (Spark's observed metrics) was
    measured at about the same cost as this pass, so the pass stays
    (bench/results/spark.md).
    """
    flag = (F.lit(False) if apart is None else apart).alias("apart")
    by_op: dict[str | None, int] = {}
    n_apart = 0
    for r in rows.groupBy("op", flag).agg(F.count(F.lit(1)).alias("n")).collect():
        if r["apart"]:
            n_apart += int(r["n"])
        else:
            by_op[r["op"]] = int(r["n"])
    return by_op, n_apart


def parse_workload(
    records: DataFrame,
    numbered: DataFrame,
    fmt: str,
    fed_text: str,
    persist: Callable[[DataFrame], DataFrame] = lambda df: df,
    broadcast_rows: int = 2_000_000,
) -> Workload:
    """`workload_records` rows validated: one `PARSED_SCHEMA` row, an op or its error, per line.

    The typed fields of fast rows stay in the JVM; what Python adds is their
    geometry (home broker, H3 cell, geofence), asked once per distinct point
    and geofence text (`_by_distinct_values`): a second pass over the few
    columns that takes costs less than a row's trip through Python. That
    second pass reads a Parquet trace again; JSON Lines are decoded once and
    read back from a checkpoint (decoding them again would cost more).
    The rows the JVM did not vouch for (rare) are set apart, read again from
    `numbered` (the trace as `read_numbered` gave it) by their k and go
    through `parse_op` itself (`_by_parse_op`): a clean trace is read once.
    `persist` materializes each step (the job's checkpoints); `broadcast_rows`
    bounds the answers and keys joined by a broadcast.
    """
    if fmt == "json":
        records = persist(records)
    stage, shapes = _by_distinct_values(records, fed_text, persist, broadcast_rows)
    # One pass counts the ops and the slow rows: a clean trace has none to parse.
    slow_rows = F.col("_slow")
    by_op, n_slow = _count_ops(stage, slow_rows)
    parsed = stage.where(~slow_rows).select(*PARSED_SCHEMA.names)
    if not n_slow:
        return Workload(parsed, shapes, by_op)
    keys = stage.where(slow_rows).select("k")
    again = numbered.join(F.broadcast(keys) if n_slow <= broadcast_rows else keys, "k", "left_semi")
    slow = persist(_by_parse_op(_slow_records(again, fmt), fmt, fed_text))
    for op_name, n in _count_ops(slow)[0].items():
        by_op[op_name] = by_op.get(op_name, 0) + n
    return Workload(
        parsed.unionByName(slow.select(*PARSED_SCHEMA.names)),
        shapes.unionByName(_shapes(slow)),
        by_op,
    )


def _shapes(answered: DataFrame) -> DataFrame:
    return answered.where(F.col("wkb").isNotNull()).select("fence", "wkb")


def _by_parse_op(slow: DataFrame, fmt: str, fed_text: str) -> DataFrame:
    """`PARSED_SCHEMA` rows and wkb (a shape on the first row of a partition that uses it)
    of `_slow_records` rows, each parsed by `parse_op`; blank lines dropped.

    A scalar Arrow UDF (`_parse_rows`) sends Python each row's line and
    `_raw` and answers `PARSE_OP_TYPE`.
    """
    # An iterator of batches (by its hints): one `_Fences` per partition.
    parse = arrow_udf(_parse_rows(fed_text, fmt), from_arrow_type(PARSE_OP_TYPE))  # type: ignore[call-overload,unused-ignore]
    # Marked nondeterministic so that it runs once: the optimizer would
    # otherwise push the blank-line filter below the projection and ask
    # Python twice per row, once for the filter and once for the columns.
    parse = parse.asNondeterministic()
    answered = slow.select("k", "file", "line", parse(F.col("line"), F.col("_raw")).alias("_g"))
    return answered.where(~F.col("_g.blank")).select(
        "k",
        "file",
        "line",
        *[F.col(f"_g.{n}").alias(n) for n in (*PARSED_SCHEMA.names[3:], "wkb")],
    )


def _typed_fields(ok: Column) -> dict[str, Column]:
    """The fields the JVM typed, of a fast row where `ok` holds (else null)."""
    op = F.col("op")
    values = {
        "op": op,
        "t": F.col("t").cast("double"),
        "client": F.col("client"),
        "lat": F.when(op != "unsubscribe", F.col("lat").cast("double")),
        "lon": F.when(op != "unsubscribe", F.col("lon").cast("double")),
        "id": F.when(op != "move", F.col("id")),
        "topic": F.when(~op.isin("move", "unsubscribe"), F.col("topic")),
        "payload": F.when(
            op == "publish", F.coalesce(F.col("payload_size").cast("long"), F.lit(0))
        ),
    }
    return {name: F.when(ok, v).alias(name) for name, v in values.items()}


def _by_distinct_values(
    records: DataFrame,
    fed_text: str,
    persist: Callable[[DataFrame], DataFrame],
    broadcast_rows: int,
) -> tuple[DataFrame, DataFrame]:
    """Python once per distinct point and geofence text, joined by the fast rows in the JVM.

    Per point its home broker and, where a publish stands, its H3 cell;
    per text its fence, meet and shape or the core's error (`_answers`,
    one Python job for both). The answers are broadcast up to
    `broadcast_rows` of them (moving clients make nearly as many points as
    rows; then they join by a shuffle). Returns the rows (`PARSED_SCHEMA`
    and `_slow`, a row the JVM did not vouch for, which `parse_workload`
    hands to `parse_op`) and the shapes (fence, wkb).

    Spark groups and joins -0.0 with 0.0: a point at -0.0 gets 0.0's answers,
    the same broker and cell (`tests/spark/test_spark_parse.py`).
    """
    op = F.col("op")
    lat, lon, text = F.col("lat").cast("double"), F.col("lon").cast("double"), F.col("geofence")
    # The keys of every row that may need them: wider than the fast rows, and
    # without the pre-check, whose columns a Parquet scan would then read too.
    # An answer nobody asks for costs little; a missing one would be wrong.
    located = op.isin("subscribe", "publish", "move") & lat.between(-90.0, 90.0)
    located = located & lon.between(-180.0, 180.0)  # false for NaN and null
    fenced = op.isin("subscribe", "publish")
    keys = (
        records.select(
            F.when(located, lat).alias("lat"),
            F.when(located, lon).alias("lon"),
            F.when(fenced, text).alias("geofence"),
            (op == "publish").alias("pub"),
        )
        .where(F.col("lat").isNotNull() | F.col("geofence").isNotNull())
        .groupBy("lat", "lon", "geofence")
        .agg(F.max("pub").alias("pub"))
    )
    # The distinct points and the distinct texts, in one pass and one Python
    # job (each job starts its Python workers): grouping sets over the keys
    # (a point: geofence null; a text: lat and lon null).
    asked = (
        keys.groupingSets([["lat", "lon"], ["geofence"]], "lat", "lon", "geofence")
        .agg(F.max("pub").alias("pub"))
        .where(F.col("lat").isNotNull() | F.col("geofence").isNotNull())
    )
    answers = persist(
        asked.mapInArrow(_answers(fed_text), from_arrow_type(pa.struct(list(ANSWERS))))  # type: ignore[arg-type]
    )
    point_cols, fence_cols = ANSWERS.names[:4], ANSWERS.names[4:]
    points = answers.where(F.col("lat").isNotNull()).select(*point_cols)
    fences = answers.where(F.col("geofence").isNotNull()).select(*fence_cols)

    n_points, n_fences = answers.select(F.count("lat"), F.count("geofence")).first() or (0, 0)

    def side(df: DataFrame, rows: int) -> DataFrame:
        return F.broadcast(df) if rows <= broadcast_rows else df

    fast = F.col("_fast")
    point = side(points.select(*[F.col(c).alias("_p" + c) for c in point_cols]), n_points)
    fence = side(fences.select(*[F.col(c).alias("_f" + c) for c in fence_cols]), n_fences)
    joined = (
        records.select(
            "*",
            F.when(fast & (op != "unsubscribe"), lat).alias("_jlat"),
            F.when(fast & fenced, text).alias("_jtext"),
        )
        .join(point, (F.col("_jlat") == F.col("_plat")) & (lon == F.col("_plon")), "left")
        .join(fence, F.col("_jtext") == F.col("_fgeofence"), "left")
    )
    bad = F.col("_ferr")
    at = F.concat(F.lit("line "), F.col("line").cast("string"), F.lit(": "))
    ok = fast & bad.isNull()  # a fast row whose geofence the core accepted

    cols = _typed_fields(ok)
    cols["fence"] = F.when(ok, F.col("_ffence")).alias("fence")
    cols["meet"] = F.when(ok, F.col("_fmeet")).alias("meet")
    cols["home"] = F.when(ok, F.col("_phome")).alias("home")
    cols["cell"] = F.when(ok & (op == "publish"), F.col("_pcell")).alias("cell")
    # The core's message names the field; the line is the row's.
    cols["err"] = F.when(fast & bad.isNotNull(), F.concat(at, bad)).alias("err")
    stage = persist(
        joined.select(*[cols.get(n, F.col(n)) for n in PARSED_SCHEMA.names], (~fast).alias("_slow"))
    )
    return stage, _shapes(fences)


def _answers(fed_text: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """`ANSWERS` of distinct (lat, lon, pub) points and distinct geofence texts (lat null).

    pub: a publish stands at the point (it then gets its H3 cell).
    """

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        fences = _Fences(worker_federation(fed_text))
        for batch in batches:
            n = batch.num_rows
            at = present(batch.column("lat"))
            lat = filled(batch.column("lat"), 0.0, np.float64)
            lon = filled(batch.column("lon"), 0.0, np.float64)
            pub = at & filled(batch.column("pub"), False, bool)
            home = np.zeros(n, dtype=np.int32)
            home[at] = fences.fidx.responsible(lat[at], lon[at])
            cells = np.zeros(n, dtype=np.int64)
            cells[pub] = h3_cells(lat[pub], lon[pub], H3_RES_MAX)
            shapes: list[Geofence | None] = []
            errors: list[str | None] = []
            for text in batch.column("geofence").to_pylist():
                shape, err = (None, None) if text is None else _fence_or_error(fences, text)
                shapes.append(shape)
                errors.append(err)
            fid, meet, wkb = fences.columns(shapes)
            yield pa.RecordBatch.from_arrays(
                [
                    batch.column("lat"),
                    batch.column("lon"),
                    pa.array(home, mask=~at),
                    pa.array(cells, mask=~pub),
                    batch.column("geofence"),
                    pa.array(fid, pa.int64()),
                    pa.array(meet, pa.list_(pa.int32())),
                    pa.array(wkb, pa.binary()),
                    pa.array(errors, pa.string()),
                ],
                schema=ANSWERS,
            )

    return run


def _fence_or_error(fences: _Fences, text: str) -> tuple[Geofence | None, str | None]:
    """A geofence text parsed by the core (cached), or why not (the message without the
    line, which the row's adds)."""
    try:
        return fences.cache.get(text, "geofence"), None
    except GeofedError as exc:
        return None, str(exc)
    except Exception as exc:  # as in _parse_slow: a core bug is reported as a row
        return None, f"unexpected {type(exc).__name__}: {exc}"


def _parse_rows(
    fed_text: str, fmt: str
) -> Callable[[Iterator[tuple[pa.Array, ...]]], Iterator[pa.Array]]:
    """The Arrow UDF of `_by_parse_op`: one `_Fences` per partition, one answer per batch."""

    def run(batches: Iterator[tuple[pa.Array, ...]]) -> Iterator[pa.Array]:
        fences = _Fences(worker_federation(fed_text))
        for line, raw in batches:
            yield _parse_batch(fences, fmt, line, raw)

    return run


def _parse_batch(fences: _Fences, fmt: str, line: pa.Array, raw: pa.Array) -> pa.StructArray:
    """`PARSE_OP_TYPE` of one batch of `_raw` records: `parse_op`'s op with its geometry,
    or its error."""
    n = len(line)
    values: dict[str, list[Any]] = {name: [None] * n for name in _OP_FIELDS}
    errors: list[str | None] = [None] * n
    blank = np.zeros(n, dtype=bool)
    fence_of: list[Geofence | None] = [None] * n
    la = np.full(n, np.nan)
    lo = np.full(n, np.nan)
    is_pub = np.zeros(n, dtype=bool)
    records = raw.to_pylist()
    for i, (record, at) in enumerate(zip(records, line.to_pylist(), strict=True)):
        op, err = _parse_slow(record["value"] if fmt == "json" else record, at, fences)
        if op is None:
            errors[i] = err
            blank[i] = err is None
            continue
        for name, value in zip(_OP_FIELDS, _op_values(op), strict=True):
            values[name][i] = value
        if op.location is not None:
            la[i], lo[i] = op.location.lat, op.location.lon
        is_pub[i] = op.op == "publish"
        fence_of[i] = op.geofence
    located = ~np.isnan(la)
    home = np.zeros(n, dtype=np.int32)
    home[located] = fences.fidx.responsible(la[located], lo[located])
    cells = np.zeros(n, dtype=np.int64)
    cells[is_pub] = h3_cells(la[is_pub], lo[is_pub], H3_RES_MAX)
    fid, meet, wkb = fences.columns(fence_of)
    return pa.StructArray.from_arrays(
        [
            *(pa.array(values[name], PARSE_OP_TYPE.field(name).type) for name in _OP_FIELDS),
            pa.array(fid, pa.int64()),
            pa.array(meet, pa.list_(pa.int32())),
            pa.array(wkb, pa.binary()),
            pa.array(home, mask=~located),
            pa.array(cells, mask=~is_pub),
            pa.array(errors, pa.string()),
            pa.array(blank),
        ],
        fields=list(PARSE_OP_TYPE),
    )


def _record(row: dict[str, Any]) -> dict[str, Any]:
    # Parquet columns are typed: a float payload_size column (what pandas
    # writes for an integer column with nulls) holding whole numbers means
    # integers. JSON text stays as written.
    size = row.get("payload_size")
    if isinstance(size, float) and size.is_integer():
        row["payload_size"] = int(size)
    return row


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


def _parse_slow(
    record: str | dict[str, Any], line: int, fences: _Fences
) -> tuple[TraceOp | None, str | None]:
    """`parse_op` of a row the JVM did not pass (its JSON text or its Parquet columns): the op,
    or the error naming what is wrong; (None, None) for a blank line."""
    if isinstance(record, str):
        if not record.strip():
            return None, None  # blank lines are skipped, as read_trace does
        try:
            parsed: Any = json.loads(record)
        except json.JSONDecodeError as exc:
            return None, f"line {line}: not JSON: {exc.msg}"
        except RecursionError:
            return None, f"line {line}: not JSON: nested too deeply"
    else:
        parsed = _record(record)
    try:
        op = parse_op(parsed, line, fences.cache)
    except GeofedError as exc:
        return None, str(exc)
    except Exception as exc:  # a core bug must not hide a row: report it as one
        return None, f"line {line}: unexpected {type(exc).__name__}: {exc}"
    if op.roaming is not None:
        return None, f"line {line}: roaming: {ROAMING_UNSUPPORTED}"
    err = _unrepresentable(op, line)
    return (None, err) if err else (op, None)


def _op_values(op: TraceOp) -> tuple[Any, ...]:
    """The `_OP_FIELDS` of a parsed op."""
    loc = op.location
    return (
        op.op,
        op.t,
        op.client,
        loc.lat if loc is not None else None,
        loc.lon if loc is not None else None,
        op.id or None,
        op.topic or None,
        op.payload_size if op.op == "publish" else None,
    )


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
        columns = set(numbered.columns)
        fields = [f.split() for f in NODE_SCHEMA.split(",")]
        typed = numbered.select(
            "k",
            "file",
            "line",
            F.lit(True).alias("_obj"),
            (F.col("bytes").cast("string") if "bytes" in columns else F.lit(None)).alias(
                "_bytes_raw"
            ),
            (F.col("t").cast("string") if "t" in columns else F.lit(None)).alias("_t_raw"),
            *[
                (F.col(c).cast(t) if c in columns else F.lit(None).cast(t)).alias(c)
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
