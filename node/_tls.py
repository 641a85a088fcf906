"""TLS for the broker's ports: reloadable credentials and the identities certificates carry.

Why here: a peer link is only as trustworthy as the proof behind the broker
id in its hello (issue #12). Every broker presents a certificate issued by the
federation's CA; the certificate, not the hello, says which broker it is.

**Naming scheme** (`docs/security.md`):

* a broker certificate carries the SAN ``DNS:<broker_id>.broker.geofed``
  (`broker_dns_name`). A DNS name, not a URI, so that a *dialler* can have
  TLS itself check who answered: it dials with ``grpc.ssl_target_name_override``
  set to that name (`dial_options`), since gRPC's Python client cannot read the
  server's certificate. Broker ids used with TLS must therefore be lowercase
  DNS labels (``a-z``, ``0-9``, ``-``; dots between labels);
* a client certificate carries the SAN ``URI:geofed://client/<identity>``
  (`client_uri`), the identity percent-encoded (RFC 3986), so any identity
  fits and no client certificate can pass for a broker.

The accepting side of a link reads the dialler's names (from its TLS front,
`_peer_front`, or from the call on a gRPC TLS port: `peer_identities`) and
holds them against the hello (`check_broker`).

**Rotation.** `server_credentials` builds gRPC dynamic credentials whose
fetcher looks at the three files on every new handshake and reloads them when
one changed (mtime, size or inode, then content). Established connections keep
the certificate they were made with. A half-rotated pair (a new certificate
beside the old key) is not taken: the old credentials stay until the key
matches. `channel_credentials` reads the files each time it is called, so a
dialler that builds credentials per connection attempt picks up rotated files.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from geofed.routing import InvalidInput, PermissionDenied, Unauthenticated, read_input_file

log = logging.getLogger("geofed.node.tls")

BROKER_DNS_SUFFIX = ".broker.geofed"
"""A broker certificate names ``<broker_id>`` + this suffix as a DNS SAN."""

CLIENT_URI_PREFIX = "geofed://client/"
"""A client certificate names this + the percent-encoded identity as a URI SAN."""

_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


def broker_dns_name(broker_id: str, field: str = "broker_id") -> str:
    """The DNS SAN that proves a certificate belongs to broker `broker_id`.

    Raises:
        InvalidInput: naming `field` if the id is not a lowercase DNS name
            (labels of ``a-z0-9-``, 1-63 characters, no hyphen at either end).
    """
    labels = broker_id.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidInput(
            field,
            f"{broker_id!r} cannot be named in a certificate: TLS needs broker ids made of"
            " lowercase DNS labels (a-z, 0-9, '-', dots between labels)",
        )
    return broker_id + BROKER_DNS_SUFFIX


def client_uri(identity: str) -> str:
    """The URI SAN that names client `identity` in a client certificate."""
    return CLIENT_URI_PREFIX + urllib.parse.quote(identity, safe="")


def broker_ids(identities: Sequence[str]) -> list[str]:
    """The broker ids named among certificate SANs (``<id>.broker.geofed``)."""
    return [
        name.removesuffix(BROKER_DNS_SUFFIX)
        for name in identities
        if name.endswith(BROKER_DNS_SUFFIX) and len(name) > len(BROKER_DNS_SUFFIX)
    ]


def client_identity(identities: Sequence[str]) -> str | None:
    """The client identity a certificate names (its first ``geofed://client/`` URI), if any."""
    for name in identities:
        if name.startswith(CLIENT_URI_PREFIX) and len(name) > len(CLIENT_URI_PREFIX):
            return urllib.parse.unquote(name[len(CLIENT_URI_PREFIX) :])
    return None


def peer_identities(
    context: grpc.aio.ServicerContext[Any, Any] | grpc.ServicerContext,
) -> list[str]:
    """The SAN names (DNS and URI) of the caller's verified certificate; [] without TLS.

    gRPC puts a name in the auth context only after the certificate chained to
    the port's CA, so with ``require_client_auth`` every name here is vouched
    for by the CA. On a plaintext port, or a TLS port without a client
    certificate, there are none.
    """
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return []
    names = [*auth.get("peer_dns", ()), *auth.get("peer_uri", ())]
    return [n.decode("utf-8", "replace") for n in names]


def check_broker(identities: Sequence[str], claimed: str) -> None:
    """Refuse a peer whose certificate does not name the broker id its hello claims.

    Args:
        identities: the peer's certificate names (`peer_identities`).
        claimed: the broker id in the peer's hello.

    Raises:
        Unauthenticated: the peer presented no certificate (plaintext or none sent).
        PermissionDenied: (rule ``identity``) its certificate names other brokers or
            none, naming the claimed id and those the certificate carries.
    """
    if not identities:
        raise Unauthenticated(f"peer claiming broker {claimed!r} presented no certificate")
    named = broker_ids(identities)
    if claimed in named:
        return
    which = (
        ", ".join(repr(b) for b in named) if named else "no broker (" + ", ".join(identities) + ")"
    )
    raise PermissionDenied(
        "identity", f"hello claims broker {claimed!r} but the peer's certificate names {which}"
    )


# --------------------------------------------------------------------------
# Credentials from files


@dataclass(frozen=True)
class TLSFiles:
    """The PEM files of one TLS identity: trusted CA certificates, own certificate and key."""

    ca: Path
    """CA certificate(s) to verify the other side with (a bundle during a CA rotation)."""
    cert: Path
    """This side's certificate chain (leaf first)."""
    key: Path
    """This side's private key (unencrypted PEM)."""

    @classmethod
    def in_dir(cls, folder: str | Path) -> TLSFiles:
        """``ca.pem``, ``cert.pem`` and ``key.pem`` in `folder` (the `geofed certs` layout)."""
        d = Path(folder)
        return cls(d / "ca.pem", d / "cert.pem", d / "key.pem")

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate, key) bytes, checked to be PEM and the key to match the certificate.

        Raises:
            InvalidInput: naming the file that is missing, unreadable or not what it should be.
        """
        ca, cert, key = (
            read_input_file(p, f"tls.{f}")
            for p, f in ((self.ca, "ca"), (self.cert, "cert"), (self.key, "key"))
        )
        _check_pair(cert, key, self)
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError as exc:
            raise InvalidInput("tls.ca", f"{self.ca}: not PEM certificates: {exc}") from None
        return ca, cert, key

    def _stamp(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for p in (self.ca, self.cert, self.key):
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)


def _check_pair(cert: bytes, key: bytes, files: TLSFiles) -> None:
    try:
        leaf = x509.load_pem_x509_certificate(cert)
    except ValueError as exc:
        raise InvalidInput("tls.cert", f"{files.cert}: not a PEM certificate: {exc}") from None
    try:
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise InvalidInput("tls.key", f"{files.key}: not an unencrypted PEM key: {exc}") from None
    spki = serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    if private.public_key().public_bytes(*spki) != leaf.public_key().public_bytes(*spki):
        raise InvalidInput(
            "tls.key", f"{files.key} does not belong to the certificate {files.cert}"
        )


class CertificateWatch:
    """Tells when a broker's TLS files changed into a new, whole and consistent set.

    Serves every TLS port of the node: gRPC's certificate fetcher (`_Reloader`)
    and the listeners beside gRPC (`Security._following`: MQTT, HTTP, the peer
    port's TLS front), each asking on new handshakes.
    """

    def __init__(self, files: TLSFiles, material: tuple[bytes, bytes, bytes]) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._material = material
        self._stamp = files._stamp()
        self.reloads = 0
        """How many times new files were taken (for tests and logs)."""

    def changed(self) -> tuple[bytes, bytes, bytes] | None:
        """The new (CA, certificate, key) if the files changed since last asked, else None."""
        with self._lock:
            try:
                stamp = self.files._stamp()
                if stamp == self._stamp:
                    return None
                material = self.files.read()
            except (OSError, InvalidInput) as exc:
                # Mid-rotation (a file missing or not matching yet): keep serving the old pair.
                log.warning("TLS files not reloaded, keeping the current ones: %s", exc)
                return None
            self._stamp = stamp
            if material == self._material:
                return None
            self._material = material
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.files.cert)
            return material


class _Reloader(CertificateWatch):
    """The certificate-config fetcher of dynamic server credentials.

    gRPC calls it from its own threads on every new handshake; it answers
    None (keep the current credentials) unless the files changed and the new
    ones are whole and consistent.
    """

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        material = self.changed()
        return None if material is None else _config(material)


def _config(material: tuple[bytes, bytes, bytes]) -> grpc.ServerCertificateConfiguration:
    ca, cert, key = material
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


def server_credentials(
    files: TLSFiles, *, require_client_auth: bool = True
) -> grpc.ServerCredentials:
    """Credentials for ``server.add_secure_port`` that follow the files as they change.

    Use ``require_client_auth=True`` on the peer port (mutual TLS: the caller's
    certificate must chain to ``files.ca``) and on a client port that
    authenticates clients by certificate. False serves TLS to clients that
    authenticate by token instead: gRPC then does not ask for a client
    certificate at all, so `peer_identities` is empty on such a port (gRPC's
    Python API has no "request but do not require").

    Raises:
        InvalidInput: naming the file that cannot be used (checked now, not at the first handshake).
    """
    material = files.read()
    return grpc.dynamic_ssl_server_credentials(
        _config(material),
        _Reloader(files, material),
        require_client_authentication=require_client_auth,
    )


def channel_credentials(files: TLSFiles, *, client_cert: bool = True) -> grpc.ChannelCredentials:
    """Credentials for a secure channel, from the files as they are now.

    Call it for each new channel (a dialler's redial) so rotated files are
    used; a channel keeps the credentials it was built with.

    Args:
        files: CA to verify the server with; own certificate and key.
        client_cert: present the certificate (mutual TLS); False verifies the server only.

    Raises:
        InvalidInput: naming the file that cannot be used.
    """
    ca, cert, key = files.read()
    if not client_cert:
        return grpc.ssl_channel_credentials(root_certificates=ca)
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )


def dial_options(peer_id: str) -> list[tuple[str, str]]:
    """Channel options that make TLS check that the answering broker is `peer_id`.

    The server's certificate must then name ``<peer_id>.broker.geofed``,
    whatever host the endpoint uses.
    """
    return [("grpc.ssl_target_name_override", broker_dns_name(peer_id, "peer"))]
