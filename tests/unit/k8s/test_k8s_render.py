"""`geofed k8s render`: manifests render, validate offline and agree with the node config.

Every rendered object is validated against the Kubernetes OpenAPI schemas of
the pinned versions (kubernetes-validate, strict: unknown fields fail). The
expected values come from the node's own configuration loader and from the
rendered objects themselves, not from the renderer's constants.
"""

from __future__ import annotations

import argparse
import base64
import filecmp
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

import geofed.k8s
from geofed.k8s.cli import register
from geofed.node import CLIENT_PORT, NodeConfig, TLSFiles, broker_dns_name, issue_federation
from geofed.routing import Federation, GeofedError, InvalidInput

ROOT = Path(__file__).resolve().parents[3]
THREE = ROOT / "deploy" / "federations" / "three.geojson"
AWS = ROOT / "deploy" / "federations" / "aws-2020.geojson"
# The oldest Kubernetes release the manifests support, and the newest schema shipped.
K8S_VERSIONS = ("1.30", "1.37")
NAMESPACE = "geofed-test"
IMAGE = "registry.example:5000/geofed:0.1.0"
BROKER_LABEL = "geofed.io/broker"
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?")  # RFC 1123

Objects = list[dict[str, Any]]


# --- helpers ------------------------------------------------------------------


