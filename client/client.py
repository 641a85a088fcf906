"""The geofed client: publish and subscribe at the broker of your region.

::

    import geofed

    client = await geofed.connect(federation="three", client_id="c1",
                                  location=geofed.LatLon(48.85, 2.35))
    async with client:
        sub = await client.subscribe("sensors/+/temp", geofence="POLYGON((...))")
        await client.publish("sensors/paris/temp", b"21.5")
        async for msg in sub:
            ...

`connect` finds the broker responsible for the client's location (from the
federation file, or by asking any broker, which answers with a redirect) and
opens a session there. `Client.move` reports a new location; when it leaves
the broker's area the client follows the redirect and re-establishes every
subscription at the new broker, with the same `Subscription` objects.

A handover makes before it breaks: the old broker keeps matching for the
client (at its last location there) until every subscription stands at the
new broker and the peers that route for it have applied the renewal; then
the client leaves the old broker, which lets go once what its peers had
sent it is delivered. What it can still miss (the federation is exact only
between moves): until the renewals stand, an event whose geofence covers the
new place but not the old one, and what a wait cut short by its bound lets
through (docs/design.md §7). Nothing is delivered twice: an event that
reaches the client through both brokers is handed over once.

Persistent sessions (``session_expiry_s`` > 0): the broker keeps the
client's subscriptions while no stream is open, for that long, and queues
their deliveries (in its store, when it has one); each delivery carries an
offset. A renewed subscription resumes after the last offset it received, and
the client acknowledges what the application has taken, so the broker forgets
it. `Client.close` then leaves the subscriptions at the broker (a client that
connects again with the same id and subscription ids resumes them), and
publishing retries a broker that is unavailable with the same event id (the
broker drops an id it already published), so an acknowledged publish is
delivered at least once and a retried one at most once per broker. A move
takes the queues along: the old broker hands what the client has not
acknowledged to the new one, which queues it with offsets of its own.

Every failure is a `geofed.GeofedError` subclass (`geofed.errors`), never a
raw ``grpc.RpcError``: input the broker rejects raises the same
`InvalidInput` / `TooLarge` it raised, with its field name.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import random
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from geofed.errors import (
    ERROR_METADATA_KEY,
    ClientClosed,
    DeadlineExceeded,
    GeofedError,
    InvalidInput,
    StorageFailed,
    Unavailable,
    from_rpc_error,
)
from geofed.routing import (
    Federation,
    HistoryAnswer,
    LatLon,
    latlon,
    new_event_id,
    read_input_file,
    validate_id,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.wire import (
    BATCH_METADATA,
    BROKER_METADATA,
    GeofenceInput,
    Message,
    PeerGeofenceCache,
    Publication,
    ack_request,
    connect_request,
    deliveries_in,
    get_strategy_request,
    health_check_request,
    history_record_from_pb,
    history_request,
    leave_request,
    message_from_pb,
    publish_batch,
    publish_request,
    set_strategy_request,
    strategy_state_from_pb,
    subscribe_request,
    unsubscribe_request,
    update_location_request,
)

T = TypeVar("T")
_log = logging.getLogger("geofed.client")

DEFAULT_PENDING_LIMIT = 10_000
"""Deliveries a subscription buffers before it drops the oldest."""
DEFAULT_BATCH_SIZE = 1_000
"""Events per batch message of `Client.publish_many`."""
_DEDUP_WINDOW = 4_096  # recent event ids per subscription: covers a handover's overlap
_MOVED = grpc.StatusCode.FAILED_PRECONDITION  # how a broker ends the streams of a client that left
# gRPC's own reconnect backoff grows to 120 s while a broker is down, and calls
# fail fast meanwhile: a restarted broker would stay unreachable for longer than
# any retry budget. `RetryConfig` paces the retries; keep the channel's short.
# (Not grpc.min_reconnect_backoff_ms: it is also the connect timeout.)
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL)
_ACK_DELAY_S = (
    0.05  # acknowledgements of a persistent subscription are sent this much later, batched
)
_RETRIED = (Unavailable, StorageFailed)  # the broker did not take the request: try it again


@dataclass(frozen=True)
class RetryConfig:
    """How requests retry a broker that is down (or whose store refused a write).

    Publishing is retried too: each event carries an id made by the client
    (when the application gives none), and the broker drops an id it already
    published, so a retry after a lost answer delivers nothing twice.
    """

    attempts: int = 10
    """Tries per request, the first included (1 = no retry): the default outlasts a broker's
    restart (about 10 s of backoff)."""
    initial_backoff_s: float = 0.1
    """Wait before the first retry; doubled after each, with full jitter."""
    max_backoff_s: float = 2.0
    """Longest wait between two tries."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise InvalidInput("retry.attempts", f"must be >= 1, got {self.attempts!r}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise InvalidInput("retry.initial_backoff_s", "must be > 0 and <= retry.max_backoff_s")


