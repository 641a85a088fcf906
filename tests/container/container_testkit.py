"""Running the broker image as a federation of containers (used by the container tests).

`ContainerFederation` runs one container per broker on a Docker network of its
own, with the environment the Kubernetes manifests give the pods
(`geofed.k8s.container_env`), a read-only root filesystem, no
capabilities, and ports published on 127.0.0.1 only.
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

from geofed.bench import free_ports
from geofed.client import health_status
from geofed.k8s import CLIENT_PORT, METRICS_PORT, PEER_PORT, container_env, slug
from geofed.routing import Federation
from geofed.wire import FEDERATION_SERVICE

TEST_LABEL = "org.geofed.test"


class ContainerFederation:
    """One broker container per broker of `source`, on a fresh Docker network.

    Inside the network a broker is ``geofed-<slug>:7401`` (peer endpoint in
    the federation file); from the host its client and metrics ports are on
    127.0.0.1, and the client endpoint in the federation file is that
    address, so redirects point where a test client can connect.
    """

    def __init__(
        self, image: str, source: Federation, strategy: str, workdir: Path, docker_client: Any
    ) -> None:
        self.image = image
        self.strategy = strategy
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
        self.network = Network(docker_network_kw={"labels": {TEST_LABEL: self.run_id}})
        self.containers: dict[str, DockerContainer] = {}

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
            broker_id, strategy=self.strategy, federation="/etc/geofed/federation.geojson"
        )
        c = (
            DockerContainer(self.image)
            .with_name(f"geofed-{slug(broker_id)}-{self.run_id}")
            .with_network(self.network)
            .with_network_aliases(f"geofed-{slug(broker_id)}")
            .with_envs(**env)
            .with_volume_mapping(str(self.federation_file), "/etc/geofed/federation.geojson", "ro")
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

    # -- one broker ----------------------------------------------------------------

    def client(self, broker_id: str) -> str:
        return f"127.0.0.1:{self.client_ports[broker_id]}"

    def metrics_url(self, broker_id: str) -> str:
        return f"http://127.0.0.1:{self.metrics_ports[broker_id]}/metrics"

    def wrapped(self, broker_id: str) -> Any:
        return self.containers[broker_id].get_wrapped_container()

    def stop_broker(self, broker_id: str, timeout: int = 30) -> int:
        """`docker stop` (SIGTERM, then SIGKILL after `timeout`); returns the exit code."""
        c = self.wrapped(broker_id)
        c.stop(timeout=timeout)
        c.reload()
        return int(c.attrs["State"]["ExitCode"])

    def start_broker(self, broker_id: str) -> None:
        """Start a stopped broker's container again (same name, ports, network alias)."""
        self.wrapped(broker_id).start()

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
            if line.startswith(("geofed_peer_connected", "geofed_peer_queue_length"))
        ]

    def docker_health(self, broker_id: str) -> str:
        c = self.wrapped(broker_id)
        c.reload()
        health = c.attrs["State"].get("Health") or {}
        return str(health.get("Status", "none"))

    # -- waiting ---------------------------------------------------------------------

    def wait_linked(self, timeout: float = 180.0, ids: list[str] | None = None) -> None:
        """Until every broker (or `ids`) is SERVING and all its peer links are up."""
        deadline = time.monotonic() + timeout
        for bid in ids or list(self.containers):
            while health_status(self.client(bid), FEDERATION_SERVICE) != "SERVING":
                c = self.wrapped(bid)
                c.reload()
                if c.status == "exited":
                    raise AssertionError(f"broker {bid} exited:\n{self.logs(bid)}")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"broker {bid} not linked after {timeout}s "
                        f"(client health {health_status(self.client(bid))}):\n{self.logs(bid)}"
                    )
                time.sleep(0.2)


def start_federation(
    image: str,
    source: Federation,
    strategy: str,
    workdir: Path,
    docker_client: Any,
) -> Iterator[ContainerFederation]:
    """Start a container federation, yield it, always remove it (logs go to stdout)."""
    fed = ContainerFederation(image, source, strategy, workdir, docker_client)
    try:
        fed.start()
        yield fed
    finally:
        for bid in list(fed.containers):
            print(f"--- logs of broker {bid} ({strategy}) ---\n{fed.logs(bid)}")
        fed.close()
