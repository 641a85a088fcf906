"""Who may talk to a broker, and what they may do: TLS, identities and the policy.

One object per node (`Security`) built from its config: it binds the two gRPC
ports (mutual TLS on the peer port, through its TLS front `_peer_front`; TLS
on the client port; or plaintext without ``tls_dir``), dials peers, holds a
peer's hello against its certificate, tells who a client is (its certificate
or its bearer token) and asks the policy whether that identity may publish,
subscribe or claim a location. Every refusal raises the typed error the client sees
(`Unauthenticated`, `PermissionDenied` naming the rule) and is counted.

The building blocks are `_tls` (credentials, names), `_tokens` (JWT) and
`_policy` (the authorization file); docs/security.md is the user's guide.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import Any

import grpc

from geofed.routing import (
    BrokerInfo,
    InvalidInput,
    LatLon,
    PermissionDenied,
    Unauthenticated,
)

from ._config import NodeConfig
from ._links import CHANNEL_OPTIONS
from ._metrics import NodeMetrics
from ._peer_front import INNER_HOST, PeerFront
from ._policy import PolicyFile
from ._tls import (
    CertificateWatch,
    TLSFiles,
    channel_credentials,
    check_broker,
    client_identity,
    dial_options,
    peer_identities,
    server_credentials,
)
from ._tls_accept import TlsAcceptor
from ._tokens import TokenVerifier, bearer_token

log = logging.getLogger("geofed.node.auth")


@dataclass(frozen=True)
class Principal:
    """Who a client is: its authenticated identity ("" without authentication) and groups."""

    identity: str
    groups: tuple[str, ...] = ()


ANONYMOUS = Principal("")


def certificate_names(ssl_object: Any) -> list[str]:
    """The DNS and URI names of a TLS connection's verified client certificate ([] without).

    `ssl_object` is the connection's ``ssl_object`` extra info (None in plaintext).
    """
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    return [v for k, v in (cert or {}).get("subjectAltName", ()) if k in ("DNS", "URI")]


def add_port(
    server: grpc.aio.Server,
    listen: str,
    field: str,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind `listen` (TLS with `credentials`); the port, or `InvalidInput` naming `field`."""
    try:
        if credentials is None:
            port = int(server.add_insecure_port(listen))
        else:
            port = int(server.add_secure_port(listen, credentials))
    except RuntimeError as exc:
        raise InvalidInput(field, f"cannot listen on {listen}: {exc}") from None
    if port == 0:
        raise InvalidInput(field, f"cannot listen on {listen}")
    return port


