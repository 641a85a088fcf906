"""Bad input: counted and reported by line, never a crash; unusable inputs exit with status 2."""

from __future__ import annotations

import argparse
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.testing import assertDataFrameEqual
from spark_helpers import THREE, run, spark_counts, write_jsonl
from test_spark_known import THREE_TRACE

from geofed.bench import analyze as cli
from geofed.bench.analysis import print_table
from geofed.routing import Federation, InvalidInput, parse_op, predict

pytestmark = pytest.mark.spark

BAD = [
    "{not json",  # line 3
    json.dumps({"t": 1, "op": "teleport", "client": "c9", "lat": 0, "lon": 0}),
    json.dumps({"t": 1, "op": "move", "client": "c9", "lat": 91, "lon": 0}),
    json.dumps(
        {
            "t": 1,
            "op": "subscribe",
            "client": "c9",
            "lat": 0,
            "lon": 0,
            "id": "s9",
            "topic": "a/#/b",
        }
    ),
    json.dumps(
        {
            "t": 1,
            "op": "publish",
            "client": "c9",
            "lat": 0,
            "lon": 0,
            "id": "e9",
            "topic": "a",
            "geofence": "POLYGON((0 0, 1 1, 1 0, 0 1, 0 0))",
        }  # self-intersecting
    ),
    json.dumps(
        {
            "t": 1,
            "op": "publish",
            "client": "c9",
            "lat": 0,
            "lon": 0,
            "id": "e9",
            "topic": "a",
            "payload_size": 1.5,
        }
    ),
    "[1, 2]",
    json.dumps({"t": -1, "op": "move", "client": "c9", "lat": 0, "lon": 0}),
]


def test_malformed_lines_are_counted_and_named(spark: Any, tmp_path: Path) -> None:
    good = THREE_TRACE
    # Two good lines, a blank line (skipped, but counted in numbering), the bad ones, then the rest.
    lines: list[Any] = [good[0], good[1], "", *BAD, *good[2:]]
    result = run(spark, THREE, write_jsonl(tmp_path / "bad.jsonl", lines), max_errors=5)
    errors = result.summary["errors"]
    assert errors["total"] == len(BAD)
    shown = errors["shown"]
    assert [e["line"] for e in shown] == [4, 5, 6, 7, 8]  # the first max_errors, in line order
    assert all(e["file"] == "bad.jsonl" for e in shown)
    assert "not JSON" in shown[0]["error"]
    assert "line 5: op" in shown[1]["error"]
    assert "line 6" in shown[2]["error"] and "lat" in shown[2]["error"]
    assert "line 7: topic" in shown[3]["error"]
    assert "line 8: geofence" in shown[4]["error"]
    assert result.malformed is not None
    assertDataFrameEqual(
        result.malformed.select("line"), [(n,) for n in range(4, 4 + len(BAD))], checkRowOrder=False
    )
    # The good lines are analyzed as if the bad ones were not there.
    ops = [parse_op(r, i) for i, r in enumerate(good, start=1)]
    got = spark_counts(result)
    fed = Federation.load(THREE)
    for name in ("flooding-events", "subscription-geofence"):
        assert got.get(name, Counter()) == +predict(fed, name, ops).messages


def test_error_list_is_capped_but_all_are_counted(spark: Any, tmp_path: Path) -> None:
    lines = [THREE_TRACE[0]] + ["garbage"] * 250
    result = run(spark, THREE, write_jsonl(tmp_path / "many.jsonl", lines))
    assert result.summary["errors"]["total"] == 250
    assert len(result.summary["errors"]["shown"]) == 100
    assert result.summary["errors"]["shown"][-1]["line"] == 101


