"""The Kubernetes objects of a federation, as JSON-like data (no files, no YAML).

The base (`base_manifests`) is one broker without its id: a Deployment, the
client and peer Services, a PodDisruptionBudget and a NetworkPolicy. Each
broker's overlay (`overlay_kustomization`, `overlay_patches`) names its
objects ``<base name>-<slug>``, selects only its own pod and sets its id and
strategy; `top_kustomization` deploys every overlay of one cluster at once.
What is the same for every broker of a render (its release name, TLS, where
metrics listen) is a `PodOptions`. With TLS, each broker mounts its own Secret
(`tls_secret_name`), which a cert-manager `certificate` may keep filled.
Ports and the ``GEOFED_*`` variable prefix are the node's (`geofed.node`),
the readiness probe's service name is the wire's (`geofed.wire`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from geofed.node import (
    CLIENT_PORT,
    ENV_PREFIX,
    HTTP_PORT,
    METRICS_PORT,
    MQTT_PORT,
    MQTT_WS_PORT,
    PEER_PORT,
    broker_dns_name,
)
from geofed.routing import InvalidInput
from geofed.wire import CLIENT_SERVICE

FRONT_ENDS = {"mqtt": MQTT_PORT, "mqtt-ws": MQTT_WS_PORT, "http": HTTP_PORT}
"""The client front ends beside gRPC a render may turn on, by port name: MQTT over TCP
and over WebSocket, the HTTP bridge. Each is served on the client Service, open to
clients like the gRPC client port."""
FRONT_END_SETTINGS = {"mqtt": "MQTT_LISTEN", "mqtt-ws": "MQTT_WS_LISTEN", "http": "HTTP_LISTEN"}
FRONT_END_ENDPOINTS = {
    "mqtt": "mqtt_endpoint",
    "mqtt-ws": "mqtt_ws_endpoint",
    "http": "http_endpoint",
}
"""The federation file property that names each front end of a broker (docs/design.md §2)."""
PORTS = {
    "grpc-client": CLIENT_PORT,
    "grpc-peer": PEER_PORT,
    "metrics": METRICS_PORT,
    **FRONT_ENDS,
}
"""The broker container's named ports (the Services and the PodMonitor use the names)."""
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
RELEASE_LABEL = "geofed.io/release"
ROLE_LABEL = "geofed.io/role"
"""With `RELEASE_LABEL`, the labels that admit a pod to the peer port (`release_labels`)."""
DEFAULT_RELEASE = "geofed"
HEALTH_PORT = 7402
"""The plaintext gRPC health port of a TLS broker (kubelet's gRPC probes cannot speak TLS)."""
TLS_DIR = "/etc/geofed-tls"
"""Where a broker's Secret is mounted (``GEOFED_TLS_DIR``): ca.pem, cert.pem, key.pem."""
TLS_VOLUME = "tls"
DATA_DIR = "/var/lib/geofed"
"""Where a durable broker's volume is mounted (``GEOFED_DATA_DIR``: its store)."""
DATA_PVC = "geofed-data"
"""The durable broker's PersistentVolumeClaim (the overlay suffixes it with the broker)."""
STORE_SHARE = 0.8
"""The share of the volume the store may fill (``GEOFED_STORE_MAX_BYTES``): publishing
is refused, never half-written, before the volume itself runs out (the SQLite WAL and
its checkpoints need the rest)."""
TLS_FILES = ("ca.pem", "cert.pem", "key.pem")
"""The files the node reads in its ``tls_dir`` (`geofed certs` writes them per broker)."""
CERT_MANAGER_KEYS = {"ca.crt": "ca.pem", "tls.crt": "cert.pem", "tls.key": "key.pem"}
"""The keys cert-manager writes in a certificate's Secret -> the file names the node reads."""
DEFAULT_TLS_SECRET = "geofed-tls-{broker}"
"""Secret name template: ``{broker}`` is the broker's `slug`."""
CERTIFICATE = "geofed-tls"
"""The cert-manager Certificate's base name (the overlay suffixes it with the broker)."""
CERT_MANAGER_API = "cert-manager.io/v1"
ISSUER_KINDS = ("Issuer", "ClusterIssuer")
DEPLOYMENT = "geofed-broker"
CLIENT_SVC = "geofed-client"
PEER_SVC = "geofed-peer"
CONFIGMAP = "geofed-federation"
PODMONITOR = "geofed-brokers"
KUSTOMIZE_API = "kustomize.config.k8s.io/v1beta1"
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")
"""An RFC 1123 label's characters (the length limit, 63, is checked apart)."""

