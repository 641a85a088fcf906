"""Fault injection under steady cross-region load, checked against the oracle.

One run starts a `LocalFederation` (durable data directories, a fault proxy
on every peer link), a `Workload` on it that records everything into a
`History`, and performs fault *cycles*: load, fault, load during the fault,
heal, wait until the federation is healthy again, load. Then publishing
stops, the run settles and `History.check` gives the verdict::

    result = await run_faults("event-geofence", "partition", cycles=2)
    assert result.report.ok, result

Faults (`FAULTS`), by the role of the broker they hit (`Roles`: publisher
``eu``, subscriber ``us``, third ``ap`` in the bundled ``three``):

* ``kill-publisher``, ``kill-subscriber``, ``kill-third``: SIGKILL, then a
  restart on the same ports and data directory;
* ``pause``: SIGSTOP of the subscriber's broker until the publisher's broker
  has timed its link out, then SIGCONT;
* ``partition``: the link publisher–subscriber cut until both sides see it down;
* ``flap``: that link cut and restored repeatedly, two flaps a cycle.

Every wait is on state (health, metrics, counts of the history), bounded by
`wait_s` only as a safety net. ``python -m geofed.bench.faults`` runs many
cycles per strategy and fault and writes ``bench/results/faults.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from geofed.client import Client, ClientConfig, RetryConfig, Subscription, connect
from geofed.node import PEER_CONNECTED, PEER_QUEUE_LENGTH, SUBSCRIPTIONS
from geofed.routing import STRATEGIES, GeofedError, LatLon, parse_geofence, strategy_for

from ._machine import describe
from .history import History, Report
from .local import LocalFederation
from .scrape import metric, scrape_all

FAULTS = ("kill-publisher", "kill-subscriber", "kill-third", "pause", "partition", "flap")
"""The faults a run can inject (see the module docs)."""
FAULT_ENV = {"GEOFED_PEER_HEARTBEAT_S": "0.2", "GEOFED_PEER_TIMEOUT_S": "1.5"}
"""Node settings of a fault run: a frozen peer is noticed within 1.5 s, not 20."""
SESSION_EXPIRY_S = 300.0
"""Session expiry the workload's clients ask for: persistent sessions."""
_RETRY = RetryConfig(attempts=60, initial_backoff_s=0.05, max_backoff_s=0.5)  # outlasts a restart
_BOX_HALF_DEG = 5.0


@dataclass(frozen=True)
class Roles:
    """Which broker plays which part: publishers live at `publisher`, subscribers at
    `subscriber` and `publisher` (a local path), nobody at `third`."""

    publisher: str = "eu"
    subscriber: str = "us"
    third: str = "ap"


@dataclass
class FaultResult:
    """One run: which strategy and fault, how many cycles, and the history's verdict."""

    strategy: str
    fault: str
    cycles: int
    report: Report
    restarts: int = 0
    errors: list[str] = field(default_factory=list)
    """Subscriptions lost for good, or other trouble the workload met (for the record)."""

    @property
    def ok(self) -> bool:
        """Nothing lost, duplicated or unexpected, and no workload error."""
        return self.report.ok and not self.errors

    def __str__(self) -> str:
        head = f"{self.strategy} / {self.fault}: {self.cycles} cycles, {self.restarts} restarts"
        return "\n".join([head, str(self.report), *(f"  error: {e}" for e in self.errors)])


def box(where: LatLon, half_deg: float = _BOX_HALF_DEG) -> str:
    """WKT of a square of ±`half_deg` degrees around `where` (a geofence for the workload)."""
    w, e = where.lon - half_deg, where.lon + half_deg
    s, n = where.lat - half_deg, where.lat + half_deg
    return f"POLYGON(({w} {s}, {e} {s}, {e} {n}, {w} {n}, {w} {s}))"


def client_config(client_id: str, where: LatLon, fed: LocalFederation) -> ClientConfig:
    """A workload client: a persistent session, retries that outlast a broker restart."""
    return ClientConfig(
        client_id,
        where,
        federation=fed.federation,
        request_timeout_s=5.0,
        retry=_RETRY,
        session_expiry_s=SESSION_EXPIRY_S,
    )


