"""geofed next to the federations operators build from topic-only brokers.

The same workload trace, per scenario, through:

* **geofed** under each routing strategy: the ``geofed bench`` pipeline
  (`geofed.bench.compare`) in its exact mode (``--barrier``, no WAN delay),
  run as its own process; its measured rows are read from its report.json;
* **mosquitto-star**: one Debian ``mosquitto`` per region, the leaves
  bridged to a hub region with ``topic # both 0``. The operator's usual
  choice for many regions: Mosquitto bridges carry no subscription interest,
  so a bridge either forwards a fixed topic pattern or misses subscriptions
  made later; ``#`` is the one pattern that serves every subscription without
  per-region configuration, and a mesh of ``both`` bridges would loop. The
  hub is the region whose site is nearest (great-circle sum) to the others;
* **nats**: one Debian ``nats-server`` per region joined by gateways into a
  super-cluster (every server dials every other; gateways run the
  interest-only mode: a server forwards a message only to servers that sent
  interest in its subject) with plain subjects (``sensors.fr.paris.noise``);
* **nats-geo-decimal** / **nats-geo-h3**: the same super-cluster with
  geo-encoded subjects built with `geofed.cover` (see "Geo-encoded subjects").

Clients attach to the server of the region of their first location and stay
there. Every peer system gets the client-side exact check a topic-only
consumer needs: the payload starts with a header line (event id, the
publisher's location, the event geofence's WKT), and a delivery counts
*after the check* when the publisher lies in the subscription's geofence and
the subscriber in the event's. The pairs (event, subscription) after the
check are compared with the central matcher (`reference_deliveries`).

Measured, not computed. Every inter-server connection (a bridge, a gateway)
runs through a counting TCP proxy (`geofed.bench.faultproxy` with a tap) that
parses the protocol on the wire: data messages (MQTT PUBLISH, NATS RMSG/HMSG)
and their bytes, interest messages (MQTT SUBSCRIBE/UNSUBSCRIBE and their
acks, NATS RS+/RS-/A+/A-), the rest (keep-alives, handshakes) apart; only
what passes after every server is up and linked counts. The brokers' own
statistics are read beside them as a check: NATS ``/gatewayz`` (messages out
on the gateways), Mosquitto ``$SYS`` (PUBLISH packets received, minus the
clients' publishes: those that came over a bridge).

Replay. Ops run in trace order as fast as the barriers allow (like ``geofed
bench --barrier``): before a publish that follows an interest change, every
server's view of every other server's interest must equal the subjects held
there (``/gatewayz?accs=1``, ``num_subs``; Mosquitto: the SUBACK, bridges
carry ``#`` anyway); before an interest or location change, and at the end,
every delivery the brokers' matching implies must have arrived (a wait on
state; a delivery that never comes is recorded after ``--settle-timeout``
seconds and shows as a recall below 1).

Geo-encoded subjects. A subject is ``g.<publisher's location>.<event
cell>.<topic>``: the location levels of the layout (`DecimalLayout`: sign
and digit levels; `H3Layout`: the base cell then a digit per resolution),
then a cell of the event geofence's cover (``cover(fence, max_filters=
--event-filters)``), its free levels written ``x``; an event with a geofence
is published once per cell, one without once with every level ``x``. A
subscription subscribes to ``g.<a cell of its geofence's cover, free levels
*>.<ancestor of its subscriber's location>.<filter>`` for every cover cell
(``--sub-filters``; no geofence: every level ``*``) and every ancestor the
event cells can take: H3, one per resolution; decimal, one per step of the
chain lon, lat, lon, ... (the cover's cells are coarsened onto that chain,
and a cell inside another kept one is dropped, so each subscription gets an
event at most once), and the all-``x`` one. A subscriber that moves swaps
the ancestors that changed.

Usage: ``python -m geofed.bench.peers [--scenario context --scenario global]
[--clients 40] [--duration 20] [--federation aws-2020]``; the report is
appended to ``bench/results/peers.md`` (``--no-record``: not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geofed.routing import (
    STRATEGIES,
    DecimalLayout,
    Federation,
    Geofence,
    H3Layout,
    InvalidInput,
    LatLon,
    TraceOp,
    cover,
    covers,
    federation_path,
    great_circle_m,
    parse_geofence,
    reference_deliveries,
    reference_topic_match,
)

from . import _compare_report as rep
from . import brokers_bench
from ._machine import describe, record
from .brokers import BrokerUnavailable, Mosquitto, NatsServer, nats_subject
from .faultproxy import ProxyHost
from .faults import until
from .trace import read_trace_file, write_trace
from .workload import SCENARIOS, WorkloadConfig, generate

RESULTS = Path(__file__).resolve().parent / "results" / "peers.md"
PEERS = ("mosquitto-star", "nats", "nats-geo-decimal", "nats-geo-h3")
"""The peer systems, in report order."""
_HANG_S = 120.0  # a start-up or barrier that takes longer is a failure
_START_ATTEMPTS = 3
_POLL_S = 0.02
_GEO = "g"  # first subject token of the geo-encoded subjects
_FREE = "x"  # an event cell's free level


# ---------------------------------------------------------------------------
# Counting what crosses the links


class LinkCounts:
    """Messages and bytes that crossed the inter-server links, per class."""

    CLASSES = ("data", "interest", "other")

    def __init__(self) -> None:
        self.messages: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.lock = threading.Lock()

    def add(self, cls: str, size: int) -> None:
        with self.lock:
            self.messages[cls] += 1
            self.bytes[cls] += size

    def snapshot(self) -> dict[str, tuple[int, int]]:
        with self.lock:
            return {c: (self.messages[c], self.bytes[c]) for c in self.CLASSES}


Frame = Callable[[bytearray, int], tuple[int, str] | None]
"""Where the protocol unit starting at an offset ends, and its class (None: incomplete)."""


def tap(counts: LinkCounts, frame: Frame) -> Callable[[], Callable[[int, bytes], None]]:
    """A tap factory (`geofed.bench.faultproxy`): each way of each connection is
    cut into protocol units by `frame`, each counted in `counts`."""

    def make() -> Callable[[int, bytes], None]:
        bufs = [bytearray(), bytearray()]

        def feed(way: int, data: bytes) -> None:
            buf = bufs[way]
            buf += data
            at = 0
            while (unit := frame(buf, at)) is not None:
                end, cls = unit
                counts.add(cls, end - at)
                at = end
            del buf[:at]

        return feed

    return make


# MQTT control packet types (the high nibble of the first byte).
_MQTT_CLASS = {3: "data", 8: "interest", 9: "interest", 10: "interest", 11: "interest"}


def mqtt_frame(buf: bytearray, at: int) -> tuple[int, str] | None:
    """An MQTT packet: the type, the remaining length (a varint), then that many bytes."""
    length, shift, i = 0, 0, at + 1
    while True:
        if i >= len(buf):
            return None
        byte = buf[i]
        length |= (byte & 0x7F) << shift
        shift += 7
        i += 1
        if not byte & 0x80:
            break
    end = i + length
    return None if end > len(buf) else (end, _MQTT_CLASS.get(buf[at] >> 4, "other"))


_NATS_CLASS = {b"RMSG": "data", b"HMSG": "data", b"RS+": "interest", b"RS-": "interest"}
_NATS_CLASS.update({b"A+": "interest", b"A-": "interest"})


def nats_frame(buf: bytearray, at: int) -> tuple[int, str] | None:
    """A NATS gateway protocol line, with the payload of RMSG / HMSG (size last)."""
    nl = buf.find(b"\r\n", at)
    if nl < 0:
        return None
    line = bytes(buf[at:nl])
    verb = line.split(b" ", 1)[0].upper()
    end = nl + 2
    if verb in (b"RMSG", b"HMSG"):
        end += int(line.rsplit(b" ", 1)[1]) + 2  # the payload and its CRLF
    return None if end > len(buf) else (end, _NATS_CLASS.get(verb, "other"))


# ---------------------------------------------------------------------------
# Geo-encoded subjects


def _tokens(levels: Sequence[str], field_name: str) -> list[str]:
    """MQTT levels as NATS tokens (``+`` -> ``*``, ``#`` -> ``>``)."""
    return nats_subject("/".join(levels), field_name).split(".")


def subject_matches(pattern: Sequence[str], subject: Sequence[str]) -> bool:
    """NATS subject matching of token lists (``*`` one token, ``>`` the rest)."""
    for i, p in enumerate(pattern):
        if p == ">":
            return len(subject) > i
        if i >= len(subject) or (p != "*" and p != subject[i]):
            return False
    return len(pattern) == len(subject)


def _contains(outer: Sequence[str], inner: Sequence[str]) -> bool:
    return all(a in (_FREE, b) for a, b in zip(outer, inner, strict=True))


class GeoEncoding:
    """Subjects and subscriptions of one layout (`DecimalLayout` or `H3Layout`)."""

    def __init__(
        self, layout: DecimalLayout | H3Layout, coverage: float, sub_filters: int, ev_filters: int
    ) -> None:
        self.layout = layout
        self.coverage = coverage
        self.sub_filters = sub_filters
        self.ev_filters = ev_filters
        self.width = layout.location_level_count
        self._fences: dict[bytes, list[tuple[str, ...]]] = {}
        if isinstance(layout, DecimalLayout):
            lat, lon = layout.lat_axis, layout.lon_axis
            self._lat = (int(lat.signed), int(lat.signed) + lat.digits)  # digit level range
            lon_at = self._lat[1] + int(lon.signed)
            self._lon = (lon_at, lon_at + lon.digits)
            # The chain lon, lat, lon, ...: (lat digits, lon digits) after k steps.
            self.chain = [(k // 2, (k + 1) // 2) for k in range(lat.digits + lon.digits + 1)]
            self.chain = [(a, b) for a, b in self.chain if a <= lat.digits and b <= lon.digits]

    def _levels(self, cell: Any) -> list[str]:
        levels = self.layout.filter(cell, "t").split("/")[:-1]  # the cell's levels, then "t"
        levels = levels[len(self.layout.prefix.split("/")) :]
        return [_FREE if x == "+" else x for x in levels]

    def _mask(self, levels: list[str], a: int, b: int) -> tuple[str, ...]:
        out = list(levels)
        for (lo, hi), keep in ((self._lat, a), (self._lon, b)):
            for i in range(lo + keep, hi):
                out[i] = _FREE
        return tuple(out)

    def event_cells(self, fence: Geofence | None) -> list[tuple[str, ...]]:
        """The event-side parts of an event's subjects (one message each)."""
        if fence is None:
            return [(_FREE,) * self.width]
        got = self._fences.get(fence.key)
        if got is not None:
            return got
        c = cover(fence, self.layout, coverage=self.coverage, max_filters=self.ev_filters)
        cells = []
        for cell in c.cells:
            levels = self._levels(cell)
            if isinstance(self.layout, DecimalLayout):
                a, b = len(cell.lat), len(cell.lon)
                a, b = max((s for s in self.chain if s[0] <= a and s[1] <= b), key=sum)
                cells.append(self._mask(levels, a, b))
            else:
                cells.append(tuple(levels))
        kept = sorted(set(cells))
        kept = [c for c in kept if not any(o != c and _contains(o, c) for o in kept)]
        self._fences[fence.key] = kept
        return kept

    def ancestors(self, where: LatLon) -> set[tuple[str, ...]]:
        """The event cells a subscriber at `where` must hear: its location's ancestors."""
        full = self.layout.location_levels(where)
        out = {(_FREE,) * self.width}
        if isinstance(self.layout, DecimalLayout):
            out.update(self._mask(full, a, b) for a, b in self.chain)
        else:
            for r in range(self.width):
                out.add(tuple(full[: r + 1]) + (_FREE,) * (self.width - r - 1))
        return out

    def sub_cells(self, fence: Geofence | None) -> list[tuple[str, ...]]:
        """The subscription-side parts (``*`` for free levels) of a subscription."""
        if fence is None:
            return [("*",) * self.width]
        c = cover(fence, self.layout, coverage=self.coverage, max_filters=self.sub_filters)
        return [tuple("*" if x == _FREE else x for x in self._levels(cell)) for cell in c.cells]

    def subjects(self, op: TraceOp) -> list[tuple[str, ...]]:
        assert op.location is not None
        where = tuple(self.layout.location_levels(op.location))
        topic = tuple(_tokens(op.topic.split("/"), "topic"))
        return [(_GEO, *where, *cell, *topic) for cell in self.event_cells(op.geofence)]

    def patterns(
        self, sub_cells: list[tuple[str, ...]], ancestors: set[tuple[str, ...]], topic_filter: str
    ) -> set[tuple[str, ...]]:
        flt = tuple(_tokens(topic_filter.split("/"), "topic_filter"))
        return {(_GEO, *s, *a, *flt) for s in sub_cells for a in ancestors}


# ---------------------------------------------------------------------------
# The peer systems on loopback


@dataclass
class _Sub:
    client: str
    topic: str
    fence: Geofence | None
    patterns: set[tuple[str, ...]] = field(default_factory=set)
    cells: list[tuple[str, ...]] = field(default_factory=list)
    handles: dict[tuple[str, ...], Any] = field(default_factory=dict)


class _Deliveries:
    """What the subscribers received, before and after the exact check."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.raw: list[tuple[str, str]] = []  # (event, subscription) as delivered
        self.checked: list[tuple[str, str]] = []
        self.fences: dict[str, Geofence | None] = {}

    def got(self, sub_id: str, sub: _Sub, where: LatLon, payload: bytes) -> None:
        head = payload.split(b"\n", 1)[0].decode()
        event, lat, lon, wkt = head.split("\t")
        fence = self.fences.get(wkt)
        if wkt and wkt not in self.fences:
            fence = self.fences[wkt] = parse_geofence(wkt)
        publisher = LatLon(float(lat), float(lon))
        ok = covers(sub.fence, publisher) and covers(fence, where)
        with self.lock:
            self.raw.append((event, sub_id))
            if ok:
                self.checked.append((event, sub_id))

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.raw)


def _payload(op: TraceOp) -> bytes:
    assert op.location is not None
    wkt = op.geofence.wkt if op.geofence is not None else ""
    head = f"{op.id}\t{op.location.lat!r}\t{op.location.lon!r}\t{wkt}\n".encode()
    return head.ljust(max(op.payload_size, len(head)), b"x")


class _System:
    """One peer federation: servers per region, links through counting proxies, clients."""

    name = ""

    def __init__(self, fed: Federation, workdir: Path, settle_timeout: float) -> None:
        self.fed = fed
        self.workdir = workdir
        self.settle_timeout = settle_timeout
        self.counts = LinkCounts()
        self.proxies = ProxyHost()
        self.deliveries = _Deliveries()
        self.subs: dict[str, _Sub] = {}
        self.where: dict[str, LatLon] = {}
        self.home: dict[str, str] = {}
        self.expected = 0  # deliveries (before the check) the brokers' matching implies
        self.published = 0  # client PUBLISH messages (counting each copy)
        self.errors: list[str] = []
        self.interest_dirty = False
        self.stats: dict[str, Any] = {}

    # -- what each system provides
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def connect(self, client: str, region: str) -> None: ...
    async def publish(self, op: TraceOp) -> None: ...
    async def subscribe(self, sub_id: str, sub: _Sub) -> None: ...
    async def unsubscribe(self, sub_id: str, sub: _Sub) -> None: ...
    async def moved(self, client: str) -> None: ...
    async def interest_barrier(self) -> None: ...
    def matches(self, op: TraceOp, sub: _Sub) -> int:
        """How many copies of the event `op` the brokers deliver to `sub`."""
        raise NotImplementedError

    def crossed(self) -> int:
        """Data messages between servers by the brokers' own statistics."""
        raise NotImplementedError

    def broker_stats(self) -> dict[str, Any]:
        return {}

    async def links_quiet(self, wire_before: int) -> None:
        """Wait until every data message the brokers sent between them has crossed
        its link (the brokers' statistics equal the proxies' count)."""
        deadline = time.monotonic() + self.settle_timeout
        while True:
            crossed = await asyncio.to_thread(self.crossed)
            on_wire = self.counts.snapshot()["data"][0] - wire_before
            if crossed == on_wire:
                return
            if time.monotonic() > deadline:
                self.errors.append(f"links: brokers count {crossed}, the wire {on_wire}")
                return
            await asyncio.sleep(0.1)

    # -- the replay
    async def replay(self, ops: Sequence[TraceOp]) -> None:
        pending = False
        for op in ops:
            if op.location is not None:
                self.where[op.client] = op.location
            if op.client not in self.home:
                if op.location is None:
                    raise InvalidInput(
                        "workload", f"client {op.client} first acts without location"
                    )
                self.home[op.client] = self.fed.responsible(op.location)
                await self.connect(op.client, self.home[op.client])
            if op.op == "publish":
                if self.interest_dirty:
                    await self.interest_barrier()
                    self.interest_dirty = False
                self.expected += sum(self.matches(op, s) for s in self.subs.values())
                await self.publish(op)
                pending = True
                continue
            if pending:
                await self.settle()
                pending = False
            if op.op == "subscribe":
                if op.roaming is not None:
                    raise InvalidInput("workload", "roaming geofences are not modelled by peers")
                if op.id in self.subs:
                    continue  # re-subscribing an id: the oracle keeps the first holder's
                sub = self.subs[op.id] = _Sub(op.client, op.topic, op.geofence)
                await self.subscribe(op.id, sub)
                self.interest_dirty = True
            elif op.op == "unsubscribe":
                held = self.subs.get(op.id)
                if held is not None and held.client == op.client:
                    del self.subs[op.id]
                    await self.unsubscribe(op.id, held)
                    self.interest_dirty = True
            elif op.op == "move":
                await self.moved(op.client)
        await self.settle()

    async def settle(self) -> None:
        """Wait until every delivery the brokers' matching implies has arrived."""
        deadline = time.monotonic() + self.settle_timeout
        while self.deliveries.count < self.expected:
            if time.monotonic() > deadline:
                self.errors.append(
                    f"{self.expected - self.deliveries.count} deliveries did not arrive"
                    f" within {self.settle_timeout} s"
                )
                self.expected = self.deliveries.count
                return
            await asyncio.sleep(_POLL_S)

    def on_message(self, client: str, sub_id: str, payload: bytes) -> None:
        sub = self.subs.get(sub_id)
        if sub is not None:
            self.deliveries.got(sub_id, sub, self.where[client], payload)


def _hub(fed: Federation) -> str:
    """The region whose site is nearest, summed over great circles, to every other."""
    sites: dict[str, LatLon] = {}
    for b in fed:
        if b.site is None:  # no site given: a point of its area
            point = b.area.geometry.representative_point()
            sites[b.id] = LatLon(point.y, point.x)
        else:
            sites[b.id] = b.site

    def total(a: str) -> float:
        return sum(float(great_circle_m(sites[a], s)) for b, s in sites.items() if b != a)

    return min(sorted(sites), key=total)


class MosquittoStar(_System):
    """Mosquitto per region, leaves bridged to the hub with ``topic # both 0``."""

    name = "mosquitto-star"

    async def start(self) -> None:
        import paho.mqtt.client as mqtt  # noqa: F401  (the bridge extra, fail early)

        ids = sorted(b.id for b in self.fed)
        self.hub = _hub(self.fed)
        sys_conf = ["sys_interval 1", "max_queued_messages 0"]
        self.brokers: dict[str, Mosquitto] = {self.hub: Mosquitto(extra=sys_conf)}
        self.brokers[self.hub].start()
        counting = tap(self.counts, mqtt_frame)
        for region in ids:
            if region == self.hub:
                continue
            proxy = self.proxies.add(
                f"{region}->{self.hub}", self.brokers[self.hub].address, counting
            )
            bridge = Mosquitto.bridge(region, self.hub, proxy.address, 0)
            self.brokers[region] = Mosquitto(extra=sys_conf + bridge).start()
        # Ready: every bridge's SUBSCRIBE to # answered (SUBACK crossed its link).
        links = len(ids) - 1
        await until(
            lambda: self.counts.snapshot()["interest"][0] >= 2 * links, "the bridges", _HANG_S
        )
        self.clients: dict[str, Any] = {}
        self.sys = await asyncio.to_thread(self._read_sys)

    def _read_sys(self) -> dict[str, int]:
        """``$SYS/broker/publish/messages/received`` per broker, as of a fresh tick.

        Mosquitto publishes its statistics every ``sys_interval`` (1 s here),
        a value only when it changed (the last one is retained): once a third
        ``uptime`` arrives, every value of the tick before it has arrived.
        """
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        readers = []
        for region, broker in self.brokers.items():
            seen = {"ticks": 0, "received": -1}
            done = threading.Event()
            c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"sys-{region}")

            def on_message(
                _c: Any, _u: Any, m: Any, seen: dict[str, int] = seen, done: Any = done
            ) -> None:
                if m.topic.endswith("/uptime"):
                    seen["ticks"] += 1
                    if seen["ticks"] >= 3 and seen["received"] >= 0:
                        done.set()
                else:
                    seen["received"] = int(m.payload)

            c.on_message = on_message
            c.connect(broker.host, broker.port)
            c.subscribe([("$SYS/broker/publish/messages/received", 0), ("$SYS/broker/uptime", 0)])
            c.loop_start()
            readers.append((region, c, seen, done))
        out: dict[str, int] = {}
        for region, c, seen, done in readers:
            ok = done.wait(_HANG_S)
            c.disconnect()
            c.loop_stop()
            if not ok:
                raise TimeoutError(f"mosquitto {region} published no $SYS statistics")
            out[region] = seen["received"]
        return out

    async def stop(self) -> None:
        for c in getattr(self, "clients", {}).values():
            c.disconnect()
            c.loop_stop()
        for b in getattr(self, "brokers", {}).values():
            b.stop()
        self.proxies.close()

    async def connect(self, client: str, region: str) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client)
        c.user_data_set({"subacks": 0})

        def on_message(_c: Any, _u: Any, m: Any) -> None:
            # One copy per client (overlapping subscriptions): attributed to each
            # of its subscriptions whose filter matches, as an MQTT app does.
            for sub_id, sub in list(self.subs.items()):
                if sub.client == client and reference_topic_match(sub.topic, m.topic):
                    self.on_message(client, sub_id, m.payload)

        def on_subscribe(_c: Any, u: dict[str, int], *_a: Any) -> None:
            u["subacks"] += 1

        c.on_message = on_message
        c.on_subscribe = on_subscribe
        c.on_unsubscribe = on_subscribe
        broker = self.brokers[region]
        c.connect(broker.host, broker.port)
        c.loop_start()
        self.clients[client] = c
        await until(c.is_connected, f"client {client}", _HANG_S)

    async def publish(self, op: TraceOp) -> None:
        self.clients[op.client].publish(op.topic, _payload(op), qos=0)
        self.published += 1

    async def _acked(self, client: str, call: Callable[[], Any]) -> None:
        c = self.clients[client]
        u = c.user_data_get()
        before = u["subacks"]
        call()
        await until(lambda: u["subacks"] > before, "SUBACK", _HANG_S)

    async def subscribe(self, sub_id: str, sub: _Sub) -> None:
        others = [s for i, s in self.subs.items() if i != sub_id and s.client == sub.client]
        if any(s.topic == sub.topic for s in others):
            return  # the client already holds this filter
        await self._acked(sub.client, lambda: self.clients[sub.client].subscribe(sub.topic, 0))

    async def unsubscribe(self, sub_id: str, sub: _Sub) -> None:
        if any(s.client == sub.client and s.topic == sub.topic for s in self.subs.values()):
            return
        await self._acked(sub.client, lambda: self.clients[sub.client].unsubscribe(sub.topic))

    def matches(self, op: TraceOp, sub: _Sub) -> int:
        return int(reference_topic_match(sub.topic, op.topic))

    def crossed(self) -> int:
        received = sum(self._read_sys().values()) - sum(self.sys.values())
        return received - self.published

    def broker_stats(self) -> dict[str, Any]:
        return {"$SYS publish received, minus client publishes": self.crossed()}


class NatsSuperCluster(_System):
    """nats-server per region, every pair joined by a gateway; plain or geo subjects."""

    name = "nats"

    def __init__(
        self,
        fed: Federation,
        workdir: Path,
        settle_timeout: float,
        geo: GeoEncoding | None = None,
        name: str = "nats",
    ) -> None:
        super().__init__(fed, workdir, settle_timeout)
        self.geo = geo
        self.name = name
        self.held: dict[str, Counter[tuple[str, ...]]] = {}  # region: subjects subscribed

    async def start(self) -> None:
        import nats  # noqa: F401  (fail early)

        from .local import free_ports

        ids = sorted(b.id for b in self.fed)
        gw_ports = dict(zip(ids, free_ports(len(ids)), strict=True))
        counting = tap(self.counts, nats_frame)
        # One proxy in front of each server's gateway port, advertised as its
        # gateway address: the URLs servers gossip lead through the proxies too.
        front = {
            r: self.proxies.add(f"->{r}", f"127.0.0.1:{gw_ports[r]}", counting).address for r in ids
        }
        self.proxy_ports = {int(a.rsplit(":", 1)[1]) for a in front.values()}
        self.servers: dict[str, NatsServer] = {}
        for region in ids:
            remotes = [f'{{name: "{o}", url: "nats://{front[o]}"}}' for o in ids if o != region]
            conf = [
                f'server_name: "{region}"',
                "no_system_account: true",
                f'gateway {{ name: "{region}", listen: "127.0.0.1:{gw_ports[region]}",'
                f' advertise: "{front[region]}", gateways: [{", ".join(remotes)}] }}',
            ]
            self.servers[region] = NatsServer(extra=conf, monitor=True)
            self.held[region] = Counter()
        for s in self.servers.values():
            s.start()
        await asyncio.to_thread(self._linked, ids)
        self.conns: dict[str, Any] = {}
        self.gw_out = await asyncio.to_thread(self._gateway_out)

    def _linked(self, ids: list[str]) -> None:
        deadline = time.monotonic() + _HANG_S
        for region, server in self.servers.items():
            while True:
                gz = server.monitor("gatewayz")
                out = gz.get("outbound_gateways") or {}
                inbound = gz.get("inbound_gateways") or {}
                if len(out) == len(ids) - 1 and len(inbound) == len(ids) - 1:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats {region}: gateways not all up: {sorted(out)}")
                time.sleep(0.1)
            for other, gw in out.items():
                if gw["connection"]["port"] not in self.proxy_ports:
                    raise RuntimeError(f"nats {region}->{other} bypasses its counting proxy")

    def _gateway_out(self) -> int:
        return sum(
            gw["connection"]["out_msgs"]
            for s in self.servers.values()
            for gw in (s.monitor("gatewayz").get("outbound_gateways") or {}).values()
        )

    async def stop(self) -> None:
        for nc in getattr(self, "conns", {}).values():
            with contextlib.suppress(Exception):
                await nc.close()
        for s in getattr(self, "servers", {}).values():
            s.stop()
        self.proxies.close()

    async def connect(self, client: str, region: str) -> None:
        import nats

        self.conns[client] = await nats.connect(
            f"nats://{self.servers[region].address}", pending_size=256 << 20, name=client
        )

    def _patterns(self, sub: _Sub) -> set[tuple[str, ...]]:
        if self.geo is None:
            return {tuple(_tokens(sub.topic.split("/"), "topic_filter"))}
        return self.geo.patterns(sub.cells, self.geo.ancestors(self.where[sub.client]), sub.topic)

    async def _add(self, sub_id: str, sub: _Sub, patterns: set[tuple[str, ...]]) -> None:
        nc = self.conns[sub.client]
        region = self.home[sub.client]

        async def cb(msg: Any) -> None:
            self.on_message(sub.client, sub_id, msg.data)

        for p in sorted(patterns):
            sub.handles[p] = await nc.subscribe(".".join(p), cb=cb, pending_msgs_limit=1 << 20)
            self.held[region][p] += 1
        sub.patterns |= patterns
        await nc.flush()

    async def _drop(self, sub: _Sub, patterns: set[tuple[str, ...]]) -> None:
        region = self.home[sub.client]
        for p in sorted(patterns):
            await sub.handles.pop(p).unsubscribe()
            self.held[region][p] -= 1
            if not self.held[region][p]:
                del self.held[region][p]
        sub.patterns -= patterns
        await self.conns[sub.client].flush()

    async def subscribe(self, sub_id: str, sub: _Sub) -> None:
        if self.geo is not None:
            sub.cells = self.geo.sub_cells(sub.fence)
        await self._add(sub_id, sub, self._patterns(sub))

    async def unsubscribe(self, sub_id: str, sub: _Sub) -> None:
        await self._drop(sub, set(sub.patterns))

    async def moved(self, client: str) -> None:
        if self.geo is None:
            return
        for sub_id, sub in self.subs.items():
            if sub.client != client:
                continue
            want = self._patterns(sub)
            if want != sub.patterns:
                await self._add(sub_id, sub, want - sub.patterns)
                await self._drop(sub, sub.patterns - want)
                self.interest_dirty = True

    async def interest_barrier(self) -> None:
        """Every server holds every other server's subject interest (``num_subs``)."""
        await asyncio.to_thread(self._interest_known)

    def _interest_known(self) -> None:
        deadline = time.monotonic() + _HANG_S
        for region, server in self.servers.items():
            while True:
                out = server.monitor("gatewayz?accs=1").get("outbound_gateways") or {}
                wrong = []
                for other, gw in out.items():
                    known = sum(
                        a.get("num_subs", 0) for a in gw.get("accounts", []) if a["name"] == "$G"
                    )
                    if known != len(self.held[other]):
                        wrong.append(other)
                if not wrong:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats {region} does not know the interest of {wrong}")
                time.sleep(_POLL_S)

    async def publish(self, op: TraceOp) -> None:
        nc = self.conns[op.client]
        payload = _payload(op)
        if self.geo is None:
            subjects = [tuple(_tokens(op.topic.split("/"), "topic"))]
        else:
            subjects = self.geo.subjects(op)
        for s in subjects:
            await nc.publish(".".join(s), payload)
        self.published += len(subjects)
        await nc.flush()

    def matches(self, op: TraceOp, sub: _Sub) -> int:
        if self.geo is None:
            return int(reference_topic_match(sub.topic, op.topic))
        return sum(1 for s in self.geo.subjects(op) for p in sub.patterns if subject_matches(p, s))

    def crossed(self) -> int:
        return self._gateway_out() - self.gw_out

    def broker_stats(self) -> dict[str, Any]:
        return {"/gatewayz messages out": self.crossed()}


def make_system(name: str, fed: Federation, workdir: Path, args: argparse.Namespace) -> _System:
    """The peer system called `name` (one of `PEERS`)."""
    if name == "mosquitto-star":
        return MosquittoStar(fed, workdir, args.settle_timeout)
    geo: GeoEncoding | None = None
    if name == "nats-geo-decimal":
        layout: DecimalLayout | H3Layout = DecimalLayout(prefix="g", decimals=args.decimals)
        geo = GeoEncoding(layout, args.coverage, args.sub_filters, args.event_filters)
    elif name == "nats-geo-h3":
        layout = H3Layout(prefix="g", resolution=args.h3_resolution)
        geo = GeoEncoding(layout, args.coverage, args.sub_filters, args.event_filters)
    elif name != "nats":
        raise InvalidInput("system", f"must be one of {', '.join(PEERS)}, got {name!r}")
    return NatsSuperCluster(fed, workdir, args.settle_timeout, geo, name)


async def run_peer(
    name: str, fed: Federation, ops: Sequence[TraceOp], workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """Replay `ops` through the peer system `name`; its measured row."""
    system = make_system(name, fed, workdir, args)
    t0 = time.monotonic()
    try:
        await system.start()
        started = time.monotonic() - t0
        before = system.counts.snapshot()
        t1 = time.monotonic()
        await system.replay(ops)
        await system.links_quiet(before["data"][0])
        replay_s = time.monotonic() - t1
        after = system.counts.snapshot()
        stats = await asyncio.to_thread(system.broker_stats)
        subjects = sum(len(h) for h in getattr(system, "held", {}).values())
    finally:
        await system.stop()
    links = {c: (after[c][0] - before[c][0], after[c][1] - before[c][1]) for c in after}
    return {
        "system": name,
        "data": {"messages": links["data"][0], "bytes": links["data"][1]},
        "interest": {"messages": links["interest"][0], "bytes": links["interest"][1]},
        "other": {"messages": links["other"][0], "bytes": links["other"][1]},
        "broker_stats": stats,
        "client_publishes": system.published,
        "subjects_at_end": subjects,
        "before_check": rep.accuracy(system.deliveries.raw, []),
        "_raw": system.deliveries.raw,
        "_checked": system.deliveries.checked,
        "errors": system.errors,
        "seconds": {"start": round(started, 1), "replay": round(replay_s, 1)},
    }


# ---------------------------------------------------------------------------
# geofed: the bench pipeline's own rows


def run_geofed(
    federation: str, workload: Path, workdir: Path, strategies: Sequence[str]
) -> dict[str, Any]:
    """``geofed bench --barrier --wan off`` on the same trace; its report.json."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "report"
    cmd = [sys.executable, "-m", "geofed.cli", "bench", "--federation", federation]
    cmd += ["--workload", str(workload), "--barrier", "--wan", "off", "--no-analysis"]
    cmd += ["--no-plots", "--out", str(out), "--workdir", str(workdir / "work"), "--force"]
    for s in strategies:
        cmd += ["--strategy", s]
    report_file = out / "report.json"
    for attempt in range(1, _START_ATTEMPTS + 1):
        log_file = workdir / f"geofed-bench-{attempt}.log"
        report_file.unlink(missing_ok=True)  # an earlier run's would be taken for this one's
        with log_file.open("w", encoding="utf-8") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
        if report_file.is_file():
            break
        # No report: the federation did not start (on a shared machine, mostly a
        # port picked free and taken by another process before a node bound it).
        print(f"[peers] geofed bench exited with {rc} ({log_file})", file=sys.stderr, flush=True)
    else:
        raise RuntimeError(f"geofed bench exited with {rc}: see {log_file}")
    report: dict[str, Any] = json.loads(report_file.read_text(encoding="utf-8"))
    report["exit_status"] = rc
    return report


def geofed_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """geofed's strategies as rows of the peers' table."""
    rows = []
    for s in report["strategies"]:
        m, b = s["messages"], s["bytes"]
        data = ("event", "delivery")
        interest = ("subscribe", "unsubscribe", "relocate")
        d = s["deliveries"]
        rows.append(
            {
                "system": f"geofed {s['strategy']}",
                "data": {
                    "messages": sum(m.get(k, 0) for k in data),
                    "bytes": sum(b.get(k, 0) for k in data),
                },
                "interest": {
                    "messages": sum(m.get(k, 0) for k in interest),
                    "bytes": sum(b.get(k, 0) for k in interest),
                },
                "other": dict(s.get("control", {})),
                "before_check": d,
                "after_check": d,
                "errors": s["replay"].get("error_samples", []),
            }
        )
    return rows


# ---------------------------------------------------------------------------
# The report


def _fmt(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def scenario_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| system | inter-region data msgs | data bytes | interest msgs | interest bytes"
        " | other link msgs | broker statistics | deliveries before check | after check"
        " | over-delivery | recall | precision |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        before = r["before_check"]["received"]
        a = r["after_check"]
        stats = "; ".join(f"{k}: {_fmt(v)}" for k, v in r.get("broker_stats", {}).items()) or "—"
        over = before - a["received"]
        lines.append(
            f"| {r['system']} | {_fmt(r['data']['messages'])} | {_fmt(r['data']['bytes'])}"
            f" | {_fmt(r['interest']['messages'])} | {_fmt(r['interest']['bytes'])}"
            f" | {_fmt(r['other'].get('messages', 0))} | {stats} | {before:,}"
            f" | {a['received']:,} | {over:,} ({over / max(before, 1):.0%})"
            f" | {a['recall']:.4f} | {a['precision']:.4f} |"
        )
    return "\n".join(lines)


def markdown(result: dict[str, Any]) -> str:
    parts = []
    for sc in result["scenarios"]:
        w = sc["workload"]
        parts.append(
            f"### {sc['scenario']}\n\nWorkload: {w['ops']:,} ops, {w['events']:,} events,"
            f" {w['subscriptions']:,} subscriptions, {w['clients']} clients"
            f" ({sc['workload_command']}); oracle: {sc['expected']:,} deliveries."
            f" Hub of the Mosquitto star: {sc.get('hub', '—')}.\n\n" + scenario_table(sc["rows"])
        )
        errs = [f"- {r['system']}: {e}" for r in sc["rows"] for e in r.get("errors", [])[:5]]
        if errs:
            parts.append("Errors:\n\n" + "\n".join(errs))
    single = result.get("single_node")
    if single is not None:
        parts.append(
            "### Single node: one geofed node, one mosquitto, one nats-server\n\n"
            "`geofed.bench.brokers_bench` in this run (topic-only traffic, and geofenced"
            " traffic where the peers carry geo-encoded topics and check each delivery"
            " themselves).\n\n" + single["table"]
        )
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------
# Command line


def _workload(args: argparse.Namespace, scenario: str, path: Path) -> tuple[list[TraceOp], str]:
    cfg = WorkloadConfig(
        scenario=scenario, clients=args.clients, duration_s=args.duration, seed=args.seed
    )
    write_trace(generate(cfg), path)
    cmd = (
        f"geofed workload {scenario} --clients {args.clients} --duration {args.duration:g}"
        f" --seed {args.seed}"
    )
    return list(read_trace_file(str(path))), cmd


def run_scenario(
    scenario: str, fed: Federation, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    trace = workdir / "workload.jsonl"
    if args.workload:
        ops = list(read_trace_file(args.workload))
        write_trace(ops, trace)
        wcmd = f"--workload {args.workload}"
    else:
        ops, wcmd = _workload(args, scenario, trace)
    expected = reference_deliveries(ops)
    kinds = Counter(op.op for op in ops)
    info = {
        "ops": len(ops),
        "events": kinds["publish"],
        "subscriptions": kinds["subscribe"],
        "clients": len({op.client for op in ops}),
    }
    print(f"[peers] {scenario}: {info}, {len(expected):,} expected", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    if args.geofed:
        report = run_geofed(
            args.federation, trace, workdir / "geofed", args.strategy or list(STRATEGIES)
        )
        rows += geofed_rows(report)
        print(f"[peers] {scenario}: geofed done", file=sys.stderr, flush=True)
    for name in args.system or PEERS:
        t0 = time.monotonic()
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                row = asyncio.run(run_peer(name, fed, ops, workdir / name, args))
                break
            except BrokerUnavailable as exc:
                # A port picked free was taken before the broker bound it (other
                # processes on the machine): a fresh set of servers and ports.
                if attempt == _START_ATTEMPTS:
                    raise RuntimeError(f"{name} ({scenario}): {exc}") from exc
                print(f"[peers] {name}: {exc}; starting afresh", file=sys.stderr, flush=True)
            except Exception as exc:
                raise RuntimeError(f"{name} ({scenario}): {type(exc).__name__}: {exc}") from exc
        row["after_check"] = rep.accuracy(row.pop("_checked"), expected)
        row["before_check"] = rep.accuracy(row.pop("_raw"), expected)
        rows.append(row)
        print(
            f"[peers] {scenario}: {name} in {time.monotonic() - t0:.0f}s:"
            f" {row['data']['messages']:,} data msgs, recall {row['after_check']['recall']:.4f}"
            f" precision {row['after_check']['precision']:.4f}",
            file=sys.stderr,
            flush=True,
        )
    return {
        "scenario": scenario,
        "workload": info,
        "workload_command": wcmd,
        "expected": len(expected),
        "hub": _hub(fed),
        "rows": rows,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m geofed.bench.peers",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--federation", default="aws-2020", help="file or bundled name")
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="repeatable (default: context, global)",
    )
    p.add_argument("--workload", help="a trace file instead of generating (one scenario)")
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--system", action="append", choices=PEERS, help="repeatable (default: all)")
    p.add_argument("--strategy", action="append", choices=list(STRATEGIES), help="geofed's")
    p.add_argument(
        "--geofed", action=argparse.BooleanOptionalAction, default=True, help="geofed's rows"
    )
    p.add_argument("--decimals", type=int, default=2, help="decimal layout: digits after the point")
    p.add_argument("--h3-resolution", type=int, default=6, help="H3 layout: finest resolution")
    p.add_argument("--coverage", type=float, default=0.8, help="covers' target coverage ratio")
    p.add_argument("--sub-filters", type=int, default=8, help="filters per subscription cover")
    p.add_argument("--event-filters", type=int, default=4, help="cells per event cover")
    p.add_argument(
        "--settle-timeout", type=float, default=60.0, help="seconds to wait for a delivery"
    )
    p.add_argument(
        "--part",
        action="append",
        choices=("scenarios", "single-node"),
        help="what to run (repeatable; default: both)",
    )
    n = p.add_argument_group("single node (geofed.bench.brokers_bench)")
    brokers_bench.add_arguments(
        n, "node-", events=5000, repeat=1, seconds=3.0, traffic="topic and geo"
    )
    p.add_argument("--workdir", type=Path, help="logs and traces (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument("--results", type=Path, default=RESULTS, help="Markdown file appended to")
    p.add_argument("--no-record", action="store_true", help="do not append to --results")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run it; bad input is one line naming the option (exit status 2)."""
    try:
        return _main(argv)
    except InvalidInput as exc:
        print(f"python -m geofed.bench.peers: error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("clients", "duration", "node_events", "node_repeat", "node_rate", "node_seconds"):
        if getattr(args, name) <= 0:
            raise InvalidInput(name, f"must be positive, got {getattr(args, name)!r}")
    parts = set(args.part or ("scenarios", "single-node"))
    scenarios = list(dict.fromkeys(args.scenario or ("context", "global")))
    if "scenarios" not in parts:
        scenarios = []
    if args.workload and len(scenarios) > 1:
        raise InvalidInput("workload", "one trace file is one scenario: give one --scenario")
    fed = Federation.load(federation_path(args.federation))
    load = os.getloadavg()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            args.workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="peers-")))
        results = [run_scenario(s, fed, args, args.workdir / s) for s in scenarios]
    single: dict[str, Any] | None = None
    if "single-node" in parts:
        node_args = argparse.Namespace(
            events=args.node_events,
            repeat=args.node_repeat,
            rate=args.node_rate,
            seconds=args.node_seconds,
            traffic=args.node_traffic or list(brokers_bench.TRAFFIC),
        )
        reps, summary, table = brokers_bench.run(node_args)
        single = {"repetitions": reps, **summary, "table": table}
    result = {
        "federation": args.federation,
        "regions": len(fed),
        "machine": describe(),
        "load_before": load,
        "load_after": os.getloadavg(),
        "scenarios": results,
        "single_node": single,
    }
    text = markdown(result)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1), encoding="utf-8")
    if not args.no_record:
        record(
            args.results,
            "geofed.bench.peers",
            argv,
            f"Federation {args.federation} ({len(fed)} regions); load before"
            f" {load[0]:.2f}, after {result['load_after'][0]:.2f}\n\n{text}",
            title=_TITLE,
        )
    return 0


