"""``geofed node`` (one broker) and ``geofed up`` (a local federation)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from geofed.node import add_arguments
from geofed.routing import STRATEGIES


def register(sub: Any, name: str) -> None:
    """Add the ``node`` or ``up`` subcommand."""
    if name == "node":
        p = sub.add_parser(name, help="run one broker node")
        add_arguments(p)
        p.set_defaults(func=_node)
    else:
        p = sub.add_parser(name, help="run a local federation: one node process per broker")
        p.add_argument("federation", nargs="?", default="aws-2020", help="file or bundled name")
        p.add_argument("--strategy", default="event-geofence", choices=list(STRATEGIES))
        p.add_argument("--workdir", help="where to keep logs and traces (default: a temp dir)")
        p.add_argument("--trace", action="store_true", help="write node message traces")
        p.add_argument(
            "--tls",
            action="store_true",
            help="mutual TLS between the brokers and TLS to clients, on a throw-away CA whose"
            " certificates go to WORKDIR/certs (clients: --ca WORKDIR/certs/ca.pem)",
        )
        p.add_argument(
            "--durable",
            action="store_true",
            help="give each broker a store in WORKDIR/<id>/data (kept across runs with --workdir)",
        )
        p.set_defaults(func=_up)


def _node(args: argparse.Namespace) -> int:
    from geofed.node import run

    return run(args)


def _up(args: argparse.Namespace) -> int:
    from geofed.bench.local import LocalFederation

    fed = LocalFederation(
        args.federation,
        args.strategy,
        args.workdir,
        trace=args.trace,
        durable=args.durable,
        tls=args.tls,
    )
    stop = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting {len(fed.source)} brokers ({args.strategy}) ...", file=sys.stderr)
    try:
        fed.start(timeout=120)
        print(
            f"{'broker':<16} {'client':<22} {'peer':<22} {'mqtt':<22} {'mqtt-ws':<22}"
            f" {'http':<22} metrics"
        )
        for n in fed.nodes.values():
            print(
                f"{n.broker_id:<16} {n.client:<22} {n.peer:<22} {n.mqtt:<22} {n.mqtt_ws:<22}"
                f" {n.http:<22}"
                f" {n.metrics_url}"
            )
        print(f"federation file: {fed.federation_path}")
        if args.tls:
            print(f"TLS: CA {fed.certs_dir / 'ca.pem'}, certificates in {fed.certs_dir}")
        print("all brokers healthy and linked; Ctrl-C stops them", flush=True)
        while not stop:
            for n in fed.nodes.values():
                if n.process.poll() is not None:
                    print(
                        f"broker {n.broker_id} exited ({n.process.returncode}); log {n.log_path}",
                        file=sys.stderr,
                    )
                    stop = True
            time.sleep(0.2)
    finally:
        fed.stop()
        print("stopped", file=sys.stderr)
    return 0
