"""Filter-scheme transitions at one broker: recall, precision and filter complexity over time.

Not a test: the shape of the evaluation of Richerzhagen et al., "Seamless
Transitions Between Filter Schemes for Location-based Mobile Applications"
(LCN 2016, its Fig. 8-10), on geofed's filter schemes (`geofed.routing.LastMile`,
docs/design.md §14). Pedestrians walk between attraction points in a 1.3 km
square of Darmstadt, each subscribed with a roaming 150 m circle and
publishing about one event a second. The number of clients rises to a peak
and falls again; the broker switches scheme by load (`scheme_for_load`:
RGRID from `--rgrid-at` subscriptions, GRID from `--grid-at`, back below nine
tenths), which gives the paper's T1-T4: EXACT -> RGRID -> GRID -> RGRID ->
EXACT. Every event's deliveries are held against the exact predicate on the
broker's subscriptions (recall: exact matches delivered / exact matches;
precision: delivered ones that match / delivered).

Three ways of running the transitions:

* ``transfer``: the paper's state transfer; missing state (GRID -> RGRID:
  the cover; -> EXACT: the geofence) comes from the client one round trip
  (`--rtt`) later, the broker holding only its scheme's state;
* ``no-transfer``: every subscription dropped at a transition; clients
  resubscribe one round trip later;
* ``broker``: geofed's node, which bootstraps missing state from its own copy
  of the subscriptions (routing keeps them whole): nothing is awaited.

Writes ``bench/results/schemes.png`` (recall and precision, median and
quartiles per bin, transitions marked; the recall around each transition per
variant; clients and filter complexity) and appends a table to
``bench/results/schemes.md`` with the command and the machine.

Usage: ``python -m geofed.bench.schemes_bench [--duration 300] [--peak 150] [--no-record]``
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from geofed.bench._extras import require
from geofed.bench._machine import record
from geofed.routing import (
    Event,
    LastMile,
    LatLon,
    Scheme,
    SubKey,
    Subscription,
    SubscriptionIndex,
    covers,
    make_subscription,
    scheme_for_load,
)

RESULTS = Path(__file__).resolve().parent / "results"
CENTRE = LatLon(49.8728, 8.6512)  # Darmstadt
SIDE_M = 1300.0
RADIUS_M = 150.0
VARIANTS = ("transfer", "no-transfer", "broker")
_M_PER_DEG = 111_195.0


def _at(x_m: float, y_m: float) -> LatLon:
    """A point `x_m` east and `y_m` north of the square's south-west corner."""
    lat = CENTRE.lat + (y_m - SIDE_M / 2) / _M_PER_DEG
    lon = CENTRE.lon + (x_m - SIDE_M / 2) / (_M_PER_DEG * math.cos(math.radians(CENTRE.lat)))
    return LatLon(lat, lon)


@dataclass
class _Walker:
    """A pedestrian walking between attraction points, pausing at each."""

    x: float
    y: float
    goal: tuple[float, float]
    speed: float
    pause: float = 0.0

    def step(self, dt: float, rng: random.Random, points: list[tuple[float, float]]) -> bool:
        """Advance `dt` seconds; True when the walker moved."""
        if self.pause > 0:
            self.pause -= dt
            return False
        gx, gy = self.goal
        d = math.hypot(gx - self.x, gy - self.y)
        if d <= self.speed * dt:
            self.x, self.y = gx, gy
            # The next attraction point, where the crowd stands within 50 m of it.
            px, py = rng.choice(points)
            a, r = rng.uniform(0, 2 * math.pi), 50.0 * math.sqrt(rng.random())
            self.goal = (px + r * math.cos(a), py + r * math.sin(a))
            self.pause = rng.uniform(10.0, 60.0)
        else:
            self.x += (gx - self.x) / d * self.speed * dt
            self.y += (gy - self.y) / d * self.speed * dt
        return True


