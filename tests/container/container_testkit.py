"""Running the broker image as a federation of containers (used by the container tests).

`ContainerFederation` runs one container per broker on a Docker network of its
own, with the environment the Kubernetes manifests give the pods with TLS
(`geofed.k8s.container_env`), a read-only root filesystem, no
capabilities, and ports published on 127.0.0.1 only. Brokers talk mutual
TLS to each other and TLS to clients, with certificates issued when the
federation is made (`geofed.node.issue_federation`, as `geofed certs` does)
and each broker's folder mounted where the pods mount their Secret. Tests
wait on the brokers' state, never for a while: gRPC health (`wait_linked`),
and the brokers' metrics (`quiescent`, `deliveries_counted`). A durable
federation (`durable=True`) keeps each broker's store on a Docker volume of
its own at `geofed.k8s.DATA_DIR`, as the manifests do with a claim, so it
outlives the broker's process (`kill_broker`, `start_broker`).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

from geofed.bench import Quiescence, free_ports, metric
from geofed.client import TLSConfig, health_status
from geofed.k8s import DATA_DIR, FEDERATION_DIR, FEDERATION_FILE, TLS_DIR, container_env, slug
from geofed.node import (
    CLIENT_PORT,
    DELIVERIES,
    METRICS_PORT,
    PEER_CONNECTED,
    PEER_PORT,
    PEER_QUEUE_LENGTH,
    TLSFiles,
    issue_federation,
)
from geofed.routing import Federation
from geofed.wire import FEDERATION_SERVICE

TEST_LABEL = "org.geofed.test"
PORT_ATTEMPTS = 3
FEDERATION_PATH = f"{FEDERATION_DIR}/{FEDERATION_FILE}"  # where the pods have it too
STORE_MAX_BYTES = 256 * 1024 * 1024  # a durable broker's store limit (tests: small)

"""(message kind, sending broker, receiving broker)."""


class ContainerFederation:
    """One broker container per broker of `source`, on a fresh Docker network.

    Inside the network a broker is ``geofed-<slug>:7401`` (peer endpoint in
    the federation file); from the host its client and metrics ports are on
    127.0.0.1, and the client endpoint in the federation file is that
    address, so redirects point where a test client can connect. Clients
    verify the brokers with `client_tls` (the CA of ``workdir/pki``).
    """

    def __init__(
        self,
        image: str,
        source: Federation,
        strategy: str,
        workdir: Path,
        docker_client: Any,
        durable: bool = False,
    ) -> None:
        self.image = image
        self.strategy = strategy
        self.durable = durable
        self.workdir = workdir
        self.docker = docker_client
        self.run_id = uuid.uuid4().hex[:8]
        ports = free_ports(2 * len(source))
        self.client_ports = {b.id: ports[2 * i] for i, b in enumerate(source)}
        self.metrics_ports = {b.id: ports[2 * i + 1] for i, b in enumerate(source)}
        self.federation = source.with_endpoints(
            {
                b.id: (f"geofed-{slug(b.id)}:{PEER_PORT}", f"127.0.0.1:{self.client_ports[b.id]}")
                for b in source
            }
        )
        self.federation_file = workdir / "federation.geojson"
        self.federation_file.write_text(json.dumps(self.federation.to_geojson()), encoding="utf-8")
        self.federation_file.chmod(0o644)  # read by the container's non-root user
        # A CA and a certificate per broker, made for this run (never kept).
        self.pki = workdir / "pki"
        issue_federation(self.federation_file, self.pki)
        for folder in (self.pki / "brokers").iterdir():
            # The container's user (uid 10001) reads its broker's key: this
            # run's throw-away key, in the test's own temporary folder.
            folder.chmod(0o755)
            for f in folder.iterdir():
                f.chmod(0o644)
        self.client_tls = TLSConfig(ca_file=str(TLSFiles.in_dir(self.pki).ca))
        self.network = Network(docker_network_kw={"labels": {TEST_LABEL: self.run_id}})
        self.containers: dict[str, DockerContainer] = {}
        self.down: set[str] = set()
        # The quiescence barrier; it sets aside the traffic of a restarted broker's
        # earlier process (see `start_broker`).
        self._barrier = Quiescence()

    # -- lifecycle ---------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> ContainerFederation:
        self.network.create()
        for b in self.federation:
            # Registered before starting, so that close() removes it even then.
            self.containers[b.id] = c = self._container(b.id)
            c.start()
        self.wait_linked(timeout)
        return self

    def _container(self, broker_id: str) -> DockerContainer:
        env = container_env(
            broker_id,
            strategy=self.strategy,
            federation=FEDERATION_PATH,
            tls=True,
            store_max_bytes=STORE_MAX_BYTES if self.durable else 0,
        )
        c = (
            DockerContainer(self.image)
            .with_name(f"geofed-{slug(broker_id)}-{self.run_id}")
            .with_network(self.network)
            .with_network_aliases(f"geofed-{slug(broker_id)}")
            .with_envs(**env)
            .with_volume_mapping(str(self.federation_file), FEDERATION_PATH, "ro")
            # Where the pods mount their broker's Secret.
            .with_volume_mapping(str(self.pki / "brokers" / broker_id), TLS_DIR, "ro")
            # Docker wants tmpfs options, not a bare size.
            .with_tmpfs_mount("/tmp", "size=64m")
            # The pod's securityContext: read-only root, no privileges.
            .with_kwargs(
                read_only=True,
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                labels={TEST_LABEL: self.run_id},
            )
        )
        if self.durable:
            volume = self.docker.volumes.create(
                self.volume(broker_id), labels={TEST_LABEL: self.run_id}
            )
            c.with_volume_mapping(volume.name, DATA_DIR, "rw")
        # Published on loopback only: tests talk to 127.0.0.1, nothing else.
        c.ports[f"{CLIENT_PORT}/tcp"] = ("127.0.0.1", self.client_ports[broker_id])  # type: ignore[assignment]
        c.ports[f"{METRICS_PORT}/tcp"] = ("127.0.0.1", self.metrics_ports[broker_id])  # type: ignore[assignment]
        return c

    def close(self) -> None:
        for c in self.containers.values():
            with contextlib.suppress(docker.errors.NotFound):
                c.stop()
        self.containers.clear()
        # The network was never created, or is already gone.
        with contextlib.suppress(AssertionError, docker.errors.NotFound):
            self.network.remove()
        for v in self.docker.volumes.list(filters={"label": f"{TEST_LABEL}={self.run_id}"}):
            v.remove(force=True)

    def volume(self, broker_id: str) -> str:
        """The Docker volume of a durable broker's store."""
        return f"geofed-data-{slug(broker_id)}-{self.run_id}"

    # -- one broker ----------------------------------------------------------------

    def client(self, broker_id: str) -> str:
        return f"127.0.0.1:{self.client_ports[broker_id]}"

    def health(self, broker_id: str, service: str = "") -> str:
        """The gRPC health status of `service` at the broker's client port (over TLS)."""
        return health_status(self.client(broker_id), service, tls=self.client_tls)

    def metrics_url(self, broker_id: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[broker_id]}/metrics"

    def wrapped(self, broker_id: str) -> Any:
        return self.containers[broker_id].get_wrapped_container()

    @property
    def live(self) -> list[str]:
        """The brokers whose containers run (not stopped with `stop_broker`)."""
        return [b for b in self.containers if b not in self.down]

    def metrics_urls(self) -> dict[str, str]:
        """The /metrics URL of every live broker."""
        return {b: self.metrics_url(b) for b in self.live}

    def stop_broker(self, broker_id: str, timeout: int = 30) -> int:
        """`docker stop` (SIGTERM, then SIGKILL after `timeout`); returns the exit code."""
        c = self.wrapped(broker_id)
        self.down.add(broker_id)
        c.stop(timeout=timeout)
        c.reload()
        return int(c.attrs["State"]["ExitCode"])

    def kill_broker(self, broker_id: str) -> None:
        """`docker kill` (SIGKILL): the broker crashes, nothing flushed on the way out."""
        c = self.wrapped(broker_id)
        self.down.add(broker_id)
        c.kill()
        c.reload()

    def start_broker(self, broker_id: str, timeout: float = 60.0) -> None:
        """Start a stopped broker's container again (same name, ports, network alias).

        The new process counts its messages from zero while its peers keep
        their counts, so once every live peer has closed its link to the old
        process (nothing more can then be sent to or received from it), the
        peers' counts of the links to and from it are set aside as earlier
        traffic (`Quiescence.restarted`).
        """
        assert broker_id in self.down, f"broker {broker_id} is not stopped"
        deadline = time.monotonic() + timeout
        peers = self.live
        while connected := [
            b for b in peers if metric(self.metrics_url(b), PEER_CONNECTED, peer=broker_id)
        ]:
            assert time.monotonic() < deadline, f"{connected} still linked to stopped {broker_id}"
            time.sleep(0.1)
        self._barrier.restarted(broker_id, self.metrics_urls())
        self.wrapped(broker_id).start()
        self.down.discard(broker_id)

    def logs(self, broker_id: str, tail: int = 200) -> str:
        try:
            data: bytes = self.wrapped(broker_id).logs(tail=tail)
        except docker.errors.NotFound:
            return "(container gone)"
        return data.decode(errors="replace")

    def peer_gauges(self, broker_id: str) -> list[str]:
        """The broker's peer link gauges (connected, queued), for failure messages."""
        try:
            with urllib.request.urlopen(self.metrics_url(broker_id), timeout=5) as resp:
                text = resp.read().decode()
        except OSError as exc:
            return [f"metrics unreachable: {exc}"]
        return [
            line
            for line in text.splitlines()
            if line.startswith((PEER_CONNECTED, PEER_QUEUE_LENGTH))
        ]

    def docker_health(self, broker_id: str) -> str:
        c = self.wrapped(broker_id)
        c.reload()
        health = c.attrs["State"].get("Health") or {}
        return str(health.get("Status", "none"))

    # -- waiting on the brokers' state ------------------------------------------------

    async def quiescent(self, timeout: float = 30.0) -> None:
        """Barrier: every inter-broker message sent between the live brokers has been
        received (`geofed.bench.Quiescence`, which holds across `start_broker`)."""
        await self._barrier.wait(self.metrics_urls(), timeout)

    def deliveries_counted(self) -> float:
        """Deliveries the live brokers have handed to their subscribers' streams, in total."""
        return sum(metric(url, DELIVERIES) for url in self.metrics_urls().values())

    def wait_linked(self, timeout: float = 180.0, ids: list[str] | None = None) -> None:
        """Until every broker (or `ids`) is SERVING and all its peer links are up."""
        deadline = time.monotonic() + timeout
        for bid in ids or self.live:
            while self.health(bid, FEDERATION_SERVICE) != "SERVING":
                c = self.wrapped(bid)
                c.reload()
                if c.status == "exited":
                    raise AssertionError(f"broker {bid} exited:\n{self.logs(bid)}")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"broker {bid} not linked after {timeout}s "
                        f"(client health {self.health(bid)}):\n{self.logs(bid)}"
                    )
                time.sleep(0.2)


def start_federation(
    image: str,
    source: Federation,
    strategy: str,
    workdir: Path,
    docker_client: Any,
    durable: bool = False,
) -> Iterator[ContainerFederation]:
    """Start a container federation, yield it, always remove it (logs go to stdout).

    The host ports are picked free before the containers start; when another
    process takes one meanwhile (Docker: "address already in use"), the
    federation is made again on other ports, up to `PORT_ATTEMPTS` times.
    """
    fed = ContainerFederation(image, source, strategy, workdir, docker_client, durable)
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                fed.start()
                break
            except docker.errors.APIError as exc:
                if "address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                    raise
                print(f"a published port was taken ({exc}); new ports, attempt {attempt + 1}")
                fed.close()
                fed = ContainerFederation(image, source, strategy, workdir, docker_client, durable)
        yield fed
    finally:
        for bid in list(fed.containers):
            print(f"--- logs of broker {bid} ({strategy}) ---\n{fed.logs(bid)}")
        fed.close()