_TITLE = """# geofed beside Mosquitto and NATS federations (bench/peers)

The same workload trace through geofed's four strategies and through the
federations an operator would build from topic-only brokers, one Debian
broker per region on loopback, clients on their region's broker:

* **mosquitto-star**: the leaves bridged to a hub region (`topic # both 0`):
  Mosquitto bridges carry no subscription interest, so `#` is the one
  pattern that serves subscriptions made later without per-region
  configuration (and a mesh of `both` bridges would loop);
* **nats**: a super-cluster, every pair of nats-servers joined by a gateway,
  interest-only mode (a server forwards a subject only to servers that
  announced interest in it), plain subjects;
* **nats-geo-decimal / nats-geo-h3**: the same with the publisher's location
  and the event geofence's cover cells in the subject and subscriptions on
  the covers of their geofences (`geofed.cover`), plus the consumers' exact
  check.

Inter-region messages and bytes are counted on the wire of every bridge /
gateway connection (and checked against Mosquitto's `$SYS` and NATS's
`/gatewayz`); "interest" is subscription traffic between servers (geofed:
subscribe, unsubscribe and relocate messages; MQTT SUBSCRIBE/UNSUBSCRIBE and
acks; NATS RS+/RS-/A+/A-); "other" is what keeps links alive (it grows with
the run's length, not the workload). Deliveries are counted before and after
the consumers' exact check (geofed delivers exactly: no check); recall and
precision are those after the check, against the central matcher. geofed's
rows are its own `geofed bench --barrier --wan off` run of the same trace.
Details: `bench/peers.py`, docs/design.md §12.
"""


if __name__ == "__main__":
    sys.exit(main())
