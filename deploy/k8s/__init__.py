"""Kubernetes manifests for a federation (``geofed k8s render``).

`render` writes a kustomize tree::

    OUT/kustomization.yaml          all brokers at once (only when they share one cluster)
    OUT/base/                       one broker: Deployment, two Services, PDB, NetworkPolicy
    OUT/components/podmonitor/      optional Prometheus-operator PodMonitor
    OUT/overlays/<broker>/          one per broker: its id, name suffix, federation file
                                    (and with cert-manager, its Certificate)

The base is the same for every federation (``k8s/base`` in the repository is
this package's output). Each overlay names its objects ``<base name>-<broker>``,
selects only its own broker's pod, and carries the federation file in a
generated ConfigMap, with peer endpoints that are either the in-cluster DNS
names of the peer Services (all brokers in one cluster) or the external
addresses given with ``--endpoints`` (one cluster per region). The peer
port admits only the pods labelled with this render's release
(`release_labels`); with ``--tls`` every broker mounts its own Secret at
`TLS_DIR` and peers authenticate each other by certificate; with
``--data-size`` every broker is durable, its store on a PersistentVolumeClaim
mounted at `DATA_DIR`.

The package is split by job:

* `geofed.k8s.manifests`: the objects, as JSON-like data; the node's settings
  (`container_env`, which the container tests run the image with too);
* `geofed.k8s.endpoints`: where each broker is reached;
* `geofed.k8s.tree`: `render`, which checks its arguments and writes the files;
* `geofed.k8s.yamlout`: `dump_yaml`, a small YAML emitter (PyYAML is not a
  runtime dependency);
* `geofed.k8s.cli`: the ``geofed k8s`` subcommand.

Ports and the ``GEOFED_`` prefix come from `geofed.node`, service names from
`geofed.wire`.
"""

from .endpoints import Endpoints, in_cluster_endpoints, parse_endpoints
from .manifests import (
    BROKER_ID_ANNOTATION,
    BROKER_LABEL,
    CERT_MANAGER_KEYS,
    CERTIFICATE,
    CLIENT_SVC,
    CONFIGMAP,
    DATA_DIR,
    DEFAULT_RELEASE,
    DEFAULT_TLS_SECRET,
    DEPLOYMENT,
    FEDERATION_DIR,
    FEDERATION_FILE,
    FRONT_ENDS,
    HEALTH_PORT,
    IMAGE_NAME,
    LABELS,
    PEER_SVC,
    PODMONITOR,
    PORTS,
    RELEASE_LABEL,
    ROLE_LABEL,
    RUN_AS,
    SCRAPER_LABEL,
    SELECTOR,
    TLS_DIR,
    TLS_FILES,
    PodOptions,
    base_manifests,
    certificate,
    container_env,
    parse_issuer,
    podmonitor_component,
    release_labels,
    slug,
    tls_secret_name,
)
from .tree import OUTPUTS, RenderResult, render
from .yamlout import dump_yaml

__all__ = [
    # rendering a federation
    "OUTPUTS",
    "RenderResult",
    "render",
    # endpoints
    "Endpoints",
    "in_cluster_endpoints",
    "parse_endpoints",
    # the objects
    "PodOptions",
    "base_manifests",
    "certificate",
    "container_env",
    "parse_issuer",
    "podmonitor_component",
    "release_labels",
    "slug",
    "tls_secret_name",
    # names, labels and paths in the manifests
    "BROKER_ID_ANNOTATION",
    "BROKER_LABEL",
    "CERT_MANAGER_KEYS",
    "CERTIFICATE",
    "CLIENT_SVC",
    "CONFIGMAP",
    "DEFAULT_RELEASE",
    "DEFAULT_TLS_SECRET",
    "DEPLOYMENT",
    "FEDERATION_DIR",
    "FEDERATION_FILE",
    "DATA_DIR",
    "FRONT_ENDS",
    "HEALTH_PORT",
    "IMAGE_NAME",
    "LABELS",
    "PEER_SVC",
    "PODMONITOR",
    "PORTS",
    "RELEASE_LABEL",
    "ROLE_LABEL",
    "RUN_AS",
    "SCRAPER_LABEL",
    "SELECTOR",
    "TLS_DIR",
    "TLS_FILES",
    # YAML
    "dump_yaml",
]