class Security:
    """TLS, authentication and authorization of one node (see the module docstring).

    Raises:
        InvalidInput: a TLS file, token key or policy file cannot be used
            (named): a broker does not start half secured.
    """

    def __init__(self, config: NodeConfig, metrics: NodeMetrics) -> None:
        self.metrics = metrics
        self.files = TLSFiles.in_dir(config.tls_dir) if config.tls_dir else None
        if self.files is not None:
            self.files.read()  # fail at start, naming the file, not at the first handshake
        self.client_auth = config.client_auth
        self.verifier = (
            TokenVerifier(
                public_key=config.token_key or None,
                jwks=config.token_jwks or None,
                audience=config.token_audience or None,
                issuer=config.token_issuer or None,
            )
            if config.client_auth == "token"
            else None
        )
        self.policy = PolicyFile(config.policy_file) if config.policy_file else None
        self._ssl: ssl.SSLContext | None = None  # server_ssl_context, made once
        self.front: PeerFront | None = None  # the peer port's TLS (peer_interceptors)
        self.handshake_timeout_s = config.peer_timeout_s or 60.0

    @property
    def authenticating(self) -> bool:
        """Clients prove who they are (and a session belongs to that identity)."""
        return self.client_auth != "none"

    # -- ports and peers ---------------------------------------------------

    def bind(self, server: grpc.aio.Server, listen: str, field: str) -> int:
        """Listen on `listen` (the client port): TLS with ``tls_dir``, else plaintext.

        The peer port has its own (`bind_peers`).
        """
        if self.files is None:
            return add_port(server, listen, field)
        mutual = self.client_auth == "cert"
        return add_port(
            server, listen, field, server_credentials(self.files, require_client_auth=mutual)
        )

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """TLS for the listeners beside gRPC (MQTT, MQTT over WebSocket, HTTP); None
        without ``tls_dir``. Made once and shared by them.

        The broker's certificate; with ``client_auth cert`` a client certificate
        from the federation's CA is required, as on the client port. Re-issued
        certificates are served without a restart (`_following`).
        """
        if self.files is None:
            return None
        if self._ssl is None:
            self._ssl = self._following(peer=False)
        return self._ssl

    def acceptor(self, listener: str) -> TlsAcceptor | None:
        """The TLS handshake of a listener beside gRPC (`listener`: its label in
        ``geofed_tls_refused_total``); None without ``tls_dir``."""
        context = self.server_ssl_context()
        return None if context is None else TlsAcceptor(listener, context, self.metrics)

    def _following(self, *, peer: bool) -> ssl.SSLContext:
        """A server context whose handshake hook hands each new connection a context of
        the current certificate files: re-issued certificates (`geofed certs` again) are
        served without a restart, as on the gRPC ports."""
        assert self.files is not None
        watch = CertificateWatch(self.files, self.files.read())
        base = current = self._new_ssl_context(peer=peer)

        def follow(conn: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
            nonlocal current
            if watch.changed() is not None:
                try:
                    current = self._new_ssl_context(peer=peer)
                except (OSError, ssl.SSLError) as exc:  # changed again while being read
                    log.warning("TLS files not reloaded, keeping the current ones: %s", exc)
            if current is not base:
                conn.context = current

        base.sni_callback = follow  # called on every handshake, with or without SNI
        return base

    def _new_ssl_context(self, *, peer: bool) -> ssl.SSLContext:
        assert self.files is not None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(self.files.cert), str(self.files.key))
        if peer or self.client_auth == "cert":
            ctx.load_verify_locations(str(self.files.ca))
            ctx.verify_mode = ssl.CERT_REQUIRED
        if peer:
            ctx.set_alpn_protocols(["h2"])  # gRPC dialers refuse a server that picks none
        return ctx

    def peer_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """For the gRPC peer server: with ``tls_dir``, calls must come through the TLS
        front (`PeerFront`, made here)."""
        if self.files is None:
            return []
        if self.front is None:
            self.front = PeerFront(
                self._following(peer=True),
                self.metrics,
                certificate_names,
                self.handshake_timeout_s,
            )
        return [self.front.interceptor()]

    async def bind_peers(self, server: grpc.aio.Server, listen: str) -> int:
        """Serve the peer port on `listen`; its port.

        Plaintext without ``tls_dir``. With it, the gRPC server listens on a
        loopback port and `listen` is the TLS front, which logs and counts every
        refused handshake (`_peer_front`); the server must have been made with
        `peer_interceptors`.
        """
        if self.files is None:
            return add_port(server, listen, "peer_listen")
        assert self.front is not None, "make the peer server with peer_interceptors()"
        inner = add_port(server, f"{INNER_HOST}:0", "peer_listen")
        return await self.front.start(listen, inner)

    async def close(self) -> None:
        """Close the peer port's TLS front, if any (idempotent)."""
        if self.front is not None:
            await self.front.stop()

    def dial(self, peer: BrokerInfo) -> grpc.aio.Channel:
        """A channel to `peer`'s federation port; with TLS, only `peer` itself may answer."""
        if self.files is None:
            return grpc.aio.insecure_channel(peer.endpoint, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(
            peer.endpoint,
            channel_credentials(self.files),  # read now: a rotated certificate is used
            options=[*CHANNEL_OPTIONS, *dial_options(peer.id)],
        )

    def check_peer(self, context: Any, claimed: str) -> None:
        """With TLS, the caller's certificate must name the broker its hello claims.

        Raises:
            Unauthenticated: no certificate.
            PermissionDenied: a certificate for another broker (or a client).
        """
        if self.files is None:
            return
        names = (
            peer_identities(context)
            if self.front is None
            else self.front.identities(context.peer())
        )
        try:
            check_broker(names or [], claimed)
        except Unauthenticated:
            self.metrics.peer_refused.labels(reason="unauthenticated").inc()
            raise
        except PermissionDenied:
            self.metrics.peer_refused.labels(reason="identity").inc()
            raise

    # -- clients -------------------------------------------------------------

    def principal(self, context: Any) -> Principal:
        """Who is calling (`ANONYMOUS` without client authentication).

        Raises:
            Unauthenticated: no (valid) certificate or token.
        """
        if self.client_auth == "none":
            return ANONYMOUS
        if self.verifier is not None:
            token = bearer_token(context.invocation_metadata())
            return self.authenticate(token, [], "no 'authorization: Bearer <token>' metadata")
        return self.authenticate(None, peer_identities(context))

    def authenticate(
        self, token: str | None, identities: list[str], no_token: str = "no token"
    ) -> Principal:
        """The principal a bearer token (``client_auth token``) or certificate names prove.

        `identities` are the SAN names of the client's verified certificate;
        `no_token` says what was missing when `token` is None. Every front end
        (gRPC, MQTT) authenticates through here.

        Raises:
            Unauthenticated: no (valid) certificate or token; counted.
        """
        if self.client_auth == "none":
            return ANONYMOUS
        try:
            if self.verifier is not None:
                if token is None:
                    raise Unauthenticated(no_token)
                claims = self.verifier.verify(token)
                return Principal(claims.identity, claims.groups)
            identity = client_identity(identities)
            if identity is None:
                raise Unauthenticated("no client certificate naming a geofed client identity")
            return Principal(identity)
        except Unauthenticated:
            self.metrics.auth_refused.labels(reason="unauthenticated").inc()
            raise

    def may_publish(self, who: Principal, client: str, topic: str, where: LatLon) -> None:
        """Raise `PermissionDenied` unless the policy lets `who` publish there, from there."""
        if self.policy is not None:
            self._counted(self.policy.check_publish, who.identity, who.groups, client, topic)
            self.may_be_at(who, where)

    def may_subscribe(self, who: Principal, client: str, topic_filter: str) -> None:
        """Raise `PermissionDenied` unless the policy lets `who` subscribe to the filter."""
        if self.policy is not None:
            self._counted(
                self.policy.check_subscribe, who.identity, who.groups, client, topic_filter
            )

    def may_read_history(self, who: Principal, client: str, topic_filter: str) -> None:
        """Reading history needs what subscribing to the filter needs (`PermissionDenied`)."""
        self.may_subscribe(who, client, topic_filter)

    def may_delete_history(self, who: Principal, client: str, topic_filter: str) -> None:
        """Deleting history needs publish permission covering every topic of the filter."""
        if self.policy is not None:
            self._counted(self.policy.check_publish, who.identity, who.groups, client, topic_filter)

    def may_be_at(self, who: Principal, where: LatLon) -> None:
        """Raise `PermissionDenied` if `where` is outside the area the policy gives `who`."""
        if self.policy is not None:
            self._counted(self.policy.check_location, who.identity, who.groups, where)

    def _counted(self, check: Any, *args: Any) -> None:
        try:
            check(*args)
        except PermissionDenied as exc:
            self.metrics.auth_refused.labels(reason=exc.rule).inc()
            raise

    def deny_other_owner(self, who: Principal, client: str, owner: str | None) -> None:
        """A client id belongs to the identity that opened its session."""
        if self.authenticating and owner is not None and owner != who.identity:
            self.metrics.auth_refused.labels(reason="identity").inc()
            raise PermissionDenied(
                "identity", f"client id {client!r} belongs to another identity's session"
            )
