"""Replaying a workload trace through real clients (`geofed.client`).

`Replayer` plays a trace (docs/design.md §4) against a running federation:
one `geofed.Client` per trace client, opened at the broker responsible for
its first location; a ``move`` is `Client.move` (which follows a redirect and
renews the client's subscriptions at its new broker, as the in-memory
simulator does); every delivery a subscription yields is recorded, and
written to the delivery log.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import IO

from geofed.client import Channels, Client, ClientConfig, Subscription, TLSConfig, connect
from geofed.routing import Federation, GeofedError, LatLon, TraceOp

from .scrape import delivered


class Replayer:
    """Replays trace actions with one client session per trace client.

    Args:
        federation: the federation, with client endpoints.
        delivery_log: open text file for delivery records (or None).
        barrier: awaited after each action (e.g. wait until no inter-broker
            message is in flight), or None.
        tls: TLS towards brokers that serve it (their clients are not
            authenticated by certificate: one connection serves every client).
    """

    def __init__(
        self,
        federation: Federation,
        delivery_log: IO[str] | None = None,
        barrier: Callable[[], Awaitable[object]] | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.federation = federation
        self._log = delivery_log
        self._barrier = barrier
        self._tls = tls
        self._channels = Channels(tls)  # one connection per broker for every client
        self._clients: dict[str, Client] = {}
        self._subs: dict[tuple[str, str], Subscription] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._ended: list[Subscription] = []
        self.deliveries: list[tuple[str, str]] = []
        """(event id, subscription id) of every delivery, in arrival order."""
        self.latencies: list[tuple[str, str, float]] = []
        """(publisher's broker, subscriber's broker, seconds from publish to delivery)."""
        self.errors: list[str] = []

    @property
    def redirects(self) -> int:
        """Redirects the clients followed (opening sessions and moves)."""
        return sum(c.redirects for c in self._clients.values())

    @property
    def received(self) -> int:
        """Deliveries that reached the clients, duplicates of handovers included."""
        subs = [*self._subs.values(), *self._ended]
        return sum(s.received for s in subs)

    async def run(self, ops: Iterable[TraceOp], speed: float = 0.0) -> None:
        """Replay `ops`; `speed` > 0 honours ``t`` scaled by it, 0 goes as fast as possible."""
        start = time.monotonic()
        for op in ops:
            if speed > 0:
                wait = start + op.t / speed - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            try:
                await self.apply(op)
            except GeofedError as exc:
                self.errors.append(f"line {op.line}: {type(exc).__name__}: {exc}")
            if self._barrier is not None:
                await self._barrier()

    async def apply(self, op: TraceOp) -> None:
        """Perform one trace action through the client library."""
        client = self._clients.get(op.client)
        if op.location is not None:
            moved = client is not None and client.location != op.location
            client = await self._locate(op.client, op.location)
            if moved and op.op != "move" and self._barrier is not None:
                # The move is an action of its own: let it settle before this one.
                await self._barrier()
        if op.op == "subscribe":
            assert client is not None
            old = self._subs.pop((op.client, op.id), None)
            fence = op.roaming if op.roaming is not None else op.geofence
            sub = await client.subscribe(op.topic, geofence=fence, subscription_id=op.id)
            if old is not None:
                self._ended.append(old)  # an update: the broker ended the old stream
            self._subs[(op.client, op.id)] = sub
            self._readers.append(asyncio.create_task(self._read(client, sub)))
        elif op.op == "unsubscribe":
            gone = self._subs.pop((op.client, op.id), None)
            if gone is None:
                self.errors.append(
                    f"line {op.line}: client {op.client} has no subscription {op.id}"
                )
                return
            self._ended.append(gone)
            await gone.unsubscribe()
        elif op.op == "publish":
            assert client is not None
            await client.publish(
                op.topic, b"\0" * op.payload_size, geofence=op.geofence, event_id=op.id
            )

    async def settle(
        self, metrics_urls: Mapping[str, str], before: float = 0.0, timeout: float = 60.0
    ) -> None:
        """Wait until every delivery the brokers handed to a stream has reached its client.

        Call it once the federation is quiescent: the brokers' delivery counts
        are then final. `before` is `geofed.bench.delivered` from before this
        replay, for a federation that served other clients already.

        Raises:
            GeofedError: if deliveries are still missing after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            sent = await asyncio.to_thread(delivered, metrics_urls) - before
            if self.received >= sent:
                return
            if time.monotonic() > deadline:
                raise GeofedError(
                    f"{int(sent) - self.received} deliveries sent by the brokers did not "
                    f"reach their clients within {timeout:g}s"
                )
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        """Close every client (their subscriptions end) and the connections."""
        for client in self._clients.values():
            await client.close()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await self._channels.close()

    async def _locate(self, client_id: str, where: LatLon) -> Client:
        client = self._clients.get(client_id)
        if client is None:
            client = await connect(
                ClientConfig(client_id, where, federation=self.federation, tls=self._tls),
                channels=self._channels,
            )
            self._clients[client_id] = client
        elif client.location != where:
            await client.move(where)
        return client

    async def _read(self, client: Client, sub: Subscription) -> None:
        try:
            async for msg in sub:
                self.deliveries.append((msg.event_id, msg.subscription_id))
                latency = msg.deliver_time - msg.publish_time
                self.latencies.append((msg.origin, msg.broker, latency))
                if self._log is not None:
                    record = {
                        "event": msg.event_id,
                        "subscription": msg.subscription_id,
                        "client": client.client_id,
                        "t_publish": msg.publish_time,
                        "t_deliver": time.time(),
                    }
                    self._log.write(json.dumps(record) + "\n")
        except GeofedError as exc:
            self.errors.append(f"subscription {sub.id} of {client.client_id}: {exc}")
