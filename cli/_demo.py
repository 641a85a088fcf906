"""``geofed demo``: the main job. A live local federation under every strategy.

For each routing strategy: start one node process per broker, replay the
same generated workload through real gRPC clients, read the inter-region
messages from the nodes' Prometheus metrics, and compare them with the
routing cost model, and the deliveries with a central matcher (the oracle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from geofed.routing import STRATEGIES, TraceOp, op_to_record, predict, reference_deliveries

KINDS = ("event", "subscribe", "unsubscribe", "delivery")


def register(sub: Any, name: str) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser(name, help="run a live local federation under each strategy and compare")
    p.add_argument(
        "--federation", default="aws-2020", help="file or bundled name (default: aws-2020)"
    )
    p.add_argument("--scenario", default="global", help="workload scenario (see geofed workload)")
    p.add_argument("--clients", type=int, default=40)
    p.add_argument(
        "--duration",
        type=float,
        default=20.0,
        help="workload seconds (replayed as fast as possible)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--strategy", action="append", choices=list(STRATEGIES), help="default: all four"
    )
    p.add_argument("--workdir", default="out/demo", help="logs, traces, workload and results")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from geofed.bench.local import LocalFederation
    from geofed.bench.workload import WorkloadConfig, generate

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fed_file = args.federation
    ops = list(
        generate(
            WorkloadConfig(
                scenario=args.scenario,
                clients=args.clients,
                duration_s=args.duration,
                seed=args.seed,
            )
        )
    )
    with (workdir / "workload.jsonl").open("w", encoding="utf-8") as f:
        for op in ops:
            f.write(json.dumps(op_to_record(op)) + "\n")
    expected = reference_deliveries(ops)
    n_events = sum(1 for o in ops if o.op == "publish")
    print(
        f"workload: {args.scenario}, {len(ops)} actions, {n_events} events, "
        f"{len(expected)} deliveries expected (oracle)",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    for name in args.strategy or list(STRATEGIES):
        t0 = time.monotonic()
        print(f"[{name}] starting federation ...", file=sys.stderr, flush=True)
        with LocalFederation(fed_file, name, workdir / name, trace=True) as fed:
            started = time.monotonic() - t0
            print(
                f"[{name}] {len(fed.nodes)} brokers ready in {started:.1f}s; replaying ...",
                file=sys.stderr,
                flush=True,
            )
            measured, deliveries, errors = asyncio.run(
                _replay(fed, ops, workdir / name / "deliveries.jsonl")
            )
            pred = predict(fed.federation, name, ops)
        rows.append(_row(name, measured, pred, deliveries, expected, errors, time.monotonic() - t0))
        r = rows[-1]
        print(
            f"[{name}] {r['messages']} inter-region messages (model {r['predicted']}), "
            f"recall {r['recall']:.3f} precision {r['precision']:.3f} in {r['seconds']:.0f}s",
            file=sys.stderr,
            flush=True,
        )
    _savings(rows)
    (workdir / "results.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows, n_events)
        print(f"\nresults, logs and node message traces: {workdir}/")
    ok = all(
        r["recall"] == 1.0
        and r["precision"] == 1.0
        and r["duplicates"] == 0
        and r["messages"] == r["predicted"]
        for r in rows
    )
    return 0 if ok else 1


async def _replay(
    fed: Any, ops: list[TraceOp], log_path: Path
) -> tuple[dict[str, float], list[tuple[str, str]], list[str]]:
    from geofed.bench import Replayer, peer_message_counts, wait_quiescent

    urls = {b: n.metrics_url for b, n in fed.nodes.items()}
    with log_path.open("w", encoding="utf-8") as log:
        r = Replayer(fed.federation, log, barrier=lambda: wait_quiescent(urls))
        try:
            await r.run(ops)
            await r.settle()
            counts = await asyncio.to_thread(peer_message_counts, urls)
        finally:
            await r.close()
    by_kind: dict[str, float] = {k: 0.0 for k in KINDS}
    for (kind, _, _), v in counts["sent"].items():
        if kind in by_kind:
            by_kind[kind] += v
    return by_kind, list(r.deliveries), r.errors


def _row(
    name: str,
    measured: dict[str, float],
    pred: Any,
    got: list[tuple[str, str]],
    expected: list[tuple[str, str]],
    errors: list[str],
    seconds: float,
) -> dict[str, Any]:
    want, have = set(expected), set(got)
    hits = len(want & have)
    kinds = pred.by_kind()
    return {
        "strategy": name,
        **{k: int(measured[k]) for k in KINDS},
        "messages": int(sum(measured.values())),
        "predicted": int(sum(kinds[k] for k in KINDS)),
        "lower_bound": pred.lower_bound_total,
        "deliveries": len(got),
        "expected": len(expected),
        "recall": hits / len(want) if want else 1.0,
        "precision": hits / len(have) if have else 1.0,
        "duplicates": len(got) - len(have),
        "errors": errors,
        "seconds": round(seconds, 1),
    }


def _savings(rows: list[dict[str, Any]]) -> None:
    base = {r["strategy"]: r["messages"] for r in rows}
    for r in rows:
        for b in ("flooding-events", "flooding-subscriptions"):
            if base.get(b):
                r[f"saved_vs_{b}"] = round(100.0 * (base[b] - r["messages"]) / base[b], 1)


def _print_table(rows: list[dict[str, Any]], n_events: int) -> None:
    print(f"\ninter-region messages measured from the nodes' metrics ({n_events} events)")
    head = f"{'strategy':<24}{'event':>7}{'sub':>6}{'unsub':>6}{'deliv':>7}{'total':>7}{'model':>7}"
    print(head + f"{'vs f-ev':>9}{'vs f-sub':>9}{'recall':>8}{'precis':>8}{'dups':>5}")
    for r in rows:
        fe = r.get("saved_vs_flooding-events")
        fs = r.get("saved_vs_flooding-subscriptions")
        print(
            f"{r['strategy']:<24}{r['event']:>7}{r['subscribe']:>6}{r['unsubscribe']:>6}{r['delivery']:>7}"
            f"{r['messages']:>7}{r['predicted']:>7}"
            f"{'' if fe is None else f'{fe:+.0f}%':>9}{'' if fs is None else f'{fs:+.0f}%':>9}"
            f"{r['recall']:>8.3f}{r['precision']:>8.3f}{r['duplicates']:>5}"
        )
    if rows:
        print(
            "lower bound (remote brokers hosting a matching subscriber, per event, summed): "
            f"{rows[0]['lower_bound']}"
        )
