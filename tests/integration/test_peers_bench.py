"""``python -m geofed.bench.peers`` end to end at a tiny size (issue #16's smoke test).

The 3-region federation and a hand-written trace (event and subscription
geofences, wildcards, a world-wide event, an unsubscribe, a move that changes
what a geofenced event reaches): geofed under every strategy (its own exact
``geofed bench`` run) and every peer system (Mosquitto bridge star, NATS
super-cluster with plain and geo-encoded subjects) on Debian's brokers on
loopback. The report has every system's row; after the client-side exact
check every system delivers exactly the oracle's pairs; and the messages the
counting proxies saw cross the links equal the brokers' own statistics. The
single-node section runs too, geofenced traffic at a tiny size: every broker
delivers the events inside the fence, the peers after turning down the ones
just outside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from geofed.bench import read_trace_file
from geofed.bench.peers import PEERS
from geofed.routing import STRATEGIES, reference_deliveries

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"
PARIS, LYON, NYC, BOSTON = (48.85, 2.35), (45.76, 4.84), (40.71, -74.01), (42.36, -71.06)
TOKYO, FRANKFURT = (35.68, 139.77), (50.11, 8.68)
FRANCE = "POLYGON((-5 42, 8 42, 8 51, -5 51, -5 42))"
NEAR_PARIS = "POLYGON((1.5 47.3, 6.25 46.9, 7.8 50.05, 2.1 51.3, 1.5 47.3))"


def _op(t: float, kind: str, client: str, at: tuple[float, float] | None, **kw: Any) -> str:
    rec: dict[str, Any] = {"t": t, "op": kind, "client": client}
    if at is not None:
        rec.update(lat=at[0], lon=at[1])
    rec.update(kw)
    return json.dumps(rec)


TRACE = [
    _op(0.0, "subscribe", "paris", PARIS, id="s1", topic="a/#", geofence=None),
    _op(0.1, "subscribe", "nyc", NYC, id="s2", topic="a/+", geofence=FRANCE),
    _op(0.2, "subscribe", "tokyo", TOKYO, id="s3", topic="#", geofence=None),
    _op(0.3, "subscribe", "boston", BOSTON, id="s4", topic="a/b", geofence=NEAR_PARIS),
    _op(1.0, "publish", "lyon", LYON, id="e1", topic="a/b", geofence=None, payload_size=64),
    _op(1.1, "publish", "fra", FRANKFURT, id="e2", topic="a/c", geofence=FRANCE, payload_size=64),
    _op(1.2, "publish", "nyc2", NYC, id="e3", topic="a/b", geofence=NEAR_PARIS, payload_size=64),
    _op(1.3, "publish", "paris2", PARIS, id="e4", topic="b/x", geofence=None, payload_size=64),
    _op(2.0, "unsubscribe", "tokyo", None, id="s3"),
    _op(2.1, "move", "paris", LYON),
    _op(
        3.0, "publish", "paris2", PARIS, id="e5", topic="a/b", geofence=NEAR_PARIS, payload_size=64
    ),
    _op(3.1, "publish", "lyon", LYON, id="e6", topic="a/z", geofence=FRANCE, payload_size=64),
]


@pytest.mark.timeout(900)
def test_peers_report_has_every_system_and_agrees_with_the_oracle(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(TRACE) + "\n", encoding="utf-8")
    ops = list(read_trace_file(str(trace)))
    expected = sorted(set(reference_deliveries(ops)))
    assert len(expected) >= 6  # the trace exercises cross-region deliveries
    results, out_json = tmp_path / "peers.md", tmp_path / "peers.json"
    cmd = [sys.executable, "-m", "geofed.bench.peers", "--federation", str(THREE)]
    cmd += ["--scenario", "global", "--workload", str(trace), "--workdir", str(tmp_path / "w")]
    cmd += ["--results", str(results), "--json", str(out_json), "--settle-timeout", "60"]
    # The single-node section at a tiny size, geofenced traffic only (topic-only
    # traffic: tests/integration/test_perf_bench_smoke.py's brokers_bench run).
    cmd += ["--node-events", "200", "--node-rate", "100", "--node-seconds", "1"]
    cmd += ["--node-traffic", "geo"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out_json.read_text(encoding="utf-8"))
    (scenario,) = report["scenarios"]
    rows = {r["system"]: r for r in scenario["rows"]}
    assert set(rows) == {f"geofed {s}" for s in STRATEGIES} | set(PEERS)
    text = results.read_text(encoding="utf-8")
    for name in rows:
        assert f"| {name} |" in text
    assert scenario["expected"] == len(expected)
    for name, row in rows.items():
        after = row["after_check"]
        assert (after["recall"], after["precision"], after["duplicates"]) == (1.0, 1.0, 0), name
        assert after["received"] == len(expected), name
        assert not row["errors"], (name, row["errors"])
    for name in PEERS:
        row = rows[name]
        (stat,) = row["broker_stats"].values()
        assert stat == row["data"]["messages"], name  # the wire and the brokers agree
    # What each set-up costs, in the order the design predicts: the star floods,
    # NATS's interest keeps data to subscribed regions, geo subjects to matching ones.
    star, plain = rows["mosquitto-star"], rows["nats"]
    assert star["data"]["messages"] == 2 * 6  # 6 events, each to both other regions
    assert plain["data"]["messages"] <= star["data"]["messages"]
    for geo in ("nats-geo-decimal", "nats-geo-h3"):
        assert rows[geo]["before_check"]["received"] <= plain["before_check"]["received"]
        assert rows[geo]["interest"]["messages"] > plain["interest"]["messages"]

    # Single node: every broker delivered every geofenced event inside the fence
    # (the peers after their exact check), and the ratios are in the report.
    single = report["single_node"]
    (rep,) = single["repetitions"]
    for kind, tests in rep["results"].items():
        assert set(tests) == {"geo 1->1", "geo 1->10", "geo latency"}, kind
        for test, row in tests.items():
            assert "error" not in row, (kind, test, row)
            assert row["expected"] == row["delivered"] > 0, (kind, test)
            if kind != "geofed":  # half the events are published outside: turned down
                assert row["filtered"] == row["delivered"], (kind, test)
    assert all(v is not None and v > 0 for v in single["median_ratios"].values())
    assert "geo 1->10 vs nats" in text
