"""``geofed bench`` end to end at a tiny size: the report's content, not its timings.

One exact run (``--barrier``) of all four strategies on the 3-broker
federation with a hand-written workload (every op kind, cross-region and
local deliveries, a re-homing move), the Spark analysis included: measured
messages equal the cost model, the analysis's what-if and node-trace figures
equal them too, and deliveries equal the central matcher. Then one paced run
(the default mode) of two strategies without Spark, checked for shape only:
its recall and precision are measurements, not guarantees.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from geofed.bench import read_trace_file
from geofed.routing import STRATEGIES, Federation, predict, reference_deliveries

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"

pytestmark = [pytest.mark.integration, pytest.mark.spark]

EUROPE = "POLYGON((-10 35, 30 35, 30 60, -10 60, -10 35))"
ASIA = "POLYGON((100 -10, 150 -10, 150 40, 100 40, 100 -10))"
PARIS, NYC, SINGAPORE, TOKYO = (48.85, 2.35), (40.71, -74.01), (1.29, 103.85), (35.68, 139.77)
FRANKFURT, DC, SGP, BOSTON = (50.11, 8.68), (38.9, -77.04), (1.35, 103.82), (42.36, -71.06)


def _op(
    t: float,
    kind: str,
    client: str,
    at: tuple[float, float],
    xid: str,
    topic: str,
    fence: str | None,
) -> dict[str, Any]:
    """A subscribe or publish record of a workload trace."""
    rec: dict[str, Any] = {"t": t, "op": kind, "client": client, "lat": at[0], "lon": at[1]}
    rec.update(id=xid, topic=topic, geofence=fence)
    if kind == "publish":
        rec["payload_size"] = 64
    return rec


WORKLOAD = [
    _op(0.0, "subscribe", "paris", PARIS, "s1", "a/#", None),
    _op(0.1, "subscribe", "nyc", NYC, "s2", "a/+", EUROPE),
    _op(0.2, "subscribe", "sing", SINGAPORE, "s3", "#", None),
    _op(0.3, "subscribe", "tokyo", TOKYO, "s4", "a/b", "POLYGON((0 45, 15 45, 15 55, 0 55, 0 45))"),
    _op(1.0, "publish", "fra", FRANKFURT, "e1", "a/b", None),
    _op(1.1, "publish", "dc", DC, "e2", "a/c", EUROPE),
    _op(1.2, "publish", "sgp", SGP, "e3", "b/x", None),
    {"t": 2.0, "op": "move", "client": "paris", "lat": BOSTON[0], "lon": BOSTON[1]},  # eu -> us
    _op(2.5, "publish", "fra", FRANKFURT, "e4", "a/b", None),
    {"t": 3.0, "op": "unsubscribe", "client": "sing", "id": "s3"},
    _op(3.5, "publish", "sgp", SGP, "e5", "a/x", EUROPE),
    _op(4.0, "publish", "dc", DC, "e6", "a/b", None),
    _op(4.5, "publish", "fra", FRANKFURT, "e7", "a/b", ASIA),
]
# Small delays: the barrier waits one hop per action, and this test is about content.
WAN_MS = {"eu": {"us": 8, "ap": 12}, "us": {"eu": 8, "ap": 15}, "ap": {"eu": 12, "us": 15}}
ROW_FIELDS = {
    "strategy",
    "messages",
    "bytes",
    "control",
    "drops",
    "cpu_s",
    "replay",
    "latency_ms",
    "stages_s",
    "model",
    "lower_bound",
    "deliveries",
    "savings",
    "ratio_to_lower_bound",
}


def _bench(tmp_path: Path, name: str, *args: str) -> tuple[int, Path, str]:
    out = tmp_path / name
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "geofed.cli",
            "bench",
            "--federation",
            str(THREE),
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / f"{name}-work"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    return proc.returncode, out, proc.stderr


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    trace = tmp_path / "workload.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in WORKLOAD), encoding="utf-8")
    wan = tmp_path / "wan.json"
    wan.write_text(json.dumps(WAN_MS), encoding="utf-8")
    return trace, wan


@pytest.mark.timeout(600)
def test_exact_run_matches_model_oracle_and_spark(
    tmp_path: Path, inputs: tuple[Path, Path]
) -> None:
    trace, wan = inputs
    rc, out, err = _bench(
        tmp_path, "exact", "--workload", str(trace), "--wan", str(wan), "--barrier"
    )
    assert rc == 0, err[-4000:]
    files = {p.name for p in out.iterdir()}
    assert {
        "report.md",
        "report.json",
        "messages.png",
        "latency.png",
        "cpu-throughput.png",
        "analysis-summary.json",
        "analysis-savings.png",
    } <= files
    assert {p.suffix for p in out.iterdir()} <= {".md", ".json", ".png"}  # no traces, no Parquet

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    ops = list(read_trace_file(trace))
    fed = Federation.load(THREE)
    rows = {r["strategy"]: r for r in report["strategies"]}
    assert list(rows) == list(STRATEGIES)
    assert report["workload"]["expected_deliveries"] == len(reference_deliveries(ops)) == 12
    assert report["settings"] == {
        "wan": f"matrix {wan} (one-way 8–15 ms)",
        "wan_latency": str(wan.resolve()),
        "speed": 0.0,
        "barrier": True,
        "tls": False,
    }
    for name, row in rows.items():
        assert set(row) >= ROW_FIELDS, name
        model = predict(fed, name, ops)
        kinds = model.by_kind()
        assert row["messages"] == {
            **{k: kinds[k] for k in ("event", "subscribe", "unsubscribe", "relocate", "delivery")},
            "total": model.total_messages,
        }, name
        assert row["lower_bound"] == model.lower_bound_total == 6
        d = row["deliveries"]
        assert (d["recall"], d["precision"], d["duplicates"], d["received"]) == (1.0, 1.0, 0, 12)
        lat = row["latency_ms"]
        assert lat["same_region"]["n"] + lat["cross_region"]["n"] == 12
        assert lat["cross_region"]["n"] > 0 and lat["same_region"]["n"] > 0
        assert row["bytes"]["total"] > 0 and row["replay"]["events"] == 7
        assert row["cpu_s"]["sum"] is not None and row["cpu_s"]["max_broker"] in fed.ids
        assert row["drops"] == {"peer_queue": 0, "subscriber_queue": 0}
    flood = rows["flooding-events"]["messages"]["total"]
    assert rows["flooding-events"]["savings"]["flooding-events"]["messages_percent"] == 0.0
    geo = rows["event-geofence"]
    assert geo["savings"]["flooding-events"] == {
        "baseline_source": "measured",
        "messages_percent": round(100 * (flood - geo["messages"]["total"]) / flood, 2),
        "bytes_percent": geo["savings"]["flooding-events"]["bytes_percent"],
    }

    spark: dict[str, Any] = report["analysis"]
    assert spark["deliveries"] == 12 and spark["trace_errors"] == 0
    for name, row in rows.items():
        s = spark["strategies"][name]
        assert s["what_if_messages"] == row["model"]["total"], name
        assert s["traces_messages"] == row["messages"]["total"], name
        assert set(s["statuses"].values()) <= {"ok"}, (name, s["statuses"])
    assert spark["strategies"]["lower-bound"]["what_if_messages"] == 6

    md = (out / "report.md").read_text(encoding="utf-8")
    for name in STRATEGIES:
        assert f"| {name} |" in md
    assert "barrier after every action" in md


def test_paced_run_reports_measured_accuracy(tmp_path: Path, inputs: tuple[Path, Path]) -> None:
    trace, wan = inputs
    rc, out, err = _bench(
        tmp_path,
        "paced",
        "--workload",
        str(trace),
        "--wan",
        str(wan),
        "--speed",
        "4",
        "--strategy",
        "event-geofence",
        "--strategy",
        "subscription-geofence",
        "--no-analysis",
    )
    assert rc == 0, err[-4000:]
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert [r["strategy"] for r in report["strategies"]] == [
        "event-geofence",
        "subscription-geofence",
    ]
    assert report["analysis"] is None and report["settings"]["speed"] == 4.0
    for row in report["strategies"]:
        assert 0.0 <= row["deliveries"]["recall"] <= 1.0
        assert row["replay"]["max_lag_s"] is not None
        assert row["replay"]["sustained_events_per_s"] > 0
        # The flooding baselines did not run: their cost-model totals stand in.
        assert row["savings"]["flooding-events"]["baseline_source"] == "model"
    assert "honouring the trace's `t` at speed ×4" in (out / "report.md").read_text("utf-8")
