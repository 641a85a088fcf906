"""Bearer token verification: claims, expiry, audience, issuer, keys, algorithms, JWKS.

Keys are generated at run time and tokens signed with them (PyJWT); none is committed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519, rsa

from geofed.node import TokenClaims, TokenVerifier, bearer_token, create_ca
from geofed.routing import InvalidInput, Unauthenticated

RSA = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC = ec.generate_private_key(ec.SECP256R1())
ED = ed25519.Ed25519PrivateKey.generate()
OTHER = rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem(key: Any) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def token(
    key: Any = RSA, alg: str = "RS256", headers: dict[str, Any] | None = None, **claims: Any
) -> str:
    body: dict[str, Any] = {"sub": "alice", "exp": int(time.time()) + 600}
    body.update(claims)
    body = {k: v for k, v in body.items() if v is not None}
    return jwt.encode(body, key, algorithm=alg, headers=headers)


def hmac_token(secret: bytes) -> str:
    """An HS256 token signed with `secret` (PyJWT itself refuses a public key as secret)."""

    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    head = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = b64(json.dumps({"sub": "mallory", "exp": int(time.time()) + 600}).encode())
    mac = hmac.new(secret, head + b"." + body, hashlib.sha256).digest()
    return (head + b"." + body + b"." + b64(mac)).decode()


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "issuer.pem"
    path.write_bytes(pem(RSA))
    return path


def refused(verifier: TokenVerifier, tok: str) -> str:
    with pytest.raises(Unauthenticated) as info:
        verifier.verify(tok)
    return info.value.reason


def test_a_valid_token_names_the_identity_and_groups(key_file: Path) -> None:
    verifier = TokenVerifier(public_key=key_file)
    exp = int(time.time()) + 60
    claims = verifier.verify(token(groups=["operators", "eu"], exp=exp))
    assert claims == TokenClaims("alice", ("operators", "eu"), float(exp))
    assert verifier.verify(token()).groups == ()


@pytest.mark.parametrize(
    ("claims", "reason"),
    [
        ({"exp": -10}, "token expired"),  # times: seconds from when the test runs
        ({"exp": None}, "token has no 'exp' claim"),
        ({"sub": None}, "token has no 'sub' claim"),
        ({"sub": ""}, "sub: must be a non-empty string"),
        ({"sub": 7}, "invalid token"),  # PyJWT: the subject must be a string
        ({"nbf": 600}, "not valid yet"),
        ({"groups": "operators"}, "'groups' must be a list of strings"),
        ({"groups": ["ok", 3]}, "'groups' must be a list of strings"),
    ],
)
def test_bad_claims_are_refused(key_file: Path, claims: dict[str, Any], reason: str) -> None:
    # Relative to now, not to collection: a long run must not turn "later" into "earlier".
    now = int(time.time())
    claims = {
        k: now + v if k in ("exp", "nbf") and isinstance(v, int) else v for k, v in claims.items()
    }
    assert reason in refused(TokenVerifier(public_key=key_file), token(**claims))


def test_audience_and_issuer_are_required_when_configured(key_file: Path) -> None:
    verifier = TokenVerifier(public_key=key_file, audience="geofed", issuer="https://idp")
    verifier.verify(token(aud="geofed", iss="https://idp"))
    verifier.verify(token(aud=["other", "geofed"], iss="https://idp"))
    assert refused(verifier, token(aud="other", iss="https://idp")) == (
        "token audience is not 'geofed'"
    )
    assert refused(verifier, token(iss="https://idp")) == "token has no 'aud' claim"
    assert refused(verifier, token(aud="geofed", iss="https://evil")) == (
        "token issuer is not 'https://idp'"
    )
    assert refused(verifier, token(aud="geofed")) == "token has no 'iss' claim"
    # Not configured: not checked.
    TokenVerifier(public_key=key_file).verify(token(aud="anything", iss="anyone"))


def test_only_the_configured_key_and_asymmetric_algorithms_verify(key_file: Path) -> None:
    verifier = TokenVerifier(public_key=key_file)
    assert refused(verifier, token(OTHER)) == "token signature does not verify"
    assert refused(verifier, token(None, "none")).startswith("token algorithm 'none' not")
    # The public key used as an HMAC secret (algorithm confusion) gets nowhere.
    assert refused(verifier, hmac_token(pem(RSA))).startswith("token algorithm 'HS256' not")
    assert "invalid token" in refused(verifier, "not.a.jwt")
    forged = token().rsplit(".", 1)[0] + "." + token(sub="mallory").rsplit(".", 1)[1]
    assert refused(verifier, forged) == "token signature does not verify"


@pytest.mark.parametrize(("key", "alg"), [(EC, "ES256"), (ED, "EdDSA"), (RSA, "PS256")])
def test_ec_eddsa_and_pss_keys_work(tmp_path: Path, key: Any, alg: str) -> None:
    path = tmp_path / "k.pem"
    path.write_bytes(pem(key))
    assert TokenVerifier(public_key=path).verify(token(key, alg)).identity == "alice"


def test_a_certificate_can_stand_for_the_public_key(tmp_path: Path) -> None:
    ca = create_ca(tmp_path / "ca")  # any certificate: its public key verifies
    verifier = TokenVerifier(public_key=ca.cert_path)
    assert verifier.verify(token(ca.key, "ES256")).identity == "alice"


def _jwks(tmp_path: Path, *entries: tuple[Any, str | None, str]) -> Path:
    keys = []
    for key, kid, alg in entries:
        algo = jwt.get_algorithm_by_name(alg)
        jwk = json.loads(algo.to_jwk(key.public_key()))
        jwk["alg"] = alg
        if kid is not None:
            jwk["kid"] = kid
        keys.append(jwk)
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": keys}))
    return path


def test_jwks_keys_are_chosen_by_kid(tmp_path: Path) -> None:
    path = _jwks(tmp_path, (RSA, "r1", "RS256"), (EC, "e1", "ES256"))
    verifier = TokenVerifier(jwks=path)
    assert verifier.verify(token(RSA, "RS256", {"kid": "r1"})).identity == "alice"
    assert verifier.verify(token(EC, "ES256", {"kid": "e1"})).identity == "alice"
    # The key named, another key's algorithm: refused before any signature check.
    assert "token algorithm 'RS256' not" in refused(verifier, token(RSA, "RS256", {"kid": "e1"}))
    assert refused(verifier, token(OTHER, "RS256", {"kid": "r1"})) == (
        "token signature does not verify"
    )
    assert refused(verifier, token(OTHER, "RS256", {"kid": "x"})) == (
        "token key id 'x' is not in the JWKS"
    )
    assert "no 'kid' header" in refused(verifier, token(RSA, "RS256"))
    single = TokenVerifier(jwks=_jwks(tmp_path, (EC, None, "ES256")))
    assert single.verify(token(EC, "ES256")).identity == "alice"


def test_unusable_configuration_is_named(tmp_path: Path, key_file: Path) -> None:
    with pytest.raises(InvalidInput, match="exactly one"):
        TokenVerifier()
    with pytest.raises(InvalidInput, match="exactly one"):
        TokenVerifier(public_key=key_file, jwks=key_file)
    with pytest.raises(InvalidInput) as info:
        TokenVerifier(public_key=tmp_path / "missing.pem")
    assert info.value.field == "tokens.public_key" and "missing.pem" in info.value.reason
    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(InvalidInput, match="not a PEM public key"):
        TokenVerifier(public_key=tmp_path / "junk.pem")
    (tmp_path / "dsa.pem").write_bytes(pem(dsa.generate_private_key(2048)))
    with pytest.raises(InvalidInput, match="cannot verify"):
        TokenVerifier(public_key=tmp_path / "dsa.pem")
    (tmp_path / "jwks.json").write_text('{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}')
    with pytest.raises(InvalidInput) as info:
        TokenVerifier(jwks=tmp_path / "jwks.json")
    assert info.value.field == "tokens.jwks"
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InvalidInput, match="not a usable JWKS"):
        TokenVerifier(jwks=tmp_path / "bad.json")
    with pytest.raises(InvalidInput) as info:
        TokenVerifier(public_key=key_file, algorithms=["HS256"])
    assert info.value.field == "tokens.algorithms"


def _replace(path: Path, data: bytes) -> None:
    """Write a new version of the file and rename it over the old one (a new inode)."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    tmp.replace(path)


