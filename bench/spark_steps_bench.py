"""Where the Spark analysis's validation stage spends its CPU, step by step, in one warm JVM.

`spark_scale_bench` times whole stages of whole runs; this one opens a stage.
It runs the job's own code (`read_numbered`, `workload_records`,
`parse_workload`, the job's checkpoints) on one trace in one process,
``--rounds`` times (the first round also pays the JIT compiling the JVM's
code), and times each Spark job the validation stage starts: every
checkpoint `parse_workload` writes (JSON Lines: the decoded records; the
distinct points and geofence texts with Python's answers; the validated
rows; the rows `parse_op` read, if any) and, as the rest, what runs
between them (the counts, the driver's planning). Two reference jobs
without a checkpoint say what reading alone costs: the numbered trace,
and the typed records with the pre-check, each written to Spark's
``noop`` sink. Figures are the whole machine's CPU seconds: run it on an
otherwise idle machine.

    python -m geofed.bench.spark_steps_bench -w <workdir>/trace-10000000.parquet
    python -m geofed.bench.spark_steps_bench -w <workdir>/trace-10000000.jsonl --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame

from geofed.bench._machine import machine_cpu_seconds, record
from geofed.bench.analysis import _fs as fs
from geofed.bench.analysis import _io as io
from geofed.bench.analysis._job import AnalysisConfig, _checkpoints, _persist, load_federation
from geofed.bench.analysis._session import build_session
from geofed.bench.spark_scale_bench import REPO, shown

DEFAULT_FEDERATION = REPO / "deploy" / "federations" / "aws-2020.geojson"


class Clock:
    """Wall and machine CPU seconds of named steps, in the order they ran."""

    def __init__(self) -> None:
        self.steps: dict[str, tuple[float, float]] = {}

    def time(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run `fn`, add its wall and machine CPU seconds to step `name`; return its result."""
        cpu, wall = machine_cpu_seconds() or 0.0, time.monotonic()
        out = fn()
        w, c = self.steps.get(name, (0.0, 0.0))
        self.steps[name] = (w + time.monotonic() - wall, c + (machine_cpu_seconds() or 0.0) - cpu)
        return out


def checkpoint_name(df: DataFrame) -> str:
    """Which of `parse_workload`'s checkpoints `df` is, told by its columns."""
    cols = set(df.columns)
    if "_fast" in cols:
        return "checkpoint: decoded records"
    if "_slow" in cols:
        return "checkpoint: validated rows (answers joined)"
    if "k" not in cols:
        return "checkpoint: distinct points and geofence texts, answered"
    return "checkpoint: rows parse_op read"


def one_round(spark: Any, files: list[str], fed_text: str, fmt: str) -> Clock:
    """The validation stage's steps on the trace's `files`, once."""
    clock = Clock()
    numbered, _ = clock.time(
        "numbering (read_numbered)",
        lambda: io.read_numbered(
            spark,
            files,
            fmt,
            what="workload",
            required=io.WORKLOAD_REQUIRED,
            optional=io.WORKLOAD_OPTIONAL,
        ),
    )
    clock.time(
        "reference: the numbered trace, read",
        lambda: numbered.write.format("noop").mode("overwrite").save(),
    )
    records = io.workload_records(numbered, fmt)
    clock.time(
        "reference: typed records and pre-check",
        lambda: records.write.format("noop").mode("overwrite").save(),
    )
    keep: list[Any] = []
    persisted: list[str] = []

    def persist(df: DataFrame) -> DataFrame:
        name = checkpoint_name(df)
        persisted.append(name)
        out: DataFrame = clock.time(name, lambda: _persist(df, keep))
        return out

    whole = clock.time(
        "validation stage (parse_workload)",
        lambda: io.parse_workload(records, numbered, fmt, fed_text, persist),
    )
    assert whole.by_op, "no ops"
    stage_wall, stage_cpu = clock.steps["validation stage (parse_workload)"]
    inner = [clock.steps[n] for n in dict.fromkeys(persisted)]
    clock.steps["rest: counts, planning"] = (
        stage_wall - sum(w for w, _ in inner),
        stage_cpu - sum(c for _, c in inner),
    )
    clock.steps["validation stage (parse_workload)"] = clock.steps.pop(
        "validation stage (parse_workload)"
    )  # last: the sum of the rows above it from the first checkpoint on
    for df in keep:
        df.unpersist()
    return clock


def report(rounds: list[Clock], fmt: str, trace: str, master: str) -> str:
    """The results section's body: one row per step, one column per round."""
    lines = [
        f"Trace: `{trace}` ({fmt}); Spark `{master}`, one process, rounds: {len(rounds)} (the"
        " first pays the JIT). Machine CPU s (all processes, Python workers included) and"
        " wall s per step; the validation stage is the sum of the checkpoints and the rest.",
        "",
        "| step | " + " | ".join(f"round {i + 1} CPU / wall" for i in range(len(rounds))) + " |",
        "|---|" + "---:|" * len(rounds),
    ]
    for step in rounds[0].steps:
        cells = [r.steps.get(step) for r in rounds]
        lines.append(
            f"| {step} | "
            + " | ".join("-" if c is None else f"{c[1]:.1f} / {c[0]:.1f}" for c in cells)
            + " |"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print and record the figures; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-w", "--workload", required=True, help="trace: JSON Lines or Parquet")
    parser.add_argument("-f", "--federation", default=str(DEFAULT_FEDERATION))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "spark.md"))
    parser.add_argument("--conf", action="append", default=[], help="Spark setting KEY=VALUE")
    parser.add_argument("--checkpoint-dir", help="as geofed analyze's (needed on a cluster)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    _, fed_text = load_federation(args.federation)
    spark = build_session(args.master, None, args.conf)
    # The job's own checkpoint folder (deleted afterwards), as `analyze` sets it up.
    cfg = AnalysisConfig(args.federation, (args.workload,), checkpoint_dir=args.checkpoint_dir)
    cleanup = _checkpoints(spark, cfg)
    try:
        fmt, files = fs.detect_format(spark, [args.workload], None, "workload")
        rounds = []
        for i in range(args.rounds):
            print(f"[steps] round {i + 1}", file=sys.stderr, flush=True)
            rounds.append(one_round(spark, files, fed_text, fmt))
    finally:
        cleanup()
    # Paths as the results page shows them: relative to the repository, the
    # trace's folder as <workdir>.
    workdir = os.path.dirname(os.path.abspath(args.workload))
    words = [
        os.path.abspath(w) if os.path.exists(w) else w
        for w in (sys.argv[1:] if argv is None else argv)
    ]
    body = report(rounds, fmt, shown([os.path.abspath(args.workload)], workdir), args.master)
    print(body)
    record(Path(args.results), "geofed.bench.spark_steps_bench", [shown(words, workdir)], body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
