"""``geofed areas``, ``geofed route`` and ``geofed simulate``: the routing core from the shell."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from geofed.routing import (
    STRATEGIES,
    Federation,
    InvalidInput,
    StrategyTable,
    generate_areas,
    latlon,
    predict,
    read_sites,
    reference_deliveries,
    route_summary,
    simulate,
)

from ._args import GEOFENCE_HELP, geofence_arg, location_arg
from .progress import track

DEFAULT_FEDERATION = "aws-2020"


def register(sub: Any, name: str) -> None:
    """Add the ``areas``, ``route`` or ``simulate`` subcommand."""
    if name == "areas":
        p = sub.add_parser(name, help="broker sites (CSV or GeoJSON points) -> federation file")
        p.add_argument("sites", help="CSV (id,name,lat,lon[,endpoint,client_endpoint]) or GeoJSON")
        p.add_argument("-o", "--out", help="write the federation here (default: stdout)")
        p.add_argument("--step", type=float, default=0.5, help="boundary densification (degrees)")
        p.set_defaults(func=_areas)
    elif name == "route":
        p = sub.add_parser(name, help="which brokers an event / subscription geofence reaches")
        p.add_argument("geofence", help=GEOFENCE_HELP)
        p.add_argument("--federation", default=DEFAULT_FEDERATION, help="file or bundled name")
        p.add_argument("--at", help="origin broker id (default: broker of --location)")
        p.add_argument("--location", help="LAT,LON of the client (default: centre of the geofence)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=_route)
    elif name == "simulate":
        p = sub.add_parser(name, help="workload trace -> per-strategy inter-broker messages")
        p.add_argument("trace", help="workload trace (JSON Lines, or Parquet: .parquet)")
        p.add_argument("--federation", default=DEFAULT_FEDERATION, help="file or bundled name")
        p.add_argument("--strategy", action="append", choices=list(STRATEGIES))
        p.add_argument(
            "--table",
            default="",
            help="per-topic strategies as the node's strategy_table setting takes them"
            ' (JSON object topic filter -> strategy, e.g. \'{"alerts/#": "event-geofence"}\');'
            " each --strategy is then the default of topics no entry matches",
        )
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=_simulate)


def _areas(args: argparse.Namespace) -> int:
    path = Path(args.sites)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidInput("sites", f"cannot read {path}: {exc.strerror}") from None
    fmt = "geojson" if text.lstrip().startswith("{") else "csv"
    collection = generate_areas(read_sites(text, fmt), step_deg=args.step)
    out = json.dumps(collection, separators=(",", ":"))
    if args.out:
        Path(args.out).write_text(out + "\n", encoding="utf-8")
        print(f"wrote {len(collection['features'])} broker areas to {args.out}", file=sys.stderr)
    else:
        print(out)
    return 0


def _route(args: argparse.Namespace) -> int:
    fed = Federation.load(args.federation)
    fence = geofence_arg(args.geofence)
    if args.at:
        fed.broker(args.at)
        origin = args.at
    else:
        if args.location:
            where = location_arg(args.location)
        elif fence is not None:
            c = fence.geometry.representative_point()
            where = latlon(c.y, c.x, "location")
        else:
            raise InvalidInput("at", "give --at or --location for a world geofence")
        origin = fed.responsible(where)
    result = route_summary(fed, origin, fence)
    meeting, rows, flood = (
        result["brokers_meeting"],
        result["strategies"],
        result["flooding_messages"],
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"origin broker: {origin}    federation: {len(fed)} brokers")
    print(
        f"remote brokers whose area meets the geofence ({len(meeting)}): "
        f"{', '.join(meeting) or '-'}"
    )
    print(f"{'strategy':<24} {'event ->':>9} {'subscription ->':>16}")
    for r in rows:
        print(f"{r['strategy']:<24} {len(r['event_to']):>9} {len(r['subscription_to']):>16}")
    print(
        f"geofence routing sends {len(meeting)} of {flood} flooding messages: "
        f"saves {result['saved']} ({result['saved_pct']}%)"
    )
    return 0


def _simulate(args: argparse.Namespace) -> int:
    fed = Federation.load(args.federation)
    from geofed.bench.trace import read_ops

    ops = read_ops(args.trace)
    expected = reference_deliveries(ops)
    names = args.strategy or list(STRATEGIES)
    tables = [StrategyTable.from_json(name, args.table, "table") for name in names]
    table: list[dict[str, Any]] = []
    lower = None
    for name, strategies in zip(names, tables, strict=True):
        label = f"{name} + table" if strategies.entries else name
        res = simulate(fed, strategies, track(ops, f"simulate {label}", unit="op"))
        pred = predict(fed, strategies, ops)
        lower = pred.lower_bound_total
        kinds = res.by_kind()
        table.append(
            {
                "strategy": label,
                "event": kinds["event"],
                "subscribe": kinds["subscribe"],
                "unsubscribe": kinds["unsubscribe"],
                "relocate": kinds["relocate"],
                "delivery": kinds["delivery"],
                "total": res.total_messages,
                "deliveries": len(res.deliveries),
                "exact": sorted(res.deliveries) == sorted(expected),
                "matches_cost_model": res.messages == pred.messages,
                "rejected": len(res.errors),
            }
        )
    summary: dict[str, Any] = {
        "federation": len(fed),
        "operations": len(ops),
        "events": sum(1 for o in ops if o.op == "publish"),
        "oracle_deliveries": len(expected),
        "lower_bound": lower,
        "strategies": table,
    }
    if tables[0].entries:
        summary["table"] = dict(tables[0].entries)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    if tables[0].entries:
        print("table: " + ", ".join(f"{f} -> {s}" for f, s in tables[0].entries))
    print(
        f"{summary['operations']} operations, {summary['events']} events, "
        f"{len(expected)} deliveries expected, {len(fed)} brokers"
    )
    # Relocations (roaming geofences, docs/design.md §3) get a column when there are any.
    reloc = any(r["relocate"] for r in table)
    head = f"{'strategy':<24}{'event':>8}{'subscribe':>10}{'unsub':>7}"
    head += f"{'reloc':>7}" if reloc else ""
    print(head + f"{'delivery':>9}{'total':>8}{'deliveries':>11}  exact  model")
    for r in table:
        print(
            f"{r['strategy']:<24}{r['event']:>8}{r['subscribe']:>10}{r['unsubscribe']:>7}"
            + (f"{r['relocate']:>7}" if reloc else "")
            + f"{r['delivery']:>9}{r['total']:>8}{r['deliveries']:>11}  "
            f"{'yes' if r['exact'] else 'NO':>5}  {'yes' if r['matches_cost_model'] else 'NO':>5}"
        )
    print(f"lower bound (remote brokers with a matching subscriber, summed over events): {lower}")
    return 0 if all(r["exact"] and r["matches_cost_model"] for r in table) else 1
