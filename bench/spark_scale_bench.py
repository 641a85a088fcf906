"""Scale benchmark of the Spark analysis: 1M- and 10M-event workloads on local[2].

Generates each workload with `geofed.bench.workload` (JSON Lines, or Parquet
with --trace-format parquet), runs
``geofed analyze`` on it as its own process (JVM start included), records
wall time, events per second and the job's stage timings, and writes
bench/results/spark.md. Generated traces are deleted afterwards unless
--keep is given.

    python -m geofed.bench.spark_scale_bench            # 1M and 10M events
    python -m geofed.bench.spark_scale_bench --events 100000 --results /tmp/spark.md
    python -m geofed.bench.spark_scale_bench --baseline /tmp/before/site --reuse --keep
    python -m geofed.bench.spark_scale_bench --trace-format parquet --reuse --keep

With --baseline (a folder holding an older geofed, put first on PYTHONPATH)
each size runs that version first and this one right after, on the same
trace: the machine is shared, so a comparison only holds between runs made
back to back. Each run records the load average at its start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from geofed.bench import WorkloadConfig, generate, write_trace
from geofed.bench._machine import TreeCpu, machine_cpu_seconds, record

REPO = Path(__file__).resolve().parents[1]
# Subscribers ask for data from a circle around themselves (10% world-wide),
# events carry none: the geofenced-subscription case the H3 join is for.
SCENARIO = "open-data"
CLIENTS = 4000  # half publish at 1 Hz: 2000 events per second of trace time
TARGET_S = 600.0
TARGET_RATIO = 11.0


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
        "bytes": _size(path),
        "generate_s": round(time.monotonic() - start, 1),
        "config": {
            "scenario": SCENARIO,
            "clients": CLIENTS,
            "duration_s": cfg.duration_s,
            "seed": seed,
        },
    }


STAGE_DONE = re.compile(r"^\[geofed analyze +[0-9.]+s\] (.+): done in ([0-9.]+)s$")
"""A stage's progress line on the job's stderr (`analysis._job.Progress`)."""
STAGE_START = re.compile(r"^\[geofed analyze +[0-9.]+s\] (.+) \.\.\.$")
"""The line a stage starts with."""
RENAMED = {"workload: validating ops (parse_op in executors)": "workload: validating ops"}
"""Stages older versions named otherwise: their name now."""


def _size(path: Path) -> int:
    """Bytes of a trace: a file, or a folder of files (a Parquet trace Spark wrote)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _cpu(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.0f}"


def load() -> str:
    """The 1-minute load average: the machine is shared, every figure carries it."""
    return f"{os.getloadavg()[0]:.1f}"


def run_job(
    federation: Path,
    trace: Path,
    out: Path,
    master: str,
    extra: list[str],
    *,
    pythonpath: str | None = None,
    stop_after: str | None = None,
) -> dict[str, Any]:
    """Run ``geofed analyze`` as a process: its wall time, stage times, command and loads.

    `pythonpath` runs another geofed (an older version, unpacked) with the
    same command; `stop_after` ends the run once that stage is done (wall
    time and summary are then missing): the older version may take far
    longer than the stages compared.
    """
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
        "--no-plots",
        *(["--force"] if pythonpath is None else []),  # --force: the benchmark's own folder
        *extra,
    ]
    if pythonpath is not None:
        shutil.rmtree(out, ignore_errors=True)  # an older version may lack --force
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    stages: dict[str, float] = {}
    cpu: dict[str, float] = {}  # CPU seconds of the job's processes per stage
    machine: dict[str, float] = {}  # the machine's CPU seconds per stage
    started: float | None = None
    machine_started: float | None = None
    last: float | None = None  # the tree's CPU seconds at the last stage's end
    first = load()
    start = time.monotonic()
    machine_start = machine_cpu_seconds()
    stopped = False
    with (
        subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: stopping it stops its JVM too
        ) as proc,
        TreeCpu(proc.pid) as tree,
    ):
        assert proc.stderr is not None
        for line in proc.stderr:
            if STAGE_START.match(line.strip()):
                started = tree.seconds()
                machine_started = machine_cpu_seconds()
            done = STAGE_DONE.match(line.strip())
            if done:
                name = RENAMED.get(done.group(1), done.group(1))
                stages[name] = float(done.group(2))
                machine_now = machine_cpu_seconds()
                if machine_started is not None and machine_now is not None:
                    machine[name] = machine_now - machine_started
                now = tree.seconds()
                if started is not None and now is not None:
                    cpu[name] = now - started
                    last = now
                if name == stop_after:
                    os.killpg(proc.pid, signal.SIGTERM)
                    stopped = True
                    break
        proc.stderr.close()
        code = proc.wait()
    wall = time.monotonic() - start
    machine_end = machine_cpu_seconds()
    if code != 0 and not stopped:
        raise subprocess.CalledProcessError(code, cmd)
    summary = None if stopped else json.loads((out / "summary.json").read_text())
    return {
        "wall_s": None if stopped else wall,
        "timings": stages,
        "cpu": cpu,
        "machine_cpu": machine,
        "cpu_s": None if stopped else last,
        "machine_cpu_s": None
        if stopped or machine_start is None or machine_end is None
        else machine_end - machine_start,
        "summary": summary,
        "command": cmd,
        "load": f"{first} -> {load()}",
    }