def _parquet(path: Path, columns: dict[str, list[Any]]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_without_a_required_column_is_invalid_input(spark: Any, tmp_path: Path) -> None:
    trace = _parquet(
        tmp_path / "w.parquet",
        {"t": [0.0], "op": ["move"], "client": ["c1"], "lat": [1.0], "id": ["x"], "topic": ["a"]},
    )
    with pytest.raises(InvalidInput) as err:
        run(spark, THREE, trace)
    assert err.value.field == "workload.lon"
    args = argparse.Namespace(
        federation=str(THREE),
        workload=[str(trace)],
        node_trace=[],
        out=str(tmp_path / "out"),
        master=None,
        workload_format=None,
        node_format=None,
        h3_res=None,
        max_errors=100,
        driver_memory=None,
        executor_memory=None,
        checkpoint_dir=None,
        conf=[],
        force=False,
        no_plots=True,
    )
    assert cli.run(args) == 2  # the active test session is reused, not stopped


def test_parquet_rows_are_validated_by_row_number(spark: Any, tmp_path: Path) -> None:
    records = [dict(r) for r in THREE_TRACE]
    records[2] = {**records[2], "lat": float("nan")}
    cols = ("t", "op", "client", "lat", "lon", "id", "topic", "geofence", "payload_size")
    table = {c: [r.get(c) for r in records] for c in cols}
    # pandas writes integers with nulls as floats: whole numbers still count as integers.
    table["payload_size"] = [None if v is None else float(v) for v in table["payload_size"]]
    result = run(spark, THREE, _parquet(tmp_path / "w.parquet", table))
    assert result.summary["errors"]["total"] == 1
    assert result.summary["errors"]["shown"][0]["line"] == 3
    assert "lat" in result.summary["errors"]["shown"][0]["error"]
    assert result.summary["events"] == 2


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ("{broken", "federation"),
        (json.dumps({"type": "FeatureCollection", "features": []}), "features"),
        (
            json.dumps(
                {
                    "type": "FeatureCollection",
                    "features": [
                        {
                            "type": "Feature",
                            "properties": {"id": "a"},
                            "geometry": {"type": "Point", "coordinates": [0, 0]},
                        }
                    ],
                }
            ),
            "geometry.type",
        ),
    ],
)
def test_invalid_federation_exits_2_before_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, field: str
) -> None:
    fed = tmp_path / "fed.geojson"
    fed.write_text(content)
    trace = write_jsonl(tmp_path / "t.jsonl", THREE_TRACE)
    assert cli.main(["-f", str(fed), "-w", str(trace), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "geofed analyze: error:" in err and field in err


def test_missing_workload_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli.main(["-f", str(THREE), "-w", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o")])
        == 2
    )
    assert "no such file" in capsys.readouterr().err


def test_node_traces_compared_and_every_difference_flagged(spark: Any, tmp_path: Path) -> None:
    # What event-geofence nodes would log for THREE_TRACE (ap sends e1 to eu
    # and us), with: a control frame, an extra delivery the model does not
    # predict, e1 sent twice to eu (a duplicate), and two malformed records.
    def rec(
        src: str, dst: str, kind: str, ids: list[str], topic: str | None, size: int
    ) -> dict[str, Any]:
        return {
            "t": 1.5,
            "strategy": "event-geofence",
            "src": src,
            "dst": dst,
            "kind": kind,
            "ids": ids,
            "topic": topic,
            "bytes": size,
        }

    node = [
        rec("ap", "eu", "event", ["e1"], "sensors/x", 180),
        rec("ap", "us", "event", ["e1"], "sensors/x", 180),
        rec("ap", "eu", "event", ["e1"], "sensors/x", 180),
        rec("ap", "us", "control", [], None, 0),
        rec("eu", "us", "delivery", ["e3"], "sensors/y", 90),
        {**rec("ap", "mars", "event", ["e2"], "sensors/x", 1)},  # line 6: unknown broker
        "not json",  # line 7
    ]
    trace = write_jsonl(tmp_path / "t.jsonl", THREE_TRACE)
    nodes = write_jsonl(tmp_path / "ap.trace.jsonl", node)
    result = run(spark, THREE, trace, node_traces=(str(nodes),))
    m = result.summary["measured"]
    assert m["records"] == 5
    assert m["errors"]["total"] == 2
    assert [e["line"] for e in m["errors"]["shown"]] == [6, 7]
    assert "dst: not a broker" in m["errors"]["shown"][0]["error"]
    assert result.comparison is not None
    cmp = result.comparison.select(
        "strategy", "kind", "src", "dst", "predicted", "measured", "status"
    )
    assertDataFrameEqual(
        cmp,
        [
            ("event-geofence", "event", "ap", "eu", 1, 2, "differs"),
            ("event-geofence", "event", "ap", "us", 1, 1, "ok"),
            ("event-geofence", "control", "ap", "us", 0, 1, "not-modelled"),
            ("event-geofence", "delivery", "eu", "us", 0, 1, "unexpected"),
        ],
        checkRowOrder=False,
    )
    assert m["duplicates"] == [{"strategy": "event-geofence", "kind": "event", "duplicates": 1}]
    assert m["topic_differences"] == 2  # sensors/x events, sensors/y deliveries


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_workload_with_roaming_geofences_is_refused(spark: Any, tmp_path: Path, fmt: str) -> None:
    # The job does not model roaming geofences (docs/design.md §4): it says so
    # and names the first such line rather than analyse the trace wrongly.
    roaming = {"t": 2, "op": "subscribe", "client": "c8", "lat": 50.1, "lon": 8.7, "id": "s8",
               "topic": "sensors/#", "roaming": "roam:circle:2000"}  # fmt: skip
    if fmt == "jsonl":
        trace = write_jsonl(tmp_path / "w.jsonl", [*THREE_TRACE[:2], roaming])
    else:
        rows = [*THREE_TRACE[:2], roaming]
        cols = ("t", "op", "client", "lat", "lon", "id", "topic", "geofence", "roaming")
        trace = _parquet(tmp_path / "w.parquet", {c: [r.get(c) for r in rows] for c in cols})
    # Refused halfway through, after the first checkpoints were written: the
    # job deletes them (and Spark's folder for them) before it raises.
    folder = tmp_path / "checkpoints"
    with pytest.raises(InvalidInput) as err:
        run(spark, THREE, trace, checkpoint_dir=str(folder))
    assert err.value.field == "workload.roaming"
    assert "line 3" in err.value.reason and "not supported" in err.value.reason
    assert not list(folder.iterdir())


def test_unsubscribes_beyond_the_workload_are_explained(spark: Any, tmp_path: Path) -> None:
    """Node traces taken past the end of a replay hold the closing clients' unsubscribes;
    the comparison flags them and the printed result says where they come from."""
    closing = {
        "t": 9.0,
        "strategy": "flooding-subscriptions",
        "src": "eu",
        "dst": "ap",
        "kind": "unsubscribe",
        "ids": ["s-closing"],  # one per closing client, below
        "topic": None,
        "bytes": 40,
    }
    trace = write_jsonl(tmp_path / "t.jsonl", THREE_TRACE)
    many = [closing | {"ids": [f"s-closing-{i}"]} for i in range(10)]
    nodes = write_jsonl(tmp_path / "eu.trace.jsonl", many)
    result = run(spark, THREE, trace, node_traces=(str(nodes),))
    by_kind = result.summary["strategies"]["flooding-subscriptions"]["by_kind"]
    extra = 10 - by_kind["unsubscribe"]["messages"]
    assert extra > 0
    out = io.StringIO()
    print_table(result.summary, out)
    assert "NOTE more unsubscribes measured than the workload has" in out.getvalue()
    assert f"flooding-subscriptions +{extra:,}" in out.getvalue()
    assert "<strategy>/measured/" in out.getvalue()


def test_inputs_are_told_apart_by_content(spark: Any, tmp_path: Path) -> None:
    """Parquet is recognised by its bytes whatever its name; a folder mixing kinds is refused."""
    cols = ("t", "op", "client", "lat", "lon", "id", "topic", "geofence", "payload_size")
    table = {c: [r.get(c) for r in THREE_TRACE] for c in cols}
    data = _parquet(tmp_path / "trace.data", table)  # no .parquet in the name
    result = run(spark, THREE, data)
    assert result.summary["workload"]["format"] == "parquet"
    assert result.summary["events"] == 3 and result.summary["errors"]["total"] == 0
    result.release()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _parquet(mixed / "a.parquet", table)
    write_jsonl(mixed / "b.jsonl", THREE_TRACE)
    with pytest.raises(InvalidInput) as err:
        run(spark, THREE, mixed)
    assert err.value.field == "workload" and "mixes Parquet" in str(err.value)


def test_parquet_without_the_optional_columns_reads_them_as_absent(
    spark: Any, tmp_path: Path
) -> None:
    """geofence, payload_size and roaming are optional columns: a file without them is
    analysed as the same records in JSON Lines without those fields."""
    rows = [
        {k: v for k, v in r.items() if k not in ("geofence", "payload_size")} for r in THREE_TRACE
    ]
    cols = ("t", "op", "client", "lat", "lon", "id", "topic")
    parquet = _parquet(tmp_path / "w.parquet", {c: [r.get(c) for r in rows] for c in cols})
    jsonl = write_jsonl(tmp_path / "w.jsonl", rows)
    assert spark_counts(run(spark, THREE, parquet)) == spark_counts(run(spark, THREE, jsonl))