_MAX_SLUG = 40  # "geofed-client-" + slug must stay a DNS label (63)
_IMAGE_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]*")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?")
_QUANTITY = re.compile(r"([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_QUANTITY_UNITS: dict[str, int] = {
    "": 1,
    **{u: 1024 ** (i + 1) for i, u in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{u: 1000 ** (i + 1) for i, u in enumerate(("k", "M", "G", "T", "P", "E"))},
}
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


# --- what every broker of a render shares ----------------------------------------


@dataclass(frozen=True)
class PodOptions:
    """The settings every broker pod of one render shares.

    Attributes:
        release: this render's name, in the `release_labels` that admit a pod
            to the peer port (a DNS label).
        tls: mutual TLS on the peer port and TLS on the client port, from a
            Secret per broker mounted at `TLS_DIR`; reflection off; probes on
            the plaintext health port `HEALTH_PORT`.
        cert_manager: the Secrets are cert-manager's (``tls.crt``, ``tls.key``,
            ``ca.crt``: the volume maps them to the node's file names).
        metrics_listen: the node's ``metrics_listen``: ``0.0.0.0:PORT`` (scraped
            from outside the pod) or ``127.0.0.1:PORT`` (inside the pod only).
        monitoring_namespace: the namespace whose pods may scrape /metrics.
        data_size: a durable broker: a PersistentVolumeClaim of this size
            (a Kubernetes quantity, e.g. ``10Gi``) mounted at `DATA_DIR`, the
            node's ``data_dir``; its store may fill `STORE_SHARE` of it. Empty:
            the broker keeps its state in memory (lost with the pod).
        storage_class: the claim's StorageClass (empty: the cluster's default).
        front_ends: the `FRONT_ENDS` each broker serves besides gRPC (port names).
    """

    release: str = DEFAULT_RELEASE
    tls: bool = False
    cert_manager: bool = False
    metrics_listen: str = f"0.0.0.0:{METRICS_PORT}"
    monitoring_namespace: str = "monitoring"
    data_size: str = ""
    storage_class: str = ""
    front_ends: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.release) > 63 or not DNS_LABEL.fullmatch(self.release):
            raise InvalidInput("release", f"not a DNS label: {self.release!r}")
        if self.cert_manager and not self.tls:
            raise InvalidInput("cert_manager", "cert-manager certificates need --tls")
        host, sep, port = self.metrics_listen.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidInput(
                "metrics_listen", f"must be 'host:port', got {self.metrics_listen!r}"
            )
        if host not in _WILDCARD_HOSTS + _LOOPBACK_HOSTS:
            raise InvalidInput(
                "metrics_listen",
                f"host {host!r}: bind every address of the pod (0.0.0.0) or its loopback"
                " (127.0.0.1); the pod's own address is not known when rendering",
            )
        if int(port) in (CLIENT_PORT, PEER_PORT, HEALTH_PORT):
            raise InvalidInput("metrics_listen", f"port {port} is taken by a gRPC port")
        for name in self.front_ends:
            if name not in FRONT_ENDS:
                raise InvalidInput(
                    "front_ends", f"unknown {name!r}; one of {', '.join(FRONT_ENDS)}"
                )
        if int(port) in {FRONT_ENDS[name] for name in self.front_ends}:
            raise InvalidInput("metrics_listen", f"port {port} is taken by a front end")
        if self.data_size:
            quantity_bytes(self.data_size, "data_size")
        if self.storage_class and not self.data_size:
            raise InvalidInput("storage_class", "a StorageClass needs a volume (--data-size)")
        if self.storage_class and (
            len(self.storage_class) > 253 or not _DNS_SUBDOMAIN.fullmatch(self.storage_class)
        ):
            raise InvalidInput("storage_class", f"not a StorageClass name: {self.storage_class!r}")

    @property
    def metrics_port(self) -> int:
        return int(self.metrics_listen.rpartition(":")[2])

    @property
    def metrics_exposed(self) -> bool:
        """Whether /metrics is reachable from outside the pod (a port, a scrape target)."""
        return self.metrics_listen.rpartition(":")[0] in _WILDCARD_HOSTS


