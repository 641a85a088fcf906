"""A local federation: one `geofed node` process per broker on loopback.

Used by ``geofed up``, ``geofed demo``, the benchmarks and the integration
tests. Ports are picked free by the OS, written into a copy of the federation
file, and readiness is awaited through gRPC health checks, never by sleeping.

For fault injection (`geofed.bench.faults`) a federation can also keep each
broker's state in ``workdir/<broker id>/data`` (``durable=True``, passed as
``GEOFED_DATA_DIR``), put a `FaultProxy` on every peer link (``links=True``:
`LocalFederation.link`), and freeze a broker (`pause_node`, `resume_node`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from geofed.client import TLSConfig, health_status
from geofed.node import CA, PEER_CONNECTED, TLSFiles, issue_client, issue_federation
from geofed.routing import Federation, GeofedError, Kind
from geofed.wire import FEDERATION_SERVICE

from .faultproxy import FaultProxy, ProxyHost
from .scrape import Quiescence, metric, peer_message_counts


@dataclass(frozen=True)
class LocalNode:
    """Where one local broker listens."""

    broker_id: str
    client: str
    peer: str
    metrics_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    mqtt: str = ""  # host:port of its MQTT listener ("" when off)
    mqtt_ws: str = ""  # host:port of its MQTT-over-WebSocket listener, path /mqtt ("" when off)
    http: str = ""  # host:port of its HTTP bridge ("" when off)


_LOWEST_PORT = 10_000  # below: ports services commonly use


def _ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections (Linux's default 32768)."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text(encoding="ascii")
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free a moment ago on 127.0.0.1.

    Drawn at random below the kernel's ephemeral range: a port the kernel
    hands out itself (bind to port 0) could be taken as the local port of any
    outgoing connection while a node that was given it restarts, and random
    picks keep runs started side by side from choosing the same ports.
    """
    top = _ephemeral_start()
    if top - _LOWEST_PORT < 4 * n:  # no room below the range: ask the kernel
        return _kernel_ports(n)
    socks: list[socket.socket] = []
    rng = random.SystemRandom()
    try:
        while len(socks) < n:
            s = socket.socket()
            try:  # without SO_REUSEADDR: a port any socket holds is refused
                s.bind(("127.0.0.1", rng.randrange(_LOWEST_PORT, top)))
            except OSError:  # in use (or drawn twice): draw again
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _kernel_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tls_config(files: TLSFiles) -> TLSConfig:
    """Client TLS settings that present the certificate of `files` (a broker's or a client's)."""
    return TLSConfig(ca_file=str(files.ca), cert_file=str(files.cert), key_file=str(files.key))


