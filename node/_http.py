"""The HTTP bridge of a node: REST publish and history, live push, the web map (`http_listen`).

One more front end of the same `BrokerServer`, beside gRPC and MQTT: a
``PUT /publish/<topic>`` is checked and routed like a gRPC ``Publish``
(`client_event`, `publish`) and answered once the node accepted it; a
``GET /subscribe/<filter>`` opens a session and a plain subscription
(`client_connect`, `client_subscribe`) and streams its deliveries as
Server-Sent Events; ``GET``/``DELETE`` on ``/publish/<filter>`` read and
remove the federation-wide message history. Matching, routing, identities,
the policy and the geo rules are the node's: a publisher or subscriber
located in another broker's area gets a 307 redirect to that broker's
``http_endpoint``. Parameters are validated here, once, with the parsers every
front end uses (`location_from_text`, `geofence_from_text`), and a bad one is
answered 400 with a JSON body naming it. The web map (``/``) and its data
(``/api/...``) are served from the package (``node/web``, vendored Leaflet).
docs/design.md §11 has the design; README's HTTP section the user's view.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import ClientSession, ClientTimeout, web

from geofed.errors import Unavailable, error_record, status_for
from geofed.routing import (
    Federation,
    GeofedError,
    Geofence,
    GeofenceCache,
    HistoryQuery,
    HistoryRecord,
    InvalidInput,
    Kind,
    LatLon,
    NotFound,
    PermissionDenied,
    StorageFailed,
    TooLarge,
    Unauthenticated,
    WrongBroker,
    route_summary,
    validate_filter,
    validate_id,
)
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import (
    geofence_from_pb,
    geofence_from_text,
    geofence_to_pb,
    location_from_text,
    strategy_state_from_pb,
)

from ._auth import ANONYMOUS, Principal, certificate_names
from ._http_openapi import openapi_document
from ._mqtt import _default_location
from ._server import _END, _Stream
from ._tls import broker_dns_name
from ._web_site import start_site

if TYPE_CHECKING:
    from ._server import BrokerServer

log = logging.getLogger("geofed.node.http")

WEB_DIR = Path(__file__).resolve().with_name("web")
"""The web map's files (index.html, map.js, vendored Leaflet), package data."""
SSE_SUBSCRIPTION_ID = "sse"
"""The subscription id of a Server-Sent Events stream (one per client id)."""
KEEPALIVE_S = 15.0
"""An idle event stream gets a comment line this often: a gone client is noticed."""
STATUS_TIMEOUT_S = 5.0
"""How long the federation status waits for another broker's bridge."""
ACCESS_TOKEN_PARAM = "access_token"
"""The query parameter that may carry the bearer token (for EventSource and WebSocket)."""
_RATE_MIN_S = 1.0  # link rates are recomputed from counters at most this often
_URL_SLACK = 1024  # request-line bytes beyond http_max_url_bytes that aiohttp still reads

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Which request parameter an error raised deeper down is about (prefix of its field).
_PUBLISH_PARAMS = {
    "event.geofence": "geofence",
    "event.publisher": "location",
    "event.topic": "topic",
    "event.payload": "body",
    "event.id": "id",
    "client": "client",
}
_HISTORY_PARAMS = {
    "topic_filter": "topic",
    "start": "from",
    "end": "to",
    "limit": "size",
    "geometry": "geometry",
    "client": "client",
}
_SUBSCRIBE_PARAMS = {
    "subscription.geofence": "geofence",
    "subscription.topic_filter": "filter",
    "subscription.id": "client",
    "subscription.client": "client",
    "location": "location",
    "client": "client",
}


def _status(exc: GeofedError) -> int:
    """The HTTP status of a rejected request (redirects are answered before)."""
    if isinstance(exc, InvalidInput):
        return 400
    if isinstance(exc, Unauthenticated):
        return 401
    if isinstance(exc, PermissionDenied):
        return 403
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, TooLarge):
        return 413
    if isinstance(exc, StorageFailed | Unavailable):
        return 503
    if isinstance(exc, WrongBroker):
        return 409  # a redirect without an http_endpoint to send the client to
    return 500


