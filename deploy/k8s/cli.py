"""``geofed k8s render``: the command line of the Kubernetes renderer.

Registered by `geofed.cli` (``register(subparsers, name)``); writes the tree
with `geofed.k8s.render` and prints where each broker's overlay went.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from geofed.node import METRICS_PORT
from geofed.routing import Federation, InvalidInput, federation_path

from .endpoints import parse_endpoints
from .manifests import DEFAULT_RELEASE, DEFAULT_TLS_SECRET, FRONT_ENDS
from .tree import RenderResult, render

FRONT_END_HELP = {
    "mqtt": "MQTT 3.1.1/5.0 (docs/mqtt.md)",
    "mqtt-ws": "MQTT over WebSocket, path /mqtt",
    "http": "the HTTP bridge and web map",
}


def register(sub: Any, name: str) -> None:
    """Add the ``k8s`` subcommand (with its ``render`` subcommand)."""
    p = sub.add_parser(name, help="Kubernetes manifests for a federation")
    k8s_sub = p.add_subparsers(dest="k8s_command", metavar="COMMAND", required=True)
    r = k8s_sub.add_parser(
        "render",
        help="write a kustomize base and one overlay per broker",
        description=(
            "Write OUT/base, OUT/overlays/<broker> and, when all brokers run in one "
            "cluster, OUT/kustomization.yaml (kubectl apply -k OUT). See deploy/DEPLOY.md."
        ),
    )
    r.add_argument("--federation", required=True, help="federation file (or bundled name)")
    r.add_argument(
        "--image", required=True, help="broker image, e.g. registry.example/geofed:0.1.0"
    )
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--namespace", default="geofed", help="namespace (default: geofed)")
    r.add_argument(
        "--endpoints",
        help='JSON file {"<id>": {"endpoint": "host:port", "client_endpoint": "host:port"}} '
        "with external addresses (one cluster per region); default: in-cluster DNS names",
    )
    r.add_argument("--strategy", default="event-geofence", help="routing strategy")
    r.add_argument("--cluster-domain", default="cluster.local", help="cluster DNS domain")
    r.add_argument(
        "--peer-cidr",
        action="append",
        default=[],
        help="network the other clusters' brokers connect from (repeatable)",
    )
    r.add_argument(
        "--monitoring-namespace", default="monitoring", help="namespace allowed to scrape /metrics"
    )
    r.add_argument(
        "--podmonitor", action="store_true", help="include a Prometheus-operator PodMonitor"
    )
    r.add_argument(
        "--metrics-listen",
        default=f"0.0.0.0:{METRICS_PORT}",
        metavar="HOST:PORT",
        help="where brokers serve /metrics: 0.0.0.0:PORT (scraped) or 127.0.0.1:PORT "
        f"(inside the pod only); default 0.0.0.0:{METRICS_PORT}",
    )
    r.add_argument(
        "--release",
        default=DEFAULT_RELEASE,
        help="name of this render, in the label (geofed.io/release) that admits a pod to "
        f"the peer port (default: {DEFAULT_RELEASE})",
    )
    r.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between brokers, TLS for clients, from a Secret per broker; "
        "reflection off",
    )
    r.add_argument(
        "--tls-secret",
        default=DEFAULT_TLS_SECRET,
        metavar="TEMPLATE",
        help="the brokers' Secret names, {broker} standing for the broker "
        f"(default: {DEFAULT_TLS_SECRET})",
    )
    r.add_argument(
        "--cert-manager",
        metavar="ISSUER",
        help="a cert-manager Certificate per broker fills its Secret: NAME of an Issuer "
        "or ClusterIssuer/NAME (with --tls)",
    )
    r.add_argument(
        "--data-size",
        default="",
        metavar="SIZE",
        help="durable brokers: a PersistentVolumeClaim of SIZE (e.g. 10Gi) per broker for its "
        "store (GEOFED_DATA_DIR); default: none, state in memory",
    )
    r.add_argument(
        "--storage-class",
        default="",
        metavar="NAME",
        help="StorageClass of the claims (with --data-size; default: the cluster's default)",
    )
    for name, port in FRONT_ENDS.items():
        r.add_argument(
            f"--{name}",
            dest="front_ends",
            action="append_const",
            const=name,
            help=f"serve {FRONT_END_HELP[name]} on port {port} of the client Service",
        )
    r.add_argument("--force", action="store_true", help="replace a previous render in OUT")
    r.set_defaults(func=_cmd_render)


def _cmd_render(args: argparse.Namespace) -> int:
    path = federation_path(args.federation)
    federation = Federation.load(path)
    endpoints = None
    if args.endpoints:
        try:
            raw = json.loads(Path(args.endpoints).read_text(encoding="utf-8"))
        except OSError as exc:
            raise InvalidInput(
                "endpoints", f"cannot read {args.endpoints}: {exc.strerror}"
            ) from None
        except json.JSONDecodeError as exc:
            raise InvalidInput("endpoints", f"{args.endpoints} is not JSON: {exc.msg}") from None
        endpoints = parse_endpoints(raw, federation)
    result = render(
        path,
        args.image,
        args.out,
        namespace=args.namespace,
        endpoints=endpoints,
        strategy=args.strategy,
        cluster_domain=args.cluster_domain,
        peer_cidrs=args.peer_cidr,
        monitoring_namespace=args.monitoring_namespace,
        podmonitor=args.podmonitor,
        release=args.release,
        tls=args.tls,
        tls_secret=args.tls_secret,
        cert_manager=args.cert_manager,
        metrics_listen=args.metrics_listen,
        data_size=args.data_size,
        storage_class=args.storage_class,
        front_ends=args.front_ends or (),
        force=args.force,
    )
    for warning in result.warnings:
        print(f"geofed k8s render: warning: {warning}", file=sys.stderr)
    _print_summary(result, sys.stdout)
    return 0


def _print_summary(result: RenderResult, stream: Any) -> None:
    print(f"{'broker':<16} {'overlay':<28} {'peer endpoint':<48} client endpoint", file=stream)
    for bid, path in result.overlays.items():
        e = result.endpoints[bid]
        rel = path.relative_to(result.out)
        print(f"{bid:<16} {rel.as_posix():<28} {e.peer:<48} {e.client}", file=stream)
    if result.single_cluster:
        print(f"deploy all brokers: kubectl apply --server-side -k {result.out}", file=stream)
    else:
        overlay = result.out / "overlays" / "<broker>"
        print(
            f"deploy each broker in its cluster: kubectl apply --server-side -k {overlay}",
            file=stream,
        )
