"""``geofed k8s render``: Kubernetes manifests for a federation.

Writes a kustomize tree::

    OUT/kustomization.yaml          all brokers at once (only when they share one cluster)
    OUT/base/                       one broker: Deployment, two Services, PDB, NetworkPolicy
    OUT/components/podmonitor/      optional Prometheus-operator PodMonitor
    OUT/overlays/<broker>/          one per broker: its id, name suffix, federation file

The base is the same for every federation (``k8s/base`` in the repository is
this module's output). Each overlay names its objects ``<base name>-<broker>``,
selects only its own broker's pod, and carries the federation file in a
generated ConfigMap, with peer endpoints that are either the in-cluster DNS
names of the peer Services (all brokers in one cluster) or the external
addresses given with ``--endpoints`` (one cluster per region).

The node reads its settings from ``GEOFED_*`` variables (`container_env`); the
container tests run the image with exactly these. Manifests are written as
YAML by a small emitter (`dump_yaml`) so that PyYAML is not a runtime
dependency.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.routing import Federation, InvalidInput, federation_path

CLIENT_PORT = 7400
PEER_PORT = 7401
METRICS_PORT = 9400
PORTS = {"grpc-client": CLIENT_PORT, "grpc-peer": PEER_PORT, "metrics": METRICS_PORT}
CLIENT_SERVICE = "geofed.v1.ClientService"
FEDERATION_DIR = "/etc/geofed"
FEDERATION_FILE = "federation.geojson"
IMAGE_NAME = "geofed"  # the base's image name; overlays replace it with --image
RUN_AS = 10001  # the image's non-root uid and gid (deploy/Dockerfile)
BROKER_LABEL = "geofed.io/broker"
BROKER_ID_ANNOTATION = "geofed.io/broker-id"
SCRAPER_LABEL = "geofed.io/metrics-scraper"
SELECTOR: dict[str, str] = {
    "app.kubernetes.io/name": "geofed",
    "app.kubernetes.io/component": "broker",
}
LABELS: dict[str, str] = {**SELECTOR, "app.kubernetes.io/part-of": "geofed"}
DEPLOYMENT = "geofed-broker"
CLIENT_SVC = "geofed-client"
PEER_SVC = "geofed-peer"
CONFIGMAP = "geofed-federation"
PODMONITOR = "geofed-brokers"
# Render outputs under OUT; `--force` replaces exactly these.
OUTPUTS = ("kustomization.yaml", "base", "components", "overlays")

_KUSTOMIZE_API = "kustomize.config.k8s.io/v1beta1"
_MAX_SLUG = 40  # "geofed-client-" + slug must stay a DNS label (63)
_SLUG_OK = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
_IMAGE_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")


# --- the node's settings -------------------------------------------------------


def container_env(
    broker_id: str,
    *,
    strategy: str = "event-geofence",
    federation: str = f"{FEDERATION_DIR}/{FEDERATION_FILE}",
    log_level: str = "info",
) -> dict[str, str]:
    """The ``GEOFED_*`` variables a broker container runs with (manifests and tests)."""
    return {
        "GEOFED_BROKER_ID": broker_id,
        "GEOFED_FEDERATION": federation,
        "GEOFED_STRATEGY": strategy,
        "GEOFED_CLIENT_LISTEN": f"0.0.0.0:{CLIENT_PORT}",
        "GEOFED_PEER_LISTEN": f"0.0.0.0:{PEER_PORT}",
        "GEOFED_METRICS_LISTEN": f"0.0.0.0:{METRICS_PORT}",
        "GEOFED_LOG_LEVEL": log_level,
    }


def slug(broker_id: str) -> str:
    """The Kubernetes name part for a broker id (a DNS label, unique per id).

    Ids that are already short lowercase DNS labels are kept; others are
    lowercased, stripped to ``[a-z0-9-]`` and suffixed with a hash of the id.
    """
    if len(broker_id) <= _MAX_SLUG and _SLUG_OK.fullmatch(broker_id):
        return broker_id
    clean = re.sub(r"[^a-z0-9]+", "-", broker_id.lower()).strip("-")[: _MAX_SLUG - 8].strip("-")
    digest = hashlib.sha256(broker_id.encode()).hexdigest()[:7]
    return f"{clean}-{digest}" if clean else f"b-{digest}"


# --- the base -----------------------------------------------------------------


def _grpc_probe(service: str, period: int, failures: int) -> dict[str, Any]:
    grpc: dict[str, Any] = {"port": CLIENT_PORT}
    if service:
        grpc["service"] = service
    return {
        "grpc": grpc,
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _deployment() -> dict[str, Any]:
    env = container_env("")
    del env["GEOFED_BROKER_ID"]  # set by each overlay
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "labels": dict(LABELS)},
        "spec": {
            # One broker per id: never two pods with the same id at once.
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": dict(SELECTOR)},
            "template": {
                "metadata": {
                    "labels": dict(LABELS),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    # Service links would add *_PORT variables; GEOFED_* is config.
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": RUN_AS,
                        "runAsGroup": RUN_AS,
                        "fsGroup": RUN_AS,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [
                        {
                            "name": "geofed",
                            "image": f"{IMAGE_NAME}:dev",
                            "imagePullPolicy": "IfNotPresent",
                            "env": [{"name": k, "value": v} for k, v in env.items()],
                            "ports": [
                                {"name": name, "containerPort": port, "protocol": "TCP"}
                                for name, port in PORTS.items()
                            ],
                            "startupProbe": _grpc_probe("", 2, 30),
                            # Liveness: the process answers. Readiness: it serves
                            # clients; a down peer link must not take a region's
                            # broker out of its Service.
                            "livenessProbe": _grpc_probe("", 10, 3),
                            "readinessProbe": _grpc_probe(CLIENT_SERVICE, 5, 2),
                            "resources": {
                                "requests": {"cpu": "250m", "memory": "256Mi"},
                                "limits": {"cpu": "2", "memory": "1Gi"},
                            },
                            "securityContext": {
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "runAsNonRoot": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {
                                    "name": "federation",
                                    "mountPath": FEDERATION_DIR,
                                    "readOnly": True,
                                },
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "federation", "configMap": {"name": CONFIGMAP}},
                        # The node writes nothing unless GEOFED_TRACE_PATH is set
                        # (point it under /tmp, or mount a volume for long traces).
                        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
                    ],
                },
            },
        },
    }


def _service(name: str, port_name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": dict(LABELS)},
        "spec": {
            "type": "ClusterIP",
            "selector": dict(SELECTOR),
            "ports": [
                {"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
            ],
        },
    }


def _pdb() -> dict[str, Any]:
    # A broker is a singleton: evicting it is a regional outage of a few
    # seconds. Voluntary evictions wait for an operator (Kubernetes' advice
    # for single-instance applications); an unhealthy pod may always go.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": DEPLOYMENT, "labels": dict(LABELS)},
        "spec": {
            "minAvailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": dict(SELECTOR)},
        },
    }


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def _peer_ingress(peer_cidrs: Sequence[str]) -> dict[str, Any]:
    sources: list[dict[str, Any]] = [{"podSelector": {"matchLabels": dict(SELECTOR)}}]
    sources += [{"ipBlock": {"cidr": cidr}} for cidr in peer_cidrs]
    return {"from": sources, "ports": _tcp(PEER_PORT)}


def _network_policy(monitoring_namespace: str, peer_cidrs: Sequence[str] = ()) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": DEPLOYMENT, "labels": dict(LABELS)},
        "spec": {
            "podSelector": {"matchLabels": dict(SELECTOR)},
            "policyTypes": ["Ingress"],
            "ingress": _ingress(monitoring_namespace, peer_cidrs),
        },
    }


def _ingress(monitoring_namespace: str, peer_cidrs: Sequence[str]) -> list[dict[str, Any]]:
    return [
        # Clients may come from anywhere.
        {"ports": _tcp(CLIENT_PORT)},
        # The federation port: other brokers only.
        _peer_ingress(peer_cidrs),
        # Metrics: the monitoring namespace, or pods labelled as scrapers.
        {
            "from": [
                {
                    "namespaceSelector": {
                        "matchLabels": {"kubernetes.io/metadata.name": monitoring_namespace}
                    }
                },
                {"namespaceSelector": {}, "podSelector": {"matchLabels": {SCRAPER_LABEL: "true"}}},
            ],
            "ports": _tcp(METRICS_PORT),
        },
    ]


def base_manifests(monitoring_namespace: str = "monitoring") -> dict[str, Any]:
    """The base's files (name -> object): one broker without its id."""
    return {
        "kustomization.yaml": {
            "apiVersion": _KUSTOMIZE_API,
            "kind": "Kustomization",
            "resources": [
                "deployment.yaml",
                "service-client.yaml",
                "service-peer.yaml",
                "pdb.yaml",
                "networkpolicy.yaml",
            ],
        },
        "deployment.yaml": _deployment(),
        "service-client.yaml": _service(CLIENT_SVC, "grpc-client", CLIENT_PORT),
        "service-peer.yaml": _service(PEER_SVC, "grpc-peer", PEER_PORT),
        "pdb.yaml": _pdb(),
        "networkpolicy.yaml": _network_policy(monitoring_namespace),
    }


