"""deploy/DEPLOY.md's "Running brokers as containers" commands, run as written.

The guide's `docker network create` and `docker run` (read-only root, no
capabilities, the federation file mounted) start broker `eu` of a three-broker
federation file made as the guide describes (`doc_shell.deploy_guide_federation`);
the broker must come up SERVING on the published client port and the image's
HEALTHCHECK must say healthy. The build command is the image fixture's
(`deploy/build-image.sh`, whose default tag is the `geofed:dev` the guide runs).
The commands are those of tests/integration/test_deploy_docs.py's NOT_RUN that
it sends here; the container and network are removed afterwards, and before, if
an interrupted run left them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_shell import HANG_GUARD_S, deploy_guide_federation, run, shell_blocks

from geofed.client import health_status

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "DEPLOY.md"
RUN_HERE = ("docker network create geofed", "docker run -d --name geofed-eu --network geofed")


def _remove_guide_objects() -> None:
    for cmd in (["docker", "rm", "-f", "geofed-eu"], ["docker", "network", "rm", "geofed"]):
        subprocess.run(cmd, capture_output=True, check=False, timeout=HANG_GUARD_S)


def _health(name: str) -> str:
    out = subprocess.run(
        ["docker", "inspect", "-f", "{{.State.Health.Status}}", name],
        capture_output=True,
        text=True,
        check=True,
        timeout=HANG_GUARD_S,
    )
    return out.stdout.strip()


def test_the_guide_runs_a_broker_container(geofed_image: str, tmp_path: Path) -> None:
    assert geofed_image == "geofed:dev", "the guide runs geofed:dev (GEOFED_TEST_IMAGE is set)"
    commands = [c for b in shell_blocks(DEPLOY) for c in b.commands if c.key.startswith(RUN_HERE)]
    assert [c.key.split()[1] for c in commands] == ["network", "run"]
    deploy_guide_federation(tmp_path)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    _remove_guide_objects()
    try:
        for cmd in commands:
            run(cmd, tmp_path, env)
        deadline = time.monotonic() + HANG_GUARD_S  # a hang guard: the waits are on state
        while (status := _health("geofed-eu")) != "healthy":
            assert status in ("starting", ""), f"geofed-eu is {status}"
            assert time.monotonic() < deadline, "geofed-eu never became healthy"
            time.sleep(0.5)
        assert health_status("127.0.0.1:7400", timeout=30.0) == "SERVING"
    finally:
        _remove_guide_objects()
