"""Bearer tokens: verify a client's JWT and read who it is and which groups it is in.

Why: not every client can hold a certificate (browsers behind a gateway,
short-lived jobs); an identity provider can instead sign a token (issue #12).
A client sends ``authorization: Bearer <JWT>`` as call metadata over TLS.

The broker verifies the signature with a configured public key (PEM) or a
JWKS file (a key chosen by the token's ``kid``), only with asymmetric
algorithms (RS*, PS*, ES*, EdDSA: no ``none``, no HMAC, so a public key can
never be used as a shared secret). Claims (`docs/security.md`):

* ``exp`` required; ``nbf`` and ``iat`` checked when present;
* ``sub``: the identity (required, an id: non-empty, at most 256 characters);
* ``groups``: optional list of group names (for the policy's ``[groups.*]``);
* ``aud`` / ``iss``: required and checked when the broker is configured with them.

Every failure is an `Unauthenticated` saying what was wrong with the token.

The key file is loaded again when it changes (`_watch.WatchedFile`, as for the
policy), so the identity provider's keys can be rotated without a restart:
put the new key into the JWKS beside the old one until tokens signed with the
old one have expired. A new file that does not load is logged and the
previous keys stay in force.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from geofed.routing import InvalidInput, Unauthenticated, read_input_file, validate_id

from ._watch import WatchedFile

log = logging.getLogger("geofed.node.tokens")

ALGORITHMS = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)
"""Signature algorithms a token may use: asymmetric only."""

_KEY_TYPES = (
    rsa.RSAPublicKey,
    ec.EllipticCurvePublicKey,
    ed25519.Ed25519PublicKey,
    ed448.Ed448PublicKey,
)

METADATA_KEY = "authorization"
"""The call metadata key carrying ``Bearer <token>``."""


@dataclass(frozen=True)
class TokenClaims:
    """What a verified token says about its holder."""

    identity: str
    """The ``sub`` claim."""
    groups: tuple[str, ...]
    """The ``groups`` claim (empty when absent)."""
    expires: float
    """The ``exp`` claim, seconds since the epoch."""


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry in call metadata, if any.

    Raises:
        Unauthenticated: the entry is there but is not a bearer token.
    """
    for key, value in metadata or ():
        if key.lower() != METADATA_KEY:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        scheme, _, token = text.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <token>'")
        return token.strip()
    return None