@dataclass
class Run:
    """One run of the scenario under one variant."""

    variant: str
    bins: list[float] = field(default_factory=list)  # bin start times
    recall: list[list[float]] = field(default_factory=list)  # per bin: per-event values
    precision: list[list[float]] = field(default_factory=list)
    clients: list[int] = field(default_factory=list)  # per bin: at its end
    complexity: list[int] = field(default_factory=list)
    transitions: list[tuple[float, str, str]] = field(default_factory=list)
    samples: list[tuple[float, float, float]] = field(default_factory=list)  # t, recall, precision
    events: int = 0
    awaited: int = 0
    seconds: float = 0.0


def clients_at(t: float, duration: float, peak: int, low: int) -> int:
    """The load curve: `low` clients, up to `peak` in the middle of the run, back down."""
    phase = min(1.0, max(0.0, t / duration))
    return round(low + (peak - low) * math.sin(math.pi * phase) ** 2)


def run(
    variant: str,
    *,
    duration: float,
    peak: int,
    low: int,
    rgrid_at: int,
    grid_at: int,
    rtt: float,
    bin_s: float,
    seed: int,
    tick: float = 0.1,
) -> Run:
    """Simulate the scenario with the broker's transitions made the `variant` way."""
    rng = random.Random(seed)
    points = [(rng.uniform(0, SIDE_M), rng.uniform(0, SIDE_M)) for _ in range(12)]
    truth = SubscriptionIndex()  # what the clients asked for: the exact answer
    lm = LastMile(Scheme.EXACT, exact=truth if variant == "broker" else None)
    walkers: dict[str, _Walker] = {}
    where: dict[str, LatLon] = {}
    subs: dict[str, Subscription] = {}
    awaiting: list[tuple[float, SubKey]] = []  # (due time, key): the clients' answers
    out = Run(variant)
    next_id = 0
    t0 = time.perf_counter()
    steps = round(duration / tick)
    per_bin = round(bin_s / tick)
    rec: list[float] = []
    prec: list[float] = []
    for step in range(steps):
        t = step * tick
        # Load: clients join and leave.
        want = clients_at(t, duration, peak, low)
        while len(walkers) < want:
            cid = f"c{next_id}"
            next_id += 1
            p = rng.choice(points)
            walkers[cid] = _Walker(p[0], p[1], rng.choice(points), rng.uniform(0.5, 1.5))
            where[cid] = _at(p[0], p[1])
            sub = make_subscription("s", cid, "game/#", {"roaming": {"radius_m": RADIUS_M}})
            subs[cid] = sub.placed(where[cid])
            truth.add(subs[cid])
            lm.add(subs[cid])
        while len(walkers) > want:
            cid = rng.choice(sorted(walkers))
            del walkers[cid], where[cid], subs[cid]
            truth.remove((cid, "s"))
            lm.remove((cid, "s"))
        # The broker's rule: the scheme for the subscriptions it holds.
        target = scheme_for_load(lm.scheme, len(truth), Scheme.EXACT, rgrid_at, grid_at)
        if target is not lm.scheme:
            source = lm.scheme
            report = lm.transition(
                target,
                state_transfer=variant != "no-transfer",
                recover=truth.get if variant == "broker" else None,
            )
            out.transitions.append((t, source.value, target.value))
            out.awaited += len(report.awaiting)
            awaiting += [(t + rtt, k) for k in report.awaiting]
        # Clients' bootstrap answers and resubscriptions arrive one round trip later.
        if awaiting and awaiting[0][0] <= t:
            due = [k for d, k in awaiting if d <= t]
            awaiting = [(d, k) for d, k in awaiting if d > t]
            for cid, _ in due:
                if cid in subs:
                    lm.add(subs[cid])
        # Movement, once a second: the broker hears every new location.
        if step % round(1.0 / tick) == 0:
            for cid, w in walkers.items():
                if w.step(1.0, rng, points):
                    where[cid] = _at(w.x, w.y)
                    subs[cid] = subs[cid].placed(where[cid])
                    truth.add(subs[cid])
                    if (cid, "s") not in lm.awaiting:
                        lm.add(subs[cid])
        # Events: about one a second per client.
        for cid in walkers:
            if rng.random() < tick:
                e = Event(f"e{out.events}", "game/action", where[cid])
                out.events += 1
                exact = {
                    s.key
                    for s in truth.match(e.topic, e.location)
                    if covers(e.geofence, where[s.client])
                }
                got = set(lm.match(e, where.get))
                hit = len(exact & got)
                r_e = hit / len(exact) if exact else math.nan
                p_e = hit / len(got) if got else math.nan
                if exact:
                    rec.append(r_e)
                if got:
                    prec.append(p_e)
                out.samples.append((t, r_e, p_e))
        if (step + 1) % per_bin == 0:
            out.bins.append(t + tick - bin_s)
            out.recall.append(rec)
            out.precision.append(prec)
            out.clients.append(len(walkers))
            out.complexity.append(lm.complexity)
            rec, prec = [], []
    out.seconds = time.perf_counter() - t0
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return (math.nan, math.nan, math.nan)
    if len(values) == 1:
        return (values[0], values[0], values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], q[1], q[2])


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _window(r: Run, start: float, stop: float) -> tuple[float, float]:
    """Mean recall and precision of the events published in [start, stop)."""
    rec = [x for t, x, _ in r.samples if start <= t < stop and not math.isnan(x)]
    prec = [y for t, _, y in r.samples if start <= t < stop and not math.isnan(y)]
    return _mean(rec), _mean(prec)


