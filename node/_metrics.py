"""Prometheus metrics of a broker node (names fixed by DESIGN §5)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class NodeMetrics:
    """All metrics of one node, registered in `registry` (default: the global one)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.peer_sent = Counter(
            "geofed_peer_messages_sent_total",
            "Logical inter-broker messages sent, by destination broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_received = Counter(
            "geofed_peer_messages_received_total",
            "Logical inter-broker messages received, by source broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_bytes = Counter(
            "geofed_peer_bytes_sent_total",
            "Serialized bytes of the messages sent, by destination broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_dropped = Counter(
            "geofed_peer_queue_dropped_total",
            "Messages dropped because a peer's queue was full.",
            ["peer"],
            registry=registry,
        )
        self.peer_duplicates = Counter(
            "geofed_peer_duplicates_dropped_total",
            "Events or deliveries received again (after a resend) and dropped.",
            ["peer"],
            registry=registry,
        )
        self.peer_connected = Gauge(
            "geofed_peer_connected",
            "1 while the link to the peer is established.",
            ["peer"],
            registry=registry,
        )
        self.peer_queue = Gauge(
            "geofed_peer_queue_length", "Messages waiting for a peer.", ["peer"], registry=registry
        )
        self.events_published = Counter(
            "geofed_events_published", "Events published by local clients.", registry=registry
        )
        self.deliveries = Counter(
            "geofed_deliveries", "Events handed to local subscribers.", registry=registry
        )
        self.subscriber_dropped = Counter(
            "geofed_subscriber_queue_dropped",
            "Deliveries dropped because a subscriber's queue was full (oldest first).",
            registry=registry,
        )
        self.subscriptions = Gauge(
            "geofed_subscriptions",
            "Subscriptions held, local or remote (forwarded by other brokers).",
            ["scope"],
            registry=registry,
        )
        self.sessions = Gauge("geofed_sessions", "Connected client sessions.", registry=registry)
        self.redirects = Counter(
            "geofed_redirects", "Clients sent to another broker.", registry=registry
        )
        self.rejected = Counter(
            "geofed_requests_rejected",
            "Client requests rejected, by gRPC status code.",
            ["code"],
            registry=registry,
        )
        self.match_seconds = Histogram(
            "geofed_match_seconds",
            "Time to match one event against the subscriptions held here.",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=registry,
        )