def podmonitor_component() -> dict[str, Any]:
    """A kustomize Component adding a PodMonitor for every broker of a namespace."""
    return {
        "kustomization.yaml": {
            "apiVersion": "kustomize.config.k8s.io/v1alpha1",
            "kind": "Component",
            "resources": ["podmonitor.yaml"],
        },
        "podmonitor.yaml": {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": {"name": PODMONITOR, "labels": dict(LABELS)},
            "spec": {
                "selector": {"matchLabels": dict(SELECTOR)},
                "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
            },
        },
    }


# --- endpoints ----------------------------------------------------------------


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


# --- overlays -----------------------------------------------------------------


def _image_entry(image: str) -> dict[str, str]:
    if not _IMAGE_OK.fullmatch(image):
        raise InvalidInput("image", f"not an image reference: {image!r}")
    entry = {"name": IMAGE_NAME}
    name, at, digest = image.partition("@")
    if at:
        entry.update(newName=name, digest=digest)
        return entry
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        entry.update(newName=name[:colon], newTag=name[colon + 1 :])
    else:
        entry.update(newName=name, newTag="latest")
    return entry


def _overlay_patches(
    broker_id: str,
    strategy: str,
    *,
    external_peer: bool,
    external_client: bool,
    peer_cidrs: Sequence[str],
    monitoring_namespace: str,
) -> list[dict[str, Any]]:
    mine = {BROKER_LABEL: slug(broker_id)}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT},
        "spec": {
            "selector": {"matchLabels": mine},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "geofed",
                            "env": [
                                {"name": "GEOFED_BROKER_ID", "value": broker_id},
                                {"name": "GEOFED_STRATEGY", "value": strategy},
                            ],
                        }
                    ]
                }
            },
        },
    }
    patches: list[dict[str, Any]] = [deployment]
    for name, external in ((CLIENT_SVC, external_client), (PEER_SVC, external_peer)):
        spec: dict[str, Any] = {"selector": mine}
        if external:
            # Reached from outside the cluster through its load balancer.
            spec["type"] = "LoadBalancer"
        patches.append(
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "spec": spec}
        )
    patches.append(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": DEPLOYMENT},
            "spec": {"selector": {"matchLabels": mine}},
        }
    )
    policy: dict[str, Any] = {"podSelector": {"matchLabels": mine}}
    if peer_cidrs:
        # Lists are replaced whole by a strategic merge: restate every rule.
        policy["ingress"] = _ingress(monitoring_namespace, peer_cidrs)
    patches.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": DEPLOYMENT},
            "spec": policy,
        }
    )
    return patches


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
        force: replace a previous render's files in `out`.

    Raises:
        InvalidInput: for a bad argument, naming it.
    """
    from geofed.routing import STRATEGIES

    source: dict[str, Any] | None = None
    if not isinstance(federation, Federation):
        source, federation = _read_federation(Path(federation))
    if strategy not in STRATEGIES:
        raise InvalidInput("strategy", f"unknown {strategy!r}; one of {', '.join(STRATEGIES)}")
    if not _SLUG_OK.fullmatch(namespace) or len(namespace) > 63:
        raise InvalidInput("namespace", f"not a valid Kubernetes namespace: {namespace!r}")
    if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?", cluster_domain):
        raise InvalidInput("cluster_domain", f"not a DNS domain: {cluster_domain!r}")
    image_entry = _image_entry(image)
    for cidr in peer_cidrs:
        _check_cidr(cidr)
    slugs = [slug(b.id) for b in federation]
    if len(set(slugs)) != len(slugs):
        raise InvalidInput("federation", "two broker ids map to the same Kubernetes name")

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
        cidrs = ["0.0.0.0/0", "::/0"]
        warnings.append(
            "peers reach each other from outside the cluster and no --peer-cidr was given: "
            "the NetworkPolicy admits the federation port from any address"
        )
    fed_text = _federation_text(federation, source, resolved)
    root = Path(out)
    _prepare(root, force)
    _write_tree(root / "base", base_manifests(monitoring_namespace))
    _write_tree(root / "components" / "podmonitor", podmonitor_component())
    overlays: dict[str, Path] = {}
    for b in federation:
        s = slug(b.id)
        kustomization: dict[str, Any] = {
            "apiVersion": _KUSTOMIZE_API,
            "kind": "Kustomization",
            "namespace": namespace,
            "nameSuffix": f"-{s}",
            "resources": ["../../base"],
        }
        if podmonitor and not single_cluster:
            kustomization["components"] = ["../../components/podmonitor"]
        kustomization.update(
            {
                "labels": [
                    {
                        "pairs": {BROKER_LABEL: s},
                        "includeSelectors": False,
                        "includeTemplates": True,
                    }
                ],
                "commonAnnotations": {BROKER_ID_ANNOTATION: b.id},
                "images": [image_entry],
                "configMapGenerator": [{"name": CONFIGMAP, "files": [FEDERATION_FILE]}],
                "patches": [{"path": "broker-patch.yaml"}],
            }
        )
        patches = _overlay_patches(
            b.id,
            strategy,
            external_peer=b.id in external_peer,
            external_client=b.id in external_client,
            peer_cidrs=cidrs if b.id in external_peer else (),
            monitoring_namespace=monitoring_namespace,
        )
        d = root / "overlays" / s
        _write_tree(d, {"kustomization.yaml": kustomization, "broker-patch.yaml": patches})
        (d / FEDERATION_FILE).write_text(fed_text + "\n", encoding="utf-8")
        overlays[b.id] = d
    if single_cluster:
        top: dict[str, Any] = {
            "apiVersion": _KUSTOMIZE_API,
            "kind": "Kustomization",
            "namespace": namespace,
            "resources": [f"overlays/{slug(b.id)}" for b in federation],
        }
        if podmonitor:
            top["components"] = ["components/podmonitor"]
        _write_tree(root, {"kustomization.yaml": top})
    return RenderResult(root, overlays, resolved, single_cluster, warnings)


def _read_federation(path: Path) -> tuple[dict[str, Any], Federation]:
    federation = Federation.load(path)  # validates, naming the file and field
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return raw, federation


def _federation_text(
    federation: Federation, source: dict[str, Any] | None, endpoints: Mapping[str, Endpoints]
) -> str:
    """The federation file every broker of this render loads."""
    if source is not None:
        doc = copy.deepcopy(source)
        for feature in doc["features"]:
            props = feature["properties"]
            props["endpoint"] = endpoints[props["id"]].peer
            props["client_endpoint"] = endpoints[props["id"]].client
    else:
        pairs = {bid: (e.peer, e.client) for bid, e in endpoints.items()}
        doc = federation.with_endpoints(pairs).to_geojson()
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    rendered = Federation.from_geojson(json.loads(text), source="rendered federation")
    if source is not None and rendered.digest != federation.digest:
        raise AssertionError("the rendered federation file changed the broker areas")
    return text


def _check_cidr(cidr: str) -> None:
    import ipaddress

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


# --- YAML ---------------------------------------------------------------------

# Plain scalars are limited to what no YAML 1.1 or 1.2 reader takes for
# anything but a string; everything else is double-quoted.
_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./@=+-]*(:[A-Za-z0-9_./@=+-]+)*")
_RESERVED = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "nan", "inf"}


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"cannot write {value!r} as YAML for Kubernetes")
        return repr(value)
    if isinstance(value, str):
        if _PLAIN.fullmatch(value) and value.lower() not in _RESERVED:
            return value
        return _quote(value)
    raise TypeError(f"cannot write {type(value).__name__} as YAML")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _quote(text: str) -> str:
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif (
            code < 0x20
            or 0x7F <= code <= 0x9F
            or 0xD800 <= code <= 0xDFFF
            or code in (0x2028, 0x2029, 0xFEFF, 0xFFFE, 0xFFFF)
        ):
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _emit(value: object, indent: int, lines: list[str]) -> None:
    pad = " " * indent
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            k = _scalar(key)
            if isinstance(item, Mapping) and item:
                lines.append(f"{pad}{k}:")
                _emit(item, indent + 2, lines)
            elif isinstance(item, list) and item:
                lines.append(f"{pad}{k}:")
                _emit(item, indent, lines)
            else:
                lines.append(f"{pad}{k}: {_inline(item)}")
    elif isinstance(value, list) and value:
        for item in value:
            if isinstance(item, Mapping | list) and item:
                sub: list[str] = []
                _emit(item, indent + 2, sub)
                lines.append(f"{pad}- {sub[0][indent + 2 :]}")
                lines.extend(sub[1:])
            else:
                lines.append(f"{pad}- {_inline(item)}")
    else:
        lines.append(pad + _inline(value))


def _inline(value: object) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def dump_yaml(*documents: object) -> str:
    """Block-style YAML for JSON-like data, one ``---``-separated document each.

    Mappings keep their order; strings are quoted whenever a YAML reader could
    take them for anything else.
    """
    parts = []
    for doc in documents:
        lines: list[str] = []
        _emit(doc, 0, lines)
        parts.append("\n".join(lines) + "\n")
    return "---\n".join(parts)


# --- CLI ----------------------------------------------------------------------


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
