"""Faults under cross-region load, every strategy: nothing lost, duplicated or unexpected.

Each case runs one fault cycle on a fresh three-broker federation (durable
data directories, a fault proxy on every peer link) under a steady load of
one publisher and four subscriptions with mixed geofences
(`geofed.bench.faults`): load, fault, load during the fault, heal, wait for
health, load; then a marker event settles the run and the history checker
holds every acknowledged event against the oracle. Waits are on state only.

The kill cases need durable brokers (docs/design.md §8): without a store, a
broker killed mid-load loses what it held, and these cases say so.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

import geofed
from geofed.bench import LocalFederation, metric
from geofed.bench.faultproxy import ProxyHost
from geofed.bench.faults import FAULTS, run_faults, until
from geofed.node import DELIVERIES, PEER_MESSAGES_RECEIVED, SUBSCRIPTIONS
from geofed.routing import STRATEGIES

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fault_cycle_loses_duplicates_and_invents_nothing(
    strategy: str, fault: str, tmp_path: Path
) -> None:
    result = asyncio.run(run_faults(strategy, fault, cycles=1, workdir=tmp_path))
    report = result.report
    # The cycle did what it says: load crossed regions, and a kill restarted a broker.
    assert report.required > 0 and report.acknowledged > 0, str(result)
    assert result.restarts == (1 if fault.startswith("kill-") else 0)
    assert result.ok, str(result)
    assert report.delivered == report.required


def test_fault_proxy_passes_partitions_blackholes_and_heals() -> None:
    received = bytearray()
    served: list[asyncio.StreamWriter] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(writer)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1024):
                received.extend(data)
                writer.write(data)
                await writer.drain()

    async def dial(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host, port = address.rsplit(":", 1)
        return await asyncio.open_connection(host, int(port))

    async def cut_off(reader: asyncio.StreamReader) -> bool:
        try:
            return await reader.read(1024) == b""
        except ConnectionResetError:
            return True

    async def run() -> None:
        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        hosts = ProxyHost()
        try:
            proxy = hosts.add("a->b", f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
            reader, writer = await dial(proxy.address)
            writer.write(b"one")
            assert await reader.readexactly(3) == b"one"
            # Partition: the open connection is reset, a new one is closed at once.
            await asyncio.to_thread(proxy.partition)
            assert await cut_off(reader)
            writer.close()
            reader, writer = await dial(proxy.address)
            assert await cut_off(reader)
            writer.close()
            assert (proxy.mode, proxy.cuts, proxy.accepted) == ("partition", 1, 2)
            # Blackhole: accepted and held, bytes read and dropped, nothing reaches the peer.
            await asyncio.to_thread(proxy.set_mode, "blackhole")
            reader, writer = await dial(proxy.address)
            writer.write(b"lost")
            await until(lambda: proxy.dropped == 4, "the proxy drops 4 bytes", 30)
            assert bytes(received) == b"one"
            # Healed: traffic passes again, on the held connection too.
            await asyncio.to_thread(proxy.heal)
            writer.write(b"two")
            assert await reader.readexactly(3) == b"two"
            assert bytes(received) == b"onetwo"
            # Hold: what is sent waits at the proxy, then arrives, in order.
            await asyncio.to_thread(proxy.hold)
            writer.write(b"late")
            await until(lambda: proxy.held == 1, "the proxy holds a chunk", 30)
            assert bytes(received) == b"onetwo"
            await asyncio.to_thread(proxy.heal)
            assert await reader.readexactly(4) == b"late"
            assert bytes(received) == b"onetwolate" and proxy.dropped == 4
            writer.close()
        finally:
            hosts.close()
            server.close()
            for w in served:
                w.close()

    asyncio.run(run())


THREE = Path(__file__).resolve().parents[2] / "deploy" / "federations" / "three.geojson"


def test_a_renewal_outlives_a_slow_links_late_announcement_and_withdrawal(tmp_path: Path) -> None:
    """A subscriber moves eu -> us -> eu while the us-ap link is slow (held): ap gets eu's
    withdrawal and renewal first, us's announcement and withdrawal after them. ap must
    still hold eu's copy and deliver to it (docs/design.md §3: each home's last word)."""
    paris, new_york = geofed.LatLon(48.85, 2.35), geofed.LatLon(40.71, -74.0)
    singapore = geofed.LatLon(1.29, 103.85)

    async def run(fed: LocalFederation) -> None:
        ap, eu = fed.nodes["ap"].metrics_url, fed.nodes["eu"].metrics_url

        def from_eu(kind: str) -> float:
            return metric(ap, PEER_MESSAGES_RECEIVED, peer="eu", kind=kind)

        mover = await geofed.connect(
            client_id="mover", location=paris, federation=fed.federation_path
        )
        sub = await mover.subscribe("race/x", subscription_id="s1")
        await fed.quiescent()
        assert metric(ap, SUBSCRIPTIONS, scope="remote") == 1
        subscribes, unsubscribes = from_eu("subscribe"), from_eu("unsubscribe")
        await asyncio.to_thread(fed.link("us", "ap").hold)
        assert await mover.move(new_york)  # eu withdraws, us announces (held towards ap)
        assert await mover.move(paris)  # us withdraws (held), eu renews
        await until(
            lambda: (
                from_eu("unsubscribe") == unsubscribes + 1
                and from_eu("subscribe") == subscribes + 1
            ),
            "ap has eu's withdrawal and renewal",
            60,
            scrapes=True,
        )
        await asyncio.to_thread(fed.link("us", "ap").heal)  # us's two arrive late
        await fed.quiescent()
        assert fed.link("us", "ap").held > 0
        made = metric(eu, DELIVERIES)
        publisher = await geofed.connect(
            client_id="far", location=singapore, federation=fed.federation_path
        )
        await publisher.publish("race/x", b"after the moves")
        await fed.quiescent()
        assert metric(eu, DELIVERIES) == made + 1, "ap lost eu's renewed copy"
        assert (await sub.next()).payload == b"after the moves"
        await publisher.close()
        await mover.close()

    with LocalFederation(
        THREE, "flooding-subscriptions", tmp_path, links=True, mqtt=False, http=False
    ) as fed:
        asyncio.run(run(fed))
