"""Output of the analysis: a table on stdout, JSON, Parquet and PNG plots in a folder.

Files written into the output folder:

- ``summary.json``: inputs, op and error counts (first errors with their
  line numbers), totals per strategy and kind, savings against both flooding
  baselines, the region matrix, top topics, the measured comparison, timings;
- ``messages.parquet``: the fact table (strategy, kind, src, dst, topic,
  messages, bytes) of the what-if analysis, lower bound included;
- ``errors.parquet``: every malformed workload row (file, line, error);
- ``comparison.parquet`` / ``comparison_topics.parquet`` (with node traces):
  predicted vs measured per (strategy, kind, src, dst) and per topic;
- ``savings.png`` and ``heatmap.png``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from pyspark.sql import DataFrame

from . import _cost as cost
from . import _fs as fs
from ._job import Analysis

ORDER = (
    cost.FLOOD_EVENTS,
    cost.FLOOD_SUBS,
    cost.EVENT_GEOFENCE,
    cost.SUB_GEOFENCE,
    cost.LOWER_BOUND,
)


def print_table(summary: dict[str, Any], out: TextIO) -> None:
    """The human-readable result."""
    fed = summary["federation"]
    ops = summary["ops"]
    print(
        f"workload {', '.join(summary['workload']['files'])} on {fed['file']}"
        f" ({len(fed['brokers'])} brokers)",
        file=out,
    )
    print(
        f"{summary['events']:,} events, {ops['valid']:,} valid ops, {ops['malformed']:,} malformed;"
        f" {summary['subscriptions']['versions']:,} subscriptions;"
        f" {summary['deliveries']:,} deliveries (central matcher)",
        file=out,
    )
    head = (
        "strategy",
        "event",
        "subscribe",
        "unsubscribe",
        "delivery",
        "total",
        "payload bytes",
        "saved vs flooding-events",
        "saved vs flooding-subs",
        "x lower bound",
    )
    rows = []
    for s in ORDER:
        e = summary["strategies"][s]
        k = e["by_kind"]
        sv = e["savings"]
        rows.append(
            (
                s,
                f"{k['event']['messages']:,}",
                f"{k['subscribe']['messages']:,}",
                f"{k['unsubscribe']['messages']:,}",
                f"{k['delivery']['messages']:,}",
                f"{e['messages']:,}",
                f"{e['bytes']:,}",
                _pct(sv[cost.FLOOD_EVENTS]["percent"]),
                _pct(sv[cost.FLOOD_SUBS]["percent"]),
                "-" if e["over_lower_bound"] is None else f"{e['over_lower_bound']:.2f}",
            )
        )
    print(file=out)
    _grid(head, rows, out)
    measured = summary.get("measured")
    if measured:
        print(file=out)
        print(
            f"measured: {measured['records']:,} node-trace records,"
            f" {measured['errors']['total']:,} malformed",
            file=out,
        )
        mrows = [
            (
                r["strategy"],
                r["kind"],
                f"{r['predicted']:,}",
                f"{r['measured']:,}",
                f"{r['delta']:+,}",
                r["status"],
            )
            for r in measured["by_strategy_kind"]
        ]
        _grid(("strategy", "kind", "predicted", "measured", "delta", "status"), mrows, out)
        diffs = [d for d in measured["differences"] if d["status"] != "not-modelled"]
        cells = measured["cells_by_status"]
        print(
            "region pairs: "
            + ", ".join(f"{n:,} {s}" for s, n in sorted(cells.items()))
            + f"; topics differing: {measured['topic_differences']:,}",
            file=out,
        )
        for d in diffs[:20]:
            print(
                f"  DIFF {d['strategy']} {d['kind']} {d['src']}->{d['dst']}:"
                f" predicted {d['predicted']:,}, measured {d['measured']:,} ({d['status']})",
                file=out,
            )
        for d in measured["duplicates"]:
            print(f"  DUPLICATES {d['strategy']} {d['kind']}: {d['duplicates']:,}", file=out)
        extra = {
            r["strategy"]: r["delta"]
            for r in measured["by_strategy_kind"]
            if r["kind"] == "unsubscribe" and r["delta"] > 0
        }
        if extra:
            print(
                "  NOTE more unsubscribes measured than the workload has ("
                + ", ".join(f"{s} {n:+,}" for s, n in sorted(extra.items()))
                + "): a client that closes withdraws its subscriptions, and a replay's"
                " clients close after its last action. geofed bench keeps the traces of"
                " its measurement window, which ends before that, in <strategy>/measured/.",
                file=out,
            )
    _print_errors("workload", summary["errors"], out)
    if measured:
        _print_errors("node trace", measured["errors"], out)


def _print_errors(what: str, errors: dict[str, Any], out: TextIO) -> None:
    if not errors["total"]:
        return
    print(file=out)
    print(f"{errors['total']:,} malformed {what} rows; the first {len(errors['shown'])}:", file=out)
    for e in errors["shown"]:
        print(f"  {e['file']}: {e['error']}", file=out)


def _pct(p: float | None) -> str:
    return "-" if p is None else f"{p:.1f}%"


def _change(saved_percent: float | None) -> str:
    # Savings of 92% read as a change of -92%, a 30% overhead as +30%.
    return "-" if saved_percent is None else f"{0.0 - saved_percent:+.1f}%"


def _grid(head: Sequence[str], rows: Sequence[Sequence[Any]], out: TextIO) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*head), file=out)
    for r in rows:
        print(fmt.format(*r), file=out)


def write_outputs(
    result: Analysis,
    out_dir: str,
    *,
    plots: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Write the Parquet tables (Spark), then summary.json and the plots; return their paths.

    `out_dir` is a local path or a URI: the tables go through Spark's writers
    (any filesystem the cluster has a connector for), the driver's files
    through fsspec with `storage_options` (`_fs.storage_options`).
    """
    written: list[str] = []

    def parquet(df: DataFrame, name: str) -> None:
        path = fs.join(out_dir, name)
        df.write.mode("overwrite").parquet(path)
        written.append(path)

    # One sorted file: the table is aggregated (regions^2 x kinds x topics), a
    # global sort would cost a sampling job for nothing.
    messages = result.messages.coalesce(1).sortWithinPartitions(
        "strategy", "kind", "src", "dst", "topic"
    )
    parquet(messages, "messages.parquet")
    if result.malformed is not None:
        parquet(result.malformed, "errors.parquet")
    if result.comparison is not None:
        parquet(result.comparison, "comparison.parquet")
    if result.comparison_topics is not None:
        parquet(result.comparison_topics, "comparison_topics.parquet")
    written.extend(write_driver_files(result.summary, out_dir, plots, storage_options or {}))
    return written