@dataclass(frozen=True)
class TLSConfig:
    """TLS towards brokers that serve it (node setting ``tls_dir``)."""

    ca_file: str = ""
    """PEM file of the authority that signed the broker certificates (default: the system's)."""
    cert_file: str = ""
    """PEM client certificate, for brokers that authenticate clients by certificate."""
    key_file: str = ""
    """PEM private key of `cert_file`."""
    server_name: str = ""
    """Name to verify in the broker certificate (default: the endpoint's host)."""

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidInput("tls.key_file", "give both cert_file and key_file, or neither")

    def credentials(self, token: str = "") -> grpc.ChannelCredentials:
        """Channel credentials from the files as they are now (and a bearer token).

        Raises:
            InvalidInput: naming the file that cannot be read.
        """
        ca, cert, key = (
            read_input_file(path, f"tls.{name}") if path else None
            for name, path in (
                ("ca_file", self.ca_file),
                ("cert_file", self.cert_file),
                ("key_file", self.key_file),
            )
        )
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        if token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token)
            )
        return creds

    def options(self) -> list[tuple[str, Any]]:
        """Channel options (the name to verify, when given)."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


@dataclass(frozen=True)
class ClientConfig:
    """Everything `connect` needs; give exactly one of `federation` and `endpoint`."""

    client_id: str
    """This client's id, unique in the federation (keys its session and subscriptions)."""
    location: LatLon
    """Where the client is; decides its broker and the geofence checks."""
    federation: str | Path | Federation | None = None
    """Federation file, bundled name (``aws-2020``, ``three``) or a loaded one: finds the broker."""
    endpoint: str | None = None
    """``host:port`` of any broker's client service: the broker redirects to the right one."""
    connect_timeout_s: float = 10.0
    """How long opening a session may take (each try)."""
    request_timeout_s: float = 30.0
    """How long any other request may take before `DeadlineExceeded`."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    """Retries of idempotent requests when a broker is unavailable."""
    pending_limit: int = DEFAULT_PENDING_LIMIT
    """Deliveries buffered per subscription; when full, the oldest is dropped and counted."""
    max_redirects: int = 8
    """Redirects followed while opening a session before giving up."""
    tls: TLSConfig | None = None
    """TLS towards the brokers (None: plaintext)."""
    token: str = ""
    """Bearer token (a JWT) for brokers that authenticate clients by token; needs `tls`."""
    session_expiry_s: float = 0.0
    """> 0: a persistent session, kept this long by the broker while no stream is open (see
    the module docs); the broker may grant less. 0: subscriptions end with their streams."""

    def __post_init__(self) -> None:
        validate_id(self.client_id, "client_id")
        if not isinstance(self.location, LatLon):
            raise InvalidInput("location", "must be a geofed.LatLon (build it with geofed.latlon)")
        latlon(self.location.lat, self.location.lon, "location")
        if (self.federation is None) == (self.endpoint is None):
            raise InvalidInput("federation", "give exactly one of federation and endpoint")
        for name in ("connect_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidInput(name, f"must be > 0, got {getattr(self, name)!r}")
        if not self.session_expiry_s >= 0:
            raise InvalidInput("session_expiry_s", f"must be >= 0, got {self.session_expiry_s!r}")
        for name in ("pending_limit", "max_redirects"):
            if getattr(self, name) < 1:
                raise InvalidInput(name, f"must be >= 1, got {getattr(self, name)!r}")
        if self.token and self.tls is None:
            raise InvalidInput("token", "a token is only sent over TLS: set tls too")


class Channels:
    """gRPC channels by broker endpoint, shareable by many clients of one process.

    A `Client` makes its own unless it is given one; a load generator or a
    trace replay running thousands of clients shares one, so that each broker
    is one connection, and closes it when they are all done. Every channel
    uses the same TLS settings and token (those of the clients sharing it).
    """

    def __init__(self, tls: TLSConfig | None = None, token: str = "") -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, cpb_grpc.ClientServiceStub] = {}
        self._tls = tls
        self._token = token

    def get(self, endpoint: str) -> grpc.aio.Channel:
        """The channel to `endpoint` (opened on first use)."""
        channel = self._channels.get(endpoint)
        if channel is None:
            channel = open_channel(endpoint, self._tls, self._token)
            self._channels[endpoint] = channel
        return channel

    def stub(self, endpoint: str) -> cpb_grpc.ClientServiceStub:
        """The client service at `endpoint`, over its channel (made once: a stub
        builds a callable per method)."""
        stub = self._stubs.get(endpoint)
        if stub is None:
            stub = self._stubs[endpoint] = cpb_grpc.ClientServiceStub(self.get(endpoint))
        return stub

    async def close(self) -> None:
        """Close every channel (idempotent)."""
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            await channel.close(grace=None)


async def connect(
    config: ClientConfig | None = None, *, channels: Channels | None = None, **settings: Any
) -> Client:
    """Open a session at the broker responsible for the client's location.

    Args:
        config: the settings; or give them as keywords (`ClientConfig` fields).
        channels: connections shared with other clients (closed by their owner).

    Raises:
        InvalidInput: a setting is wrong (named), or the broker rejected it.
        Unavailable: no broker could be reached (after `RetryConfig.attempts`).
    """
    if config is None:
        config = ClientConfig(**settings)
    elif settings:
        raise InvalidInput("settings", "give a ClientConfig or keyword settings, not both")
    client = Client(config, channels)
    try:
        await client._open()
    except BaseException:
        await client.close()
        raise
    return client


class Client:
    """A session at the local broker. Make one with `connect`; close it (or use ``async with``)."""

    def __init__(self, config: ClientConfig, channels: Channels | None = None) -> None:
        self.config = config
        fed = config.federation
        self._federation = (
            fed if isinstance(fed, Federation) else None if fed is None else Federation.load(fed)
        )
        self._location = config.location
        self._broker_id = ""
        self._endpoint = ""
        self._own_channels = channels is None
        self._channels = Channels(config.tls, config.token) if channels is None else channels
        self._subs: dict[str, Subscription] = {}
        self._publishing: _PublishCall | None = None  # `publish`'s open call
        self._retired: set[_PublishCall] = set()  # earlier ones still answering
        self._lock = asyncio.Lock()  # session changes (open, move) and subscription renewals
        self._closed = False
        self._closing = False
        self.session_expiry_s = 0.0
        """The session expiry the broker granted (0: not a persistent session)."""
        self.redirects = 0
        """Redirects followed so far (opening the session and moves)."""

    # -- what the application sees -------------------------------------------

    @property
    def client_id(self) -> str:
        """This client's id."""
        return self.config.client_id

    @property
    def location(self) -> LatLon:
        """The location last reported to the broker."""
        return self._location

    @property
    def broker_id(self) -> str:
        """Id of the broker the session is at."""
        return self._broker_id

    @property
    def endpoint(self) -> str:
        """Client endpoint (``host:port``) of that broker."""
        return self._endpoint

    @property
    def subscriptions(self) -> list[Subscription]:
        """The live subscriptions."""
        return list(self._subs.values())

    async def publish(
        self,
        topic: str,
        payload: bytes | str = b"",
        *,
        geofence: GeofenceInput = None,
        event_id: str = "",
    ) -> str:
        """Publish one event at the client's location; returns its id.

        Args:
            topic: topic name (``/``-separated levels, no wildcards).
            payload: bytes, or text (sent as UTF-8).
            geofence: the event geofence, where subscribers must be (None: the
                world): a `geofed.Geofence`, WKT or GeoJSON text, or a circle
                ``{"circle": {"lat": ..., "lon": ..., "radius_m": ...}}``.
            event_id: a globally unique id; empty: the client makes one (a UUID).

        Returns once the broker accepted it (durably, if it has a store).
        A client's publishes share one open call to its broker: concurrent
        ones are published, and answered, in the order they were made.
        """
        pub = Publication(
            topic, _bytes(payload), self._location, geofence, event_id or new_event_id()
        )
        request = publish_request(self.client_id, pub)
        return await self._call(
            "publish",
            lambda stub, timeout: self._publish_call(stub).publish(request, timeout),
        )

    async def publish_many(
        self, events: Iterable[Publication], *, batch_size: int = DEFAULT_BATCH_SIZE
    ) -> list[str]:
        """Publish many events in one streaming call (much faster than `publish` in a loop).

        Each `Publication` carries its own location; one without an id gets
        one made by the client, so that a retry is safe. A batch the broker
        rejects raises its typed error; the batches before it were published.
        Returns the event ids in order.
        """
        if batch_size < 1:
            raise InvalidInput("batch_size", f"must be >= 1, got {batch_size!r}")
        items = [
            p if p.event_id else dataclasses.replace(p, event_id=new_event_id()) for p in events
        ]

        async def batches() -> AsyncIterator[Any]:
            for i in range(0, len(items), batch_size):
                yield publish_batch(self.client_id, items[i : i + batch_size])

        resp = await self._call(
            "publish_many", lambda stub, timeout: stub.PublishStream(batches(), timeout=timeout)
        )
        return list(resp.event_ids)

    async def subscribe(
        self,
        topic_filter: str,
        *,
        geofence: GeofenceInput = None,
        subscription_id: str | None = None,
        pending_limit: int | None = None,
    ) -> Subscription:
        """Subscribe; the returned `Subscription` is an async iterator of `Message`.

        Args:
            topic_filter: MQTT filter (``+`` one level, ``#`` the rest).
            geofence: the subscription geofence, where publishers must be (None: the
                world); a roaming one (``"roam:circle:5000"``, ``{"roaming":
                {"radius_m": 5000}}``, ``{"roaming": {"polygon": [[east_m,
                north_m], ...]}}``) is placed around this client and follows
                every `move`.
            subscription_id: unique in the federation; default: generated.
            pending_limit: deliveries buffered (default `ClientConfig.pending_limit`).

        Returns once the broker holds the subscription: events published
        afterwards at this broker match it.
        """
        self._check_open()
        sub_id = subscription_id or f"{self.client_id}-{uuid.uuid4().hex[:12]}"
        limit = pending_limit if pending_limit is not None else self.config.pending_limit
        if limit < 1:
            raise InvalidInput("pending_limit", f"must be >= 1, got {limit!r}")
        sub = Subscription(self, sub_id, topic_filter, geofence, limit)
        async with self._lock:
            old = self._subs.get(sub_id)
            await self._retrying("subscribe", functools.partial(self._reattach, sub))
            self._subs[sub_id] = sub
        if old is not None:
            old._finish(None)  # the broker ended its stream: the new one took the id over
        return sub

    async def history(
        self,
        topic_filter: str,
        *,
        start: float | None = None,
        end: float | None = None,
        geometry: GeofenceInput = None,
        limit: int = 100,
    ) -> HistoryAnswer:
        """The logged events matching a topic filter, time interval and area, newest first.

        Answered federation-wide by the client's broker: it asks the brokers
        whose areas meet `geometry` (every broker without one) and merges
        their entries (docs/design.md §10). Needs subscribe permission on the
        filter where a policy is in force.

        Args:
            topic_filter: an MQTT topic filter (``+``, ``#``).
            start, end: publish times in unix seconds, both included (None: open).
            geometry: the area publisher locations must lie in (any geofence
                form: WKT, GeoJSON, circle, a `geofed.Geofence`); None: the world.
            limit: the most entries returned (at most the broker's ``history_max_rows``).

        Returns:
            `geofed.HistoryRecord` entries (a list), with `truncated` (the
            broker's answer-size limit cut it) and `brokers` (those asked).
        """
        return await self._history(topic_filter, start, end, geometry, limit, delete=False)

    async def delete_history(
        self,
        topic_filter: str,
        *,
        start: float | None = None,
        end: float | None = None,
        geometry: GeofenceInput = None,
        limit: int = 100,
    ) -> HistoryAnswer:
        """Remove the entries `history` would return with these arguments; returns them.

        Needs publish permission covering the filter where a policy is in
        force. Removes at most `limit` entries (the newest): call again until
        it returns fewer to remove everything that matches. Unlike the other
        requests it is not retried while the broker is unavailable: had the
        lost answer's removal happened, a retry would remove the next entries.
        """
        return await self._history(topic_filter, start, end, geometry, limit, delete=True)

    async def _history(
        self,
        topic_filter: str,
        start: float | None,
        end: float | None,
        geometry: GeofenceInput,
        limit: int,
        *,
        delete: bool,
    ) -> HistoryAnswer:
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit < 2**32:
            raise InvalidInput("limit", f"must be an integer >= 1, got {limit!r}")
        request = history_request(
            topic_filter,
            start=start,
            end=end,
            geometry=geometry,
            limit=limit,
            delete=delete,
            client=self.client_id,
        )
        timeout = self.config.request_timeout_s
        if delete:
            # Not retried: after a lost answer a retry would remove the next entries.
            self._check_open()
            resp = await self._unary(
                "delete_history", self._stub().History(request, timeout=timeout)
            )
        else:
            resp = await self._call(
                "history", lambda stub, timeout: stub.History(request, timeout=timeout)
            )
        cache = PeerGeofenceCache()  # canonical WKT, as the brokers validated it
        return HistoryAnswer(
            (history_record_from_pb(pb, cache, f"events[{i}]") for i, pb in enumerate(resp.events)),
            truncated=resp.truncated,
            brokers=frozenset(resp.brokers),
        )

    async def move(self, location: LatLon) -> bool:
        """Report a new location; returns True if the session moved to another broker.

        A move out of the broker's area follows the redirect: the session opens
        at the responsible broker and every subscription is renewed there,
        before this returns. Make before break: the old broker goes on matching
        for the client until the renewals stand (their peers included), then
        the client leaves it (see the module docs for what a handover can miss).
        """
        self._check_open()
        where = latlon(getattr(location, "lat", None), getattr(location, "lon", None), "location")
        async with self._lock:
            resp = await self._retrying(
                "move",
                lambda: self._unary(
                    "move",
                    self._stub().UpdateLocation(
                        update_location_request(self.client_id, where, hold=True),
                        timeout=self.config.request_timeout_s,
                    ),
                ),
            )
            self._location = where
            if resp.accepted:
                return False
            self.redirects += 1
            # The old broker holds our subscriptions until we leave it (a broker
            # that does not hold, held_s 0, withdrew them already: what is published
            # until the new one holds them is missed). They are renewed all at once
            # (one round trip, not one per subscription).
            left = self._endpoint if resp.held_s > 0 else None
            await self._open_session(*self._redirect_target(resp))
            renewed = await asyncio.gather(
                *(
                    self._retrying("subscribe", functools.partial(self._reattach, sub, True))
                    for sub in list(self._subs.values())
                ),
                return_exceptions=True,
            )
            for outcome in renewed:
                if isinstance(outcome, BaseException):
                    raise outcome
            if left is not None:
                await self._leave(left)
            return True

    async def _leave(self, endpoint: str) -> None:
        """End the handover the broker at `endpoint` holds (best effort: the broker
        withdraws on its own once its hold runs out)."""
        try:
            await self._unary(
                "leave",
                self._channels.stub(endpoint).Leave(
                    leave_request(self.client_id), timeout=self.config.request_timeout_s
                ),
            )
        except GeofedError as exc:
            _log.info(
                "client %s: leaving %s failed (%s); it withdraws within its handover hold",
                self.client_id,
                endpoint,
                exc,
            )

    async def close(self) -> None:
        """End every subscription's iteration and close the connections (idempotent).

        In a plain session the subscriptions are withdrawn: the broker holds
        none of them once this returns (unless it could not be reached: then it
        drops them when it sees the streams end). In a persistent session they
        stay at the broker, which queues their deliveries until the session
        expires or a client with this id subscribes again; each one's last
        acknowledgement is retried like a request (`RetryConfig`), and if it
        never reaches the broker a warning says what the next client with this
        id receives again.
        """
        if self._closed or self._closing:
            return
        self._closing = True  # retries stop; a renewal in progress gives up the lock
        for sub in list(self._subs.values()):
            await sub._stop_recovery()
        async with self._lock:
            subs, self._subs = list(self._subs.values()), {}
            for sub in subs:
                if self.session_expiry_s:
                    await sub._flush_ack(final=True)
                    continue
                with contextlib.suppress(GeofedError):
                    await self._unary(
                        "unsubscribe",
                        self._stub().Unsubscribe(
                            unsubscribe_request(self.client_id, sub.id),
                            timeout=self.config.request_timeout_s,
                        ),
                    )
            self._closed = True
            for sub in subs:
                sub._finish(None)
                await sub._detach()
                await sub._stop_draining()
            calls = [*self._retired, *([self._publishing] if self._publishing else [])]
            self._publishing, self._retired = None, set()
            for call in calls:
                await call.close()
        if self._own_channels:
            await self._channels.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- session ---------------------------------------------------------------

    async def _open(self) -> None:
        async with self._lock:
            if self._federation is not None:
                home = self._federation.broker(self._federation.responsible(self._location))
                if not home.client_endpoint:
                    raise InvalidInput(
                        "federation",
                        f"broker {home.id} has no client_endpoint in the federation file",
                    )
                await self._open_session(home.id, home.client_endpoint)
            else:
                assert self.config.endpoint is not None
                await self._open_session("", self.config.endpoint)

    async def _open_session(self, broker_id: str, endpoint: str) -> None:
        """Connect at `endpoint`, following redirects, and make it the session's broker."""
        for _ in range(self.config.max_redirects + 1):
            self._broker_id, self._endpoint = broker_id, endpoint
            resp = await self._retrying(
                "connect",
                lambda: self._unary(
                    "connect",
                    self._stub().Connect(
                        connect_request(
                            self.client_id, self._location, self.config.session_expiry_s
                        ),
                        timeout=self.config.connect_timeout_s,
                    ),
                    self.config.connect_timeout_s,
                ),
            )
            if resp.accepted:
                self._broker_id = resp.broker_id
                self.session_expiry_s = resp.session_expiry_s
                if not resp.session_present:
                    # A new session: offsets from an earlier one mean nothing here.
                    for sub in self._subs.values():
                        sub._reset_offsets()
                return
            self.redirects += 1
            broker_id, endpoint = self._redirect_target(resp)
        raise GeofedError(
            f"client {self.client_id}: more than {self.config.max_redirects} redirects"
        )

    def _redirect_target(self, resp: Any) -> tuple[str, str]:
        """(broker id, client endpoint) a redirect points at; the federation fills a gap."""
        broker_id, endpoint = resp.redirect.broker_id, resp.redirect.endpoint
        if not endpoint and self._federation is not None:
            endpoint = self._federation.broker(broker_id).client_endpoint
        if not endpoint:
            raise Unavailable("", f"broker {broker_id} is responsible but has no client endpoint")
        return broker_id, endpoint

    async def _reattach(self, sub: Subscription, moved: bool = False) -> None:
        await sub._attach(self._broker_id, self._stub(), moved)

    async def _renew(self, sub: Subscription) -> None:
        """Re-establish `sub` after its stream broke (the broker restarted, say)."""
        async with self._lock:
            if self._closed or self._subs.get(sub.id) is not sub:
                return
            await self._open_session(self._broker_id, self._endpoint)
            await self._reattach(sub)

    # -- calls -------------------------------------------------------------------

    async def set_strategy(self, topic_filter: str, strategy: str | None) -> dict[str, Any]:
        """Route the topics of `topic_filter` by `strategy`, federation-wide (None: unpin).

        The client's broker proposes the change; the sequencer numbers it and
        every broker carries it out with state transfer — no subscriber
        resubscribes, and no event is lost or delivered twice meanwhile
        (docs/design.md §3). Answers once the sequencer has numbered the
        change (``newest`` has the entry), before the transition is done:
        `strategy_table` tells when (``in_transition`` false, ``table`` with
        the entry). A change lost on its way to the sequencer is asked for
        again (`RetryConfig`). Needs `strategy_admins` membership when the broker
        authenticates clients.

        Returns:
            The broker's view: ``broker``, ``sequencer``, ``in_transition``,
            ``table`` (what it routes by) and ``newest`` (the newest it knows),
            tables as ``{"epoch", "default", "entries": [{"topic_filter", "strategy"}]}``.

        Raises:
            InvalidInput: naming ``topic_filter`` or ``strategy``.
            Unavailable: the sequencer (or one of its links) is down.
        """
        request = set_strategy_request(topic_filter, strategy)
        resp = await self._call(
            "set_strategy", lambda stub, timeout: stub.SetStrategy(request, timeout=timeout)
        )
        return strategy_state_from_pb(resp)

    async def strategy_table(self) -> dict[str, Any]:
        """The client's broker's strategy table and transition state (as `set_strategy`)."""
        request = get_strategy_request()
        resp = await self._call(
            "strategy_table", lambda stub, timeout: stub.GetStrategy(request, timeout=timeout)
        )
        return strategy_state_from_pb(resp)

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"client {self.client_id} is closed")

    def _publish_call(self, stub: cpb_grpc.ClientServiceStub) -> _PublishCall:
        """The open `PublishEach` call to the session's broker (opened, or replaced
        after it broke or the client moved: a replaced one answers what it took)."""
        call = self._publishing
        if call is not None and call.ended is None and call.endpoint == self._endpoint:
            return call
        if call is not None and call.ended is None:
            call.finish()
            self._retired = {c for c in self._retired if c.ended is None} | {call}
        self._publishing = _PublishCall(stub, self._endpoint)
        return self._publishing

    def _stub(self) -> cpb_grpc.ClientServiceStub:
        self._check_open()
        return self._channels.stub(self._endpoint)

    async def _unary(self, operation: str, call: Awaitable[T], timeout: float | None = None) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and not (self._closed or self._closing):
                # Not this client's doing: a broker stopping cancels the calls in flight
                # (its restart is ahead), so the request was not taken: try it again.
                raise Unavailable(
                    self._endpoint, f"{operation} cancelled: {exc.details()}"
                ) from None
            raise _error(
                exc, self._endpoint, operation, timeout or self.config.request_timeout_s
            ) from None

    async def _call(
        self,
        operation: str,
        start: Callable[[cpb_grpc.ClientServiceStub, float], Awaitable[T]],
    ) -> T:
        self._check_open()
        timeout = self.config.request_timeout_s

        async def once() -> T:
            return await self._unary(operation, start(self._stub(), timeout))

        return await self._retrying(operation, once)

    async def _retrying(
        self, operation: str, attempt: Callable[[], Awaitable[T]], *, closing: bool = False
    ) -> T:
        """`attempt` again while the broker is unavailable, with jittered exponential backoff.

        Retries stop once the client is closing, except for what `close` itself
        sends (``closing``).
        """
        retry = self.config.retry
        backoff = retry.initial_backoff_s
        for n in range(1, retry.attempts + 1):
            try:
                return await attempt()
            except _RETRIED as exc:
                if n == retry.attempts or self._closed or (self._closing and not closing):
                    raise
                wait = random.uniform(0.5, 1.0) * backoff
                _log.debug("%s, try %d: %s; again in %.2f s", operation, n, exc, wait)
            await asyncio.sleep(wait)
            backoff = min(retry.max_backoff_s, backoff * 2)
        raise AssertionError("unreachable")  # pragma: no cover


