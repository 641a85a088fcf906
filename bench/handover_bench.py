"""What a handover costs a moving subscriber: events missed and the move's time.

A subscriber with `--subs` world-wide subscriptions (one topic each) moves
back and forth between Paris (eu) and New York (us) on the bundled `three`
federation, `--moves` times, while a publisher at Singapore (ap) publishes
`--rate` events a second on those topics, round robin, for the whole run.
Every event is world-wide, so a subscriber that held its subscriptions the
whole time would receive every event once. The client makes before it
breaks (docs/design.md §7): the old broker matches for it until the
renewals stand and lets go once what its peers sent it is delivered, so it
should miss nothing; the price is the time `move` takes, which `--wan
model` (emulated inter-region delays) shows. `--hold-s 0` runs the brokers
without holding (break before make: the old broker withdraws when it
answers the move), which misses what is matched between that withdrawal
and the new broker's registration.

Reported per strategy: events published, received, missed (in total and per
move), deliveries the brokers made that never reached the client (counted
from the nodes' delivery metric: none should be), and the median and worst
time `Client.move` took. The run ends with the quiescence barrier, so
nothing is counted as missed that was only late.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import geofed
from geofed.node import DELIVERIES
from geofed.routing import STRATEGIES, Federation, GeofedError

from ._machine import record
from .compare import wan_settings
from .faults import until
from .local import LocalFederation

RESULTS = Path(__file__).resolve().parent / "results" / "handover.md"
PARIS = geofed.LatLon(48.85, 2.35)
NEW_YORK = geofed.LatLon(40.71, -74.0)
SINGAPORE = geofed.LatLon(1.29, 103.85)
HANG_S = 120.0
LOST_S = 10.0  # after the barrier, a delivery made that has not arrived by then was lost


async def _run(fed: LocalFederation, subs: int, moves: int, rate: float) -> dict[str, float]:
    where = str(fed.federation_path)
    published: list[str] = []
    received: set[str] = set()
    took: list[float] = []
    async with (
        await geofed.connect(client_id="mover", location=PARIS, federation=where) as mover,
        await geofed.connect(client_id="pub", location=SINGAPORE, federation=where) as pub,
    ):
        streams = [await mover.subscribe(f"ho/{i}", subscription_id=f"s{i}") for i in range(subs)]
        await fed.quiescent(HANG_S)

        async def take(sub: geofed.Subscription) -> None:
            async for msg in sub:
                received.add(msg.event_id)

        takers = [asyncio.create_task(take(s)) for s in streams]
        stop = asyncio.Event()

        async def publish() -> None:
            start, n = time.perf_counter(), 0
            while not stop.is_set():
                wait = start + n / rate - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                published.append(await pub.publish(f"ho/{n % subs}", b"x"))
                n += 1

        publisher = asyncio.create_task(publish())
        while len(published) < rate / 4:  # publishing before the first move
            await asyncio.sleep(0.01)
        for i in range(moves):
            began = time.perf_counter()
            assert await mover.move(NEW_YORK if i % 2 == 0 else PARIS)
            took.append(time.perf_counter() - began)
            mark = len(published)
            while len(published) < mark + rate / 4:  # a quarter second between moves
                await asyncio.sleep(0.01)
        stop.set()
        await publisher
        await fed.quiescent(HANG_S)
        made = await asyncio.to_thread(fed.total, DELIVERIES)  # every delivery the brokers made
        with contextlib.suppress(GeofedError):  # one made and lost never arrives: counted
            await until(
                lambda: sum(s.received for s in streams) >= made, "the deliveries arrive", LOST_S
            )
        arrived = sum(s.received for s in streams)
        await mover.close()
        for t in takers:
            await t
    missed = len(set(published) - received)
    return {
        "published": len(published),
        "received": len(received & set(published)),
        "missed": missed,
        "per_move": missed / moves,
        "move_ms_p50": 1000 * statistics.median(took),
        "move_ms_max": 1000 * max(took),
        "lost": made - arrived,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--subs", type=int, default=20, help="subscriptions of the moving client")
    p.add_argument("--moves", type=int, default=20, help="handovers (eu <-> us)")
    p.add_argument("--rate", type=float, default=400.0, help="events/s published at ap")
    p.add_argument(
        "--strategy", action="append", choices=list(STRATEGIES), help="repeatable; default: all"
    )
    p.add_argument(
        "--hold-s",
        type=float,
        help="the brokers' handover_hold_s (default: theirs, 10; 0: break before make)",
    )
    p.add_argument(
        "--wan",
        default="off",
        metavar="model|off|FILE",
        help="emulated inter-broker latency, as for `geofed compare` (default: off)",
    )
    p.add_argument("--wan-ms-per-km", type=float, help="with --wan model (default 0.021)")
    p.add_argument("--no-record", action="store_true", help="do not append to handover.md")
    args = p.parse_args(argv)
    env, wan_text = wan_settings(args.wan, args.wan_ms_per_km, Federation.load("three"))
    if args.hold_s is not None:
        env["GEOFED_HANDOVER_HOLD_S"] = f"{args.hold_s:g}"
    rows = []
    for strategy in args.strategy or list(STRATEGIES):
        with (
            tempfile.TemporaryDirectory(prefix="geofed-handover-") as work,
            LocalFederation("three", strategy, Path(work), extra_env=env) as fed,
        ):
            r = asyncio.run(_run(fed, args.subs, args.moves, args.rate))
        rows.append(
            f"| {strategy} | {r['published']:,.0f} | {r['received']:,.0f} | {r['missed']:,.0f}"
            f" | {r['per_move']:.1f} | {r['lost']:,.0f} | {r['move_ms_p50']:.1f}"
            f" | {r['move_ms_max']:.1f} |"
        )
        print(rows[-1], flush=True)
    body = (
        f"{args.subs} world-wide subscriptions, {args.moves} moves eu <-> us, a quarter"
        f" second apart, {args.rate:g} events/s published at ap throughout; handover_hold_s"
        f" {'10, the default' if args.hold_s is None else f'{args.hold_s:g}'}:"
        f" {'break before make' if args.hold_s == 0 else 'make before break'}; WAN"
        f" emulation: {wan_text}.\n\n"
        "| strategy | published | received | missed | missed per move | made, never received"
        " | move ms p50 | move ms max |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
        + "\n".join(rows)
        + "\n"
    )
    print(body)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.handover_bench",
            argv,
            body,
            title="# Handover: what a moving subscriber misses\n\n"
            "`python -m geofed.bench.handover_bench` (bench/handover_bench.py says what it"
            " measures).\n",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
