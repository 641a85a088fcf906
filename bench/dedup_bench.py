"""CPU per message and memory of the duplicate windows, against the ordered dicts before.

Not a test: it prints what it measured and appends it to
``bench/results/dedup.md`` with the command and the machine.

Each window takes `--messages` fresh event ids (new str objects, as decoded
from the wire, so their hash is not cached yet) the way the node does, with
its calls: for the local window a lookup and an add (`BrokerServer.publish`,
`_remember`), for a peer window a lookup of (kind, id) at receive time and an
add after the commit (`receive_frame`, `_commit`, `_remember`). The baseline
is the code before node/_dedup.py, kept here only to compare with: an
OrderedDict of ids (local) or of (kind.value, id) tuples (per peer, behind
`PeerLink.seen` and `remember`), popping the oldest past the size.
CPU is `time.process_time` over the ids (construction not included: once
per process), the best of `--rounds`;
memory is what tracemalloc sees allocated after construction and after the
last message (the ids themselves not counted).

Usage: ``python -m geofed.bench.dedup_bench [--size 100000] [--messages 300000]
[--rounds 5]``
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from geofed.node import DedupWindow
from geofed.routing import Kind

from ._machine import record

RESULTS = Path(__file__).resolve().parent / "results" / "dedup.md"

Feed = Callable[[list[str]], object]  # takes the ids, answers the window (kept alive)
Make = Callable[[int], Feed]  # builds a window of a size (not timed), answers its feed


# Each feed has the shape of the node's code: `remember` stands for
# `BrokerServer._remember` (durable off), `link_seen`/`link_remember` for the
# `PeerLink.seen`/`remember` methods the ordered dict had.


def _ordered_local(size: int) -> Feed:
    published: OrderedDict[str, None] = OrderedDict()

    def remember(event_id: str) -> tuple[str, str] | None:
        published[event_id] = None
        if len(published) > size:
            return (Kind.EVENT.value, published.popitem(last=False)[0])
        return None

    def feed(ids: list[str]) -> object:
        for event_id in ids:
            if event_id in published:
                continue
            remember(event_id)
        return published

    return feed


def _ordered_peer(size: int) -> Feed:
    seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def link_seen(kind: Kind, event_id: str) -> bool:
        return (kind.value, event_id) in seen

    def link_remember(kind: Kind, event_id: str) -> tuple[str, str] | None:
        seen[(kind.value, event_id)] = None
        if len(seen) > size:
            return seen.popitem(last=False)[0]
        return None

    def feed(ids: list[str]) -> object:
        kind = Kind.EVENT
        for event_id in ids:
            if link_seen(kind, event_id):
                continue
            link_remember(kind, event_id)  # through _remember, which added a call
        return seen

    return feed


def _window_local(size: int) -> Feed:
    published = DedupWindow(size)

    def remember(kind: Kind, event_id: str) -> bool:
        return published.add(kind, event_id)

    def feed(ids: list[str]) -> object:
        for event_id in ids:
            if not remember(Kind.EVENT, event_id):
                continue
        return published

    return feed


def _window_peer(size: int) -> Feed:
    window = DedupWindow(size)

    def remember(kind: Kind, event_id: str) -> bool:
        return window.add(kind, event_id)

    def feed(ids: list[str]) -> object:
        kind = Kind.EVENT
        for event_id in ids:
            if window.seen(kind, event_id):
                continue
            remember(kind, event_id)
        return window

    return feed


def _fresh(raw: list[bytes]) -> list[str]:
    return [b.decode() for b in raw]


def _cpu(make: Make, size: int, raw: list[bytes], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        feed = make(size)
        ids = _fresh(raw)
        gc.collect()
        t0 = time.process_time()
        feed(ids)
        best = min(best, time.process_time() - t0)
    return best


def _memory(make: Make, size: int, raw: list[bytes]) -> tuple[float, float]:
    """(MiB after construction, MiB after all messages), the ids not counted."""
    ids = _fresh(raw)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        feed = make(size)
        built = tracemalloc.get_traced_memory()[0] - base
        kept = feed(ids)
        end = tracemalloc.get_traced_memory()[0] - base
        del kept, feed
    finally:
        tracemalloc.stop()
    return built / 2**20, end / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--size", type=int, default=100_000, help="window size (dedup_window)")
    p.add_argument("--messages", type=int, default=300_000, help="fresh ids per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds (the best is reported)")
    p.add_argument("--no-record", action="store_true", help="do not append to dedup.md")
    args = p.parse_args(argv)
    raw = [f"publisher-{i % 7}-{i:09d}".encode() for i in range(args.messages)]
    rows = []
    for name, make in (
        ("local, OrderedDict of ids (before)", _ordered_local),
        ("local, DedupWindow (now)", _window_local),
        ("per peer, OrderedDict of (kind, id) (before)", _ordered_peer),
        ("per peer, DedupWindow (now)", _window_peer),
    ):
        cpu = _cpu(make, args.size, raw, args.rounds)
        built, end = _memory(make, args.size, raw)
        rows.append(f"| {name} | {1e9 * cpu / args.messages:.0f} | {built:.1f} | {end:.1f} |")
        print(rows[-1], flush=True)
    body = (
        f"Window of {args.size:,} keys, {args.messages:,} fresh ids of 20 characters,"
        f" best of {args.rounds} rounds. Memory: allocated (tracemalloc) after"
        " construction and after the last id, the id strings not counted (in the node"
        " the ordered dicts also kept them alive: about 70 bytes each for these ids).\n\n"
        "| window | CPU ns/message | MiB at start | MiB at the end |\n"
        "|---|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.dedup_bench",
            argv,
            body,
            title="# Duplicate windows: CPU per message and memory\n\n"
            "`python -m geofed.bench.dedup_bench` (bench/dedup_bench.py says what it"
            " measures).\n",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