class Subscription:
    """A live subscription: ``async for msg in sub`` yields each `Message`.

    Iteration ends after `unsubscribe` or `Client.close`; it raises the typed
    error when the subscription was lost for good (its broker rejected the
    renewal, or stayed unreachable through every retry). Moves are invisible:
    the same object carries on at the new broker.
    """

    def __init__(
        self,
        client: Client,
        subscription_id: str,
        topic_filter: str,
        geofence: GeofenceInput,
        pending_limit: int,
    ) -> None:
        self._client = client
        self.id = subscription_id
        """The subscription id."""
        self.topic_filter = topic_filter
        """The MQTT topic filter."""
        self.geofence = geofence
        """The subscription geofence as given (None: the world)."""
        self.pending_limit = pending_limit
        """Deliveries buffered before the oldest is dropped."""
        self.dropped = 0
        """Deliveries dropped because the application did not keep up."""
        self.received = 0
        """Deliveries that arrived from brokers, duplicates of a handover included."""
        self.duplicates = 0
        """Deliveries that arrived twice (through both brokers of a handover) and were dropped."""
        self._items: deque[Message] = deque()
        self._ready = asyncio.Event()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._done = False
        self._error: GeofedError | None = None
        self._call: Any = None
        self._pump: asyncio.Task[None] | None = None
        self._draining: set[asyncio.Task[None]] = set()  # old brokers' streams after a move
        self._recovery: asyncio.Task[None] | None = None
        self._broker = ""  # the broker its offsets come from
        self._offset = 0  # last offset received (persistent sessions)
        self._taken = 0  # last offset the application took
        self._acked = 0  # last offset acknowledged to the broker
        self._acking: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Deliveries received and not yet taken."""
        return len(self._items)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.next()
        except ClientClosed:
            raise StopAsyncIteration from None

    async def next(self, timeout: float | None = None) -> Message:
        """The next delivery.

        Raises:
            ClientClosed: the subscription ended (unsubscribed or client closed).
            DeadlineExceeded: nothing arrived within `timeout` seconds.
            GeofedError: the subscription was lost (see the class docs).
        """
        while not self._items:
            if self._done:
                if self._error is not None:
                    raise self._error
                raise ClientClosed(f"subscription {self.id} ended")
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except TimeoutError:
                raise DeadlineExceeded(f"subscription {self.id}", timeout) from None
        msg = self._items.popleft()
        # An offset of the broker left behind by a move (received before it) means
        # nothing at the new one: acknowledged there, it would cover others.
        if msg.offset and msg.broker == self._broker:
            self._taken = msg.offset
            if self._acking is None or self._acking.done():
                self._acking = asyncio.create_task(self._ack_later(), name=f"ack-{self.id}")
        return msg

    async def unsubscribe(self) -> None:
        """Withdraw the subscription; iteration ends after the deliveries already sent."""
        client = self._client
        if self._done:
            return
        await self._stop_recovery()  # a renewal in progress holds the client's lock
        async with client._lock:
            if client._subs.get(self.id) is self:
                del client._subs[self.id]
            try:
                if not client._closed:
                    await client._call(
                        "unsubscribe",
                        lambda stub, timeout: stub.Unsubscribe(
                            unsubscribe_request(client.client_id, self.id), timeout=timeout
                        ),
                    )
                    # The broker ends the stream after what it had queued: take all of it.
                    pump = self._pump
                    if pump is not None:
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(client.config.request_timeout_s):
                                await asyncio.shield(pump)
            finally:
                self._finish(None)
                await self._detach()
                await self._stop_draining()

    # -- the stream underneath -------------------------------------------------

    async def _attach(
        self, broker_id: str, stub: cpb_grpc.ClientServiceStub, moved: bool = False
    ) -> None:
        """Register at a broker and pump its stream (replacing any earlier one).

        After a move (`moved`) the old broker's stream is not cancelled: that
        broker ends it after what it had already queued, and the deliveries
        still on their way arrive (a duplicate of one the new broker also
        sends is dropped by event id).
        """
        if moved and self._pump is not None and not self._pump.done():
            self._draining.add(self._pump)
            self._pump.add_done_callback(self._draining.discard)
            self._call = self._pump = None
        await self._detach()
        client = self._client
        if broker_id != self._broker:
            self._reset_offsets()  # offsets are per broker
            self._broker = broker_id
        call = stub.Subscribe(
            subscribe_request(
                client.client_id,
                self.id,
                self.topic_filter,
                self.geofence,
                self._offset,
                handover=moved,
            ),
            metadata=(BATCH_METADATA,),  # many deliveries per stream message
        )
        try:
            # Sent once the broker registered the subscription; a rejection ends the
            # call without it (and the call may not read as done yet: wait for its status).
            async with asyncio.timeout(client.config.request_timeout_s):
                metadata = await call.initial_metadata()
        except TimeoutError:
            call.cancel()
            raise DeadlineExceeded("subscribe", client.config.request_timeout_s) from None
        registered = any(key == BROKER_METADATA for key, _ in metadata or ())
        if not registered or call.done():
            code = await call.code()
            if code != grpc.StatusCode.OK:
                raise _error(
                    _ended(code, await call.details(), await call.trailing_metadata()),
                    client.endpoint,
                    "subscribe",
                    None,
                )
        self._call = call
        self._pump = asyncio.create_task(self._read(call, broker_id), name=f"sub-{self.id}")

    async def _stop_recovery(self) -> None:
        task, self._recovery = self._recovery, None
        if task is not None and task is not asyncio.current_task() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _detach(self) -> None:
        call, pump = self._call, self._pump
        self._call = self._pump = None
        if call is not None:
            call.cancel()
        if pump is not None and pump is not asyncio.current_task():
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _stop_draining(self) -> None:
        """Cancel what still reads an old broker's stream (the subscription ends)."""
        tasks, self._draining = set(self._draining), set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _read(self, call: Any, broker_id: str) -> None:
        try:
            async for pb in call:
                for one in deliveries_in(pb):
                    self._push(message_from_pb(one, broker_id))
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if self._call is not call or code == _MOVED:
                return  # we replaced or cancelled it, or the client moved: `move` renews it
            if code in _BROKEN and not self._done:
                # The broker went away (shutting down, crashed, its server
                # cancelled the call): reconnect and subscribe again.
                self._recovery = asyncio.create_task(self._recover(), name=f"renew-{self.id}")
                return
            self._finish(_error(exc, self._client.endpoint, "subscribe", None))
            return
        if self._call is call:
            # The broker ended the stream: another Subscribe took the id over,
            # or the subscription was withdrawn there.
            self._finish(None)

    async def _recover(self) -> None:
        try:
            await self._client._retrying("subscribe", lambda: self._client._renew(self))
        except GeofedError as err:
            self._finish(err)

    def _push(self, msg: Message) -> None:
        self.received += 1
        if msg.offset and msg.broker != self._broker:
            # From the broker left behind by a move, draining: its offsets mean nothing
            # at the new one (neither for resuming nor for acknowledging).
            msg = dataclasses.replace(msg, offset=0)
        if msg.offset:
            if msg.offset <= self._offset:
                self.duplicates += 1  # sent again after a resume
                return
            self._offset = msg.offset
        if msg.event_id in self._seen:
            self.duplicates += 1  # the same event through the old and the new broker of a handover
            return
        self._seen[msg.event_id] = None
        if len(self._seen) > _DEDUP_WINDOW:
            self._seen.popitem(last=False)
        if len(self._items) >= self.pending_limit:
            self._items.popleft()
            self.dropped += 1
        self._items.append(msg)
        self._ready.set()

    def _reset_offsets(self) -> None:
        self._offset = self._taken = self._acked = 0

    async def _ack_later(self) -> None:
        await asyncio.sleep(_ACK_DELAY_S)  # batch: one Ack covers what was taken meanwhile
        await self._flush_ack()

    async def _flush_ack(self, final: bool = False) -> None:
        """Tell the broker what the application took.

        While the subscription runs this is best effort: the next
        acknowledgement covers a lost one. The ``final`` one (`Client.close`)
        is retried like any request, since nothing comes after it: a broker
        that never gets it sends what the application took again to the next
        client with this id (logged at warning).
        """
        client = self._client
        offset = self._taken
        if offset <= self._acked or client._closed or not client._endpoint:
            return

        async def once() -> None:
            await client._unary(
                "ack",
                client._stub().Ack(
                    ack_request(client.client_id, self.id, offset),
                    timeout=client.config.request_timeout_s,
                ),
            )

        try:
            await (client._retrying("ack", once, closing=True) if final else once())
        except GeofedError as exc:
            if final:
                _log.warning(
                    "subscription %s of client %s: the last acknowledgement (offset %d) did "
                    "not reach the broker: %s; a client resuming this session receives the "
                    "deliveries after offset %d again",
                    self.id,
                    client.client_id,
                    offset,
                    exc,
                    self._acked,
                )
            return
        self._acked = max(self._acked, offset)

    def _finish(self, error: GeofedError | None) -> None:
        if self._done:
            return
        self._done = True
        self._error = error
        self._ready.set()


