"""Integration tests start real node processes on loopback through `LocalFederation`."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from geofed.bench import LocalFederation
from geofed.routing import Federation, LatLon

ROOT = Path(__file__).resolve().parents[2]
THREE = ROOT / "deploy" / "federations" / "three.geojson"


@pytest.fixture
def three_federation(tmp_path: Path) -> Iterator[LocalFederation]:
    """A 3-broker federation (eu, us, ap) running event-geofence, stopped after the test."""
    fed = LocalFederation(
        THREE, "event-geofence", tmp_path, extra_env={"GEOFED_PEER_QUEUE_SIZE": "5"}
    )
    with fed:
        yield fed


@dataclass(frozen=True)
class TokenSigner:
    """Client tokens (ES256 JWTs) and the public key file that nodes check them with."""

    public: Path  # PEM: GEOFED_TOKEN_KEY
    key: ec.EllipticCurvePrivateKey
    forger: ec.EllipticCurvePrivateKey  # a key no node trusts

    def token(self, sub: str, *, forged: bool = False, ttl: float = 600) -> str:
        """A token for identity `sub`, valid `ttl` s from now (negative: expired)."""
        claims = {"sub": sub, "exp": int(time.time() + ttl), "iat": int(time.time()) - 1}
        return jwt.encode(claims, self.forger if forged else self.key, algorithm="ES256")


@pytest.fixture
def token_signer(tmp_path: Path) -> TokenSigner:
    key = ec.generate_private_key(ec.SECP256R1())
    public = tmp_path / "token.pub"
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return TokenSigner(public, key, ec.generate_private_key(ec.SECP256R1()))


@pytest.fixture(scope="session")
def eu_ap_edge() -> float:
    """Longitude (±0.01) where, going east along latitude 30, eu's area gives way to ap's."""
    fed = Federation.load(THREE)
    lon = 0.0
    while not (
        fed.responsible(LatLon(30.0, lon)) == "eu"
        and fed.responsible(LatLon(30.0, lon + 0.01)) == "ap"
    ):
        lon += 0.01
        assert lon < 180.0, "no eu/ap edge at latitude 30"
    return lon
