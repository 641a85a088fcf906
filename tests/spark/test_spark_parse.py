"""The JVM pre-check plus the executors' geometry parse exactly as `parse_op` does.

Workload records are typed in the JVM (`from_json`, Parquet columns) and
only rows the JVM cannot vouch for reach `parse_op` itself. These tests
feed both paths adversarial records (wrong JSON types, numbers as strings,
non-finite values, wildcards, bad geofences, lax JSON that Spark's parser
accepts and `json.loads` does not) and require every row to come out as
the core's parse of the same line: the same values, or the same error.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import shapely
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.pandas.types import to_arrow_schema
from spark_helpers import AWS, THREE, write_jsonl
from test_spark_known import AROUND_FRANKFURT, THREE_TRACE

from geofed.bench.analysis import load_federation
from geofed.bench.analysis._geo import H3_RES_MAX, FederationIndex, fence_id, h3_cells
from geofed.bench.analysis._io import (
    PARSED_SCHEMA,
    WORKLOAD_REQUIRED,
    parse_workload,
    read_numbered,
    workload_records,
)
from geofed.routing import GeofedError, GeofenceCache, parse_op

pytestmark = pytest.mark.spark

# Values a field may take instead of a good one: each must come out as the core says.
ODD_VALUES: list[Any] = [
    None,
    "",
    "5",
    "-1.5e3",
    "true",
    "null",
    "NaN",
    "Infinity",
    "[1]",
    "x\u0001y",
    "\u00e9t\u00e9",
    "a/+/b",
    "a/#",
    "#",
    "+",
    "a+/b",
    "a/#/b",
    "s" * 300,
    5,
    0,
    -0.0,
    -1,
    1.5,
    3.0,
    10**30,
    1e300,
    True,
    False,
    [1, 2],
    [],
    {"a": 1},
    {"circle": {"lat": 50, "lon": 8, "radius_m": 1000}},
    "POLYGON((0 0, 1 1, 1 0, 0 1, 0 0))",
    AROUND_FRANKFURT,
    "POLYGON((0 0, 1 0, 1 1, 0 1, 0 0))",
    '{"type": "Polygon", "coordinates": [[[0, 0], [1, 0], [1, 1], [0, 1], [0, 0]]]}',
    "POLYGON((0 0",
    91,
    -180,
    180.0,
    -90,
]
FIELDS = ("t", "op", "client", "lat", "lon", "id", "topic", "geofence", "payload_size")
# Whole lines whose JSON Spark's parser and json.loads may read differently.
ODD_LINES = [
    '{"t": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2} {"t": 2}',
    '{"t": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2}}',
    "{'t': 1, 'op': 'move', 'client': 'c1', 'lat': 1, 'lon': 2}",
    '{"t": 01, "op": "move", "client": "c1", "lat": 1, "lon": 2}',
    '{"t": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2,}',
    '{"t": 1, "op": "move", "client": "\\u0063\\u0031", "lat": 1, "lon": 2}',
    '{"t": 1, "op": "move", "client": "c\\ud800", "lat": 1, "lon": 2}',
    '\ufeff{"t": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2}',
    '  {"t": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2}\t',
    '{"t": 1, "op": "move", "op": "publish", "client": "c1", "lat": 1, "lon": 2}',
    '{"T": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2}',
    '{"t": NaN, "op": "move", "client": "c1", "lat": 1, "lon": 2}',
    '{"t": 1, "op": "move", "client": "c1", "lat": Infinity, "lon": 2}',
    '{"t": 1, "op": "move", "client": "c1", "lat": "NaN", "lon": 2}',
    '{"t": 1, "op": "move", "client": "c1", "lat": 1, "lon": 2, "extra": {"x": [1]}}',
    # Raw control characters in a string (json.loads refuses them, Spark marks the record).
    '{"t": 1, "op": "move", "client": "c\x01", "lat": 1, "lon": 2}',
    '{"t": 1, "op": "unsubscribe", "client": "c1", "id": "s\t1"}',
    # Strings that start like a number or a word JSON spells bare: still strings.
    '{"t": 1, "op": "unsubscribe", "client": "3d", "id": "-s1"}',
    '{"t": 1, "op": "unsubscribe", "client": "truest", "id": "[s]"}',
    '{"t": 1, "op": "unsubscribe", "client": "true", "id": "s1"}',
    "[1, 2]",
    "5",
    '"move"',
    "\t",
    "",
]


def _records(rng: random.Random, n: int) -> list[str]:
    """Good records with one to three fields replaced by odd values (or dropped)."""
    lines: list[str] = []
    for _ in range(n):
        rec = dict(rng.choice(THREE_TRACE))
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(FIELDS)
            if rng.random() < 0.15:
                rec.pop(field, None)
            else:
                rec[field] = rng.choice(ODD_VALUES)
        lines.append(json.dumps(rec))
    return lines


def _expected(records: list[tuple[int, Any]]) -> dict[int, tuple[Any, ...]]:
    """line -> the core's answer: (op, t, client, lat, lon, id, topic, payload, err)."""
    cache = GeofenceCache()
    out: dict[int, tuple[Any, ...]] = {}
    for line, record in records:
        try:
            op = parse_op(record, line, cache)
        except GeofedError as exc:
            out[line] = (None,) * 8 + (str(exc),)
            continue
        if op.payload_size >= 1 << 63:  # parse_op's integers are unbounded, a Spark long is not
            msg = f"line {line}: payload_size: must be below 2**63, got {op.payload_size}"
            out[line] = (None,) * 8 + (msg,)
            continue
        loc = op.location
        out[line] = (
            op.op,
            op.t,
            op.client,
            loc.lat if loc else None,
            loc.lon if loc else None,
            op.id or None,
            op.topic or None,
            op.payload_size if op.op == "publish" else None,
            None,
        )
    return out


