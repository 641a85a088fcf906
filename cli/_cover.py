"""``geofed cover``: a geofence as MQTT topic filters for a topic-only broker."""

from __future__ import annotations

import argparse
from typing import Any

from geofed.routing import (
    DEFAULT_COVERAGE,
    DEFAULT_MAX_FILTERS,
    DecimalLayout,
    H3Layout,
    cover,
)

from ._args import GEOFENCE_HELP, geofence_arg


def register(sub: Any, name: str) -> None:
    """Add the ``cover`` subcommand."""
    p = sub.add_parser(
        name,
        help="geofence -> MQTT topic filters on geo-encoded topics (for topic-only brokers)",
        description="Print the topic filters that match every location in the geofence on"
        " topics written by the layout (what `geofed bridge-topics` publishes), one a line,"
        " then a line '# N filters, coverage C ...'. Coverage = area of the geofence / area"
        " of the cover (planar lon/lat): 1 - coverage is the share of over-delivery for"
        " evenly spread publishers.",
    )
    p.add_argument("geofence", help=GEOFENCE_HELP)
    add_layout_arguments(p)
    p.add_argument(
        "--coverage",
        type=float,
        default=DEFAULT_COVERAGE,
        help="target coverage ratio in [0, 1]: refine until reached",
    )
    p.add_argument(
        "--max-filters",
        type=int,
        default=DEFAULT_MAX_FILTERS,
        help="at most this many filters (the refinement stops before exceeding it)",
    )
    p.add_argument(
        "--topic", default="#", help="topic filter of the events, after the location levels"
    )
    p.set_defaults(func=_cover)


def add_layout_arguments(p: argparse.ArgumentParser) -> None:
    """The topic layout options (shared with ``geofed bridge-topics``)."""
    g = p.add_argument_group("topic layout")
    g.add_argument(
        "--layout",
        choices=["decimal", "h3"],
        default="decimal",
        help="decimal: latitude and longitude digits, one a level; h3: the H3 cell's digits",
    )
    g.add_argument(
        "--prefix", help="topic levels before the location (default: geo, or h3 with --layout h3)"
    )
    g.add_argument("--decimals", type=int, default=4, help="decimal: digits after the point (0-10)")
    g.add_argument(
        "--signs",
        choices=["sign", "offset"],
        default="sign",
        help="decimal: a sign level (_ or -) before each coordinate, or lat+90 / lon+180",
    )
    g.add_argument("--resolution", type=int, default=9, help="h3: resolution of the topics")


def layout_from(args: argparse.Namespace) -> DecimalLayout | H3Layout:
    """The layout the options describe."""
    if args.layout == "h3":
        return H3Layout(
            prefix="h3" if args.prefix is None else args.prefix, resolution=args.resolution
        )
    return DecimalLayout(
        prefix="geo" if args.prefix is None else args.prefix,
        decimals=args.decimals,
        signs=args.signs,
    )


def _cover(args: argparse.Namespace) -> int:
    result = cover(
        geofence_arg(args.geofence),
        layout_from(args),
        coverage=args.coverage,
        max_filters=args.max_filters,
        topic_filter=args.topic,
    )
    for f in result.filters:
        print(f)
    print(
        f"# {len(result.filters)} filters, coverage {result.coverage:.3f}"
        f" (target {args.coverage:g}, at most {args.max_filters} filters;"
        f" stopped: {result.stopped})"
    )
    return 0
