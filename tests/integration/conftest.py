"""Integration tests start real node processes on loopback through `LocalFederation`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
