"""The pure half of ``geofed bench``: statistics, the report dict, Markdown and plots.

Nothing here starts a process or reads a clock: `geofed.bench.compare` runs
the federations and hands plain measurements to these functions, so that the
tables, savings and percentiles can be tested on hand-made inputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from geofed.node import (
    PEER_BYTES_SENT,
    PEER_MESSAGES_SENT,
    PEER_QUEUE_DROPPED,
    SUBSCRIBER_QUEUE_DROPPED,
)

from .scrape import Samples

KINDS = ("event", "subscribe", "unsubscribe", "relocate", "delivery")
"""Message kinds of the cost model (reports written before relocations count them as 0)."""
"""Logical inter-region message kinds (docs/design.md §5); ``control`` is reported apart."""
BASELINES = ("flooding-events", "flooding-subscriptions")
PERCENTILES = (50.0, 95.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) by linear interpolation between ranks.

    The same definition as numpy's default (``method="linear"``), so that
    figures can be re-derived from a delivery log with any common tool.
    None for no values.
    """
    if not values:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q!r}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_summary(latencies: Iterable[tuple[str, str, float]]) -> dict[str, dict[str, Any]]:
    """Publish-to-delivery latency in ms, same region and cross region apart.

    Args:
        latencies: (publisher broker, subscriber broker, seconds) per delivery.
            An empty publisher broker (unknown origin) is left out.

    Returns:
        ``{"same_region": {...}, "cross_region": {...}}``, each with ``n``,
        ``p50``, ``p95``, ``p99``, ``mean`` and ``max`` (None when n is 0).
    """
    groups: dict[str, list[float]] = {"same_region": [], "cross_region": []}
    for origin, broker, seconds in latencies:
        if not origin:
            continue
        groups["same_region" if origin == broker else "cross_region"].append(seconds * 1000.0)
    return {name: _stats(ms) for name, ms in groups.items()}


def _stats(ms: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(ms)}
    for q in PERCENTILES:
        p = percentile(ms, q)
        out[f"p{q:g}"] = None if p is None else round(p, 3)
    out["mean"] = round(sum(ms) / len(ms), 3) if ms else None
    out["max"] = round(max(ms), 3) if ms else None
    return out


def node_totals(before: Mapping[str, Samples], after: Mapping[str, Samples]) -> dict[str, Any]:
    """What the nodes counted between two scrapes of every broker's metrics.

    Args:
        before: per broker, the samples scraped once the federation was ready
            (so start-up is not counted).
        after: per broker, the samples scraped once the replay had drained.

    Returns:
        ``messages`` and ``bytes`` sent per kind (and ``total``, control
        excluded), ``control`` (messages, bytes), ``drops`` (peer and
        subscriber queues) and ``cpu_s`` (``sum``, ``max``, ``max_broker``,
        ``per_node``; None where a node exports no process metrics).
    """
    msgs = dict.fromkeys(KINDS, 0)
    byts = dict.fromkeys(KINDS, 0)
    control = {"messages": 0, "bytes": 0}
    drops = {"peer_queue": 0, "subscriber_queue": 0}
    cpu: dict[str, float | None] = {}
    for broker, samples in after.items():
        old = before.get(broker, {})
        cpu[broker] = None
        for key, value in samples.items():
            name, labels = key
            delta = value - old.get(key, 0.0)
            kind = dict(labels).get("kind")
            if name in (PEER_MESSAGES_SENT, PEER_BYTES_SENT):
                what = "messages" if name == PEER_MESSAGES_SENT else "bytes"
                if kind in msgs:
                    (msgs if what == "messages" else byts)[kind] += round(delta)
                elif kind == "control":
                    control[what] += round(delta)
            elif name == PEER_QUEUE_DROPPED:
                drops["peer_queue"] += round(delta)
            elif name == SUBSCRIBER_QUEUE_DROPPED:
                drops["subscriber_queue"] += round(delta)
            elif name == "process_cpu_seconds_total":
                cpu[broker] = round(delta, 3)
    known = {b: v for b, v in cpu.items() if v is not None}
    top = max(known, key=lambda b: known[b]) if known else None
    return {
        "messages": {**msgs, "total": sum(msgs.values())},
        "bytes": {**byts, "total": sum(byts.values())},
        "control": control,
        "drops": drops,
        "cpu_s": {
            "sum": round(sum(known.values()), 3) if known else None,
            "max": known[top] if top else None,
            "max_broker": top,
            "per_node": cpu,
        },
    }


