"""Geofence covers: how many topic filters buy how much coverage, decimal vs H3.

Not a test: for a few geofences of different kinds (a lon/lat box, circles of
10 km and 1,000 km, a box across the antimeridian, a 2,000-vertex wavy
polygon, a two-part multipolygon) and filter budgets, it runs
`geofed.routing.cover` with a decimal layout (5 decimals) and an H3 layout
(resolution 9), both asked for a coverage of 0.99, and prints the filters
used, the coverage reached (area of the geofence / area of the cover, so
1 − coverage is the over-delivery share for evenly spread publishers), why
the refinement stopped, and the time taken. The table is appended to
``bench/results/cover.md`` with the command and the machine.

Usage: ``python -m geofed.bench.cover_bench [--budgets 10,50,500] [--no-record]``
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from geofed.bench._machine import record
from geofed.routing import DecimalLayout, Geofence, H3Layout, circle, cover, latlon, parse_geofence

RESULTS = Path(__file__).resolve().parent / "results" / "cover.md"


def _wavy(n: int) -> str:
    ring = []
    for i in range(n):
        a = 2 * math.pi * i / n
        r = 1 + 0.3 * math.sin(7 * a)
        ring.append((10 + 5 * r * math.cos(a), 50 + 3 * r * math.sin(a)))
    ring.append(ring[0])
    return "POLYGON((" + ", ".join(f"{x!r} {y!r}" for x, y in ring) + "))"


def geofences() -> dict[str, Geofence]:
    """The benchmark's geofences, by name."""
    shapes = {
        "box Europe 40x35 deg": parse_geofence("POLYGON((-10 36, 30 36, 30 71, -10 71, -10 36))"),
        "circle Tokyo 10 km": circle(latlon(35.6812, 139.7671), 10_000),
        "circle Paris 1,000 km": circle(latlon(48.85, 2.35), 1_000_000),
        "box across 180, 20x10 deg": parse_geofence(
            "POLYGON((170 -5, -170 -5, -170 5, 170 5, 170 -5))"
        ),
        "wavy polygon, 2,000 vertices": parse_geofence(_wavy(2000)),
        "multipolygon, 2 parts": parse_geofence(
            "MULTIPOLYGON(((-74.3 40.5, -73.7 40.5, -73.7 40.9, -74.3 40.9, -74.3 40.5)),"
            " ((103.6 1.2, 104.0 1.2, 104.0 1.5, 103.6 1.5, 103.6 1.2)))"
        ),
    }
    return {k: v for k, v in shapes.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="10,50,500", help="max_filters values")
    parser.add_argument("--no-record", action="store_true", help=f"do not append to {RESULTS}")
    args = parser.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    layouts: dict[str, DecimalLayout | H3Layout] = {
        "decimal (5 dp)": DecimalLayout(decimals=5),
        "h3 (res 9)": H3Layout(resolution=9),
    }
    rows = [
        "| geofence | layout | max filters | filters | coverage | stopped | seconds |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for name, fence in geofences().items():
        for lname, layout in layouts.items():
            for k in budgets:
                started = time.perf_counter()
                result = cover(fence, layout, coverage=0.99, max_filters=k)
                took = time.perf_counter() - started
                rows.append(
                    f"| {name} | {lname} | {k} | {len(result.filters)} |"
                    f" {result.coverage:.3f} | {result.stopped} | {took:.2f} |"
                )
                print(rows[-1], flush=True)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.cover_bench",
            argv,
            "\n" + "\n".join(rows),
            title="# Geofence covers: filters vs coverage, decimal and H3 layouts\n\n"
            "Written by `bench/cover_bench.py` (see its docstring). Coverage is the"
            " geofence's area over the cover's (planar square degrees): 1 - coverage"
            " is the over-delivery share for evenly spread publishers. Target 0.99"
            " in every row.\n",
        )
        print(f"appended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