def quantity_bytes(text: str, field: str) -> int:
    """Bytes of a Kubernetes storage quantity (``10Gi``, ``500M``, ``1073741824``)."""
    m = _QUANTITY.fullmatch(text)
    if m is None or int(m.group(1)) == 0:
        raise InvalidInput(
            field, f"not a storage size: {text!r} (a positive integer with Ki, Mi, Gi, Ti, ...)"
        )
    return int(m.group(1)) * _QUANTITY_UNITS[m.group(2) or ""]


def release_labels(release: str) -> dict[str, str]:
    """The labels of this release's broker pods; the peer port admits exactly these."""
    return {RELEASE_LABEL: release, ROLE_LABEL: "broker"}


# --- the node's settings -------------------------------------------------------


def container_env(
    broker_id: str,
    *,
    strategy: str = "event-geofence",
    federation: str = f"{FEDERATION_DIR}/{FEDERATION_FILE}",
    log_level: str = "info",
    tls: bool = False,
    metrics_listen: str = f"0.0.0.0:{METRICS_PORT}",
    store_max_bytes: int = 0,
    front_ends: Iterable[str] = (),
) -> dict[str, str]:
    """The ``GEOFED_*`` variables a broker container runs with (manifests and tests).

    With `tls`, the node reads its certificate from `TLS_DIR`, turns
    reflection off and serves gRPC health in plaintext on `HEALTH_PORT`.
    With `store_max_bytes` the broker is durable: its store lives in
    `DATA_DIR` (a volume) and may grow to that size. Each of `front_ends`
    (`FRONT_ENDS`) listens on every address of the pod at its port.
    """
    env = {
        f"{ENV_PREFIX}BROKER_ID": broker_id,
        f"{ENV_PREFIX}FEDERATION": federation,
        f"{ENV_PREFIX}STRATEGY": strategy,
        f"{ENV_PREFIX}CLIENT_LISTEN": f"0.0.0.0:{CLIENT_PORT}",
        f"{ENV_PREFIX}PEER_LISTEN": f"0.0.0.0:{PEER_PORT}",
        f"{ENV_PREFIX}METRICS_LISTEN": metrics_listen,
        f"{ENV_PREFIX}LOG_LEVEL": log_level,
    }
    if tls:
        env[f"{ENV_PREFIX}TLS_DIR"] = TLS_DIR
        env[f"{ENV_PREFIX}REFLECTION"] = "off"
        env[f"{ENV_PREFIX}HEALTH_LISTEN"] = f"0.0.0.0:{HEALTH_PORT}"
    for name in front_ends:
        env[f"{ENV_PREFIX}{FRONT_END_SETTINGS[name]}"] = f"0.0.0.0:{FRONT_ENDS[name]}"
    if store_max_bytes:
        env[f"{ENV_PREFIX}DATA_DIR"] = DATA_DIR
        env[f"{ENV_PREFIX}STORE_MAX_BYTES"] = str(store_max_bytes)
    return env


def tls_secret_name(template: str, broker_id: str) -> str:
    """The name of broker `broker_id`'s TLS Secret: `template` with ``{broker}`` its slug.

    Raises:
        InvalidInput: (field ``tls_secret``) when the result is not a Secret name.
    """
    rest = template.replace("{broker}", "")
    if "{" in rest or "}" in rest:
        raise InvalidInput("tls_secret", f"{template!r}: the only placeholder is {{broker}}")
    name = template.replace("{broker}", slug(broker_id))
    if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise InvalidInput("tls_secret", f"{name!r} is not a Secret name (a DNS subdomain)")
    return name


def slug(broker_id: str) -> str:
    """The Kubernetes name part for a broker id (a DNS label, unique per id).

    Ids that are already short lowercase DNS labels are kept; others are
    lowercased, stripped to ``[a-z0-9-]`` and suffixed with a hash of the id.
    """
    if len(broker_id) <= _MAX_SLUG and DNS_LABEL.fullmatch(broker_id):
        return broker_id
    clean = re.sub(r"[^a-z0-9]+", "-", broker_id.lower()).strip("-")[: _MAX_SLUG - 8].strip("-")
    digest = hashlib.sha256(broker_id.encode()).hexdigest()[:7]
    return f"{clean}-{digest}" if clean else f"b-{digest}"