def test_a_rotated_key_file_is_loaded_again_and_a_broken_one_keeps_the_old_key(
    key_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    verifier = TokenVerifier(public_key=key_file, check_interval_s=0)
    assert verifier.verify(token(RSA)).identity == "alice"
    _replace(key_file, pem(EC))  # the identity provider rotated its key
    assert verifier.verify(token(EC, "ES256")).identity == "alice"
    assert "token algorithm 'RS256' not" in refused(verifier, token(RSA))  # the old key is gone
    assert verifier.keys.loads == 2 and verifier.keys.error is None
    with caplog.at_level(logging.WARNING, "geofed.node.tokens"):
        _replace(key_file, b"half written")
        assert verifier.verify(token(EC, "ES256")).identity == "alice"  # the old key stays
        assert verifier.verify(token(EC, "ES256")).identity == "alice"
    assert verifier.keys.error is not None and "not a PEM public key" in verifier.keys.error
    assert caplog.text.count("token key") == 1  # logged once per change, not per token


def test_a_jwks_file_is_loaded_again_within_its_interval(tmp_path: Path) -> None:
    now = [100.0]
    path = _jwks(tmp_path, (RSA, "r1", "RS256"))
    verifier = TokenVerifier(jwks=path, check_interval_s=5.0, clock=lambda: now[0])
    (tmp_path / "new").mkdir()
    new_key = _jwks(tmp_path / "new", (RSA, "r1", "RS256"), (EC, "e2", "ES256"))
    _replace(path, new_key.read_bytes())
    assert "not in the JWKS" in refused(verifier, token(EC, "ES256", {"kid": "e2"}))
    now[0] += 5.0
    assert verifier.verify(token(EC, "ES256", {"kid": "e2"})).identity == "alice"
    assert verifier.verify(token(RSA, "RS256", {"kid": "r1"})).identity == "alice"


def test_the_bearer_token_is_read_from_call_metadata() -> None:
    assert bearer_token([("x-other", "1"), ("authorization", "Bearer abc.def.ghi")]) == (
        "abc.def.ghi"
    )
    assert bearer_token([("Authorization", b"bearer  tok ")]) == "tok"
    assert bearer_token([("x-other", "1")]) is None
    assert bearer_token(None) is None
    for bad in ("Basic dXNlcjpwdw==", "Bearer", "Bearer   "):
        with pytest.raises(Unauthenticated, match="Bearer <token>"):
            bearer_token([("authorization", bad)])
