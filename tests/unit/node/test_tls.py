"""TLS credentials and certificate identities against a real gRPC server on loopback.

Every certificate is made at run time by the project's own CA helper
(`geofed.node.create_ca` and friends); no key is committed. A real ``grpc.aio`` server on
``127.0.0.1:0`` serves the standard health service and a small "who am I"
method whose handler does what the node's link servicer will do: read the
caller's certificate names and hold them against the broker id it claims.
Refusals are read from the call's status; nothing waits on a clock.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from geofed.errors import from_rpc_error
from geofed.node import (
    CA,
    TLSFiles,
    _tls,
    broker_dns_name,
    broker_ids,
    channel_credentials,
    check_broker,
    client_identity,
    client_uri,
    create_ca,
    dial_options,
    issue_broker,
    issue_client,
    peer_identities,
    server_credentials,
)
from geofed.node._errors import abort
from geofed.routing import GeofedError, InvalidInput, PermissionDenied, Unauthenticated

SAFETY_S = 30.0
CALL_S = 10.0  # a refused handshake fails at once; this only turns a hang into a failure
WHO = "/geofed.test.Who/Check"


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def guarded() -> None:
        async with asyncio.timeout(SAFETY_S):
            await test()

    asyncio.run(guarded())


@dataclass
class Pki:
    ca: CA
    eu: TLSFiles  # the server: broker eu
    us: TLSFiles  # a peer broker
    alice: TLSFiles  # a client
    root: Path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca = create_ca(tmp_path / "ca")
    return Pki(
        ca,
        issue_broker(ca, "eu", [], tmp_path / "eu"),
        issue_broker(ca, "us", [], tmp_path / "us"),
        issue_client(ca, "alice/1", tmp_path / "alice"),
        tmp_path,
    )


async def _who(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """Check the caller's certificate against the broker id in the request, as a hello."""
    names = peer_identities(context)
    if request:
        try:
            check_broker(names, request.decode())
        except GeofedError as exc:
            await abort(context, exc)
    return "\n".join(names).encode()


@asynccontextmanager
async def serving(
    files: TLSFiles | None, *, require_client_auth: bool = True
) -> AsyncIterator[str]:
    """A real server with health and `WHO` on loopback (plaintext when `files` is None)."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    handler = grpc.unary_unary_rpc_method_handler(_who)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("geofed.test.Who", {"Check": handler})]
    )
    if files is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        creds = server_credentials(files, require_client_auth=require_client_auth)
        port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


def channel(
    target: str,
    files: TLSFiles | None,
    *,
    peer: str | None = "eu",
    client_cert: bool = True,
) -> grpc.aio.Channel:
    """A client channel with its own connection (no subchannel shared with other channels).

    With a `peer`, TLS checks the server is that broker (a dialler); without, the host dialled.
    """
    options = [("grpc.use_local_subchannel_pool", 1)]
    if files is None:
        return grpc.aio.insecure_channel(target, options=options)
    creds = channel_credentials(files, client_cert=client_cert)
    if peer is not None:
        options += dial_options(peer)
    return grpc.aio.secure_channel(target, creds, options=options)


async def healthy(ch: grpc.aio.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(ch)
    answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_S)
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


async def refused(ch: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    """The error of a health check that must not get through."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await healthy(ch)
    return info.value


async def who(ch: grpc.aio.Channel, claimed: str = "") -> list[str]:
    answer = await ch.unary_unary(WHO)(claimed.encode(), timeout=CALL_S)
    return answer.decode().split("\n") if answer else []


# --------------------------------------------------------------------------
# Accepted


def test_a_peer_with_a_certificate_from_the_federation_ca_is_accepted(pki: Pki) -> None:
    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, pki.us) as ch:
            assert await healthy(ch)
            names = await who(ch, "us")  # the hello's id is backed by the certificate
            assert broker_ids(names) == ["us"]
            assert "us.broker.geofed" in names and "localhost" in names

    run(test)


