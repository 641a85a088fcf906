"""Container health check: is the node's gRPC health service SERVING?

Run by the image's HEALTHCHECK (Kubernetes uses its native gRPC probes
instead). The node's own configuration loader (`geofed.node.NodeConfig`)
finds the address, from the same settings the node reads minus command-line
flags, which a health check cannot see: GEOFED_CLIENT_LISTEN (or
GEOFED_PEER_LISTEN with ``--peer``), else that field of the GEOFED_CONFIG JSON
file, else the node's default port. When the node serves TLS (GEOFED_TLS_DIR),
the check speaks TLS too, with the broker's own certificate and key (from the
federation's CA, good for either side of a handshake, so it also passes a
port that asks for a client certificate) and verifies that the broker answers
(``DNS:<broker id>.broker.geofed``; without a known id, the address dialled,
which `geofed certs` puts in every broker certificate). The check itself is
the client library's `geofed.client.health_status`. Exit status 0 means
SERVING; anything else is unhealthy, with the reason on stderr.

    python healthcheck.py [--peer] [--service NAME] [--target HOST:PORT] [--timeout S]
"""

from __future__ import annotations

import argparse
import sys

from geofed.client import TLSConfig, health_status
from geofed.node import ENV_PREFIX, NodeConfig, TLSFiles, broker_dns_name
from geofed.routing import GeofedError, InvalidInput

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]", "*"}
# The node's required settings may come as flags, which a health check cannot see.
_REQUIRED = ("broker_id", "federation")
_UNKNOWN = "-"


def node_settings() -> NodeConfig:
    """The node's settings as the node resolves them, without command-line flags."""
    unknown: dict[str, str] = {}
    while True:
        try:
            return NodeConfig.load(overrides=unknown)
        except InvalidInput as exc:
            if exc.field not in _REQUIRED or exc.field in unknown:
                raise
            unknown[exc.field] = _UNKNOWN


def tls_settings(config: NodeConfig) -> TLSConfig | None:
    """How to reach the node's own ports: TLS as the broker itself, or None (plaintext)."""
    if not config.tls_dir:
        return None
    files = TLSFiles.in_dir(config.tls_dir)
    known = config.broker_id != _UNKNOWN
    return TLSConfig(
        ca_file=str(files.ca),
        cert_file=str(files.cert),
        key_file=str(files.key),
        server_name=broker_dns_name(config.broker_id) if known else "",
    )


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

    try:
        config = node_settings()
        tls = tls_settings(config)
    except GeofedError as exc:
        print(f"unhealthy: bad node settings ({ENV_PREFIX}*): {exc}", file=sys.stderr)
        return 1
    target = args.target or dial_target(config.peer_listen if args.peer else config.client_listen)
    status = health_status(target, args.service, timeout=args.timeout, tls=tls)
    if status != "SERVING":
        print(f"unhealthy: {target} service {args.service!r} is {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
