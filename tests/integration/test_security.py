"""Security with real node processes: mutual TLS between brokers, authenticated clients,
the policy (docs/security.md).

Certificates come from a throw-away CA made at test time (`LocalFederation(tls=True)`,
`geofed.node.create_ca`); no key is committed. Waits are on state (a call's answer, a
delivery, a metric); `next` timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client import CollectorRegistry

import geofed
from geofed import wire as gw
from geofed.bench import LocalFederation, metric
from geofed.bench.faults import until
from geofed.client import TLSConfig, health_status
from geofed.node import (
    AUTH_REFUSED,
    CA,
    PEER_MESSAGES_RECEIVED,
    PEER_REFUSED,
    BrokerServer,
    NodeConfig,
    TLSFiles,
    create_ca,
    issue_broker,
    issue_client,
    issue_federation,
)
from geofed.node._links import PROTOCOL_VERSION
from geofed.v1 import federation_pb2_grpc as fpb_grpc

if TYPE_CHECKING:
    from conftest import TokenSigner  # tests/integration/conftest.py

pytestmark = pytest.mark.integration

THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"
PARIS = geofed.LatLon(48.85, 2.35)  # eu
SINGAPORE = geofed.LatLon(1.29, 103.85)  # ap
NEW_YORK = geofed.LatLon(40.71, -74.0)  # us
HANG_S = 60.0
POLICY = """
[everyone]
subscribe = ["clients/%c/#"]

[identities.alice]
publish = ["sensors/%u/+"]
subscribe = ["alerts/#", "sensors/+/+"]

