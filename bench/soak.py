"""Soak: a durable federation under steady cross-region load, memory sampled over time.

``python -m geofed.bench.soak --minutes 30`` starts a durable three-broker
`LocalFederation` (``workdir/<id>/data``) and keeps it busy:

* one publisher per region, together `--rate` events/s at a steady pace,
  each event's geofence rotating through the world and boxes around each
  broker's site (`geofed.bench.faults.box`), payloads of `--payload-bytes`;
* per region a plain subscriber to everything and a persistent one
  (`geofed.bench.faults.client_config`) to the events published near the
  next region's site; both must receive every matching acknowledged event;
* a little session churn: every `--churn-every` acknowledged events one
  region's persistent subscriber closes and reconnects (what was published
  meanwhile waits in its broker's store), and that region's churn client
  (a plain session) connects and subscribes, or closes, in turn.

Every few seconds (`--sample-s`) it reads each node process's resident memory
(VmRSS in ``/proc/<pid>/status``) and the memory SQLite holds in it
(``geofed_sqlite_memory_bytes``: the store's and the history's page caches,
which fill up to their bounds as the files grow). At the end publishing stops, one marker
event per publisher settles the run (each link and stream is ordered: once
the markers arrived, everything before them did), and the history checker
(`geofed.bench.history`) holds every acknowledged event against the oracle.
The report (``bench/results/soak.md``) gives the command, the machine, the
duration, events, deliveries, lost / duplicated / unexpected, the nodes'
counters and RSS at start, end and peak with its slope; the plot of RSS over
time goes next to it (``soak-rss.png``, matplotlib from the ``analysis``
extra). ``--events N`` bounds a run by acknowledged events instead of time
(the smoke test's tiny run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from geofed.client import Client, ClientConfig, Message, Subscription, connect
from geofed.node import (
    DELIVERIES,
    EVENTS_PUBLISHED,
    PEER_QUEUE_DROPPED,
    PEER_QUEUE_LENGTH,
    SESSION_QUEUE_DROPPED,
    SESSIONS,
    SESSIONS_EXPIRED,
    SQLITE_MEMORY,
    SUBSCRIBER_QUEUE_DROPPED,
)
from geofed.routing import GeofedError, LatLon

from ._extras import require
from ._machine import describe
from .faults import box, client_config, until
from .history import History, Report
from .local import LocalFederation
from .scrape import scrape_all

REGIONS = ("eu", "us", "ap")
"""The brokers of the bundled ``three`` federation, each with a publisher and subscribers."""
SOAK_ENV = {"GEOFED_SESSION_IDLE_S": "60"}
"""Node settings of a soak: the churn's plain sessions are reaped within the run."""
COUNTERS = (
    EVENTS_PUBLISHED,
    DELIVERIES,
    SUBSCRIBER_QUEUE_DROPPED,
    SESSION_QUEUE_DROPPED,
    PEER_QUEUE_DROPPED,
    SESSIONS_EXPIRED,
    SESSIONS,
)
"""Node metrics the report lists, scraped once the run settled."""


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` in MiB (VmRSS of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise GeofedError(f"no VmRSS for process {pid} (a zombie?)")


def slope_mib_per_h(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per hour (0 with < 2 samples)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if not var:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var * 3600


@dataclass
class SoakResult:
    """One soak run: what was asked, how long it took, the verdict and the memory samples."""

    command: str
    duration_s: float
    rate: float
    payload_bytes: int
    churns: int
    report: Report
    rss: dict[str, list[tuple[float, float]]]
    """Per broker: (seconds since the load started, RSS MiB)."""
    sqlite: dict[str, list[tuple[float, float]]]
    """Per broker: (seconds since the load started, MiB SQLite holds), when the node tells."""
    counters: dict[str, dict[str, float]]
    """Per broker: the `COUNTERS` at the end."""
    load: tuple[tuple[float, float, float], tuple[float, float, float]]
    """The machine's load averages (1, 5, 15 min) at start and end."""
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing lost, duplicated or unexpected, no workload error."""
        return self.report.ok and not self.errors


class _Load:
    """The soak's clients, their readers and the churn, all recording into `history`."""

    def __init__(
        self, fed: LocalFederation, history: History, rate: float, payload_bytes: int
    ) -> None:
        self.fed = fed
        self.history = history
        self.interval_s = len(REGIONS) / rate  # per publisher
        self.payload_bytes = payload_bytes
        self.sites = {b: self._site(b) for b in REGIONS}
        self.fences = [None, *(box(s) for s in self.sites.values())]
        self.errors: list[str] = []
        self.churns = 0
        self.markers: set[tuple[str, str]] = set()  # (event id, subscription id) received
        self._publishers: dict[str, Client] = {}
        self._readers: dict[str, tuple[Client, asyncio.Task[None]]] = {}  # by client id
        self._publishing: list[asyncio.Task[None]] = []

    def _site(self, broker: str) -> LatLon:
        site = self.fed.federation.broker(broker).site
        assert site is not None, f"broker {broker} has no site"
        return site

    def _plain(self, client_id: str, broker: str) -> ClientConfig:
        """A workload client like the persistent ones, in a plain session."""
        return replace(client_config(client_id, self.sites[broker], self.fed), session_expiry_s=0)

    async def _subscribe(
        self, config: ClientConfig, topic_filter: str, fence: str | None, *, required: bool
    ) -> None:
        cid = config.client_id
        sub_id = f"{cid}-s"
        if sub_id not in self.history.subscriptions:
            self.history.subscribed(
                sub_id, cid, topic_filter, fence, config.location, required=required
            )
        client = await connect(config)
        sub = await client.subscribe(topic_filter, geofence=fence, subscription_id=sub_id)
        self._readers[cid] = (client, asyncio.create_task(self._read(cid, sub)))

    async def _read(self, client_id: str, sub: Subscription) -> None:
        try:
            async for msg in sub:
                self._take(client_id, msg)
        except GeofedError as exc:
            self.errors.append(f"subscription {sub.id} lost: {type(exc).__name__}: {exc}")

    def _take(self, client_id: str, msg: Message) -> None:
        self.history.received(client_id, msg)
        if msg.event_id.startswith("marker-"):
            self.markers.add((msg.event_id, msg.subscription_id))

    async def _close(self, client_id: str) -> None:
        """Stop taking deliveries first (so all it took gets acknowledged), then close."""
        client, task = self._readers.pop(client_id)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.close()

    async def start(self) -> None:
        """Subscribe everyone, wait until the subscriptions are in place, connect publishers."""
        for i, b in enumerate(REGIONS):
            nxt = REGIONS[(i + 1) % len(REGIONS)]
            await self._subscribe(self._plain(f"plain-{b}", b), "s/#", None, required=True)
            await self._subscribe(
                client_config(f"pers-{b}", self.sites[b], self.fed),
                "s/+",
                box(self.sites[nxt]),
                required=True,
            )
        # Nothing restarted yet: the barrier's counts hold, and forwarded subscriptions
        # (subscription-forwarding strategies) are in place once it passes.
        await self.fed.quiescent(60.0)
        for b in REGIONS:
            self._publishers[b] = await connect(self._plain(f"pub-{b}", b))

    def publish_steadily(self) -> None:
        """Start every publisher at its steady pace."""
        for b in REGIONS:
            self._publishing.append(asyncio.create_task(self._publish_forever(b)))

    async def publish(self, broker: str, event_id: str, fence: str | None) -> bool:
        """One publish (the client retries it with its id); True once acknowledged."""
        topic = f"s/{broker}"
        payload = f"{event_id} ".encode().ljust(self.payload_bytes, b".")
        self.history.attempt(event_id, topic, self.sites[broker], fence, payload, broker)
        try:
            await self._publishers[broker].publish(
                topic, payload, geofence=fence, event_id=event_id
            )
        except GeofedError as exc:
            self.history.failed(event_id, f"{type(exc).__name__}: {exc}")
            return False
        self.history.acknowledged(event_id, time.time())
        return True

    async def _publish_forever(self, broker: str) -> None:
        start = time.monotonic()
        n = 0
        while True:
            await self.publish(broker, f"{broker}-{n}", self.fences[n % len(self.fences)])
            n += 1
            wait = start + n * self.interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)

    async def churn(self) -> None:
        """One churn step: a persistent subscriber reconnects; a churn client comes or goes."""
        b = REGIONS[self.churns % len(REGIONS)]
        self.churns += 1
        await self._close(f"pers-{b}")
        nxt = REGIONS[(REGIONS.index(b) + 1) % len(REGIONS)]
        await self._subscribe(
            client_config(f"pers-{b}", self.sites[b], self.fed),
            "s/+",
            box(self.sites[nxt]),
            required=True,
        )
        churn = f"churn-{b}"
        if churn in self._readers:
            await self._close(churn)
        else:  # not required: it misses what is published while it is away
            await self._subscribe(self._plain(churn, b), "s/#", None, required=False)

    async def stop_publishing(self) -> None:
        """Stop the steady load (a publish in flight is cancelled: unacknowledged)."""
        tasks, self._publishing = self._publishing, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def settle(self, wait_s: float) -> None:
        """Once publishing stopped: wait until every delivery still owed has arrived.

        One marker event per publisher (world-wide: every subscription near its
        site matches it); each link and stream is ordered, so once every marker
        reached every subscription it matches, what was published before it has
        arrived too. Then no peer queue holds anything.
        """
        for b in REGIONS:
            if f"churn-{b}" in self._readers:
                await self._close(f"churn-{b}")
        deadline = time.monotonic() + wait_s
        for b in REGIONS:
            while not await self.publish(b, f"marker-{b}", None):
                if time.monotonic() > deadline:
                    raise GeofedError(f"no marker event acknowledged at {b} within {wait_s:g}s")
        owed = History()
        owed.subscriptions = {k: s for k, s in self.history.subscriptions.items() if s.required}
        owed.events = {f"marker-{b}": self.history.events[f"marker-{b}"] for b in REGIONS}
        pairs = owed.expected()
        await until(lambda: pairs <= self.markers, f"the markers arrive: {pairs}", wait_s)
        urls = self.fed.metrics_urls()

        def queues_empty() -> bool:
            return not sum(
                v
                for samples in scrape_all(urls).values()
                for (name, _), v in samples.items()
                if name == PEER_QUEUE_LENGTH
            )

        await until(queues_empty, "every peer queue is empty", wait_s, scrapes=True)

    async def close(self) -> None:
        """Stop publishing and close every client."""
        await self.stop_publishing()
        for cid in list(self._readers):
            await self._close(cid)
        for client in self._publishers.values():
            await client.close()


_Series = dict[str, list[tuple[float, float]]]


async def _sample_forever(
    fed: LocalFederation, t0: float, period_s: float, rss: _Series, sqlite: _Series
) -> None:
    while True:
        await _sample(fed, t0, rss, sqlite)
        await asyncio.sleep(period_s)


async def _sample(fed: LocalFederation, t0: float, rss: _Series, sqlite: _Series) -> None:
    now = time.monotonic() - t0
    for b, node in fed.nodes.items():
        rss.setdefault(b, []).append((now, rss_mib(node.process.pid)))
    scraped = await asyncio.to_thread(scrape_all, fed.metrics_urls())
    for b, samples in scraped.items():
        if (SQLITE_MEMORY, ()) in samples:
            sqlite.setdefault(b, []).append((now, samples[SQLITE_MEMORY, ()] / 2**20))


async def run_soak(
    *,
    minutes: float | None = None,
    events: int | None = None,
    rate: float = 30.0,
    payload_bytes: int = 1024,
    churn_every: int = 300,
    sample_s: float = 5.0,
    strategy: str = "event-geofence",
    federation: str | Path = "three",
    workdir: str | Path | None = None,
    wait_s: float = 120.0,
    command: str = "",
    node_env: dict[str, str] | None = None,
) -> SoakResult:
    """Run a soak until `minutes` passed or `events` were acknowledged (whichever first).

    Raises:
        GeofedError: when the federation or the load gets stuck (a wait exceeded `wait_s`).
    """
    if minutes is None and events is None:
        raise GeofedError("give minutes or events (or both)")
    env = SOAK_ENV | (node_env or {})
    fed = LocalFederation(federation, strategy, workdir, extra_env=env, durable=True)
    await asyncio.to_thread(fed.start, wait_s)
    history = History()
    load = _Load(fed, history, rate, payload_bytes)
    rss: _Series = {}
    sqlite: _Series = {}
    load_start = os.getloadavg()
    sampler: asyncio.Task[None] | None = None
    try:
        await load.start()
        t0 = time.monotonic()
        sampler = asyncio.create_task(_sample_forever(fed, t0, sample_s, rss, sqlite))
        load.publish_steadily()
        end = t0 + minutes * 60 if minutes is not None else None
        next_churn = churn_every
        while (end is None or time.monotonic() < end) and (events is None or history.acks < events):
            if history.acks >= next_churn:
                next_churn += churn_every
                await load.churn()
            await asyncio.sleep(0.05)
        await load.stop_publishing()
        while history.acks >= next_churn:  # the steps owed (a slow machine lags behind)
            next_churn += churn_every
            await load.churn()
        await load.settle(wait_s)
        sampler.cancel()
        await _sample(fed, t0, rss, sqlite)
        duration = time.monotonic() - t0
        urls = fed.metrics_urls()
        scraped = await asyncio.to_thread(scrape_all, urls)
        counters = {
            b: {name: sum(v for (n, _), v in s.items() if n == name) for name in COUNTERS}
            for b, s in scraped.items()
        }
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        await load.close()
        await asyncio.to_thread(fed.stop)
    return SoakResult(
        command,
        duration,
        rate,
        payload_bytes,
        load.churns,
        history.check(),
        rss,
        sqlite,
        counters,
        (load_start, os.getloadavg()),
        load.errors,
    )


def plot(result: SoakResult, path: Path) -> None:
    """RSS of every node over the run, one line each (PNG)."""
    require("analysis", "the soak's RSS plot", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for b, samples in sorted(result.rss.items()):
        ax.plot([t / 60 for t, _ in samples], [v for _, v in samples], label=b)
    ax.set_xlabel("minutes since the load started")
    ax.set_ylabel("RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"geofed soak: durable 3-broker federation, {result.rate:g} events/s,"
        f" {result.payload_bytes} B payloads"
    )
    ax.legend(title="broker")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(result: SoakResult, plot_name: str) -> str:
    """The results file: command, machine, load, verdict, counters and memory per node."""
    c = result.report.counts()
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    (l1, l5, _), (e1, e5, _) = result.load
    status = "ok" if result.ok else "**FAILED**"
    lines = [
        "# Soak: a durable federation at steady load",
        "",
        f"## {now}",
        "",
        f"Command: `{result.command}`  ",
        f"Machine: {describe()}  ",
        f"Load average (1 / 5 min): {l1:.2f} / {l5:.2f} at the start, {e1:.2f} / {e5:.2f}"
        " at the end",
        "",
        "Durable three-broker `LocalFederation` (event store in each broker's data"
        " directory, `store_sync=normal`); one publisher per region, together"
        f" {result.rate:g} events/s with {result.payload_bytes}-byte payloads; per region a"
        " plain subscriber to every event and a persistent one to the events near the next"
        f" region; {result.churns} churn steps (a persistent subscriber closes and"
        " reconnects, a plain churn client comes or goes).",
        "",
        "| duration | events acknowledged | deliveries received | required delivered"
        " | lost | duplicated | unexpected | status |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {result.duration_s / 60:.1f} min | {c['acknowledged']:,} of {c['published']:,}"
        f" | {c['received']:,} | {c['delivered']:,} of {c['required']:,} | {c['lost']:,}"
        f" | {c['duplicated']:,} | {c['unexpected']:,} | {status} |",
        "",
        "Resident memory of each node process (VmRSS), sampled every few seconds; slope by"
        " least squares over the whole run and over its second half (after warm-up); the"
        " memory SQLite holds in the process (`geofed_sqlite_memory_bytes`, its page caches)"
        " at the start and the end:",
        "",
        "| broker | samples | RSS start MiB | RSS end MiB | RSS max MiB | slope MiB/h"
        " | slope, 2nd half MiB/h | SQLite start → end MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b, samples in sorted(result.rss.items()):
        values = [v for _, v in samples]
        half = [s for s in samples if s[0] >= result.duration_s / 2]
        held = result.sqlite.get(b)
        sqlite = f"{held[0][1]:.2f} → {held[-1][1]:.2f}" if held else "n/a"
        lines.append(
            f"| {b} | {len(samples)} | {values[0]:.1f} | {values[-1]:.1f} | {max(values):.1f}"
            f" | {slope_mib_per_h(samples):+.1f} | {slope_mib_per_h(half):+.1f} | {sqlite} |"
        )
    lines += [
        "",
        f"![RSS over time]({plot_name})",
        "",
        "Node counters at the end:",
        "",
        "| broker | " + " | ".join(f"`{n}`" for n in COUNTERS) + " |",
        "|---|" + "---:|" * len(COUNTERS),
    ]
    for b, counts in sorted(result.counters.items()):
        lines.append(f"| {b} | " + " | ".join(f"{counts[n]:,.0f}" for n in COUNTERS) + " |")
    if not result.ok:
        lines += ["", "### Failures", "", "```", str(result.report)]
        lines += [f"error: {e}" for e in result.errors] + ["```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m geofed.bench.soak``: a soak run, to a results file and an RSS plot."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, help="length of the load (default: until --events)")
    p.add_argument("--events", type=int, help="stop after this many acknowledged events")
    p.add_argument("--rate", type=float, default=30.0, help="events/s over all publishers")
    p.add_argument("--payload-bytes", type=int, default=1024, help="bytes per event payload")
    p.add_argument(
        "--churn-every", type=int, default=300, help="acknowledged events between churn steps"
    )
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--strategy", default="event-geofence", help="routing strategy")
    p.add_argument(
        "--dedup-window",
        type=int,
        help="the nodes' dedup_window (default 100,000 ids per window; each window's"
        " memory is allocated when the node starts)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/soak.md"))
    p.add_argument("--workdir", type=Path, help="node logs and data (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.minutes is None and args.events is None:
        p.error("give --minutes or --events (or both)")
    if not args.rate > 0 or args.churn_every < 1 or not args.sample_s > 0:
        p.error("--rate and --sample-s must be > 0, --churn-every >= 1")
    if args.payload_bytes < 64:
        p.error("--payload-bytes must be >= 64 (the payload starts with the event id)")
    command = "python -m geofed.bench.soak " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="geofed-soak-") as tmp:
        result = asyncio.run(
            run_soak(
                minutes=args.minutes,
                events=args.events,
                rate=args.rate,
                payload_bytes=args.payload_bytes,
                churn_every=args.churn_every,
                sample_s=args.sample_s,
                strategy=args.strategy,
                workdir=args.workdir or Path(tmp),
                command=command.strip(),
                node_env=(
                    {"GEOFED_DEDUP_WINDOW": str(args.dedup_window)} if args.dedup_window else None
                ),
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_name(args.out.stem + "-rss.png")
    plot(result, png)
    args.out.write_text(markdown(result, png.name), encoding="utf-8")
    print(result.report)
    for e in result.errors:
        print(f"error: {e}")
    print(f"written to {args.out} and {png}")
    return 0 if result.ok else 1


__all__ = [
    "COUNTERS",
    "REGIONS",
    "SOAK_ENV",
    "SoakResult",
    "main",
    "markdown",
    "plot",
    "rss_mib",
    "run_soak",
    "slope_mib_per_h",
]


if __name__ == "__main__":
    sys.exit(main())
