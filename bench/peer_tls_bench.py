"""What the peer port's TLS front costs: bytes and round trips through it, beside gRPC's TLS.

Not a test: it prints what it measured and appends it to
``bench/results/node.md`` with the command, the machine and the load.

A server process serves a sink (a client stream of 64 KiB messages, answered
with their byte count) and an echo (a 100-byte unary call) the way a node
serves its peer port, through `geofed.node`'s own `Security`:

* ``plaintext``: no ``tls_dir`` (``add_insecure_port``);
* ``grpc-tls``: mutual TLS done by gRPC's C core (``add_secure_port`` with
  ``server_credentials(require_client_auth=True)``: the peer port before the
  front);
* ``front``: the TLS front (`geofed.node._peer_front`) before a plaintext
  gRPC server on loopback, with its interceptor (the peer port now).

A client in this process dials it as a broker does (the broker ``ap``'s
certificate, ``eu.broker.geofed`` verified): ``--mib`` MiB through one
stream, then ``--pings`` sequential echo calls. Measured: MiB/s, the server
process's CPU time per MiB (`time.process_time`, what the node pays on its
event loop and gRPC's threads), echo round trip p50/p99 and server CPU per
echo. Every mode runs ``--rounds`` times, the order rotated; the table has
the medians. CPU time per unit is the figure that survives a loaded machine;
wall-clock rates drift with the load (recorded beside them).

Usage: ``python -m geofed.bench.peer_tls_bench [--mib 256] [--pings 2000] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from geofed.client import TLSConfig
from geofed.node import (
    NodeConfig,
    NodeMetrics,
    Security,
    TLSFiles,
    dial_options,
    issue_federation,
)

from ._machine import record

RESULTS = Path(__file__).resolve().parent / "results" / "node.md"
MODES = ("plaintext", "grpc-tls", "front")
_CHUNK = b"x" * (64 << 10)
_PING = b"p" * 100
_SINK, _ECHO = "/bench.Sink/Push", "/bench.Sink/Echo"


# --------------------------------------------------------------------------
# The server process


async def _serve(mode: str, certs: Path) -> None:
    tls = {} if mode == "plaintext" else {"tls_dir": str(certs / "brokers" / "eu")}
    auth = {"client_auth": "cert"} if mode == "grpc-tls" else {}
    config = NodeConfig(broker_id="eu", federation="three", **tls, **auth)  # type: ignore[arg-type]
    security = Security(config, NodeMetrics(CollectorRegistry()))
    interceptors = security.peer_interceptors() if mode == "front" else []
    server = grpc.aio.server(interceptors=interceptors)

    async def push(requests: Any, context: Any) -> bytes:
        n = 0
        async for chunk in requests:
            n += len(chunk)
        return str(n).encode()

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Sink",
                {
                    "Push": grpc.stream_unary_rpc_method_handler(push),
                    "Echo": grpc.unary_unary_rpc_method_handler(echo),
                },
            ),
        )
    )
    listen = "127.0.0.1:0"
    if mode == "grpc-tls":
        port = security.bind(server, listen, "peer_listen")  # mutual: client_auth cert
    else:
        port = await security.bind_peers(server, listen)
    await server.start()
    print(f"port {port}", flush=True)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "cpu":
        print(f"cpu {time.process_time()}", flush=True)
    await server.stop(None)
    await security.close()


# --------------------------------------------------------------------------
# The client


class _Server:
    def __init__(self, mode: str, certs: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "geofed.bench.peer_tls_bench", "--serve", mode, str(certs)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline().split()[1])

    def cpu(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline().split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


async def _measure(mode: str, certs: Path, mib: int, pings: int) -> dict[str, float]:
    server = await asyncio.to_thread(_Server, mode, certs)
    endpoint = f"127.0.0.1:{server.port}"
    if mode == "plaintext":
        channel = grpc.aio.insecure_channel(endpoint)
    else:
        ap = TLSFiles.in_dir(certs / "brokers" / "ap")
        tls = TLSConfig(ca_file=str(ap.ca), cert_file=str(ap.cert), key_file=str(ap.key))
        channel = grpc.aio.secure_channel(endpoint, tls.credentials(), options=dial_options("eu"))
    try:
        async with channel:
            sink = channel.stream_unary(_SINK)
            echo = channel.unary_unary(_ECHO)
            for _ in range(50):  # warm up: the connection, the handshake, the code paths
                await echo(_PING)
            n = mib * 16  # 64 KiB messages

            async def chunks() -> Any:
                for _ in range(n):
                    yield _CHUNK

            cpu0, t0 = server.cpu(), time.perf_counter()
            got = await sink(chunks())
            wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
            assert int(got) == n * len(_CHUNK), got
            rtts = []
            cpu0 = server.cpu()
            for _ in range(pings):
                t = time.perf_counter()
                assert await echo(_PING) == _PING
                rtts.append(time.perf_counter() - t)
            ping_cpu = server.cpu() - cpu0
    finally:
        await asyncio.to_thread(server.close)
    rtts.sort()
    return {
        "mib_per_s": mib / wall,
        "cpu_ms_per_mib": 1000 * cpu / mib,
        "p50_us": 1e6 * rtts[len(rtts) // 2],
        "p99_us": 1e6 * rtts[int(len(rtts) * 0.99)],
        "cpu_us_per_ping": 1e6 * ping_cpu / pings,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--mib", type=int, default=256, help="MiB through one stream per run")
    p.add_argument("--pings", type=int, default=2000, help="echo calls per run")
    p.add_argument("--rounds", type=int, default=3, help="runs of every mode (order rotated)")
    p.add_argument("--no-record", action="store_true", help="do not append to node.md")
    p.add_argument("--serve", nargs=2, metavar=("MODE", "CERTS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve[0], Path(args.serve[1])))
        return 0
    if args.mib < 1 or args.pings < 100 or args.rounds < 1:
        p.error("--mib >= 1, --pings >= 100 and --rounds >= 1")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="geofed-peer-tls-") as tmp:
        certs = Path(tmp) / "certs"
        issue_federation("three", certs)
        for r in range(args.rounds):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                row = asyncio.run(_measure(mode, certs, args.mib, args.pings))
                runs[mode].append(row)
                print(f"[{mode}, round {r + 1}] {row}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    lines = [
        "| peer port | MiB/s | server CPU ms/MiB | echo p50 µs | echo p99 µs"
        " | server CPU µs/echo |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in runs[mode]) for k in runs[mode][0]}
        lines.append(
            f"| {mode} | {med['mib_per_s']:,.0f} | {med['cpu_ms_per_mib']:.2f}"
            f" | {med['p50_us']:,.0f} | {med['p99_us']:,.0f} | {med['cpu_us_per_ping']:,.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.peer_tls_bench",
            argv,
            f"Load average (1 / 5 min): {load_before[0]:.2f} / {load_before[1]:.2f} before,"
            f" {load_after[0]:.2f} / {load_after[1]:.2f} after; medians of {args.rounds}"
            f" rounds\n\n{table}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