# --- the base -----------------------------------------------------------------


def _labels(options: PodOptions) -> dict[str, str]:
    return {**LABELS, **release_labels(options.release)}


def _grpc_probe(port: int, service: str, period: int, failures: int) -> dict[str, Any]:
    grpc: dict[str, Any] = {"port": port}
    if service:
        grpc["service"] = service
    return {
        "grpc": grpc,
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _tls_volume(options: PodOptions) -> dict[str, Any]:
    secret: dict[str, Any] = {
        "secretName": CERTIFICATE,  # each overlay names its broker's Secret
        # Readable by the node's group (fsGroup) only, never by others.
        "defaultMode": 0o440,
    }
    if options.cert_manager:
        secret["items"] = [{"key": k, "path": f} for k, f in CERT_MANAGER_KEYS.items()]
    return {"name": TLS_VOLUME, "secret": secret}


def _deployment(options: PodOptions) -> dict[str, Any]:
    env = container_env(
        "",
        tls=options.tls,
        metrics_listen=options.metrics_listen,
        store_max_bytes=_store_max_bytes(options),
        front_ends=options.front_ends,
    )
    del env[f"{ENV_PREFIX}BROKER_ID"]  # set by each overlay
    ports = {"grpc-client": CLIENT_PORT, "grpc-peer": PEER_PORT}
    ports.update({name: FRONT_ENDS[name] for name in options.front_ends})
    annotations = {}
    if options.metrics_exposed:
        ports["metrics"] = options.metrics_port
        annotations = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(options.metrics_port),
            "prometheus.io/path": "/metrics",
        }
    # kubelet's gRPC probes speak plaintext only: a TLS broker answers them
    # on its health port, which serves nothing but gRPC health.
    probe_port = CLIENT_PORT
    if options.tls:
        ports["grpc-health"] = probe_port = HEALTH_PORT
    mounts: list[dict[str, Any]] = [
        {"name": "federation", "mountPath": FEDERATION_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "federation", "configMap": {"name": CONFIGMAP}},
        # The node writes nothing unless GEOFED_TRACE_PATH is set
        # (point it under /tmp, or mount a volume for long traces).
        {"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}},
    ]
    if options.tls:
        # A directory mount, not subPath: the kubelet swaps a changed Secret's
        # files in place and the node reloads them (rotation).
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True})
        volumes.append(_tls_volume(options))
    if options.data_size:
        # One pod at a time holds the claim: the Deployment recreates, never rolls.
        mounts.append({"name": "data", "mountPath": DATA_DIR})
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": DATA_PVC}})
    template_metadata: dict[str, Any] = {"labels": _labels(options)}
    if annotations:
        template_metadata["annotations"] = annotations
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "labels": _labels(options)},
        "spec": {
            # One broker per id: never two pods with the same id at once.
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "revisionHistoryLimit": 5,
            "selector": {"matchLabels": dict(SELECTOR)},
            "template": {
                "metadata": template_metadata,
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
                                for name, port in ports.items()
                            ],
                            "startupProbe": _grpc_probe(probe_port, "", 2, 30),
                            # Liveness: the process answers. Readiness: it serves
                            # clients; a down peer link must not take a region's
                            # broker out of its Service.
                            "livenessProbe": _grpc_probe(probe_port, "", 10, 3),
                            "readinessProbe": _grpc_probe(probe_port, CLIENT_SERVICE, 5, 2),
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
                            "volumeMounts": mounts,
                        }
                    ],
                    "volumes": volumes,
                },
            },
        },
    }


def _store_max_bytes(options: PodOptions) -> int:
    if not options.data_size:
        return 0
    return int(quantity_bytes(options.data_size, "data_size") * STORE_SHARE)


def _data_claim(options: PodOptions) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": options.data_size}},
    }
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": DATA_PVC, "labels": _labels(options)},
        "spec": spec,
    }


def _service(name: str, port_names: Sequence[str], options: PodOptions) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": _labels(options)},
        "spec": {
            "type": "ClusterIP",
            "selector": dict(SELECTOR),
            "ports": [
                {
                    "name": port_name,
                    "port": PORTS[port_name],
                    "targetPort": port_name,
                    "protocol": "TCP",
                }
                for port_name in port_names
            ],
        },
    }


