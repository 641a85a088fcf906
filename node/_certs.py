"""A small certificate authority for a federation (brokers and clients).

Why: the secure path should be the easy one (issue #12). This issues what a
federation needs for mutual TLS and client certificates, with the names the
node checks (`docs/security.md`); ``geofed certs`` is its command line, and
``geofed up --tls`` uses it for a local federation:

* broker: SAN ``DNS:<broker_id>.broker.geofed``, plus ``localhost``,
  ``127.0.0.1``, ``::1`` and the hosts of the broker's ``endpoint`` and
  ``client_endpoint`` (so clients can verify the host they dial); usable as
  server and as client (a broker dials its peers with it);
* client: SAN ``URI:geofed://client/<identity>`` (percent-encoded), client use only.

Keys are ECDSA P-256, made fresh on every call and written ``0600``. Each
certificate folder holds ``ca.pem`` (the CA to trust), ``cert.pem`` and
``key.pem`` (`geofed.node.TLSFiles.in_dir`). Files are replaced atomically,
so a running node reloading them never reads half a file.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import tempfile
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from geofed.routing import Federation, InvalidInput, validate_id

from ._tls import TLSFiles, broker_dns_name, client_uri

CA_VALID = dt.timedelta(days=3650)
"""Default lifetime of a CA made by `create_ca`."""
LEAF_VALID = dt.timedelta(days=365)
"""Default lifetime of a broker or client certificate."""
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Names every broker certificate carries, so loopback endpoints verify."""


