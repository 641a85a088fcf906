"""``geofed publish``, ``subscribe``, ``history``, ``replay`` and ``strategy``: clients
from the shell."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from geofed.client import ClientConfig, TLSConfig, connect
from geofed.routing import InvalidInput

from ._args import (
    GEOFENCE_HELP,
    LOCATION_HELP,
    ROAMING_HELP,
    geofence_arg,
    location_arg,
    subscription_geofence_arg,
)
from .progress import track


def register(sub: Any, name: str) -> None:
    """Add the ``publish``, ``subscribe``, ``history``, ``replay`` or ``strategy`` subcommand."""
    if name == "history":
        _register_history(sub)
    elif name == "strategy":
        _register_strategy(sub)
    elif name in ("publish", "subscribe"):
        p = sub.add_parser(
            name, help=f"{name} at the local broker for a location (follows redirects)"
        )
        _session_arguments(p)
        p.add_argument("--topic", required=True, help="topic (publish) or filter (subscribe)")
        p.add_argument(
            "--geofence",
            help=f"{'event' if name == 'publish' else 'subscription'} geofence: {GEOFENCE_HELP}"
            + ("" if name == "publish" else f", {ROAMING_HELP}")
            + " (default: the whole world)",
        )
        p.add_argument("--id", default="", help="event / subscription id (default: generated)")
        _tls_arguments(p)
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
        p.add_argument("workload", help="workload trace (JSON Lines, or Parquet: .parquet)")
        p.add_argument("--federation", required=True, help="federation file with client endpoints")
        p.add_argument(
            "--speed",
            type=float,
            default=0.0,
            help="time scale (2 = twice as fast; 0 = as fast as possible)",
        )
        p.add_argument("--deliveries", help="write the delivery log (JSON Lines) here")
        p.add_argument("--force", action="store_true", help="overwrite an existing delivery log")
        p.add_argument(
            "--metrics",
            nargs="*",
            default=[],
            help="metrics URLs of every broker: wait for in-flight messages after each action,"
            " and for every delivery at the end",
        )
        p.add_argument(
            "--grace",
            type=float,
            default=0.5,
            help="without --metrics: seconds to wait for late deliveries at the end",
        )
        _tls_arguments(p, client_auth=False)
        p.set_defaults(func=_replay)


def _session_arguments(p: argparse.ArgumentParser) -> None:
    """Where the client's session opens: its broker (by federation or endpoint), id, location."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--federation", help="federation file or bundled name: finds the local broker"
    )
    where.add_argument("--endpoint", help="host:port of any broker's client service")
    p.add_argument("--client", required=True, help="client id")
    p.add_argument("--location", required=True, help=f"the client's location, {LOCATION_HELP}")


def _register_history(sub: Any) -> None:
    p = sub.add_parser(
        "history",
        help="read (or --delete) the federation's logged events by topic, time and area",
        description="Ask the local broker for the logged history: the brokers whose areas"
        " meet --geometry answer, newest first. Prints a GeoJSON FeatureCollection.",
    )
    _session_arguments(p)
    p.add_argument("--topic", required=True, help="topic filter (+, #)")
    p.add_argument(
        "--from",
        dest="start",
        help="earliest publish time: unix seconds or ISO 8601 (UTC if no zone)",
    )
    p.add_argument("--to", dest="end", help="latest publish time (included), as --from")
    p.add_argument(
        "--geometry", help=f"publisher locations inside: {GEOFENCE_HELP} (default: the world)"
    )
    p.add_argument("--limit", type=int, default=100, help="most entries, newest first")
    p.add_argument(
        "--delete", action="store_true", help="remove the entries answered (and print them)"
    )
    _tls_arguments(p)
    p.set_defaults(func=_history)


