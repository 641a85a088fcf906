"""Where each broker is reached: in-cluster Service names, or addresses the user gives."""

from __future__ import annotations

from dataclasses import dataclass

from geofed.node import CLIENT_PORT, PEER_PORT
from geofed.routing import Federation, InvalidInput

from .manifests import CLIENT_SVC, PEER_SVC, slug


@dataclass(frozen=True)
class Endpoints:
    """Where a broker is reached: its peer (federation) and client ``host:port``."""

    peer: str
    client: str


def in_cluster_endpoints(
    federation: Federation, namespace: str, cluster_domain: str = "cluster.local"
) -> dict[str, Endpoints]:
    """The in-cluster DNS names of every broker's Services."""
    out = {}
    for b in federation:
        s = slug(b.id)
        out[b.id] = Endpoints(
            peer=f"{PEER_SVC}-{s}.{namespace}.svc.{cluster_domain}:{PEER_PORT}",
            client=f"{CLIENT_SVC}-{s}.{namespace}.svc.{cluster_domain}:{CLIENT_PORT}",
        )
    return out


def _check_host_port(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise InvalidInput(where, "must be a 'host:port' string")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(where, f"must be 'host:port', got {value!r}")
    return value


def parse_endpoints(
    obj: object, federation: Federation, source: str = "endpoints"
) -> dict[str, dict[str, str]]:
    """Validate ``{id: {"endpoint": "host:port", "client_endpoint": "host:port"}}``.

    Either field may be left out (the in-cluster name is kept for it).

    Raises:
        InvalidInput: naming the entry that is wrong.
    """
    if not isinstance(obj, dict):
        raise InvalidInput(source, 'must be a JSON object {"<broker id>": {"endpoint": ...}}')
    out: dict[str, dict[str, str]] = {}
    for broker_id, entry in obj.items():
        where = f"{source}.{broker_id}"
        if broker_id not in federation:
            raise InvalidInput(where, "not a broker of the federation")
        if not isinstance(entry, dict):
            raise InvalidInput(where, 'must be an object with "endpoint" and/or "client_endpoint"')
        unknown = set(entry) - {"endpoint", "client_endpoint"}
        if unknown:
            raise InvalidInput(f"{where}.{min(unknown)}", "unknown field")
        out[broker_id] = {k: _check_host_port(v, f"{where}.{k}") for k, v in entry.items()}
    return out