def write_driver_files(
    summary: dict[str, Any], out_dir: str, plots: bool, storage_options: Mapping[str, Any]
) -> list[str]:
    """summary.json and (with `plots`) the PNGs, written by the driver through fsspec."""
    files = {"summary.json": (json.dumps(summary, indent=2, default=str) + "\n").encode()}
    if plots:
        files.update(plot(summary))
    written = []
    for name, data in files.items():
        path = fs.join(out_dir, name)
        fs.write_bytes(path, data, storage_options)
        written.append(path)
    return written


def plot(summary: dict[str, Any]) -> dict[str, bytes]:
    """savings.png (messages per strategy) and heatmap.png (region x region per strategy)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    strategies = summary["strategies"]
    totals = [strategies[s]["messages"] for s in ORDER]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    colors = ["#9e9e9e", "#757575", "#1f77b4", "#2ca02c", "#d62728"]
    bars = ax.bar(range(len(ORDER)), totals, color=colors)
    for i, (b, s) in enumerate(zip(bars, ORDER, strict=True)):
        sv = strategies[s]["savings"]
        label = (
            f"{totals[i]:,}\n{_change(sv[cost.FLOOD_EVENTS]['percent'])} vs FE\n"
            f"{_change(sv[cost.FLOOD_SUBS]['percent'])} vs FS"
        )
        ax.annotate(
            label,
            (b.get_x() + b.get_width() / 2, b.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(ORDER)), [s.replace("-", "-\n", 1) for s in ORDER], fontsize=8)
    ax.set_ylabel("inter-region messages")
    ax.set_title(f"Inter-region messages per strategy ({summary['events']:,} events)")
    ax.margins(y=0.25)
    fig.tight_layout()
    savings = io.BytesIO()
    fig.savefig(savings, format="png", dpi=120)
    plt.close(fig)

    ids = summary["federation"]["brokers"]
    matrix = summary["matrix"]
    cols = 3
    rows = math.ceil(len(ORDER) / cols)
    size = max(4.0, 0.28 * len(ids) + 2)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * size, rows * size), squeeze=False)
    peak = max([v for m in matrix.values() for row in m.values() for v in row.values()] or [1])
    image = None
    for i, s in enumerate(ORDER):
        ax = axes[i // cols][i % cols]
        grid = [[matrix.get(s, {}).get(a, {}).get(b, 0) for b in ids] for a in ids]
        masked = [[v if v > 0 else float("nan") for v in row] for row in grid]
        image = ax.imshow(masked, norm=LogNorm(vmin=1, vmax=max(1, peak)), cmap="viridis")
        ax.set_title(f"{s} ({strategies[s]['messages']:,})", fontsize=9)
        ax.set_xticks(range(len(ids)), ids, rotation=90, fontsize=6)
        ax.set_yticks(range(len(ids)), ids, fontsize=6)
        ax.set_xlabel("dst", fontsize=7)
        ax.set_ylabel("src", fontsize=7)
    for j in range(len(ORDER), rows * cols):
        axes[j // cols][j % cols].axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6, label="messages (log)")
    heatmap = io.BytesIO()
    fig.savefig(heatmap, format="png", dpi=110)
    plt.close(fig)
    return {"savings.png": savings.getvalue(), "heatmap.png": heatmap.getvalue()}
