"""Scale benchmark of the Spark analysis: 1M- and 10M-event workloads on local[2].

Generates each workload with `geofed.bench.workload` (JSON Lines), runs
``geofed analyze`` on it as its own process (JVM start included), records
wall time, events per second and the job's stage timings, and writes
bench/results/spark.md. Generated traces are deleted afterwards unless
--keep is given.

    python -m geofed.bench.spark_scale_bench            # 1M and 10M events
    python -m geofed.bench.spark_scale_bench --events 100000 --results /tmp/spark.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from geofed.bench import WorkloadConfig, generate, write_trace
from geofed.bench._machine import cpu_model

REPO = Path(__file__).resolve().parents[1]
# Subscribers ask for data from a circle around themselves (10% world-wide),
# events carry none: the geofenced-subscription case the H3 join is for.
SCENARIO = "open-data"
CLIENTS = 4000  # half publish at 1 Hz: 2000 events per second of trace time
TARGET_S = 600.0
TARGET_RATIO = 11.0


def machine() -> dict[str, Any]:
    """Cores, CPU model, RAM and load: the benchmark shares its machine."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "ram_gib": round(ram, 1),
        "python": platform.python_version(),
        "load": os.getloadavg(),
    }


def generate_trace(events: int, path: Path, seed: int) -> dict[str, Any]:
    """Write a workload of about `events` events; return what it holds."""
    publishers = CLIENTS // 2
    cfg = WorkloadConfig(
        scenario=SCENARIO, clients=CLIENTS, duration_s=events / publishers, seed=seed
    )
    start = time.monotonic()
    summary = write_trace(generate(cfg), path)
    return {
        "ops": summary.ops,
        "bytes": path.stat().st_size,
        "generate_s": round(time.monotonic() - start, 1),
        "config": {
            "scenario": SCENARIO,
            "clients": CLIENTS,
            "duration_s": cfg.duration_s,
            "seed": seed,
        },
    }


def run_job(
    federation: Path, trace: Path, out: Path, master: str, extra: list[str]
) -> tuple[float, list[str]]:
    """Run ``geofed analyze`` as a process; return its wall time and command."""
    cmd = [
        sys.executable,
        "-m",
        "geofed.bench.analyze",
        "--master",
        master,
        "-f",
        str(federation),
        "-w",
        str(trace),
        "-o",
        str(out),
        "--force",  # the benchmark's own folder
        "--no-plots",
        *extra,
    ]
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - start, cmd


def shown(cmd: list[str], workdir: str) -> str:
    """A command as the results page shows it: relative to the repository, no machine paths."""
    words = ["python" if c == sys.executable else c for c in cmd]
    words = [os.path.relpath(c, REPO) if c.startswith(str(REPO) + os.sep) else c for c in words]
    words = [c.replace(workdir.rstrip("/"), "<workdir>") for c in words]
    return " ".join(shlex.quote(c) if "<workdir>" not in c else c for c in words)


def report(rows: list[dict[str, Any]], env: dict[str, Any], argv: list[str]) -> str:
    """The results page."""
    lines = [
        "# Spark analysis: scale benchmark",
        "",
        f"Date: {env['date']}. Machine: {env['machine']['cores']} cores ({env['machine']['cpu']}),"
        f" {env['machine']['ram_gib']} GiB RAM, Python {env['machine']['python']}."
        f" Load average before / after: {env['load_before']} / {env['load_after']}"
        " (the machine is shared; other jobs ran alongside).",
        "",
        "Reproduce:",
        "",
        "```",
        "python -m geofed.bench.spark_scale_bench " + " ".join(shlex.quote(a) for a in argv),
        "```",
        "",
        f"Workload: `geofed.bench.workload`, scenario `{SCENARIO}`, {CLIENTS} clients (half publish"
        " at 1 Hz, half hold two subscriptions each, 10% world-wide), JSON Lines; federation"
        f" `{env['federation']}`; Spark `{env['master']}`, one process per run"
        " (JVM start included).",
        "",
        "| events | ops | trace size | wall time | events/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['events']:,} | {sum(r['ops'].values()):,} | {r['bytes'] / 1e9:.2f} GB"
            f" | {r['wall_s']:.0f} s | {r['events'] / r['wall_s']:,.0f} |"
        )
    lines += ["", "Where the time goes (seconds per stage of the job, from its summary.json):", ""]
    lines.append("| stage | " + " | ".join(r["label"] for r in rows) + " |")
    lines.append("|---|" + "---:|" * len(rows))
    for stage in rows[0]["timings"]:
        lines.append(
            f"| {stage} | " + " | ".join(f"{r['timings'].get(stage, 0):.1f}" for r in rows) + " |"
        )
    lines.append("")
    by = {r["label"]: r for r in rows}
    if "1M" in by and "10M" in by:
        ratio = by["10M"]["wall_s"] / by["1M"]["wall_s"]
        ten = by["10M"]["wall_s"]
        lines += [
            f"1M -> 10M time ratio: **{ratio:.2f}x** (target <= {TARGET_RATIO:g}x:"
            f" {'met' if ratio <= TARGET_RATIO else 'missed'}).",
            f"10M events: **{ten:.0f} s** (target < {TARGET_S:.0f} s:"
            f" {'met' if ten < TARGET_S else 'missed'}).",
            "",
        ]
    lines += ["Commands run (from the repository's root; <workdir> is --workdir):", ""]
    lines += [f"- {r['label']}: `{shown(r['command'], env['workdir'])}`" for r in rows]
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Generate, run, record; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument(
        "--federation", default=str(REPO / "deploy" / "federations" / "aws-2020.geojson")
    )
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--workdir", default="/tmp/geofed-spark-bench")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "spark.md"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the generated traces")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="analyze a trace left in --workdir by an earlier --keep run instead of generating it",
    )
    parser.add_argument("--conf", action="append", default=[], help="passed to geofed analyze")
    args = parser.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "federation": os.path.relpath(args.federation, REPO),
        "master": args.master,
        "workdir": str(work),
    }
    env["load_before"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rows: list[dict[str, Any]] = []
    extra = [x for c in args.conf for x in ("--conf", c)]
    for n in args.events:
        label = f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n:,}"
        trace = work / f"trace-{n}.jsonl"
        out = work / f"out-{n}"
        if args.reuse and trace.exists():
            info = {"ops": None, "bytes": trace.stat().st_size, "generate_s": 0.0}
        else:
            print(f"[bench] generating {label} events -> {trace}", file=sys.stderr, flush=True)
            info = generate_trace(n, trace, args.seed)
        print(
            f"[bench] {info['ops']} in {info['generate_s']} s; analyzing",
            file=sys.stderr,
            flush=True,
        )
        try:
            wall, cmd = run_job(Path(args.federation), trace, out, args.master, extra)
        finally:
            if not args.keep:
                trace.unlink(missing_ok=True)
        summary = json.loads((out / "summary.json").read_text())
        rows.append(
            {
                "label": label,
                "events": summary["events"],
                "ops": info["ops"] or summary["ops"]["by_op"],
                "bytes": info["bytes"],
                "wall_s": wall,
                "timings": summary["timings_s"],
                "command": cmd,
                "matching": summary["matching"],
            }
        )
        print(
            f"[bench] {label}: {wall:.0f} s, {summary['events'] / wall:,.0f} events/s",
            file=sys.stderr,
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    env["load_after"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    text = report(rows, env, given)
    Path(args.results).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
