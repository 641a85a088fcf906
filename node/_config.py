"""Node configuration: one frozen dataclass, settable from file, environment and flags.

Precedence: command-line flag > environment variable (``GEOFED_<FIELD>``) >
config file (JSON, ``--config`` / ``GEOFED_CONFIG``) > default. Values are
validated once, at start, and a bad one raises `InvalidInput` naming the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from geofed.routing import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_VERTICES,
    STRATEGIES,
    AdaptiveConfig,
    InvalidInput,
    StrategyTable,
    parse_scheme,
)

ENV_PREFIX = "GEOFED_"
CLIENT_PORT = 7400
"""Default port of the client gRPC service."""
PEER_PORT = 7401
"""Default port of the federation (broker-to-broker) gRPC service."""
METRICS_PORT = 9400
"""Default port of the Prometheus /metrics endpoint."""
MQTT_PORT = 1883
"""The registered MQTT port (8883 with TLS); the listener is off unless `mqtt_listen` is set."""
MQTT_WS_PORT = 8083
"""The MQTT-over-WebSocket port the Kubernetes render uses (the listener is off unless set)."""
HTTP_PORT = 8400
"""Suggested port of the HTTP bridge and web map; off unless `http_listen` is set."""
REQUIRED = ("broker_id", "federation")
"""Settings without a default: flag, environment or file must give them."""
LOG_LEVELS = ("debug", "info", "warning", "error")
SYNC_MODES = ("normal", "full", "off")
CLIENT_AUTH = ("none", "cert", "token")
"""`store_sync` values: SQLite's ``synchronous`` pragma in WAL mode."""
STORE_CACHE_KIB = 512
"""Default `store_cache_kib` (SQLite's own default is 2,000 KiB; node/_store.py `Store`)."""


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass(frozen=True)
class NodeConfig:
    """Everything one broker node needs to run."""

    broker_id: str = _doc("this broker's id in the federation file", default="")
    federation: str = _doc("path of the federation file (GeoJSON)", default="")
    strategy: str = _doc(
        "routing strategy of topics no strategy_table entry names, the same on every broker",
        default="event-geofence",
    )
    strategy_table: str = _doc(
        "JSON object topic filter -> strategy: the per-topic table every broker starts"
        " from (epoch 0, the same on every broker); `geofed strategy set` changes it",
        default="",
    )
    strategy_admins: str = _doc(
        "with client authentication: identities or groups (comma-separated) that may"
        " change the strategy table; without authentication anyone may",
        default="",
    )
    adaptive: str = _doc(
        "'on': the adaptive controller switches topic keys' strategies by the cost model"
        " (each broker measures its share of every window, the sequencer decides;"
        " docs/design.md §13); 'off': the table changes only when asked. The same on every"
        " broker",
        default="off",
    )
    adaptive_config: str = _doc(
        "JSON object of the controller's settings, the fields of the routing core's"
        " AdaptiveConfig (window_s in seconds, hysteresis, min_saving, dwell_windows,"
        " horizon_windows, average_windows, key_levels, max_keys, idle_windows, candidates);"
        " a field left out keeps its default",
        default="",
    )
    client_listen: str = _doc(
        "host:port of the client gRPC service", default=f"0.0.0.0:{CLIENT_PORT}"
    )
    peer_listen: str = _doc(
        "host:port of the federation gRPC service", default=f"0.0.0.0:{PEER_PORT}"
    )
    metrics_listen: str = _doc(
        "host:port of the Prometheus /metrics endpoint", default=f"0.0.0.0:{METRICS_PORT}"
    )
    trace_path: str = _doc("node message trace file (JSON Lines); empty = off", default="")
    log_level: str = _doc("debug, info, warning or error", default="info")
    max_payload_bytes: int = _doc("largest accepted event payload", default=1_048_576)
    max_geofence_vertices: int = _doc(
        "most vertices one geofence may have", default=DEFAULT_MAX_VERTICES
    )
    max_geofence_bytes: int = _doc(
        "largest geofence text (WKT or GeoJSON, UTF-8 bytes), refused before it is parsed",
        default=DEFAULT_MAX_BYTES,
    )
    max_publish_batch: int = _doc("most events one PublishStream call may carry", default=100_000)
    peer_queue_size: int = _doc(
        "messages queued per peer before new ones are dropped", default=100_000
    )
    peer_queue_bytes: int = _doc(
        "bytes of messages queued in memory per peer (estimated); beyond, new ones are dropped,"
        " or, with a data_dir, left in the store's outbox and read back in order",
        default=256 << 20,
    )
    node_queue_bytes: int = _doc(
        "bytes queued in memory across all subscriber streams and peer queues of the node;"
        " beyond, each queue applies its own overflow policy as if it were full",
        default=1 << 30,
    )
    subscriber_queue_size: int = _doc(
        "deliveries queued per subscription before the oldest is dropped", default=10_000
    )
    batch_max_messages: int = _doc("most messages per frame to a peer", default=512)
    batch_max_delay_ms: float = _doc("longest a message waits for its frame to fill", default=2.0)
    reconnect_initial_s: float = _doc("first reconnect delay to a peer", default=0.05)
    reconnect_max_s: float = _doc(
        "longest reconnect delay (exponential backoff, jittered)", default=5.0
    )
    peer_heartbeat_s: float = _doc("an idle peer link sends an empty frame this often", default=5.0)
    peer_timeout_s: float = _doc(
        "a peer link that received nothing for this long is closed and redialled; 0 = never",
        default=20.0,
    )
    dedup_window: int = _doc(
        "recent event ids remembered per peer (and of local publishes) to drop duplicates;"
        " ~10 MiB per 100,000, allocated at start for each of the 1 + peers windows",
        default=100_000,
    )
    wan_latency: str = _doc(
        "inter-broker delay: 'off', 'model' (per km) or a latency matrix file", default="off"
    )
    wan_ms_per_km: float = _doc(
        "delay per km of great-circle distance when wan_latency=model", default=0.021
    )
    shutdown_grace_s: float = _doc("how long shutdown waits for in-flight work", default=5.0)
    data_dir: str = _doc(
        "directory of the durable store (SQLite, WAL): the peer outbox, persistent sessions"
        " and their queued deliveries, forwarded subscriptions; empty = memory only",
        default="",
    )
    store_sync: str = _doc(
        "when a store commit reaches the disk: 'normal' (survives a killed process, not a"
        " power loss), 'full' (fsync every commit) or 'off'",
        default="normal",
    )
    store_max_bytes: int = _doc(
        "most bytes the store's database may grow to (0 = no limit); a full store refuses"
        " publishes (UNAVAILABLE) rather than acknowledge what it cannot keep",
        default=0,
    )
    store_cache_kib: int = _doc(
        "SQLite page cache of the store's database, in KiB: its resident memory grows to"
        " this as the file grows (over the first minutes to hours) and stays there; with"
        " data_dir only",
        default=STORE_CACHE_KIB,
    )
    max_session_expiry_s: float = _doc(
        "longest a persistent session is kept without an open stream (clients ask for less)",
        default=86_400.0,
    )
    session_idle_s: float = _doc(
        "a non-persistent session without subscriptions is forgotten after this long",
        default=600.0,
    )
    handover_hold_s: float = _doc(
        "make before break: a client that moves out of the area and asks for it is matched"
        " here until it leaves (its subscriptions stand at its new broker), for at most this"
        " long (0 = withdraw at once)",
        default=10.0,
    )
    session_queue_bytes: int = _doc(
        "bytes of unacknowledged deliveries kept per persistent subscription; beyond, the"
        " oldest are dropped",
        default=64 << 20,
    )
    subscriber_queue_bytes: int = _doc(
        "bytes of deliveries buffered in memory per subscriber stream before the oldest is"
        " dropped (a persistent subscription reads them back from the store instead)",
        default=16 << 20,
    )
    subscriber_batch_max: int = _doc(
        "most deliveries per message on a subscriber stream (clients that read batches)",
        default=512,
    )
    subscriber_batch_delay_ms: float = _doc(
        "right after a subscriber stream sent a message, how long the next one may wait to"
        " fill (0: send what is queued at once; measured faster, bench/results/brokers.md)",
        default=0.0,
    )
    subscriber_backpressure_ms: float = _doc(
        "longest a local publish waits for a plain subscriber stream that is more than half"
        " full to drain before its oldest deliveries may be dropped; a stream that did not"
        " drain in time is not waited for again until it has (0: never wait)",
        default=1000.0,
    )
    tls_dir: str = _doc(
        "folder with ca.pem, cert.pem and key.pem (as `geofed certs` writes per broker): the"
        " peer port requires mutual TLS, the client port serves TLS; empty = plaintext",
        default="",
    )
    client_auth: str = _doc(
        "how clients authenticate: 'none', 'cert' (a client certificate from the CA) or"
        " 'token' (a JWT as 'authorization: Bearer'); cert and token need tls_dir",
        default="none",
    )
    token_key: str = _doc("PEM public key (or certificate) that signs client tokens", default="")
    token_jwks: str = _doc("JWKS file with the keys that sign client tokens", default="")
    token_audience: str = _doc("when set, client tokens must name it in 'aud'", default="")
    token_issuer: str = _doc("when set, client tokens must have this 'iss'", default="")
    policy_file: str = _doc(
        "authorization policy (TOML; docs/security.md), reloaded when it changes; empty ="
        " every client may publish and subscribe anything",
        default="",
    )
    reflection: str = _doc("gRPC server reflection on both ports: 'on' or 'off'", default="on")
    health_listen: str = _doc(
        "host:port of a plaintext port serving only gRPC health (probes of a TLS node, e.g."
        " the kubelet's); empty = off",
        default="",
    )
    mqtt_listen: str = _doc(
        "host:port of the MQTT 3.1.1/5.0 listener (TLS with tls_dir; docs/mqtt.md), e.g."
        f" 0.0.0.0:{MQTT_PORT}; empty = off",
        default="",
    )
    mqtt_ws_listen: str = _doc(
        "host:port of the MQTT-over-WebSocket listener for browsers (path /mqtt, subprotocol"
        f" mqtt; wss with tls_dir; docs/mqtt.md), e.g. 0.0.0.0:{MQTT_WS_PORT}; empty = off",
        default="",
    )
    mqtt_connect_timeout_s: float = _doc(
        "an MQTT connection that sends no CONNECT within this time is closed", default=10.0
    )
    http_listen: str = _doc(
        "host:port of the HTTP bridge (REST publish, history, Server-Sent Events, the web map;"
        f" TLS with tls_dir), e.g. 0.0.0.0:{HTTP_PORT}; empty = off",
        default="",
    )
    http_max_url_bytes: int = _doc(
        "longest HTTP request target (path and query, as sent) the bridge reads; longer ones"
        " are refused with 400 naming 'query'",
        default=65_536,
    )
    http_map_tiles: str = _doc(
        "tile URL template for the web map's background (e.g. https://host/{z}/{x}/{y}.png);"
        " empty = the bundled world outline only (works offline)",
        default="",
    )
    client_keepalive_s: float = _doc(
        "ping idle client connections this often; one that does not answer within the same"
        " time is closed, ending its streams (0 = off)",
        default=30.0,
    )
    history: str = _doc(
        "log every event published here for history queries: 'on' or 'off'", default="on"
    )
    history_retention_s: float = _doc(
        "history entries older than this are no longer answered and are deleted (0 = kept"
        " until history_max_bytes removes them)",
        default=604_800.0,
    )
    history_max_bytes: int = _doc(
        "most bytes of history entries kept (payload, texts, 64 bytes each); beyond, the"
        " oldest are deleted",
        default=64 << 20,
    )
    history_dsn: str = _doc(
        "PostgreSQL/PostGIS connection string for the history (postgresql://...); empty ="
        " SQLite history.db in data_dir (in memory without one)",
        default="",
    )
    history_max_rows: int = _doc("the largest limit a history query may ask for", default=10_000)
    history_max_answer_bytes: int = _doc(
        "most bytes of entries in one history answer (fits the client's 4 MiB message"
        " limit); a longer answer is cut and marked truncated",
        default=4_000_000,
    )
    history_timeout_s: float = _doc(
        "how long a broker waits for another broker's share of a history query", default=10.0
    )
    filter_scheme: str = _doc(
        "how local subscriptions are matched: 'exact' (the match predicate), or the"
        " approximate 'rgrid' (H3 cells covering the subscription geofence: nothing missed,"
        " some extra) or 'grid' (one cell: some missed, some extra); docs/design.md §14",
        default="exact",
    )
    filter_scheme_rgrid_at: int = _doc(
        "local subscriptions from which the broker switches to 'rgrid' (back below nine tenths"
        " of it); 0 = never",
        default=0,
    )
    filter_scheme_grid_at: int = _doc(
        "local subscriptions from which the broker switches to 'grid' (back below nine tenths"
        " of it); 0 = never",
        default=0,
    )
    filter_scheme_audit_every: int = _doc(
        "under an approximate scheme, run the exact matcher beside it on one event in this"
        " many, for the recall metric",
        default=16,
    )

    def __post_init__(self) -> None:
        if not self.broker_id:
            raise InvalidInput("broker_id", "is required (flag --broker-id or GEOFED_BROKER_ID)")
        if not self.federation:
            raise InvalidInput("federation", "is required (flag --federation or GEOFED_FEDERATION)")
        if self.strategy not in STRATEGIES:
            raise InvalidInput(
                "strategy", f"unknown {self.strategy!r}; one of {', '.join(STRATEGIES)}"
            )
        self.initial_table()  # raises naming strategy_table
        if self.adaptive not in ("on", "off"):
            raise InvalidInput("adaptive", f"'on' or 'off', got {self.adaptive!r}")
        self.adaptive_settings()  # raises naming adaptive_config.<field>
        for name in ("client_listen", "peer_listen", "metrics_listen"):
            _check_listen(name, getattr(self, name))
        for name in ("health_listen", "mqtt_listen", "mqtt_ws_listen", "http_listen"):
            if getattr(self, name):
                _check_listen(name, getattr(self, name))
        if self.log_level not in LOG_LEVELS:
            raise InvalidInput(
                "log_level", f"one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}"
            )
        for name in (
            "max_payload_bytes",
            "max_geofence_vertices",
            "max_geofence_bytes",
            "max_publish_batch",
            "peer_queue_size",
            "subscriber_queue_size",
            "batch_max_messages",
            "dedup_window",
            "session_queue_bytes",
            "subscriber_queue_bytes",
            "peer_queue_bytes",
            "node_queue_bytes",
            "http_max_url_bytes",
            "history_max_bytes",
            "history_max_rows",
            "history_max_answer_bytes",
            "store_cache_kib",
            "subscriber_batch_max",
            "filter_scheme_audit_every",
        ):
            if getattr(self, name) < 1:
                raise InvalidInput(name, f"must be >= 1, got {getattr(self, name)!r}")
        for name in (
            "batch_max_delay_ms",
            "reconnect_initial_s",
            "wan_ms_per_km",
            "peer_timeout_s",
            "shutdown_grace_s",
            "max_session_expiry_s",
            "session_idle_s",
            "handover_hold_s",
            "store_max_bytes",
            "client_keepalive_s",
            "mqtt_connect_timeout_s",
            "history_retention_s",
            "subscriber_batch_delay_ms",
            "subscriber_backpressure_ms",
        ):
            if getattr(self, name) < 0:
                raise InvalidInput(name, f"must be >= 0, got {getattr(self, name)!r}")
        parse_scheme(self.filter_scheme)
        for name in ("filter_scheme_rgrid_at", "filter_scheme_grid_at"):
            if getattr(self, name) < 0:
                raise InvalidInput(name, f"must be >= 0 (0 = never), got {getattr(self, name)!r}")
        # Load moves a broker to cheaper schemes only: exact -> rgrid -> grid.
        cheaper = {"exact": ("rgrid", "grid"), "rgrid": ("grid",), "grid": ()}[self.filter_scheme]
        for name in ("filter_scheme_rgrid_at", "filter_scheme_grid_at"):
            target = name.split("_")[2]
            if getattr(self, name) and target not in cheaper:
                raise InvalidInput(
                    name,
                    f"switches to {target!r}, not cheaper than {self.filter_scheme!r}",
                )
        if 0 < self.filter_scheme_grid_at <= self.filter_scheme_rgrid_at:
            raise InvalidInput(
                "filter_scheme_grid_at",
                f"must be above filter_scheme_rgrid_at ({self.filter_scheme_rgrid_at})",
            )
        if self.client_auth not in CLIENT_AUTH:
            raise InvalidInput(
                "client_auth", f"one of {', '.join(CLIENT_AUTH)}, got {self.client_auth!r}"
            )
        if self.client_auth != "none" and not self.tls_dir:
            raise InvalidInput("client_auth", f"{self.client_auth!r} needs tls_dir")
        if self.client_auth == "token" and bool(self.token_key) == bool(self.token_jwks):
            raise InvalidInput(
                "token_key", "client_auth 'token' needs one of token_key, token_jwks"
            )
        if self.history not in ("on", "off"):
            raise InvalidInput("history", f"'on' or 'off', got {self.history!r}")
        if not self.history_timeout_s > 0:
            raise InvalidInput("history_timeout_s", f"must be > 0, got {self.history_timeout_s!r}")
        if self.reflection not in ("on", "off"):
            raise InvalidInput("reflection", f"'on' or 'off', got {self.reflection!r}")
        if self.store_sync not in SYNC_MODES:
            raise InvalidInput(
                "store_sync", f"one of {', '.join(SYNC_MODES)}, got {self.store_sync!r}"
            )
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise InvalidInput("reconnect_max_s", "must be >= reconnect_initial_s")
        if not self.peer_heartbeat_s > 0:
            raise InvalidInput("peer_heartbeat_s", f"must be > 0, got {self.peer_heartbeat_s!r}")
        if self.peer_timeout_s and not self.peer_timeout_s >= 2 * self.peer_heartbeat_s:
            raise InvalidInput(
                "peer_timeout_s",
                f"must be 0 (off) or at least twice peer_heartbeat_s ({self.peer_heartbeat_s:g}),"
                f" got {self.peer_timeout_s!r}",
            )

    def initial_table(self) -> StrategyTable:
        """The strategy table of epoch 0: `strategy` as default, `strategy_table`'s entries.

        Raises:
            InvalidInput: naming ``strategy_table`` (and the bad entry).
        """
        return StrategyTable.from_json(self.strategy, self.strategy_table, "strategy_table")

    def adaptive_digest(self) -> str:
        """What the hello says of the controller (``adaptive`` and its settings), so that
        brokers that would decide differently refuse each other's links: "off", or "on "
        followed by the settings as canonical JSON (defaults filled in)."""
        if self.adaptive != "on":
            return "off"
        return "on " + json.dumps(asdict(self.adaptive_settings()), sort_keys=True)

    def adaptive_settings(self) -> AdaptiveConfig:
        """`adaptive_config` as the routing core's `AdaptiveConfig` (defaults for fields left out).

        Raises:
            InvalidInput: naming ``adaptive_config`` or ``adaptive_config.<field>``.
        """
        if not self.adaptive_config:
            return AdaptiveConfig()
        try:
            values = json.loads(self.adaptive_config)
        except json.JSONDecodeError as exc:
            raise InvalidInput("adaptive_config", f"not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise InvalidInput("adaptive_config", "must be a JSON object: field -> value")
        known = {f.name for f in fields(AdaptiveConfig)}
        for key in values:
            if key not in known:
                raise InvalidInput(
                    f"adaptive_config.{key}", f"unknown field; one of {', '.join(sorted(known))}"
                )
        if isinstance(values.get("candidates"), list):
            values["candidates"] = tuple(values["candidates"])
        try:
            return AdaptiveConfig(**values)
        except InvalidInput as exc:
            raise exc.within("adaptive_config") from None

    def strategy_admin_names(self) -> frozenset[str]:
        """`strategy_admins` as a set of identities and groups."""
        return frozenset(n.strip() for n in self.strategy_admins.split(",") if n.strip())

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        config_file: str | None = None,
    ) -> NodeConfig:
        """Merge file, environment and explicit overrides (flags), then validate."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        path = config_file or env.get(ENV_PREFIX + "CONFIG", "")
        if path:
            values.update(_read_file(path))
        for f in fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None and raw != "":
                values[f.name] = _coerce(f, raw, f"{ENV_PREFIX}{f.name.upper()}")
        for key, value in (overrides or {}).items():
            if value is not None:
                values[key] = value
        return cls(**values)

    def describe(self) -> dict[str, Any]:
        """The effective configuration (for the start-up log line)."""
        return dataclasses.asdict(self)


def _check_listen(name: str, value: str) -> None:
    _, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidInput(name, f"must be 'host:port' (port 0 = any free port), got {value!r}")


def _coerce(f: dataclasses.Field[Any], raw: Any, where: str) -> Any:
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except (TypeError, ValueError):
        raise InvalidInput(f.name, f"{where}: expected a number, got {raw!r}") from None
    return str(raw)


def _read_file(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidInput("config", f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InvalidInput("config", f"{path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise InvalidInput("config", f"{path} must hold a JSON object")
    known = {f.name: f for f in fields(NodeConfig)}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise InvalidInput(key, f"unknown setting in {path}")
        out[key] = _coerce(known[key], value, path)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--kebab-case`` flag per config field (default: not given)."""
    parser.add_argument("--config", help="JSON config file (GEOFED_CONFIG)")
    for f in fields(NodeConfig):
        kind = f.type if isinstance(f.type, str) else "str"
        conv = {"int": int, "float": float}.get(kind, str)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=conv,
            default=None,
            help=f"{f.metadata['doc']} (env {ENV_PREFIX}{f.name.upper()}; "
            + ("required)" if f.name in REQUIRED else f"default {f.default!r})"),
        )


def from_args(args: argparse.Namespace) -> NodeConfig:
    """Build the config from parsed flags plus environment and file."""
    overrides = {f.name: getattr(args, f.name, None) for f in fields(NodeConfig)}
    return NodeConfig.load(overrides, config_file=args.config)
