"""`render`: check the arguments, resolve endpoints, write the kustomize tree.

The objects come from `geofed.k8s.manifests`, their YAML from
`geofed.k8s.yamlout`; this module decides which files go where and writes
each overlay's federation file.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.node import METRICS_PORT, broker_dns_name
from geofed.routing import STRATEGIES, Federation, InvalidInput

from .endpoints import Endpoints, in_cluster_endpoints
from .manifests import (
    CLIENT_SVC,
    DEFAULT_RELEASE,
    DEFAULT_TLS_SECRET,
    DNS_LABEL,
    FEDERATION_FILE,
    FRONT_END_ENDPOINTS,
    FRONT_ENDS,
    PEER_SVC,
    PodOptions,
    base_manifests,
    certificate,
    image_entry,
    overlay_kustomization,
    overlay_patches,
    parse_issuer,
    podmonitor_component,
    slug,
    tls_secret_name,
    top_kustomization,
)
from .yamlout import dump_yaml

OUTPUTS = ("kustomization.yaml", "base", "components", "overlays")
"""What a render writes under its output directory; ``--force`` replaces exactly these."""

_DNS_DOMAIN = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")


@dataclass
class RenderResult:
    """What `render` wrote.

    Attributes:
        out: the output directory.
        overlays: broker id -> its overlay directory.
        endpoints: broker id -> the endpoints written into the federation file.
        single_cluster: True when every peer endpoint is an in-cluster name
            (``OUT/kustomization.yaml`` then deploys the whole federation).
        warnings: things the user should know about the result.
    """

    out: Path
    overlays: dict[str, Path]
    endpoints: dict[str, Endpoints]
    single_cluster: bool
    warnings: list[str] = field(default_factory=list)


def render(
    federation: Federation | str | Path,
    image: str,
    out: str | Path,
    *,
    namespace: str = "geofed",
    endpoints: Mapping[str, Mapping[str, str]] | None = None,
    strategy: str = "event-geofence",
    cluster_domain: str = "cluster.local",
    peer_cidrs: Sequence[str] = (),
    monitoring_namespace: str = "monitoring",
    podmonitor: bool = False,
    release: str = DEFAULT_RELEASE,
    tls: bool = False,
    tls_secret: str = DEFAULT_TLS_SECRET,
    cert_manager: str | None = None,
    metrics_listen: str = f"0.0.0.0:{METRICS_PORT}",
    data_size: str = "",
    storage_class: str = "",
    front_ends: Sequence[str] = (),
    force: bool = False,
) -> RenderResult:
    """Write the kustomize tree for `federation` into `out`.

    Args:
        federation: the federation file, or a loaded federation. From a file,
            each feature is copied as it is, with only its endpoints replaced,
            so the rendered file has the same areas (and digest, which peers
            compare on connecting) as the source.
        image: the broker image reference (``name[:tag]`` or ``name@digest``).
        out: output directory; must be empty or absent unless `force`.
        namespace: namespace of every object, part of the in-cluster names.
        endpoints: per broker id, external ``endpoint`` / ``client_endpoint``
            (`parse_endpoints`); missing ones are the in-cluster names.
        strategy: the routing strategy (the same on every broker).
        cluster_domain: the cluster's DNS domain.
        peer_cidrs: networks other clusters' brokers connect from (NetworkPolicy).
        monitoring_namespace: the namespace whose pods may scrape /metrics.
        podmonitor: also deploy a Prometheus-operator PodMonitor.
        release: this render's name, carried by its broker pods in the label
            that admits them to each other's peer port.
        tls: mutual TLS between brokers and TLS for clients, from one Secret
            per broker (``ca.pem``, ``cert.pem``, ``key.pem``); reflection off.
            Every broker id must then be a lowercase DNS name.
        tls_secret: the Secrets' names, ``{broker}`` standing for the broker's
            Kubernetes name (`slug`).
        cert_manager: ``NAME`` of an Issuer or ``ClusterIssuer/NAME``: a
            cert-manager Certificate per broker fills its Secret (needs `tls`).
        metrics_listen: where the node serves /metrics: ``0.0.0.0:PORT`` (a
            scrape target) or ``127.0.0.1:PORT`` (inside the pod only).
        data_size: durable brokers: a PersistentVolumeClaim of this size per
            broker (``10Gi``) for the node's store (`PodOptions`); empty: state
            in memory.
        storage_class: the claims' StorageClass (default: the cluster's).
        front_ends: client front ends besides gRPC (`FRONT_ENDS`: ``mqtt``,
            ``mqtt-ws``, ``http``), each on the client Service at its port and
            in the federation file (``mqtt_endpoint``, ...) at the client
            endpoint's host.
        force: replace a previous render's files in `out`.

    Raises:
        InvalidInput: for a bad argument, naming it; when peers reach each
            other from outside the cluster without `peer_cidrs` or `tls`
            (field ``peer_cidr``).
    """
    source: dict[str, Any] | None = None
    if not isinstance(federation, Federation):
        source, federation = _read_federation(Path(federation))
    if strategy not in STRATEGIES:
        raise InvalidInput("strategy", f"unknown {strategy!r}; one of {', '.join(STRATEGIES)}")
    if not DNS_LABEL.fullmatch(namespace) or len(namespace) > 63:
        raise InvalidInput("namespace", f"not a valid Kubernetes namespace: {namespace!r}")
    if not _DNS_DOMAIN.fullmatch(cluster_domain):
        raise InvalidInput("cluster_domain", f"not a DNS domain: {cluster_domain!r}")
    image_ref = image_entry(image)
    for cidr in peer_cidrs:
        _check_cidr(cidr)
    if (tls_secret != DEFAULT_TLS_SECRET) and not tls:
        raise InvalidInput("tls_secret", "TLS Secrets need --tls")
    options = PodOptions(
        release=release,
        tls=tls,
        cert_manager=cert_manager is not None,
        metrics_listen=metrics_listen,
        monitoring_namespace=monitoring_namespace,
        data_size=data_size,
        storage_class=storage_class,
        front_ends=tuple(dict.fromkeys(front_ends)),
    )
    if podmonitor and not options.metrics_exposed:
        raise InvalidInput(
            "podmonitor", f"metrics listen on the pod's loopback ({metrics_listen}): no scraping"
        )
    issuer = parse_issuer(cert_manager) if cert_manager is not None else None
    slugs = [slug(b.id) for b in federation]
    if len(set(slugs)) != len(slugs):
        raise InvalidInput("federation", "two broker ids map to the same Kubernetes name")
    secrets: dict[str, str] = {}
    if tls:
        for b in federation:
            _check_tls_id(b.id)
        secrets = {b.id: tls_secret_name(tls_secret, b.id) for b in federation}
        if len(set(secrets.values())) != len(secrets):
            raise InvalidInput("tls_secret", f"{tls_secret!r} gives two brokers one Secret")

    defaults = in_cluster_endpoints(federation, namespace, cluster_domain)
    given = dict(endpoints or {})
    resolved: dict[str, Endpoints] = {}
    for b in federation:
        entry = given.get(b.id, {})
        resolved[b.id] = Endpoints(
            peer=entry.get("endpoint", defaults[b.id].peer),
            client=entry.get("client_endpoint", defaults[b.id].client),
        )
    external_peer = {bid for bid, e in resolved.items() if e.peer != defaults[bid].peer}
    external_client = {bid for bid, e in resolved.items() if e.client != defaults[bid].client}
    single_cluster = not external_peer
    warnings: list[str] = []
    if external_peer and len(external_peer) < len(resolved):
        inside = sorted(set(resolved) - external_peer)
        warnings.append(
            f"brokers {', '.join(inside)} keep in-cluster peer endpoints, which brokers in "
            "other clusters cannot resolve; give an external endpoint for every broker"
        )
    cidrs = list(peer_cidrs)
    if external_peer and not cidrs:
        if not tls:
            raise InvalidInput(
                "peer_cidr",
                "the peers reach each other from outside the cluster: give the networks the "
                "other clusters' brokers connect from (--peer-cidr), or turn on mutual TLS "
                "(--tls) to expose the peer port to any address",
            )
        # Mutual TLS only: any address may try, only the federation's brokers get in.
        cidrs = ["0.0.0.0/0", "::/0"]
    fed_text = _federation_text(federation, source, resolved, options.front_ends)
    root = Path(out)
    _prepare(root, force)
    _write_tree(root / "base", base_manifests(options))
    _write_tree(root / "components" / "podmonitor", podmonitor_component(options))
    overlays: dict[str, Path] = {}
    for b in federation:
        # One cluster: the PodMonitor is added once, at the top.
        kustomization = overlay_kustomization(
            b.id,
            namespace,
            image_ref,
            podmonitor=podmonitor and not single_cluster,
            certificate=issuer is not None,
        )
        patches = overlay_patches(
            b.id,
            strategy,
            external_peer=b.id in external_peer,
            external_client=b.id in external_client,
            peer_cidrs=cidrs if b.id in external_peer else (),
            options=options,
            tls_secret=secrets.get(b.id, ""),
        )
        files: dict[str, Any] = {"kustomization.yaml": kustomization, "broker-patch.yaml": patches}
        if issuer is not None:
            hosts = _service_names(b.id, namespace, cluster_domain) + [
                _host(e) for e in (resolved[b.id].peer, resolved[b.id].client)
            ]
            files["certificate.yaml"] = certificate(b.id, secrets[b.id], hosts, issuer)
        d = root / "overlays" / slug(b.id)
        _write_tree(d, files)
        (d / FEDERATION_FILE).write_text(fed_text + "\n", encoding="utf-8")
        overlays[b.id] = d
    if single_cluster:
        top = top_kustomization(federation.ids, namespace, podmonitor=podmonitor)
        _write_tree(root, {"kustomization.yaml": top})
    return RenderResult(root, overlays, resolved, single_cluster, warnings)


def _read_federation(path: Path) -> tuple[dict[str, Any], Federation]:
    federation = Federation.load(path)  # validates, naming the file and field
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return raw, federation


def _federation_text(
    federation: Federation,
    source: dict[str, Any] | None,
    endpoints: Mapping[str, Endpoints],
    front_ends: Sequence[str] = (),
) -> str:
    """The federation file every broker of this render loads.

    Each front end is reached on the client Service, so at the client endpoint's host.
    """

    def front(bid: str) -> dict[str, str]:
        host = endpoints[bid].client.rpartition(":")[0]  # with an IPv6 address's brackets
        return {FRONT_END_ENDPOINTS[f]: f"{host}:{FRONT_ENDS[f]}" for f in front_ends}

    if source is not None:
        doc = copy.deepcopy(source)
        for feature in doc["features"]:
            props = feature["properties"]
            props["endpoint"] = endpoints[props["id"]].peer
            props["client_endpoint"] = endpoints[props["id"]].client
            props.update(front(props["id"]))
    else:
        pairs = {bid: (e.peer, e.client) for bid, e in endpoints.items()}
        doc = federation.with_endpoints(pairs).to_geojson()
        for feature in doc["features"]:
            feature["properties"].update(front(feature["properties"]["id"]))
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    rendered = Federation.from_geojson(json.loads(text), source="rendered federation")
    if source is not None and rendered.digest != federation.digest:
        raise AssertionError("the rendered federation file changed the broker areas")
    return text


def _check_tls_id(broker_id: str) -> None:
    try:
        broker_dns_name(broker_id)
    except InvalidInput as exc:
        raise InvalidInput(f"federation broker {broker_id!r}", exc.reason) from None


def _service_names(broker_id: str, namespace: str, cluster_domain: str) -> list[str]:
    """Every name a pod of the cluster may use for the broker's Services."""
    names = []
    for svc in (CLIENT_SVC, PEER_SVC):
        short = f"{svc}-{slug(broker_id)}"
        svc_ns = f"{short}.{namespace}.svc"
        names += [short, f"{short}.{namespace}", svc_ns, f"{svc_ns}.{cluster_domain}"]
    return names


def _host(endpoint: str) -> str:
    return endpoint.rpartition(":")[0].strip("[]")


def _check_cidr(cidr: str) -> None:
    try:
        ipaddress.ip_network(cidr)
    except ValueError as exc:
        raise InvalidInput("peer_cidr", str(exc)) from None


def _prepare(root: Path, force: bool) -> None:
    if root.exists() and not root.is_dir():
        raise InvalidInput("out", f"{root} exists and is not a directory")
    if root.is_dir():
        ours = [root / name for name in OUTPUTS if (root / name).exists()]
        if ours and not force:
            raise InvalidInput(
                "out", f"{root} already holds a render ({ours[0].name}); pass --force to replace it"
            )
        for p in ours:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
    root.mkdir(parents=True, exist_ok=True)


def _write_tree(directory: Path, files: Mapping[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, obj in files.items():
        docs = obj if isinstance(obj, list) else [obj]
        (directory / name).write_text(dump_yaml(*docs), encoding="utf-8")
