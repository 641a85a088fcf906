"""``geofed certs``: issue TLS certificates for a federation's brokers and clients.

The certificate authority itself is `geofed.node`'s (`create_ca`,
`issue_broker`, `issue_client`, `issue_federation`; names in docs/security.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from geofed.node import LEAF_VALID, issue_federation
from geofed.routing import InvalidInput


def register(sub: Any, name: str) -> None:
    """Add the ``certs`` subcommand."""
    p = sub.add_parser(
        name,
        help="issue TLS certificates for a federation's brokers and clients (a throw-away CA)",
        description="Write a CA (reused if DIR has one), one folder per broker"
        " (DIR/brokers/ID: ca.pem, cert.pem, key.pem) and per --client (DIR/clients/ID)."
        " Running it again re-issues the certificates: a running broker reloads them.",
    )
    p.add_argument("federation", help="federation file or bundled name")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="output folder")
    p.add_argument(
        "--client",
        action="append",
        default=[],
        metavar="ID",
        help="also issue a client certificate for this identity (repeatable)",
    )
    p.add_argument("--days", type=int, default=LEAF_VALID.days, help="certificate lifetime")
    p.set_defaults(func=_certs)


def _certs(args: argparse.Namespace) -> int:
    if args.days < 1:
        raise InvalidInput("days", f"must be at least 1, got {args.days}")
    reused = (Path(args.out) / "ca.pem").exists()
    issued = issue_federation(
        args.federation, args.out, clients=args.client, valid=dt.timedelta(days=args.days)
    )
    ca = Path(args.out) / "ca.pem"
    print(f"{'reused' if reused else 'created'} CA {ca}", file=sys.stderr)
    for who, files in issued.items():
        print(f"{who:<32} {files.cert.parent}")
    return 0