def phases(r: Run) -> list[tuple[str, float, float, float, float, int]]:
    """Per scheme phase: (scheme, start, end, mean recall, mean precision, mean complexity),
    over the events published in the phase (complexity: the bins inside it)."""
    edges = [(0.0, "exact")] + [(t, target) for t, _, target in r.transitions]
    width = r.bins[1] - r.bins[0] if len(r.bins) > 1 else 0.0
    end = r.bins[-1] + width
    out = []
    for i, (start, scheme) in enumerate(edges):
        stop = edges[i + 1][0] if i + 1 < len(edges) else end
        rec, prec = _window(r, start, stop)
        cx = [r.complexity[j] for j, b in enumerate(r.bins) if start <= b and b + width <= stop]
        out.append((scheme, start, stop, rec, prec, round(_mean(cx)) if cx else 0))
    return out


def dips(r: Run, after: float) -> list[float]:
    """Mean recall of the events published within `after` seconds of each transition."""
    return [_window(r, t, t + after)[0] for t, _, _ in r.transitions]


def plot(runs: dict[str, Run], path: Path) -> None:
    """Recall and precision over time (transfer), recall per variant, clients and complexity."""
    require("analysis", "the schemes benchmark's plot", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")  # files only; benchmark machines have no display
    import matplotlib.pyplot as plt

    main = runs["transfer"]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    half = (main.bins[1] - main.bins[0]) / 2 if len(main.bins) > 1 else 0.0
    xs = [b + half for b in main.bins]  # bin centres
    for ax, series, name in (
        (axes[0], main.precision, "precision"),
        (axes[1], main.recall, "recall"),
    ):
        q = [_quartiles(v) for v in series]
        ax.plot(xs, [m for _, m, _ in q], label=f"{name}: median (with state transfer)")
        ax.fill_between(xs, [a for a, _, _ in q], [b for _, _, b in q], alpha=0.3, label="25-75 %")
        ax.set_ylabel(name)
        ax.set_ylim(-0.02, 1.05)
    styles = {
        "broker": {"linewidth": 4, "alpha": 0.4},
        "transfer": {"linestyle": "--"},
        "no-transfer": {"linewidth": 1},
    }
    for variant, r in runs.items():
        axes[2].plot(
            [b + half for b in r.bins],
            [_mean(v) for v in r.recall],
            label=variant,
            **styles.get(variant, {}),  # type: ignore[arg-type]
        )
    axes[2].set_ylabel("mean recall per bin")
    axes[2].set_ylim(-0.02, 1.05)
    axes[3].plot(xs, main.clients, label="clients (subscriptions)")
    axes[3].plot(xs, main.complexity, label="filter complexity")
    axes[3].set_ylabel("count")
    axes[3].set_xlabel("seconds")
    for ax in axes:
        for i, (t, _, target) in enumerate(main.transitions):
            ax.axvline(t, color="grey", linestyle=":")
            if ax is axes[0]:
                ax.annotate(f"T{i + 1}\n{target}", (t, 1.0), fontsize=8, ha="left", va="top")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    axes[0].set_title("filter schemes at one broker: EXACT -> RGRID -> GRID -> RGRID -> EXACT")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(runs: dict[str, Run], args: argparse.Namespace, plot_name: str | None) -> str:
    """The results section: per variant, each scheme phase's means; the recall dips."""
    lines = [
        f"{args.duration:g} s, {args.low}-{args.peak} clients (roaming {RADIUS_M:g} m circles,"
        f" ~1 event/s each), RGRID from {args.rgrid_at} subscriptions, GRID from"
        f" {args.grid_at}, client round trip {args.rtt:g} s, bins of {args.bin:g} s,"
        f" seed {args.seed}.",
        "",
        "| variant | phase | from s | to s | mean recall | mean precision | mean complexity |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, r in runs.items():
        for scheme, a, b, rec, prec, cx in phases(r):
            lines.append(
                f"| {variant} | {scheme} | {a:.1f} | {b:.1f} | {rec:.3f} | {prec:.3f} | {cx} |"
            )
    window = max(args.rtt, 0.5)
    names = " | ".join(
        f"T{i + 1} {s}->{t}" for i, (_, s, t) in enumerate(runs["transfer"].transitions)
    )
    lines += [
        "",
        f"Recall of the events published within {window:g} s after each transition:",
        "",
        f"| variant | events | subscriptions awaited from clients | {names} |",
        "|---|---|---|" + "---|" * len(runs["transfer"].transitions),
    ]
    for variant, r in runs.items():
        cells = " | ".join(f"{x:.3f}" for x in dips(r, window))
        lines.append(f"| {variant} | {r.events} | {r.awaited} | {cells} |")
    if plot_name:
        lines += ["", f"![recall, precision and complexity over time]({plot_name})"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=300.0, help="seconds simulated")
    p.add_argument("--peak", type=int, default=150, help="most clients at once")
    p.add_argument("--low", type=int, default=20, help="clients at start and end")
    p.add_argument("--rgrid-at", type=int, default=60, help="subscriptions from which RGRID")
    p.add_argument("--grid-at", type=int, default=110, help="subscriptions from which GRID")
    p.add_argument("--rtt", type=float, default=0.4, help="client round trip, seconds")
    p.add_argument("--bin", type=float, default=2.0, help="seconds per plotted bin")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder of schemes.md / .png")
    p.add_argument("--no-record", action="store_true", help="print only")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    runs = {
        v: run(
            v,
            duration=args.duration,
            peak=args.peak,
            low=args.low,
            rgrid_at=args.rgrid_at,
            grid_at=args.grid_at,
            rtt=args.rtt,
            bin_s=args.bin,
            seed=args.seed,
        )
        for v in VARIANTS
    }
    plot_name = None
    if not args.no_plot:
        plot_name = "schemes.png"
        args.out.mkdir(parents=True, exist_ok=True)
        plot(runs, args.out / plot_name)
    body = markdown(runs, args, plot_name)
    print(body)
    for v, r in runs.items():
        print(f"{v}: {r.events} events in {r.seconds:.1f} s", file=sys.stderr)
    if not args.no_record:
        record(
            args.out / "schemes.md",
            "geofed.bench.schemes_bench",
            argv,
            body,
            title="# Filter schemes at the broker: transitions under load\n\n"
            "Recall, precision and filter complexity of one broker through the transitions"
            " T1-T4 (EXACT -> RGRID -> GRID -> RGRID -> EXACT), with the paper's state"
            " transfer, without it, and with geofed's bootstrap from the broker"
            " (docs/design.md §14). Simulated in-process with the routing core's `LastMile`.\n",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
