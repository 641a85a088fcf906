"""The pure parts of ``geofed bench``: statistics, savings, report tables, inputs.

Everything here runs on hand-made measurements; the live federation is
covered by tests/integration/test_bench_smoke.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from geofed.bench import _compare_report as rep
from geofed.bench import compare
from geofed.routing import Federation, InvalidInput, TraceOp, latlon

ROOT = Path(__file__).resolve().parents[3]
THREE = ROOT / "deploy" / "federations" / "three.geojson"


# -- statistics ---------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_is_numpys_linear(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.uniform(0, 500) for _ in range(n)]
    for q in (0, 1, 50, 95, 99, 100):
        assert rep.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edges() -> None:
    assert rep.percentile([], 50) is None
    assert rep.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert rep.percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError, match="percentile"):
        rep.percentile([1.0], 101)


def test_latency_summary_splits_same_and_cross_region_in_ms() -> None:
    lat = [("eu", "eu", 0.001), ("eu", "eu", 0.003), ("eu", "us", 0.140), ("us", "eu", 0.160)]
    lat.append(("", "eu", 9.0))  # unknown publisher broker: left out
    s = rep.latency_summary(lat)
    assert s["same_region"] == {
        "n": 2,
        "p50": 2.0,
        "p95": 2.9,
        "p99": 2.98,
        "mean": 2.0,
        "max": 3.0,
    }
    assert s["cross_region"]["n"] == 2
    assert s["cross_region"]["p50"] == pytest.approx(150.0)
    assert s["cross_region"]["max"] == pytest.approx(160.0)


def test_latency_summary_empty_groups() -> None:
    s = rep.latency_summary([])
    assert s["same_region"] == {
        "n": 0,
        "p50": None,
        "p95": None,
        "p99": None,
        "mean": None,
        "max": None,
    }


def test_accuracy_counts_missing_unexpected_and_duplicates() -> None:
    expected = [("e1", "s1"), ("e1", "s2"), ("e2", "s1"), ("e3", "s3")]
    got = [("e1", "s1"), ("e1", "s1"), ("e2", "s1"), ("e9", "s9")]
    a = rep.accuracy(got, expected)
    assert a == {
        "expected": 4,
        "received": 4,
        "recall": 0.5,
        "precision": 2 / 3,
        "duplicates": 1,
        "missing": 2,
        "unexpected": 1,
    }


def test_accuracy_of_nothing_is_perfect() -> None:
    a = rep.accuracy([], [])
    assert (a["recall"], a["precision"]) == (1.0, 1.0)
    assert rep.accuracy([], [("e", "s")])["recall"] == 0.0


def test_saved_percent() -> None:
    assert rep.saved_percent(200, 50) == 75.0
    assert rep.saved_percent(100, 300) == -200.0
    assert rep.saved_percent(0, 5) is None
    assert rep.saved_percent(None, 5) is None


# -- savings and lower bound -----------------------------------------------------


def _row(strategy: str, messages: int, byts: int, lower_bound: int = 10) -> dict[str, Any]:
    return {
        "strategy": strategy,
        "messages": {"total": messages},
        "bytes": {"total": byts},
        "lower_bound": lower_bound,
    }


def test_savings_against_measured_baselines() -> None:
    rows = [
        _row("flooding-events", 2000, 20_000),
        _row("flooding-subscriptions", 400, 8_000),
        _row("event-geofence", 500, 5_000),
    ]
    rep.add_comparisons(rows, {"flooding-events": 1, "flooding-subscriptions": 1})
    geo = rows[2]
    assert geo["savings"]["flooding-events"] == {
        "baseline_source": "measured",
        "messages_percent": 75.0,
        "bytes_percent": 75.0,
    }
    assert geo["savings"]["flooding-subscriptions"] == {
        "baseline_source": "measured",
        "messages_percent": -25.0,
        "bytes_percent": 37.5,
    }
    assert rows[0]["savings"]["flooding-events"]["messages_percent"] == 0.0
    assert geo["ratio_to_lower_bound"] == 50.0


def test_savings_fall_back_to_the_model_when_a_baseline_did_not_run() -> None:
    rows = [_row("subscription-geofence", 30, 900, lower_bound=0)]
    rep.add_comparisons(rows, {"flooding-events": 300, "flooding-subscriptions": 60})
    s = rows[0]["savings"]
    assert s["flooding-events"] == {
        "baseline_source": "model",
        "messages_percent": 90.0,
        "bytes_percent": None,
    }
    assert s["flooding-subscriptions"]["messages_percent"] == 50.0
    assert rows[0]["ratio_to_lower_bound"] is None  # no lower bound to divide by


# -- node metrics ----------------------------------------------------------------


def _samples(**values: float) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples from keyword names like ``sent__event__us`` = messages sent to us."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for key, v in values.items():
        what, *rest = key.split("__")
        if what in ("sent", "bytes"):
            kind, peer = rest
            name = (
                "geofed_peer_messages_sent_total"
                if what == "sent"
                else "geofed_peer_bytes_sent_total"
            )
            out[(name, (("kind", kind), ("peer", peer)))] = v
        elif what == "dropped":
            out[("geofed_peer_queue_dropped_total", (("peer", rest[0]),))] = v
        elif what == "subdropped":
            out[("geofed_subscriber_queue_dropped_total", ())] = v
        elif what == "cpu":
            out[("process_cpu_seconds_total", ())] = v
        elif what == "received":
            out[("geofed_peer_messages_received_total", (("kind", rest[0]), ("peer", rest[1])))] = v
    return out


def test_node_totals_are_deltas_between_scrapes() -> None:
    before = {
        "eu": _samples(sent__control__us=2, bytes__control__us=0, cpu=1.0),
        "us": _samples(sent__control__eu=2, cpu=2.0),
    }
    after = {
        "eu": _samples(
            sent__event__us=10,
            bytes__event__us=1000,
            sent__control__us=7,
            bytes__control__us=70,
            sent__subscribe__us=3,
            bytes__subscribe__us=300,
            sent__relocate__us=2,
            bytes__relocate__us=60,
            received__event__us=99,
            dropped__us=1,
            cpu=1.5,
        ),
        "us": _samples(
            sent__delivery__eu=4,
            bytes__delivery__eu=400,
            sent__control__eu=3,
            subdropped=2,
            cpu=4.25,
        ),
    }
    t = rep.node_totals(before, after)
    assert t["messages"] == {
        "event": 10,
        "subscribe": 3,
        "unsubscribe": 0,
        "relocate": 2,
        "delivery": 4,
        "total": 19,
    }
    assert t["bytes"] == {
        "event": 1000,
        "subscribe": 300,
        "unsubscribe": 0,
        "relocate": 60,
        "delivery": 400,
        "total": 1760,
    }
    assert t["control"] == {"messages": 6, "bytes": 70}
    assert t["drops"] == {"peer_queue": 1, "subscriber_queue": 2}
    assert t["cpu_s"] == {
        "sum": 2.75,
        "max": 2.25,
        "max_broker": "us",
        "per_node": {"eu": 0.5, "us": 2.25},
    }


def test_node_totals_without_process_metrics() -> None:
    t = rep.node_totals({}, {"eu": _samples(sent__event__us=1)})
    assert t["cpu_s"] == {"sum": None, "max": None, "max_broker": None, "per_node": {"eu": None}}
    assert t["messages"]["total"] == 1


# -- Spark summary -----------------------------------------------------------------


SPARK_SUMMARY = {
    "events": 7,
    "deliveries": 12,
    "strategies": {
        "event-geofence": {"messages": 11, "bytes": 700},
        "lower-bound": {"messages": 6, "bytes": 384},
    },
    "measured": {
        "records": 40,
        "errors": {"total": 0, "shown": []},
        "by_strategy_kind": [
            {
                "strategy": "event-geofence",
                "kind": "control",
                "predicted": 0,
                "measured": 9,
                "measured_bytes": 0,
                "status": "not-modelled",
            },
            {
                "strategy": "event-geofence",
                "kind": "event",
                "predicted": 11,
                "measured": 11,
                "measured_bytes": 2200,
                "status": "ok",
            },
        ],
        "duplicates": [],
    },
}


def test_spark_extract_leaves_control_out() -> None:
    s = rep.spark_extract(SPARK_SUMMARY)
    assert s["events"] == 7 and s["deliveries"] == 12
    assert s["strategies"]["event-geofence"] == {
        "what_if_messages": 11,
        "what_if_payload_bytes": 700,
        "traces_messages": 11,
        "traces_bytes": 2200,
        "statuses": {"event": "ok"},
    }
    assert s["strategies"]["lower-bound"] == {"what_if_messages": 6, "what_if_payload_bytes": 384}
    assert (s["trace_records"], s["trace_errors"], s["duplicates"]) == (40, 0, [])


def test_spark_extract_without_node_traces() -> None:
    s = rep.spark_extract({"events": 1, "deliveries": 0, "strategies": {}})
    assert "trace_records" not in s and s["strategies"] == {}


# -- report ------------------------------------------------------------------------


def _report(rows: list[dict[str, Any]], analysis: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "command": "geofed bench --federation three",
        "date": "2024-01-01 00:00 UTC",
        "machine": {
            "description": "2 cores, AMD EPYC, 8 GiB RAM, Python 3.11.7, Linux 6.1",
            "load_before": "1.00 1.00 1.00",
            "load_after": "2.00 1.00 1.00",
        },
        "federation": {"name": "three", "file": "three.geojson", "brokers": 3},
        "workload": {
            "file": "w.jsonl",
            "scenario": "mobile",
            "ops": 20,
            "events": 7,
            "subscriptions": 4,
            "clients": 8,
            "duration_s": 4.5,
            "expected_deliveries": 12,
        },
        "settings": {"wan": "off", "wan_latency": "off", "speed": 1.0, "barrier": False},
        "strategies": rows,
        "analysis": analysis,
    }


def _full_row(strategy: str, total: int) -> dict[str, Any]:
    row = _row(strategy, total, total * 100, lower_bound=6)
    row["messages"] = {
        "event": total,
        "subscribe": 0,
        "unsubscribe": 0,
        "delivery": 0,
        "total": total,
    }
    row["bytes"] = {k: v * 100 for k, v in row["messages"].items()}
    row["model"] = dict(row["messages"])
    row["control"] = {"messages": 3, "bytes": 0}
    row["drops"] = {"peer_queue": 0, "subscriber_queue": 0}
    row["deliveries"] = rep.accuracy([("e1", "s1")], [("e1", "s1"), ("e2", "s1")])
    row["latency_ms"] = rep.latency_summary([("eu", "eu", 0.002), ("eu", "us", 0.15)])
    row["replay"] = {
        "seconds": 4.6,
        "events": 7,
        "events_per_s": 1.52,
        "drain_s": 0.4,
        "sustained_events_per_s": 1.4,
        "max_lag_s": 0.01,
        "errors": 0,
    }
    row["cpu_s"] = {"sum": 1.5, "max": 0.75, "max_broker": "eu", "per_node": {}}
    return row


def test_markdown_tables() -> None:
    rows = [_full_row("flooding-events", 14), _full_row("event-geofence", 11)]
    rep.add_comparisons(rows, {"flooding-subscriptions": 20})
    md = rep.markdown(_report(rows, {"error": "geofed analyze exited with 1"}))
    assert md.startswith("# geofed bench: mobile on three (3 brokers)\n")
    lines = md.splitlines()
    messages = (
        "| flooding-events | 14 | 0 | 0 | 0 | 0 | **14** | 2.00 | 14 | +0.0% | +30.0% | 2.33 |"
    )
    assert messages in lines
    assert (
        "| event-geofence | 11 | 0 | 0 | 0 | 0 | **11** | 1.57 | 11 | +21.4% | +45.0% | 1.83 |"
        in lines
    )
    assert "| event-geofence | 1,100 | 0 | 0 | 0 | 0 | **1,100** | +21.4% | – |" in lines
    assert "| event-geofence | 2 | 1 | 0.5000 | 1.0000 | 0 | 1 | 0 | 0 / 0 | 0 |" in md
    assert "| event-geofence | 1 | 2.0 | 2.0 | 2.0 | 1 | 150.0 | 150.0 | 150.0 |" in md
    assert "| event-geofence | 7 | 4.6 | 1.5 | 0.40 | 1.4 | 0.01 | 1.5 | 0.8 (eu) |" in md
    assert "honouring the trace's `t` at speed ×1, no barrier" in md
    assert "Failed: geofed analyze exited with 1" in md


def test_markdown_spark_table_and_missing_values() -> None:
    rows = [_full_row("event-geofence", 11)]
    rows[0]["latency_ms"] = rep.latency_summary([])
    rep.add_comparisons(rows, {})
    md = rep.markdown(_report(rows, rep.spark_extract(SPARK_SUMMARY)))
    assert "| event-geofence | 11 | 700 | 11 | 11 | event ok |" in md
    assert "| lower-bound | 6 | 384 | – | – | – |" in md
    assert "| event-geofence | 0 | – | – | – | 0 | – | – | – |" in md  # no latencies
    assert "| event-geofence | 11 | 0 | 0 | 0 | 0 | **11** | 1.57 | 11 | – | – | 1.83 |" in md


def test_plots_are_written(tmp_path: Path) -> None:
    rows = [_full_row("flooding-events", 14), _full_row("subscription-geofence", 3)]
    rep.add_comparisons(rows, {"flooding-subscriptions": 20})
    names = rep.plot(_report(rows), tmp_path)
    assert names == ["messages.png", "latency.png", "cpu-throughput.png"]
    for n in names:
        assert (tmp_path / n).read_bytes().startswith(b"\x89PNG")


# -- command-line inputs -------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.register(parser.add_subparsers(), "bench")
    return parser.parse_args(["bench", *argv])


def test_defaults_and_reproducing_command() -> None:
    args = _args()
    compare._workload_args(args)
    assert (args.federation, args.wan, args.scenario, args.barrier) == (
        "aws-2020",
        "model",
        "mobile",
        False,
    )
    assert args.func is compare.run
    assert compare._command_line(args, 1.0) == (
        "geofed bench --federation aws-2020 --wan model --scenario mobile --clients 100"
        " --duration 30 --seed 1 --speed 1 --out out/bench/report --workdir out/bench/work"
    )
    args = _args(
        "--workload",
        "my trace.jsonl",
        "--barrier",
        "--strategy",
        "event-geofence",
        "--wan-ms-per-km",
        "0.05",
        "--no-analysis",
    )
    compare._workload_args(args)
    assert compare._command_line(args, 0.0) == (
        "geofed bench --federation aws-2020 --wan model --wan-ms-per-km 0.05"
        " --strategy event-geofence --workload 'my trace.jsonl' --speed 0 --barrier"
        " --out out/bench/report --workdir out/bench/work --no-analysis"
    )


def test_generation_options_are_refused_beside_a_workload_file() -> None:
    with pytest.raises(InvalidInput) as info:
        compare._workload_args(_args("--workload", "w.jsonl", "--scenario", "mobile"))
    assert info.value.field == "scenario"
    with pytest.raises(InvalidInput) as info:
        compare._workload_args(_args("--workload", "w.jsonl", "--seed", "3"))
    assert info.value.field == "seed"


def test_wan_settings(tmp_path: Path) -> None:
    fed = Federation.load(THREE)
    assert compare.wan_settings("off", None, fed) == ({}, "off")
    env, text = compare.wan_settings("model", None, fed)
    assert env == {"GEOFED_WAN_LATENCY": "model", "GEOFED_WAN_MS_PER_KM": "0.021"}
    assert text == "model, 0.021 ms/km of great-circle distance (one-way 138–326 ms)"
    env, text = compare.wan_settings("model", 0.1, fed)
    assert env["GEOFED_WAN_MS_PER_KM"] == "0.1" and "(one-way 655–1553 ms)" in text
    matrix = tmp_path / "m.json"
    matrix.write_text(json.dumps({"eu": {"us": 80, "ap": 120.5}}), encoding="utf-8")
    env, text = compare.wan_settings(str(matrix), None, fed)
    assert env == {"GEOFED_WAN_LATENCY": str(matrix.resolve())}
    assert text == f"matrix {matrix} (one-way 80–120.5 ms)"


def test_wan_settings_reject_bad_input(tmp_path: Path) -> None:
    fed = Federation.load(THREE)
    with pytest.raises(InvalidInput, match="wan"):
        compare.wan_settings(str(tmp_path / "missing.json"), None, fed)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(InvalidInput, match="not a JSON matrix"):
        compare.wan_settings(str(bad), None, fed)
    with pytest.raises(InvalidInput, match="wan_ms_per_km"):
        compare.wan_settings("model", -1.0, fed)
    doc = fed.to_geojson()
    for f in doc["features"]:
        del f["properties"]["site"]
    no_sites = Federation.from_geojson(doc)
    with pytest.raises(InvalidInput, match="needs a site"):
        compare.wan_settings("model", None, no_sites)


def test_generated_workload_is_written_for_spark(tmp_path: Path) -> None:
    args = _args("--scenario", "open-data", "--clients", "10", "--duration", "5", "--seed", "3")
    ops, info = compare._workload(args, tmp_path / "w.jsonl")
    lines = (tmp_path / "w.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(ops) == info["ops"] > 0
    assert info["scenario"] == "open-data" and info["clients"] == 10
    assert info["events"] == sum(1 for o in ops if o.op == "publish")
    assert info["duration_s"] <= 5.0


def test_pacer_counts_and_measures_lag() -> None:
    ops = [TraceOp(0.0, "move", "c", latlon(0, 0)), TraceOp(0.01, "move", "c", latlon(1, 1))]
    pacer = compare._Pacer(ops, speed=1.0)
    it = iter(pacer)
    next(it)
    time.sleep(0.05)  # the first op "took" 50 ms: the second starts ~40 ms late
    next(it)
    assert 0.03 < pacer.max_lag < 1.0
    assert list(it) == [] and pacer.done == 2
    assert compare._Pacer(ops, speed=0.0).max_lag == 0.0


def test_pacer_stops_a_cancelled_replay() -> None:
    ops = [TraceOp(0.0, "move", "c", latlon(0, 0))] * 1000

    async def replay(pacer: compare._Pacer) -> None:
        for _ in pacer:
            # As the replayer does with an RPC cancelled under it: noted, not raised.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.001)

    async def main() -> int:
        pacer = compare._Pacer(ops, speed=0.0)
        task = asyncio.create_task(replay(pacer))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pacer.done

    assert 0 < asyncio.run(main()) < len(ops)


def test_trim_traces_drops_records_after_the_cutoff(tmp_path: Path) -> None:
    src = tmp_path / "s"
    src.mkdir()
    recs = [{"t": 1.0, "kind": "event"}, {"t": 2.0, "kind": "unsubscribe"}]
    (src / "trace-eu.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in recs) + "not json\n", encoding="utf-8"
    )
    (src / "node-eu.log").write_text("x\n", encoding="utf-8")
    compare._trim_traces(src, src / "measured", cutoff=1.5)
    assert [p.name for p in (src / "measured").iterdir()] == ["trace-eu.jsonl"]
    kept = (src / "measured" / "trace-eu.jsonl").read_text(encoding="utf-8").splitlines()
    assert kept == [json.dumps(recs[0]), "not json"]  # malformed lines are the analysis's to report


# -- progress ----------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_in_place_on_a_terminal() -> None:
    out = _Terminal()
    progress = compare._Progress(out)
    assert progress.every_s < compare._HEARTBEAT_S
    progress.bar("fe: actions", 25, 100, ", 3 deliveries")
    progress.bar("fe: actions", 50, 100)
    progress.say("fe: done")
    text = out.getvalue()
    draws = text.split("\r")[1:]
    assert any("25/100" in d and "3 deliveries" in d for d in draws)
    assert any("50/100" in d for d in draws)
    # The next line starts on a fresh line, after the bar.
    assert "\n[geofed bench" in text and text.endswith("fe: done\n")


def test_progress_prints_lines_in_logs() -> None:
    out = io.StringIO()
    progress = compare._Progress(out)
    assert progress.every_s == compare._HEARTBEAT_S
    progress.bar("fe: actions", 828, 3132, ", 60 deliveries")
    assert "\r" not in out.getvalue()
    assert out.getvalue().endswith("fe: actions: 828/3,132, 60 deliveries\n")
