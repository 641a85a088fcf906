"""`geofed k8s render`: manifests render, validate offline and agree with the node config.

Every rendered object is validated against the Kubernetes OpenAPI schemas of
the pinned versions (kubernetes-validate, strict: unknown fields fail). The
expected values come from the node's own configuration loader and from the
rendered objects themselves, not from the renderer's constants.
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import geofed.k8s
from geofed.k8s.cli import register
from geofed.node import CLIENT_PORT, NodeConfig
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


def validate(objects: Objects) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes OpenAPI set
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
    objects = kustomize(single)
    validate(objects)
    return objects


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
        objects = kustomize(single / "overlays" / name)
        validate(objects)
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
        objects = kustomize(external / "overlays" / b.id)
        validate(objects)
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


def test_external_peers_without_cidr_warn(
    tmp_path: Path, three: Federation, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "e.json"
    spec.write_text(json.dumps({b.id: {"endpoint": f"{b.id}.example:7401"} for b in three}))
    assert render_cli(tmp_path / "out", "--endpoints", str(spec)) == 0
    assert "no --peer-cidr" in capsys.readouterr().err
    (policy,) = of_kind(kustomize(tmp_path / "out" / "overlays" / "eu"), "NetworkPolicy")
    peer_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 7401)
    assert {"ipBlock": {"cidr": "0.0.0.0/0"}} in peer_rule["from"]


def test_podmonitor_once_per_cluster(tmp_path: Path) -> None:
    assert render_cli(tmp_path, "--podmonitor") == 0
    objects = kustomize(tmp_path)
    validate(objects)
    assert len(of_kind(objects, "PodMonitor")) == 1
    assert len(of_kind(objects, "Deployment")) == 3


def test_twenty_one_regions(tmp_path: Path) -> None:
    aws = Federation.load(AWS)
    result = geofed.k8s.render(AWS, "geofed:dev", tmp_path)
    objects = kustomize(tmp_path)
    validate(objects)
    assert sorted(env_of(d)["GEOFED_BROKER_ID"] for d in of_kind(objects, "Deployment")) == sorted(
        aws.ids
    )
    for cm in of_kind(objects, "ConfigMap"):
        # A ConfigMap holds at most 1 MiB.
        assert len(cm["data"]["federation.geojson"].encode()) < 1024 * 1024
    assert result.single_cluster


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
