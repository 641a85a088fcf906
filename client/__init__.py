"""geofed: a geo-distributed publish/subscribe broker federation.

Connect to the broker of your region and publish and subscribe with
geo-context::

    import geofed

    async with await geofed.connect(federation="three", client_id="c1",
                                    location=geofed.LatLon(48.85, 2.35)) as client:
        sub = await client.subscribe("sensors/#")
        await client.publish("sensors/paris/temp", b"21.5")
        async for msg in sub:
            print(msg.topic, msg.payload)

Packages: `geofed.client` (this API), `geofed.errors` (the typed errors),
`geofed.wire` (protobuf conversions), `geofed.routing` (the pure routing
core), `geofed.node` (the broker), `geofed.bench` (tools and benchmarks),
`geofed.k8s` (Kubernetes manifests), ``geofed.cli`` (the command line).
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from geofed.client import (
    Client,
    ClientConfig,
    Message,
    Publication,
    RetryConfig,
    Subscription,
    TLSConfig,
    connect,
)
from geofed.errors import (
    ClientClosed,
    DeadlineExceeded,
    FederationMismatch,
    GeofedError,
    InvalidInput,
    NotFound,
    PermissionDenied,
    RequestFailed,
    StorageFailed,
    TooLarge,
    Unauthenticated,
    Unavailable,
    WrongBroker,
)
from geofed.routing import (
    Cover,
    DecimalLayout,
    Federation,
    Geofence,
    H3Layout,
    HistoryAnswer,
    HistoryRecord,
    LatLon,
    Roaming,
    circle,
    cover,
    latlon,
    parse_geofence,
    parse_roaming,
)

try:
    __version__ = _version("geofed")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    # the client
    "Client",
    "ClientConfig",
    "Message",
    "Publication",
    "RetryConfig",
    "Subscription",
    "TLSConfig",
    "connect",
    "HistoryAnswer",
    "HistoryRecord",
    # errors
    "ClientClosed",
    "DeadlineExceeded",
    "FederationMismatch",
    "GeofedError",
    "InvalidInput",
    "NotFound",
    "PermissionDenied",
    "RequestFailed",
    "StorageFailed",
    "TooLarge",
    "Unauthenticated",
    "Unavailable",
    "WrongBroker",
    # geometry and the federation
    "Federation",
    "Geofence",
    "LatLon",
    "Roaming",
    "circle",
    "latlon",
    "parse_geofence",
    # geofences as topic filters for topic-only brokers
    "Cover",
    "DecimalLayout",
    "H3Layout",
    "cover",
    "parse_roaming",
]