class LocalFederation:
    """Starts, waits for and stops a federation of node processes.

    Args:
        federation: the federation file (endpoints are replaced).
        strategy: routing strategy for every node.
        workdir: where the generated federation file, logs and traces go.
        trace: write node message traces into `workdir`.
        extra_env: more GEOFED_* settings for every node.
        durable: give each broker the data directory ``workdir/<id>/data``
            (``GEOFED_DATA_DIR``), kept across restarts.
        links: put a fault proxy on every peer link (see `link`).
        tls: issue certificates from a throw-away CA in ``workdir/certs``
            (`geofed.node.issue_federation`) and run every broker with mutual
            TLS between brokers and TLS on its client port; clients get their
            settings from `client_tls`.
        client_auth: how brokers authenticate clients with `tls`: ``none``
            or ``cert`` (each client's certificate from `client_tls`).
        mqtt: give every broker an MQTT listener and an MQTT-over-WebSocket
            listener on free ports, written into the generated federation file as
            its ``mqtt_endpoint`` and ``mqtt_ws_endpoint`` (docs/mqtt.md).
        http: give every broker an HTTP bridge (REST, Server-Sent Events, the web map)
            on a free port, written into the federation file as its ``http_endpoint``.
    """

    def __init__(
        self,
        federation: str | Path,
        strategy: str,
        workdir: str | Path | None = None,
        *,
        trace: bool = False,
        extra_env: dict[str, str] | None = None,
        durable: bool = False,
        links: bool = False,
        tls: bool = False,
        client_auth: str = "none",
        mqtt: bool = True,
        http: bool = True,
    ) -> None:
        self.source = Federation.load(federation)
        self.strategy = strategy
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="geofed-")
        self.workdir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.trace = trace
        self.extra_env = extra_env or {}
        self.nodes: dict[str, LocalNode] = {}
        self.federation_path = self.workdir / "federation.geojson"
        self.federation: Federation = self.source
        self.durable = durable
        self._proxies = ProxyHost() if links else None
        self.tls = tls
        self.client_auth = client_auth
        self.mqtt = mqtt
        self.http = http
        self.certs_dir = self.workdir / "certs"
        self._health_tls: TLSConfig | None = None
        self._node_federation: dict[str, Path] = {}  # a broker's own copy, dialling via proxies
        self._barrier = Quiescence()
        self._barrier_broken = ""  # why `quiescent` cannot be used any more ("" : it can)
        self._paused: set[str] = set()

    def start(self, timeout: float = 60.0) -> LocalFederation:
        """Start every node and wait until all are healthy and linked."""
        ids = list(self.source.ids)
        n = 6  # client, peer, metrics, MQTT, MQTT over WebSocket, HTTP
        ports = free_ports(n * len(ids))
        endpoints = {
            bid: (f"127.0.0.1:{ports[n * i + 1]}", f"127.0.0.1:{ports[n * i]}")
            for i, bid in enumerate(ids)
        }
        fed = self.source.with_endpoints(endpoints)
        if self.mqtt or self.http:
            fed = Federation(
                [
                    dataclasses.replace(
                        b,
                        mqtt_endpoint=f"127.0.0.1:{ports[n * i + 3]}" if self.mqtt else "",
                        mqtt_ws_endpoint=f"127.0.0.1:{ports[n * i + 4]}" if self.mqtt else "",
                        http_endpoint=f"127.0.0.1:{ports[n * i + 5]}" if self.http else "",
                    )
                    for i, b in enumerate(fed.brokers)
                ]
            )
        self.federation = fed
        self.federation_path.write_text(json.dumps(self.federation.to_geojson()), encoding="utf-8")
        if self.tls:
            issue_federation(self.federation_path, self.certs_dir)
            # A broker's certificate serves as a client one too: health checks use the first.
            self._health_tls = tls_config(TLSFiles.in_dir(self.certs_dir / "brokers" / ids[0]))
        if self._proxies is not None:
            self._route_links_through(self._proxies)
        try:
            for i, bid in enumerate(ids):
                self.start_node(bid, metrics_port=ports[n * i + 2])
            self.wait_ready(timeout)
        except BaseException:  # `with` runs no __exit__ when __enter__ fails: stop them here
            self.stop()
            raise
        return self

    def _route_links_through(self, host: ProxyHost) -> None:
        """One proxy per broker pair; the dialling broker's file points the other at it."""
        ids = sorted(self.federation.ids)
        for i, dialler in enumerate(ids):
            dialled = {}
            for peer in ids[i + 1 :]:
                b = self.federation.broker(peer)
                proxy = host.add(f"{dialler}->{peer}", b.endpoint)
                dialled[peer] = (proxy.address, b.client_endpoint)
            path = self.workdir / f"federation-{dialler}.geojson"
            own = self.federation.with_endpoints(dialled)
            path.write_text(json.dumps(own.to_geojson()), encoding="utf-8")
            self._node_federation[dialler] = path

    def link(self, a: str, b: str) -> FaultProxy:
        """The fault proxy on the link between brokers `a` and `b` (needs ``links=True``)."""
        if self._proxies is None:
            raise GeofedError("this federation runs without link proxies (links=False)")
        return self._proxies.proxies["->".join(sorted((a, b)))]

    def client_tls(self, identity: str | None = None) -> TLSConfig | None:
        """TLS settings for a client of this federation (None without ``tls``).

        With an `identity`, a client certificate naming it is issued (once) in
        ``workdir/certs/clients/``; without, the client only verifies brokers.
        """
        if not self.tls:
            return None
        if identity is None:
            return TLSConfig(ca_file=str(self.certs_dir / "ca.pem"))
        folder = self.certs_dir / "clients" / urllib.parse.quote(identity, safe="")
        if not (folder / "cert.pem").exists():
            issue_client(CA.load(self.certs_dir), identity, folder)
        return tls_config(TLSFiles.in_dir(folder))

    def data_dir(self, broker_id: str) -> Path:
        """Where a durable broker keeps its state: ``workdir/<broker id>/data``."""
        return self.workdir / broker_id / "data"

    def start_node(
        self, broker_id: str, metrics_port: int | None = None, env: dict[str, str] | None = None
    ) -> LocalNode:
        """(Re)start the process of one broker on its ports; `env` overrides settings."""
        b = self.federation.broker(broker_id)
        old = self.nodes.get(broker_id)
        if metrics_port is None:
            assert old is not None
            metrics_port = int(old.metrics_url.rsplit(":", 1)[1].split("/")[0])
        extra = env or {}
        if old is not None and old.process.poll() is not None:
            self._set_aside(broker_id)
        federation = self._node_federation.get(broker_id, self.federation_path)
        env = dict(os.environ)
        env.update(
            {
                "GEOFED_BROKER_ID": broker_id,
                "GEOFED_FEDERATION": str(federation),
                "GEOFED_STRATEGY": self.strategy,
                "GEOFED_CLIENT_LISTEN": b.client_endpoint,
                "GEOFED_PEER_LISTEN": b.endpoint,
                "GEOFED_METRICS_LISTEN": f"127.0.0.1:{metrics_port}",
                "GEOFED_RECONNECT_MAX_S": "1.0",
            }
        )
        if b.mqtt_endpoint:
            env["GEOFED_MQTT_LISTEN"] = b.mqtt_endpoint
        if b.mqtt_ws_endpoint:
            env["GEOFED_MQTT_WS_LISTEN"] = b.mqtt_ws_endpoint
        if b.http_endpoint:
            env["GEOFED_HTTP_LISTEN"] = b.http_endpoint
        if self.tls:
            env["GEOFED_TLS_DIR"] = str(self.certs_dir / "brokers" / broker_id)
            env["GEOFED_CLIENT_AUTH"] = self.client_auth
        if self.durable:
            self.data_dir(broker_id).mkdir(parents=True, exist_ok=True)
            env["GEOFED_DATA_DIR"] = str(self.data_dir(broker_id))
        if self.trace:
            env["GEOFED_TRACE_PATH"] = str(self.workdir / f"trace-{broker_id}.jsonl")
        env.update(self.extra_env)
        env.update(extra)
        log_path = self.workdir / f"node-{broker_id}.log"
        log_file = log_path.open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "geofed.node"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log_file.close()
        node = LocalNode(
            broker_id,
            b.client_endpoint,
            b.endpoint,
            f"http://127.0.0.1:{metrics_port}/metrics",
            proc,
            log_path,
            b.mqtt_endpoint,
            b.mqtt_ws_endpoint,
            http=b.http_endpoint,
        )
        self.nodes[broker_id] = node
        return node

    def wait_ready(self, timeout: float = 60.0, ids: list[str] | None = None) -> None:
        """Wait until the nodes answer SERVING for the federation service (all links up)."""
        deadline = time.monotonic() + timeout
        for bid in ids or list(self.nodes):
            node = self.nodes[bid]
            while True:
                if node.process.poll() is not None:
                    raise GeofedError(
                        f"broker {bid} exited with {node.process.returncode}; "
                        f"log: {node.log_path}\n"
                        + node.log_path.read_text(errors="replace")[-2000:]
                    )
                if health_status(node.peer, FEDERATION_SERVICE, tls=self._health_tls) == "SERVING":
                    break
                if time.monotonic() > deadline:
                    raise GeofedError(
                        f"broker {bid} not ready after {timeout}s; log: {node.log_path}"
                    )
                time.sleep(0.05)

    def metrics_urls(self) -> dict[str, str]:
        """Each broker's /metrics URL by broker id (what `wait_quiescent` reads)."""
        return {b: n.metrics_url for b, n in self.nodes.items()}

    def total(self, name: str) -> float:
        """Metric `name` summed over every broker and every label (each must answer)."""
        return sum(metric(url, name) for url in self.metrics_urls().values())

    def sent(self) -> Counter[tuple[str, str, str]]:
        """Logical inter-broker messages sent so far by (kind, src, dst): what the cost model
        counts (control frames left out)."""
        counts = peer_message_counts(self.metrics_urls())["sent"]
        return Counter({k: int(v) for k, v in counts.items() if k[0] != Kind.CONTROL})

    def _live_urls(self) -> dict[str, str]:
        return {b: n.metrics_url for b, n in self.nodes.items() if n.process.poll() is None}

    async def quiescent(self, timeout: float = 60.0) -> None:
        """Barrier: every inter-broker message sent so far between the running brokers has
        been taken in by its peer (`Quiescence`, which holds across a restart of a broker
        with `stop_node` / `start_node`; a paused broker is waited for).

        Raises:
            GeofedError: still in flight after `timeout`, or a broker restarted while a peer
                was paused or unreachable, so its earlier traffic could not be set aside.
        """
        if self._barrier_broken:
            raise GeofedError(f"the quiescence barrier cannot be used: {self._barrier_broken}")
        await self._barrier.wait(self._live_urls(), timeout)

    def _set_aside(self, broker_id: str, timeout: float = 60.0) -> None:
        """Before `broker_id` starts again: once its running peers closed their links to
        its previous process, set their counts of that traffic aside (`Quiescence`)."""
        peers = {b: u for b, u in self._live_urls().items() if b != broker_id}
        if paused := sorted(self._paused & set(peers)):
            self._barrier_broken = f"{broker_id} restarted while {', '.join(paused)} was paused"
            return
        deadline = time.monotonic() + timeout
        try:
            while any(metric(u, PEER_CONNECTED, peer=broker_id) for u in peers.values()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"peers still linked to {broker_id} after {timeout}s")
                time.sleep(0.05)
            self._barrier.restarted(broker_id, peers)
        except OSError as exc:  # a peer's metrics did not answer (TimeoutError included)
            self._barrier_broken = f"{broker_id} restarted: {exc}"

    def stop_node(self, broker_id: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Stop one broker's process (SIGTERM: graceful; SIGKILL: crash)."""
        proc = self.nodes[broker_id].process
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def pause_node(self, broker_id: str) -> None:
        """Freeze one broker (SIGSTOP): its sockets stay open, it answers nothing."""
        self.nodes[broker_id].process.send_signal(signal.SIGSTOP)
        self._paused.add(broker_id)

    def resume_node(self, broker_id: str) -> None:
        """Let a frozen broker continue (SIGCONT)."""
        self.nodes[broker_id].process.send_signal(signal.SIGCONT)
        self._paused.discard(broker_id)

    def stop(self) -> None:
        """Stop every node (idempotent); a frozen one is let go first."""
        for node in self.nodes.values():
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGCONT)
                node.process.send_signal(signal.SIGTERM)
        for bid in self.nodes:
            self.stop_node(bid)
        if self._proxies is not None:
            self._proxies.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalFederation:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
