"""``geofed publish``, ``geofed subscribe`` and ``geofed replay``: real gRPC clients."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from geofed.bench import Replayer, read_ops, wait_quiescent
from geofed.bench.replay import latlon_pb
from geofed.routing import Federation, InvalidInput, latlon, parse_geofence
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import geofence_to_pb


def register(sub: Any, name: str) -> None:
    """Add the ``publish``, ``subscribe`` or ``replay`` subcommand."""
    if name in ("publish", "subscribe"):
        p = sub.add_parser(
            name, help=f"{name} at the local broker for a location (follows redirects)"
        )
        p.add_argument("--federation", required=True, help="federation file with client endpoints")
        p.add_argument("--client", required=True, help="client id")
        p.add_argument("--lat", type=float, required=True)
        p.add_argument("--lon", type=float, required=True)
        p.add_argument("--topic", required=True, help="topic (publish) or filter (subscribe)")
        p.add_argument("--geofence", help="WKT or GeoJSON (default: the whole world)")
        p.add_argument("--id", default="", help="event / subscription id (default: generated)")
        if name == "publish":
            p.add_argument("--payload", default="", help="payload text")
            p.set_defaults(func=_publish)
        else:
            p.add_argument(
                "--count", type=int, default=0, help="exit after N deliveries (0: never)"
            )
            p.set_defaults(func=_subscribe)
    else:
        p = sub.add_parser(name, help="replay a workload trace against a running federation")
        p.add_argument("workload", help="workload trace (JSON Lines)")
        p.add_argument("--federation", required=True, help="federation file with client endpoints")
        p.add_argument(
            "--speed",
            type=float,
            default=0.0,
            help="time scale (2 = twice as fast; 0 = as fast as possible)",
        )
        p.add_argument("--deliveries", default="deliveries.jsonl", help="delivery log to write")
        p.add_argument(
            "--metrics",
            nargs="*",
            default=[],
            help="metrics URLs: wait for in-flight messages after each action",
        )
        p.set_defaults(func=_replay)


def _geofence(text: str | None) -> gpb.Geofence:
    return geofence_to_pb(parse_geofence(text, "geofence")) if text else gpb.Geofence()


async def _session(args: argparse.Namespace) -> tuple[Replayer, str]:
    fed = Federation.load(args.federation)
    where = latlon(args.lat, args.lon, "location")
    r = Replayer(fed)
    broker = await r._connect(args.client, where, fed.responsible(where))
    return r, broker


def _publish(args: argparse.Namespace) -> int:
    async def run() -> int:
        r, broker = await _session(args)
        try:
            ev = gpb.Event(
                id=args.id,
                topic=args.topic,
                payload=args.payload.encode(),
                publisher=latlon_pb(latlon(args.lat, args.lon)),
                geofence=_geofence(args.geofence),
            )
            resp = await r.stub(broker).Publish(cpb.PublishRequest(client=args.client, event=ev))
            print(json.dumps({"event": resp.event_id, "broker": broker}))
            return 0
        except grpc.aio.AioRpcError as exc:
            print(f"geofed publish: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        finally:
            await r.close()

    return asyncio.run(run())


def _subscribe(args: argparse.Namespace) -> int:
    async def run() -> int:
        r, broker = await _session(args)
        sub = gpb.Subscription(
            id=args.id or f"{args.client}-{int(time.time() * 1000)}",
            client=args.client,
            topic_filter=args.topic,
            geofence=_geofence(args.geofence),
        )
        call = r.stub(broker).Subscribe(cpb.SubscribeRequest(client=args.client, subscription=sub))
        seen = 0
        try:
            await call.initial_metadata()
            print(f"subscribed {sub.id} at broker {broker}", file=sys.stderr, flush=True)
            async for d in call:
                print(
                    json.dumps(
                        {
                            "event": d.event.id,
                            "subscription": d.subscription_id,
                            "client": args.client,
                            "topic": d.event.topic,
                            "payload": d.event.payload.decode(errors="replace"),
                            "t_publish": d.event.publish_time,
                            "t_deliver": time.time(),
                        }
                    ),
                    flush=True,
                )
                seen += 1
                if args.count and seen >= args.count:
                    break
            return 0
        except grpc.aio.AioRpcError as exc:
            print(f"geofed subscribe: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        finally:
            call.cancel()
            await r.close()

    return asyncio.run(run())


def _replay(args: argparse.Namespace) -> int:
    ops = read_ops(args.workload)
    fed = Federation.load(args.federation)
    if args.speed < 0:
        raise InvalidInput("speed", "must be >= 0")

    async def run() -> int:
        urls = {str(i): u for i, u in enumerate(args.metrics)}
        barrier = (lambda: wait_quiescent(urls)) if urls else None
        with Path(args.deliveries).open("w", encoding="utf-8") as log:
            r = Replayer(fed, log, barrier)
            started = time.monotonic()
            try:
                await r.run(ops, speed=args.speed)
                await asyncio.sleep(0.5)  # let the last deliveries arrive
            finally:
                await r.close()
        took = time.monotonic() - started
        print(
            f"replayed {len(ops)} actions in {took:.1f}s: {len(r.deliveries)} deliveries, "
            f"{r.redirects} redirects, {len(r.errors)} errors; delivery log {args.deliveries}"
        )
        for e in r.errors[:20]:
            print("  " + e, file=sys.stderr)
        return 0 if not r.errors else 1

    return asyncio.run(run())
