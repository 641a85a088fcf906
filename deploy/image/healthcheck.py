"""Container health check: is the node's gRPC health service SERVING?

Run by the image's HEALTHCHECK (Kubernetes uses its native gRPC probes
instead). The node's own configuration loader (`geofed.node.NodeConfig`)
finds the address, from the same settings the node reads minus command-line
flags, which a health check cannot see: GEOFED_CLIENT_LISTEN (or
GEOFED_PEER_LISTEN with ``--peer``), else that field of the GEOFED_CONFIG JSON
file, else the node's default port. The check itself is the client library's
`geofed.client.health_status`. Exit status 0 means SERVING; anything else is
unhealthy, with the reason on stderr.

    python healthcheck.py [--peer] [--service NAME] [--target HOST:PORT] [--timeout S]
"""

from __future__ import annotations

import argparse
import sys

from geofed.client import health_status
from geofed.node import ENV_PREFIX, NodeConfig
from geofed.routing import GeofedError

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}


def listen_address(field: str) -> str:
    """The node's listen address `field`, as the node resolves it (without flags)."""
    # The id and federation file are required settings that may come as flags.
    config = NodeConfig.load(overrides={"broker_id": "-", "federation": "-"})
    return str(getattr(config, field))


def dial_target(listen: str) -> str:
    """Where to connect to reach a server listening on `listen` from the same host."""
    host, _, port = listen.rpartition(":")
    if host in _WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="check the federation port")
    parser.add_argument("--service", default="", help='health service name ("" = overall)')
    parser.add_argument("--target", help="host:port to check (default: from the node settings)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)

    target = args.target
    if not target:
        field = "peer_listen" if args.peer else "client_listen"
        try:
            target = dial_target(listen_address(field))
        except GeofedError as exc:
            print(f"unhealthy: bad node settings ({ENV_PREFIX}*): {exc}", file=sys.stderr)
            return 1
    status = health_status(target, args.service, timeout=args.timeout)
    if status != "SERVING":
        print(f"unhealthy: {target} service {args.service!r} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