def test_a_client_certificate_names_its_identity(pki: Pki) -> None:
    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, pki.alice) as ch:
            names = await who(ch)
            assert names == [client_uri("alice/1")] == ["geofed://client/alice%2F1"]
            assert client_identity(names) == "alice/1"
            assert broker_ids(names) == []
            # A client certificate never passes for a broker.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await who(ch, "alice")
            error = from_rpc_error(info.value)
            assert isinstance(error, PermissionDenied) and error.rule == "identity"

    run(test)


def test_tls_without_client_auth_serves_clients_without_a_certificate(pki: Pki) -> None:
    # gRPC's Python servers either require a client certificate or do not ask for one:
    # a token port identifies nobody by certificate, even a client that has one.
    async def test() -> None:
        async with serving(pki.eu, require_client_auth=False) as target:
            async with channel(target, pki.alice, client_cert=False) as ch:
                assert await who(ch) == []  # encrypted, but nobody authenticated
            async with channel(target, pki.alice) as ch:
                assert await who(ch) == []

    run(test)


def test_clients_verify_a_broker_by_the_loopback_host_they_dial(pki: Pki) -> None:
    async def test() -> None:
        async with serving(pki.eu, require_client_auth=False) as target:
            port = target.rpartition(":")[2]
            for host in ("127.0.0.1", "localhost"):
                async with channel(f"{host}:{port}", pki.alice, peer=None, client_cert=False) as ch:
                    assert await healthy(ch)

    run(test)


# --------------------------------------------------------------------------
# Refused


def test_a_plaintext_client_is_refused(pki: Pki) -> None:
    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, None) as ch:
            assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE

    run(test)


def test_a_client_without_a_certificate_is_refused(pki: Pki) -> None:
    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, pki.us, client_cert=False) as ch:
            assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE

    run(test)


def test_a_certificate_from_another_ca_is_refused(pki: Pki) -> None:
    rogue_ca = create_ca(pki.root / "rogue-ca", name="rogue")
    # Everything right but the issuer: the name a real peer has, the server trusted.
    rogue = issue_broker(rogue_ca, "us", [], pki.root / "rogue")
    shutil.copyfile(pki.ca.cert_path, rogue.ca)

    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, rogue) as ch:
            assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE

    run(test)


def test_an_expired_certificate_is_refused(pki: Pki) -> None:
    yesterday = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    expired = issue_broker(pki.ca, "us", [], pki.root / "expired", not_after=yesterday)

    async def test() -> None:
        async with serving(pki.eu) as target:
            async with channel(target, expired) as ch:
                assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE
            async with channel(target, pki.us) as ch:  # the same name, in date: accepted
                assert await healthy(ch)

    run(test)


def test_a_valid_certificate_for_another_broker_fails_the_hello_check(pki: Pki) -> None:
    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, pki.us) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await who(ch, "ap")  # "us" says hello as "ap"
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            error = from_rpc_error(info.value)
            assert isinstance(error, PermissionDenied) and error.rule == "identity"
            assert "'ap'" in error.detail and "'us'" in error.detail

    run(test)


def test_a_dialler_refuses_a_server_that_is_not_the_broker_it_dialled(pki: Pki) -> None:
    async def test() -> None:
        # eu answers where ap should.
        async with serving(pki.eu) as target, channel(target, pki.us, peer="ap") as ch:
            assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE

    run(test)


def test_on_a_plaintext_port_there_are_no_identities_and_the_hello_check_refuses() -> None:
    async def test() -> None:
        async with serving(None) as target, channel(target, None) as ch:
            assert await who(ch) == []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await who(ch, "us")
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert isinstance(from_rpc_error(info.value), Unauthenticated)

    run(test)


# --------------------------------------------------------------------------
# Rotation


def _replace(src: TLSFiles, dst: TLSFiles, ca_bundle: bytes) -> None:
    """Rotate `dst`'s files to `src`'s key and certificate, trusting `ca_bundle` (atomic moves)."""
    for a, b in ((src.key, dst.key), (src.cert, dst.cert)):
        tmp = b.with_suffix(".new")
        shutil.copyfile(a, tmp)
        os.replace(tmp, b)
    tmp = dst.ca.with_suffix(".new")
    tmp.write_bytes(ca_bundle)
    os.replace(tmp, dst.ca)