def _actual(spark: Any, path: Path, fmt: str) -> dict[int, tuple[Any, ...]]:
    _, fed_text = load_federation(str(THREE))
    numbered, _ = read_numbered(
        spark,
        [str(path)],
        fmt,
        what="workload",
        required=("t", "op", "client", "lat", "lon", "id", "topic"),
        optional=("geofence", "payload_size"),
    )
    workload = parse_workload(workload_records(numbered, fmt), numbered, fmt, fed_text)
    parsed = workload.parsed
    typed = [(f.name, f.type) for f in to_arrow_schema(parsed.schema)]
    assert typed == [(f.name, f.type) for f in PARSED_SCHEMA]
    cols = ("op", "t", "client", "lat", "lon", "id", "topic", "payload", "err")
    rows = parsed.collect()
    assert workload.by_op == Counter(r["op"] for r in rows)
    return {int(r["line"]): tuple(r[c] for c in cols) for r in rows}


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    # -0.0 == 0.0 in Python; compare floats by their bits so a sign flip shows.
    return [repr(x) for x in a] == [repr(x) for x in b]


def test_json_lines_parse_as_the_core_does(spark: Any, tmp_path: Path) -> None:
    rng = random.Random(18)
    lines = [*(json.dumps(r) for r in THREE_TRACE), *ODD_LINES, *_records(rng, 600)]
    path = write_jsonl(tmp_path / "odd.jsonl", lines)
    records: list[tuple[int, Any]] = []
    errors: dict[int, str] = {}
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            records.append((n, json.loads(text)))
        except json.JSONDecodeError as exc:
            errors[n] = f"line {n}: not JSON: {exc.msg}"
    want = _expected(records) | {n: (None,) * 8 + (e,) for n, e in errors.items()}
    # The one deliberate difference: text Spark cannot hold is an error, not a crash.
    lone = lines.index('{"t": 1, "op": "move", "client": "c\\ud800", "lat": 1, "lon": 2}') + 1
    assert want[lone][-1] is None
    want[lone] = (None,) * 8 + (f"line {lone}: client: not valid Unicode (a lone surrogate)",)
    got = _actual(spark, path, "json")
    assert sorted(got) == sorted(want)  # blank lines skipped, every other line a row
    differ = {n: (got[n], want[n]) for n in want if not _same(got[n], want[n])}
    assert not differ, "\n".join(
        f"line {n}: {lines[n - 1]!r}: {g} != {w}" for n, (g, w) in differ.items()
    )
    # The mix exercised both paths: good rows and errors of many fields.
    assert sum(1 for v in want.values() if v[-1] is None) > 50
    assert len({v[-1].split(":")[1] for v in want.values() if v[-1]}) > 8