def _pdb(options: PodOptions) -> dict[str, Any]:
    # A broker is a singleton: evicting it is a regional outage of a few
    # seconds. Voluntary evictions wait for an operator (Kubernetes' advice
    # for single-instance applications); an unhealthy pod may always go.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": DEPLOYMENT, "labels": _labels(options)},
        "spec": {
            "minAvailable": 1,
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
            "selector": {"matchLabels": dict(SELECTOR)},
        },
    }


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def _ingress(options: PodOptions, peer_cidrs: Sequence[str]) -> list[dict[str, Any]]:
    # Only this release's broker pods: labels no other workload has reason to carry.
    peer_sources: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": release_labels(options.release)}}
    ]
    peer_sources += [{"ipBlock": {"cidr": cidr}} for cidr in peer_cidrs]
    rules: list[dict[str, Any]] = [
        # Clients may come from anywhere, to every front end.
        {"ports": _tcp(CLIENT_PORT)},
        *({"ports": _tcp(FRONT_ENDS[name])} for name in options.front_ends),
        # The federation port: other brokers only.
        {"from": peer_sources, "ports": _tcp(PEER_PORT)},
    ]
    if options.tls:
        # gRPC health only (kubelet's probes; where they come from depends on the CNI).
        rules.append({"ports": _tcp(HEALTH_PORT)})
    if options.metrics_exposed:
        # Metrics: the monitoring namespace, or pods labelled as scrapers.
        rules.append(
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchLabels": {
                                "kubernetes.io/metadata.name": options.monitoring_namespace
                            }
                        }
                    },
                    {
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": {SCRAPER_LABEL: "true"}},
                    },
                ],
                "ports": _tcp(options.metrics_port),
            }
        )
    return rules


def _network_policy(options: PodOptions) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": DEPLOYMENT, "labels": _labels(options)},
        "spec": {
            "podSelector": {"matchLabels": dict(SELECTOR)},
            "policyTypes": ["Ingress"],
            "ingress": _ingress(options, ()),
        },
    }


def base_manifests(options: PodOptions | None = None) -> dict[str, Any]:
    """The base's files (name -> object): one broker without its id."""
    options = options or PodOptions()
    files: dict[str, Any] = {
        "deployment.yaml": _deployment(options),
        "service-client.yaml": _service(CLIENT_SVC, ("grpc-client", *options.front_ends), options),
        "service-peer.yaml": _service(PEER_SVC, ("grpc-peer",), options),
        "pdb.yaml": _pdb(options),
        "networkpolicy.yaml": _network_policy(options),
    }
    if options.data_size:
        files["pvc.yaml"] = _data_claim(options)
    return {
        "kustomization.yaml": {
            "apiVersion": KUSTOMIZE_API,
            "kind": "Kustomization",
            "resources": list(files),
        },
        **files,
    }


def podmonitor_component(options: PodOptions | None = None) -> dict[str, Any]:
    """A kustomize Component adding a PodMonitor for this release's brokers in a namespace."""
    options = options or PodOptions()
    return {
        "kustomization.yaml": {
            "apiVersion": "kustomize.config.k8s.io/v1alpha1",
            "kind": "Component",
            "resources": ["podmonitor.yaml"],
        },
        "podmonitor.yaml": {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PodMonitor",
            "metadata": {"name": PODMONITOR, "labels": _labels(options)},
            "spec": {
                "selector": {"matchLabels": release_labels(options.release)},
                "podMetricsEndpoints": [{"port": "metrics", "path": "/metrics", "interval": "15s"}],
            },
        },
    }


# --- overlays -----------------------------------------------------------------


def image_entry(image: str) -> dict[str, str]:
    """The kustomize ``images`` entry that replaces the base's image with `image`.

    Raises:
        InvalidInput: (field ``image``) when `image` is not an image reference.
    """
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


def overlay_kustomization(
    broker_id: str,
    namespace: str,
    image: dict[str, str],
    *,
    podmonitor: bool,
    certificate: bool = False,
) -> dict[str, Any]:
    """One broker's kustomization: the base, renamed, relabelled, with its image and file.

    `image` is an `image_entry`; `podmonitor` adds the PodMonitor component;
    `certificate` the broker's cert-manager Certificate (``certificate.yaml``).
    """
    s = slug(broker_id)
    kustomization: dict[str, Any] = {
        "apiVersion": KUSTOMIZE_API,
        "kind": "Kustomization",
        "namespace": namespace,
        "nameSuffix": f"-{s}",
        "resources": ["../../base", *(["certificate.yaml"] if certificate else [])],
    }
    if podmonitor:
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
            "commonAnnotations": {BROKER_ID_ANNOTATION: broker_id},
            "images": [image],
            "configMapGenerator": [{"name": CONFIGMAP, "files": [FEDERATION_FILE]}],
            "patches": [{"path": "broker-patch.yaml"}],
        }
    )
    return kustomization


