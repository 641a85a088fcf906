"""Integration tests start real node processes on loopback through `LocalFederation`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from geofed.bench import LocalFederation

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