def test_parquet_rows_parse_as_the_core_does(spark: Any, tmp_path: Path) -> None:
    # Typed columns: NaN and out-of-range numbers, nulls, whole-number float
    # payloads (pandas' integers with nulls), int32 times, float32 positions.
    rows = [dict(r) for r in THREE_TRACE]
    rows[0]["lat"] = float("nan")
    rows[1]["topic"] = "a/#/b"
    rows[2]["payload_size"] = 1.5
    rows[3]["client"] = ""
    rows[4]["geofence"] = "POLYGON((0 0"
    rows.append({**THREE_TRACE[2], "id": "e9", "payload_size": None})
    rows.append({**THREE_TRACE[2], "id": "e10", "lon": 181.0})
    cols = {c: [r.get(c) for r in rows] for c in FIELDS}
    cols["payload_size"] = [None if v is None else float(v) for v in cols["payload_size"]]
    table = pa.table(
        {
            **{c: pa.array(v) for c, v in cols.items() if c not in ("t", "lat", "lon")},
            "t": pa.array([int(v) for v in cols["t"]], pa.int32()),
            "lat": pa.array(cols["lat"], pa.float32()),
            "lon": pa.array(cols["lon"], pa.float64()),
        }
    )
    path = tmp_path / "w.parquet"
    pq.write_table(table, path)
    records = []
    for n, row in enumerate(table.to_pylist(), start=1):
        size = row.get("payload_size")
        if isinstance(size, float) and size.is_integer():
            row["payload_size"] = int(size)
        records.append((n, row))
    want = _expected(records)
    got = _actual(spark, path, "parquet")
    differ = {n: (got[n], want[n]) for n in want if not _same(got[n], want[n])}
    assert not differ, differ
    assert sum(1 for v in want.values() if v[-1]) == 6


# Points the distinct-value path groups (Spark groups -0.0 with 0.0), on and
# off the antimeridian, and geofences good and bad, each on many lines.
POINTS = [
    (0.0, 0.0),
    (-0.0, 0.0),
    (0.0, -0.0),
    (-0.0, -0.0),
    (-0.0, 180.0),
    (0.0, -180.0),
    (50.1, 8.6),
    (1.3, 103.8),
    (-33.9, 151.2),
]
FENCES = [
    None,
    AROUND_FRANKFURT,
    "POLYGON((0 0",
    "POLYGON((0 0, 1 1, 1 0, 0 1, 0 0))",
    '{"circle": {"lat": 50, "lon": 8, "radius_m": 1000}}',
    '{"circle": {"lat": 95, "lon": 8, "radius_m": 1000}}',
]