async def until(
    cond: Callable[[], bool], what: str, timeout: float, *, scrapes: bool = False
) -> None:
    """Poll `cond` until it holds; `scrapes`: it reads metrics, so it runs in a thread
    (a condition on the history must not: the event loop changes the history).

    Raises:
        GeofedError: naming `what`, if it does not hold within `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while not (await asyncio.to_thread(cond) if scrapes else cond()):
        if time.monotonic() > deadline:
            raise GeofedError(f"not reached within {timeout:g}s: {what}")
        await asyncio.sleep(0.02)


class Workload:
    """Steady cross-region load: one publisher, subscribers with a mix of geofences.

    The publisher, at the publisher's broker, publishes every `interval_s` an
    event whose geofence rotates through the world and boxes around each
    broker's site; a failed publish is tried again with the same event id up
    to `retries` times. Subscribers stand at the subscriber's broker (every
    event, events from the publisher's region, events from the third region:
    none) and at the publisher's broker (every event), so every strategy
    forwards across regions. Everything goes into `history`.
    """

    def __init__(
        self,
        fed: LocalFederation,
        history: History,
        roles: Roles = Roles(),
        *,
        run: str = "w",
        interval_s: float = 0.01,
        retries: int = 3,
    ) -> None:
        self.fed = fed
        self.history = history
        self.roles = roles
        self.run = run
        self.interval_s = interval_s
        self.retries = retries
        self.errors: list[str] = []
        self.calling = False
        """A publish call is in progress."""
        self._sites = {b: self._site(b) for b in (roles.publisher, roles.subscriber, roles.third)}
        self._clients: list[Client] = []
        self._publisher: Client | None = None
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._publishing: asyncio.Task[None] | None = None
        self._published = 0

    def _site(self, broker: str) -> LatLon:
        site = self.fed.federation.broker(broker).site
        if site is None or self.fed.federation.responsible(site) != broker:
            raise GeofedError(f"broker {broker} needs a site inside its own area")
        return site

    async def start(self) -> None:
        """Connect and subscribe everyone, then start publishing."""
        r, sites = self.roles, self._sites
        plan: list[tuple[str, list[tuple[str, str, str | None]]]] = [
            (r.subscriber, [("all", "f/#", None), ("near-pub", "f/+", box(sites[r.publisher]))]),
            (r.subscriber, [("near-third", "f/+", box(sites[r.third]))]),
            (r.publisher, [("all", "f/#", None)]),
        ]
        for i, (broker, subs) in enumerate(plan):
            client_id = f"{self.run}-sub{i}-{broker}"
            client = await connect(client_config(client_id, sites[broker], self.fed))
            self._clients.append(client)
            for name, topic_filter, fence in subs:
                sub_id = f"{client_id}-{name}"
                self.history.subscribed(sub_id, client_id, topic_filter, fence, sites[broker])
                sub = await client.subscribe(topic_filter, geofence=fence, subscription_id=sub_id)
                self._subs.append(sub)
                self._tasks.append(asyncio.create_task(self._read(client_id, sub)))
        self._publisher = await connect(
            client_config(f"{self.run}-pub-{r.publisher}", sites[r.publisher], self.fed)
        )
        self._clients.append(self._publisher)
        self._publishing = asyncio.create_task(self._publish_forever())

    async def _read(self, client_id: str, sub: Subscription) -> None:
        try:
            async for msg in sub:
                self.history.received(client_id, msg)
        except GeofedError as exc:
            self.errors.append(f"subscription {sub.id} lost: {type(exc).__name__}: {exc}")

    async def publish(self, fence: str | None, kind: str = "e") -> bool:
        """Publish one event (retried with its id); True once acknowledged."""
        assert self._publisher is not None
        self._published += 1
        event_id = f"{self.run}-{kind}{self._published}"
        topic, payload = f"f/{self.roles.publisher}", f"payload of {event_id}".encode()
        where, broker = self._publisher.location, self.roles.publisher
        for attempt in range(self.retries):
            if attempt:
                await asyncio.sleep(self.interval_s)
            self.history.attempt(event_id, topic, where, fence, payload, broker)
            self.calling = True
            try:
                await self._publisher.publish(topic, payload, geofence=fence, event_id=event_id)
            except GeofedError as exc:
                self.history.failed(event_id, f"{type(exc).__name__}: {exc}")
                continue
            finally:
                self.calling = False
            self.history.acknowledged(event_id, time.time())
            return True
        return False

    async def _publish_forever(self) -> None:
        fences = [None, *(box(site) for site in self._sites.values())]
        while True:
            await self.publish(fences[self._published % len(fences)])
            await asyncio.sleep(self.interval_s)

    async def stop_publishing(self) -> None:
        """Stop the steady load (idempotent)."""
        task, self._publishing = self._publishing, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def settle(self, wait_s: float) -> None:
        """Once publishing stopped: wait until every delivery still owed has arrived.

        The federation is healthy and holds every subscription again; then one
        marker event goes out (recorded like any other). Each link applies
        messages in order (resends first) and each stream delivers in order, so
        once the marker reached every subscription it matches, whatever was
        published before it and not lost has arrived too; last, no peer queue
        holds anything. (The quiescence barrier, `wait_quiescent`, cannot serve
        here: a frame resent after a broken link counts as sent twice, and a
        restarted broker starts its counts afresh.)
        """
        await asyncio.to_thread(self.fed.wait_ready, wait_s)
        await until(
            self._subscriptions_in_place,
            "every broker holds its subscriptions",
            wait_s,
            scrapes=True,
        )
        before = len(self.history.events)
        deadline = time.monotonic() + wait_s
        while not await self.publish(None, "marker"):
            if time.monotonic() > deadline:  # its broker is up: a failure is a passing glitch
                raise GeofedError(f"no marker event acknowledged within {wait_s:g}s")
        markers = list(self.history.events)[before:]
        owed = [pair for pair in self.history.expected() if pair[0] in markers]
        await until(
            lambda: all(self.history.arrived(*pair) for pair in owed),
            f"the markers arrive: {owed}",
            wait_s,
        )
        await until(self._queues_empty, "every peer queue is empty", wait_s, scrapes=True)

    def _subscriptions_in_place(self) -> bool:
        """Each broker counts the local subscriptions and remote copies the strategy puts there."""
        strategy = strategy_for(self.fed.strategy, self.fed.federation)
        want: dict[tuple[str, str], int] = {}
        homes = {c.client_id: c.broker_id for c in self._clients}
        for sub in self.history.subscriptions.values():
            home = homes[sub.client]
            want[(home, "local")] = want.get((home, "local"), 0) + 1
            for target in strategy.subscription_targets(home, parse_geofence(sub.geofence)):
                want[(target, "remote")] = want.get((target, "remote"), 0) + 1
        return all(
            metric(n.metrics_url, SUBSCRIPTIONS, scope=scope) == want.get((b, scope), 0)
            for b, n in self.fed.nodes.items()
            for scope in ("local", "remote")
        )

    def _queues_empty(self) -> bool:
        return not sum(
            v
            for samples in scrape_all(self.fed.metrics_urls()).values()
            for (name, _), v in samples.items()
            if name == PEER_QUEUE_LENGTH
        )

    async def close(self) -> None:
        """Stop publishing, close every client (their subscriptions end)."""
        await self.stop_publishing()
        for client in self._clients:
            await client.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class Cycle:
    """Fault cycles on a running workload: `run` one, `restarts` counts broker restarts."""

    def __init__(
        self, fed: LocalFederation, load: Workload, roles: Roles, phase_events: int, wait_s: float
    ) -> None:
        self.fed, self.load, self.roles = fed, load, roles
        self.phase_events = phase_events
        self.wait_s = wait_s
        self.restarts = 0

    async def run(self, fault: str) -> None:
        """Load, inject `fault`, load during it, heal, wait for health, load.

        During a kill of the publisher's broker one publish call facing the
        outage is the load: the client library retries it (with its event id)
        until the broker is back, or it fails and the next one is made.
        """
        await self._acked(f"{self.phase_events} events acknowledged before the fault")
        heal = await self._inject(fault)
        if fault == "kill-publisher":
            attempts = self.load.history.attempts + 1
            await until(
                lambda: self.load.calling or self.load.history.attempts >= attempts,
                "a publish call facing the outage",
                self.wait_s,
            )
        else:
            attempts = self.load.history.attempts + self.phase_events
            await until(
                lambda: self.load.history.attempts >= attempts,
                f"{self.phase_events} publish calls during the fault",
                self.wait_s,
            )
        await heal()
        await asyncio.to_thread(self.fed.wait_ready, self.wait_s)
        await self._acked(f"{self.phase_events} events acknowledged after the fault")

    async def _acked(self, what: str) -> None:
        target = self.load.history.acks + self.phase_events
        await until(lambda: self.load.history.acks >= target, what, self.wait_s)

    def _link_down(self, at: str, peer: str) -> Callable[[], bool]:
        url = self.fed.nodes[at].metrics_url
        return lambda: metric(url, PEER_CONNECTED, peer=peer) == 0

    async def _inject(self, fault: str) -> Callable[[], Awaitable[object]]:
        """Start `fault`, wait until it is in effect; returns what heals it."""
        r = self.roles
        if fault.startswith("kill-"):
            broker = {"publisher": r.publisher, "subscriber": r.subscriber, "third": r.third}[
                fault.removeprefix("kill-")
            ]
            await asyncio.to_thread(self.fed.stop_node, broker, signal.SIGKILL)
            self.restarts += 1
            return functools.partial(asyncio.to_thread, self.fed.start_node, broker)
        if fault == "pause":
            self.fed.pause_node(r.subscriber)
            try:
                await until(
                    self._link_down(r.publisher, r.subscriber),
                    f"{r.publisher} times the frozen {r.subscriber} out",
                    self.wait_s,
                    scrapes=True,
                )
            except BaseException:
                self.fed.resume_node(r.subscriber)
                raise
            return functools.partial(asyncio.to_thread, self.fed.resume_node, r.subscriber)
        link = self.fed.link(r.publisher, r.subscriber)
        if fault == "partition":
            await asyncio.to_thread(link.partition)
            for at, peer in ((r.publisher, r.subscriber), (r.subscriber, r.publisher)):
                down = self._link_down(at, peer)
                await until(down, f"{at} sees {peer} cut off", self.wait_s, scrapes=True)
        elif fault == "flap":
            flaps = link.flaps + 2
            await asyncio.to_thread(link.flap)
            await until(lambda: link.flaps >= flaps, "the link flaps twice", self.wait_s)
        else:
            raise GeofedError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
        return functools.partial(asyncio.to_thread, link.heal)


async def run_faults(
    strategy: str,
    fault: str,
    *,
    cycles: int = 1,
    federation: str | Path = "three",
    roles: Roles = Roles(),
    workdir: str | Path | None = None,
    phase_events: int = 10,
    interval_s: float = 0.01,
    wait_s: float = 60.0,
) -> FaultResult:
    """Run `cycles` cycles of `fault` on a fresh durable federation under load; check the history.

    Raises:
        GeofedError: when the federation or the load gets stuck (a wait exceeded `wait_s`).
    """
    if fault not in FAULTS:
        raise GeofedError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    fed = LocalFederation(
        federation, strategy, workdir, extra_env=FAULT_ENV, durable=True, links=True
    )
    await asyncio.to_thread(fed.start, wait_s)
    history = History()
    load = Workload(fed, history, roles, interval_s=interval_s)
    cycle = Cycle(fed, load, roles, phase_events, wait_s)
    try:
        await load.start()
        for _ in range(cycles):
            await cycle.run(fault)
        await load.stop_publishing()
        await load.settle(wait_s)
    finally:
        await load.close()
        await asyncio.to_thread(fed.stop)
    return FaultResult(strategy, fault, cycles, history.check(), cycle.restarts, load.errors)


# -- the benchmark -------------------------------------------------------------

_COLUMNS = ("cycles", "acknowledged", "delivered", "lost", "duplicated", "unexpected")


def _row(result: FaultResult) -> list[str]:
    c = result.report.counts()
    status = "ok" if result.ok else "**FAILED**"
    return [
        result.strategy,
        result.fault,
        str(result.cycles),
        f"{c['acknowledged']:,} of {c['published']:,}",
        f"{c['delivered']:,} of {c['required']:,}",
        f"{c['lost']:,}",
        f"{c['duplicated']:,}",
        f"{c['unexpected']:,}",
        status,
    ]


def markdown(results: Sequence[FaultResult | tuple[str, str, str]], command: str) -> str:
    """The results file: command, machine, one row per strategy and fault, failures in detail.

    A `(strategy, fault, error)` tuple stands for a run that got stuck.
    """
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Fault injection: lost, duplicated, unexpected",
        "",
        f"## {now}",
        "",
        f"Command: `{command}`  ",
        f"Machine: {describe()}",
        "",
        "Per strategy and fault: cycles run; events acknowledged of those published "
        "(a publish failing while its broker was down is unacknowledged); required "
        "deliveries (acknowledged event × matching subscriber that stood still) that "
        "arrived; lost, duplicated (copies beyond the first) and unexpected deliveries "
        "by the history checker (`geofed.bench.history`).",
        "",
        "| strategy | fault | " + " | ".join(_COLUMNS) + " | status |",
        "|---|---|" + "---:|" * len(_COLUMNS) + "---|",
    ]
    details: list[str] = []
    for r in results:
        if isinstance(r, FaultResult):
            lines.append("| " + " | ".join(_row(r)) + " |")
            if not r.ok:
                details += ["", "```", str(r), "```"]
        else:
            strategy, fault, error = r
            lines.append(f"| {strategy} | {fault} |" + " |" * len(_COLUMNS) + " **STUCK** |")
            details += ["", "```", f"{strategy} / {fault}: {error}", "```"]
    if details:
        lines += ["", "### Failures", *details]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m geofed.bench.faults``: fault cycles per strategy and fault, to a results file."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--strategy", default="all", help="a strategy, comma-separated ones, or all")
    p.add_argument(
        "--fault", default="all", help=f"of {', '.join(FAULTS)}; comma-separated, or all"
    )
    p.add_argument("--cycles", type=int, default=20, help="fault cycles per strategy and fault")
    p.add_argument("--phase-events", type=int, default=10, help="events acknowledged per phase")
    p.add_argument("--interval", type=float, default=0.01, help="seconds between two publishes")
    p.add_argument("--federation", default="three", help="federation file or bundled name")
    p.add_argument("--out", type=Path, default=Path("bench/results/faults.md"))
    p.add_argument("--workdir", type=Path, help="node logs and data (default: a temporary folder)")
    args = p.parse_args(argv)
    strategies = list(STRATEGIES) if args.strategy == "all" else args.strategy.split(",")
    faults = list(FAULTS) if args.fault == "all" else args.fault.split(",")
    for name, chosen, known in (("strategy", strategies, STRATEGIES), ("fault", faults, FAULTS)):
        unknown = [x for x in chosen if x not in known]
        if unknown:
            p.error(f"unknown --{name} {', '.join(unknown)}; one of {', '.join(known)}")
    if args.cycles < 1:
        p.error("--cycles must be >= 1")
    results: list[FaultResult | tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="geofed-faults-") as tmp:
        root = args.workdir or Path(tmp)
        for strategy in strategies:
            for fault in faults:
                started = time.monotonic()
                try:
                    result = asyncio.run(
                        run_faults(
                            strategy,
                            fault,
                            cycles=args.cycles,
                            federation=args.federation,
                            workdir=root / f"{strategy}-{fault}",
                            phase_events=args.phase_events,
                            interval_s=args.interval,
                        )
                    )
                except GeofedError as exc:
                    results.append((strategy, fault, str(exc)))
                    print(f"{strategy} / {fault}: STUCK: {exc}", flush=True)
                    continue
                results.append(result)
                took = time.monotonic() - started
                print(f"{result}\n  ({took:.0f} s)", flush=True)
    command = "python -m geofed.bench.faults " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(results, command), encoding="utf-8")
    print(f"written to {args.out}")
    return 0 if all(isinstance(r, FaultResult) and r.ok for r in results) else 1


__all__ = [
    "FAULTS",
    "FAULT_ENV",
    "SESSION_EXPIRY_S",
    "Cycle",
    "FaultResult",
    "Roles",
    "Workload",
    "box",
    "client_config",
    "main",
    "markdown",
    "run_faults",
    "until",
]


if __name__ == "__main__":
    sys.exit(main())
