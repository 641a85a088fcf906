"""The durable store's cost and memory at a page-cache size: one broker's writes, replayed.

Not a test: it prints what it measured and appends it to
``bench/results/store.md`` with the command and the machine.

A `Store` in a temporary directory takes the writes a broker of the soak's
three-broker federation makes (bench/soak.py), as fast as it can: per event
it publishes, the outbox rows for its two peers, its id in the local
duplicate window's ``seen`` rows and a commit (a publish waits for it); per
event each peer sends, the id in that peer's ``seen`` rows, a queued
delivery for a persistent subscriber every fourth time, and a commit (a
peer frame is acknowledged after it); the peers acknowledge the outbox rows
a few events later (deleted), the subscriber acknowledges its queue every
twenty events; the ``seen`` rows are trimmed every quarter window, as the
node does. ``--events`` such rounds (one publish, one event from each peer)
make the file outgrow any cache: ``seen`` grows to 1.25 windows per peer.

For each ``--cache-kib`` (`store_cache_kib`), in turn for ``--rounds``
rounds (the order rotated, so that a drift of the machine's load favours
none): events/s (wall clock), CPU µs per event of the whole process (the
event loop and the store's thread, `time.process_time`), the memory SQLite
holds at the end (`sqlite_memory_used`) and the file's size.

Usage: ``python -m geofed.bench.store_bench [--cache-kib 512,2000] [--events 150000]
[--window 100000] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from geofed.node import Store, sqlite_memory_used

from ._machine import record

RESULTS = Path(__file__).resolve().parent / "results" / "store.md"
TITLE = (
    "# The durable store: cost and memory by page-cache size\n\n"
    "`python -m geofed.bench.store_bench` (bench/store_bench.py says what it measures).\n"
)
PEERS = ("us", "ap")
_IDENTITY = {"broker_id": "eu", "strategy": "event-geofence", "federation_digest": "bench"}


@dataclass
class Run:
    """One replay at one cache size."""

    cache_kib: int
    events: int
    wall_s: float
    cpu_s: float
    sqlite_mib: float
    file_mib: float


async def _replay(store: Store, events: int, window: int, payload: bytes) -> None:
    oid = seen = offset = acked = 0
    added = dict.fromkeys(("", *PEERS), 0)

    def remember(peer: str, event_id: str) -> None:
        nonlocal seen
        seen += 1
        store.put_seen(peer, "event", event_id, seen)
        added[peer] += 1
        if added[peer] % max(1, window // 4) == 0:
            store.trim_seen(peer, window)

    for i in range(events):
        for peer in PEERS:
            oid += 1
            store.put_outbox(oid, peer, "event", f"eu-{i}", payload)
        remember("", f"eu-{i}")
        await store.commit()
        for peer in PEERS:
            remember(peer, f"{peer}-{i}")
            if i % 4 == 0:
                offset += 1
                store.put_pending("pers-eu/pers-eu-s", offset, payload)
            await store.commit()
        if i >= 5:
            for peer in PEERS:
                store.delete_outbox(peer, [("event", f"eu-{i - 5}")])
        if i % 20 == 0 and offset > acked:
            await store.ack("pers-eu/pers-eu-s", offset)
            acked = offset


def run_once(cache_kib: int, events: int, window: int, payload_bytes: int) -> Run:
    """Replay `events` rounds into a fresh store with a page cache of `cache_kib`."""
    with tempfile.TemporaryDirectory(prefix="geofed-store-bench-") as tmp:
        before = sqlite_memory_used() or 0
        store = Store(tmp, "normal", _IDENTITY, cache_kib=cache_kib)
        store.open()

        async def go() -> tuple[float, float, float]:
            try:
                t0, c0 = time.perf_counter(), time.process_time()
                await _replay(store, events, window, b"x" * payload_bytes)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                return wall, cpu, ((sqlite_memory_used() or 0) - before) / 2**20
            finally:
                await store.close()

        wall, cpu, held = asyncio.run(go())
        size = sum(p.stat().st_size for p in Path(tmp).iterdir()) / 2**20
    return Run(cache_kib, events, wall, cpu, held, size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--cache-kib", default="512,2000", help="comma-separated store_cache_kib")
    p.add_argument("--events", type=int, default=150_000, help="rounds per replay")
    p.add_argument("--window", type=int, default=100_000, help="dedup_window (seen trimming)")
    p.add_argument("--payload-bytes", type=int, default=1100, help="bytes per stored message")
    p.add_argument("--rounds", type=int, default=2, help="replays per cache size")
    p.add_argument("--no-record", action="store_true", help="do not append to store.md")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.cache_kib.split(",")]
    if any(k < 1 for k in sizes) or args.events < 1 or args.rounds < 1 or args.window < 4:
        p.error("--cache-kib, --events, --rounds must be >= 1, --window >= 4")
    rows = []
    for r in range(args.rounds):
        for k in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
            run = run_once(k, args.events, args.window, args.payload_bytes)
            rows.append(
                f"| {run.cache_kib:,} | {r + 1} | {run.events:,} | {run.events / run.wall_s:,.0f}"
                f" | {1e6 * run.cpu_s / run.events:.0f} | {run.sqlite_mib:.2f}"
                f" | {run.file_mib:.1f} |"
            )
            print(rows[-1], flush=True)
    body = (
        f"Replay of one broker's store writes (bench/store_bench.py): {args.events:,} rounds"
        f" of one publish and one event from each of two peers, {args.payload_bytes}-byte"
        f" messages, duplicate windows of {args.window:,}.\n\n"
        "| store_cache_kib | round | rounds replayed | rounds/s | CPU µs/round"
        " | SQLite MiB at the end | file MiB |\n"
        "|---:|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if not args.no_record:
        record(RESULTS, "geofed.bench.store_bench", argv, body, title=TITLE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