@pytest.mark.parametrize("broadcast_rows", [2_000_000, 0])
def test_parquet_points_and_geofences_repeated_across_files(
    spark: Any, tmp_path: Path, broadcast_rows: int
) -> None:
    """Every row gets its own point's broker and cell and its own line in a geofence error,
    whether the answers are broadcast or joined by a shuffle, across files and partitions;
    the rows the JVM does not vouch for are read again by their k (both joins too)."""
    rng = random.Random(5)
    rows: list[dict[str, Any]] = []
    for i in range(900):
        lat, lon = rng.choice(POINTS)
        kind = rng.choice(["publish", "publish", "subscribe", "move", "unsubscribe"])
        rec: dict[str, Any] = {"t": float(i), "op": kind, "client": f"c{i % 7}", "id": f"x{i}"}
        rec.update(lat=lat, lon=lon, topic="a/b", geofence=None, payload_size=None)
        if kind == "publish":
            rec["payload_size"] = i
        if kind in ("publish", "subscribe"):
            rec["geofence"] = rng.choice(FENCES)
        if kind == "unsubscribe":
            rec.update(lat=None, lon=None)
        if i % 37 == 0:
            rec["client"] = ""  # parse_op names it; the JVM leaves it to parse_op
        rows.append(rec)
    folder = tmp_path / "w.parquet"
    folder.mkdir()
    for part in range(3):  # three files: each point and geofence in every one
        chunk = rows[part * 300 : (part + 1) * 300]
        pq.write_table(pa.Table.from_pylist(chunk), folder / f"part-{part}.parquet")
    fed, fed_text = load_federation(str(THREE))
    fidx = FederationIndex(fed)
    paths = sorted(str(p) for p in folder.iterdir())
    numbered, _ = read_numbered(
        spark,
        paths,
        "parquet",
        what="workload",
        required=WORKLOAD_REQUIRED,
        optional=("geofence", "payload_size"),
    )
    workload = parse_workload(
        workload_records(numbered, "parquet"),
        numbered,
        "parquet",
        fed_text,
        broadcast_rows=broadcast_rows,
    )
    got = {(r["file"], r["line"]): r for r in workload.parsed.collect()}
    assert len(got) == len(rows)
    assert workload.by_op == Counter(r["op"] for r in got.values())
    cache = GeofenceCache()
    fences: set[int] = set()
    for n, rec in enumerate(rows):
        line = n % 300 + 1
        row = got[(n // 300, line)]
        try:
            op = parse_op(rec, line, cache)
        except GeofedError as exc:
            assert row["err"] == str(exc), (n, rec)
            assert row["op"] is None and row["home"] is None
            continue
        assert row["err"] is None and row["op"] == op.op, (n, rec)
        loc = op.location
        if loc is None:
            assert row["home"] is None and row["cell"] is None
        else:
            lat, lon = np.array([loc.lat]), np.array([loc.lon])
            assert _same((row["lat"], row["lon"]), (loc.lat, loc.lon))
            assert row["home"] == fidx.responsible(lat, lon)[0], (n, rec)
            want_cell = h3_cells(lat, lon, H3_RES_MAX)[0] if op.op == "publish" else None
            assert row["cell"] == want_cell, (n, rec)
        want_fence = None if op.geofence is None else fence_id(op.geofence)
        assert row["fence"] == want_fence, (n, rec)
        if want_fence is not None:
            fences.add(want_fence)
            assert row["meet"] == fidx.meeting([op.geofence.geometry])[0]
    shapes = {r["fence"]: shapely.from_wkb(r["wkb"]) for r in workload.shapes.collect()}
    assert fences <= set(shapes)
    # The repeated errors kept their lines: one message per line of a file, not per text.
    bad = [(r["file"], r["err"]) for r in got.values() if r["err"] and "geofence" in r["err"]]
    assert len(bad) > 50 and len(set(bad)) == len(bad)
    assert sum(1 for r in got.values() if r["err"] and "client" in r["err"]) == 25


@given(
    st.floats(-90.0, 90.0),
    st.floats(-180.0, 180.0),
)
@settings(max_examples=300, deadline=None)
def test_a_signed_zero_has_the_broker_and_cell_of_zero(lat: float, lon: float) -> None:
    """Spark groups -0.0 with 0.0 when it looks points up once per distinct value: both must
    answer the same broker and H3 cell (as `parse_op`'s path answers them per row)."""
    fidx = _aws_index()
    for a, b in ((0.0, lon), (lat, 0.0), (0.0, 0.0)):
        plus = np.array([a]), np.array([b])
        minus = np.array([-a if a == 0 else a]), np.array([-b if b == 0 else b])
        assert fidx.responsible(*plus)[0] == fidx.responsible(*minus)[0]
        assert h3_cells(*plus, H3_RES_MAX)[0] == h3_cells(*minus, H3_RES_MAX)[0]


@functools.cache
def _aws_index() -> FederationIndex:
    return FederationIndex(load_federation(str(AWS))[0])
