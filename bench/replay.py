"""Real gRPC clients: connect at the local broker, follow redirects, replay traces.

`Replayer` plays a workload trace (DESIGN §4) against a running federation:
one client session per trace client, each at the broker responsible for its
location; a location update that leaves the area is answered with a redirect,
and the client reconnects there and renews its subscriptions (the same
semantics as the in-memory simulator). Deliveries received on the Subscribe
streams are written to the delivery log.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

import grpc

from geofed.routing import Federation, GeofedError, LatLon, TraceOp
from geofed.v1 import client_pb2 as cpb
from geofed.v1 import client_pb2_grpc as cpb_grpc
from geofed.v1 import geo_pb2 as gpb
from geofed.wire import geofence_to_pb


def latlon_pb(p: LatLon) -> gpb.LatLon:
    """Wire form of a point."""
    return gpb.LatLon(lat=p.lat, lon=p.lon)


@dataclass
class _Client:
    id: str
    location: LatLon
    broker: str
    subs: dict[str, gpb.Subscription] = field(default_factory=dict)
    streams: dict[str, asyncio.Task[None]] = field(default_factory=dict)


class Replayer:
    """Replays trace actions with one gRPC session per client.

    Args:
        federation: the federation, with client endpoints.
        delivery_log: open text file for delivery records (or None).
        barrier: awaited after each action (e.g. wait until no inter-broker
            message is in flight), or None.
    """

    def __init__(
        self,
        federation: Federation,
        delivery_log: IO[str] | None = None,
        barrier: Callable[[], Any] | None = None,
    ) -> None:
        self.federation = federation
        self._log = delivery_log
        self._barrier = barrier
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._clients: dict[str, _Client] = {}
        self.deliveries: list[tuple[str, str]] = []
        self.latencies: list[
            tuple[str, str, float]
        ] = []  # (publisher broker, subscriber broker, seconds)
        self.redirects = 0
        self.errors: list[str] = []
        self._origin: dict[str, str] = {}

    def stub(self, broker_id: str) -> cpb_grpc.ClientServiceStub:
        """A client stub for a broker (one channel per broker)."""
        ch = self._channels.get(broker_id)
        if ch is None:
            endpoint = self.federation.broker(broker_id).client_endpoint
            if not endpoint:
                raise GeofedError(
                    f"broker {broker_id} has no client_endpoint in the federation file"
                )
            ch = self._channels[broker_id] = grpc.aio.insecure_channel(endpoint)
        return cpb_grpc.ClientServiceStub(ch)

    async def close(self) -> None:
        """Cancel streams and close channels."""
        for c in self._clients.values():
            for task in c.streams.values():
                task.cancel()
        for c in self._clients.values():
            await asyncio.gather(*c.streams.values(), return_exceptions=True)
        for ch in self._channels.values():
            await ch.close()

    async def settle(self, quiet: float = 0.3) -> None:
        """Wait until no delivery has arrived for `quiet` seconds.

        Deliveries the brokers already pushed may still be on the client streams
        after the federation went quiescent.
        """
        last, since = -1, time.monotonic()
        while time.monotonic() - since < quiet:
            if len(self.deliveries) != last:
                last, since = len(self.deliveries), time.monotonic()
            await asyncio.sleep(0.05)

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
            except grpc.aio.AioRpcError as exc:
                self.errors.append(f"line {op.line}: {exc.code().name}: {exc.details()}")
            if self._barrier is not None:
                await self._barrier()

    async def apply(self, op: TraceOp) -> None:
        """Perform one trace action through gRPC."""
        if op.location is not None:
            await self._locate(op.client, op.location)
        client = self._clients.get(op.client)
        if op.op == "subscribe":
            assert client is not None
            sub = gpb.Subscription(
                id=op.id,
                client=op.client,
                topic_filter=op.topic,
                geofence=geofence_to_pb(op.geofence),
            )
            await self._subscribe(client, sub)
        elif op.op == "unsubscribe":
            if client is None or op.id not in client.subs:
                self.errors.append(
                    f"line {op.line}: client {op.client} has no subscription {op.id}"
                )
                return
            del client.subs[op.id]
            await self.stub(client.broker).Unsubscribe(
                cpb.UnsubscribeRequest(client=op.client, subscription_id=op.id)
            )
            task = client.streams.pop(op.id, None)
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        elif op.op == "publish":
            assert client is not None and op.location is not None
            ev = gpb.Event(
                id=op.id,
                topic=op.topic,
                payload=b"\0" * op.payload_size,
                publisher=latlon_pb(op.location),
                geofence=geofence_to_pb(op.geofence),
            )
            self._origin[op.id] = client.broker
            await self.stub(client.broker).Publish(cpb.PublishRequest(client=op.client, event=ev))

    async def _locate(self, client_id: str, where: LatLon) -> None:
        client = self._clients.get(client_id)
        if client is None:
            broker = await self._connect(client_id, where, self.federation.responsible(where))
            self._clients[client_id] = _Client(client_id, where, broker)
            return
        if client.location == where:
            return
        client.location = where
        resp = await self.stub(client.broker).UpdateLocation(
            cpb.UpdateLocationRequest(client=client_id, location=latlon_pb(where))
        )
        if resp.accepted:
            return
        self.redirects += 1
        # The old broker ended our streams and withdrew the subscriptions.
        for task in client.streams.values():
            await asyncio.gather(task, return_exceptions=True)
        client.streams.clear()
        client.broker = await self._connect(client_id, where, resp.redirect.broker_id)
        for sub in client.subs.values():
            await self._subscribe(client, sub)

    async def _connect(self, client_id: str, where: LatLon, broker: str) -> str:
        for _ in range(len(self.federation) + 1):
            resp = await self.stub(broker).Connect(
                cpb.ConnectRequest(client=client_id, location=latlon_pb(where))
            )
            if resp.accepted:
                return broker
            self.redirects += 1
            broker = resp.redirect.broker_id
        raise GeofedError(f"client {client_id}: redirect loop")

    async def _subscribe(self, client: _Client, sub: gpb.Subscription) -> None:
        old = client.streams.pop(sub.id, None)
        call = self.stub(client.broker).Subscribe(
            cpb.SubscribeRequest(client=client.id, subscription=sub)
        )
        await call.initial_metadata()  # sent once the broker registered the subscription
        client.subs[sub.id] = sub
        client.streams[sub.id] = asyncio.create_task(self._pump(client, client.broker, call))
        if old is not None:
            await asyncio.gather(old, return_exceptions=True)

    async def _pump(self, client: _Client, broker: str, call: Any) -> None:
        try:
            async for d in call:
                now = time.time()
                self.deliveries.append((d.event.id, d.subscription_id))
                origin = self._origin.get(d.event.id, "")
                self.latencies.append((origin, broker, d.deliver_time - d.event.publish_time))
                if self._log is not None:
                    self._log.write(
                        json.dumps(
                            {
                                "event": d.event.id,
                                "subscription": d.subscription_id,
                                "client": client.id,
                                "t_publish": d.event.publish_time,
                                "t_deliver": now,
                            }
                        )
                        + "\n"
                    )
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION):
                self.errors.append(f"stream {client.id}: {exc.code().name}: {exc.details()}")