def overlay_patches(
    broker_id: str,
    strategy: str,
    *,
    external_peer: bool,
    external_client: bool,
    peer_cidrs: Sequence[str],
    options: PodOptions,
    tls_secret: str = "",
) -> list[dict[str, Any]]:
    """One broker's strategic-merge patches of the base objects (``broker-patch.yaml``).

    An ``external_*`` Service becomes a LoadBalancer; `peer_cidrs`, if any,
    are admitted to the peer port besides the other brokers' pods; with
    ``options.tls``, the pod mounts the Secret `tls_secret`.
    """
    mine = {BROKER_LABEL: slug(broker_id)}
    pod: dict[str, Any] = {
        "containers": [
            {
                "name": "geofed",
                "env": [
                    {"name": f"{ENV_PREFIX}BROKER_ID", "value": broker_id},
                    {"name": f"{ENV_PREFIX}STRATEGY", "value": strategy},
                ],
            }
        ]
    }
    if options.tls:
        # Volumes merge by name: only the Secret's name changes.
        pod["volumes"] = [{"name": TLS_VOLUME, "secret": {"secretName": tls_secret}}]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT},
        "spec": {
            "selector": {"matchLabels": mine},
            "template": {"spec": pod},
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
        policy["ingress"] = _ingress(options, peer_cidrs)
    patches.append(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": DEPLOYMENT},
            "spec": policy,
        }
    )
    return patches


def certificate(
    broker_id: str, secret: str, hosts: Iterable[str], issuer: tuple[str, str]
) -> dict[str, Any]:
    """A cert-manager Certificate keeping broker `broker_id`'s Secret `secret` filled.

    It names the broker as `geofed certs` does: ``DNS:<id>.broker.geofed`` (what
    peers and `check_broker` verify) plus `hosts` (the names and addresses
    clients dial: its Services' DNS names, external endpoints), and serves
    both TLS sides, since a broker also dials its peers. `issuer` is
    (kind, name): an ``Issuer`` in the namespace or a ``ClusterIssuer``.
    """
    names: list[str] = [broker_dns_name(broker_id)]
    addresses: list[str] = []
    for host in hosts:
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            if host not in names:
                names.append(host)
        else:
            if str(address) not in addresses:
                addresses.append(str(address))
    spec: dict[str, Any] = {"secretName": secret, "dnsNames": names}
    if addresses:
        spec["ipAddresses"] = addresses
    spec.update(
        {
            "usages": ["digital signature", "server auth", "client auth"],
            # As `geofed certs` makes them; a new key with every renewal.
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "issuerRef": {"group": "cert-manager.io", "kind": issuer[0], "name": issuer[1]},
        }
    )
    return {
        "apiVersion": CERT_MANAGER_API,
        "kind": "Certificate",
        "metadata": {"name": CERTIFICATE},
        "spec": spec,
    }


def parse_issuer(text: str) -> tuple[str, str]:
    """``NAME`` (an Issuer in the namespace) or ``ClusterIssuer/NAME`` -> (kind, name).

    Raises:
        InvalidInput: (field ``cert_manager``) for anything else.
    """
    kind, slash, name = text.rpartition("/")
    kind = kind if slash else "Issuer"
    if kind not in ISSUER_KINDS or len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
        raise InvalidInput("cert_manager", f"{text!r}: give NAME (an Issuer) or ClusterIssuer/NAME")
    return kind, name


def top_kustomization(
    broker_ids: Iterable[str], namespace: str, *, podmonitor: bool
) -> dict[str, Any]:
    """The kustomization deploying every broker's overlay into one cluster."""
    top: dict[str, Any] = {
        "apiVersion": KUSTOMIZE_API,
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": [f"overlays/{slug(b)}" for b in broker_ids],
    }
    if podmonitor:
        top["components"] = ["components/podmonitor"]
    return top