@dataclass(frozen=True)
class CA:
    """A certificate authority: its certificate and private key, and where they are."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    cert_path: Path
    """``ca.pem``: what brokers and clients trust."""
    key_path: Path
    """``ca.key``: keep it private; only `issue_*` needs it."""

    @classmethod
    def load(cls, folder: str | Path) -> CA:
        """The CA kept in `folder` (``ca.pem``, ``ca.key``) by `create_ca`.

        Raises:
            InvalidInput: naming the file that is missing or unusable.
        """
        d = Path(folder)
        cert_path, key_path = d / "ca.pem", d / "ca.key"
        try:
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except OSError as exc:
            raise InvalidInput("ca", f"cannot read {exc.filename}: {exc.strerror}") from None
        except (ValueError, TypeError) as exc:
            raise InvalidInput("ca", f"{d}: not a PEM CA certificate and key: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidInput("ca", f"{key_path}: expected an EC key, got {type(key).__name__}")
        return cls(cert, key, cert_path, key_path)


def create_ca(
    folder: str | Path,
    *,
    name: str = "geofed federation CA",
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> CA:
    """Make a new CA (key and self-signed certificate) in `folder` as ``ca.pem``/``ca.key``.

    Args:
        folder: created if missing; existing CA files there are replaced.
        name: the CA's common name.
        not_before: start of validity (default: now, minus a minute for clock skew).
        not_after: end of validity (default: `CA_VALID` after `not_before`).
    """
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start, end = _validity(not_before, not_after, CA_VALID)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(d / "ca.key", _key_pem(key), private=True)
    _write(d / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return CA(cert, key, d / "ca.pem", d / "ca.key")


def issue_broker(
    ca: CA,
    broker_id: str,
    hosts: Iterable[str],
    folder: str | Path,
    *,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> TLSFiles:
    """Issue broker `broker_id` a certificate for its peer and client ports, into `folder`.

    Args:
        ca: the federation's CA.
        broker_id: a lowercase DNS name (`geofed.node.broker_dns_name`).
        hosts: extra host names or IP addresses clients dial it by (loopback is always in).
        folder: gets ``ca.pem``, ``cert.pem`` and ``key.pem``.
        not_before: start of validity (default: now, minus a minute).
        not_after: end of validity (default: `LEAF_VALID` after `not_before`); a
            time in the past makes an expired certificate (for tests).

    Raises:
        InvalidInput: the broker id cannot be a DNS name, or a host is not a valid name.
    """
    names: list[x509.GeneralName] = [x509.DNSName(broker_dns_name(broker_id))]
    for host in dict.fromkeys((*LOOPBACK_HOSTS, *hosts)):
        names.append(_host_name(host))
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return _issue(ca, broker_id, names, usage, Path(folder), not_before, not_after)


def issue_client(
    ca: CA,
    identity: str,
    folder: str | Path,
    *,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> TLSFiles:
    """Issue a client certificate naming `identity` (``URI:geofed://client/<identity>``).

    Args:
        ca: the federation's CA.
        identity: the authenticated identity a broker sees for this client (an id:
            non-empty, at most 256 characters, no control characters).
        folder: gets ``ca.pem``, ``cert.pem`` and ``key.pem``.
        not_before: start of validity (default: now, minus a minute).
        not_after: end of validity (default: `LEAF_VALID` after `not_before`).

    Raises:
        InvalidInput: (field ``identity``) for an identity that is not a valid id.
    """
    validate_id(identity, "identity")
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(client_uri(identity))]
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    return _issue(ca, identity, names, usage, Path(folder), not_before, not_after)


def issue_federation(
    federation: str | Path,
    out: str | Path,
    *,
    clients: Sequence[str] = (),
    valid: dt.timedelta = LEAF_VALID,
) -> dict[str, TLSFiles]:
    """Certificates for every broker of a federation file (and some clients), under `out`.

    Layout: ``out/ca.pem`` and ``out/ca.key`` (the CA: reused when present,
    so running it again re-issues the certificates under the same CA, and a
    client can be added later), ``out/brokers/<id>/`` per broker and
    ``out/clients/<identity>/`` per client (percent-encoded).

    Args:
        federation: a federation file or bundled name (`geofed.routing.federation_path`).
        out: the output folder (created if missing).
        clients: identities to issue client certificates for.
        valid: lifetime of each issued certificate.

    Returns:
        ``broker:<id>`` and ``client:<identity>`` -> the files written.

    Raises:
        InvalidInput: naming the federation member or the identity that cannot be used.
    """
    fed = Federation.load(federation)
    root = Path(out)
    ca = CA.load(root) if (root / "ca.pem").exists() else create_ca(root)
    not_after = dt.datetime.now(dt.UTC) + valid
    issued: dict[str, TLSFiles] = {}
    for b in fed.brokers:
        hosts = [_host(e) for e in (b.endpoint, b.client_endpoint) if e]
        try:
            broker_dns_name(b.id)
        except InvalidInput as exc:
            raise InvalidInput(f"federation broker {b.id!r}", exc.reason) from None
        folder = root / "brokers" / b.id
        issued[f"broker:{b.id}"] = issue_broker(ca, b.id, hosts, folder, not_after=not_after)
    for identity in clients:
        folder = root / "clients" / _folder_name(identity)
        issued[f"client:{identity}"] = issue_client(ca, identity, folder, not_after=not_after)
    return issued


# --------------------------------------------------------------------------
# Helpers


def _validity(
    not_before: dt.datetime | None, not_after: dt.datetime | None, default: dt.timedelta
) -> tuple[dt.datetime, dt.datetime]:
    # A minute back: a peer whose clock is slightly behind still accepts a fresh certificate.
    start = not_before or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    end = not_after or start + default
    if end <= start:
        start = end - dt.timedelta(days=1)  # an expired certificate (for tests): valid before
    return start, end


def _issue(
    ca: CA,
    common_name: str,
    names: list[x509.GeneralName],
    usage: list[x509.ObjectIdentifier],
    folder: Path,
    not_before: dt.datetime | None,
    not_after: dt.datetime | None,
) -> TLSFiles:
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(not_before, not_after, LEAF_VALID)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    files = TLSFiles.in_dir(folder)
    # Key first: a node reloading between the two writes sees a mismatched pair and waits.
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
    _write(files.ca, ca.cert.public_bytes(serialization.Encoding.PEM))
    return files


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    """Replace `path` atomically (a reader sees the old or the new file, never half)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600 if private else 0o644)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _host(endpoint: str) -> str:
    """The host of a ``host:port`` endpoint (IPv6 brackets removed)."""
    return endpoint.rpartition(":")[0].strip("[]")


def _host_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        host.encode("ascii")
    except UnicodeEncodeError:
        raise InvalidInput("hosts", f"{host!r}: give non-ASCII host names in IDNA form") from None
    return x509.DNSName(host)


def _folder_name(identity: str) -> str:
    """A file name for an identity: percent-encoded, never ``.`` or ``..``."""
    validate_id(identity, "client")
    name = urllib.parse.quote(identity, safe="")
    return name.replace(".", "%2E", 1) if name.startswith(".") else name