def _as_param(exc: GeofedError, params: Mapping[str, str]) -> GeofedError:
    """The error with its field renamed to the request parameter that carried the value."""
    field = getattr(exc, "field", None)
    if not isinstance(field, str) or isinstance(exc, WrongBroker):
        return exc
    for prefix, param in params.items():
        if field == prefix or field.startswith(prefix + "."):
            if isinstance(exc, InvalidInput):
                return InvalidInput(
                    param, f"{exc.reason} ({field})" if field != param else exc.reason
                )
            if isinstance(exc, TooLarge):
                return TooLarge(param, exc.size, exc.limit)
    return exc


def error_response(exc: GeofedError, headers: Mapping[str, str] | None = None) -> web.Response:
    """A JSON error answer: ``{"type", "message", "field", ...}`` (`geofed.errors.error_record`)."""
    return web.json_response(error_record(exc), status=_status(exc), headers=headers)


class _Params:
    """The query parameters of one request: each known name once, nothing else.

    Raises `InvalidInput` naming the parameter for an unknown or repeated one.
    """

    def __init__(self, request: web.Request, known: tuple[str, ...]) -> None:
        self.query = request.query
        for name in self.query:
            if name == ACCESS_TOKEN_PARAM:  # any resource: read by `HttpBridge.principal`
                if len(self.query.getall(name)) > 1:
                    raise InvalidInput(name, "given more than once")
                continue
            if name not in known:
                raise InvalidInput(
                    name, f"unknown parameter; this resource takes {', '.join(known) or 'none'}"
                )
            if len(self.query.getall(name)) > 1:
                raise InvalidInput(name, "given more than once")

    def get(self, name: str) -> str | None:
        return self.query.get(name)

    def location(self, name: str = "location") -> LatLon | None:
        text = self.get(name)
        try:
            return None if text is None else location_from_text(text, name)
        except InvalidInput as exc:
            raise _as_param(exc, {name: name}) from None

    def geofence(self, name: str) -> gpb.Geofence:
        return geofence_to_pb(geofence_from_text(self.get(name) or "", name))

    def time(self, name: str) -> float | None:
        """A time: seconds since the epoch, or ISO 8601 (UTC unless an offset is given)."""
        text = self.get(name)
        if text is None or not text.strip():
            return None
        try:
            value = float(text)
        except ValueError:
            try:
                moment = dt.datetime.fromisoformat(text.strip())
            except ValueError:
                raise InvalidInput(
                    name, f"expected seconds since the epoch or ISO 8601, got {text!r}"
                ) from None
            if moment.tzinfo is None:
                moment = moment.replace(tzinfo=dt.UTC)
            value = moment.timestamp()
        if not math.isfinite(value):
            raise InvalidInput(name, f"must be a finite time, got {text!r}")
        return value

    def count(self, name: str, default: int, limit: int) -> int:
        text = self.get(name)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise InvalidInput(name, f"expected a whole number, got {text!r}") from None
        if value < 1:
            raise InvalidInput(name, f"must be at least 1, got {value}")
        if value > limit:
            raise TooLarge(name, value, limit)
        return value


def event_feature(event: gpb.Event, geofences: GeofenceCache) -> dict[str, Any]:
    """A delivered event as the GeoJSON Feature a history answer gives for it.

    One format for live and logged events: `HistoryRecord.to_geojson_feature`.
    """
    fence = geofence_from_pb(event.geofence, "event.geofence", geofences)
    record = HistoryRecord(
        event.id,
        event.topic,
        bytes(event.payload),
        event.publish_time,
        event.origin,
        LatLon(event.publisher.lat, event.publisher.lon),
        fence,
    )
    return record.to_geojson_feature()


