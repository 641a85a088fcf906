"""Benchmark one broker node: batched publish throughput and delivery latency.

Not a test: it prints what it measured and appends it to
``bench/results/node.md`` with the command and the machine.

Set-up: a two-broker federation. The node under test (``node``) covers the
world but a small box in Antarctica, which belongs to ``peer``: an in-process
stand-in broker that speaks the real federation protocol. Under
``subscription-geofence`` the peer hands the node N geofenced subscriptions
(open-data workload: 1-100 km circles around cities, some world), so every
event published at the node is matched against N subscriptions, and matched
events travel to the peer as deliveries.

1. Throughput: events published through PublishStream batches (context
   workload events: 1-100 km event geofences, 10 % world) until the node
   answered each batch; events/s. Under subscription-geofence an event whose
   geofence meets no other broker's area needs no match against remote
   subscriptions, so ``--world-events`` (every event without geofence, every
   one matched against all N) gives the worst case. *Absorbed* events/s
   count until the peer has also received every delivery message. *Node
   CPU µs/event*: the node process's CPU time (all its threads, from
   ``/proc``) over that same span, per event: what the load of other
   processes moves much less than the rates.
2. Local delivery: ``--local-events`` events (64-byte payloads, topic
   ``local/x`` that no remote subscription matches) through PublishStream
   to ``--local-subs`` subscribers at the node itself (Subscribe streams,
   ``geofed.client``, in this process): deliveries/s until every subscriber
   received every event, and how many never arrived (dropped on the way).
3. Latency: 1,000 events/s through the client's single publishes (one open
   PublishEach call) for a few seconds to a local subscriber (Subscribe
   stream) at the node; publish->delivery from the client's clock, p50/p99.

The price of durability: each configuration runs with persistence off (no
``data_dir``, everything in memory) and on with ``store_sync=normal`` and
``store_sync=full`` (``--durability``), side by side in one run, the order
of the three rotated from one subscription count (and ``--rounds`` round) to
the next so that a drift of the machine's load does not favour one mode.
With a store, a publish is answered once its peer outbox entries are
committed (group commit), so both phases pay the commit.

Usage: ``python -m geofed.bench.node_bench [--subs 10000,100000] [--events 50000]
[--world-events] [--local-subs 10] [--local-events 20000] [--durability off,normal,full]
[--rounds 1]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from geofed.client import Publication, TLSConfig, connect, health_status
from geofed.errors import DeadlineExceeded
from geofed.node import (
    PEER_MESSAGES_SENT,
    PEER_QUEUE_LENGTH,
    PROTOCOL_VERSION,
    SUBSCRIPTIONS,
    TLSFiles,
    issue_federation,
    server_credentials,
)
from geofed.routing import Federation, LatLon, SubscribeMsg, Subscription
from geofed.v1 import federation_pb2_grpc as fpb_grpc
from geofed.wire import (
    FEDERATION_SERVICE,
    ack_frame,
    add_to_frame,
    hello_frame,
    new_frame,
    snapshot_frames,
)

from ._machine import TreeCpu, record
from .local import free_ports, tls_config
from .scrape import metric
from .workload import WorkloadConfig, generate

RESULTS = Path(__file__).resolve().parent / "results" / "node.md"
_LOCAL_IDLE_S = 10.0  # a local subscriber that got nothing for this long has lost the rest
DURABILITY = ("off", "normal", "full")
"""Persistence modes: no data_dir, or a store with that ``store_sync``."""
PARIS = LatLon(48.85, 2.35)
STRATEGY = "subscription-geofence"
PEER_BOX = [[-10.0, -89.0], [10.0, -89.0], [10.0, -85.0], [-10.0, -85.0], [-10.0, -89.0]]


def federation_file(
    path: Path, node_ports: tuple[int, int], peer_port: int, peer_id: str = "peer"
) -> Federation:
    """Write the two-broker federation and return it."""
    world = [[-180.0, -90.0], [180.0, -90.0], [180.0, 90.0], [-180.0, 90.0], [-180.0, -90.0]]
    doc = {
        "type": "FeatureCollection",
        "features": [
            {
                "type": "Feature",
                "properties": {
                    "id": "node",
                    "endpoint": f"127.0.0.1:{node_ports[1]}",
                    "client_endpoint": f"127.0.0.1:{node_ports[0]}",
                },
                "geometry": {"type": "Polygon", "coordinates": [world, PEER_BOX[::-1]]},
            },
            {
                "type": "Feature",
                "properties": {
                    "id": peer_id,
                    "endpoint": f"127.0.0.1:{peer_port}",
                    "client_endpoint": "127.0.0.1:1",
                },
                "geometry": {"type": "Polygon", "coordinates": [PEER_BOX]},
            },
        ],
    }
    path.write_text(json.dumps(doc))
    return Federation.load(path)


class FakePeer(fpb_grpc.FederationServiceServicer):
    """The other broker: accepts the node's link (or dials it: `dial`), sends
    subscriptions, counts deliveries."""

    def __init__(self, fed: Federation, subs: list[Subscription], broker_id: str = "peer") -> None:
        self.fed = fed
        self.subs = subs
        self.id = broker_id
        self.deliveries = 0
        self.loaded = asyncio.Event()

    async def dial(self, endpoint: str, tls: TLSConfig | None) -> None:
        """Dial the node's peer port (its id sorts after ours) and run the link."""
        channel = (
            grpc.aio.insecure_channel(endpoint)
            if tls is None
            else grpc.aio.secure_channel(endpoint, tls.credentials(), options=tls.options())
        )
        async with channel:
            call = fpb_grpc.FederationServiceStub(channel).Link()
            await call.write(
                hello_frame(self.id, STRATEGY, self.fed.digest, PROTOCOL_VERSION, time.time_ns())
            )
            await self.Link(None, call, hello_sent=True)

    async def Link(self, request_iterator: Any, context: Any, hello_sent: bool = False) -> None:
        first = await context.read()
        hello = first.hello  # answered in kind: the node's strategy and protocol version
        if not hello_sent:
            await context.write(
                hello_frame(
                    self.id, hello.strategy, self.fed.digest, hello.protocol_version, time.time_ns()
                )
            )
        for frame, _, _ in snapshot_frames([], 1):  # an empty snapshot: we held nothing
            await context.write(frame)
        for seq, i in enumerate(range(0, len(self.subs), 2000), start=1):
            frame = new_frame()
            for s in self.subs[i : i + 2000]:
                add_to_frame(frame, SubscribeMsg(s, self.id), self.id)
            frame.seq = seq
            await context.write(frame)
        self.loaded.set()
        lock = asyncio.Lock()  # one write at a time: acks and heartbeats

        async def heartbeats() -> None:
            # The node drops a link that is silent for peer_timeout_s (a long run outlasts it).
            while True:
                await asyncio.sleep(1.0)
                async with lock:
                    await context.write(new_frame())

        beating = asyncio.create_task(heartbeats())
        try:
            while True:
                frame = await context.read()
                if frame is grpc.aio.EOF:
                    return
                self.deliveries += len(frame.deliveries)
                if frame.seq:
                    async with lock:
                        await context.write(ack_frame(frame.seq))
        finally:
            beating.cancel()


