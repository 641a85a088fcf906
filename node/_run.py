"""Running one broker node in the foreground: ``python -m geofed.node`` / ``geofed node``."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import Sequence

from ._config import NodeConfig, add_arguments, from_args
from ._logging import configure
from ._server import BrokerServer

log = logging.getLogger("geofed.node")


async def serve(config: NodeConfig) -> int:
    """Run a broker until SIGINT or SIGTERM, then shut it down gracefully."""
    node = BrokerServer(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await node.start()
    # Start-up objects (federation areas, modules) live as long as the node:
    # keep them out of the collector's full passes, which would stall serving.
    gc.collect()
    gc.freeze()
    await stop.wait()
    log.info("signal received: shutting down")
    await node.stop()
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a node from parsed flags (see `add_arguments`), environment and config file."""
    config = from_args(args)
    configure(config.log_level, config.broker_id)
    return asyncio.run(serve(config))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m geofed.node [flags]``: one broker node."""
    parser = argparse.ArgumentParser(prog="geofed node", description="Run one broker node.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