def accuracy(got: Iterable[tuple[str, str]], expected: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """Recall and precision of the deliveries against the central matcher (oracle).

    Args:
        got: (event, subscription) per delivery received, duplicates included.
        expected: the oracle's (event, subscription) pairs.
    """
    got = list(got)
    want, have = set(expected), set(got)
    hits = len(want & have)
    return {
        "expected": len(want),
        "received": len(got),
        "recall": hits / len(want) if want else 1.0,
        "precision": hits / len(have) if have else 1.0,
        "duplicates": len(got) - len(have),
        "missing": len(want - have),
        "unexpected": len(have - want),
    }


def saved_percent(baseline: float | None, value: float) -> float | None:
    """Share of `baseline` that `value` saves, in percent (negative: costs more)."""
    if not baseline:
        return None
    return round(100.0 * (baseline - value) / baseline, 2)


def add_comparisons(rows: list[dict[str, Any]], model_totals: Mapping[str, int]) -> None:
    """Savings against both flooding baselines and the ratio to the lower bound, in place.

    A baseline's measured total is used when that strategy ran; otherwise its
    cost-model total (`model_totals`), and ``baseline_source`` says which.

    Args:
        rows: one per strategy run, with ``strategy``, ``messages.total``,
            ``bytes.total`` and ``lower_bound``.
        model_totals: the cost model's total messages for every strategy.
    """
    measured = {r["strategy"]: r for r in rows}
    for r in rows:
        r["savings"] = {}
        for base in BASELINES:
            ran = measured.get(base)
            msgs = ran["messages"]["total"] if ran else model_totals.get(base)
            entry: dict[str, Any] = {
                "baseline_source": "measured" if ran else "model",
                "messages_percent": saved_percent(msgs, r["messages"]["total"]),
            }
            # Bytes exist only where the baseline ran: the model counts messages.
            entry["bytes_percent"] = (
                saved_percent(ran["bytes"]["total"], r["bytes"]["total"]) if ran else None
            )
            r["savings"][base] = entry
        lb = r.get("lower_bound")
        r["ratio_to_lower_bound"] = round(r["messages"]["total"] / lb, 3) if lb else None


def spark_extract(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The figures `geofed bench` reports from the Spark analysis's summary.json.

    Per strategy: the what-if messages and payload bytes from the workload
    trace, and (with node traces) the messages the traces measured, with the
    comparison statuses of the non-control kinds.
    """
    out: dict[str, Any] = {
        "events": summary.get("events"),
        "deliveries": summary.get("deliveries"),
        "strategies": {},
    }
    for name, entry in (summary.get("strategies") or {}).items():
        out["strategies"][name] = {
            "what_if_messages": entry.get("messages"),
            "what_if_payload_bytes": entry.get("bytes"),
        }
    measured = summary.get("measured") or {}
    for row in measured.get("by_strategy_kind") or []:
        if row.get("kind") == "control":
            continue
        s = out["strategies"].setdefault(row["strategy"], {})
        s["traces_messages"] = s.get("traces_messages", 0) + int(row.get("measured") or 0)
        s["traces_bytes"] = s.get("traces_bytes", 0) + int(row.get("measured_bytes") or 0)
        statuses = s.setdefault("statuses", {})
        statuses[row["kind"]] = row.get("status")
    if measured:
        out["trace_records"] = measured.get("records")
        out["trace_errors"] = (measured.get("errors") or {}).get("total")
        out["duplicates"] = measured.get("duplicates")
    return out


# ---------------------------------------------------------------------------
# Markdown


def _num(x: Any, digits: int = 0) -> str:
    if x is None:
        return "–"
    if isinstance(x, float) and digits:
        return f"{x:,.{digits}f}"
    if isinstance(x, float):
        return f"{x:,.0f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _per(total: float, n: int) -> float | None:
    return total / n if n else None


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:+.1f}%"


def _table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown: settings, then one table per question."""
    w, s, m = report["workload"], report["settings"], report["machine"]
    rows = report["strategies"]
    out = [
        f"# geofed bench: {w.get('scenario') or w['file']} on {report['federation']['name']}"
        f" ({report['federation']['brokers']} brokers)",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}; machine: {m['description']};"
        f" load average {m['load_before']} before, {m['load_after']} after",
        f"- code: {_code(report.get('code'))}",
        f"- workload: {w['ops']:,} ops, {w['events']:,} events, {w['subscriptions']:,}"
        f" subscriptions, {w['clients']:,} clients over {w['duration_s']:.1f} s;"
        f" {w['expected_deliveries']:,} deliveries expected by the central matcher",
        f"- replay: {_replay_mode(s)}; WAN emulation: {s['wan']};"
        f" TLS: {'mutual between brokers, to clients' if s.get('tls') else 'off'}",
        "",
        "## Inter-region messages (measured from the nodes' metrics)",
        "",
    ]
    out += _table(
        (
            "strategy",
            *KINDS,
            "total",
            "per event",
            "cost model",
            "saved vs flooding-events",
            "saved vs flooding-subscriptions",
            "× lower bound",
        ),
        (
            (
                r["strategy"],
                *(_num(r["messages"].get(k, 0)) for k in KINDS),
                f"**{_num(r['messages']['total'])}**",
                _num(_per(r["messages"]["total"], w["events"]), 2),
                _num(r["model"]["total"]),
                _pct(r["savings"]["flooding-events"]["messages_percent"]),
                _pct(r["savings"]["flooding-subscriptions"]["messages_percent"]),
                _num(r["ratio_to_lower_bound"], 2),
            )
            for r in rows
        ),
    )
    lb = rows[0]["lower_bound"] if rows else None
    control = ", ".join(f"{r['strategy']} {_num(r['control']['messages'])}" for r in rows)
    out += [
        "",
        f"Lower bound (per event, the remote brokers hosting a matching subscription, summed):"
        f" {_num(lb)}. Control traffic (hello, acks, snapshots) is not in the totals:"
        f" {control} control messages.",
        "",
        "## Inter-region bytes (serialized message sizes, from the nodes' metrics)",
        "",
    ]
    out += _table(
        (
            "strategy",
            *KINDS,
            "total",
            "saved vs flooding-events",
            "saved vs flooding-subscriptions",
        ),
        (
            (
                r["strategy"],
                *(_num(r["bytes"].get(k, 0)) for k in KINDS),
                f"**{_num(r['bytes']['total'])}**",
                _pct(r["savings"]["flooding-events"]["bytes_percent"]),
                _pct(r["savings"]["flooding-subscriptions"]["bytes_percent"]),
            )
            for r in rows
        ),
    )
    out += [
        "",
        "## Deliveries against the central matcher",
        "",
    ]
    out += _table(
        (
            "strategy",
            "expected",
            "received",
            "recall",
            "precision",
            "duplicates",
            "missing",
            "unexpected",
            "dropped (peer / subscriber queues)",
            "replay errors",
        ),
        (
            (
                r["strategy"],
                _num(r["deliveries"]["expected"]),
                _num(r["deliveries"]["received"]),
                f"{r['deliveries']['recall']:.4f}",
                f"{r['deliveries']['precision']:.4f}",
                _num(r["deliveries"]["duplicates"]),
                _num(r["deliveries"]["missing"]),
                _num(r["deliveries"]["unexpected"]),
                f"{_num(r['drops']['peer_queue'])} / {_num(r['drops']['subscriber_queue'])}",
                _num(r["replay"]["errors"]),
            )
            for r in rows
        ),
    )
    out += [
        "",
        "## Delivery latency (ms, publish → delivery, on the brokers' clocks)",
        "",
    ]
    out += _table(
        ("strategy", "same-region n", "p50", "p95", "p99", "cross-region n", "p50", "p95", "p99"),
        (
            (
                r["strategy"],
                *(
                    _num(r["latency_ms"][g][f], 1) if f != "n" else _num(r["latency_ms"][g]["n"])
                    for g in ("same_region", "cross_region")
                    for f in ("n", "p50", "p95", "p99")
                ),
            )
            for r in rows
        ),
    )
    out += ["", "## Throughput and CPU", ""]
    out += _table(
        (
            "strategy",
            "events",
            "replay s",
            "events/s",
            "drain s",
            "events/s incl. drain",
            "max lag behind schedule s",
            "CPU s (all nodes)",
            "CPU s (busiest node)",
        ),
        (
            (
                r["strategy"],
                _num(r["replay"]["events"]),
                _num(r["replay"]["seconds"], 1),
                _num(r["replay"]["events_per_s"], 1),
                _num(r["replay"].get("drain_s"), 2),
                _num(r["replay"].get("sustained_events_per_s"), 1),
                _num(r["replay"]["max_lag_s"], 2),
                _num(r["cpu_s"]["sum"], 1),
                f"{_num(r['cpu_s']['max'], 1)} ({r['cpu_s']['max_broker'] or '–'})",
            )
            for r in rows
        ),
    )
    out += _analysis_md(report.get("analysis"), rows)
    plots = report.get("plots") or []
    if plots:
        out += ["", "## Plots", ""]
        out += [f"![{p}]({p})" for p in plots]
    return "\n".join(out) + "\n"


def summary(report: Mapping[str, Any]) -> str:
    """One compact table: messages by kind against the cost model, savings, accuracy."""
    rows, w = report["strategies"], report["workload"]
    head = f"{'strategy':<24}{'event':>7}{'sub':>6}{'unsub':>6}{'deliv':>7}{'total':>7}{'model':>7}"
    out = [
        f"inter-region messages measured from the nodes' metrics ({w['events']:,} events)",
        head + f"{'vs f-ev':>9}{'vs f-sub':>9}{'recall':>8}{'precis':>8}{'dups':>5}",
    ]
    for r in rows:
        m, d = r["messages"], r["deliveries"]
        fe = r["savings"]["flooding-events"]["messages_percent"]
        fs = r["savings"]["flooding-subscriptions"]["messages_percent"]
        out.append(
            f"{r['strategy']:<24}{m['event']:>7}{m['subscribe']:>6}{m['unsubscribe']:>6}"
            f"{m['delivery']:>7}{m['total']:>7}{r['model']['total']:>7}"
            f"{'' if fe is None else f'{fe:+.0f}%':>9}{'' if fs is None else f'{fs:+.0f}%':>9}"
            f"{d['recall']:>8.3f}{d['precision']:>8.3f}{d['duplicates']:>5}"
        )
    if rows:
        out.append(
            "lower bound (remote brokers hosting a matching subscriber, per event, summed): "
            f"{rows[0]['lower_bound']}"
        )
    return "\n".join(out)


def _code(code: Mapping[str, Any] | None) -> str:
    if not code or not code.get("commit"):
        return "not a git checkout"
    return f"commit {code['commit'][:12]}" + (
        " with uncommitted changes in the tree" if code.get("modified") else ""
    )


def _replay_mode(s: Mapping[str, Any]) -> str:
    if s["barrier"]:
        return "barrier after every action (no inter-broker message in flight): exact"
    if not s["speed"]:
        return "as fast as possible, no barrier"
    return f"honouring the trace's `t` at speed ×{s['speed']:g}, no barrier"


def _analysis_md(
    analysis: Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]]
) -> list[str]:
    out = ["", "## Spark analysis (`geofed analyze`)", ""]
    if not analysis:
        return [*out, "Not run (`--no-analysis`)."]
    if analysis.get("error"):
        return [*out, f"Failed: {analysis['error']}"]
    per = analysis["strategies"]
    metrics = {r["strategy"]: r["messages"]["total"] for r in rows}
    out += _table(
        (
            "strategy",
            "what-if messages (workload trace)",
            "what-if payload bytes",
            "measured (node traces)",
            "measured (metrics)",
            "trace vs what-if",
        ),
        (
            (
                name,
                _num(e.get("what_if_messages")),
                _num(e.get("what_if_payload_bytes")),
                _num(e.get("traces_messages")),
                _num(metrics.get(name)),
                ", ".join(f"{k} {v}" for k, v in sorted((e.get("statuses") or {}).items())) or "–",
            )
            for name, e in per.items()
        ),
    )
    out += [
        "",
        f"{_num(analysis.get('trace_records'))} node-trace records,"
        f" {_num(analysis.get('trace_errors'))} malformed; the analysis's own files:"
        " `analysis-summary.json`, `analysis-savings.png`, `analysis-heatmap.png`.",
    ]
    return out


