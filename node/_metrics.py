"""Prometheus metrics of a broker node (names are stable: docs/design.md, Metrics)."""

from __future__ import annotations

import logging
from collections import Counter as Tally

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from geofed.routing import LastMile, Scheme

# Metric names as scrapers see them (a histogram adds _bucket, _sum and _count).
PEER_MESSAGES_SENT = "geofed_peer_messages_sent_total"
PEER_MESSAGES_RECEIVED = "geofed_peer_messages_received_total"
PEER_BYTES_SENT = "geofed_peer_bytes_sent_total"
PEER_QUEUE_DROPPED = "geofed_peer_queue_dropped_total"
PEER_UNACKED_FORGOTTEN = "geofed_peer_unacked_forgotten_total"
PEER_DUPLICATES_DROPPED = "geofed_peer_duplicates_dropped_total"
PEER_MESSAGES_REJECTED = "geofed_peer_messages_rejected_total"
PEER_CONNECTED = "geofed_peer_connected"
PEER_QUEUE_LENGTH = "geofed_peer_queue_length"
EVENTS_PUBLISHED = "geofed_events_published_total"
DELIVERIES = "geofed_deliveries_total"
SUBSCRIBER_QUEUE_DROPPED = "geofed_subscriber_queue_dropped_total"
PUBLISH_BACKPRESSURE_SECONDS = "geofed_publish_backpressure_seconds_total"
PUBLISH_BACKPRESSURE_WAITS = "geofed_publish_backpressure_waits_total"
SUBSCRIPTIONS = "geofed_subscriptions"
SESSIONS = "geofed_sessions"
REDIRECTS = "geofed_redirects_total"
REQUESTS_REJECTED = "geofed_requests_rejected_total"
MATCH_SECONDS = "geofed_match_seconds"
PUBLISH_DUPLICATES = "geofed_publish_duplicates_total"
STORE_FAILURES = "geofed_store_failures_total"
SQLITE_MEMORY = "geofed_sqlite_memory_bytes"
SESSION_QUEUE_DROPPED = "geofed_session_queue_dropped_total"
SESSIONS_EXPIRED = "geofed_sessions_expired_total"
HANDOVERS = "geofed_handovers_total"
HANDOVER_WAIT_TIMEOUTS = "geofed_handover_wait_timeouts_total"
HANDOFF_DELIVERIES = "geofed_handoff_deliveries_total"
SESSION_TRANSFERS = "geofed_session_transfers_total"
AUTH_REFUSED = "geofed_auth_refused_total"
QUEUED_BYTES = "geofed_queued_bytes"
PEER_REFUSED = "geofed_peer_refused_total"
TLS_REFUSED = "geofed_tls_refused_total"
PEER_LINK_FAILURES = "geofed_peer_link_failures_total"
MQTT_CONNECTIONS = "geofed_mqtt_connections"
MQTT_CONNECTS = "geofed_mqtt_connects_total"
HISTORY_BROKERS_ASKED = "geofed_history_brokers_asked_total"
HISTORY_QUERIES = "geofed_history_queries_total"
HISTORY_ENTRIES = "geofed_history_entries"
HISTORY_BYTES = "geofed_history_bytes"
HISTORY_REMOVED = "geofed_history_removed_total"
HISTORY_DROPPED = "geofed_history_dropped_total"
FILTER_SCHEME = "geofed_filter_scheme"
FILTER_COMPLEXITY = "geofed_filter_complexity"
FILTER_MATCH_OPERATIONS = "geofed_filter_match_operations_total"
FILTER_APPROXIMATE_DELIVERIES = "geofed_filter_approximate_deliveries_total"
FILTER_FALSE_DELIVERIES = "geofed_filter_false_deliveries_total"
FILTER_AUDITED_MATCHES = "geofed_filter_audited_matches_total"
FILTER_AUDITED_DELIVERED = "geofed_filter_audited_delivered_total"
FILTER_TRANSITIONS = "geofed_filter_transitions_total"
FILTER_BOOTSTRAPPED = "geofed_filter_bootstrapped_total"
ADAPTIVE_WINDOWS = "geofed_adaptive_windows_total"
ADAPTIVE_KEYS = "geofed_adaptive_keys"
ADAPTIVE_SWITCHES = "geofed_adaptive_switches_total"
ADAPTIVE_DEFERRED = "geofed_adaptive_deferred_total"
ADAPTIVE_SAVING = "geofed_adaptive_predicted_saving_total"
ADAPTIVE_PREDICTED = "geofed_adaptive_predicted_messages"
MQTT_PROTOCOL_VERSIONS = {4: "3.1.1", 5: "5.0"}
"""The `version` label of the MQTT metrics, by CONNECT protocol level."""