class _PublishCall:
    """An open `PublishEach` call: the broker answers its requests in order, so the
    n-th answer settles the n-th publish waiting on it.

    Requests go out through one writer task (a cancelled write would cancel the
    whole call); a publish that stops waiting (its timeout) leaves its place in
    the queue, and its answer is skipped. When the call ends, every publish
    still waiting fails with how it ended (a broker gone: `Unavailable`, so the
    client retries it on a new call, with the same event id).
    """

    def __init__(self, stub: cpb_grpc.ClientServiceStub, endpoint: str) -> None:
        self.endpoint = endpoint
        self.ended: grpc.aio.AioRpcError | None = None
        self._call = stub.PublishEach()
        self._waiting: deque[asyncio.Future[str]] = deque()
        self._outbox: asyncio.Queue[cpb.PublishRequest | None] = asyncio.Queue()
        self._writer = asyncio.create_task(self._write(), name="publish-requests")
        self._reader = asyncio.create_task(self._read(), name="publish-answers")

    async def publish(self, request: cpb.PublishRequest, timeout: float) -> str:
        """The published event's id; a refusal raises as the unary call's status would."""
        if self.ended is not None:
            raise self.ended
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        self._outbox.put_nowait(request)
        try:
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            raise DeadlineExceeded("publish", timeout) from None

    def finish(self) -> None:
        """Send no more: the broker answers what it took, then the call ends."""
        self._outbox.put_nowait(None)

    async def close(self) -> None:
        """Cancel the call: publishes still waiting fail (`ClientClosed` for a closing client)."""
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _write(self) -> None:
        while (request := await self._outbox.get()) is not None:
            try:
                await self._call.write(request)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                return  # the call ended: the reader settles what waits
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await self._call.done_writing()

    async def _read(self) -> None:
        try:
            async for result in self._call:
                if not self._waiting:
                    raise _ended(grpc.StatusCode.INTERNAL, "an answer to no publish")
                answer = self._waiting.popleft()
                if answer.done():
                    continue  # its publish gave up waiting
                if result.HasField("refused"):
                    r = result.refused
                    trailer = grpc.aio.Metadata((ERROR_METADATA_KEY, r.error))
                    answer.set_exception(_ended(_status(r.code), r.details, trailer))
                else:
                    answer.set_result(result.event_id)
            raise _ended(grpc.StatusCode.UNAVAILABLE, "the broker ended the publish call")
        except grpc.aio.AioRpcError as exc:
            self.ended = exc
        except asyncio.CancelledError:
            self.ended = _ended(grpc.StatusCode.CANCELLED, "the publish call was closed")
            raise
        finally:
            self._writer.cancel()
            while self._waiting:
                answer = self._waiting.popleft()
                if not answer.done():
                    answer.set_exception(self.ended or _ended(grpc.StatusCode.UNKNOWN, ""))


