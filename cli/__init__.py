"""The ``geofed`` command line: one entry point, subcommands in their own modules.

Each module listed in `SUBCOMMANDS` exposes ``register(subparsers, name)``,
which adds the subcommand's parser and sets ``func`` (called with the parsed
arguments; its return value is the exit status). Heavy imports (pyspark,
grpc) happen inside ``func`` so that ``geofed --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from geofed.routing import GeofedError

SUBCOMMANDS: dict[str, str] = {
    "areas": "geofed.cli._routing",
    "route": "geofed.cli._routing",
    "simulate": "geofed.cli._routing",
    "node": "geofed.cli._node",
    "up": "geofed.cli._node",
    "publish": "geofed.cli._client",
    "subscribe": "geofed.cli._client",
    "replay": "geofed.cli._client",
    "demo": "geofed.bench.compare",
    "workload": "geofed.bench.workload",
    "analyze": "geofed.bench.analyze",
    "bench": "geofed.bench.compare",
    "k8s": "geofed.k8s.cli",
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every subcommand registered)."""
    parser = argparse.ArgumentParser(
        prog="geofed", description="Geo-distributed publish/subscribe broker federation."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue  # an optional part that is not installed
        mod.register(sub, name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GeofedError as exc:
        print(f"geofed {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped into `head` and the like: not an error of ours.
        sys.stdout = None
        return 0


if __name__ == "__main__":
    sys.exit(main())