log = logging.getLogger("geofed.node.links")


class NodeMetrics:
    """All metrics of one node, registered in `registry` (default: the global one)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.peer_sent = Counter(
            PEER_MESSAGES_SENT,
            "Logical inter-broker messages sent, by destination broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_received = Counter(
            PEER_MESSAGES_RECEIVED,
            "Logical inter-broker messages received, by source broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_bytes = Counter(
            PEER_BYTES_SENT,
            "Serialized bytes of the messages sent, by destination broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_dropped = Counter(
            PEER_QUEUE_DROPPED,
            "Messages dropped because a peer's queue was full.",
            ["peer"],
            registry=registry,
        )
        self.peer_forgotten = Counter(
            PEER_UNACKED_FORGOTTEN,
            "Events and deliveries a link ended without an acknowledgement for and could not"
            " send again: without a store, beyond the last 4,096 unacknowledged frames.",
            ["peer"],
            registry=registry,
        )
        self.peer_duplicates = Counter(
            PEER_DUPLICATES_DROPPED,
            "Events or deliveries received again (after a resend) and dropped.",
            ["peer"],
            registry=registry,
        )
        self.peer_rejected = Counter(
            PEER_MESSAGES_REJECTED,
            "Messages from a peer that could not be converted or applied and were skipped"
            " (the rest of their frame was applied), by source broker and kind.",
            ["peer", "kind"],
            registry=registry,
        )
        self.peer_connected = Gauge(
            PEER_CONNECTED,
            "1 while the link to the peer is established.",
            ["peer"],
            registry=registry,
        )
        self.peer_queue = Gauge(
            PEER_QUEUE_LENGTH, "Messages waiting for a peer.", ["peer"], registry=registry
        )
        self.events_published = Counter(
            EVENTS_PUBLISHED, "Events published by local clients.", registry=registry
        )
        self.deliveries = Counter(
            DELIVERIES, "Events handed to local subscribers.", registry=registry
        )
        self.subscriber_dropped = Counter(
            SUBSCRIBER_QUEUE_DROPPED,
            "Deliveries dropped because a subscriber's queue was full (oldest first).",
            registry=registry,
        )
        self.publish_backpressure = Counter(
            PUBLISH_BACKPRESSURE_SECONDS,
            "Seconds local publishes waited for subscriber streams to drain (flow control).",
            registry=registry,
        )
        self.publish_waits = Counter(
            PUBLISH_BACKPRESSURE_WAITS,
            "Local publishes that waited for subscriber streams to drain (counted as they start).",
            registry=registry,
        )
        self.subscriptions = Gauge(
            SUBSCRIPTIONS,
            "Subscriptions held, local or remote (forwarded by other brokers).",
            ["scope"],
            registry=registry,
        )
        self.sessions = Gauge(SESSIONS, "Connected client sessions.", registry=registry)
        self.strategy_epoch = Gauge(
            "geofed_strategy_epoch",
            "Epoch of the strategy table this broker reached (docs/design.md §3).",
            registry=registry,
        )
        self.strategy_phase = Gauge(
            "geofed_strategy_transition_phase",
            "Transition under way here: 0 none, 1 prepared, 2 switched (old copies not yet"
            " withdrawn).",
            registry=registry,
        )
        # The adaptive controller (docs/design.md §13).
        self.adaptive_windows = Counter(
            ADAPTIVE_WINDOWS,
            "Adaptive-controller windows this broker closed (its share sent to the sequencer).",
            registry=registry,
        )
        self.adaptive_keys = Gauge(
            ADAPTIVE_KEYS, "Topic keys this broker measures its share of.", registry=registry
        )
        self.adaptive_switches = Counter(
            ADAPTIVE_SWITCHES,
            "Strategy switches the controller proposed (at the sequencer), by new strategy.",
            ["strategy"],
            registry=registry,
        )
        self.adaptive_deferred = Counter(
            ADAPTIVE_DEFERRED,
            "Switches the decision rule asked for but not proposed: a transition under way"
            " or a link down (the rule asks again at the next window).",
            registry=registry,
        )
        self.adaptive_saving = Counter(
            ADAPTIVE_SAVING,
            "Inter-broker messages the proposed switches were predicted to save over the"
            " horizon, their transitions already deducted.",
            registry=registry,
        )
        self.adaptive_predicted = Gauge(
            ADAPTIVE_PREDICTED,
            "At the sequencer: the last window's inter-broker messages predicted with every"
            " key by `strategy`, or by its strategy now (`current`), summed over keys.",
            ["strategy"],
            registry=registry,
        )
        self.redirects = Counter(REDIRECTS, "Clients sent to another broker.", registry=registry)
        self.rejected = Counter(
            REQUESTS_REJECTED,
            "Client requests rejected, by gRPC status code.",
            ["code"],
            registry=registry,
        )
        self.match_seconds = Histogram(
            MATCH_SECONDS,
            "Time to match one event against the subscriptions held here"
            " (a published batch: its time per event, observed once).",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2),
            registry=registry,
        )
        self._durability(registry)
        self.queued_bytes = Gauge(
            QUEUED_BYTES,
            "Bytes queued in memory across subscriber streams and peer queues (node_queue_bytes).",
            registry=registry,
        )
        self.auth_refused = Counter(
            AUTH_REFUSED,
            "Client requests refused by authentication or the policy, by reason"
            " (unauthenticated, identity, publish, subscribe, location).",
            ["reason"],
            registry=registry,
        )
        self.peer_refused = Counter(
            PEER_REFUSED,
            "Peer links refused because of who the peer is, by reason. At the peer port:"
            " plaintext, no_certificate, unknown_ca, expired, bad_certificate, handshake (the"
            " TLS handshake failed); identity (the certificate names another broker);"
            " unauthenticated (no certificate). Dialling: tls (this broker's dial failed the"
            " TLS handshake).",
            ["reason"],
            registry=registry,
        )
        self.tls_refused = Counter(
            TLS_REFUSED,
            "Client connections refused by the TLS handshake at the listeners beside gRPC, by"
            " listener (mqtt, mqtt_ws, http) and reason: plaintext, no_certificate, unknown_ca,"
            " expired, bad_certificate, handshake (as geofed_peer_refused_total's).",
            ["listener", "reason"],
            registry=registry,
        )
        self.peer_link_failures = Counter(
            PEER_LINK_FAILURES,
            "Peer link sessions ended by an unexpected error (not a closed or refused"
            " connection), by peer; the link is redialled.",
            ["peer"],
            registry=registry,
        )

        self.mqtt_connections = Gauge(
            MQTT_CONNECTIONS,
            "Open MQTT connections with an accepted CONNECT, by protocol version.",
            ["version"],
            registry=registry,
        )
        self.mqtt_connects = Counter(
            MQTT_CONNECTS,
            "MQTT CONNECTs answered, by protocol version and result (accepted, redirected,"
            " refused).",
            ["version", "result"],
            registry=registry,
        )

        self._history(registry)
        self._filter_schemes(registry)

    def _history(self, registry: CollectorRegistry) -> None:
        self.history_brokers_asked = Counter(
            HISTORY_BROKERS_ASKED,
            "Brokers asked for their share of history queries this broker answered for its"
            " clients (itself included), by broker asked.",
            ["broker"],
            registry=registry,
        )
        self.history_queries = Counter(
            HISTORY_QUERIES,
            "History queries answered for clients, by kind (read, delete).",
            ["kind"],
            registry=registry,
        )
        self.history_entries = Gauge(
            HISTORY_ENTRIES, "Entries in this broker's history.", registry=registry
        )
        self.history_bytes = Gauge(
            HISTORY_BYTES,
            "Bytes of the entries in this broker's history (history_max_bytes).",
            registry=registry,
        )
        self.history_removed = Counter(
            HISTORY_REMOVED,
            "History entries removed, by reason (age, size, delete).",
            ["reason"],
            registry=registry,
        )
        self.history_dropped = Counter(
            HISTORY_DROPPED,
            "Published events not logged: the history's write queue was full or its write failed.",
            registry=registry,
        )

    def _filter_schemes(self, registry: CollectorRegistry) -> None:
        self.filter_scheme = Gauge(
            FILTER_SCHEME,
            "1 for the filter scheme this broker matches its local subscriptions with.",
            ["scheme"],
            registry=registry,
        )
        self.filter_complexity = Gauge(
            FILTER_COMPLEXITY,
            "Filter entries an event is matched against: local subscriptions (exact) or"
            " distinct channels (grid, rgrid).",
            registry=registry,
        )
        self.filter_match_operations = Counter(
            FILTER_MATCH_OPERATIONS,
            "Filter entries matched against, summed over the events matched here.",
            registry=registry,
        )
        self.filter_approximate = Counter(
            FILTER_APPROXIMATE_DELIVERIES,
            "Deliveries made under an approximate filter scheme (grid, rgrid).",
            registry=registry,
        )
        self.filter_false = Counter(
            FILTER_FALSE_DELIVERIES,
            "Of those, deliveries the exact match predicate denies (precision = 1 - false /"
            " approximate).",
            registry=registry,
        )
        self.filter_audited_matches = Counter(
            FILTER_AUDITED_MATCHES,
            "Exact matches of the events audited under an approximate scheme.",
            registry=registry,
        )
        self.filter_audited_delivered = Counter(
            FILTER_AUDITED_DELIVERED,
            "Of those, the ones the scheme delivered (recall = delivered / matches).",
            registry=registry,
        )
        self.filter_transitions = Counter(
            FILTER_TRANSITIONS,
            "Filter scheme transitions, by source and target scheme.",
            ["source", "target"],
            registry=registry,
        )
        self.filter_bootstrapped = Counter(
            FILTER_BOOTSTRAPPED,
            "Subscriptions whose missing state a transition took from the broker's own copy.",
            registry=registry,
        )
        # The last mile's counters each metric follows, and their values at the
        # last sync: a sync (every publish) touches only the metrics that moved.
        self._scheme_counters = [
            (self.filter_match_operations, "match_operations"),
            (self.filter_approximate, "deliveries"),
            (self.filter_false, "false_deliveries"),
            (self.filter_audited_matches, "audited_matches"),
            (self.filter_audited_delivered, "audited_delivered"),
            (self.filter_bootstrapped, "recovered"),
        ]
        self._scheme_seen = dict.fromkeys((name for _, name in self._scheme_counters), 0)
        self._transitions_seen: Tally[tuple[str, str]] = Tally()
        self._scheme_shown: Scheme | None = None
        self._complexity_shown = -1

    def sync_filter(self, last_mile: LastMile) -> None:
        """Bring the filter scheme metrics up to the last mile's counters."""
        now, seen = last_mile.stats, self._scheme_seen
        if last_mile.scheme is not self._scheme_shown:
            for scheme in Scheme:
                self.filter_scheme.labels(scheme=scheme.value).set(
                    1 if scheme is last_mile.scheme else 0
                )
            self._scheme_shown = last_mile.scheme
        if last_mile.complexity != self._complexity_shown:
            self.filter_complexity.set(last_mile.complexity)
            self._complexity_shown = last_mile.complexity
        for counter, name in self._scheme_counters:
            value = getattr(now, name)
            if value != seen[name]:
                counter.inc(value - seen[name])
                seen[name] = value
        if now.transitions != self._transitions_seen:
            before = self._transitions_seen
            for (source, target), n in now.transitions.items():
                if n > before[(source, target)]:
                    self.filter_transitions.labels(source=source, target=target).inc(
                        n - before[(source, target)]
                    )
            self._transitions_seen = Tally(now.transitions)

    def _durability(self, registry: CollectorRegistry) -> None:
        self.publish_duplicates = Counter(
            PUBLISH_DUPLICATES,
            "Published events dropped because this broker already published their id"
            " (a client's retry).",
            registry=registry,
        )
        self.store_failures = Counter(
            STORE_FAILURES,
            "Store commits that failed (the publish or peer frame was refused, not acknowledged).",
            registry=registry,
        )
        self.sqlite_memory = Gauge(
            SQLITE_MEMORY,
            "Bytes SQLite holds in this process: the store's and the history's page caches"
            " (store_cache_kib), statements, schema.",
            registry=registry,
        )
        self.session_dropped = Counter(
            SESSION_QUEUE_DROPPED,
            "Queued deliveries of persistent subscriptions dropped over session_queue_bytes"
            " (oldest first).",
            registry=registry,
        )
        self.sessions_expired = Counter(
            SESSIONS_EXPIRED,
            "Sessions forgotten after their expiry (or session_idle_s) without an open stream.",
            registry=registry,
        )
        self.handovers = _preset_counter(
            HANDOVERS,
            "Held handovers (make before break) that ended: the client left (left), the hold"
            " ran out (expired) or the client came back into the area (returned).",
            "outcome",
            ("left", "expired", "returned"),
            registry,
        )
        self.handover_wait_timeouts = _preset_counter(
            HANDOVER_WAIT_TIMEOUTS,
            "Handover waits whose bound ran out: a renewal answered before every connected"
            " peer acknowledged what it was sent (settle), a withdrawal made before every"
            " connected peer's flush reply arrived (flush), a client redirected before its"
            " new broker said it holds the transferred session (transfer).",
            "step",
            ("settle", "flush", "transfer"),
            registry,
        )
        self.handoff_deliveries = _preset_counter(
            HANDOFF_DELIVERIES,
            "Queued deliveries of persistent subscriptions moved by handovers: sent to the"
            " client's new broker (sent), queued here for a client that arrived (queued),"
            " dropped here as the client gets them elsewhere (duplicate: in a handoff, queued"
            " here already since its transferred session came; in a queue held here when the"
            " session came back, queued by the broker it came back from; an event matched here"
            " after its session came, which the client gets from the broker it came from), or"
            " lost: no link to the new broker, or no such subscription there (dropped).",
            "outcome",
            ("sent", "queued", "duplicate", "dropped"),
            registry,
        )
        self.session_transfers = _preset_counter(
            SESSION_TRANSFERS,
            "Persistent sessions moved with their MQTT clients (or ahead of a client whose"
            " hold ran out): sent to the new broker (sent), opened here (taken), or not taken"
            " here (refused).",
            "outcome",
            ("sent", "taken", "refused"),
            registry,
        )

    def reject_peer_message(self, peer: str, kind: str, msg_id: str, reason: str) -> None:
        """Account for a message from `peer` that was skipped: counted, logged once.

        It counts as received too (it was read and handled), so that sent and
        received totals still meet (the quiescence barrier compares them).
        """
        self.peer_rejected.labels(peer=peer, kind=kind).inc()
        self.peer_received.labels(peer=peer, kind=kind).inc()
        log.warning("peer %s: %s %r rejected and skipped: %s", peer, kind, msg_id, reason)


def _preset_counter(
    name: str, doc: str, label: str, values: tuple[str, ...], registry: CollectorRegistry
) -> Counter:
    """A counter of one `label` with a sample at 0 for each of `values`: exported before
    anything is counted, so a rate or a wait on it needs no first count."""
    counter = Counter(name, doc, [label], registry=registry)
    for value in values:
        counter.labels(**{label: value})
    return counter