class HttpBridge:
    """The HTTP bridge of one node (see the module docstring)."""

    def __init__(self, node: BrokerServer) -> None:
        self.node = node
        self.me = node.federation.broker(node.broker_id)
        self.default_location = _default_location(self.me, node)
        self.tls = node.security.files is not None
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._streams: set[_Stream] = set()
        self._client: ClientSession | None = None
        self._last_counts: tuple[float, dict[str, tuple[float, float]]] | None = None
        self._rates: dict[str, tuple[float, float]] = {}
        self.app = self._build_app()

    # -- lifecycle ---------------------------------------------------------------

    def _build_app(self) -> web.Application:
        cfg = self.node.config
        app = web.Application(
            middlewares=[self._errors],
            # The body limit is checked by `_read_body` (413 naming 'body'); this only
            # keeps aiohttp's own reader from refusing first.
            client_max_size=cfg.max_payload_bytes + 1,
        )
        r = app.router
        for prefix in ("publish", "geopublish"):
            r.add_put(f"/{prefix}/{{topic:.+}}", self._publish(geo=prefix == "geopublish"))
            r.add_get(f"/{prefix}/{{topic:.+}}", self._history(delete=False))
            r.add_delete(f"/{prefix}/{{topic:.+}}", self._history(delete=True))
        r.add_get("/subscribe/{filter:.+}", self.subscribe)
        r.add_get("/ws/subscribe/{filter:.+}", self.subscribe_ws)
        r.add_get("/openapi.json", self.openapi)
        r.add_get("/api/federation", self.federation)
        r.add_get("/api/status", self.status)
        r.add_get("/api/federation/status", self.federation_status)
        r.add_get("/api/route", self.route)
        r.add_get("/api/strategy", self.strategy)
        r.add_put("/api/strategy/{filter:.+}", self.set_strategy)
        r.add_delete("/api/strategy/{filter:.+}", self.set_strategy)
        r.add_get("/", self.index)
        r.add_static("/static/", WEB_DIR, name="static")
        return app

    async def start(self, listen: str) -> int:
        """Bind `listen` (TLS with the node's ``tls_dir``) and serve; returns the port.

        Raises:
            InvalidInput: naming ``http_listen`` when the port cannot be bound.
        """
        cfg = self.node.config
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            shutdown_timeout=cfg.shutdown_grace_s,
            handler_cancellation=True,  # a client that goes away ends its handler
            max_line_size=cfg.http_max_url_bytes + _URL_SLACK,
        )
        self.port = await start_site(
            self._runner, listen, "http_listen", self.node.security.acceptor("http")
        )
        return self.port

    async def stop(self) -> None:
        """End the event streams, then stop serving (in-flight requests get the grace time)."""
        for stream in list(self._streams):
            stream.close(None)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()

    # -- plumbing ------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every refusal as JSON naming what was wrong; the URL limit; redirects."""
        limit = self.node.config.http_max_url_bytes
        if len(request.raw_path) > limit:
            exc: GeofedError = InvalidInput(
                "query",
                f"the request target is {len(request.raw_path)} bytes, over the limit of {limit}",
            )
            self.node.on_reject(status_for(exc))
            return error_response(exc)
        try:
            return await handler(request)
        except WrongBroker as exc:
            self.node.on_reject(status_for(exc))
            return self._redirect(request, exc)
        except GeofedError as exc:
            self.node.on_reject(status_for(exc))
            headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
            return error_response(exc, headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response(
                {"type": exc.__class__.__name__, "message": exc.reason, "status": exc.status},
                status=exc.status,
                headers={k: v for k, v in exc.headers.items() if k.lower() == "allow"},
            )
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away
        except Exception:
            log.exception("http %s %s failed", request.method, request.path)
            return web.json_response(
                {"type": "GeofedError", "message": "internal error (logged by the broker)"},
                status=500,
            )

    def _redirect(self, request: web.Request, exc: WrongBroker) -> web.Response:
        """307 to the same request at the responsible broker's bridge (the body is sent again)."""
        target = self.node.federation.broker(exc.broker_id)
        record = error_record(exc)
        if not target.http_endpoint:
            return web.json_response(record, status=409)
        scheme = "https" if self.tls else "http"
        record["location"] = f"{scheme}://{target.http_endpoint}{request.raw_path}"
        return web.json_response(record, status=307, headers={"Location": record["location"]})

    def principal(self, request: web.Request) -> Principal:
        """Who is asking: a bearer token (``client_auth token``) or the client certificate."""
        security = self.node.security
        if not security.authenticating:
            return ANONYMOUS
        token = None
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            token = value.strip()
        in_query = request.query.get(ACCESS_TOKEN_PARAM)
        if in_query is not None:
            # A browser's EventSource and WebSocket send no Authorization header
            # (RFC 6750 §2.3 allows the URI query parameter instead).
            if token is not None:
                raise InvalidInput(
                    ACCESS_TOKEN_PARAM, "give the token once: in the Authorization header or here"
                )
            token = in_query.strip() or None
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        return security.authenticate(
            token,
            certificate_names(ssl_object),
            f"no 'Authorization: Bearer <token>' header or {ACCESS_TOKEN_PARAM} parameter",
        )

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, refused past ``max_payload_bytes`` before it is all read."""
        limit = self.node.config.max_payload_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise TooLarge("body", length, limit)
        data = bytearray()
        async for chunk in request.content.iter_chunked(1 << 16):
            data += chunk
            if len(data) > limit:
                raise TooLarge("body", len(data), limit)
        return bytes(data)

    def _geofence(self, pb: gpb.Geofence, field: str) -> Geofence | None:
        """Parse a geofence parameter with the node's cache and limits."""
        return geofence_from_pb(pb, field, self.node.geofences)

    # -- publish -----------------------------------------------------------------

    def _publish(self, *, geo: bool) -> Handler:
        known = ("location", "geofence", "client", "id")

        async def publish(request: web.Request) -> web.Response:
            """PUT /publish/<topic>, /geopublish/<topic>: the body is the payload."""
            node = self.node
            params = _Params(request, known)
            where = params.location()
            if where is None:
                if geo:
                    raise InvalidInput("location", "is required: LAT,LON of the publisher")
                where = self.default_location
            fence = params.geofence("geofence")
            who = self.principal(request)
            # Without a client id: the caller's identity (policies' %c), or "http".
            client = validate_id(params.get("client") or who.identity or "http", "client")
            payload = await self._read_body(request)
            node.check_owner(who, client)
            pb = gpb.Event(
                id=params.get("id") or "",
                topic=request.match_info["topic"],
                payload=payload,
                publisher=gpb.LatLon(lat=where.lat, lon=where.lon),
                geofence=fence,
            )
            try:
                event = await node.client_event(who, client, pb, "event")
                await node.publish([event])
            except GeofedError as exc:
                raise _as_param(exc, _PUBLISH_PARAMS) from None
            return web.json_response(
                {
                    "id": event.id,
                    "topic": event.topic,
                    "broker": node.broker_id,
                    "time": event.t,
                    "location": [where.lon, where.lat],
                    "geofence": None if event.geofence is None else event.geofence.wkt,
                }
            )

        return publish

    # -- history -------------------------------------------------------------------

    def _history(self, *, delete: bool) -> Handler:
        known = ("from", "to", "geometry", "size", "client")

        async def history(request: web.Request) -> web.Response:
            """GET / DELETE /publish/<filter>: the logged events that match, newest first."""
            node = self.node
            params = _Params(request, known)
            limit = node.config.history_max_rows
            size = params.count("size", limit, limit)
            start, end = params.time("from"), params.time("to")
            client = params.get("client") or ""
            who = self.principal(request)
            if client:
                node.check_owner(who, validate_id(client, "client"))
            pb = params.geofence("geometry")
            try:
                await node.parse_ahead(pb, "geometry")
                fence = self._geofence(pb, "geometry")
                query = HistoryQuery(
                    request.match_info["topic"],
                    start,
                    end,
                    None if fence is None else fence.geometry,
                    size,
                )
                answer = await node.client_history(who, query, delete, client=client)
            except GeofedError as exc:
                raise _as_param(exc, _HISTORY_PARAMS) from None
            return web.json_response(
                {
                    "type": "FeatureCollection",
                    "features": [r.to_geojson_feature() for r in answer],
                    "truncated": answer.truncated,
                    "brokers": sorted(answer.brokers),
                }
            )

        return history

    # -- live push -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _live(self, request: web.Request) -> AsyncIterator[tuple[dict[str, Any], _Stream]]:
        """A plain subscription for one live stream (SSE or WebSocket), withdrawn after it.

        Yields what the ``ready`` message says and the delivery stream. A
        client id with a session here keeps that session as it is (a
        location moves it); without one the bridge makes a client for the
        stream, whose session ends with it.
        """
        node = self.node
        params = _Params(request, ("location", "geofence", "client"))
        topic_filter = request.match_info["filter"]
        given = params.get("client")
        client = validate_id(given or f"sse-{uuid.uuid4().hex[:16]}", "client")
        located = params.location()
        known = node.location_of(client)  # the client has a session here (gRPC, MQTT, HTTP)
        where = located or known or self.default_location
        pb = gpb.Subscription(
            id=SSE_SUBSCRIPTION_ID,
            client=client,
            topic_filter=topic_filter,
            geofence=params.geofence("geofence"),
        )
        who = self.principal(request)
        try:
            validate_filter(topic_filter, "subscription.topic_filter")
            if known is None:
                opened = await node.client_connect(who, client, where, 0.0)
                target = opened.redirect
            else:  # its session stays as it is (a persistent one too); a location moves it
                target = None if located is None else node.client_move(who, client, where)
            if target is not None:
                raise WrongBroker("location", target.id, target.client_endpoint)
            sub, stream = await node.client_subscribe(who, client, pb)
        except GeofedError as exc:
            if given is None:  # the session made for this stream goes with it
                with contextlib.suppress(GeofedError):
                    node.client_disconnect(who, client)
            raise _as_param(exc, _SUBSCRIBE_PARAMS) from None
        self._streams.add(stream)
        ready = {
            "broker": node.broker_id,
            "client": client,
            "subscription": SSE_SUBSCRIPTION_ID,
            "filter": topic_filter,
            "location": [where.lon, where.lat],
        }
        try:
            yield ready, stream
        finally:
            self._streams.discard(stream)
            node.client_stream_closed(sub.key, stream)
            if given is None:  # the bridge made this client: it goes with its stream
                with contextlib.suppress(GeofedError):
                    node.client_disconnect(who, client)

    async def _next_feature(self, stream: _Stream, wait: float | None) -> dict[str, Any] | None:
        """The next delivery as a GeoJSON Feature; None after `wait` s idle; `_Ended` at the end."""
        try:
            item = await asyncio.wait_for(stream.get(), wait)
        except TimeoutError:
            return None
        if item is _END:
            raise _Ended
        assert isinstance(item, cpb.Delivery)
        feature = event_feature(item.event, self.node.peer_geofences)
        if item.filter_scheme:  # matched approximately (docs/design.md §14)
            feature["properties"]["filter_scheme"] = item.filter_scheme
        return feature

    async def subscribe(self, request: web.Request) -> web.StreamResponse:
        """GET /subscribe/<filter>: matching events as Server-Sent Events, until the client goes."""
        if request.method == "HEAD":  # the headers of a stream, without subscribing
            _Params(request, ("location", "geofence", "client"))
            return web.Response(headers={"Content-Type": "text/event-stream"})
        async with self._live(request) as (ready, stream):
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                }
            )
            await response.prepare(request)
            await response.write(_sse("ready", json.dumps(ready)))
            with contextlib.suppress(_Ended):
                while True:
                    feature = await self._next_feature(stream, KEEPALIVE_S)
                    if feature is None:
                        await response.write(b": keep-alive\n\n")
                    else:
                        await response.write(_sse("event", json.dumps(feature), feature["id"]))
            return response

    async def subscribe_ws(self, request: web.Request) -> web.StreamResponse:
        """GET /ws/subscribe/<filter>: the same stream over a WebSocket, one JSON text each."""
        ws = web.WebSocketResponse(heartbeat=KEEPALIVE_S)
        if not ws.can_prepare(request).ok:
            raise InvalidInput("Upgrade", "a WebSocket upgrade request is required")
        async with self._live(request) as (ready, stream):
            await ws.prepare(request)
            await ws.send_json({"type": "ready", **ready})

            async def read_until_closed() -> None:
                async for _ in ws:  # the client sends nothing we use; its close ends the stream
                    pass
                stream.close(None)

            reader = asyncio.get_running_loop().create_task(read_until_closed())
            try:
                with contextlib.suppress(_Ended, ConnectionError):
                    while True:
                        feature = await self._next_feature(stream, None)
                        if feature is not None and not ws.closed:
                            await ws.send_json(feature)
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                await ws.close()
            return ws

    # -- the map and its data -------------------------------------------------------------

    async def index(self, request: web.Request) -> web.FileResponse:
        """GET /: the web map."""
        return web.FileResponse(WEB_DIR / "index.html")

    async def openapi(self, request: web.Request) -> web.Response:
        """GET /openapi.json: this API described in OpenAPI 3."""
        return web.json_response(openapi_document(self.node.broker_id))

    async def federation(self, request: web.Request) -> web.Response:
        """GET /api/federation: the federation file, this broker, strategy and map settings."""
        _Params(request, ())
        node = self.node
        return web.json_response(
            {
                "broker": node.broker_id,
                "strategy": node.config.strategy,
                "tiles": node.config.http_map_tiles,
                "location": [self.default_location.lon, self.default_location.lat],
                "federation": node.federation.to_geojson(),
            }
        )

    def link_status(self) -> dict[str, Any]:
        """This broker's links: up or down, logical messages sent and received, rates.

        Rates are messages per second (control frames left out) between this
        call and an earlier one at least a second before.
        """
        node = self.node
        registry = node.metrics.registry
        now = time.monotonic()
        counts: dict[str, tuple[float, float]] = {}
        links = []
        kinds = [k.value for k in Kind if k is not Kind.CONTROL]
        for peer, link in sorted(node.links.items()):
            sent = {
                k: registry.get_sample_value(
                    "geofed_peer_messages_sent_total", {"peer": peer, "kind": k}
                )
                or 0.0
                for k in kinds
            }
            received = {
                k: registry.get_sample_value(
                    "geofed_peer_messages_received_total", {"peer": peer, "kind": k}
                )
                or 0.0
                for k in kinds
            }
            counts[peer] = (sum(sent.values()), sum(received.values()))
            links.append(
                {
                    "peer": peer,
                    "connected": link.connected,
                    "sent": sent,
                    "received": received,
                    "queue": registry.get_sample_value("geofed_peer_queue_length", {"peer": peer})
                    or 0.0,
                }
            )
        last = self._last_counts
        if last is None or now - last[0] >= _RATE_MIN_S:
            if last is not None:
                span = now - last[0]
                self._rates = {
                    peer: (
                        max(0.0, (s - last[1].get(peer, (s, r))[0]) / span),
                        max(0.0, (r - last[1].get(peer, (s, r))[1]) / span),
                    )
                    for peer, (s, r) in counts.items()
                }
            self._last_counts = (now, counts)
        for entry in links:
            sent_rate, received_rate = self._rates.get(str(entry["peer"]), (0.0, 0.0))
            entry["sent_per_s"] = round(sent_rate, 3)
            entry["received_per_s"] = round(received_rate, 3)
        return {
            "broker": node.broker_id,
            "time": time.time(),
            "strategy": node.config.strategy,
            "events_published": registry.get_sample_value("geofed_events_published_total") or 0.0,
            "deliveries": registry.get_sample_value("geofed_deliveries_total") or 0.0,
            "sessions": len(node.core.sessions),
            "links": links,
        }

    async def status(self, request: web.Request) -> web.Response:
        """GET /api/status: this broker's link status and per-link message rates."""
        _Params(request, ())
        return web.json_response(self.link_status())

    async def federation_status(self, request: web.Request) -> web.Response:
        """GET /api/federation/status: every broker's /api/status, read from its bridge."""
        _Params(request, ())
        fed: Federation = self.node.federation
        results = await asyncio.gather(*(self._status_of(b.id) for b in fed))
        return web.json_response({"brokers": dict(zip(fed.ids, results, strict=True))})

    async def _status_of(self, broker_id: str) -> dict[str, Any]:
        if broker_id == self.node.broker_id:
            return self.link_status()
        b = self.node.federation.broker(broker_id)
        if not b.http_endpoint:
            return {"broker": broker_id, "error": "no http_endpoint in the federation file"}
        if self._client is None:
            self._client = ClientSession(timeout=ClientTimeout(total=STATUS_TIMEOUT_S))
        scheme = "https" if self.tls else "http"
        extra: dict[str, Any] = {}
        if self.tls:
            extra = {"ssl": self._client_ssl(), "server_hostname": broker_dns_name(broker_id)}
        try:
            async with self._client.get(
                f"{scheme}://{b.http_endpoint}/api/status", **extra
            ) as resp:
                if resp.status != 200:
                    return {"broker": broker_id, "error": f"HTTP {resp.status}"}
                data: dict[str, Any] = await resp.json()
                return data
        except (OSError, TimeoutError, ValueError) as exc:
            return {"broker": broker_id, "error": str(exc) or type(exc).__name__}
        except Exception as exc:  # aiohttp.ClientError and the like: the broker is unreachable
            return {"broker": broker_id, "error": str(exc) or type(exc).__name__}

    def _client_ssl(self) -> Any:
        """TLS towards another broker's bridge: the federation's CA, this broker's certificate."""
        import ssl

        files = self.node.security.files
        assert files is not None
        ctx = ssl.create_default_context(cafile=str(files.ca))
        ctx.load_cert_chain(str(files.cert), str(files.key))
        return ctx

    async def route(self, request: web.Request) -> web.Response:
        """GET /api/route?geofence=...: which brokers the geofence reaches, per strategy."""
        params = _Params(request, ("geofence", "origin"))
        if not params.get("geofence"):
            raise InvalidInput("geofence", "is required (WKT, GeoJSON or circle:LAT,LON,RADIUS_M)")
        pb = params.geofence("geofence")
        try:
            await self.node.parse_ahead(pb, "geofence")
            fence = self._geofence(pb, "geofence")
        except GeofedError as exc:
            raise _as_param(exc, {"geofence": "geofence"}) from None
        origin = params.get("origin") or self.node.broker_id
        if origin not in self.node.federation:
            raise InvalidInput("origin", f"no broker {origin!r} in the federation")
        return web.json_response(route_summary(self.node.federation, origin, fence))

    async def strategy(self, request: web.Request) -> web.Response:
        """GET /api/strategy: this broker's strategy table (as ``geofed strategy show``)."""
        _Params(request, ())
        self.principal(request)
        return web.json_response(strategy_state_from_pb(self.node.strategy_state()))

    async def set_strategy(self, request: web.Request) -> web.Response:
        """PUT /api/strategy/{filter}?strategy=S: route the filter's topics by S, federation-wide;
        DELETE: remove the filter's entry. Answers once the sequencer numbered the change."""
        put = request.method == "PUT"
        params = _Params(request, ("strategy",) if put else ())
        who = self.principal(request)
        strategy = params.get("strategy") if put else None
        if put and not strategy:
            raise InvalidInput("strategy", "is required (DELETE removes the entry)")
        try:
            await self.node.set_strategy(who, request.match_info["filter"], strategy)
        except GeofedError as exc:
            raise _as_param(exc, {"topic_filter": "filter"}) from None
        return web.json_response(strategy_state_from_pb(self.node.strategy_state()))


class _Ended(Exception):
    """A live stream's subscription ended (withdrawn, moved away, the node stopping)."""


def _sse(event: str, data: str, event_id: str = "") -> bytes:
    """One Server-Sent Event (`data` holds no newline: it is compact JSON)."""
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}event: {event}\ndata: {data}\n\n".encode()


__all__ = ["HttpBridge", "event_feature", "WEB_DIR"]
