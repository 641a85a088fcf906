"""Benchmark one broker's message history: logging rate and query latency.

Not a test: it prints what it measured and appends it to
``bench/results/history.md`` with the command and the machine.

In process, through `HistoryLog` as the node uses it: N entries (context
workload shapes: publishers around the world's cities, topics over a few
hundred sensors, 200-byte payloads, a tenth with an event geofence) are
recorded in batches of 1,000 and flushed; then queries run, each 50 times:
a 500 km box around a city with a one-level wildcard filter (the usual map
question), the same with a one-hour window, and the whole world (every entry
is a candidate), each asking for the newest 100. Backends: SQLite in a file
(`history.db`), SQLite in memory, and PostgreSQL/PostGIS when ``--dsn`` names
one (the test suite's throw-away cluster works: see tests/conftest.py).

Usage: ``python -m geofed.bench.history_bench [--entries 100000] [--dsn postgresql://...]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from shapely.geometry import box

from geofed.bench._machine import record
from geofed.node import HistoryBackend, HistoryLog, PostgisHistory, SqliteHistory
from geofed.routing import HistoryQuery, HistoryRecord, LatLon, circle

RESULTS = Path(__file__).resolve().parent / "results" / "history.md"
CITIES = [
    (48.85, 2.35),
    (52.52, 13.40),
    (40.71, -74.0),
    (41.88, -87.63),
    (1.29, 103.85),
    (35.68, 139.77),
    (-33.87, 151.21),
    (-23.55, -46.63),
    (19.08, 72.88),
    (30.04, 31.24),
]
BATCH = 1_000
REPEAT = 50


def records(n: int, now: float, seed: int = 1) -> list[HistoryRecord]:
    rng = random.Random(seed)
    fences = [circle(LatLon(lat, lon), 50_000) for lat, lon in CITIES]
    out = []
    for i in range(n):
        lat, lon = rng.choice(CITIES)
        where = LatLon(lat + rng.uniform(-3, 3), lon + rng.uniform(-3, 3))
        fence = rng.choice(fences) if rng.random() < 0.1 else None
        topic = f"sensors/{rng.randrange(300)}/{rng.choice(['temp', 'wind', 'rain'])}"
        t = now - 86_400 + 86_400 * i / n
        out.append(HistoryRecord(f"e{i}", topic, rng.randbytes(200), t, "b", where, fence))
    return out


async def run_backend(
    name: str, backend: HistoryBackend, data: list[HistoryRecord]
) -> dict[str, Any]:
    log = HistoryLog(backend, 0.0, 1 << 40)
    log.open()
    try:
        started = time.perf_counter()
        for i in range(0, len(data), BATCH):
            log.record(data[i : i + BATCH])
            await log.flush()
        write_s = time.perf_counter() - started
        now = data[-1].published_at
        paris = box(2.35 - 3.2, 48.85 - 2.25, 2.35 + 3.2, 48.85 + 2.25)  # about 500 km
        queries = {
            "box, sensors/+/temp": HistoryQuery("sensors/+/temp", None, None, paris, 100),
            "box, last hour": HistoryQuery("sensors/#", now - 3600, None, paris, 100),
            "world, #": HistoryQuery("#", None, None, None, 100),
        }
        latency = {}
        for label, q in queries.items():
            times = []
            for _ in range(REPEAT):
                t0 = time.perf_counter()
                found, _ = await log.query(q)
                times.append(time.perf_counter() - t0)
            assert found, label
            latency[label] = (statistics.median(times) * 1000, max(times) * 1000)
        return {
            "backend": name,
            "entries": len(data),
            "write_per_s": len(data) / write_s,
            "latency": latency,
        }
    finally:
        await log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m geofed.bench.history_bench")
    p.add_argument("--entries", type=int, default=100_000, help="entries logged first")
    p.add_argument("--dsn", default="", help="PostgreSQL/PostGIS DSN (also benchmarked)")
    p.add_argument(
        "--no-record", action="store_true", help="do not append to bench/results/history.md"
    )
    args = p.parse_args(argv)
    data = records(args.entries, time.time())
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="geofed-history-bench-") as tmp:
        backends: list[tuple[str, HistoryBackend]] = [
            ("sqlite file", SqliteHistory(str(Path(tmp) / "history.db"))),
            ("sqlite memory", SqliteHistory(":memory:", "off")),
        ]
        if args.dsn:
            backends.append(("postgis", PostgisHistory(args.dsn, "bench-" + uuid.uuid4().hex[:8])))
        for name, backend in backends:
            print(f"[{name}] {args.entries} entries ...", file=sys.stderr)
            rows.append(asyncio.run(run_backend(name, backend, data)))
    load_after = os.getloadavg()
    labels = list(rows[0]["latency"])
    header = (
        "| backend | entries | logged/s | "
        + " | ".join(f"{label} p50 / max ms" for label in labels)
        + " |\n|---|---:|---:|"
        + "---:|" * len(labels)
    )
    lines = [
        f"| {r['backend']} | {r['entries']:,} | {r['write_per_s']:,.0f} | "
        + " | ".join(f"{r['latency'][x][0]:.1f} / {r['latency'][x][1]:.1f}" for x in labels)
        + " |"
        for r in rows
    ]
    table = "\n".join([header, *lines])
    print(table)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.history_bench",
            # A DSN may hold a password: the command is recorded without it.
            [
                a if not a.startswith("postgresql://") else "postgresql://..."
                for a in (argv if argv is not None else sys.argv[1:])
            ],
            f"Load average before / after: {load_before[0]:.1f} / {load_after[0]:.1f}\n\n{table}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
