"""CPU time per event of the publisher's broker path, in-process, with a profile.

Not a test: it prints what it measured and appends it to
``bench/results/node.md`` with the command and the machine.

`node_bench` measures a whole node with its clients on the same cores, so on
a shared machine its rates say as much about the load as about the code.
This measures the part of the node's worst case that is the node's own
Python work, in CPU seconds (``time.process_time``), which the load moves
much less: `node_bench`'s federation and subscriptions (N remote
subscriptions from the peer, under ``subscription-geofence``), events without
geofence (each one matched against all N), and per event what the node does
between reading a `PublishStream` batch and writing the peer frame:
converting the event from the wire (`event_from_pb`), matching and routing it
(`BrokerState.publish_many`, `--batch` events at a time, as the node does with
the events of one `PublishStream` message) and adding the delivery message to a frame
(`EncodedFrame`, as a peer link does). gRPC, asyncio, metrics and the peer's
side are left out. After loading the subscriptions the heap is frozen as the
node's `HeapFreezer` does. ``--unique-points`` moves each event's latitude by
its own millionth of a degree, so that no event of a batch repeats the topic
and point of an earlier one (the workload's 100 publishers stand at fixed
places: otherwise 80 % of a batch does).
``--profile`` adds a cProfile summary (the functions with the most own time).
``--adaptive`` runs the adaptive controller's measurement too (a `ShareMeter`
in the broker, as a node with ``adaptive=on`` has; docs/design.md §13): what it
adds per event is the price of running the controller.

Usage: ``python -m geofed.bench.publish_cpu_bench [--subs 100000] [--events 5000]
[--rounds 3] [--batch 1000] [--unique-points] [--profile] [--adaptive]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from geofed.client import DEFAULT_BATCH_SIZE
from geofed.node import HeapFreezer
from geofed.routing import BrokerState, GeofenceCache, ShareMeter, SubscribeMsg, strategy_for
from geofed.v1 import client_pb2 as cpb
from geofed.wire import EncodedFrame, event_from_pb, publish_batch

from ._machine import record
from .node_bench import _events, _subscriptions, federation_file

RESULTS = Path(__file__).resolve().parent / "results" / "node.md"
_FRAME_DELIVERIES = 256  # deliveries per frame before it is serialized and started afresh


def _run(
    core: BrokerState, batch: cpb.PublishBatch, cache: GeofenceCache, size: int
) -> tuple[float, int]:
    """CPU seconds for all the events, published `size` at a time; the subscriptions named.

    Each `size` events are matched together (`BrokerState.publish_many`), as
    the node matches the events of one `PublishStream` message.
    """
    named = 0
    t0 = time.process_time()
    frame = EncodedFrame()
    pbs = batch.events
    for i in range(0, len(pbs), size):
        events = [event_from_pb(pb, cache, field="event") for pb in pbs[i : i + size]]
        for out in core.publish_many(events):
            for send in out.sends:
                named += len(send.msg.subs)  # type: ignore[union-attr]
                frame.add(send.msg, "node")
            if len(frame.deliveries) >= _FRAME_DELIVERIES:
                frame.SerializeToString()
                frame = EncodedFrame()
    frame.SerializeToString()
    return time.process_time() - t0, named


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--subs", type=int, default=100_000, help="remote subscriptions held")
    p.add_argument("--events", type=int, default=5_000, help="world-wide events per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (the median is reported)")
    p.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help="events matched together, as one PublishStream message (the client's default)",
    )
    p.add_argument(
        "--unique-points",
        action="store_true",
        help="every event at a point of its own (no repeats within a batch)",
    )
    p.add_argument("--profile", action="store_true", help="add a cProfile summary")
    p.add_argument(
        "--adaptive", action="store_true", help="measure the adaptive controller's share too"
    )
    p.add_argument("--no-record", action="store_true", help="do not append to node.md")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="geofed-bench-") as tmp:
        fed = federation_file(Path(tmp) / "federation.geojson", (1, 2), 3)
    core = BrokerState("node", fed, strategy_for("subscription-geofence", fed))
    if args.adaptive:
        core.meter = ShareMeter()
    for sub in _subscriptions(args.subs, seed=args.subs):
        core.on_message("peer", SubscribeMsg(sub, "peer"))
    HeapFreezer().held(args.subs)  # as the node does once it holds them
    batch = publish_batch("bench", _events(args.events, seed=1, world=True))
    for i, pb in enumerate(batch.events):
        pb.id = pb.id or f"e{i}"
        if args.unique_points:
            pb.publisher.lat += (i + 1) * 1e-6 * (1 if pb.publisher.lat < 0 else -1)
    cache = GeofenceCache()
    _run(core, batch, cache, args.batch)  # warm the caches, as a running node has them
    times = []
    named = 0
    for _ in range(args.rounds):
        seconds, named = _run(core, batch, cache, args.batch)
        times.append(seconds)
    n = len(batch.events)
    per_event = statistics.median(times) / n
    summary = ""
    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(_run, core, batch, cache, args.batch)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        summary = "\n\ncProfile, one round, by own time:\n\n```\n" + _trim(text.getvalue()) + "```"
    body = (
        f"{args.subs:,} remote subscriptions, {n:,} world-wide events per round"
        f" in batches of {args.batch:,}{', each at its own point' if args.unique_points else ''},"
        f" {named / n:.1f} subscriptions named per event"
        f"{', adaptive controller on' if args.adaptive else ''}; rounds (CPU µs/event):"
        f" {', '.join(f'{t / n * 1e6:.1f}' for t in times)}; median"
        f" **{per_event * 1e6:.1f} µs/event = {1 / per_event:,.0f} events per CPU second**"
        f"{summary}"
    )
    print(body)
    if not args.no_record:
        record(RESULTS, "geofed.bench.publish_cpu_bench", argv, body)
    return 0


def _trim(text: str) -> str:
    """The profile's table from its header on, file paths shortened to the package."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return (
        "\n".join(re.sub(r"\S*/(geofed|site-packages)/", "", line) for line in lines[start:]) + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
