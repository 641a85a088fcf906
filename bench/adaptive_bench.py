"""Static strategies against the adaptive controller, per scenario, in the simulator.

Not a test: for each workload scenario (``geofed workload``: the four of
``geofed bench`` and ``mixed``) it runs the trace through the in-memory
federation (`geofed.routing.Simulator`) under each static strategy and with
the adaptive controller (`geofed.routing.simulate_adaptive`: windows of
``--window`` seconds, the controller's switches executed as transitions of
the per-topic strategy table, with the transitions' own messages), starting
from each strategy in ``--start``. Per run: inter-region messages (PREPARED /
SWITCHED and moved copies included), the ratio to the lower bound and to the
best static strategy, recall, precision and duplicates against the oracle
(``reference_deliveries``), whether the cost model with the same transitions
predicts the measured count exactly, and the transitions made. The mixed
scenario also gets a time-series plot of messages per second with the
transition points marked. Tables are appended to ``bench/results/adaptive.md``
with the command and the machine; plots go next to it.

Usage: ``python -m geofed.bench.adaptive_bench [--clients 100] [--duration 60]
[--mixed-duration 120] [--seed 1] [--out DIR] [--no-record]``
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from geofed.bench._machine import record
from geofed.routing import (
    STRATEGIES,
    AdaptiveConfig,
    AdaptiveRun,
    Federation,
    StrategyTable,
    TraceOp,
    federation_path,
    predict,
    reference_deliveries,
    simulate_adaptive,
)

from ._extras import require
from .workload import SCENARIOS, WorkloadConfig, activity, generate

RESULTS = Path(__file__).resolve().parent / "results"
_BIN_S = 5.0  # seconds per point of the time series


def run_scenario(
    federation: Federation,
    ops: list[TraceOp],
    starts: list[str],
    config: AdaptiveConfig,
) -> dict[str, Any]:
    """Every static strategy and the controller from each of `starts`, on one trace."""
    expected = Counter(reference_deliveries(ops))
    lower = predict(federation, "event-geofence", ops).lower_bound_total
    rows: list[dict[str, Any]] = []
    runs: dict[str, AdaptiveRun] = {}
    plans: list[tuple[str, str, bool]] = [(s, s, False) for s in STRATEGIES]
    plans += [(f"adaptive from {s}", s, True) for s in starts]
    for label, start, adapt in plans:
        began = time.perf_counter()
        run = simulate_adaptive(federation, ops, start, config, adapt=adapt, bin_s=_BIN_S)
        took = time.perf_counter() - began
        got = Counter(run.result.deliveries)
        hits = sum((got & expected).values())
        model = predict(federation, StrategyTable(start), ops, run.transitions)
        rows.append(
            {
                "run": label,
                "messages": run.result.total_messages,
                "transition": run.result.by_kind()["transition"],
                "recall": hits / sum(expected.values()) if expected else 1.0,
                "precision": hits / sum(got.values()) if got else 1.0,
                "duplicates": sum(n - 1 for n in got.values() if n > 1),
                "exact_model": model.messages == +run.result.messages,
                "transitions": [
                    (s.window_end, s.key, s.new) for _end, _r, found in run.windows for s in found
                ],
                "seconds": took,
            }
        )
        runs[label] = run
    best = min(r["messages"] for r in rows[: len(STRATEGIES)])
    for r in rows:
        r["vs_best"] = r["messages"] / best - 1.0 if best else 0.0
        r["x_lower"] = r["messages"] / lower if lower else None
    return {
        "rows": rows,
        "lower_bound": lower,
        "best_static": best,
        "runs": runs,
        "expected": expected,
    }


def per_bin_quality(
    ops: list[TraceOp], expected: Counter[tuple[str, str]], run: AdaptiveRun, bins: int
) -> tuple[list[float], list[float]]:
    """Recall and precision of the deliveries of events published in each bin (1 when none)."""
    when = {op.id: min(bins - 1, int(op.t // _BIN_S)) for op in ops if op.op == "publish"}
    got = Counter(run.result.deliveries)
    hits, want, sent = [0] * bins, [0] * bins, [0] * bins
    for (event, _sub), n in expected.items():
        want[when[event]] += n
    for pair, n in got.items():
        sent[when[pair[0]]] += n
        hits[when[pair[0]]] += min(n, expected[pair])
    recall = [h / w if w else 1.0 for h, w in zip(hits, want, strict=True)]
    precision = [h / n if n else 1.0 for h, n in zip(hits, sent, strict=True)]
    return recall, precision


def table(result: dict[str, Any]) -> str:
    """The Markdown table of one scenario."""
    lines = [
        "| run | inter-region messages | of them PREPARED / SWITCHED | vs best static"
        " | × lower bound"
        " | recall | precision | dups | model = measured | transitions (t s: key → strategy) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        x = "–" if r["x_lower"] is None else f"{r['x_lower']:.1f}"
        moves = "; ".join(f"{t:.0f}: {k} → {s}" for t, k, s in r["transitions"]) or "–"
        lines.append(
            f"| {r['run']} | {r['messages']:,} | {r['transition']:,} | {r['vs_best']:+.1%} | {x}"
            f" | {r['recall']:.4f} | {r['precision']:.4f} | {r['duplicates']}"
            f" | {'yes' if r['exact_model'] else 'NO'} | {moves} |"
        )
    return "\n".join(lines)


def plot_series(
    result: dict[str, Any], ops: list[TraceOp], duration: float, path: Path, title: str
) -> None:
    """Messages per second over time per run, each adaptive run's transitions marked.

    In the style of the paper's time series: (a) what drives the change (live
    alert subscriptions and the app activity profile), (b) messages per second
    of every run, log scale, with dotted lines at the transitions (T1, T2, ...
    in the colour of the run that made them), (c) recall and precision of the
    adaptive runs' deliveries per bin, through the transitions.
    """
    require("analysis", "the adaptive benchmark's plot", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")  # files only; benchmark machines have no display
    import matplotlib.pyplot as plt

    bins = max(1, math.ceil(duration / _BIN_S))
    xs = [(i + 0.5) * _BIN_S for i in range(bins)]
    fig, (top, bottom, quality) = plt.subplots(
        3, 1, figsize=(9, 9.5), sharex=True, gridspec_kw={"height_ratios": [1, 2.2, 1]}
    )
    live: set[str] = set()
    counts = [0] * bins
    for op in ops:
        if op.op == "subscribe" and op.topic.startswith("alerts/"):
            live.add(op.id)
        elif op.op == "unsubscribe":
            live.discard(op.id)
        counts[min(bins - 1, int(op.t // _BIN_S))] = len(live)
    top.step(xs, counts, where="mid", color="#444444", label="live alert subscriptions")
    top.plot(
        xs,
        [max(counts) * activity(x, duration) for x in xs],
        color="#999999",
        linestyle=":",
        label="app activity profile (scaled)",
    )
    top.set_ylabel("(a) subscriptions")
    top.legend(fontsize=7, loc="upper left")
    for label, run in result["runs"].items():
        per_s = [run.per_bin.get(i, 0) / _BIN_S for i in range(bins)]
        adaptive = label.startswith("adaptive")
        (line,) = bottom.step(
            xs, per_s, where="mid", label=label, linewidth=2.2 if adaptive else 1.0
        )
        if not adaptive:
            continue
        recall, precision = per_bin_quality(ops, result["expected"], run, bins)
        quality.step(xs, recall, where="mid", color=line.get_color(), label=f"recall, {label}")
        quality.step(
            xs,
            precision,
            where="mid",
            color=line.get_color(),
            linestyle="--",
            label=f"precision, {label}",
        )
        for n, (t, key, new) in enumerate(_transitions(result, label), 1):
            for ax in (top, bottom, quality):
                ax.axvline(t, color=line.get_color(), linestyle=":", linewidth=1.2)
            bottom.annotate(
                f"T{n}: {key} → {new}",
                (t, 0.02),
                xycoords=("data", "axes fraction"),
                rotation=90,
                ha="right",
                va="bottom",
                fontsize=7,
                color=line.get_color(),
            )
    bottom.set_yscale("log")
    low, high = bottom.get_ylim()
    bottom.set_ylim(low, high * 8)  # room for the legend above the busiest run
    bottom.set_ylabel("(b) inter-region messages / s")
    bottom.legend(fontsize=7, loc="upper right", ncol=2, framealpha=0.9)
    quality.set_ylim(0.0, 1.05)
    quality.set_ylabel("(c) recall, precision")
    quality.set_xlabel(f"trace time (s), {_BIN_S:g}-s bins of the events' publication")
    quality.set_xlim(0, bins * _BIN_S)
    quality.legend(fontsize=7, loc="lower right", ncol=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _transitions(result: dict[str, Any], label: str) -> list[tuple[float, str, str]]:
    for r in result["rows"]:
        if r["run"] == label:
            return list(r["transitions"])
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--federation", default="aws-2020", help="file or bundled name")
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (bench scenarios)")
    parser.add_argument("--mixed-duration", type=float, default=120.0, help="seconds (mixed)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--window", type=float, default=10.0, help="controller window, seconds")
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated scenario names"
    )
    parser.add_argument(
        "--start",
        default="subscription-geofence,event-geofence",
        help="strategies the adaptive runs start from (the table's default)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of the results")
    parser.add_argument("--no-record", action="store_true", help="print only")
    args = parser.parse_args(argv)
    federation = Federation.load(federation_path(args.federation))
    config = AdaptiveConfig(window_s=args.window)
    starts = [s for s in args.start.split(",") if s]
    sections: list[str] = [
        f"Federation `{args.federation}` ({len(federation)} brokers); {args.clients} clients,"
        f" seed {args.seed}; controller: {config}.\n"
    ]
    for scenario in [s for s in args.scenarios.split(",") if s]:
        duration = args.mixed_duration if scenario == "mixed" else args.duration
        cfg = WorkloadConfig(
            scenario=scenario, clients=args.clients, duration_s=duration, seed=args.seed
        )
        ops = list(generate(cfg))
        result = run_scenario(federation, ops, starts, config)
        events = sum(op.op == "publish" for op in ops)
        head = (
            f"### `{scenario}` ({duration:g} s, {len(ops):,} actions, {events:,} events,"
            f" lower bound {result['lower_bound']:,})"
        )
        text = f"{head}\n\n{table(result)}\n"
        if scenario == "mixed":
            args.out.mkdir(parents=True, exist_ok=True)
            png = args.out / "adaptive-mixed.png"
            plot_series(
                result,
                ops,
                duration,
                png,
                f"mixed scenario: {args.clients} clients, {duration:g} s, seed {args.seed},"
                f" {len(federation)} brokers\nmessages per second of each run; dotted:"
                " the adaptive runs' transitions",
            )
            text += f"\n![messages per second, mixed]({png.name})\n"
        print(text, flush=True)
        sections.append(text)
    if not args.no_record:
        path = args.out / "adaptive.md"
        record(
            path,
            "geofed.bench.adaptive_bench",
            argv,
            "\n" + "\n".join(sections),
            title="# Adaptive strategy per topic against static strategies (simulator)\n\n"
            "Written by `bench/adaptive_bench.py` (see its docstring). Messages are the"
            " in-memory federation's inter-region messages, transitions included; the"
            " model column says whether `predict` with the same transitions gives the"
            " same count.\n",
        )
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
