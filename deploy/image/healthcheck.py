"""Container health check: asks the node's gRPC health service whether it is SERVING.

Run by the image's HEALTHCHECK (Kubernetes uses its native gRPC probes instead).
The port comes from the same settings the node reads, minus command-line flags
that a health check cannot see: GEOFED_CLIENT_LISTEN (or GEOFED_PEER_LISTEN
with ``--peer``), else that field of the GEOFED_CONFIG JSON file, else the
node's default. Exit status 0 means SERVING; anything else is unhealthy, with
the reason on stderr.

    python healthcheck.py [--peer] [--service NAME] [--target HOST:PORT] [--timeout S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULTS = {"client_listen": "0.0.0.0:7400", "peer_listen": "0.0.0.0:7401"}
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}


def listen_address(field: str) -> str:
    """The node's listen address for `field`: env var, then config file, then default."""
    env = os.environ.get(f"GEOFED_{field.upper()}")
    if env:
        return env
    config = os.environ.get("GEOFED_CONFIG")
    if config:
        try:
            with open(config, encoding="utf-8") as fh:
                value = json.load(fh).get(field)
        except (OSError, ValueError, AttributeError):
            value = None  # the node itself reports a bad config file; fall back
        if isinstance(value, str) and value:
            return value
    return DEFAULTS[field]


def dial_target(listen: str) -> str:
    """Where to connect to reach a server listening on `listen` from the same host."""
    host, _, port = listen.rpartition(":")
    if host in _WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="store_true", help="check the federation port")
    parser.add_argument("--service", default="", help='health service name ("" = overall)')
    parser.add_argument("--target", help="host:port to check (default: from the node settings)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    field = "peer_listen" if args.peer else "client_listen"
    target = args.target or dial_target(listen_address(field))
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"unhealthy: {target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"unhealthy: {target} service {args.service!r} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