def _register_strategy(sub: Any) -> None:
    p = sub.add_parser(
        "strategy",
        help="show or change the per-topic routing strategy table (federation-wide)",
        description="set FILTER STRATEGY pins the topics of FILTER to STRATEGY, unset FILTER"
        " removes the pin, show prints the local broker's table; changes are carried out"
        " by every broker with state transfer (docs/design.md §3). Prints JSON.",
    )
    p.add_argument("action", choices=("show", "set", "unset"))
    p.add_argument("filter", nargs="?", help="topic filter (set, unset)")
    p.add_argument("name", nargs="?", metavar="strategy", help="strategy (set)")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        help="set, unset: wait up to this many seconds for the transition to finish here",
    )
    _session_arguments(p)
    _tls_arguments(p)
    p.set_defaults(func=_strategy)


def _strategy(args: argparse.Namespace) -> int:
    if args.action != "show" and not args.filter:
        raise InvalidInput("filter", f"strategy {args.action} needs a topic filter")
    if args.action == "set" and not args.name:
        raise InvalidInput("strategy", "strategy set needs a strategy")
    if args.action != "set" and args.name:
        raise InvalidInput("strategy", f"strategy {args.action} takes no strategy")

    async def run() -> int:
        async with await connect(_config(args)) as client:
            if args.action == "show":
                state = await client.strategy_table()
            else:
                state = await client.set_strategy(args.filter, args.name)
                deadline = time.monotonic() + args.wait
                while _pending(state, args.filter, args.name) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)  # polling the broker: a human waits here
                    state = await client.strategy_table()
        print(json.dumps(state))
        if args.action != "show" and args.wait and _pending(state, args.filter, args.name):
            print(f"transition not finished within {args.wait:g}s", file=sys.stderr)
            return 1
        return 0

    return asyncio.run(run())


def _pending(state: dict[str, Any], topic_filter: str, strategy: str | None) -> bool:
    """Whether the broker still has to finish the change (`state` as `Client.strategy_table`):
    until then the table routing here lacks the entry as the operator set it (or still has
    the removed one)."""
    entries = {e["topic_filter"]: e for e in state["table"]["entries"]}
    wanted = None
    if strategy is not None:
        wanted = {"topic_filter": topic_filter, "strategy": strategy, "adaptive": False}
    return bool(state["in_transition"]) or entries.get(topic_filter) != wanted


