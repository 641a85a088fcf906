"""The broker node: one process per region serving clients and peers over gRPC.

`BrokerServer` wraps the routing core's `BrokerState` with the client and
federation gRPC services, one `PeerLink` per other broker, Prometheus metrics
and the node message trace. ``python -m geofed.node`` (or ``geofed node``)
runs one, configured by a `NodeConfig` from flags, ``GEOFED_*`` environment
variables or a JSON file.
"""

from ._budget import ByteBudget
from ._certs import (
    CA,
    CA_VALID,
    LEAF_VALID,
    LOOPBACK_HOSTS,
    create_ca,
    issue_broker,
    issue_client,
    issue_federation,
)
from ._config import (
    CLIENT_PORT,
    ENV_PREFIX,
    HTTP_PORT,
    METRICS_PORT,
    MQTT_PORT,
    MQTT_WS_PORT,
    PEER_PORT,
    NodeConfig,
    add_arguments,
    from_args,
)
from ._history import HistoryBackend, HistoryLog, PostgisHistory, SqliteHistory
from ._links import LinkHost, PeerLink, Transport
from ._metrics import (
    AUTH_REFUSED,
    DELIVERIES,
    EVENTS_PUBLISHED,
    HISTORY_BROKERS_ASKED,
    HISTORY_BYTES,
    HISTORY_DROPPED,
    HISTORY_ENTRIES,
    HISTORY_QUERIES,
    HISTORY_REMOVED,
    MATCH_SECONDS,
    MQTT_CONNECTIONS,
    MQTT_CONNECTS,
    PEER_BYTES_SENT,
    PEER_CONNECTED,
    PEER_DUPLICATES_DROPPED,
    PEER_LINK_FAILURES,
    PEER_MESSAGES_RECEIVED,
    PEER_MESSAGES_REJECTED,
    PEER_MESSAGES_SENT,
    PEER_QUEUE_DROPPED,
    PEER_QUEUE_LENGTH,
    PEER_REFUSED,
    PUBLISH_BACKPRESSURE_SECONDS,
    PUBLISH_BACKPRESSURE_WAITS,
    PUBLISH_DUPLICATES,
    REDIRECTS,
    REQUESTS_REJECTED,
    SESSION_QUEUE_DROPPED,
    SESSIONS,
    SESSIONS_EXPIRED,
    STORE_FAILURES,
    SUBSCRIBER_QUEUE_DROPPED,
    SUBSCRIPTIONS,
    NodeMetrics,
)
from ._policy import Grant, Policy, PolicyFile, covered
from ._run import main, run, serve
from ._server import BrokerServer
from ._tls import (
    TLSFiles,
    broker_dns_name,
    broker_ids,
    channel_credentials,
    check_broker,
    client_identity,
    client_uri,
    dial_options,
    peer_identities,
    server_credentials,
)
from ._tokens import ALGORITHMS, TokenClaims, TokenVerifier, bearer_token

__all__ = [
    # certificates (a federation's own CA)
    "CA",
    "CA_VALID",
    "LEAF_VALID",
    "LOOPBACK_HOSTS",
    "create_ca",
    "issue_broker",
    "issue_client",
    "issue_federation",
    "AUTH_REFUSED",
    "PEER_LINK_FAILURES",
    "PEER_REFUSED",
    # the node
    "BrokerServer",
    "ByteBudget",
    "LinkHost",
    "NodeConfig",
    "NodeMetrics",
    "PeerLink",
    "Transport",
    "add_arguments",
    # the message history (docs/design.md §10)
    "HistoryBackend",
    "HistoryLog",
    "PostgisHistory",
    "SqliteHistory",
    "from_args",
    "main",
    "run",
    "serve",
    # authorization (docs/security.md)
    "Grant",
    "Policy",
    "PolicyFile",
    "covered",
    # bearer tokens (docs/security.md)
    "ALGORITHMS",
    "TokenClaims",
    "TokenVerifier",
    "bearer_token",
    # TLS and identities (docs/security.md)
    "TLSFiles",
    "broker_dns_name",
    "broker_ids",
    "channel_credentials",
    "check_broker",
    "client_identity",
    "client_uri",
    "dial_options",
    "peer_identities",
    "server_credentials",
    # ports and the environment
    "CLIENT_PORT",
    "ENV_PREFIX",
    "HTTP_PORT",
    "METRICS_PORT",
    "MQTT_PORT",
    "MQTT_WS_PORT",
    "PEER_PORT",
    # metric names
    "DELIVERIES",
    "EVENTS_PUBLISHED",
    "HISTORY_BROKERS_ASKED",
    "HISTORY_BYTES",
    "HISTORY_DROPPED",
    "HISTORY_ENTRIES",
    "HISTORY_QUERIES",
    "HISTORY_REMOVED",
    "MATCH_SECONDS",
    "MQTT_CONNECTIONS",
    "MQTT_CONNECTS",
    "PEER_BYTES_SENT",
    "PEER_CONNECTED",
    "PEER_DUPLICATES_DROPPED",
    "PEER_MESSAGES_RECEIVED",
    "PEER_MESSAGES_REJECTED",
    "PEER_MESSAGES_SENT",
    "PEER_QUEUE_DROPPED",
    "PEER_QUEUE_LENGTH",
    "REDIRECTS",
    "REQUESTS_REJECTED",
    "PUBLISH_DUPLICATES",
    "SESSIONS",
    "SESSIONS_EXPIRED",
    "SESSION_QUEUE_DROPPED",
    "STORE_FAILURES",
    "PUBLISH_BACKPRESSURE_SECONDS",
    "PUBLISH_BACKPRESSURE_WAITS",
    "SUBSCRIBER_QUEUE_DROPPED",
    "SUBSCRIPTIONS",
]
