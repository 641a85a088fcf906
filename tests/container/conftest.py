"""Container tests: the broker image, built by deploy/build-image.sh, on a Docker engine.

A session fixture makes sure an engine runs (starting one with
.ci/docker-setup.sh --engine-only if needed; the tests are skipped, with the
reason, only when none can be started) and builds the image once per session
(Docker's layer cache makes an unchanged rebuild cheap). Set
GEOFED_TEST_IMAGE to use another tag, and GEOFED_TEST_REUSE_IMAGE=1 to use an
existing image without building.

The federation itself is `container_testkit.ContainerFederation`.
Testcontainers' reaper image cannot be pulled here, so the reaper is off and
the fixtures remove what they create (and leftovers of interrupted runs).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

import docker
import pytest
from container_testkit import TEST_LABEL

from geofed.routing import Federation

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("GEOFED_TEST_IMAGE", "geofed:dev")
# Building on the vfs storage driver copies whole filesystems per step.
BUILD_TIMEOUT_S = 1800


def _engine_reason() -> str | None:
    """None if a Docker engine answers, else why not."""
    client = None
    try:
        client = docker.from_env(timeout=10)
        client.ping()
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if client is not None:
            client.close()


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[docker.DockerClient]:
    """A Docker client; starts an engine with .ci/docker-setup.sh if none answers."""
    if _engine_reason() is not None:
        setup = subprocess.run(
            [str(ROOT / ".ci" / "docker-setup.sh"), "--engine-only"],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        reason = _engine_reason()
        if reason is not None:
            tail = "\n".join((setup.stdout + setup.stderr).strip().splitlines()[-5:])
            pytest.skip(
                f"no Docker engine could be started ({reason}); docker-setup.sh said:\n{tail}"
            )
    client = docker.from_env(timeout=120)
    # Leftovers of an interrupted earlier run (there is no reaper).
    for c in client.containers.list(all=True, filters={"label": TEST_LABEL}):
        c.remove(force=True)
    for n in client.networks.list(filters={"label": TEST_LABEL}):
        n.remove()
    for v in client.volumes.list(filters={"label": TEST_LABEL}):
        v.remove(force=True)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def geofed_image(docker_engine: docker.DockerClient) -> str:
    """The broker image, built from the working tree once per session."""
    if os.environ.get("GEOFED_TEST_REUSE_IMAGE") == "1":
        docker_engine.images.get(IMAGE)  # fails clearly if absent
        return IMAGE
    started = time.monotonic()
    proc = subprocess.run(
        [str(ROOT / "deploy" / "build-image.sh"), "--tag", IMAGE],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"deploy/build-image.sh failed:\n{proc.stderr[-4000:]}"
    print(f"built {IMAGE} in {time.monotonic() - started:.0f} s")
    return IMAGE


@pytest.fixture(scope="module")
def three_source() -> Federation:
    return Federation.load(ROOT / "deploy" / "federations" / "three.geojson")