def _status(code: int) -> grpc.StatusCode:
    """The status with number `code` (UNKNOWN for a number gRPC does not have)."""
    return next((s for s in grpc.StatusCode if s.value[0] == code), grpc.StatusCode.UNKNOWN)


def _ended(
    code: grpc.StatusCode, details: str, trailer: grpc.aio.Metadata | None = None
) -> grpc.aio.AioRpcError:
    """A call's end with this status, as `_error` reads it (`trailer`: its trailing
    metadata, where a broker's typed error is)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailer or grpc.aio.Metadata(), details)


def _error(exc: Any, endpoint: str, operation: str, timeout: float | None) -> GeofedError:
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(operation, timeout)
    return from_rpc_error(exc, endpoint=endpoint, operation=operation)


def _bytes(payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        return payload.encode()
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    raise InvalidInput("payload", f"must be bytes or str, got {type(payload).__name__}")


def open_channel(endpoint: str, tls: TLSConfig | None = None, token: str = "") -> grpc.aio.Channel:
    """An asyncio channel to a broker port: TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(
        endpoint, tls.credentials(token), options=[*_CHANNEL_OPTIONS, *tls.options()]
    )


def health_status(
    endpoint: str, service: str = "", timeout: float = 1.0, tls: TLSConfig | None = None
) -> str:
    """The gRPC health status name of `service` at `endpoint` ("UNREACHABLE" if none answers).

    `service` is "" (the broker), `geofed.wire.CLIENT_SERVICE` or
    `geofed.wire.FEDERATION_SERVICE` (SERVING only while every peer link is up).
    With `tls`, the port is reached over TLS (a broker's peer port needs a
    certificate from the federation's CA).
    """
    channel = (
        grpc.insecure_channel(endpoint)
        if tls is None
        else grpc.secure_channel(endpoint, tls.credentials(), options=tls.options())
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with contextlib.suppress(grpc.RpcError):
            resp = stub.Check(health_check_request(service), timeout=timeout)
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
    return "UNREACHABLE"


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_PENDING_LIMIT",
    "Channels",
    "Client",
    "ClientConfig",
    "Message",
    "Publication",
    "RetryConfig",
    "Subscription",
    "TLSConfig",
    "connect",
    "health_status",
    "open_channel",
]