@functools.cache
def _kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed (it renders the kustomizations; .ci/run installs it)")
    proc = subprocess.run(
        [path, "version", "--client", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    kustomize = json.loads(proc.stdout or "{}").get("kustomizeVersion", "")
    # Components, `labels` and `patches` need kustomize 5 (kubectl 1.27 or newer).
    assert kustomize.startswith("v") and int(kustomize[1:].split(".")[0]) >= 5, (
        f"{path} bundles kustomize {kustomize or '(unknown)'}; the manifests need v5 or newer "
        "(kubectl >= 1.27; Debian bookworm's kubernetes-client 1.20 is too old)"
    )
    return path


def kustomize(directory: Path) -> Objects:
    """`kubectl kustomize DIR` as a list of objects."""
    proc = subprocess.run(
        [_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def valid_objects(directory: Path) -> Objects:
    """`kustomize` of `directory`, every object validated."""
    objects = kustomize(directory)
    validate(objects)
    return objects


def validate(objects: Objects) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith(("monitoring.coreos.com/", "cert-manager.io/")):
            continue  # CRDs: no schema in the Kubernetes OpenAPI set
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                name = f"{obj['kind']}/{obj['metadata']['name']}"
                pytest.fail(f"{name} is invalid for Kubernetes {version}: {exc}")


def of_kind(objects: Objects, kind: str) -> Objects:
    return [o for o in objects if o["kind"] == kind]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any]
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def env_of(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(deployment)["env"]}


def node_config(deployment: dict[str, Any]) -> NodeConfig:
    """What the node would run with, given exactly the pod's environment."""
    return NodeConfig.load(env=env_of(deployment))


def port_of(listen: str) -> int:
    return int(listen.rpartition(":")[2])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def assert_release_only(selector: dict[str, str], release: str) -> None:
    """`selector` admits this release's pods by geofed's own labels, not generic ones."""
    assert selector and all(k.startswith("geofed.io/") for k in selector), selector
    assert release in selector.values(), selector
    # A pod of another release, otherwise labelled alike, is not selected.
    for key, value in selector.items():
        if value == release:
            assert not selects(selector, {**selector, key: f"{release}-other"})


def volume_files(
    pod: dict[str, Any], mount_path: str, secrets: dict[str, dict[str, Any]], folder: Path
) -> Path:
    """The files the kubelet would put at `mount_path`, written into `folder` (made here).

    `secrets` holds the Secret objects by name (``kubectl create secret ...
    -o json``); items map keys to paths as the kubelet does.
    """
    (c,) = pod["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount_path]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    data = secrets[secret["secretName"]]["data"]
    items = secret.get("items") or [{"key": k, "path": k} for k in data]
    folder.mkdir()
    for item in items:
        (folder / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
    return folder


def kubectl_secret(name: str, *from_files: str) -> dict[str, Any]:
    """`kubectl create secret generic NAME --from-file=...` (client dry run) as an object."""
    args = [f"--from-file={f}" for f in from_files]
    proc = subprocess.run(
        [_kubectl(), "create", "secret", "generic", name, *args, "--dry-run=client", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    secret: dict[str, Any] = json.loads(proc.stdout)
    return secret


def render_cli(out: Path, *extra: str, image: str = "geofed:dev") -> int:
    """`geofed k8s render` of the 3-broker federation into `out`."""
    return run_cli(
        ["k8s", "render", "--federation", str(THREE), "--image", image, "--out", str(out), *extra]
    )


def run_cli(argv: list[str]) -> int:
    """`geofed <argv>` through the k8s subcommand's own `register` (others may be absent)."""
    parser = argparse.ArgumentParser(prog="geofed")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub, "k8s")
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GeofedError as exc:
        print(f"geofed {args.command}: error: {exc}")
        return 2


# --- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def three() -> Federation:
    return Federation.load(THREE)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-broker federation rendered for one cluster."""
    out = tmp_path_factory.mktemp("single")
    assert render_cli(out, "--namespace", NAMESPACE, "--force", image=IMAGE) == 0
    return out


@pytest.fixture(scope="module")
def single_objects(single: Path) -> Objects:
    return valid_objects(single)


@pytest.fixture(scope="module")
def external(tmp_path_factory: pytest.TempPathFactory, three: Federation) -> Path:
    """The 3-broker federation rendered for one cluster per region."""
    out = tmp_path_factory.mktemp("external")
    endpoints = {
        b.id: {
            "endpoint": f"peer.{b.id}.geofed.example:443",
            "client_endpoint": f"{b.id}.example:7400",
        }
        for b in three
    }
    spec = out / "endpoints.json"
    spec.write_text(json.dumps(endpoints))
    args = ["--endpoints", str(spec), "--peer-cidr", "203.0.113.0/24", "--podmonitor"]
    assert render_cli(out / "k8s", *args, image=IMAGE) == 0
    return out / "k8s"


# --- one cluster ------------------------------------------------------------------


def test_every_overlay_renders_and_validates(single: Path, three: Federation) -> None:
    overlays = sorted(p.name for p in (single / "overlays").iterdir())
    assert overlays == sorted(three.ids)
    for name in overlays:
        objects = valid_objects(single / "overlays" / name)
        assert sorted(o["kind"] for o in objects) == [
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "Service",
            "Service",
        ]
        assert {o["metadata"]["namespace"] for o in objects} == {NAMESPACE}
    validate(kustomize(single / "base"))


def test_one_node_per_broker_area(single_objects: Objects, three: Federation) -> None:
    deployments = of_kind(single_objects, "Deployment")
    assert sorted(env_of(d)["GEOFED_BROKER_ID"] for d in deployments) == sorted(three.ids)
    names = [(o["kind"], o["metadata"]["name"]) for o in single_objects]
    assert len(names) == len(set(names)), "object names collide between overlays"
    for d in deployments:
        assert d["spec"]["replicas"] == 1
        assert d["spec"]["strategy"]["type"] == "Recreate"  # never two pods with one id
        cfg = node_config(d)
        assert cfg.broker_id in three
        assert cfg.strategy == "event-geofence"
        # Each Deployment's selector owns its own pods and no other broker's.
        owners = [
            o for o in deployments if selects(d["spec"]["selector"]["matchLabels"], pod_labels(o))
        ]
        assert owners == [d]


def test_probes_and_ports_match_the_node_config(single_objects: Objects) -> None:
    services = of_kind(single_objects, "Service")
    for d in of_kind(single_objects, "Deployment"):
        cfg = node_config(d)
        c = container(d)
        client, peer, metrics = (
            port_of(cfg.client_listen),
            port_of(cfg.peer_listen),
            port_of(cfg.metrics_listen),
        )
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == client, probe
        assert c["livenessProbe"]["grpc"].get("service", "") == ""
        assert c["readinessProbe"]["grpc"]["service"] == "geofed.v1.ClientService"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc-client": client, "grpc-peer": peer, "metrics": metrics}
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics
        # The federation file is where the node looks for it.
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        fed_dir = mounts["federation"]
        assert cfg.federation == f"{fed_dir}/federation.geojson"
        cm_name = volumes["federation"]["configMap"]["name"]
        (cm,) = [
            o for o in of_kind(single_objects, "ConfigMap") if o["metadata"]["name"] == cm_name
        ]
        assert "federation.geojson" in cm["data"]
        # Both Services of this broker select its pod and reach the right port.
        mine = [s for s in services if selects(s["spec"]["selector"], pod_labels(d))]
        assert len(mine) == 2
        targets = {ports[p["targetPort"]] for s in mine for p in s["spec"]["ports"]}
        assert targets == {client, peer}
        for s in mine:
            for p in s["spec"]["ports"]:
                assert p["port"] == ports[p["targetPort"]]


def test_peer_endpoints_in_each_federation_file(single_objects: Objects, three: Federation) -> None:
    services = of_kind(single_objects, "Service")
    expected: dict[str, tuple[str, str]] = {}
    for d in of_kind(single_objects, "Deployment"):
        broker_id = env_of(d)["GEOFED_BROKER_ID"]
        by_port: dict[str, str] = {}
        for s in services:
            if selects(s["spec"]["selector"], pod_labels(d)):
                (p,) = s["spec"]["ports"]
                dns = f"{s['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{p['port']}"
                by_port[p["targetPort"]] = dns
        expected[broker_id] = (by_port["grpc-peer"], by_port["grpc-client"])
    configmaps = of_kind(single_objects, "ConfigMap")
    assert len(configmaps) == len(three)
    for cm in configmaps:
        fed = Federation.from_geojson(json.loads(cm["data"]["federation.geojson"]))
        assert fed.digest == three.digest  # same ids and areas as the source file
        assert {b.id: (b.endpoint, b.client_endpoint) for b in fed} == expected


def test_non_root_read_only_and_bounded(single_objects: Objects) -> None:
    for d in of_kind(single_objects, "Deployment"):
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp and "emptyDir" in volumes[tmp[0]["name"]]
        for kind in ("requests", "limits"):
            assert set(c["resources"][kind]) == {"cpu", "memory"}


def test_network_policy_and_disruption_budget(single_objects: Objects) -> None:
    deployments = of_kind(single_objects, "Deployment")
    all_pods = [pod_labels(d) for d in deployments]
    for d in deployments:
        cfg = node_config(d)
        client, peer, metrics = (
            port_of(cfg.client_listen),
            port_of(cfg.peer_listen),
            port_of(cfg.metrics_listen),
        )
        (policy,) = [
            p
            for p in of_kind(single_objects, "NetworkPolicy")
            if selects(p["spec"]["podSelector"]["matchLabels"], pod_labels(d))
        ]
        assert [selects(policy["spec"]["podSelector"]["matchLabels"], p) for p in all_pods].count(
            True
        ) == 1
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rules = {r["ports"][0]["port"]: r for r in policy["spec"]["ingress"]}
        assert set(rules) == {client, peer, metrics}
        assert "from" not in rules[client]  # clients come from anywhere
        (peer_from,) = rules[peer]["from"]  # only brokers, every broker
        assert all(selects(peer_from["podSelector"]["matchLabels"], p) for p in all_pods)
        assert_release_only(peer_from["podSelector"]["matchLabels"], "geofed")
        scrapers = rules[metrics]["from"]
        assert {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        } in scrapers
        (pdb,) = [
            p
            for p in of_kind(single_objects, "PodDisruptionBudget")
            if selects(p["spec"]["selector"]["matchLabels"], pod_labels(d))
        ]
        assert [selects(pdb["spec"]["selector"]["matchLabels"], p) for p in all_pods].count(
            True
        ) == 1
        assert pdb["spec"]["minAvailable"] == 1


def test_image_is_set_everywhere(single_objects: Objects) -> None:
    assert {container(d)["image"] for d in of_kind(single_objects, "Deployment")} == {IMAGE}


# --- one cluster per region ---------------------------------------------------------


def test_external_endpoints_one_cluster_per_region(external: Path, three: Federation) -> None:
    assert not (external / "kustomization.yaml").exists()  # no "apply everything" here
    for b in three:
        objects = valid_objects(external / "overlays" / b.id)
        (cm,) = of_kind(objects, "ConfigMap")
        fed = Federation.from_geojson(json.loads(cm["data"]["federation.geojson"]))
        assert {x.id: (x.endpoint, x.client_endpoint) for x in fed} == {
            x.id: (f"peer.{x.id}.geofed.example:443", f"{x.id}.example:7400") for x in three
        }
        assert {s["spec"]["type"] for s in of_kind(objects, "Service")} == {"LoadBalancer"}
        (policy,) = of_kind(objects, "NetworkPolicy")
        peer_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 7401)
        assert {"ipBlock": {"cidr": "203.0.113.0/24"}} in peer_rule["from"]
        (monitor,) = of_kind(objects, "PodMonitor")
        (d,) = of_kind(objects, "Deployment")
        assert selects(monitor["spec"]["selector"]["matchLabels"], pod_labels(d))
        port_names = {p["name"] for p in container(d)["ports"]}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= port_names


def test_external_peers_need_cidrs_or_tls(
    tmp_path: Path, three: Federation, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "e.json"
    spec.write_text(json.dumps({b.id: {"endpoint": f"{b.id}.example:7401"} for b in three}))
    # Peers in other clusters and neither their networks nor mutual TLS: refused.
    assert render_cli(tmp_path / "out", "--endpoints", str(spec)) == 2
    out = capsys.readouterr().out
    assert "peer_cidr" in out and "--peer-cidr" in out and "--tls" in out
    assert not (tmp_path / "out").exists()
    # Mutual TLS only: the peer port is open to any address, and only
    # certificates of the federation's CA get in.
    assert render_cli(tmp_path / "out", "--endpoints", str(spec), "--tls") == 0
    (policy,) = of_kind(kustomize(tmp_path / "out" / "overlays" / "eu"), "NetworkPolicy")
    peer_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 7401)
    assert {"ipBlock": {"cidr": "0.0.0.0/0"}} in peer_rule["from"]
    assert {"ipBlock": {"cidr": "::/0"}} in peer_rule["from"]


def test_podmonitor_once_per_cluster(tmp_path: Path) -> None:
    assert render_cli(tmp_path, "--podmonitor") == 0
    objects = valid_objects(tmp_path)
    assert len(of_kind(objects, "PodMonitor")) == 1
    assert len(of_kind(objects, "Deployment")) == 3


def test_twenty_one_regions(tmp_path: Path) -> None:
    aws = Federation.load(AWS)
    result = geofed.k8s.render(AWS, "geofed:dev", tmp_path)
    objects = valid_objects(tmp_path)
    assert sorted(env_of(d)["GEOFED_BROKER_ID"] for d in of_kind(objects, "Deployment")) == sorted(
        aws.ids
    )
    for cm in of_kind(objects, "ConfigMap"):
        # A ConfigMap holds at most 1 MiB.
        assert len(cm["data"]["federation.geojson"].encode()) < 1024 * 1024
    assert result.single_cluster


# --- TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-broker federation rendered for one cluster with TLS from Secrets."""
    out = tmp_path_factory.mktemp("tls")
    args = ["--namespace", NAMESPACE, "--tls", "--release", "blue", "--podmonitor"]
    assert render_cli(out, *args, image=IMAGE) == 0
    return out


@pytest.fixture(scope="module")
def tls_objects(tls: Path) -> Objects:
    return valid_objects(tls)


@pytest.fixture(scope="module")
def pki(tls: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`geofed certs` of the rendered federation file (DEPLOY.md's first step)."""
    out = tmp_path_factory.mktemp("pki")
    issue_federation(tls / "overlays" / "eu" / "federation.geojson", out)
    return out


def test_tls_secrets_from_geofed_certs_are_what_the_node_reads(
    tls_objects: Objects, pki: Path, three: Federation, tmp_path: Path
) -> None:
    """The kubectl flow of DEPLOY.md: one Secret per broker from its `geofed certs` folder."""
    deployments = of_kind(tls_objects, "Deployment")
    assert len(deployments) == len(three)
    secret_names = set()
    for d in deployments:
        cfg = node_config(d)
        assert cfg.tls_dir and cfg.reflection == "off"
        pod = d["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        name = volume["secret"]["secretName"]
        secret_names.add(name)
        assert volume["secret"]["defaultMode"] & 0o007 == 0  # the key is not world-readable
        secret = kubectl_secret(name, str(pki / "brokers" / cfg.broker_id))
        mounted = volume_files(pod, cfg.tls_dir, {name: secret}, tmp_path / cfg.broker_id)
        # The node's own loader takes the files (and checks the key fits the certificate).
        TLSFiles.in_dir(mounted).read()
        cert = x509.load_pem_x509_certificate((mounted / "cert.pem").read_bytes())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert broker_dns_name(cfg.broker_id) in sans.get_values_for_type(x509.DNSName)
    assert len(secret_names) == len(three)  # one Secret per broker
    assert {f"geofed-tls-{b.id}" for b in three} == secret_names  # the default names


def test_tls_mounts_are_read_only_and_not_nested(tls_objects: Objects) -> None:
    for d in of_kind(tls_objects, "Deployment"):
        mounts = container(d)["volumeMounts"]
        paths = [PurePosixPath(m["mountPath"]) for m in mounts]
        for a in paths:
            for b in paths:
                assert a == b or not b.is_relative_to(a), f"{b} is mounted inside {a}"
        cfg = node_config(d)
        (tls_mount,) = [m for m in mounts if m["mountPath"] == cfg.tls_dir]
        assert tls_mount["readOnly"] is True and "subPath" not in tls_mount  # rotation


def test_tls_probes_use_the_plaintext_health_port(tls_objects: Objects) -> None:
    """kubelet's gRPC probes cannot speak TLS: they ask the node's health-only port."""
    for d in of_kind(tls_objects, "Deployment"):
        c = container(d)
        cfg = node_config(d)
        health = port_of(cfg.health_listen)
        assert health not in (port_of(cfg.client_listen), port_of(cfg.peer_listen))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"]["port"] == health, probe
        assert c["readinessProbe"]["grpc"]["service"] == "geofed.v1.ClientService"
        assert health in {p["containerPort"] for p in c["ports"]}


def test_tls_peer_port_admits_only_this_release(tls_objects: Objects) -> None:
    deployments = of_kind(tls_objects, "Deployment")
    for policy in of_kind(tls_objects, "NetworkPolicy"):
        peer = port_of(node_config(deployments[0]).peer_listen)
        (rule,) = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == peer]
        (source,) = rule["from"]
        assert set(source) == {"podSelector"}  # this namespace only, no ipBlock
        selector = source["podSelector"]["matchLabels"]
        assert_release_only(selector, "blue")
        assert all(selects(selector, pod_labels(d)) for d in deployments)
    (monitor,) = of_kind(tls_objects, "PodMonitor")
    assert_release_only(monitor["spec"]["selector"]["matchLabels"], "blue")


def test_cert_manager_certificates(tmp_path: Path, three: Federation, pki: Path) -> None:
    spec = tmp_path / "e.json"
    spec.write_text(
        json.dumps(
            {
                "eu": {"endpoint": "peer.eu.example:443", "client_endpoint": "192.0.2.7:7400"},
                "us": {"endpoint": "peer.us.example:443", "client_endpoint": "[2001:db8::1]:7400"},
                "ap": {"endpoint": "peer.ap.example:443"},
            }
        )
    )
    args = ["--tls", "--cert-manager", "ClusterIssuer/geofed-ca", "--endpoints", str(spec)]
    args += ["--tls-secret", "broker-{broker}-tls", "--namespace", NAMESPACE]
    assert render_cli(tmp_path / "out", *args) == 0
    for b in three:
        objects = valid_objects(tmp_path / "out" / "overlays" / b.id)
        (cert,) = of_kind(objects, "Certificate")
        (d,) = of_kind(objects, "Deployment")
        cfg = node_config(d)
        pod = d["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert cert["spec"]["secretName"] == volume["secret"]["secretName"] == f"broker-{b.id}-tls"
        assert cert["metadata"]["namespace"] == NAMESPACE
        assert cert["spec"]["issuerRef"] == {
            "group": "cert-manager.io",
            "kind": "ClusterIssuer",
            "name": "geofed-ca",
        }
        assert {"server auth", "client auth"} <= set(cert["spec"]["usages"])
        # Named as peers verify a broker, and as clients and peers dial it.
        (cm,) = of_kind(objects, "ConfigMap")
        fed = Federation.from_geojson(json.loads(cm["data"]["federation.geojson"]))
        names = set(cert["spec"]["dnsNames"]) | set(cert["spec"].get("ipAddresses", []))
        assert broker_dns_name(b.id) in names
        for endpoint in (fed.broker(b.id).endpoint, fed.broker(b.id).client_endpoint):
            assert endpoint.rpartition(":")[0].strip("[]") in names
        for s in of_kind(objects, "Service"):
            assert f"{s['metadata']['name']}.{NAMESPACE}.svc" in names
        # cert-manager's Secret keys, mapped to the files the node reads: a
        # Secret as cert-manager writes it, made from `geofed certs` output.
        folder = pki / "brokers" / b.id
        secret = kubectl_secret(
            "cm",
            f"tls.crt={folder / 'cert.pem'}",
            f"tls.key={folder / 'key.pem'}",
            f"ca.crt={folder / 'ca.pem'}",
        )
        mounted = volume_files(
            pod, cfg.tls_dir, {volume["secret"]["secretName"]: secret}, tmp_path / f"mounted-{b.id}"
        )
        TLSFiles.in_dir(mounted).read()


def test_tls_needs_dns_broker_ids(tmp_path: Path) -> None:
    raw = json.loads(THREE.read_text())
    raw["features"][0]["properties"]["id"] = "EU_West"
    (tmp_path / "fed.geojson").write_text(json.dumps(raw))
    geofed.k8s.render(tmp_path / "fed.geojson", "geofed:dev", tmp_path / "plain")
    with pytest.raises(InvalidInput) as err:
        geofed.k8s.render(tmp_path / "fed.geojson", "geofed:dev", tmp_path / "tls", tls=True)
    assert "EU_West" in err.value.field


# --- metrics --------------------------------------------------------------------------


def test_metrics_on_the_pod_loopback_are_not_exposed(tmp_path: Path) -> None:
    assert render_cli(tmp_path, "--metrics-listen", "127.0.0.1:9400") == 0
    objects = valid_objects(tmp_path)
    for d in of_kind(objects, "Deployment"):
        assert node_config(d).metrics_listen == "127.0.0.1:9400"
        assert 9400 not in {p["containerPort"] for p in container(d)["ports"]}
        annotations = d["spec"]["template"]["metadata"].get("annotations", {})
        assert not any(k.startswith("prometheus.io/") for k in annotations)
    for policy in of_kind(objects, "NetworkPolicy"):
        assert 9400 not in {r["ports"][0]["port"] for r in policy["spec"]["ingress"]}


def test_metrics_port_follows_the_setting(tmp_path: Path) -> None:
    assert render_cli(tmp_path, "--metrics-listen", "0.0.0.0:9500", "--podmonitor") == 0
    objects = valid_objects(tmp_path)
    for d in of_kind(objects, "Deployment"):
        metrics = port_of(node_config(d).metrics_listen)
        assert metrics == 9500
        ports = {p["name"]: p["containerPort"] for p in container(d)["ports"]}
        assert ports["metrics"] == metrics
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == metrics
    for policy in of_kind(objects, "NetworkPolicy"):
        assert 9500 in {r["ports"][0]["port"] for r in policy["spec"]["ingress"]}
    (monitor,) = of_kind(objects, "PodMonitor")
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_durable_brokers_keep_their_store_on_their_own_claim(tmp_path: Path) -> None:
    assert render_cli(tmp_path, "--data-size", "10Gi", "--storage-class", "fast-ssd") == 0
    objects = valid_objects(tmp_path)
    claims = {c["metadata"]["name"]: c for c in of_kind(objects, "PersistentVolumeClaim")}
    deployments = of_kind(objects, "Deployment")
    assert len(claims) == len(deployments) == 3
    for d in deployments:
        assert d["spec"]["strategy"] == {"type": "Recreate"}  # one pod holds the claim
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        cfg = node_config(d)
        (mount,) = [m for m in container(d)["volumeMounts"] if m["mountPath"] == cfg.data_dir]
        assert not mount.get("readOnly")
        claim = claims[volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]]
        assert claim["metadata"]["labels"][BROKER_LABEL] == pod_labels(d)[BROKER_LABEL]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
        assert claim["spec"]["storageClassName"] == "fast-ssd"
        assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
        # The store is refused more before the volume is full.
        assert 0 < cfg.store_max_bytes < 10 * 1024**3
    plain = tmp_path / "plain"
    assert render_cli(plain) == 0
    assert not of_kind(valid_objects(plain), "PersistentVolumeClaim")


def test_front_ends_on_the_client_service_and_in_the_federation_file(tmp_path: Path) -> None:
    """--mqtt, --mqtt-ws, --http: each broker listens on the front end's port (as its node
    config reads the pod's environment), its client Service and NetworkPolicy carry the
    port, and the federation file names the front end at the client Service's host."""
    assert render_cli(tmp_path, "--namespace", NAMESPACE, "--mqtt", "--mqtt-ws", "--http") == 0
    objects = valid_objects(tmp_path)
    services = of_kind(objects, "Service")
    policies = of_kind(objects, "NetworkPolicy")
    (cm, *_) = of_kind(objects, "ConfigMap")
    fed = Federation.from_geojson(json.loads(cm["data"]["federation.geojson"]))
    for d in of_kind(objects, "Deployment"):
        cfg = node_config(d)
        listens = {
            "mqtt": cfg.mqtt_listen,
            "mqtt-ws": cfg.mqtt_ws_listen,
            "http": cfg.http_listen,
        }
        ports = {p["name"]: p["containerPort"] for p in container(d)["ports"]}
        for name, listen in listens.items():
            assert listen.startswith("0.0.0.0:") and port_of(listen) == ports[name]
        (client_svc,) = [
            s
            for s in services
            if selects(s["spec"]["selector"], pod_labels(d))
            and "grpc-client" in {p["name"] for p in s["spec"]["ports"]}
        ]
        served = {p["targetPort"]: p["port"] for p in client_svc["spec"]["ports"]}
        assert {served[n] for n in listens} == {port_of(v) for v in listens.values()}
        (policy,) = [
            p for p in policies if selects(p["spec"]["podSelector"]["matchLabels"], pod_labels(d))
        ]
        open_ports = {r["ports"][0]["port"] for r in policy["spec"]["ingress"] if "from" not in r}
        assert {port_of(v) for v in listens.values()} <= open_ports
        b = fed.broker(env_of(d)["GEOFED_BROKER_ID"])
        host = b.client_endpoint.rpartition(":")[0]
        assert b.mqtt_endpoint == f"{host}:{port_of(cfg.mqtt_listen)}"
        assert b.mqtt_ws_endpoint == f"{host}:{port_of(cfg.mqtt_ws_listen)}"
        assert b.http_endpoint == f"{host}:{port_of(cfg.http_listen)}"
    plain = tmp_path / "plain"
    assert render_cli(plain) == 0
    for d in of_kind(valid_objects(plain), "Deployment"):
        cfg = node_config(d)
        assert not (cfg.mqtt_listen or cfg.mqtt_ws_listen or cfg.http_listen)


# --- the repository's k8s/ tree -----------------------------------------------------


def test_repository_tree_is_the_render_of_three(tmp_path: Path) -> None:
    geofed.k8s.render(THREE, "geofed:dev", tmp_path)
    stale = []
    for path in sorted(tmp_path.rglob("*")):
        if path.is_file():
            rel = path.relative_to(tmp_path)
            committed = ROOT / "k8s" / rel
            if not committed.is_file() or not filecmp.cmp(path, committed, shallow=False):
                stale.append(str(rel))
    for path in (ROOT / "k8s").rglob("*"):
        rel = path.relative_to(ROOT / "k8s")
        if path.is_file() and rel.parts[0] in geofed.k8s.OUTPUTS and not (tmp_path / rel).exists():
            stale.append(f"{rel} (not rendered any more)")
    assert not stale, (
        "k8s/ is out of date; regenerate with `geofed k8s render --federation "
        "deploy/federations/three.geojson --image geofed:dev --out k8s --force`: "
        + ", ".join(stale)
    )


# --- input checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"namespace": "Not_A_Namespace"}, "namespace"),
        ({"image": "has space:1"}, "image"),
        ({"strategy": "gossip"}, "strategy"),
        ({"peer_cidrs": ["10.0.0.0/33"]}, "peer_cidr"),
        ({"cluster_domain": "-bad-"}, "cluster_domain"),
        ({"release": "Blue_1"}, "release"),
        ({"release": "r" * 64}, "release"),
        ({"cert_manager": "ca"}, "cert_manager"),  # without tls
        ({"tls_secret": "tls-{broker}"}, "tls_secret"),  # without tls
        ({"tls": True, "tls_secret": "shared"}, "tls_secret"),  # one Secret for three
        ({"tls": True, "tls_secret": "tls-{id}-{broker}"}, "tls_secret"),
        ({"tls": True, "tls_secret": "TLS-{broker}"}, "tls_secret"),
        ({"tls": True, "cert_manager": "Vault/ca"}, "cert_manager"),
        ({"tls": True, "cert_manager": "ClusterIssuer/"}, "cert_manager"),
        ({"metrics_listen": "10.0.0.1:9400"}, "metrics_listen"),
        ({"metrics_listen": "0.0.0.0:7401"}, "metrics_listen"),
        ({"metrics_listen": "9400"}, "metrics_listen"),
        ({"metrics_listen": "127.0.0.1:9400", "podmonitor": True}, "podmonitor"),
        ({"data_size": "ten gigs"}, "data_size"),
        ({"data_size": "0Gi"}, "data_size"),
        ({"data_size": "1.5Gi"}, "data_size"),
        ({"storage_class": "fast"}, "storage_class"),  # without a volume
        ({"data_size": "1Gi", "storage_class": "Fast_SSD"}, "storage_class"),
    ],
)
def test_bad_arguments_name_the_field(
    tmp_path: Path, three: Federation, kwargs: dict[str, Any], field: str
) -> None:
    args: dict[str, Any] = {"image": "geofed:dev", **kwargs}
    image = args.pop("image")
    with pytest.raises(InvalidInput) as err:
        geofed.k8s.render(three, image, tmp_path / "out", **args)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("endpoints", "field"),
    [
        ([], "endpoints"),
        ({"mars": {"endpoint": "a:1"}}, "endpoints.mars"),
        ({"eu": "a:1"}, "endpoints.eu"),
        ({"eu": {"endpoint": "no-port"}}, "endpoints.eu.endpoint"),
        ({"eu": {"client_endpoint": "h:99999"}}, "endpoints.eu.client_endpoint"),
        ({"eu": {"peer": "h:1"}}, "endpoints.eu.peer"),
    ],
)
def test_bad_endpoints_name_the_entry(three: Federation, endpoints: object, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        geofed.k8s.parse_endpoints(endpoints, three)
    assert err.value.field == field


def test_refuses_to_overwrite_without_force(
    tmp_path: Path, three: Federation, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    geofed.k8s.render(three, "geofed:dev", tmp_path)
    argv = [
        "k8s",
        "render",
        "--federation",
        str(THREE),
        "--image",
        "geofed:dev",
        "--out",
        str(tmp_path),
    ]
    assert run_cli(argv) == 2
    assert "--force" in capsys.readouterr().out
    assert run_cli([*argv, "--force"]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only render outputs are replaced


def test_render_of_a_loaded_federation_keeps_ids_and_areas(
    tmp_path: Path, three: Federation
) -> None:
    geofed.k8s.render(three, "geofed:dev", tmp_path)
    fed = Federation.load(tmp_path / "overlays" / "eu" / "federation.geojson")
    assert fed.ids == three.ids
    for a, b in zip(fed, three, strict=True):
        assert a.area.geometry.equals(b.area.geometry)
    assert fed.broker("eu").endpoint == "geofed-peer-eu.geofed.svc.cluster.local:7401"


def test_image_references(tmp_path: Path, three: Federation) -> None:
    cases = {
        "geofed": {"newName": "geofed", "newTag": "latest"},
        "geofed:dev": {"newName": "geofed", "newTag": "dev"},
        "reg:5000/team/geofed:1.2": {"newName": "reg:5000/team/geofed", "newTag": "1.2"},
        "reg:5000/geofed": {"newName": "reg:5000/geofed", "newTag": "latest"},
        "geofed@sha256:" + "a" * 64: {"newName": "geofed", "digest": "sha256:" + "a" * 64},
    }
    for image, expected in cases.items():
        geofed.k8s.render(three, image, tmp_path, force=True)
        kustomization = yaml.safe_load(
            (tmp_path / "overlays" / "eu" / "kustomization.yaml").read_text()
        )
        assert kustomization["images"] == [{"name": "geofed", **expected}], image


@pytest.mark.parametrize(
    "broker_id",
    ["eu", "us-east-1", "EU_West", "a" * 80, "zone/7", "été", "-x-", "UPPER"],
)
def test_slugs_are_dns_labels(broker_id: str) -> None:
    s = geofed.k8s.slug(broker_id)
    assert DNS_LABEL.fullmatch(s) and len(s) <= 40
    assert len(f"geofed-client-{s}") <= 63


def test_slugs_are_unique() -> None:
    ids = ["EU", "eu", "e-u", "E_U", "e u", "eu-" + "x" * 60, "eu-" + "x" * 61]
    assert len({geofed.k8s.slug(i) for i in ids}) == len(ids)


# --- the YAML emitter -----------------------------------------------------------------

_json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([1e20, -2.5e-7, 1e16, 0.1, -0.0])
    | st.text(st.characters(codec="utf-8"), max_size=20)  # no surrogates in UTF-8
    | st.sampled_from(
        [
            "yes",
            "No",
            "on",
            "~",
            "null",
            "1e3",
            "0x1F",
            "-eu",
            "a: b",
            "#x",
            "- a",
            "",
            " x",
            "7400",
            "1.30",
            "*.example",
            "@a",
            "!tag",
            "'q'",
            '"q"',
            "a\u2028b",
            "\x85",
            "\ufeff",
        ]
    )
)
_json = st.recursive(
    _json_scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(max_size=8) | st.sampled_from(["on", "1", "-"]), children, max_size=4
        )
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_dump_yaml_round_trips(value: Any) -> None:
    assert yaml.safe_load(geofed.k8s.dump_yaml(value)) == value


def test_dump_yaml_documents() -> None:
    text = geofed.k8s.dump_yaml({"a": [1, {"b": []}]}, [{"c": {}}], "x")
    assert list(yaml.safe_load_all(text)) == [{"a": [1, {"b": []}]}, [{"c": {}}], "x"]


# --- the environment shared with the container tests -------------------------------------


def test_container_env_is_a_valid_node_config() -> None:
    cfg = NodeConfig.load(env=geofed.k8s.container_env("eu", strategy="subscription-geofence"))
    assert (cfg.broker_id, cfg.strategy) == ("eu", "subscription-geofence")
    assert port_of(cfg.client_listen) == CLIENT_PORT
    assert not cfg.tls_dir and not cfg.health_listen


def test_container_env_with_tls() -> None:
    cfg = NodeConfig.load(env=geofed.k8s.container_env("eu", tls=True))
    assert cfg.tls_dir == geofed.k8s.TLS_DIR
    assert cfg.reflection == "off"
    assert port_of(cfg.health_listen) == geofed.k8s.HEALTH_PORT