# ---------------------------------------------------------------------------
# Plots


def plot(report: Mapping[str, Any], out_dir: Path) -> list[str]:
    """Write the PNG plots into `out_dir`; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")  # files only; benchmark machines have no display
    import matplotlib.pyplot as plt

    rows = report["strategies"]
    if not rows:
        return []
    names = [r["strategy"] for r in rows]
    labels = [n.replace("-", "-\n", 1) for n in names]
    x = list(range(len(rows)))
    colors = {
        "event": "#1f77b4",
        "subscribe": "#2ca02c",
        "unsubscribe": "#98df8a",
        "relocate": "#9467bd",
        "delivery": "#ff7f0e",
    }
    files: list[str] = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, what, unit in ((axes[0], "messages", "messages"), (axes[1], "bytes", "bytes")):
        bottom = [0.0] * len(rows)
        for kind in KINDS:
            vals = [float(r[what].get(kind, 0)) for r in rows]
            ax.bar(x, vals, bottom=bottom, color=colors[kind], label=kind)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        for i, r in enumerate(rows):
            fe = r["savings"]["flooding-events"][f"{what}_percent"]
            fs = r["savings"]["flooding-subscriptions"][f"{what}_percent"]
            ax.annotate(
                f"{r[what]['total']:,}\n{_pct(fe)} vs FE\n{_pct(fs)} vs FS",
                (i, bottom[i]),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        if what == "messages":
            lb = rows[0]["lower_bound"]
            ax.axhline(
                lb, color="#d62728", linestyle="--", linewidth=1, label=f"lower bound ({lb:,})"
            )
            ax.scatter(
                x,
                [r["model"]["total"] for r in rows],
                marker="_",
                s=400,
                color="black",
                zorder=3,
                label="cost model",
            )
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_ylabel(f"inter-region {unit}")
        # Room above the tallest bar for its three-line label.
        ax.set_ylim(0, max(max(bottom), 1.0) * 1.35)
        ax.legend(fontsize=7)
    fig.suptitle("Inter-region traffic per strategy (measured; FE/FS: saved vs flooding)")
    fig.tight_layout()
    files.append(_save(fig, out_dir, "messages.png"))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    width = 0.25
    for ax, group in zip(axes, ("same_region", "cross_region"), strict=True):
        for j, q in enumerate(("p50", "p95", "p99")):
            vals = [r["latency_ms"][group][q] or 0.0 for r in rows]
            ax.bar([i + (j - 1) * width for i in x], vals, width, label=q)
        counts = [
            f"{lab}\nn={r['latency_ms'][group]['n']:,}" for lab, r in zip(labels, rows, strict=True)
        ]
        ax.set_xticks(x, counts, fontsize=8)
        ax.set_title(group.replace("_", " "))
        ax.margins(y=0.15)
        ax.set_ylabel("publish → delivery (ms)")
        ax.legend(fontsize=8)
    fig.suptitle("Delivery latency")
    fig.tight_layout()
    files.append(_save(fig, out_dir, "latency.png"))
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    axes[0].bar(
        [i - 0.2 for i in x], [r["cpu_s"]["sum"] or 0.0 for r in rows], 0.4, label="all nodes"
    )
    axes[0].bar(
        [i + 0.2 for i in x], [r["cpu_s"]["max"] or 0.0 for r in rows], 0.4, label="busiest node"
    )
    axes[0].set_ylabel("CPU seconds during the replay")
    axes[0].legend(fontsize=8)
    axes[1].bar(
        [i - 0.2 for i in x],
        [r["replay"]["events_per_s"] or 0.0 for r in rows],
        0.4,
        label="published",
    )
    axes[1].bar(
        [i + 0.2 for i in x],
        [r["replay"].get("sustained_events_per_s") or 0.0 for r in rows],
        0.4,
        label="absorbed (until every inter-broker message arrived)",
    )
    axes[1].set_ylabel("events/s in the replay")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(x, labels, fontsize=8)
    fig.suptitle("CPU and throughput")
    fig.tight_layout()
    files.append(_save(fig, out_dir, "cpu-throughput.png"))
    plt.close(fig)
    return files


def _save(fig: Any, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / name, dpi=110)
    return name