def shown(cmd: list[str], workdir: str) -> str:
    """A command as the results page shows it: relative to the repository, no machine paths."""
    words = ["python" if c == sys.executable else c for c in cmd]
    words = [os.path.relpath(c, REPO) if c.startswith(str(REPO) + os.sep) else c for c in words]
    words = [c.replace(workdir.rstrip("/"), "<workdir>") for c in words]
    return " ".join(shlex.quote(c) if "<workdir>" not in c else c for c in words)


FORMATS = {"json": ("jsonl", "JSON Lines"), "parquet": ("parquet", "Parquet")}
"""--trace-format: the trace's file suffix (`write_trace` picks the format by it) and name."""


def report(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The body of the results section (`record` writes command and machine above it)."""
    lines = [
        f"Workload: `geofed.bench.workload`, scenario `{SCENARIO}`, {CLIENTS} clients (half publish"
        f" at 1 Hz, half hold two subscriptions each, 10% world-wide), {env['format']};"
        " federation"
        f" `{env['federation']}`; Spark `{env['master']}`, one process per run"
        " (JVM start included). The machine is shared: load is the 1-minute load average"
        " at each run's start -> end.",
        "",
        "| run | ops | trace size | wall time | CPU s | machine CPU s | events/s | load |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        wall = r["wall_s"]
        lines.append(
            f"| {r['label']} | {sum(r['ops'].values()):,} | {r['bytes'] / 1e9:.2f} GB"
            + (
                f" | {wall:.0f} s | {_cpu(r.get('cpu_s'))} | {_cpu(r.get('machine_cpu_s'))}"
                f" | {r['events'] / wall:,.0f}"
                if wall is not None
                else f" | stopped after {r['stop_after']!r} | - | - | -"
            )
            + f" | {r['load']} |"
        )
    lines += [
        "",
        "CPU s: user + system seconds of the job's processes up to the end of its last stage"
        " (processes that ended unreaped, such as PySpark workers, are missed). Machine CPU"
        " s: user + system seconds of the whole machine over the run, every process of the"
        " job included: the job's cost when nothing else runs, an upper bound otherwise.",
        "",
        "Where the time goes (seconds per stage of the job):",
        "",
    ]
    lines.append("| stage | " + " | ".join(r["label"] for r in rows) + " |")
    lines.append("|---|" + "---:|" * len(rows))
    stages = list(dict.fromkeys(stage for r in rows for stage in r["timings"]))
    for stage in stages:
        cells = [r["timings"].get(stage) for r in rows]
        lines.append(
            f"| {stage} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |"
        )
    lines.append("")
    for key, title in (
        (
            "cpu",
            "CPU seconds per stage (user + system of the job's processes: the driver, its JVM"
            " and the JVM's Python workers; less sensitive to the machine's load than wall"
            " time):",
        ),
        (
            "machine_cpu",
            "The machine's CPU seconds per stage (every process, those that ended unreaped"
            " included: the stage's cost when nothing else runs, an upper bound otherwise):",
        ),
    ):
        if not any(r.get(key) for r in rows):
            continue
        lines += [
            title,
            "",
            "| stage | " + " | ".join(r["label"] for r in rows) + " |",
            "|---|" + "---:|" * len(rows),
        ]
        for stage in stages:
            cells = [r.get(key, {}).get(stage) for r in rows]
            lines.append(
                f"| {stage} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |"
            )
        lines.append("")
    walls = {r["label"]: r["wall_s"] for r in rows if r["wall_s"] is not None}
    if "1M" in walls and "10M" in walls:
        ratio = walls["10M"] / walls["1M"]
        lines += [
            f"1M -> 10M time ratio: **{ratio:.2f}x** (target <= {TARGET_RATIO:g}x:"
            f" {'met' if ratio <= TARGET_RATIO else 'missed'}).",
            f"10M events: **{walls['10M']:.0f} s** (target < {TARGET_S:.0f} s:"
            f" {'met' if walls['10M'] < TARGET_S else 'missed'}).",
            "",
        ]
    lines += ["Runs (from the repository's root; <workdir> is --workdir):", ""]
    for r in rows:
        where = " (`PYTHONPATH=<baseline>`)" if r["baseline"] else ""
        lines.append(f"- {r['label']}{where}: `{shown(r['command'], env['workdir'])}`")
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
    parser.add_argument(
        "--trace-format",
        choices=sorted(FORMATS),
        default="json",
        help="write (or, with --reuse, read) the traces as JSON Lines or Parquet"
        " (trace-N.jsonl / trace-N.parquet: a file, or a folder of Parquet files)",
    )
    parser.add_argument("--conf", action="append", default=[], help="passed to geofed analyze")
    parser.add_argument(
        "--baseline",
        help="a folder with an older geofed (e.g. an unpacked wheel): run it on PYTHONPATH"
        " right before this version, on the same trace",
    )
    parser.add_argument(
        "--baseline-stop-after",
        metavar="STAGE",
        help="end the baseline's runs once this stage is done (e.g. 'workload: validating ops')",
    )
    args = parser.parse_args(argv)
    given = list(argv if argv is not None else sys.argv[1:])

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    suffix, format_name = FORMATS[args.trace_format]
    env: dict[str, Any] = {
        "format": format_name,
        "federation": os.path.relpath(args.federation, REPO),
        "master": args.master,
        "workdir": str(work),
    }
    rows: list[dict[str, Any]] = []
    extra = [x for c in args.conf for x in ("--conf", c)]
    versions: list[str | None] = [args.baseline, None] if args.baseline else [None]
    for n in args.events:
        size = f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n:,}"
        trace = work / f"trace-{n}.{suffix}"
        if args.reuse and trace.exists():
            info = {"ops": None, "bytes": _size(trace), "generate_s": 0.0}
        else:
            print(f"[bench] generating {size} events -> {trace}", file=sys.stderr, flush=True)
            info = generate_trace(n, trace, args.seed)
        try:
            for baseline in versions:
                label = size + (" before" if baseline else " after" if args.baseline else "")
                # Each version its own folder: their summaries can be compared afterwards.
                out = work / (f"out-{n}-baseline" if baseline else f"out-{n}")
                stop = args.baseline_stop_after if baseline else None
                print(f"[bench] analyzing {label}", file=sys.stderr, flush=True)
                run = run_job(
                    Path(args.federation),
                    trace,
                    out,
                    args.master,
                    extra,
                    pythonpath=baseline,
                    stop_after=stop,
                )
                summary = run["summary"]
                rows.append(
                    {
                        **run,
                        "label": label,
                        "baseline": baseline is not None,
                        "stop_after": stop,
                        "events": summary["events"] if summary else None,
                        "ops": info["ops"] or (summary or {}).get("ops", {}).get("by_op", {}),
                        "bytes": info["bytes"],
                    }
                )
                print(
                    f"[bench] {label}: {run['wall_s']} s, load {run['load']}",
                    file=sys.stderr,
                    flush=True,
                )
                if not args.keep:
                    shutil.rmtree(out, ignore_errors=True)
        finally:
            if not args.keep:
                if trace.is_dir():
                    shutil.rmtree(trace)
                else:
                    trace.unlink(missing_ok=True)
    for row in rows:  # a stopped run counts the ops its pair counted
        if not row["ops"]:
            row["ops"] = next(
                (r["ops"] for r in rows if r["bytes"] == row["bytes"] and r["ops"]), {}
            )
    text = report(rows, env)
    # The command as run, without this machine's folders.
    names = {args.workdir: "<workdir>", args.baseline: "<baseline>"}
    record(
        Path(args.results),
        "geofed.bench.spark_scale_bench",
        [names.get(a) or shlex.quote(a) for a in given],
        text,
        title="# Spark analysis: scale benchmark\n",
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
