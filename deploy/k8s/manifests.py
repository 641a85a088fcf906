"""The Kubernetes objects of a federation, as JSON-like data (no files, no YAML).

The base (`base_manifests`) is one broker without its id: a Deployment, the
client and peer Services, a PodDisruptionBudget and a NetworkPolicy. Each
broker's overlay (`overlay_kustomization`, `overlay_patches`) names its
objects ``<base name>-<slug>``, selects only its own pod and sets its id and
strategy; `top_kustomization` deploys every overlay of one cluster at once.
Ports and the ``GEOFED_*`` variable prefix are the node's (`geofed.node`),
the readiness probe's service name is the wire's (`geofed.wire`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

from geofed.node import CLIENT_PORT, ENV_PREFIX, METRICS_PORT, PEER_PORT
from geofed.routing import InvalidInput
from geofed.wire import CLIENT_SERVICE

PORTS = {"grpc-client": CLIENT_PORT, "grpc-peer": PEER_PORT, "metrics": METRICS_PORT}
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
        f"{ENV_PREFIX}BROKER_ID": broker_id,
        f"{ENV_PREFIX}FEDERATION": federation,
        f"{ENV_PREFIX}STRATEGY": strategy,
        f"{ENV_PREFIX}CLIENT_LISTEN": f"0.0.0.0:{CLIENT_PORT}",
        f"{ENV_PREFIX}PEER_LISTEN": f"0.0.0.0:{PEER_PORT}",
        f"{ENV_PREFIX}METRICS_LISTEN": f"0.0.0.0:{METRICS_PORT}",
        f"{ENV_PREFIX}LOG_LEVEL": log_level,
    }


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
    del env[f"{ENV_PREFIX}BROKER_ID"]  # set by each overlay
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


def _service(name: str, port_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": dict(LABELS)},
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


def _ingress(monitoring_namespace: str, peer_cidrs: Sequence[str]) -> list[dict[str, Any]]:
    peer_sources: list[dict[str, Any]] = [{"podSelector": {"matchLabels": dict(SELECTOR)}}]
    peer_sources += [{"ipBlock": {"cidr": cidr}} for cidr in peer_cidrs]
    return [
        # Clients may come from anywhere.
        {"ports": _tcp(CLIENT_PORT)},
        # The federation port: other brokers only.
        {"from": peer_sources, "ports": _tcp(PEER_PORT)},
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


def _network_policy(monitoring_namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": DEPLOYMENT, "labels": dict(LABELS)},
        "spec": {
            "podSelector": {"matchLabels": dict(SELECTOR)},
            "policyTypes": ["Ingress"],
            "ingress": _ingress(monitoring_namespace, ()),
        },
    }


def base_manifests(monitoring_namespace: str = "monitoring") -> dict[str, Any]:
    """The base's files (name -> object): one broker without its id."""
    return {
        "kustomization.yaml": {
            "apiVersion": KUSTOMIZE_API,
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
        "service-client.yaml": _service(CLIENT_SVC, "grpc-client"),
        "service-peer.yaml": _service(PEER_SVC, "grpc-peer"),
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
    broker_id: str, namespace: str, image: dict[str, str], *, podmonitor: bool
) -> dict[str, Any]:
    """One broker's kustomization: the base, renamed, relabelled, with its image and file.

    `image` is an `image_entry`; `podmonitor` adds the PodMonitor component.
    """
    s = slug(broker_id)
    kustomization: dict[str, Any] = {
        "apiVersion": KUSTOMIZE_API,
        "kind": "Kustomization",
        "namespace": namespace,
        "nameSuffix": f"-{s}",
        "resources": ["../../base"],
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
    monitoring_namespace: str,
) -> list[dict[str, Any]]:
    """One broker's strategic-merge patches of the base objects (``broker-patch.yaml``).

    An ``external_*`` Service becomes a LoadBalancer; `peer_cidrs`, if any,
    are admitted to the peer port besides the other brokers' pods.
    """
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
                                {"name": f"{ENV_PREFIX}BROKER_ID", "value": broker_id},
                                {"name": f"{ENV_PREFIX}STRATEGY", "value": strategy},
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