class TokenVerifier:
    """Verifies bearer tokens with one public key or the keys of a JWKS file."""

    def __init__(
        self,
        *,
        public_key: str | Path | None = None,
        jwks: str | Path | None = None,
        audience: str | None = None,
        issuer: str | None = None,
        algorithms: Sequence[str] = ALGORITHMS,
        leeway_s: float = 0.0,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Read the verification key(s); they are read again when the file changes.

        Args:
            public_key: a PEM public key (or certificate) file.
            jwks: a JWKS file (``{"keys": [...]}``); exactly one of the two.
            audience: when set, tokens need an ``aud`` naming it.
            issuer: when set, tokens need this ``iss``.
            algorithms: allowed signature algorithms (a subset of `ALGORITHMS`).
            leeway_s: clock skew tolerated on ``exp``, ``nbf`` and ``iat``.
            check_interval_s: look at the key file at most this often (0: at every token).
            clock: monotonic seconds (tests may drive it).

        Raises:
            InvalidInput: naming the option or file that cannot be used.
        """
        if (public_key is None) == (jwks is None):
            raise InvalidInput("tokens", "give exactly one of public_key and jwks")
        bad = [a for a in algorithms if a not in ALGORITHMS]
        if bad or not algorithms:
            raise InvalidInput(
                "tokens.algorithms", f"{bad or 'none'}: allowed are {', '.join(ALGORITHMS)}"
            )
        self.audience = audience
        self.issuer = issuer
        self.algorithms = list(algorithms)
        self.leeway_s = leeway_s
        # A public key object (PEM) or the JWKS keys by kid, following the file.
        self.keys: WatchedFile[Any] | WatchedFile[dict[str | None, jwt.PyJWK]]
        if public_key is not None:
            self.keys = WatchedFile(
                public_key,
                _load_pem,
                "token key",
                check_interval_s=check_interval_s,
                clock=clock,
                logger=log,
            )
        else:
            self.keys = WatchedFile(
                str(jwks),
                _load_jwks,
                "token JWKS",
                check_interval_s=check_interval_s,
                clock=clock,
                logger=log,
            )
        self._pem = public_key is not None

    def verify(self, token: str) -> TokenClaims:
        """Check a token's signature and claims; who it names and their groups.

        Raises:
            Unauthenticated: saying what is wrong (expired, bad signature, wrong
                audience, a missing claim, ...).
        """
        key = self._key_for(token)
        required = (
            ["exp", "sub"] + (["aud"] if self.audience else []) + (["iss"] if self.issuer else [])
        )
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=self._algorithms_for(key),
                audience=self.audience,
                issuer=self.issuer,
                leeway=self.leeway_s,
                options={"require": required, "verify_aud": self.audience is not None},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("token expired") from None
        except jwt.ImmatureSignatureError:
            raise Unauthenticated("token not valid yet (nbf)") from None
        except jwt.MissingRequiredClaimError as exc:
            raise Unauthenticated(f"token has no {exc.claim!r} claim") from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated(f"token audience is not {self.audience!r}") from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated(f"token issuer is not {self.issuer!r}") from None
        except jwt.InvalidSignatureError:
            raise Unauthenticated("token signature does not verify") from None
        except jwt.InvalidAlgorithmError:
            alg = _header(token).get("alg")
            raise Unauthenticated(
                f"token algorithm {alg!r} not allowed for this key"
                f" (allowed: {', '.join(self._algorithms_for(key))})"
            ) from None
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"invalid token: {exc}") from None
        return _claims(claims)

    def _algorithms_for(self, key: Any) -> list[str]:
        """The allowed algorithms a PEM key can check (PyJWT raises a TypeError, not a
        token error, when asked to check an RS256 token with an EC key); a JWKS key
        names its own algorithm."""
        if isinstance(key, jwt.PyJWK):
            return self.algorithms
        prefixes = {
            rsa.RSAPublicKey: ("RS", "PS"),
            ec.EllipticCurvePublicKey: ("ES",),
        }
        fits = next((p for t, p in prefixes.items() if isinstance(key, t)), ("EdDSA",))
        return [a for a in self.algorithms if a.startswith(fits)]

    def _key_for(self, token: str) -> Any:
        loaded = self.keys.value
        if self._pem:
            return loaded
        keys: dict[str | None, jwt.PyJWK] = loaded
        kid = _header(token).get("kid")
        if kid is None and len(keys) == 1:
            return next(iter(keys.values()))
        if kid is None:
            raise Unauthenticated("token has no 'kid' header to choose among the JWKS keys")
        if kid not in keys:
            raise Unauthenticated(f"token key id {kid!r} is not in the JWKS")
        return keys[kid]


def _header(token: str) -> dict[str, Any]:
    try:
        return jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise Unauthenticated(f"invalid token: {exc}") from None


def _claims(claims: dict[str, Any]) -> TokenClaims:
    try:
        identity = validate_id(claims["sub"], "sub")
    except InvalidInput as exc:
        raise Unauthenticated(f"token claim {exc}") from None
    groups = claims.get("groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise Unauthenticated("token claim 'groups' must be a list of strings")
    return TokenClaims(identity, tuple(groups), float(claims["exp"]))


def _load_pem(path: Path) -> Any:
    """The public key of a PEM public key or certificate file."""
    field = "tokens.public_key"
    data = read_input_file(path, field)
    try:
        if b"-----BEGIN CERTIFICATE-----" in data:
            key: Any = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(field, f"{path}: not a PEM public key or certificate: {exc}") from None
    if not isinstance(key, _KEY_TYPES):
        raise InvalidInput(field, f"{path}: a {type(key).__name__} cannot verify {ALGORITHMS}")
    return key


def _load_jwks(path: Path) -> dict[str | None, jwt.PyJWK]:
    field = "tokens.jwks"
    try:
        text = read_input_file(path, field).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(field, f"{path} is not UTF-8: {exc.reason}") from None
    try:
        keys = jwt.PyJWKSet.from_json(text).keys
    except (ValueError, jwt.PyJWTError) as exc:
        raise InvalidInput(field, f"{path}: not a usable JWKS: {exc}") from None
    out: dict[str | None, jwt.PyJWK] = {}
    for k in keys:
        if k.key_type == "oct":
            raise InvalidInput(field, f"{path}: symmetric ('oct') keys are not accepted")
        out[k.key_id] = k
    return out
