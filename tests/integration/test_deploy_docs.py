"""The deployment documents' shell examples run as written.

deploy/DEPLOY.md, k8s/README.md and docs/security.md: every ```sh command
either runs here (in document order, one temporary working directory per
document, the venv's `geofed` on PATH, `deploy/` linked in as the commands run
from the checkout's root) and exits 0, or is in NOT_RUN with the reason --
mostly that it needs a Kubernetes cluster or a container engine; the Docker
commands run in the container tier (tests/container/test_deploy_docs_containers.py).
The files an example names without making them come from FILES: the JSON
block the document shows for them, or a federation file where the text says
"a federation file". What the renders write is checked by
tests/unit/k8s/test_k8s_render.py; here, that the documented commands work.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from doc_shell import (
    Block,
    _fenced_blocks,
    check_inventory,
    deploy_guide_federation,
    run,
    shell_blocks,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DEPLOY = ROOT / "deploy" / "DEPLOY.md"
K8S = ROOT / "k8s" / "README.md"
SECURITY = ROOT / "docs" / "security.md"
THREE = ROOT / "deploy" / "federations" / "three.geojson"

CLUSTER = (
    "needs a Kubernetes cluster (the rendered trees are built with kubectl kustomize"
    " in tests/unit/k8s/test_k8s_render.py)"
)
CONTAINERS = "run by tests/container/test_deploy_docs_containers.py (needs the Docker engine)"

NOT_RUN: dict[Path, dict[str, str]] = {
    DEPLOY: {
        "deploy/build-image.sh": (
            "the container tier's image fixture (tests/container/conftest.py) runs it,"
            " its default tag geofed:dev spelt out"
        ),
        "deploy/build-image.sh --tag registry.example/geofed:0.1.0": (
            "the same build under another tag; the container tier builds geofed:dev"
        ),
        "deploy/build-image.sh --base python:3.11-slim-bookworm": (
            "pulls a base image from an image registry, which this machine cannot reach"
        ),
        "docker network create geofed": CONTAINERS,
        "docker run -d --name geofed-eu --network geofed --network-alias geofed-eu --read-only"
        " --tmpfs /tmp:size=64m --cap-drop ALL --security-opt no-new-privileges -v"
        ' "$PWD/federation.geojson:/etc/geofed/federation.geojson:ro" -e GEOFED_BROKER_ID=eu'
        " -e GEOFED_FEDERATION=/etc/geofed/federation.geojson -p 127.0.0.1:7400:7400"
        " -p 127.0.0.1:9400:9400 geofed:dev": CONTAINERS,
        'docker run -d --name geofed-eu ... -v "$PWD/pki/brokers/eu:/etc/geofed-tls:ro"'
        " -e GEOFED_TLS_DIR=/etc/geofed-tls -e GEOFED_REFLECTION=off geofed:dev": (
            "`...` stands for the flags of the run above; the container tests run TLS"
            " brokers with these mounts (tests/container/test_container_federation.py)"
        ),
        "kubectl create namespace geofed": CLUSTER,
        "kubectl apply --server-side -k deploy-aws": CLUSTER,
        "kubectl --context eu apply --server-side -k deploy-regions/overlays/eu": CLUSTER,
        "for b in eu us ap; do": CLUSTER,
        "kubectl -n geofed create secret generic geofed-tls-$b --from-file=pki/brokers/$b": (
            CLUSTER
        ),
        "done": CLUSTER,
        "kubectl apply --server-side -k deploy-3": CLUSTER,
        "kubectl -n geofed create secret generic geofed-tls-eu --from-file=pki/brokers/eu"
        " --dry-run=client -o yaml | kubectl apply -f -": CLUSTER,
        "kubectl -n cert-manager create secret tls geofed-ca --cert=pki/ca.pem"
        " --key=pki/ca.key": CLUSTER,
        "cat <<'END' | kubectl apply -f - apiVersion: cert-manager.io/v1 kind: ClusterIssuer"
        " metadata: {name: geofed-ca} spec: {ca: {secretName: geofed-ca}} END": CLUSTER,
    },
    K8S: {},
    SECURITY: {
        "geofed node --broker-id eu --federation FEDERATION.geojson --tls-dir certs/brokers/eu"
        " --client-auth cert --policy-file policy.toml": (
            "a broker that serves until stopped; tests/integration/test_security.py runs"
            " brokers with these settings"
        ),
    },
}


def _json_block_before(doc: Path, command: str) -> str:
    """The last ```json block of `doc` before the block holding `command`."""
    shown = ""
    for lang, _, body in _fenced_blocks(doc):
        if lang == "json":
            shown = "\n".join(body)
        elif any(command in line for line in body):
            return shown
    raise AssertionError(f"{doc.name}: no block runs {command!r}")


# Files the examples use without making them: name -> how the test makes it.
FILES: dict[Path, dict[str, Callable[[Path], None]]] = {
    DEPLOY: {
        "endpoints.json": lambda cwd: (cwd / "endpoints.json").write_text(
            _json_block_before(DEPLOY, "--endpoints endpoints.json"), encoding="utf-8"
        ),
        "federation.geojson": deploy_guide_federation,
    },
    K8S: {},
    SECURITY: {
        # "FEDERATION" is the reader's federation file: the bundled three here.
        "FEDERATION.geojson": lambda cwd: (cwd / "FEDERATION.geojson").write_bytes(
            THREE.read_bytes()
        ),
    },
}

DOCS = [DEPLOY, K8S, SECURITY]


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_every_command_is_run_or_listed(doc: Path) -> None:
    check_inventory(shell_blocks(doc), NOT_RUN[doc])


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(ROOT)))
def test_commands_run_as_written(doc: Path, tmp_path: Path) -> None:
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")
    for make in FILES[doc].values():
        make(tmp_path)
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    blocks: list[Block] = shell_blocks(doc)
    ran = 0
    for cmd in (c for b in blocks for c in b.commands):
        if cmd.key in NOT_RUN[doc]:
            continue
        run(cmd, tmp_path, env)
        ran += 1
    assert ran
    if doc is DEPLOY:  # what the later steps rely on was made
        assert (tmp_path / "deploy-3" / "overlays" / "eu" / "federation.geojson").is_file()
        assert (tmp_path / "pki" / "brokers" / "eu" / "key.pem").is_file()
        cm = (tmp_path / "deploy-3-cm" / "overlays" / "eu" / "certificate.yaml").read_text()
        assert re.search(r"kind: ClusterIssuer", cm) and "geofed-ca" in cm
