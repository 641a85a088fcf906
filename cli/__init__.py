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
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any

from geofed.errors import DeadlineExceeded, GeofedError, Unavailable

SUBCOMMANDS: dict[str, str] = {
    "areas": "geofed.cli._routing",
    "route": "geofed.cli._routing",
    "simulate": "geofed.cli._routing",
    "cover": "geofed.cli._cover",
    "bridge-topics": "geofed.cli.bridge",
    "node": "geofed.cli._node",
    "up": "geofed.cli._node",
    "certs": "geofed.cli.certs",
    "publish": "geofed.cli._client",
    "subscribe": "geofed.cli._client",
    "history": "geofed.cli._client",
    "replay": "geofed.cli._client",
    "strategy": "geofed.cli._client",
    "demo": "geofed.bench.compare",
    "workload": "geofed.bench.workload",
    "analyze": "geofed.bench.analyze",
    "bench": "geofed.bench.compare",
    "k8s": "geofed.k8s.cli",
}


EXIT_OK = 0
EXIT_INTERNAL = 1
"""An unexpected failure (a bug): a short message, the traceback in a log file."""
EXIT_INPUT = 2
"""Bad usage or input: a flag, a file, a value (the message names it)."""
EXIT_UNAVAILABLE = 3
"""A broker could not be reached or did not answer in time."""
EXIT_INTERRUPTED = 130


class _Formatter(argparse.HelpFormatter):
    """Help that says every default and which options are required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required and action.option_strings:
            return f"{text} (required)"
        default = action.default
        if (
            "default" in text
            or default in (None, False, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Every subcommand's parser: defaults and required options shown in --help."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(**kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every subcommand registered)."""
    parser = _Parser(
        prog="geofed",
        description="Geo-distributed publish/subscribe broker federation.",
        epilog="Exit status: 0 ok, 2 bad usage or input, 3 broker unavailable, 1 internal"
        " error (traceback logged; --debug shows it).",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error"
    )
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )
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
    """Run the CLI; returns the exit status (`EXIT_INPUT`, `EXIT_UNAVAILABLE`, ...).

    The one error boundary of the command line: expected failures print one
    line naming the argument or file; no traceback reaches the user unless
    ``--debug`` asks for it.
    """
    args = build_parser().parse_args(argv)
    prog = f"geofed {args.command}"
    try:
        return int(args.func(args) or EXIT_OK)
    except (Unavailable, DeadlineExceeded) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except GeofedError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            # Output piped into `head` and the like: not an error of ours.
            sys.stdout = None
            return EXIT_OK
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prog}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_INPUT
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:
            raise
        with tempfile.NamedTemporaryFile(
            "w", prefix="geofed-error-", suffix=".log", delete=False
        ) as log:
            traceback.print_exc(file=log)
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc}"
            f" (traceback in {log.name}; --debug shows it)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