def _time_arg(text: str | None, field: str) -> float | None:
    """A time option: unix seconds, or ISO 8601 (a naive time is UTC)."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(field, f"expected unix seconds or ISO 8601, got {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def _history(args: argparse.Namespace) -> int:
    geometry = geofence_arg(args.geometry, "geometry") if args.geometry else None
    start, end = _time_arg(args.start, "from"), _time_arg(args.end, "to")

    async def run() -> int:
        async with await connect(_config(args)) as client:
            call = client.delete_history if args.delete else client.history
            answer = await call(
                args.topic, start=start, end=end, geometry=geometry, limit=args.limit
            )
        print(
            json.dumps(
                {"type": "FeatureCollection", "features": [r.to_geojson_feature() for r in answer]}
            )
        )
        print(
            f"{len(answer)} entr{'y' if len(answer) == 1 else 'ies'}"
            f"{' removed' if args.delete else ''}"
            f"{' (cut by the answer-size limit)' if answer.truncated else ''};"
            f" brokers asked: {', '.join(sorted(answer.brokers))}",
            file=sys.stderr,
        )
        return 0

    return asyncio.run(run())


def _tls_arguments(p: argparse.ArgumentParser, client_auth: bool = True) -> None:
    t = p.add_argument_group("TLS (brokers run with tls_dir)")
    t.add_argument("--ca", metavar="FILE", help="PEM CA that signed the broker certificates")
    t.add_argument(
        "--server-name", help="name to verify in the broker certificate (default: its host)"
    )
    if client_auth:
        t.add_argument("--cert", metavar="FILE", help="PEM client certificate (client_auth cert)")
        t.add_argument("--key", metavar="FILE", help="PEM key of --cert")
        t.add_argument(
            "--token-file", metavar="FILE", help="file holding a bearer token (client_auth token)"
        )


def _tls(args: argparse.Namespace) -> TLSConfig | None:
    cert, key = getattr(args, "cert", None), getattr(args, "key", None)
    if not (args.ca or args.server_name or cert or key):
        return None
    return TLSConfig(
        ca_file=args.ca or "",
        cert_file=cert or "",
        key_file=key or "",
        server_name=args.server_name or "",
    )


def _token(args: argparse.Namespace) -> str:
    if not args.token_file:
        return ""
    try:
        return Path(args.token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise InvalidInput("token-file", f"cannot read {args.token_file}: {exc.strerror}") from None


def _config(args: argparse.Namespace) -> ClientConfig:
    return ClientConfig(
        client_id=args.client,
        location=location_arg(args.location),
        federation=args.federation,
        endpoint=args.endpoint,
        tls=_tls(args),
        token=_token(args),
    )


def _publish(args: argparse.Namespace) -> int:
    geofence = geofence_arg(args.geofence) if args.geofence else None

    async def run() -> int:
        async with await connect(_config(args)) as client:
            event_id = await client.publish(
                args.topic, args.payload, geofence=geofence, event_id=args.id
            )
            print(json.dumps({"event": event_id, "broker": client.broker_id}))
        return 0

    return asyncio.run(run())


def _subscribe(args: argparse.Namespace) -> int:
    geofence = subscription_geofence_arg(args.geofence) if args.geofence else None
    if args.count < 0:
        raise InvalidInput("count", f"must be >= 0, got {args.count}")

    async def run() -> int:
        async with await connect(_config(args)) as client:
            sub = await client.subscribe(
                args.topic, geofence=geofence, subscription_id=args.id or None
            )
            print(f"subscribed {sub.id} at broker {client.broker_id}", file=sys.stderr, flush=True)
            seen = 0
            async for msg in sub:
                record = {
                    "event": msg.event_id,
                    "subscription": msg.subscription_id,
                    "client": args.client,
                    "topic": msg.topic,
                    "payload": msg.payload.decode(errors="replace"),
                    "t_publish": msg.publish_time,
                    "t_deliver": time.time(),
                }
                print(json.dumps(record), flush=True)
                seen += 1
                if args.count and seen >= args.count:
                    break
        return 0

    return asyncio.run(run())


def _replay(args: argparse.Namespace) -> int:
    from geofed.bench import Replayer, read_ops, wait_quiescent
    from geofed.routing import Federation

    ops = read_ops(args.workload)
    fed = Federation.load(args.federation)
    if args.speed < 0:
        raise InvalidInput("speed", "must be >= 0")
    log = None
    if args.deliveries:
        path = Path(args.deliveries)
        if path.exists() and not args.force:
            raise InvalidInput("deliveries", f"{path} exists (--force overwrites it)")
        try:
            log = path.open("w", encoding="utf-8")
        except OSError as exc:
            raise InvalidInput("deliveries", f"cannot write {path}: {exc.strerror}") from None

    async def run() -> int:
        urls = {str(i): u for i, u in enumerate(args.metrics)}
        barrier = (lambda: wait_quiescent(urls)) if urls else None
        r = Replayer(fed, log, barrier, tls=_tls(args))
        started = time.monotonic()
        try:
            await r.run(track(ops, "replay", unit="action"), speed=args.speed)
            if urls:
                await wait_quiescent(urls)
                await r.settle(urls)
            else:
                await asyncio.sleep(args.grace)  # nothing to ask: give deliveries a moment
        finally:
            await r.close()
        took = time.monotonic() - started
        print(
            f"replayed {len(ops)} actions in {took:.1f}s: {len(r.deliveries)} deliveries, "
            f"{r.redirects} redirects, {len(r.errors)} errors"
            + (f"; delivery log {args.deliveries}" if args.deliveries else "")
        )
        for e in r.errors[:20]:
            print("  " + e, file=sys.stderr)
        return 0 if not r.errors else 1

    try:
        return asyncio.run(run())
    finally:
        if log is not None:
            log.close()