[identities.bob]
publish = ["alerts/%u"]
area = "POLYGON((95 -5, 110 -5, 110 10, 95 10, 95 -5))"
"""


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """mTLS between brokers, client certificates, the policy above."""
    workdir = tmp_path_factory.mktemp("secure")
    policy = workdir / "policy.toml"
    policy.write_text(POLICY, encoding="utf-8")
    env = {"GEOFED_POLICY_FILE": str(policy)}
    with LocalFederation(
        THREE, "event-geofence", workdir, tls=True, client_auth="cert", extra_env=env
    ) as running:
        yield running


async def connect(
    fed: LocalFederation, identity: str, client_id: str, where: geofed.LatLon, **kw: Any
) -> geofed.Client:
    return await geofed.connect(
        client_id=client_id,
        location=where,
        federation=fed.federation_path,
        tls=fed.client_tls(identity),
        **kw,
    )


def refused(fed: LocalFederation, broker: str, reason: str) -> float:
    return metric(fed.nodes[broker].metrics_url, PEER_REFUSED, reason=reason)


def received_from(fed: LocalFederation, broker: str, peer: str) -> float:
    url = fed.nodes[broker].metrics_url
    return sum(
        metric(url, PEER_MESSAGES_RECEIVED, peer=peer, kind=k)
        for k in ("event", "subscribe", "unsubscribe", "delivery", "control")
    )


async def rogue_link(
    endpoint: str, credentials: grpc.ChannelCredentials | None, claims: str
) -> list[object]:
    """Dial a broker's peer port as `claims` would; return what it answered (frames, or the
    error that ended the call)."""
    fed_digest = geofed.Federation.load(THREE).digest
    hello = gw.hello_frame(claims, "event-geofence", fed_digest, PROTOCOL_VERSION, 1)
    channel = (
        grpc.aio.insecure_channel(endpoint)
        if credentials is None
        else grpc.aio.secure_channel(endpoint, credentials)
    )
    got: list[object] = []
    async with channel:
        call = fpb_grpc.FederationServiceStub(channel).Link()
        try:
            await call.write(hello)
            async for frame in call:
                got.append(frame)
        except grpc.aio.AioRpcError as exc:
            got.append(exc.code())
        except asyncio.InvalidStateError:  # the call ended before our write
            got.append(await call.code())
    return got


def creds(files: TLSFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        files.ca.read_bytes(), files.key.read_bytes(), files.cert.read_bytes()
    )


def test_a_rogue_broker_gets_nothing_and_injects_nothing(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """A process with the public federation file but no valid certificate dials eu's peer
    port as broker ap: plaintext, no certificate, a certificate from another CA, an expired
    one, a client's and another broker's are all refused before any snapshot or delivery;
    eu logs and counts each refusal by its reason; the real links stay up and carry
    traffic."""
    eu = fed.nodes["eu"]
    ca = CA.load(fed.certs_dir)
    before = received_from(fed, "eu", "ap")
    # Refused in the TLS handshake (the dialler only sees the connection fail).
    rogue_ca = create_ca(tmp_path / "rogue-ca")
    other_ca = issue_broker(rogue_ca, "ap", ["127.0.0.1"], tmp_path / "rogue")
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    expired = issue_broker(ca, "ap", ["127.0.0.1"], tmp_path / "expired", not_after=past)
    # The rogue knows the federation's CA certificate (every client has it), so it gets as
    # far as showing its own certificate.
    fed_ca = fed.certs_dir / "ca.pem"
    no_cert = grpc.ssl_channel_credentials(fed_ca.read_bytes())
    wrong_ca = creds(TLSFiles(fed_ca, other_ca.cert, other_ca.key))
    handshakes = {"plaintext": None, "no_certificate": no_cert}
    handshakes |= {"unknown_ca": wrong_ca, "expired": creds(expired)}
    for reason, credentials in handshakes.items():
        got = asyncio.run(rogue_link(eu.peer, credentials, "ap"))
        assert got == [grpc.StatusCode.UNAVAILABLE], got
        # eu, the broker dialled, logs and counts it (its TLS front, not gRPC, shook hands).
        counted = lambda: refused(fed, "eu", reason) >= 1  # noqa: B023, E731
        asyncio.run(until(counted, f"eu counted {reason}", HANG_S, scrapes=True))
        assert f"TLS handshake failed ({reason})" in eu.log_path.read_text()
    # A valid certificate that is not ap's: refused after the handshake, by the hello check.
    client = issue_client(ca, "ap", tmp_path / "client-ap")
    us = TLSFiles.in_dir(fed.certs_dir / "brokers" / "us")
    for files in (client, us):
        got = asyncio.run(rogue_link(eu.peer, creds(files), "ap"))
        assert len(got) == 2 and got[-1] == grpc.StatusCode.PERMISSION_DENIED, got
        assert got[0].refuse_reason and "ap" in got[0].refuse_reason  # type: ignore[attr-defined]
        assert not got[0].HasField("snapshot") and not got[0].events  # type: ignore[attr-defined]
    assert refused(fed, "eu", "identity") == 2
    assert "refusing link from ap" in eu.log_path.read_text()
    assert received_from(fed, "eu", "ap") == before  # nothing counted, nothing applied

    async def traffic() -> None:
        sub = await connect(fed, "alice", "alice-r", SINGAPORE)
        pub = await connect(fed, "alice", "alice-p", PARIS)
        s = await sub.subscribe("sensors/+/+")
        await pub.publish("sensors/alice/t", b"1")
        assert (await s.next(timeout=HANG_S)).origin == "eu"
        await sub.close()
        await pub.close()

    asyncio.run(traffic())
    fed.wait_ready(HANG_S)


def test_clients_must_prove_who_they_are_and_cannot_take_over_another_id(
    fed: LocalFederation,
) -> None:
    async def run() -> None:
        # No client certificate: the TLS handshake fails.
        with pytest.raises(geofed.Unavailable):
            await geofed.connect(
                client_id="anon",
                location=PARIS,
                federation=fed.federation_path,
                tls=fed.client_tls(),
                retry=geofed.RetryConfig(attempts=1),
            )
        alice = await connect(fed, "alice", "alice-1", PARIS)
        sub = await alice.subscribe("alerts/#", subscription_id="a-alerts")
        # mallory holds a valid certificate, but alice-1 is alice's.
        with pytest.raises(geofed.PermissionDenied) as info:
            await connect(fed, "mallory", "alice-1", PARIS)
        assert info.value.rule == "identity"
        mallory = await connect(fed, "mallory", "mallory-1", PARIS)
        with pytest.raises(geofed.PermissionDenied):
            await mallory._call(  # the raw RPC with alice's client id
                "unsubscribe",
                lambda stub, timeout: stub.Unsubscribe(
                    gw.unsubscribe_request("alice-1", "a-alerts"), timeout=timeout
                ),
            )
        bob = await connect(fed, "bob", "bob-1", SINGAPORE)
        await bob.publish("alerts/bob", b"still subscribed")
        assert (await sub.next(timeout=HANG_S)).payload == b"still subscribed"
        for c in (alice, mallory, bob):
            await c.close()

    asyncio.run(run())
    url = fed.nodes["eu"].metrics_url
    assert metric(url, AUTH_REFUSED, reason="identity") >= 2


def geofed_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "geofed.cli", *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        check=False,
    )


def test_the_cli_takes_a_client_certificate(fed: LocalFederation) -> None:
    """geofed publish --ca --cert --key: alice publishes in her tree; mallory's certificate
    does not grant it (exit 2, the rule named); without a certificate the handshake fails."""
    common = ["--federation", str(fed.federation_path), "--location", "48.85,2.35"]
    common += ["--topic", "sensors/alice/cli", "--payload", "1"]

    def cert(identity: str) -> list[str]:
        files = fed.client_tls(identity)
        assert files is not None
        return ["--ca", files.ca_file, "--cert", files.cert_file, "--key", files.key_file]

    ok = geofed_cli("publish", *common, "--client", "alice-cli", *cert("alice"))
    assert ok.returncode == 0, ok.stderr
    denied = geofed_cli("publish", *common, "--client", "mallory-cli", *cert("mallory"))
    assert denied.returncode == 2 and "publish" in denied.stderr, denied.stderr
    anonymous = geofed_cli("publish", *common, "--client", "anon-cli", "--ca", cert("x")[1])
    assert anonymous.returncode == 3, anonymous.stderr


def test_the_policy_grants_topics_with_substitutions_and_areas(fed: LocalFederation) -> None:
    urls = list(fed.metrics_urls().values())

    def refusals(rule: str) -> float:  # the federation is the module's: count from here
        return sum(metric(u, AUTH_REFUSED, reason=rule) for u in urls)

    before = {rule: refusals(rule) for rule in ("publish", "subscribe", "location")}

    async def run() -> None:
        alice = await connect(fed, "alice", "alice-2", PARIS)
        await alice.publish("sensors/alice/temp", b"1")  # %u
        for topic in ("sensors/bob/temp", "alerts/x", "$SYS/x"):
            with pytest.raises(geofed.PermissionDenied) as info:
                await alice.publish(topic, b"1")
            assert info.value.rule == "publish"
        await alice.subscribe("clients/alice-2/#")  # %c, from [everyone]
        await alice.subscribe("alerts/+/fire")  # covered by alerts/#
        for topic_filter in ("#", "sensors/#", "clients/other/#", "$SYS/#"):
            with pytest.raises(geofed.PermissionDenied) as info:
                await alice.subscribe(topic_filter)
            assert info.value.rule == "subscribe"
        # bob may only be around Singapore: connecting from Paris or moving there is refused.
        with pytest.raises(geofed.PermissionDenied) as info:
            await connect(fed, "bob", "bob-2", PARIS)
        assert info.value.rule == "location"
        bob = await connect(fed, "bob", "bob-3", SINGAPORE)
        with pytest.raises(geofed.PermissionDenied):
            await bob.move(PARIS)
        for c in (alice, bob):
            await c.close()

    asyncio.run(run())
    assert refusals("publish") == before["publish"] + 3
    assert refusals("subscribe") == before["subscribe"] + 4
    assert refusals("location") == before["location"] + 2


def test_certificates_rotate_without_dropping_deliveries(fed: LocalFederation) -> None:
    """Re-issuing every broker certificate under the same CA while events flow: nothing is
    lost; new connections get the new certificate, and a restarted broker links again."""

    async def run() -> None:
        sub_client = await connect(fed, "alice", "rot-sub", SINGAPORE)
        pub = await connect(fed, "alice", "rot-pub", PARIS)
        sub = await sub_client.subscribe("sensors/+/+")
        old = (fed.certs_dir / "brokers" / "eu" / "cert.pem").read_bytes()
        sent: list[str] = []
        for i in range(60):
            sent.append(await pub.publish("sensors/alice/r", b"%d" % i))
            if i == 20:
                issue_federation(fed.federation_path, fed.certs_dir)  # rotation
        new = (fed.certs_dir / "brokers" / "eu" / "cert.pem").read_bytes()
        assert new != old
        got = [(await sub.next(timeout=HANG_S)).event_id for _ in sent]
        assert got == sent
        for port_of in (fed.nodes["eu"].client, fed.nodes["eu"].peer):  # the peer's TLS front
            host, port = port_of.rsplit(":", 1)
            served = await asyncio.to_thread(_served_certificate, host, int(port), fed)
            assert served == _pem_der(new)
        await sub_client.close()
        await pub.close()

    asyncio.run(run())
    fed.stop_node("us")
    fed.start_node("us")
    fed.wait_ready(HANG_S)  # us and its peers handshake with the new certificates


def _served_certificate(host: str, port: int, fed: LocalFederation) -> bytes:
    """The certificate a broker's port presents to a new connection (DER)."""
    ctx = ssl.create_default_context(cafile=str(fed.certs_dir / "ca.pem"))
    files = TLSFiles.in_dir(fed.certs_dir / "clients" / "alice")
    ctx.load_cert_chain(str(files.cert), str(files.key))
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, port)) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def _pem_der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def test_token_authentication(tmp_path: Path, token_signer: TokenSigner) -> None:
    """client_auth=token: a signed JWT names the identity; none, a forged one or an expired
    one is refused with Unauthenticated."""
    token = token_signer.token

    env = {"GEOFED_TOKEN_KEY": str(token_signer.public)}
    with LocalFederation(
        THREE, "event-geofence", tmp_path, tls=True, client_auth="token", extra_env=env
    ) as fed:
        tls = fed.client_tls()
        assert tls is not None

        async def run() -> None:
            ok = await geofed.connect(
                client_id="t1",
                location=PARIS,
                federation=fed.federation_path,
                tls=tls,
                token=token("carol"),
            )
            await ok.publish("any/topic", b"1")  # no policy: an authenticated client may
            await ok.close()
            no = geofed.RetryConfig(attempts=1)
            for bad in ("", token("carol", forged=True), token("carol", ttl=-60)):
                with pytest.raises(geofed.Unauthenticated):
                    await geofed.connect(
                        client_id="t2",
                        location=PARIS,
                        federation=fed.federation_path,
                        tls=tls,
                        token=bad,
                        retry=no,
                    )

        asyncio.run(run())
        url = fed.nodes["eu"].metrics_url
        assert metric(url, AUTH_REFUSED, reason="unauthenticated") == 3
        # The CLI sends a token from a file.
        token_file = tmp_path / "carol.jwt"
        token_file.write_text(token("carol") + "\n")
        out = geofed_cli(
            "publish",
            *("--federation", str(fed.federation_path), "--ca", tls.ca_file),
            *("--token-file", str(token_file), "--client", "t-cli", "--location", "48.85,2.35"),
            *("--topic", "any/cli", "--payload", "1"),
        )
        assert out.returncode == 0, out.stderr

        # The identity provider rotates its key: the brokers take the new public key
        # without a restart, and tokens of the old key no longer pass.
        new_key = ec.generate_private_key(ec.SECP256R1())
        staged = tmp_path / "token.pub.new"
        staged.write_bytes(
            new_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        staged.replace(token_signer.public)
        rotated = jwt.encode(
            {"sub": "carol", "exp": int(time.time()) + 600}, new_key, algorithm="ES256"
        )

        async def accepted(tok: str) -> bool:
            try:
                c = await geofed.connect(
                    client_id="t3",
                    location=PARIS,
                    federation=fed.federation_path,
                    tls=tls,
                    token=tok,
                    retry=geofed.RetryConfig(attempts=1),
                )
            except geofed.Unauthenticated:
                return False
            await c.close()
            return True

        async def rotation() -> None:
            deadline = time.monotonic() + HANG_S
            while not await accepted(rotated):  # the key file is looked at once a second
                assert time.monotonic() < deadline, "the rotated token key was never taken"
                await asyncio.sleep(0.1)
            assert not await accepted(token("carol"))

        asyncio.run(rotation())


def test_a_bad_security_setting_stops_the_node_naming_it(tmp_path: Path) -> None:
    env = {"GEOFED_TLS_DIR": str(tmp_path / "none")}
    fed = LocalFederation(THREE, "event-geofence", tmp_path, extra_env=env)
    with pytest.raises(geofed.GeofedError, match=r"tls\.ca"):
        fed.start(timeout=HANG_S)
    fed.stop()


def test_a_broker_with_a_certificate_from_another_ca_is_refused_in_the_handshake(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """us comes back with a certificate from another CA: its peers' dials fail the TLS
    handshake, which they log as an error and count; back with its own, it links again."""
    rogue = issue_broker(create_ca(tmp_path / "rogue-ca"), "us", ["127.0.0.1"], tmp_path / "us")
    before = refused(fed, "ap", "tls")
    fed.stop_node("us")
    fed.start_node("us", env={"GEOFED_TLS_DIR": str(rogue.cert.parent)})
    asyncio.run(until(lambda: refused(fed, "ap", "tls") > before, "ap refused us", HANG_S))
    assert "handshake" in fed.nodes["ap"].log_path.read_text().lower()
    fed.stop_node("us")
    fed.start_node("us")
    fed.wait_ready(HANG_S)


def test_the_broker_dialled_logs_and_counts_every_refused_peer_handshake(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The TLS front of eu's peer port: each dial that fails the handshake gets UNAVAILABLE,
    and eu logs it with the caller's address and why and counts it under its reason:
    plaintext, no client certificate, a certificate from another CA, an expired one. A
    dialler that does not trust eu's CA just hangs up (logged at INFO, counted on its own
    side). A call to the loopback gRPC port behind the front (going around it) is refused
    as unauthenticated, whatever the RPC. Through the front, the hello check still sees
    the caller's certificate; health answers a broker."""
    issue_federation("three", tmp_path / "certs")
    ca = CA.load(tmp_path / "certs")
    ap = TLSFiles.in_dir(tmp_path / "certs" / "brokers" / "ap")
    rogue = issue_broker(create_ca(tmp_path / "rogue-ca"), "ap", ["127.0.0.1"], tmp_path / "rogue")
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    expired = issue_broker(ca, "ap", ["127.0.0.1"], tmp_path / "expired", not_after=past)
    cases: dict[str, grpc.ChannelCredentials | None] = {
        "plaintext": None,
        "no_certificate": grpc.ssl_channel_credentials(ap.ca.read_bytes()),
        "unknown_ca": creds(TLSFiles(ap.ca, rogue.cert, rogue.key)),
        "expired": creds(expired),
    }
    registry = CollectorRegistry()
    config = lone_eu(tls_dir=str(tmp_path / "certs" / "brokers" / "eu"))
    caplog.set_level(logging.INFO, logger="geofed.node.peer_tls")

    def count(reason: str) -> float:
        return registry.get_sample_value(PEER_REFUSED, {"reason": reason}) or 0.0

    def logged(text: str, level: int = logging.ERROR) -> bool:
        return any(r.levelno == level and text in r.getMessage() for r in caplog.records)

    async def run() -> None:
        async with BrokerServer(config, registry) as node:
            front = f"127.0.0.1:{node.peer_port}"
            for reason, credentials in cases.items():
                assert await rogue_link(front, credentials, "ap") == [grpc.StatusCode.UNAVAILABLE]
                line = f"TLS handshake failed ({reason})"
                await until(lambda: count(reason) >= 1 and logged(line), line, HANG_S)  # noqa: B023
                assert logged("refusing peer connection from 127.0.0.1:")
            distrust = creds(TLSFiles(rogue.ca, ap.cert, ap.key))
            assert await rogue_link(front, distrust, "ap") == [grpc.StatusCode.UNAVAILABLE]
            hangup = "closed during the TLS handshake"
            await until(lambda: logged(hangup, logging.INFO), hangup, HANG_S)
            assert count("handshake") == count("identity") == count("unauthenticated") == 0
            # Around the front: the gRPC server on loopback answers nobody.
            assert node.security.front is not None
            behind = f"127.0.0.1:{node.security.front.inner_port}"
            assert await rogue_link(behind, None, "ap") == [grpc.StatusCode.UNAUTHENTICATED]
            status = await asyncio.to_thread(health_status, behind, "", HANG_S)
            assert status == "UNREACHABLE"  # health too: UNAUTHENTICATED
            await until(lambda: count("unauthenticated") >= 2, "unauthenticated", HANG_S)
            assert logged("did not come through the TLS front")
            # Through the front the hello check reads the certificate: ap's, not us's.
            got = await rogue_link(front, creds(ap), "us")
            assert got[-1] == grpc.StatusCode.PERMISSION_DENIED, got
            assert "certificate names 'ap'" in got[0].refuse_reason  # type: ignore[attr-defined]
            assert count("identity") == 1
            tls = TLSConfig(ca_file=str(ap.ca), cert_file=str(ap.cert), key_file=str(ap.key))
            assert await asyncio.to_thread(health_status, front, "", HANG_S, tls) == "SERVING"

    asyncio.run(run())


def test_the_tls_peer_port_binds_every_interface_and_names_a_port_in_use(tmp_path: Path) -> None:
    """``[::]`` (every interface, as gRPC binds it) serves the TLS front on IPv4 loopback
    too; a port already taken stops the node naming ``peer_listen``."""
    issue_federation("three", tmp_path / "certs")
    eu = tmp_path / "certs" / "brokers" / "eu"
    ap = TLSFiles.in_dir(tmp_path / "certs" / "brokers" / "ap")
    tls = TLSConfig(ca_file=str(ap.ca), cert_file=str(ap.cert), key_file=str(ap.key))

    async def run() -> None:
        config = lone_eu(tls_dir=str(eu), peer_listen="[::]:0")
        async with BrokerServer(config, CollectorRegistry()) as node:
            front = f"127.0.0.1:{node.peer_port}"
            assert await asyncio.to_thread(health_status, front, "", HANG_S, tls) == "SERVING"
            taken = lone_eu(tls_dir=str(eu), peer_listen=f"127.0.0.1:{node.peer_port}")
            with pytest.raises(geofed.InvalidInput) as info:
                await BrokerServer(taken, CollectorRegistry()).start()
            assert info.value.field == "peer_listen"

    asyncio.run(run())


def lone_eu(**settings: Any) -> NodeConfig:
    """Broker eu of `three` on free loopback ports, in-process, without its peers."""
    ports = {"client_listen": "127.0.0.1:0", "peer_listen": "127.0.0.1:0"}
    return NodeConfig(
        broker_id="eu",
        federation="three",
        metrics_listen="127.0.0.1:0",
        peer_timeout_s=0,
        **(ports | settings),
    )


def test_a_plaintext_health_port_answers_the_probes_of_a_tls_node(tmp_path: Path) -> None:
    """health_listen: a TLS broker answers plaintext health checks there (a kubelet's
    probes), and nothing else; its client port answers only over TLS."""
    issue_federation("three", tmp_path / "certs")
    config = lone_eu(
        tls_dir=str(tmp_path / "certs" / "brokers" / "eu"), health_listen="127.0.0.1:0"
    )

    async def run() -> None:
        async with BrokerServer(config, CollectorRegistry()) as node:
            probe = f"127.0.0.1:{node.health_port}"
            client = f"127.0.0.1:{node.client_port}"
            tls = TLSConfig(ca_file=str(tmp_path / "certs" / "ca.pem"))
            # Generous deadlines: a loaded machine may take seconds for a handshake.
            assert await asyncio.to_thread(health_status, probe, "", HANG_S) == "SERVING"
            assert await asyncio.to_thread(health_status, client) == "UNREACHABLE"
            assert await asyncio.to_thread(health_status, client, "", HANG_S, tls) == "SERVING"

    asyncio.run(run())


@pytest.mark.parametrize("reflection", ["on", "off"])
def test_reflection_can_be_turned_off(reflection: str) -> None:
    """``reflection off`` hides the API description on both ports (UNIMPLEMENTED); with
    ``on`` a client lists the services."""
    config = lone_eu(reflection=reflection)

    def services(endpoint: str) -> list[str] | grpc.StatusCode:
        with grpc.insecure_channel(endpoint) as channel:
            try:
                return sorted(ProtoReflectionDescriptorDatabase(channel).get_services())
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[no-any-return]

    async def run() -> None:
        async with BrokerServer(config, CollectorRegistry()) as node:
            client = await asyncio.to_thread(services, f"127.0.0.1:{node.client_port}")
            peer = await asyncio.to_thread(services, f"127.0.0.1:{node.peer_port}")
            if reflection == "off":
                assert client == peer == grpc.StatusCode.UNIMPLEMENTED
            else:
                assert isinstance(client, list) and "geofed.v1.ClientService" in client
                assert isinstance(peer, list) and "geofed.v1.FederationService" in peer

    asyncio.run(run())


def test_history_reads_need_subscribe_deletes_publish_and_peers_need_a_broker_certificate(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """History over mutual TLS: reading a filter needs subscribe permission on it,
    deleting needs publish permission covering it; the peer port's History RPC answers
    brokers only (a client certificate is refused)."""

    async def run() -> None:
        alice = await connect(fed, "alice", "alice-h", PARIS)
        bob = await connect(fed, "bob", "bob-h", SINGAPORE)
        await alice.publish("sensors/alice/h", b"eu")
        await bob.publish("alerts/bob", b"ap")
        # Read across regions (eu asks ap over the mTLS peer port); the newest first
        # (other tests of this federation published under these topics before).
        seen = await alice.history("alerts/#", limit=1)
        assert [r.payload for r in seen] == [b"ap"] and seen.brokers == {"eu", "us", "ap"}
        assert [r.payload for r in await alice.history("sensors/+/+", limit=1)] == [b"eu"]
        with pytest.raises(geofed.PermissionDenied) as info:
            await alice.history("sensors/#")  # sensors/+/+ does not cover it
        assert info.value.rule == "subscribe"
        # Delete: publish permission covering the filter (sensors/%u/+).
        with pytest.raises(geofed.PermissionDenied) as info:
            await alice.delete_history("sensors/+/+")
        assert info.value.rule == "publish"
        gone = await alice.delete_history("sensors/alice/+", limit=1)
        assert [(r.topic, r.payload) for r in gone] == [("sensors/alice/h", b"eu")]
        left = await alice.history("sensors/+/+", limit=100)
        assert "sensors/alice/h" not in {r.topic for r in left}
        for c in (alice, bob):
            await c.close()

    asyncio.run(run())

    async def as_client() -> grpc.StatusCode:
        ca = CA.load(fed.certs_dir)
        files = issue_client(ca, "eu", tmp_path / "client-eu")
        async with grpc.aio.secure_channel(fed.nodes["ap"].peer, creds(files)) as channel:
            request = gw.peer_history_request(
                "eu", geofed.routing.HistoryQuery("#", None, None, None, 10), 1 << 20
            )
            try:
                await fpb_grpc.FederationServiceStub(channel).History(request, timeout=HANG_S)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    assert asyncio.run(as_client()) == grpc.StatusCode.PERMISSION_DENIED