def test_rotated_files_serve_new_connections_while_old_ones_keep_working(pki: Pki) -> None:
    # The server moves to a certificate from a new CA (and trusts both CAs for callers).
    # A channel trusting only the old CA could not reconnect after that, so its calls
    # still working shows its connection was kept.
    new_ca = create_ca(pki.root / "new-ca", name="new")
    new_eu = issue_broker(new_ca, "eu", [], pki.root / "new-eu")
    trusts_new = TLSFiles(new_ca.cert_path, pki.us.cert, pki.us.key)

    async def test() -> None:
        async with serving(pki.eu) as target, channel(target, pki.us) as old:
            assert await healthy(old)
            async with channel(target, trusts_new) as ch:
                assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE
            bundle = pki.ca.cert_path.read_bytes() + new_ca.cert_path.read_bytes()
            _replace(new_eu, pki.eu, bundle)
            async with channel(target, trusts_new) as ch:
                assert await healthy(ch)  # a new connection gets the new certificate
            async with channel(target, pki.us) as ch:
                assert (await refused(ch)).code() == grpc.StatusCode.UNAVAILABLE
            assert await healthy(old)
            assert broker_ids(await who(old, "us")) == ["us"]

    run(test)


def test_a_half_rotated_pair_is_not_taken(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = TLSFiles.in_dir(tmp_path / "live")
    shutil.copytree(pki.eu.cert.parent, files.cert.parent)
    reloader = _tls._Reloader(files, files.read())
    assert reloader() is None  # nothing changed
    renewed = issue_broker(pki.ca, "eu", [], tmp_path / "renewed")
    shutil.copyfile(renewed.cert, files.cert)  # the new certificate beside the old key
    with caplog.at_level(logging.WARNING, "geofed.node.tls"):
        assert reloader() is None
    assert "does not belong to the certificate" in caplog.text and reloader.reloads == 0
    shutil.copyfile(renewed.key, files.key)
    assert isinstance(reloader(), grpc.ServerCertificateConfiguration)
    assert reloader.reloads == 1
    assert reloader() is None  # taken once
    # Rewritten with the same content (a touched file): stat changes, nothing reloads.
    files.cert.write_bytes(files.cert.read_bytes())
    assert reloader() is None and reloader.reloads == 1


# --------------------------------------------------------------------------
# Names and files


def test_broker_names_are_dns_names_and_other_ids_are_refused() -> None:
    assert broker_dns_name("eu") == "eu.broker.geofed"
    assert broker_dns_name("us-east-1") == "us-east-1.broker.geofed"
    assert broker_dns_name("eu.west") == "eu.west.broker.geofed"
    for bad in ("EU", "a_b", "-x", "x-", "", "a..b", "x" * 64, "é"):
        with pytest.raises(InvalidInput) as info:
            broker_dns_name(bad)
        assert info.value.field == "broker_id"
    assert broker_ids(["eu.broker.geofed", ".broker.geofed", "localhost", "geofed://x"]) == ["eu"]


def test_check_broker_without_tls_or_without_a_broker_name() -> None:
    with pytest.raises(Unauthenticated, match="'us' presented no certificate"):
        check_broker([], "us")
    with pytest.raises(PermissionDenied, match="names no broker") as info:
        check_broker([client_uri("bob")], "us")
    assert info.value.rule == "identity"
    check_broker(["localhost", "us.broker.geofed"], "us")


def test_unusable_files_are_named(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput) as info:
        server_credentials(TLSFiles(pki.eu.ca, pki.eu.cert, tmp_path / "missing.pem"))
    assert info.value.field == "tls.key" and "missing.pem" in info.value.reason
    with pytest.raises(InvalidInput, match="does not belong") as info:
        channel_credentials(TLSFiles(pki.eu.ca, pki.eu.cert, pki.us.key))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(InvalidInput) as info:
        TLSFiles(tmp_path / "junk.pem", pki.eu.cert, pki.eu.key).read()
    assert info.value.field == "tls.ca"