def _subscriptions(n: int, seed: int) -> list[Subscription]:
    cfg = WorkloadConfig(
        scenario="open-data",
        clients=n // 2,
        publisher_share=0.0,
        subscriptions_per_subscriber=2,
        unsubscribe_share=0.0,
        world_share=0.05,
        seed=seed,
        duration_s=10.0,
    )
    out = []
    for op in generate(cfg):
        if op.op == "subscribe":
            out.append(Subscription(op.id, op.client, op.topic, op.geofence))
    return out[:n]


def _events(n: int, seed: int, world: bool) -> list[Publication]:
    rate = 5.0
    cfg = WorkloadConfig(
        scenario="context",
        clients=max(2, int(n / (rate * 10) * 2)),
        publisher_share=0.5,
        publish_rate_hz=rate,
        duration_s=10.0,
        world_share=0.1,
        seed=seed,
    )
    out = []
    for op in generate(cfg):
        if op.op == "publish":
            assert op.location is not None
            fence = None if world else op.geofence
            out.append(Publication(op.topic, b"\0" * 64, op.location, fence, op.id))
    return out[:n]


async def _run(
    subs: list[Subscription],
    events: list[Publication],
    world: bool,
    rate: float,
    seconds: float,
    workdir: Path,
    durability: str,
    tls: bool = False,
    local: tuple[int, int] = (10, 20_000),
    peer_dials: bool = False,
) -> dict[str, Any]:
    """One configuration; `subs` and `events` are emptied (the latency run needs the memory).

    With `tls` the node runs with mutual TLS to the peer and TLS to its clients
    (certificates from a throw-away CA). With `peer_dials` the peer (``edge``)
    dials the node, so the link comes in through the node's peer port.
    """
    client_port, peer_listen, metrics_port, fake_port = free_ports(4)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    peer_id = "edge" if peer_dials else "peer"  # the broker whose id sorts first dials
    fed_path = workdir / "federation.geojson"
    fed = federation_file(fed_path, (client_port, peer_listen), fake_port, peer_id)
    n_subs = len(subs)
    n_loaded, n_sent = len(subs), len(events)
    tag = f"[{n_subs} subs, persistence {durability}, TLS {'on' if tls else 'off'}]"
    peer = FakePeer(fed, subs, peer_id)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
    fpb_grpc.add_FederationServiceServicer_to_server(peer, server)
    certs = workdir / "certs"
    client_tls: TLSConfig | None = None
    peer_tls: TLSConfig | None = None
    if tls:
        issue_federation(workdir / "federation.geojson", certs)
        peer_files = TLSFiles.in_dir(certs / "brokers" / peer_id)
        server.add_secure_port(
            f"127.0.0.1:{fake_port}", server_credentials(peer_files, require_client_auth=True)
        )
        client_tls = TLSConfig(ca_file=str(certs / "ca.pem"))
        peer_tls = tls_config(peer_files)
    else:
        server.add_insecure_port(f"127.0.0.1:{fake_port}")
    await server.start()
    env = dict(os.environ)
    env.update(
        {
            "GEOFED_BROKER_ID": "node",
            "GEOFED_FEDERATION": str(workdir / "federation.geojson"),
            "GEOFED_STRATEGY": STRATEGY,
            "GEOFED_CLIENT_LISTEN": f"127.0.0.1:{client_port}",
            "GEOFED_PEER_LISTEN": f"127.0.0.1:{peer_listen}",
            "GEOFED_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
            "GEOFED_LOG_LEVEL": os.environ.get("GEOFED_LOG_LEVEL", "warning"),
        }
    )
    data_dir = workdir / f"data-{n_subs}-{durability}"
    if durability != "off":
        shutil.rmtree(data_dir, ignore_errors=True)
        data_dir.mkdir(parents=True)
        env.update({"GEOFED_DATA_DIR": str(data_dir), "GEOFED_STORE_SYNC": durability})
    if tls:
        env["GEOFED_TLS_DIR"] = str(certs / "brokers" / "node")
    proc = subprocess.Popen([sys.executable, "-m", "geofed.node"], env=env)
    dialling: asyncio.Task[None] | None = None
    try:
        node_peer = f"127.0.0.1:{peer_listen}"
        if peer_dials:
            while health_status(node_peer, tls=peer_tls) != "SERVING":
                await asyncio.sleep(0.1)
            dialling = asyncio.create_task(peer.dial(node_peer, peer_tls))
        while health_status(node_peer, FEDERATION_SERVICE, tls=peer_tls) != "SERVING":
            await asyncio.sleep(0.1)
        t0 = time.perf_counter()
        await asyncio.wait_for(peer.loaded.wait(), 600)
        endpoint = f"127.0.0.1:{client_port}"
        async with await connect(
            client_id="bench", location=PARIS, endpoint=endpoint, tls=client_tls
        ) as client:
            while await _metric(metrics_url, SUBSCRIPTIONS, scope="remote") < n_loaded:
                await asyncio.sleep(0.2)
            load_s = time.perf_counter() - t0
            print(
                f"{tag} loaded in {load_s:.1f}s; throughput ...",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            tree = TreeCpu(proc.pid)  # one process: sampled when asked
            cpu0 = tree.seconds()
            accepted = await client.publish_many(events, batch_size=1000)
            assert len(accepted) == len(events), len(accepted)
            throughput = n_sent / (time.perf_counter() - t0)
            # Absorbed: the peer also has every delivery message the node sent.
            while peer.deliveries < await _metric(
                metrics_url, PEER_MESSAGES_SENT, kind="delivery"
            ) or await _metric(metrics_url, PEER_QUEUE_LENGTH):
                await asyncio.sleep(0.05)
            absorbed = n_sent / (time.perf_counter() - t0)
            cpu1 = tree.seconds()
            node_cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / n_sent
            print(
                f"{tag} {throughput:,.0f} events/s accepted, {absorbed:,.0f} absorbed;"
                f" local delivery to {local[0]} subscribers ...",
                file=sys.stderr,
                flush=True,
            )
            local_per_s, local_lost = await _local_delivery(endpoint, *local, client_tls)
            print(
                f"{tag} {local_per_s:,.0f} deliveries/s to local subscribers ({local_lost} lost);"
                f" latency at {rate:.0f}/s ...",
                file=sys.stderr,
                flush=True,
            )
            # The bench's own garbage (events, subscriptions) must not pause the
            # client that measures latency.
            events.clear()
            subs.clear()
            gc.collect()
            gc.freeze()
            latencies, failures = await _latency(endpoint, rate, seconds, client_tls)
            for what, count in failures.items():
                print(f"{tag} latency run: {count} publishes failed: {what}", file=sys.stderr)
        matched = peer.deliveries
    finally:
        proc.terminate()
        proc.wait(30)
        if dialling is not None:
            dialling.cancel()
            with contextlib.suppress(BaseException):
                await dialling
        await server.stop(None)
    lat_ms = sorted(x * 1000 for x in latencies)
    store = sum(f.stat().st_size for f in data_dir.iterdir()) if durability != "off" else None
    return {
        "tls": "on" if tls else "off",
        "persistence": durability,
        "store_mib": None if store is None else round(store / 1048576, 1),
        "subscriptions": n_loaded,
        "events": n_sent,
        "event_geofences": "none (world)" if world else "workload",
        "load_s": round(load_s, 1),
        "events_per_s": round(throughput),
        "absorbed_per_s": round(absorbed),
        "node_cpu_us": None if node_cpu is None else round(node_cpu * 1e6, 1),
        "delivery_messages": matched,
        "local_subscribers": local[0],
        "local_deliveries_per_s": round(local_per_s),
        "local_lost": local_lost,
        "latency_rate": rate,
        "latency_samples": len(lat_ms),
        "latency_failed": sum(failures.values()),
        "p50_ms": round(statistics.median(lat_ms), 2) if lat_ms else "—",
        "p99_ms": round(lat_ms[int(0.99 * (len(lat_ms) - 1))], 2) if lat_ms else "—",
    }


async def _metric(url: str, name: str, **labels: str) -> float:
    return await asyncio.to_thread(metric, url, name, **labels)


async def _local_delivery(
    endpoint: str, subscribers: int, n: int, tls: TLSConfig | None = None
) -> tuple[float, int]:
    """Deliveries/s of `n` batched publishes to `subscribers` local subscribers, and the lost.

    A subscriber that receives nothing more for `_LOCAL_IDLE_S` while short
    of `n` has lost the rest (a queue on the way overflowed).
    """
    clients = [
        await connect(client_id=f"local-sub-{i}", location=PARIS, endpoint=endpoint, tls=tls)
        for i in range(subscribers)
    ]
    try:
        subs = [
            await c.subscribe("local/#", subscription_id=f"local-{i}")
            for i, c in enumerate(clients)
        ]
        counts = [0] * subscribers
        last = [0.0]

        async def take(i: int) -> None:
            while counts[i] < n:
                try:
                    await subs[i].next(timeout=_LOCAL_IDLE_S)
                except DeadlineExceeded:
                    return  # the rest was dropped
                counts[i] += 1
                last[0] = time.perf_counter()

        readers = [asyncio.create_task(take(i)) for i in range(subscribers)]
        async with await connect(
            client_id="local-pub", location=PARIS, endpoint=endpoint, tls=tls
        ) as publisher:
            events = [Publication("local/x", b"\0" * 64, PARIS) for _ in range(n)]
            t0 = time.perf_counter()
            await publisher.publish_many(events)
            await asyncio.gather(*readers)
        delivered = sum(counts)
        return delivered / max(last[0] - t0, 1e-9), subscribers * n - delivered
    finally:
        for c in clients:
            await c.close()


async def _latency(
    endpoint: str, rate: float, seconds: float, tls: TLSConfig | None = None
) -> tuple[list[float], dict[str, int]]:
    """Publish -> delivery times of `rate` events/s for `seconds` to one local subscriber.

    A publish that fails is counted by its error (returned), not raised: the
    subscriber then waits only for the events that were published, and the
    row reports the failures instead of the run losing every row.
    """
    async with (
        await connect(
            client_id="lat-sub", location=PARIS, endpoint=endpoint, tls=tls
        ) as subscriber,
        await connect(client_id="lat-pub", location=PARIS, endpoint=endpoint, tls=tls) as publisher,
    ):
        sub = await subscriber.subscribe("latency/#", subscription_id="lat")
        n = int(rate * seconds)
        received: list[float] = []
        published: set[str] = set()
        done_publishing = asyncio.Event()

        async def take() -> None:
            while not done_publishing.is_set() or len(received) < len(published):
                try:
                    msg = await sub.next(timeout=30.0)
                except DeadlineExceeded:
                    return  # what is missing is reported as lost
                received.append(time.perf_counter() - float(msg.payload.decode()))

        task = asyncio.create_task(take())
        start = time.perf_counter()
        tasks = []
        for i in range(n):
            wait = start + i / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            payload = str(time.perf_counter())
            tasks.append(asyncio.ensure_future(publisher.publish("latency/x", payload)))
        failures: dict[str, int] = {}
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, BaseException):
                failures[str(result)] = failures.get(str(result), 0) + 1
            else:
                published.add(result)
        done_publishing.set()
        await task
        if len(received) < len(published):
            failures["published, never delivered"] = len(published) - len(received)
    return received, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--subs", default="10000,100000", help="comma-separated subscription counts")
    p.add_argument("--events", type=int, default=50_000, help="events for the throughput run")
    p.add_argument(
        "--world-events",
        action="store_true",
        help="throughput events without geofence (each matched against every subscription)",
    )
    p.add_argument(
        "--local-subs", type=int, default=10, help="subscribers of the local delivery run"
    )
    p.add_argument(
        "--local-events", type=int, default=20_000, help="events of the local delivery run"
    )
    p.add_argument("--rate", type=float, default=1000.0, help="events/s for the latency run")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    p.add_argument(
        "--durability",
        default=",".join(DURABILITY),
        help="comma-separated persistence modes: off (no data_dir), normal, full (store_sync)",
    )
    p.add_argument(
        "--tls",
        default="off",
        help="comma-separated: off (plaintext), on (mutual TLS to the peer, TLS to clients)",
    )
    p.add_argument(
        "--peer-dials",
        action="store_true",
        help="the peer dials the node, so the link enters through the node's peer port"
        " (with TLS: its TLS front); by default the node dials the peer",
    )
    p.add_argument(
        "--rounds", type=int, default=1, help="runs of every configuration (order rotated)"
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="where the stores go (default: the temporary folder; put it on the disk measured)",
    )
    p.add_argument(
        "--no-record", action="store_true", help="do not append to bench/results/node.md"
    )
    args = p.parse_args(argv)
    modes = args.durability.split(",")
    unknown = [m for m in modes if m not in DURABILITY]
    if unknown or not modes:
        p.error(f"unknown --durability {', '.join(unknown)}; of {', '.join(DURABILITY)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.local_subs < 1 or args.local_events < 1:
        p.error("--local-subs and --local-events must be >= 1")
    tls_modes = args.tls.split(",")
    if not tls_modes or any(t not in ("off", "on") for t in tls_modes):
        p.error(f"--tls takes off, on or off,on; got {args.tls!r}")
    configs = [(m, t) for m in modes for t in tls_modes]
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    turn = 0
    with tempfile.TemporaryDirectory(prefix="geofed-bench-", dir=args.workdir) as tmp:
        for n in (int(x) for x in args.subs.split(",")):
            print(f"[{n} subs] generating subscriptions and events ...", file=sys.stderr)
            subs = _subscriptions(n, seed=n)
            events = _events(args.events, seed=1, world=args.world_events)
            for _ in range(args.rounds):
                k = turn % len(configs)
                for mode, tls in configs[k:] + configs[:k]:
                    row = asyncio.run(
                        _run(
                            list(subs),
                            list(events),
                            args.world_events,
                            args.rate,
                            args.seconds,
                            Path(tmp),
                            mode,
                            tls == "on",
                            (args.local_subs, args.local_events),
                            args.peer_dials,
                        )
                    )
                    rows.append(row | {"order": len(rows) + 1})
                turn += 1
    load_after = os.getloadavg()
    table = _table(rows, modes)
    print(table)
    if not args.no_record:
        record(
            RESULTS,
            "geofed.bench.node_bench",
            argv,
            f"Load average (1 / 5 min): {load_before[0]:.2f} / {load_before[1]:.2f} before,"
            f" {load_after[0]:.2f} / {load_after[1]:.2f} after\n\n{table}",
        )
    return 0


def _table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    """One row per run, grouped by subscription count in the order of `modes`."""
    head = (
        "| subscriptions | persistence | TLS | run | events | event geofences | load s "
        "| events/s (batched) | events/s absorbed | node CPU µs/event | delivery msgs "
        "| local deliveries/s (lost) "
        "| p50 ms @ rate | p99 ms @ rate | failed publishes @ rate | store MiB after |"
    )
    lines = [head, "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    order = sorted(
        rows, key=lambda r: (r["subscriptions"], modes.index(r["persistence"]), r["tls"])
    )
    for r in order:
        store = "—" if r["store_mib"] is None else r["store_mib"]
        cpu = "—" if r["node_cpu_us"] is None else f"{r['node_cpu_us']:,}"
        lines.append(
            f"| {r['subscriptions']:,} | {r['persistence']} | {r['tls']} | {r['order']} "
            f"| {r['events']:,} "
            f"| {r['event_geofences']} | {r['load_s']} | {r['events_per_s']:,} "
            f"| {r['absorbed_per_s']:,} | {cpu} | {r['delivery_messages']:,} "
            f"| {r['local_deliveries_per_s']:,} to {r['local_subscribers']} "
            f"({r['local_lost']:,}) "
            f"| {r['p50_ms']} @ {r['latency_rate']:.0f}/s "
            f"| {r['p99_ms']} @ {r['latency_rate']:.0f}/s | {r['latency_failed']} | {store} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
